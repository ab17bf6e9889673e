"""The engine hands its own spec transitions to a reference scheduler (ReferenceScheduler.accept_transition),
which uses one only for exactly the same transition, and the engine still catches a scheduler whose state
goes its own way."""

from __future__ import annotations

import attrs

from schedspec.reference import scheduler as scheduler_module
from schedspec.reference.engine import Engine
from schedspec.reference.scheduler import ReferenceScheduler, make_scheduler
from schedspec.spec import stepper as stepper_module
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request
from schedspec.spec.stepper import Stepper
from schedspec.spec.workload import RequestSpec

CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=32, max_num_batched_tokens=16, max_num_seqs=4,
                         max_model_len=64)
WORKLOAD = [RequestSpec("A", 6, 10, arrival_step=0), RequestSpec("B", 20, 5, arrival_step=1),
            RequestSpec("C", 9, 7, arrival_step=3, abort_at_step=6)]


def test_a_reference_scheduler_reuses_the_engines_transitions(monkeypatch):
    calls = {"engine": 0, "scheduler": 0}
    for module, key in ((stepper_module, "engine"), (scheduler_module, "scheduler")):
        original = module.apply_plan

        def counted(*args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "apply_plan", counted)
    run = Engine(make_scheduler("fcfs", CONFIG), CONFIG).run(WORKLOAD)
    assert run.ok, run.violations
    assert calls["engine"] == run.num_steps > 0
    assert calls["scheduler"] == 0, "every update took the engine's transition"


class DropsPriority(ReferenceScheduler):
    """A scheduler with a bug in its own bookkeeping: it records every arrival with priority 7."""

    def add_request(self, request: Request) -> None:
        super().add_request(attrs.evolve(request, priority=7))


def test_a_scheduler_whose_state_differs_is_still_caught():
    base = make_scheduler("fcfs", CONFIG)
    buggy = DropsPriority(CONFIG, base.plan_function, "drops-priority", base.guarantees)
    run = Engine(buggy, CONFIG).run(WORKLOAD)
    assert any(v.name == "state-mismatch" and v.request_id == "A" and "priority" in v.detail
               for v in run.violations), run.violations


def test_a_handed_transition_is_used_once_and_only_for_the_same_objects():
    scheduler = make_scheduler("fcfs", CONFIG)
    stepper = Stepper(CONFIG, state=scheduler.state)
    request = RequestSpec("A", 6, 10, arrival_step=0).to_request(0)
    twin = RequestSpec("A", 6, 10, arrival_step=0).to_request(0)  # equal, another object
    handed = stepper.arrive(request)
    assert handed.matches("add_request", scheduler.state, request, CONFIG)
    assert not handed.matches("add_request", scheduler.state, twin, CONFIG)
    assert not handed.matches("abort_request", scheduler.state, request, CONFIG)
    assert not handed.matches("add_request", handed.result, request, CONFIG)  # another state object
    assert not handed.matches("add_request", scheduler.state, request, attrs.evolve(CONFIG, max_num_seqs=3))
    scheduler.accept_transition(handed)
    scheduler.add_request(twin)  # not the handed transition: computed, and the hand-off is spent
    assert scheduler.state is not handed.result and scheduler.state == handed.result
    other = make_scheduler("fcfs", CONFIG)
    other.state = handed.before
    other.accept_transition(handed)
    other.add_request(request)
    assert other.state is handed.result
    other.abort_request("A")  # the hand-off was used once: this one is computed
    assert "A" in other.state.finished
