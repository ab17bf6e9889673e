"""A pure policy run as an asynchronous engine runs it: step n + 1 is planned while step n is in flight.

:class:`InFlightScheduler` plays vLLM's ``AsyncScheduler`` (``vllm/v1/core/sched/async_scheduler.py``, driven
by ``EngineCore.step_with_batch_queue``) with a reference policy, in pure Python, so that the spec's step in
flight (:class:`~schedspec.spec.state.InFlightStep`) can be exercised without vLLM (the trace-mutation
catalogue's asynchronous trace, ``schedspec.trace_mutations.in_flight_trace``). In its ``update`` of step n
it first plans step n + 1 from the **optimistic** state, the spec's state after step n with a placeholder
token for every request that samples in it, a token that stops none of them (vLLM plans over
``num_output_placeholders`` before the tokens exist); a request that step n brings to ``max_tokens`` or
``max_model_len`` ends there too, so the plan leaves it out, as vLLM's guard does, but its blocks are not
handed out (they are freed after the plan, by ``update_from_output``). Then it applies step n's
real samples. The next ``schedule`` returns that plan, its items for requests that ended meanwhile (an
end-of-sequence token sampled in step n, a client abort since) included: the spec counts them as wasted.
The input processor's refusals of requests that arrived since (``reject-only-impossible``) are added to it,
as vLLM's engine refuses them before its scheduler sees them.

Prefix caching, speculative decoding and the prefill cadence (``prefill_schedule_interval`` > 1) are
refused (``UnsupportedFeature``), as the ``vllm-async`` adapter refuses them: a placeholder token would change a block's hash, and drafts would need placeholder
drafts.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from schedspec.reference.scheduler import PlanFunction, UnsupportedFeature
from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request
from schedspec.spec.rules import eligible_when_planned
from schedspec.spec.state import (
    NO_SPECULATION,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
    landed_plan,
    samples_this_step,
)
from schedspec.spec.transitions import abort_request, add_request, apply_plan


def placeholder_token(request: Request) -> int:
    """A token id that does not stop ``request`` (neither its ``eos_token_id`` nor a stop id): the
    placeholder the optimistic state samples for it (token ids ``0, 1, 2, ...``, the first allowed)."""
    stops = {request.eos_token_id, *request.stop_token_ids}
    return next(token for token in range(len(stops) + 1) if token not in stops)


class InFlightScheduler:
    """A reference policy planned one step ahead (module docstring); a
    :class:`~schedspec.reference.scheduler.Scheduler` whose ``async_scheduling`` is true, so the engine loop
    judges it against the spec's state with a step in flight.

    Args:
        config: the limits.
        plan: the policy's pure plan function (``plan(state, config) -> StepPlan``).
        name: the scheduler's name.

    Raises:
        UnsupportedFeature: prefix caching or speculative decoding on.
    """

    async_scheduling = True

    def __init__(self, config: SchedulerConfig, plan: PlanFunction, name: str) -> None:
        if config.enable_prefix_caching or config.speculative:
            raise UnsupportedFeature(f"scheduler {name!r}: prefix caching and speculative decoding are not planned "
                                     "over placeholders (enable_prefix_caching, num_speculative_tokens)")
        if config.prefill_schedule_interval > 1:
            raise UnsupportedFeature(f"scheduler {name!r}: prefill_schedule_interval="
                                     f"{config.prefill_schedule_interval}: the prefill cadence with a step in flight "
                                     "is not specified (the vllm-async adapters refuse it too)")
        self.config = config
        self.plan_function = plan
        self.name = name
        self.guarantees: frozenset[str] = frozenset()
        self.spec_state = SchedulerState.initial(config, asynchronous=True)
        """The spec state after the last step and the client's actions since (not ``state``: the engine loop
        must not trust it as the scheduler's own, since it is the spec's)."""
        self.prepared: StepPlan | None = None
        self.plan: StepPlan | None = None
        self.arrived: list[str] = []

    def add_request(self, request: Request) -> None:
        self.spec_state = add_request(self.spec_state, request)
        self.arrived.append(request.request_id)

    def abort_request(self, request_id: str) -> None:
        self.spec_state = abort_request(self.spec_state, request_id)

    def schedule(self) -> StepPlan:
        """Step 0's plan from the state (nothing in flight), later the plan made during the last ``update``,
        with the input processor's refusals of the requests that arrived since; the same until ``update``."""
        if self.plan is None:
            if self.prepared is None:
                self.plan = self.plan_function(self.spec_state, self.config)
            else:
                refused = []
                for request_id in self.arrived:
                    request = self.spec_state.requests.get(request_id)
                    reason = None if request is None else rejection_reason(request.prompt_len, request.max_tokens,
                                                                           self.config)
                    if reason is not None:
                        refused.append((request_id, reason))
                self.plan = attrs.evolve(self.prepared, rejected=self.prepared.rejected + tuple(refused))
            self.prepared = None
            self.arrived = []
        return self.plan

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int],
               speculative: SpeculativeOutput = NO_SPECULATION) -> tuple[str, ...]:
        """Plan the next step over placeholders, then apply this step's samples; the ids that finished."""
        if plan != self.plan:
            raise ValueError("update: the plan is not the one schedule() returned")
        before = self.spec_state
        landed = landed_plan(before, plan)[0]
        placeholders = {item.request_id: placeholder_token(before.requests[item.request_id])
                        for item in landed.scheduled if samples_this_step(before.requests[item.request_id], item)}
        optimistic = apply_plan(before, plan, placeholders, self.config).state
        # the blocks of a request that step n brings to its length are still held when vLLM plans step n + 1
        # (Scheduler.update_from_output frees them after): the plan sees a free queue without them
        assert optimistic.in_flight is not None
        held = {b for blocks in optimistic.in_flight.freed_blocks.values() for b in blocks}
        if held:
            optimistic = attrs.evolve(optimistic, free_block_ids=tuple(b for b in optimistic.free_block_ids if b not in held))
        # and those requests still take their max_num_seqs slots (vLLM's self.running holds them until then)
        holding = sum(1 for blocks in optimistic.in_flight.freed_blocks.values() if blocks)
        config = self.config
        if holding:
            active = config.max_num_active_seqs
            config = attrs.evolve(config, max_num_seqs=max(1, config.max_num_seqs - holding),
                                  max_num_active_seqs=None if active is None else max(1, active - holding))
        if config.long_prefill_token_threshold_adaptive:
            # and they count in the threshold's floor (vLLM's get_request_counts): the spec's count of the
            # requests the planner saw, as a plain threshold (no rejections: arrivals are refused at schedule)
            threshold = config.effective_long_prefill_threshold(eligible_when_planned(optimistic, StepPlan()))
            config = config.with_changes(long_prefill_token_threshold=threshold,
                                         long_prefill_token_threshold_adaptive=False)
        self.prepared = self.plan_function(optimistic, config)
        if holding and len(optimistic.running) + holding >= self.config.active_seq_cap:
            admitted = {i.request_id for i in self.prepared.scheduled if i.request_id not in optimistic.running}
            if admitted:  # every slot is held: no admission (max_num_seqs cannot say 0)
                self.prepared = attrs.evolve(self.prepared, scheduled=tuple(
                    i for i in self.prepared.scheduled if i.request_id not in admitted))
        result = apply_plan(before, plan, sampled_token_ids, self.config)
        self.spec_state = result.state
        self.plan = None
        return result.finished


def fcfs_async(config: SchedulerConfig) -> InFlightScheduler:
    """The ``fcfs`` policy planned while a step is in flight (``schedspec.reference.in_flight:fcfs_async``)."""
    from schedspec.reference.policies import fcfs

    return InFlightScheduler(config, fcfs, "fcfs-async")
