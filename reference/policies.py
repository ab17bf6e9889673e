"""Reference scheduling policies: pure functions ``plan(state, config) -> StepPlan``.

Each policy refines the spec: every plan it returns is allowed by
:func:`schedspec.spec.rules.violated_rules` (checked at every step by the engine loop and the
Hypothesis suite, and for fcfs proved by ``schedspec.reference.proofs``). The trace properties of
:mod:`schedspec.spec.properties` each promises are its scheduler's ``guarantees``, given where it is
registered (``schedspec.reference.scheduler.REGISTRY``).

The shared mechanism of fcfs, static and shortest-prompt-first (:func:`plan_step`), one step in three
phases (the priority policy visits running and waiting requests in one pass in urgency order instead, so
that no urgent request waits behind less urgent ones: :func:`plan_by_priority`; it reuses the phases'
rejection, chunking and block pools):

1. **Reject** every waiting request that was never admitted and could never complete alone
   (``rejects-impossible``).
2. **Running requests**: those with one pending token first (:func:`one_token_pending`: every decode,
   :attr:`~schedspec.spec.request.Request.is_decode`, and a prefill with one token left), then the other
   partial prefills, each group in admission order. A decode gets one token; a prefill chunk gets its pending tokens capped by ``long_prefill_token_threshold``
   and by the budget left. A request that needs a new block when none is free preempts the most
   recently admitted running request not yet scheduled in this step (recompute), possibly itself.
3. **Admission** (only in a step that preempted nothing, as vLLM): waiting requests in the policy's
   order while budget, a ``max_num_seqs`` slot and blocks allow; admission reserves blocks for the
   whole current sequence (prompt plus any output to recompute), not only the first chunk. The first
   request that does not fit stops admission (no skipping ahead), with two exceptions, as vLLM: a request
   whose structured-output grammar is not ready (``Request.grammar_ready``) is skipped, and so, with
   ``max_loras > 0``, is a request whose LoRA adapter would be one too many (:func:`lora_fits`): admission
   goes on after them. With ``watermark > 0`` an admission while others run leaves ``watermark_blocks``
   free (:func:`watermark_keep`); the adapters counted are those of every running request (vLLM 0.33's count;
   0.32 counts only the running requests scheduled in the step), so no later step can exceed the limit.
   KV connector: the waiting requests that hold blocks after a remote KV load come first (vLLM's
   ``kv_holding_waiting``); one whose load is in flight (WAITING_FOR_REMOTE_KVS) is skipped; one whose
   connector offers a load (:func:`~schedspec.spec.state.offers_load`) gets blocks for the loaded prefix
   (:class:`~schedspec.spec.state.KVLoad`, no token, no ``max_num_seqs`` slot), and admission goes on after it;
   the load starts only if the request's whole sequence fits beside the blocks the requests holding loaded
   blocks still need (vLLM reserves the in-flight loads' remaining blocks,
   ``Scheduler._inflight_prefill_reserved_blocks``, but admits on the load's blocks alone; reserving the whole
   sequence means no two waiting holders can wait on each other's blocks).
   With ``prefill_schedule_interval > 1`` a step the cadence holds (:func:`~schedspec.spec.state.prefill_held`,
   vLLM 0.33) skips the running prefill chunks and stops admission at the first request with a prefill
   to compute (``plan_step`` only; ``priority`` does not follow the cadence).

Sources: vLLM 0.32 ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule`` (running first, then
waiting; ``_preempt_request`` takes the last of ``self.running``; no admission after a preemption);
Sarathi-Serve (OSDI'24) §4.2 stall-free batching (decodes before prefill chunks).

With ``enable_prefix_caching`` (:mod:`schedspec.spec.prefix_cache`) every policy here looks up the
longest chain of cached blocks when it admits a waiting request (fresh or preempted; vLLM
``KVCacheManager.get_computed_blocks``), reuses them (``ScheduledRequest.cached_block_ids``, the chunk
starting after the hit) and reserves blocks for the rest of the sequence only; a hit on an evictable
block counts against the free blocks (it leaves the free queue). Blocks come from :class:`CachePool`,
which follows vLLM's free-queue order with caching (released cached blocks at the back, handed out last),
also for the blocks a preemption releases (without caching those are taken after the free ones).

Speculative decoding (``num_speculative_tokens > 0``): a running decode verifies the drafts proposed for
it (``Request.spec_token_ids``), as many as the budget, ``long_prefill_token_threshold`` and
``max_model_len`` leave, as vLLM trims them, and (beyond vLLM) no more than ``max_tokens`` can still accept
(:func:`num_drafts`), after one token of the budget is kept for each decode still to schedule in the step
(vLLM gives a decode's drafts whatever budget is left, which can starve a later decode of its token:
``stall-free-decode``); every block table covers ``num_lookahead_tokens`` past its chunk, admission
included (:func:`~schedspec.spec.config.slot_tokens`). fcfs, static, shortest-prompt-first and priority
share this (:func:`_running_item`); priority keeps a token for each running decode it has not visited yet
in its urgency-ordered pass, so a decode's drafts take only budget no more urgent request asked for.

Where this differs from vLLM 0.32, on purpose:
- decodes are scheduled before running prefill chunks (vLLM keeps admission order), so a long
  chunked prefill never stalls a decode (``stall-free-decode``);
- admission reserves the whole current sequence (vLLM reserves the first chunk), so a running prefill
  never needs a block later and never triggers preemption halfway through its prompt;
- a request that preempts itself does not end the step's running phase (vLLM breaks out of the
  loop), so older running requests still get their tokens (``work-conserving``, ``bounded-wait``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens, slot_tokens
from schedspec.spec.kv_cache_groups import (
    NULL_BLOCK,
    allocation_cost,
    free_skipped,
    held_block_ids,
    longest_group_hit,
    new_blocks_needed,
    release_tables,
    window_frees,
)
from schedspec.spec.persistent import evolve_request
from schedspec.spec.prefix_cache import CacheUpdate
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import (
    KVLoad,
    ScheduledRequest,
    SchedulerState,
    StepPlan,
    holding_first,
    is_prefill_chunk,
    offers_load,
    prefill_held,
)

AdmissionOrder = Callable[[SchedulerState], Sequence[str]]


class BlockPool(Protocol):
    """The one interface of the free queue as a reference policy's plan sees it during one step (blocks
    are not taken from the state: the plan names them, the spec's transition applies it). Three
    implementations, differing only in where a released block goes: :class:`_BlockPool` (caching off,
    after the blocks already free: fcfs, static, shortest-prompt-first, priority),
    ``vllm_v1._FreeQueue`` (caching off, at the front, as vLLM 0.32 ``BlockPool.free_blocks``) and
    :class:`CachePool` (prefix caching: at the back, cached, as :class:`~schedspec.spec.prefix_cache.CacheUpdate`).
    """

    @property
    def available(self) -> int:
        """Blocks that could be handed out now (blocks)."""
        ...

    def take(self, count: int) -> tuple[int, ...]:
        """The next ``count`` block ids (the caller checked :attr:`available`); ``()`` for ``count <= 0``."""
        ...

    def release(self, blocks: tuple[int, ...]) -> None:
        """A block table given back (a preemption in this step)."""
        ...

    def admission(self, request: Request, config: SchedulerConfig,
                  tokens: int | None = None) -> tuple[tuple[int, ...], int, int]:
        """``(hit blocks, new blocks for tokens tokens, blocks it costs the free queue)`` for a waiting
        request; ``tokens`` defaults to its whole current sequence."""
        ...

    def admit(self, hit: tuple[int, ...], needed: int) -> tuple[int, ...]:
        """Reference the hit blocks and take ``needed`` new ones."""
        ...

    def admission_after(self, released: Sequence[tuple[int, ...]], request: Request,
                        config: SchedulerConfig) -> tuple[tuple[int, ...], int, int, int]:
        """:meth:`admission` once these block tables are released (not done here), and the blocks then
        available: ``(hit blocks, new blocks, cost, available)``."""
        ...


class _BlockPool:
    """The free queue as this step's plan sees it: allocate from the front; blocks released by this
    step's preemptions are taken only after the blocks already free (any free block may be taken; the
    vllm-v1 profile hands released blocks out first, as vLLM does)."""

    def __init__(self, free: tuple[int, ...]) -> None:
        self.free = free  # not copied: the pool only reads it
        self.size = len(free)
        self.released: list[int] = []
        self.next = 0

    @property
    def available(self) -> int:
        return self.size + len(self.released) - self.next

    def release(self, blocks: tuple[int, ...]) -> None:
        self.released.extend(reversed(blocks))

    def take(self, count: int) -> tuple[int, ...]:
        if count <= 0:
            return ()
        start, stop, size = self.next, self.next + count, self.size
        self.next = stop
        if stop <= size:
            return self.free[start:stop]
        return self.free[start:size] + tuple(self.released[max(start - size, 0):stop - size])

    def admission(self, request: Request, config: SchedulerConfig,
                  tokens: int | None = None) -> tuple[tuple[int, ...], int, int]:
        """``(hit blocks, new blocks for tokens tokens, blocks it costs the free pool)``: no hit without
        caching; ``tokens`` defaults to the whole current sequence; with ``num_lookahead_tokens`` the
        slots include the lookahead (:func:`~schedspec.spec.config.slot_tokens`)."""
        total = request.num_tokens if tokens is None else tokens
        # a waiting request holds blocks only after a remote KV load (Request.holds_loaded_kv): it needs the rest
        needed = max(blocks_for_tokens(slot_tokens(total, config), config.block_size) - len(request.block_ids), 0)
        return (), needed, needed

    def admit(self, hit: tuple[int, ...], needed: int) -> tuple[int, ...]:
        """Reference the hit blocks and take ``needed`` new ones."""
        return self.take(needed)

    def admission_after(self, released: Sequence[tuple[int, ...]], request: Request,
                        config: SchedulerConfig) -> tuple[tuple[int, ...], int, int, int]:
        """:meth:`admission` as it would be once these block tables are released (not done here), and the
        blocks then available: ``(hit blocks, new blocks, cost, available)``."""
        return (*self.admission(request, config), self.available + sum(len(t) for t in released))

    def fits_after(self, released: list[tuple[int, ...]], request: Request, config: SchedulerConfig) -> bool:
        """Whether ``request`` could be admitted once these block tables are released (not done here)."""
        _, _, cost, available = self.admission_after(released, request, config)
        return cost <= available


class CachePool:
    """The free queue with prefix caching, as a plan sees it during one step
    (:class:`~schedspec.spec.prefix_cache.CacheUpdate`, vLLM's order: released cached blocks stay cached
    at the back of the queue, allocation from the front evicts). Same interface as the caching-off pools,
    plus the admission lookup."""

    def __init__(self, state: SchedulerState) -> None:
        assert state.prefix_cache is not None
        self.update = CacheUpdate(state.prefix_cache, state.free_block_ids)

    @property
    def available(self) -> int:
        return self.update.available

    def release(self, blocks: tuple[int, ...]) -> None:
        self.update.release(blocks)

    def take(self, count: int) -> tuple[int, ...]:
        return self.update.take_front(max(count, 0))

    def admission(self, request: Request, config: SchedulerConfig,
                  tokens: int | None = None) -> tuple[tuple[int, ...], int, int]:
        """The longest prefix-cache hit for a waiting request, the new blocks it needs for ``tokens`` tokens
        (default its whole current sequence) beyond the hit, and what that costs the free queue: the new
        blocks plus the hit blocks that are evictable now, since referencing them takes them out of it
        (vLLM ``SingleTypeKVCacheManager.get_num_blocks_to_allocate``)."""
        hit = self.update.longest_hit(request, config.block_size)
        total = request.num_tokens if tokens is None else tokens
        needed = max(blocks_for_tokens(slot_tokens(total, config), config.block_size) - len(hit), 0)
        return hit, needed, needed + self.update.num_evictable(hit)

    def admit(self, hit: tuple[int, ...], needed: int) -> tuple[int, ...]:
        self.update.touch(hit)
        return self.take(needed)

    def admission_after(self, released: Sequence[tuple[int, ...]], request: Request,
                        config: SchedulerConfig) -> tuple[tuple[int, ...], int, int, int]:
        """On a copy of the pool with these block tables released (shared blocks stay held, released cached
        blocks can be hit): ``(hit blocks, new blocks, cost, available)``."""
        if not released:
            return (*self.admission(request, config), self.available)
        trial = CachePool.__new__(CachePool)
        trial.update = self.update.clone()
        for table in released:
            trial.release(table)
        return (*trial.admission(request, config), trial.available)

    def fits_after(self, released: list[tuple[int, ...]], request: Request, config: SchedulerConfig) -> bool:
        _, _, cost, available = self.admission_after(released, request, config)
        return cost <= available


def reject_impossible(state: SchedulerState, config: SchedulerConfig) -> tuple[tuple[str, str], ...]:
    """``(request_id, reason)`` for each waiting, never-admitted request that could never complete alone."""
    rejected = []
    for request_id in state.waiting:
        request = state.requests[request_id]
        if request.admitted_step is None:
            reason = rejection_reason(request.prompt_len, request.max_tokens, config)
            if reason is not None:
                rejected.append((request_id, reason))
    return tuple(rejected)


def one_token_pending(request: Request) -> bool:
    """Whether ``request`` has exactly one token pending (``num_pending_tokens == 1``): the group the
    policies schedule first, one token each. Wider than the spec's decode
    (:attr:`~schedspec.spec.request.Request.is_decode`, which also asks that the prompt is computed): it
    also holds a prefill with only its prompt's last token left, which is as cheap to schedule."""
    return request.num_pending_tokens == 1


def step_config(state: SchedulerState, config: SchedulerConfig, num_rejected: int) -> SchedulerConfig:
    """``config`` with the threshold this step applies (its floor, ``long_prefill_token_threshold_adaptive``:
    :meth:`~schedspec.spec.config.SchedulerConfig.effective_long_prefill_threshold`), as a plain threshold;
    ``config`` itself when the floor is off."""
    if not config.long_prefill_token_threshold_adaptive:
        return config
    threshold = config.effective_long_prefill_threshold(len(state.running) + len(state.waiting) - num_rejected)
    return config.with_changes(long_prefill_token_threshold=threshold, long_prefill_token_threshold_adaptive=False)


def loras_of(request_ids: Iterable[str], requests: Mapping[str, Request]) -> set[int]:
    """The distinct LoRA adapters (``lora_int_id > 0``) of ``request_ids``."""
    return {requests[r].lora_int_id for r in request_ids if requests[r].lora_int_id}


def lora_fits(request: Request, loras: AbstractSet[int], config: SchedulerConfig) -> bool:
    """Whether admitting ``request`` keeps the step within ``max_loras`` distinct adapters, ``loras``
    being those already counted: vLLM 0.32/0.33 ``Scheduler.schedule``'s waiting loop skips (``continue``,
    not ``break``) a request whose adapter is new when ``len(scheduled_loras) == max_loras``. Always true
    with ``max_loras == 0`` (LoRA off) or for a base-model request (``lora_int_id == 0``)."""
    lora = request.lora_int_id
    return not (config.max_loras and lora and lora not in loras and len(loras) >= config.max_loras)


def watermark_keep(config: SchedulerConfig, num_running: int) -> int:
    """Blocks an admission must leave free with ``num_running`` requests running at that point: the
    watermark's ``watermark_blocks``, or 0 into an empty running set (vLLM 0.32/0.33
    ``KVCacheManager.allocate_slots``, ``has_scheduled_reqs=bool(self.running)``; rule ``watermark``)."""
    return config.watermark_blocks if num_running else 0


def _chunk(request: Request, budget: int, config: SchedulerConfig, hit_tokens: int = 0) -> int:
    """Tokens a request may compute with ``budget`` tokens left: its pending tokens (less a prefix-cache hit
    of ``hit_tokens``), capped by the long prefill threshold (chunked prefill only) and the budget; 0 if
    chunking is off and it does not fit."""
    pending = request.num_pending_tokens - hit_tokens
    if not config.enable_chunked_prefill:
        return pending if pending <= budget else 0
    threshold = config.long_prefill_token_threshold
    if threshold and pending > threshold:
        pending = threshold
    return min(pending, budget)


def num_drafts(request: Request, budget: int, config: SchedulerConfig) -> int:
    """How many of a running decode's drafts (``spec_token_ids``) it verifies with ``budget`` tokens left:
    as vLLM 0.32 ``Scheduler.schedule``, ``1 + d`` is capped by the budget (``min(num_new_tokens,
    token_budget)``), by ``long_prefill_token_threshold`` (which vLLM applies to every request's
    ``num_new_tokens``) and by ``max_model_len`` (``num_new_tokens <= max_model_len - num_computed_tokens -
    1``: rule ``drafts-within-max-model-len``); beyond vLLM, also by what ``max_tokens`` can still accept
    (``1 + d <= max_tokens - outputs``), so no budget goes to drafts that could only be dropped. 0 for a
    request that is not a decode or holds no drafts."""
    drafts = request.spec_token_ids
    if not drafts or not request.is_decode:
        return 0
    room = min(len(drafts), budget - 1, config.max_model_len - request.num_tokens - 1,
               request.max_tokens - request.num_output_tokens - 1)
    threshold = config.long_prefill_token_threshold
    if config.enable_chunked_prefill and threshold:
        room = min(room, threshold - 1)
    return max(room, 0)


def _running_item(request: Request, num_tokens: int, draft_budget: int,
                  config: SchedulerConfig) -> tuple[int, tuple[int, ...], int]:
    """A running request's item once its chunk of ``num_tokens`` tokens (without drafts) is chosen, the one
    definition fcfs (:func:`plan_step`) and priority (:func:`plan_by_priority`) share.

    Args:
        request: a running request.
        num_tokens: its chunk without drafts (tokens; 1 for a decode).
        draft_budget: tokens of the budget its drafts may take, its own token included (the budget left less
            one token for each decode the policy still has to schedule in the step).
        config: the limits.

    Returns:
        ``(num_tokens, drafts, needed)``: the chunk's tokens with its drafts (``1 + d`` for a decode that
        verifies ``d`` drafts), the drafts it verifies (a prefix of ``spec_token_ids``, :func:`num_drafts`),
        and the new blocks its table needs to cover them and the lookahead (blocks; at most 0 when its table
        already does: :func:`~schedspec.spec.config.slot_tokens`, vLLM 0.32
        ``KVCacheManager.allocate_slots``).
    """
    drafts = request.spec_token_ids[:num_drafts(request, draft_budget, config)] if request.spec_token_ids else ()
    num_tokens += len(drafts)
    needed = blocks_for_tokens(slot_tokens(request.num_computed_tokens + num_tokens, config),
                               config.block_size) - len(request.block_ids)
    return num_tokens, drafts, needed


def free_window(pool: BlockPool, request: Request, skipped: tuple[int, ...]) -> None:
    """The blocks a request's window frees (``skipped``, :func:`~schedspec.spec.kv_cache_groups.window_frees`)
    go back to ``pool``: with prefix caching group by group, a block another table holds staying held
    (:func:`~schedspec.spec.kv_cache_groups.free_skipped`); else at once, last block first."""
    if skipped and isinstance(pool, CachePool):
        free_skipped(pool.update, request, skipped)
    elif skipped:
        pool.release(tuple(reversed(skipped)))


def group_item(request: Request, start: int, num_tokens: int, pool: BlockPool, config: SchedulerConfig,
               hit: tuple[tuple[int, ...], ...] = (), drafts: tuple[int, ...] = (),
               freed: tuple[int, ...] | None = None) -> ScheduledRequest:
    """Hybrid KV cache groups: the item of a chunk ``[start, start + num_tokens)``: its window's frees go back
    to ``pool`` first (vLLM ``KVCacheManager.allocate_slots`` calls ``remove_skipped_blocks`` before it
    allocates), then a prefix-cache hit's blocks are referenced (``hit``: one table per group, from
    :func:`group_admission`, whose request ``request`` then is), then every group's table is extended from it
    (:func:`~schedspec.spec.kv_cache_groups.new_blocks_needed`). The caller checked that
    :func:`~schedspec.spec.kv_cache_groups.allocation_cost` (plus the hit's evictable blocks) fits
    ``pool.available``. ``freed``: the window's frees when the caller gave them back already (:func:`free_window`,
    as vLLM does before it checks the free blocks), ``None`` to give them back here."""
    skipped = window_frees(request, start, config) if freed is None else freed
    if freed is None:
        free_window(pool, request, skipped)
    if hit:
        assert isinstance(pool, CachePool)
        for table in hit:
            pool.update.touch(table)
    new = tuple(pool.take(count) for count in new_blocks_needed(request, start + num_tokens, config))
    return ScheduledRequest(request.request_id, start, num_tokens, new[0], hit[0] if hit else (), drafts, new[1:],
                            skipped, hit[1:])


def group_admission(pool: BlockPool, request: Request,
                    config: SchedulerConfig) -> tuple[Request, tuple[tuple[int, ...], ...], int]:
    """Hybrid KV cache groups: a waiting request's prefix-cache hit on ``pool`` (none without caching):
    ``(request, hit, evictable)``, the request as the hit leaves it (its tables the hit's, its computed tokens
    the hit's), the hit's tables, one per group (:func:`~schedspec.spec.kv_cache_groups.longest_group_hit`; empty
    without a hit), and how many of the hit's blocks are evictable now (a hit takes them out of the free queue:
    vLLM ``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` ``num_evictable_blocks`` of every group)."""
    if not isinstance(pool, CachePool):
        return request, (), 0
    tables = longest_group_hit(pool.update.view(), request, config)
    if not tables[0]:
        return request, (), 0
    hit_request = evolve_request(request, block_ids=tables[0], group_block_ids=tables[1:],
                                 num_computed_tokens=request.num_computed_tokens + len(tables[0]) * config.block_size)
    return hit_request, tables, pool.update.num_evictable(b for table in tables for b in table)


def release_victim(pool: BlockPool, request: Request, gone: tuple[int, ...] = ()) -> None:
    """A preempted request's blocks go back to ``pool``: with prefix caching every group's table in turn
    (:func:`~schedspec.spec.kv_cache_groups.release_tables`, vLLM ``KVCacheCoordinator.free``), else all its
    blocks (:func:`~schedspec.spec.kv_cache_groups.held_block_ids`) at once; ``gone``: blocks its window gave
    back already in this step (:func:`free_window`), null entries of its tables by now."""
    if gone:
        request = evolve_request(request, group_block_ids=tuple(
            tuple(NULL_BLOCK if b in gone else b for b in table) for table in request.group_block_ids))
    if isinstance(pool, CachePool) and request.group_block_ids:
        release_tables(pool.update, request)
    else:
        pool.release(held_block_ids(request))


def shared_frees(pool: BlockPool, request: Request, start: int, config: SchedulerConfig) -> frozenset[int]:
    """Of the blocks the request's window frees at ``start``, those another block table also holds now (prefix
    caching: a hit shared them), which the free does not give back (empty without caching)."""
    if not isinstance(pool, CachePool) or not request.group_block_ids:
        return frozenset()
    counts = pool.update.ref_counts
    return frozenset(b for b in window_frees(request, start, config) if counts.get(b, 0) > 1)


def group_cost(pool: BlockPool, request: Request, start: int, end: int, config: SchedulerConfig) -> int:
    """:func:`~schedspec.spec.kv_cache_groups.allocation_cost` of a chunk ``[start, end)`` on ``pool`` as it is
    now (the window's frees of blocks another table holds give nothing back: :func:`shared_frees`)."""
    return allocation_cost(request, start, end, config, shared_frees(pool, request, start, config))


def fit_chunk(request: Request, start: int, num_tokens: int, available: int, config: SchedulerConfig,
              shared: frozenset[int] = frozenset()) -> int:
    """Hybrid KV cache groups, chunked prefill on: the largest chunk of at most ``num_tokens`` tokens from
    ``start`` whose :func:`~schedspec.spec.kv_cache_groups.allocation_cost` fits ``available`` blocks (the
    cost grows with the chunk), at least 1. A chunk that asks for fewer blocks keeps a lone request within the
    peak the admission rule allows (:func:`~schedspec.spec.kv_cache_groups.min_peak_blocks`: one token a step
    fits), where vLLM would preempt. ``num_tokens`` itself without chunked prefill."""
    if not config.enable_chunked_prefill or allocation_cost(request, start, start + num_tokens, config,
                                                            shared) <= available:
        return num_tokens
    low, high = 1, num_tokens  # allocation_cost(start + low) may not fit either: then the caller preempts
    while low < high:
        middle = (low + high + 1) // 2
        if allocation_cost(request, start, start + middle, config, shared) <= available:
            low = middle
        else:
            high = middle - 1
    return low


def _urgency(request: Request) -> tuple[int, int, float]:
    """Sort key, most urgent first: lower ``priority`` value, then earlier arrival (vLLM's priority
    queue orders by ``(priority, arrival_time)``)."""
    return (request.priority, request.arrival_step, request.arrival_time)


def _pool(state: SchedulerState) -> BlockPool:
    """This step's free queue: :class:`CachePool` with prefix caching, :class:`_BlockPool` without."""
    return _BlockPool(state.free_block_ids) if state.prefix_cache is None else CachePool(state)


def plan_by_priority(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """One step of the priority policy, which keeps ``no-priority-inversion``: no waiting request is kept
    out only by a ``max_num_seqs`` slot, blocks or budget that a strictly less urgent running request holds.

    1. **Reject** as every policy (:func:`reject_impossible`).
    2. **One pass in urgency order** (:func:`_urgency`, running before waiting on ties) over the running
       requests and the waiting ones. One token per running decode not yet visited is reserved (when the
       running decodes number at most ``max_num_batched_tokens``), so a more urgent prefill never takes a
       decode's token (``stall-free-decode``):

       - a running decode gets one token, plus with speculative decoding the drafts the budget above the
         reserve leaves it (as fcfs: :func:`_running_item`, :func:`num_drafts`), a running prefill a chunk
         (:func:`_chunk`) of the budget left above the reserve; each table covers the lookahead too
         (:func:`~schedspec.spec.config.slot_tokens`); one that needs a new block when none is free
         preempts the least urgent running request not yet visited, possibly itself (recompute);
       - a waiting request is admitted (blocks for its whole current sequence beyond its prefix-cache
         hit, a chunk of the budget above the reserve) if it gets a slot, blocks and at least one token
         (its whole pending prompt without chunked prefill). If it does not fit, the strictly less
         urgent running requests are preempted, least urgent first, only if that makes it fit (each frees
         its slot, the blocks no one else holds and, for a decode, its reserved token); then it is
         admitted in the same step, so no preemption is wasted. One that cannot fit even so is skipped,
         not a stop: it waits for more urgent requests only, and a less urgent one may still fit.
       - no waiting request is admitted while a more urgent request (by ``(priority, arrival)``, so also
         an older one of equal priority) preempted in this step waits: it would take what that one needs
         (and with equal priorities it would be preempted for it in the next step).

       Every victim comes later in the pass than the request it makes room for, so no victim has been
       scheduled yet: nothing is taken back, and with prefix caching the plan's allocations, in plan
       order, are the pool's (``prefix-hit-longest`` sees the evictions this pass made).

    Source: vLLM 0.32 ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule`` with
    ``--scheduling-policy priority``: waiting requests in a heap by ``(priority, arrival_time)``, and when a
    running request's ``allocate_slots`` fails the victim is ``max(self.running, key=lambda r:
    (r.priority, r.arrival_time))``, possibly the request itself. Where this differs from vLLM, on purpose:

    - a waiting request preempts strictly less urgent running requests for a slot, blocks or budget
      (vLLM never preempts for a waiting request, so at ``max_num_seqs`` an urgent request waits: finding
      ``counterexample-vllm-priority-no-preempt-at-seq-cap``);
    - running and waiting requests share one pass in urgency order (vLLM schedules every running request
      first, so a less urgent running prefill takes the budget an urgent waiting one needs), with one token
      reserved per running decode;
    - a victim is never a request already scheduled in the step (vLLM takes back such a victim's tokens
      and blocks); visiting in urgency order makes the least urgent request one not visited yet;
    - admission continues after a preemption and skips a request that does not fit (vLLM stops at the
      first waiting request that does not fit and admits nothing after a preemption);
    - admission reserves the whole current sequence, as the other policies here.

    Args:
        state: the state before the step.
        config: the limits.

    Returns:
        A plan allowed by the spec from ``state``.
    """
    rejected = reject_impossible(state, config)
    config = step_config(state, config, len(rejected))  # the threshold's floor, when on
    requests = state.requests
    pool = _pool(state)
    budget = config.max_num_batched_tokens
    running = list(state.running)  # the running set as the pass goes: less the preempted, plus the admitted
    decodes = sum(1 for r in running if one_token_pending(requests[r]))
    # a token per running decode not visited yet, when all of them fit the budget (stall-free-decode asks
    # for no more: with more decodes than budget each request just takes its turn)
    reserving = decodes <= budget
    reserve = decodes if reserving else 0
    scheduled: list[ScheduledRequest] = []
    preempted: list[str] = []
    visited: set[str] = set()
    skip = {request_id for request_id, _ in rejected}

    def key(request_id: str) -> tuple[int, int, float]:
        return _urgency(requests[request_id])

    def is_reserved_decode(request_id: str) -> bool:
        return reserving and request_id not in visited and one_token_pending(requests[request_id])

    def preempt(victim: str) -> None:
        nonlocal reserve
        reserve -= is_reserved_decode(victim)
        running.remove(victim)
        preempted.append(victim)
        pool.release(requests[victim].block_ids)

    def fits(request: Request, victims: list[str]) -> bool:
        """Whether the waiting ``request`` gets a slot, blocks and a chunk once ``victims`` are preempted
        (slot and budget first: the prefix-cache lookup is the costly part)."""
        tokens = budget - reserve + sum(map(is_reserved_decode, victims))
        if config.active_seq_cap - len(running) + len(victims) < 1 or tokens < 1:
            return False
        hit, _, cost, available = pool.admission_after([requests[v].block_ids for v in victims], request, config)
        keep = watermark_keep(config, len(running) - len(victims))
        return cost + keep <= available and _chunk(request, tokens, config, len(hit) * config.block_size) > 0

    waiting = [r for r in _priority_order(state) if r not in skip]
    for request_id in sorted([*state.running, *waiting], key=key):
        if request_id in preempted:
            continue
        request = requests[request_id]
        if request_id in state.running:
            single = one_token_pending(request)
            reserve -= is_reserved_decode(request_id)
            visited.add(request_id)
            num_tokens = min(budget, 1) if single else _chunk(request, max(budget - reserve, 0), config)
            if num_tokens == 0:
                continue
            # a decode's drafts leave one token of the budget to each running decode not visited yet
            num_tokens, drafts, needed = _running_item(request, num_tokens, budget - reserve, config)
            while needed > pool.available:
                # the least urgent running request not yet visited, or this one (every other visited one is
                # more urgent, or as urgent and earlier in the pass)
                victim = max((r for r in running if r not in visited or r == request_id), key=key)
                preempt(victim)
                if victim == request_id:
                    break
            if request_id in preempted:
                continue
            scheduled.append(ScheduledRequest(request_id, request.num_computed_tokens, num_tokens,
                                              pool.take(max(needed, 0)), (), drafts))
            budget -= num_tokens
            continue
        visited.add(request_id)
        if any(key(p) < key(request_id) for p in preempted):
            continue  # a more urgent request preempted in this step waits: take nothing it needs
        if not request.grammar_ready(state.step):
            continue  # structured output: its grammar is compiling (vLLM skips it)
        if config.max_loras and not lora_fits(request, loras_of(running, requests), config):
            continue  # its adapter would pass max_loras among the running requests (lora-limit)
        less_urgent = sorted((r for r in running if r not in visited and key(r) > key(request_id)),
                             key=key, reverse=True)
        if not fits(request, []):
            if not less_urgent or not fits(request, less_urgent):
                continue  # kept out by more urgent requests only
            count = next(n for n in range(1, len(less_urgent) + 1) if fits(request, less_urgent[:n]))
            for victim in less_urgent[:count]:
                preempt(victim)
        hit, needed, _ = pool.admission(request, config)
        hit_tokens = len(hit) * config.block_size
        num_tokens = _chunk(request, budget - reserve, config, hit_tokens)
        scheduled.append(ScheduledRequest(request_id, request.num_computed_tokens + hit_tokens, num_tokens,
                                          pool.admit(hit, needed), hit))
        budget -= num_tokens
        running.append(request_id)
    return StepPlan(scheduled=tuple(scheduled), preempted=tuple(preempted), rejected=rejected)


def plan_step(
    state: SchedulerState,
    config: SchedulerConfig,
    admission_order: AdmissionOrder,
    admit_only_when_idle: bool = False,
) -> StepPlan:
    """The shared three-phase step (module docstring) with a policy's admission order.

    Args:
        state: the state before the step.
        config: the limits.
        admission_order: waiting request ids in the order the policy admits them.
        admit_only_when_idle: admit only when nothing is running (static batching).

    Returns:
        A plan allowed by the spec from ``state``.
    """
    rejected = reject_impossible(state, config)
    config = step_config(state, config, len(rejected))  # the threshold's floor, when on
    requests = state.requests
    budget = config.max_num_batched_tokens
    pool = _pool(state)
    scheduled: list[ScheduledRequest] = []
    preempted: list[str] = []
    gone: set[str] = set()  # preempted or scheduled this step: no longer a preemption candidate
    skip = {request_id for request_id, _ in rejected}
    victims = list(state.running)  # candidates, most recently admitted last
    hybrid = bool(config.kv_cache_groups)

    held = prefill_held(state, config)  # the prefill cadence holds this step's prefills (vLLM 0.33)
    decodes, prefills = [], []
    for request_id in state.running:
        request = requests[request_id]
        if held and is_prefill_chunk(state, request_id):
            continue  # a held step skips running prefill chunks, decodes still run
        (decodes if one_token_pending(request) else prefills).append(request_id)
    for index, request_id in enumerate(decodes + prefills):
        if request_id in gone:
            continue
        if budget == 0:
            break
        request = requests[request_id]
        num_tokens = _chunk(request, budget, config)
        if num_tokens == 0:
            continue
        # one token of the budget stays for each decode after this one
        num_tokens, drafts, needed = _running_item(request, num_tokens,
                                                   budget - max(len(decodes) - index - 1, 0), config)
        if hybrid:  # every group's blocks, less those its window frees; a prefill chunk shrinks to fit
            start = request.num_computed_tokens
            num_tokens = fit_chunk(request, start, num_tokens, pool.available, config,
                                   shared_frees(pool, request, start, config))
            needed = group_cost(pool, request, start, start + num_tokens, config)
        while needed > pool.available:
            while victims and victims[-1] in gone:
                victims.pop()
            victim = victims.pop()
            gone.add(victim)
            preempted.append(victim)
            release_victim(pool, requests[victim])
            if victim == request_id:
                break
            if hybrid:  # a victim that shared a block the window frees lets that free give it back
                needed = group_cost(pool, request, start, start + num_tokens, config)
        if request_id in gone:
            continue
        gone.add(request_id)
        if hybrid:
            scheduled.append(group_item(request, request.num_computed_tokens, num_tokens, pool, config))
        else:
            scheduled.append(
                ScheduledRequest(request_id, request.num_computed_tokens, num_tokens, pool.take(max(needed, 0)), (),
                                 drafts)
            )
        budget -= num_tokens

    if not preempted and not (admit_only_when_idle and state.running):
        num_running = len(state.running)
        # the adapters of every running request, scheduled or not (as vLLM 0.33 counts them), so the running
        # set never holds more than max_loras: a running request left out of this step cannot break the
        # limit in a later one
        loras = loras_of(state.running, requests) if config.max_loras else set()
        loads: list[KVLoad] = []
        reserved: int | None = None  # blocks the requests holding loaded blocks still need (computed on demand)
        for request_id in holding_first(admission_order(state), requests):
            if request_id in skip:
                continue
            if num_running >= config.active_seq_cap or budget == 0:
                break
            request = requests[request_id]
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue  # its transfer has not landed (rule wait-for-remote-kv): vLLM skips it
            if not request.grammar_ready(state.step) or not lora_fits(request, loras, config):
                continue  # vLLM skips a request whose grammar is compiling, or whose adapter is one too many
            if offers_load(request, config):  # start its remote KV load: blocks for the loaded prefix, no token
                # only if its whole sequence fits beside what the requests holding loaded blocks still need
                # (they wait, unpreemptible, and are admitted first): no two of them can wait on each other
                whole = blocks_for_tokens(slot_tokens(request.num_tokens, config), config.block_size)
                if reserved is None:
                    reserved = sum(_remaining_blocks(requests[r], config) for r in state.waiting
                                   if requests[r].holds_loaded_kv)
                if whole + reserved + watermark_keep(config, num_running) > pool.available:
                    break
                needed = blocks_for_tokens(request.num_external_computed_tokens, config.block_size)
                loads.append(KVLoad(request_id, request.num_external_computed_tokens, pool.take(needed)))
                reserved += whole - needed
                continue
            if hybrid:  # every group's blocks for the first chunk only beyond the hit, shrunk to fit (fit_chunk)
                admitted, group_hit, evictable = group_admission(pool, request, config)
                hit, needed, hit_tokens = (), 0, admitted.num_computed_tokens
            else:
                hit, needed, cost = pool.admission(request, config)
                hit_tokens = len(hit) * config.block_size
            if held and request.num_computed_tokens + hit_tokens < request.num_tokens - 1:
                break  # a held step admits no prefill (state.carries_prefill)
            num_tokens = _chunk(request, budget, config, hit_tokens)
            keep = watermark_keep(config, num_running)
            if hybrid and num_tokens:
                num_tokens = fit_chunk(admitted, hit_tokens, num_tokens, pool.available - keep - evictable, config)
                cost = group_cost(pool, admitted, hit_tokens, hit_tokens + num_tokens, config) + evictable
            if num_tokens == 0 or cost + keep > pool.available:
                break
            scheduled.append(group_item(admitted, hit_tokens, num_tokens, pool, config, group_hit) if hybrid else
                             ScheduledRequest(request_id, request.num_computed_tokens + hit_tokens, num_tokens,
                                              pool.admit(hit, needed), hit))
            budget -= num_tokens
            num_running += 1
            if request.lora_int_id:
                loras.add(request.lora_int_id)

        return StepPlan(scheduled=tuple(scheduled), preempted=tuple(preempted), rejected=rejected, loads=tuple(loads))
    return StepPlan(scheduled=tuple(scheduled), preempted=tuple(preempted), rejected=rejected)


def _remaining_blocks(request: Request, config: SchedulerConfig) -> int:
    """Blocks a waiting request holding loaded blocks still needs for its whole current sequence (blocks)."""
    return max(blocks_for_tokens(slot_tokens(request.num_tokens, config), config.block_size) - len(request.block_ids), 0)


def _queue_order(state: SchedulerState) -> Sequence[str]:
    return state.waiting


def _shortest_prompt_order(state: SchedulerState) -> Sequence[str]:
    position = {request_id: i for i, request_id in enumerate(state.waiting)}
    return sorted(state.waiting, key=lambda r: (state.requests[r].prompt_len, position[r]))


def _priority_order(state: SchedulerState) -> Sequence[str]:
    position = {request_id: i for i, request_id in enumerate(state.waiting)}
    return sorted(state.waiting, key=lambda r: (*_urgency(state.requests[r]), position[r]))


def priority(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """Priority scheduling (vLLM ``--scheduling-policy priority``): requests in order of urgency
    (lower ``priority`` value, then earlier arrival); when blocks run out the least urgent running
    request is preempted. Beyond vLLM 0.32 (which preempts only when a running request lacks a block),
    a waiting request may preempt strictly less urgent running requests to get a ``max_num_seqs`` slot,
    blocks or budget, so an urgent request never waits behind less urgent ones: the policy keeps the
    trace property ``no-priority-inversion`` (:func:`plan_by_priority`). Starves less urgent requests by
    design: no ``bounded-wait``."""
    return plan_by_priority(state, config)


def fcfs(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """Continuous batching, first come first served, as vLLM 0.32's V1 scheduler with the documented
    differences (module docstring). Admission in waiting-queue order (arrival order, preempted requests
    first)."""
    return plan_step(state, config, _queue_order)


def static(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """Static batching (the baseline before Orca): admit a batch in queue order when nothing runs, run it
    until its longest request ends, then admit the next. A finished request's slot stays empty until the
    whole batch is done."""
    return plan_step(state, config, _queue_order, admit_only_when_idle=True)


def shortest_prompt_first(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """Continuous batching that admits the waiting request with the shortest prompt first (ties in queue
    order). A documented example policy: it lowers mean TTFT but **starves long prompts by design**
    under a steady stream of short ones, so it does not guarantee ``bounded-wait``."""
    return plan_step(state, config, _shortest_prompt_order)
