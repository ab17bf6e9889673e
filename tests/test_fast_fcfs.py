"""``fcfs-fast`` refines the plain ``fcfs`` scheduler: the same plan and the same spec state after every
call, step for step.

The two are driven in lockstep by Hypothesis (arrivals, bursts, aborts of waiting and running requests,
steps that preempt, chunk, stop on EOS, a stop id, ``max_tokens`` or ``max_model_len``, and requests
rejected as impossible), and on every bundled scenario through the engine with every check on. Cost
on a 2-core machine: a few seconds by default, about 20 s with ``HYPOTHESIS_PROFILE=ci`` (500 derandomized
examples of up to 60 actions).
"""

from __future__ import annotations

import random

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedspec.reference.engine import Engine
from schedspec.reference.fast_fcfs import FastFcfsScheduler, fcfs_fast
from schedspec.reference.kv_connector import uses_kv_connector
from schedspec.reference.scenarios import _run, bundled_scenarios, load_scenario, replay
from schedspec.reference.scheduler import (
    ReferenceScheduler,
    UnsupportedFeature,
    make_scheduler,
    state_differences,
)
from schedspec.spec.config import ConfigError, SchedulerConfig
from schedspec.spec.request import Request
from schedspec.spec.state import SchedulerState, samples_this_step
from schedspec.spec.transitions import PlanError
from schedspec.strategies import scheduler_configs

EOS = 0
STOP = 5


def assert_same_state(plain: SchedulerState, fast: SchedulerState, where: str) -> None:
    differences = state_differences(plain, fast, tuple(plain.finished))
    assert not differences, f"{where}: {differences[:5]}"
    assert plain.waiting == fast.waiting and plain.running == fast.running, where
    assert plain.free_block_ids == fast.free_block_ids, where
    assert dict(plain.requests) == dict(fast.requests), where
    assert dict(plain.finished) == dict(fast.finished), where
    assert plain == fast, where


actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.one_of(st.integers(1, 24), st.integers(0, 70)), st.integers(0, 40),
                  st.integers(0, 3), st.integers(1, 4)),
        st.tuples(st.just("step"), st.integers(1, 12)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
    ),
    min_size=1, max_size=60,
)


@settings(deadline=None, suppress_health_check=list(HealthCheck))  # examples: the active profile's
@given(config=st.one_of(scheduler_configs(), scheduler_configs(max_block_size=2, max_kv_blocks=12, max_model_len=40)),
       actions=actions, seed=st.integers(0, 2**16))
def test_same_plans_and_states_as_fcfs(config: SchedulerConfig, actions: list[tuple], seed: int) -> None:
    plain = make_scheduler("fcfs", config)
    fast = FastFcfsScheduler(config)
    rng = random.Random(seed)
    added = 0
    for index, action in enumerate(actions):
        where = f"action {index} {action}"
        if action[0] == "add":
            _, prompt_len, max_tokens, kind, count = action
            for _ in range(count):  # a burst of requests of one shape
                request = Request(f"r{added}", plain.state.step, [1 + (added + k) % 7 for k in range(prompt_len)],
                                  max_tokens, eos_token_id=EOS if kind != 3 else None,
                                  stop_token_ids=(STOP,) if kind == 2 else (), min_tokens=2 if kind == 1 else 0)
                added += 1
                plain.add_request(request)
                fast.add_request(request)
        elif action[0] == "abort":
            live = list(plain.state.requests) + ["never-added"]
            request_id = live[action[1] % len(live)]
            plain.abort_request(request_id)
            fast.abort_request(request_id)
        else:
            for _ in range(action[1]):
                before = plain.state
                plan = plain.schedule()
                assert fast.schedule() == plan, where
                sampled = {item.request_id: rng.choice((EOS, STOP, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11))
                           for item in plan.scheduled
                           if samples_this_step(before.requests[item.request_id], item)}
                assert fast.update(plan, sampled) == plain.update(plan, sampled), where
                view_before, view_after = fast.step_views()  # what the lab's statistics read
                for item in plan.scheduled:
                    request = before.requests[item.request_id]
                    phase = view_before.requests[item.request_id]
                    assert (phase.is_decode, phase.prompt_len) == (request.is_decode, request.prompt_len), where
                assert (len(view_after.running), len(view_after.waiting), len(view_after.free_block_ids)) == (
                    len(plain.state.running), len(plain.state.waiting), len(plain.state.free_block_ids)), where
                assert_same_state(plain.state, fast.state, where)
        assert_same_state(plain.state, fast.state, where)
        assert fast.has_live_requests == bool(plain.state.requests)


def test_same_errors_as_the_spec() -> None:
    config = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4,
                             max_model_len=32)
    fast = FastFcfsScheduler(config)
    fast.add_request(Request("a", 0, [1, 2, 3], 4))
    with pytest.raises(PlanError, match="already added"):
        fast.add_request(Request("a", 0, [1, 2, 3], 4))
    with pytest.raises(PlanError, match="max_tokens=-1"):
        fast.add_request(Request("b", 0, [1], -1))
    plan = fast.schedule()
    with pytest.raises(PlanError, match="no sampled token"):
        fast.update(plan, {})


def test_a_broken_fast_path_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: a fast scheduler that frees a finished request's blocks in the wrong
    order differs from the spec's state."""
    config = SchedulerConfig(block_size=2, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4,
                             max_model_len=32)
    plain, fast = make_scheduler("fcfs", config), FastFcfsScheduler(config)
    for scheduler in (plain, fast):
        scheduler.add_request(Request("a", 0, [1, 2, 3, 4, 5], 1))
    plan = plain.schedule()
    assert fast.schedule() == plan
    plain.update(plan, {"a": 1})
    fast.update(plan, {"a": 1})
    fast.free[-3:] = fast.free[-3:][::-1]  # the blocks freed by "a", in the wrong order
    fast._state = None
    with pytest.raises(AssertionError):
        assert_same_state(plain.state, fast.state, "deliberate break")


def test_prefix_caching_falls_back_to_the_plain_policy() -> None:
    config = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4,
                             max_model_len=32, enable_prefix_caching=True)
    scheduler = fcfs_fast(config)
    assert isinstance(scheduler, ReferenceScheduler) and scheduler.name == "fcfs-fast"
    with pytest.raises(ValueError, match="prefix caching"):
        FastFcfsScheduler(config)


@pytest.mark.parametrize("path", [p for p in bundled_scenarios()], ids=lambda p: p.stem)
def test_bundled_scenarios_same_as_fcfs(path) -> None:
    """Every bundled scenario, run by the engine with every check on: fcfs-fast breaks no rule,
    invariant or property fcfs keeps, and ends in the same state with the same steps."""
    scenario = load_scenario(path)
    try:
        config = SchedulerConfig.from_dict(dict(scenario.config))
    except ConfigError:
        pytest.skip("the scenario's config is refused (a config-error scenario)")
    if config.enable_prefix_caching:
        pytest.skip("fcfs-fast falls back to the plain fcfs with prefix caching")
    if any(r.grammar_compile_steps is not None for r in scenario.requests):
        with pytest.raises(UnsupportedFeature, match="structured output"):
            _run(scenario, "fcfs-fast", config, scenario.requests)
        pytest.skip("structured output: fcfs-fast refuses it (UnsupportedFeature, asserted), use fcfs")
    if uses_kv_connector(scenario.requests):
        with pytest.raises(UnsupportedFeature, match="remote KV"):
            _run(scenario, "fcfs-fast", config, scenario.requests)
        pytest.skip("remote KV loads and sends: fcfs-fast refuses them (UnsupportedFeature, asserted), use fcfs")
    requests = scenario.requests
    plain = _run(scenario, "fcfs", config, requests)
    fast = _run(scenario, "fcfs-fast", config, requests)
    assert fast.violations == plain.violations
    assert fast.num_steps == plain.num_steps
    assert [r.to_json() for r in fast.records] == [r.to_json() for r in plain.records]
    assert_same_state(plain.state, fast.state, path.name)
    if (scenario.scheduler or scenario.policy or "fcfs") == "fcfs":
        assert replay(scenario, "fcfs-fast").passed == replay(scenario, "fcfs").passed


def test_engine_fast_path_same_run_as_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With checks off the engine drives fcfs-fast without spec states; the run ends in the same state
    and the same step count as a fully checked run of the plain fcfs."""
    from schedspec.reference.fake_model import CostOnlyModel
    from schedspec.spec.workload import RequestSpec

    config = SchedulerConfig(block_size=4, num_kv_blocks=40, max_num_batched_tokens=32, max_num_seqs=6,
                             max_model_len=96)
    rng = random.Random(7)
    workload = [RequestSpec(f"r{i}", prompt_len=rng.randint(1, 60), max_tokens=rng.randint(1, 30),
                            arrival_time=i * 0.01, eos_token_id=EOS,
                            abort_at_time=i * 0.01 + 0.05 if i % 11 == 5 else None) for i in range(60)]
    views = []
    fast = Engine(make_scheduler("fcfs-fast", config), config, token_source=CostOnlyModel(config), check=False,
                  properties=(), record_steps=False, on_step_view=lambda v: views.append(
                      (v.step, [v.before.requests[i.request_id].is_decode for i in v.plan.scheduled],
                       len(v.after.running), len(v.after.waiting), len(v.after.free_block_ids), v.finished)))
    plain_views = []
    plain = Engine(make_scheduler("fcfs", config), config, token_source=CostOnlyModel(config), check=True,
                   record_steps=False, on_step_view=lambda v: plain_views.append(
                       (v.step, [v.before.requests[i.request_id].is_decode for i in v.plan.scheduled],
                        len(v.after.running), len(v.after.waiting), len(v.after.free_block_ids), v.finished)))
    fast_run, plain_run = fast.run(workload, mode="time"), plain.run(workload, mode="time")
    assert plain_run.ok
    assert views == plain_views
    assert fast_run.num_steps == plain_run.num_steps
    assert_same_state(plain_run.state, fast_run.state, "end of run")


def test_lab_statistics_same_as_plain_fcfs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unchecked lab run (fcfs as fcfs-fast, no spec states) gives the same per-step statistics and
    request timelines as the plain fcfs, on the first 300 requests of the bundled Azure trace with a
    small KV cache (preemptions) and a small budget (chunked prefills)."""
    from schedspec.lab import trace_formats, windows
    from schedspec.lab.run import run_lab
    from schedspec.reference import cost_model
    from schedspec.reference import scheduler as registry

    requests = windows.select_window(trace_formats.load_trace(trace_formats.default_trace_path()), max_requests=300)
    kwargs, _ = cost_model.default_scheduler_config()
    config = SchedulerConfig(**{**kwargs, "num_kv_blocks": 2000, "max_num_batched_tokens": 512})
    fast = run_lab(requests, "fcfs", config, check=False)
    monkeypatch.setitem(registry.REGISTRY, "fcfs", attrs.evolve(registry.REGISTRY["fcfs"], unchecked=None))
    plain = run_lab(requests, "fcfs", config, check=False)
    assert sum(step.num_preempted for step in plain.steps) > 0
    assert fast.steps == plain.steps
    assert fast.timelines == plain.timelines
    assert_same_state(plain.run.state, fast.run.state, "end of the lab run")
