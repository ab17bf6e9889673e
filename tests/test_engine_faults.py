"""A scheduler under test that hangs or crashes is a finding, never a hang or a traceback of schedspec:
a hung one ends the run after ``max_model_len`` steps without progress with a ``progress`` violation,
whether or not it promised progress (the lab used to spin forever); one that raises, or returns something
that is not a plan, is an ``EngineFault`` the CLI reports in one line with exit 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from schedspec.reference.engine import Engine, ViolationFound
from schedspec.reference.fake_model import CostOnlyModel
from schedspec.reference.scheduler import EngineFault, make_scheduler
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.state import StepPlan
from schedspec.spec.workload import RequestSpec

CONFIG = SchedulerConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                         max_model_len=32)


class Idle:
    """fcfs that admits nothing and schedules nothing (a hung engine)."""

    def __init__(self, guarantees: frozenset[str], config: SchedulerConfig = CONFIG) -> None:
        self.inner = make_scheduler("fcfs", config)
        self.guarantees = guarantees
        self.name = "idle"

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def schedule(self) -> StepPlan:
        return StepPlan()


@pytest.mark.parametrize("guarantees", [frozenset(), frozenset({"progress"})])
@pytest.mark.parametrize("mode", ["time", "steps"])
def test_a_hung_scheduler_stops_the_run_with_a_progress_violation(guarantees, mode):
    workload = [RequestSpec(f"r{i}", prompt_len=5, max_tokens=3, arrival_step=0, arrival_time=0.0)
                for i in range(2)]
    # max_steps only bounds the test if the guard is broken (then num_steps is 10x too many)
    run = Engine(Idle(guarantees), CONFIG, check=True, record_steps=False).run(
        workload, mode=mode, max_steps=10 * CONFIG.max_model_len)
    assert run.num_steps == CONFIG.max_model_len
    assert [v.name for v in run.violations] == ["progress"]
    assert set(run.state.requests) == {"r0", "r1"}, "nothing was lost: both are still live, not dropped"


def test_a_scheduler_that_progresses_is_not_stopped():
    workload = [RequestSpec("r0", prompt_len=5, max_tokens=3, arrival_step=0, arrival_time=0.0)]
    run = Engine(make_scheduler("fcfs", CONFIG), CONFIG, record_steps=False).run(workload, mode="time")
    assert not run.violations and not run.state.requests


class Faulty(Idle):
    """fcfs whose ``schedule`` or ``update`` misbehaves as ``fault`` says."""

    def __init__(self, fault: str, config: SchedulerConfig = CONFIG) -> None:
        super().__init__(frozenset(), config)
        self.fault = fault
        self.name = f"faulty-{fault}"

    def schedule(self):
        if self.fault == "raises":
            raise RuntimeError("boom [red]x[/red]")
        if self.fault == "none":
            return None
        return self.inner.schedule()

    def update(self, plan, sampled):
        if self.fault == "update-raises":
            raise KeyError("lost")
        return self.inner.update(plan, sampled)


@pytest.mark.parametrize("fault, operation, detail", [
    ("raises", "schedule", "RuntimeError: boom"),
    ("none", "schedule", "returned a NoneType, not a StepPlan"),
    ("update-raises", "update", "KeyError"),
])
def test_a_crashing_scheduler_is_an_engine_fault_naming_the_call_and_step(fault, operation, detail):
    workload = [RequestSpec("r0", prompt_len=5, max_tokens=3, arrival_step=0, arrival_time=0.0)]
    with pytest.raises(EngineFault) as caught:
        Engine(Faulty(fault), CONFIG, record_steps=False).run(workload, mode="steps")
    assert caught.value.operation == operation and caught.value.step == 0
    assert detail in caught.value.detail


def raising(config):
    """A ``module:factory`` whose scheduler raises in ``schedule`` (for the CLI test below)."""
    return Faulty("raises", config)


def test_lab_and_replay_report_a_crashing_scheduler_in_one_line():
    root = Path(__file__).resolve().parents[1]
    scheduler = "tests.test_engine_faults:raising"
    case = root / "schedspec" / "data" / "cases" / "slot-freed-is-reused.json"
    for args in (("lab", "--scheduler", scheduler, "--max-requests", "5", "--steps", "none"),
                 ("replay", "--scheduler", scheduler, str(case))):
        result = subprocess.run([sys.executable, "-m", "schedspec", *args], capture_output=True, text=True,
                                cwd=root, timeout=300)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stdout + result.stderr
        assert "boom [red]x[/red]" in result.stdout, "user text printed as text, not markup"


class Misbehaving(Idle):
    """fcfs that breaks the spec once, at step 1, as ``fault`` says: ``plan`` hands out no block for a
    prefill that needs some (a rule), ``finished`` reports a running request as finished (a refinement
    mismatch)."""

    def __init__(self, fault: str) -> None:
        super().__init__(frozenset())
        self.fault = fault

    def schedule(self) -> StepPlan:
        plan = self.inner.schedule()
        if self.fault == "plan" and self.inner.state.step == 1:
            plan = attrs.evolve(plan, scheduled=tuple(attrs.evolve(i, new_block_ids=()) if i.request_id == "r1"
                                                      else i for i in plan.scheduled))
        return plan

    def update(self, plan, sampled_token_ids):
        step = self.inner.state.step
        finished = self.inner.update(plan, sampled_token_ids)
        if self.fault == "finished" and step == 1:
            return (*finished, "r0")
        return finished


@pytest.mark.parametrize(("fault", "names"), [("plan", {"block-table-covers"}), ("finished", {"refinement"})])
def test_stop_on_violation_stops_at_the_first_violation_a_full_run_records(fault, names):
    """The same violations end a ``stop_on_violation`` run (ViolationFound) and are the first ones a run
    without it records, at step 1; without it the run goes on to the end."""
    workload = [RequestSpec("r0", prompt_len=3, max_tokens=4, arrival_step=0),
                RequestSpec("r1", prompt_len=9, max_tokens=2, arrival_step=1)]
    # CostOnlyModel: FakeModel writes KV through the block table, which the broken plan leaves short.
    full = Engine(Misbehaving(fault), CONFIG, CostOnlyModel(CONFIG), record_steps=False).run(workload)
    assert names <= {v.name for v in full.violations}
    first = [v for v in full.violations if v.step == min(v.step for v in full.violations)]
    assert {v.step for v in first} == {1} and names <= {v.name for v in first}
    with pytest.raises(ViolationFound) as caught:
        Engine(Misbehaving(fault), CONFIG, CostOnlyModel(CONFIG), record_steps=False,
               stop_on_violation=True).run(workload)
    assert [str(v) for v in caught.value.violations] == [str(v) for v in first][:len(caught.value.violations)]
    assert names <= {v.name for v in caught.value.violations}
    assert full.num_steps > 2
