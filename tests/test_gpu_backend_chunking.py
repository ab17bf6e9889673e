"""Property: any chunking of the prefills, any block order, any batch mix gives each request the tokens
it gets alone (greedy, tiny model, ``$SCHEDSPEC_DEVICE``)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from schedspec.gpu_backend import Runner  # noqa: E402
from schedspec.gpu_backend.testing import device_for_tests, plan_step, run_step, run_to_end, state_with  # noqa: E402
from schedspec.spec.config import SchedulerConfig  # noqa: E402
from schedspec.spec.transitions import add_request  # noqa: E402
from schedspec.spec.workload import RequestSpec  # noqa: E402

CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=96, max_num_batched_tokens=128, max_num_seqs=8,
                         max_model_len=96)
SPECS = [RequestSpec("a", 13, 5), RequestSpec("b", 5, 5), RequestSpec("c", 1, 5), RequestSpec("d", 22, 5)]


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def runner():
    return Runner(CONFIG, device=device_for_tests(), debug=True)


@pytest.fixture(scope="module")
def solo(runner):
    outputs = {}
    for spec in SPECS:
        runner.reset()
        state = run_to_end(runner, state_with(CONFIG, [spec]), CONFIG)
        outputs[spec.request_id] = state.finished[spec.request_id].output_token_ids
    return outputs


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chunks=st.lists(st.integers(1, 9), min_size=4, max_size=4),
    arrivals=st.lists(st.integers(0, 4), min_size=4, max_size=4),
    preempt_at=st.one_of(st.none(), st.integers(1, 8)),
    seed=st.integers(0, 2**16),
)
def test_any_chunking_arrival_preemption_and_block_order_gives_the_solo_tokens(
        runner, solo, chunks, arrivals, preempt_at, seed):
    """Requests arrive at different steps, prefill in different chunk sizes, one may be preempted
    (recomputed later), blocks come in a random order; debug mode checks every block access."""
    rng = random.Random(seed)
    order = list(range(CONFIG.num_kv_blocks))
    rng.shuffle(order)
    runner.reset()
    state = state_with(CONFIG, [], free_block_ids=tuple(order))
    chunk = {spec.request_id: size for spec, size in zip(SPECS, chunks, strict=True)}
    pending = sorted(zip(arrivals, range(len(SPECS)), strict=True))
    for step in range(200):
        while pending and pending[0][0] <= step:
            state = add_request(state, SPECS[pending.pop(0)[1]].to_request(state.step))
        if not state.requests and not pending:
            break
        preempt = [rng.choice(state.running)] if step == preempt_at and state.running else []
        state, _, _ = run_step(runner, state, CONFIG, plan_step(state, CONFIG, chunk, preempt=preempt))
    assert not state.requests
    for spec in SPECS:
        assert state.finished[spec.request_id].output_token_ids == solo[spec.request_id]
