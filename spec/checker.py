"""Judge any engine's step trace against the spec.

:func:`check_trace` rebuilds the spec state from the trace's own records: before each step it adds the
recorded arrivals and applies the recorded aborts; it turns the step's scheduled tokens, allocated
blocks, preemptions and rejections into a :class:`~schedspec.spec.state.StepPlan`, checks that the
plan is allowed (:func:`~schedspec.spec.rules.violated_rules`), applies it with the recorded sampled
tokens, checks every invariant, and compares what the record says happened (finished requests and
reasons, freed blocks, free/running/waiting counts) with what the spec says must have happened.
Mismatches are reported as ``trace-mismatch`` violations.
"""

from __future__ import annotations

from collections.abc import Iterable

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import check_step
from schedspec.spec.properties import monitors
from schedspec.spec.rules import Violation, violated_rules
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan, samples_this_step
from schedspec.spec.trace import StepRecord
from schedspec.spec.transitions import PlanError, abort_request, add_request, apply_plan
from schedspec.spec.workload import EOS_TOKEN_ID


def plan_from_record(record: StepRecord) -> StepPlan:
    """The :class:`StepPlan` a step record describes."""
    return StepPlan(
        scheduled=tuple(
            ScheduledRequest(s.request_id, s.num_computed_tokens, s.num_tokens, record.blocks_allocated.get(s.request_id, ()))
            for s in record.scheduled
        ),
        preempted=record.preempted,
        rejected=tuple(record.rejected.items()),
    )


def _sampled(state: SchedulerState, plan: StepPlan, record: StepRecord) -> dict[str, int]:
    """The recorded sampled tokens; where a record omits them, EOS for requests it says stopped and a
    non-EOS id for the others."""
    sampled = dict(record.sampled_token_ids)
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is not None and item.request_id not in sampled and samples_this_step(request, item):
            sampled[item.request_id] = EOS_TOKEN_ID if record.finished.get(item.request_id) == "stop" else EOS_TOKEN_ID + 1
    return sampled


def check_trace(
    config: SchedulerConfig, records: Iterable[StepRecord], properties: Iterable[str] = ()
) -> tuple[list[Violation], int]:
    """Check a trace; returns ``(violations, steps_checked)``.

    Args:
        config: the trace header's config.
        records: the step records in order.
        properties: trace properties to check as well (names from ``spec.properties.PROPERTIES``).

    Raises:
        KeyError: an unknown property name.
    """
    state = SchedulerState.initial(config)
    watched = monitors(tuple(properties), config)
    violations: list[Violation] = []
    steps = 0

    def mismatch(step: int, detail: str, request_id: str | None = None) -> None:
        violations.append(Violation("trace-mismatch", detail, step, request_id, kind="mismatch"))

    for record in records:
        if record.step != state.step:
            mismatch(record.step, f"expected step {state.step}, record says {record.step}")
            break
        try:
            for spec in record.arrivals:
                state = add_request(state, spec.to_request(record.step))
            for request_id in record.aborts:
                state = abort_request(state, request_id)
        except PlanError as error:
            mismatch(record.step, str(error))
            break
        before = state
        plan = plan_from_record(record)
        found = violated_rules(before, plan, config)
        violations.extend(found)
        try:
            result = apply_plan(before, plan, _sampled(before, plan, record), config)
        except PlanError as error:
            mismatch(record.step, f"cannot apply the recorded step: {error}")
            break
        after = result.state
        steps += 1
        violations.extend(check_step(before, plan, after, config))
        for monitor in watched:
            monitor.observe(before, plan, after)
        expected_finished = {r: after.finished[r].finish_reason for r in result.finished}
        if expected_finished != dict(record.finished):
            mismatch(record.step, f"spec finishes {expected_finished}, trace says {dict(record.finished)}")
        for name, spec_value, trace_value in (
            ("free blocks", len(after.free_block_ids), record.num_free_blocks),
            ("running", len(after.running), record.num_running),
            ("waiting", len(after.waiting), record.num_waiting),
        ):
            if spec_value != trace_value:
                mismatch(record.step, f"{name} after the step: spec {spec_value}, trace {trace_value}")
        state = after
    for monitor in watched:
        violations.extend(monitor.finish(state))
    return violations, steps
