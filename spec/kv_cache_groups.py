"""Hybrid KV cache groups: a request's block table per group, and what a sliding window frees.

A hybrid model (Gemma, GPT-OSS, Qwen3-Next, ...) mixes layers of several attention kinds. vLLM 0.32 keeps one
**KV cache group** per kind (``vllm/v1/kv_cache_interface.py`` ``KVCacheConfig.kv_cache_groups``), one
``SingleTypeKVCacheManager`` per group (``vllm/v1/core/single_type_kv_cache_manager.py``) and one block table
per group and request; a ``HybridKVCacheCoordinator`` (``vllm/v1/core/kv_cache_coordinator.py``) drives them
together. All groups take their blocks from **one** ``BlockPool`` of ``kv_cache_config.num_blocks`` blocks
(``KVCacheCoordinator.__init__``), so the spec's ``num_kv_blocks`` is shared by the groups and each block
id is held by at most one table of one group.

- **Full attention** (``FullAttentionManager``): a request holds ``ceil(tokens / block_size)`` blocks until it
  ends or is preempted.
- **Sliding window** (``SlidingWindowManager``, window ``w`` tokens): the next token to compute, at position
  ``c = num_computed_tokens``, attends ``[c - w + 1, c]``, so the first ``max(0, c - w + 1) // block_size``
  blocks (:func:`num_skipped_blocks`) are never read again. ``KVCacheManager.allocate_slots`` frees them
  (``remove_skipped_blocks``) before it allocates the step's new blocks, and the table keeps its length with
  the ``null_block`` in their place (:data:`NULL_BLOCK` here). The freed blocks go to the front of the free
  queue at once, so the same or a later request of the step may be handed them.

The spec's request keeps group 0's table in ``Request.block_ids`` and those of groups 1.. in
``Request.group_block_ids``; a step's item names the blocks it appends to each group
(``ScheduledRequest.new_block_ids``, ``group_new_block_ids``) and those its window freed
(``ScheduledRequest.skipped_block_ids``), and the rules judge them (``window-keeps-visible``,
``window-frees-skipped``, ``group-table-covers``, ``group-no-excess-blocks``). Without groups
(``SchedulerConfig.kv_cache_groups`` empty) every function here is the single full-attention group's.

**Prefix caching across groups** (``enable_prefix_caching``; vLLM 0.32 and 0.33 alike, see each function's
source). The cache is keyed by group: a block of group ``g`` is published under its chained hash and ``g``
(:func:`group_cache_key`; vLLM ``BlockHashWithGroupId``), so a hit in one group never names a block of another.
A full-attention group publishes every full block; a sliding-window group every full block it still holds (a
block its window freed first is a null entry and is skipped, ``BlockPool.cache_full_blocks``); and a window of
one token publishes none (``SlidingWindowManager.reachable_block_mask`` masks every block when no block is
needed, with the ``KVCacheConfig`` default ``prefix_cache_retention_interval=None``: dense retention).
A hit of ``n`` blocks is allowed only where **every group holds the prefix** (:func:`group_holds_prefix`): a
full-attention group its blocks ``[0, n)``, a sliding-window group the blocks ``[skipped, n)`` its window still
needs at ``n * block_size`` computed tokens (at least block ``n - 1``), the entries below being null; the hit
is the longest such ``n`` within :func:`~schedspec.spec.prefix_cache.max_hit_blocks` (:func:`longest_group_hit`),
which is what ``HybridKVCacheCoordinator.find_longest_cache_hit``'s fixed point computes.

Not specified yet (refused: a feature the scheduler lacks, exit 3): speculative decoding's lookahead slots in a
window, asynchronous scheduling with groups, remote KV with groups, Mamba state groups (``MambaSpec``), groups of
different block sizes, and vLLM's sparse retention (``prefix_cache_retention_interval`` >= 0, the serving
default 0 of ``CacheConfig``).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from schedspec.spec.config import KVCacheGroup, SchedulerConfig, blocks_for_tokens, slot_tokens
from schedspec.spec.prefix_cache import (
    NULL_BLOCK,
    ROOT_HASH,
    CacheUpdate,
    PrefixCache,
    group_cache_key,
    max_hit_blocks,
    request_block_hash,
    request_block_hashes,
)
from schedspec.spec.request import Request

__all__ = ["NULL_BLOCK", "group_cache_key"]  # defined in prefix_cache (which the cache's updates use), named here too

FULL_ATTENTION = KVCacheGroup("full_attention")
"""The one group of a config without ``kv_cache_groups``."""


def unspecified_with_groups(config: SchedulerConfig, async_scheduling: bool = False,
                            kv_connector: bool = False) -> str | None:
    """What the spec does not specify about this config's KV cache groups, in one line, or ``None``: groups with
    speculative decoding (a window with lookahead slots), with asynchronous scheduling (a window's frees over
    a plan made while a step is in flight: vLLM frees on the processed tokens), or with a KV connector's remote
    loads and sends. Callers refuse such a run or trace as a feature the scheduler lacks (exit 3), never as a
    bad config."""
    if not config.kv_cache_groups:
        return None
    groups = f"kv_cache_groups={[g.to_dict() for g in config.kv_cache_groups]}"
    if config.speculative:
        return (f"{groups} with speculative decoding (num_speculative_tokens={config.num_speculative_tokens}): "
                "a sliding window with lookahead slots is not specified")
    if async_scheduling:
        return (f"{groups} with async_scheduling: a sliding window's frees for plans made while a step is in "
                "flight are not specified")
    if kv_connector:
        return f"{groups} with remote KV loads and sends: loads into several groups' tables are not specified"
    return None


def groups_of(config: SchedulerConfig) -> tuple[KVCacheGroup, ...]:
    """The config's KV cache groups: ``kv_cache_groups``, or the one full-attention group without them."""
    return config.kv_cache_groups or (FULL_ATTENTION,)


def group_tables(request: Request) -> tuple[tuple[int, ...], ...]:
    """The request's block table per group, in group order: ``(block_ids,) + group_block_ids``."""
    return (request.block_ids,) + request.group_block_ids


def held_block_ids(request: Request) -> tuple[int, ...]:
    """Every block the request holds, over all groups (group 0's first, :data:`NULL_BLOCK` entries left out);
    ``request.block_ids`` itself without groups."""
    if not request.group_block_ids:
        return request.block_ids
    return request.block_ids + tuple(b for table in request.group_block_ids for b in table if b != NULL_BLOCK)


def release_order(request: Request) -> tuple[int, ...]:
    """The request's blocks in the order they go to the front of the free queue when it releases them all
    (preemption, finish, abort): each group's table last block first, the last group's in front. vLLM
    ``KVCacheCoordinator.free`` frees each manager's blocks in group order, each
    ``BlockPool.free_blocks(reversed(blocks))``, which prepends them (null blocks skipped)."""
    if not request.group_block_ids:
        return tuple(reversed(request.block_ids))
    order: tuple[int, ...] = ()
    for table in group_tables(request):
        order = tuple(b for b in reversed(table) if b != NULL_BLOCK) + order
    return order


def release_tables(update: CacheUpdate, request: Request) -> None:
    """With prefix caching, the request gives back every group's table (preemption, finish, abort): group by
    group in group order, each last block first (:meth:`~schedspec.spec.prefix_cache.CacheUpdate.release`, null
    entries skipped). vLLM ``KVCacheCoordinator.free`` (one ``free_blocks`` per manager)."""
    for table in group_tables(request):
        update.release(table)


def free_skipped(update: CacheUpdate, request: Request, skipped: tuple[int, ...]) -> None:
    """With prefix caching, the blocks a window freed at an item (``skipped``, a set of blocks of the request's
    tables) are given back group by group in group order, each group's from its highest index down: a block still
    held by another table stays held, a cached one stays cached at the back of the free queue. vLLM
    ``SingleTypeKVCacheManager._remove_blocks_in_range`` (backward, one ``free_blocks`` per manager)."""
    gone = frozenset(skipped)
    for table in request.group_block_ids:
        update.free_blocks([b for b in reversed(table) if b in gone])


def num_skipped_blocks(group: KVCacheGroup, num_computed_tokens: int, block_size: int) -> int:
    """Blocks at the start of a table the next token no longer attends: ``max(0, num_computed_tokens -
    sliding_window + 1) // block_size`` for a sliding window, 0 for full attention. vLLM
    ``SlidingWindowManager.get_num_skipped_tokens`` (``extra_retained_tokens`` = 0), divided as
    ``SingleTypeKVCacheManager.remove_skipped_blocks`` does."""
    if group.sliding_window is None:
        return 0
    return max(0, num_computed_tokens - group.sliding_window + 1) // block_size


def window_frees(request: Request, num_computed_tokens: int, config: SchedulerConfig) -> tuple[int, ...]:
    """The blocks an allocation for the request frees at ``num_computed_tokens`` (tokens computed before the
    chunk), in the order they go to the front of the free queue: per sliding-window group, the blocks still
    held at table indices below :func:`num_skipped_blocks` (capped at the table's length), the highest index
    first, a later group's in front of an earlier one's. vLLM ``SingleTypeKVCacheManager._remove_blocks_in_range``
    (backward, ``free_blocks`` prepends them), called per manager in group order. Empty without groups."""
    if not request.group_block_ids:
        return ()
    order: tuple[int, ...] = ()
    for group, table in zip(config.kv_cache_groups[1:], request.group_block_ids, strict=False):
        skipped = min(num_skipped_blocks(group, num_computed_tokens, config.block_size), len(table))
        order = tuple(table[i] for i in range(skipped - 1, -1, -1) if table[i] != NULL_BLOCK) + order
    return order


def blocks_held_after(config: SchedulerConfig, start: int, end: int) -> int:
    """Blocks the groups hold together once a chunk computing positions ``[start, end)`` has its slots: each
    group's table covers ``end`` tokens (``slot_tokens``), less a sliding window's blocks freed at ``start``."""
    needed = blocks_for_tokens(slot_tokens(end, config), config.block_size)
    return sum(needed - min(num_skipped_blocks(group, start, config.block_size), needed) for group in groups_of(config))


def min_peak_blocks(tokens: int, prompt_len: int, config: SchedulerConfig) -> int:
    """The fewest blocks a request whose KV covers positions ``[0, tokens)`` must hold at once, over all groups,
    however it is scheduled alone: the largest :func:`blocks_held_after` over the schedule that computes one
    token a step (with chunked prefill off, its first step computes the whole prompt). Full attention only
    grows; a window's count, past its window, repeats every ``block_size`` tokens; so the peak lies in the
    last ``block_size`` steps before each window's edge or before ``tokens`` (the brute force over every step is
    ``tests/test_kv_cache_groups.py``'s check of this)."""
    size = config.block_size
    first = 0
    peak = 0
    if not config.enable_chunked_prefill:
        first = min(prompt_len, tokens)
        peak = blocks_held_after(config, 0, first) if first else 0
    edges = {tokens} | {min(g.sliding_window - 1, tokens) for g in config.kv_cache_groups if g.sliding_window}
    for edge in edges:
        for start in range(max(first, edge - size), edge):
            peak = max(peak, blocks_held_after(config, start, start + 1))
    return peak


def new_blocks_needed(request: Request, end: int, config: SchedulerConfig) -> tuple[int, ...]:
    """Per group, in group order, the blocks the request's table needs appended so that it covers a chunk
    ending at position ``end`` (``slot_tokens(end)``): ``max(0, ceil(slots / block_size) - len(table))``, a
    window's null entries counted in the table's length. vLLM ``SingleTypeKVCacheManager.get_num_blocks_to_allocate``
    for a request it already tracks (``num_required_blocks - num_req_blocks``)."""
    needed = blocks_for_tokens(slot_tokens(end, config), config.block_size)
    tables = group_tables(request)
    return tuple(max(0, needed - (len(tables[g]) if g < len(tables) else 0)) for g in range(len(groups_of(config))))


def allocation_cost(request: Request, start: int, end: int, config: SchedulerConfig,
                    shared: AbstractSet[int] = frozenset()) -> int:
    """What scheduling a chunk ``[start, end)`` of the request costs the free queue (blocks, may be negative):
    the new blocks of every group (:func:`new_blocks_needed`) less those its window frees first
    (:func:`window_frees`) that go back to the free queue: not those in ``shared``, the blocks another table
    still holds (prefix caching: a hit shared them; ``BlockPool.free_blocks`` only drops their ``ref_cnt``).
    vLLM ``KVCacheManager.allocate_slots`` frees the skipped blocks, then requires ``num_blocks_to_allocate <=
    block_pool.get_num_free_blocks()``."""
    freed = window_frees(request, start, config)
    returned = len(freed) - (sum(1 for b in freed if b in shared) if shared else 0)
    return sum(new_blocks_needed(request, end, config)) - returned


# --- Prefix caching across groups ---------------------------------------------------------------------------


def hit_blocks_needed(group: KVCacheGroup, num_blocks: int, block_size: int) -> range:
    """The table indices a group must hold cached for a hit of ``num_blocks`` blocks: all of ``[0, num_blocks)``
    for full attention; for a sliding window those its window still needs, ``[skipped, num_blocks)`` with
    ``skipped`` = :func:`num_skipped_blocks` at ``num_blocks * block_size`` computed tokens, and at least block
    ``num_blocks - 1`` (the entries below are null in the hit). vLLM ``SlidingWindowManager.find_longest_cache_hit``
    (``cdiv(sliding_window - 1, block_size)`` contiguous cached blocks ending at the hit, or every block of a
    shorter hit; a run is counted after its block is found, so at least one) with
    ``SingleTypeKVCacheManager.add_local_computed_blocks`` (the skipped blocks padded with nulls)."""
    if num_blocks == 0:
        return range(0)
    skipped = num_skipped_blocks(group, num_blocks * block_size, block_size)
    return range(min(skipped, num_blocks - 1), num_blocks)


def group_publishes(group: KVCacheGroup, block_size: int) -> bool:
    """Whether the group publishes its full blocks at all: every group but a sliding window that needs no block
    (``cdiv(sliding_window - 1, block_size) == 0``, a window of one token), whose blocks vLLM masks out of the
    cache (``SlidingWindowManager.reachable_block_mask``, dense retention: ``need >= per_segment`` is false and
    no block lies in the needed tail)."""
    return group.sliding_window is None or group.sliding_window > 1


def group_holds_prefix(cache: PrefixCache, hashes: list[str], group_index: int, group: KVCacheGroup,
                       num_blocks: int, block_size: int,
                       excluded: frozenset[int] | set[int] = frozenset()) -> tuple[int, ...] | None:
    """The group's part of a hit of ``num_blocks`` blocks: its table with :data:`NULL_BLOCK` below the indices of
    :func:`hit_blocks_needed` and, at each of those, the first cached block (not in ``excluded``) under
    :func:`group_cache_key` of that block's hash; ``None`` if one of them is not cached (the group does not hold
    the prefix). ``hashes``: the request's chained block hashes, at least ``num_blocks`` of them. vLLM
    ``BlockPool.get_cached_block`` (first block of the key, ``get_one_block``)."""
    needed = hit_blocks_needed(group, num_blocks, block_size)
    table = [NULL_BLOCK] * num_blocks
    for index in needed:
        block_id = cache.cached_block(group_cache_key(hashes[index], group_index), excluded)
        if block_id is None:
            return None
        table[index] = block_id
    return tuple(table)


def longest_group_hit(cache: PrefixCache, request: Request, config: SchedulerConfig,
                      excluded: frozenset[int] | set[int] = frozenset()) -> tuple[tuple[int, ...], ...]:
    """The prefix-cache hit of a waiting request with KV cache groups: per group, in group order, the blocks its
    table starts with (a sliding window's skipped entries :data:`NULL_BLOCK`); all of one length ``n``, the
    largest ``n <= max_hit_blocks`` at which every group holds the prefix (:func:`group_holds_prefix`); ``n = 0``
    (empty tables) when none does. ``excluded``: blocks not to use (handed out earlier in the step).

    Source: vLLM 0.32 and 0.33 ``kv_cache_coordinator.py`` ``HybridKVCacheCoordinator.find_longest_cache_hit``:
    full attention first (downward-closed: its longest run of cached blocks from the start bounds the hit), then
    each other spec (``SlidingWindowManager.find_longest_cache_hit`` searches from the right for the longest
    hit within the bound), repeated until no group shortens it (one pass for one full-attention spec and one
    other). Each search returns the longest length its group holds within the bound, so the fixed point is the
    longest length every group holds, which is what this computes; groups of one spec, searched together
    (``verify_and_split_kv_cache_groups``), hold a length exactly when each does. ``max_cache_hit_length =
    num_tokens - 1`` (``KVCacheManager.get_computed_blocks``), block-aligned as every group has
    ``block_size``."""
    groups = groups_of(config)
    size = config.block_size
    limit = max_hit_blocks(request, size)
    if not cache.hash_to_blocks or limit == 0:
        return tuple(() for _ in groups)
    hashes: list[str] = []
    parent = ROOT_HASH
    full = 0  # the longest run every full-attention group holds from the start
    for index in range(limit):
        parent = request_block_hash(request, index, parent, size)
        hashes.append(parent)
        if not all(cache.cached_block(group_cache_key(parent, g), excluded) is not None
                   for g, group in enumerate(groups) if group.sliding_window is None):
            break  # no hit reaches past here: the rest of the prompt is not hashed (a hot path of the references)
        full = index + 1
    for num_blocks in range(full, 0, -1):
        tables = [group_holds_prefix(cache, hashes, g, group, num_blocks, size, excluded)
                  for g, group in enumerate(groups)]
        if all(table is not None for table in tables):
            return tuple(t for t in tables if t is not None)
    return tuple(() for _ in groups)


def group_hit_violation(cache: PrefixCache, request: Request, tables: tuple[tuple[int, ...], ...],
                        config: SchedulerConfig) -> str | None:
    """Why a hit given as per-group tables (``tables[0]`` group 0's ``cached_block_ids``, then groups 1..) is not
    one every group holds, or ``None``: the tables differ in length, the hit leaves no token to compute
    (:func:`~schedspec.spec.prefix_cache.max_hit_blocks`), an entry :func:`hit_blocks_needed` names is not the
    block cached under that group's key for that index (null, another group's, or other tokens'), or an entry
    below them is not null."""
    groups = groups_of(config)
    size = config.block_size
    lengths = {len(t) for t in tables}
    num_blocks = len(tables[0]) if tables else 0
    if len(tables) != len(groups) or len(lengths) > 1:
        return f"hit tables of lengths {[len(t) for t in tables]} for {len(groups)} groups: not one length per group"
    if num_blocks > max_hit_blocks(request, size):
        return (f"hit of {num_blocks} blocks, but at most {max_hit_blocks(request, size)} may hit so that one of its "
                f"{request.num_tokens} tokens is computed")
    hashes = request_block_hashes(request, num_blocks, size)
    for g, (group, table) in enumerate(zip(groups, tables, strict=True)):
        needed = hit_blocks_needed(group, num_blocks, size)
        for index, block_id in enumerate(table):
            if index not in needed:
                if block_id != NULL_BLOCK:
                    return f"group {g}: hit entry {index} is block {block_id}, but the window no longer needs it"
                continue
            if cache.block_hashes.get(block_id) != group_cache_key(hashes[index], g):
                return (f"group {g}: hit entry {index} is block {block_id}, which is not cached for these tokens in "
                        "this group")
    return None


def group_hashes(request: Request, table: tuple[int, ...], block_hashes: Mapping[int, str], group: int,
                 block_size: int, num_computed_tokens: int) -> str | None:
    """Why a group's table breaks ``prefix-published-computed``, or ``None``: a block carrying a hash is fully
    computed (index ``i`` with ``(i + 1) * block_size <= num_computed_tokens``) and carries
    :func:`group_cache_key` of the chained hash of the request's block ``i`` and ``group`` (a sliding window's
    null entries skipped)."""
    parent = ROOT_HASH
    for index, block_id in enumerate(table):
        if (index + 1) * block_size > num_computed_tokens:
            if block_id != NULL_BLOCK and block_id in block_hashes:
                return f"group {group}: block {block_id} at index {index} is cached but not fully computed"
            continue
        parent = request_block_hash(request, index, parent, block_size)
        if block_id == NULL_BLOCK or block_id not in block_hashes:
            continue
        if block_hashes[block_id] != group_cache_key(parent, group):
            return f"group {group}: block {block_id} at index {index} is cached under another key than its tokens'"
    return None
