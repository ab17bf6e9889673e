"""The engine loop: drive any :class:`~schedspec.reference.scheduler.Scheduler` with arrivals and a
token source, and check it against the spec at every step.

Per step: arrivals and aborts due before the step are applied; the scheduler plans; with checking on,
the plan must be allowed by the spec from the current state (the **refinement check**,
:func:`schedspec.spec.rules.violated_rules`); the token source runs the batch; the scheduler updates;
the spec's **shadow** state is advanced by the spec's own transition
(:func:`~schedspec.spec.transitions.apply_plan`), never taken from the scheduler, and compared field by
field with the scheduler's own state (its ``state``, or an engine adapter's ``engine_view()``):
a difference is a ``state-mismatch``, a different set of finished requests a ``refinement`` mismatch;
every invariant (:mod:`schedspec.spec.invariants`) is checked on the step; the trace-property monitors
(:mod:`schedspec.spec.properties`) watch it. A :class:`StepRecord` is produced for every step.
With checking off, a scheduler's own spec state is trusted (the lab's fast path).

Two clocks: ``mode="steps"`` adds a request before step ``arrival_step`` and runs empty steps while
waiting for arrivals (scenarios); ``mode="time"`` adds requests whose ``arrival_time`` has passed on a
simulated clock that advances by each step's duration and jumps over idle gaps (traces). In both
modes every arrival is stamped with its ``arrival_time`` on the engine's clock, as a serving engine
stamps a request on receipt (:class:`~schedspec.spec.workload.ArrivalClock`): the start of its arrival
step on the simulated clock in steps mode, the trace's time in time mode, strictly increasing in the
order of addition. The stamped descriptor is what the scheduler receives and what the step's record
lists.

Speculative decoding (``num_speculative_tokens > 0``): the token source's ``execute_speculative`` also
returns what it accepted and the drafts proposed after the step (default: :class:`FakeModel` with its
seeded :class:`~schedspec.reference.fake_model.AcceptanceModel`), which the spec's transition and the
scheduler's ``update`` take as their third input; a scheduler or token source without it is refused
(:class:`UnsupportedFeature`, exit 3).
"""

from __future__ import annotations

import gc
import time as wallclock
import traceback
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.kv_cache_groups import unspecified_with_groups
from schedspec.spec.properties import Monitor, Progress, monitors
from schedspec.spec.rules import Violation
from schedspec.spec.state import (
    NO_SPECULATION,
    NO_TRANSFERS,
    KVTransferOutput,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
    landed_plan,
)
from schedspec.spec.stepper import Stepper, Transition, step_checker
from schedspec.spec.trace import StepRecord
from schedspec.spec.transitions import StepResult
from schedspec.spec.workload import ArrivalClock, RequestSpec

from .fake_model import CostOnlyModel, FakeModel, TokenSource
from .kv_connector import ScheduledConnector, uses_kv_connector
from .scheduler import (
    EngineFault,
    EngineView,
    Scheduler,
    UnsupportedFeature,
    state_differences,
    supports_speculative,
    view_differences,
)


def _innermost(error: BaseException) -> str:
    """``file:line in function`` of the innermost frame of ``error``'s traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "unknown location"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


class _ClientEvents:
    """The workload's client events in the order a run meets them: arrivals (by ``arrival_step`` in
    steps mode, ``arrival_time`` in time mode) and aborts (``abort_at_step``, ``abort_at_time``).
    Both engine loops take their events from here, so they cannot disagree on when one is due, nor on
    an arrival's ``arrival_time`` (stamped by :class:`ArrivalClock` in :meth:`arrivals`)."""

    def __init__(self, workload: Sequence[RequestSpec], mode: str) -> None:
        key = (lambda s: (s.arrival_step, 0.0)) if mode == "steps" else (lambda s: (0, s.arrival_time))
        self.pending = sorted(workload, key=key)
        self.by_step = mode == "steps"
        self.next_arrival = 0
        self.step_aborts: dict[int, list[str]] = {}
        for spec in workload:
            if spec.abort_at_step is not None:
                self.step_aborts.setdefault(spec.abort_at_step, []).append(spec.request_id)
        self.time_aborts = sorted((s.abort_at_time, s.request_id) for s in workload if s.abort_at_time is not None)
        self.next_time_abort = 0
        self.arrival_clock = ArrivalClock()

    @property
    def arrivals_left(self) -> bool:
        return self.next_arrival < len(self.pending)

    def idle_clock(self, clock: float) -> float:
        """The clock of an idle engine in time mode: moved on to the next arrival."""
        return max(clock, self.pending[self.next_arrival].arrival_time) if self.arrivals_left else clock

    def arrivals(self, step: int, clock: float) -> list[RequestSpec]:
        """The arrivals due before ``step`` (steps mode) or by ``clock`` seconds (time mode), in order,
        each stamped with its ``arrival_time``: ``clock``, the step's start (steps mode), or its own
        time (time mode), made strictly increasing by :meth:`ArrivalClock.stamp`."""
        start = end = self.next_arrival
        while end < len(self.pending):
            spec = self.pending[end]
            if not (spec.arrival_step <= step if self.by_step else spec.arrival_time <= clock):
                break
            end += 1
        self.next_arrival = end
        stamped = self.arrival_clock.stamped
        return [stamped(spec, clock if self.by_step else spec.arrival_time) for spec in self.pending[start:end]]

    def aborts(self, step: int, clock: float) -> list[str]:
        """The ids the client aborts before ``step`` is planned: by step, then those due by ``clock``."""
        due = list(self.step_aborts.get(step, ()))
        while self.next_time_abort < len(self.time_aborts) and self.time_aborts[self.next_time_abort][0] <= clock:
            due.append(self.time_aborts[self.next_time_abort][1])
            self.next_time_abort += 1
        return due


def engine_identity(scheduler: object) -> dict[str, str] | None:
    """The real engine behind ``scheduler`` (an adapter's ``engine`` attribute: ``name`` and the exact
    ``version``, e.g. ``{"name": "vllm", "version": "0.33.0"}``), or ``None`` (a reference scheduler)."""
    engine = getattr(scheduler, "engine", None)
    return dict(engine) if isinstance(engine, dict) else None


class ViolationFound(Exception):
    """A rule, invariant or guaranteed property was violated and the run was asked to stop."""

    def __init__(self, violations: list[Violation], state: SchedulerState,
                 records: list[StepRecord] | None = None) -> None:
        self.violations = violations
        self.state = state
        self.records = records if records is not None else []
        """The steps recorded before the violation (``record_steps``): what a differential test may still
        compare (``schedspec diff``)."""
        super().__init__("; ".join(str(v) for v in violations[:5]))


@attrs.define
class RunResult:
    """What a run produced.

    Attributes:
        records: one :class:`StepRecord` per step (empty if ``record_steps`` was off).
        state: the spec state after the last step.
        violations: every rule, invariant and property violation found.
        property_violations: the property violations by property name (guaranteed or only watched).
        num_steps: steps run.
        num_steps_checked: steps whose plan and invariants were checked.
        wall_seconds: wall-clock time of the run.
        specs: the workload's request descriptors by id.
        num_wasted_tokens: asynchronous scheduling (a scheduler whose ``async_scheduling`` is true): the
            tokens its plans computed for requests that had ended while the step before was in flight
            (:attr:`~schedspec.spec.transitions.StepResult.num_wasted_tokens`, summed over the run); 0 otherwise.
        async_scheduling: whether the run's scheduler plans while a step is in flight (its ``async_scheduling``).
        engine: the real engine behind an adapter, as the adapter's ``engine`` attribute gives it
            (``{"name": "vllm", "version": "0.33.0"}``), or ``None`` for a reference scheduler.
    """

    records: list[StepRecord]
    state: SchedulerState
    violations: list[Violation]
    property_violations: dict[str, list[Violation]]
    num_steps: int
    num_steps_checked: int
    wall_seconds: float
    specs: dict[str, RequestSpec]
    engine: dict[str, str] | None = None
    num_wasted_tokens: int = 0
    async_scheduling: bool = False

    @property
    def ok(self) -> bool:
        return not self.violations


@attrs.define(slots=True)
class StepView:
    """One step as it happened, without building a :class:`StepRecord` (the lab's statistics read
    only this; a StepRecord copies every scheduled item into new objects, a fifth of a lab run).

    Not merged with :class:`~schedspec.spec.trace.StepRecord`: a StepRecord is the trace's unit (what an
    engine's log says, judged by the checker, written as JSON), built from a view only when a trace is
    written; a view is the engine's in-memory step, holding the states around it, alive during the
    step only. The lab keeps :class:`~schedspec.lab.run.LabStep` rows from it.

    Attributes:
        step: the step index.
        start_time: simulated seconds at the step's start; ``duration``: its length in seconds.
        before, after: the spec states around the step (immutable; shared, not copied). In an unchecked
            run of a scheduler with light views (:meth:`Engine._run_light`, ``fcfs-fast``) they are its
            :class:`~schedspec.reference.fast_fcfs.LightState` views instead: ``before.requests`` has the
            scheduled requests' ``is_decode`` and ``prompt_len``, ``after`` the queues and
            ``len(after.free_block_ids)``.
        plan: the scheduler's plan (with a step in flight, the part that landed: :func:`~schedspec.spec.state.landed_plan`).
        sampled: request id -> the token sampled this step.
        finished: ids that finished this step (not aborted or rejected).
        arrivals: the requests added before the step; ``aborted``: live ids aborted before it.
        speculative: speculative decoding's inputs to the step (drafts accepted per request that verified
            drafts, drafts proposed); with them a sampler may append ``1 + accepted`` tokens in one step.
    """

    step: int
    start_time: float
    duration: float
    before: SchedulerState
    after: SchedulerState
    plan: StepPlan
    sampled: dict[str, int]
    finished: tuple[str, ...]
    arrivals: list[RequestSpec]
    aborted: list[str]
    speculative: SpeculativeOutput = NO_SPECULATION



ENDED_BY_SCHEDULER_ONLY = "refinement:ended-by-scheduler-only"
""":attr:`Violation.code` of a request the scheduler reports finished in a step where the spec runs it on."""
ENDED_BY_SPEC_ONLY = "refinement:ended-by-spec-only"
""":attr:`Violation.code` of a request the spec ends in a step where the scheduler runs it on."""
FINISH_REASON_MISMATCH = "refinement:finish-reason"
""":attr:`Violation.code` of a request both end in a step, the engine with another reason than the spec's."""


def finished_set_mismatches(reported: Iterable[str], expected: Iterable[str], step: int) -> list[Violation]:
    """The ``refinement`` mismatches of a step whose finished requests as the scheduler ``reported`` them
    differ from the spec's ``expected`` ones: one per request, with its id and a code saying which side ended
    it (:data:`ENDED_BY_SCHEDULER_ONLY`, :data:`ENDED_BY_SPEC_ONLY`), so that programs (``schedspec diff``'s
    documented findings) test the code and the id, never the wording."""
    reported, expected = set(reported), set(expected)
    both = f"scheduler says finished {sorted(reported)}, spec says {sorted(expected)}"
    return ([Violation("refinement", f"the scheduler ended it, the spec runs it on ({both})", step, request_id,
                       kind="mismatch", code=ENDED_BY_SCHEDULER_ONLY) for request_id in sorted(reported - expected)]
            + [Violation("refinement", f"the spec ends it, the scheduler runs it on ({both})", step, request_id,
                         kind="mismatch", code=ENDED_BY_SPEC_ONLY) for request_id in sorted(expected - reported)])


class Engine:
    """Drives a scheduler (module docstring).

    Args:
        scheduler: any :class:`Scheduler`.
        config: the limits the scheduler was built with.
        token_source: runs each step; default :class:`FakeModel` (with ``eos_at_output`` from the
            workload).
        check: check every plan and every invariant (the refinement check); off for speed only.
        properties: trace properties to monitor; default: those the scheduler guarantees.
        watch: extra properties to monitor without counting their violations as failures (used to
            demonstrate counterexamples).
        record_steps: keep a :class:`StepRecord` per step.
        incremental: check with :class:`~schedspec.spec.incremental.IncrementalChecker` (same verdicts,
            time proportional to what each step changed) instead of the full check.
        stop_on_violation: raise :class:`ViolationFound` at the first violated rule or invariant.
        on_step: called with each record (progress bars, streaming output).
        on_step_view: called with each step as a :class:`StepView` (no record is built for it).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        config: SchedulerConfig,
        token_source: TokenSource | None = None,
        check: bool = True,
        properties: Iterable[str] | None = None,
        watch: Iterable[str] = (),
        record_steps: bool = True,
        stop_on_violation: bool = False,
        on_step: Callable[[StepRecord], None] | None = None,
        incremental: bool = False,
        on_step_view: Callable[[StepView], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.config = config
        self.token_source = token_source
        self.check = check
        self.properties = tuple(properties if properties is not None else sorted(scheduler.guarantees))
        self.watch = tuple(name for name in watch if name not in self.properties)
        self.record_steps = record_steps
        self.stop_on_violation = stop_on_violation
        self.on_step = on_step
        self.incremental = incremental
        self.on_step_view = on_step_view

    def _hand(self, transition: Transition | None) -> None:
        """Hand the spec's ``transition`` to a scheduler that accepts one (``accept_transition``:
        :class:`~schedspec.reference.scheduler.ReferenceScheduler`) before calling it for the same
        action, so it need not compute the transition again."""
        accept = getattr(self.scheduler, "accept_transition", None)
        if accept is not None and transition is not None:
            accept(transition)

    def _call(self, operation: str, step: int, method: Callable[..., Any], *args: Any) -> Any:
        """Call a method of the scheduler under test. What it raises (other than the protocol's own
        :class:`UnsupportedFeature` and :class:`EngineFault`) becomes an :class:`EngineFault`: a crash of
        the scheduler under test is a finding about it (the CLI reports it in one line, exit 1), not a
        traceback of schedspec."""
        try:
            return method(*args)
        except (UnsupportedFeature, EngineFault, ViolationFound):
            raise
        except Exception as error:
            name = getattr(self.scheduler, "name", None) or type(self.scheduler).__name__
            raise EngineFault(str(name), operation, step, _innermost(error),
                              f"{type(error).__name__}: {error}") from error

    def _schedule(self, step: int) -> StepPlan:
        plan = self._call("schedule", step, self.scheduler.schedule)
        if not isinstance(plan, StepPlan):
            name = getattr(self.scheduler, "name", None) or type(self.scheduler).__name__
            raise EngineFault(str(name), "schedule", step, "its return value",
                              f"schedule() returned a {type(plan).__name__}, not a StepPlan")
        return plan

    def _update(self, step: int, plan: StepPlan, sampled: dict[str, int],
                speculative: SpeculativeOutput = NO_SPECULATION,
                transfers: KVTransferOutput = NO_TRANSFERS) -> tuple[str, ...]:
        if transfers is not NO_TRANSFERS:  # a scheduler with supports_kv_connector takes the report by keyword
            finished = self._call("update", step, partial(self.scheduler.update, transfers=transfers), plan, sampled,
                                  speculative)
        elif self.config.speculative:
            finished = self._call("update", step, self.scheduler.update, plan, sampled, speculative)
        else:
            finished = self._call("update", step, self.scheduler.update, plan, sampled)
        if not isinstance(finished, (tuple, list)) or not all(isinstance(r, str) for r in finished):
            name = getattr(self.scheduler, "name", None) or type(self.scheduler).__name__
            raise EngineFault(str(name), "update", step, "its return value",
                              f"update() returned {type(finished).__name__}, not a tuple of request ids")
        return tuple(finished)

    def run(
        self,
        workload: Sequence[RequestSpec],
        mode: str = "steps",
        max_steps: int | None = None,
    ) -> RunResult:
        """Run the workload until every request has ended (or ``max_steps`` steps, or the scheduler hangs:
        ``max_model_len`` steps with live requests and no progress, a ``progress`` violation).

        Args:
            workload: request descriptors; ``arrival_step`` (mode ``steps``) or ``arrival_time``
                (mode ``time``) says when each arrives.
            mode: ``"steps"`` or ``"time"`` (module docstring).
            max_steps: stop after this many steps even if requests are live.

        Raises:
            ValueError: unknown mode, duplicate request ids, or a request without ``arrival_step``
                in steps mode.
            ViolationFound: with ``stop_on_violation``, at the first rule or invariant violation.
        """
        if mode not in ("steps", "time"):
            raise ValueError(f"mode={mode!r}: must be 'steps' or 'time'")
        specs: dict[str, RequestSpec] = {}
        for spec in workload:
            if spec.request_id in specs:
                raise ValueError(f"request_id={spec.request_id!r} appears twice in the workload")
            if mode == "steps" and spec.arrival_step is None:
                raise ValueError(f"request_id={spec.request_id!r}: arrival_step is required in steps mode")
            specs[spec.request_id] = spec
        events = _ClientEvents(workload, mode)
        token_source = self.token_source or FakeModel(
            self.config, eos_at_output={s.request_id: s.eos_at_output for s in workload if s.eos_at_output}
        )
        unspecified = unspecified_with_groups(self.config, bool(getattr(self.scheduler, "async_scheduling", False)),
                                              uses_kv_connector(workload))
        if unspecified is not None:  # a combination the spec does not specify: no scheduler can be judged on it
            raise UnsupportedFeature(unspecified)
        if self.config.kv_cache_groups and not getattr(self.scheduler, "supports_kv_cache_groups", False):
            name = getattr(self.scheduler, "name", None) or type(self.scheduler).__name__
            raise UnsupportedFeature(f"scheduler {name!r} does not support hybrid KV cache groups "
                                     f"(kv_cache_groups={[g.to_dict() for g in self.config.kv_cache_groups]})")
        if self.config.speculative:
            name = getattr(self.scheduler, "name", None) or type(self.scheduler).__name__
            if not supports_speculative(self.scheduler):
                raise UnsupportedFeature(f"scheduler {name!r} does not support speculative decoding "
                                         f"(num_speculative_tokens={self.config.num_speculative_tokens}): its update "
                                         "takes no drafts")
            if not callable(getattr(token_source, "execute_speculative", None)):
                raise UnsupportedFeature(f"token source {type(token_source).__name__} does not support speculative "
                                         f"decoding (num_speculative_tokens={self.config.num_speculative_tokens})")

        connector = ScheduledConnector(workload) if uses_kv_connector(workload) else None
        if connector is not None and not getattr(self.scheduler, "supports_kv_connector", False):
            name = getattr(self.scheduler, "name", None) or type(self.scheduler).__name__
            raise UnsupportedFeature(f"scheduler {name!r} does not support remote KV loads and sends (a workload "
                                     "request has num_external_computed_tokens or kv_send): its update takes no "
                                     "KV connector report")
        if connector is not None and self.config.enable_prefix_caching:
            raise UnsupportedFeature("remote KV loads and sends are specified with prefix caching off "
                                     "(enable_prefix_caching is on)")
        if connector is not None and callable(getattr(self.scheduler, "enable_kv_connector", None)):
            self._call("enable_kv_connector", 0, self.scheduler.enable_kv_connector)  # an engine's own connector
        checker = step_checker(self.config, self.incremental) if self.check else None
        # A run allocates millions of short-lived tuples while holding every finished request: the
        # default thresholds make the cyclic garbage collector rescan that growing heap thousands of
        # times. Nothing here builds reference cycles, so collect rarely during the run.
        gc_thresholds = gc.get_threshold()
        gc.set_threshold(200_000, 50, 100)
        try:
            return self._run(events, specs, mode, max_steps, token_source, checker, connector)
        finally:
            gc.set_threshold(*gc_thresholds)

    def _run(self, events, specs, mode, max_steps, token_source, checker, connector=None) -> RunResult:
        watched: list[Monitor] = monitors(self.properties, self.config) + monitors(self.watch, self.config)
        # A hung scheduler (no new token position and no request ended for max_model_len steps with live
        # requests) would keep a run going forever: the run stops there with a progress violation, which
        # every scheduler owes (spec.checker.DEFAULT_PROPERTIES), whether or not it was asked to monitor it.
        hang_guard = next((m for m in watched if m.name == "progress"), None) or Progress(self.config)
        counted = "progress" in self.properties
        if (not self.check and not watched and not self.record_steps and self.on_step is None and connector is None
                and callable(getattr(self.scheduler, "step_views", None)) and type(token_source) is CostOnlyModel):
            return self._run_light(events, specs, mode, max_steps, token_source)
        # a scheduler that plans step n + 1 while step n is in flight (vLLM's AsyncScheduler) is judged
        # against the spec's state with a step in flight (SchedulerState.in_flight)
        asynchronous = bool(getattr(self.scheduler, "async_scheduling", False))
        initial = SchedulerState.initial(self.config, asynchronous=asynchronous)
        has_state = isinstance(getattr(self.scheduler, "state", None), SchedulerState)
        if has_state and not state_differences(initial, self.scheduler.state):
            # An equal immutable start state: the same object, so that the spec transitions the engine
            # computes can be handed to a reference scheduler (accept_transition).
            initial = self.scheduler.state
        # With checks off, a scheduler that keeps a spec state is trusted (the fast path); with checks on,
        # the spec's shadow is always advanced by the spec's own transitions and compared with it.
        trust_state = has_state and not self.check
        has_view = self.check and not has_state and callable(getattr(self.scheduler, "engine_view", None))
        stepper = Stepper(self.config, checker, watched, initial)
        records: list[StepRecord] = []
        violations: list[Violation] = []
        speculative_on = self.config.speculative
        speculative = NO_SPECULATION
        clock = 0.0
        step = 0
        checked = 0
        wasted = 0
        started = wallclock.perf_counter()

        def compare_own(after: SchedulerState, ended: tuple[str, ...], blamed: int) -> list[Violation]:
            if has_state:
                differences = state_differences(after, self.scheduler.state, ended)
            elif has_view:
                differences = view_differences(EngineView.of_state(after), self.scheduler.engine_view())
            else:
                return []
            return [Violation("state-mismatch", detail, blamed, request_id, kind="mismatch")
                    for request_id, detail in differences]

        def report(found: list[Violation], state: SchedulerState) -> None:
            """Keep ``found``; with ``stop_on_violation``, stop the run at ``state`` if it is not empty."""
            violations.extend(found)
            if found and self.stop_on_violation:
                raise ViolationFound(found, state, records)

        while True:
            if max_steps is not None and step >= max_steps:
                break
            if mode == "time" and not stepper.state.requests:
                clock = events.idle_clock(clock)
            arrivals = events.arrivals(step, clock)
            for spec in arrivals:
                request = spec.to_request(step)
                if trust_state:
                    self._call("add_request", step, self.scheduler.add_request, request)
                    stepper.arrive(request, spec, after=self.scheduler.state)
                else:
                    self._hand(stepper.arrive(request, spec))
                    self._call("add_request", step, self.scheduler.add_request, request)
            aborts = events.aborts(step, clock)
            for request_id in aborts:
                if trust_state:
                    self._call("abort_request", step, self.scheduler.abort_request, request_id)
                    stepper.abort(request_id, after=self.scheduler.state)
                else:
                    self._hand(stepper.abort(request_id).transition)
                    self._call("abort_request", step, self.scheduler.abort_request, request_id)
            if not stepper.state.requests and not events.arrivals_left and not (connector and connector.pending):
                break  # (with a KV connector, steps go on until the transfers still holding blocks are done)

            before = stepper.state
            if self.check and (arrivals or aborts):
                report(compare_own(before, tuple(a.request_id for a in stepper.aborted if a.live), step), before)
            plan = self._schedule(before.step)
            report(stepper.check_plan(plan), before)
            # the model runs the part of the plan that lands; its items for requests that ended while the
            # step before was in flight are wasted (spec.state.landed_plan; the plan itself when synchronous)
            landed = landed_plan(before, plan)[0]
            if speculative_on:
                sampled, duration, speculative = token_source.execute_speculative(landed, before)
            else:
                sampled, duration = token_source.execute(landed, before)
            transfers = connector.report(before.step) if connector is not None else NO_TRANSFERS
            if trust_state:
                finished = self._update(before.step, plan, sampled, speculative, transfers)
                outcome = stepper.step(plan, sampled, StepResult(self.scheduler.state, finished, ()),
                                       speculative=speculative, transfers=transfers)
            else:
                # The spec's own transition first, handed to a reference scheduler that keeps the same spec
                # state (accept_transition), so its state is this state.
                outcome = stepper.step(plan, sampled, speculative=speculative, transfers=transfers)
                if outcome.error is not None:
                    report([Violation("refinement", f"the spec cannot apply the scheduler's plan: {outcome.error}",
                                      before.step, kind="mismatch")], before)
                    break
                self._hand(outcome.transition)
                finished = self._update(before.step, plan, sampled, speculative, transfers)
                if self.check:
                    found = []
                    found += finished_set_mismatches(finished, outcome.finished, before.step)
                    reasons = getattr(self.scheduler, "finish_reason_mismatches", None)
                    if reasons is not None:  # an engine adapter's own finish reasons against the spec's
                        found += [Violation("refinement", text, before.step, request_id, kind="mismatch",
                                            code=FINISH_REASON_MISMATCH)
                                  for request_id, text in reasons(outcome.after.finished)]
                    found += compare_own(outcome.after, outcome.finished, before.step)
                    report(found, outcome.after)
            after = outcome.after
            if connector is not None:
                connector.started(before.step, landed)
                connector.finished(before.step, outcome.finished, after.finished)
            wasted += outcome.num_wasted_tokens
            if self.check:
                checked += 1
                report(outcome.invariant_violations, after)
            stepper.observe(outcome)
            hung = False
            if hang_guard not in watched:
                hang_guard.observe(before, landed, after)
            if hang_guard.violations:
                hung = True
                if not counted:
                    violations.extend(hang_guard.violations)
            if self.on_step_view is not None:
                self.on_step_view(StepView(before.step, clock, duration, before, after, landed, sampled,
                                           outcome.finished, outcome.arrivals, outcome.aborted_ids, speculative))
            if self.record_steps or self.on_step is not None:
                record = stepper.record(outcome, clock, duration)
                if self.record_steps:
                    records.append(record)
                if self.on_step is not None:
                    self.on_step(record)
            clock += duration
            step += 1
            if hung:
                break

        property_violations = stepper.finish()
        for monitor in watched:
            if monitor.name in self.properties:
                violations.extend(property_violations[monitor.name])
        return RunResult(
            records=records,
            state=stepper.state,
            violations=violations,
            property_violations=property_violations,
            num_steps=step,
            num_steps_checked=checked,
            wall_seconds=wallclock.perf_counter() - started,
            specs=specs,
            engine=engine_identity(self.scheduler),
            num_wasted_tokens=wasted,
            async_scheduling=asynchronous,
        )

    def _run_light(self, events, specs, mode, max_steps, token_source) -> RunResult:
        """The unchecked loop for a scheduler that keeps its own mutable tables and offers light views of
        them (``has_live_requests``, ``is_live``, ``live_view()``, ``step_views()``:
        :class:`~schedspec.reference.fast_fcfs.FastFcfsScheduler`): no spec state is built during the run
        (the :class:`StepView`'s ``before`` and ``after`` are the scheduler's light views), only once at
        the end. The same steps, arrivals, aborts and durations as :meth:`_run` with checks off
        (``tests/test_fast_fcfs.py``); used only with :class:`CostOnlyModel`, no monitors and no records."""
        scheduler = self.scheduler
        on_step_view = self.on_step_view
        clock = 0.0
        step = 0
        started = wallclock.perf_counter()
        while True:
            if max_steps is not None and step >= max_steps:
                break
            if mode == "time" and not scheduler.has_live_requests:
                clock = events.idle_clock(clock)
            arrivals = events.arrivals(step, clock)
            for spec in arrivals:
                scheduler.add_request(spec.to_request(step))
            aborts = events.aborts(step, clock)
            aborted = []
            for request_id in aborts:
                if scheduler.is_live(request_id):
                    aborted.append(request_id)
                scheduler.abort_request(request_id)
            if not scheduler.has_live_requests and not events.arrivals_left:
                break
            plan = scheduler.schedule()
            sampled, duration = token_source.execute(plan, scheduler.live_view())
            finished = scheduler.update(plan, sampled)
            if on_step_view is not None:
                before, after = scheduler.step_views()
                on_step_view(StepView(step, clock, duration, before, after, plan, sampled, tuple(finished),
                                      arrivals, aborted))
            clock += duration
            step += 1
        return RunResult(records=[], state=scheduler.state, violations=[], property_violations={},
                         num_steps=step, num_steps_checked=0, wall_seconds=wallclock.perf_counter() - started,
                         specs=specs, engine=engine_identity(self.scheduler))
