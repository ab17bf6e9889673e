"""Reference scheduling policies: pure functions ``plan(state, config) -> StepPlan``.

Each policy refines the spec: every plan it returns is allowed by
:func:`schedspec.spec.rules.violated_rules` (checked at every step by the engine loop and the
Hypothesis suite, and for fcfs proved by ``schedspec.reference.proofs``). Each declares in
``GUARANTEES`` the trace properties of :mod:`schedspec.spec.properties` it promises.

The shared mechanism, one step in three phases:

1. **Reject** every waiting request that was never admitted and could never complete alone
   (``rejects-impossible``).
2. **Running requests**: decodes first, then partial prefills, each group in admission order. A decode
   gets one token; a prefill chunk gets its pending tokens capped by ``long_prefill_token_threshold``
   and by the budget left. A request that needs a new block when none is free preempts the most
   recently admitted running request not yet scheduled in this step (recompute), possibly itself.
3. **Admission** (only in a step that preempted nothing, as vLLM): waiting requests in the policy's
   order while budget, a ``max_num_seqs`` slot and blocks allow; admission reserves blocks for the
   whole current sequence (prompt plus any output to recompute), not only the first chunk. The first
   request that does not fit stops admission (no skipping ahead).

Sources: vLLM 0.32 ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule`` (running first, then
waiting; ``_preempt_request`` takes the last of ``self.running``; no admission after a preemption);
Sarathi-Serve (OSDI'24) §4.2 stall-free batching (decodes before prefill chunks).

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
from schedspec.spec.request import Request
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan

AdmissionOrder = Callable[[SchedulerState], Sequence[str]]


class _BlockPool:
    """The free queue as this step's plan sees it: allocate from the front, preempted blocks join the
    back (the order :func:`schedspec.spec.transitions.apply_plan` will produce)."""

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


def _chunk(request: Request, budget: int, config: SchedulerConfig) -> int:
    """Tokens a request may compute with ``budget`` tokens left: its pending tokens, capped by the long
    prefill threshold (chunked prefill only) and the budget; 0 if chunking is off and it does not fit."""
    pending = request.num_pending_tokens
    if not config.enable_chunked_prefill:
        return pending if pending <= budget else 0
    threshold = config.long_prefill_token_threshold
    if threshold and pending > threshold:
        pending = threshold
    return min(pending, budget)


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
    requests = state.requests
    budget = config.max_num_batched_tokens
    pool = _BlockPool(state.free_block_ids)
    scheduled: list[ScheduledRequest] = []
    preempted: list[str] = []
    gone: set[str] = set()  # preempted or scheduled this step: no longer a preemption candidate
    victims = list(state.running)  # candidates, most recently admitted last

    decodes = [r for r in state.running if requests[r].num_pending_tokens == 1]
    prefills = [r for r in state.running if requests[r].num_pending_tokens > 1]
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

    if not preempted and not (admit_only_when_idle and state.running):
        num_running = len(state.running)
        skip = {request_id for request_id, _ in rejected}
        for request_id in admission_order(state):
            if request_id in skip:
                continue
            if num_running >= config.max_num_seqs or budget == 0:
                break
            request = requests[request_id]
            num_tokens = _chunk(request, budget, config)
            needed = blocks_for_tokens(request.num_tokens, config.block_size)
            if num_tokens == 0 or needed > pool.available:
                break
            scheduled.append(ScheduledRequest(request_id, request.num_computed_tokens, num_tokens, pool.take(needed)))
            budget -= num_tokens
            num_running += 1

    return StepPlan(scheduled=tuple(scheduled), preempted=tuple(preempted), rejected=rejected)


def _queue_order(state: SchedulerState) -> Sequence[str]:
    return state.waiting


def _shortest_prompt_order(state: SchedulerState) -> Sequence[str]:
    position = {request_id: i for i, request_id in enumerate(state.waiting)}
    return sorted(state.waiting, key=lambda r: (state.requests[r].prompt_len, position[r]))


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
