"""Reference scheduling policies: pure functions ``plan(state, config) -> StepPlan``.

Each policy refines the spec: every plan it returns is allowed by
:func:`schedspec.spec.rules.violated_rules` (checked at every step by the engine loop and the
Hypothesis suite, and for fcfs proved by ``schedspec.reference.proofs``). Each declares in
``GUARANTEES`` the trace properties of :mod:`schedspec.spec.properties` it promises.

The shared mechanism, one step in three phases:

1. **Reject** every waiting request that was never admitted and could never complete alone
   (``rejects-impossible``).
2. **Running requests**: those with one pending token first (every decode,
   :attr:`~schedspec.spec.request.Request.is_decode`, and a prefill with one token left), then the other
   partial prefills, each group in admission order. A decode gets one token; a prefill chunk gets its pending tokens capped by ``long_prefill_token_threshold``
   and by the budget left. A request that needs a new block when none is free preempts the most
   recently admitted running request not yet scheduled in this step (recompute), possibly itself.
3. **Admission** (only in a step that preempted nothing, as vLLM): waiting requests in the policy's
   order while budget, a ``max_num_seqs`` slot and blocks allow; admission reserves blocks for the
   whole current sequence (prompt plus any output to recompute), not only the first chunk. The first
   request that does not fit stops admission (no skipping ahead).

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

Where this differs from vLLM 0.32, on purpose:
- decodes are scheduled before running prefill chunks (vLLM keeps admission order), so a long
  chunked prefill never stalls a decode (``stall-free-decode``);
- admission reserves the whole current sequence (vLLM reserves the first chunk), so a running prefill
  never needs a block later and never triggers preemption halfway through its prompt;
- a request that preempts itself does not end the step's running phase (vLLM breaks out of the
  loop), so older running requests still get their tokens (``work-conserving``, ``bounded-wait``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens
from schedspec.spec.prefix_cache import CacheUpdate
from schedspec.spec.request import Request
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan

AdmissionOrder = Callable[[SchedulerState], Sequence[str]]


class _BlockPool:
    """The free queue as this step's plan sees it: allocate from the front; blocks released by this
    step's preemptions are taken only after the blocks already free (any free block may be taken; the
    vllm-v1 profile hands released blocks out first, as vLLM does)."""

    def __init__(self, free: tuple[int, ...]) -> None:
        self.free = free  # not copied: the pool only reads it
        self.released: list[int] = []
        self.next = 0

    @property
    def available(self) -> int:
        return len(self.free) + len(self.released) - self.next

    def release(self, blocks: tuple[int, ...]) -> None:
        self.released.extend(reversed(blocks))

    def take(self, count: int) -> tuple[int, ...]:
        start, stop, size = self.next, self.next + count, len(self.free)
        self.next = stop
        if stop <= size:
            return self.free[start:stop]
        return self.free[start:size] + tuple(self.released[max(start - size, 0):stop - size])

    def admission(self, request: Request, config: SchedulerConfig) -> tuple[tuple[int, ...], int, int]:
        """``(hit blocks, new blocks for the whole current sequence, blocks it costs the free pool)``."""
        needed = blocks_for_tokens(request.num_tokens, config.block_size)
        return (), needed, needed

    def admit(self, hit: tuple[int, ...], needed: int) -> tuple[int, ...]:
        """Reference the hit blocks and take ``needed`` new ones."""
        return self.take(needed)

    def fits_after(self, released: list[tuple[int, ...]], request: Request, config: SchedulerConfig) -> bool:
        """Whether ``request`` could be admitted once these block tables are released (not done here)."""
        return self.admission(request, config)[2] <= self.available + sum(len(t) for t in released)


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

    put_back = release

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
        needed = max(blocks_for_tokens(total, config.block_size) - len(hit), 0)
        return hit, needed, needed + self.update.num_evictable(hit)

    def admit(self, hit: tuple[int, ...], needed: int) -> tuple[int, ...]:
        self.update.touch(hit)
        return self.take(needed)

    def fits_after(self, released: list[tuple[int, ...]], request: Request, config: SchedulerConfig) -> bool:
        trial = CachePool.__new__(CachePool)
        trial.update = self.update.clone()
        for table in released:
            trial.release(table)
        return trial.admission(request, config)[2] <= trial.available


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


def _urgency(request: Request) -> tuple[int, int, float]:
    """Sort key, most urgent first: lower ``priority`` value, then earlier arrival (vLLM's priority
    queue orders by ``(priority, arrival_time)``)."""
    return (request.priority, request.arrival_step, request.arrival_time)


def _make_room_by_priority(
    state: SchedulerState, config: SchedulerConfig, order: Sequence[str], skip: set[str], pool: _BlockPool | CachePool
) -> tuple[str | None, int, list[str]]:
    """Priority admission gate: if the most urgent waiting request cannot be admitted for want of a
    ``max_num_seqs`` slot or blocks, preempt the least urgent running requests that are strictly less
    urgent than it, if (and only if) that makes room **and** the request then gets a chunk of this step's
    budget next to the running decodes (else the preemption would be wasted: the victim loses its KV
    cache and the urgent request still waits; shared case ``priority-preemption-must-admit``).

    Returns:
        ``(request to admit first, its chunk in tokens, requests to preempt)``; ``(None, 0, [])`` when
        no preemption is needed or none would admit it.
    """
    head = next((r for r in order if r not in skip), None)
    if head is None:
        return None, 0, []
    candidate = state.requests[head]
    slots_free = config.max_num_seqs - len(state.running)
    if slots_free > 0 and pool.fits_after([], candidate, config):
        return None, 0, []
    less_urgent = sorted(
        (r for r in state.running if _urgency(state.requests[r]) > _urgency(candidate)),
        key=lambda r: _urgency(state.requests[r]), reverse=True,
    )
    victims: list[str] = []
    freed: list[tuple[int, ...]] = []
    for request_id in less_urgent:
        if slots_free + len(victims) > 0 and pool.fits_after(freed, candidate, config):
            break
        victims.append(request_id)
        freed.append(state.requests[request_id].block_ids)
    if not (slots_free + len(victims) > 0 and pool.fits_after(freed, candidate, config)):
        return None, 0, []
    gone = set(victims)
    decodes = sum(1 for r in state.running if r not in gone and state.requests[r].num_pending_tokens == 1)
    hit_tokens = 0
    if isinstance(pool, CachePool):
        trial = CachePool.__new__(CachePool)
        trial.update = pool.update.clone()
        for table in freed:
            trial.release(table)
        hit_tokens = len(trial.admission(candidate, config)[0]) * config.block_size
    chunk = _chunk(candidate, max(config.max_num_batched_tokens - decodes, 0), config, hit_tokens)
    if chunk == 0:
        return None, 0, []
    return head, chunk, victims


def plan_step(
    state: SchedulerState,
    config: SchedulerConfig,
    admission_order: AdmissionOrder,
    admit_only_when_idle: bool = False,
    by_priority: bool = False,
) -> StepPlan:
    """The shared three-phase step (module docstring) with a policy's admission order.

    Args:
        state: the state before the step.
        config: the limits.
        admission_order: waiting request ids in the order the policy admits them.
        admit_only_when_idle: admit only when nothing is running (static batching).
        by_priority: the priority policy: preemption victims are the least urgent running requests
            (not the most recently admitted), and before the running phase the most urgent waiting
            request may preempt less urgent running ones to get a slot and blocks
            (:func:`_make_room_by_priority`); it is then admitted first, before running prefills can
            take the budget, and further admission still happens in that step.

    Returns:
        A plan allowed by the spec from ``state``.
    """
    rejected = reject_impossible(state, config)
    requests = state.requests
    budget = config.max_num_batched_tokens
    pool = _BlockPool(state.free_block_ids) if state.prefix_cache is None else CachePool(state)
    scheduled: list[ScheduledRequest] = []
    preempted: list[str] = []
    gone: set[str] = set()  # preempted or scheduled this step: no longer a preemption candidate
    skip = {request_id for request_id, _ in rejected}
    if by_priority:
        # candidates, least urgent last
        victims = sorted(state.running, key=lambda r: _urgency(requests[r]))
        urgent, chunk, made_room = _make_room_by_priority(state, config, admission_order(state), skip, pool)
        for victim in made_room:
            gone.add(victim)
            preempted.append(victim)
            pool.release(requests[victim].block_ids)
    else:
        victims = list(state.running)  # candidates, most recently admitted last
        urgent, chunk = None, 0
    preempted_for_admission = len(preempted)
    admitted = 0
    if urgent is not None:
        # The request the preemptions made room for is admitted first, with blocks for its whole
        # sequence and a chunk that leaves one token per running decode.
        request = requests[urgent]
        hit, needed, _ = pool.admission(request, config)
        scheduled.append(ScheduledRequest(urgent, request.num_computed_tokens + len(hit) * config.block_size, chunk,
                                          pool.admit(hit, needed), hit))
        budget -= chunk
        skip.add(urgent)
        admitted = 1

    decodes, prefills = [], []
    for request_id in state.running:
        request = requests[request_id]
        pending = request.prompt_len + len(request.output_token_ids) - request.num_computed_tokens
        (decodes if pending == 1 else prefills).append(request_id)
    for request_id in decodes + prefills:
        if request_id in gone:
            continue
        if budget == 0:
            break
        request = requests[request_id]
        num_tokens = _chunk(request, budget, config)
        if num_tokens == 0:
            continue
        needed = blocks_for_tokens(request.num_computed_tokens + num_tokens, config.block_size) - len(request.block_ids)
        while needed > pool.available:
            while victims and victims[-1] in gone:
                victims.pop()
            victim = victims.pop()
            gone.add(victim)
            preempted.append(victim)
            pool.release(requests[victim].block_ids)
            if victim == request_id:
                break
        if request_id in gone:
            continue
        gone.add(request_id)
        scheduled.append(
            ScheduledRequest(request_id, request.num_computed_tokens, num_tokens, pool.take(max(needed, 0)))
        )
        budget -= num_tokens

    if len(preempted) == preempted_for_admission and not (admit_only_when_idle and state.running):
        num_running = len(state.running) - len(preempted) + admitted
        for request_id in admission_order(state):
            if request_id in skip:
                continue
            if num_running >= config.max_num_seqs or budget == 0:
                break
            request = requests[request_id]
            hit, needed, cost = pool.admission(request, config)
            hit_tokens = len(hit) * config.block_size
            num_tokens = _chunk(request, budget, config, hit_tokens)
            if num_tokens == 0 or cost > pool.available:
                break
            scheduled.append(ScheduledRequest(request_id, request.num_computed_tokens + hit_tokens, num_tokens,
                                              pool.admit(hit, needed), hit))
            budget -= num_tokens
            num_running += 1

    return StepPlan(scheduled=tuple(scheduled), preempted=tuple(preempted), rejected=rejected)


def _queue_order(state: SchedulerState) -> Sequence[str]:
    return state.waiting


def _shortest_prompt_order(state: SchedulerState) -> Sequence[str]:
    position = {request_id: i for i, request_id in enumerate(state.waiting)}
    return sorted(state.waiting, key=lambda r: (state.requests[r].prompt_len, position[r]))


def _priority_order(state: SchedulerState) -> Sequence[str]:
    position = {request_id: i for i, request_id in enumerate(state.waiting)}
    return sorted(state.waiting, key=lambda r: (*_urgency(state.requests[r]), position[r]))


def priority(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """Priority scheduling (vLLM ``--scheduling-policy priority``): admission in order of urgency
    (lower ``priority`` value, then earlier arrival); when blocks run out the least urgent running
    request is preempted. Beyond vLLM 0.32 (which preempts only when a running request lacks a block),
    a waiting request may preempt strictly less urgent running requests to get a ``max_num_seqs`` slot
    and blocks, so an urgent request never waits behind less urgent ones
    (scenario ``priority-preempts-at-seq-cap``). Starves less urgent requests by design: no
    ``bounded-wait``."""
    return plan_step(state, config, _priority_order, by_priority=True)


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
