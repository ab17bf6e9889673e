"""Real arrival clocks (issue 24): every arrival reaches the scheduler with the time it arrives on the
engine's clock (the start of its step on the simulated clock, or the trace's time), strictly increasing
in the order of addition, as a serving engine stamps it; never 0 s for all, and never ordered by id.

The bundled case ``equal-priority-older-first`` (a copy of the shared case) is the end-to-end check: a
profile of vLLM's priority queue (``(priority, arrival_time, request_id)``) admits the older request
only if arrival times are real. Each check here is shown able to fail: with every arrival put back at
0 s (the behaviour before the fix, ``arrivals_at_zero``) the same assertions fail.
"""

from __future__ import annotations

import math

import attrs
import pytest

from schedspec.reference.engine import Engine
from schedspec.reference.fake_model import CostOnlyModel
from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
from schedspec.reference.scheduler import make_scheduler
from schedspec.spec import workload
from schedspec.spec.checker import check_trace
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.workload import ArrivalClock, RequestSpec

CASE = next(p for p in bundled_scenarios() if p.stem == "equal-priority-older-first")
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=32, max_num_batched_tokens=16, max_num_seqs=4,
                         max_model_len=64)


@pytest.fixture
def arrivals_at_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine loop before issue 24: every arrival keeps ``arrival_time = 0.0``."""
    monkeypatch.setattr(workload.ArrivalClock, "stamped",
                        lambda self, spec, now: attrs.evolve(spec, arrival_time=0.0))


def test_stamps_are_now_or_the_next_float_after_the_last() -> None:
    clock = ArrivalClock()
    assert clock.stamp(0.0) == 0.0
    assert clock.stamp(0.0) == math.nextafter(0.0, 1.0)  # a second arrival at the same time: later
    assert clock.stamp(0.0) == math.nextafter(math.nextafter(0.0, 1.0), 1.0)
    assert clock.stamp(0.25) == 0.25
    assert clock.stamp(0.1) == math.nextafter(0.25, 1.0)  # never back in time
    assert clock.stamp(2.0) == 2.0


def test_stamped_keeps_an_unchanged_descriptor() -> None:
    clock = ArrivalClock()
    spec = RequestSpec("a", 4, 2, arrival_time=1.5)
    assert clock.stamped(spec, 1.5) is spec
    later = clock.stamped(spec, 1.5)
    assert later.arrival_time > 1.5 and attrs.evolve(later, arrival_time=1.5) == spec


def _arrival_times(records) -> list[tuple[int, float, str]]:
    return [(record.step, spec.arrival_time, spec.request_id) for record in records for spec in record.arrivals]


def test_steps_mode_stamps_the_step_start_in_order_of_addition() -> None:
    """Ids in the opposite order of addition: ``z`` is added before ``a`` in step 0, so it is older; ``m``
    arrives before step 3 at that step's start; the scheduler's requests carry the same times."""
    workload_specs = [RequestSpec("z", 6, 4, arrival_step=0), RequestSpec("a", 6, 4, arrival_step=0),
                      RequestSpec("m", 5, 3, arrival_step=3)]
    scheduler = make_scheduler("fcfs", CONFIG)
    seen = {}
    original = scheduler.add_request

    def add(request):
        seen[request.request_id] = request.arrival_time
        original(request)

    scheduler.add_request = add
    result = Engine(scheduler, CONFIG).run(workload_specs, mode="steps")
    assert result.ok, result.violations
    times = {request_id: time for _, time, request_id in _arrival_times(result.records)}
    starts = {record.step: record.start_time for record in result.records}
    assert starts[3] > 0.0  # the fake model's steps take time
    assert times["z"] == starts[0] == 0.0
    assert times["a"] == math.nextafter(0.0, 1.0)
    assert times["m"] == starts[3]
    assert seen == times


def test_steps_mode_gives_distinct_times_even_at_zero_cost() -> None:
    """Steps that take 0 s (a cost model of zero) still give each arrival a later time than the one
    before it."""

    class Free:
        def step_seconds(self, prefill_tokens, decode_tokens, kv_tokens):
            return 0.0

    specs = [RequestSpec(f"r{k}", 3, 2, arrival_step=k // 2) for k in range(6)]
    result = Engine(make_scheduler("fcfs", CONFIG), CONFIG,
                    token_source=CostOnlyModel(CONFIG, Free())).run(specs, mode="steps")
    times = [time for _, time, _ in _arrival_times(result.records)]
    assert times == sorted(times) and len(set(times)) == len(times)


def test_time_mode_keeps_the_trace_time_and_orders_equal_times_by_addition() -> None:
    specs = [RequestSpec("b", 6, 3, arrival_time=0.5), RequestSpec("a", 6, 3, arrival_time=0.5),
             RequestSpec("c", 6, 3, arrival_time=0.75)]
    result = Engine(make_scheduler("fcfs", CONFIG), CONFIG).run(specs, mode="time")
    times = {request_id: time for _, time, request_id in _arrival_times(result.records)}
    assert times == {"b": 0.5, "a": math.nextafter(0.5, 1.0), "c": 0.75}


def test_fast_path_stamps_the_same_times_as_the_checked_loop() -> None:
    specs = [RequestSpec(f"r{k}", 5 + k, 3, arrival_time=0.001 * (k // 3)) for k in range(12)]

    def times(name: str, check: bool) -> dict[str, float]:
        found = {}
        engine = Engine(make_scheduler(name, CONFIG), CONFIG, token_source=CostOnlyModel(CONFIG), check=check,
                        properties=(), record_steps=False,
                        on_step_view=lambda v: found.update({s.request_id: s.arrival_time for s in v.arrivals}))
        engine.run(specs, mode="time")
        return found

    fast = times("fcfs-fast", False)
    assert fast == times("fcfs", True)
    assert len(set(fast.values())) == len(specs)


def test_a_stamped_trace_passes_the_checker() -> None:
    """The records list the stamped descriptors; the checker replays them and accepts every arrival
    (an ``arrival_time`` no later than its step's start, within its tolerance)."""
    specs = [RequestSpec(f"r{k}", 4 + k, 3, arrival_step=k // 3) for k in range(9)]
    result = Engine(make_scheduler("priority", CONFIG), CONFIG).run(specs, mode="steps")
    assert len({time for _, time, _ in _arrival_times(result.records)}) == 9
    report = check_trace(CONFIG, result.records)
    assert report.ok, report


@pytest.mark.parametrize("scheduler", ["vllm-v1-priority", "priority"])
def test_equal_priority_older_first_meets_its_expectations(scheduler: str) -> None:
    result = replay(load_scenario(CASE), scheduler)
    assert result.passed, [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]


def test_equal_priority_older_first_fails_on_the_profile_with_arrivals_at_zero(arrivals_at_zero) -> None:
    """The check can fail: with every arrival at 0 s, ``vllm-v1-priority`` breaks the tie by id and
    admits ``a-late`` first (``z-early``'s first token in step 23, the case's bound is 13)."""
    verdicts = {v.name: v for v in replay(load_scenario(CASE), "vllm-v1-priority").verdicts}
    assert not verdicts["first_token_by_step[z-early]"].passed
    assert "step 23" in verdicts["first_token_by_step[z-early]"].detail
