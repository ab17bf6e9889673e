"""Helpers for tests and checks of the backend: a minimal planner that drives :class:`Runner` through
real spec states (``add_request`` / ``apply_plan``), without the project's schedulers.

The planner is deliberately naive (every live request runs every step, blocks from the front of the
free queue, no budget); it exists to build valid plans of a chosen shape, not to schedule well.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from schedspec.spec.config import SchedulerConfig, blocks_for_tokens
from schedspec.spec.state import NO_SPECULATION, ScheduledRequest, SchedulerState, SpeculativeOutput, StepPlan
from schedspec.spec.transitions import add_request, apply_plan
from schedspec.spec.workload import RequestSpec

DEVICE_ENV = "SCHEDSPEC_DEVICE"
"""Environment variable naming the device the backend tests run on (default ``cpu``)."""


def device_for_tests() -> str:
    """The device tests use: ``$SCHEDSPEC_DEVICE`` or ``"cpu"``."""
    return os.environ.get(DEVICE_ENV, "cpu") or "cpu"


def state_with(config: SchedulerConfig, specs: Iterable[RequestSpec],
               free_block_ids: tuple[int, ...] | None = None) -> SchedulerState:
    """The initial state (optionally with a chosen free-queue order) plus these requests, waiting."""
    state = SchedulerState.initial(config)
    if free_block_ids is not None:
        state = SchedulerState(free_block_ids=tuple(free_block_ids))
    for spec in specs:
        state = add_request(state, spec.to_request(state.step))
    return state


def plan_step(state: SchedulerState, config: SchedulerConfig, chunk: int | Mapping[str, int] | None = None,
              only: Iterable[str] | None = None, preempt: Iterable[str] = (), prefix_hits: bool = False) -> StepPlan:
    """A plan that runs every live request (or those in ``only``), running ones first.

    Each computes ``min(pending, chunk)`` tokens (``chunk`` per request id if a mapping; ``None``: all
    pending) and takes the blocks it needs from the front of the free queue (after ``preempt``'s
    blocks join its back). A decode (one pending token) of a request with drafts (``spec_token_ids``)
    verifies all of them: ``1 + d`` tokens, blocks allocated for the drafts too. With
    ``prefix_hits`` and a state with a prefix cache, a request without blocks starts with its longest
    hit (``cached_block_ids``; ``num_computed_tokens`` = the hit length), and hit blocks are not handed
    out as new ones.
    """
    preempted = tuple(preempt)
    free = list(state.free_block_ids)
    counts = dict(state.prefix_cache.ref_counts) if state.prefix_cache is not None else {}
    for request_id in preempted:
        for block in reversed(state.requests[request_id].block_ids):
            counts[block] = counts.get(block, 1) - 1
            if counts[block] <= 0:  # not still held by another request (a shared prefix block)
                free.append(block)
    cache = state.prefix_cache if prefix_hits else None
    chosen = None if only is None else set(only)
    order = [r for r in state.running if r not in preempted] + list(state.waiting)
    scheduled = []
    for request_id in order:
        if chosen is not None and request_id not in chosen:
            continue
        request = state.requests[request_id]
        hit: tuple[int, ...] = ()
        computed = request.num_computed_tokens
        if cache is not None and not request.block_ids and request_id not in preempted:
            taken = set(state.free_block_ids) - set(free)
            hit = cache.longest_hit(request, config.block_size, excluded=taken)
            free = [b for b in free if b not in hit]
            computed = len(hit) * config.block_size
        pending = request.num_tokens - computed
        limit = chunk.get(request_id) if isinstance(chunk, Mapping) else chunk
        n = pending if limit is None else min(pending, limit)
        if n <= 0:
            continue
        drafts = request.spec_token_ids if pending == 1 else ()
        n += len(drafts)
        need = blocks_for_tokens(computed + n, config.block_size) - len(request.block_ids) - len(hit)
        new, free = tuple(free[:max(need, 0)]), free[max(need, 0):]
        scheduled.append(ScheduledRequest(request_id, computed, n, new, cached_block_ids=hit, spec_token_ids=drafts))
    return StepPlan(scheduled=tuple(scheduled), preempted=preempted)



def run_step(runner, state: SchedulerState, config: SchedulerConfig, plan: StepPlan):
    """Execute ``plan`` on ``runner`` and apply it (with the runner's accepted drafts, when the plan verifies
    any). Returns ``(new_state, sampled, seconds)``."""
    sampled, seconds = runner.execute(plan, state)
    return apply_plan(state, plan, sampled, config, speculative_output(runner)).state, sampled, seconds


def speculative_output(runner, draft_token_ids: Mapping[str, tuple[int, ...]] | None = None) -> SpeculativeOutput:
    """The spec's :class:`~schedspec.spec.state.SpeculativeOutput` of the runner's last step: its accepted
    drafts (``runner.last_num_accepted_tokens``) and the drafts proposed after it; ``NO_SPECULATION``
    when there are neither."""
    accepted = dict(getattr(runner, "last_num_accepted_tokens", {}))
    if not accepted and not draft_token_ids:
        return NO_SPECULATION
    return SpeculativeOutput(num_accepted_tokens=accepted, draft_token_ids=dict(draft_token_ids or {}))


def run_to_end(runner, state: SchedulerState, config: SchedulerConfig,
               chunk: int | Mapping[str, int] | None = None, max_steps: int = 10_000) -> SchedulerState:
    """Step with :func:`plan_step` until no request is live. Returns the final state."""
    for _ in range(max_steps):
        if not state.requests:
            return state
        state, _, _ = run_step(runner, state, config, plan_step(state, config, chunk))
    raise RuntimeError(f"requests still live after {max_steps} steps")
