"""`schedspec lab`: a real trace window end to end, the comparison, the outputs, and bad input."""

from __future__ import annotations

import csv
import json

import pytest
from click.testing import CliRunner

from schedspec.cli import cli
from schedspec.spec.checker import check_trace
from schedspec.spec.trace import read_trace


def lab(*args: str):
    return CliRunner().invoke(cli, ["lab", *args], catch_exceptions=False)


def test_lab_prints_conditions_steps_latency_and_efficiency():
    result = lab("--max-requests", "40", "--steps", "5")
    assert result.exit_code == 0, result.output
    for needle in ("Run conditions", "max_num_batched_tokens", "num_kv_blocks", "Azure", "Steps (5 of",
                   "Per-request latency", "ttft", "Batch efficiency", "0 violations"):
        assert needle in result.output, needle


def test_lab_json_summary_counts_every_request():
    result = lab("--max-requests", "60", "--json", "--slo", "ttft=2s,itl=200ms")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)["figures"]
    assert figures["requests_total"] == 60
    assert figures["requests_finished"] + figures["requests_rejected"] == 60
    assert figures["violations"] == 0
    assert figures["steps_checked"] == figures["num_steps"] > 0
    assert 0 <= figures["goodput_percent"] <= 100


@pytest.fixture(scope="module")
def burst_comparison() -> dict[str, dict]:
    """One ``lab --compare static,fcfs,fcfs-no-chunking`` run on a burst (60 requests of the trace at 20x
    their rate, ``max_num_seqs=16``), read by the two comparison tests below: each run's JSON summary by
    name. (Each test made its own run, of 120 and 150 requests: about 4.5 s and 1.8 s of CPU; this one takes
    about 1.3 s, and both comparisons hold on it by a wide margin: TTFT p50 3.1 s vs static's 12.5 s,
    worst ITL 0.22 s vs 0.50 s without chunking.)"""
    result = lab("--compare", "static,fcfs,fcfs-no-chunking", "--max-requests", "60", "--time-scale", "0.05",
                 "--set", "max_num_seqs=16", "--json")
    assert result.exit_code == 0, result.output
    return {s["name"]: s for s in json.loads(result.stdout)}


def test_continuous_batching_beats_static_on_ttft_under_load(burst_comparison):
    """The comparison shows why continuous batching exists: on the same burst, static batching makes
    later requests wait for the longest request of each batch."""
    by_name = burst_comparison
    assert set(by_name) == {"static", "fcfs", "fcfs-no-chunking"}
    assert by_name["fcfs"]["figures"]["ttft_p50_s"] < by_name["static"]["figures"]["ttft_p50_s"]
    no_chunking, fcfs = by_name["fcfs-no-chunking"]["conditions"], by_name["fcfs"]["conditions"]
    assert no_chunking["config"]["enable_chunked_prefill"] is False
    assert no_chunking["config"]["max_num_batched_tokens"] >= fcfs["config"]["max_model_len"]


def test_chunked_prefill_bounds_the_worst_inter_token_latency(burst_comparison):
    """Without chunking a whole long prompt joins a step with running decodes; chunking caps the step."""
    by_name = {name: run["figures"] for name, run in burst_comparison.items()}
    assert by_name["fcfs"]["itl_max_s"] < by_name["fcfs-no-chunking"]["itl_max_s"]


def test_steps_out_is_a_trace_the_checker_accepts(tmp_path):
    """The lab's ``--steps-out`` passes the trace checker. The pool is 2,048 blocks, not the A100 profile's
    28,181: the run's 1,140 steps are the same (no request needs more), and the checker's block-conservation
    invariant and free-pool rule walk the whole free queue at every step (about 4 s of CPU at 28,181, 0.5 s at
    2,048)."""
    steps = tmp_path / "steps.jsonl"
    rows = tmp_path / "requests.csv"
    result = lab("--max-requests", "30", "--set", "num_kv_blocks=2048", "--steps", "none", "--steps-out", str(steps),
                 "--requests-out", str(rows))
    assert result.exit_code == 0, result.output
    config, records = read_trace(steps)
    report = check_trace(config, records)
    assert report.violations == []
    assert report.steps_checked > 0 and report.first_bad_step is None
    with rows.open() as handle:
        assert len(list(csv.DictReader(handle))) == 30


def test_plots_are_written(tmp_path):
    result = lab("--compare", "static,fcfs", "--max-requests", "20", "--plot", str(tmp_path))
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["itl-cdf.png", "steps-fcfs.png", "steps-static.png", "ttft-cdf.png"]
    assert all(p.stat().st_size > 1000 for p in tmp_path.iterdir())


def test_requests_that_cannot_fit_are_rejected_and_counted():
    result = lab("--max-requests", "50", "--set", "max_model_len=1024", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["figures"]["requests_rejected"] > 0
    assert record["figures"]["rejected_prompt_exceeds_max_model_len"] == record["figures"]["requests_rejected"]
    assert any("max_model_len" in reason for reason in record["details"]["rejected_reasons"])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--trace", "no-such-file.csv"), "no-such-file.csv"),
        (("--duration", "0"), "duration"),
        (("--start", "99999999"), "no requests"),
        (("--max-requests", "0"), "--max-requests"),
        (("--time-scale", "-1"), "--time-scale"),
        (("--scheduler", "lottery"), "lottery"),
        (("--set", "max_num_seqs=0"), "max_num_seqs"),
        (("--synthetic", "rate=abc,prompt=10,output=5,n=3"), "rate"),
        (("--slo", "ttft=fast"), "ttft"),
        (("--steps", "x-y", "--max-requests", "3"), "--steps"),
        (("--compare", "fcfs,bogus", "--max-requests", "3"), "bogus"),
        (("--profile", "tpu"), "tpu"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle):
    result = lab(*args)
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_malformed_trace_rows_name_the_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,12,-3\r\n")
    result = lab("--trace", str(path))
    assert result.exit_code == 2
    assert "bad.csv" in result.output and "GeneratedTokens" in result.output


def test_compare_shows_each_runs_own_conditions():
    """Chunking and the budget differ between fcfs and fcfs-no-chunking: each run's value is shown,
    not the first run's as if it held for all."""
    result = lab("--compare", "fcfs,fcfs-no-chunking", "--max-requests", "10")
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in result.stdout.splitlines() if line.startswith("│") and line.count("│") == 4}
    assert rows["chunked prefill"] == ["on", "off"]
    assert rows["max_num_batched_tokens"] == ["2,048", "8,192"]
    assert rows["policy"] == ["fcfs", "fcfs-no-chunking"]


def test_rejections_are_grouped_by_kind_of_reason():
    result = lab("--max-requests", "50", "--set", "max_model_len=1024", "--steps", "none")
    assert result.exit_code == 0, result.output
    rejected_rows = [line for line in result.stdout.splitlines() if line.startswith("│ rejected ")]
    figures = json.loads(lab("--max-requests", "50", "--set", "max_model_len=1024", "--json").stdout)["figures"]
    assert figures["requests_rejected"] > 1
    assert len(rejected_rows) == 1
    assert f"{figures['requests_rejected']}: prompt-exceeds-max-model-len" in rejected_rows[0]


def test_lab_reports_the_prefix_hit_rate_with_its_conditions():
    """Prefix caching is off in every reference scheduler today: the rate is 0 over the first admissions'
    prompt tokens, and the line names the conditions."""
    result = lab("--max-requests", "20", "--steps", "none", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    prefix = record["details"]["prefix_cache"]
    assert prefix["enable_prefix_caching"] is False and prefix["prefix_hit_tokens"] == 0
    assert prefix["prefix_admissions"] > 0 and prefix["prefix_query_tokens"] > 0
    assert record["figures"]["prefix_hit_rate_percent"] == 0.0
    text = lab("--max-requests", "20", "--steps", "none").output
    assert "Prefix cache (enable_prefix_caching=false, block_size=" in " ".join(text.split())
