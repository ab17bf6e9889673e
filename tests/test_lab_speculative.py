"""Speculative decoding in the lab: the cost model charges the verified drafts, the acceptance model's
statistics come out as its law says, the metrics and the run record carry them, and with k = 0 nothing
changes (the byte-for-byte check of the lab's output is in the report's commands; here the record's
figures keep exactly their keys)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from schedspec.cli import cli
from schedspec.lab import metrics, run_record
from schedspec.lab.run import run_lab
from schedspec.reference.cost_model import PROFILES, step_shape
from schedspec.reference.fake_model import AcceptanceModel, CostOnlyModel
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.persistent import evolve_request
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.transitions import add_request
from schedspec.spec.workload import RequestSpec

COST = PROFILES["llama3-8b-a100-80gb"]


def config(k: int) -> SchedulerConfig:
    return SchedulerConfig(block_size=16, num_kv_blocks=400, max_num_batched_tokens=512, max_num_seqs=16,
                           max_model_len=1024, num_speculative_tokens=k)


def workload(n: int = 24, gap: float = 0.05) -> list[RequestSpec]:
    return [RequestSpec(f"r{i}", 40 + 7 * i % 50, 30 + 11 * i % 40, arrival_time=i * gap) for i in range(n)]


def run(k: int, rate: float = 0.7, check: bool = False, gap: float = 0.05):
    return run_lab(workload(gap=gap), "fcfs", config(k), check=check, acceptance=AcceptanceModel(rate=rate))


def test_a_decode_with_drafts_is_charged_its_drafts_as_decode_tokens():
    """``step_shape`` and the cost-only token source agree: 1 + d decode tokens, d of them drafts."""
    cfg = config(3)
    state = add_request(SchedulerState.initial(cfg), RequestSpec("a", 20, 10).to_request(0))
    request = state.requests["a"]
    decoding = evolve_request(request, num_computed_tokens=20, output_token_ids=(5,), block_ids=(0, 1),
                              spec_token_ids=(1, 1, 1))
    state = SchedulerState(requests={"a": decoding}, running=("a",), free_block_ids=tuple(range(2, 400)))
    plan = StepPlan(scheduled=(ScheduledRequest("a", 20, 4, (), (), (1, 1, 1)),))
    shape = step_shape(plan, state)
    assert (shape.prefill_tokens, shape.decode_tokens, shape.num_draft_tokens, shape.kv_tokens_attended) == (0, 4, 3, 24)
    _, seconds = CostOnlyModel(cfg, COST).execute(plan, state)
    assert seconds == pytest.approx(COST.step_seconds(0, 4, 24))
    assert seconds > COST.step_seconds(0, 1, 21)  # the drafts cost time


def test_the_cost_only_and_the_fake_model_token_sources_accept_the_same_drafts():
    """The unchecked lab's token source (no KV) and the checked one (greedy verification over the fake KV)
    see the same acceptance model, so the runs take the same steps and times."""
    fast, checked = run(3), run(3, check=True)
    assert checked.run.num_steps_checked == len(checked.steps) and not checked.run.violations
    assert [(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) for s in fast.steps] == \
        [(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) for s in checked.steps]
    assert [t.token_times for t in fast.timelines] == [t.token_times for t in checked.timelines]


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.7, 0.9])
def test_the_acceptance_rate_follows_the_acceptance_model(rate):
    """Each draft is right with probability ``rate`` at its position, so a decode verifying d drafts
    accepts a with P(a >= i) = rate ** i: E[a | d] = sum_{i<=d} rate ** i. Over the run's own verified
    decodes (their d from the step records), the measured acceptance rate is within 3 points of it."""
    drafts: list[int] = []

    def observe(record) -> None:
        drafts.extend(len(item.spec_token_ids) for item in record.scheduled if item.spec_token_ids)

    result = run_lab(workload(), "fcfs", config(3), check=False, acceptance=AcceptanceModel(rate=rate),
                     on_step=observe)
    summary = metrics.efficiency_summary(result.steps, config(3).num_kv_blocks, result.timelines)
    assert summary["num_drafts"] == len(drafts) > 300 and summary["num_draft_tokens"] == sum(drafts)
    expected = sum(sum(rate ** i for i in range(1, d + 1)) for d in drafts) / sum(drafts)
    assert summary["draft_acceptance_rate"] == pytest.approx(expected, abs=0.03)
    assert summary["mean_acceptance_length"] == pytest.approx(
        1 + summary["num_accepted_tokens"] / summary["num_drafts"])


def test_every_draft_accepted_and_none_accepted():
    every, none, off = run(3, 1.0), run(3, 0.0), run(0)
    s_every = metrics.efficiency_summary(every.steps, 400, every.timelines)
    s_none = metrics.efficiency_summary(none.steps, 400, none.timelines)
    assert s_every["num_accepted_tokens"] == s_every["num_draft_tokens"] and s_every["draft_acceptance_rate"] == 1.0
    assert s_none["num_accepted_tokens"] == 0 and s_none["mean_acceptance_length"] == 1.0
    # the same tokens per request whatever is accepted
    outputs = {t.request_id: t.num_output_tokens for t in off.timelines}
    assert {t.request_id: t.num_output_tokens for t in every.timelines} == outputs
    assert {t.request_id: t.num_output_tokens for t in none.timelines} == outputs
    # all drafts right: fewer steps and a lower TPOT; none right: a higher TPOT (each step is dearer)
    tpot = {name: metrics.latency_summary(r.timelines)["all"]["tpot"]["p50"] for name, r in
            (("every", every), ("none", none), ("off", off))}
    assert len(every.steps) < len(off.steps) and tpot["every"] < tpot["off"] < tpot["none"]


def test_tokens_of_one_step_arrive_together_one_itl_per_step():
    result = run(3, 1.0)
    timeline = next(t for t in result.timelines if t.speculative)
    arrivals = sorted(set(timeline.token_times))
    assert len(timeline.itls) == len(arrivals) - 1 < timeline.num_output_tokens - 1
    assert all(gap > 0 for gap in timeline.itls)
    assert not any(t.speculative for t in run(0).timelines)


SYNTHETIC = ["lab", "--synthetic", "rate=5,cv=1,prompt=50,output=20,n=20,seed=3", "--no-check"]


def test_the_run_record_carries_the_speculative_figures_and_the_acceptance_model(tmp_path):
    saved = tmp_path / "spec.json"
    result = CliRunner().invoke(cli, [*SYNTHETIC, "--set", "num_speculative_tokens=3", "--acceptance-rate", "0.6",
                                      "--save", str(saved)])
    assert result.exit_code == 0, result.output
    assert "mean_acceptance_length" in result.output and "draft_acceptance_rate" in result.output
    record = run_record.load_record(saved)  # validated against the schema
    figures = record["figures"]
    assert figures["num_draft_tokens"] > 0 and 0 < figures["draft_acceptance_rate_percent"] < 100
    assert 1 < figures["mean_acceptance_length"] <= 4
    assert record["conditions"]["acceptance"] == {"rate": 0.6, "seed": 0}
    assert record["conditions"]["config"]["num_speculative_tokens"] == 3
    for path, value in ((("conditions", "acceptance", "rate"), 1.5), (("figures", "mean_acceptance_length"), -1.0)):
        bad = json.loads(json.dumps(record))
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        assert run_record.validate_record(bad) is not None
    plain = tmp_path / "plain.json"
    assert CliRunner().invoke(cli, [*SYNTHETIC, "--save", str(plain)]).exit_code == 0
    plain_record = run_record.load_record(plain)
    assert "acceptance" not in plain_record["conditions"] and "num_drafts" not in plain_record["figures"]
    assert "num_speculative_tokens" not in plain_record["conditions"]["config"]
    assert tuple(metrics.efficiency_summary(run(0).steps, 400)) == metrics.EFFICIENCY_KEYS


def test_speculation_lowers_tpot_at_low_load_and_costs_time_per_step():
    """At a light load with a good drafter, TPOT falls; every step that verifies drafts is longer."""
    light_off, light_on = run(0, gap=1.0), run(3, 0.8, gap=1.0)
    tpot_off = metrics.latency_summary(light_off.timelines)["all"]["tpot"]["p50"]
    tpot_on = metrics.latency_summary(light_on.timelines)["all"]["tpot"]["p50"]
    assert tpot_on < tpot_off
    itl_off = metrics.latency_summary(light_off.timelines)["all"]["itl"]["p50"]
    itl_on = metrics.latency_summary(light_on.timelines)["all"]["itl"]["p50"]
    assert itl_on > itl_off and not math.isclose(itl_on, itl_off)


@pytest.mark.parametrize("args, message", [
    (["--acceptance-rate", "1.5"], "--acceptance-rate"),
    (["--acceptance-rate", "0.5", "--backend", "torch"], "--acceptance-rate: only with --backend cost-model"),
])
def test_bad_acceptance_options_exit_2(args, message):
    result = CliRunner().invoke(cli, [*SYNTHETIC, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_the_sweep_table_shows_the_draft_figures_only_with_drafts():
    """``lab --sweep num_speculative_tokens=0,3``: the table gains vLLM's draft figures (acceptance rate,
    mean acceptance length), equal to each point's run record, "-" for the point without drafts; a sweep
    without drafts keeps its columns (its output is byte-identical to before: scripts/lab_output_diff.py)."""
    common = ("lab", "--max-requests", "12", "--time-scale", "0.1", "--acceptance-rate", "0.5", "--jobs", "1")
    runner = CliRunner()
    with_drafts = runner.invoke(cli, [*common, "--sweep", "num_speculative_tokens=0,3"], catch_exceptions=False)
    records = json.loads(runner.invoke(cli, [*common, "--sweep", "num_speculative_tokens=0,3", "--json"],
                                       catch_exceptions=False).stdout)
    assert with_drafts.exit_code == 0, with_drafts.output
    assert "draft accept %" in with_drafts.stdout and "mean accept len" in with_drafts.stdout
    off, on = records[0]["figures"], records[1]["figures"]
    assert "mean_acceptance_length" not in off and on["num_drafts"] > 0
    rows = [line.split("│") for line in with_drafts.stdout.splitlines() if line.startswith("│")]
    cells = {row[1].strip(): [c.strip() for c in row[2:-1]] for row in rows}
    assert cells["1"][-3:-1] == ["-", "-"]
    assert cells["2"][-3:-1] == [f"{on['draft_acceptance_rate_percent']:.1f}", f"{on['mean_acceptance_length']:.2f}"]
    without = runner.invoke(cli, [*common, "--sweep", "max_num_seqs=4,8"], catch_exceptions=False)
    assert without.exit_code == 0 and "│" in without.stdout and "accept" not in without.stdout
