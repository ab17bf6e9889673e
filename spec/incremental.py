"""Incremental checking: the same verdicts as :func:`~schedspec.spec.invariants.check_step`, cheaper.

:func:`schedspec.spec.invariants.check_step` is the definition: it looks at every block (tens of
thousands on a real GPU) and every request that ever ended. Over a one-hour trace (about 150,000 steps)
that is too slow, so the lab uses :class:`IncrementalChecker`. It returns exactly the violations
``check_step`` returns (names, steps and request ids; ``tests/test_incremental.py`` compares the two on
every step of random runs with injected faults), by two means:

- **Terminal requests are checked once**, in the step they become terminal, because no transition of
  the spec changes a terminal request. A terminal request found broken is re-checked at every later
  step, so a persistent breach is reported as often as the full check reports it.
- **``block-conservation`` is screened by a ledger** (block -> owner, the free set, the last free
  queue), which proves the invariant from the previous state's and what changed: every newly owned
  block was free and in range, every released block was owned by the releasing request, the new free
  queue is the old one less a front part, with blocks added in front of it or behind it that were
  released (or taken from that front part) and are not owned, and ``free + owned == num_kv_blocks``. When the screen cannot prove
  it (a fault, or a free queue rearranged otherwise), the full ``block_conservation`` check runs on
  that state and its answer is returned; the ledger is rebuilt from the state.

- **With ``enable_prefix_caching``** blocks are shared between block tables and cached blocks are
  released to the back of the free queue and stay cached, so a **shared-block ledger** (block -> the
  live tables holding it, the free queue as a set, the cache, and per request the prefix of its table
  known published right) proves ``block-conservation``, ``kv-capacity``, ``prefix-ref-counts``,
  ``prefix-block-partition`` and ``prefix-published-computed`` (:data:`CACHE_SCREENED`) from what
  changed: the blocks added to and dropped from tables, the keys the cache's working copy wrote (logged
  by its only writers: :class:`~schedspec.spec.prefix_cache.CacheChanges`, followed back to the cache
  of the previous state), the free queue's changed ends, and the chains of the requests that changed or
  hold a block whose hash changed (:func:`~schedspec.spec.invariants.published_chain`, resumed after the
  prefix known right). A cache not made from the previous one by a working copy (no change log), or
  anything the ledger cannot prove, runs those invariants in full, as above.

Cost per step: O(live requests) Python operations (the other state invariants and the scan for
requests that left the live set), plus O(changed blocks) for the ledger (with prefix caching also
O(changed keys of the cache) and O(new blocks of each changed table) for the chains), plus one
comparison of the new free queue with the old one: O(blocks added in front) when both are
:class:`~schedspec.spec.persistent.FreeQueue` values sharing their base (the spec's transitions make
them so), else done by CPython's tuple slicing and comparison (O(num_kv_blocks) machine operations, no
Python loop). The queue is compared even when it is the same object as before: a block taken from it
without leaving it, with another released elsewhere, keeps every count right. A fallback step costs
the full checks of the invariants the ledger proves.

**KV connector**: the ledger does not follow the blocks that remote KV loads and delayed frees hold
(``StepPlan.loads``, ``SchedulerState.delayed_frees``); from the first step that has either, every step runs
the rules and the ledger's invariants in full (:attr:`IncrementalChecker.remote`), the same verdicts at the
full check's cost.
"""

from __future__ import annotations

from collections.abc import Mapping

from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens, slot_tokens
from schedspec.spec.invariants import (
    STATE_INVARIANTS,
    TERMINAL_OWNS_BLOCKS,
    check_state,
    check_step,
    published_chain,
    terminal_owns,
)
from schedspec.spec.persistent import FreeQueue
from schedspec.spec.prefix_cache import ROOT_HASH, PrefixCache
from schedspec.spec.request import Request
from schedspec.spec.rules import (
    Violation,
    blocks_not_from_free_pool,
    coded,
    running_when_planned,
    violated_rules,
)
from schedspec.spec.state import SchedulerState, StepPlan

NAME = "block-conservation"
FREE_POOL_RULE = "blocks-from-free-pool"
FREE_POOL = frozenset({FREE_POOL_RULE})
TERMINAL_OWNS_CODE = coded(NAME, TERMINAL_OWNS_BLOCKS)
CACHE_SCREENED = frozenset({
    NAME, "kv-capacity", "prefix-ref-counts", "prefix-block-partition", "prefix-published-computed",
})
"""With prefix caching, the state invariants the shared-block ledger proves (:meth:`IncrementalChecker._follow_cached`)."""
STATE_NAMES = frozenset(i.name for i in STATE_INVARIANTS)


SCREENED = frozenset({
    "known-requests", "token-budget", "positive-tokens", "chunk-continues", "no-overcompute",
    "whole-prefill-without-chunking", "long-prefill-threshold", "sequence-cap", "admit-fits-alone",
    "preempt-running-only", "block-table-covers", "no-excess-blocks", "prefix-hit-at-admission",
})
"""The rules :func:`screened_rules_hold` screens; every other rule of :mod:`~schedspec.spec.rules` always
runs (``reject-only-impossible``, ``blocks-from-free-pool``, which the checker judges against the free set it
keeps, the prefix-cache hit rules, the draft rules, the in-flight rules ``IN_FLIGHT_RULES`` and the per-step
limits ``LIMIT_RULES``). ``long-prefill-threshold`` is screened with the plain threshold, never above its
floor (``long_prefill_token_threshold_adaptive``), so the screen is only ever too strict there."""
SCREENED_AND_FREE_POOL = SCREENED | FREE_POOL


def screened_rules_hold(state: SchedulerState, plan: StepPlan, config: SchedulerConfig) -> bool:
    """True only if none of the rules in :data:`SCREENED` finds anything in ``plan`` from ``state``
    (without prefix caching): their conditions, as :mod:`~schedspec.spec.rules` states them, checked in
    one pass over the plan instead of one pass per rule. False means "run the rules" (a rule may or may
    not be broken); so a screen that is too strict costs time, never a verdict
    (``tests/test_incremental.py`` compares the checker's verdicts with the rules' on broken plans). With
    speculative decoding the conditions count each item's d drafts and ``num_lookahead_tokens`` as the
    rules do (``config.slot_tokens``); the draft rules themselves are not screened (they always run)."""
    requests = state.requests
    running = set(state.running)
    block_size = config.block_size
    chunked = config.enable_chunked_prefill
    threshold = config.long_prefill_token_threshold if chunked else 0
    speculative = config.speculative
    named: set[str] = set()
    total = admitted = 0
    for item in plan.scheduled:
        request_id = item.request_id
        request = requests.get(request_id)
        if request is None or request_id in named or item.cached_block_ids:  # known-requests, prefix-hit-at-admission
            return False
        named.add(request_id)
        num_tokens = item.num_tokens
        computed = request.num_computed_tokens
        pending = request.num_tokens - computed
        drafts = len(item.spec_token_ids)
        if (num_tokens < 1  # positive-tokens
                or item.num_computed_tokens != computed  # chunk-continues
                or num_tokens > pending + drafts  # no-overcompute
                or (not chunked and num_tokens != pending + drafts)  # whole-prefill-without-chunking
                or (threshold and num_tokens > threshold and not drafts)):  # long-prefill-threshold
            return False
        blocks = len(request.block_ids) + len(item.new_block_ids)
        if blocks < blocks_for_tokens(slot_tokens(computed + num_tokens, config), block_size):  # block-table-covers
            return False
        if (blocks > blocks_for_tokens(slot_tokens(request.num_tokens + drafts, config), block_size)
                and (item.new_block_ids or not speculative)):  # no-excess-blocks
            return False
        if request_id not in running:
            admitted += 1
            if rejection_reason(request.prompt_len, request.max_tokens, config) is not None:  # admit-fits-alone
                return False
        total += num_tokens
    if total > config.max_num_batched_tokens:  # token-budget
        return False
    preempted = 0
    for request_id in plan.preempted:  # preempt-running-only, known-requests
        if request_id not in requests or request_id in named or request_id not in running:
            return False
        named.add(request_id)
        preempted += 1
    for request_id, _ in plan.rejected:  # known-requests
        if request_id not in requests or request_id in named:
            return False
        named.add(request_id)
    # sequence-cap, with the running requests as the planner saw them (a step in flight: those ended since
    # still held their slots; without one, state.running; every preempted id is in state.running, checked above)
    return len(running_when_planned(state)[0]) - preempted + admitted <= config.max_num_seqs


class IncrementalChecker:
    """Checks steps incrementally (module docstring). Feed it every state in order.

    Usage per step (the :class:`~schedspec.spec.stepper.StepChecker` interface, which
    :class:`~schedspec.spec.stepper.Stepper` follows): ``checker.sync(before)`` (after arrivals and
    aborts), then ``checker.rules(before, plan)``, which returns what
    :func:`schedspec.spec.rules.violated_rules` returns (as a multiset), then
    ``checker.invariants(before, plan, after)``, which returns what ``check_step(before, plan, after)``
    returns.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.cached = config.enable_prefix_caching
        """Prefix caching: the shared-block ledger (:meth:`_follow_cached`) instead of the owner ledger."""
        self.screened = CACHE_SCREENED if self.cached else frozenset({NAME})
        """The invariants the ledger proves (run in full on a step where it cannot)."""
        initial = SchedulerState.initial(config)
        self._rebuild(initial)
        self.sound = True
        self.terminal_ids: set[str] = set()
        self.broken_terminal: dict[str, Request] = {}
        self.pending_terminal: dict[str, Request] = {}
        self.fallbacks = 0
        """Steps on which the screen could not prove ``block-conservation`` and the full check ran."""
        self.scans = 0
        """Steps on which ended requests were found by scanning all of ``state.finished`` (O(every request
        that ever ended)): only when some arrived and ended between two states the checker saw."""
        self.chain_blocks = 0
        """With prefix caching, the blocks of published chains checked (:func:`published_chain` from the prefix
        known right, :meth:`_chain_known`): near one check per block of a table, not one per block and step."""
        self.remote = False
        """KV connector: a remote KV load or a delayed free was seen. The ledger does not follow the blocks
        transfers hold, so from then on every step runs the rules and the ledger's invariants in full."""

    def _rebuild(self, state: SchedulerState) -> None:
        """The ledger of ``state``, from scratch (O(blocks + live requests))."""
        if self.cached:
            self._rebuild_cached(state)
            return
        self.owner = {}
        self.tables = {}
        for request_id, request in state.requests.items():
            if request.block_ids:
                self.tables[request_id] = request.block_ids
                for block_id in request.block_ids:
                    self.owner[block_id] = request_id
        self.free = set(range(self.config.num_kv_blocks)) - set(self.owner)
        self.queue = state.free_block_ids
        self.live = set(state.requests)
        self.num_terminal = len(state.finished)

    def _collect_terminal(self, state: SchedulerState, gone: list[str]) -> None:
        found = 0
        for request_id in gone:
            ended = state.finished.get(request_id)
            if ended is not None:
                self.pending_terminal[request_id] = ended
                self.terminal_ids.add(request_id)
                found += 1
        if len(state.finished) - self.num_terminal > found:
            # Requests that arrived and ended between two states this checker saw (an arrival aborted
            # before the step was planned): find them by scanning (rare).
            self.scans += 1
            for request_id, ended in state.finished.items():
                if request_id not in self.terminal_ids:
                    self.pending_terminal[request_id] = ended
                    self.terminal_ids.add(request_id)
        self.num_terminal = len(state.finished)

    def _follow(self, state: SchedulerState) -> bool:
        """Bring the ledger to ``state``; True when the screen proves ``block-conservation`` of ``state``
        given that it held for the previous state. False as soon as a check fails: the ledger is then off
        (partly brought to ``state``) and the caller runs the full check, which rebuilds it
        (:meth:`invariants`), or marks it unsound (:meth:`sync`). Every step keeps the free set exactly the
        blocks in range that no table owns (a block moves between the two at once, or not at all)."""
        owner, free, tables = self.owner, self.free, self.tables
        gone = [r for r in self.live if r not in state.requests]
        self._collect_terminal(state, gone)
        self.live = set(state.requests)
        released: set[int] = set()

        def release(request_id: str, blocks: tuple[int, ...]) -> bool:
            for block_id in blocks:
                if owner.get(block_id) != request_id:
                    return False
                del owner[block_id]
                free.add(block_id)
                released.add(block_id)
            return True

        for request_id in gone:
            if not release(request_id, tables.pop(request_id, ())):
                return False
        takes: list[tuple[str, tuple[int, ...]]] = []
        for request_id, request in state.requests.items():
            old = tables.get(request_id, ())
            table = request.block_ids
            if table == old:
                continue
            if table[: len(old)] == old:
                takes.append((request_id, table[len(old):]))
            elif release(request_id, old):
                takes.append((request_id, table))
            else:
                return False
            if table:
                tables[request_id] = table
            else:
                del tables[request_id]
        fresh_from_queue: list[int] = []  # taken blocks that were free before this state, not released now
        for request_id, blocks in takes:
            for block_id in blocks:
                if block_id not in free:  # owned, or out of range (the free set is the rest of the range)
                    return False
                free.remove(block_id)
                owner[block_id] = request_id
                if block_id not in released:
                    fresh_from_queue.append(block_id)
        previous, queue = self.queue, state.free_block_ids
        self.queue = queue
        # The queue is compared even when it is the same object: a block taken from it (and one released
        # elsewhere, so the count still agrees) leaves the queue unchanged, and only _queue_follows sees it.
        return len(free) == len(queue) and self._queue_follows(previous, queue, released, fresh_from_queue)

    def _queue_follows(self, previous: tuple[int, ...], queue: tuple[int, ...], released: set[int],
                       fresh_from_queue: list[int]) -> bool:
        """Whether the new free queue is the old one less a front part, with blocks added in front of it
        and behind it, every added block released in this step (or taken from that front part and
        released again) and not owned now, none twice; and every block taken from the old queue taken
        from that front part. With the old queue equal to the free set, this makes the new one equal to
        the new free set (the spec adds freed blocks at the front, as vLLM; engines may add them at the
        back)."""
        owner = self.owner
        shared = (queue.shares_suffix_with(previous)
                  if isinstance(queue, FreeQueue) and isinstance(previous, FreeQueue) else None)
        if shared is not None:
            # queue == queue[:front] + previous[start:] by shared structure (spec.persistent.FreeQueue): the
            # same decomposition the search below finds, without comparing the kept blocks one by one
            front, start = shared
            added = queue[:front]
        else:
            size, length = len(previous), len(queue)
            front = 0  # blocks added in front: a leading run of released blocks
            while front < length and queue[front] in released:
                front += 1
            try:
                start = previous.index(queue[front]) if front < length else size
            except ValueError:
                start = size
            kept = size - start
            if front + kept > length or queue[front:front + kept] != previous[start:]:
                return False
            added = queue[:front] + queue[front + kept:]
        removed = set(previous[:start])
        if len(set(added)) != len(added):
            return False
        for block_id in added:
            if block_id in owner or not (block_id in released or block_id in removed):
                return False
        return all(block_id in removed for block_id in fresh_from_queue)

    def _follow_any(self, state: SchedulerState) -> bool:
        return self._follow_cached(state) if self.cached else self._follow(state)

    # --- With prefix caching: the shared-block ledger ------------------------------------------------

    def _rebuild_cached(self, state: SchedulerState) -> None:
        """The shared-block ledger of ``state``, from scratch (O(blocks + live requests)): the block
        tables, block -> the live requests whose tables hold it, the free queue (as a tuple and a set),
        the cache, and per request how much of its table's published prefix is known right."""
        self.tables = {rid: r.block_ids for rid, r in state.requests.items() if r.block_ids}
        self.holders: dict[int, set[str]] = {}
        for request_id, table in self.tables.items():
            for block_id in table:
                self.holders.setdefault(block_id, set()).add(request_id)
        self.seen: dict[str, Request] = dict(state.requests)
        self.chains: dict[str, tuple[Request, int, str]] = {}
        self.queue = tuple(state.free_block_ids)
        self.free = set(self.queue)
        self.cache: PrefixCache | None = state.prefix_cache
        self.num_terminal = len(state.finished)

    def _follow_cached(self, state: SchedulerState) -> bool:
        """Bring the shared-block ledger to ``state``; True when it proves the invariants in
        :data:`CACHE_SCREENED` (``block-conservation`` but its terminal case) of ``state``, given that
        they held for the previous state. It looks only at what changed: the block tables that changed
        (blocks added to and dropped from them), the keys the cache's working copies wrote
        (:class:`~schedspec.spec.prefix_cache.CacheChanges`, logged by the dicts themselves), the free
        queue's changed ends, and the requests that changed or hold a block whose hash changed.

        What it proves, and why that is the invariants: every block's reference count equals the number
        of live tables holding it (checked for every block whose holders or count changed; the rest are
        as before), no table holds a block twice, every held block is in range, the free queue is
        exactly the blocks in range held by no table, without repeats (checked by :meth:`_queue_follows_cached`),
        the hash map agrees with the blocks' hashes at every changed key, and every changed request's
        published blocks are a fully computed prefix of its table under the right hashes
        (:func:`~schedspec.spec.invariants.published_chain`, resumed after the prefix known right)."""
        num_blocks = self.config.num_kv_blocks
        requests = state.requests
        holders, tables, seen, chains = self.holders, self.tables, self.seen, self.chains
        gone = [r for r in seen if r not in requests]  # seen: the live requests of the last state followed
        self._collect_terminal(state, gone)
        moved: set[int] = set()  # blocks whose holders changed
        changed: list[str] = []  # requests that are new values

        def drop(request_id: str, blocks: tuple[int, ...]) -> bool:
            for block_id in blocks:
                owners = holders.get(block_id, set())
                if request_id not in owners:
                    return False
                owners.remove(request_id)
                if not owners:
                    del holders[block_id]
                moved.add(block_id)
            return True

        def add(request_id: str, blocks: tuple[int, ...]) -> bool:
            for block_id in blocks:
                owners = holders.setdefault(block_id, set())
                if not 0 <= block_id < num_blocks or request_id in owners:  # out of range, or held twice
                    return False
                owners.add(request_id)
                moved.add(block_id)
            return True

        for request_id in gone:
            del seen[request_id]
            chains.pop(request_id, None)
            if not drop(request_id, tables.pop(request_id, ())):
                return False
        for request_id, request in requests.items():
            if seen.get(request_id) is request:
                continue
            seen[request_id] = request
            changed.append(request_id)
            old = tables.get(request_id, ())
            table = request.block_ids
            if table == old:
                continue
            if table[:len(old)] == old:
                if not add(request_id, table[len(old):]):
                    return False
            elif not (drop(request_id, old) and add(request_id, table)):
                return False
            if table:
                tables[request_id] = table
            else:
                del tables[request_id]

        cache, previous = state.prefix_cache, self.cache
        self.cache = cache
        keys = _cache_changes(cache, previous)
        if keys is None or cache is None:  # a cache made otherwise (or none): previous is not None below
            return False
        hashed, listed, counted = keys
        counts = cache.ref_counts
        moved |= counted
        if any(counts.get(block_id, 0) != len(holders.get(block_id, ())) for block_id in moved):
            return False
        if not (self._queue_follows_cached(tuple(state.free_block_ids), moved)
                and _hash_map_follows(previous, cache, hashed, listed)):
            return False
        for block_id in hashed:  # a held block whose hash changed: its holders' chains
            changed.extend(holders.get(block_id, ()))
        size = self.config.block_size
        block_hashes = cache.block_hashes
        for request_id in set(changed):  # live requests (a table without blocks has an empty chain)
            request = requests[request_id]
            start, parent = self._chain_known(request_id, request, hashed)
            self.chain_blocks += len(request.block_ids) - start
            breach, published, parent = published_chain(request, block_hashes, size, start, parent)
            if breach is not None:
                return False
            chains[request_id] = (request, published, parent)
        return True

    def _chain_known(self, request_id: str, request: Request, hashed: set[int]) -> tuple[int, str]:
        """How many leading blocks of the request's table are known published right (0 and the root when
        none): those found right before, if the request still has the same blocks there, none of them
        changed its hash, they are still computed and the request's tokens there are the same."""
        known = self.chains.get(request_id)
        if known is None:
            return 0, ROOT_HASH
        old, count, parent = known
        if not count:
            return 0, ROOT_HASH
        size = self.config.block_size
        table = request.block_ids
        outputs = count * size - request.prompt_len
        if (request.prompt_token_ids is not old.prompt_token_ids or count * size > request.num_computed_tokens
                or table[:count] != old.block_ids[:count] or not hashed.isdisjoint(table[:count])
                or (outputs > 0 and request.output_token_ids[:outputs] != old.output_token_ids[:outputs])):
            return 0, ROOT_HASH
        return count, parent

    def _queue_follows_cached(self, queue: tuple[int, ...], moved: set[int]) -> bool:
        """Whether the free queue is still exactly the blocks held by no table, without repeats, given
        that the old one was and only the ``moved`` blocks' holders (or counts) changed: the blocks now
        held left it, the blocks now held by none that were held joined it at its front or its back
        (as :meth:`~schedspec.spec.prefix_cache.CacheUpdate.release` puts them), and the rest kept their
        order (checked by slices, no Python loop over the queue). Updates the ledger's queue and set."""
        holders, free, previous = self.holders, self.free, self.queue
        left = {b for b in moved if b in free and b in holders}
        joined = {b for b in moved if b not in free and b not in holders}
        self.queue = queue
        free -= left
        free |= joined
        if queue == previous:  # (identity first) nothing may have moved in or out
            return not (left or joined)
        length = len(queue)
        front = 0
        while front < length and queue[front] in joined:
            front += 1
        back = length
        while back > front and queue[back - 1] in joined:
            back -= 1
        if front + length - back != len(joined) or len(set(queue[:front] + queue[back:])) != len(joined):
            return False
        start = 0  # leading blocks of the old queue that left it (allocation takes from the front)
        while start < len(previous) and previous[start] in left:
            start += 1
        try:  # the others left it from the middle (a prefix-cache hit on an evictable block)
            cuts = sorted(previous.index(b) for b in left.difference(previous[:start]))
        except ValueError:  # not in the old queue: the ledger is off (it is rebuilt)
            return False
        at = front
        for cut in [*cuts, len(previous)]:
            kept = previous[start:cut]
            if queue[at:at + len(kept)] != kept:
                return False
            at += len(kept)
            start = cut + 1
        return at == back

    def sync(self, before: SchedulerState) -> None:
        """Follow the arrivals and aborts applied since the last step. Reports nothing (the next
        :meth:`invariants` does)."""
        self.sound = self._follow_any(before) and self.sound

    def rules(self, before: SchedulerState, plan: StepPlan) -> list[Violation]:
        """:func:`schedspec.spec.rules.violated_rules` for ``before`` (after :meth:`sync`), with
        ``blocks-from-free-pool`` checked against the ledger's free set instead of a set built from
        the free queue (the same check: :func:`~schedspec.spec.rules.blocks_not_from_free_pool`), and the
        rules in :data:`SCREENED` first screened in one pass over the plan (:func:`screened_rules_hold`):
        when the screen holds they find nothing and are not run. The same violations as a multiset; the
        free-pool ones come last. Once a remote KV load or a delayed free is seen (:attr:`remote`), the rules
        run in full and the next :meth:`invariants` falls back to the full check."""
        if plan.loads or before.delayed_frees:
            self.remote = True
        if self.remote or not self.sound:
            return violated_rules(before, plan, self.config)
        # the screen knows no prefix caching (e.g. prefix-hit-at-admission of an item without a hit)
        screened = not self.cached and screened_rules_hold(before, plan, self.config)
        skip = SCREENED_AND_FREE_POOL if screened else FREE_POOL
        found = violated_rules(before, plan, self.config, skip=skip)
        found += [Violation(FREE_POOL_RULE, detail, before.step, request_id, kind="rule",
                            code=coded(FREE_POOL_RULE, case[0] if case else None))
                  for request_id, detail, *case in blocks_not_from_free_pool(before, plan, self.free)]
        return found

    def invariants(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> list[Violation]:
        """The violations of the step ``before -> after``: what :func:`check_step` returns (as a multiset;
        the order may differ)."""
        proved = self._follow_any(after) and self.sound and not self.remote
        # The terminal requests as ``after`` has them (one that ended before ``before`` was seen by sync).
        terminal: Mapping[str, Request] = {
            rid: after.finished.get(rid, r) for rid, r in {**self.broken_terminal, **self.pending_terminal}.items()
        }
        self.pending_terminal = {}
        found = check_step(before, plan, after, self.config, terminal=terminal, skip=self.screened)
        if proved:
            found += [
                Violation(NAME, terminal_owns(r), before.step, rid,
                          kind="invariant", code=TERMINAL_OWNS_CODE)
                for rid, r in terminal.items() if r.block_ids
            ]
        else:
            self.fallbacks += 1
            breached = check_state(after, self.config, terminal, skip=STATE_NAMES - self.screened, step=before.step)
            found += breached
            self._rebuild(after)
            # Sound again once nothing but terminal requests' blocks is wrong: the ledger then matches the
            # live tables and the free queue exactly.
            self.sound = all(v.request_id in terminal and v.code == TERMINAL_OWNS_CODE for v in breached)
        for violation in found:
            if violation.request_id in terminal:
                self.broken_terminal[violation.request_id] = terminal[violation.request_id]
        return found

    def forget_ended(self) -> None:
        """The state forgot its ended requests (:meth:`~schedspec.spec.stepper.Stepper.forget_ended`): they
        are no longer listed by iterating ``state.finished``, so the ids of those already collected
        (:meth:`_collect_terminal`'s scan skips them) need not be kept."""
        self.terminal_ids.clear()


def _cache_changes(cache: PrefixCache | None, previous: PrefixCache | None) -> tuple[set[int], set[str], set[int]] | None:
    """The keys at which ``cache`` may differ from ``previous`` (block hashes, hash-map entries, reference
    counts), by following the caches' :class:`~schedspec.spec.prefix_cache.CacheChanges` back to
    ``previous`` (or to a cache equal to it); ``None`` when they do not lead there (a cache made
    otherwise, or an intermediate one gone)."""
    hashed: set[int] = set()
    listed: set[str] = set()
    counted: set[int] = set()
    while cache is not previous:
        changes = cache.changes if cache is not None else None
        if changes is None:  # another object: the same cache (the initial state's, made twice), or not known
            return (hashed, listed, counted) if cache is not None and cache == previous else None
        hashed |= changes.block_hashes
        listed |= changes.hash_to_blocks
        counted |= changes.ref_counts
        cache = changes.base()
        if cache is None:
            return None
    return hashed, listed, counted


def _hash_map_follows(previous: PrefixCache, cache: PrefixCache, hashed: set[int], listed: set[str]) -> bool:
    """Whether the hash map and the blocks' hashes still agree (every block of hash h listed under h, once,
    and under no other), given that they agreed in ``previous`` and only the ``hashed`` blocks' hashes and
    the ``listed`` hashes' entries may have changed."""
    block_hashes, by_hash = cache.block_hashes, cache.hash_to_blocks
    old_hashes, old_by_hash = previous.block_hashes, previous.hash_to_blocks
    for block_id in hashed:
        value, old = block_hashes.get(block_id), old_hashes.get(block_id)
        if value is not None and by_hash.get(value, ()).count(block_id) != 1:
            return False
        if old is not None and old != value and block_id in by_hash.get(old, ()):
            return False
    for value in listed:
        blocks = by_hash.get(value, ())
        if len(set(blocks)) != len(blocks) or any(block_hashes.get(b) != value for b in blocks):
            return False
        if any(b not in hashed and b not in blocks for b in old_by_hash.get(value, ())):
            return False
    return True
