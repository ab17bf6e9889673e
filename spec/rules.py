"""Which step plans are allowed from a state: a list of local rules.

A plan is allowed when no rule is violated. Each rule looks at the state before the step and the
plan only; none of them says "the invariants hold afterwards". That is what makes the spec's central
theorem non-circular (``schedspec.spec.proofs``): these rules alone imply that every invariant of
:mod:`schedspec.spec.invariants` is preserved by :func:`schedspec.spec.transitions.apply_plan`.

The rules are policy-independent: any policy (FCFS, priority, static batching, an engine's own)
must obey them. What a policy chooses among the allowed plans is its own business, judged by the
trace properties of :mod:`schedspec.spec.properties`.

Use :func:`violated_rules` to check a plan; it returns the violations, empty if the plan is allowed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet

import attrs

from schedspec.spec.admission import rejection_code, rejection_reason, rejection_reasons
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens, slot_tokens
from schedspec.spec.kv_cache_groups import (
    NULL_BLOCK,
    group_hit_violation,
    group_tables,
    held_block_ids,
    longest_group_hit,
    num_skipped_blocks,
    window_frees,
)
from schedspec.spec.prefix_cache import (
    ROOT_HASH,
    max_hit_blocks,
    publishes_at_step,
    request_block_hash,
    request_block_hashes,
)
from schedspec.spec.request import Request, RequestStatus, printable
from schedspec.spec.state import (
    ScheduledRequest,
    SchedulerState,
    StepPlan,
    carries_prefill,
    prefill_held,
    wasted_items,
    window_releases,
)

VIOLATION_KINDS = ("rule", "invariant", "property", "mismatch")
"""What a :class:`Violation` broke: an allowed-plan ``rule`` (:mod:`~schedspec.spec.rules`), an
``invariant`` (:mod:`~schedspec.spec.invariants`), a trace ``property``
(:mod:`~schedspec.spec.properties`), or a ``mismatch``: something an engine reported (a trace field, its
own state) differs from what the spec says happened."""


@attrs.frozen
class Violation:
    """A broken rule, invariant or property, or a mismatch with the spec.

    Attributes:
        name: the registered name (a rule, invariant or property name; for mismatches ``trace-mismatch``,
            ``state-mismatch`` or ``refinement``).
        detail: one line saying what differs and what the spec allows.
        step: the step that caused it (the step whose plan or update broke it).
        request_id: the request concerned, if one is.
        kind: one of :data:`VIOLATION_KINDS`.
        code: a stable machine-readable code for what was found, for programs to test instead of the
            wording of ``detail``: the ``name``, or ``name:case`` for a named case of it (:func:`coded`),
            e.g. ``block-conservation:terminal-owns-blocks``. Default: the ``name``.
    """

    name: str
    detail: str
    step: int | None = None
    request_id: str | None = None
    kind: str = attrs.field(kw_only=True, validator=attrs.validators.in_(VIOLATION_KINDS))
    code: str = attrs.field(kw_only=True, default=attrs.Factory(lambda self: self.name, takes_self=True))

    def __str__(self) -> str:
        where = f"step {self.step}: " if self.step is not None else ""
        who = f" (request {printable(self.request_id)})" if self.request_id is not None else ""
        kind = "" if self.kind == "mismatch" else f"{self.kind} "
        return f"{where}{kind}{self.name}{who}: {self.detail}"


def coded(name: str, case: str | None) -> str:
    """The :attr:`Violation.code` of a breach of ``name``: ``name``, or ``name:case`` when the check
    names the case (a breach yielded as ``(request_id, detail, case)``)."""
    return name if case is None else f"{name}:{case}"


REUSED_BY_HIT_IN_STEP = "reused-by-hit-in-step"
"""The case of ``blocks-from-free-pool`` where a block is both handed out and hit by a prefix-cache hit in the
same plan (code ``blocks-from-free-pool:reused-by-hit-in-step``; vLLM's same-step hits commit it:
``schedspec.engines.vllm``)."""


RuleCheck = Callable[[SchedulerState, StepPlan, SchedulerConfig], Iterator[tuple[str | None, str]]]


ACTIONS = ("step", "preempt", "reject", "schedule", "start_load")
"""What a rule guards: the ``step`` as a whole, or one of the scheduler's actions of
:mod:`~schedspec.spec.transitions` (:func:`~schedspec.spec.transitions.preempt`,
:func:`~schedspec.spec.transitions.reject`, :func:`~schedspec.spec.transitions.schedule`,
:func:`~schedspec.spec.transitions.start_load`)."""


@attrs.frozen
class Rule:
    """A local rule on plans: a name, what it says, where it comes from, the action it guards (one of
    :data:`ACTIONS`), and its check (``check(state, plan, config)`` yields ``(request_id or None,
    detail)`` per breach, or ``(request_id or None, detail, case)`` for a named case: :func:`coded`)."""

    name: str
    statement: str
    source: str
    check: RuleCheck
    action: str = attrs.field(validator=attrs.validators.in_(ACTIONS))


RULES: list[Rule] = []


def rule(name: str, statement: str, source: str, *, action: str) -> Callable[[RuleCheck], RuleCheck]:
    """Register the decorated check as the rule ``name`` guarding ``action`` (the one form of registering a
    check: a decorator on it naming its source, as :func:`~schedspec.spec.invariants.state_invariant` and
    :func:`~schedspec.spec.properties.trace_property`).

    Raises:
        ValueError: a rule of that name is registered already.
    """

    def register(check: RuleCheck) -> RuleCheck:
        if any(r.name == name for r in RULES):
            raise ValueError(f"rule {name!r} registered twice")
        RULES.append(Rule(name, statement, source, check, action))
        return check

    return register


@rule(
    "known-requests",
    "Every id the plan names is a live request, or, with a step in flight (asynchronous scheduling), one that "
    "ended after the plan was made (in_flight.ended: its work is wasted); no id is scheduled twice; a request is "
    "at most one of scheduled, preempted, rejected, loaded.",
    "vLLM vllm/v1/core/sched/scheduler.py Scheduler.schedule (each request scheduled once per step); "
    "Scheduler.update_from_output skips a request 'already finished ... aborted while the model is executing it "
    "(e.g., ... in async scheduling)'",
    action="step",
)
def _known_requests(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    named = ([item.request_id for item in plan.scheduled] + list(plan.preempted) + [r for r, _ in plan.rejected]
             + [load.request_id for load in plan.loads])
    ended = state.in_flight.ended if state.in_flight is not None else {}
    rejected = {r for r, _ in plan.rejected}
    for request_id, count in Counter(named).items():
        if request_id not in state.requests and (request_id not in ended or request_id in rejected):
            yield request_id, "not a live request"
        if count > 1:
            yield request_id, f"named {count} times in one plan"


@rule(
    "token-budget",
    "The tokens of a step, prefill and decode together, the drafts the decodes verify included, are at most "
    "max_num_batched_tokens.",
    "vLLM Scheduler.schedule token_budget (num_new_tokens counts the scheduled drafts: token_budget -= "
    "num_new_tokens); Sarathi-Serve (OSDI'24) §4.2 token budget",
    action="step",
)
def _token_budget(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    total = plan.num_scheduled_tokens
    if total > config.max_num_batched_tokens:
        yield None, f"{total} tokens scheduled > max_num_batched_tokens={config.max_num_batched_tokens}"


@rule(
    "positive-tokens",
    "A scheduled request computes at least one token.",
    "vLLM Scheduler.schedule (num_new_tokens == 0 means not scheduled)",
    action="schedule",
)
def _positive_tokens(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item in plan.scheduled:
        if item.num_tokens < 1:
            yield item.request_id, f"num_tokens={item.num_tokens} < 1"


@rule(
    "chunk-continues",
    "A chunk starts where the request's computed tokens end: ScheduledRequest.num_computed_tokens equals "
    "the request's num_computed_tokens (0 for a waiting request) plus its prefix-cache hit "
    "(len(cached_block_ids) * block_size).",
    "Sarathi-Serve §4.1 chunked prefill; vLLM Request.num_computed_tokens (Scheduler.schedule sets it to the "
    "hit length at admission)",
    action="schedule",
)
def _chunk_continues(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is None:
            continue
        hit = len(item.cached_block_ids) * config.block_size
        if item.num_computed_tokens != request.num_computed_tokens + hit:
            with_hit = f" plus a prefix-cache hit of {hit}" if hit else ""
            yield item.request_id, (
                f"chunk starts at {item.num_computed_tokens} but {request.num_computed_tokens} tokens are computed"
                f"{with_hit}"
            )


@rule(
    "no-overcompute",
    "A request computes at most its pending tokens (prompt plus output minus computed, minus a prefix-cache "
    "hit) plus the drafts its item verifies; so a decode computes exactly one token and its d drafts.",
    "vLLM Scheduler.schedule num_new_tokens = num_tokens_with_spec - num_computed_tokens (num_tokens_with_spec "
    "counts the drafts, Request.spec_token_ids)",
    action="schedule",
)
def _no_overcompute(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is None:
            continue
        pending = request.num_pending_tokens - len(item.cached_block_ids) * config.block_size
        if item.num_tokens > pending + len(item.spec_token_ids):
            drafts = f" plus {len(item.spec_token_ids)} drafts" if item.spec_token_ids else ""
            yield item.request_id, f"num_tokens={item.num_tokens} > pending tokens={pending}{drafts}"


@rule(
    "whole-prefill-without-chunking",
    "With enable_chunked_prefill off, a scheduled request computes all its pending tokens (less a prefix-cache "
    "hit) at once.",
    "vLLM Scheduler.schedule: without chunked prefill a prompt that does not fit the budget waits",
    action="schedule",
)
def _whole_prefill(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    if config.enable_chunked_prefill:
        return
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is None:
            continue
        pending = request.num_pending_tokens - len(item.cached_block_ids) * config.block_size
        if item.num_tokens != pending + len(item.spec_token_ids):  # a decode's drafts are no prefill
            yield item.request_id, f"chunk of {item.num_tokens} tokens of {pending} pending with chunked prefill off"


@rule(
    "long-prefill-threshold",
    "With chunked prefill on and long_prefill_token_threshold > 0, a prefill chunk is at most that many tokens; "
    "with long_prefill_token_threshold_adaptive, at most max(threshold, max_num_batched_tokens // n), n the "
    "requests running or waiting when the plan was made (eligible_when_planned: with a step in flight, those "
    "that ended since included and those that arrived since left out) less those it rejects.",
    "vLLM Scheduler.schedule long_prefill_token_threshold (and its floor, adaptive_long_prefill_threshold: "
    "max(long_prefill_token_threshold, input_budget // num_eligible_reqs), num_eligible_reqs from "
    "Scheduler.get_request_counts at the start of Scheduler.schedule)",
    action="schedule",
)
def _long_prefill(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    threshold = config.effective_long_prefill_threshold(eligible_when_planned(state, plan))
    if not config.enable_chunked_prefill or threshold == 0:
        return
    for item in plan.scheduled:
        if item.num_tokens > threshold and not item.spec_token_ids:  # a decode verifying drafts is no prefill chunk
            yield item.request_id, f"chunk of {item.num_tokens} tokens > long_prefill_token_threshold={threshold}"


@rule(
    "sequence-cap",
    "Running requests after the step (running, less preempted, plus admitted) are at most max_num_seqs.",
    "vLLM Scheduler.schedule: len(self.running) == self.max_num_running_reqs stops admission",
    action="step",
)
def _sequence_cap(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    _, after = _running_after(state, plan)
    if after > config.max_num_seqs:
        yield None, f"{after} running after the step > max_num_seqs={config.max_num_seqs}"


def eligible_when_planned(state: SchedulerState, plan: StepPlan) -> int:
    """The requests running or waiting when the plan from ``state`` was made, less those it rejects: vLLM's
    ``num_eligible_reqs`` (``Scheduler.get_request_counts``, read at the start of ``Scheduler.schedule``; its
    input processor refuses the rejected ones before the scheduler sees them). Without a step in flight,
    ``state.running`` and ``state.waiting``. With one (asynchronous scheduling) the planner saw the requests
    that ended since (``in_flight.ended``: at the in-flight step's samples or by an abort, still in vLLM's
    queues when ``Scheduler.schedule`` ran, ``Scheduler.update_from_output`` and ``finish_requests`` come
    after) and not those that arrived since (``arrival_step == state.step``: they reach the waiting queue for
    the next plan, rule ``in-flight-arrivals-wait``). Count of requests, >= 0."""
    ids = set(state.running).union(state.waiting)
    in_flight = state.in_flight
    if in_flight is not None and in_flight.step >= 0:  # step 0 is planned with nothing in flight
        ids.update(in_flight.ended)
        ids = {r for r in ids
               if (state.requests[r] if r in state.requests else in_flight.ended[r]).arrival_step != state.step}
    return len(ids.difference(r for r, _ in plan.rejected))


def request_when_planned(state: SchedulerState, request_id: str) -> tuple[Request, int] | None:
    """``(request, blocks it held)`` when the plan from ``state`` was made, or ``None`` for an id the plan
    could not name: a live request with its table; with a step in flight, also a request that ended since (a
    wasted item's), with the blocks it held then (``in_flight.freed_blocks``), so that the per-item rules judge
    a wasted item as the planner made it (vLLM allocates its blocks and counts its LoRA adapter)."""
    request = state.requests.get(request_id)
    if request is not None:
        return request, len(request.block_ids)
    if state.in_flight is None:
        return None
    ended = state.in_flight.ended.get(request_id)
    return None if ended is None else (ended, len(state.in_flight.freed_blocks.get(request_id, ())))


def running_when_planned(state: SchedulerState) -> tuple[frozenset[str], frozenset[int]]:
    """``(ids, blocks)``: the requests running when the plan from ``state`` was made, and the blocks they held
    then that are free now. Without a step in flight, ``state.running`` and no blocks. With one
    (asynchronous scheduling), also the requests that ended since, at the in-flight step's samples or by an
    abort, while holding blocks (``in_flight.freed_blocks``): vLLM's ``AsyncScheduler`` plans step n + 1
    while they are still in ``self.running`` holding their blocks (``Scheduler.update_from_output`` for step n,
    which frees them, comes after; vLLM ``EngineCore.step_with_batch_queue``)."""
    if state.in_flight is None or not state.in_flight.freed_blocks:
        return frozenset(state.running), frozenset()
    ended = {r: blocks for r, blocks in state.in_flight.freed_blocks.items() if blocks}
    return frozenset(state.running).union(ended), frozenset(b for blocks in ended.values() for b in blocks)


def _running_after(state: SchedulerState, plan: StepPlan) -> tuple[int, int]:
    """``(admitted, running after the step)``: the live requests the plan admits, and the running requests
    (as the planner saw them: :func:`running_when_planned`) less the preempted plus the admitted."""
    running = running_when_planned(state)[0]
    admitted = sum(1 for item in plan.scheduled if item.request_id not in running and item.request_id in state.requests)
    preempted = sum(1 for request_id in set(plan.preempted) if request_id in running)
    return admitted, len(running) - preempted + admitted


@rule(
    "active-sequence-cap",
    "With max_num_active_seqs set, a step that admits a request leaves at most max_num_active_seqs running "
    "(running, less preempted, plus admitted): admission stops at that many.",
    "vLLM vllm/v1/core/sched/scheduler.py Scheduler.schedule (0.32 and 0.33): the waiting loop breaks once "
    "len(self.running) >= self.max_num_active_reqs (SchedulerConfig.max_num_active_seqs, default max_num_seqs)",
    action="schedule",
)
def _active_sequence_cap(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    if config.max_num_active_seqs is None:
        return
    admitted, after = _running_after(state, plan)
    if admitted and after > config.max_num_active_seqs:
        yield None, f"{admitted} admitted: {after} running after the step > max_num_active_seqs={config.max_num_active_seqs}"


@rule(
    "lora-limit",
    "With max_loras > 0, the requests a step schedules use at most max_loras distinct LoRA adapters "
    "(lora_int_id > 0; 0 is the base model).",
    "vLLM vllm/v1/core/sched/scheduler.py Scheduler.schedule (0.32 and 0.33): scheduled_loras, assert "
    "len(scheduled_loras) <= self.lora_config.max_loras, and the waiting loop's 'Scheduling would exceed "
    "max_loras, skip'; vllm/config/lora.py LoRAConfig.max_loras",
    action="schedule",
)
def _lora_limit(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    if not config.max_loras:
        return
    loras: dict[int, str] = {}
    for item in plan.scheduled:
        planned = request_when_planned(state, item.request_id)  # a wasted item's adapter counts too
        request = planned[0] if planned is not None else None
        if request is not None and request.lora_int_id and request.lora_int_id not in loras:
            loras[request.lora_int_id] = item.request_id
            if len(loras) == config.max_loras + 1:
                yield item.request_id, (f"its LoRA {request.lora_int_id} makes {len(loras)} distinct adapters in the "
                                        f"step ({sorted(loras)}) > max_loras={config.max_loras}")


@rule(
    "grammar-ready-before-admission",
    "A request with structured output is not admitted before its grammar is ready (step >= its "
    "grammar_ready_step).",
    "vLLM vllm/v1/core/sched/scheduler.py Scheduler._handle_blocked_waiting_request (0.32 and 0.33): a request in "
    "RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR whose StructuredOutputRequest.grammar is not ready is "
    "skipped by the waiting loop (skip_request)",
    action="schedule",
)
def _grammar_ready(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is not None and item.request_id not in state.running and not request.grammar_ready(state.step):
            yield item.request_id, (f"admitted in step {state.step} before its grammar is ready "
                                    f"(step {request.grammar_ready_step})")


@rule(
    "watermark",
    "With watermark > 0, a waiting request admitted while another request is running (the running requests "
    "less the preempted, plus those admitted before it in the plan) leaves at least watermark_blocks blocks "
    "free after its allocation (counting, in plan order, the free blocks, those the step's preemptions "
    "release, and the blocks handed out and the evictable cached blocks hit up to it: a hit on a block free "
    "before the step or released by its preemptions). With KV cache groups the blocks are the shared pool's: "
    "every group's new blocks count, and the blocks sliding windows free in the step (skipped_block_ids) are "
    "free from that item on. The first admission into an empty running set may take every block.",
    "vLLM vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots (0.32 and 0.33): watermark_blocks "
    "is added to the blocks required for a request in WAITING or PREEMPTED when has_scheduled_reqs, which "
    "Scheduler.schedule passes as bool(self.running); KVCacheManager.__init__ watermark_blocks; the required "
    "blocks count the hit blocks at ref_cnt 0 (single_type_kv_cache_manager.py "
    "SingleTypeKVCacheManager.get_num_blocks_to_allocate, num_evictable_blocks); with KV cache groups "
    "KVCacheCoordinator.get_num_blocks_to_allocate sums every group's, against the shared "
    "BlockPool.get_num_free_blocks, after remove_skipped_blocks",
    action="schedule",
)
def _watermark(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    keep = config.watermark_blocks
    if not keep:
        return
    preempted = set(plan.preempted)
    planned_running, held = running_when_planned(state)  # with a step in flight: as the planner saw them
    running = sum(1 for r in planned_running if r not in preempted)
    if state.in_flight is not None:  # the blocks of an ended request it preempts: that preemption released them
        held = held.difference(b for r in preempted for b in state.in_flight.freed_blocks.get(r, ()))
    # the blocks at reference count 0 when the waiting loop admits: the free queue as planned and the blocks
    # this step's preemptions released (vLLM preempts in the running loop, before it)
    evictable = set(frozenset(state.free_block_ids) - held) | released_by_preemptions(state, plan)
    free = len(evictable)
    hit: set[int] = set()
    for item, releases in zip(plan.scheduled, window_releases(state, plan), strict=True):
        # KV cache groups: the blocks its windows pass go back to the shared pool before it allocates
        # (remove_skipped_blocks), and it allocates in every group (get_num_blocks_to_allocate sums them)
        window_freed = releases - evictable
        evictable |= window_freed
        free += len(window_freed) - len(item.new_block_ids) - sum(len(b) for b in item.group_new_block_ids)
        for block_id in item.cached_block_ids + tuple(b for t in item.group_cached_block_ids for b in t):
            if block_id in evictable and block_id not in hit:  # an evictable cached block leaves the free queue
                hit.add(block_id)
                free -= 1
        if item.request_id in state.running or item.request_id not in state.requests:
            continue
        if running and free < keep:
            yield item.request_id, (f"admitted while {running} run, leaving {free} free blocks < watermark_blocks="
                                    f"{keep} (watermark={config.watermark})")
        running += 1


@rule(
    "prefill-cadence",
    "With prefill_schedule_interval N > 1, a held step (fewer than N executed steps since the last step that "
    "carried a prefill, some running request decoding, and the last release step not backed up: "
    "state.prefill_held) carries no prefill: no chunk of a running request's prefill and no admission that "
    "leaves more than one token to compute after its prefix-cache hit.",
    "vLLM 0.33 vllm/v1/core/sched/scheduler.py Scheduler.schedule, 'Local prefill cadence' (defer_prefills: "
    "the running loop skips is_prefill_chunk requests, the waiting loop breaks at num_computed_tokens < "
    "num_tokens - 1), its counters num_executed_steps, last_prefill_step, prefill_capacity_bound; "
    "vllm/config/scheduler.py SchedulerConfig.prefill_schedule_interval",
    action="schedule",
)
def _prefill_cadence(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    if config.prefill_schedule_interval <= 1 or not prefill_held(state, config):
        return
    since = state.prefill_cadence.steps_since_prefill if state.prefill_cadence is not None else None
    for item in plan.scheduled:
        if item.request_id in state.requests and carries_prefill(state, item):
            yield item.request_id, (f"a prefill of {item.num_tokens} tokens on a held step ({since} executed steps "
                                    f"since the last prefill, prefill_schedule_interval="
                                    f"{config.prefill_schedule_interval})")


@rule(
    "admit-fits-alone",
    "A waiting request is admitted only if it could complete alone (see admission.rejection_reason).",
    "rejects-impossible (this spec); vLLM input_processor.py InputProcessor._validate_prompt_len rejects long prompts",
    action="schedule",
)
def _admit_fits_alone(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is not None and item.request_id not in state.running:
            reason = rejection_reason(request.prompt_len, request.max_tokens, config)
            if reason is not None:
                yield item.request_id, f"admitted although {reason}"


@rule(
    "reject-only-impossible",
    "A plan rejects only waiting requests that could never complete alone, with a reason whose code "
    "(admission.REJECTION_CODES) names a limit the request breaks; and it rejects every such request that is "
    "waiting and was never admitted (rejects-impossible: at the arrival step).",
    "this spec, section 'admission'",
    action="reject",
)
def _reject_impossible(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    rejected = dict(plan.rejected)
    for request_id in rejected:
        request = state.requests.get(request_id)
        if request is None:
            continue
        if request_id in state.running:
            yield request_id, "rejected while running (only waiting requests can be rejected)"
            continue
        reasons = rejection_reasons(request.prompt_len, request.max_tokens, config)
        if not reasons:
            yield request_id, "rejected although it can complete alone"
        elif rejection_code(rejected[request_id]) not in {rejection_code(r) for r in reasons}:
            yield request_id, (
                f"rejected with reason {rejected[request_id]!r}, which names no limit it breaks; it breaks "
                f"{'; '.join(repr(r) for r in reasons)}"
            )
    for request_id in state.waiting:
        request = state.requests[request_id]
        if request.admitted_step is None and request_id not in rejected:
            reason = rejection_reason(request.prompt_len, request.max_tokens, config)
            if reason is not None:
                yield request_id, f"not rejected although {reason}"


@rule(
    "preempt-running-only",
    "Only running requests are preempted, and a preempted request is not also scheduled.",
    "vLLM Scheduler._preempt_request (pops from self.running)",
    action="preempt",
)
def _preempt_running(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    scheduled = {item.request_id for item in plan.scheduled}
    for request_id in plan.preempted:
        if request_id in state.requests and request_id not in state.running:
            yield request_id, "preempted but not running"
        if request_id in scheduled:
            yield request_id, "preempted and scheduled in the same step"


@rule(
    "blocks-from-free-pool",
    "New blocks (of every KV cache group, and of the remote KV loads the step starts) come only from the free "
    "pool, from blocks released by this step's preemptions, or from blocks a sliding window freed in this step "
    "at this item or an earlier one; no block is handed out twice. With prefix caching the free pool includes "
    "evictable cached blocks, a released "
    "block is one whose reference count the preemptions bring to 0, and a block reused by a prefix-cache hit "
    "in the step is not also handed out.",
    "vLLM vllm/v1/core/block_pool.py BlockPool.get_new_blocks (assert block.ref_cnt == 0), BlockPool.touch",
    action="schedule",
)
def _blocks_from_free_pool(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    yield from blocks_not_from_free_pool(state, plan, frozenset(state.free_block_ids))


def released_by_preemptions(state: SchedulerState, plan: StepPlan) -> set[int]:
    """The blocks the plan's preemptions free: every block of a preempted request's table, or with prefix
    caching those whose reference count the preemptions bring to 0 (vLLM ``BlockPool.free_blocks``)."""
    released: set[int] = set()
    cache = state.prefix_cache
    counts: dict[int, int] = {}
    for request_id in plan.preempted:
        request = state.requests.get(request_id)
        if request is not None:
            if cache is None:
                released.update(held_block_ids(request))
                continue
            for block_id in held_block_ids(request):  # every group's table
                counts[block_id] = counts.get(block_id, cache.ref_counts.get(block_id, 0)) - 1
    released.update(b for b, count in counts.items() if count <= 0)
    return released


def blocks_not_from_free_pool(state: SchedulerState, plan: StepPlan, free: AbstractSet[int]):
    """The check of ``blocks-from-free-pool`` given the free queue as a set (``free`` must equal
    ``set(state.free_block_ids)``; the incremental checker passes the set it keeps, instead of building
    one per step). Yields ``(request_id, detail)`` per breach (``(request_id, detail, case)`` for
    :data:`REUSED_BY_HIT_IN_STEP`)."""
    released = released_by_preemptions(state, plan)
    hits = {b for item in plan.scheduled for b in item.cached_block_ids}
    hits.update(b for item in plan.scheduled for hit in item.group_cached_block_ids for b in hit if b != NULL_BLOCK)
    handed: set[int] = set()
    for item, window_released in zip(plan.scheduled, window_releases(state, plan), strict=True):
        new_block_ids = item.new_block_ids
        if item.skipped_block_ids or item.group_new_block_ids:  # hybrid KV cache groups
            released = released | window_released  # a window's frees, from its own item on
            new_block_ids = new_block_ids + tuple(b for blocks in item.group_new_block_ids for b in blocks)
        for block_id in new_block_ids:
            if block_id in handed:
                yield item.request_id, f"block {block_id} handed out twice"
            elif block_id in hits:
                yield (item.request_id, f"block {block_id} is handed out and reused by a prefix-cache hit in the same step",
                       REUSED_BY_HIT_IN_STEP)
            elif block_id not in free and block_id not in released:
                yield item.request_id, f"block {block_id} is not free"
            handed.add(block_id)
    for load in plan.loads:  # KV connector: a remote load's blocks, taken after the batch's
        for block_id in load.new_block_ids:
            if block_id in handed:
                yield load.request_id, f"block {block_id} handed out twice"
            elif block_id not in free and block_id not in released:
                yield load.request_id, f"block {block_id} is not free"
            handed.add(block_id)


@rule(
    "block-table-covers",
    "After the step, the request's block table holds slots for its computed tokens plus this step's (the "
    "drafts it verifies included): len(table) * block_size >= num_computed_tokens + num_tokens; with "
    "num_lookahead_tokens > 0, also for that many tokens after them, capped at max_model_len.",
    "vLLM vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots (num_tokens_need_slot = "
    "min(num_computed + num_new_tokens + num_lookahead_tokens, max_model_len)); Scheduler.schedule passes "
    "num_lookahead_tokens=self.num_lookahead_tokens",
    action="schedule",
)
def _block_table_covers(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item in plan.scheduled:
        planned = request_when_planned(state, item.request_id)  # a wasted item's table as planned too
        if planned is None:
            continue
        blocks = planned[1] + len(item.cached_block_ids) + len(item.new_block_ids)
        needed = _blocks_needed(item, config)
        if blocks < needed:
            yield item.request_id, f"{blocks} blocks hold fewer than the {needed} needed"


def _blocks_needed(item: ScheduledRequest, config: SchedulerConfig) -> int:
    """The table length (blocks) an item's request needs after the step: slots for its computed tokens plus
    the step's (``block-table-covers``, ``group-table-covers``)."""
    return blocks_for_tokens(slot_tokens(item.num_computed_tokens + item.num_tokens, config), config.block_size)


def _blocks_limit(request: Request, item: ScheduledRequest, config: SchedulerConfig) -> tuple[int, int]:
    """``(limit, tokens)``: the most blocks a table may hold for the request's current sequence and the item's
    drafts, and that sequence in tokens (``no-excess-blocks``, ``group-no-excess-blocks``)."""
    tokens = slot_tokens(request.num_tokens + len(item.spec_token_ids), config)
    return blocks_for_tokens(tokens, config.block_size), tokens


@rule(
    "no-excess-blocks",
    "A request never holds more blocks than its current sequence (prompt plus output) needs, and only "
    "scheduled requests get new blocks. With speculative decoding the sequence counts the drafts the item "
    "verifies and num_lookahead_tokens (capped at max_model_len: config.slot_tokens), and a table that already "
    "holds more (kept after rejected drafts) gets no new block.",
    "vLLM KVCacheManager.allocate_slots (allocates for min(num_computed + num_new + num_lookahead_tokens, "
    "max_model_len) tokens; get_num_blocks_to_allocate allocates none when the table holds them)",
    action="schedule",
)
def _no_excess_blocks(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item in plan.scheduled:
        planned = request_when_planned(state, item.request_id)  # a wasted item's table as planned too
        if planned is None:
            continue
        request = planned[0]
        blocks = planned[1] + len(item.cached_block_ids) + len(item.new_block_ids)
        limit, tokens = _blocks_limit(request, item, config)
        if blocks > limit and (item.new_block_ids or not config.speculative):
            yield item.request_id, f"{blocks} blocks > {limit} for a sequence of {tokens} tokens"


@rule(
    "prefix-hit-at-admission",
    "A plan reuses cached blocks (ScheduledRequest.cached_block_ids, and group_cached_block_ids with KV cache "
    "groups) only with enable_prefix_caching on, and only for a waiting request it admits.",
    "vLLM Scheduler.schedule: KVCacheManager.get_computed_blocks is called for waiting requests only",
    action="schedule",
)
def _prefix_hit_at_admission(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item in plan.scheduled:
        if not item.cached_block_ids and not any(item.group_cached_block_ids):
            continue
        if state.prefix_cache is None:
            yield item.request_id, f"reuses cached blocks {list(item.cached_block_ids)} with prefix caching off"
        elif item.request_id in state.running:
            yield item.request_id, f"reuses cached blocks {list(item.cached_block_ids)} while already running"


@rule(
    "prefix-hit-is-cached-chain",
    "A prefix-cache hit reuses, for each block i of the hit, a block published before the step whose hash is "
    "the hash of the request's block i (chained over blocks 0..i), not handed out in the same step; and it "
    "leaves at least one token to compute (at most (num_tokens - 1) // block_size blocks). With KV cache groups "
    "a hit is one only where every group holds the prefix: each group's hit table is as long as group 0's, a "
    "full-attention group's entries and a sliding-window group's entries its window still needs at the hit "
    "length (at least the last) are blocks cached under that group's key for those tokens, the entries below "
    "null (kv_cache_groups.hit_blocks_needed).",
    "vLLM kv_cache_utils.py hash_block_tokens; kv_cache_manager.py KVCacheManager.get_computed_blocks "
    "(max_cache_hit_length = num_tokens - 1); with groups kv_cache_coordinator.py "
    "HybridKVCacheCoordinator.find_longest_cache_hit, single_type_kv_cache_manager.py "
    "SlidingWindowManager.find_longest_cache_hit and add_local_computed_blocks, block_pool.py get_cached_block "
    "(BlockHashWithGroupId) (0.32 and 0.33)",
    action="schedule",
)
def _prefix_hit_chain(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    cache = state.prefix_cache
    if cache is None:
        return
    handed = {b for item in plan.scheduled for b in item.new_block_ids}
    if config.kv_cache_groups:
        handed.update(b for item in plan.scheduled for new in item.group_new_block_ids for b in new)
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is None or not (item.cached_block_ids or any(item.group_cached_block_ids)):
            continue
        if config.kv_cache_groups:
            tables = (item.cached_block_ids,) + (item.group_cached_block_ids
                                                 or tuple(() for _ in config.kv_cache_groups[1:]))
            breach = group_hit_violation(cache, request, tables, config)
            if breach is None:
                breach = next((f"hit block {b} handed out in the same step" for t in tables for b in t if b in handed),
                              None)
            if breach is not None:
                yield item.request_id, breach
            continue
        limit = max_hit_blocks(request, config.block_size)
        if len(item.cached_block_ids) > limit:
            yield item.request_id, (
                f"hit of {len(item.cached_block_ids)} blocks, but at most {limit} may hit so that one of its "
                f"{request.num_tokens} tokens is computed")
            continue
        parent = ROOT_HASH
        for index, block_id in enumerate(item.cached_block_ids):
            parent = request_block_hash(request, index, parent, config.block_size)
            found = cache.block_hashes.get(block_id)
            if found is None:
                yield item.request_id, f"hit block {index} is block {block_id}, which is not cached"
                break
            if found != parent:
                yield item.request_id, f"hit block {index} is block {block_id}, which caches other tokens"
                break
            if block_id in handed:
                yield item.request_id, f"hit block {index} is block {block_id}, handed out in the same step"
                break


@rule(
    "prefix-hit-longest",
    "With prefix caching on and vLLM's publication (prefix_cache_publication vllm), a waiting request admitted in "
    "the step reuses the longest chain of cached blocks that matches its sequence (at most (num_tokens - 1) // block_size blocks), not counting blocks handed "
    "out to requests earlier in the batch (those are evicted before its lookup). With KV cache groups, the "
    "longest hit every group holds (kv_cache_groups.longest_group_hit).",
    "vLLM kv_cache_manager.py KVCacheManager.get_computed_blocks -> find_longest_cache_hit, called just before "
    "the request's allocate_slots in Scheduler.schedule; with groups HybridKVCacheCoordinator.find_longest_cache_hit "
    "(0.32 and 0.33)",
    action="schedule",
)
def _prefix_hit_longest(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    cache = state.prefix_cache
    if cache is None or not cache.hash_to_blocks or config.prefix_cache_publication != "vllm":
        return  # SGLang's radix cache: a hit is a cached chain (prefix-hit-is-cached-chain), at most the longest
    handed: set[int] = set()
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is not None and item.request_id not in state.running:
            if config.kv_cache_groups:  # the longest hit every group holds
                longest = longest_group_hit(cache, request, config, handed)[0]
            else:
                longest = cache.longest_hit(request, config.block_size, handed)
            if len(longest) != len(item.cached_block_ids):
                yield item.request_id, (
                    f"prefix-cache hit of {len(item.cached_block_ids) * config.block_size} tokens, but "
                    f"{len(longest) * config.block_size} were cached (blocks {list(longest)})")
        handed.update(item.new_block_ids)
        for new in item.group_new_block_ids:
            handed.update(new)


def _publication_end(request: Request, item: ScheduledRequest) -> int:
    """Tokens of ``request`` computed once ``item`` ran (positions of its sequence, drafts left out): its blocks
    below ``end // block_size`` are full and computed (``deduplicate-at-publication``)."""
    return min(item.num_computed_tokens + item.num_sequence_tokens, request.num_tokens)


@rule(
    "deduplicate-at-publication",
    "A de-duplication (ScheduledRequest.deduplicated_block_ids, (own, cached) pairs) only with prefix caching on "
    "and SGLang's publication (prefix_cache_publication sglang-radix), in an item that publishes at its step (a "
    "prefill chunk; at a finish the table is released at once, and the spec keeps the copies cached). Each own block is a block "
    "of the request's table after the item, at an index i whose tokens are all computed once the item ran, not "
    "published before the step (the request's own copy: no other table can hold it), named once; its cached block carries the hash "
    "of the request's block i (same prefix, same tokens) and is either published before the step and not handed "
    "out in it, or block i of an earlier item of the batch that publishes it in this step and does not "
    "de-duplicate it; a cached block is never itself an own block of the step.",
    "SGLang 0.5.23 mem_cache/radix_cache.py RadixCache.cache_unfinished_req and cache_finished_req -> "
    "_insert_cache (the prefix the tree already holds: free_segment of the request's copies) and "
    "req_to_token_pool.write (the tree's pages written into the request's row)",
    action="schedule",
)
def _deduplicate_at_publication(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    if not any(item.deduplicated_block_ids for item in plan.scheduled):
        return
    cache = state.prefix_cache
    if cache is None or config.prefix_cache_publication != "sglang-radix":
        for item in plan.scheduled:
            if item.deduplicated_block_ids:
                why = ("prefix caching is off" if cache is None
                       else f"prefix_cache_publication is {config.prefix_cache_publication!r}, not 'sglang-radix'")
                yield item.request_id, (f"de-duplicates {[list(p) for p in item.deduplicated_block_ids]}, but "
                                        f"{why} (only SGLang's radix cache de-duplicates)")
        return
    size = config.block_size
    handed = {b for item in plan.scheduled for b in item.new_block_ids}
    own_blocks = {own for item in plan.scheduled for own, _ in item.deduplicated_block_ids}
    published: dict[int, str] = {}  # block -> hash, for the blocks earlier items publish in this step
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is None:
            continue
        table = request.block_ids + item.cached_block_ids + item.new_block_ids
        full = min(_publication_end(request, item) // size, len(table))
        hashes = request_block_hashes(request, full, size)
        seen: set[int] = set()
        for own, cached in item.deduplicated_block_ids:
            index = table.index(own) if own in table else -1
            if own in seen:
                yield item.request_id, f"block {own} de-duplicated twice"
            elif index < 0:
                yield item.request_id, f"de-duplicates block {own}, which is not in its table"
            elif index >= full:
                yield item.request_id, f"de-duplicates block {own} (block {index} of its table), not full and computed"
            elif own in cache.block_hashes and own not in handed:  # (a block handed out in the step is evicted)
                yield item.request_id, f"de-duplicates block {own}, published before the step"
            elif not publishes_at_step(request, config):
                yield item.request_id, f"de-duplicates block {own} in a decode, which publishes only at its finish"
            elif cached in own_blocks:
                yield item.request_id, f"replaces block {own} by block {cached}, itself de-duplicated in the step"
            elif (published[cached] if cached in published else cache.block_hashes.get(cached)) != hashes[index]:
                yield item.request_id, f"replaces block {own} (block {index}) by block {cached}, which does not cache its tokens"
            elif cached in handed and cached not in published:  # cached before the step, evicted in it
                yield item.request_id, f"replaces block {own} by block {cached}, handed out in the same step"
            seen.add(own)
        if publishes_at_step(request, config):
            for index in range(full):
                block_id = table[index]
                if (block_id not in cache.block_hashes or block_id in handed) and block_id not in seen:
                    published[block_id] = hashes[index]


# Hybrid KV cache groups (SchedulerConfig.kv_cache_groups; schedspec.spec.kv_cache_groups). Without groups no
# item carries group blocks or window frees, and none of these finds anything.


def _group_items(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    """``(item, request)`` for each item of a live request, with groups configured (none without)."""
    if not config.kv_cache_groups:
        return
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is not None:
            yield item, request


def _group_table(request: Request, index: int) -> tuple[int, ...]:
    """The request's table of group ``index`` (0 = ``block_ids``); empty if it holds none in that group."""
    tables = group_tables(request)
    return tables[index] if index < len(tables) else ()


@rule(
    "group-table-covers",
    "With KV cache groups, after the step every group's block table (its freed-by-window null entries "
    "included) has slots for the request's computed tokens plus this step's: len(table) * block_size >= "
    "num_computed_tokens + num_tokens; and an item names new blocks for no group the config lacks.",
    "vLLM vllm/v1/core/kv_cache_coordinator.py KVCacheCoordinator.allocate_new_blocks (every manager); "
    "single_type_kv_cache_manager.py SingleTypeKVCacheManager.allocate_new_blocks (num_required_blocks = "
    "cdiv(num_tokens, block_size) - len(req_blocks), null blocks counted)",
    action="schedule",
)
def _group_table_covers(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    extra = len(config.kv_cache_groups) - 1
    for item, request in _group_items(state, plan, config):
        if len(item.group_new_block_ids) > extra:
            yield item.request_id, f"new blocks for {len(item.group_new_block_ids)} groups past group 0, but {extra} are configured"
            continue
        needed = _blocks_needed(item, config)
        for index in range(1, extra + 1):
            new = item.group_new_block_ids[index - 1] if index - 1 < len(item.group_new_block_ids) else ()
            blocks = len(_group_table(request, index)) + len(_group_hit(item, index)) + len(new)
            if blocks < needed:
                yield item.request_id, f"group {index}: {blocks} blocks hold fewer than the {needed} needed"


@rule(
    "group-no-excess-blocks",
    "With KV cache groups, no group's block table (null entries included) holds more blocks than the request's "
    "sequence needs, as no-excess-blocks for group 0.",
    "vLLM single_type_kv_cache_manager.py SingleTypeKVCacheManager.get_num_blocks_to_allocate / "
    "allocate_new_blocks (no block past cdiv(num_tokens, block_size))",
    action="schedule",
)
def _group_no_excess_blocks(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item, request in _group_items(state, plan, config):
        limit, tokens = _blocks_limit(request, item, config)
        for index, new in enumerate(item.group_new_block_ids, start=1):
            blocks = len(_group_table(request, index)) + len(_group_hit(item, index)) + len(new)
            if blocks > limit and new:
                yield item.request_id, f"group {index}: {blocks} blocks > {limit} for a sequence of {tokens} tokens"


def _group_hit(item: ScheduledRequest, index: int) -> tuple[int, ...]:
    """The item's prefix-cache hit in group ``index`` >= 1 (null entries included); empty without one."""
    hits = item.group_cached_block_ids
    return hits[index - 1] if index - 1 < len(hits) else ()


def _where_held(request: Request, block_id: int) -> tuple[int, int] | None:
    """``(group, table index)`` of a block the request holds, or ``None``."""
    for group, table in enumerate(group_tables(request)):
        if block_id in table:
            return group, table.index(block_id)
    return None


@rule(
    "window-keeps-visible",
    "A block an item's allocation frees (skipped_block_ids) is one the request holds in a sliding-window "
    "group, at a table index below max(0, num_computed_tokens - sliding_window + 1) // block_size: the "
    "window of the next token no longer sees it. Nothing the window still sees is freed, and nothing of a "
    "full-attention group.",
    "vLLM vllm/v1/core/single_type_kv_cache_manager.py SlidingWindowManager.get_num_skipped_tokens, "
    "SingleTypeKVCacheManager.remove_skipped_blocks / _remove_blocks_in_range; kv_cache_manager.py "
    "KVCacheManager.allocate_slots (frees on the processed tokens before it allocates)",
    action="schedule",
)
def _window_keeps_visible(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item, request in _group_items(state, plan, config):
        for block_id in item.skipped_block_ids:
            where = _where_held(request, block_id) if block_id != NULL_BLOCK else None
            if where is None:
                yield item.request_id, f"frees block {block_id}, which it does not hold"
                continue
            group, index = where
            kind = config.kv_cache_groups[group]
            skipped = num_skipped_blocks(kind, item.num_computed_tokens, config.block_size)
            if index >= skipped:
                window = "full attention" if kind.sliding_window is None else f"sliding_window={kind.sliding_window}"
                yield item.request_id, (f"frees block {block_id} (group {group}, index {index}, {window}), which the "
                                        f"token at position {item.num_computed_tokens} still attends (only the first "
                                        f"{skipped} blocks are past its window)")


@rule(
    "window-frees-skipped",
    "An item's allocation frees every block a sliding-window group of the request still holds below the "
    "window of its next token (the table indices below max(0, num_computed_tokens - sliding_window + 1) // "
    "block_size): a block kept past the window is neither free nor needed.",
    "vLLM vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots ('Free the blocks that are skipped "
    "during the attention computation ... before allocating new blocks'), KVCacheCoordinator.remove_skipped_blocks",
    action="schedule",
)
def _window_frees_skipped(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item, request in _group_items(state, plan, config):
        kept = [b for b in window_frees(request, item.num_computed_tokens, config) if b not in item.skipped_block_ids]
        if kept:
            where = _where_held(request, kept[-1])
            assert where is not None  # window_frees names blocks the request holds
            group, index = where
            yield item.request_id, (f"keeps {len(kept)} block(s) past the window at position "
                                    f"{item.num_computed_tokens} (block {kept[-1]}: group {group}, index {index})")


# Speculative decoding (num_speculative_tokens > 0). With it off no item carries drafts, and none of these
# finds anything.


@rule(
    "drafts-only-in-decodes",
    "Only a running decode carries drafts (a prefill chunk, the last chunk of a prompt and a recompute carry "
    "none), and it computes its one pending token and every draft it carries: num_tokens = 1 + d.",
    "vLLM Scheduler.update_draft_token_ids ('Ignore draft tokens for prefill chunks'); Scheduler.schedule "
    "(num_scheduled_spec_tokens = num_new_tokens + num_computed_tokens - num_tokens: the drafts are the "
    "scheduled tokens past the sequence)",
    action="schedule",
)
def _drafts_only_in_decodes(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item in plan.scheduled:
        if not item.spec_token_ids:
            continue
        request = state.requests.get(item.request_id)
        if request is None:
            continue
        d = len(item.spec_token_ids)
        if item.request_id not in state.running or not request.is_decode:
            yield item.request_id, f"carries {d} drafts but is not a running decode"
        elif item.num_tokens != 1 + d:
            yield item.request_id, f"carries {d} drafts but computes {item.num_tokens} tokens, not 1 + {d}"


@rule(
    "drafts-are-proposed",
    "The drafts an item carries are the first d of the drafts proposed for the request after its last step "
    "(its spec_token_ids), in order; so at most num_speculative_tokens.",
    "vLLM Scheduler.schedule (scheduled_spec_decode_tokens[request_id] = request.spec_token_ids[:"
    "num_scheduled_spec_tokens])",
    action="schedule",
)
def _drafts_are_proposed(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item in plan.scheduled:
        if not item.spec_token_ids:
            continue
        request = state.requests.get(item.request_id)
        if request is None:
            continue
        proposed = request.spec_token_ids
        if item.spec_token_ids != proposed[:len(item.spec_token_ids)]:
            yield item.request_id, (f"carries drafts {list(item.spec_token_ids)}, not a prefix of those proposed "
                                    f"{list(proposed)}")


@rule(
    "drafts-within-max-model-len",
    "A decode carries no more drafts than max_model_len can still accept: its accepted drafts and the token "
    "sampled after them fit, num_computed_tokens + num_tokens + 1 <= max_model_len (num_tokens + d + 1 <= "
    "max_model_len for the request). Drafts past max_tokens are allowed: vLLM 0.32 schedules them and the "
    "stop at max_tokens drops what is past it (sample).",
    "vLLM Scheduler.schedule ('Make sure the input position does not exceed the max model len. This is "
    "necessary when using spec decoding': num_new_tokens <= max_model_len - num_computed_tokens - "
    "num_sampled_tokens_per_step); vllm/v1/spec_decode/ngram_proposer.py "
    "_find_longest_matched_ngram_and_propose_tokens (k = min(k, max_model_len - total_token))",
    action="schedule",
)
def _drafts_within_max_model_len(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item in plan.scheduled:
        if item.spec_token_ids and item.num_computed_tokens + item.num_tokens + 1 > config.max_model_len:
            yield item.request_id, (
                f"computes positions up to {item.num_computed_tokens + item.num_tokens} with "
                f"{len(item.spec_token_ids)} drafts: its drafts and the token after them pass "
                f"max_model_len={config.max_model_len}")


# Asynchronous scheduling (a step in flight when the plan was made: SchedulerState.in_flight). Without one
# (a synchronous engine) none of these finds anything.


@rule(
    "in-flight-foreseen-length",
    "A plan made while a step was in flight does not schedule a request that the in-flight step's placeholders "
    "bring to max_tokens outputs or max_model_len tokens: the planner knows it ends at that step's sample (a "
    "stop by end-of-sequence or a stop id, or an abort, it cannot foresee).",
    "vLLM Scheduler.schedule: 'Async scheduling: Avoid scheduling an extra step when we are sure that the "
    "previous step has reached request.max_tokens' (num_output_placeholders > 0 and num_computed_tokens + 2 - "
    "num_output_placeholders >= num_prompt_tokens + max_tokens), and num_new_tokens <= max_model_len - "
    "num_computed_tokens - num_sampled_tokens_per_step ('the request has reached to either its "
    "max_total_tokens or max_model_len')",
    action="schedule",
)
def _in_flight_foreseen_length(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    in_flight = state.in_flight
    for item, ended in wasted_items(state, plan):
        # vLLM's guard counts tokens, whatever ends the request: an end-of-sequence sampled as the
        # max_tokens-th output was foreseen too (only an abort is not a sample the planner counted)
        at_max_tokens = len(ended.output_token_ids) >= ended.max_tokens
        if ended.finish_reason == "abort" or not (at_max_tokens or ended.num_tokens >= config.max_model_len):
            continue
        assert in_flight is not None
        placeholders = in_flight.num_output_placeholders.get(item.request_id, 0)
        limit = f"max_tokens={ended.max_tokens}" if at_max_tokens else f"max_model_len={config.max_model_len}"
        yield item.request_id, (f"scheduled although its {placeholders} output placeholder(s) of step "
                                f"{in_flight.step} bring it to {limit}")


@rule(
    "in-flight-blocks-held-when-planned",
    "A plan made while a step was in flight hands out no block that was held when it was made: none of the "
    "blocks released since by requests that ended at the in-flight step's samples or were aborted after "
    "(in_flight.freed_blocks), unless the plan preempts their request (its preemption released them).",
    "vLLM vllm/v1/engine/core.py EngineCore.step_with_batch_queue (Scheduler.schedule for step n + 1 runs before "
    "Scheduler.update_from_output for step n, which frees a finished request's blocks: Scheduler._free_request); "
    "Scheduler.finish_requests",
    action="schedule",
)
def _in_flight_blocks_held(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    in_flight = state.in_flight
    if in_flight is None or not in_flight.freed_blocks:
        return
    preempted = set(plan.preempted)
    held = {b for request_id, blocks in in_flight.freed_blocks.items() if request_id not in preempted for b in blocks}
    for item in plan.scheduled:
        for block_id in item.new_block_ids:
            if block_id in held:
                yield item.request_id, (f"block {block_id} is handed out, but it was held when the plan was made "
                                        f"(freed after the plan was made, while step {in_flight.step} was in flight)")


@rule(
    "in-flight-arrivals-wait",
    "A plan made while a step was in flight schedules no request that arrived after it was made (arrival_step "
    "equal to the step planned): such a request waits for the next plan.",
    "vLLM EngineCore.step_with_batch_queue: requests added after schedule() reach the scheduler's waiting "
    "queue for the next schedule()",
    action="schedule",
)
def _in_flight_arrivals_wait(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    in_flight = state.in_flight
    if in_flight is None or in_flight.step < 0:  # step 0 is planned with nothing in flight
        return
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is not None and request.arrival_step == state.step:
            yield item.request_id, (f"arrived before step {state.step}, after its plan was made (while step "
                                    f"{in_flight.step} was in flight)")


@rule(
    "wasted-item-continues",
    "An item for a request that ended while the plan's in-flight step ran (wasted work) is one the planner could "
    "make: it starts at the request's computed tokens and computes at least one and at most its pending tokens "
    "plus the drafts it verifies.",
    "vLLM Scheduler.schedule num_new_tokens = num_tokens_with_spec + num_output_placeholders - "
    "num_computed_tokens (over placeholders: the token the in-flight step samples is pending, already counted "
    "computed by Scheduler._update_after_schedule)",
    action="schedule",
)
def _wasted_item_continues(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for item, ended in wasted_items(state, plan):
        pending = ended.num_pending_tokens + len(item.spec_token_ids)
        if item.num_computed_tokens != ended.num_computed_tokens:
            yield item.request_id, (f"wasted chunk starts at {item.num_computed_tokens} but "
                                    f"{ended.num_computed_tokens} tokens were computed")
        elif not 1 <= item.num_tokens <= pending:
            yield item.request_id, f"wasted chunk of {item.num_tokens} tokens of {pending} pending"


# KV connector: remote KV loads (vLLM WAITING_FOR_REMOTE_KVS). With no request offering a load they find nothing.


@rule(
    "wait-for-remote-kv",
    "A request whose remote KV load is in flight (WAITING_FOR_REMOTE_KVS) is not scheduled, preempted or "
    "rejected: it waits, holding its blocks, until the transfer lands.",
    "vLLM vllm/v1/core/sched/scheduler.py Scheduler._handle_blocked_waiting_request (a request not in "
    "finished_recving_kv_req_ids is skipped: 'still in WAITING_FOR_REMOTE_KVS state')",
    action="schedule",
)
def _wait_for_remote_kv(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    named = ([(item.request_id, "scheduled") for item in plan.scheduled] + [(r, "preempted") for r in plan.preempted]
             + [(r, "rejected") for r, _ in plan.rejected])
    for request_id, what in named:
        request = state.requests.get(request_id)
        if request is not None and request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            yield request_id, f"{what} while its remote KV load (started at step {request.kv_load_step}) is in flight"


@rule(
    "load-as-offered",
    "A remote KV load is started only for a waiting request never admitted (status WAITING) that offers one "
    "(num_external_computed_tokens > 0) and has not started it (kv_load_step None), for exactly the tokens "
    "offered, at most its sequence.",
    "vLLM Scheduler.schedule: get_num_new_matched_tokens is asked when request.num_computed_tokens == 0, and "
    "a load_kv_async answer moves the request to WAITING_FOR_REMOTE_KVS with num_computed_tokens set to the "
    "loaded tokens; KVConnectorBase_V1.get_num_new_matched_tokens",
    action="start_load",
)
def _load_as_offered(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for load in plan.loads:
        request = state.requests.get(load.request_id)
        if request is None:
            continue
        if request.status is not RequestStatus.WAITING or request.admitted_step is not None:
            yield load.request_id, f"load started for a request with status {request.status.value}" + (
                f", admitted at step {request.admitted_step}" if request.admitted_step is not None else "")
        elif request.kv_load_step is not None:
            yield load.request_id, f"second load started (the first at step {request.kv_load_step})"
        elif load.num_tokens != request.num_external_computed_tokens or not 0 < load.num_tokens <= request.num_tokens:
            yield load.request_id, (f"load of {load.num_tokens} tokens, but the connector offers "
                                    f"{request.num_external_computed_tokens} of a {request.num_tokens}-token sequence")


@rule(
    "load-blocks-exact",
    "A remote KV load takes exactly the blocks that hold its tokens: blocks_for_tokens(num_tokens).",
    "vLLM KVCacheManager.allocate_slots(num_new_tokens=0, num_external_computed_tokens=n) allocates for the "
    "n external tokens (Scheduler.schedule: 'KVTransfer: loading remote KV, do not allocate for new work')",
    action="start_load",
)
def _load_blocks_exact(state: SchedulerState, plan: StepPlan, config: SchedulerConfig):
    for load in plan.loads:
        if load.request_id not in state.requests:
            continue  # known-requests names it (a load for an unknown request: not a live request)
        needed = blocks_for_tokens(load.num_tokens, config.block_size)
        if len(load.new_block_ids) != needed:
            yield load.request_id, f"load of {load.num_tokens} tokens takes {len(load.new_block_ids)} blocks, not {needed}"


RULE_NAMES: tuple[str, ...] = tuple(r.name for r in RULES)

REMOTE_KV_RULES: tuple[str, ...] = ("wait-for-remote-kv", "load-as-offered", "load-blocks-exact")
"""The rules of remote KV loads (KV connector): with no request offering a load (the default) none finds
anything, and each only removes plans, so the Z3 encodings (:mod:`schedspec.spec.proofs`) leave them out."""

IN_FLIGHT_RULES: tuple[str, ...] = ("in-flight-foreseen-length", "in-flight-blocks-held-when-planned",
                                     "in-flight-arrivals-wait", "wasted-item-continues")
"""The rules of a plan made while a step was in flight (asynchronous scheduling): without a step in flight
(``SchedulerState.in_flight is None``, a synchronous engine) none finds anything. The proofs
(:mod:`schedspec.spec.proofs`) model synchronous engines and do not encode them."""

GROUP_RULES: tuple[str, ...] = ("group-table-covers", "group-no-excess-blocks", "window-keeps-visible",
                                 "window-frees-skipped")
"""The rules of hybrid KV cache groups (``SchedulerConfig.kv_cache_groups``): without groups they constrain
nothing, so the Z3 encodings (:mod:`schedspec.spec.proofs`), which model one full-attention group, leave them
out."""

PUBLICATION_RULES: tuple[str, ...] = ("deduplicate-at-publication",)
"""The rules of SGLang's publication policy (``prefix_cache_publication = "sglang-radix"``): a plan without a
de-duplication (every plan under vLLM's policy, the default) meets them, so the Z3 encodings
(:mod:`schedspec.spec.proofs`), which model vLLM's publication, leave them out."""

LIMIT_RULES: tuple[str, ...] = ("active-sequence-cap", "lora-limit", "grammar-ready-before-admission", "watermark",
                                 "prefill-cadence")
"""The rules of the per-step limits that are off by default (``config.LIMIT_DEFAULTS``, and structured output):
with them off they constrain nothing, and each only removes plans, so the Z3 encodings
(:mod:`schedspec.spec.proofs`) leave them out and their proofs hold with them too."""


def violated_rules(state: SchedulerState, plan: StepPlan, config: SchedulerConfig,
                   skip: AbstractSet[str] = frozenset()) -> list[Violation]:
    """The rules the plan breaks from this state; empty if the plan is allowed.

    Args:
        state: the state before the step.
        plan: the proposed plan.
        config: the limits.
        skip: names of rules not to check here (a caller that checks them its own way, as the
            incremental checker does ``blocks-from-free-pool``).

    Returns:
        One :class:`Violation` per broken rule instance, tagged with ``state.step``.
    """
    found: list[Violation] = []
    for r in RULES:
        if r.name in skip:
            continue
        for request_id, detail, *case in r.check(state, plan, config):
            found.append(Violation(r.name, detail, state.step, request_id, kind="rule",
                                   code=coded(r.name, case[0] if case else None)))
    return found


def is_allowed(state: SchedulerState, plan: StepPlan, config: SchedulerConfig) -> bool:
    """True when :func:`violated_rules` finds nothing."""
    return not violated_rules(state, plan, config)
