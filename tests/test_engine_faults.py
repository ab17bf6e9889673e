"""A scheduler under test that hangs or crashes is a finding, never a hang or a traceback of schedspec:
a hung one ends the run after ``max_model_len`` steps without progress with a ``progress`` violation,
whether or not it promised progress (the lab used to spin forever); one that raises, or returns something
that is not a plan, is an ``EngineFault`` the CLI reports in one line with exit 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from schedspec.reference.engine import Engine
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
