"""The scheduler's state and a step's plan.

A scheduler alternates two things, once per forward pass (Orca, OSDI'22 §3, "iteration-level
scheduling"): it **plans** a step (which requests run, how many tokens each computes, which get new
KV blocks, which are preempted or rejected), the model runs that batch, and the state is
**updated** with the plan and the sampled tokens. :mod:`schedspec.spec.rules` says which plans are
allowed from a state; :mod:`schedspec.spec.transitions` says how the state changes.

Everything here is immutable. ``requests`` and ``finished`` are read-only mappings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.kv_cache_groups import NULL_BLOCK, held_block_ids
from schedspec.spec.persistent import ArrivedRequests, TerminalRequests, terminal_requests
from schedspec.spec.prefix_cache import PrefixCache
from schedspec.spec.request import Request, RequestStatus

_EMPTY: Mapping[str, Request] = MappingProxyType({})

MAX_STATE_BLOCKS = 10_000_000
"""Most KV blocks a state is built for: it keeps one entry per block (about 100 bytes each, with the
checkers' ledgers), so 10 million blocks cost about 1 GB. Readers of configs refuse larger ones as
unusable input (far beyond any GPU's cache) instead of exhausting memory."""


def _readonly(mapping: Mapping[str, Request]) -> Mapping[str, Request]:
    return mapping if isinstance(mapping, MappingProxyType | ArrivedRequests) else MappingProxyType(dict(mapping))


@attrs.frozen(slots=True)
class DelayedFree:
    """The blocks a transfer holds after its request ended (``SchedulerState.delayed_frees``).

    Attributes:
        block_ids: the blocks (its block table when it ended).
        transfer: ``"recving"``: its remote KV load, in flight when it was aborted (freed by
            ``finished_recving``); ``"sending"``: its KV send after it finished (freed by ``finished_sending``).
    """

    block_ids: tuple[int, ...]
    transfer: str = attrs.field(validator=attrs.validators.in_(("recving", "sending")))


@attrs.frozen(slots=True)
class SchedulerState:
    """Everything a scheduler knows between two steps.

    Attributes:
        step: index of the next step to plan (steps are numbered from 0, empty steps included).
        waiting: ids of waiting requests, front of the queue first. Fresh requests join the back;
            preempted ones go to the front (vLLM ``Scheduler._preempt_request`` ``prepend_request``).
        running: ids of running requests in admission order (vLLM ``Scheduler.running``).
        requests: every live request (waiting or running) by id (a read-only mapping; after arrivals an
            :class:`~schedspec.spec.persistent.ArrivedRequests`, shared with the map before them, for speed).
        finished: every terminal request (finished, aborted or rejected) by id (a read-only mapping;
            :class:`~schedspec.spec.persistent.TerminalRequests` shares it between states, for speed). A trace
            check forgets the requests ended in earlier steps and keeps their ids and count
            (:meth:`~schedspec.spec.stepper.Stepper.forget_ended`): ``len`` and ``in`` see every one.
        free_block_ids: the free KV blocks, in the order they will be handed out. As vLLM 0.32 without
            prefix caching: allocation takes from the front (``BlockPool.get_new_blocks``) and a freed
            block table goes to the front, last block first (``BlockPool.free_blocks`` puts blocks
            without a hash at the front, "LIFO reuse"; ``SingleTypeKVCacheManager.free`` passes them
            reversed), so the blocks freed last are handed out first. Any free block may be handed
            out (rule ``blocks-from-free-pool``); the order only lets a policy pick vLLM's. With prefix
            caching the queue also holds the evictable cached blocks, and its order is vLLM's with
            caching on (:mod:`schedspec.spec.prefix_cache`).
        num_requests_added: how many requests were ever added (for ``no-request-lost``).
        prefix_cache: block hashes and reference counts (:class:`~schedspec.spec.prefix_cache.PrefixCache`)
            when ``enable_prefix_caching`` is on, else ``None``.
        in_flight: asynchronous scheduling only (vLLM ``AsyncScheduler``): the step that was in flight when
            the next plan was made, and what has landed since (:class:`InFlightStep`); ``None`` for a
            synchronous engine, whose plans are made from this very state (nothing is in flight).
        prefill_cadence: with ``prefill_schedule_interval > 1`` only, the step history the cadence needs
            (:class:`PrefillCadence`); ``None`` before the first step and whenever the cadence is off, so a
            state without it is what it was before it existed.
        delayed_frees: KV connector: request id -> the blocks a transfer still holds after its request ended
            (:class:`DelayedFree`: the blocks, and which transfer holds them)
            (vLLM ``Scheduler._free_request(delay_free_blocks=True)``: the request stays in
            ``Scheduler.requests`` until ``_update_from_kv_xfer_finished`` frees them): a request aborted while
            its remote KV load was in flight (WAITING_FOR_REMOTE_KVS), freed when the load lands
            (``finished_recving``), and a ``kv_send`` request that finished, freed when its send completes
            (``finished_sending``). Every id is a terminal request's; empty without a KV connector.
    """

    step: int = 0
    waiting: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    requests: Mapping[str, Request] = attrs.field(default=_EMPTY, converter=_readonly)
    finished: Mapping[str, Request] = attrs.field(factory=TerminalRequests, converter=terminal_requests)
    free_block_ids: tuple[int, ...] = ()
    num_requests_added: int = 0
    prefix_cache: PrefixCache | None = None
    in_flight: InFlightStep | None = None
    prefill_cadence: PrefillCadence | None = None
    delayed_frees: Mapping[str, DelayedFree] = attrs.field(default=MappingProxyType({}), converter=_readonly)

    @classmethod
    def initial(cls, config: SchedulerConfig, asynchronous: bool = False) -> SchedulerState:
        """The state before step 0: no requests, every block free in id order (and an empty prefix cache
        when ``enable_prefix_caching`` is on). With ``asynchronous`` (an engine that plans step n + 1 while
        step n is in flight), ``in_flight`` is :data:`NOTHING_IN_FLIGHT`: step 0 is planned with no step
        in flight."""
        cache = PrefixCache() if config.enable_prefix_caching else None
        return cls(free_block_ids=tuple(range(config.num_kv_blocks)), prefix_cache=cache,
                   in_flight=NOTHING_IN_FLIGHT if asynchronous else None)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def request(self, request_id: str) -> Request:
        """The request with this id, live or terminal. Raises ``KeyError`` if never added."""
        found = self.requests.get(request_id)
        if found is None:
            return self.finished[request_id]
        return found

    def running_requests(self) -> list[Request]:
        return [self.requests[request_id] for request_id in self.running]

    def waiting_requests(self) -> list[Request]:
        return [self.requests[request_id] for request_id in self.waiting]

    @property
    def has_live_requests(self) -> bool:
        return bool(self.requests)


@attrs.frozen(slots=True)
class PrefillCadence:
    """The step history vLLM 0.33's local prefill cadence reads (``prefill_schedule_interval`` N > 1).

    vLLM 0.33 ``Scheduler`` keeps three counters (``__init__``): ``num_executed_steps`` (steps that
    scheduled a token), ``last_prefill_step`` (the executed step that last carried a prefill, first
    ``-N``) and ``prefill_capacity_bound``. The hold reads only their difference, so the spec keeps that.

    Attributes:
        steps_since_prefill: executed steps since the last step that carried a prefill (vLLM
            ``num_executed_steps - last_prefill_step``; N before the first step: the first step is never held).
        capacity_bound: whether the last step that was not held and ran the waiting loop (no preemption)
            left waiting requests its scan had not passed over (vLLM ``prefill_capacity_bound``,
            ``num_waiting > len(deferred_waiting)``); while true no step is held.
        unsampled: running requests whose last chunk stopped one token short of their sequence past the
            prompt (a recompute after preemption cut by the budget): the spec's state of such a request is a
            decode's (:attr:`Request.is_decode`), vLLM's ``is_prefill_chunk`` is true (:func:`is_prefill_chunk`).
    """

    steps_since_prefill: int
    capacity_bound: bool = False
    unsampled: frozenset[str] = frozenset()


def _cadence(state: SchedulerState, config: SchedulerConfig) -> PrefillCadence:
    interval = config.prefill_schedule_interval
    return state.prefill_cadence if state.prefill_cadence is not None else PrefillCadence(interval)


def is_prefill_chunk(state: SchedulerState, request_id: str) -> bool:
    """Whether the running request ``request_id`` is a prefill chunk for the cadence (vLLM 0.33
    ``Request.is_prefill_chunk``, set by ``Scheduler._update_after_schedule``: its last chunk did not reach
    the end of its sequence): :attr:`Request.is_prefill`, or its last chunk stopped one token short of a
    sequence past its prompt (``PrefillCadence.unsampled``), a state the spec's request shares with a decode."""
    cadence = state.prefill_cadence
    return state.requests[request_id].is_prefill or (cadence is not None and request_id in cadence.unsampled)


def prefill_held(state: SchedulerState, config: SchedulerConfig) -> bool:
    """Whether the step planned from ``state`` is held by the prefill cadence: it may carry no prefill.

    True when ``prefill_schedule_interval`` N > 1, the last release step did not leave the queue backed
    up (``capacity_bound`` false), fewer than N executed steps would separate this step from the last
    one that carried a prefill (``steps_since_prefill + 1 < N``), and some running request decodes (is
    not a prefill chunk). Source: vLLM 0.33 ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule``,
    "Local prefill cadence" (``defer_prefills``); ``local_prefill_interval`` is the option without data
    parallelism. A running request decodes when it is not a prefill chunk (:func:`is_prefill_chunk`). A plan made
    with a step in flight (asynchronous scheduling, where vLLM's ``is_prefill_chunk`` counts output
    placeholders) is never held: the cadence there is not specified, and the adapters refuse it.
    """
    if config.prefill_schedule_interval <= 1 or state.in_flight is not None:
        return False  # off, or a plan made with a step in flight: the cadence there is not specified (never held)
    cadence = _cadence(state, config)
    return (not cadence.capacity_bound and cadence.steps_since_prefill + 1 < config.prefill_schedule_interval
            and any(not is_prefill_chunk(state, r) for r in state.running))


def carries_prefill(state: SchedulerState, item: ScheduledRequest) -> bool:
    """Whether ``item`` (of a plan made from ``state``) is a prefill for the cadence: a running request's
    prefill chunk (vLLM ``prefill_scheduled |= request.is_prefill_chunk``), or an admission that leaves more
    than one token to compute after its prefix-cache hit (vLLM ``prefill_admitted``, the same predicate as
    the held step's gate, ``num_computed_tokens < request.num_tokens - 1``: a full hit is no prefill)."""
    if item.request_id in state.running:
        return is_prefill_chunk(state, item.request_id)
    return item.num_computed_tokens < state.requests[item.request_id].num_tokens - 1


def cadence_after(before: SchedulerState, plan: StepPlan, waiting: tuple[str, ...],
                  config: SchedulerConfig) -> PrefillCadence | None:
    """The :class:`PrefillCadence` after a step planned from ``before`` with ``plan``, ``waiting`` the
    waiting queue after it (before new arrivals); ``None`` with the cadence off.

    vLLM 0.33 ``Scheduler.schedule``: a step that scheduled a token counts (``num_executed_steps += 1``),
    one that carried a prefill restarts the count; a step that is not held and runs the waiting loop (no
    preemption) records ``prefill_capacity_bound = num_waiting > len(deferred_waiting)``. The spec counts
    as passed over the waiting requests with structured output never admitted: vLLM enqueues them in a
    blocked status (``_enqueue_waiting_request``: ``deferred_waiting.add``) and discards them from the set
    only at admission. vLLM's set also keeps a request its scan skipped for a LoRA adapter one too many
    until it is admitted, which the spec does not count (it has no record of the scan), so with
    ``max_loras`` the spec may see the queue backed up where vLLM does not, and hold fewer steps (never
    more) than vLLM.
    """
    if config.prefill_schedule_interval <= 1:
        return None
    cadence = _cadence(before, config)
    since = cadence.steps_since_prefill
    if plan.scheduled:
        since = 0 if any(carries_prefill(before, item) for item in plan.scheduled) else since + 1
    requests = before.requests
    left = {item.request_id for item in plan.scheduled} | set(plan.preempted)
    unsampled = {r for r in cadence.unsampled if r in requests and r not in left}
    for item in plan.scheduled:  # a chunk that stops one token short of a sequence past the prompt
        request = requests.get(item.request_id)
        end = item.num_computed_tokens + item.num_sequence_tokens
        if request is not None and end == request.num_tokens - 1 and end >= request.prompt_len:
            unsampled.add(item.request_id)
    bound = cadence.capacity_bound
    if not plan.preempted and not prefill_held(before, config):
        passed_over = sum(1 for r in waiting if r in requests and requests[r].grammar_ready_step is not None
                          and requests[r].admitted_step is None)
        bound = len(waiting) > passed_over
    return PrefillCadence(since, bound, frozenset(unsampled))


@attrs.frozen(slots=True)
class InFlightStep:
    """Asynchronous scheduling: the step that was **in flight** when the next plan was made, and what has
    landed since.

    vLLM's ``AsyncScheduler`` (``vllm/v1/core/sched/async_scheduler.py``, driven by
    ``EngineCore.step_with_batch_queue``) plans step n + 1 while step n runs: ``Scheduler.schedule()`` for
    n + 1 comes before ``Scheduler.update_from_output()`` for n. It plans over **placeholders**: after
    scheduling step n, ``Scheduler._update_after_schedule`` advances ``num_computed_tokens`` by step n's
    tokens and ``AsyncScheduler._update_after_schedule`` counts, per request whose chunk reaches the end of
    its sequence, the token step n will sample as an output placeholder (``Request.num_output_placeholders
    += 1``, plus its drafts). A decode of step n + 1 thus starts where the spec's state after step n has
    computed, so the spec judges the plan of step n + 1 against its state after step n (samples applied),
    this record beside it: at most one step is in flight when a plan is made. What the planner could not
    know is here: which requests step n's samples ended, which the client aborted since, and the blocks
    they freed.

    Attributes:
        step: the index of the step that was in flight (the state's ``step - 1``; -1 before step 0:
            nothing was in flight).
        plan: that step's plan (the requests it computed for; the items of requests that had already ended
            left out: :func:`landed_plan`).
        num_output_placeholders: request id -> tokens that step was to sample for it, as the planner counted
            them (vLLM ``Request.num_output_placeholders``): ``1 + len(spec_token_ids)`` for each item that
            samples (:func:`samples_this_step`), none for a middle prefill chunk.
        ended: request id -> the request as it ended, for every request that ended after the next plan was
            made: at the in-flight step's samples (a stop, or a length it reached), or aborted since. The next
            plan may still name them: the work it plans for them is **wasted** (:func:`landed_plan`).
        freed_blocks: request id -> the blocks it released, for each of ``ended`` that held blocks. They were
            held when the next plan was made, so it hands none of them out, unless it preempts their request
            (then its preemption released them: rule ``in-flight-blocks-held-when-planned``).
    """

    step: int = -1
    plan: StepPlan = attrs.field(factory=lambda: StepPlan())
    num_output_placeholders: Mapping[str, int] = attrs.field(factory=lambda: MappingProxyType({}))
    ended: Mapping[str, Request] = attrs.field(factory=lambda: MappingProxyType({}))
    freed_blocks: Mapping[str, tuple[int, ...]] = attrs.field(factory=lambda: MappingProxyType({}))


@attrs.frozen(slots=True)
class ScheduledRequest:
    """One request's part of a step.

    Attributes:
        request_id: the request.
        num_computed_tokens: tokens already computed before this step; the chunk computes positions
            ``[num_computed_tokens, num_computed_tokens + num_tokens)`` (vLLM ``SchedulerOutput``
            ``num_computed_tokens``). Must equal the request's count: a chunk continues where the
            last one ended.
        num_tokens: tokens computed this step (vLLM ``num_scheduled_tokens``); 1 for a decode, plus the
            drafts it verifies (``1 + len(spec_token_ids)``).
        new_block_ids: KV blocks appended to the request's block table this step, taken from the free
            queue. The table after the step is ``request.block_ids + cached_block_ids + new_block_ids``.
        cached_block_ids: prefix caching only, for a waiting request admitted in this step: the cached
            blocks it reuses (a prefix-cache hit, :mod:`schedspec.spec.prefix_cache`); then
            ``num_computed_tokens`` is the hit length, ``len(cached_block_ids) * block_size``.
        spec_token_ids: speculative decoding, a decode only: the d drafts it verifies this step, the
            first d of the request's ``spec_token_ids`` (vLLM ``SchedulerOutput.scheduled_spec_decode_tokens``,
            ``request.spec_token_ids[:num_scheduled_spec_tokens]`` in ``Scheduler.schedule``); the step
            computes positions ``[num_computed_tokens, num_computed_tokens + 1 + d)``: the pending token
            and the d drafts after it. Empty otherwise.
        group_new_block_ids: hybrid KV cache groups: the blocks appended to the tables of groups 1.., one
            tuple per group in group order (group 0's are ``new_block_ids``); empty without groups.
        skipped_block_ids: hybrid KV cache groups: the blocks this item's allocation frees because the
            window of a sliding-window group has passed them (vLLM ``KVCacheManager.allocate_slots`` calls
            ``remove_skipped_blocks`` before it allocates), in the order they go to the front of the free
            queue; they become :data:`~schedspec.spec.kv_cache_groups.NULL_BLOCK` in their tables and may be
            handed out again from this item on. Empty otherwise.
        group_cached_block_ids: hybrid KV cache groups with prefix caching, a waiting request admitted with a
            hit: the tables of groups 1.. the hit starts with, one tuple per group in group order, each as long as
            ``cached_block_ids`` (vLLM ``KVCacheBlocks.blocks`` of ``get_computed_blocks``), a sliding window's
            entries below what it still needs :data:`~schedspec.spec.kv_cache_groups.NULL_BLOCK`
            (:func:`~schedspec.spec.kv_cache_groups.longest_group_hit`). Empty otherwise.
        deduplicated_block_ids: prefix caching with SGLang's publication (``SchedulerConfig.prefix_cache_publication
            == "sglang-radix"``), a prefill chunk: ``(own, cached)`` pairs, each a block of the request's own table
            that this step completes and publishes and the cached block of the same hash that replaces it there: at
            the publication (the end of the item) ``own`` is freed (to the front of the free queue, never
            published) and ``cached`` takes its place in the table, one reference more. (At a finish SGLang
            de-duplicates too, which needs no pair: the table is released at once, and the spec keeps the copies
            cached: :mod:`~schedspec.spec.prefix_cache`, *SGLang's publication*.) SGLang
            0.5.23 ``mem_cache/radix_cache.py`` ``RadixCache.cache_unfinished_req`` / ``cache_finished_req`` ->
            ``_insert_cache`` (``free_segment`` of the request's copies of tokens the tree already holds) and
            ``req_to_token_pool.write`` (the tree's pages written into the request's row). Rule
            ``deduplicate-at-publication``. Empty otherwise (vLLM never de-duplicates).
    """

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    new_block_ids: tuple[int, ...] = ()
    cached_block_ids: tuple[int, ...] = ()
    spec_token_ids: tuple[int, ...] = ()
    group_new_block_ids: tuple[tuple[int, ...], ...] = ()
    skipped_block_ids: tuple[int, ...] = ()
    group_cached_block_ids: tuple[tuple[int, ...], ...] = ()
    deduplicated_block_ids: tuple[tuple[int, int], ...] = ()

    @property
    def num_sequence_tokens(self) -> int:
        """The item's tokens that are sequence positions (prompt or sampled outputs), its drafts left out:
        ``num_tokens - len(spec_token_ids)`` (tokens; 1 for a decode that verifies drafts)."""
        return self.num_tokens - len(self.spec_token_ids)


@attrs.frozen(slots=True)
class KVLoad:
    """A remote KV load the plan starts (KV connector, vLLM ``Scheduler.schedule`` with ``load_kv_async``):
    the request gets blocks for the tokens the transfer fills and waits in WAITING_FOR_REMOTE_KVS, holding
    them, without computing a token this step.

    Attributes:
        request_id: a waiting request never admitted whose ``num_external_computed_tokens`` > 0.
        num_tokens: the tokens the transfer loads, positions ``[0, num_tokens)`` of its prompt (tokens): the
            request's ``num_external_computed_tokens`` (rule ``load-as-offered``).
        new_block_ids: the blocks that hold them, ``blocks_for_tokens(num_tokens)`` of them, from the free
            queue (vLLM ``KVCacheManager.allocate_slots`` with ``num_new_tokens=0`` and
            ``num_external_computed_tokens=num_tokens``).
    """

    request_id: str
    num_tokens: int
    new_block_ids: tuple[int, ...] = ()


@attrs.frozen(slots=True)
class KVTransferOutput:
    """The KV connector's report after a step (vLLM ``KVConnectorOutput``, handed to
    ``Scheduler.update_from_output``), applied after the step's samples
    (:func:`~schedspec.spec.transitions.land_transfers`).

    Attributes:
        finished_recving: ids whose remote KV load landed (vLLM ``finished_recving``): a WAITING_FOR_REMOTE_KVS
            request, or one aborted while it loaded (its blocks, held in ``delayed_frees``, are freed).
        invalid_block_ids: blocks a landing load failed to fill (vLLM ``invalid_block_ids``, handled by
            ``Scheduler._handle_invalid_blocks`` with the recompute policy): each is a block of a request in
            ``finished_recving`` of this report. The request keeps as computed only the tokens before its
            first invalid block, and recomputes the rest (one aborted while it loaded frees them all).
        finished_sending: ids whose KV send completed (vLLM ``finished_sending``): their blocks, held in
            ``delayed_frees``, are freed.
    """

    finished_recving: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    invalid_block_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    finished_sending: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_recving or self.invalid_block_ids or self.finished_sending)


def window_releases(state: SchedulerState, plan: StepPlan) -> tuple[frozenset[int], ...]:
    """Per item of ``plan.scheduled``, in order: the blocks its sliding-window groups free in the step
    (``skipped_block_ids``) that go back to the free pool (blocks). Without prefix caching every such block; with
    it, a block whose reference count the free brings to 0, the counts walked in the order vLLM changes them: the
    plan's preemptions first (the running loop, ``_preempt_request`` → ``free``), then item by item its window's
    frees and then its prefix hits (a block another item hit earlier in the step is still held when a window
    passes it; one a preempted request shared may be released by the window). vLLM 0.32
    ``KVCacheManager.allocate_slots`` → ``SingleTypeKVCacheManager.remove_skipped_blocks`` →
    ``BlockPool.free_blocks``, before the request's allocation and ``touch`` of its hits. The one definition of
    what a window's free releases: rules ``watermark`` and ``blocks-from-free-pool`` and the property
    ``work-conserving`` use it (found in review: they computed it three ways, two of them from the counts before
    the step)."""
    cache = state.prefix_cache
    if cache is None or not any(item.skipped_block_ids for item in plan.scheduled):
        return tuple(frozenset(item.skipped_block_ids) for item in plan.scheduled)
    counts: dict[int, int] = {}
    for request_id in plan.preempted:
        request = state.requests.get(request_id)
        if request is not None:
            for block_id in held_block_ids(request):  # every group's table
                counts[block_id] = counts.get(block_id, cache.ref_counts.get(block_id, 0)) - 1
    releases = []
    for item in plan.scheduled:
        released = set()
        for block_id in item.skipped_block_ids:
            counts[block_id] = counts.get(block_id, cache.ref_counts.get(block_id, 0)) - 1
            if counts[block_id] <= 0:
                released.add(block_id)
        for block_id in item.cached_block_ids + tuple(b for hit in item.group_cached_block_ids for b in hit):
            if block_id != NULL_BLOCK:
                counts[block_id] = counts.get(block_id, cache.ref_counts.get(block_id, 0)) + 1
        releases.append(frozenset(released))
    return tuple(releases)


def holding_first(order: Sequence[str], requests: Mapping[str, Request]) -> Sequence[str]:
    """``order`` (waiting request ids) with those that may hold blocks after a remote KV load
    (``Request.holds_loaded_kv``) first, in their order: the order vLLM 0.32 ``Scheduler.schedule`` visits the
    waiting requests (``kv_holding_waiting`` drained before ``waiting``). ``order`` itself when none does."""
    holding = [r for r in order if requests[r].holds_loaded_kv]
    if not holding:
        return order
    held = set(holding)
    return holding + [r for r in order if r not in held]


def offers_load(request: Request, config: SchedulerConfig) -> bool:
    """Whether a remote KV load may start now for this waiting request: its connector offers one it has not
    started (rule ``load-as-offered``), prefix caching is off and there is one KV cache group (remote loads with
    a local prefix hit, or into several groups' tables, are not specified: :func:`~schedspec.spec.transitions.start_load`)."""
    return (request.num_external_computed_tokens > 0 and request.kv_load_step is None
            and request.admitted_step is None and request.status is RequestStatus.WAITING
            and not config.enable_prefix_caching and not config.kv_cache_groups)


NO_TRANSFERS = KVTransferOutput()
"""The :class:`KVTransferOutput` of a step without a KV connector: nothing landed or was sent."""


@attrs.frozen(slots=True)
class StepPlan:
    """What one step does, decided before the forward pass.

    Attributes:
        scheduled: the batch, in batch order. A waiting request listed here is admitted.
        preempted: running requests preempted (recompute) this step, in the order the policy chose
            them; each releases all its blocks and is prepended to the waiting queue in this order,
            so the last one listed ends up at the front.
        rejected: ``(request_id, reason)`` for waiting requests ended without being admitted.
        loads: KV connector: the remote KV loads the step starts (:class:`KVLoad`), in the order the policy
            chose them; each takes its blocks after the batch's. Empty without a connector.
    """

    scheduled: tuple[ScheduledRequest, ...] = ()
    preempted: tuple[str, ...] = ()
    rejected: tuple[tuple[str, str], ...] = ()
    loads: tuple[KVLoad, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens in the batch: prefill chunks plus decodes."""
        return sum(item.num_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.preempted or self.rejected or self.loads)


@attrs.frozen(slots=True)
class SpeculativeOutput:
    """Speculative decoding's inputs to a step, beside the sampled tokens: what the model accepted and
    what the drafter proposed. Both are chosen by the model, as sampled tokens are; the spec only
    bounds them (:func:`~schedspec.spec.transitions.apply_plan` raises ``PlanError`` outside the bounds).

    Attributes:
        num_accepted_tokens: request id -> a, for a request whose item verified d > 0 drafts: the drafts
            the model accepted, ``0 <= a <= d``, a prefix (the first a drafts). The request's sampled
            token (``sampled_token_ids``) is the one the model sampled after them (vLLM's "bonus" token
            when a = d, else the correction of draft a + 1). vLLM ``Scheduler.update_from_output``:
            ``num_accepted = len(generated_token_ids) - 1``. A missing entry means a = 0.
        draft_token_ids: request id -> the drafts the drafter proposed after this step for its next
            decode (vLLM ``DraftTokenIds`` handed to ``Scheduler.update_draft_token_ids``), at most
            ``num_speculative_tokens`` ids. They become the request's ``spec_token_ids`` if it sampled in
            this step and still runs; for any other id they are ignored, as vLLM ignores them.
    """

    num_accepted_tokens: Mapping[str, int] = attrs.field(factory=dict)
    draft_token_ids: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)


NOTHING_IN_FLIGHT = InFlightStep()
"""The :class:`InFlightStep` of an asynchronous run before step 0: nothing was in flight."""


def landed_plan(state: SchedulerState, plan: StepPlan) -> tuple[StepPlan, tuple[ScheduledRequest, ...]]:
    """``(the plan's part that lands, its wasted items)``.

    With a step in flight (``state.in_flight``), the plan was made before the requests of
    ``state.in_flight.ended`` ended: its items for them are **wasted** (the forward pass computes their tokens
    and vLLM's ``Scheduler.update_from_output`` skips them: "The request is already finished. This can
    happen if the request is aborted while the model is executing it (e.g., ... in async scheduling)"), and
    its preemptions of them change nothing (their blocks are freed with the request). The part that lands
    is the plan without them. Without a step in flight the whole plan lands, nothing is wasted (the very
    ``plan`` object is returned)."""
    in_flight = state.in_flight
    if in_flight is None or not in_flight.ended:
        return plan, ()
    ended = in_flight.ended
    wasted = tuple(item for item, _ in wasted_items(state, plan))
    stale = [r for r in plan.preempted if r in ended and r not in state.requests]
    if not wasted and not stale:
        return plan, ()
    wasted_ids = {item.request_id for item in wasted}
    kept = tuple(item for item in plan.scheduled if item.request_id not in wasted_ids)
    return attrs.evolve(plan, scheduled=kept, preempted=tuple(r for r in plan.preempted if r not in stale)), wasted


def wasted_items(state: SchedulerState, plan: StepPlan) -> list[tuple[ScheduledRequest, Request]]:
    """The plan's items for requests that ended after it was made (``state.in_flight.ended``, not live), each
    with the request as it ended; empty without a step in flight."""
    in_flight = state.in_flight
    if in_flight is None or not in_flight.ended:
        return []
    ended = in_flight.ended
    return [(item, ended[item.request_id]) for item in plan.scheduled
            if item.request_id in ended and item.request_id not in state.requests]


NO_SPECULATION = SpeculativeOutput()
"""The :class:`SpeculativeOutput` of a step without speculative decoding: nothing accepted, nothing proposed."""


def samples_this_step(request: Request, item: ScheduledRequest) -> bool:
    """Whether the request samples a token after this step.

    It does when the chunk reaches the end of its known sequence (prompt plus output; past it by the
    drafts a decode verifies): a prefill that completes the prompt samples the first output token,
    every decode samples the next one (after its accepted drafts), a middle chunk samples nothing (vLLM
    ``Scheduler.update_from_output`` discards partial-prefill samples).
    """
    return item.num_computed_tokens + item.num_sequence_tokens == request.num_tokens
