"""Tests that kill surviving mutants of ``spec/prefix_cache.py`` (issue 28: ``scripts/mutmut.sh prefix_cache``).

Each test's docstring names the mutants it kills (by what they change: names move whenever the module does) and
why the behaviour matters. Expected values are computed here from the documented definitions (blake2b of the
parent and the little-endian int64 token ids; vLLM's free-queue order), not read from the code under test.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from test_prefix_cache import CONFIG, HIT_B, warm_state  # tests/ is on sys.path under pytest

import schedspec.spec.prefix_cache as prefix_cache
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import check_step
from schedspec.spec.persistent import evolve_request
from schedspec.spec.prefix_cache import (
    NULL_BLOCK,
    ROOT_HASH,
    CacheUpdate,
    PrefixCache,
    block_hash,
    publishes_at_step,
    request_block_hashes,
)
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import violated_rules
from schedspec.spec.state import ScheduledRequest, StepPlan
from schedspec.spec.transitions import add_request, apply_plan


def _blake(parent: str, tokens: list[int]) -> str:
    """The documented block hash, written out: blake2b (16 bytes) of the parent's ASCII, ``|``, then each token
    id as 8 little-endian bytes."""
    data = parent.encode("ascii") + b"|" + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@pytest.mark.parametrize("stored", [list, np.int32, np.uint16, ">i8"], ids=["list", "int32", "uint16", "big-endian"])
def test_a_block_hash_is_blake2b_of_int64_token_ids_however_they_are_stored(stored) -> None:
    """``block_hash`` (the dtype given as ``None`` or dropped): the hash is that of the token ids' values as
    little-endian int64, whatever integer type holds them (a prompt's ids may come as a list or as a narrower or
    big-endian numpy array); otherwise equal prefixes could get different hashes and a hit be missed. Also pins
    the documented formula (parent, ``|``, ids), so that traces stay reproducible across processes."""
    tokens = [5, 70000 % 65536, 31999, 0]
    held = tokens if stored is list else np.asarray(tokens, dtype=stored)
    parent = _blake(ROOT_HASH, [1, 2, 3, 4])
    assert block_hash(parent, held) == _blake(parent, tokens)
    assert block_hash(ROOT_HASH, held) == _blake(ROOT_HASH, tokens)


def test_the_hash_memo_is_hit_and_a_hit_equals_a_fresh_hash(monkeypatch) -> None:
    """``request_block_hash``'s memo (its lookup dropped or keyed wrong, or the value stored as ``None``: the memo
    never hit). Its contract (speed only): a second lookup of a request's blocks hashes nothing again, nor does a
    later version of the request (an output appended, as every step does), and what the memo returns equals the
    chain computed afresh from the token ids. Observed by counting ``block_hash`` calls."""
    calls: list[str] = []
    real = prefix_cache.block_hash

    def counting(parent, token_ids):
        calls.append(parent)
        return real(parent, token_ids)

    monkeypatch.setattr(prefix_cache, "block_hash", counting)
    prompt = tuple(range(300, 312))  # 3 full blocks of 4
    request = Request("m", 0, prompt, max_tokens=4)
    fresh = [_blake(ROOT_HASH, list(prompt[:4]))]
    fresh.append(_blake(fresh[0], list(prompt[4:8])))
    fresh.append(_blake(fresh[1], list(prompt[8:12])))
    assert request_block_hashes(request, 3, 4) == fresh and len(calls) == 3
    assert request_block_hashes(request, 3, 4) == fresh and len(calls) == 3  # all three from the memo
    later = evolve_request(request, output_token_ids=(7, 8, 9, 10))
    assert request_block_hashes(later, 3, 4) == fresh and len(calls) == 3  # the later version shares the memo
    assert request_block_hashes(later, 4, 4)[3] == _blake(fresh[2], [7, 8, 9, 10]) and len(calls) == 4


def test_the_view_is_the_cache_as_it_is_now() -> None:
    """``CacheUpdate.view`` (its ``block_hashes`` or ``ref_counts`` left out or ``None``): the view a policy reads
    shows every edit so far: a cached block handed out has lost its hash and is held, so it is not evictable; an
    evictable block a hit touched is held."""
    request = Request("p", 0, tuple(range(12)), max_tokens=1)
    first = _blake(ROOT_HASH, list(range(4)))
    second = _blake(first, list(range(4, 8)))
    cache = PrefixCache({0: first, 1: second}, {first: (0,), second: (1,)}, {})
    update = CacheUpdate(cache, (2, 3, 0, 1))
    update.touch((0,))
    update.take((1,))
    view = update.view()
    assert dict(view.block_hashes) == {0: first} and dict(view.ref_counts) == {0: 1, 1: 1}
    assert not view.is_evictable(0) and not view.is_evictable(1)
    assert view.longest_hit(request, 4) == (0,)


def test_taking_the_queues_front_edits_the_queue_in_place() -> None:
    """``CacheUpdate.take``'s fast path (its length ``None``: taken only when the blocks are the whole queue):
    handing out the front of the free queue, the usual case, removes them in place rather than rebuilding a queue
    of thousands of blocks for every request of every step (performance: the general path gives the same queue,
    which ``test_taking_blocks_from_anywhere_in_the_free_queue_removes_exactly_them`` checks)."""
    update = CacheUpdate(PrefixCache(), (4, 5, 6, 7))
    queue = update.free
    assert update.take_front(2) == (4, 5)
    assert update.free is queue and queue == [6, 7]


def test_a_null_entry_is_skipped_and_the_blocks_after_it_still_count() -> None:
    """``CacheUpdate.free_blocks`` and ``touch`` (``continue`` turned into ``break`` at a :data:`NULL_BLOCK`): a
    sliding window's table holds null entries before its live blocks; releasing it frees every live block (last
    first, to the front of the queue), and a hit through it references every live block."""
    update = CacheUpdate(PrefixCache(), (3, 4, 5))
    update.take((3, 4))
    update.release((NULL_BLOCK, 3, NULL_BLOCK, 4))
    assert update.free == [4, 3, 5] and dict(update.ref_counts) == {}
    update.touch((NULL_BLOCK, 4, NULL_BLOCK, 3))
    assert update.free == [5] and dict(update.ref_counts) == {4: 1, 3: 1}


def test_a_faulty_hit_outside_the_pool_is_reported_not_a_crash() -> None:
    """``CacheUpdate.touch`` (``count == 0 and block in free`` turned into ``or``): a faulty plan that names a hit
    on a block outside the pool (block 9 of 8) is reported by the rule ``prefix-hit-is-cached-chain``, and the
    spec still applies it (the checker goes on to the invariants) instead of failing with a ``ValueError`` on a
    block that is not in the free queue."""
    state = warm_state()
    plan = StepPlan(scheduled=(ScheduledRequest("b", 8, 2, (2,), cached_block_ids=(0, 9)),))
    assert {(v.name, v.request_id) for v in violated_rules(state, plan, CONFIG)} == {("prefix-hit-is-cached-chain", "b")}
    after = apply_plan(state, plan, {"b": 7}, CONFIG).state
    assert after.prefix_cache.ref_counts[9] == 1 and 9 not in after.free_block_ids
    assert after.free_block_ids == (3, 4, 5, 6, 7, 1)  # block 0 (hit) and block 2 (new) left the queue


def test_a_faulty_handout_of_a_held_block_counts_every_table() -> None:
    """``CacheUpdate.take`` (the new count read at another key: 1 instead of one more than the block had): a faulty
    plan hands out block 2, which ``b`` holds, to ``c``. The rule ``blocks-from-free-pool`` reports it, and block
    2's count is 2, the number of tables holding it, so the invariant ``prefix-ref-counts`` does not report the
    same fault a second time."""
    state = apply_plan(warm_state(), StepPlan(scheduled=(HIT_B,)), {"b": 77}, CONFIG).state
    state = add_request(state, Request("c", 2, tuple(range(200, 206)), max_tokens=2))
    plan = StepPlan(scheduled=(ScheduledRequest("c", 0, 6, (2, 3)),))
    assert [(v.name, v.request_id) for v in violated_rules(state, plan, CONFIG)] == [("blocks-from-free-pool", "c")]
    after = apply_plan(state, plan, {"c": 7}, CONFIG).state
    holders = [r for r in after.requests.values() if 2 in r.block_ids]
    assert len(holders) == 2 and after.prefix_cache.ref_counts[2] == 2
    assert "prefix-ref-counts" not in {v.name for v in check_step(state, plan, after, CONFIG)}


SGLANG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32,
                         enable_prefix_caching=True, prefix_cache_publication="sglang-radix")


@pytest.mark.parametrize(("status", "outputs", "computed", "publishes"), [
    (RequestStatus.RUNNING, (5,), 8, False),  # a decode: 9 tokens, 8 computed, its one pending token sampled
    (RequestStatus.RUNNING, (5, 6), 8, True),  # 10 tokens, 2 pending: a prefill chunk (recomputation)
    (RequestStatus.RUNNING, (), 4, True),  # a prefill chunk of the prompt
    (RequestStatus.WAITING, (5,), 0, True),  # a preempted request's first chunk again
])
def test_sglang_publishes_a_prefill_chunk_at_its_step_and_a_decode_at_the_finish(status, outputs, computed,
                                                                                   publishes) -> None:
    """``publishes_at_step`` (its test inverted, ``vllm`` compared the other way, or the decode's pending count
    moved from 1 to 2): with SGLang's publication a step publishes a request's blocks unless the item is a decode
    (running, with outputs, exactly one token left to compute: SGLang 0.5.23 inserts decoded tokens into the
    radix tree only at the finish); with vLLM's every step publishes."""
    request = evolve_request(Request("s", 0, tuple(range(8)), max_tokens=4), status=status,
                             output_token_ids=outputs, num_computed_tokens=computed)
    assert publishes_at_step(request, SGLANG) is publishes
    assert publishes_at_step(request, CONFIG) is True


def test_a_group_table_publishes_its_full_blocks_after_its_null_entries() -> None:
    """``CacheUpdate.publish`` for a group past 0 (``continue`` turned into ``break`` at a null or already
    published entry): a sliding window's table starts with :data:`NULL_BLOCK` entries (blocks the window freed)
    and may start with blocks a hit reused; every full block after them still gets its hash, under the group's
    key (``<hash>@<group>``, vLLM ``BlockHashWithGroupId``), so a later request can hit it in that group."""
    prompt = tuple(range(500, 517))  # 17 tokens: 4 full blocks of 4
    request = Request("w", 0, prompt, max_tokens=1)
    chain = [_blake(ROOT_HASH, list(prompt[:4]))]
    for index in (1, 2, 3):
        chain.append(_blake(chain[-1], list(prompt[4 * index:4 * index + 4])))
    update = CacheUpdate(PrefixCache(), (4, 5, 6))
    update.take((4, 5, 6))
    update.publish(request, (NULL_BLOCK, 4, 5), 12, 4, group=1)
    assert dict(update.block_hashes) == {4: f"{chain[1]}@1", 5: f"{chain[2]}@1"}
    update.publish(request, (NULL_BLOCK, 4, 5, 6), 16, 4, group=1)  # 4 and 5 published already: 6 still is
    assert update.block_hashes[6] == f"{chain[3]}@1" and update.hash_to_blocks[f"{chain[3]}@1"] == (6,)


def test_a_deduplication_onto_other_tokens_names_both_blocks() -> None:
    """``CacheUpdate.publish``'s error (its message replaced by ``None``): a de-duplication whose cached block does
    not carry the hash of the block it replaces is refused with a message naming the request's own block and the
    cached block (the two numbers a user needs to find the faulty record; the checker reports it as a plan the
    spec cannot apply)."""
    request = Request("d", 0, tuple(range(600, 609)), max_tokens=1)
    other = _blake(ROOT_HASH, [1, 2, 3, 4])  # block 7 caches other tokens
    update = CacheUpdate(PrefixCache({7: other}, {other: (7,)}, {}), (3, 7))
    update.take((3,))
    with pytest.raises(ValueError, match=r"\b3\b.*\b7\b"):
        update.publish(request, (3,), 4, 4, replaced={3: 7})
