"""Prefix-hit sharing in the backend: a request admitted with ``num_computed_tokens`` = the hit length and a
block table that starts with blocks another request computed computes only the rest, reads those blocks
in place (no copy), and samples exactly the tokens it gets alone without a hit; debug mode (freed-block
NaN poisoning) stays on: a freed block the scheduler keeps cached keeps its KV until it is handed out
again, and one it does not keep is poisoned, so a hit on it is caught.

The spec's prefix cache (branch prefix-cache) is not merged here, so the steps with a hit are advanced
by :func:`_apply`, a minimal stand-in for its transitions (shared blocks, refcounts by table), and the
runner is told the hits and the cached blocks through its own keywords (``prefix_hits``,
``cached_blocks``); one test drives the defaults (plan items' ``cached_block_ids``, the state's
``prefix_cache.block_hashes``) that the merged spec will feed. Built-in tiny model, greedy, about 3 s
on CPU.
"""

from __future__ import annotations

import types

import attrs
import pytest

torch = pytest.importorskip("torch")

from schedspec.gpu_backend import Runner  # noqa: E402
from schedspec.gpu_backend.errors import BlockTableError  # noqa: E402
from schedspec.gpu_backend.testing import device_for_tests, run_to_end, state_with  # noqa: E402
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens  # noqa: E402
from schedspec.spec.request import RequestStatus  # noqa: E402
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan  # noqa: E402
from schedspec.spec.transitions import add_request  # noqa: E402
from schedspec.spec.workload import RequestSpec, token_id_at, token_ids  # noqa: E402

CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=48)
A = RequestSpec("a", 14, 5, prefix_group="p", prefix_len=8)  # shares its first 8 ids (2 blocks) with B
B = RequestSpec("b", 11, 5, prefix_group="p", prefix_len=8)
C = RequestSpec("c", 2, 1)
HIT = 8


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def solo():
    runner = Runner(CONFIG, device=device_for_tests(), debug=True)
    outputs = {}
    for spec in (A, B):
        runner.reset()
        final = run_to_end(runner, state_with(CONFIG, [spec]), CONFIG)
        outputs[spec.request_id] = final.finished[spec.request_id].output_token_ids
    return outputs


def _apply(state: SchedulerState, plan: StepPlan, sampled, hits) -> SchedulerState:
    """The state after ``plan`` as the spec with prefix caching will have it: a hit's blocks start the
    table; a request that reaches ``max_tokens`` finishes and a block no live table holds any more goes
    back to the free queue (to its back, as a cached block)."""
    requests, finished = dict(state.requests), dict(state.finished)
    running, waiting, free = list(state.running), list(state.waiting), list(state.free_block_ids)
    for item in plan.scheduled:
        request_id = item.request_id
        request = requests[request_id]
        hit = tuple(hits.get(request_id, ()))
        for block in hit + item.new_block_ids:
            if block in free:
                free.remove(block)
        outputs = request.output_token_ids + ((sampled[request_id],) if request_id in sampled else ())
        request = attrs.evolve(request, block_ids=request.block_ids + hit + item.new_block_ids, output_token_ids=outputs,
                                  num_computed_tokens=item.num_computed_tokens + item.num_tokens,
                                  status=RequestStatus.RUNNING)
        if request_id in waiting:
            waiting.remove(request_id)
            running.append(request_id)
        requests[request_id] = request
    for request_id in list(running):
        request = requests[request_id]
        if len(request.output_token_ids) >= request.max_tokens:
            running.remove(request_id)
            del requests[request_id]
            finished[request_id] = attrs.evolve(request, block_ids=(), status=RequestStatus.FINISHED_LENGTH,
                                                   finish_reason="length")
            held = {b for r in requests.values() for b in r.block_ids}
            free.extend(b for b in request.block_ids if b not in held)
    return SchedulerState(state.step + 1, tuple(waiting), tuple(running), requests, finished, tuple(free),
                          state.num_requests_added)


def _continue(state: SchedulerState) -> StepPlan:
    """Every live request computes all its pending tokens, new blocks from the front of the free queue."""
    free = list(state.free_block_ids)
    items = []
    for request_id in (*state.running, *state.waiting):
        request = state.requests[request_id]
        need = blocks_for_tokens(request.num_tokens, CONFIG.block_size) - len(request.block_ids)
        items.append(ScheduledRequest(request_id, request.num_computed_tokens, request.num_pending_tokens,
                                      tuple(free[:need])))
        free = free[need:]
    return StepPlan(tuple(items))


def _hit_plan(state: SchedulerState, hit_blocks: tuple[int, ...]) -> StepPlan:
    """B admitted with ``hit_blocks`` (8 tokens): computes positions 8..10 only, in a new block."""
    plan = _continue(attrs.evolve(state, waiting=tuple(r for r in state.waiting if r != "b")))
    taken = {b for item in plan.scheduled for b in item.new_block_ids}
    new = tuple(b for b in state.free_block_ids if b not in taken and b not in hit_blocks)[:1]
    return StepPlan(plan.scheduled + (ScheduledRequest("b", HIT, B.prompt_len - HIT, new),))


def _drain(runner: Runner, state: SchedulerState, cached: set[int]) -> SchedulerState:
    while state.requests:
        plan = _continue(state)
        sampled, _ = runner.execute(plan, state, prefix_hits={}, cached_blocks=cached)
        state = _apply(state, plan, sampled, {})
    return state


def _nan_blocks(runner: Runner, blocks) -> list[bool]:
    """Per block: is it NaN (poisoned) in every layer's keys and values?"""
    cache = runner.kv_cache
    return [all(bool(t[b].isnan().all()) for t in (*cache.key, *cache.value)) for b in blocks]


def test_the_two_prompts_share_exactly_two_blocks():
    a, b = A.to_request(0), B.to_request(0)
    assert list(token_ids(a, 0, HIT)) == list(token_ids(b, 0, HIT)) and token_id_at(a, HIT) != token_id_at(b, HIT)


def test_hit_on_blocks_a_running_request_holds_gives_the_solo_tokens(solo):
    runner = Runner(CONFIG, device=device_for_tests(), debug=True)
    state = state_with(CONFIG, [A])
    plan = _continue(state)
    state = _apply(state, plan, runner.execute(plan, state)[0], {})
    hit_blocks = state.requests["a"].block_ids[:2]
    state = add_request(state, B.to_request(state.step))
    plan = _hit_plan(state, hit_blocks)
    before_forward = runner.num_forward_calls
    sampled, _ = runner.execute(plan, state, prefix_hits={"b": hit_blocks}, cached_blocks=set(hit_blocks))
    assert runner.num_forward_calls == before_forward + 1
    shared = [b for b in runner.ledger.owners if runner.ledger.owners[b] == {"a", "b"}]
    assert sorted(shared) == sorted(hit_blocks)  # the same physical blocks, held by both: no copy
    assert runner.ledger.filled["b"] == B.prompt_len
    state = _apply(state, plan, sampled, {"b": hit_blocks})
    assert state.requests["b"].block_ids[:2] == hit_blocks and state.requests["b"].num_computed_tokens == 11
    final = _drain(runner, state, set(hit_blocks))
    assert final.finished["b"].output_token_ids == solo["b"]
    assert final.finished["a"].output_token_ids == solo["a"]


def _a_alone_then_b(runner: Runner, cached: set[int]):
    """A runs to its end (its first two blocks published as cached); B arrives after. Returns the state
    and A's first two blocks."""
    state = state_with(CONFIG, [A])
    plan = _continue(state)
    state = _apply(state, plan, runner.execute(plan, state, cached_blocks=cached)[0], {})
    hit_blocks = state.requests["a"].block_ids[:2]
    others = state.requests["a"].block_ids[2:]
    state = _drain(runner, state, cached)
    return add_request(state, B.to_request(state.step)), hit_blocks, others


def test_hit_on_cached_blocks_of_a_finished_request_keeps_their_kv_and_gives_the_solo_tokens(solo):
    runner = Runner(CONFIG, device=device_for_tests(), debug=True)
    state, hit_blocks, others = _a_alone_then_b(runner, cached={0, 1})
    assert hit_blocks == (0, 1)
    plan = _hit_plan(state, hit_blocks)
    sampled, _ = runner.execute(plan, state, prefix_hits={"b": hit_blocks}, cached_blocks={0, 1})
    # A's blocks were released at this step: the cached ones kept their KV, the others were poisoned
    assert _nan_blocks(runner, others) == [True] * len(others)
    assert runner.ledger.owners[0] == {"b"} and not runner.ledger.cached
    final = _drain(runner, _apply(state, plan, sampled, {"b": hit_blocks}), set())
    assert final.finished["b"].output_token_ids == solo["b"]


def test_a_hit_on_blocks_the_scheduler_did_not_keep_reads_poison_and_is_caught():
    """Deliberate break: the same hit, but the scheduler never said A's blocks stay cached, so they were
    poisoned when A ended; the ledger names the hit, and without that check the NaN reaches the logits."""
    runner = Runner(CONFIG, device=device_for_tests(), debug=True)
    state, hit_blocks, _ = _a_alone_then_b(runner, cached=set())
    plan = _hit_plan(state, hit_blocks)
    with pytest.raises(BlockTableError, match=r"prefix hit on block 0, which holds no valid KV"):
        runner.execute(plan, state, prefix_hits={"b": hit_blocks}, cached_blocks=set())
    runner.check_block_tables = False
    with pytest.raises(BlockTableError, match=r"NaN logits for request\(s\) \['b'\]"):
        runner.execute(plan, state, prefix_hits={"b": hit_blocks}, cached_blocks=set())


def test_a_cached_block_handed_out_again_is_poisoned_before_its_new_owner_writes():
    runner = Runner(CONFIG, device=device_for_tests(), debug=True)
    state, _, _ = _a_alone_then_b(runner, cached={0, 1})
    state = add_request(attrs.evolve(state, waiting=()), C.to_request(state.step))
    state = attrs.evolve(state, requests={k: v for k, v in state.requests.items() if k != "b"})
    plan = StepPlan((ScheduledRequest("c", 0, 2, (0,)),))  # C (2 tokens) takes cached block 0: evicted
    runner.execute(plan, state, prefix_hits={}, cached_blocks={0, 1})
    cache = runner.kv_cache
    for tensor in (*cache.key, *cache.value):
        assert not tensor[0, :2].isnan().any() and tensor[0, 2:].isnan().all()  # A's stale KV is gone
        assert not tensor[1].isnan().any()  # still cached
    assert 0 not in runner.ledger.cached and 1 in runner.ledger.cached


def test_the_defaults_read_the_prefix_cache_design_fields(solo):
    """What the merged spec will feed: plan items with ``cached_block_ids`` and a state whose
    ``prefix_cache.block_hashes`` lists the published blocks; no keywords."""

    @attrs.frozen(slots=True)
    class ItemWithHit(ScheduledRequest):
        cached_block_ids: tuple[int, ...] = ()

    @attrs.frozen(slots=True)
    class StateWithCache(SchedulerState):
        prefix_cache: object = None

    def with_cache(state: SchedulerState, blocks) -> StateWithCache:
        cache = types.SimpleNamespace(block_hashes={b: f"h{b}" for b in blocks})
        return StateWithCache(state.step, state.waiting, state.running, state.requests, state.finished,
                              state.free_block_ids, state.num_requests_added, prefix_cache=cache)

    runner = Runner(CONFIG, device=device_for_tests(), debug=True)
    state = state_with(CONFIG, [A])
    while state.requests:
        plan = _continue(state)
        state = _apply(state, plan, runner.execute(plan, with_cache(state, (0, 1)))[0], {})
    state = add_request(state, B.to_request(state.step))
    plain = _hit_plan(state, (0, 1))
    items = tuple(ItemWithHit(i.request_id, i.num_computed_tokens, i.num_tokens, i.new_block_ids,
                              cached_block_ids=(0, 1) if i.request_id == "b" else ()) for i in plain.scheduled)
    plan = StepPlan(items)
    sampled, _ = runner.execute(plan, with_cache(state, (0, 1)))
    assert runner.ledger.tables["b"][:2] == (0, 1)
    final = _drain(runner, _apply(state, plan, sampled, {"b": (0, 1)}), set())
    assert final.finished["b"].output_token_ids == solo["b"]


def test_a_hit_on_blocks_of_other_tokens_changes_the_output(solo):
    """Deliberate break, to show the token equality above is not vacuous: B "hits" A's blocks 0 and 2
    (block 2 holds A's positions 8-11, not B's 4-7); the ledger cannot know the content (the spec's
    block hashes do), and B's tokens differ from its solo tokens."""
    runner = Runner(CONFIG, device=device_for_tests(), debug=True)
    state, _, _ = _a_alone_then_b(runner, cached={0, 1, 2, 3})
    plan = _hit_plan(state, (0, 2))
    sampled, _ = runner.execute(plan, state, prefix_hits={"b": (0, 2)}, cached_blocks={0, 1, 2, 3})
    final = _drain(runner, _apply(state, plan, sampled, {"b": (0, 2)}), set())
    assert final.finished["b"].output_token_ids != solo["b"]
