"""The trace property ``no-priority-inversion``: registered, checked by ``schedspec check --property``,
seen to fail where a less urgent running request holds what an urgent waiting one lacks (fcfs, a
hand-made trace, vLLM's priority profile, the priority policy's documented gap) and silent where it
does not (equal priorities, a request that would not fit anyway, the priority scenarios).
Cost: about 3 s (two ``schedspec check`` subprocesses, a few short engine runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from schedspec.reference.engine import Engine
from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
from schedspec.reference.scheduler import SCHEDULERS, make_scheduler
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.properties import PROPERTIES, NoPriorityInversion, monitors
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.transitions import add_request, apply_plan
from schedspec.spec.workload import RequestSpec

NAME = "no-priority-inversion"
CASES = {p.stem: p for p in bundled_scenarios()}


def _run(case: str, scheduler: str) -> list:
    scenario = load_scenario(CASES[case])
    config = SchedulerConfig.from_dict({k: v for k, v in scenario.config.items() if k != "policy"})
    run = Engine(make_scheduler(scheduler, config), config, properties=[], watch=[NAME]).run(list(scenario.requests))
    assert not run.violations, run.violations
    return run.property_violations[NAME]


def test_registered_with_statement_and_source():
    prop = PROPERTIES[NAME]
    assert prop.monitor is NoPriorityInversion
    assert "kept out only by" in prop.statement and "vLLM 0.32" in prop.source
    assert isinstance(monitors([NAME], SchedulerConfig(16, 8, 8, 1, 8))[0], NoPriorityInversion)


def test_fcfs_counterexample_shows_the_inversion():
    scenario = load_scenario(CASES["counterexample-fcfs-priority-inversion"])
    assert scenario.scheduler == "fcfs" and scenario.expect == {"demonstrates": NAME}
    verdicts = {v.name: v for v in replay(scenario).verdicts}
    assert verdicts["demonstrates"].passed and verdicts["invariants"].passed
    found = _run("counterexample-fcfs-priority-inversion", "fcfs")
    # H arrives before step 2 and waits for L's only slot until L ends (20 outputs: steps 0..19)
    assert [v.step for v in found] == list(range(2, 20))
    assert {v.request_id for v in found} == {"H"} and "max_num_seqs slot" in found[0].detail
    # the priority policy preempts L instead: the same workload shows no inversion
    assert _run("counterexample-fcfs-priority-inversion", "priority") == []


@pytest.mark.parametrize("case", ["priority-preempts-at-seq-cap", "priority-preemption-must-admit"])
def test_priority_scenarios_hold_on_priority_and_fail_on_policies_without_it(case):
    assert _run(case, "priority") == []
    assert _run(case, "fcfs"), "fcfs ignores priorities"
    # vLLM 0.32 never preempts for a waiting request: at max_num_seqs the urgent one waits
    assert any("max_num_seqs slot" in v.detail for v in _run(case, "vllm-v1-priority"))


def test_priority_policy_keeps_and_declares_no_priority_inversion():
    """The priority policy makes room for every waiting request more urgent than a running one, for a slot,
    blocks or budget (policies.plan_by_priority), and declares the property; vLLM's priority profile,
    which never preempts for a waiting request, shows the inversion on the same workloads (the check can
    fail)."""
    # two urgent requests at max_num_seqs (the case that showed the policy's old gap, now a counterexample
    # for fcfs): the second preempts the less urgent L in the same step, both prefill in step 2
    case = "counterexample-priority-inversion-second-urgent"
    assert _run(case, "priority") == []
    scenario = load_scenario(CASES[case])
    config = SchedulerConfig.from_dict(scenario.config)
    run = Engine(make_scheduler("priority", config), config).run(list(scenario.requests))
    assert run.ok and run.records[2].preempted == ("L",)
    assert run.records[2].sampled_token_ids.keys() == {"H1", "H2"}
    verdicts = {v.name: v for v in replay(scenario, "priority").verdicts}
    assert verdicts["invariants"].passed and not verdicts["demonstrates"].passed
    assert [v.request_id for v in _run(case, "vllm-v1-priority")] == ["H2"] * 5  # steps 2..6, until H1 ends
    assert {v.request_id for v in _run(case, "fcfs")} == {"H2"}
    # budget: a less urgent running prefill (L, 320 tokens, chunks of the 16-token budget) no longer takes
    # it all; H (8 tokens, arrives before step 2) is visited first and prefills in step 2
    config = SchedulerConfig(16, 64, 16, 4, 512)
    requests = [RequestSpec("L", 320, 4, arrival_step=0, priority=5), RequestSpec("H", 8, 4, arrival_step=2, priority=0)]
    run = Engine(make_scheduler("priority", config), config, properties=[], watch=[NAME]).run(requests)
    assert not run.violations and run.property_violations[NAME] == []
    assert [s.request_id for s in run.records[2].scheduled] == ["H", "L"]
    assert run.records[2].sampled_token_ids.keys() == {"H"}
    run = Engine(make_scheduler("vllm-v1-priority", config), config, properties=[], watch=[NAME]).run(requests)
    assert len(run.property_violations[NAME]) >= 10
    tiny = SchedulerConfig(16, 8, 8, 1, 8)
    assert {n for n in SCHEDULERS if NAME in SCHEDULERS[n](tiny).guarantees} == {"priority"}


def test_priority_policy_preempts_for_a_waiting_request_with_prefix_caching():
    """With prefix caching the victim's released prefix blocks stay cached, so the urgent request that
    preempted it starts with a hit on them; no rule, invariant or no-priority-inversion breaks."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=1,
                             max_model_len=64, enable_prefix_caching=True)
    requests = [RequestSpec("L", 12, 20, arrival_step=0, priority=5, prefix_group="p", prefix_len=8),
                RequestSpec("H", 12, 4, arrival_step=3, priority=0, prefix_group="p", prefix_len=8)]
    run = Engine(make_scheduler("priority", config), config, properties=[], watch=[NAME]).run(requests)
    assert not run.violations and run.property_violations[NAME] == []
    step = run.records[3]
    assert step.preempted == ("L",) and step.prefix_hit_tokens.get("H") == 8, step
    assert {r for record in run.records for r in record.finished} == {"L", "H"}
    fcfs = Engine(make_scheduler("fcfs", config), config, properties=[], watch=[NAME]).run(requests)
    assert {v.request_id for v in fcfs.property_violations[NAME]} == {"H"}


# --- the statement's edges, on hand-built states ------------------------------------------------------

def _state(config: SchedulerConfig, running: list[tuple[str, int, int]], waiting: list[tuple[str, int, int]]):
    """A state with ``running`` (id, priority, prompt_len) admitted whole in step 0 and ``waiting`` added
    after it; the fake tokens are 7."""
    state = SchedulerState.initial(config)
    for request_id, priority, prompt_len in running:
        state = add_request(state, RequestSpec(request_id, prompt_len, 50, priority=priority).to_request(0))
    items, free = [], list(state.free_block_ids)
    for request_id, _, prompt_len in running:
        count = -(-prompt_len // config.block_size)
        items.append(ScheduledRequest(request_id, 0, prompt_len, tuple(free[:count])))
        free = free[count:]
    state = apply_plan(state, StepPlan(tuple(items)), {r: 7 for r, _, _ in running}, config).state
    for request_id, priority, prompt_len in waiting:
        state = add_request(state, RequestSpec(request_id, prompt_len, 5, priority=priority).to_request(1))
    return state


def _observe(config: SchedulerConfig, state: SchedulerState, plan: StepPlan) -> list:
    monitor = NoPriorityInversion(config)
    after = apply_plan(state, plan, {i.request_id: 7 for i in plan.scheduled}, config).state
    monitor.observe(state, plan, after)
    return monitor.violations


def _decodes(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    items = []
    free = list(state.free_block_ids)
    for request_id in state.running:
        request = state.requests[request_id]
        need = -(-(request.num_computed_tokens + 1) // config.block_size) - len(request.block_ids)
        items.append(ScheduledRequest(request_id, request.num_computed_tokens, 1, tuple(free[:need])))
        free = free[need:]
    return StepPlan(tuple(items))


def test_slot_held_by_less_urgent_is_an_inversion_equal_priority_is_not():
    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=1, max_model_len=64)
    state = _state(config, [("L", 5, 4)], [("H", 0, 4)])
    found = _observe(config, state, _decodes(state, config))
    assert [(v.request_id, v.step) for v in found] == [("H", 1)] and "max_num_seqs slot" in found[0].detail
    same = _state(config, [("L", 5, 4)], [("H", 5, 4)])
    assert _observe(config, same, _decodes(same, config)) == []
    more_urgent_runs = _state(config, [("L", 0, 4)], [("H", 5, 4)])
    assert _observe(config, more_urgent_runs, _decodes(more_urgent_runs, config)) == []


def test_the_blocks_a_waiting_request_needs_include_the_lookahead():
    """With speculative decoding's lookahead, admission must give a table ``slot_tokens`` (the sequence
    plus ``num_lookahead_tokens``), so H (4 tokens, 1 block; 2 with a lookahead of 3) does not fit the one
    free block and L holds what it lacks; without the lookahead H fits and nothing is inverted."""
    plain = SchedulerConfig(block_size=4, num_kv_blocks=3, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=64)
    for config, inverted in ((plain, False),
                             (plain.with_changes(num_speculative_tokens=3), False),
                             (plain.with_changes(num_speculative_tokens=3, num_lookahead_tokens=3), True)):
        state = _state(config, [("L", 5, 4)], [("H", 0, 4)])
        found = _observe(config, state, _decodes(state, config))
        assert bool(found) == inverted, (config, found)
        if inverted:
            assert "2 blocks (1 free)" in found[0].detail, found


def test_blocks_and_budget_held_count_but_a_request_that_would_not_fit_anyway_does_not():
    # 4 blocks of 4 tokens: M (priority 0) and L (priority 5) each hold 1 block and their decodes (5
    # tokens) take the last 2. H8 (priority 1, 8 tokens) needs 2 blocks: L's would do. H12 (12 tokens)
    # needs 3: even L's 2 would not do (the rest is held by the more urgent M), so it is no inversion.
    config = SchedulerConfig(block_size=4, num_kv_blocks=4, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=16)
    state = _state(config, [("M", 0, 4), ("L", 5, 4)], [("H12", 1, 12), ("H8", 1, 8)])
    found = _observe(config, state, _decodes(state, config))
    assert [v.request_id for v in found] == ["H8"] and "2 blocks (0 free)" in found[0].detail
    # budget: L's long chunk takes the whole budget while H (chunked prefill: 1 token would do) waits
    wide = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)
    state = add_request(SchedulerState.initial(wide), RequestSpec("L", 40, 5, priority=5).to_request(0))
    state = apply_plan(state, StepPlan((ScheduledRequest("L", 0, 8, tuple(range(10))),)), {}, wide).state
    state = add_request(state, RequestSpec("H", 4, 5, priority=0).to_request(1))
    plan = StepPlan((ScheduledRequest("L", 8, 8, ()),))
    found = _observe(wide, state, plan)
    assert [v.request_id for v in found] == ["H"] and "1 tokens of budget (0 left)" in found[0].detail
    # H admitted in L's place: nothing waits
    plan = StepPlan((ScheduledRequest("L", 8, 4, ()), ScheduledRequest("H", 0, 4, (10,))))
    assert _observe(wide, state, plan) == []


# --- schedspec check --property on a hand-made trace ---------------------------------------------------

CONFIG = {"block_size": 4, "num_kv_blocks": 8, "max_num_batched_tokens": 8, "max_num_seqs": 1, "max_model_len": 16,
          "enable_chunked_prefill": True, "long_prefill_token_threshold": 0, "enable_prefix_caching": False,
          "preemption_mode": "recompute"}


def _arrival(request_id: str, priority: int, max_tokens: int, step: int) -> dict:
    return {"request_id": request_id, "prompt_len": 4, "max_tokens": max_tokens, "arrival_step": step,
            "arrival_time": 0.01 * step, "priority": priority, "prefix_len": 0, "eos_token_id": None,
            "stop_token_ids": [], "min_tokens": 0}


def _record(step: int, arrivals: list, scheduled: list, allocated: dict, freed: dict, sampled: dict,
            finished: dict, free: int, running: int, waiting: int) -> dict:
    return {"step": step, "start_time": 0.01 * step, "duration": 0.01, "arrivals": arrivals, "aborts": [],
            "scheduled": scheduled, "blocks_allocated": allocated, "blocks_freed": freed, "prefix_hit_tokens": {},
            "preempted": [], "finished": finished, "aborted": [], "rejected": {}, "sampled_token_ids": sampled,
            "num_free_blocks": free, "num_running": running, "num_waiting": waiting}


def _hand_made_trace(path: Path, urgent: int) -> Path:
    """max_num_seqs = 1: L (priority 5) prefills at step 0 and decodes at steps 1-2 while H (priority
    ``urgent``), arrived before step 1, waits; H runs at step 3."""
    prefill = {"request_id": "L", "num_computed_tokens": 0, "prefill_tokens": 4, "decode_tokens": 0}
    lines = [
        {"schema_version": 2, "config": CONFIG, "scheduler": "hand-made"},
        _record(0, [_arrival("L", 5, 3, 0)], [prefill], {"L": [0]}, {}, {"L": 11}, {}, 7, 1, 0),
        _record(1, [_arrival("H", urgent, 1, 1)],
                [{"request_id": "L", "num_computed_tokens": 4, "prefill_tokens": 0, "decode_tokens": 1}],
                {"L": [1]}, {}, {"L": 12}, {}, 6, 1, 1),
        _record(2, [], [{"request_id": "L", "num_computed_tokens": 5, "prefill_tokens": 0, "decode_tokens": 1}],
                {}, {"L": [1, 0]}, {"L": 13}, {"L": "length"}, 8, 0, 1),
        _record(3, [], [{"request_id": "H", "num_computed_tokens": 0, "prefill_tokens": 4, "decode_tokens": 0}],
                {"H": [0]}, {"H": [0]}, {"H": 14}, {"H": "length"}, 8, 0, 0),
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "schedspec", "check", *args], capture_output=True, text=True,
                          timeout=300)


def test_check_property_flags_the_hand_made_inversion(tmp_path):
    trace = _hand_made_trace(tmp_path / "inversion.jsonl", urgent=0)
    plain = _check(str(trace))
    assert plain.returncode == 0, plain.stdout + plain.stderr  # legal: the spec does not demand priority
    result = _check(str(trace), "--property", NAME, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    verdict = json.loads(result.stdout)
    assert [(v["name"], v["step"], v["request_id"]) for v in verdict["violations"]] == [
        (NAME, 1, "H"), (NAME, 2, "H")]
    fair = _check(str(_hand_made_trace(tmp_path / "equal.jsonl", urgent=5)), "--property", NAME)
    assert fair.returncode == 0, fair.stdout + fair.stderr


def test_blocks_shared_with_a_more_urgent_request_are_not_counted_as_held():
    """With prefix caching (tables sharing blocks), preempting the less urgent L frees only the blocks
    nobody else holds: L shares blocks 0, 1 with the more urgent M and holds block 2 alone; H needs 2."""
    from schedspec.spec.request import RequestStatus

    config = SchedulerConfig(block_size=4, num_kv_blocks=3, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=12)

    def running(request_id: str, priority: int, blocks: tuple[int, ...], length: int):
        request = RequestSpec(request_id, length, 1, priority=priority).to_request(0)
        return attrs.evolve(request, status=RequestStatus.RUNNING, block_ids=blocks, num_computed_tokens=length - 1,
                            admitted_step=0)

    requests = {"M": running("M", 0, (0, 1), 8), "L": running("L", 5, (0, 1, 2), 12),
                "H": RequestSpec("H", 8, 1, priority=1).to_request(1)}
    state = SchedulerState(step=1, waiting=("H",), running=("M", "L"), requests=requests, free_block_ids=(),
                           num_requests_added=3)
    plan = StepPlan((ScheduledRequest("M", 7, 1), ScheduledRequest("L", 11, 1)))
    monitor = NoPriorityInversion(config)
    monitor.observe(state, plan, state)  # ``after`` is not read
    assert monitor.violations == []
    # the same tables without sharing (L holds 2 blocks alone): H would fit in them, an inversion
    alone = dict(requests, L=running("L", 5, (1, 2), 8), M=running("M", 0, (0,), 4))
    monitor.observe(attrs.evolve(state, requests=alone), StepPlan((ScheduledRequest("M", 3, 1),
                                                                   ScheduledRequest("L", 7, 1))), state)
    assert [v.request_id for v in monitor.violations] == ["H"]
