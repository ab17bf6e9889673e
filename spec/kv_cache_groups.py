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

Not specified yet (the config refuses them with groups): prefix-cache hits across groups (vLLM's coordinator
finds the longest hit every group holds), speculative decoding's lookahead slots in a window, Mamba state
groups (``MambaSpec``), and groups of different block sizes.
"""

from __future__ import annotations

from schedspec.spec.config import KVCacheGroup, SchedulerConfig, blocks_for_tokens, slot_tokens
from schedspec.spec.request import Request

NULL_BLOCK = -1
"""The table entry of a block a sliding window freed (vLLM ``BlockPool.null_block``, never handed out, never
counted among the ``num_kv_blocks``)."""

FULL_ATTENTION = KVCacheGroup("full_attention")
"""The one group of a config without ``kv_cache_groups``."""


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


def allocation_cost(request: Request, start: int, end: int, config: SchedulerConfig) -> int:
    """What scheduling a chunk ``[start, end)`` of the request costs the free queue (blocks, may be negative):
    the new blocks of every group (:func:`new_blocks_needed`) less those its window frees first
    (:func:`window_frees`). vLLM ``KVCacheManager.allocate_slots`` frees the skipped blocks, then requires
    ``num_blocks_to_allocate <= block_pool.get_num_free_blocks()``."""
    return sum(new_blocks_needed(request, end, config)) - len(window_frees(request, start, config))
