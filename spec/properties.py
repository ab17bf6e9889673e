"""Trace properties: claims about a whole run, not a single step.

Each property has a registered name that the proofs, the scenarios (``demonstrates``) and the docs
cite. A property is checked by a monitor that watches every step ``(before, plan, after)`` and
reports :class:`~schedspec.spec.rules.Violation` values. Each scheduler declares which properties it
guarantees (its ``guarantees``, set where it is registered: ``schedspec.reference.scheduler.REGISTRY``);
a violation of a guaranteed property is a bug, a
violation of another one is a fact about the policy (for example head-of-line blocking under
static batching).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from schedspec.spec.admission import max_blocks_needed, rejection_reason
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens, slot_tokens
from schedspec.spec.kv_cache_groups import groups_of
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import Violation
from schedspec.spec.state import (
    SchedulerState,
    StepPlan,
    holding_first,
    is_prefill_chunk,
    offers_load,
    prefill_held,
    window_releases,
)


class Monitor:
    """Watches a run step by step; ``violations`` collects what it finds."""

    name = ""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.violations: list[Violation] = []

    def observe(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> None:
        """Called once per step with the state before, the plan, and the state after."""

    def finish(self, final: SchedulerState) -> list[Violation]:
        """Called once at the end; returns every violation found."""
        return self.violations

    def forget_ended(self, state: SchedulerState) -> None:
        """Between two steps (:meth:`~schedspec.spec.stepper.Stepper.forget_ended`): drop what the monitor
        keeps of requests that are no longer live in ``state`` (an ended request is never scheduled
        again: a rule would stop the check first). Most monitors keep nothing per request."""

    def report(self, step: int, detail: str, request_id: str | None = None) -> None:
        self.violations.append(Violation(self.name, detail, step, request_id, kind="property"))


def _oldest_live(state: SchedulerState) -> str | None:
    """The live request that arrived first (arrival step, then order of addition).

    Uses a fact of the spec's transitions: fresh requests join the back of the waiting queue and
    preempted ones its front, so the waiting queue is its preempted requests followed by the fresh ones
    in arrival order; only the preempted prefix and the first fresh request can be the oldest waiting.
    """
    candidates: list[tuple[int, float, int, str]] = []
    for position, request_id in enumerate(state.running):
        request = state.requests[request_id]
        candidates.append((request.arrival_step, request.arrival_time, position, request_id))
    for position, request_id in enumerate(state.waiting, start=len(state.running)):
        request = state.requests[request_id]
        candidates.append((request.arrival_step, request.arrival_time, position, request_id))
        if not request.num_preemptions:
            break
    return min(candidates)[3] if candidates else None


@attrs.frozen
class TraceProperty:
    """A registered trace property: name, statement, source and monitor factory."""

    name: str
    statement: str
    source: str
    monitor: Callable[[SchedulerConfig], Monitor]


PROPERTIES: dict[str, TraceProperty] = {}
"""Every trace property by name, in the order they are defined here."""


def trace_property(source: str) -> Callable[[type[Monitor]], type[Monitor]]:
    """Register the decorated :class:`Monitor` subclass as the trace property ``cls.name``: its statement
    is the class docstring. The same form as :func:`~schedspec.spec.rules.rule` and
    :func:`~schedspec.spec.invariants.state_invariant` (a decorator on the check naming its source).

    Raises:
        ValueError: a property of that name is registered already.
    """

    def register(cls: type[Monitor]) -> type[Monitor]:
        if cls.name in PROPERTIES:
            raise ValueError(f"trace property {cls.name!r} registered twice")
        PROPERTIES[cls.name] = TraceProperty(cls.name, (cls.__doc__ or "").strip(), source, cls)
        return cls

    return register


def free_at_plan(before: SchedulerState, plan: StepPlan, config: SchedulerConfig) -> int:
    """Free blocks the plan leaves (blocks): the free queue before the step less every block the plan allocates
    (its items' new blocks, in every KV cache group, and its remote KV loads'), plus the blocks sliding windows
    free in the step (with prefix caching only those no other table holds: a shared block's free only drops its
    reference count), less the prefix hits on evictable blocks (or on blocks a window freed in the step), which
    leave the free queue. Blocks freed by requests that finish in the step are not counted: they are free only
    after sampling. vLLM 0.32 ``KVCacheManager.allocate_slots`` / ``BlockPool.get_num_free_blocks`` as the
    waiting loop sees it (``Scheduler.schedule``)."""
    free = (len(before.free_block_ids) - sum(len(i.new_block_ids) for i in plan.scheduled)
            - sum(len(load.new_block_ids) for load in plan.loads))
    cache = before.prefix_cache
    window_freed: set[int] = set()
    if config.kv_cache_groups:
        free -= sum(len(b) for i in plan.scheduled for b in i.group_new_block_ids)
        window_freed = set().union(*window_releases(before, plan))
        free += len(window_freed)
    if cache is not None:
        free -= len({b for i in plan.scheduled
                     for b in i.cached_block_ids + tuple(b for t in i.group_cached_block_ids for b in t)
                     if cache.is_evictable(b) or b in window_freed})
    return free


def whole_sequence_need(request: Request, config: SchedulerConfig) -> int:
    """Blocks a waiting request needs beyond those it holds to admit its whole sequence (blocks): its
    ``num_tokens`` with the lookahead its table must hold (speculative decoding: ``slot_tokens``), in every KV
    cache group (a window's savings not counted), less the blocks of its table (a request holding loaded blocks
    needs the rest). The admission ``work-conserving`` judges: the head is admitted when this many blocks are free."""
    return (len(groups_of(config)) * blocks_for_tokens(slot_tokens(request.num_tokens, config), config.block_size)
            - len(request.block_ids))


@trace_property("Orca (OSDI'22) iteration-level scheduling; this spec")
class Progress(Monitor):
    """``progress``: over any window of ``window`` steps that start with live work, some request ends or
    some request computes a token position it never computed before.

    Recomputing already-computed positions after a preemption is not progress, so a request that
    preempts itself forever breaks the property. The default window is ``max_model_len`` steps: a policy
    that gives the oldest request at least one token per step recomputes at most that many positions
    before passing its high-water mark (fcfs; see ``bounded-wait``). A step in which every live request
    waits for its structured-output grammar (:meth:`~schedspec.spec.request.Request.grammar_ready`) has no
    work to do: it starts no window; nor does a step that a remote KV transfer in flight holds back
    (:meth:`TransfersInFlight.holds_back`: every live request waits on its own load, or the blocks transfers hold
    are what the head or the running requests lack). Any other step counts while a transfer is in flight, so a
    scheduler that preempts without need, recomputes forever or never admits a head that fits fails.
    """

    name = "progress"

    def __init__(self, config: SchedulerConfig, window: int | None = None) -> None:
        super().__init__(config)
        self.window = window or config.max_model_len
        self.high_water: dict[str, int] = {}
        self.stalled_since: int | None = None
        self.transfers = TransfersInFlight(config)

    def observe(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> None:
        # (during is called every step: it follows the loads)
        busy = self.transfers.during(before, plan, after) and self.transfers.holds_back(before, plan)
        advanced = busy or len(after.finished) > len(before.finished)
        for item in plan.scheduled:
            reach = item.num_computed_tokens + item.num_sequence_tokens  # no draft position
            if reach > self.high_water.get(item.request_id, 0):
                self.high_water[item.request_id] = reach
                advanced = True
        if advanced or not before.requests or all(
                not r.grammar_ready(before.step) for r in before.requests.values()):
            self.stalled_since = None
            return
        if self.stalled_since is None:
            self.stalled_since = before.step
        if before.step - self.stalled_since + 1 >= self.window:
            self.report(before.step, f"no new token position and no request ended for {self.window} steps")
            self.stalled_since = None

    def forget_ended(self, state: SchedulerState) -> None:
        """Drop the high-water marks of ended requests (when they outnumber the live ones: O(1) amortized)."""
        if len(self.high_water) > 2 * len(state.requests) + 64:
            self.high_water = {r: reach for r, reach in self.high_water.items() if r in state.requests}


class TransfersInFlight:
    """Follows, step by step, whether a remote KV transfer is in flight (KV connector): a load started and not
    landed (WAITING_FOR_REMOTE_KVS), or blocks held for an ended request's transfer (``delayed_frees``); and
    whether that transfer is what holds the engine back in a step (:meth:`holds_back`), the only steps
    ``progress`` and ``bounded-wait`` do not count. Costs O(live requests) per step while one is in flight.

    What vLLM 0.32 does in such steps (``vllm/v1/core/sched/scheduler.py``): the waiting loop skips a request
    whose load has not landed (``_handle_blocked_waiting_request``: WAITING_FOR_REMOTE_KVS and not in
    ``finished_recving_kv_req_ids`` returns False, ``skip_request``), and promotes it only once
    ``_update_from_kv_xfer_finished`` reported it (``_update_waiting_for_remote_kv``); the blocks of a load in
    flight stay in the request's table, and those of a request that ended while its transfer ran are freed only
    when the transfer is reported done (``_free_request``: ``delay_free_blocks`` from ``_connector_finished`` /
    ``request_finished``, or an abort while WAITING_FOR_REMOTE_KVS; ``_free_blocks`` from
    ``_update_from_kv_xfer_finished``). Until then those blocks are missing from the pool: the waiting loop stops at
    a head ``allocate_slots`` cannot place (``new_blocks is None``: ``break``), and a running request that cannot
    get its next block preempts (``_preempt_request``) or, with ``has_pending_block_frees``, is left out. Every
    other step the engine could compute: a scheduler that then preempts without need, recomputes forever or
    never admits a head that fits is judged as without a transfer (a transfer in flight excused every step
    before, so such a livelock passed).

    A transfer that never completes excuses the steps it holds back for as long as it is in flight; a whole
    trace ends with every transfer reported (``unfinished-request``), so only a window checked with
    ``--allow-unfinished`` can hide it.

    Args:
        config: the run's configuration (block_size, the lookahead of ``slot_tokens``).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.loading: set[str] = set()

    def during(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> bool:
        """Whether a transfer was in flight during the step ``before -> after`` (call once per step, in order)."""
        busy = bool(self.loading or plan.loads or before.delayed_frees)
        if plan.loads or self.loading:
            started = {load.request_id for load in plan.loads}
            self.loading = {r for r in self.loading | started if r in after.requests
                            and after.requests[r].status is RequestStatus.WAITING_FOR_REMOTE_KVS}
        return busy

    def holds_back(self, before: SchedulerState, plan: StepPlan) -> bool:
        """Whether a transfer in flight holds the step ``before -> plan`` back (call after :meth:`during` found
        one in flight): (a) every live request waits on its own load (WAITING_FOR_REMOTE_KVS, or one the plan
        starts) or on its structured-output grammar; or, with blocks held by transfers (``held``: those of
        ``delayed_frees``, of loads in flight and of loads the plan starts, > 0), (b) the first waiting request
        the plan leaves waiting (``holding_first`` order; past those loading, rejected, or whose grammar is not
        ready) needs more blocks for its whole sequence than the plan leaves free, and no more than that plus
        ``held``, and the plan schedules every running request; or (c) the plan preempts or leaves a running
        request out while the running requests need more blocks to compute one more position each than are free
        before the step, and no more than that plus ``held``."""
        config = self.config
        waiting_on_load = {r for r, request in before.requests.items()
                           if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS}
        waiting_on_load.update(load.request_id for load in plan.loads)
        if all(r in waiting_on_load or not request.grammar_ready(before.step)
               for r, request in before.requests.items()):
            return True  # (a)
        held = (sum(len(d.block_ids) for d in before.delayed_frees.values())
                + sum(len(before.requests[r].block_ids) for r in waiting_on_load if r in before.requests)
                + sum(len(load.new_block_ids) for load in plan.loads))
        if not held:
            return False
        scheduled = {item.request_id for item in plan.scheduled}
        if plan.preempted or any(r not in scheduled for r in before.running):  # (c) short of blocks for running
            demand = sum(max(0, blocks_for_tokens(slot_tokens(before.requests[r].num_computed_tokens + 1, config),
                                                  config.block_size) - len(before.requests[r].block_ids))
                         for r in before.running)
            free = len(before.free_block_ids)
            return free < demand <= free + held  # (not (b): a running request left out may have been the work)
        head = next((r for r in holding_first(before.waiting, before.requests)  # (b) the head left waiting
                     if r not in waiting_on_load and r not in scheduled and before.requests[r].grammar_ready(before.step)
                     and r not in {rejected for rejected, _ in plan.rejected}), None)
        if head is None:
            return False
        free = free_at_plan(before, plan, config)
        return free < whole_sequence_need(before.requests[head], config) <= free + held


@trace_property('vLLM Scheduler.schedule; Orca §3')
class WorkConserving(Monitor):
    """``work-conserving``: no step leaves budget unused while a running request could use it, and no step
    without preemption leaves budget, a sequence slot and blocks unused while the head of the waiting
    queue fits.

    Precisely, with ``left = max_num_batched_tokens - scheduled tokens``: if ``left > 0`` every running
    request is scheduled or preempted; and if the step preempted nothing, ``left > 0`` and running after
    the step ``< max_num_seqs``, then the first waiting request that is not rejected does not fit: its
    whole sequence (with ``num_lookahead_tokens``; with KV cache groups, in every group) needs more blocks than the
    plan leaves free (blocks freed by requests that finish
    in the step are not counted: they are free only after sampling), or (chunked prefill off) its pending
    tokens exceed ``left``. With ``max_loras > 0`` a waiting request whose LoRA adapter is not among those of
    the running requests as the plan leaves them, which already number ``max_loras``, is not the head: it is passed
    over, as vLLM's waiting loop skips it (rule ``lora-limit``), and so is one whose grammar is not ready
    (rule ``grammar-ready-before-admission``). With ``watermark > 0`` and requests running, the head fits
    only with ``watermark_blocks`` left free (rule ``watermark``). On a step the prefill cadence holds
    (``prefill_schedule_interval`` > 1, :func:`~schedspec.spec.state.prefill_held`) running prefill chunks may
    be left out and the waiting queue is not judged. Strict FCFS (head-of-line) is allowed; holding a finished request's slot
    (static batching) is not. vLLM does not admit in a step that preempted
    (``Scheduler.schedule``: ``if not preempted_reqs``), hence the exception. KV connector: the waiting
    requests holding loaded blocks come first (``state.holding_first``), one whose remote KV load is in flight is
    passed over, and a head whose remote KV load may start (``state.offers_load``) is not judged: a policy may hold
    a load back to keep the blocks that the requests holding loaded blocks still need.
    """

    name = "work-conserving"

    def observe(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> None:
        config = self.config
        left = config.max_num_batched_tokens - plan.num_scheduled_tokens
        if left <= 0:
            return
        scheduled = {item.request_id for item in plan.scheduled}
        preempted = set(plan.preempted)
        held = prefill_held(before, config)  # the prefill cadence holds the step's prefills (prefill-cadence)
        for request_id in before.running:
            if request_id not in scheduled and request_id not in preempted \
                    and not (held and is_prefill_chunk(before, request_id)):
                self.report(before.step, f"running request left out with {left} tokens of budget unused", request_id)
        if plan.preempted or held:
            return
        running_after = len(before.running) + sum(1 for i in plan.scheduled if i.request_id not in before.running)
        if running_after >= config.active_seq_cap:  # max_num_active_seqs when set (rule active-sequence-cap)
            return
        rejected = {request_id for request_id, _ in plan.rejected}
        free_at_plan_ = free_at_plan(before, plan, config)
        loaded = {load.request_id for load in plan.loads}
        # the adapters of the running set as the plan leaves it (before.running plus the admitted; nothing is
        # preempted here); requests that finish in the step still count: they end only after sampling
        loras = ({before.requests[r].lora_int_id for r in before.running}
                 | {before.requests[i.request_id].lora_int_id for i in plan.scheduled if i.request_id in before.requests}
                 ) - {0} if config.max_loras else set()
        for request_id in holding_first(before.waiting, before.requests):
            if request_id in rejected or request_id in scheduled or request_id in loaded:
                continue
            request = before.requests[request_id]
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue  # its remote KV load has not landed (wait-for-remote-kv)
            if config.max_loras and request.lora_int_id and request.lora_int_id not in loras \
                    and len(loras) >= config.max_loras:
                continue  # its adapter would be one too many: vLLM skips it (lora-limit)
            if not request.grammar_ready(before.step):
                continue  # structured output: its grammar is compiling (grammar-ready-before-admission)
            # its whole sequence, with the lookahead its table must hold (speculative decoding: slot_tokens)
            # with the watermark kept free when others run (rule watermark)
            keep = config.watermark_blocks if running_after else 0
            if offers_load(request, config):
                break  # a head whose remote KV load may start is not judged (a policy may hold a load back)
            # a request holding loaded blocks needs the rest of its sequence; with KV cache groups, the whole
            # sequence in every group (a window's savings not counted)
            needed = whole_sequence_need(request, config)
            fits_budget = config.enable_chunked_prefill or request.num_pending_tokens <= left
            fits_blocks = needed + keep <= free_at_plan_
            if fits_blocks and fits_budget:
                self.report(
                    before.step,
                    f"head of the waiting queue fits ({free_at_plan_} free blocks, {left} tokens, "
                    f"{config.active_seq_cap - running_after} slots left) but was not admitted",
                    request_id,
                )
            break


@trace_property("Sarathi-Serve (OSDI'24) §4.2")
class StallFreeDecode(Monitor):
    """``stall-free-decode`` (Sarathi-Serve §4.2, stall-free batching): in a step without preemption, if the
    running requests in decode (one pending token) number at most ``max_num_batched_tokens``, each of them
    gets exactly one token (its pending one, with any drafts it verifies: speculative decoding). A long
    prefill never delays a running decode."""

    name = "stall-free-decode"

    def observe(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> None:
        if plan.preempted:
            return
        decodes = [r for r in before.running if before.requests[r].is_decode]
        if len(decodes) > self.config.max_num_batched_tokens:
            return
        # a decode's own token; the drafts it verifies with it (speculative decoding) are extra
        tokens = {item.request_id: item.num_sequence_tokens for item in plan.scheduled}
        for request_id in decodes:
            if tokens.get(request_id) != 1:
                self.report(before.step, "running decode got no token", request_id)


@trace_property('this spec (FCFS starvation bound)')
class BoundedWait(Monitor):
    """``bounded-wait`` (no starvation): a request that becomes the oldest live request (by arrival) ends
    within ``max_model_len`` steps.

    Why this bound: a policy that schedules the oldest live request in every step (fcfs does: it is first
    in the running set, or alone) computes at least one of its at most ``max_model_len`` positions per
    step. It follows that a request with ``k`` live requests older than it at arrival ends within
    ``(k + 1) * max_model_len`` steps. Policies that starve by design (shortest-prompt-first) do not
    guarantee this. An oldest request whose structured-output grammar is not ready is not counted: its wait
    starts at its grammar's ready step. With vLLM 0.33's prefill cadence (``prefill_schedule_interval`` N > 1)
    the bound is ``N * max_model_len``: a held step may leave the oldest request's prefill out, and at most
    N - 1 executed steps in a row are held (rule ``prefill-cadence``). An oldest request waiting on its own remote
    KV load (WAITING_FOR_REMOTE_KVS) is not counted: its wait starts when the load lands; nor is a step that a
    transfer in flight holds back (:meth:`TransfersInFlight.holds_back`: the blocks transfers hold are what the
    head or the running requests lack): the wait starts again from the first step no transfer holds back. Once
    a trace has had a transfer in flight the
    bound is doubled: requests admitted while the oldest waited on its load may hold every sequence slot until
    they end, at most ``max_model_len`` steps later (found by ``schedspec diff --remote-kv``: a request loading
    while a younger one took the only slot).
    """

    name = "bounded-wait"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.transfers = TransfersInFlight(config)
        self.transfers_seen = False
        self.oldest: str | None = None
        self.since = 0

    def observe(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> None:
        oldest = _oldest_live(before)
        rejected = {r for r, _ in plan.rejected}
        if oldest in rejected or (oldest is not None and not before.requests[oldest].grammar_ready(before.step)):
            oldest = None  # rejected, or waiting for its structured-output grammar: its wait starts when ready
        if self.transfers.during(before, plan, after):
            self.transfers_seen = True
            if oldest is not None and before.requests[oldest].status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                oldest = None  # waiting on its own load: its wait starts when the load lands
            elif self.transfers.holds_back(before, plan):
                oldest = None  # a remote KV transfer holds the engine back: the wait is counted from when none does
        if oldest != self.oldest:
            self.oldest, self.since = oldest, before.step
        bound = self.config.max_model_len * self.config.prefill_schedule_interval * (2 if self.transfers_seen else 1)
        if oldest is not None and oldest in after.requests and after.step - self.since >= bound:
            self.report(before.step, f"oldest live request for {after.step - self.since} steps without ending", oldest)
            self.oldest = None


@trace_property('vLLM Scheduler._preempt_request (victim: last of running)')
class BoundedPreemptions(Monitor):
    """``bounded-preemptions``: after the last arrival, no request is preempted more than ``P(i)`` times,
    where requests live at the last arrival are ranked by their place in line ``i = 1..n`` (the running
    requests in running order, then the waiting queue; by age when admission follows arrival) and ``P(1) = 0``,
    ``A(j) = (P(j) + 1) * max_blocks(j)``, ``P(i) = sum_{j < i} A(j)``.

    Why (for a policy that preempts the most recently admitted running request, as fcfs and vLLM do): a
    request is preempted only when an older running request needs a new block; a request allocates at most
    ``max_blocks`` blocks per admission. Without arrivals no younger request can take its place in line.
    A structured-output request whose grammar becomes ready enters the competition for blocks then: its
    ready step counts as an arrival; requests admitted past it while it waited are ahead of it in line.
    Likewise, with ``max_loras > 0``, a step that admits a request past one it skips (rule ``lora-limit``)
    changes the line: the next step counts as an arrival. KV connector: blocks held outside the line (by a
    waiting request holding the blocks of its remote KV load, or by a transfer after its request ended:
    ``delayed_frees``) can force the preemption of any running request, the oldest included, until they are
    given back: a step that starts a load or in which such blocks are held is not judged, and the next step
    counts as an arrival.
    """

    name = "bounded-preemptions"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.counts: dict[str, int] = {}
        self.bounds: dict[str, int] | None = None
        self.last_added = 0
        self.grammar_due: frozenset[int] = frozenset()  # ready steps of grammars still compiling
        self.holding: set[str] = set()  # KV connector: waiting requests holding the blocks of their remote KV load

    def observe(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> None:
        if plan.loads or self.holding or before.delayed_frees:  # KV connector: blocks held outside the line
            self.holding = {r for r in self.holding.union(load.request_id for load in plan.loads)
                            if r in after.requests and after.requests[r].holds_loaded_kv and after.requests[r].block_ids}
            self.bounds = None  # not judged; the next step counts as an arrival
            self.counts = {}
            return
        if before.num_requests_added != self.last_added or before.step in self.grammar_due:
            self.last_added = before.num_requests_added
            self.counts = {}
            self.bounds = None
        if self.bounds is None:
            step = before.step
            self.grammar_due = frozenset(r.grammar_ready_step for r in before.requests.values()
                                         if r.grammar_ready_step is not None and r.grammar_ready_step > step)
            # the line: running requests in running order, then the waiting queue in its order; that is the
            # order of arrival unless admission skipped a request (a grammar that was compiling)
            requests = before.requests
            order = [requests[r] for r in before.running] + [requests[r] for r in before.waiting]

            total, bounds = 0, {}
            for request in order:
                bounds[request.request_id] = total
                blocks = max_blocks_needed(request.prompt_len, request.max_tokens, self.config)
                total += (total + 1) * blocks
                total = min(total, 10**18)
            self.bounds = bounds
        for request_id in plan.preempted:
            self.counts[request_id] = self.counts.get(request_id, 0) + 1
            bound = self.bounds.get(request_id, 0)
            if self.counts[request_id] > bound:
                self.report(before.step, f"preempted {self.counts[request_id]} times after the last arrival > bound {bound}", request_id)
        if self.config.max_loras and plan.scheduled and _admitted_past_a_skip(before, plan):
            self.bounds = None  # the line changed (a LoRA skip): a new baseline from the next step
            self.counts = {}



def _admitted_past_a_skip(before: SchedulerState, plan: StepPlan) -> bool:
    """Whether the plan admits a waiting request while one ahead of it in the queue (not rejected) stays."""
    admitted = {i.request_id for i in plan.scheduled if i.request_id not in before.running}
    if not admitted:
        return False
    rejected = {r for r, _ in plan.rejected}
    left = len(admitted)
    for request_id in before.waiting:
        if request_id in admitted:
            left -= 1
            if not left:
                return False
        elif request_id not in rejected:
            return True
    return False


@trace_property('this spec, admission')
class RejectsImpossible(Monitor):
    """``rejects-impossible``: a request that could never complete alone (see ``admission``) is rejected,
    with its reason, in the first step after its arrival; no other request is rejected."""

    name = "rejects-impossible"

    def observe(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> None:
        rejected = dict(plan.rejected)
        for request_id in before.waiting:
            request = before.requests[request_id]
            if request.admitted_step is not None:
                continue
            reason = rejection_reason(request.prompt_len, request.max_tokens, self.config)
            if reason is not None and request_id not in rejected:
                self.report(before.step, f"not rejected although {reason}", request_id)
            if reason is None and request_id in rejected:
                self.report(before.step, f"rejected ({rejected[request_id]}) although it can complete alone", request_id)


ITL_TOKEN_BUDGET = 512
"""Tokens per step that ``bounded-itl`` allows in a step carrying a running decode (Sarathi-Serve's
token budget for a strict inter-token-latency target)."""


@trace_property("Sarathi-Serve (OSDI'24) §3, generation stalls; this spec")
class BoundedItl(Monitor):
    """``bounded-itl`` (Sarathi-Serve §3, generation stalls): a step that carries a running decode (one
    pending token, prompt computed) computes at most ``ITL_TOKEN_BUDGET`` (512) tokens, prefill and
    decode together.

    A decode's inter-token latency is the duration of the steps it rides in; under a step-time model
    that grows with the tokens of a step (``reference.cost_model``) it is then at most the time of a
    512-token step. Chunked prefill with ``max_num_batched_tokens <= 512`` keeps this; without chunked
    prefill a whole prompt of up to ``max_model_len`` tokens joins the decodes' step, so no reference
    policy guarantees it (counterexample: ``counterexample-bounded-itl``).
    """

    name = "bounded-itl"

    def __init__(self, config: SchedulerConfig, budget: int = ITL_TOKEN_BUDGET) -> None:
        super().__init__(config)
        self.budget = budget

    def observe(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> None:
        total = plan.num_scheduled_tokens
        if total <= self.budget:
            return
        for item in plan.scheduled:
            request = before.requests.get(item.request_id)
            if request is not None and item.request_id in before.running and request.is_decode:
                self.report(before.step, f"a running decode rides in a step of {total} tokens > {self.budget}",
                            item.request_id)
                return


def _table(request_id: str, requests, tables) -> tuple[int, ...]:
    found = tables.get(request_id)
    return requests[request_id].block_ids if found is None else found


def _held_only_by(group: list[str], running: list[str], requests, tables) -> set[int]:
    """Blocks held by requests of ``group`` and by no other request of ``running`` (with prefix caching
    a block may be shared; preempting ``group`` frees only the blocks no one else holds)."""
    members = set(group)
    mine = {b for r in group for b in _table(r, requests, tables)}
    others = {b for r in running if r not in members for b in _table(r, requests, tables)}
    return mine - others


def _released(requests, preempted, running) -> set[int]:
    """Blocks the preempted requests release: those no request still running holds."""
    mine = {b for r in preempted for b in requests[r].block_ids}
    return mine - {b for r in running for b in requests[r].block_ids} if mine else mine


def _hits_on_free_blocks(before: SchedulerState, plan: StepPlan, released: set[int]) -> int:
    """Free blocks the plan's prefix-cache hits take out of the free queue: distinct hit blocks that were
    evictable before the step (reference count 0) or that this step's preemptions released (vLLM
    ``BlockPool.touch`` removes a block from the free queue when its count rises from 0, once)."""
    cache = before.prefix_cache
    hits = {b for item in plan.scheduled for b in getattr(item, "cached_block_ids", ())}
    if cache is None or not hits:
        return 0
    return sum(1 for b in hits if b in released or not cache.ref_counts.get(b))


@trace_property('vLLM 0.32 vllm/v1/core/sched/scheduler.py Scheduler.schedule (priority preemption); this spec')
class NoPriorityInversion(Monitor):
    """``no-priority-inversion``: after a step's preemptions, no waiting request is kept out only by
    resources that a strictly less urgent running request holds.

    Urgency is vLLM's: a lower ``priority`` value is more urgent; "strictly less urgent" means a
    strictly greater ``priority`` value (requests of equal priority are ordered by arrival, which is
    ``bounded-wait``'s concern, not this one's). Everything is computed at plan time, from the state
    before the step and the plan, i.e. after the plan's preemptions and allocations and before
    sampling (blocks of requests that finish in the step are not free yet):

    - ``running`` = the running requests not preempted, plus the waiting ones the plan admits;
    - ``slots = max_num_seqs - len(running)`` (``max_num_active_seqs`` when set);
    - ``blocks`` = the free blocks before the step, plus the blocks the preempted requests release,
      minus the blocks the plan hands out (new blocks, and each free cached block a prefix hit takes:
      evictable before the step or released by its preemptions);
    - ``tokens = max_num_batched_tokens - scheduled tokens``.

    A request ``W`` waiting at plan time (not admitted, not rejected by the plan; preempted ones
    included) that could complete alone (``rejection_reason`` is ``None``) *fits* in
    ``(slots, blocks, tokens)`` when ``slots >= 1``, ``blocks >= ceil(slot_tokens(W.num_tokens) /
    block_size)`` (its whole current sequence, with speculative decoding's lookahead: the admission gate of
    ``work-conserving``) and ``tokens >= 1``
    (chunked prefill) or ``tokens >= W``'s pending tokens (chunked prefill off). With ``L`` = the
    requests of ``running`` whose ``priority`` is greater than ``W``'s, holding ``len(L)`` slots,
    ``held_blocks`` blocks (the blocks of their tables after this step's allocations that no other
    running request shares: with prefix caching a shared block is not freed by preempting ``L``) and
    ``held_tokens`` tokens of this step's budget, ``W`` is **kept out only by** ``L`` when it does not fit in
    ``(slots, blocks, tokens)`` but fits in ``(slots + len(L), blocks + held_blocks, tokens +
    held_tokens)``. The property fails at every step where some ``W`` is kept out only by its ``L``.

    A waiting request that fits but is not admitted is not an inversion (the policy's order may stop
    admission at a more urgent request that does not fit); one that would not fit even with every
    less urgent request gone waits for more urgent ones, which is no inversion either.

    Source: vLLM 0.32 ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule`` with
    ``--scheduling-policy priority`` preempts the least urgent running request
    (``max(self.running, key=lambda r: (r.priority, r.arrival_time))``) only when a *running*
    request's ``allocate_slots`` fails; a waiting request never preempts, so at ``max_num_seqs`` an
    urgent request waits behind less urgent running ones (finding
    ``counterexample-vllm-priority-no-preempt-at-seq-cap``). Priority inversion: Lampson and Redell,
    "Experience with processes and monitors in Mesa" (CACM 1980).
    """

    name = "no-priority-inversion"

    def observe(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> None:
        config = self.config
        requests = before.requests
        priorities = [requests[r].priority for r in before.requests]
        if not priorities or min(priorities) == max(priorities):
            return  # one priority level: nothing can be inverted
        preempted = set(plan.preempted)
        rejected = {request_id for request_id, _ in plan.rejected}
        tokens_of = {item.request_id: item.num_tokens for item in plan.scheduled}
        tables: dict[str, tuple[int, ...]] | None = None  # built when first needed
        running = [r for r in before.running if r not in preempted]
        running += [item.request_id for item in plan.scheduled if item.request_id not in before.running]
        slots = config.active_seq_cap - len(running)  # max_num_active_seqs when set
        released = _released(requests, preempted, running)
        blocks = (len(before.free_block_ids) + len(released)
                  - sum(len(item.new_block_ids) for item in plan.scheduled)
                  - _hits_on_free_blocks(before, plan, released))
        tokens = config.max_num_batched_tokens - plan.num_scheduled_tokens
        waiting = [r for r in before.waiting if r not in tokens_of and r not in rejected] + list(plan.preempted)
        held: dict[int, tuple[list[str], int, int]] = {}  # priority of W -> (L, held_blocks, held_tokens)
        for request_id in waiting:
            request = requests[request_id]
            if rejection_reason(request.prompt_len, request.max_tokens, config) is not None:
                continue
            # its whole sequence, with the lookahead its table must hold (speculative decoding: slot_tokens)
            needed_blocks = blocks_for_tokens(slot_tokens(request.num_tokens, config), config.block_size)
            needed_tokens = 1 if config.enable_chunked_prefill else request.num_tokens - request.num_computed_tokens
            if slots >= 1 and blocks >= needed_blocks and tokens >= needed_tokens:
                continue  # fits: not kept out by resources at all
            if request.priority not in held:
                if tables is None:
                    # block tables after the step's allocations; with prefix caching an admitted
                    # request's table starts with its hit blocks (``cached_block_ids``)
                    tables = {item.request_id: (*requests[item.request_id].block_ids,
                                                *getattr(item, "cached_block_ids", ()), *item.new_block_ids)
                              for item in plan.scheduled}
                less_urgent = [r for r in running if requests[r].priority > request.priority]
                held[request.priority] = (
                    less_urgent,
                    len(_held_only_by(less_urgent, running, requests, tables)),
                    sum(tokens_of.get(r, 0) for r in less_urgent),
                )
            less_urgent, held_blocks, held_tokens = held[request.priority]
            if not less_urgent:
                continue
            if blocks + held_blocks >= needed_blocks and tokens + held_tokens >= needed_tokens:
                lacking = [what for what, ok in (("a max_num_seqs slot", slots >= 1),
                                                 (f"{needed_blocks} blocks ({blocks} free)", blocks >= needed_blocks),
                                                 (f"{needed_tokens} tokens of budget ({tokens} left)",
                                                  tokens >= needed_tokens)) if not ok]
                self.report(
                    before.step,
                    f"priority {request.priority} waits for {', '.join(lacking)} held by less urgent running "
                    f"{', '.join(sorted(less_urgent))}",
                    request_id,
                )




def monitors(names: list[str] | tuple[str, ...] | frozenset[str], config: SchedulerConfig) -> list[Monitor]:
    """Fresh monitors for the named properties. Raises ``KeyError`` naming an unknown property."""
    found = []
    for name in names:
        if name not in PROPERTIES:
            raise KeyError(f"unknown trace property {name!r}; known: {sorted(PROPERTIES)}")
        found.append(PROPERTIES[name].monitor(config))
    return found
