"""Run records (`lab --json`, `--save`) and `schedspec compare`: every condition is recorded, and
compare refuses records whose conditions differ other than where --allow-different allows.

Cost: three lab runs of 20 requests (about 2 s each on a 2-core machine); the compare tests edit
copies of one saved record."""

from __future__ import annotations

import copy
import hashlib
import json

import attrs
import pytest
from click.testing import CliRunner

from schedspec.cli import cli
from schedspec.lab import trace_formats
from schedspec.lab.run_record import validate_record
from schedspec.spec.config import LIMIT_DEFAULTS, SPECULATIVE_FIELDS, SchedulerConfig


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One record saved with --save and the same run's --json output."""
    folder = tmp_path_factory.mktemp("record")
    path = folder / "before.json"
    result = run("lab", "--max-requests", "20", "--slo", "ttft=2s,itl=200ms", "--json", "--save", str(path))
    assert result.exit_code == 0, result.output
    return path, json.loads(result.stdout)


def test_the_record_carries_every_condition(saved):
    path, printed = saved
    record = json.loads(path.read_text())
    assert record == printed  # --json and --save: one builder
    assert validate_record(record) is None
    conditions = record["conditions"]
    trace = trace_formats.default_trace_path()
    assert conditions["workload"]["trace_path"] == str(trace)
    assert conditions["workload"]["trace_sha256"] == hashlib.sha256(trace.read_bytes()).hexdigest()
    assert conditions["window"] == {"start_s": None, "duration_s": None, "max_requests": 20, "time_scale": 1.0,
                                    "length_scale": 1.0}
    # the speculative-decoding fields are written only when on (SchedulerConfig.to_dict), so a run without
    # speculative decoding keeps the record it had before they existed
    # (kv_cache_groups and prefix_cache_publication too: written only when not at their defaults,
    # SchedulerConfig.to_dict)
    assert set(conditions["config"]) == ({f.name for f in attrs.fields(SchedulerConfig)} - set(SPECULATIVE_FIELDS)
                                         - set(LIMIT_DEFAULTS) - {"kv_cache_groups", "prefix_cache_publication"})
    assert conditions["scheduler"] == "fcfs"
    assert conditions["cost_profile"]["name"] == "llama3-8b-a100-80gb"
    assert conditions["cost_profile"]["a_s_per_step"] > 0
    assert conditions["backend"]["kind"] == "cost-model"
    assert conditions["model"] == "llama3-8b"
    assert conditions["slo"] == {"ttft_s": 2.0, "itl_s": 0.2, "tpot_s": None, "e2e_s": None}
    assert conditions["sweep_point"] is None
    assert conditions["arrivals"]["num_requests"] == 20
    assert conditions["arrivals"]["rate_req_per_s"] == pytest.approx(20 / conditions["arrivals"]["span_s"])
    assert conditions["python_version"].startswith("3.")
    assert conditions["machine"]["cpu_count"] >= 1
    figures = record["figures"]
    for metric in ("ttft", "itl", "tpot", "e2e", "queueing"):
        for stat in ("p50", "p95", "p99", "max", "mean"):
            assert isinstance(figures[f"{metric}_{stat}_s"], float)
    assert figures["ttft_p50_s"] <= figures["ttft_p99_s"] <= figures["ttft_max_s"]
    assert 0 <= figures["goodput_percent"] <= 100
    assert 0 < figures["kv_usage_mean_percent"] <= figures["kv_usage_max_percent"] <= 100
    assert figures["requests_total"] == 20 and figures["violations"] == 0


def test_the_schema_check_can_fail(saved):
    _, record = saved
    broken = copy.deepcopy(record)
    broken["figures"]["ttft_p99_s"] = "fast"
    assert "figures.ttft_p99_s" in validate_record(broken)
    del broken["conditions"]["window"]
    assert validate_record(broken) is not None


def test_save_never_overwrites_an_input(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_bytes(trace_formats.default_trace_path().read_bytes()[:2000].rsplit(b"\n", 1)[0] + b"\n")
    before = trace.read_bytes()
    result = run("lab", "--trace", str(trace), "--save", str(trace))
    assert result.exit_code == 2
    assert "--save" in result.stderr and "input file" in result.stderr
    assert trace.read_bytes() == before


def _write(tmp_path, name, record):
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return str(path)


def test_compare_same_conditions_shows_each_change_with_its_sign(saved, tmp_path):
    path, record = saved
    after = copy.deepcopy(record)
    after["figures"]["ttft_p99_s"] = record["figures"]["ttft_p99_s"] * 2
    after["figures"]["output_tokens_per_s"] = record["figures"]["output_tokens_per_s"] * 1.5
    result = run("compare", str(path), _write(tmp_path, "after.json", after), "--json")
    assert result.exit_code == 0, result.output
    verdict = json.loads(result.stdout)
    assert verdict["comparable"] is True
    assert [d for d in verdict["differing_conditions"] if d["status"] == "DIFFERS"] == []
    rows = {row["figure"]: row for row in verdict["figures"]}
    assert rows["ttft_p99_s"]["change_percent"] == pytest.approx(100.0)
    assert rows["ttft_p99_s"]["verdict"] == "worse"
    assert rows["output_tokens_per_s"]["change_percent"] == pytest.approx(50.0)
    assert rows["output_tokens_per_s"]["verdict"] == "better"
    assert rows["itl_p99_s"]["change"] == 0
    text = run("compare", str(path), _write(tmp_path, "after.json", after))
    assert text.exit_code == 0
    assert "+100.0%" in text.stdout and "+50.0%" in text.stdout and "NOT COMPARABLE" not in text.stdout


def test_compare_refuses_differing_conditions(saved, tmp_path):
    path, record = saved
    after = copy.deepcopy(record)
    after["conditions"]["config"]["max_num_seqs"] = 8
    other = _write(tmp_path, "after.json", after)
    refused = run("compare", str(path), other)
    assert refused.exit_code == 1
    assert "NOT COMPARABLE" in refused.stdout and "config.max_num_seqs" in refused.stdout
    for field in ("max_num_seqs", "config.max_num_seqs", "config"):
        assert run("compare", str(path), other, "--allow-different", field).exit_code == 0, field
    assert run("compare", str(path), other, "--allow-different", "block_size").exit_code == 1
    # A second difference is still refused when only the first is allowed.
    after["conditions"]["window"]["time_scale"] = 0.5
    both = _write(tmp_path, "both.json", after)
    result = run("compare", str(path), both, "--allow-different", "max_num_seqs")
    assert result.exit_code == 1 and "window.time_scale" in result.stdout
    assert run("compare", str(path), both, "--allow-different", "max_num_seqs",
               "--allow-different", "time_scale").exit_code == 0


def test_compare_machine_counts_only_for_measured_step_times(saved, tmp_path):
    path, record = saved
    after = copy.deepcopy(record)
    after["conditions"]["machine"]["cpu_count"] = 512
    assert run("compare", str(path), _write(tmp_path, "a.json", after)).exit_code == 0
    torch_before, torch_after = copy.deepcopy(record), copy.deepcopy(after)
    for r in (torch_before, torch_after):
        r["conditions"]["backend"]["kind"] = "torch"
    result = run("compare", _write(tmp_path, "b.json", torch_before), _write(tmp_path, "c.json", torch_after))
    assert result.exit_code == 1 and "machine.cpu_count" in result.stdout


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b'{"record": "schedspec-run-record"}', "schema_version"),
        (None, "not a file"),
    ],
)
def test_compare_unreadable_record_is_one_line_exit_2(saved, tmp_path, content, needle):
    path, _ = saved
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_bytes(content)
    result = run("compare", str(path), str(bad))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "bad.json" in result.stderr and needle in result.stderr


def test_compare_names_the_field_of_an_invalid_record(saved, tmp_path):
    path, record = saved
    broken = copy.deepcopy(record)
    broken["figures"]["itl_p99_s"] = "slow"
    result = run("compare", str(path), _write(tmp_path, "broken.json", broken))
    assert result.exit_code == 2 and "figures.itl_p99_s" in result.stderr
    assert run("compare", str(path), str(path), "--allow-different", "no_such_field").exit_code == 2


def test_compare_two_real_runs_of_a_compare(tmp_path):
    """`lab --compare A,B --save F.json` writes F-A.json and F-B.json; compare refuses them (the
    scheduler differs) unless the scheduler is the condition under study."""
    result = run("lab", "--compare", "fcfs,static", "--max-requests", "10", "--save", str(tmp_path / "run.json"))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-fcfs.json", "run-static.json"]
    before, after = str(tmp_path / "run-fcfs.json"), str(tmp_path / "run-static.json")
    refused = run("compare", before, after)
    assert refused.exit_code == 1 and "scheduler" in refused.stdout
    allowed = run("compare", before, after, "--allow-different", "scheduler", "--json")
    assert allowed.exit_code == 0, allowed.output
    differing = [d["condition"] for d in json.loads(allowed.stdout)["differing_conditions"]]
    assert differing == ["scheduler"]
