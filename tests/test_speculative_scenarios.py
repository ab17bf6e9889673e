"""The bundled speculative-decoding scenarios (issue 23, ``schedspec/data/cases/spec-*.json``): each passes on
its own scheduler (``vllm-v1``) and on every reference scheduler, and each that guards a bug class fails on a
scheduler broken on purpose in that way, judged by the spec's checks alone (a rule, an invariant, or the
engine loop's comparison of the scheduler's own state and finished requests with the spec's)."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import pytest

from schedspec.reference.engine import Engine, ViolationFound
from schedspec.reference.fake_model import AcceptanceModel, FakeModel
from schedspec.reference.scenarios import bundled_scenarios, judged_on, load_scenario, replay
from schedspec.reference.scheduler import SCHEDULERS, ReferenceScheduler
from schedspec.reference.vllm_v1 import vllm_v1
from schedspec.spec import NO_SPECULATION, SchedulerConfig, SchedulerState, SpeculativeOutput, StepPlan
from schedspec.spec.config import blocks_for_tokens
from schedspec.spec.persistent import evolve_request
from schedspec.spec.transitions import apply_plan

CASES = {p.stem: p for p in bundled_scenarios() if p.stem.startswith("spec-")}


def _free_blocks_left(state: SchedulerState, plan: StepPlan) -> list[int]:
    taken = {b for item in plan.scheduled for b in item.new_block_ids}
    return [b for b in state.free_block_ids if b not in taken]


def _all_drafts(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """Broken: every decode verifies all its proposed drafts, whatever the budget or max_model_len."""
    plan = vllm_v1(state, config)
    spare = _free_blocks_left(state, plan)
    items = []
    for item in plan.scheduled:
        request = state.requests[item.request_id]
        if item.spec_token_ids and len(item.spec_token_ids) < len(request.spec_token_ids):
            tokens = 1 + len(request.spec_token_ids)
            table = len(request.block_ids) + len(item.new_block_ids)
            extra = max(0, blocks_for_tokens(item.num_computed_tokens + tokens, config.block_size) - table)
            more, spare = tuple(spare[:extra]), spare[extra:]
            item = attrs.evolve(item, num_tokens=tokens, spec_token_ids=request.spec_token_ids,
                                new_block_ids=item.new_block_ids + more)
        items.append(item)
    return attrs.evolve(plan, scheduled=tuple(items))


def _drafts_on_last_prefill_chunk(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """Broken: the chunk that completes a prompt also verifies three invented drafts."""
    plan = vllm_v1(state, config)
    spare = _free_blocks_left(state, plan)
    items = []
    for item in plan.scheduled:
        request = state.requests[item.request_id]
        if request.num_computed_tokens < request.prompt_len == item.num_computed_tokens + item.num_tokens:
            table = len(request.block_ids) + len(item.new_block_ids)
            extra = max(0, blocks_for_tokens(request.prompt_len + 3, config.block_size) - table)
            more, spare = tuple(spare[:extra]), spare[extra:]
            item = attrs.evolve(item, num_tokens=item.num_tokens + 3, spec_token_ids=(7, 8, 9),
                                new_block_ids=item.new_block_ids + more)
        items.append(item)
    return attrs.evolve(plan, scheduled=tuple(items))


class StaleDraftsAfterPreemption(ReferenceScheduler):
    """Broken: remembers each request's drafts and hands them to its item when it is resumed after a
    preemption (the drafts ``Scheduler._preempt_request`` should have dropped)."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config, vllm_v1, "stale-drafts", frozenset())
        self.held: dict[str, tuple[int, ...]] = {}

    def schedule(self) -> StepPlan:
        for request_id, request in self.state.requests.items():
            if request.spec_token_ids:
                self.held[request_id] = request.spec_token_ids
        plan = vllm_v1(self.state, self.config)
        items = []
        for item in plan.scheduled:
            request = self.state.requests[item.request_id]
            if item.request_id in self.state.waiting and request.num_preemptions and item.request_id in self.held:
                item = attrs.evolve(item, spec_token_ids=self.held[item.request_id])
            items.append(item)
        return attrs.evolve(plan, scheduled=tuple(items))


class KeepsRejectedDraftsComputed(ReferenceScheduler):
    """Broken: after a verification, the rejected drafts stay counted in ``num_computed_tokens``."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config, vllm_v1, "keeps-rejected", frozenset())

    def update(self, plan: StepPlan, sampled: Mapping[str, int],
               speculative: SpeculativeOutput = NO_SPECULATION) -> tuple[str, ...]:
        result = apply_plan(self.state, plan, sampled, self.config, speculative)
        requests = dict(result.state.requests)
        for item in plan.scheduled:
            rejected = len(item.spec_token_ids) - speculative.num_accepted_tokens.get(item.request_id, 0)
            if rejected and item.request_id in requests:
                request = requests[item.request_id]
                requests[item.request_id] = evolve_request(request,
                                                           num_computed_tokens=request.num_computed_tokens + rejected)
        self.state = attrs.evolve(result.state, requests=requests)
        return result.finished


class IgnoresStopInsideDrafts(ReferenceScheduler):
    """Broken: a request that stops at one of its accepted drafts is not reported finished."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config, vllm_v1, "ignores-stop", frozenset())

    def update(self, plan: StepPlan, sampled: Mapping[str, int],
               speculative: SpeculativeOutput = NO_SPECULATION) -> tuple[str, ...]:
        finished = super().update(plan, sampled, speculative)
        accepted = speculative.num_accepted_tokens
        return tuple(r for r in finished if not accepted.get(r))


def _model(scenario, config: SchedulerConfig) -> FakeModel:
    """The token source a replay of ``scenario`` uses: the fake model with its acceptance patterns."""
    eos = {s.request_id: s.eos_at_output for s in scenario.requests if s.eos_at_output}
    return FakeModel(config, eos_at_output=eos, acceptance=AcceptanceModel(patterns=scenario.acceptance))


def _plan_scheduler(plan):
    return lambda config: ReferenceScheduler(config, plan, "broken", frozenset())


BROKEN = {
    "spec-drafts-over-budget": (_plan_scheduler(_all_drafts), "token-budget"),
    "spec-drafts-past-max-model-len": (_plan_scheduler(_all_drafts), "drafts-within-max-model-len"),
    "spec-no-drafts-in-a-prefill": (_plan_scheduler(_drafts_on_last_prefill_chunk), "drafts-only-in-decodes"),
    "spec-preempted-request-drops-its-drafts": (StaleDraftsAfterPreemption, "drafts-are-proposed"),
    "spec-rejected-drafts-not-computed": (KeepsRejectedDraftsComputed, "state-mismatch"),
    "spec-eos-inside-accepted-drafts": (IgnoresStopInsideDrafts, "refinement"),
}
"""Scenario -> (a scheduler broken in the way it guards against, the check that must catch it)."""

DEMONSTRATIONS = {"spec-drafts-starve-a-decode", "spec-drafts-past-max-tokens-preempt"}
"""Scenarios recording what vLLM 0.32 (and ``vllm-v1``, which reproduces it) does: ``expect.demonstrates``."""


def test_there_are_at_least_six_speculative_scenarios_each_guarding_or_demonstrating():
    assert len(BROKEN) >= 6
    assert set(CASES) == set(BROKEN) | DEMONSTRATIONS


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_scenario_passes_on_its_own_scheduler(name):
    result = replay(load_scenario(CASES[name]))
    assert result.passed, [str(v) for v in result.verdicts if not v.passed]


@pytest.mark.parametrize("scheduler", ["fcfs", "priority", "vllm-v1-priority", "vllm-v1@0.33"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_scenario_holds_on_every_reference_scheduler(name, scheduler):
    assert scheduler in SCHEDULERS
    scenario, _ = judged_on(load_scenario(CASES[name]), scheduler)  # what any correct scheduler owes
    result = replay(scenario, scheduler)
    assert result.passed, [str(v) for v in result.verdicts if not v.passed]


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_scenario_fails_on_a_scheduler_broken_that_way(name):
    scenario = load_scenario(CASES[name])
    factory, check = BROKEN[name]
    config = SchedulerConfig.from_dict(scenario.config)
    try:
        run = Engine(factory(config), config, token_source=_model(scenario, config), properties=(),
                     stop_on_violation=True).run(scenario.requests, max_steps=200)
    except ViolationFound as found:
        names = {v.name for v in found.violations}
    else:
        names = {v.name for v in run.violations}
    assert check in names, names
    # the same checks pass the correct profile on the same scenario
    correct = Engine(ReferenceScheduler(config, vllm_v1, "vllm-v1", frozenset()), config,
                     token_source=_model(scenario, config), properties=()).run(scenario.requests, max_steps=200)
    assert correct.violations == []
