"""Helpers for tests and checks of the backend: a minimal planner that drives :class:`Runner` through
real spec states (``add_request`` / ``apply_plan``), without the project's schedulers.

The planner is deliberately naive (every live request runs every step, blocks from the front of the
free queue, no budget); it exists to build valid plans of a chosen shape, not to schedule well.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from schedspec.spec.config import SchedulerConfig, blocks_for_tokens
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
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
              only: Iterable[str] | None = None, preempt: Iterable[str] = ()) -> StepPlan:
    """A plan that runs every live request (or those in ``only``), running ones first.

    Each computes ``min(pending, chunk)`` tokens (``chunk`` per request id if a mapping; ``None``: all
    pending) and takes the blocks it needs from the front of the free queue (after ``preempt``'s
    blocks join its back).
    """
    preempted = tuple(preempt)
    free = list(state.free_block_ids)
    for request_id in preempted:
        free.extend(reversed(state.requests[request_id].block_ids))
    chosen = None if only is None else set(only)
    order = [r for r in state.running if r not in preempted] + list(state.waiting)
    scheduled = []
    for request_id in order:
        if chosen is not None and request_id not in chosen:
            continue
        request = state.requests[request_id]
        pending = request.num_tokens - request.num_computed_tokens
        limit = chunk.get(request_id) if isinstance(chunk, Mapping) else chunk
        n = pending if limit is None else min(pending, limit)
        if n <= 0:
            continue
        need = blocks_for_tokens(request.num_computed_tokens + n, config.block_size) - len(request.block_ids)
        new, free = tuple(free[:max(need, 0)]), free[max(need, 0):]
        scheduled.append(ScheduledRequest(request_id, request.num_computed_tokens, n, new))
    return StepPlan(scheduled=tuple(scheduled), preempted=preempted)


def run_step(runner, state: SchedulerState, config: SchedulerConfig, plan: StepPlan):
    """Execute ``plan`` on ``runner`` and apply it. Returns ``(new_state, sampled, seconds)``."""
    sampled, seconds = runner.execute(plan, state)
    return apply_plan(state, plan, sampled, config).state, sampled, seconds


def run_to_end(runner, state: SchedulerState, config: SchedulerConfig,
               chunk: int | Mapping[str, int] | None = None, max_steps: int = 10_000) -> SchedulerState:
    """Step with :func:`plan_step` until no request is live. Returns the final state."""
    for _ in range(max_steps):
        if not state.requests:
            return state
        state, _, _ = run_step(runner, state, config, plan_step(state, config, chunk))
    raise RuntimeError(f"requests still live after {max_steps} steps")
