"""`schedspec lab --capacity`: the bisection agrees with a brute-force scan of the rate on a small case
(where the SLO predicate is checked to be monotone), the search's bookkeeping, the percentile SLO keys,
the table, determinism across --jobs, and bad input.

Cost: about 60 small lab runs of 12 requests (checks off in the scan) and four CLI runs: about 10-15 s
on a 2-core machine."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from schedspec.cli import cli
from schedspec.lab import capacity
from schedspec.lab.metrics import MetricsError, RequestTimeline, Slo
from schedspec.lab.synthetic import synthetic
from schedspec.reference.cost_model import get_profile
from schedspec.spec.config import SchedulerConfig

CONFIG = SchedulerConfig(block_size=16, num_kv_blocks=256, max_num_batched_tokens=256, max_num_seqs=4,
                         max_model_len=1024)
TARGETS = capacity.parse_slo("ttft_p90=300ms,itl_p99=60ms")


def test_search_finds_a_threshold_to_the_tolerance_without_repeating_a_rate():
    for threshold in (0.013, 1.0, 7.77, 300.0):
        calls = []

        def holds(rate, threshold=threshold, calls=calls):
            calls.append(rate)
            return rate <= threshold

        found = capacity.search(holds, start=2.0, tolerance=0.01)
        assert found.status == "found"
        assert found.rate <= threshold < found.upper <= found.rate * 1.01
        assert len(calls) == len(set(calls)) == len(found.evaluations)
        assert all(verdict == (rate <= threshold) for rate, verdict in found.evaluations)


def test_search_reports_the_range_ends_instead_of_extrapolating():
    above = capacity.search(lambda rate: True, start=1.0, max_doublings=5)
    assert above.status == "above-range" and above.rate == 32.0 and above.upper is None
    below = capacity.search(lambda rate: False, start=1.0, max_doublings=5)
    assert below.status == "below-range" and below.rate is None and below.upper == 1.0 / 32
    with pytest.raises(ValueError):
        capacity.search(lambda rate: True, start=0.0)


def _holds(window, natural, rate):
    return capacity.evaluate(window, natural, rate, "fcfs", CONFIG, get_profile(), False, None, TARGETS)["holds"]


def test_bisection_matches_a_brute_force_scan_on_a_small_case():
    window = synthetic(rate=1.0, prompt="uniform:32:256", output="uniform:4:32", num_requests=12, seed=5)
    natural = 1.0
    # The scan: 40 rates, geometric from 1/8 to 64 requests/s.
    rates = [0.125 * 512 ** (k / 39) for k in range(40)]
    verdicts = [_holds(window, natural, r) for r in rates]
    # The predicate is monotone in the rate on this case: holds up to a point, fails from there on.
    boundary = verdicts.index(False)
    assert 0 < boundary and not any(verdicts[boundary:]), verdicts
    assert all(verdicts[:boundary])
    tolerance = 0.02
    found = capacity.search(lambda r: _holds(window, natural, r), start=natural, tolerance=tolerance)
    assert found.status == "found"
    # The true boundary lies between the last scanned rate that holds and the first that fails; the
    # bisection's bracket [rate, upper] (upper / rate <= 1.02) must overlap it.
    assert rates[boundary - 1] <= found.upper and found.rate < rates[boundary]
    assert found.upper / found.rate <= 1 + tolerance
    # Every rate the search ran agrees with the scan's verdict where the scan has one on each side.
    for rate, verdict in found.evaluations:
        if rate <= rates[boundary - 1]:
            assert verdict
        if rate >= rates[boundary]:
            assert not verdict


def test_a_deliberately_broken_search_is_caught_by_the_same_check():
    """The comparison above would fail for a search that returns the upper end of its bracket."""
    window = synthetic(rate=1.0, prompt="uniform:32:256", output="uniform:4:32", num_requests=12, seed=5)
    found = capacity.search(lambda r: _holds(window, 1.0, r), start=1.0, tolerance=0.02)
    assert not _holds(window, 1.0, found.upper) and _holds(window, 1.0, found.rate)


def test_scaled_window_is_the_same_requests_at_the_asked_rate():
    window = synthetic(rate=2.0, prompt=64, output=8, num_requests=50, seed=1)
    natural = len(window) / (window[-1].arrival_time - window[0].arrival_time)
    scaled = capacity.scaled_window(window, natural, 8.0)
    assert [s.request_id for s in scaled] == [s.request_id for s in window]
    assert len(scaled) / (scaled[-1].arrival_time - scaled[0].arrival_time) == pytest.approx(8.0)
    # For a synthetic workload, scaling equals drawing the Poisson process at that rate.
    drawn = synthetic(rate=8.0, prompt=64, output=8, num_requests=50, seed=1)
    assert [s.arrival_time for s in capacity.scaled_window(window, 2.0, 8.0)] == pytest.approx(
        [s.arrival_time for s in drawn], rel=1e-12)


def test_slo_keys():
    targets = capacity.parse_slo("ttft_p90=2s, itl_p99=200ms,e2e=10,queueing_p99.9=1s")
    assert targets.goodput == Slo(e2e=10.0)
    assert targets.targets() == (("ttft", 90.0, 2.0), ("itl", 99.0, 0.2), ("queueing", 99.9, 1.0), ("e2e", 99.0, 10.0))
    assert capacity.parse_slo("ttft=2s").percentiles == ()
    for text, match in (("ttft_p0=1s", "percentile"), ("ttft_p101=1s", "percentile"),
                        ("ttft_p90=1s,ttft_p90=2s", "twice"), ("itl_p99=fast", "seconds"), ("tbt_p99=1s", "unknown"),
                        ("ttft_p90=0", "> 0")):
        with pytest.raises(MetricsError, match=match):
            capacity.parse_slo(text)


def test_percentiles_use_the_metrics_definitions():
    timelines = [RequestTimeline("a", 4, 0.0, 0.0, [1.0, 1.5, 2.5], 2.5, "finished"),
                 RequestTimeline("b", 4, 1.0, 1.0, [4.0], 4.0, "finished"),
                 RequestTimeline("c", 4, 0.0, None, [], None, "rejected")]
    assert capacity.latency_values(timelines, "itl") == [0.5, 1.0]  # pooled gaps, finished only
    assert capacity.percentile(timelines, "ttft", 50) == pytest.approx(2.0)  # TTFTs 1 and 3
    assert capacity.percentile(timelines, "e2e", 100) == pytest.approx(3.0)
    assert capacity.percentile(timelines[2:], "ttft", 90) is None


CLI = ("lab", "--capacity", "--synthetic", "rate=1,prompt=uniform:32:256,output=uniform:4:32,n=12,seed=5",
       "--set", "max_num_batched_tokens=256", "--set", "block_size=16", "--sweep", "max_num_seqs=2,4",
       "--slo", "ttft_p90=300ms,itl_p99=60ms", "--profile", "llama3-8b-a100-80gb", "--capacity-tolerance", "0.2")


def test_cli_table_is_the_same_whatever_the_jobs(tmp_path):
    # Checks off here (the packaged-trace test below runs with them on): the point is the parallel path.
    one = CliRunner().invoke(cli, [*CLI, "--jobs", "1", "--json", "--no-check"], catch_exceptions=False)
    two = CliRunner().invoke(cli, [*CLI, "--jobs", "2", "--json", "--no-check", "--plot", str(tmp_path)],
                             catch_exceptions=False)
    assert one.exit_code == two.exit_code == 0, one.output + two.output
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert a["configurations"] == b["configurations"] and a["best"] == b["best"] == 1
    for configuration in a["configurations"]:
        assert configuration["status"] == "found"
        assert configuration["figures"]["ttft_p90_s"] <= 0.3 and configuration["figures"]["itl_p99_s"] <= 0.06
        rate, upper = configuration["capacity_req_per_s"], configuration["upper_req_per_s"]
        assert upper / rate <= 1.2 and math.isfinite(rate)
    assert (tmp_path / "capacity.png").stat().st_size > 1000


def test_capacity_runs_on_a_packaged_trace():
    result = CliRunner().invoke(cli, ["lab", "--capacity", "--max-requests", "12", "--slo", "ttft_p90=300ms,itl_p99=200ms",
                                      "--capacity-tolerance", "0.2", "--jobs", "1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for text in ("Azure", "Best: fcfs", "TTFT p90", "capacity req/s", "< "):
        assert text in result.output


@pytest.mark.parametrize(("args", "expected"), [
    (["--capacity"], "--capacity: needs --slo"),
    (["--slo", "ttft_p90=2s"], "--slo ttft_p90"),
    (["--capacity", "--slo", "ttft=2s", "--time-scale", "2"], "--time-scale"),
    (["--capacity", "--slo", "ttft=2s", "--sweep", "rate=1,2"], "--sweep rate"),
    (["--capacity", "--slo", "ttft=2s", "--backend", "torch"], "--backend"),
    (["--capacity", "--slo", "ttft=2s", "--save", "x.json"], "--save"),
    (["--capacity", "--slo", "ttft=2s", "--capacity-tolerance", "2"], "--capacity-tolerance"),
    (["--capacity-tolerance", "0.1"], "only with --capacity"),
    (["--capacity", "--slo", "ttft=2s", "--synthetic", "rate=1,prompt=8,output=8,duration=10"], "n=N"),
])
def test_bad_capacity_input_exits_2_with_one_line(args, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["lab", "--max-requests", "5", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.output


def test_an_slo_that_holds_at_every_rate_is_reported_as_such():
    result = CliRunner().invoke(cli, ["lab", "--capacity", "--synthetic", "rate=1,prompt=16,output=4,n=3",
                                      "--no-check", "--slo", "e2e_p50=1000s",
                                      "--capacity-tolerance", "0.5", "--jobs", "1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "(or more)" in result.output and "held at the top of the range" in result.output
