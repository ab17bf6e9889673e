"""The Runner as a token source: packed mixed batches, one forward call per step, sampling, EOS,
preemption (recompute), timing. Runs on ``$SCHEDSPEC_DEVICE`` (default cpu) with the tiny model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from schedspec.gpu_backend import Runner  # noqa: E402
from schedspec.gpu_backend.testing import device_for_tests, plan_step, run_step, run_to_end, state_with  # noqa: E402
from schedspec.spec.config import SchedulerConfig  # noqa: E402
from schedspec.spec.request import RequestStatus  # noqa: E402
from schedspec.spec.state import StepPlan  # noqa: E402
from schedspec.spec.transitions import add_request  # noqa: E402
from schedspec.spec.workload import DEFAULT_VOCAB_SIZE, EOS_TOKEN_ID, RequestSpec  # noqa: E402

CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=96, max_num_batched_tokens=128, max_num_seqs=8,
                         max_model_len=96)
SPECS = [RequestSpec("a", 13, 6), RequestSpec("b", 5, 6), RequestSpec("c", 1, 6), RequestSpec("d", 22, 6)]


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    # Tiny matmuls on a small shared CPU run faster (and steadier) on one thread.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def runner():
    return Runner(CONFIG, device=device_for_tests(), record_logits="last")


def _solo_outputs(runner: Runner, spec: RequestSpec) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    runner.reset()
    state = state_with(CONFIG, [spec])
    logits = []
    while state.requests:
        state, _, _ = run_step(runner, state, CONFIG, plan_step(state, CONFIG))
        logits.extend(runner.last_logits.values())
    return state.finished[spec.request_id].output_token_ids, logits


@pytest.fixture(scope="module")
def solo(runner):
    return {spec.request_id: _solo_outputs(runner, spec) for spec in SPECS}


def test_mixed_packed_batch_matches_solo_runs_with_one_forward_per_step(runner, solo):
    """Chunks of 5 tokens: the steps mix prefill chunks at offsets with decodes; every request gets the
    tokens (and logits) it gets alone, and each step is one forward call."""
    runner.reset()
    state = state_with(CONFIG, SPECS, free_block_ids=tuple(reversed(range(CONFIG.num_kv_blocks))))
    logits: dict[str, list[torch.Tensor]] = {spec.request_id: [] for spec in SPECS}
    steps = mixed_steps = 0
    while state.requests:
        plan = plan_step(state, CONFIG, chunk=5)
        sizes = {item.num_tokens for item in plan.scheduled}
        mixed_steps += 1 in sizes and any(size > 1 for size in sizes)
        state, _, seconds = run_step(runner, state, CONFIG, plan)
        steps += 1
        assert runner.num_forward_calls == steps
        assert seconds > 0
        for request_id, row in runner.last_logits.items():
            logits[request_id].append(row)
    assert mixed_steps >= 2
    for spec in SPECS:
        outputs, solo_logits = solo[spec.request_id]
        assert state.finished[spec.request_id].output_token_ids == outputs
        for got, want in zip(logits[spec.request_id], solo_logits, strict=True):
            assert (got - want).abs().max().item() < 1e-4


def test_sampled_ids_are_in_vocab_and_never_eos_by_default(solo):
    for outputs, _ in solo.values():
        assert len(outputs) == 6
        assert all(1 <= t < DEFAULT_VOCAB_SIZE for t in outputs)


def test_recorded_logits_argmax_is_the_greedy_token(runner):
    runner.reset()
    state = state_with(CONFIG, [RequestSpec("a", 9, 3)])
    while state.requests:
        state, sampled, _ = run_step(runner, state, CONFIG, plan_step(state, CONFIG))
        row = runner.last_logits["a"].clone()
        assert row.shape == (DEFAULT_VOCAB_SIZE,) and row.dtype == torch.float32
        row[EOS_TOKEN_ID] = -float("inf")
        assert sampled["a"] == int(row.argmax())


def test_middle_chunks_sample_nothing_and_empty_plan_runs_nothing(runner):
    runner.reset()
    state = state_with(CONFIG, [RequestSpec("a", 12, 3)])
    state, sampled, _ = run_step(runner, state, CONFIG, plan_step(state, CONFIG, chunk=5))
    assert sampled == {} and runner.num_forward_calls == 1
    assert runner.execute(StepPlan(), state) == ({}, 0.0)
    assert runner.num_forward_calls == 1


def test_eos_at_output_stops_the_request(solo):
    runner = Runner(CONFIG, device=device_for_tests(), eos_at_output={"a": 3, "b": 1})
    state = run_to_end(runner, state_with(CONFIG, SPECS[:3]), CONFIG, chunk=8)
    a, b, c = (state.finished[r] for r in "abc")
    assert a.output_token_ids == solo["a"][0][:2] + (EOS_TOKEN_ID,) and a.status is RequestStatus.FINISHED_STOPPED
    assert b.output_token_ids == (EOS_TOKEN_ID,) and b.finish_reason == "stop"
    assert c.output_token_ids == solo["c"][0] and c.finish_reason == "length"


def test_recompute_after_preemption_gives_the_same_tokens(solo):
    """Preempt "d" after 3 outputs (its blocks go to "a" in the same step), recompute it later from
    position 0 (prompt plus outputs as prefill): same tokens as alone. Debug mode checks every block."""
    config = CONFIG.with_changes(num_kv_blocks=9)
    runner = Runner(config, device=device_for_tests(), debug=True)
    state = state_with(config, [RequestSpec("d", 22, 6)])
    while len(state.requests["d"].output_token_ids) < 3:
        state, _, _ = run_step(runner, state, config, plan_step(state, config))
    state = add_request(state, RequestSpec("a", 13, 6).to_request(state.step))
    plan = plan_step(state, config, only={"a"}, preempt={"d"})
    assert set(plan.scheduled[0].new_block_ids) & set(state.requests["d"].block_ids)
    state, _, _ = run_step(runner, state, config, plan)
    assert state.requests["d"].status is RequestStatus.PREEMPTED
    while "a" in state.requests:
        state, _, _ = run_step(runner, state, config, plan_step(state, config, only={"a"}))
    state = run_to_end(runner, state, config)
    assert state.finished["d"].num_preemptions == 1
    assert state.finished["d"].output_token_ids == solo["d"][0]
    assert state.finished["a"].output_token_ids == solo["a"][0]


def test_temperature_sampling_is_seeded_per_request_not_per_batch():
    def outputs(specs, seed):
        runner = Runner(CONFIG, device=device_for_tests(), temperature=0.9, top_p=0.95, seed=seed)
        state = run_to_end(runner, state_with(CONFIG, specs), CONFIG, chunk=7)
        return {r: state.finished[r].output_token_ids for r in state.finished}

    alone = outputs(SPECS[:1], seed=3)
    together = outputs(SPECS, seed=3)
    assert together["a"] == alone["a"]
    assert all(1 <= t < DEFAULT_VOCAB_SIZE for out in together.values() for t in out)
    assert outputs(SPECS[:1], seed=4)["a"] != alone["a"]


def test_runs_on_the_requested_device_and_in_bfloat16(solo):
    device = device_for_tests()
    runner = Runner(CONFIG, device=device, dtype="bfloat16")
    assert runner.device.type == torch.device(device).type
    assert runner.kv_cache.key[0].device.type == runner.device.type and runner.kv_cache.key[0].dtype == torch.bfloat16
    state = run_to_end(runner, state_with(CONFIG, SPECS), CONFIG, chunk=6)
    for spec in SPECS:
        outputs = state.finished[spec.request_id].output_token_ids
        assert len(outputs) == 6 and all(1 <= t < DEFAULT_VOCAB_SIZE for t in outputs)
