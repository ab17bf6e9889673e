"""How the state changes: arrivals, aborts, and a step (an allowed plan plus the sampled tokens).

These are the spec's actions. Each returns a new :class:`SchedulerState`; nothing is mutated.
:func:`apply_plan` assumes the plan is allowed (:func:`schedspec.spec.rules.violated_rules` is
empty); it raises :class:`PlanError` only for plans it cannot apply at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.prefix_cache import CacheUpdate
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import SchedulerState, StepPlan, samples_this_step


class PlanError(ValueError):
    """A plan or an action that cannot be applied to this state (names the request and the problem)."""


def add_request(state: SchedulerState, request: Request) -> SchedulerState:
    """A request arrives: it joins the back of the waiting queue.

    Raises:
        PlanError: the id was already added, the request is not fresh (status WAITING, nothing
            computed, no output, no blocks), or its ``max_tokens`` is negative (vLLM's
            ``SamplingParams`` refuses it; ``max_tokens == 0`` is a rejection at the next step).
    """
    request_id = request.request_id
    if request_id in state.requests or request_id in state.finished:
        raise PlanError(f"request_id={request_id!r} was already added")
    if request.max_tokens < 0:
        raise PlanError(f"request_id={request_id!r}: max_tokens={request.max_tokens} < 0")
    if (
        request.status is not RequestStatus.WAITING
        or request.num_computed_tokens
        or request.output_token_ids
        or request.block_ids
    ):
        raise PlanError(f"request_id={request_id!r} is not a fresh request (status={request.status.value})")
    requests = dict(state.requests)
    requests[request_id] = request
    return attrs.evolve(
        state,
        waiting=state.waiting + (request_id,),
        requests=requests,
        num_requests_added=state.num_requests_added + 1,
    )


def abort_request(state: SchedulerState, request_id: str) -> SchedulerState:
    """The client aborts a request: it ends ``FINISHED_ABORTED`` and releases all its blocks at once
    (to the front of the free queue, last block first: see ``SchedulerState.free_block_ids``; with prefix
    caching its cached blocks stay cached and go to the back: :meth:`CacheUpdate.release`).

    Aborting a request that already ended, or an id never added, changes nothing (vLLM
    ``Scheduler.finish_requests`` skips ids it does not know).
    """
    request = state.requests.get(request_id)
    if request is None:
        return state
    requests = dict(state.requests)
    del requests[request_id]
    finished = state.finished.with_added(
        {request_id: request.replace(status=RequestStatus.FINISHED_ABORTED, finish_reason="abort", block_ids=())}
    )
    cache = state.prefix_cache
    if cache is None:
        free = tuple(reversed(request.block_ids)) + state.free_block_ids
    else:
        update = CacheUpdate(cache, state.free_block_ids)
        update.release(request.block_ids)
        cache, free = update.freeze()
    return attrs.evolve(
        state,
        waiting=tuple(r for r in state.waiting if r != request_id),
        running=tuple(r for r in state.running if r != request_id),
        requests=requests,
        finished=finished,
        free_block_ids=free,
        prefix_cache=cache,
    )


def stop_reason(request: Request, config: SchedulerConfig) -> tuple[RequestStatus, str] | None:
    """Whether a request with a freshly sampled token stops, and why.

    As vLLM 0.32 ``vllm/v1/core/sched/utils.py`` ``check_stop``, in this order: its EOS id, or one of
    its ``stop_token_ids``, ends it ``FINISHED_STOPPED`` (``stop``), so an EOS sampled as the last
    allowed token is a stop; then ``max_model_len`` total tokens or ``max_tokens`` outputs end it
    ``FINISHED_LENGTH`` (``max_model_len``, ``length``). ``min_tokens``: vLLM's sampler never samples
    EOS or a stop id before ``min_tokens`` outputs (its min-tokens logits processor), so the spec does
    not stop on one sampled earlier.
    """
    outputs = request.output_token_ids
    last = outputs[-1]
    if len(outputs) >= request.min_tokens and (
            (request.eos_token_id is not None and last == request.eos_token_id) or last in request.stop_token_ids):
        return RequestStatus.FINISHED_STOPPED, "stop"
    if request.num_tokens >= config.max_model_len:
        return RequestStatus.FINISHED_LENGTH, "max_model_len"
    if len(outputs) >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH, "length"
    return None


@attrs.frozen
class StepResult:
    """The state after a step and what ended in it."""

    state: SchedulerState
    finished: tuple[str, ...]
    """Requests that finished in this step (stop or length), in batch order."""
    sampled: tuple[str, ...]
    """Requests that sampled a token in this step, in batch order."""


def _take_blocks(free: tuple[int, ...], taken: list[int]) -> tuple[int, ...]:
    if not taken:
        return free
    count = len(taken)
    if list(free[:count]) == taken:  # the usual case: allocation from the front of the free queue
        return free[count:]
    gone = set(taken)
    return tuple(b for b in free if b not in gone)


def apply_plan(
    state: SchedulerState,
    plan: StepPlan,
    sampled_token_ids: Mapping[str, int],
    config: SchedulerConfig,
) -> StepResult:
    """Apply an allowed plan and the tokens the model sampled; the step counter advances by one.

    In order: preempted requests release every block (to the front of the free queue, last block
    first, each preempted request in front of the one before it, as vLLM ``KVCacheManager.free`` and
    ``BlockPool.free_blocks`` without prefix caching) and are prepended to the waiting queue with
    ``num_computed_tokens = 0``; rejected requests end ``REJECTED`` with their reason; scheduled
    requests take their new blocks, waiting ones are admitted (appended to ``running``), and each
    adds ``num_tokens`` to ``num_computed_tokens``; a request whose chunk reached the end of its
    sequence (:func:`~schedspec.spec.state.samples_this_step`) appends its sampled token and is
    checked by :func:`stop_reason`; one that stops releases its blocks (to the front of the free
    queue, in batch order, as vLLM ``Scheduler.update_from_output``) and ends.

    With prefix caching (``state.prefix_cache`` set) the blocks go through
    :class:`~schedspec.spec.prefix_cache.CacheUpdate`: a release drops reference counts (cached blocks
    stay cached, at the back of the free queue), an admitted request's ``cached_block_ids`` are
    referenced and start its table, with ``num_computed_tokens`` counting the hit; handing out a cached
    block evicts it; and at the end of the step every scheduled request publishes its fully computed
    blocks (before a finished request releases them).

    Args:
        state: the state before the step.
        plan: an allowed plan for this state.
        sampled_token_ids: request id -> token id, for each request that samples this step
            (extra entries are ignored).
        config: the limits.

    Returns:
        :class:`StepResult` with the new state.

    Raises:
        PlanError: a named request is not live, or a sampling request has no sampled token.
    """
    requests = dict(state.requests)
    finished = state.finished
    waiting = list(state.waiting)
    running = list(state.running)
    free = state.free_block_ids
    update = CacheUpdate(state.prefix_cache, free) if state.prefix_cache is not None else None

    def live(request_id: str) -> Request:
        try:
            return requests[request_id]
        except KeyError:
            raise PlanError(f"request_id={request_id!r} is not a live request at step {state.step}") from None

    released: list[int] = []
    for request_id in plan.preempted:
        request = live(request_id)
        if update is not None:
            update.release(request.block_ids)
        released[:0] = reversed(request.block_ids)
        requests[request_id] = request.replace(
            status=RequestStatus.PREEMPTED,
            num_computed_tokens=0,
            block_ids=(),
            num_preemptions=request.num_preemptions + 1,
        )
        running.remove(request_id)
        waiting.insert(0, request_id)
    if released and update is None:
        free = tuple(released) + free

    ended: dict[str, Request] = {}
    if plan.rejected:
        for request_id, reason in plan.rejected:
            request = live(request_id)
            del requests[request_id]
            waiting.remove(request_id)
            ended[request_id] = request.replace(status=RequestStatus.REJECTED, finish_reason=reason)

    taken: list[int] = []
    sampled: list[str] = []
    stopped: list[str] = []
    admitted: set[str] = set()
    for item in plan.scheduled:
        request_id = item.request_id
        request = live(request_id)
        changes: dict = {"num_computed_tokens": request.num_computed_tokens + item.num_tokens}
        if update is not None:
            update.touch(item.cached_block_ids)
            update.take(item.new_block_ids)
            if item.cached_block_ids:
                changes["num_computed_tokens"] += len(item.cached_block_ids) * config.block_size
                changes["block_ids"] = request.block_ids + item.cached_block_ids + item.new_block_ids
        if item.new_block_ids:
            taken.extend(item.new_block_ids)
            changes.setdefault("block_ids", request.block_ids + item.new_block_ids)
        if request.status is not RequestStatus.RUNNING:
            changes["status"] = RequestStatus.RUNNING
            changes["admitted_step"] = state.step
            admitted.add(request_id)
            running.append(request_id)
        if samples_this_step(request, item):
            try:
                token_id = sampled_token_ids[request_id]
            except KeyError:
                raise PlanError(f"no sampled token for request_id={request_id!r} at step {state.step}") from None
            changes["output_token_ids"] = request.output_token_ids + (token_id,)
            if request.first_token_step is None:
                changes["first_token_step"] = state.step
            sampled.append(request_id)
        samples = "output_token_ids" in changes
        request = request.replace(**changes)
        requests[request_id] = request
        if samples:
            ending = stop_reason(request, config)
            if ending is not None:
                status, reason = ending
                stopped.append(request_id)
                requests[request_id] = request.replace(status=status, finish_reason=reason)
    if admitted:
        waiting = [r for r in waiting if r not in admitted]
    if update is None:
        free = _take_blocks(free, taken)
    else:
        for item in plan.scheduled:
            request = requests[item.request_id]
            update.publish(request, request.block_ids, request.num_computed_tokens, config.block_size)

    if stopped:
        gone = set(stopped)
        ended_blocks: list[int] = []
        for request_id in stopped:
            request = requests.pop(request_id)
            if update is not None:
                update.release(request.block_ids)
            ended_blocks[:0] = reversed(request.block_ids)
            ended[request_id] = request.replace(block_ids=())
        running = [r for r in running if r not in gone]
        if update is None:
            free = tuple(ended_blocks) + free
    cache = None
    if update is not None:
        cache, free = update.freeze()

    new_state = SchedulerState(
        step=state.step + 1,
        waiting=tuple(waiting),
        running=tuple(running),
        requests=MappingProxyType(requests),
        finished=finished.with_added(ended),
        free_block_ids=free,
        num_requests_added=state.num_requests_added,
        prefix_cache=cache,
    )
    return StepResult(new_state, tuple(stopped), tuple(sampled))
