"""Debug mode: block-ownership checks on every write and read, NaN poisoning of freed blocks, and the
block-table checks made in every mode."""

from __future__ import annotations

import attrs
import pytest

torch = pytest.importorskip("torch")

from schedspec.gpu_backend import BlockTableError, Runner  # noqa: E402
from schedspec.gpu_backend.testing import device_for_tests, plan_step, run_step, run_to_end, state_with  # noqa: E402
from schedspec.spec.config import SchedulerConfig  # noqa: E402
from schedspec.spec.state import ScheduledRequest, StepPlan  # noqa: E402
from schedspec.spec.transitions import abort_request, add_request  # noqa: E402
from schedspec.spec.workload import RequestSpec  # noqa: E402

CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                         max_model_len=64)


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def runner():
    return Runner(CONFIG, device=device_for_tests(), debug=True)


@pytest.fixture
def prefilled(runner):
    """After one step: "a" (8-token prompt) holds blocks 0, 1; "b" (6 tokens) holds 2, 3; both sampled."""
    state = state_with(CONFIG, [RequestSpec("a", 8, 4), RequestSpec("b", 6, 4)])
    state, _, _ = run_step(runner, state, CONFIG, plan_step(state, CONFIG))
    assert state.requests["a"].block_ids == (0, 1) and state.requests["b"].block_ids == (2, 3)
    return state


def _with_blocks(state, request_id, block_ids):
    requests = dict(state.requests)
    requests[request_id] = attrs.evolve(requests[request_id], block_ids=tuple(block_ids))
    return attrs.evolve(state, requests=requests)


def _decode(request, new_block_ids=()):
    return ScheduledRequest(request.request_id, request.num_computed_tokens, 1, tuple(new_block_ids))


def test_writing_into_another_requests_block_is_caught(runner, prefilled):
    plan = StepPlan(scheduled=(_decode(prefilled.requests["a"], [2]),))  # block 2 belongs to "b"
    with pytest.raises(BlockTableError, match=r"new_block_ids writes into block 2, which is owned by request 'b'"):
        runner.execute(plan, prefilled)


def test_reading_through_a_block_table_that_lists_another_requests_block_is_caught(runner, prefilled):
    state = _with_blocks(prefilled, "b", [0, 3])  # "b"'s table now points at "a"'s block 0
    with pytest.raises(BlockTableError, match=r"request 'b': block_ids lists block 0 owned by 'a'"):
        runner.execute(StepPlan(scheduled=(_decode(state.requests["b"]),)), state)


def test_new_block_missing_from_the_free_queue_is_caught(runner, prefilled):
    state = attrs.evolve(prefilled, free_block_ids=tuple(b for b in prefilled.free_block_ids if b != 9))
    plan = StepPlan(scheduled=(_decode(state.requests["a"], [9]),))
    with pytest.raises(BlockTableError, match=r"block 9, which is not in free_block_ids"):
        runner.execute(plan, state)


def test_one_free_block_given_to_two_requests_is_caught(runner, prefilled):
    plan = StepPlan(scheduled=(_decode(prefilled.requests["a"], [4]), _decode(prefilled.requests["b"], [4])))
    with pytest.raises(BlockTableError, match=r"block 4 is also given to request 'a'"):
        runner.execute(plan, prefilled)


def test_reading_positions_never_written_is_caught(prefilled):
    fresh = Runner(CONFIG, device=device_for_tests(), debug=True)  # never ran the prefill
    with pytest.raises(BlockTableError, match=r"only positions \[0, 0\) were written"):
        fresh.execute(StepPlan(scheduled=(_decode(prefilled.requests["a"], [4]),)), prefilled)


@pytest.mark.parametrize("debug", [False, True])
def test_short_or_out_of_range_block_tables_fail_in_every_mode(debug):
    runner = Runner(CONFIG, device=device_for_tests(), debug=debug)
    state = state_with(CONFIG, [RequestSpec("a", 8, 4)])
    short = StepPlan(scheduled=(ScheduledRequest("a", 0, 8, (0,)),))
    with pytest.raises(BlockTableError, match=r"request 'a': block table \[0\] holds 4 tokens but the chunk ends"):
        runner.execute(short, state)
    outside = StepPlan(scheduled=(ScheduledRequest("a", 0, 8, (0, 16)),))
    with pytest.raises(BlockTableError, match=r"outside \[0, 16\)"):
        runner.execute(outside, attrs.evolve(state, free_block_ids=tuple(range(17))))


def test_freed_blocks_are_poisoned_and_a_wrong_read_poisons_the_logits(runner, prefilled):
    state = abort_request(prefilled, "a")  # blocks 0, 1 go back to the free queue
    plan = StepPlan(scheduled=(_decode(state.requests["b"]),))
    state, _, _ = run_step(runner, state, CONFIG, plan)
    for layer in range(runner.model_config.num_hidden_layers):
        for cache in (runner.kv_cache.key[layer], runner.kv_cache.value[layer]):
            assert cache[[0, 1]].isnan().all()
            # "b" has written positions 0..6: block 2 whole, block 3 slots 0..2 (slot 3 is still NaN).
            assert not cache[2].isnan().any() and not cache[3, :3].isnan().any()
            assert cache[3, 3].isnan().all()

    # A block table pointing at a freed block: the ownership check names it ...
    bad = _with_blocks(state, "b", [0, 3])
    decode = StepPlan(scheduled=(_decode(bad.requests["b"]),))
    with pytest.raises(BlockTableError, match=r"block_ids lists block 0 owned by no request \(free\)"):
        runner.execute(decode, bad)
    # ... and with that check off, the NaN in the freed block reaches the logits and is reported.
    runner.check_block_tables = False
    with pytest.raises(BlockTableError, match=r"NaN logits for request\(s\) \['b'\]"):
        runner.execute(decode, bad)


def test_debug_mode_changes_no_token_while_blocks_are_freed_poisoned_and_reused():
    """A pool of 6 blocks: "b" reuses "a"'s freed (NaN) blocks, partly filled; same tokens as without
    debug mode, and no NaN anywhere."""
    config = CONFIG.with_changes(num_kv_blocks=6)
    results = []
    for debug in (False, True):
        runner = Runner(config, device=device_for_tests(), debug=debug)
        state = run_to_end(runner, state_with(config, [RequestSpec("a", 13, 6)]), config, chunk=5)
        state = add_request(state, RequestSpec("b", 6, 6).to_request(state.step))
        assert set(state.free_block_ids[:3]) & {0, 1, 2, 3, 4}
        state = run_to_end(runner, state, config, chunk=4)
        results.append({r: state.finished[r].output_token_ids for r in ("a", "b")})
    assert results[0] == results[1]
