"""A reusable Hypothesis state machine that checks any scheduler against the spec.

:class:`SchedulerStateMachine` drives a scheduler (any object with the ``Scheduler`` protocol of
:mod:`schedspec.reference.scheduler`: ``add_request``, ``abort_request``, ``schedule``, ``update``,
``guarantees``) through random workloads on random configs, and checks, at every step:

- the **refinement check**: the plan is allowed from the spec state *before* the step
  (``violated_rules(state, plan, config) == []``), checked before the plan is executed;
- the scheduler reports the same finished requests as the spec's :func:`apply_plan` (and, for an engine
  adapter that reports them, ``finish_reason_mismatches``, the same finish reasons), and, when it
  exposes a ``state`` (reference schedulers), that state equals the spec's;
- every state and step invariant (:func:`check_state`, :func:`check_step`);
- the trace properties the scheduler guarantees (``scheduler.guarantees``), via their monitors.

The machine keeps its own **spec shadow state**, advanced only by the spec's transitions
(``add_request``, ``abort_request``, ``apply_plan``), so it works for engine adapters whose state is
hidden. At the end of every example (``teardown``) it **drains** the workload: it steps until no
request is live (bounded, see :meth:`SchedulerStateMachine.drain_step_limit`), then asserts that no
guaranteed property was violated and that nothing was lost: every added request ended finished,
aborted or rejected, with a reason and with the number of outputs its limits imply.

Use it for a registered scheduler::

    from schedspec.testing import machine_for
    TestFcfs = machine_for("fcfs").TestCase      # a unittest.TestCase that pytest collects

or subclass it for an engine adapter::

    class MyEngineMachine(SchedulerStateMachine):
        @classmethod
        def build_scheduler(cls, config):
            return MyEngineScheduler(config)

        @classmethod
        def configs(cls):
            return scheduler_configs(max_model_len=32)

    TestMyEngine = MyEngineMachine.TestCase

Rules draw their inputs with ``st.data()`` from the machine's strategy hooks (defaults in
:mod:`schedspec.strategies`, which engine authors can use on their own), ``@precondition`` keeps
useless rules out (several steps in a row only while requests are live), and ``note()`` records every
arrival, abort and plan, so a failing example prints the run that broke the spec, step by step.

Settings (examples, steps per example) come from the active Hypothesis profile (see
``tests/conftest.py`` and ``docs/testing.md``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable
from typing import Any, ClassVar

import attrs
from hypothesis import assume, event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from schedspec import strategies
from schedspec.spec.admission import max_sequence_len, rejection_reason
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import check_state
from schedspec.spec.properties import Monitor, monitors
from schedspec.spec.request import RequestStatus
from schedspec.spec.rules import Violation
from schedspec.spec.state import SchedulerState, StepPlan, landed_plan, samples_this_step
from schedspec.spec.stepper import FullChecker, Stepper
from schedspec.spec.workload import EOS_TOKEN_ID, ArrivalClock, RequestSpec
from schedspec.strategies import scheduler_configs

__all__ = [
    "MACHINE_STEP_SECONDS",
    "SchedulerStateMachine",
    "SpecViolation",
    "machine_for",
    "scheduler_configs",
]


class SpecViolation(AssertionError):
    """The scheduler under test broke the spec: a rule (refinement check), an invariant, a guaranteed
    trace property, or the end-of-run checks. ``check`` names the kind of check, ``violations`` holds
    the spec's :class:`~schedspec.spec.rules.Violation` values (empty for the end-of-run checks)."""

    def __init__(self, check: str, message: str, violations: Iterable[Violation] = ()) -> None:
        self.check = check
        self.violations = list(violations)
        super().__init__(f"{check}: {message}")


MACHINE_STEP_SECONDS = 0.01
"""How long every step of :class:`SchedulerStateMachine` lasts on its simulated clock (seconds). The
machine counts steps, not seconds; its clock exists to stamp arrivals as an engine does
(:class:`~schedspec.spec.workload.ArrivalClock`): a request added before step ``n`` arrives at
``n * MACHINE_STEP_SECONDS`` (the sum of ``n`` steps; several added before one step: in the order
added, each the next float after the one before), so arrival times follow the order of addition,
never the id. Before issue 24 the machine's steps took 0 s and every arrival had 0 s."""


class _FixedStep:
    """A cost model for :class:`~schedspec.reference.fake_model.FakeModel`: every step takes
    :data:`MACHINE_STEP_SECONDS`, whatever it computes."""

    def step_seconds(self, prefill_tokens: int, decode_tokens: int, kv_tokens: int) -> float:
        return MACHINE_STEP_SECONDS


@attrs.define
class _Added:
    """What the machine knows about a request it added (to check its fate at the end)."""

    spec: RequestSpec
    aborted_live: bool = False


def _lines(violations: Iterable[Violation], limit: int = 8) -> str:
    found = list(violations)
    text = "; ".join(str(v) for v in found[:limit])
    if len(found) > limit:
        text += f"; ... ({len(found) - limit} more)"
    return text


ABORT_TARGETS = ("waiting", "running", "finished", "unknown")

_NO_STATE = SchedulerState()
"""The machine's spec state before ``setup`` draws a config."""

_STRATEGIES: dict[tuple[type, str, SchedulerConfig | None], st.SearchStrategy[Any]] = {}


def _plan_line(plan: StepPlan) -> str:
    """A plan on one line, for ``note()``: each scheduled request with its tokens, then preemptions and
    rejections."""
    parts = [f"{item.request_id}+{item.num_tokens}" for item in plan.scheduled]
    if plan.preempted:
        parts.append(f"preempt {list(plan.preempted)}")
    if plan.rejected:
        parts.append(f"reject {[r for r, _ in plan.rejected]}")
    return ", ".join(parts) or "(empty step)"


def _machine_strategy(machine: SchedulerStateMachine, hook: str) -> st.SearchStrategy[Any]:
    """``getattr(machine, hook)()``, cached per (machine class, hook, config): building and validating
    a strategy costs more than drawing from it, and a rule draws from the same one many times."""
    key = (type(machine), hook, machine.config)
    found = _STRATEGIES.get(key)
    if found is None:
        if len(_STRATEGIES) > 10_000:
            _STRATEGIES.clear()
        found = _STRATEGIES[key] = getattr(machine, hook)()
    return found


class SchedulerStateMachine(RuleBasedStateMachine):
    """Checks a scheduler against the spec on random configs and workloads (module docstring).

    Hooks for subclasses:

    - :attr:`scheduler_name` / :meth:`build_scheduler`: the scheduler under test (default: the
      registered scheduler ``scheduler_name``, ``"fcfs"``).
    - :meth:`configs`: the config strategy (default :func:`scheduler_configs`).
    - :meth:`guaranteed_properties`: the trace properties to enforce (default
      ``scheduler.guarantees``).
    - :meth:`prompt_lengths`, :meth:`max_tokens_values`, :meth:`eos_positions`, :meth:`priorities`,
      :meth:`request_shapes`: request strategies for ``self.config``. They are built once per
      (machine class, config) and cached, so they must depend on nothing else.
    - :meth:`known_divergences`: rule violations the scheduler is documented to commit (default none).
    - :meth:`drain_step_limit`: bound on the steps the final drain may take.

    Subclasses may add rules; :meth:`advance` runs one fully checked step and :meth:`add_request`
    adds a request to the scheduler and the shadow state.

    Attributes set by ``setup``: ``config``, ``scheduler``, ``stepper`` (the spec's
    :class:`~schedspec.spec.stepper.Stepper`, with the full checker and the guaranteed properties'
    monitors), ``shadow`` (its spec state), ``model`` (the fake model), ``monitors``, ``added`` (request
    id -> what was added). ``clock``: the simulated clock (seconds,
    :data:`MACHINE_STEP_SECONDS` per step) that stamps arrivals.
    """

    scheduler_name: ClassVar[str] = "fcfs"

    # ----------------------------------------------------------------------------------- hooks
    @classmethod
    def build_scheduler(cls, config: SchedulerConfig) -> Any:
        """The scheduler under test for ``config``. May raise ``UnsupportedFeature`` to skip a config."""
        from schedspec.reference.scheduler import make_scheduler

        return make_scheduler(cls.scheduler_name, config)

    @classmethod
    def configs(cls) -> st.SearchStrategy[SchedulerConfig]:
        """Strategy for the config of one example."""
        return scheduler_configs()

    def acceptance_patterns(self) -> st.SearchStrategy[str]:
        """Speculative decoding (a config with ``num_speculative_tokens > 0``): the acceptance pattern drawn
        for each request added (:func:`schedspec.strategies.acceptance_patterns`: every draft right, none,
        partly, right up to an output; with ``eos_at_output`` among right drafts, a stop inside the accepted
        drafts)."""
        return strategies.acceptance_patterns(self.config.num_speculative_tokens)

    def guaranteed_properties(self, scheduler: Any) -> Iterable[str]:
        """Names of the trace properties whose violation fails the test."""
        return sorted(getattr(scheduler, "guarantees", ()))

    def prompt_lengths(self) -> st.SearchStrategy[int]:
        """Prompt lengths for ``self.config`` (default :func:`schedspec.strategies.prompt_lengths`)."""
        return strategies.prompt_lengths(self.config)

    def max_tokens_values(self) -> st.SearchStrategy[int]:
        """``max_tokens`` values for ``self.config`` (default :func:`schedspec.strategies.max_tokens_values`)."""
        return strategies.max_tokens_values(self.config)

    def eos_positions(self) -> st.SearchStrategy[int | None]:
        """Output index (1-based) at which the fake model emits end-of-sequence, or ``None``."""
        return strategies.eos_positions()

    def priorities(self) -> st.SearchStrategy[int]:
        """Request priorities (lower is more urgent); only priority policies look at them."""
        return strategies.priorities()

    def request_shapes(self) -> st.SearchStrategy[tuple[int, int, int | None, int]]:
        """``(prompt_len, max_tokens, eos_at_output, priority)`` tuples, from the four hooks above."""
        return st.tuples(self.prompt_lengths(), self.max_tokens_values(), self.eos_positions(), self.priorities())

    def prefix_shapes(self) -> st.SearchStrategy[tuple[int, int, int, int, int | None]]:
        """``(group, prefix_len, suffix_len, max_tokens, eos_at_output)`` for the ``shared_prefix`` rule
        (prefix caching only): one of three prefix groups, a shared prefix that is mostly a whole number of
        blocks (so that it can hit) and otherwise anything up to ``max_model_len``, and a suffix of the
        request's own tokens (0 included: the whole prompt shared, of which the last token is recomputed)."""
        config = self.config
        size, limit = config.block_size, config.max_model_len
        prefix = st.one_of(st.integers(1, max(1, limit // size)).map(lambda k: k * size), st.integers(1, limit))
        suffix = st.one_of(st.integers(0, 3), st.integers(0, max(0, limit // 2)))
        return st.tuples(st.integers(0, 2), prefix, suffix, self.max_tokens_values(), self.eos_positions())

    def known_divergences(self, state: SchedulerState, plan: StepPlan, found: list[Violation]) -> list[Violation]:
        """Those of ``found`` (the rule violations of ``plan`` from ``state``) that the scheduler under
        test is known and documented to commit; they do not fail the test. Default: none. An engine
        adapter's machine overrides this for documented differences from the spec (e.g. vLLM lifts
        ``long_prefill_token_threshold`` for a lone request), each with a precise condition."""
        return []

    def drain_step_limit(self) -> int:
        """Most steps the final drain may take before the test fails.

        A policy with ``progress`` computes a new position or ends a request at least every
        ``max_model_len`` steps (the monitor fails the test earlier otherwise), and the live
        requests have at most ``sum(max_sequence_len)`` positions, so
        ``(positions + live requests + 1) * max_model_len`` steps suffice.
        """
        config = self.config
        live = list(self.shadow.requests.values())
        positions = sum(max_sequence_len(r.prompt_len, r.max_tokens, config) for r in live)
        return (positions + len(live) + 1) * config.max_model_len

    # ------------------------------------------------------------------------------ machinery
    def __init__(self) -> None:
        super().__init__()
        self.config: SchedulerConfig | None = None
        self.scheduler: Any = None
        self.stepper: Stepper | None = None
        self.model: Any = None
        self.added: dict[str, _Added] = {}
        self.steps_run = 0
        self.seen: set[str] = set()
        self.clock = 0.0
        self._arrival_clock = ArrivalClock()
        self._checked: SchedulerState | None = None  # the latest spec state every check passed on
        self._data: Any = None  # the rule's data object, for add_request's draws (speculative decoding)

    @property
    def shadow(self) -> SchedulerState:
        """The spec state (the stepper's), advanced only by the spec's transitions (empty before ``setup``)."""
        return self.stepper.state if self.stepper is not None else _NO_STATE

    @shadow.setter
    def shadow(self, state: SchedulerState) -> None:
        assert self.stepper is not None, "the spec state is set up by setup()"
        self.stepper.state = state

    @property
    def monitors(self) -> list[Monitor]:
        """The monitors of the guaranteed trace properties (the stepper's)."""
        return self.stepper.monitors if self.stepper is not None else []

    def _fail(self, check: str, message: str, violations: Iterable[Violation] = ()) -> None:
        raise SpecViolation(check, f"[scheduler {self._label()}] {message}", violations)

    def _label(self) -> str:
        return getattr(self.scheduler, "name", None) or type(self).scheduler_name

    def _scheduler_state(self) -> SchedulerState | None:
        state = getattr(self.scheduler, "state", None)
        return state if isinstance(state, SchedulerState) else None

    def _check_scheduler_state(self) -> None:
        own = self._scheduler_state()
        if own is not None and own != self.shadow:
            self._fail(
                "refinement",
                f"the scheduler's state differs from the spec state at step {self.shadow.step} "
                f"(scheduler running={own.running} waiting={own.waiting} free={own.free_block_ids}; "
                f"spec running={self.shadow.running} waiting={self.shadow.waiting} "
                f"free={self.shadow.free_block_ids})",
            )

    def _check_monitors(self) -> None:
        found = [v for m in self.monitors for v in m.violations]
        if found:
            self._fail("guaranteed property", _lines(found), found)

    def advance(self) -> StepPlan:
        """One step with every check (:class:`~schedspec.spec.stepper.Stepper`): plan, refinement check
        (before anything runs), fake-model execution, the spec's transition, update, finished-set
        agreement, step and state invariants, property monitors."""
        assert self.config is not None
        before = self.shadow
        plan = self.scheduler.schedule()
        note(f"step {before.step}: {_plan_line(plan)}")
        assert self.stepper is not None
        found = self.stepper.check_plan(plan)
        if found:
            known = self.known_divergences(before, plan, found)
            found = [v for v in found if v not in known]
        if found:
            self._fail("refinement check (spec rules)", f"plan {plan} breaks: {_lines(found)}", found)
        landed = landed_plan(before, plan)[0]  # with a step in flight, less the items wasted on ended requests
        if landed is not plan:
            self.seen.add("work wasted on a request that ended in flight")
        if self.config.speculative:
            # the fake model verifies the drafts greedily and proposes the next ones (its AcceptanceModel)
            sampled, duration, speculative = self.model.execute_speculative(landed, before)
            self.clock += duration
            outcome = self.stepper.step(plan, sampled, speculative=speculative)
            reported = self.scheduler.update(plan, sampled, speculative)
            self._see_drafts(plan, before, speculative, outcome.finished)
        else:
            sampled, duration = self.model.execute(landed, before)
            self.clock += duration
            outcome = self.stepper.step(plan, sampled)
            reported = self.scheduler.update(plan, sampled)
        if outcome.error is not None:
            raise outcome.error
        if set(reported) != set(outcome.finished):
            self._fail(
                "refinement",
                f"step {before.step}: scheduler says finished {sorted(reported)}, spec says {sorted(outcome.finished)}",
            )
        reasons = getattr(self.scheduler, "finish_reason_mismatches", None)
        mismatched = reasons(outcome.after.finished) if reasons is not None else []
        if mismatched:  # an engine adapter's own finish reasons against the spec's (as the engine loop)
            self._fail("refinement", f"step {before.step}: " + "; ".join(text for _, text in mismatched))
        found = outcome.invariant_violations
        if found:
            self._fail("invariant", f"after plan {plan}: {_lines(found)}", found)
        self._checked = outcome.after
        self._check_scheduler_state()
        self.stepper.observe(outcome)
        self._check_monitors()
        self.steps_run += 1
        made, plan = plan, landed
        if plan.preempted:
            self.seen.add("preemption")
        if plan.rejected:
            self.seen.add("rejection")
        if any(samples_this_step(before.requests[i.request_id], i) is False for i in plan.scheduled):
            self.seen.add("partial prefill chunk")
        for item in plan.scheduled:
            if item.cached_block_ids:
                self.seen.add("prefix-cache hit")
                if before.requests[item.request_id].num_preemptions:
                    self.seen.add("prefix-cache hit after preemption")
        return made

    def _see_drafts(self, plan: StepPlan, before: SchedulerState, speculative, finished: tuple[str, ...]) -> None:
        """Record which speculative-decoding situations the example reached (``seen``)."""
        for item in plan.scheduled:
            d = len(item.spec_token_ids)
            if not d:
                continue
            a = speculative.num_accepted_tokens.get(item.request_id, 0)
            self.seen.add("drafts all accepted" if a == d else "drafts none accepted" if a == 0
                          else "drafts partly accepted")
            if item.request_id in finished and a and before.requests[item.request_id].max_tokens > (
                    before.requests[item.request_id].num_output_tokens + a + 1):
                self.seen.add("stop inside accepted drafts")
            if d < len(before.requests[item.request_id].spec_token_ids):
                self.seen.add("drafts trimmed")

    # ---------------------------------------------------------------------------------- rules
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        """Draw the config and build the scheduler under test (a config it refuses with
        ``UnsupportedFeature`` is not a failure: the example is discarded)."""
        from schedspec.reference.fake_model import FakeModel
        from schedspec.reference.scheduler import UnsupportedFeature

        config = data.draw(_machine_strategy(self, "configs"), label="config")
        try:
            scheduler = self.build_scheduler(config)
        except UnsupportedFeature:
            assume(False)
        self.config = config
        self.scheduler = scheduler
        # a scheduler that plans while a step is in flight (async_scheduling) is judged against the spec's
        # state with a step in flight (SchedulerState.in_flight)
        initial = SchedulerState.initial(config, asynchronous=bool(getattr(scheduler, "async_scheduling", False)))
        self.stepper = Stepper(config, FullChecker(config), monitors(list(self.guaranteed_properties(scheduler)), config),
                               initial)
        self.model = FakeModel(config, _FixedStep(), {})
        self._check_scheduler_state()

    @rule(data=st.data())
    def add(self, data: st.DataObject) -> None:
        """A request arrives before the next step (it may be one that must be rejected)."""
        self._data = data  # speculative decoding: add_request draws each request's acceptance pattern
        self.add_request(*data.draw(_machine_strategy(self, "request_shapes"), label="request"))

    @rule(data=st.data())
    def burst(self, data: st.DataObject) -> None:
        """Several requests arrive before the same step (they compete for slots and blocks): up to
        ``max_num_seqs + 2``, so that one burst can fill the running set past its cap."""
        self._data = data  # speculative decoding: add_request draws each request's acceptance pattern
        most = max(6, self.config.max_num_seqs + 2)
        shapes = data.draw(st.lists(_machine_strategy(self, "request_shapes"), min_size=2, max_size=most), label="requests")
        for shape in shapes:
            self.add_request(*shape)

    @precondition(lambda self: self.config is not None and self.config.enable_prefix_caching)
    @rule(data=st.data())
    def shared_prefix(self, data: st.DataObject) -> None:
        """Prefix caching: requests whose prompts start with one of three shared prefixes arrive before the
        same step (later ones, or re-admissions after a preemption, hit what earlier ones published)."""
        self._data = data  # speculative decoding: add_request draws each request's acceptance pattern
        shapes = data.draw(st.lists(_machine_strategy(self, "prefix_shapes"), min_size=1, max_size=4), label="requests")
        for group, prefix_len, suffix_len, max_tokens, eos_at_output in shapes:
            self.add_request(prefix_len + suffix_len, max_tokens, eos_at_output,
                             prefix_group=f"shared{group}", prefix_len=prefix_len)

    def add_request(self, prompt_len: int, max_tokens: int, eos_at_output: int | None = None, priority: int = 0,
                    prefix_group: str | None = None, prefix_len: int = 0) -> str:
        """Add a request of this shape to the scheduler and to the spec state; returns its id. Requests of
        one ``prefix_group`` share their first ``prefix_len`` prompt token ids
        (:class:`~schedspec.spec.workload.SyntheticPrompt`). Its ``arrival_time`` is the machine's
        ``clock`` (:data:`MACHINE_STEP_SECONDS`), stamped by an :class:`ArrivalClock`."""
        request_id = f"r{len(self.added)}"
        spec = self._arrival_clock.stamped(
            RequestSpec(request_id, prompt_len, max_tokens, arrival_step=self.shadow.step, priority=priority,
                        eos_at_output=eos_at_output, prefix_group=prefix_group, prefix_len=prefix_len),
            self.clock)
        request = spec.to_request(self.shadow.step)
        note(f"step {self.shadow.step}: add {request_id} prompt_len={prompt_len} max_tokens={max_tokens} "
             f"eos_at_output={eos_at_output} priority={priority}"
             + (f" prefix_group={prefix_group} prefix_len={prefix_len}" if prefix_group else ""))
        self.added[request_id] = _Added(spec)
        if eos_at_output is not None:
            self.model.eos_at_output[request_id] = eos_at_output
        if self.config.speculative and self._data is not None:
            from schedspec.reference.fake_model import AcceptanceModel

            pattern = self._data.draw(_machine_strategy(self, "acceptance_patterns"), label=f"acceptance[{request_id}]")
            self.model.acceptance.patterns.update(AcceptanceModel(patterns={request_id: pattern}).patterns)
            note(f"  {request_id} acceptance {pattern}")
        self.scheduler.add_request(request)
        self.stepper.arrive(request, spec)
        return request_id

    @rule()
    def step(self) -> None:
        """One scheduler step."""
        self.advance()

    @precondition(lambda self: bool(self.shadow.requests))
    @rule(count=st.integers(2, 8))
    def steps(self, count: int) -> None:
        """Several scheduler steps in a row (lets requests progress between arrivals)."""
        for _ in range(count):
            self.advance()

    @rule(which=st.sampled_from(ABORT_TARGETS), index=st.integers(0, 63))
    def abort(self, which: str, index: int) -> None:
        """The client aborts a waiting, running or finished request, or an id never added (the last
        two must change nothing)."""
        state = self.shadow
        pools = {"waiting": state.waiting, "running": state.running, "finished": tuple(sorted(state.finished))}
        pool = pools.get(which, ())
        request_id = pool[index % len(pool)] if pool else f"unknown-{index}"
        note(f"step {state.step}: abort {request_id} ({which})")
        self.scheduler.abort_request(request_id)
        live = self.stepper.abort(request_id).live
        if live:
            self.added[request_id].aborted_live = True
            self.seen.add(f"abort of a {which} request")
        elif self.shadow != state:
            self._fail("transition", f"aborting {request_id!r} (not live) changed the spec state")
        self._check_scheduler_state()

    # ----------------------------------------------------------------------------- invariants
    @invariant()
    def spec_holds(self) -> None:
        """After every rule (arrivals and aborts included): every state invariant holds of the spec
        state (:func:`check_state`), a scheduler that exposes its state agrees with it, and no
        monitor of a guaranteed trace property has reported anything. (Step invariants,
        :func:`check_step`, run inside :meth:`advance`, once per step.)"""
        if self.config is None or self.shadow is self._checked:
            return  # a step just checked this very state (check_step, scheduler state, monitors)
        found = check_state(self.shadow, self.config)
        if found:
            self._fail("invariant", _lines(found), found)
        self._check_scheduler_state()
        self._check_monitors()
        self._checked = self.shadow

    # ------------------------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Drain the workload and run the end-of-run checks (skipped when the example already failed
        or was rejected, so the original failure is what Hypothesis reports)."""
        if self.config is None or sys.exc_info()[1] is not None:
            return
        self.drain()
        for what in sorted(self.seen):
            event(f"example has a {what}")

    def drain(self) -> None:
        """Step until no request is live (at most :meth:`drain_step_limit` steps), then check that
        no guaranteed property was violated and that every added request ended as its limits say."""
        assert self.config is not None
        limit = self.drain_step_limit()
        taken = 0
        while self.shadow.requests:
            if taken >= limit:
                live = {r.request_id: r.status.value for r in self.shadow.requests.values()}
                self._fail("drain", f"requests still live after {limit} drain steps: {live}")
            self.advance()
            taken += 1
        found = [v for m in self.monitors for v in m.finish(self.shadow)]
        if found:
            self._fail("guaranteed property", _lines(found), found)
        self.check_nothing_lost()

    def check_nothing_lost(self) -> None:
        """Every added request is terminal, with a reason, and ended the way its shape implies:
        aborted ones ``abort``; impossible ones rejected; the others finished with
        ``min(max_tokens, max(1, max_model_len - prompt_len), eos_at_output)`` outputs, the reason
        matching which limit was hit, and end-of-sequence only as the last output."""
        config = self.config
        assert config is not None
        state = self.shadow
        if state.num_requests_added != len(self.added):
            self._fail("no request lost", f"spec counted {state.num_requests_added} added, machine added {len(self.added)}")
        if state.requests:
            self._fail("no request lost", f"live requests left: {sorted(state.requests)}")
        for request_id, added in self.added.items():
            request = state.finished.get(request_id)
            if request is None:
                self._fail("no request lost", f"{request_id} was added but is not terminal")
                return
            spec = added.spec
            status, reason = request.status, request.finish_reason
            if not status.is_terminal or not reason:
                self._fail("no request lost", f"{request_id} ended with status {status.value}, reason {reason!r}")
            if request.block_ids:
                self._fail("no request lost", f"{request_id} ended holding blocks {request.block_ids}")
            if added.aborted_live:
                if (status, reason) != (RequestStatus.FINISHED_ABORTED, "abort"):
                    self._fail("outcome", f"{request_id} was aborted but ended {status.value} ({reason})")
                continue
            impossible = rejection_reason(spec.prompt_len, spec.max_tokens, config)
            if impossible is not None:
                if status is not RequestStatus.REJECTED:
                    self._fail("outcome", f"{request_id} ({impossible}) ended {status.value}, not rejected")
                continue
            if status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                self._fail("outcome", f"{request_id} (possible, never aborted) ended {status.value} ({reason})")
            self._check_finished(request_id, request, spec, config)

    def _check_finished(self, request_id: str, request: Any, spec: RequestSpec, config: SchedulerConfig) -> None:
        outputs = request.output_token_ids
        room = max(1, config.max_model_len - spec.prompt_len)
        eos = spec.eos_at_output if spec.eos_at_output is not None else spec.max_tokens + room
        expected = min(spec.max_tokens, room, eos)
        if len(outputs) != expected:
            self._fail(
                "outcome",
                f"{request_id} (prompt_len={spec.prompt_len}, max_tokens={spec.max_tokens}, "
                f"eos_at_output={spec.eos_at_output}) produced {len(outputs)} outputs, expected {expected}",
            )
        if EOS_TOKEN_ID in outputs[:-1]:
            self._fail("outcome", f"{request_id} continued after sampling end-of-sequence")
        # vLLM 0.32 check_stop order (spec.transitions.stop_reason): an end-of-sequence token is a stop
        # even when it is also the last token max_tokens or max_model_len allows
        if outputs and outputs[-1] == EOS_TOKEN_ID:
            wanted = "stop"
        elif request.num_tokens >= config.max_model_len:
            wanted = "max_model_len"
        elif len(outputs) >= spec.max_tokens:
            wanted = "length"
        else:
            wanted = "stop"
        if request.finish_reason != wanted:
            self._fail("outcome", f"{request_id} ended with reason {request.finish_reason!r}, expected {wanted!r}")


@functools.cache
def machine_for(scheduler_name: str, prefix_caching: bool = False) -> type[SchedulerStateMachine]:
    """The :class:`SchedulerStateMachine` subclass testing the registered scheduler ``scheduler_name``
    (or a ``module:factory``). Its ``.TestCase`` is a ``unittest.TestCase`` pytest collects. The same
    class is returned for the same arguments. With ``prefix_caching`` every config has
    ``enable_prefix_caching`` on and the ``shared_prefix`` rule adds requests with shared prefixes."""
    words = "".join(part.capitalize() for part in scheduler_name.replace(":", "-").replace(".", "-").split("-"))
    members: dict[str, Any] = {"scheduler_name": scheduler_name}
    if prefix_caching:
        words += "PrefixCaching"
        members["configs"] = classmethod(lambda cls: scheduler_configs(prefix_caching=True))
    cls = type(f"{words}StateMachine", (SchedulerStateMachine,), members)
    cls.__module__ = __name__
    return cls
