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

With ``enable_prefix_caching`` the ledger does not apply (blocks are shared between block tables, and
cached blocks are released to the back of the free queue and stay cached), so the checker runs the full
:func:`~schedspec.spec.invariants.check_step` on every step: the same verdicts, at the full check's cost.

Cost per step: O(live requests) Python operations (the other state invariants and the scan for
requests that left the live set), plus O(changed blocks) for the ledger, plus, on steps where the free
queue changed, one comparison of the new queue with the old one done by CPython's tuple slicing and
comparison (O(num_kv_blocks) machine operations, no Python loop). A fallback step costs a full
``block_conservation``.
"""

from __future__ import annotations

from collections.abc import Mapping

from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens
from schedspec.spec.invariants import TERMINAL_OWNS_BLOCKS, block_conservation, check_step, terminal_owns
from schedspec.spec.persistent import FreeQueue
from schedspec.spec.request import Request
from schedspec.spec.rules import Violation, blocks_not_from_free_pool, coded, violated_rules
from schedspec.spec.state import SchedulerState, StepPlan

NAME = "block-conservation"
FREE_POOL_RULE = "blocks-from-free-pool"
FREE_POOL = frozenset({FREE_POOL_RULE})
TERMINAL_OWNS_CODE = coded(NAME, TERMINAL_OWNS_BLOCKS)


SCREENED = frozenset({
    "known-requests", "token-budget", "positive-tokens", "chunk-continues", "no-overcompute",
    "whole-prefill-without-chunking", "long-prefill-threshold", "sequence-cap", "admit-fits-alone",
    "preempt-running-only", "block-table-covers", "no-excess-blocks", "prefix-hit-at-admission",
})
"""The rules :func:`screened_rules_hold` screens (every rule of :mod:`~schedspec.spec.rules` but
``reject-only-impossible``, ``blocks-from-free-pool`` and the prefix-cache hit rules)."""
SCREENED_AND_FREE_POOL = SCREENED | FREE_POOL


def screened_rules_hold(state: SchedulerState, plan: StepPlan, config: SchedulerConfig) -> bool:
    """True only if none of the rules in :data:`SCREENED` finds anything in ``plan`` from ``state``
    (without prefix caching): their conditions, as :mod:`~schedspec.spec.rules` states them, checked in
    one pass over the plan instead of one pass per rule. False means "run the rules" (a rule may or may
    not be broken); so a screen that is too strict costs time, never a verdict
    (``tests/test_incremental.py`` compares the checker's verdicts with the rules' on broken plans). With
    speculative decoding (``num_speculative_tokens > 0``) it is always False: every rule runs."""
    if config.speculative:  # the screen knows neither drafts nor num_lookahead_tokens: run the rules
        return False
    requests = state.requests
    running = set(state.running)
    block_size = config.block_size
    chunked = config.enable_chunked_prefill
    threshold = config.long_prefill_token_threshold if chunked else 0
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
        if (num_tokens < 1  # positive-tokens
                or item.num_computed_tokens != computed  # chunk-continues
                or num_tokens > pending  # no-overcompute
                or (not chunked and num_tokens != pending)  # whole-prefill-without-chunking
                or (threshold and num_tokens > threshold)):  # long-prefill-threshold
            return False
        blocks = len(request.block_ids) + len(item.new_block_ids)
        if blocks < blocks_for_tokens(computed + num_tokens, block_size):  # block-table-covers
            return False
        if blocks > blocks_for_tokens(request.num_tokens, block_size):  # no-excess-blocks
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
    return len(running) - preempted + admitted <= config.max_num_seqs  # sequence-cap


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
        self.full = config.enable_prefix_caching
        """Prefix caching: every step gets the full check (module docstring)."""
        initial = SchedulerState.initial(config)
        self._rebuild(initial)
        self.sound = True
        self.terminal_ids: set[str] = set()
        self.broken_terminal: dict[str, Request] = {}
        self.pending_terminal: dict[str, Request] = {}
        self.fallbacks = 0
        """Steps on which the screen could not prove ``block-conservation`` and the full check ran."""

    def _rebuild(self, state: SchedulerState) -> None:
        """The ledger of ``state``, from scratch (O(blocks + live requests))."""
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
            for request_id, ended in state.finished.items():
                if request_id not in self.terminal_ids:
                    self.pending_terminal[request_id] = ended
                    self.terminal_ids.add(request_id)
        self.num_terminal = len(state.finished)

    def _follow(self, state: SchedulerState) -> bool:
        """Bring the ledger to ``state``; True when the screen proves ``block-conservation`` of ``state``
        given that it held for the previous state."""
        ok = True
        num_blocks = self.config.num_kv_blocks
        owner, free = self.owner, self.free
        gone = [r for r in self.live if r not in state.requests]
        self._collect_terminal(state, gone)
        released: set[int] = set()
        taken: list[int] = []

        def release(request_id: str, blocks: tuple[int, ...]) -> None:
            nonlocal ok
            for block_id in blocks:
                if owner.get(block_id) != request_id:
                    ok = False
                    continue
                del owner[block_id]
                free.add(block_id)
                released.add(block_id)

        for request_id in gone:
            self.live.discard(request_id)
            blocks = self.tables.pop(request_id, None)
            if blocks:
                release(request_id, blocks)
        self.live.update(state.requests)
        takes: list[tuple[str, tuple[int, ...]]] = []
        for request_id, request in state.requests.items():
            old = self.tables.get(request_id, ())
            table = request.block_ids
            if table is old or table == old:
                continue
            if table[: len(old)] == old:
                takes.append((request_id, table[len(old):]))
            else:
                release(request_id, old)
                takes.append((request_id, table))
            if table:
                self.tables[request_id] = table
            else:
                self.tables.pop(request_id, None)
        fresh_from_queue: list[int] = []  # taken blocks that were free before this state, not released now
        for request_id, blocks in takes:
            for block_id in blocks:
                if not 0 <= block_id < num_blocks or block_id in owner or block_id not in free:
                    ok = False
                    continue
                free.discard(block_id)
                owner[block_id] = request_id
                taken.append(block_id)
                if block_id not in released:
                    fresh_from_queue.append(block_id)

        previous, queue = self.queue, state.free_block_ids
        self.queue = queue
        if queue is not previous and not self._queue_follows(previous, queue, released, fresh_from_queue):
            ok = False
        if len(queue) + len(owner) != num_blocks or len(free) != len(queue):
            ok = False
        return ok

    def _queue_follows(self, previous: tuple[int, ...], queue: tuple[int, ...], released: set[int],
                       fresh_from_queue: list[int]) -> bool:
        """Whether the new free queue is the old one less a front part, with blocks added in front of it
        and behind it, every added block released in this step (or taken from that front part and
        released again) and not owned now, none twice; and every block taken from the old queue taken
        from that front part. With the old queue equal to the free set, this makes the new one equal to
        the new free set (the spec adds freed blocks at the front, as vLLM; engines may add them at the
        back)."""
        owner = self.owner
        size, length = len(previous), len(queue)
        shared = (queue.shares_suffix_with(previous)
                  if isinstance(queue, FreeQueue) and isinstance(previous, FreeQueue) else None)
        if shared is not None:
            # queue == queue[:front] + previous[start:] by shared structure (spec.persistent.FreeQueue): the
            # same decomposition the search below finds, without comparing the kept blocks one by one
            front, start = shared
            kept = size - start
        else:
            front = 0  # blocks added in front: a leading run of released blocks
            while front < length and queue[front] in released:
                front += 1
            if front < length:
                try:
                    start = previous.index(queue[front])
                except ValueError:
                    start = size
            else:
                start = size
            kept = size - start
            if front + kept > length or queue[front:front + kept] != previous[start:]:
                return False
        removed = set(previous[:start])
        added = queue[:front] + queue[front + kept:]
        if len(set(added)) != len(added):
            return False
        for block_id in added:
            if block_id in owner or not (block_id in released or block_id in removed):
                return False
        return all(block_id in removed for block_id in fresh_from_queue)

    def sync(self, before: SchedulerState) -> None:
        """Follow the arrivals and aborts applied since the last step. Reports nothing (the next
        :meth:`invariants` does)."""
        if self.full:
            return
        if not self._follow(before):
            self.sound = False

    def rules(self, before: SchedulerState, plan: StepPlan) -> list[Violation]:
        """:func:`schedspec.spec.rules.violated_rules` for ``before`` (after :meth:`sync`), with
        ``blocks-from-free-pool`` checked against the ledger's free set instead of a set built from
        the free queue (the same check: :func:`~schedspec.spec.rules.blocks_not_from_free_pool`), and the
        rules in :data:`SCREENED` first screened in one pass over the plan (:func:`screened_rules_hold`):
        when the screen holds they find nothing and are not run. The same violations as a multiset; the
        free-pool ones come last."""
        if self.full or not self.sound:
            return violated_rules(before, plan, self.config)
        skip = SCREENED_AND_FREE_POOL if screened_rules_hold(before, plan, self.config) else FREE_POOL
        found = violated_rules(before, plan, self.config, skip=skip)
        found += [Violation(FREE_POOL_RULE, detail, before.step, request_id, kind="rule",
                            code=coded(FREE_POOL_RULE, case[0] if case else None))
                  for request_id, detail, *case in blocks_not_from_free_pool(before, plan, self.free)]
        return found

    def invariants(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> list[Violation]:
        """The violations of the step ``before -> after``: what :func:`check_step` returns (as a multiset;
        the order may differ)."""
        if self.full:
            return check_step(before, plan, after, self.config)
        proved = self._follow(after) and self.sound
        # The terminal requests as ``after`` has them (one that ended before ``before`` was seen by sync).
        terminal: Mapping[str, Request] = {
            rid: after.finished.get(rid, r) for rid, r in {**self.broken_terminal, **self.pending_terminal}.items()
        }
        self.pending_terminal = {}
        found = check_step(before, plan, after, self.config, terminal=terminal, skip=frozenset({NAME}))
        if proved:
            found += [
                Violation(NAME, terminal_owns(r), before.step, rid,
                          kind="invariant", code=TERMINAL_OWNS_CODE)
                for rid, r in terminal.items() if r.block_ids
            ]
        else:
            self.fallbacks += 1
            breached = [Violation(NAME, detail, before.step, rid, kind="invariant",
                                  code=coded(NAME, case[0] if case else None))
                        for rid, detail, *case in block_conservation(after, self.config, terminal)]
            found += breached
            self._rebuild(after)
            # Sound again once nothing but terminal requests' blocks is wrong: the ledger then matches the
            # live tables and the free queue exactly.
            self.sound = all(v.request_id in terminal and v.code == TERMINAL_OWNS_CODE for v in breached)
        for violation in found:
            if violation.request_id in terminal:
                self.broken_terminal[violation.request_id] = terminal[violation.request_id]
        return found
