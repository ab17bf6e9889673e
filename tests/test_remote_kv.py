"""Requests that wait holding blocks: remote KV loads and delayed frees (the KV connector).

vLLM 0.32 ``vllm/v1/core/sched/scheduler.py``: a request whose connector answers ``load_kv_async`` gets
blocks for the loaded prefix and waits in ``WAITING_FOR_REMOTE_KVS`` until the transfer lands
(``_update_waiting_for_remote_kv``); a failed transfer's invalid blocks are recomputed from the last valid
token (``_handle_invalid_blocks``, recompute policy); an abort while loading, and a finished request whose
blocks are being sent, free their blocks later (``delay_free_blocks``, ``_update_from_kv_xfer_finished``).
Each new rule and invariant has a failing case here (registered with the others' in ``test_rules.py`` and
``test_invariants.py``), and the transitions are walked step by step with the invariants checked after each.
"""

from __future__ import annotations

import attrs
import pytest

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import check_state, check_step
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import violated_rules
from schedspec.spec.state import (
    DelayedFree,
    KVLoad,
    KVTransferOutput,
    ScheduledRequest,
    SchedulerState,
    StepPlan,
)
from schedspec.spec.transitions import PlanError, abort_request, add_request, apply_plan

# block_size 4, 8 blocks, budget 16 tokens, 2 sequences, max_model_len 32.
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32)
PROMPT = tuple(range(100, 110))  # 10 tokens; the connector offers the first 8 (2 blocks)


def fresh(**changes) -> Request:
    return attrs.evolve(Request("r", 0, PROMPT, max_tokens=3, num_external_computed_tokens=8), **changes)


def with_request(request: Request) -> SchedulerState:
    return add_request(SchedulerState.initial(CONFIG), request)


LOAD = StepPlan(loads=(KVLoad("r", 8, (0, 1)),))


def loading() -> SchedulerState:
    """After step 0: r waits for its remote KV in blocks 0, 1."""
    state = with_request(fresh())
    after = apply_plan(state, LOAD, {}, CONFIG).state
    assert check_step(state, LOAD, after, CONFIG) == []
    return after


def step(state: SchedulerState, plan: StepPlan, sampled=None, transfers=None) -> SchedulerState:
    """Apply an allowed plan; assert the rules allowed it and the invariants hold after."""
    assert violated_rules(state, plan, CONFIG) == []
    after = apply_plan(state, plan, sampled or {}, CONFIG, transfers=transfers or KVTransferOutput()).state
    assert check_step(state, plan, after, CONFIG) == [], check_step(state, plan, after, CONFIG)
    return after


def test_a_load_holds_its_blocks_and_computes_nothing_until_it_lands() -> None:
    state = loading()
    r = state.requests["r"]
    assert (r.status, r.block_ids, r.num_computed_tokens, r.kv_load_step) == (
        RequestStatus.WAITING_FOR_REMOTE_KVS, (0, 1), 8, 0)
    assert state.waiting == ("r",) and state.free_block_ids == (2, 3, 4, 5, 6, 7)
    state = step(state, StepPlan())  # nothing landed: it still waits
    state = step(state, StepPlan(), transfers=KVTransferOutput(finished_recving=("r",)))
    r = state.requests["r"]
    assert (r.status, r.block_ids, r.num_computed_tokens) == (RequestStatus.WAITING, (0, 1), 8)
    # admitted on the loaded prefix: the 2 tokens left, into a third block
    state = step(state, StepPlan(scheduled=(ScheduledRequest("r", 8, 2, (2,)),)), {"r": 7})
    r = state.requests["r"]
    assert (r.status, r.block_ids, r.num_computed_tokens, r.output_token_ids) == (
        RequestStatus.RUNNING, (0, 1, 2), 10, (7,))


def test_a_load_of_the_whole_prompt_leaves_its_last_token_to_compute() -> None:
    state = with_request(fresh(prompt_token_ids=PROMPT[:8]))
    state = step(state, LOAD, transfers=KVTransferOutput(finished_recving=("r",)))
    assert state.requests["r"].num_computed_tokens == 7  # vLLM: num_computed_tokens = num_tokens - 1
    state = step(state, StepPlan(scheduled=(ScheduledRequest("r", 7, 1),)), {"r": 5})
    assert state.requests["r"].output_token_ids == (5,)


def test_a_failed_load_keeps_the_tokens_before_its_first_invalid_block() -> None:
    state = step(loading(), StepPlan(), transfers=KVTransferOutput(finished_recving=("r",), invalid_block_ids=(1,)))
    r = state.requests["r"]
    assert (r.status, r.block_ids, r.num_computed_tokens) == (RequestStatus.WAITING, (0, 1), 4)
    # recomputes from token 4 into the blocks it holds, plus one for tokens 8, 9
    state = step(state, StepPlan(scheduled=(ScheduledRequest("r", 4, 6, (2,)),)), {"r": 7})
    assert state.requests["r"].num_computed_tokens == 10


def test_a_load_failed_from_its_first_block_frees_everything() -> None:
    state = step(loading(), StepPlan(), transfers=KVTransferOutput(finished_recving=("r",), invalid_block_ids=(0,)))
    r = state.requests["r"]
    assert (r.status, r.block_ids, r.num_computed_tokens) == (RequestStatus.WAITING, (), 0)
    assert state.free_block_ids[:2] == (1, 0)  # to the front, last block first
    # it offers no second load; it is admitted as a fresh prompt
    again = StepPlan(loads=(KVLoad("r", 8, (0, 1)),))
    assert [v.name for v in violated_rules(state, again, CONFIG)] == ["load-as-offered"]
    step(state, StepPlan(scheduled=(ScheduledRequest("r", 0, 10, (0, 1, 2)),)), {"r": 7})


def test_an_abort_while_loading_frees_the_blocks_when_the_load_lands() -> None:
    state = abort_request(loading(), "r")
    assert state.delayed_frees == {"r": DelayedFree((0, 1), "recving")} and state.free_block_ids == (2, 3, 4, 5, 6, 7)
    assert check_state(state, CONFIG) == []
    state = step(state, StepPlan())  # still held
    assert state.delayed_frees == {"r": DelayedFree((0, 1), "recving")}
    state = step(state, StepPlan(), transfers=KVTransferOutput(finished_recving=("r",)))
    assert state.delayed_frees == {} and state.free_block_ids == (1, 0, 2, 3, 4, 5, 6, 7)


def test_an_abort_after_the_load_landed_frees_at_once() -> None:
    state = step(loading(), StepPlan(), transfers=KVTransferOutput(finished_recving=("r",)))
    state = abort_request(state, "r")
    assert state.delayed_frees == {} and state.free_block_ids[:2] == (1, 0)
    assert check_state(state, CONFIG) == []


def test_a_sending_request_frees_its_blocks_when_the_send_completes() -> None:
    state = with_request(Request("s", 0, (1, 2, 3), max_tokens=1, kv_send=True))
    state = step(state, StepPlan(scheduled=(ScheduledRequest("s", 0, 3, (0,)),)), {"s": 9})
    assert state.finished["s"].status is RequestStatus.FINISHED_LENGTH and state.delayed_frees == {"s": DelayedFree((0,), "sending")}
    assert 0 not in state.free_block_ids
    state = step(state, StepPlan(), transfers=KVTransferOutput(finished_sending=("s",)))
    assert state.delayed_frees == {} and state.free_block_ids[0] == 0


@pytest.mark.parametrize("transfers", [
    KVTransferOutput(finished_recving=("x",)),  # unknown id
    KVTransferOutput(finished_sending=("r",)),  # a load, not a send
    KVTransferOutput(invalid_block_ids=(0,)),  # an invalid block of no load that lands
])
def test_a_report_of_a_transfer_that_is_not_in_flight_is_refused(transfers: KVTransferOutput) -> None:
    with pytest.raises(PlanError):
        apply_plan(loading(), StepPlan(), {}, CONFIG, transfers=transfers)


def test_a_second_landing_of_an_aborted_load_is_refused() -> None:
    state = abort_request(loading(), "r")
    state = step(state, StepPlan(), transfers=KVTransferOutput(finished_recving=("r",)))
    with pytest.raises(PlanError):  # its blocks were freed once; freeing them again is no transfer of the spec
        apply_plan(state, StepPlan(), {}, CONFIG, transfers=KVTransferOutput(finished_recving=("r",)))


# --- each rule and invariant can fail (registered in test_rules.py and test_invariants.py) ---------------------


def case_wait_for_remote_kv():
    # r's load is in flight: scheduling it computes on blocks the transfer has not filled.
    state = loading()
    bad = StepPlan(scheduled=(ScheduledRequest("r", 8, 2, (2,)),))
    return state, bad, StepPlan(), CONFIG


def case_load_as_offered():
    # the connector offers 8 tokens; a load of 4 is not what it offered.
    state = with_request(fresh())
    return state, StepPlan(loads=(KVLoad("r", 4, (0,)),)), LOAD, CONFIG


def case_load_blocks_exact():
    # 8 tokens fill 2 blocks; a third block is taken for nothing.
    state = with_request(fresh())
    return state, StepPlan(loads=(KVLoad("r", 8, (0, 1, 2)),)), LOAD, CONFIG


REMOTE_KV_RULE_CASES = {
    "wait-for-remote-kv": case_wait_for_remote_kv,
    "load-as-offered": case_load_as_offered,
    "load-blocks-exact": case_load_blocks_exact,
}


def case_delayed_frees_ended():
    # blocks held for the transfer of r, which is live: only an ended request's blocks wait for a transfer.
    good = abort_request(loading(), "r")
    bad = attrs.evolve(loading(), delayed_frees={"r": DelayedFree((2,), "recving")}, free_block_ids=(3, 4, 5, 6, 7))
    return bad, good, CONFIG, CONFIG


REMOTE_KV_STATE_CASES = {"delayed-frees-ended": case_delayed_frees_ended}


def test_the_waiting_invariant_says_which_waiting_requests_may_hold_blocks() -> None:
    """``preempted-holds-nothing``: a loading or landed request holds exactly its load's blocks; a fresh one,
    or one whose table is not its load's, holds nothing."""
    state = loading()
    assert check_state(state, CONFIG) == []
    r = state.requests["r"]
    names = lambda s: {v.name for v in check_state(s, CONFIG)}  # noqa: E731
    # a fresh request (no load) holding the same blocks
    assert "preempted-holds-nothing" in names(attrs.evolve(
        state, requests={"r": attrs.evolve(r, status=RequestStatus.WAITING, kv_load_step=None)}))
    # the load holding one block fewer than its tokens need
    assert "preempted-holds-nothing" in names(attrs.evolve(
        state, requests={"r": attrs.evolve(r, block_ids=(0,))}, free_block_ids=(1, 2, 3, 4, 5, 6, 7)))
    # in flight, computed tokens other than the loaded ones
    assert "preempted-holds-nothing" in names(attrs.evolve(state, requests={"r": attrs.evolve(r, num_computed_tokens=4)}))


def test_block_conservation_counts_the_blocks_held_for_transfers() -> None:
    state = abort_request(loading(), "r")
    assert check_state(state, CONFIG) == []
    freed_twice = attrs.evolve(state, free_block_ids=(0, 1) + state.free_block_ids)  # freed, and still held
    assert "block-conservation" in {v.name for v in check_state(freed_twice, CONFIG)}
    lost = attrs.evolve(state, delayed_frees={})  # forgotten: neither free nor held
    assert "block-conservation" in {v.name for v in check_state(lost, CONFIG)}


# --- the trace, the checker and the reference schedulers -----------------------------------------------------


def _workload(seed: int, count: int) -> list:
    """A seeded workload: half the requests load part of their prompt remotely (some failing from one of their
    first blocks), every fourth sends its KV when it finishes, every sixth is aborted soon after it arrives."""
    import random

    from schedspec.spec.workload import RequestSpec

    rng = random.Random(seed)
    workload = []
    for k in range(count):
        prompt = rng.randrange(1, 40)
        arrival = rng.randrange(0, 12)
        extra: dict = {}
        if k % 2 == 0:
            extra = {"num_external_computed_tokens": rng.randrange(1, prompt + 1), "kv_load_steps": rng.randrange(1, 5),
                     "kv_load_invalid_block": rng.choice([None, 0, 1, 2])}
        workload.append(RequestSpec(f"r{k}", prompt, rng.randrange(1, 8), arrival_step=arrival, kv_send=k % 4 == 1,
                                    abort_at_step=arrival + rng.randrange(0, 4) if k % 6 == 3 else None, **extra))
    return workload


@pytest.mark.parametrize("scheduler", ["fcfs", "static", "vllm-v1", "vllm-v1@0.33"])
def test_reference_schedulers_follow_remote_kv_and_their_traces_check(scheduler: str) -> None:
    """Every plan allowed and every invariant kept at every step (the engine loop checks both), fcfs's promised
    properties kept, and the written trace (JSON, schema-valid) passes the full and the incremental checker."""
    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS
    from schedspec.spec.checker import check_trace
    from schedspec.spec.trace import StepRecord, record_schema_errors

    config = SchedulerConfig(block_size=4, num_kv_blocks=30, max_num_batched_tokens=16, max_num_seqs=3,
                             max_model_len=64)
    loads = landings = failures = sends = 0
    for seed in range(4):
        result = Engine(SCHEDULERS[scheduler](config), config, stop_on_violation=True).run(_workload(seed, 14))
        if scheduler == "fcfs":
            assert result.violations == []
        records = [StepRecord.from_json(r.to_json()) for r in result.records]
        assert records == result.records and all(record_schema_errors(r.to_dict()) is None for r in records)
        for incremental in (False, True):
            report = check_trace(config, records, incremental=incremental)
            assert report.first_bad_step is None, report.violations[:3]
        assert result.state.delayed_frees == {} and len(result.state.free_block_ids) == config.num_kv_blocks
        loads += sum(len(r.kv_loads) for r in records)
        landings += sum(len(r.finished_recving) for r in records)
        failures += sum(len(r.invalid_block_ids) for r in records)
        sends += sum(len(r.finished_sending) for r in records)
    assert loads and landings == loads and failures and sends  # the runs exercise every path


def test_a_run_without_a_connector_writes_none_of_its_fields() -> None:
    from schedspec.spec.trace import KV_CONNECTOR_RECORD_FIELDS, StepRecord
    from schedspec.spec.workload import RequestSpec

    data = StepRecord(step=0, start_time=0.0, duration=0.0).to_dict()
    assert not set(KV_CONNECTOR_RECORD_FIELDS) & set(data)
    arrival = RequestSpec("a", 4, 2, arrival_step=0).to_dict()
    assert not {"num_external_computed_tokens", "kv_load_steps", "kv_load_invalid_block", "kv_send",
                "kv_send_steps"} & set(arrival)


def test_a_scheduler_without_remote_kv_is_refused_not_misjudged() -> None:
    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS, UnsupportedFeature

    config = SchedulerConfig(block_size=4, num_kv_blocks=30, max_num_batched_tokens=16, max_num_seqs=3,
                             max_model_len=64)
    with pytest.raises(UnsupportedFeature, match="remote KV"):
        Engine(SCHEDULERS["priority"](config), config).run(_workload(0, 4))


@pytest.mark.parametrize("value", [0, -1])
def test_a_transfer_lands_with_a_later_steps_report(value: int) -> None:
    from schedspec.spec.workload import RequestSpec

    with pytest.raises(ValueError, match="kv_load_steps"):
        RequestSpec("a", 8, 2, arrival_step=0, num_external_computed_tokens=4, kv_load_steps=value)
    with pytest.raises(ValueError, match="num_external_computed_tokens"):
        RequestSpec("a", 8, 2, arrival_step=0, num_external_computed_tokens=9)


@pytest.mark.parametrize("name", ["remote-kv-load-lands-then-runs", "remote-kv-load-fails-recomputes",
                                  "remote-kv-abort-while-loading-frees-late", "remote-kv-send-holds-blocks"])
def test_the_remote_kv_scenarios_fail_on_a_scheduler_that_ignores_the_transfer(name: str) -> None:
    """Each scenario passes on fcfs and vllm-v1 (tests/test_scenarios.py replays it), and a scheduler that
    ignores the transfer (schedules a loading request, or frees blocks a transfer holds) breaks a rule or an
    invariant in it: the scenario's trace mutated as such an engine would write it is refused."""
    from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
    from schedspec.trace_mutations import (
        Trace,
        failed_load_kept_computed,
        freed_at_abort_while_loading,
        judge,
        scheduled_before_transfer_landed,
        send_freed_at_finish,
    )

    path = next(p for p in bundled_scenarios() if p.stem == name)
    scenario = load_scenario(path)
    for scheduler in ("fcfs", "vllm-v1"):
        result = replay(scenario, scheduler)
        assert all(v.passed for v in result.verdicts), [v for v in result.verdicts if not v.passed]
    import json

    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS
    from schedspec.spec.trace import header_line

    config = SchedulerConfig.from_dict(scenario.config)
    run = Engine(SCHEDULERS["fcfs"](config), config).run(list(scenario.requests))
    trace = Trace.of(json.loads(header_line(config, "fcfs")), run.records)
    operators = {"remote-kv-load-lands-then-runs": scheduled_before_transfer_landed,
                 "remote-kv-load-fails-recomputes": failed_load_kept_computed,
                 "remote-kv-abort-while-loading-frees-late": freed_at_abort_while_loading,
                 "remote-kv-send-holds-blocks": send_freed_at_finish}
    mutants = [m for m in (operators[name](trace, i) for i in range(len(trace.records))) if m is not None]
    assert mutants
    for header, records, step in mutants:
        assert judge(header, records) == (step, step)


def test_remote_kv_with_prefix_caching_is_refused_not_misjudged() -> None:
    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS, UnsupportedFeature

    config = SchedulerConfig(block_size=4, num_kv_blocks=30, max_num_batched_tokens=16, max_num_seqs=3,
                             max_model_len=64, enable_prefix_caching=True)
    with pytest.raises(UnsupportedFeature, match="prefix caching"):
        Engine(SCHEDULERS["fcfs"](config), config).run(_workload(0, 4))
    state = add_request(SchedulerState.initial(config), fresh())
    with pytest.raises(PlanError, match="not specified"):
        apply_plan(state, LOAD, {}, config)



def _send_blocks_the_queue(send_steps: int):
    """fcfs on 3 blocks of 4 (max_model_len 8): ``a`` finishes at once and sends its 2 blocks for ``send_steps``
    steps; ``b`` (2 blocks) cannot be admitted until the send completes. Returns ``(config, run result)``."""
    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import make_scheduler
    from schedspec.spec.workload import RequestSpec

    config = SchedulerConfig(block_size=4, num_kv_blocks=3, max_num_batched_tokens=16, max_num_seqs=4,
                             max_model_len=8)
    workload = [RequestSpec("a", 7, 1, arrival_step=0, kv_send=True, kv_send_steps=send_steps),
                RequestSpec("b", 7, 1, arrival_step=1)]
    return config, Engine(make_scheduler("fcfs", config), config).run(workload, max_steps=40)


def test_a_transfer_still_holding_blocks_at_the_end_of_a_trace_is_unfinished():
    """A trace that ends while a send still holds blocks (never reported in finished_sending): an
    unfinished-request mismatch naming the ended request (a whole trace ends with every transfer complete)."""
    from schedspec.spec.checker import check_trace

    config, result = _send_blocks_the_queue(3)
    ended_at = next(i for i, r in enumerate(result.records) if "a" in r.finished)
    cut = result.records[:ended_at + 1]  # the send's report never comes
    assert not any(r.finished_sending for r in cut)
    report = check_trace(config, cut)
    assert any(v.name == "unfinished-request" and v.request_id == "a" for v in report.violations)
    assert check_trace(config, result.records).ok


def _watched(config: SchedulerConfig, state: SchedulerState, plans) -> set[str]:
    """Apply each plan of ``plans`` (a callable ``state -> (plan, sampled)`` per step, or ``None`` to stop) with no
    transfer reported, under the ``progress`` and ``bounded-wait`` monitors; the names of the properties violated."""
    from schedspec.spec.properties import monitors

    watchers = monitors(["progress", "bounded-wait"], config)
    for make in plans:
        plan, sampled = make(state)
        after = apply_plan(state, plan, sampled, config).state
        for watcher in watchers:
            watcher.observe(state, plan, after)
        state = after
    return {v.name for watcher in watchers for v in watcher.finish(state)}


def _other_and_a_long_load(config: SchedulerConfig, other_prompt: int) -> SchedulerState:
    """``o`` (``other_prompt`` tokens, 3 to generate) arrives first, then ``r``, which offers a remote KV load of 8
    tokens (2 blocks of 4)."""
    state = add_request(SchedulerState.initial(config), Request("o", 0, tuple(range(other_prompt)), max_tokens=3))
    return add_request(state, fresh())


def _load_then(step_plan, steps: int = 40):
    """Step 0 starts ``r``'s load into blocks 0, 1; then ``steps`` steps of ``step_plan`` while it never lands."""
    return [lambda state: (LOAD, {})] + [step_plan] * steps


def test_starving_the_others_while_a_load_is_in_flight_fails_progress_and_bounded_wait() -> None:
    """A scheduler that never admits ``o`` (1 block; 6 of 8 free) during ``r``'s 70-step load: the load does not
    hold the engine back, so the stall counts (past bounded-wait's bound, doubled with a transfer: 64 steps).
    Main excused every step a transfer was in flight: it passed."""
    state = _other_and_a_long_load(CONFIG, 4)
    assert _watched(CONFIG, state, _load_then(lambda s: (StepPlan(), {}), 70)) == {"progress", "bounded-wait"}


def test_a_head_the_loads_blocks_keep_out_is_excused() -> None:
    """The same stall with 3 blocks: ``r``'s load holds 2, ``o`` needs 2 for its whole sequence (5 + 3 tokens) and
    1 is free: the transfer holds the engine back (vLLM's waiting loop stops at ``allocate_slots``), no alarm."""
    config = attrs.evolve(CONFIG, num_kv_blocks=3)
    state = _other_and_a_long_load(config, 5)
    assert _watched(config, state, _load_then(lambda s: (StepPlan(), {}), 70)) == set()


def test_a_preempt_and_recompute_livelock_while_a_load_is_in_flight_fails_progress() -> None:
    """``o`` computes its first 4-token chunk, is preempted, recomputes the same chunk, and so on, while ``r``'s
    load never lands, with 5 blocks free: no preemption was needed, the livelock counts."""

    def livelock(state: SchedulerState):
        if "o" in state.running:
            return StepPlan(preempted=("o",)), {}
        return StepPlan(scheduled=(ScheduledRequest("o", 0, 4, state.free_block_ids[:1]),)), {}

    state = _other_and_a_long_load(CONFIG, 6)
    assert _watched(CONFIG, state, _load_then(livelock, 70)) == {"progress", "bounded-wait"}


def test_leaving_the_running_out_while_a_load_keeps_the_head_out_fails_progress() -> None:
    """``r``'s load holds 2 of 4 blocks and keeps ``w`` (2 blocks, 5 + 3 tokens) waiting, which is excused; but the
    scheduler also leaves ``o`` out, running with its block and 1 block free: the step is not held back."""
    config = attrs.evolve(CONFIG, num_kv_blocks=4)
    state = add_request(SchedulerState.initial(config), Request("o", 0, (1, 2, 3), max_tokens=20))
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("o", 0, 3, (0,)),)), {"o": 9}, config).state
    state = add_request(add_request(state, fresh(arrival_step=1)), Request("w", 1, (1, 2, 3, 4, 5), max_tokens=3))
    load = StepPlan(loads=(KVLoad("r", 8, (1, 2)),))
    assert _watched(config, state, [lambda s: (load, {})] + [lambda s: (StepPlan(), {})] * 70) == {
        "progress", "bounded-wait"}
def test_a_load_for_an_unknown_request_is_named_as_unknown_only():
    """A record starting a remote KV load for an id never added: ``known-requests`` (not a live request),
    and no other rule about a load it cannot judge (``load-blocks-exact`` said "takes 0 blocks")."""
    from schedspec.spec.checker import check_trace
    from schedspec.spec.trace import StepRecord
    from schedspec.trace_mutations import remote_kv_trace

    _, trace = remote_kv_trace()
    records = [dict(record) for record in trace.records]  # a copy to edit
    step = next(index for index, record in enumerate(records) if record.get("kv_loads"))
    records[step]["kv_loads"]["ghost"] = 5
    report = check_trace(trace.config, [StepRecord.from_dict(record) for record in records])
    assert report.first_bad_step == step
    assert [(v.name, v.request_id, v.detail) for v in report.violations] == [
        ("known-requests", "ghost", "not a live request")]
