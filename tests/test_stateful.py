"""The stateful refinement suite: every reference policy, driven by :mod:`schedspec.testing`.

Examples and steps per example come from the active Hypothesis profile (``tests/conftest.py``):
``HYPOTHESIS_PROFILE=ci`` runs 500 derandomized examples of 50 rules per policy, 250 for the three vLLM V1
policies (``CI_HALVED``). Two registered schedulers that make the same plans as another (``TWINS``:
``fcfs-fast``, ``vllm-v1@0.33``) run in lockstep inside that one's examples, and 10 more through their own
machine.

The other tests here check the machine itself: it works for an adapter that hides its state, and it
fails (with a :class:`~schedspec.testing.SpecViolation`) on schedulers that break the spec.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Mapping

import attrs
import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.stateful import run_state_machine_as_test

from schedspec.reference.scheduler import SCHEDULERS, make_scheduler
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request
from schedspec.spec.state import StepPlan
from schedspec.strategies import scheduler_configs
from schedspec.testing import MACHINE_STEP_SECONDS, SchedulerStateMachine, SpecViolation, machine_for

SHARDS = 4
"""Each policy's examples run as this many tests (``shard``), so that pytest-xdist can balance them over
its workers (a policy was one test of two to four minutes under ``ci``). Together the shards run the
active profile's ``max_examples`` (rounded up to a multiple of ``SHARDS``) of ``stateful_step_count``
rules per policy. Under a derandomized profile (``ci``) each shard is its own fixed seed (from the policy
name and the shard number), so the shards run different examples and CI stays reproducible; otherwise
each draws at random as before."""


def shard_machine(scheduler_name: str, shard: int, derandomize: bool | None = None) -> type[SchedulerStateMachine]:
    """The machine of ``scheduler_name`` for one shard: a subclass of :func:`machine_for`'s (its own name,
    so its own example-database key), with a fixed seed when ``derandomize`` (default: the active
    profile's)."""
    machine = machine_for(scheduler_name)
    part = type(f"{machine.__name__}Shard{shard}", (machine,), {})
    part.__module__ = machine.__module__
    if settings().derandomize if derandomize is None else derandomize:
        part = seed(zlib.crc32(f"{scheduler_name}/{shard}".encode()))(part)
    return part


TWINS = {"fcfs": "fcfs-fast", "vllm-v1": "vllm-v1@0.33"}
"""Registered schedulers that make the same plans as another one on every config the machine draws, and run
in lockstep inside that one's shards instead of in shards of their own (the checks of a shard are most of
its cost, the twin's plan and update little; two policies' shards were a fifth of CI's pytest time):

- ``fcfs-fast`` is a faster implementation of ``fcfs``'s plans (``reference/fast_fcfs.py``);
  ``tests/test_fast_fcfs.py`` drives the two in lockstep too, on its own workloads.
- ``vllm-v1@0.33`` is ``vllm-v1`` in the machine's scope: under FCFS vLLM 0.33 plans as 0.32
  (``reference/vllm_v1.py``, module docstring); the releases differ only with ``max_loras`` or
  ``prefill_schedule_interval > 1``, which ``scheduler_configs()`` never draws.

At every call the twin gets the same arrivals, aborts and outcomes; its plan, the requests it reports
finished and its state must equal the primary's (:class:`_Lockstep`), so every step the machine checks
against the spec is the twin's step too. Each twin still runs a few examples through its own machine
(``test_twin_runs_in_its_own_machine``)."""


class _Lockstep:
    """The ``primary`` scheduler as the machine sees it (its name, guarantees and state), with ``twin`` driven
    alongside; any difference between the two raises ``AssertionError`` naming the call."""

    def __init__(self, primary, twin) -> None:
        self.primary, self.twin = primary, twin
        self.name = primary.name
        self.guarantees = primary.guarantees
        assert twin.guarantees == primary.guarantees, (twin.name, twin.guarantees, primary.guarantees)

    @property
    def state(self):
        return self.primary.state

    def add_request(self, request: Request) -> None:
        self.primary.add_request(request)
        self.twin.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.primary.abort_request(request_id)
        self.twin.abort_request(request_id)

    def schedule(self) -> StepPlan:
        plan, twin_plan = self.primary.schedule(), self.twin.schedule()
        assert twin_plan == plan, f"lockstep: {self.twin.name} planned {twin_plan}, {self.primary.name} {plan}"
        return plan

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int]) -> tuple[str, ...]:
        finished = self.primary.update(plan, sampled_token_ids)
        twin_finished = self.twin.update(plan, sampled_token_ids)
        assert set(twin_finished) == set(finished), (self.twin.name, twin_finished, finished)
        assert self.twin.state == self.primary.state, f"lockstep: {self.twin.name}'s state differs after {plan}"
        return finished


def with_twin(machine: type[SchedulerStateMachine], scheduler_name: str) -> type[SchedulerStateMachine]:
    """``machine`` (of the registered ``scheduler_name``), with the twin of ``scheduler_name``
    (:data:`TWINS`), if any, in lockstep (also used by ``tests/test_prefix_cache.py``)."""
    if scheduler_name not in TWINS:
        return machine
    twin_name = TWINS[scheduler_name]

    class WithTwin(machine):
        @classmethod
        def build_scheduler(cls, config):
            return _Lockstep(super().build_scheduler(config), make_scheduler(twin_name, config))

    WithTwin.__name__ = WithTwin.__qualname__ = f"{machine.__name__}With{twin_name.title().replace('-', '')}"
    return WithTwin


def lockstep_machine(scheduler_name: str, shard: int) -> type[SchedulerStateMachine]:
    """:func:`shard_machine`, with the twin of ``scheduler_name`` (:data:`TWINS`), if any, in lockstep."""
    return with_twin(shard_machine(scheduler_name, shard), scheduler_name)


CI_HALVED = frozenset({"vllm-v1", "vllm-v1-priority", "vllm-v1-priority@0.33"})
"""The policies that run half the ``ci`` profile's examples (250 of 50 rules, in the same 4 shards) under
``HYPOTHESIS_PROFILE=ci``; every other profile runs its full count for them (``nightly``: 10,000). The three
are one planner (``reference/vllm_v1.py``, ``plan_vllm_v1``: the priority policies change the queue order and
the victim, the 0.33 one a few lines of it), and each is also checked in CI against the real engine it
models, which this suite cannot do: ``tests/test_engine_vllm.py`` and ``tests/test_engine_vllm033.py``
(stateful machines and 1,000-scenario ``schedspec diff`` runs per policy). Shard 0 of the three: 44.6 s of
CPU at 125 examples each, 14.2 s at 63 (docs/testing.md, *What CI runs*)."""


def policy_examples(scheduler_name: str, profile: settings) -> int:
    """Examples of ``scheduler_name`` per shard of :func:`test_policy_refines_spec` under ``profile``: its
    ``max_examples`` over :data:`SHARDS`, rounded up; half of that for :data:`CI_HALVED` under ``ci``."""
    total = profile.max_examples
    if scheduler_name in CI_HALVED and os.environ.get("HYPOTHESIS_PROFILE") == "ci":
        total //= 2
    return -(-total // SHARDS)


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("scheduler_name", sorted(set(SCHEDULERS) - set(TWINS.values())))
def test_policy_refines_spec(scheduler_name: str, shard: int) -> None:
    machine = lockstep_machine(scheduler_name, shard)
    assert issubclass(machine, SchedulerStateMachine) and machine.scheduler_name == scheduler_name
    profile = settings()
    run_state_machine_as_test(machine, settings=settings(profile, max_examples=policy_examples(scheduler_name,
                                                                                                profile)))


@pytest.mark.parametrize("twin", sorted(TWINS.values()))
def test_twin_runs_in_its_own_machine(twin: str) -> None:
    """A twin (:data:`TWINS`) is still a scheduler the machine builds by its registered name: a few examples
    through its own machine (the full count runs in lockstep with its primary)."""
    assert set(TWINS.values()) <= set(SCHEDULERS) and not set(TWINS) & set(TWINS.values())
    run_state_machine_as_test(shard_machine(twin, 0), settings=settings(settings(), max_examples=10))


def test_lockstep_catches_a_twin_that_plans_differently() -> None:
    """Deliberate break: a twin that plans as ``static`` instead of ``fcfs`` fails the lockstep."""

    class Broken(machine_for("fcfs")):
        @classmethod
        def build_scheduler(cls, config):
            twin = make_scheduler("static", config)
            twin.guarantees = make_scheduler("fcfs", config).guarantees
            return _Lockstep(super().build_scheduler(config), twin)

    with pytest.raises(AssertionError, match="lockstep"):
        run_state_machine_as_test(Broken, settings=settings(QUICK, max_examples=200, phases=(Phase.generate,)))


def test_the_shards_run_different_examples_reproducibly() -> None:
    """Derandomized, two shards of one policy draw different configs (distinct seeds: copies of one
    stream would run a fraction of the claimed examples), and a shard run twice draws the same ones."""
    drawn: list[list[SchedulerConfig]] = []
    small = settings(max_examples=8, stateful_step_count=5, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))
    for shard in (0, 1, 0):
        seen: list[SchedulerConfig] = []
        drawn.append(seen)

        class Recording(shard_machine("fcfs", shard, derandomize=True)):
            @classmethod
            def build_scheduler(cls, config, _seen=seen):
                _seen.append(config)
                return super().build_scheduler(config)

        run_state_machine_as_test(Recording, settings=small)
    assert drawn[0] and drawn[0] != drawn[1] and drawn[0] == drawn[2]


def test_machine_for_is_cached_and_has_a_testcase() -> None:
    assert machine_for("fcfs") is machine_for("fcfs")
    assert machine_for("fcfs") is not machine_for("static")
    assert machine_for("shortest-prompt-first").__name__ == "ShortestPromptFirstStateMachine"
    assert hasattr(machine_for("fcfs").TestCase, "runTest")


class _Adapter:
    """Wraps a reference scheduler as an engine adapter would: no ``state`` attribute, only the protocol.
    ``plan_hook`` may rewrite each plan; ``report_finished`` may lie about what finished."""

    def __init__(self, config: SchedulerConfig, plan_hook=None, report_finished: bool = True) -> None:
        self.inner = make_scheduler("fcfs", config)
        self.name = "adapter"
        self.guarantees = self.inner.guarantees
        self.plan_hook = plan_hook
        self.report_finished = report_finished

    def add_request(self, request: Request) -> None:
        self.inner.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.inner.abort_request(request_id)

    def schedule(self) -> StepPlan:
        plan = self.inner.schedule()
        return self.plan_hook(self.inner.state, plan) if self.plan_hook else plan

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int]) -> tuple[str, ...]:
        finished = self.inner.update(plan, sampled_token_ids)
        return finished if self.report_finished else ()


QUICK = settings(max_examples=200, stateful_step_count=30, deadline=None, derandomize=True, database=None,
                 phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))


def test_machine_works_for_an_adapter_without_state() -> None:
    class AdapterMachine(SchedulerStateMachine):
        @classmethod
        def build_scheduler(cls, config):
            return _Adapter(config)

    run_state_machine_as_test(AdapterMachine, settings=settings(QUICK, max_examples=25))


def test_machine_stamps_arrivals_on_its_clock_in_order_of_addition() -> None:
    """Issue 24: a request added before step ``n`` arrives at ``n * MACHINE_STEP_SECONDS`` on the machine's
    clock, several before one step each the next float after the one before, so the times strictly
    increase in the order of addition (before the fix every arrival had 0 s)."""
    examples: list[list[Request]] = []

    class Recording(_Adapter):
        def add_request(self, request: Request) -> None:
            examples[-1].append(request)
            super().add_request(request)

    class ClockMachine(SchedulerStateMachine):
        @classmethod
        def build_scheduler(cls, config):
            examples.append([])
            return Recording(config)

    run_state_machine_as_test(ClockMachine, settings=settings(QUICK, max_examples=40))
    steps_apart = 0
    for added in examples:
        times = [r.arrival_time for r in added]
        assert times == sorted(times) and len(set(times)) == len(times), times
        for request in added:
            expected = request.arrival_step * MACHINE_STEP_SECONDS
            assert math.isclose(request.arrival_time, expected, rel_tol=1e-9, abs_tol=1e-12), (request, expected)
        steps_apart += len({r.arrival_step for r in added}) > 1
    assert steps_apart, "no example added requests before two different steps"


def _two_token_decodes(state, plan: StepPlan) -> StepPlan:
    items = tuple(
        attrs.evolve(item, num_tokens=2) if state.requests[item.request_id].num_pending_tokens == 1 else item
        for item in plan.scheduled
    )
    return attrs.evolve(plan, scheduled=items)


def _keep_one_impossible(state, plan: StepPlan) -> StepPlan:
    return attrs.evolve(plan, rejected=plan.rejected[1:])


@pytest.mark.parametrize(
    ("plan_hook", "report_finished", "expected"),
    [
        (_two_token_decodes, True, "no-overcompute"),
        (_keep_one_impossible, True, "reject-only-impossible"),
        (None, False, "says finished"),
    ],
    ids=["decode-with-two-tokens", "impossible-request-not-rejected", "lies-about-finished"],
)
def test_machine_catches_a_broken_adapter(plan_hook, report_finished: bool, expected: str) -> None:
    class BrokenMachine(SchedulerStateMachine):
        @classmethod
        def build_scheduler(cls, config):
            return _Adapter(config, plan_hook, report_finished)

    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(BrokenMachine, settings=QUICK)
    assert expected in str(caught.value)


def test_config_strategy_can_be_narrowed_by_a_subclass() -> None:
    seen: list[SchedulerConfig] = []

    class Narrow(machine_for("fcfs")):
        @classmethod
        def configs(cls):
            return scheduler_configs(max_model_len=8, max_kv_blocks=2, chunked_prefill=False)

        @classmethod
        def build_scheduler(cls, config):
            seen.append(config)
            return super().build_scheduler(config)

    run_state_machine_as_test(Narrow, settings=settings(QUICK, max_examples=20))
    assert seen and all(c.max_model_len <= 8 and c.num_kv_blocks <= 2 and not c.enable_chunked_prefill for c in seen)
