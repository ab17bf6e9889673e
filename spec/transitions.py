"""How the state changes: the spec's actions.

As a TLA+ specification names them, an action is a guard (when it may happen) and an update (what
it changes). The client's actions happen between steps: a request **arrives**
(:func:`add_request`) or is **aborted** (:func:`abort_request`). A step is the composition
:func:`apply_plan` of the scheduler's actions, in this order:

- :func:`preempt`: a running request gives back all its blocks and returns to the front of the
  waiting queue. Guard: ``preempt-running-only``.
- :func:`reject`: a waiting request that can never complete ends ``REJECTED`` with its reason.
  Guard: ``reject-only-impossible``.
- :func:`schedule`: a request computes a chunk of its prompt (a prefill) or its last sampled token
  (a decode) with the drafts it verifies (speculative decoding), taking new blocks; a waiting one is
  admitted. Guard: ``positive-tokens``, ``chunk-continues``, ``no-overcompute``,
  ``whole-prefill-without-chunking``, ``long-prefill-threshold``, ``admit-fits-alone``,
  ``blocks-from-free-pool``, ``block-table-covers``, ``no-excess-blocks``, ``prefix-hit-at-admission``,
  ``prefix-hit-is-cached-chain``, ``prefix-hit-longest``, ``deduplicate-at-publication``, ``drafts-only-in-decodes``,
  ``drafts-are-proposed``, ``drafts-within-max-model-len``; the per-step limits, which constrain
  nothing while their options are off: ``active-sequence-cap``, ``lora-limit``,
  ``grammar-ready-before-admission``, ``watermark``, ``prefill-cadence``; with hybrid KV cache groups
  (:mod:`~schedspec.spec.kv_cache_groups`; a sliding window's blocks are freed at the item, before its new
  blocks are taken) ``group-table-covers``, ``group-no-excess-blocks``, ``window-keeps-visible``,
  ``window-frees-skipped``; and with a step in flight (asynchronous
  scheduling) also ``in-flight-foreseen-length``, ``in-flight-blocks-held-when-planned``,
  ``in-flight-arrivals-wait`` and ``wasted-item-continues``; and, with a KV connector, ``wait-for-remote-kv``.
- :func:`start_load`: (KV connector) a waiting request takes blocks for the prefix a remote KV transfer
  fills and waits in WAITING_FOR_REMOTE_KVS until it lands (:func:`land_transfers`, after the samples).
  Guard: ``load-as-offered``, ``load-blocks-exact``.
- :func:`sample`: a request whose chunk reached the end of its sequence appends its accepted drafts and
  the sampled token, stopping at the first that stops it (:func:`stop_reason`), and gives back its
  rejected drafts. Guard: none (the model chooses the tokens and what it accepts).
- :func:`propose_drafts` (speculative decoding): the drafter's drafts for a request that sampled and
  still runs become its ``spec_token_ids``. Guard: none (the drafter chooses them).

The rules about the plan as a whole guard the step itself: ``known-requests``, ``token-budget``,
``sequence-cap``. Every rule's check is in :mod:`~schedspec.spec.rules` (``Rule.action`` names its
action); :func:`apply_plan` assumes the plan is allowed and raises :class:`PlanError` only for plans it
cannot apply at all.

**A step in flight** (asynchronous scheduling, vLLM ``AsyncScheduler``: step n + 1 is planned while step n
runs): the state after step n carries ``in_flight`` (:class:`~schedspec.spec.state.InFlightStep`), step n as
it was when step n + 1 was planned, with what landed since: the requests step n's samples ended and those
the client aborted after (:func:`abort_request`), and the blocks they freed. The plan of step n + 1 may
still compute for those requests: :func:`apply_plan` skips those items (their tokens are **wasted**:
``StepResult.num_wasted_tokens``) and records step n + 1 as in flight in the state after it
(:func:`in_flight_after`). Without a step in flight (``in_flight is None``) every action is as above.

**The prefill cadence** (``prefill_schedule_interval`` > 1, vLLM 0.33): :func:`apply_plan` also records the
step history the cadence reads in the state after (``prefill_cadence``,
:func:`~schedspec.spec.state.cadence_after`); with the option off the state has none.

Each action of a step updates a :class:`StepInProgress`, a working copy of the state that the step
turns into the next :class:`SchedulerState`. Nothing else is mutated.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from types import MappingProxyType

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.kv_cache_groups import (
    NULL_BLOCK,
    free_skipped,
    group_publishes,
    held_block_ids,
    release_order,
    release_tables,
)
from schedspec.spec.persistent import FreeQueue, live_copy, with_arrival
from schedspec.spec.persistent import evolve_request as evolve
from schedspec.spec.prefix_cache import CacheUpdate, publishes_at_step
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import (
    NO_SPECULATION,
    NO_TRANSFERS,
    DelayedFree,
    InFlightStep,
    KVLoad,
    KVTransferOutput,
    ScheduledRequest,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
    cadence_after,
    landed_plan,
    samples_this_step,
)
from schedspec.spec.stop_rule import stop_reason_of


class PlanError(ValueError):
    """A plan or an action that cannot be applied to this state (names the request and the problem)."""


# --- The client's actions, between steps ------------------------------------------------------------


def add_request(state: SchedulerState, request: Request) -> SchedulerState:
    """A request **arrives**: it joins the back of the waiting queue.

    Raises:
        PlanError: the id was already added, the request is not fresh (status WAITING, nothing
            computed, no output, no blocks), its ``max_tokens`` is negative (vLLM's
            ``SamplingParams`` refuses it; ``max_tokens == 0`` is a rejection at the next step), or its
            ``arrival_step`` is not this state's ``step`` (it is added before that step is planned: the
            order of arrivals, which ``bounded-wait`` and the proofs' encoding rely on, is the order of
            addition).
    """
    request_id = request.request_id
    if request_id in state.requests or request_id in state.finished:
        raise PlanError(f"request_id={request_id!r} was already added")
    if request.max_tokens < 0:
        raise PlanError(f"request_id={request_id!r}: max_tokens={request.max_tokens} < 0")
    if request.arrival_step != state.step:
        raise PlanError(f"request_id={request_id!r}: arrival_step={request.arrival_step}, but it is added before "
                        f"step {state.step}")
    if (
        request.status is not RequestStatus.WAITING
        or request.num_computed_tokens
        or request.output_token_ids
        or request.block_ids
        or request.kv_load_step is not None
    ):
        raise PlanError(f"request_id={request_id!r} is not a fresh request (status={request.status.value})")
    return attrs.evolve(
        state,
        waiting=state.waiting + (request_id,),
        requests=with_arrival(state.requests, request),  # {**state.requests, request_id: request}
        num_requests_added=state.num_requests_added + 1,
    )


def abort_request(state: SchedulerState, request_id: str) -> SchedulerState:
    """The client **aborts** a request: it ends ``FINISHED_ABORTED`` and releases all its blocks at once
    (to the front of the free queue, last block first: see ``SchedulerState.free_block_ids``; with prefix
    caching its cached blocks stay cached and go to the back: :meth:`CacheUpdate.release`).

    Aborting a request that already ended, or an id never added, changes nothing (vLLM
    ``Scheduler.finish_requests`` skips ids it does not know).

    With a step in flight (``state.in_flight``, asynchronous scheduling) the abort lands after the next plan
    was made: the request joins ``in_flight.ended`` and its blocks ``in_flight.freed_blocks``, so that
    plan's work for it is wasted and it hands none of those blocks out (vLLM ``Scheduler.finish_requests``
    frees them at once; ``update_from_output`` then skips the request).

    KV connector: a request aborted while its remote KV load is in flight (WAITING_FOR_REMOTE_KVS) frees
    nothing yet: the transfer still writes its blocks, which move to ``delayed_frees`` until the load lands
    (vLLM ``Scheduler.finish_requests``: ``delay_free_blocks`` when the id is not in
    ``finished_recving_kv_req_ids``; ``_update_from_kv_xfer_finished`` frees them).
    """
    request = state.requests.get(request_id)
    if request is None:
        return state
    requests = live_copy(state.requests)
    del requests[request_id]
    aborted = evolve(request, status=RequestStatus.FINISHED_ABORTED, finish_reason="abort", block_ids=(),
                     spec_token_ids=(), group_block_ids=())
    cache = state.prefix_cache
    delayed = state.delayed_frees
    if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
        delayed = MappingProxyType({**delayed, request_id: DelayedFree(request.block_ids, "recving")})
        return attrs.evolve(state, waiting=tuple(r for r in state.waiting if r != request_id), requests=requests,
                            finished=state.finished.with_added({request_id: aborted}), delayed_frees=delayed)
    if cache is None:
        free = FreeQueue.of(state.free_block_ids).pushed_front(release_order(request))
    else:
        update = CacheUpdate(cache, state.free_block_ids)
        release_tables(update, request)
        cache, free = update.freeze()
    in_flight = state.in_flight
    if in_flight is not None:
        held = held_block_ids(request)
        freed = {**in_flight.freed_blocks, request_id: held} if held else in_flight.freed_blocks
        in_flight = attrs.evolve(in_flight, ended=MappingProxyType({**in_flight.ended, request_id: aborted}),
                                 freed_blocks=MappingProxyType(freed))
    return attrs.evolve(
        state,
        waiting=tuple(r for r in state.waiting if r != request_id),
        running=tuple(r for r in state.running if r != request_id),
        requests=requests,
        finished=state.finished.with_added({request_id: aborted}),
        free_block_ids=free,
        prefix_cache=cache,
        in_flight=in_flight,
    )


# --- A step: the scheduler's actions ----------------------------------------------------------------


@attrs.define
class StepInProgress:
    """The state while a step's actions apply: working copies of :class:`SchedulerState`'s fields.

    Changes to the free queue are collected and applied once, in :meth:`end` (one pass over the
    queue per step, however many requests move): blocks released by preemptions go to its front,
    then the blocks handed out are taken from it, then the blocks of requests that ended go to its
    front. That is the order of vLLM 0.32, which frees a victim's blocks inside ``Scheduler.schedule``
    and a finished request's in ``Scheduler.update_from_output``. With prefix caching every change to
    the blocks goes through ``cache`` (:class:`~schedspec.spec.prefix_cache.CacheUpdate`: reference
    counts, hashes and the free queue with evictable blocks), in the same order.
    """

    before: SchedulerState
    config: SchedulerConfig
    requests: dict[str, Request]
    waiting: list[str]
    running: list[str]
    ended: dict[str, Request] = attrs.field(factory=dict)
    """Requests that became terminal in this step (rejected or stopped)."""
    released: list[int] = attrs.field(factory=list)
    """Blocks released by preemptions, in the order they go to the front of the free queue."""
    taken: list[int] = attrs.field(factory=list)
    """Blocks handed out by :func:`schedule`, in batch order."""
    freed: list[int] = attrs.field(factory=list)
    """Blocks released by requests that stopped, in the order they go to the front of the free queue."""
    skipped: list[int] = attrs.field(factory=list)
    """Hybrid KV cache groups: blocks the items' sliding windows freed, in the order they go to the front of the
    free queue (a later item's in front), before the blocks handed out are taken."""
    sampled: list[str] = attrs.field(factory=list)
    stopped: list[str] = attrs.field(factory=list)
    cache: CacheUpdate | None = None
    """With prefix caching: the working copy of the prefix cache and the free queue."""
    delayed: dict[str, DelayedFree] | None = None
    """KV connector: the working copy of ``delayed_frees`` (``None``: unchanged in this step)."""

    @classmethod
    def begin(cls, state: SchedulerState, config: SchedulerConfig) -> StepInProgress:
        cache = CacheUpdate(state.prefix_cache, state.free_block_ids) if state.prefix_cache is not None else None
        return cls(state, config, live_copy(state.requests), list(state.waiting), list(state.running), cache=cache)

    def delay_free(self, request_id: str, held: DelayedFree) -> None:
        """Hold the blocks of the ended ``request_id`` for a transfer (``SchedulerState.delayed_frees``)."""
        if self.delayed is None:
            self.delayed = dict(self.before.delayed_frees)
        self.delayed[request_id] = held

    def free_delayed(self, request_id: str, transfer: str) -> None:
        """Its ``transfer`` (``"recving"`` or ``"sending"``) done, the blocks held for the ended ``request_id`` go
        to the front of the free queue, last block first.

        Raises:
            PlanError: no blocks are held for that transfer of ``request_id``.
        """
        delayed = self.before.delayed_frees if self.delayed is None else self.delayed
        held = delayed.get(request_id)
        if held is None or held.transfer != transfer:
            raise PlanError(f"request_id={request_id!r}: finished_{transfer} at step {self.before.step}, but it has "
                            f"no {'remote KV load' if transfer == 'recving' else 'KV send'} in flight")
        if self.delayed is None:
            self.delayed = dict(self.before.delayed_frees)
        del self.delayed[request_id]
        self.freed[:0] = reversed(held.block_ids)

    def live(self, request_id: str) -> Request:
        """The live request with this id. Raises :class:`PlanError` if there is none."""
        try:
            return self.requests[request_id]
        except KeyError:
            raise PlanError(f"request_id={request_id!r} is not a live request at step {self.before.step}") from None

    def end(self) -> StepResult:
        """The state after the step: the step counter advances by one."""
        cache = None
        if self.cache is not None:
            cache, free = self.cache.freeze()
        else:  # a FreeQueue: the tuple of free blocks, sharing structure with the one before
            free = FreeQueue.of(self.before.free_block_ids).pushed_front(self.released)
            if self.skipped:  # a window's frees may be handed out again by its item or a later one
                free = free.pushed_front(self.skipped)
            free = free.without(self.taken).pushed_front(self.freed)
        state = SchedulerState(
            step=self.before.step + 1,
            waiting=tuple(self.waiting),
            running=tuple(self.running),
            requests=MappingProxyType(self.requests),
            finished=self.before.finished.with_added(self.ended),
            free_block_ids=free,  # a FreeQueue, or the tuple CacheUpdate.freeze returns
            num_requests_added=self.before.num_requests_added,
            prefix_cache=cache,
            delayed_frees=self.before.delayed_frees if self.delayed is None else MappingProxyType(self.delayed),
        )
        return StepResult(state, tuple(self.stopped), tuple(self.sampled))


@attrs.frozen
class StepResult:
    """The state after a step and what ended in it."""

    state: SchedulerState
    finished: tuple[str, ...]
    """Requests that finished in this step (stop or length), in batch order."""
    sampled: tuple[str, ...]
    """Requests that sampled a token in this step, in batch order."""
    wasted: tuple[ScheduledRequest, ...] = ()
    """Asynchronous scheduling: the plan's items for requests that had ended while the step before was in
    flight (:func:`~schedspec.spec.state.landed_plan`). Their tokens are computed and thrown away."""

    @property
    def num_wasted_tokens(self) -> int:
        """**Wasted tokens**: tokens the step computed for requests that had already ended (the drafts they
        verify included), the work asynchronous scheduling throws away; 0 for a synchronous engine."""
        return sum(item.num_tokens for item in self.wasted)


def preempt(step: StepInProgress, request_id: str) -> None:
    """**Preempt** a running request (recompute): it releases every block (to the front of the free
    queue, last block first; a request preempted later in the same step goes in front of one preempted
    earlier, as vLLM ``KVCacheManager.free`` and ``BlockPool.free_blocks`` without prefix caching), forgets
    its computed tokens (``num_computed_tokens = 0``; its outputs are kept and recomputed as a prefill)
    and its drafts (``spec_token_ids``), and goes to the front of the waiting queue (vLLM
    ``Scheduler._preempt_request``)."""
    request = step.live(request_id)
    if step.cache is not None:
        release_tables(step.cache, request)
    else:
        step.released[:0] = release_order(request)
    changes: dict = {"status": RequestStatus.PREEMPTED, "num_computed_tokens": 0, "block_ids": (),
                     "num_preemptions": request.num_preemptions + 1}
    if request.group_block_ids:
        changes["group_block_ids"] = ()
    if request.spec_token_ids:  # vLLM Scheduler._preempt_request: request.spec_token_ids = []
        changes["spec_token_ids"] = ()
    step.requests[request_id] = evolve(request, **changes)
    step.running.remove(request_id)
    step.waiting.insert(0, request_id)


def reject(step: StepInProgress, request_id: str, reason: str) -> None:
    """**Reject** a waiting request: it leaves the queue and ends ``REJECTED`` with ``reason``
    (``"CODE: detail"``, see :mod:`~schedspec.spec.admission`). It holds no blocks."""
    request = step.live(request_id)
    del step.requests[request_id]
    step.waiting.remove(request_id)
    step.ended[request_id] = evolve(request, status=RequestStatus.REJECTED, finish_reason=reason)


def schedule(step: StepInProgress, item: ScheduledRequest) -> None:
    """**Schedule** one request's part of the batch: it computes ``item.num_tokens`` more tokens (a
    prefill chunk, or the one token of a decode) and appends ``item.new_block_ids`` to its block table.
    A waiting request is admitted: it leaves the waiting queue and joins the back of ``running``
    (vLLM ``Scheduler.schedule``, ``self.running.append(request)``).

    With prefix caching, an admitted request's ``item.cached_block_ids`` (a hit) are referenced and start
    its block table, and count as computed tokens (with KV cache groups, every group's hit table too,
    ``item.group_cached_block_ids``, its null entries skipped; a window's frees go back first, a block another
    table shares staying held); a new block that carries a hash is evicted (its hash
    dropped); and the blocks the request has fully computed after the step are published (each group's under
    its own key, :func:`~schedspec.spec.prefix_cache.group_cache_key`)
    (:meth:`~schedspec.spec.prefix_cache.CacheUpdate.publish`: the same cache as publishing at the end
    of the step, since a hit may only name blocks published before it).

    Speculative decoding: a decode's item also computes its d drafts (``item.num_tokens = 1 + d``), so
    ``num_computed_tokens`` counts them until :func:`sample` takes the rejected ones back; only the
    positions of the request's sequence (``< num_tokens``, no draft) are published (vLLM
    ``KVCacheManager.allocate_slots`` caches ``min(num_computed + num_new_tokens, request.num_tokens)``
    tokens: "only finalized tokens are cached"). Scheduling consumes the request's drafts
    (``spec_token_ids = ()``, vLLM ``Scheduler.schedule``), those not scheduled included."""
    request = step.live(item.request_id)
    table = request.block_ids + item.cached_block_ids + item.new_block_ids
    computed = request.num_computed_tokens + len(item.cached_block_ids) * step.config.block_size + item.num_tokens
    changes: dict = {"num_computed_tokens": computed}
    if table != request.block_ids:
        changes["block_ids"] = table
    if request.spec_token_ids:
        changes["spec_token_ids"] = ()
    # every group's table, whether or not the item names blocks for it (a record leaves out a request with none:
    # its tables still get the step's full blocks published)
    groups = bool(step.config.kv_cache_groups)
    if groups or item.group_new_block_ids or item.group_cached_block_ids:  # PlanError: blocks for groups not configured
        changes["group_block_ids"] = group_tables_after(request, item, step.config)
    if step.cache is not None:  # vLLM KVCacheManager.allocate_slots: window frees, hits touched, new blocks taken
        size = step.config.block_size
        if item.skipped_block_ids:
            free_skipped(step.cache, request, item.skipped_block_ids)
        step.cache.touch(item.cached_block_ids)
        for hit in item.group_cached_block_ids:
            step.cache.touch(hit)
        step.cache.take(item.new_block_ids)
        for new in item.group_new_block_ids:
            step.cache.take(new)
        cacheable = min(computed, request.num_tokens)
        pending = dict(item.deduplicated_block_ids)
        if publishes_at_step(request, step.config):
            try:
                published = step.cache.publish(request, table, cacheable, size, replaced=pending)
            except ValueError as error:  # a de-duplication onto other tokens (rule deduplicate-at-publication)
                raise PlanError(f"request_id={item.request_id!r} at step {step.before.step}: {error}") from None
            if published != table:  # SGLang's de-duplication: cached blocks in place of the request's own
                changes["block_ids"] = table = published
        if pending:  # rule deduplicate-at-publication: only blocks this item publishes
            raise PlanError(f"request_id={item.request_id!r}: blocks {sorted(pending)} de-duplicated at step "
                            f"{step.before.step}, but not published in it")
        if groups:  # every group's blocks under its own keys (KVCacheCoordinator.cache_blocks, per manager)
            for index, group_table in enumerate(changes["group_block_ids"], start=1):
                if group_publishes(step.config.kv_cache_groups[index], size):
                    step.cache.publish(request, group_table, cacheable, size, group=index)
    else:
        if groups:
            step.skipped[:0] = item.skipped_block_ids
            step.taken.extend(b for blocks in item.group_new_block_ids for b in blocks)
        step.taken.extend(item.new_block_ids)
    if request.status is not RequestStatus.RUNNING:
        changes.update(status=RequestStatus.RUNNING, admitted_step=step.before.step)
        step.waiting.remove(item.request_id)
        step.running.append(item.request_id)
    step.requests[item.request_id] = evolve(request, **changes)


def group_tables_after(request: Request, item: ScheduledRequest, config: SchedulerConfig) -> tuple[tuple[int, ...], ...]:
    """Hybrid KV cache groups: the request's tables of groups 1.. after ``item`` is scheduled: the blocks its
    window freed (``item.skipped_block_ids``) become :data:`~schedspec.spec.kv_cache_groups.NULL_BLOCK` (the
    table keeps its length, vLLM ``_remove_blocks_in_range``), then each group's prefix-cache hit
    (``item.group_cached_block_ids``, ``add_local_computed_blocks``) and new blocks are appended
    (vLLM ``SingleTypeKVCacheManager.allocate_new_blocks``).

    Raises:
        PlanError: the item names new or hit blocks for more groups than ``config.kv_cache_groups`` has.
    """
    extra = max(len(config.kv_cache_groups) - 1, 0)
    if max(len(item.group_new_block_ids), len(item.group_cached_block_ids)) > extra:
        raise PlanError(f"request_id={item.request_id!r}: blocks for "
                        f"{max(len(item.group_new_block_ids), len(item.group_cached_block_ids))} groups past "
                        f"group 0, but the config has {extra}")
    skipped = frozenset(item.skipped_block_ids)
    tables = []
    for index in range(extra):
        table = request.group_block_ids[index] if index < len(request.group_block_ids) else ()
        if skipped:
            table = tuple(NULL_BLOCK if b in skipped else b for b in table)
        hit = item.group_cached_block_ids[index] if index < len(item.group_cached_block_ids) else ()
        new = item.group_new_block_ids[index] if index < len(item.group_new_block_ids) else ()
        tables.append(table + hit + new)
    return tuple(tables)


def sample(step: StepInProgress, request_id: str, token_id: int, item: ScheduledRequest | None = None,
           num_accepted: int = 0) -> None:
    """**Sample**: the request appends its accepted drafts, the first ``num_accepted`` of
    ``item.spec_token_ids`` (speculative decoding; none without), then ``token_id``, one token at a time;
    after each, :func:`stop_reason` says whether it stops, and a stop drops the tokens after it (vLLM
    ``Scheduler._update_request_with_output``: ``check_stop`` per token, ``del new_token_ids[num_new:]``).
    Its first output token records ``first_token_step``. The d - a rejected drafts are taken back from
    ``num_computed_tokens`` (vLLM ``Scheduler.update_from_output``: ``request.num_computed_tokens -=
    num_rejected``), so a request that goes on is a decode again, its one pending token the one sampled;
    one that stopped at an accepted draft keeps that draft computed (``num_computed_tokens`` at most
    ``num_tokens``). The blocks past the computed tokens stay in its block table (vLLM frees no block on
    a rejection: they are reused by the next tokens). A request that stops releases its blocks to the front
    of the free queue (a request that stops later in the batch goes in front of one that stopped
    earlier, as vLLM ``Scheduler.update_from_output`` frees them in batch order)."""
    request = step.live(request_id)
    outputs = request.output_token_ids
    changes: dict = {}
    if request.first_token_step is None:
        changes["first_token_step"] = step.before.step
    if item is not None and item.spec_token_ids:
        rejected = len(item.spec_token_ids) - num_accepted
        for token in item.spec_token_ids[:num_accepted] + (token_id,):
            outputs += (token,)
            ending = stop_reason(evolve(request, output_token_ids=outputs), step.config)
            if ending is not None:
                break
        computed = min(request.num_computed_tokens - rejected, request.prompt_len + len(outputs))
        changes["num_computed_tokens"] = computed
        changes["output_token_ids"] = outputs
        request = evolve(request, **changes)
    else:
        changes["output_token_ids"] = outputs + (token_id,)
        request = evolve(request, **changes)
        ending = stop_reason(request, step.config)
    step.sampled.append(request_id)
    if ending is None:
        step.requests[request_id] = request
        return
    status, reason = ending
    del step.requests[request_id]
    step.running.remove(request_id)
    if request.kv_send:  # KV connector: its blocks are sent; freed when the send completes (land_transfers)
        if step.cache is not None or step.before.in_flight is not None or step.config.kv_cache_groups:
            raise PlanError(f"request_id={request_id!r}: KV sends with enable_prefix_caching, a step in flight or "
                            "kv_cache_groups are not specified")
        step.delay_free(request_id, DelayedFree(request.block_ids, "sending"))
    elif step.cache is not None:
        if step.config.prefix_cache_publication == "sglang-radix":  # decoded blocks are published at the finish
            # (cache_finished_req); SGLang frees its copies of tokens its tree holds, the spec keeps them cached:
            # module docstring of prefix_cache, SGLang's publication
            step.cache.publish(request, request.block_ids, min(request.num_computed_tokens, request.num_tokens),
                               step.config.block_size)
        release_tables(step.cache, request)
    else:
        step.freed[:0] = release_order(request)
    step.ended[request_id] = evolve(request, status=status, finish_reason=reason, block_ids=(), group_block_ids=())
    step.stopped.append(request_id)


def start_load(step: StepInProgress, load: KVLoad) -> None:
    """**Start a remote KV load** (KV connector): the waiting request takes ``load.new_block_ids`` from the
    free queue (after the batch's blocks), counts the ``load.num_tokens`` tokens the transfer will write as
    computed, records ``kv_load_step`` and waits, in its place in the queue, in WAITING_FOR_REMOTE_KVS until
    the transfer lands (:func:`land_transfers`). vLLM ``Scheduler.schedule``: with ``load_kv_async``,
    ``allocate_slots(num_new_tokens=0, num_external_computed_tokens=...)``, ``request.status =
    WAITING_FOR_REMOTE_KVS``, ``request.num_computed_tokens = num_computed_tokens`` ("will not be used
    anywhere until the request finished the KV transfer"); the request is skipped into
    ``kv_holding_waiting``. It computes nothing and takes no ``max_num_seqs`` slot.

    Raises:
        PlanError: prefix caching is on, a step is in flight, or KV cache groups are configured (remote loads
            with a local prefix hit, with asynchronous scheduling, and into several groups' tables are not
            specified).
    """
    if step.cache is not None or step.before.in_flight is not None or step.config.kv_cache_groups:
        raise PlanError(f"request_id={load.request_id!r}: remote KV loads with enable_prefix_caching, a step in "
                        "flight or kv_cache_groups are not specified")
    request = step.live(load.request_id)
    step.taken.extend(load.new_block_ids)
    step.requests[load.request_id] = evolve(request, status=RequestStatus.WAITING_FOR_REMOTE_KVS,
                                            num_computed_tokens=load.num_tokens, block_ids=load.new_block_ids,
                                            kv_load_step=step.before.step)


def land_transfers(step: StepInProgress, transfers: KVTransferOutput) -> None:
    """The KV connector's report after the step (after the samples; vLLM ``Scheduler.update_from_output``
    handles ``kv_connector_output`` there): each load in ``finished_recving`` **lands**, each send in
    ``finished_sending`` completes.

    A landing request that is live (WAITING_FOR_REMOTE_KVS) is WAITING again and keeps its blocks; its
    computed tokens are the loaded ones up to its first block in ``invalid_block_ids`` (block i invalid:
    ``i * block_size`` tokens stay computed, the rest is recomputed in those same blocks: vLLM
    ``Scheduler._handle_invalid_blocks``, recompute policy, ``_update_requests_with_invalid_blocks``); if
    none stay computed it frees its blocks, to the front of the free queue, last block first
    (``_update_waiting_for_remote_kv``: ``kv_cache_manager.free``), and is a fresh request again, with no load
    to start. A load that covered the whole sequence leaves its last token to compute, so that it samples
    (``num_computed_tokens = num_tokens - 1``). vLLM promotes the request in its next ``Scheduler.schedule``
    (``_handle_blocked_waiting_request``); the spec does it here, which is the same for what the next plan may
    do, except that vLLM frees a failed load's blocks inside that plan. A landing request that was aborted
    while it loaded, and a completed send, free the blocks held for them in ``delayed_frees``.

    Raises:
        PlanError: an id that has no load in flight (or no send), or an invalid block of no landing request.
    """
    before = step.before
    landing = set(transfers.finished_recving)
    delayed = before.delayed_frees
    owner = {b: r for r in landing if r in step.requests for b in step.requests[r].block_ids}
    owner.update({b: r for r in landing if r in delayed for b in delayed[r].block_ids})  # aborted while loading
    for block_id in transfers.invalid_block_ids:
        if block_id not in owner:
            raise PlanError(f"invalid block {block_id} at step {before.step} belongs to no load that lands")
    invalid = frozenset(transfers.invalid_block_ids)
    size = step.config.block_size
    for request_id in transfers.finished_recving:
        request = step.requests.get(request_id)
        if request is not None and request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            computed = next((i * size for i, b in enumerate(request.block_ids) if b in invalid),
                            request.num_computed_tokens)
            changes: dict = {"status": RequestStatus.WAITING, "num_computed_tokens": computed}
            if computed == 0:
                step.freed[:0] = reversed(request.block_ids)
                changes["block_ids"] = ()
            elif computed == request.num_tokens:
                changes["num_computed_tokens"] = computed - 1
            step.requests[request_id] = evolve(request, **changes)
            continue
        step.free_delayed(request_id, "recving")  # aborted while it loaded
    for request_id in transfers.finished_sending:
        step.free_delayed(request_id, "sending")


def propose_drafts(step: StepInProgress, request_id: str, draft_token_ids: tuple[int, ...],
                   sampled: AbstractSet[str]) -> None:
    """The drafter **proposes** drafts after the step: for a request that sampled in it and still runs
    they become its ``spec_token_ids`` (vLLM ``Scheduler.update_draft_token_ids``); for any other id they
    are ignored, as vLLM ignores them (a request that ended, or an unknown id: "The request may have been
    finished. Skip."; one whose chunk did not reach its end: "Ignore draft tokens for prefill chunks").
    ``sampled``: the ids that sampled in the step (``set(step.sampled)``).

    Raises:
        PlanError: the proposal is longer than ``num_speculative_tokens``.
    """
    limit = step.config.num_speculative_tokens
    if len(draft_token_ids) > limit:
        raise PlanError(f"request_id={request_id!r}: {len(draft_token_ids)} drafts proposed at step "
                        f"{step.before.step} > num_speculative_tokens={limit}")
    request = step.requests.get(request_id)
    if request is None or request_id not in sampled:
        return
    step.requests[request_id] = evolve(request, spec_token_ids=tuple(draft_token_ids))


def stop_reason(request: Request, config: SchedulerConfig) -> tuple[RequestStatus, str] | None:
    """Whether a request with a freshly sampled token stops, and why.

    As vLLM 0.32 ``vllm/v1/core/sched/utils.py`` ``check_stop``, in this order: its EOS id, or one of
    its ``stop_token_ids``, ends it ``FINISHED_STOPPED`` (``stop``), so an EOS sampled as the last
    allowed token is a stop; then ``max_model_len`` total tokens or ``max_tokens`` outputs end it
    ``FINISHED_LENGTH`` (``max_model_len``, ``length``). ``min_tokens``: vLLM's sampler never samples
    EOS or a stop id before ``min_tokens`` outputs (its min-tokens logits processor), so the spec does
    not stop on one sampled earlier. The rule itself is :func:`spec.stop_rule.stop_reason_of`, shared
    with the whole-engine recorder.
    """
    reason = stop_reason_of(request.output_token_ids[-1], len(request.output_token_ids), request.num_tokens,
                            request.eos_token_id, request.stop_token_ids, request.min_tokens, request.max_tokens,
                            config.max_model_len)
    if reason is None:
        return None
    return (RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH), reason


def apply_plan(
    state: SchedulerState,
    plan: StepPlan,
    sampled_token_ids: Mapping[str, int],
    config: SchedulerConfig,
    speculative: SpeculativeOutput = NO_SPECULATION,
    transfers: KVTransferOutput = NO_TRANSFERS,
) -> StepResult:
    """One step: apply an allowed plan and the tokens the model sampled, action by action.

    Args:
        state: the state before the step.
        plan: an allowed plan for this state (``violated_rules(state, plan, config) == []``).
        sampled_token_ids: request id -> token id, for each request that samples this step
            (:func:`~schedspec.spec.state.samples_this_step`; extra entries are ignored). With
            speculative decoding, the token sampled after the accepted drafts.
        config: the limits.
        speculative: speculative decoding's inputs (:class:`~schedspec.spec.state.SpeculativeOutput`):
            the accepted drafts per request that verified drafts, and the drafts proposed after the step
            (:func:`propose_drafts`, applied after every sample).
        transfers: the KV connector's report after the step (:class:`~schedspec.spec.state.KVTransferOutput`,
            :func:`land_transfers`, applied last); nothing without a connector.

    Returns:
        :class:`StepResult`: the state after the step (``step`` advanced by one) and what ended. With a step
        in flight (``state.in_flight``, asynchronous scheduling) the plan's items and preemptions for
        requests that ended meanwhile do nothing: their tokens are the result's ``wasted`` work
        (:func:`~schedspec.spec.state.landed_plan`); and the state after records this step as the one in
        flight when the next plan was made (:func:`in_flight_after`).

    Raises:
        PlanError: a named request is not live, a sampling request has no sampled token, an accepted
            count is outside ``[0, d]`` or given for a request that verified no drafts, or a proposal
            is longer than ``num_speculative_tokens`` (:func:`propose_drafts`), a remote KV load with prefix
            caching (:func:`start_load`), or a transfer report it cannot apply (:func:`land_transfers`).
    """
    plan, wasted = landed_plan(state, plan)  # a plan made with a step in flight: its wasted items do nothing
    step = StepInProgress.begin(state, config)
    for request_id in plan.preempted:
        preempt(step, request_id)
    for request_id, reason in plan.rejected:
        reject(step, request_id, reason)
    for item in plan.scheduled:
        schedule(step, item)
    for load in plan.loads:
        start_load(step, load)
    for item in plan.scheduled:  # the forward pass ran; now each request that reached its end samples
        if samples_this_step(state.requests[item.request_id], item):
            if item.request_id not in sampled_token_ids:
                raise PlanError(f"no sampled token for request_id={item.request_id!r} at step {state.step}")
            if item.spec_token_ids:
                accepted = speculative.num_accepted_tokens.get(item.request_id, 0)
                if not 0 <= accepted <= len(item.spec_token_ids):
                    raise PlanError(f"request_id={item.request_id!r}: {accepted} drafts accepted at step "
                                    f"{state.step}, of {len(item.spec_token_ids)} verified")
                sample(step, item.request_id, sampled_token_ids[item.request_id], item, accepted)
            else:
                sample(step, item.request_id, sampled_token_ids[item.request_id])
    if speculative is not NO_SPECULATION:
        verified = {item.request_id for item in plan.scheduled if item.spec_token_ids}
        for request_id in speculative.num_accepted_tokens:
            if request_id not in verified:
                raise PlanError(f"request_id={request_id!r}: drafts accepted at step {state.step}, but it verified "
                                "no drafts")
        sampled = set(step.sampled)
        for request_id, drafts in speculative.draft_token_ids.items():
            propose_drafts(step, request_id, drafts, sampled)
    if not transfers.is_empty:
        land_transfers(step, transfers)
    result = step.end()
    cadence = cadence_after(state, plan, result.state.waiting, config)  # the cadence's step history
    if cadence is not None:  # off (prefill_schedule_interval <= 1): the state has none
        result = attrs.evolve(result, state=attrs.evolve(result.state, prefill_cadence=cadence))
    if state.in_flight is None:
        return result
    return attrs.evolve(result, state=attrs.evolve(result.state, in_flight=in_flight_after(state, plan, result)),
                        wasted=wasted)


def in_flight_after(before: SchedulerState, plan: StepPlan, result: StepResult) -> InFlightStep:
    """Asynchronous scheduling: the :class:`~schedspec.spec.state.InFlightStep` of the state after a step,
    ``before`` the state before it and ``plan`` the part of its plan that landed. The next plan was made
    while this step was in flight: over one placeholder per request that samples in it, plus the drafts it
    verifies (vLLM ``AsyncScheduler._update_after_schedule``); the requests it ended (stop or length) and
    the blocks they held were still live when that plan was made."""
    placeholders = {item.request_id: 1 + len(item.spec_token_ids) for item in plan.scheduled
                    if samples_this_step(before.requests[item.request_id], item)}
    items = {item.request_id: item for item in plan.scheduled}
    freed: dict[str, tuple[int, ...]] = {}
    for request_id in result.finished:
        item = items[request_id]
        blocks = before.requests[request_id].block_ids + item.cached_block_ids + item.new_block_ids
        if blocks:
            freed[request_id] = blocks
    return InFlightStep(before.step, plan, MappingProxyType(placeholders),
                        MappingProxyType({r: result.state.finished[r] for r in result.finished}), MappingProxyType(freed))

