"""The incremental checker (used by the lab) finds exactly what the full check finds, on every step of
random runs, and on states broken on purpose."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from schedspec.reference.fake_model import FakeModel
from schedspec.reference.scheduler import make_scheduler
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.incremental import IncrementalChecker
from schedspec.spec.invariants import check_step
from schedspec.spec.request import RequestStatus
from schedspec.spec.rules import violated_rules
from schedspec.spec.state import ScheduledRequest
from schedspec.spec.transitions import abort_request
from schedspec.spec.workload import RequestSpec


class _Flat:
    def step_seconds(self, prefill: int, decode: int, kv: int) -> float:
        return 0.01


@st.composite
def runs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(8, 96))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max(max_num_seqs, 1 if chunked else max_model_len), max(max_num_seqs, max_model_len) + 32))
    config = SchedulerConfig(
        block_size=block_size, num_kv_blocks=draw(st.integers(1, 40)), max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
    )
    requests = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 100), st.integers(1, 20),
                                       st.one_of(st.none(), st.integers(0, 30)),
                                       st.sampled_from([None, "a", "b"]), st.integers(0, 64)), max_size=10))
    specs = [RequestSpec(f"r{i}", prompt, out, arrival_step=arrive,  # an abort is due at or after arrival
                         abort_at_step=None if abort is None else max(abort, arrive),
                         prefix_group=group, prefix_len=shared)  # shared prompt prefixes: prefix-cache hits
             for i, (arrive, prompt, out, abort, group, shared) in enumerate(requests)]
    return config, specs, draw(st.sampled_from(["fcfs", "static", "shortest-prompt-first"]))


def _verdict(violations):
    """What a check reports: each violation's name, kind, step, request and code (as a multiset)."""
    return Counter((v.name, v.kind, v.step, v.request_id, v.code) for v in violations)


FAULTS = {
    "block owned twice": lambda s, before, checked: _give_block(s, lambda req, other: req.block_ids + other.block_ids[:1]),
    "block leaked": lambda s, before, checked: attrs.evolve(s, free_block_ids=s.free_block_ids[1:]) if s.free_block_ids else None,
    "block out of range": lambda s, before, checked: _give_block(s, lambda req, other: req.block_ids + (10**6,)),
    # the first id past the pool (num_kv_blocks itself: an off-by-one range test of the ledger passes it)
    "block one past the pool": lambda s, before, checked: _past_the_pool(s),
    "terminal holds blocks": lambda s, before, checked: _finished_with_blocks(s, before),
    # a request that ended in this step keeps its table in its record while its blocks were freed as they should:
    # the ledger proves the blocks and must still name the terminal request's table (its own check)
    "ended request keeps its freed table": lambda s, before, checked: _ended_keeps_table(s, before),
    # Faults that keep the free queue's length right (the count alone cannot see them).
    "owned block in the free queue": lambda s, before, checked: _owned_in_queue(s),
    "duplicate in the free queue": lambda s, before, checked: (
        attrs.evolve(s, free_block_ids=s.free_block_ids[1:] + s.free_block_ids[-1:]) if len(s.free_block_ids) > 1 else None),
    # the queue's second block replaced by an owned one (same length: only the kept-part comparison sees it)
    "owned block in the middle of the free queue": lambda s, before, checked: _owned_in_middle(s),
    "out-of-range id in the free queue": lambda s, before, checked: (
        attrs.evolve(s, free_block_ids=s.free_block_ids[1:] + (10**6,)) if s.free_block_ids else None),
    "aborted request not terminal": lambda s, before, checked: _aborted_not_terminal(s, before, checked),
    # Prefix caching: faults of the cache's bookkeeping, made through its working copy (as a faulty
    # transition would make them, so the change log the incremental checker follows records them).
    "reference count off": lambda s, before, checked: _cache_fault(s, _count_off),
    "held block loses its hash": lambda s, before, checked: _cache_fault(s, _unhash_held),
    "uncomputed block published": lambda s, before, checked: _cache_fault(s, _publish_uncomputed),
    "block listed twice under its hash": lambda s, before, checked: _cache_fault(s, _list_twice),
    "block published under another hash": lambda s, before, checked: _cache_fault(s, _rehash),
    "held block in the free queue": lambda s, before, checked: _held_in_queue(s),
    # an evictable block (no holder, so no chain check reaches it) whose hash changes while the hash map is
    # left as it was, or lists it under the new hash and still under the old one
    "evictable block rehashed, not relisted": lambda s, before, checked: _cache_fault(s, _rehash_evictable),
    "evictable block rehashed, still under its old hash": lambda s, before, checked: _cache_fault(
        s, lambda update, state: _rehash_evictable(update, state, new_listing=True)),
    "evictable block rehashed, listed under neither": lambda s, before, checked: _cache_fault(
        s, lambda update, state: _rehash_evictable(update, state, old_listing=False)),
    # a free block joins a table (its count 1) but stays in the free queue, which is otherwise as before
    "held block left in an unchanged free queue": lambda s, before, checked: _held_still_free(s),
    # the cache replaced by one built directly (no change log) with a reference count off
    "cache rebuilt without a change log": lambda s, before, checked: _rebuilt_cache(s),
    # two working copies in a row: the first publishes an uncomputed block, the second writes a count again
    "uncomputed block published, then another working copy": lambda s, before, checked: _twice(s),
    # another table's unpublished block joins a table, its count left at 1 (only the reference count is wrong)
    "unpublished block in a second table": lambda s, before, checked: _share(s, hashed=False, count=False),
    # another request's published block joins a table after its own blocks, its count raised (only the
    # request's chain is wrong: that block's hash is not the hash of this request's tokens there)
    "published block in a second table": lambda s, before, checked: _share(s, hashed=True, count=True),
    # a table that holds one of its blocks twice (its count left as it was)
    "block twice in one table": lambda s, before, checked: _twice_in_table(s),
    # a published block dropped from its hash's listing while it keeps its hash
    "published block unlisted": lambda s, before, checked: _cache_fault(s, _unlist),
    # Not a breach (the full check finds nothing): the free queue reordered, which the ledger cannot follow.
    "free queue reordered": lambda s, before, checked: (
        attrs.evolve(s, free_block_ids=s.free_block_ids[::-1]) if len(s.free_block_ids) > 1 else None),
}


NOT_BREACHES = {"free queue reordered"}


def _cache_fault(state, edit):
    """``state`` with its prefix cache edited by ``edit(update, state)`` through the writers of a
    :class:`~schedspec.spec.prefix_cache.CacheUpdate`, as a faulty transition would edit it (``None``:
    caching off, or nothing to edit)."""
    from schedspec.spec.prefix_cache import CacheUpdate

    if state.prefix_cache is None:
        return None
    update = CacheUpdate(state.prefix_cache, state.free_block_ids)
    if edit(update, state) is False:
        return None
    cache, free = update.freeze()
    return attrs.evolve(state, prefix_cache=cache, free_block_ids=free)


def _held(state, hashed=None):
    blocks = [b for r in state.requests.values() for b in r.block_ids]
    if hashed is not None:
        blocks = [b for b in blocks if (b in state.prefix_cache.block_hashes) == hashed]
    return blocks


def _count_off(update, state):
    held = _held(state)
    if not held:
        return False
    update._set_count(held[-1], update.ref_counts.get(held[-1], 0) + 1)


def _unhash_held(update, state):
    """A held block loses its hash: one followed, in the table of a request holding it, by a published block,
    so that the table's published blocks no longer come first (``prefix-published-computed``). Unhashing the
    last published block of a table breaks no rule of the spec, which requires only that published blocks be
    computed and come first, not that every full computed block be published (vLLM 0.32 publishes them at
    allocation, ``KVCacheManager.allocate_slots`` -> ``coordinator.cache_blocks``, but not for a request whose
    remote KV load is in flight, ``delay_cache_blocks``), so such a fault would be undetectable by either check
    and is not made."""
    hashes = state.prefix_cache.block_hashes
    followed = [block for r in state.requests.values() for index, block in enumerate(r.block_ids[:-1])
                if block in hashes and r.block_ids[index + 1] in hashes]
    if not followed:
        return False
    update._evict(followed[0])


def _publish_uncomputed(update, state):
    held = _held(state, hashed=False)
    if not held:
        return False
    update._set_hash(held[0], "f" * 32)
    update._set_listed("f" * 32, (held[0],))


def _list_twice(update, state):
    held = _held(state, hashed=True)
    if not held:
        return False
    value = state.prefix_cache.block_hashes[held[0]]
    update._set_listed(value, update.hash_to_blocks[value] + (held[0],))


def _rehash(update, state):
    held = _held(state, hashed=True)
    if not held:
        return False
    old = update.block_hashes[held[-1]]
    update._set_listed(old, tuple(b for b in update.hash_to_blocks[old] if b != held[-1]))
    update._set_hash(held[-1], "e" * 32)
    update._set_listed("e" * 32, (held[-1],))


def _rehash_evictable(update, state, new_listing=False, old_listing=True):
    """An evictable block's hash becomes another; it is listed under the new one (``new_listing``) and kept
    under the old one (``old_listing``) or not."""
    evictable = [b for b in state.prefix_cache.block_hashes if not state.prefix_cache.ref_counts.get(b)]
    if not evictable:
        return False
    block_id = evictable[0]
    old = update.block_hashes[block_id]
    update._set_hash(block_id, "d" * 32)
    if new_listing:
        update._set_listed("d" * 32, (block_id,))
    if not old_listing:
        update._set_listed(old, tuple(b for b in update.hash_to_blocks[old] if b != block_id))


def _held_still_free(state):
    from schedspec.spec.prefix_cache import CacheUpdate

    cache = state.prefix_cache
    live = [r for r in state.requests.values() if r.block_ids]
    free = [b for b in state.free_block_ids if b not in cache.block_hashes] if cache is not None else []
    if not live or not free:
        return None
    update = CacheUpdate(cache, state.free_block_ids)
    update._set_count(free[-1], 1)
    requests = dict(state.requests)
    requests[live[0].request_id] = attrs.evolve(live[0], block_ids=live[0].block_ids + (free[-1],))
    return attrs.evolve(state, requests=requests, prefix_cache=update.freeze_cache())


def _rebuilt_cache(state):
    from schedspec.spec.prefix_cache import PrefixCache

    cache = state.prefix_cache
    held = _held(state)
    if cache is None or not held:
        return None
    counts = dict(cache.ref_counts)
    counts[held[0]] += 1
    return attrs.evolve(state, prefix_cache=PrefixCache(dict(cache.block_hashes), dict(cache.hash_to_blocks), counts))


def _twice(state):
    from schedspec.spec.prefix_cache import CacheUpdate

    broken = _cache_fault(state, _publish_uncomputed)
    held = _held(state)
    if broken is None or not held:
        return None
    update = CacheUpdate(broken.prefix_cache, broken.free_block_ids)
    update._set_count(held[0], update.ref_counts[held[0]])
    return attrs.evolve(broken, prefix_cache=update.freeze_cache())


def _share(state, hashed, count):
    from schedspec.spec.prefix_cache import CacheUpdate

    cache = state.prefix_cache
    live = [r for r in state.requests.values() if r.block_ids]
    if cache is None or len(live) < 2:
        return None
    taker, giver = live[0], live[1]
    given = [b for b in giver.block_ids if (b in cache.block_hashes) == hashed and b not in taker.block_ids]
    if not given:
        return None
    requests = dict(state.requests)
    requests[taker.request_id] = attrs.evolve(taker, block_ids=taker.block_ids + (given[-1],))
    update = CacheUpdate(cache, state.free_block_ids)
    if count:
        update._set_count(given[-1], update.ref_counts[given[-1]] + 1)
    return attrs.evolve(state, requests=requests, prefix_cache=update.freeze_cache())


def _twice_in_table(state):
    live = [r for r in state.requests.values() if r.block_ids]
    if state.prefix_cache is None or not live:
        return None
    requests = dict(state.requests)
    requests[live[0].request_id] = attrs.evolve(live[0], block_ids=live[0].block_ids + live[0].block_ids[-1:])
    return attrs.evolve(state, requests=requests)


def _unlist(update, state):
    hashed = sorted(state.prefix_cache.block_hashes)
    if not hashed:
        return False
    value = update.block_hashes[hashed[0]]
    update._set_listed(value, tuple(b for b in update.hash_to_blocks[value] if b != hashed[0]))


def _held_in_queue(state):
    held = _held(state)
    if state.prefix_cache is None or not held or not state.free_block_ids:
        return None
    return attrs.evolve(state, free_block_ids=(held[0],) + tuple(state.free_block_ids[1:]))


def _owned_in_middle(state):
    owned = [b for r in state.requests.values() for b in r.block_ids]
    if not owned or len(state.free_block_ids) < 3:
        return None
    queue = tuple(state.free_block_ids)
    return attrs.evolve(state, free_block_ids=queue[:1] + (owned[0],) + queue[2:])


def _owned_in_queue(state):
    owned = [b for r in state.requests.values() for b in r.block_ids]
    if not owned or not state.free_block_ids:
        return None
    return attrs.evolve(state, free_block_ids=state.free_block_ids[1:] + (owned[0],))


def _aborted_not_terminal(state, before, checked):
    """A request aborted before this step (possibly in the step it arrived, before the checker saw it live)
    is left with a live status among the terminal requests. Only a request that became terminal since the
    previous step (not in ``checked``, the terminal ids of the previous step's state) is chosen: the
    incremental checker checks a terminal request once, in the step it becomes terminal (its module
    docstring), so breaking one that ended steps ago is outside its contract."""
    aborted = [r for r, q in state.finished.items() if q.finish_reason == "abort" and r in before.finished
               and before.finished[r].admitted_step is None and r not in checked]
    if not aborted:
        return None
    finished = dict(state.finished)
    finished[aborted[-1]] = attrs.evolve(finished[aborted[-1]], status=RequestStatus.WAITING)
    return attrs.evolve(state, finished=finished)


def _pool_size(state):
    """num_kv_blocks of a state that keeps block-conservation: every block is free or in a live table."""
    return len(set(state.free_block_ids) | {b for r in state.requests.values() for b in r.block_ids})


def _past_the_pool(state):
    """A table gains the id num_kv_blocks; with prefix caching its reference count is written too (through a
    working copy), so that only the range check can see it."""
    from schedspec.spec.prefix_cache import CacheUpdate

    size = _pool_size(state)
    broken = _give_block(state, lambda req, other: req.block_ids + (size,))
    if broken is None or state.prefix_cache is None:
        return broken
    update = CacheUpdate(state.prefix_cache, state.free_block_ids)
    update._set_count(size, 1)
    return attrs.evolve(broken, prefix_cache=update.freeze_cache())


def _give_block(state, table):
    live = [r for r in state.requests.values() if r.block_ids]
    if len(live) < 2:
        return None
    first, second = live[0], live[1]
    requests = dict(state.requests)
    requests[first.request_id] = attrs.evolve(first, block_ids=table(first, second))
    return attrs.evolve(state, requests=requests)


def _ended_keeps_table(state, before):
    ended = [r for r in state.finished if r in before.requests and before.requests[r].block_ids]
    if not ended:
        return None
    finished = dict(state.finished)
    finished[ended[0]] = attrs.evolve(finished[ended[0]], block_ids=before.requests[ended[0]].block_ids)
    return attrs.evolve(state, finished=finished)


def _finished_with_blocks(state, before):
    """A request that ends in this step keeps a block (terminal requests never change afterwards: the
    spec's transitions never touch them, so a request is checked once, when it ends)."""
    ended = [r for r in state.finished if r in before.requests]
    if not ended or not state.free_block_ids:
        return None
    request_id, request = ended[0], state.finished[ended[0]]
    finished = dict(state.finished)
    finished[request_id] = attrs.evolve(request, block_ids=state.free_block_ids[:1])
    return attrs.evolve(state, finished=finished, free_block_ids=state.free_block_ids[1:])


@settings(max_examples=300, deadline=None)
@given(runs(), st.sampled_from(sorted(FAULTS)), st.integers(0, 40))
def test_incremental_equals_full_check(run, fault, fault_step):
    config, specs, name = run
    scheduler = make_scheduler(name, config)
    model = FakeModel(config, cost_model=_Flat())
    checker = IncrementalChecker(config)
    pending = sorted(specs, key=lambda s: s.arrival_step)
    step = 0
    checked: frozenset[str] = frozenset()  # terminal ids of the previous step's state
    while step < 200:
        for spec in [s for s in pending if s.arrival_step == step]:
            scheduler.add_request(spec.to_request(step))
        for spec in specs:
            if spec.abort_at_step == step:
                scheduler.state = abort_request(scheduler.state, spec.request_id)
        before = scheduler.state
        if not before.requests and step > max((s.arrival_step for s in specs), default=0):
            break
        checker.sync(before)
        plan = scheduler.schedule()
        assert violated_rules(before, plan, config) == []
        sampled, _ = model.execute(plan, before)
        scheduler.update(plan, sampled)
        after = scheduler.state
        broken = FAULTS[fault](after, before, checked) if step == fault_step else None
        target = broken if broken is not None else after
        full = check_step(before, plan, target, config)
        incremental = checker.invariants(before, plan, target)
        assert _verdict(incremental) == _verdict(full), (fault if broken is not None else "no fault", step)
        if broken is not None:
            assert full or fault in NOT_BREACHES, f"the fault {fault!r} must be detected"
            if full:
                return  # else: a change that breaks nothing; go on (the checker rebuilds its ledger)
        checked = frozenset(after.finished)
        step += 1
        fault_step = -1 if broken is not None else fault_step


def _advance(scheduler, model, checker):
    """One step of a driven run: the checker synced to the state before it, the plan made and applied; returns
    (state before, plan, state after)."""
    before = scheduler.state
    checker.sync(before)
    plan = scheduler.schedule()
    sampled, _ = model.execute(plan, before)
    scheduler.update(plan, sampled)
    return before, plan, scheduler.state


def _step_inputs(scheduler, specs, step: int) -> bool:
    """Give ``scheduler`` the arrivals and the aborts of ``step`` from ``specs``; False when the run is over
    (nothing live and no arrival to come)."""
    for spec in specs:
        if spec.arrival_step == step:
            scheduler.add_request(spec.to_request(step))
        if spec.abort_at_step == step:
            scheduler.state = abort_request(scheduler.state, spec.request_id)
    return bool(scheduler.state.requests) or step <= max(s.arrival_step for s in specs)


def _drive(config, specs, name, fault=None, fault_step=None, checker=None):
    """Run ``name`` on ``specs`` and compare the incremental and the full check at every step, breaking
    the state after step ``fault_step`` with FAULTS[fault]; returns the verdicts of that step (or None)."""
    scheduler = make_scheduler(name, config)
    model = FakeModel(config, cost_model=_Flat())
    checker = checker if checker is not None else IncrementalChecker(config)
    checked: frozenset[str] = frozenset()
    for step in range(200):
        if not _step_inputs(scheduler, specs, step):
            return None
        before, plan, after = _advance(scheduler, model, checker)
        broken = FAULTS[fault](after, before, checked) if step == fault_step else None
        target = broken if broken is not None else after
        full, incremental = check_step(before, plan, target, config), checker.invariants(before, plan, target)
        assert _verdict(incremental) == _verdict(full), step
        if broken is not None:
            return full
        checked = frozenset(after.finished)
    return None


CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=3, max_model_len=32)
SPECS = [RequestSpec(f"r{i}", 5 + 3 * i, 4 + i, arrival_step=i // 2) for i in range(6)]


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "prefix-caching"])
def test_correct_run_never_falls_back_to_the_full_block_checks(caching):
    """The block ledger proves the block invariants (block-conservation; with prefix caching also the
    reference counts, the free/evictable/held partition and the published blocks) on every step of a
    correct run (with preemptions, finishes, aborts and prefix-cache hits and evictions), so the full
    checks, whose cost grows with the pool, never run."""
    config = CONFIG.with_changes(num_kv_blocks=8, enable_prefix_caching=caching)
    specs = [attrs.evolve(s, prefix_group="p", prefix_len=8) for s in SPECS]
    specs += [RequestSpec("aborted", 6, 4, arrival_step=1, abort_at_step=3, prefix_group="p", prefix_len=8)]
    hits = 0
    for name in ("fcfs", "static", "shortest-prompt-first"):
        checker = IncrementalChecker(config)
        assert _drive(config, specs, name, checker=checker) is None
        assert checker.fallbacks == 0, name
        hits += bool(caching and checker.cache.block_hashes)
    assert hits or not caching  # the cache was used


def test_arrival_aborted_before_its_first_step_and_broken_then_is_reported():
    """A request that arrives and is aborted before the checker ever sees it live is still checked in
    that step: left with a live status, both checks report it (queues-disjoint)."""
    specs = SPECS[:2] + [RequestSpec("gone", 3, 2, arrival_step=1, abort_at_step=1)]
    full = _drive(CONFIG, specs, "fcfs", fault="aborted request not terminal", fault_step=1)
    assert full is not None and "gone" in {v.request_id for v in full}


def _mutate_item(plan, index, **changes):
    items = list(plan.scheduled)
    items[index % len(items)] = attrs.evolve(items[index % len(items)], **changes)
    return attrs.evolve(plan, scheduled=tuple(items))


def _waiting_not_scheduled(state, plan):
    scheduled = {item.request_id for item in plan.scheduled} | {r for r, _ in plan.rejected}
    return [r for r in state.waiting if r not in scheduled]


PLAN_FAULTS = {
    "one token more": lambda s, p, i: p.scheduled and _mutate_item(p, i, num_tokens=p.scheduled[i % len(p.scheduled)].num_tokens + 1),
    "one token less": lambda s, p, i: p.scheduled and _mutate_item(p, i, num_tokens=p.scheduled[i % len(p.scheduled)].num_tokens - 1),
    "many tokens": lambda s, p, i: p.scheduled and _mutate_item(p, i, num_tokens=10**4),
    "chunk starts early": lambda s, p, i: p.scheduled and _mutate_item(
        p, i, num_computed_tokens=p.scheduled[i % len(p.scheduled)].num_computed_tokens - 1),
    "scheduled twice": lambda s, p, i: p.scheduled and attrs.evolve(p, scheduled=p.scheduled + p.scheduled[:1]),
    "block missing": lambda s, p, i: any(x.new_block_ids for x in p.scheduled) and _mutate_item(
        p, next(k for k, x in enumerate(p.scheduled) if x.new_block_ids), new_block_ids=()),
    "block too many": lambda s, p, i: p.scheduled and s.free_block_ids and _mutate_item(
        p, i, new_block_ids=p.scheduled[i % len(p.scheduled)].new_block_ids + (s.free_block_ids[-1],)),
    "unknown request": lambda s, p, i: attrs.evolve(p, scheduled=p.scheduled + (ScheduledRequest("nobody", 0, 1),)),
    "prefix hit without caching": lambda s, p, i: p.scheduled and _mutate_item(p, i, cached_block_ids=(0,)),
    "preempt a waiting request": lambda s, p, i: s.waiting and attrs.evolve(p, preempted=p.preempted + (s.waiting[0],)),
    "preempt a scheduled request": lambda s, p, i: p.scheduled and attrs.evolve(
        p, preempted=p.preempted + (p.scheduled[i % len(p.scheduled)].request_id,)),
    "reject a running request": lambda s, p, i: s.running and attrs.evolve(p, rejected=p.rejected + ((s.running[0], "x: y"),)),
    "admit a rejected request": lambda s, p, i: p.rejected and attrs.evolve(
        p, rejected=p.rejected[1:], scheduled=p.scheduled + (_admission(s, p, p.rejected[0][0]),)),
    "admit one more": lambda s, p, i: _waiting_not_scheduled(s, p) and attrs.evolve(
        p, scheduled=p.scheduled + (_admission(s, p, _waiting_not_scheduled(s, p)[0]),)),
}


def _admission(state, plan, request_id):
    """An admission of one token (its whole prompt without chunking) with the blocks it needs: breaks no
    rule but the one the fault aims at (admit-fits-alone, sequence-cap, or the budget)."""
    from schedspec.spec.config import blocks_for_tokens

    request = state.requests[request_id]
    num_tokens = request.num_pending_tokens if not CHUNKED[0] else 1
    handed = {b for item in plan.scheduled for b in item.new_block_ids}
    spare = [b for b in state.free_block_ids if b not in handed]
    return ScheduledRequest(request_id, 0, num_tokens, tuple(spare[:blocks_for_tokens(num_tokens, BLOCK_SIZE[0])]))


CHUNKED, BLOCK_SIZE = [True], [16]


@settings(deadline=None)  # examples: the active profile's (500 derandomized in CI)
@given(runs(), st.sampled_from(sorted(PLAN_FAULTS)), st.integers(0, 12), st.integers(0, 7))
def test_incremental_rules_equal_the_rules_on_broken_plans(run, fault, fault_step, index):
    """The checker's rule verdicts (its screen of SCREENED and its ledger's free pool) are the rules'
    verdicts, on every plan of random runs and on plans broken on purpose."""
    config, specs, name = run
    CHUNKED[0], BLOCK_SIZE[0] = config.enable_chunked_prefill, config.block_size
    scheduler = make_scheduler(name, config)
    model = FakeModel(config, cost_model=_Flat())
    checker = IncrementalChecker(config)
    for step in range(200):
        for spec in specs:
            if spec.arrival_step == step:
                scheduler.add_request(spec.to_request(step))
        before = scheduler.state
        if not before.requests and step > max((s.arrival_step for s in specs), default=0):
            break
        checker.sync(before)
        plan = scheduler.schedule()
        broken = PLAN_FAULTS[fault](before, plan, index) if step >= fault_step else None
        for candidate in ([plan, broken] if broken else [plan]):
            full = violated_rules(before, candidate, config)
            assert _verdict(checker.rules(before, candidate)) == _verdict(full), (fault, step)
        if broken:
            return
        sampled, _ = model.execute(plan, before)
        scheduler.update(plan, sampled)
        checker.invariants(before, plan, scheduler.state)


def test_screened_rules_are_rules() -> None:
    from schedspec.spec.incremental import SCREENED
    from schedspec.spec.rules import RULE_NAMES

    assert SCREENED <= set(RULE_NAMES) and "reject-only-impossible" not in SCREENED


def test_the_screen_holds_for_an_allowed_plan_only() -> None:
    config = SchedulerConfig(block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=3,
                             max_model_len=32)
    from schedspec.spec.incremental import screened_rules_hold

    scheduler = make_scheduler("fcfs", config)
    scheduler.add_request(RequestSpec("a", 6, 3, arrival_step=0).to_request(0))
    plan = scheduler.schedule()
    assert screened_rules_hold(scheduler.state, plan, config)
    for broken in (_mutate_item(plan, 0, num_tokens=17), _mutate_item(plan, 0, new_block_ids=()),
                   attrs.evolve(plan, scheduled=plan.scheduled * 2)):
        assert violated_rules(scheduler.state, broken, config)
        assert not screened_rules_hold(scheduler.state, broken, config)


def test_the_screen_sees_a_sequence_cap_breach_alone() -> None:
    """A plan that breaks sequence-cap and nothing else: the screen must not hold."""
    from schedspec.spec.incremental import screened_rules_hold

    config = SchedulerConfig(block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=1,
                             max_model_len=32)
    scheduler = make_scheduler("fcfs", config)
    for name in ("a", "b"):
        scheduler.add_request(RequestSpec(name, 4, 3, arrival_step=0).to_request(0))
    plan = scheduler.schedule()
    assert [item.request_id for item in plan.scheduled] == ["a"]
    taken = plan.scheduled[0].new_block_ids
    spare = [b for b in scheduler.state.free_block_ids if b not in taken]
    broken = attrs.evolve(plan, scheduled=plan.scheduled + (ScheduledRequest("b", 0, 4, tuple(spare[:1])),))
    assert [v.name for v in violated_rules(scheduler.state, broken, config)] == ["sequence-cap"]
    assert screened_rules_hold(scheduler.state, plan, config)
    assert not screened_rules_hold(scheduler.state, broken, config)


CACHE_FAULTS = ["block owned twice", "block leaked", "block out of range", "block one past the pool", "terminal holds blocks",
                "ended request keeps its freed table",
                "reference count off", "held block loses its hash", "uncomputed block published",
                "block listed twice under its hash", "block published under another hash",
                "held block in the free queue", "duplicate in the free queue", "out-of-range id in the free queue",
                "evictable block rehashed, not relisted", "evictable block rehashed, still under its old hash",
                "evictable block rehashed, listed under neither", "held block left in an unchanged free queue",
                "cache rebuilt without a change log", "uncomputed block published, then another working copy",
                "unpublished block in a second table", "published block in a second table", "block twice in one table",
                "published block unlisted"]


@pytest.mark.parametrize("fault", CACHE_FAULTS)
def test_prefix_caching_faults_are_found_as_the_full_check_finds_them(fault):
    """With prefix caching, each fault of the shared blocks and the cache's bookkeeping, made after some
    step of a run with prefix-cache hits, is reported by the incremental checker exactly as by the full
    check (``_drive`` compares them at every step): its ledger does not prove what is broken."""
    config = CONFIG.with_changes(num_kv_blocks=10, enable_prefix_caching=True)
    specs = [attrs.evolve(s, prefix_group="p", prefix_len=8) for s in SPECS]
    found = [step for step in range(2, 14) if _drive(config, specs, "fcfs", fault=fault, fault_step=step)]
    assert found, f"the fault {fault!r} was never made or never found"


def test_the_screen_counts_lookahead_and_drafts_as_the_rules_do() -> None:
    """With speculative decoding the screen passes a legal plan, and fails each plan a screened rule
    refuses only because of the lookahead slots or the drafts (a screen that forgot them would skip the
    rule and lose the violation)."""
    from schedspec.spec.incremental import screened_rules_hold

    config = SchedulerConfig(block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=3,
                             max_model_len=32, num_speculative_tokens=2, num_lookahead_tokens=2)
    scheduler = make_scheduler("fcfs", config)
    scheduler.add_request(RequestSpec("a", 8, 3, arrival_step=0).to_request(0))
    state = scheduler.state
    plan = scheduler.schedule()
    assert len(plan.scheduled[0].new_block_ids) == 3  # 8 tokens and 2 lookahead slots
    assert not violated_rules(state, plan, config) and screened_rules_hold(state, plan, config)
    short = _mutate_item(plan, 0, new_block_ids=plan.scheduled[0].new_block_ids[:2])  # no lookahead slots
    assert {v.name for v in violated_rules(state, short, config)} == {"block-table-covers"}
    assert not screened_rules_hold(state, short, config)
    whole = config.with_changes(enable_chunked_prefill=False, max_num_batched_tokens=32)
    decode = _mutate_item(plan, 0, spec_token_ids=(5,))  # all 8 pending but not the draft it carries
    assert "whole-prefill-without-chunking" in {v.name for v in violated_rules(state, decode, whole)}
    assert not screened_rules_hold(state, decode, whole)


def test_a_cache_copied_by_evolve_carries_no_change_log():
    """``attrs.evolve`` on a :class:`~schedspec.spec.prefix_cache.PrefixCache` made by a transition gives a cache
    without its change log (the copy may differ at keys the log never names), so the incremental checker
    rechecks it whole: a reference count changed that way is found as the full check finds it. With the log
    kept (``changes`` a constructor argument, as it was), the copy carries a log that does not name its change
    (this test then fails at ``changes is None``), and the checker follows that log."""
    config = CONFIG.with_changes(num_kv_blocks=10, enable_prefix_caching=True)
    specs = [attrs.evolve(s, prefix_group="p", prefix_len=8) for s in SPECS]
    scheduler = make_scheduler("fcfs", config)
    model = FakeModel(config, cost_model=_Flat())
    checker = IncrementalChecker(config)
    for spec in specs:
        scheduler.add_request(spec.to_request(0))
    found = False
    for _ in range(6):
        before, plan, after = _advance(scheduler, model, checker)
        assert after.prefix_cache.changes is not None or after.prefix_cache is before.prefix_cache
        held = _held(after)
        if not held:
            continue
        counts = dict(after.prefix_cache.ref_counts)
        counts[held[0]] = counts.get(held[0], 0) + 1
        broken_cache = attrs.evolve(after.prefix_cache, ref_counts=counts)
        assert broken_cache.changes is None
        broken = attrs.evolve(after, prefix_cache=broken_cache)
        full = check_step(before, plan, broken, config)
        assert full and _verdict(checker.invariants(before, plan, broken)) == _verdict(full)
        found = True
        break
    assert found
class _CountingChecker(IncrementalChecker):
    """An incremental checker that keeps the steps on which it fell back to the full block checks."""

    def __init__(self, config):
        super().__init__(config)
        self.fallback_steps = []

    def invariants(self, before, plan, after):
        fallbacks = self.fallbacks
        found = super().invariants(before, plan, after)
        if self.fallbacks > fallbacks:
            self.fallback_steps.append((plan, after))
        return found


def _takes_and_releases(plan, after) -> bool:
    """A request got new blocks in this step and ended in it: those blocks were handed out and given back within
    the step, a move the ledger does not follow (it sees the tables of the states only; the full check runs)."""
    return any(item.new_block_ids and item.request_id in after.finished for item in plan.scheduled)


# shortest-prompt-first keeps r0 waiting, unchanged, before r1 in the request map while r1 runs: a ledger that
# stops at the first unchanged request (_follow_cached#61) never follows r1
_WAITING_FIRST = (SchedulerConfig(block_size=4, num_kv_blocks=12, max_num_batched_tokens=32, max_num_seqs=1,
                                  max_model_len=32, enable_prefix_caching=True),
                  [RequestSpec("r0", 20, 4, arrival_step=0), RequestSpec("r1", 5, 6, arrival_step=0)],
                  "shortest-prompt-first")


# chunks of 2 tokens with 4-token blocks: a chain checked with no published block, then block 0 published a
# step later and block 1 two steps after (_chain_known#7: a memo of no block taken as one block known right)
_CHUNKS_OF_TWO = (SchedulerConfig(block_size=4, num_kv_blocks=12, max_num_batched_tokens=32, max_num_seqs=2,
                                  max_model_len=32, long_prefill_token_threshold=2, enable_prefix_caching=True),
                  [RequestSpec("r0", 12, 2, arrival_step=0)], "fcfs")


@settings(deadline=None)  # examples: the active profile's
@given(runs())
@example(_WAITING_FIRST)
@example(_CHUNKS_OF_TWO)
def test_the_ledger_follows_every_correct_run(run):
    """On random correct runs (arrivals, aborts, preemptions, shared prompt prefixes, with and without prefix
    caching) the ledger proves every step but those where a request got new blocks and ended (its blocks handed
    out and released within the step, which the ledger does not see: a known cost of a fallback, never a wrong
    verdict). A ledger that loses track of a table, a block's holders, the cache or a request's published chain
    falls back on other steps too (it cannot prove what it no longer follows), which costs only time, so only
    this count shows it (spec/incremental.py mutants of ``_follow``, ``_follow_cached`` and ``_chain_known``)."""
    config, specs, name = run
    if not specs:
        return
    checker = _CountingChecker(config)
    _drive(config, specs, name, checker=checker)
    assert all(_takes_and_releases(plan, after) for plan, after in checker.fallback_steps), [
        (plan, sorted(after.finished)) for plan, after in checker.fallback_steps if not _takes_and_releases(plan, after)]


PLAIN_FAULTS = ["block owned twice", "block leaked", "block out of range", "block one past the pool", "terminal holds blocks",
                "ended request keeps its freed table",
                "owned block in the free queue", "owned block in the middle of the free queue", "duplicate in the free queue",
                "out-of-range id in the free queue"]


@pytest.mark.parametrize("fault", PLAIN_FAULTS)
def test_block_faults_without_prefix_caching_are_found_as_the_full_check_finds_them(fault):
    """Without prefix caching, each fault of the blocks and the free queue, made after some step of a run with
    preemptions and finishes, is reported by the incremental checker exactly as by the full check: the owner
    ledger's queue and count checks do not prove what is broken (spec/incremental.py ``_follow`` and
    ``_queue_follows`` mutants: the queue check skipped, the count check loosened)."""
    config = CONFIG.with_changes(num_kv_blocks=10)
    found = [step for step in range(2, 14) if _drive(config, SPECS, "fcfs", fault=fault, fault_step=step)]
    assert found, f"the fault {fault!r} was never made or never found"


@pytest.mark.parametrize("name", ["fcfs", "static", "shortest-prompt-first"])
def test_the_ledger_follows_free_queues_without_shared_structure(name):
    """The owner ledger's general search (_queue_follows without FreeQueue's shared structure, as for queues read
    from a trace or rebuilt as tuples) proves every correct step but those where a request got new blocks and
    ended, as the shortcut does (spec/incremental.py ``_queue_follows`` mutants of the search: a wrong leading
    run of released blocks, a wrong start in the old queue, the kept part not compared)."""
    config = CONFIG.with_changes(num_kv_blocks=8)
    scheduler = make_scheduler(name, config)
    model = FakeModel(config, cost_model=_Flat())
    checker = _CountingChecker(config)
    plain = lambda state: attrs.evolve(state, free_block_ids=tuple(state.free_block_ids))  # noqa: E731
    for step in range(200):
        for spec in SPECS:
            if spec.arrival_step == step:
                scheduler.add_request(spec.to_request(step))
        before = plain(scheduler.state)
        if not before.requests and step > max(s.arrival_step for s in SPECS):
            break
        checker.sync(before)
        plan = scheduler.schedule()
        sampled, _ = model.execute(plan, scheduler.state)
        scheduler.update(plan, sampled)
        after = plain(scheduler.state)
        assert checker.invariants(before, plan, after) == check_step(before, plan, after, config) == []
    assert all(_takes_and_releases(plan, after) for plan, after in checker.fallback_steps)
    assert step > 5
