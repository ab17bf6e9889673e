"""The paged KV cache and, for debug mode, a ledger of which request owns which block.

Block ``b`` of the pool holds ``block_size`` token slots; slot ``b * block_size + o`` is offset ``o``
of block ``b``. A request's block table ``[b0, b1, ...]`` puts its position ``p`` in slot
``table[p // block_size] * block_size + p % block_size`` (vLLM's paged attention layout).

Hybrid KV cache groups (``SchedulerConfig.kv_cache_groups``): each layer's KV lives in the pages of its group's
block table (group 0's is ``Request.block_ids``, groups 1..'s ``Request.group_block_ids``), and the groups share one
pool of ``num_kv_blocks`` block ids, as vLLM's ``KVCacheConfig`` does: the ``k``-th layer of every group shares
one tensor (vLLM 0.32 ``vllm/v1/kv_cache_interface.py`` ``KVCacheTensor``: "cache groups overlay each other, which
is sound because a block ID is owned by one group at a time"), so a block id handed to another group, or another
request, overwrites what the first one wrote there (see :func:`layer_groups`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from schedspec.gpu_backend.config import SLIDING_ATTENTION, ModelConfig
from schedspec.gpu_backend.errors import BackendError
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.state import SchedulerState, StepPlan


def layer_groups(model: ModelConfig, config: SchedulerConfig) -> tuple[tuple[int, int], ...]:
    """Per decoder layer, ``(group, tensor)``: the KV cache group whose block tables hold its KV and the cache
    tensor it writes (:attr:`PagedKVCache.key` ``[layer]`` is tensor ``tensor`` of the shared ones).

    Without ``config.kv_cache_groups`` every layer is in group 0 with a tensor of its own; a sliding-window
    layer then reads the full-attention pages through its window mask (vLLM with the hybrid KV cache manager
    off: ``--disable-hybrid-kv-cache-manager`` allocates a sliding window as full attention). With groups,
    the full-attention layers go to the ``full_attention`` groups and the ``sliding_attention`` layers to the
    ``sliding_window`` groups whose window is the model's ``sliding_window``: the ``k``-th layer of a kind
    (in layer order) to that kind's group ``k % n`` of ``n``, as its tensor ``k // n`` (vLLM 0.32
    ``vllm/v1/core/kv_cache_utils.py`` ``_get_kv_cache_groups_uniform_page_size`` gives group ``i`` the layers
    ``layers[i::num_groups]``); so layers of different groups share tensors. The number of groups is the
    config's (vLLM derives it from the layer counts; this does not check that it would derive the same).

    Raises:
        BackendError (field ``kv_cache_groups``): a group whose kind or window no layer has, or a kind of
            layer with no group.
    """
    num_layers = model.num_hidden_layers
    if not config.kv_cache_groups:
        return tuple((0, layer) for layer in range(num_layers))

    def kind_of(layer: int) -> int | None:
        return model.sliding_window if model.layer_types and model.layer_types[layer] == SLIDING_ATTENTION else None

    groups = [g.sliding_window for g in config.kv_cache_groups]
    result: list[tuple[int, int]] = [(0, 0)] * num_layers
    for window in dict.fromkeys([kind_of(layer) for layer in range(num_layers)] + groups):
        layers = [layer for layer in range(num_layers) if kind_of(layer) == window]
        members = [g for g, w in enumerate(groups) if w == window]
        if not layers or not members or len(members) > len(layers):
            kind = "full attention" if window is None else f"sliding window {window}"
            raise BackendError(
                f"kv_cache_groups={[g.to_dict() for g in config.kv_cache_groups]}: {len(members)} group(s) of "
                f"{kind} for the model's {len(layers)} layer(s) of it (layer_types, sliding_window="
                f"{model.sliding_window})", field="kv_cache_groups")
        for index, layer in enumerate(layers):
            result[layer] = (members[index % len(members)], index // len(members))
    return tuple(result)


class PagedKVCache:
    """Per-layer key and value tensors of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Args:
        num_layers: tensors to allocate (per key and value); one per layer unless ``tensor_of_layer`` says
            which layers share one (hybrid KV cache groups, :func:`layer_groups`).
        tensor_of_layer: per layer, the index of its tensor in ``[0, num_layers)``; default: layer ``i`` has
            tensor ``i``.

    Attributes:
        key, value: one tensor per layer (the same object for layers that share one), in the model dtype on
            the model device.
        num_blocks, block_size, num_kv_heads, head_dim: the sizes (blocks, tokens, heads, elements).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fill: float = 0.0,
                 tensor_of_layer: Iterable[int] | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        keys = [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(num_layers)]
        which = range(num_layers) if tensor_of_layer is None else tuple(tensor_of_layer)
        self.key = [keys[i] for i in which]
        self.value = [values[i] for i in which]
        self._tensors = (*keys, *values)

    @staticmethod
    def size_bytes(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
        """Bytes the cache takes: ``2 * layers * blocks * block_size * kv_heads * head_dim * itemsize``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim * itemsize

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new keys/values ``[T, num_kv_heads, head_dim]`` at slots ``slot_mapping`` ``[T]`` (int64)."""
        width = self.num_kv_heads * self.head_dim  # slots as rows of the 2-d view: faster than the 3-d one
        self.key[layer].view(-1, width).index_copy_(0, slot_mapping, key.reshape(-1, width))
        self.value[layer].view(-1, width).index_copy_(0, slot_mapping, value.reshape(-1, width))

    def fill_blocks(self, block_ids: Iterable[int], value: float = float("nan")) -> None:
        """Overwrite whole blocks in every layer (debug mode poisons freed blocks with NaN)."""
        ids = sorted(set(block_ids))
        if not ids:
            return
        index = torch.tensor(ids, dtype=torch.int64, device=self.key[0].device)
        for tensor in self._tensors:
            tensor.index_fill_(0, index, value)

    def fill_slots(self, slots: Iterable[int], value: float = float("nan")) -> None:
        """Overwrite single token slots (``block * block_size + offset``) in every layer (debug mode
        poisons the slots of rejected draft positions with NaN)."""
        ids = sorted(set(slots))
        if not ids:
            return
        index = torch.tensor(ids, dtype=torch.int64, device=self.key[0].device)
        width = self.num_kv_heads * self.head_dim
        for tensor in self._tensors:
            tensor.view(-1, width).index_fill_(0, index, value)


def _names(requests: set[str]) -> str:
    """``'a'`` for one request, ``'a', 'b'`` for several (sorted)."""
    return ", ".join(repr(r) for r in sorted(requests))


class BlockLedger:
    """Debug-mode bookkeeping: which requests hold each block, how many of each request's positions the
    backend has written, and which free blocks keep their KV for prefix-cache hits, as the backend saw
    it happen.

    With prefix caching a block may be held by several requests (a prefix hit shares it, no copy; vLLM
    ``KVCacheManager.get_computed_blocks`` / ``BlockPool.touch``), and a block whose last holder lets go
    may stay **cached**: free (in the free queue) but keeping its KV until it is handed out again
    (vLLM ``BlockPool.free_blocks`` keeps the hash; ``get_new_blocks`` evicts it). Which freed blocks
    stay cached is the scheduler's decision, passed in as ``kept`` (the spec's published blocks). A
    freed block that is not kept is poisoned at once; a cached block is poisoned when it is handed out
    again (as a new block of some request) or when the scheduler stops listing it as kept.

    At every step :meth:`check_step` compares the scheduler state against the ledger, finds the blocks
    freed since the last step, and checks that every block the step writes or reads is the request's
    own, a shared block with valid KV or a cached one; :meth:`commit` records the step afterwards.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.owners: dict[int, set[str]] = {}
        """Block id -> the requests whose block table holds it (several after a prefix hit)."""
        self.tables: dict[str, tuple[int, ...]] = {}
        """Request id -> its block table as the backend wrote it."""
        self.filled: dict[str, int] = {}
        """Request id -> positions ``[0, filled)`` written to its blocks (tokens)."""
        self.written: dict[int, int] = {}
        """Block id -> slots ``[0, written)`` of it that hold valid KV (0 or absent once poisoned)."""
        self.cached: set[int] = set()
        """Free blocks that keep their KV (not poisoned) for prefix-cache hits."""

    @property
    def owner(self) -> dict[int, str]:
        """Block id -> its holder, for blocks held by exactly one request."""
        return {block: next(iter(held)) for block, held in self.owners.items() if len(held) == 1}

    def release(self, request_id: str, kept: frozenset[int] | set[int] = frozenset()) -> tuple[int, ...]:
        """Forget a request's blocks. A block no other request holds becomes free: cached (KV kept) if
        it is in ``kept`` and fully written, else it is returned to be poisoned.

        Returns:
            the blocks to poison (in table order).
        """
        table = self.tables.pop(request_id, ())
        self.filled.pop(request_id, None)
        poison = []
        for block in table:
            held = self.owners.get(block)
            if held is not None:
                held.discard(request_id)
                if held:
                    continue
                del self.owners[block]
            if block in kept and self.written.get(block, 0) == self.block_size:
                self.cached.add(block)
            else:
                self.written.pop(block, None)
                poison.append(block)
        return tuple(poison)

    def _evict(self, block: int) -> None:
        self.cached.discard(block)
        self.written.pop(block, None)

    def check_step(self, plan: StepPlan, state: SchedulerState,
                   hits: Mapping[str, tuple[int, ...]] | None = None,
                   kept: frozenset[int] | set[int] = frozenset()) -> tuple[list[int], list[str]]:
        """Reconcile with ``state`` (before the step) and check ``plan``.

        Releases (in the ledger) the blocks of requests that ended since the last step and of the
        requests ``plan`` preempts.

        Args:
            plan: the step.
            state: the scheduler state before it.
            hits: request id -> the cached blocks that start its block table this step (a prefix hit;
                its table is ``block_ids + hits + new_block_ids``).
            kept: the free blocks whose KV the scheduler keeps for hits (the spec's published blocks).

        Returns:
            ``(poison, problems)``: the blocks to poison now (freed and not kept, cached ones the
            scheduler no longer keeps, cached ones handed out again), and one message per violation
            (empty when the step only touches blocks it may).
        """
        hits = hits or {}
        problems: list[str] = []
        poison: list[int] = []
        free = frozenset(state.free_block_ids)
        for request_id in list(self.tables):
            request = state.requests.get(request_id)
            if request is None:  # ended (finished or aborted) since the last step
                table = self.tables[request_id]
                poison.extend(self.release(request_id, kept))
                not_free = [b for b in table if b not in self.owners and b not in free]
                if not_free:
                    problems.append(f"request {request_id!r} ended but its blocks {not_free} are not in "
                                    "free_block_ids")
            elif request.block_ids != self.tables[request_id]:
                problems.append(
                    f"request {request_id!r}: state block_ids={list(request.block_ids)} but the backend "
                    f"gave it {list(self.tables[request_id])}")
        for block in sorted(free & self.owners.keys()):
            problems.append(f"block {block} is in free_block_ids but request {_names(self.owners[block])} "
                            "still holds it")
        for block in sorted(self.cached - set(kept)):  # the scheduler dropped it from its cache
            self._evict(block)
            poison.append(block)
        for request_id in plan.preempted:
            poison.extend(self.release(request_id, kept))
        available = free | set(poison) | self.cached
        hit_blocks = {b: r for r, blocks in hits.items() for b in blocks}
        taken: dict[int, str] = {}
        for item in plan.scheduled:
            request = state.requests.get(item.request_id)
            if request is None:
                problems.append(f"request {item.request_id!r} is not a live request")
                continue
            for block in request.block_ids:
                if item.request_id not in self.owners.get(block, ()):
                    held = self.owners.get(block)
                    problems.append(
                        f"request {item.request_id!r}: block_ids lists block {block} owned by "
                        f"{'no request (free)' if not held else _names(held)}; reading it would read "
                        "another request's KV")
            hit = tuple(hits.get(item.request_id, ()))
            if hit and request.block_ids:
                problems.append(f"request {item.request_id!r}: a prefix hit {list(hit)} for a request that "
                                f"already holds blocks {list(request.block_ids)}")
            for block in hit:
                if self.written.get(block, 0) != self.block_size or not (block in self.cached or self.owners.get(block)):
                    problems.append(f"request {item.request_id!r}: prefix hit on block {block}, which holds no "
                                    "valid KV (never fully written, or freed and poisoned)")
            for block in item.new_block_ids:
                held = self.owners.get(block)
                if held or block not in available:
                    who = f"owned by request {_names(held)}" if held else "not in free_block_ids"
                    problems.append(f"request {item.request_id!r}: new_block_ids writes into block {block}, "
                                    f"which is {who}")
                elif block in taken:
                    problems.append(f"request {item.request_id!r}: new_block_ids block {block} is also given "
                                    f"to request {taken[block]!r} in this step")
                elif block in hit_blocks:
                    problems.append(f"request {item.request_id!r}: new_block_ids block {block} is a prefix hit "
                                    f"of request {hit_blocks[block]!r} in this step")
                elif block in self.cached:  # handed out again: its cached KV is gone
                    self._evict(block)
                    poison.append(block)
                taken[block] = item.request_id
            written = self.filled.get(item.request_id, 0) + len(hit) * self.block_size
            if item.num_computed_tokens > written:
                problems.append(f"request {item.request_id!r}: num_computed_tokens={item.num_computed_tokens} "
                                f"but only positions [0, {written}) were written to its blocks")
        return poison, problems

    def commit(self, plan: StepPlan, state: SchedulerState, hits: Mapping[str, tuple[int, ...]] | None = None,
               computed_ends: Mapping[str, int] | None = None) -> None:
        """Record the step: hit and new blocks join their request's table (a hit block leaves the cached
        set: it is held again); its positions up to the chunk's end are written, or up to
        ``computed_ends[request]`` for an item with drafts (the position after its last accepted draft: the
        rejected positions' slots were poisoned)."""
        hits = hits or {}
        computed_ends = computed_ends or {}
        size = self.block_size
        for item in plan.scheduled:
            request = state.requests.get(item.request_id)
            if request is None:
                continue
            table = request.block_ids + tuple(hits.get(item.request_id, ())) + item.new_block_ids
            self.tables[item.request_id] = table
            end = computed_ends.get(item.request_id, item.num_computed_tokens + item.num_tokens)
            self.filled[item.request_id] = end
            for index, block in enumerate(table):
                self.owners.setdefault(block, set()).add(item.request_id)
                self.cached.discard(block)
                slots = min(size, end - index * size)
                if slots > self.written.get(block, 0):
                    self.written[block] = slots
