"""The ``vllm`` adapters with speculative decoding (issue 23): vLLM 0.32's and 0.33's schedulers with an n-gram
``SpeculativeConfig`` (no draft model), the drafts handed to ``Scheduler.update_draft_token_ids`` after each
step, the accepted drafts in ``ModelRunnerOutput.sampled_token_ids``; compared with the ``vllm-v1`` profile by
``schedspec diff`` and replayed on the bundled speculative scenarios. Needs the vLLM environment
(``scripts/engines_setup.sh``); like the other engine tests, it fails without it rather than skip."""

from __future__ import annotations

import os

import pytest

from schedspec.commands.diff import PADDED_ADMISSION, run_diff
from schedspec.engines.vllm import VllmScheduler, fcfs, fcfs_async, padded_admission
from schedspec.reference.scenarios import bundled_scenarios, judged_on, load_scenario, replay
from schedspec.reference.scheduler import UnsupportedFeature
from schedspec.spec import (
    Request,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
)
from schedspec.spec.transitions import add_request

DIFF_EXAMPLES = int(os.environ.get("SCHEDSPEC_SPECULATIVE_DIFF_EXAMPLES", "1000"))
SPECULATIVE_CASES = [p for p in bundled_scenarios() if p.stem.startswith("spec-")]
CRASH_CASE = next(p for p in bundled_scenarios() if p.stem == "counterexample-vllm-spec-padding-threshold-crash")


def config(**changes) -> SchedulerConfig:
    base = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=40,
                num_speculative_tokens=3)
    base.update(changes)
    return SchedulerConfig(**base)


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_drafts_reach_vllm_and_come_back_in_its_plan(version):
    scheduler = VllmScheduler(config(), "fcfs", version)
    scheduler.add_request(Request("a", 0, [5, 6, 7, 8, 9], max_tokens=10, eos_token_id=2))
    plan = scheduler.schedule()
    assert plan.scheduled == (ScheduledRequest("a", 0, 5, (0, 1)),)
    scheduler.update(plan, {"a": 11}, SpeculativeOutput(draft_token_ids={"a": (12, 13, 14)}))
    plan = scheduler.schedule()  # vLLM's scheduled_spec_decode_tokens: the drafts update_draft_token_ids set
    assert plan.scheduled == (ScheduledRequest("a", 5, 4, (2,), spec_token_ids=(12, 13, 14)),)
    scheduler.update(plan, {"a": 20}, SpeculativeOutput(num_accepted_tokens={"a": 1},
                                                         draft_token_ids={"a": (21, 22, 23)}))
    view = scheduler.engine_view()
    # update_from_output: num_rejected = 3 - 1 taken back; the block of the rejected positions kept
    assert view.num_computed_tokens == {"a": 7} and view.block_tables == {"a": (0, 1, 2)}
    plan = scheduler.schedule()
    assert plan.scheduled == (ScheduledRequest("a", 7, 4, (), spec_token_ids=(21, 22, 23)),)
    # an end-of-sequence among the accepted drafts ends the request there
    scheduler.update(plan, {"a": 30}, SpeculativeOutput(num_accepted_tokens={"a": 3}))
    scheduler.close()


def test_the_budget_trims_the_drafts_in_vllm_as_in_the_profile():
    scheduler = fcfs(config(max_num_batched_tokens=6, max_num_seqs=2))
    for request_id in ("a", "b"):
        scheduler.add_request(Request(request_id, 0, [5, 6], max_tokens=6, eos_token_id=2))
    plan = scheduler.schedule()
    scheduler.update(plan, {"a": 11, "b": 11}, SpeculativeOutput(draft_token_ids={"a": (1, 2, 3), "b": (4, 5, 6)}))
    plan = scheduler.schedule()
    assert [(i.request_id, i.num_tokens, i.spec_token_ids) for i in plan.scheduled] == [
        ("a", 4, (1, 2, 3)), ("b", 2, (4,))]
    scheduler.close()


def test_async_scheduling_and_a_lookahead_are_refused():
    with pytest.raises(UnsupportedFeature, match="async scheduling"):
        fcfs_async(config())
    with pytest.raises(UnsupportedFeature, match="num_lookahead_tokens"):
        fcfs(config(num_lookahead_tokens=3))


def test_padded_admission_is_recognised_only_for_placeholder_drafts_of_a_one_token_request():
    cfg = config()
    state = add_request(SchedulerState.initial(cfg), Request("one", 0, [7], max_tokens=3, eos_token_id=2))
    padded = StepPlan(scheduled=(ScheduledRequest("one", 0, 4, (0,), spec_token_ids=(-1, -1, -1)),))
    assert padded_admission(state, padded, cfg, "one")
    invented = StepPlan(scheduled=(ScheduledRequest("one", 0, 4, (0,), spec_token_ids=(1, 2, 3)),))
    assert not padded_admission(state, invented, cfg, "one")
    assert not padded_admission(state, padded, cfg, "other")  # not in the plan
    two = add_request(SchedulerState.initial(cfg), Request("one", 0, [7, 8], max_tokens=3, eos_token_id=2))
    assert not padded_admission(two, padded, cfg, "one")  # two tokens to compute: no padding


@pytest.mark.parametrize("name", ["vllm", "vllm@0.33"])
def test_the_padding_threshold_crash_reproduces(name):
    """docs/findings/vllm-spec-padding-threshold-crash.md: ``assert num_new_tokens == 1 + self.num_spec_tokens``."""
    result = replay(load_scenario(CRASH_CASE), name)
    assert result.passed, [str(v) for v in result.verdicts if not v.passed]


@pytest.mark.parametrize("name", ["vllm", "vllm-priority", "vllm@0.33"])
@pytest.mark.parametrize("path", SPECULATIVE_CASES, ids=[p.stem for p in SPECULATIVE_CASES])
def test_vllm_passes_the_speculative_scenarios(path, name):
    scenario, _ = judged_on(load_scenario(path), name)
    result = replay(scenario, name)
    assert result.passed, [str(v) for v in result.verdicts if not v.passed]


def test_diff_vllm_against_the_profile_with_three_drafts():
    """``schedspec diff --scheduler vllm --against vllm-v1 --set num_speculative_tokens=3``: no unexplained
    divergence; the only findings allowed are vLLM's padding/threshold crash (the bundled finding)."""
    lines: list[str] = []
    report = run_diff("vllm", "vllm-v1", DIFF_EXAMPLES, 0, {"num_speculative_tokens": 3}, None, echo=lines.append)
    assert report.examples == DIFF_EXAMPLES and not report.unsupported
    assert report.divergent == 0, [line for line in lines if "DIVERGENCE" in line][:3]
    unexplained = [f for _, f in report.findings if not (f.side == "vllm" and "AssertionError" in f.detail)]
    assert unexplained == [], unexplained[:3]
    assert report.documented > 0 and any(PADDED_ADMISSION in line for line in lines)
