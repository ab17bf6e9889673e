"""Named invariants: what must hold of every state, and of every step.

State invariants take ``(state, config)``; step invariants take ``(before, plan, after, config)``.
Each yields ``(request_id or None, detail)`` for every breach it finds (or ``(request_id or None, detail,
case)`` for a named case, whose violation's ``code`` is ``name:case``: :func:`~schedspec.spec.rules.coded`,
e.g. :data:`TERMINAL_OWNS_BLOCKS`). :func:`check_state` and
:func:`check_step` run them all and return :class:`~schedspec.spec.rules.Violation` values naming
the invariant; an empty list means all hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping

import attrs

from schedspec.spec.config import SchedulerConfig, blocks_for_tokens
from schedspec.spec.kv_cache_groups import (
    NULL_BLOCK,
    group_hashes,
    group_tables,
    held_block_ids,
    num_skipped_blocks,
)
from schedspec.spec.persistent import evolve_request
from schedspec.spec.prefix_cache import ROOT_HASH, request_block_hash
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import Violation, coded
from schedspec.spec.state import SchedulerState, StepPlan
from schedspec.spec.transitions import stop_reason

Breaches = Iterator[tuple[str | None, str] | tuple[str | None, str, str]]
Terminal = Mapping[str, Request] | None
"""State invariants look at the terminal requests given here; ``None`` means all of ``state.finished``.
Terminal requests never change, so an incremental checker passes only the newly terminal ones."""
StateCheck = Callable[..., Breaches]
StepCheck = Callable[[SchedulerState, StepPlan, SchedulerState, SchedulerConfig], Breaches]


@attrs.frozen
class Invariant:
    """A named invariant: its statement (the check's docstring), its source and its check."""

    name: str
    statement: str
    source: str
    check: Callable[..., Breaches]
    kind: str  # "state" or "step"


STATE_INVARIANTS: list[Invariant] = []
STEP_INVARIANTS: list[Invariant] = []


def _unique(name: str) -> None:
    if any(i.name == name for i in STATE_INVARIANTS + STEP_INVARIANTS):
        raise ValueError(f"invariant {name!r} registered twice")


def state_invariant(name: str, source: str) -> Callable[[StateCheck], StateCheck]:
    """Register the decorated check as the state invariant ``name`` (its statement: the docstring), the
    same form as :func:`~schedspec.spec.rules.rule`. Raises ``ValueError`` for a name registered already."""

    def register(check: StateCheck) -> StateCheck:
        _unique(name)
        STATE_INVARIANTS.append(Invariant(name, (check.__doc__ or "").strip(), source, check, "state"))
        return check

    return register


def step_invariant(name: str, source: str) -> Callable[[StepCheck], StepCheck]:
    """Register the decorated check as the step invariant ``name``, as :func:`state_invariant`."""

    def register(check: StepCheck) -> StepCheck:
        _unique(name)
        STEP_INVARIANTS.append(Invariant(name, (check.__doc__ or "").strip(), source, check, "step"))
        return check

    return register


@state_invariant("running-within-max-num-seqs", "vLLM Scheduler.schedule max_num_running_reqs")
def sequence_cap(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """len(running) <= max_num_seqs."""
    if len(state.running) > config.max_num_seqs:
        yield None, f"{len(state.running)} running > max_num_seqs={config.max_num_seqs}"


@state_invariant("kv-capacity", "vLLM BlockPool (num_gpu_blocks)")
def kv_capacity(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """The blocks held by all requests, and by transfers for ended requests (delayed_frees), are at most
    num_kv_blocks (distinct blocks, with prefix caching)."""
    if state.prefix_cache is not None:
        held = len({b for r in state.requests.values() for b in held_block_ids(r)})
    else:  # every KV cache group's blocks come from the one pool
        held = sum(len(held_block_ids(r)) for r in state.requests.values())
    held += sum(len(held.block_ids) for held in state.delayed_frees.values())
    if held > config.num_kv_blocks:
        yield None, f"{held} blocks held > num_kv_blocks={config.num_kv_blocks}"


def _some(block_ids: list[int], limit: int = 8) -> str:
    """``"block 3"``, ``"blocks 3, 7"``, or the first ``limit`` of them and how many more."""
    shown = ", ".join(map(str, block_ids[:limit])) + (f" and {len(block_ids) - limit} more" if len(block_ids) > limit else "")
    return f"block{'s' if len(block_ids) > 1 else ''} {shown}"


@state_invariant("block-conservation", "vLLM BlockPool: every block is in the free queue or owned")
def block_conservation(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """free + owned == num_kv_blocks; every block id is in range; no block is owned twice or both free
    and owned; terminal requests own nothing. With prefix caching a block may be owned by several block
    tables (shared prefix), so owned counts distinct blocks. With KV cache groups, owned counts every group's
    blocks (one shared pool, vLLM ``KVCacheCoordinator``), a window's null entries not. KV connector: the
    blocks a transfer holds for an ended request (delayed_frees) are owned by it, and by nothing else."""
    owners: dict[int, str] = {}
    shared = state.prefix_cache is not None
    for request_id, request in state.requests.items():
        for block_id in held_block_ids(request):
            if block_id in owners and not shared:
                yield request_id, f"block {block_id} also owned by {owners[block_id]}"
            owners[block_id] = request_id
    delayed = 0
    for request_id, held in state.delayed_frees.items():
        for block_id in held.block_ids:
            if block_id in owners:
                yield request_id, f"block {block_id} held for its transfer is also owned by {owners[block_id]}"
            owners[block_id] = request_id
            delayed += 1
    free = frozenset(state.free_block_ids)
    if len(free) != len(state.free_block_ids):
        for block_id, count in Counter(state.free_block_ids).items():
            if count > 1:
                yield None, f"block {block_id} is {count} times in the free queue"
    for block_id in free.intersection(owners):
        yield owners[block_id], f"block {block_id} is both free and owned"
    for ids in (free, owners):
        if ids and (min(ids) < 0 or max(ids) >= config.num_kv_blocks):
            for block_id in ids:
                if not 0 <= block_id < config.num_kv_blocks:
                    yield owners.get(block_id), f"block id {block_id} out of range [0, {config.num_kv_blocks})"
    owned = len(owners) if shared else sum(len(held_block_ids(r)) for r in state.requests.values()) + delayed
    if len(state.free_block_ids) + owned != config.num_kv_blocks:
        # name the blocks: those neither free nor owned (leaked), not the whole free queue
        leaked = sorted(set(range(config.num_kv_blocks)) - free - set(owners))
        named = f"; neither free nor owned: {_some(leaked)}" if leaked else ""
        yield None, f"free {len(state.free_block_ids)} + owned {owned} != num_kv_blocks={config.num_kv_blocks}{named}"
    for request_id, request in (state.finished if terminal is None else terminal).items():
        if request.block_ids or request.group_block_ids:
            yield request_id, terminal_owns(request), TERMINAL_OWNS_BLOCKS


def terminal_owns(request: Request) -> str:
    """The detail of a ``block-conservation`` breach by a terminal ``request`` that still owns blocks."""
    return f"terminal request still owns {len(held_block_ids(request))} blocks"


TERMINAL_OWNS_BLOCKS = "terminal-owns-blocks"
"""The case of ``block-conservation`` where a terminal request still owns blocks (code
``block-conservation:terminal-owns-blocks``; the incremental checker tests it)."""


@state_invariant("table-covers-computed", "vLLM KVCacheManager.allocate_slots")
def table_covers_computed(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """Every running request's block table holds its computed tokens:
    len(block_ids) * block_size >= num_computed_tokens."""
    for request_id in state.running:
        request = state.requests.get(request_id)
        if request is not None and len(request.block_ids) * config.block_size < request.num_computed_tokens:
            yield request_id, (
                f"{len(request.block_ids)} blocks cannot hold {request.num_computed_tokens} computed tokens"
            )
    if config.kv_cache_groups:  # every group's table, a window's null entries counted (they keep its length)
        for request_id in state.running:
            request = state.requests.get(request_id)
            if request is None:
                continue
            for index in range(1, len(config.kv_cache_groups)):
                table = request.group_block_ids[index - 1] if index - 1 < len(request.group_block_ids) else ()
                if len(table) * config.block_size < request.num_computed_tokens:
                    yield request_id, (f"group {index}: {len(table)} blocks cannot hold {request.num_computed_tokens} "
                                       "computed tokens")


@state_invariant("queues-disjoint", "vLLM Scheduler.waiting / Scheduler.running")
def queues_disjoint(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """waiting and running have no duplicates and share no id; waiting requests have status WAITING or
    PREEMPTED (or WAITING_FOR_REMOTE_KVS, a remote KV load in flight), running ones RUNNING; finished ones are terminal."""
    for name, queue in (("waiting", state.waiting), ("running", state.running)):
        for request_id, count in Counter(queue).items():
            if count > 1:
                yield request_id, f"{count} times in {name}"
    for request_id in set(state.waiting) & set(state.running):
        yield request_id, "both waiting and running"
    for request_id in state.waiting:
        request = state.requests.get(request_id)
        if request is not None and not request.status.is_waiting:
            yield request_id, f"in waiting with status {request.status.value}"
    for request_id in state.running:
        request = state.requests.get(request_id)
        if request is not None and request.status is not RequestStatus.RUNNING:
            yield request_id, f"in running with status {request.status.value}"
    for request_id, request in (state.finished if terminal is None else terminal).items():
        if not request.status.is_terminal:
            yield request_id, f"in finished with status {request.status.value}"


@state_invariant("no-request-lost", "this spec: every admitted request ends finished, aborted or rejected")
def no_request_lost(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """Every added request is in exactly one of waiting, running, finished (terminal, rejected included):
    the live requests are exactly waiting plus running, and live plus terminal count the added ones."""
    queued = set(state.waiting) | set(state.running)
    for request_id in set(state.requests) - queued:
        yield request_id, "live but in neither waiting nor running"
    for request_id in queued - set(state.requests):
        yield request_id, "queued but not a live request"
    for request_id in state.requests:
        if request_id in state.finished:
            yield request_id, "both live and terminal"
    total = len(state.requests) + len(state.finished)
    if total != state.num_requests_added:
        yield None, f"{total} requests known but {state.num_requests_added} were added"


@state_invariant("output-bound", "vLLM check_stop (max_tokens, max_model_len)")
def output_bound(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """len(output) <= max_tokens, and len(prompt) + len(output) <= max(max_model_len, len(prompt) + 1)
    for every request: no request grows past max_model_len, except that a prompt of exactly
    max_model_len tokens still samples its one token (vLLM ``check_stop`` runs after sampling)."""
    for table in (state.requests, state.finished if terminal is None else terminal):
        for request_id, request in table.items():
            if len(request.output_token_ids) > request.max_tokens:
                yield request_id, f"{len(request.output_token_ids)} outputs > max_tokens={request.max_tokens}"
            limit = max(config.max_model_len, request.prompt_len + 1)
            if request.output_token_ids and request.num_tokens > limit:
                yield request_id, f"{request.num_tokens} tokens > max_model_len={config.max_model_len}"


@state_invariant("computed-bound", "vLLM Request.num_computed_tokens")
def computed_bound(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """0 <= num_computed_tokens <= len(prompt) + len(output) for every live request."""
    for request_id, request in state.requests.items():
        if not 0 <= request.num_computed_tokens <= request.num_tokens:
            yield request_id, f"num_computed_tokens={request.num_computed_tokens} outside [0, {request.num_tokens}]"


@state_invariant("preempted-holds-nothing", "vLLM Scheduler._preempt_request (kv_cache_manager.free, num_computed_tokens = "
                 "0); KV connector: Scheduler._holds_kv_blocks, _update_waiting_for_remote_kv")
def preempted_holds_nothing(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """A waiting request (fresh or preempted) holds no blocks and has no computed tokens, except one whose
    remote KV load started and that was never admitted since (``Request.holds_loaded_kv``): its table is
    exactly the blocks of its load (blocks_for_tokens(num_external_computed_tokens)) and holds its computed
    tokens, or, after a load that failed from its first block, it holds nothing and has nothing computed.
    While the load is in flight (WAITING_FOR_REMOTE_KVS, only with kv_load_step set) its table is those
    blocks and its computed tokens are the loaded ones."""
    size = config.block_size
    for request_id in state.waiting:
        request = state.requests.get(request_id)
        if request is None:
            continue
        loading = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        if loading and request.kv_load_step is None:
            yield request_id, "waiting for remote KV without a load started"
        elif not request.holds_loaded_kv or not (request.block_ids or request.num_computed_tokens):
            if request.block_ids or request.group_block_ids or request.num_computed_tokens:
                yield request_id, (
                    f"waiting with {len(held_block_ids(request))} blocks and {request.num_computed_tokens} "
                    "computed tokens"
                )
        elif (len(request.block_ids) != blocks_for_tokens(request.num_external_computed_tokens, size)
              or request.num_computed_tokens > len(request.block_ids) * size
              or (loading and request.num_computed_tokens != request.num_external_computed_tokens)):
            yield request_id, (
                f"waiting on its remote KV load of {request.num_external_computed_tokens} tokens with "
                f"{len(request.block_ids)} blocks and {request.num_computed_tokens} computed tokens")


@state_invariant("delayed-frees-ended", "vLLM Scheduler._free_request (delay_free_blocks), "
                 "_update_from_kv_xfer_finished")
def delayed_frees_ended(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """The blocks held for a transfer after its request ended (delayed_frees) belong to terminal requests only,
    and each entry holds at least one block."""
    for request_id, held in state.delayed_frees.items():
        if request_id in state.requests or request_id not in state.finished:
            yield request_id, f"{len(held.block_ids)} blocks held for the transfer of a request that has not ended"
        elif not held.block_ids:
            yield request_id, "held for its transfer with no block"


@state_invariant("window-sees-held", "vLLM single_type_kv_cache_manager.py SlidingWindowManager.get_num_skipped_tokens, "
                 "SingleTypeKVCacheManager.remove_skipped_blocks (only blocks before the window become null_block)")
def window_sees_held(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """With KV cache groups, every running request holds a real block (not the null block) at every table
    index its next token's window still sees: in a sliding-window group every index from
    max(0, num_computed_tokens - sliding_window + 1) // block_size on, in a full-attention group every index.
    Nothing the window still sees has been freed."""
    if not config.kv_cache_groups:
        return
    for request_id in state.running:
        request = state.requests.get(request_id)
        if request is None:
            continue
        for index, table in enumerate((request.block_ids,) + request.group_block_ids):
            if index >= len(config.kv_cache_groups):
                yield request_id, f"holds a table for group {index}, but {len(config.kv_cache_groups)} groups are configured"
                break
            skipped = num_skipped_blocks(config.kv_cache_groups[index], request.num_computed_tokens, config.block_size)
            nulled = [i for i in range(skipped, len(table)) if table[i] == NULL_BLOCK]
            if nulled:
                yield request_id, (f"group {index}: table index {nulled[0]} was freed, but the window of the token at "
                                   f"position {request.num_computed_tokens} still sees it")


@step_invariant("chunks-in-order", "Sarathi-Serve §4.1: chunks of a prompt run in order")
def chunks_in_order(before: SchedulerState, plan: StepPlan, after: SchedulerState, config: SchedulerConfig) -> Breaches:
    """Each scheduled chunk starts at the request's computed tokens before the step and, unless the request
    ended, its computed tokens after the step are exactly that plus the chunk (a chunk after a prefix-cache
    hit: see ``prefix-hit-computed``; a decode with drafts: see ``rejected-drafts-uncomputed``)."""
    for item in plan.scheduled:
        old = before.requests.get(item.request_id)
        if old is None or item.cached_block_ids:
            continue
        if item.num_computed_tokens != old.num_computed_tokens:
            yield item.request_id, f"chunk starts at {item.num_computed_tokens}, computed was {old.num_computed_tokens}"
        new = after.requests.get(item.request_id)
        if item.spec_token_ids:
            continue  # its rejected drafts are taken back: rejected-drafts-uncomputed
        if new is not None and new.num_computed_tokens != old.num_computed_tokens + item.num_tokens:
            yield item.request_id, (
                f"computed {old.num_computed_tokens} + {item.num_tokens} != {new.num_computed_tokens} after the step"
            )


# Prefix caching (schedspec.spec.prefix_cache). Each holds trivially with caching off (prefix_cache None).


def _held_tables(state: SchedulerState) -> Counter[int]:
    """Per block, how many live block tables (of every KV cache group) hold it, null entries left out."""
    return Counter(b for request in state.requests.values() for table in group_tables(request)
                   for b in set(table) if b != NULL_BLOCK)


@state_invariant("prefix-ref-counts", "vLLM block_pool.py KVCacheBlock.ref_cnt (touch, get_new_blocks, free_blocks)")
def prefix_ref_counts(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """With prefix caching, every block's reference count equals the number of live block tables holding
    it (0 for a block no table holds), and no table holds a block twice. With KV cache groups every group's
    table counts (a window's null entries not), so a block a window freed while a hit shares it stays held."""
    cache = state.prefix_cache
    if cache is None:
        return
    held = _held_tables(state)
    for request_id, request in state.requests.items():
        for table in group_tables(request):
            blocks = [b for b in table if b != NULL_BLOCK]
            if len(set(blocks)) != len(blocks):
                yield request_id, f"holds a block twice in its table {list(table)}"
    for block_id in sorted(set(held) | set(cache.ref_counts)):
        if cache.ref_counts.get(block_id, 0) != held.get(block_id, 0):
            yield None, (f"block {block_id} has reference count {cache.ref_counts.get(block_id, 0)} but "
                         f"{held.get(block_id, 0)} block tables hold it")


@state_invariant("prefix-block-partition", "vLLM block_pool.py FreeKVCacheBlockQueue (free and evictable blocks)")
def prefix_block_partition(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """With prefix caching, every block is exactly one of free (in the free queue, no hash), evictable (in
    the free queue, with a hash, reference count 0) or held (reference count >= 1, not in the free queue),
    and free + evictable + held == num_kv_blocks; the free queue holds no block twice."""
    cache = state.prefix_cache
    if cache is None:
        return
    queue = state.free_block_ids
    in_queue = frozenset(queue)
    if len(in_queue) != len(queue):
        for block_id, count in Counter(queue).items():
            if count > 1:
                yield None, f"block {block_id} is {count} times in the free queue"
    held = {b for b, count in cache.ref_counts.items() if count > 0}
    for block_id in sorted(b for b in held if b in in_queue):
        yield None, f"block {block_id} is in the free queue with reference count {cache.ref_counts[block_id]}"
    evictable = sum(1 for b in cache.block_hashes if b in in_queue)
    free = len(in_queue) - evictable
    only_held = len(held) - sum(1 for b in held if b in in_queue)
    if free + evictable + only_held != config.num_kv_blocks:
        yield None, (f"free {free} + evictable {evictable} + held {only_held} blocks != num_kv_blocks="
                     f"{config.num_kv_blocks}")


@state_invariant("prefix-published-computed", "vLLM block_pool.py BlockPool.cache_full_blocks (full blocks only)")
def prefix_published_computed(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """With prefix caching, a published block (one with a hash) held by a live request is fully computed by
    it: it sits at table index i with (i + 1) * block_size <= the request's num_computed_tokens, the hashed
    blocks of a table come first, and its hash is the chained hash of the request's tokens of block i. The
    hash map and the blocks' hashes agree (every block of hash h is listed under h, once).
    With KV cache groups, a block of group g > 0 is cached only fully computed and under its group's key
    (:func:`~schedspec.spec.kv_cache_groups.group_cache_key`; null entries skipped)."""
    cache = state.prefix_cache
    if cache is None:
        return
    listed: Counter[int] = Counter()
    for hash_value, blocks in cache.hash_to_blocks.items():
        for block_id in blocks:
            listed[block_id] += 1
            if cache.block_hashes.get(block_id) != hash_value:
                yield None, f"block {block_id} is listed under a hash it does not carry"
    for block_id in cache.block_hashes:
        if listed[block_id] != 1:
            yield None, f"block {block_id} carries a hash but is listed {listed[block_id]} times in the hash map"
    for request_id, request in state.requests.items():
        breach, _, _ = published_chain(request, cache.block_hashes, config.block_size)
        if breach is not None:
            yield request_id, breach
        for group, table in enumerate(request.group_block_ids, start=1):  # KV cache groups: under their own keys
            breach = group_hashes(request, table, cache.block_hashes, group, config.block_size,
                                  request.num_computed_tokens)
            if breach is not None:
                yield request_id, breach


def published_chain(request: Request, block_hashes: Mapping[int, str], block_size: int, start: int = 0,
                    parent: str = ROOT_HASH) -> tuple[str | None, int, str]:
    """The per-request part of ``prefix-published-computed``: the request's table from index ``start``
    on (the ``start`` blocks before it known to be published, fully computed and under the right hashes,
    ``parent`` the hash of block ``start - 1``), with ``block_hashes`` the cache's.

    Returns:
        ``(breach, published, parent)``: the first breach's detail (``None`` if none), the number of
        leading published blocks found right (blocks ``[0, published)``), and the hash of the last of
        them (the parent of block ``published``), so that a later check may start there
        (:class:`~schedspec.spec.incremental.IncrementalChecker`).
    """
    table = request.block_ids
    published = start
    unhashed_seen = False
    for index in range(start, len(table)):
        block_id = table[index]
        found = block_hashes.get(block_id)
        if found is None:
            unhashed_seen = True
            continue
        if unhashed_seen:
            return f"block {block_id} at index {index} is cached after a block that is not", published, parent
        if (index + 1) * block_size > request.num_computed_tokens:
            return (f"block {block_id} at index {index} is cached but only {request.num_computed_tokens} of its "
                    f"tokens are computed"), published, parent
        expected = request_block_hash(request, index, parent, block_size)
        if found != expected:
            return f"block {block_id} at index {index} is cached under the hash of other tokens", published, parent
        parent, published = expected, index + 1
    return None, published, parent


@state_invariant("released-holds-no-reference", "vLLM Scheduler._preempt_request / _free_request (kv_cache_manager.free)")
def released_holds_no_reference(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """With prefix caching, only running requests hold references: waiting (fresh or preempted) and terminal
    requests hold no block, and the reference counts add up to the running requests' block tables."""
    cache = state.prefix_cache
    if cache is None:
        return
    for request_id in state.waiting:
        request = state.requests.get(request_id)
        if request is not None and held_block_ids(request):
            yield request_id, f"waiting but holds {len(held_block_ids(request))} blocks"
    total = sum(cache.ref_counts.values())
    running = sum(len(held_block_ids(state.requests[r])) for r in state.running if r in state.requests)
    if total != running:
        yield None, f"reference counts add up to {total}, but running requests' tables hold {running} blocks"


@step_invariant("prefix-hit-computed", "vLLM Scheduler.schedule (request.num_computed_tokens = num_computed_tokens "
                "of the hit) and KVCacheManager.allocate_slots")
def prefix_hit_computed(before: SchedulerState, plan: StepPlan, after: SchedulerState, config: SchedulerConfig) -> Breaches:
    """A request admitted with a prefix-cache hit starts at the hit length found at allocation
    (len(cached_block_ids) * block_size), its table starts with the hit blocks, and unless it ended its
    computed tokens after the step are exactly the hit plus the chunk."""
    for item in plan.scheduled:
        if not item.cached_block_ids:
            continue
        hit = len(item.cached_block_ids) * config.block_size
        old = before.requests.get(item.request_id)
        if old is None:
            continue
        if item.num_computed_tokens != old.num_computed_tokens + hit:
            yield item.request_id, f"chunk starts at {item.num_computed_tokens} after a hit of {hit} tokens"
        new = after.requests.get(item.request_id)
        if new is None:
            continue
        if new.num_computed_tokens != hit + item.num_tokens:
            yield item.request_id, (f"computed {new.num_computed_tokens} after a hit of {hit} tokens and a chunk of "
                                    f"{item.num_tokens}")
        if new.block_ids[:len(item.cached_block_ids)] != item.cached_block_ids:
            yield item.request_id, f"block table {list(new.block_ids)} does not start with the hit blocks"


# Speculative decoding. With num_speculative_tokens = 0 no transition gives a request drafts (propose_drafts
# refuses any) and the rule drafts-are-proposed refuses an item that carries some, so these return at once.


@state_invariant("drafts-on-running-decodes", "vLLM Scheduler.update_draft_token_ids (drafts of a prefill chunk "
                 "are dropped), Scheduler._preempt_request (request.spec_token_ids = [])")
def drafts_on_running_decodes(state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None) -> Breaches:
    """With speculative decoding, only a running decode holds drafts (spec_token_ids), at most
    num_speculative_tokens of them: a waiting (fresh or preempted) request and a running one in the middle
    of its prompt hold none."""
    if not config.speculative:
        return
    limit = config.num_speculative_tokens
    for request_id, request in state.requests.items():
        drafts = request.spec_token_ids
        if not drafts:
            continue
        if request.status is not RequestStatus.RUNNING or not request.is_decode:
            yield request_id, f"holds {len(drafts)} drafts but is not a running decode ({request.status.value})"
        elif len(drafts) > limit:
            yield request_id, f"holds {len(drafts)} drafts > num_speculative_tokens={limit}"


def _appended(before: Request, after: Request | None) -> tuple[int, ...]:
    return () if after is None else after.output_token_ids[before.num_output_tokens:]


@step_invariant("rejected-drafts-uncomputed", "vLLM Scheduler.update_from_output (request.num_computed_tokens "
                "-= num_rejected)")
def rejected_drafts_uncomputed(before: SchedulerState, plan: StepPlan, after: SchedulerState,
                               config: SchedulerConfig) -> Breaches:
    """A decode that verified d drafts and goes on after the step has computed its pending token and the
    drafts it accepted, no rejected one: its num_computed_tokens is the one before plus 1 + a, where the a
    accepted drafts and the sampled token are the 1 + a tokens it appended; so it is a decode again (one
    pending token, the one sampled). A decode that verified drafts appends at least its sampled token."""
    if not config.speculative:
        return
    for item in plan.scheduled:
        if not item.spec_token_ids:
            continue
        old = before.requests.get(item.request_id)
        new = after.requests.get(item.request_id)
        if old is None or new is None or item.request_id not in after.running:
            continue
        appended = _appended(old, new)
        if not appended:
            yield item.request_id, f"verified {len(item.spec_token_ids)} drafts but appended no token"
            continue
        accepted = len(appended) - 1
        expected = old.num_computed_tokens + 1 + accepted
        if new.num_computed_tokens != expected:
            yield item.request_id, (
                f"computed {new.num_computed_tokens} after verifying {len(item.spec_token_ids)} drafts and accepting "
                f"{accepted}: {expected} (the {len(item.spec_token_ids) - max(accepted, 0)} rejected are not computed)")


@step_invariant("accepted-drafts-prefix", "vLLM Scheduler._update_request_with_output (check_stop per token, "
                "del new_token_ids[num_new:]); rejection sampling (Leviathan et al., ICML'23, §2.3) accepts a prefix")
def accepted_drafts_prefix(before: SchedulerState, plan: StepPlan, after: SchedulerState,
                           config: SchedulerConfig) -> Breaches:
    """A decode that verified d drafts appends at most 1 + d tokens: the first of the drafts, in order,
    then the sampled token, cut at the first stop: no appended token but the last meets a stop condition
    (EOS or a stop id after min_tokens, max_tokens, max_model_len), and a request whose last appended token
    does has ended."""
    if not config.speculative:
        return
    for item in plan.scheduled:
        if not item.spec_token_ids:
            continue
        old = before.requests.get(item.request_id)
        if old is None:
            continue
        new = after.requests.get(item.request_id) or after.finished.get(item.request_id)
        appended = _appended(old, new)
        drafts = item.spec_token_ids
        if not appended:
            continue  # rejected-drafts-uncomputed reports it
        if len(appended) > 1 + len(drafts):
            yield item.request_id, f"appended {len(appended)} tokens after verifying {len(drafts)} drafts"
            continue
        if appended[:-1] != drafts[:len(appended) - 1]:
            yield item.request_id, (f"appended {list(appended)}: the tokens before the last are not the first of its "
                                    f"drafts {list(drafts)}")
            continue
        outputs = old.output_token_ids
        for index, token in enumerate(appended):
            outputs += (token,)
            stop = stop_reason(evolve_request(old, output_token_ids=outputs), config)
            if stop is not None and index < len(appended) - 1:
                yield item.request_id, (f"token {index + 1} of the {len(appended)} appended stops it "
                                        f"({stop[1]}), but the tokens after it were kept")
                break
            if stop is not None and new is not None and not new.status.is_terminal:
                yield item.request_id, f"its last appended token stops it ({stop[1]}), but it goes on"


INVARIANT_NAMES: tuple[str, ...] = tuple(i.name for i in STATE_INVARIANTS + STEP_INVARIANTS)


def check_state(
    state: SchedulerState, config: SchedulerConfig, terminal: Terminal = None, skip: frozenset[str] = frozenset(),
    step: int | None = None,
) -> list[Violation]:
    """Every state invariant on one state; the violations found.

    Args:
        terminal: the terminal requests to check (default: all of ``state.finished``).
        skip: invariant names checked elsewhere (the incremental checker's block ledger).
        step: the step to blame (default ``state.step``; :func:`check_step` passes the step that
            produced the state).
    """
    blamed = state.step if step is None else step
    return [
        Violation(inv.name, detail, blamed, request_id, kind="invariant", code=coded(inv.name, case[0] if case else None))
        for inv in STATE_INVARIANTS
        if inv.name not in skip
        for request_id, detail, *case in inv.check(state, config, terminal)
    ]


def check_step(
    before: SchedulerState,
    plan: StepPlan,
    after: SchedulerState,
    config: SchedulerConfig,
    terminal: Terminal = None,
    skip: frozenset[str] = frozenset(),
) -> list[Violation]:
    """Every step invariant on one step, then every state invariant on the state after it
    (``terminal`` and ``skip`` as in :func:`check_state`). Every violation is blamed on ``before.step``,
    the step that caused it."""
    found = [
        Violation(inv.name, detail, before.step, request_id, kind="invariant", code=coded(inv.name, case[0] if case else None))
        for inv in STEP_INVARIANTS
        for request_id, detail, *case in inv.check(before, plan, after, config)
    ]
    return found + check_state(after, config, terminal, skip, step=before.step)
