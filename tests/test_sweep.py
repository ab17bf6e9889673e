"""`schedspec lab --sweep`: one row per configuration, the same whatever --jobs, each point checked as a
normal lab run, the best configuration chosen against the SLO, plots, and bad input.

Cost: about 20 lab runs of 20 requests (1-2 s each on a 2-core machine): roughly 30-40 s in all."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from schedspec.cli import cli
from schedspec.lab.sweep import pareto_front
from schedspec.reference.scheduler import make_scheduler

SWEEP = ("--max-requests", "20", "--time-scale", "0.1", "--sweep", "max_num_batched_tokens=512,2048",
         "--sweep", "max_num_seqs=4,16", "--slo", "ttft=2s,itl=200ms")
SLO_TTFT, SLO_ITL = 2.0, 0.2


def lab(*args: str):
    return CliRunner().invoke(cli, ["lab", *args], catch_exceptions=False)


def _table(output: str) -> str:
    """The output without the header (``Sweep: ...; N worker processes``), which names the number of
    worker processes. Rich wraps the header at the console's width (80 columns without a terminal, e.g.
    under pytest-xdist), so every line from ``Sweep:`` to the one naming the workers is dropped."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Sweep:"))
    end = next(i for i in range(start, len(lines)) if "worker processes" in lines[i])
    return "\n".join(lines[:start] + lines[end + 1:])


def test_one_and_two_jobs_give_the_same_table():
    one = lab(*SWEEP, "--jobs", "1")
    two = lab(*SWEEP, "--jobs", "2")
    assert one.exit_code == two.exit_code == 0, one.output + two.output
    assert _table(one.stdout) == _table(two.stdout)
    assert one.stdout.count("│") > 0 and "Best: point" in one.stdout


def test_every_point_is_a_checked_run_and_the_best_meets_the_slo(tmp_path):
    result = lab(*SWEEP, "--jobs", "2", "--json", "--save", str(tmp_path / "run.json"))
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert [r["conditions"]["sweep_point"] for r in records] == [
        {"max_num_batched_tokens": 512, "max_num_seqs": 4}, {"max_num_batched_tokens": 512, "max_num_seqs": 16},
        {"max_num_batched_tokens": 2048, "max_num_seqs": 4}, {"max_num_batched_tokens": 2048, "max_num_seqs": 16}]
    for record in records:
        point, config, figures = record["conditions"]["sweep_point"], record["conditions"]["config"], record["figures"]
        assert {k: config[k] for k in point} == point
        assert figures["steps_checked"] == figures["num_steps"] > 0 and figures["violations"] == 0
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["run-1.json", "run-2.json", "run-3.json", "run-4.json"]
    assert json.loads((tmp_path / "run-2.json").read_text())["figures"]["itl_p99_s"] == records[1]["figures"]["itl_p99_s"]
    # The best, by hand: among the points whose p99 TTFT and ITL are within the SLO, the highest goodput, then
    # the highest output throughput.
    meeting = [i for i, r in enumerate(records)
               if r["figures"]["ttft_p99_s"] <= SLO_TTFT and r["figures"]["itl_p99_s"] <= SLO_ITL]
    assert 0 < len(meeting) < len(records)  # the SLO separates the points
    best = max(meeting, key=lambda i: (records[i]["figures"]["goodput_percent"],
                                       records[i]["figures"]["output_tokens_per_s"], -i))
    table = lab(*SWEEP, "--jobs", "1")
    assert f"Best: point {best + 1} (" in table.stdout
    assert table.stdout.count("meets") + table.stdout.count("BEST") >= len(meeting)


def test_a_sweep_point_equals_a_single_run():
    sweep = lab("--max-requests", "20", "--sweep", "max_num_seqs=4,8", "--jobs", "2", "--json")
    single = lab("--max-requests", "20", "--set", "max_num_seqs=8", "--json")
    assert sweep.exit_code == single.exit_code == 0
    swept, alone = json.loads(sweep.stdout)[1]["figures"], json.loads(single.stdout)["figures"]
    swept.pop("wall_time_s"), alone.pop("wall_time_s")
    assert swept == alone


def test_rate_sweep_sets_the_arrival_rate():
    result = lab("--max-requests", "20", "--sweep", "rate=1,4", "--jobs", "1", "--json")
    assert result.exit_code == 0, result.output
    rates = [r["conditions"]["arrivals"]["rate_req_per_s"] for r in json.loads(result.stdout)]
    assert rates == pytest.approx([1.0, 4.0])


def seq_cap_ignored(config):
    """A deliberately broken scheduler: fcfs planning with four times the allowed max_num_seqs."""
    return make_scheduler("fcfs", config.with_changes(max_num_seqs=config.max_num_seqs * 4,
                                                      max_num_batched_tokens=max(config.max_num_batched_tokens,
                                                                                 config.max_num_seqs * 4)))


def test_a_point_that_breaks_the_spec_fails_the_sweep():
    result = lab("--max-requests", "20", "--time-scale", "0.05", "--scheduler", "tests.test_sweep:seq_cap_ignored",
                 "--sweep", "max_num_seqs=2,3", "--jobs", "1")
    assert result.exit_code == 1, result.output
    assert "FAILED point 1" in result.stdout and "VIOLATION" in result.stdout


def test_plots_are_written(tmp_path):
    result = lab("--max-requests", "20", "--sweep", "max_num_seqs=4,16", "--slo", "itl=100ms", "--jobs", "1",
                 "--plot", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep-itl-p99.png", "sweep-ttft-p99.png"]
    assert all(p.stat().st_size > 5000 for p in tmp_path.iterdir())


def test_pareto_front():
    # (latency, throughput): (2, 10) is beaten by (1, 10); (3, 5) by everything.
    points = [(1.0, 10.0), (2.0, 10.0), (3.0, 20.0), (3.0, 5.0)]
    assert pareto_front(points) == [0, 2]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--sweep", "max_num_sheep=1,2"), "max_num_sheep"),
        (("--sweep", "max_num_seqs=4,4"), "twice"),
        (("--sweep", "max_num_seqs=4,"), "empty value"),
        (("--sweep", "max_num_seqs"), "FIELD=V1,V2"),
        (("--sweep", "max_num_seqs=0,4"), "max_num_seqs"),
        (("--sweep", "rate=0,1"), "rate"),
        (("--sweep", "rate=1", "--time-scale", "2"), "--time-scale"),
        (("--sweep", "max_num_seqs=4", "--set", "max_num_seqs=8"), "--set max_num_seqs"),
        (("--sweep", "max_num_seqs=4", "--compare", "fcfs,static"), "--compare"),
        (("--jobs", "2",), "--jobs"),
        (("--sweep", "max_num_seqs=4", "--jobs", "0"), "--jobs"),
    ],
)
def test_bad_sweep_input_is_one_line_exit_2(args, needle):
    result = lab("--max-requests", "5", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and needle in result.stderr, result.stderr
