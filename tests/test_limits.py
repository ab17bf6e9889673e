"""The per-step limits of vLLM's scheduler that are off by default (``SchedulerConfig`` fields in
``spec.config.LIMIT_DEFAULTS``): each field's validation and its absence from traces while off, each rule's
hand-made failing case (``LIMIT_RULE_CASES``, run by ``tests/test_rules.py`` with the other rules' cases),
the reference policies and the ``vllm-v1`` profiles obeying them, and each bundled scenario failing on a
scheduler that ignores its limit.

LoRA (``max_loras``): vLLM 0.32/0.33 ``Scheduler.schedule``, ``scheduled_loras`` and the waiting loop's skip.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from schedspec.reference import policies
from schedspec.reference.scenarios import load_scenario, replay
from schedspec.reference.scheduler import (
    ALL_PROPERTIES,
    ReferenceScheduler,
    UnsupportedFeature,
    make_scheduler,
)
from schedspec.reference.vllm_v1 import plan_vllm_v1
from schedspec.spec.config import ConfigError, SchedulerConfig
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import violated_rules
from schedspec.spec.state import (
    PrefillCadence,
    ScheduledRequest,
    SchedulerState,
    StepPlan,
    cadence_after,
    carries_prefill,
    is_prefill_chunk,
    prefill_held,
)
from schedspec.spec.trace import record_schema_errors
from schedspec.spec.transitions import add_request, apply_plan
from schedspec.spec.workload import RequestSpec

CASES = Path(__file__).resolve().parents[1] / "schedspec" / "data" / "cases"
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32)


VLLM_LIKE_PLANS = [policies.fcfs, policies.priority, lambda s, c: plan_vllm_v1(s, c),
                   lambda s, c: plan_vllm_v1(s, c, version="0.33")]
VLLM_LIKE_IDS = ["fcfs", "priority", "vllm-v1", "vllm-v1@0.33"]
"""The policies whose admission each limit changes, as vLLM's does."""


def _waiting(request_id: str, lora: int, prompt_len: int = 4) -> Request:
    return Request(request_id, 0, tuple(range(100, 100 + prompt_len)), max_tokens=2, lora_int_id=lora)


def _state(*requests: Request, running: tuple[Request, ...] = ()) -> SchedulerState:
    every = {r.request_id: r for r in (*running, *requests)}
    held = {b for r in running for b in r.block_ids}
    return SchedulerState(step=1, waiting=tuple(r.request_id for r in requests),
                          running=tuple(r.request_id for r in running), requests=every,
                          free_block_ids=tuple(b for b in range(8) if b not in held),
                          num_requests_added=len(every))


def _passes_on(scenario, *names: str) -> None:
    """Every expectation of ``scenario`` holds on each scheduler of ``names``."""
    for name in names:
        failed = [f"{v.name}: {v.detail}" for v in replay(scenario, name).verdicts if not v.passed]
        assert not failed, (name, failed)


# ------------------------------------------------------------------------------------------- LoRA
def case_lora_limit():
    # max_loras 1: a (adapter 1) and b (adapter 2) in one step are 2 adapters > 1; a with c (adapter 1) is one.
    config = CONFIG.with_changes(max_loras=1)
    state = _state(_waiting("a", 1), _waiting("b", 2), _waiting("c", 1), _waiting("d", 0))
    bad = StepPlan(scheduled=(ScheduledRequest("a", 0, 4, (0,)), ScheduledRequest("b", 0, 4, (1,))))
    good = StepPlan(scheduled=(ScheduledRequest("a", 0, 4, (0,)), ScheduledRequest("c", 0, 4, (1,)),
                               ScheduledRequest("d", 0, 4, (2,))))
    return state, bad, good, config


LIMIT_RULE_CASES = {"lora-limit": case_lora_limit}


def test_lora_limit_counts_distinct_adapters_not_requests_nor_the_base_model() -> None:
    state, bad, good, config = case_lora_limit()
    assert [v.name for v in violated_rules(state, bad, config)] == ["lora-limit"]
    assert violated_rules(state, good, config) == []  # two requests of adapter 1 plus a base-model one
    # off (max_loras 0): no limit, as vLLM without a LoRAConfig
    assert violated_rules(state, bad, CONFIG) == []
    # two adapters are fine under max_loras 2
    assert violated_rules(state, bad, CONFIG.with_changes(max_loras=2)) == []


@pytest.mark.parametrize("value", [-1, True, 1.0, "1"])
def test_max_loras_is_validated(value) -> None:
    with pytest.raises(ConfigError) as error:
        CONFIG.with_changes(max_loras=value)
    assert error.value.field == "max_loras"
    assert "\n" not in str(error.value)


def test_max_loras_off_is_left_out_of_the_config_dict_and_lora_0_out_of_arrivals() -> None:
    assert "max_loras" not in CONFIG.to_dict()
    assert CONFIG.limits_on == ()
    on = CONFIG.with_changes(max_loras=2)
    assert on.to_dict()["max_loras"] == 2 and on.limits_on == ("max_loras",)
    assert SchedulerConfig.from_dict(on.to_dict()) == on
    assert "lora_int_id" not in RequestSpec("r", 4, 2, arrival_step=0).to_dict()
    spec = RequestSpec("r", 4, 2, arrival_step=0, lora_int_id=3)
    assert spec.to_dict()["lora_int_id"] == 3
    assert RequestSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_request(0).lora_int_id == 3


def test_the_trace_schema_carries_lora_int_id() -> None:
    record = {"step": 0, "start_time": 0.0, "duration": 0.01, "scheduled": [], "blocks_allocated": {},
              "blocks_freed": {}, "prefix_hit_tokens": {}, "preempted": [], "finished": {}, "aborted": [],
              "rejected": {}, "sampled_token_ids": {}, "num_free_blocks": 8, "num_running": 0, "num_waiting": 1,
              "aborts": [], "arrivals": [RequestSpec("r", 4, 2, arrival_step=0, lora_int_id=3).to_dict()]}
    assert record_schema_errors(json.loads(json.dumps(record))) is None
    record["arrivals"][0]["lora_int_id"] = -1
    assert "lora_int_id" in record_schema_errors(record)


@pytest.mark.parametrize("plan", [policies.fcfs, policies.priority, policies.shortest_prompt_first],
                         ids=["fcfs", "priority", "shortest-prompt-first"])
def test_policies_skip_a_request_whose_adapter_is_one_too_many(plan) -> None:
    config = CONFIG.with_changes(max_loras=1)
    state = _state(_waiting("a", 1), _waiting("b", 2), _waiting("c", 1), _waiting("d", 0))
    chosen = plan(state, config)
    assert [i.request_id for i in chosen.scheduled] == ["a", "c", "d"]
    assert violated_rules(state, chosen, config) == []


def test_fcfs_counts_the_adapters_of_running_requests_it_does_not_schedule() -> None:
    # Chunking off, budget 32: the decodes r1 and r2 take 2 tokens, so a (adapter 1, 31 prompt tokens pending)
    # gets none in this step. b (adapter 2) must still wait: were only the scheduled adapters counted (vLLM
    # 0.32's count), b would run beside a in the next step, two adapters > max_loras = 1.
    config = CONFIG.with_changes(max_loras=1, enable_chunked_prefill=False, max_num_batched_tokens=32,
                                 num_kv_blocks=24)

    def decode(request_id: str, blocks: tuple[int, ...]) -> Request:
        return Request(request_id, 0, (1, 2, 3), max_tokens=4, status=RequestStatus.RUNNING, num_computed_tokens=3,
                       output_token_ids=(7,), block_ids=blocks, admitted_step=0)

    a = Request("a", 0, tuple(range(1, 32)), max_tokens=1, status=RequestStatus.RUNNING, block_ids=(),
                admitted_step=0, lora_int_id=1)
    state = _state(_waiting("b", 2), running=(decode("r1", (0,)), decode("r2", (1,)), a))
    state = SchedulerState(step=1, waiting=state.waiting, running=state.running, requests=state.requests,
                           free_block_ids=tuple(range(2, 24)), num_requests_added=4)
    chosen = policies.fcfs(state, config)
    assert [i.request_id for i in chosen.scheduled] == ["r1", "r2"]
    assert violated_rules(state, chosen, config) == []
    assert policies.lora_fits(state.requests["b"], policies.loras_of(["r1", "r2"], state.requests), config)


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_the_vllm_v1_profile_skips_as_vllm(version: str) -> None:
    config = CONFIG.with_changes(max_loras=1)
    running = Request("r", 0, (1, 2, 3, 4), max_tokens=4, status=RequestStatus.RUNNING, num_computed_tokens=4,
                      output_token_ids=(7,), block_ids=(0, 1), admitted_step=0, lora_int_id=2)
    state = _state(_waiting("a", 1), _waiting("b", 2), _waiting("d", 0), running=(running,))
    chosen = plan_vllm_v1(state, config, version=version)
    assert [i.request_id for i in chosen.scheduled] == ["r", "b", "d"]
    assert violated_rules(state, chosen, config) == []


def _lora_blind(config: SchedulerConfig) -> ReferenceScheduler:
    """fcfs that ignores ``max_loras`` (a deliberate break)."""
    return ReferenceScheduler(config, lambda state, c: policies.fcfs(state, c.with_changes(max_loras=0)),
                              "fcfs-lora-blind", ALL_PROPERTIES)


def test_the_lora_scenario_passes_on_the_references_and_fails_when_the_limit_is_ignored() -> None:
    scenario = load_scenario(CASES / "limit-lora-skips-not-blocks.json")
    _passes_on(scenario, "fcfs", "fcfs-fast", "priority", "vllm-v1", "vllm-v1@0.33", "vllm-v1-priority")
    verdicts = {v.name: v for v in replay(scenario, "test_limits:_lora_blind").verdicts}
    assert not verdicts["invariants"].passed and "lora-limit" in verdicts["invariants"].detail


# ----------------------------------------------------------------------------- structured output
def case_grammar_ready_before_admission():
    # a's grammar is ready at step 2; the state is at step 1: admitting a is too early, b (no grammar) is fine.
    state = _state(Request("a", 0, (1, 2, 3, 4), max_tokens=2, grammar_ready_step=2), _waiting("b", 0))
    bad = StepPlan(scheduled=(ScheduledRequest("a", 0, 4, (0,)), ScheduledRequest("b", 0, 4, (1,))))
    good = StepPlan(scheduled=(ScheduledRequest("b", 0, 4, (0,)),))
    return state, bad, good, CONFIG


LIMIT_RULE_CASES["grammar-ready-before-admission"] = case_grammar_ready_before_admission


def test_a_grammar_is_ready_from_its_ready_step_on() -> None:
    state, bad, _, config = case_grammar_ready_before_admission()
    assert [v.name for v in violated_rules(state, bad, config)] == ["grammar-ready-before-admission"]
    at_ready = SchedulerState(step=2, waiting=state.waiting, running=(), requests=state.requests,
                              free_block_ids=state.free_block_ids, num_requests_added=2)
    assert violated_rules(at_ready, bad, config) == []
    spec = RequestSpec("r", 4, 2, arrival_step=3, grammar_compile_steps=2)
    assert spec.to_request(3).grammar_ready_step == 5
    assert RequestSpec.from_dict(spec.to_dict()) == spec
    assert "grammar_compile_steps" not in RequestSpec("r", 4, 2, arrival_step=3).to_dict()
    assert RequestSpec("r", 4, 2, arrival_step=3).to_request(3).grammar_ready_step is None


@pytest.mark.parametrize("plan", VLLM_LIKE_PLANS, ids=VLLM_LIKE_IDS)
def test_a_request_whose_grammar_compiles_is_skipped_not_blocking(plan) -> None:
    state, _, _, config = case_grammar_ready_before_admission()
    chosen = plan(state, config)
    assert [i.request_id for i in chosen.scheduled] == ["b"]


def _grammar_blind(config: SchedulerConfig) -> ReferenceScheduler:
    """fcfs that admits a request whose grammar is not ready (a deliberate break)."""
    import attrs

    def plan(state, c):
        ready = {r: attrs.evolve(q, grammar_ready_step=None) for r, q in state.requests.items()}
        return policies.fcfs(attrs.evolve(state, requests=ready), c)

    return ReferenceScheduler(config, plan, "fcfs-grammar-blind", ALL_PROPERTIES)


def test_the_grammar_scenario_passes_on_the_references_and_fails_when_the_wait_is_ignored() -> None:
    scenario = load_scenario(CASES / "limit-grammar-wait-skips-not-blocks.json")
    _passes_on(scenario, "fcfs", "priority", "vllm-v1", "vllm-v1@0.33", "vllm-v1-priority")
    verdicts = {v.name: v for v in replay(scenario, "test_limits:_grammar_blind").verdicts}
    assert not verdicts["invariants"].passed
    assert "grammar-ready-before-admission" in verdicts["invariants"].detail


# ----------------------------------------------------------------------------------------- watermark
def _running_a() -> Request:
    """Running, 4 prompt tokens computed and one output: a decode holding blocks 0 and 1 (5 tokens, block 4)."""
    return Request("a", 0, (1, 2, 3, 4), max_tokens=4, status=RequestStatus.RUNNING, num_computed_tokens=4,
                   output_token_ids=(7,), block_ids=(0, 1), admitted_step=0)


def case_watermark():
    # 8 blocks, watermark 0.3: int(0.3 * 9) = 2 blocks kept free. a runs on blocks 0-1 (6 free); b's 12 tokens
    # take 3 blocks (3 left, fine), then c's 8 tokens take 2 more: 1 left < 2.
    config = CONFIG.with_changes(watermark=0.3, max_num_batched_tokens=32)
    state = _state(_waiting("b", 0, 12), _waiting("c", 0, 8), running=(_running_a(),))
    decode = ScheduledRequest("a", 4, 1)
    bad = StepPlan(scheduled=(decode, ScheduledRequest("b", 0, 12, (2, 3, 4)), ScheduledRequest("c", 0, 8, (5, 6))))
    good = StepPlan(scheduled=(decode, ScheduledRequest("b", 0, 12, (2, 3, 4))))
    return state, bad, good, config


LIMIT_RULE_CASES["watermark"] = case_watermark


def test_watermark_blocks_count_the_null_block_and_spare_the_first_admission() -> None:
    assert CONFIG.with_changes(watermark=0.3).watermark_blocks == 2  # int(0.3 * (8 + 1)), vLLM's num_blocks
    assert CONFIG.with_changes(watermark=0.1).watermark_blocks == 0
    state, bad, good, config = case_watermark()
    assert [v.request_id for v in violated_rules(state, bad, config)] == ["c"]
    # into an empty running set the first admission may take every block, the second may not
    empty = _state(_waiting("b", 0, 24), _waiting("c", 0, 4))
    first = StepPlan(scheduled=(ScheduledRequest("b", 0, 24, tuple(range(6))),))
    assert violated_rules(empty, first, config) == []
    both = StepPlan(scheduled=(*first.scheduled, ScheduledRequest("c", 0, 4, (6,))))
    assert [v.name for v in violated_rules(empty, both, config)] == ["watermark"]


def test_the_watermark_counts_a_hit_on_a_block_the_step_preemption_released() -> None:
    """vLLM counts every hit block at reference count 0 in the blocks an admission needs
    (SingleTypeKVCacheManager.get_num_blocks_to_allocate, num_evictable_blocks), and a block the step's
    preemption released is one: it leaves the free queue when the hit touches it. 8 blocks, watermark 2; r
    runs on block 0, p on blocks 1 and 2 (cached). The plan preempts p (blocks 1 and 2 free again) and
    admits q, which hits block 1 (p's first 4 prompt tokens)."""
    config = CONFIG.with_changes(max_num_batched_tokens=32, enable_prefix_caching=True, watermark=0.3)
    state = SchedulerState.initial(config)
    state = add_request(add_request(state, Request("r", 0, (1, 2, 3), max_tokens=4)),
                        Request("p", 0, tuple(range(10, 18)), max_tokens=4))
    first = StepPlan(scheduled=(ScheduledRequest("r", 0, 3, (0,)), ScheduledRequest("p", 0, 8, (1, 2))))
    state = apply_plan(state, first, {"r": 5, "p": 6}, config).state
    assert state.free_block_ids == (3, 4, 5, 6, 7)

    def admit_q(prompt_len: int):
        q = Request("q", 1, (10, 11, 12, 13, *range(40, 36 + prompt_len)), max_tokens=2)
        new = tuple(range(3, 3 + (prompt_len - 4) // 4))
        plan = StepPlan(scheduled=(ScheduledRequest("r", 3, 1), ScheduledRequest("q", 4, prompt_len - 4, new, (1,))),
                        preempted=("p",))
        return [(v.name, v.request_id) for v in violated_rules(add_request(state, q), plan, config)]

    # 5 free + 2 released - 5 new - the hit block = 1 < 2 (counting the hit only on the 5 free: 2, passed)
    assert admit_q(24) == [("watermark", "q")]
    assert admit_q(20) == []  # 4 new blocks: 2 left


def test_the_watermark_counts_the_blocks_released_by_preempting_a_request_that_ended_in_flight() -> None:
    """With a step in flight, the blocks of a request that ended since were held when the plan was made; a
    plan that preempts that request released them (rule in-flight-blocks-held-when-planned), so vLLM's free
    count has them. test_in_flight's state: a runs on blocks 0 and 1, c ended at step 0's sample and freed
    blocks 6 and 7; free now 7, 6, 2, 3, 4, 5; watermark int(0.5 * 9) = 4."""
    from tests.test_in_flight import DECODE_A, in_flight_state

    config = CONFIG.with_changes(max_num_seqs=3, watermark=0.5)
    state = in_flight_state("length")
    admit_b = ScheduledRequest("b", 0, 5, (2, 3))
    # c preempted: 4 free + 2 released - 2 new = 4 free after b, the watermark
    assert violated_rules(state, StepPlan(scheduled=(DECODE_A, admit_b), preempted=("c",)), config) == []
    # c not preempted: its blocks were held, 4 - 2 = 2 < 4
    assert [v.name for v in violated_rules(state, StepPlan(scheduled=(DECODE_A, admit_b)), config)] == ["watermark"]


@pytest.mark.parametrize("value", [-0.1, 1.0, 1, True, "0.1"])
def test_watermark_is_validated(value) -> None:
    with pytest.raises(ConfigError) as error:
        CONFIG.with_changes(watermark=value)
    assert error.value.field == "watermark"
    assert "watermark" not in CONFIG.to_dict() and CONFIG.with_changes(watermark=0.25).to_dict()["watermark"] == 0.25


@pytest.mark.parametrize("plan", VLLM_LIKE_PLANS, ids=VLLM_LIKE_IDS)
def test_the_policies_keep_the_watermark(plan) -> None:
    state, _, _, config = case_watermark()
    chosen = plan(state, config)
    assert [i.request_id for i in chosen.scheduled] == ["a", "b"]
    assert violated_rules(state, chosen, config) == []


def test_the_watermark_scenario_fails_when_the_watermark_is_ignored() -> None:
    scenario = load_scenario(CASES / "limit-watermark-keeps-blocks-free.json")
    _passes_on(scenario, "fcfs", "priority", "vllm-v1", "vllm-v1@0.33")
    verdicts = {v.name: v for v in replay(scenario, "test_limits:_watermark_blind").verdicts}
    assert not verdicts["invariants"].passed and "watermark" in verdicts["invariants"].detail


def _watermark_blind(config: SchedulerConfig) -> ReferenceScheduler:
    """fcfs that ignores ``watermark`` (a deliberate break)."""
    return ReferenceScheduler(config, lambda state, c: policies.fcfs(state, c.with_changes(watermark=0.0)),
                              "fcfs-watermark-blind", ALL_PROPERTIES)


# -------------------------------------------- the trace properties with requests that wait for a grammar
GRAMMAR_LINE = {
    "name": "grammar-line", "about": "schedspec diff --scheduler vllm --against vllm-v1 --seed 2 --grammar-steps 3, "
    "example 181, shrunk: r1 arrives first but waits for its grammar, r2 is admitted past it and, ahead of r1 in "
    "the running list, preempts it at step 8.",
    "config": {"block_size": 10, "num_kv_blocks": 7, "max_num_batched_tokens": 60, "max_num_seqs": 4,
               "max_model_len": 60, "enable_chunked_prefill": False},
    "requests": [
        {"id": "r4", "arrival_step": 3, "prompt_len": 37, "max_tokens": 4, "priority": 1, "grammar_compile_steps": 2},
        {"id": "r6", "arrival_step": 8, "prompt_len": 18, "max_tokens": 9, "grammar_compile_steps": 2},
        {"id": "r0", "arrival_step": 7, "prompt_len": 24, "max_tokens": 47},
        {"id": "r5", "arrival_step": 4, "prompt_len": 59, "max_tokens": 10, "priority": 2, "grammar_compile_steps": 2},
        {"id": "r3", "arrival_step": 3, "prompt_len": 37, "max_tokens": 4, "priority": 1, "grammar_compile_steps": 2},
        {"id": "r1", "arrival_step": 2, "prompt_len": 36, "max_tokens": 16, "grammar_compile_steps": 3},
        {"id": "r2", "arrival_step": 4, "prompt_len": 27, "max_tokens": 16},
    ],
    "expect": {"outcome": {r: "finished" for r in ("r4", "r6", "r0", "r5", "r3", "r1", "r2")}},
}
"""bounded-preemptions ranked requests by arrival, which a grammar wait breaks: r1 (oldest, bound 0) is
preempted by r2, admitted while r1's grammar compiled. The line is the running order then the queue."""


@pytest.mark.parametrize("name", ["vllm-v1", "fcfs"])
def test_properties_hold_when_admission_skips_a_compiling_grammar(name: str, tmp_path) -> None:
    path = tmp_path / "grammar-line.json"
    path.write_text(json.dumps(GRAMMAR_LINE))
    result = replay(load_scenario(path), name)
    failed = [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]
    assert not failed, failed


# ------------------------------------------------------------------------------- max_num_active_seqs
def case_active_sequence_cap():
    # max_num_active_seqs 1 (max_num_seqs 4): a runs, so admitting b makes 2 > 1; the decode alone is fine.
    config = CONFIG.with_changes(max_num_active_seqs=1)
    state = _state(_waiting("b", 0), running=(_running_a(),))
    bad = StepPlan(scheduled=(ScheduledRequest("a", 4, 1), ScheduledRequest("b", 0, 4, (2,))))
    good = StepPlan(scheduled=(ScheduledRequest("a", 4, 1),))
    return state, bad, good, config


LIMIT_RULE_CASES["active-sequence-cap"] = case_active_sequence_cap


@pytest.mark.parametrize("value", [0, 5, True, 1.5])
def test_max_num_active_seqs_is_validated(value) -> None:
    with pytest.raises(ConfigError) as error:
        CONFIG.with_changes(max_num_active_seqs=value)  # max_num_seqs is 4
    assert error.value.field == "max_num_active_seqs"
    assert CONFIG.active_seq_cap == 4 and CONFIG.with_changes(max_num_active_seqs=2).active_seq_cap == 2
    assert "max_num_active_seqs" not in CONFIG.to_dict()


@pytest.mark.parametrize("plan", VLLM_LIKE_PLANS, ids=VLLM_LIKE_IDS)
def test_the_policies_stop_admission_at_max_num_active_seqs(plan) -> None:
    state, _, _, config = case_active_sequence_cap()
    assert [i.request_id for i in plan(state, config).scheduled] == ["a"]
    assert [i.request_id for i in plan(state, config.with_changes(max_num_active_seqs=2)).scheduled] == ["a", "b"]


def _active_blind(config: SchedulerConfig) -> ReferenceScheduler:
    """fcfs that ignores ``max_num_active_seqs`` (a deliberate break)."""
    return ReferenceScheduler(config, lambda state, c: policies.fcfs(state, c.with_changes(max_num_active_seqs=None)),
                              "fcfs-active-blind", ALL_PROPERTIES)


def test_the_max_num_active_seqs_scenario_fails_when_the_cap_is_ignored() -> None:
    scenario = load_scenario(CASES / "limit-max-num-active-seqs.json")
    _passes_on(scenario, "fcfs", "priority", "vllm-v1", "vllm-v1@0.33")
    verdicts = {v.name: v for v in replay(scenario, "test_limits:_active_blind").verdicts}
    assert not verdicts["invariants"].passed and "active-sequence-cap" in verdicts["invariants"].detail


# ------------------------------------------------------------------------------- the threshold's floor
def test_the_threshold_floor_raises_the_cap_to_a_fair_share_and_no_further() -> None:
    config = CONFIG.with_changes(long_prefill_token_threshold=2, long_prefill_token_threshold_adaptive=True)
    assert config.effective_long_prefill_threshold(3) == 5  # max(2, 16 // 3)
    assert config.effective_long_prefill_threshold(1) == 16  # a lone request: the whole budget
    assert config.with_changes(long_prefill_token_threshold=0).effective_long_prefill_threshold(3) == 0
    assert CONFIG.with_changes(long_prefill_token_threshold=2).effective_long_prefill_threshold(3) == 2
    # two live requests (a running, b waiting): the floor is 16 // 2 = 8; b's chunk of 5 > 2 is allowed, 9 is not
    state = _state(_waiting("b", 0, 12), running=(_running_a(),))
    allowed = StepPlan(scheduled=(ScheduledRequest("a", 4, 1), ScheduledRequest("b", 0, 5, (2, 3))))
    assert violated_rules(state, allowed, config) == []
    assert [v.name for v in violated_rules(state, allowed, config.with_changes(
        long_prefill_token_threshold_adaptive=False))] == ["long-prefill-threshold"]
    over = StepPlan(scheduled=(ScheduledRequest("a", 4, 1), ScheduledRequest("b", 0, 9, (2, 3, 4))))
    assert [v.name for v in violated_rules(state, over, config)] == ["long-prefill-threshold"]
    with pytest.raises(ConfigError):
        CONFIG.with_changes(long_prefill_token_threshold_adaptive=1)


def _floor_blind(config: SchedulerConfig) -> ReferenceScheduler:
    """fcfs that ignores the threshold's floor (a deliberate break)."""
    return ReferenceScheduler(config, lambda state, c: policies.fcfs(
        state, c.with_changes(long_prefill_token_threshold_adaptive=False)), "fcfs-floor-blind", ALL_PROPERTIES)


def test_the_floor_scenario_fails_when_the_floor_is_ignored() -> None:
    scenario = load_scenario(CASES / "limit-threshold-floor.json")
    _passes_on(scenario, "fcfs", "priority", "vllm-v1", "vllm-v1@0.33")
    failed = {v.name for v in replay(scenario, "test_limits:_floor_blind").verdicts if not v.passed}
    assert any(name.startswith("first_token_by_step") for name in failed), failed


# ------------------------------------------------------------------------ the prefill cadence (0.33)
def _running_prefill() -> Request:
    """Running, 4 of its 12 prompt tokens computed (a prefill chunk in flight across steps), on block 2."""
    return Request("p", 0, tuple(range(200, 212)), max_tokens=2, status=RequestStatus.RUNNING,
                   num_computed_tokens=4, block_ids=(2,), admitted_step=0)


def _held_state(since: int = 0, bound: bool = False, *running: Request) -> SchedulerState:
    return attrs.evolve(_state(_waiting("b", 0, 8), running=running or (_running_a(),)),
                        prefill_cadence=PrefillCadence(since, bound))


def case_prefill_cadence():
    # interval 3, the last prefill one executed step back (0 + 1 < 3), a decodes: held. Admitting b is a prefill;
    # so is p's next chunk. The decode alone is fine.
    config = CONFIG.with_changes(prefill_schedule_interval=3)
    state = _held_state(0, False, _running_a(), _running_prefill())
    bad = StepPlan(scheduled=(ScheduledRequest("a", 4, 1), ScheduledRequest("p", 4, 4, (3,)),
                              ScheduledRequest("b", 0, 8, (4, 5))))
    good = StepPlan(scheduled=(ScheduledRequest("a", 4, 1),))
    return state, bad, good, config


LIMIT_RULE_CASES["prefill-cadence"] = case_prefill_cadence


def test_a_held_step_carries_no_prefill_and_which_steps_are_held() -> None:
    state, bad, good, config = case_prefill_cadence()
    assert [(v.name, v.request_id) for v in violated_rules(state, bad, config)] == [
        ("prefill-cadence", "p"), ("prefill-cadence", "b")]
    assert violated_rules(state, good, config) == []
    assert prefill_held(state, config)
    assert not prefill_held(state, CONFIG)  # interval 1: off
    assert prefill_held(_held_state(1), config) and not prefill_held(_held_state(2), config)  # 2 + 1 = 3 steps
    assert not prefill_held(_held_state(0, True), config)  # the last release step left the queue backed up
    assert not prefill_held(_held_state(0, False, _running_prefill()), config)  # nothing decodes
    assert not prefill_held(attrs.evolve(state, prefill_cadence=None), config)  # the first step is never held
    # a full prefix-cache hit leaves one token to compute: no prefill (vLLM's gate, num_tokens - 1)
    assert not carries_prefill(state, ScheduledRequest("b", 7, 1))
    assert carries_prefill(state, ScheduledRequest("b", 6, 2))


def test_the_cadence_counts_executed_steps_and_records_the_capacity_bound() -> None:
    _, _, _, config = case_prefill_cadence()
    held = _held_state(0)
    decode = StepPlan(scheduled=(ScheduledRequest("a", 4, 1),))
    # a held decode-only step: one more executed step, the bound is not recomputed
    assert cadence_after(held, decode, ("b",), config) == PrefillCadence(1, False)
    # a released step (2 back) that decodes only and leaves b waiting: backed up
    released = _held_state(2)
    assert cadence_after(released, decode, ("b",), config) == PrefillCadence(3, True)
    # one that admits b: the count restarts, the queue is drained
    admit = StepPlan(scheduled=(*decode.scheduled, ScheduledRequest("b", 0, 8, (2, 3))))
    assert cadence_after(released, admit, (), config) == PrefillCadence(0, False)
    # an empty step is not executed; a preemption step does not recompute the bound
    assert cadence_after(released, StepPlan(), ("b",), config) == PrefillCadence(2, True)
    assert cadence_after(released, StepPlan(scheduled=decode.scheduled, preempted=("x",)), ("b",),
                         config) == PrefillCadence(3, False)
    assert cadence_after(held, decode, ("b",), CONFIG) is None  # off: no history
    # a structured-output request never admitted is in vLLM's deferred_waiting from its arrival: not backed up
    grammar = attrs.evolve(released, requests={**released.requests, "b": attrs.evolve(
        released.requests["b"], grammar_ready_step=0)})
    assert cadence_after(grammar, decode, ("b",), config) == PrefillCadence(3, False)


def test_a_recompute_chunk_one_token_short_stays_a_prefill_chunk() -> None:
    """vLLM's is_prefill_chunk of a resumed request whose chunk stops one token short of its sequence is true,
    though the spec's request then looks like a decode: the cadence remembers it (``unsampled``), so a step
    with only that request running is not held (nothing decodes), and its next token restarts the count."""
    _, _, _, config = case_prefill_cadence()
    resumed = Request("c", 0, (1, 2, 3, 4), max_tokens=4, output_token_ids=(7, 8))  # 6 tokens, all to recompute
    state = attrs.evolve(_state(resumed), prefill_cadence=PrefillCadence(0))
    chunk = StepPlan(scheduled=(ScheduledRequest("c", 0, 5, (0, 1)),))  # 5 of 6: one short, nothing sampled
    after = apply_plan(state, chunk, {}, config).state
    assert after.requests["c"].is_decode and is_prefill_chunk(after, "c")
    assert after.prefill_cadence == PrefillCadence(0, False, frozenset({"c"}))
    assert not prefill_held(after, config)  # vLLM: no running request is past its prefill
    last = StepPlan(scheduled=(ScheduledRequest("c", 5, 1),))
    assert carries_prefill(after, last.scheduled[0])
    assert apply_plan(after, last, {"c": 9}, config).state.prefill_cadence == PrefillCadence(0, False)


def test_the_cadence_is_validated_and_left_out_of_traces_while_off() -> None:
    for value in (0, True, 1.5, "2"):
        with pytest.raises(ConfigError) as error:
            CONFIG.with_changes(prefill_schedule_interval=value)
        assert error.value.field == "prefill_schedule_interval"
    assert "prefill_schedule_interval" not in CONFIG.to_dict()
    assert CONFIG.with_changes(prefill_schedule_interval=4).limits_on == ("prefill_schedule_interval",)


@pytest.mark.parametrize("plan", [policies.fcfs, lambda s, c: plan_vllm_v1(s, c, version="0.33")],
                         ids=["fcfs", "vllm-v1@0.33"])
def test_the_policies_hold_prefills_on_a_held_step(plan) -> None:
    state, _, _, config = case_prefill_cadence()
    assert [i.request_id for i in plan(state, config).scheduled] == ["a"]
    released = attrs.evolve(state, prefill_cadence=PrefillCadence(2))
    assert [i.request_id for i in plan(released, config).scheduled] == ["a", "p", "b"]


@pytest.mark.parametrize("name", ["vllm-v1", "vllm-v1-priority", "priority"])
def test_schedulers_that_do_not_follow_the_cadence_refuse_it(name: str) -> None:
    config = CONFIG.with_changes(prefill_schedule_interval=2)
    with pytest.raises(UnsupportedFeature, match="prefill_schedule_interval=2"):
        make_scheduler(name, config)


def _cadence_blind(config: SchedulerConfig) -> ReferenceScheduler:
    """fcfs that ignores ``prefill_schedule_interval`` (a deliberate break)."""
    return ReferenceScheduler(config, lambda state, c: policies.fcfs(state, c.with_changes(prefill_schedule_interval=1)),
                              "fcfs-cadence-blind", ALL_PROPERTIES)


def test_the_cadence_scenario_fails_when_the_cadence_is_ignored() -> None:
    scenario = load_scenario(CASES / "limit-prefill-cadence-holds-prefills.json")
    _passes_on(scenario, "fcfs", "vllm-v1@0.33", "vllm-v1-priority@0.33")
    verdicts = {v.name: v for v in replay(scenario, "test_limits:_cadence_blind").verdicts}
    assert not verdicts["invariants"].passed and "prefill-cadence" in verdicts["invariants"].detail


def test_check_refuses_an_async_trace_with_the_prefill_cadence(tmp_path: Path) -> None:
    """The cadence of a plan made while a step is in flight is not specified (``prefill_held`` never holds
    one), so ``check`` refuses such a trace with exit 3 rather than pass whatever its cadence did; the same
    header without async scheduling is judged (exit 0: an empty, legal trace)."""
    from click.testing import CliRunner

    from schedspec.cli import cli
    from schedspec.spec.trace import header_line

    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=2,
                             max_model_len=32, prefill_schedule_interval=2)
    for asynchronous, status in ((True, 3), (False, 0)):
        trace = tmp_path / f"cadence-{asynchronous}.jsonl"
        trace.write_text(header_line(config, "vllm@0.33", async_scheduling=asynchronous) + "\n")
        result = CliRunner().invoke(cli, ["check", str(trace)], prog_name="schedspec")
        assert result.exit_code == status, result.output
        if asynchronous:
            assert "prefill_schedule_interval=2" in result.output and "Traceback" not in result.output
