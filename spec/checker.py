"""Judge any engine's step trace against the spec.

:func:`check_trace` replays the trace on the spec, as a linearizability checker replays a history on
its model. Before each step it adds the recorded arrivals and applies the recorded aborts; it turns
the step's scheduled tokens, allocated blocks, preemptions and rejections into a
:class:`~schedspec.spec.state.StepPlan` and checks that the plan is allowed
(:func:`~schedspec.spec.rules.violated_rules`); it applies the plan with the recorded sampled tokens
(:func:`~schedspec.spec.transitions.apply_plan`) and checks every invariant; and it compares **every
field** of the record with what the spec says happened:

==========================  ==========================================================================
record field                compared with
==========================  ==========================================================================
``step``                    the spec's step counter (steps are numbered from 0, none skipped)
``start_time``/``duration`` a step lasts ``>= 0`` s and starts no earlier than the last one ended
``arrivals``                a fresh id (never added before); its ``arrival_step`` (if given) is this
                            step, its ``arrival_time`` no later than the step's start; the workload's
                            own events happen: ``abort_at_step`` (aborted in that step if still live;
                            ``abort_at_time`` is not judged: a client's abort reaches an engine after
                            some delay), ``eos_at_output`` (output k sampled as its ``eos_token_id``)
``aborts``/``aborted``      ``aborted`` is exactly the ids of ``aborts`` that were live
``scheduled``               the plan (rules); ``prefill_tokens``/``decode_tokens`` split as the spec
                            defines a decode (:attr:`~schedspec.spec.request.Request.is_prefill`)
``blocks_allocated``        the plan's new blocks (rules); only requests in ``scheduled`` or ``kv_loads`` get
                            blocks
``blocks_freed``            exactly the blocks each preempted, finished or aborted request held, and those a
                            transfer held until it landed or completed (KV connector)
``kv_loads``                the remote KV loads the plan starts (rules ``load-*``); their blocks in
                            ``blocks_allocated``
``finished_recving`` ...    KV connector, inputs (``finished_recving``, ``invalid_block_ids``,
                            ``finished_sending``): the spec applies them after the samples
                            (:func:`~schedspec.spec.transitions.land_transfers`); a report of a transfer
                            not in flight is one the spec cannot apply
``prefix_hit_tokens``       0 with prefix caching off; with it, the hit of each admitted request:
                            ``len(prefix_hit_blocks[id]) * block_size``
``prefix_hit_blocks``       the plan's ``cached_block_ids`` (rules ``prefix-hit-*``); only for requests in
                            ``scheduled``
``blocks_evicted``          exactly the handed-out blocks that were cached before the step
``group_blocks_allocated``  version 4, KV cache groups: the plan's new blocks of groups 1.. (rules
                            ``group-*``, ``blocks-from-free-pool``); only requests in ``scheduled``
``blocks_skipped``          version 4: the plan's blocks freed by a sliding window (rules ``window-*``);
                            only requests in ``scheduled``, only with KV cache groups configured
``preempted``/``rejected``  the plan (rules; a rejection's reason by its code)
``sampled_token_ids``       exactly the requests whose chunk reached the end of their sequence
``scheduled[].spec_token_ids`` the plan's drafts (rules ``drafts-*``); version 3, speculative decoding
``num_accepted_tokens``     its keys: exactly the samplers that verified drafts; each count is the spec's
                            input, bounded by the drafts verified (the spec applies it: accepted prefix,
                            sampled token, a stop inside)
``draft_token_ids``         an input: at most num_speculative_tokens each; proposals for requests that
                            did not sample are ignored, as vLLM's ``update_draft_token_ids`` ignores them,
                            and a wrong proposal is caught when it is scheduled (``drafts-are-proposed``)
``finished``                the requests the spec ends after sampling, with the spec's reasons
``num_free_blocks`` ...     the spec's free blocks, running and waiting counts after the step
``wasted_tokens``           asynchronous scheduling (header ``async_scheduling``): exactly the tokens of
                            the items for requests that ended after the step was planned (rules
                            ``in-flight-*``, ``wasted-item-continues``; ``StepResult.num_wasted_tokens``)
==========================  ==========================================================================

By default the check stops at the **first illegal step**: the step whose plan breaks a rule, whose
update breaks an invariant, or whose record differs from the spec. The report gives that step, the
state before it, the plan, every violation found in it, and the longest valid prefix (the steps before
it). ``keep_going`` continues past illegal steps, applying the recorded plan where the spec can
(later violations may then be consequences of the first).

**Every request ends.** A trace is the whole life of its requests: at its end every request that
arrived has ended (finished, aborted or rejected with a reason), or the check reports each one still
live as an ``unfinished-request`` mismatch, with where it is (running, holding blocks, or waiting) and
the last step that scheduled it. An engine that starves a running request, or that crashed mid-run,
so cannot pass by its log ending early. A window cut from a running engine's log is judged with
``allow_unfinished`` (``schedspec check --allow-unfinished``).

Trace properties (:mod:`schedspec.spec.properties`) are checked on the valid prefix.
:data:`DEFAULT_PROPERTIES` are owed by every correct scheduler and checked unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.properties import monitors
from schedspec.spec.request import Request
from schedspec.spec.rules import Violation
from schedspec.spec.state import (
    NO_SPECULATION,
    NO_TRANSFERS,
    KVLoad,
    KVTransferOutput,
    ScheduledRequest,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
    samples_this_step,
)
from schedspec.spec.stepper import Stepper, split_tokens, step_checker
from schedspec.spec.trace import StepRecord
from schedspec.spec.transitions import PlanError
from schedspec.spec.workload import RequestSpec

DEFAULT_PROPERTIES: tuple[str, ...] = ("progress", "rejects-impossible")
"""Properties :func:`check_trace` checks unless told otherwise, because every correct scheduler owes
them whatever its policy: ``progress`` (an engine that stops computing while requests are live has
hung; no policy excuses it) and ``rejects-impossible`` (a request that can never complete is ended
with a reason at arrival, not left to block the queue or be lost). The others (work-conserving,
stall-free-decode, bounded-wait, bounded-itl, bounded-preemptions) are choices some correct policies
do not make (static batching, shortest-prompt-first, no chunking); ask for them by name."""

TIME_TOLERANCE = 1e-9
"""Relative tolerance when comparing a step's start with the previous step's end (float sums)."""

MISMATCH = "trace-mismatch"
UNFINISHED = "unfinished-request"
"""The name of the violation for a request still live at the end of a trace (module docstring)."""


def plan_from_record(record: StepRecord) -> StepPlan:
    """The :class:`StepPlan` a step record describes (allocations to requests outside ``scheduled``
    are not part of it: :func:`check_trace` reports them)."""
    return StepPlan(
        scheduled=tuple(
            ScheduledRequest(s.request_id, s.num_computed_tokens, s.num_tokens, record.blocks_allocated.get(s.request_id, ()),
                             record.prefix_hit_blocks.get(s.request_id, ()), s.spec_token_ids,
                             record.group_blocks_allocated.get(s.request_id, ()), record.blocks_skipped.get(s.request_id, ()),
                             record.group_prefix_hit_blocks.get(s.request_id, ()),
                             record.blocks_deduplicated.get(s.request_id, ()))
            for s in record.scheduled
        ),
        preempted=record.preempted,
        rejected=tuple(record.rejected.items()),
        loads=tuple(KVLoad(r, tokens, record.blocks_allocated.get(r, ())) for r, tokens in record.kv_loads.items()),
    )


def transfers_of(record: StepRecord) -> KVTransferOutput:
    """The KV connector's report after the step, as the record gives it (``finished_recving``,
    ``invalid_block_ids``, ``finished_sending``): an input to the step, as the sampled tokens are."""
    if not (record.finished_recving or record.invalid_block_ids or record.finished_sending):
        return NO_TRANSFERS
    return KVTransferOutput(record.finished_recving, record.invalid_block_ids, record.finished_sending)


@attrs.define
class CheckReport:
    """The verdict on a trace.

    Attributes:
        violations: every violation found (with ``keep_going``, of every illegal step; else of the first).
        steps_checked: records replayed.
        first_bad_step: the first illegal step, or ``None`` if every step was legal.
        valid_prefix: how many steps from step 0 are legal (the longest valid prefix).
        state_before: the spec's state before the first illegal step (after its arrivals and aborts).
        plan: the plan the first illegal step's record describes.
        record: the first illegal step's record.
        properties: the trace properties that were checked.
    """

    violations: list[Violation] = attrs.field(factory=list)
    steps_checked: int = 0
    first_bad_step: int | None = None
    valid_prefix: int = 0
    state_before: SchedulerState | None = None
    plan: StepPlan | None = None
    record: StepRecord | None = None
    properties: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.violations


def _sorted_blocks(blocks: Iterable[int]) -> list[int]:
    return sorted(blocks)


class _StepComparison:
    """Collects the trace-mismatch violations of one step."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.found: list[Violation] = []

    def __call__(self, detail: str, request_id: str | None = None) -> None:
        self.found.append(Violation(MISMATCH, detail, self.step, request_id, kind="mismatch"))


def _compare_times(record: StepRecord, previous: StepRecord | None, mismatch: _StepComparison) -> None:
    if record.duration < 0:
        mismatch(f"duration {record.duration} s < 0: a step cannot last a negative time")
    if previous is not None:
        end = previous.start_time + max(previous.duration, 0.0)
        if record.start_time < end - TIME_TOLERANCE * max(1.0, abs(end)):
            mismatch(f"starts at {record.start_time} s, before step {previous.step} ended at {end} s "
                     "(time runs backwards or steps overlap)")


def _compare_arrival(spec: RequestSpec, record: StepRecord, mismatch: _StepComparison) -> None:
    """An arrival's own step and time agree with the step that records it."""
    if spec.arrival_step is not None and spec.arrival_step != record.step:
        mismatch(f"arrival_step {spec.arrival_step}, but the trace adds it before step {record.step}",
                 spec.request_id)
    if spec.arrival_time > record.start_time + TIME_TOLERANCE * max(1.0, abs(record.start_time)):
        mismatch(f"arrival_time {spec.arrival_time} s is after the start of step {record.step} "
                 f"({record.start_time} s), which already admits it", spec.request_id)


def _compare_driven_aborts(driven: dict[str, RequestSpec], state: SchedulerState, record: StepRecord,
                           mismatch: _StepComparison) -> None:
    """A live request whose arrival says ``abort_at_step <= this step`` is aborted in this step (the engine
    applies the workload's aborts before planning the step)."""
    for request_id, spec in list(driven.items()):
        if request_id not in state.requests and request_id not in record.aborts:
            del driven[request_id]  # ended
            continue
        due = spec.abort_at_step is not None and spec.abort_at_step <= record.step
        if due and request_id not in record.aborts and request_id in state.requests:
            mismatch(f"its arrival says abort_at_step {spec.abort_at_step}, but it is still live and not aborted "
                     f"in step {record.step}", request_id)


def _compare_driven_eos(driven: dict[str, RequestSpec], before: SchedulerState, record: StepRecord,
                        mismatch: _StepComparison) -> None:
    """A request whose arrival says ``eos_at_output = k`` samples its ``eos_token_id`` as output ``k`` (with
    speculative decoding, output ``k`` may be an accepted draft: the outputs a step appends are the first
    ``num_accepted_tokens`` drafts the request verified, then the sampled token)."""
    drafts = {s.request_id: s.spec_token_ids for s in record.scheduled if s.spec_token_ids}
    for request_id, token in record.sampled_token_ids.items():
        spec = driven.get(request_id)
        request = before.requests.get(request_id)
        if spec is None or request is None or not spec.eos_at_output or spec.eos_token_id is None:
            continue
        appended = (*drafts.get(request_id, ())[:record.num_accepted_tokens.get(request_id, 0)], token)
        index = spec.eos_at_output - request.num_output_tokens - 1
        if not 0 <= index < len(appended):
            continue
        token = appended[index]
        if token != spec.eos_token_id:
            mismatch(f"its arrival says eos_at_output {spec.eos_at_output}, but output {spec.eos_at_output} was "
                     f"sampled as {token}, not its eos_token_id {spec.eos_token_id}", request_id)


def _compare_split(before: SchedulerState, record: StepRecord, mismatch: _StepComparison) -> None:
    ended = before.in_flight.ended if before.in_flight is not None else {}
    for item in record.scheduled:
        request = before.requests.get(item.request_id) or ended.get(item.request_id)  # or a wasted item's
        if request is None or (item.num_computed_tokens != request.num_computed_tokens
                               and item.request_id not in record.prefix_hit_blocks):
            continue  # a rule reports it (known-requests, chunk-continues)
        prefill, decode = split_tokens(request, item.num_tokens)
        if (item.prefill_tokens, item.decode_tokens) != (prefill, decode):
            kind = "a prefill (or recompute) chunk" if request.is_prefill else "a decode"
            mismatch(f"prefill_tokens={item.prefill_tokens}, decode_tokens={item.decode_tokens}, but the step is "
                     f"{kind} of {item.num_tokens} tokens: the spec says prefill_tokens={prefill}, "
                     f"decode_tokens={decode}", item.request_id)


def _expected_samplers(before: SchedulerState, plan: StepPlan) -> list[str]:
    samplers = []
    for item in plan.scheduled:
        request = before.requests.get(item.request_id)
        if request is not None and samples_this_step(request, item):
            samplers.append(item.request_id)
    return samplers


def _compare_sampled(samplers: list[str], record: StepRecord, mismatch: _StepComparison) -> None:
    expected = set(samplers)
    for request_id in record.sampled_token_ids:
        if request_id not in expected:
            mismatch("a token was sampled for a request that does not sample this step (not scheduled, not live, "
                     "or its chunk does not reach the end of its sequence)", request_id)
    for request_id in samplers:
        if request_id not in record.sampled_token_ids:
            mismatch("no sampled token, but its chunk reaches the end of its sequence, so it samples one",
                     request_id)


def speculative_of(record: StepRecord) -> SpeculativeOutput:
    """Speculative decoding's inputs a record gives (:data:`~schedspec.spec.state.NO_SPECULATION` when it
    has none: a version-2 record, or a step without drafts)."""
    if not (record.num_accepted_tokens or record.draft_token_ids):
        return NO_SPECULATION
    return SpeculativeOutput(record.num_accepted_tokens, record.draft_token_ids)


def _compare_accepted(plan: StepPlan, samplers: list[str], record: StepRecord, mismatch: _StepComparison) -> None:
    """``num_accepted_tokens`` names exactly the samplers that verified drafts (the spec bounds each count
    when it applies the step)."""
    verifying = {item.request_id for item in plan.scheduled if item.spec_token_ids} & set(samplers)
    for request_id in record.num_accepted_tokens:
        if request_id not in verifying:
            mismatch("num_accepted_tokens for a request that verified no drafts or does not sample this step",
                     request_id)
    for request_id in verifying:
        if request_id not in record.num_accepted_tokens:
            mismatch("no num_accepted_tokens, but it verified drafts and samples this step", request_id)


def _compare_record(record: StepRecord, expected: StepRecord, config: SchedulerConfig,
                    mismatch: _StepComparison) -> None:
    """The fields of the recorded step that the spec derives after the step (``finished``,
    ``blocks_freed``, ``blocks_allocated``, ``prefix_hit_tokens``, ``prefix_hit_blocks``,
    ``blocks_evicted``, the counters) compared with the spec's :func:`~schedspec.spec.stepper.expected_record`
    of the same step, field by field."""
    for request_id, reason in record.finished.items():
        if request_id not in expected.finished:
            mismatch(f"finished ({reason!r}) but the spec does not end it in this step", request_id)
        elif expected.finished[request_id] != reason:
            mismatch(f"finished with reason {reason!r}, the spec's reason is {expected.finished[request_id]!r}",
                     request_id)
    for request_id, reason in expected.finished.items():
        if request_id not in record.finished:
            mismatch(f"not reported finished, but the spec ends it in this step ({reason!r})", request_id)

    for request_id in sorted(set(record.blocks_freed) | set(expected.blocks_freed)):
        said = _sorted_blocks(record.blocks_freed.get(request_id, ()))
        spec = _sorted_blocks(expected.blocks_freed.get(request_id, ()))
        if said != spec:
            mismatch(f"blocks_freed {said}, but it released {spec}", request_id)

    scheduled = {item.request_id for item in expected.scheduled}
    for request_id, blocks in record.blocks_allocated.items():
        if request_id not in scheduled and request_id not in record.kv_loads and blocks:
            mismatch(f"blocks_allocated {list(blocks)} to a request that is not in the step's batch nor loads",
                     request_id)

    for name in ("group_blocks_allocated", "blocks_skipped", "group_prefix_hit_blocks"):  # KV cache groups (v4)
        for request_id, blocks in getattr(record, name).items():
            if request_id not in scheduled and any(blocks):
                mismatch(f"{name} {[list(b) if isinstance(b, tuple) else b for b in blocks]} for a request that is "
                         "not in the step's batch", request_id)
            elif any(blocks) and not config.kv_cache_groups:
                mismatch(f"{name} with no kv_cache_groups configured", request_id)

    for request_id, pairs in record.blocks_deduplicated.items():
        if request_id not in scheduled and pairs:
            mismatch(f"blocks_deduplicated {[list(p) for p in pairs]} for a request that is not in the step's batch",
                     request_id)

    for request_id, hit in record.prefix_hit_tokens.items():
        if hit and not config.enable_prefix_caching:
            mismatch(f"prefix_hit_tokens={hit} with prefix caching off", request_id)
    for request_id, blocks in record.prefix_hit_blocks.items():
        if request_id not in scheduled and blocks:
            mismatch(f"prefix_hit_blocks {list(blocks)} for a request that is not in the step's batch", request_id)
    if config.enable_prefix_caching:
        for request_id in scheduled | set(record.prefix_hit_tokens):
            said = record.prefix_hit_tokens.get(request_id, 0)
            spec = expected.prefix_hit_tokens.get(request_id, 0)
            if said == spec:
                continue
            if request_id in scheduled:
                mismatch(f"prefix_hit_tokens={said}, but its hit blocks {list(expected.prefix_hit_blocks.get(request_id, ()))} "
                         f"hold {spec} tokens", request_id)
            else:
                mismatch(f"prefix_hit_tokens={said} for a request that is not in the step's batch", request_id)
    if (sorted(record.blocks_evicted) != sorted(expected.blocks_evicted)
            or len(set(record.blocks_evicted)) != len(record.blocks_evicted)):
        mismatch(f"blocks_evicted {sorted(record.blocks_evicted)}, but the cached blocks handed out were "
                 f"{sorted(expected.blocks_evicted)}")

    if record.wasted_tokens != expected.wasted_tokens:
        mismatch(f"wasted_tokens {dict(sorted(record.wasted_tokens.items()))}, but the tokens computed for requests "
                 f"that had ended were {dict(sorted(expected.wasted_tokens.items()))}")

    for name in ("num_free_blocks", "num_running", "num_waiting"):
        spec_value, trace_value = getattr(expected, name), getattr(record, name)
        if spec_value != trace_value:
            mismatch(f"{name} after the step: the trace says {trace_value}, the spec {spec_value}")


def _sampled_for_update(samplers: list[str], record: StepRecord, before: SchedulerState) -> dict[str, int]:
    """The tokens to apply: the recorded ones; for a sampler the record omits (already reported), a token
    that stops it exactly when the record says it stopped, so that ``keep_going`` follows the engine."""
    sampled = {r: t for r, t in record.sampled_token_ids.items() if r in samplers}
    for request_id in samplers:
        if request_id in sampled:
            continue
        request: Request = before.requests[request_id]
        stop = record.finished.get(request_id) == "stop"
        candidates = [request.eos_token_id, *request.stop_token_ids] if stop else []
        token = next((t for t in candidates if t is not None), None)
        if token is None:
            avoid = {request.eos_token_id, *request.stop_token_ids}
            token = next(t for t in range(len(avoid) + 1) if t not in avoid)
        sampled[request_id] = token
    return sampled


def check_trace(
    config: SchedulerConfig,
    records: Iterable[StepRecord],
    properties: Iterable[str] = DEFAULT_PROPERTIES,
    keep_going: bool = False,
    incremental: bool = False,
    allow_unfinished: bool = False,
    async_scheduling: bool = False,
) -> CheckReport:
    """Replay a trace on the spec and judge every field of every record (module docstring).

    Args:
        config: the trace header's config.
        records: the step records in order (already validated against the schema, e.g. by
            :func:`schedspec.spec.trace.open_trace`).
        properties: trace properties to check (names from ``spec.properties.PROPERTIES``); default
            :data:`DEFAULT_PROPERTIES`.
        keep_going: continue past illegal steps instead of stopping at the first.
        incremental: check invariants with :class:`~schedspec.spec.incremental.IncrementalChecker`
            (the same violations, at a cost that does not grow with the run) instead of
            :func:`~schedspec.spec.invariants.check_step`.
        allow_unfinished: do not report requests still live at the end of the trace (a window cut from
            a running engine's log); by default each is an ``unfinished-request`` mismatch.
        async_scheduling: the trace's header says ``async_scheduling`` (:attr:`~schedspec.spec.trace.TraceFile.async_scheduling`):
            replay it from the spec's state with a step in flight (``SchedulerState.initial(config,
            asynchronous=True)``), so that each plan is judged as one made before the previous step's
            samples were known, and its ``wasted_tokens`` against the spec's.

    Returns:
        A :class:`CheckReport`.

    Raises:
        KeyError: an unknown property name.
    """
    names = tuple(dict.fromkeys(properties))
    stepper = Stepper(config, step_checker(config, incremental), monitors(names, config),
                      SchedulerState.initial(config, asynchronous=async_scheduling))
    report = CheckReport(properties=names)
    previous: StepRecord | None = None
    last_scheduled: dict[str, int] = {}
    driven: dict[str, RequestSpec] = {}  # live requests whose arrival names an abort or an EOS position

    for record in records:
        state = stepper.state
        mismatch = _StepComparison(state.step)
        if record.step != state.step:
            mismatch(f"expected step {state.step} (steps are numbered from 0, none skipped), the record says "
                     f"{record.step}")
            _fail(report, mismatch.found, state, None, record, state.step)
            break
        _compare_times(record, previous, mismatch)
        previous = record

        stuck = False
        for spec in record.arrivals:
            _compare_arrival(spec, record, mismatch)
            try:
                stepper.arrive(spec.to_request(record.step), spec)
            except PlanError as error:
                mismatch(f"arrival: {error}", spec.request_id)
                stuck = True
            else:
                if spec.abort_at_step is not None or spec.eos_at_output:
                    driven[spec.request_id] = spec
        _compare_driven_aborts(driven, stepper.state, record, mismatch)
        for request_id in record.aborts:
            stepper.abort(request_id)
        expected_aborted = [a.request_id for a in stepper.aborted if a.live]
        if sorted(set(record.aborted)) != sorted(expected_aborted) or len(record.aborted) != len(set(record.aborted)):
            mismatch(f"aborted {sorted(record.aborted)}, but of aborts {list(record.aborts)} the live ones were "
                     f"{sorted(expected_aborted)}")

        before = stepper.state
        plan = plan_from_record(record)
        _compare_split(before, record, mismatch)
        samplers = _expected_samplers(before, plan)
        _compare_sampled(samplers, record, mismatch)
        _compare_driven_eos(driven, before, record, mismatch)
        speculative = speculative_of(record)
        if speculative is not NO_SPECULATION or config.speculative:
            _compare_accepted(plan, samplers, record, mismatch)
        outcome = stepper.step(plan, _sampled_for_update(samplers, record, before), speculative=speculative,
                               transfers=transfers_of(record))
        found = outcome.rule_violations + outcome.invariant_violations
        if outcome.error is not None:
            if not found:
                mismatch(f"the spec cannot apply the recorded step: {outcome.error}")
            stuck = True
        else:
            _compare_record(record, stepper.record(outcome, record.start_time, record.duration), config, mismatch)
        report.steps_checked += 1
        found += mismatch.found
        if found:
            _fail(report, found, before, plan, record, before.step)
            if not keep_going or outcome.error is not None or stuck:
                break
        elif report.first_bad_step is None:
            report.valid_prefix += 1
            for item in plan.scheduled:
                last_scheduled[item.request_id] = before.step
            stepper.observe(outcome)
            # Bounded memory: forget the requests ended so far (checked in the step they ended; their ids
            # stay for no-request-lost and reused ids), while every step so far is legal, so that the
            # states the report keeps are exact (Stepper.forget_ended).
            stepper.forget_ended()
            if len(last_scheduled) > 2 * len(stepper.state.requests) + 64:
                last_scheduled = {r: s for r, s in last_scheduled.items() if r in stepper.state.requests}

    if report.first_bad_step is None or keep_going:
        for violations in stepper.finish().values():
            report.violations.extend(violations)
    if report.first_bad_step is None and not allow_unfinished:
        report.violations.extend(_unfinished(stepper.state, last_scheduled))
    return report


def _unfinished(state: SchedulerState, last_scheduled: dict[str, int]) -> list[Violation]:
    """One ``unfinished-request`` mismatch per request live in ``state`` (the end of a legal trace), and one per
    ended request whose remote KV transfer still holds blocks (``delayed_frees``)."""
    found = []
    for queue, ids in (("running", state.running), ("waiting", state.waiting)):
        for request_id in ids:
            request = state.requests[request_id]
            last = last_scheduled.get(request_id)
            when = f"last scheduled at step {last}" if last is not None else "never scheduled"
            found.append(Violation(
                UNFINISHED,
                f"still {queue} when the trace ends after step {state.step - 1} ({when}; computed "
                f"{request.num_computed_tokens} of {request.num_tokens} tokens, {len(request.block_ids)} blocks "
                f"held): every request must end finished, aborted or rejected; a log window cut from a running "
                f"engine is checked with --allow-unfinished",
                state.step - 1, request_id, kind="mismatch"))
    for request_id, held in state.delayed_frees.items():  # KV connector: a transfer never reported done
        found.append(Violation(
            UNFINISHED,
            f"ended, but its remote KV {'send' if held.transfer == 'sending' else 'load'} still holds "
            f"{len(held.block_ids)} blocks when the trace ends after step {state.step - 1} (never reported in "
            f"finished_{held.transfer}): every transfer must complete; a log window cut from a running engine is "
            f"checked with --allow-unfinished",
            state.step - 1, request_id, kind="mismatch"))
    return found


def _fail(report: CheckReport, found: list[Violation], before: SchedulerState, plan: StepPlan | None,
          record: StepRecord, step: int) -> None:
    report.violations.extend(found)
    if report.first_bad_step is None:
        report.first_bad_step = step
        report.state_before = before
        report.plan = plan
        report.record = record

