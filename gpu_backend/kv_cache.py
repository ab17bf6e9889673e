"""The paged KV cache and, for debug mode, a ledger of which request owns which block.

Block ``b`` of the pool holds ``block_size`` token slots; slot ``b * block_size + o`` is offset ``o``
of block ``b``. A request's block table ``[b0, b1, ...]`` puts its position ``p`` in slot
``table[p // block_size] * block_size + p % block_size`` (vLLM's paged attention layout).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from schedspec.spec.state import SchedulerState, StepPlan


class PagedKVCache:
    """Per-layer key and value tensors of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Attributes:
        key, value: one tensor per layer, in the model dtype on the model device.
        num_blocks, block_size, num_kv_heads, head_dim: the sizes (blocks, tokens, heads, elements).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fill: float = 0.0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key = [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(num_layers)]

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
        for tensor in (*self.key, *self.value):
            tensor.index_fill_(0, index, value)


class BlockLedger:
    """Debug-mode bookkeeping: which request owns each block and how many of its positions the backend
    has written, as the backend saw it happen.

    At every step :meth:`check_step` compares the scheduler state against the ledger, finds the blocks
    freed since the last step, and checks that every block the step writes or reads belongs to the
    request doing it; :meth:`commit` records the step afterwards.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.owner: dict[int, str] = {}
        """Block id -> owning request id."""
        self.tables: dict[str, tuple[int, ...]] = {}
        """Request id -> its block table as the backend wrote it."""
        self.filled: dict[str, int] = {}
        """Request id -> positions ``[0, filled)`` written to its blocks (tokens)."""

    def release(self, request_id: str) -> tuple[int, ...]:
        """Forget a request's blocks; returns them."""
        table = self.tables.pop(request_id, ())
        self.filled.pop(request_id, None)
        for block in table:
            if self.owner.get(block) == request_id:
                del self.owner[block]
        return table

    def check_step(self, plan: StepPlan, state: SchedulerState) -> tuple[list[int], list[str]]:
        """Reconcile with ``state`` (before the step) and check ``plan``.

        Releases (in the ledger) the blocks of requests that ended since the last step and of the
        requests ``plan`` preempts.

        Returns:
            ``(freed, problems)``: the blocks released now (to poison), and one message per violation
            (empty when the step only touches blocks its requests own).
        """
        problems: list[str] = []
        freed: list[int] = []
        free = set(state.free_block_ids)
        for request_id in list(self.tables):
            request = state.requests.get(request_id)
            if request is None:  # ended (finished or aborted) since the last step
                released = self.release(request_id)
                not_free = [b for b in released if b not in free]
                if not_free:
                    problems.append(f"request {request_id!r} ended but its blocks {not_free} are not in "
                                    "free_block_ids")
                freed.extend(released)
            elif request.block_ids != self.tables[request_id]:
                problems.append(
                    f"request {request_id!r}: state block_ids={list(request.block_ids)} but the backend "
                    f"gave it {list(self.tables[request_id])}")
        for block in sorted(free & self.owner.keys()):
            problems.append(f"block {block} is in free_block_ids but request {self.owner[block]!r} still holds it")
        for request_id in plan.preempted:
            freed.extend(self.release(request_id))
        available = free | set(freed)
        taken: dict[int, str] = {}
        for item in plan.scheduled:
            request = state.requests.get(item.request_id)
            if request is None:
                problems.append(f"request {item.request_id!r} is not a live request")
                continue
            for block in request.block_ids:
                owner = self.owner.get(block)
                if owner != item.request_id:
                    problems.append(
                        f"request {item.request_id!r}: block_ids lists block {block} owned by "
                        f"{'no request (free)' if owner is None else repr(owner)}; reading it would read "
                        "another request's KV")
            for block in item.new_block_ids:
                owner = self.owner.get(block)
                if owner is not None or block not in available:
                    who = f"owned by request {owner!r}" if owner is not None else "not in free_block_ids"
                    problems.append(f"request {item.request_id!r}: new_block_ids writes into block {block}, "
                                    f"which is {who}")
                elif block in taken:
                    problems.append(f"request {item.request_id!r}: new_block_ids block {block} is also given "
                                    f"to request {taken[block]!r} in this step")
                taken[block] = item.request_id
            written = self.filled.get(item.request_id, 0)
            if item.num_computed_tokens > written:
                problems.append(f"request {item.request_id!r}: num_computed_tokens={item.num_computed_tokens} "
                                f"but only positions [0, {written}) were written to its blocks")
        return freed, problems

    def commit(self, plan: StepPlan, state: SchedulerState) -> None:
        """Record the step: new blocks belong to their request; its positions up to the chunk's end are
        written."""
        for item in plan.scheduled:
            request = state.requests.get(item.request_id)
            if request is None:
                continue
            table = request.block_ids + item.new_block_ids
            self.tables[item.request_id] = table
            for block in table:
                self.owner[block] = item.request_id
            self.filled[item.request_id] = item.num_computed_tokens + item.num_tokens
