"""One checked step of the spec, written once: what the engine loop, the trace checker and the
Hypothesis machine all do between and in steps.

A :class:`Stepper` holds the spec state of a run and, per step:

1. applies the client's actions before the step: :meth:`Stepper.arrive` (``add_request``) and
   :meth:`Stepper.abort` (``abort_request``, which says whether the request was live and which blocks
   it freed: the abort accounting of a step record);
2. checks the step's plan against the rules (:meth:`Stepper.check_plan`, before the plan runs);
3. applies the plan with the sampled tokens (:meth:`Stepper.step`: the spec's own
   :func:`~schedspec.spec.transitions.apply_plan`) and checks every invariant on the step;
4. feeds the trace-property monitors (:meth:`Stepper.observe`);
5. derives the step's :class:`~schedspec.spec.trace.StepRecord` (:func:`expected_record`): what the spec
   says a log of the step holds. The engine writes it as its record; the trace checker compares the
   recorded step with it field by field.

The rules and invariants are checked behind one interface, :class:`StepChecker`: :class:`FullChecker`
(:func:`~schedspec.spec.rules.violated_rules`, :func:`~schedspec.spec.invariants.check_step`, the
definitions) or :class:`~schedspec.spec.incremental.IncrementalChecker` (the same verdicts, at a cost
proportional to what each step changed); :func:`step_checker` picks one.

Each transition the stepper computes is returned as a :class:`Transition`, which the engine hands to a
reference scheduler that keeps the same spec state (``accept_transition``,
:class:`schedspec.reference.scheduler.ReferenceScheduler`), so the transition is computed once per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.incremental import IncrementalChecker
from schedspec.spec.invariants import check_step
from schedspec.spec.kv_cache_groups import NULL_BLOCK, held_block_ids
from schedspec.spec.prefix_cache import evicted_blocks
from schedspec.spec.properties import Monitor
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import Violation, violated_rules
from schedspec.spec.state import (
    NO_SPECULATION,
    NO_TRANSFERS,
    KVTransferOutput,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
    landed_plan,
)
from schedspec.spec.trace import ScheduledTokens, StepRecord
from schedspec.spec.transitions import (
    PlanError,
    StepResult,
    abort_request,
    add_request,
    apply_plan,
    group_tables_after,
)
from schedspec.spec.workload import RequestSpec


class StepChecker(Protocol):
    """Checks one step at a time; fed every state of a run in order.

    Per step: ``sync(before)`` (the state after the step's arrivals and aborts), ``rules(before, plan)``
    (what :func:`~schedspec.spec.rules.violated_rules` returns, as a multiset), then
    ``invariants(before, plan, after)`` (what :func:`~schedspec.spec.invariants.check_step` returns, as a
    multiset)."""

    def sync(self, before: SchedulerState) -> None: ...

    def rules(self, before: SchedulerState, plan: StepPlan) -> list[Violation]: ...

    def invariants(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> list[Violation]: ...

    def forget_ended(self) -> None:
        """The run's state has forgotten its ended requests (:meth:`Stepper.forget_ended`): drop what the
        checker keeps of them."""


class FullChecker:
    """The :class:`StepChecker` of the definitions: every rule and every invariant on every step."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def sync(self, before: SchedulerState) -> None:
        """Nothing to follow: each check looks at the whole state."""

    def rules(self, before: SchedulerState, plan: StepPlan) -> list[Violation]:
        """:func:`~schedspec.spec.rules.violated_rules`."""
        return violated_rules(before, plan, self.config)

    def invariants(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> list[Violation]:
        """:func:`~schedspec.spec.invariants.check_step`."""
        return check_step(before, plan, after, self.config)

    def forget_ended(self) -> None:
        """Nothing kept: each check looks at the state."""


def step_checker(config: SchedulerConfig, incremental: bool = False) -> StepChecker:
    """The :class:`~schedspec.spec.incremental.IncrementalChecker` with ``incremental``, else the
    :class:`FullChecker`. With hybrid KV cache groups (``config.kv_cache_groups``) always the
    :class:`FullChecker`: the incremental checker's block ledger knows one table per request; and with SGLang's
    prefix-cache publication (``prefix_cache_publication != "vllm"``): its ledger assumes tables that only grow
    while their request runs, which a de-duplication breaks (a block replaced in the middle of a table)."""
    if not incremental or config.kv_cache_groups or config.prefix_cache_publication != "vllm":
        return FullChecker(config)
    return IncrementalChecker(config)


@attrs.frozen(eq=False)
class Transition:
    """One spec transition as the stepper computed it: ``operation`` (``"add_request"``,
    ``"abort_request"`` or ``"apply_plan"``) of the state ``before`` with ``argument`` (the request, the
    request id, or the plan with ``sampled``) under ``config``, and its ``result`` (the new state, or the
    :class:`~schedspec.spec.transitions.StepResult`).

    A scheduler that keeps the same spec state may use it instead of computing the transition again
    (the spec's transitions are pure functions, so the result is the one it would compute), but only for
    exactly this transition: :meth:`matches`."""

    operation: str
    before: SchedulerState
    argument: object
    config: SchedulerConfig
    result: object
    sampled: Mapping[str, int] | None = None
    speculative: SpeculativeOutput = NO_SPECULATION

    def matches(self, operation: str, state: SchedulerState, argument: object, config: SchedulerConfig,
                sampled: Mapping[str, int] | None = None,
                speculative: SpeculativeOutput = NO_SPECULATION) -> bool:
        """Whether this is ``operation`` of the very ``state`` object with the very ``argument`` (and
        ``sampled`` and ``speculative``) objects (identity, not equality: none is changed by either side)
        under an equal ``config``."""
        return (operation == self.operation and state is self.before and argument is self.argument
                and sampled is self.sampled and speculative is self.speculative and config == self.config)


@attrs.frozen
class Aborted:
    """What a client abort did: ``live`` whether the request was live (an abort of an ended or unknown
    id changes nothing), ``freed`` the blocks it released (its block table), ``transition`` the spec's."""

    request_id: str
    live: bool
    freed: tuple[int, ...]
    transition: Transition


@attrs.define
class StepOutcome:
    """One step as the spec saw it (:meth:`Stepper.step`).

    Attributes:
        before: the state before the step (after its arrivals and aborts).
        plan: the step's plan; ``sampled``: request id -> the token sampled this step.
        result: the spec's :class:`~schedspec.spec.transitions.StepResult` (the state after the step and
            what finished), or ``None`` when the spec cannot apply the plan (``error``).
        error: the spec's :class:`~schedspec.spec.transitions.PlanError`, if it cannot apply the plan.
        rule_violations: the rules the plan breaks (empty when unchecked).
        invariant_violations: the invariants the step breaks (empty when unchecked or not applied).
        arrivals: the requests added before the step; ``aborts``: the ids the client aborted before it;
            ``aborted``: what each of those aborts did.
        transition: the step as a :class:`Transition` (``None`` when not applied or given by the caller).
        speculative: speculative decoding's inputs to the step (accepted drafts, drafts proposed after it).
        landed: the part of the plan that landed (:func:`~schedspec.spec.state.landed_plan`: with a step in
            flight, the plan less its items and preemptions for requests that ended meanwhile); the plan
            itself otherwise. The invariants and the monitors see this part.
        transfers: the KV connector's report after the step (loads landed, invalid blocks, sends completed).
    """

    before: SchedulerState
    plan: StepPlan
    sampled: Mapping[str, int]
    result: StepResult | None
    error: PlanError | None
    rule_violations: list[Violation]
    invariant_violations: list[Violation]
    arrivals: list[RequestSpec]
    aborts: list[str]
    aborted: list[Aborted]
    transition: Transition | None = None
    speculative: SpeculativeOutput = NO_SPECULATION
    landed: StepPlan | None = None
    transfers: KVTransferOutput = NO_TRANSFERS

    @property
    def landed_plan(self) -> StepPlan:
        """:attr:`landed`, or the plan when none was given."""
        return self.plan if self.landed is None else self.landed

    @property
    def num_wasted_tokens(self) -> int:
        """The step's wasted tokens (:attr:`~schedspec.spec.transitions.StepResult.num_wasted_tokens`): 0
        for a synchronous engine or a step not applied."""
        return self.result.num_wasted_tokens if self.result is not None else 0

    @property
    def after(self) -> SchedulerState:
        """The state after the step (raises the :attr:`error` when the plan could not be applied)."""
        if self.result is None:
            assert self.error is not None
            raise self.error
        return self.result.state

    @property
    def finished(self) -> tuple[str, ...]:
        """The ids that finished in this step (stop or length), in batch order."""
        return self.result.finished if self.result is not None else ()

    @property
    def aborted_ids(self) -> list[str]:
        """The ids of the aborts that ended a live request, in order."""
        return [a.request_id for a in self.aborted if a.live]


def prefix_hit_tokens(plan: StepPlan, block_size: int) -> dict[str, int]:
    """Request id -> the tokens its prefix-cache hit in this step covers (a record's
    ``prefix_hit_tokens``): ``len(cached_block_ids) * block_size`` for each request the plan gives
    ``cached_block_ids`` (:func:`~schedspec.spec.transitions.schedule` counts them as computed; the rule
    ``chunk-continues`` starts the chunk there)."""
    return {item.request_id: len(item.cached_block_ids) * block_size for item in plan.scheduled if item.cached_block_ids}


def split_tokens(request: Request, num_tokens: int) -> tuple[int, int]:
    """``(prefill_tokens, decode_tokens)`` of a chunk of ``num_tokens`` tokens of ``request`` (as it is
    before the step): all decode for a decode (the prompt computed and exactly the newest token pending:
    not :attr:`~schedspec.spec.request.Request.is_prefill`), else all prefill (or recompute)."""
    return (num_tokens, 0) if request.is_prefill else (0, num_tokens)


def scheduled_tokens(before: SchedulerState, plan: StepPlan) -> list[ScheduledTokens]:
    """The plan's batch as a record's ``scheduled``, each item's tokens split by :func:`split_tokens` (a
    decode's drafts are decode tokens), with the drafts it verifies. Every scheduled id must be live in
    ``before``, or (a step in flight) one of ``before.in_flight.ended``: a wasted item, split as the request
    was when it ended."""
    ended = before.in_flight.ended if before.in_flight is not None else {}
    return [ScheduledTokens(item.request_id, item.num_computed_tokens,
                            *split_tokens(before.requests.get(item.request_id) or ended[item.request_id],
                                          item.num_tokens), item.spec_token_ids)
            for item in plan.scheduled]


def expected_record(outcome: StepOutcome, config: SchedulerConfig, start_time: float, duration: float) -> StepRecord:
    """The :class:`~schedspec.spec.trace.StepRecord` of an applied step: what the spec says happened in
    it, every field derived from the state before, the plan, the spec's result, the client's events
    before the step and the step's times (``start_time``, ``duration``: seconds).

    ``num_accepted_tokens`` holds, with speculative decoding, the accepted drafts of every request that
    verified drafts and sampled (0 included); ``draft_token_ids`` the drafts proposed after the step.

    ``blocks_freed`` holds, per request, the blocks an abort before the step freed, those a preempted
    request held, and those a finished request held after the step (its table before, its hit blocks and
    its new blocks); ``blocks_evicted`` the handed-out blocks that were cached before the step. With a step
    in flight, a wasted item (its request ended after the plan was made) is in ``scheduled``, its new blocks
    in ``blocks_allocated`` and again in ``blocks_freed``: handed out at planning, freed with the request.
    KV connector: a load's blocks are in ``blocks_allocated``; a ``kv_send`` request that finishes frees
    nothing then, and an abort while a load is in flight frees nothing; the blocks a transfer held are in
    ``blocks_freed`` of the step whose report lands it (and those of a load that failed from its first
    block).

    Raises:
        PlanError: the outcome's plan was not applied (:attr:`StepOutcome.error`).
    """
    before, plan, after = outcome.before, outcome.plan, outcome.after
    landed = outcome.landed_plan
    allocated = {item.request_id: item.new_block_ids for item in plan.scheduled if item.new_block_ids}
    allocated.update({load.request_id: load.new_block_ids for load in plan.loads if load.new_block_ids})
    hits = {item.request_id: item.cached_block_ids for item in plan.scheduled if item.cached_block_ids}
    freed = {a.request_id: a.freed for a in outcome.aborted if a.freed}
    for request_id in landed.preempted:
        if held_block_ids(before.requests[request_id]):
            freed[request_id] = held_block_ids(before.requests[request_id])
    if landed is not plan:  # a wasted item's new blocks go back with its request, which had ended
        for item in plan.scheduled:
            if item.request_id not in before.requests and item.new_block_ids:
                freed[item.request_id] = freed.get(item.request_id, ()) + item.new_block_ids
    finished_reasons = {}
    for request_id in outcome.finished:
        finished_reasons[request_id] = after.finished[request_id].finish_reason or ""
        blocks = before.requests[request_id].block_ids + hits.get(request_id, ()) + allocated.get(request_id, ())
        if config.kv_cache_groups:  # and every other group's table after the step (a window's frees are not here)
            item = next(item for item in plan.scheduled if item.request_id == request_id)
            blocks += tuple(b for table in group_tables_after(before.requests[request_id], item, config)
                            for b in table if b != NULL_BLOCK)
        if blocks and not before.requests[request_id].kv_send:  # a sending request's blocks wait for the send
            freed[request_id] = blocks
    for item in plan.scheduled:  # SGLang's de-duplication: the own copies are freed, the cached blocks held instead
        if item.deduplicated_block_ids:
            replaced = dict(item.deduplicated_block_ids)
            own = tuple(replaced)
            table = tuple(replaced.get(b, b) for b in freed.get(item.request_id, ()))
            freed[item.request_id] = own + table if item.request_id in outcome.finished else own
    transfers = outcome.transfers
    for request_id in transfers.finished_recving + transfers.finished_sending:
        delayed = before.delayed_frees.get(request_id)
        held = None if delayed is None else delayed.block_ids
        if held is None and request_id in before.requests:
            landed_request = after.requests.get(request_id)
            held = (before.requests[request_id].block_ids + allocated.get(request_id, ())
                    if landed_request is not None and not landed_request.block_ids else None)
        if held is None and request_id in after.finished:  # a send of a request that finished in this step
            request = before.requests.get(request_id)
            held = None if request is None else request.block_ids + allocated.get(request_id, ())
        if held:
            freed[request_id] = freed.get(request_id, ()) + held
    accepted: dict[str, int] = {}
    if outcome.speculative is not NO_SPECULATION or any(item.spec_token_ids for item in plan.scheduled):
        sampled = outcome.sampled
        given = outcome.speculative.num_accepted_tokens
        accepted = {item.request_id: given.get(item.request_id, 0) for item in plan.scheduled
                    if item.spec_token_ids and item.request_id in sampled}
    evicted: list[int] = []
    if before.prefix_cache is not None:
        evicted = evicted_blocks(before.prefix_cache, (b for item in plan.scheduled
                                                       for b in item.new_block_ids + tuple(
                                                           b for new in item.group_new_block_ids for b in new)))
    return StepRecord(
        step=before.step,
        start_time=start_time,
        duration=duration,
        arrivals=outcome.arrivals,
        aborts=outcome.aborts,
        scheduled=scheduled_tokens(before, plan),
        blocks_allocated=allocated,
        blocks_freed=freed,
        prefix_hit_tokens=prefix_hit_tokens(plan, config.block_size),
        prefix_hit_blocks=hits,
        blocks_evicted=evicted,
        preempted=plan.preempted,
        finished=finished_reasons,
        aborted=outcome.aborted_ids,
        rejected=dict(plan.rejected),
        sampled_token_ids=outcome.sampled,
        num_free_blocks=len(after.free_block_ids),
        num_running=len(after.running),
        num_waiting=len(after.waiting),
        num_accepted_tokens=accepted,
        draft_token_ids=dict(outcome.speculative.draft_token_ids),
        wasted_tokens={item.request_id: item.num_tokens for item in outcome.result.wasted} if outcome.result else {},
        group_blocks_allocated={item.request_id: item.group_new_block_ids for item in plan.scheduled
                                if any(item.group_new_block_ids)},
        blocks_skipped={item.request_id: item.skipped_block_ids for item in plan.scheduled if item.skipped_block_ids},
        group_prefix_hit_blocks={item.request_id: item.group_cached_block_ids for item in plan.scheduled
                                 if any(item.group_cached_block_ids)},
        kv_loads={load.request_id: load.num_tokens for load in plan.loads},
        blocks_deduplicated={item.request_id: item.deduplicated_block_ids for item in plan.scheduled
                             if item.deduplicated_block_ids},
        finished_recving=transfers.finished_recving,
        invalid_block_ids=transfers.invalid_block_ids,
        finished_sending=transfers.finished_sending,
    )


class Stepper:
    """The spec state of a run, advanced one checked step at a time (module docstring).

    Args:
        config: the limits.
        checker: the :class:`StepChecker` of rules and invariants, or ``None`` for an unchecked run
            (nothing is checked; transitions and records as with one).
        monitors: the trace-property monitors :meth:`observe` feeds.
        state: the state to start from (default ``SchedulerState.initial(config)``).

    Attributes:
        state: the spec state now: after the last step and the client's actions since.
    """

    def __init__(self, config: SchedulerConfig, checker: StepChecker | None = None,
                 monitors: Iterable[Monitor] = (), state: SchedulerState | None = None) -> None:
        self.config = config
        self.checker = checker
        self.monitors: list[Monitor] = list(monitors)
        self.state = state if state is not None else SchedulerState.initial(config)
        self._arrivals: list[RequestSpec] = []
        self._aborts: list[str] = []
        self._aborted: list[Aborted] = []
        self._checked: tuple[StepPlan, list[Violation]] | None = None

    def arrive(self, request: Request, spec: RequestSpec | None = None,
               after: SchedulerState | None = None) -> Transition:
        """A request arrives before the next step (:func:`~schedspec.spec.transitions.add_request`);
        ``spec`` is its descriptor for the step's record. With ``after``, that state (a trusted
        scheduler's own, in an unchecked run) is taken as the state after the arrival instead of the
        spec's transition.

        Raises:
            PlanError: the spec refuses the arrival (an id already added, a request that is not fresh).
        """
        before = self.state
        self.state = add_request(before, request) if after is None else after
        if spec is not None:
            self._arrivals.append(spec)
        return Transition("add_request", before, request, self.config, self.state)

    def abort(self, request_id: str, after: SchedulerState | None = None) -> Aborted:
        """The client aborts ``request_id`` before the next step
        (:func:`~schedspec.spec.transitions.abort_request`); returns whether it was live and the blocks it
        freed. ``after`` as in :meth:`arrive`."""
        before = self.state
        live = before.requests.get(request_id)
        self.state = abort_request(before, request_id) if after is None else after
        # an abort while its remote KV load is in flight frees nothing yet (delayed_frees)
        loading = live is not None and live.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        freed = held_block_ids(live) if live is not None and not loading else ()
        aborted = Aborted(request_id, live is not None, freed,
                          Transition("abort_request", before, request_id, self.config, self.state))
        self._aborts.append(request_id)
        self._aborted.append(aborted)
        return aborted

    @property
    def aborted(self) -> list[Aborted]:
        """What each abort since the last step did, in order."""
        return self._aborted

    def check_plan(self, plan: StepPlan) -> list[Violation]:
        """The rules ``plan`` breaks from the current state (empty when unchecked), checked before the
        plan runs; :meth:`step` reports the same list for this plan."""
        found: list[Violation] = []
        if self.checker is not None:
            self.checker.sync(self.state)
            found = self.checker.rules(self.state, plan)
        self._checked = (plan, found)
        return found

    def step(self, plan: StepPlan, sampled: Mapping[str, int], result: StepResult | None = None,
             speculative: SpeculativeOutput = NO_SPECULATION,
             transfers: KVTransferOutput = NO_TRANSFERS) -> StepOutcome:
        """Apply ``plan`` with the ``sampled`` tokens (request id -> token id) and speculative decoding's
        inputs (``speculative``: accepted drafts, drafts proposed) and the KV connector's report after it
        (``transfers``: loads landed, sends completed), check the invariants on the
        step, and advance the state. The rules are those :meth:`check_plan` found for this plan (checked
        now if it was not called for it). With ``result``, that step (a trusted scheduler's own, in an
        unchecked run) is taken instead of the spec's transition.

        A plan the spec cannot apply is not raised: the outcome has the :class:`PlanError` as ``error``,
        no result, and the state stays the state before the step."""
        before = self.state
        landed = landed_plan(before, plan)[0]
        checked = self._checked
        rules = checked[1] if checked is not None and checked[0] is plan else self.check_plan(plan)
        self._checked = None
        error = None
        transition = None
        if result is None:
            try:
                result = apply_plan(before, plan, sampled, self.config, speculative, transfers)
            except PlanError as raised:
                error = raised
            else:
                transition = Transition("apply_plan", before, plan, self.config, result, sampled, speculative)
        invariants: list[Violation] = []
        if result is not None:
            if self.checker is not None:
                invariants = self.checker.invariants(before, landed, result.state)
            self.state = result.state
        outcome = StepOutcome(before, plan, sampled, result, error, rules, invariants,
                              self._arrivals, self._aborts, self._aborted, transition, speculative,
                              None if landed is plan else landed, transfers)
        self._arrivals, self._aborts, self._aborted = [], [], []
        return outcome

    def observe(self, outcome: StepOutcome) -> None:
        """Feed the applied step to every monitor."""
        before, plan, after = outcome.before, outcome.landed_plan, outcome.after
        for monitor in self.monitors:
            monitor.observe(before, plan, after)

    def record(self, outcome: StepOutcome, start_time: float, duration: float) -> StepRecord:
        """The step's :func:`expected_record`."""
        return expected_record(outcome, self.config, start_time, duration)

    def forget_ended(self) -> None:
        """Forget the requests that have ended so far: the state keeps their ids and their count, not the
        requests (:meth:`~schedspec.spec.persistent.TerminalRequests.forgetting`), and the checker and the
        monitors drop what they keep of them, so that a check of millions of steps runs in memory bounded
        by the live requests (plus about one bit per numbered id: :class:`~schedspec.spec.persistent.EndedIds`).

        Only between steps of a checked run whose steps so far were legal: every invariant looked at each
        ended request in the step it ended (and found nothing), and no transition of the spec changes a
        terminal request, so no later check would find anything in it; ``no-request-lost`` and a reused
        id still see every one (``len`` and ``in``). The engine loop and the lab, which read the ended
        requests' times for their metrics, never call it."""
        finished = self.state.finished
        if finished.num_held:
            self.state = attrs.evolve(self.state, finished=finished.forgetting())
        if self.checker is not None:
            self.checker.forget_ended()
        for monitor in self.monitors:
            monitor.forget_ended(self.state)

    def finish(self) -> dict[str, list[Violation]]:
        """Every monitor's violations at the end of the run (``Monitor.finish`` on the current state), by
        property name."""
        return {monitor.name: monitor.finish(self.state) for monitor in self.monitors}


__all__ = [
    "Aborted", "FullChecker", "StepChecker", "StepOutcome", "Stepper", "Transition", "expected_record",
    "prefix_hit_tokens", "scheduled_tokens", "split_tokens", "step_checker",
]
