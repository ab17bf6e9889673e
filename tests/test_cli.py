"""The command line: exit codes 0/1/2/3 and one-line errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from schedspec.reference.scenarios import bundled_scenarios

CASES = {p.stem: p for p in bundled_scenarios()}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "schedspec", *args], capture_output=True, text=True, timeout=600)


def test_replay_passes_with_exit_0():
    result = run("replay", str(CASES["slot-freed-is-reused"]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout


def test_replay_failed_expectation_exits_1(tmp_path):
    data = json.loads(CASES["slot-freed-is-reused"].read_text())
    data["expect"]["all_terminal_by_step"] = 3
    path = tmp_path / "tight.json"
    path.write_text(json.dumps(data))
    result = run("replay", "-q", str(path))
    assert result.returncode == 1
    assert "FAIL all_terminal_by_step" in result.stdout


def test_replay_static_override_judges_what_static_owes():
    """The fcfs scenario's latency bounds are fcfs's own (static batching holds the slot): on static they are
    not judged, and said so (issue 28); what every scheduler owes still is."""
    result = run("replay", "-q", "--scheduler", "static", str(CASES["slot-freed-is-reused"]))
    assert result.returncode == 0, result.stdout
    assert "not judged on static (written for fcfs): all_terminal_by_step, first_token_by_step" in result.stdout
    assert "PASS outcome[C]" in result.stdout and "first_token_by_step[C]" not in result.stdout


def test_replay_prefix_caching_case_passes():
    """Prefix caching was a missing feature (exit 3) before the spec and the reference policies had it."""
    result = run("replay", "-q", str(CASES["preempt-then-prefix-hit"]))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("replay", "does-not-exist.json"), "does-not-exist.json"),
        (("replay", "--scheduler", "nonsense", "CASE"), "nonsense"),
        (("replay", "--set", "block_size=0", "CASE"), "block_size"),
        (("replay", "--set", "oops", "CASE"), "oops"),
        (("replay", "--set", "colour=blue", "CASE"), "colour"),
        (("check", "missing-trace.jsonl"), "missing-trace.jsonl"),
    ],
)
def test_bad_input_exits_2_without_traceback(args, needle):
    args = tuple(str(CASES["slot-freed-is-reused"]) if a == "CASE" else a for a in args)
    result = run(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert needle in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_check_accepts_a_reference_trace_and_rejects_a_tampered_one(tmp_path):
    from schedspec.reference.scenarios import load_scenario, replay
    from schedspec.spec.config import SchedulerConfig
    from schedspec.spec.trace import write_trace

    scenario = load_scenario(CASES["kv-pressure-no-thrash"])
    result = replay(scenario)
    config = SchedulerConfig.from_dict(scenario.config)
    good = tmp_path / "good.jsonl"
    with good.open("w") as out:
        write_trace(out, config, result.run.records, "fcfs")
    checked = run("check", str(good))
    assert checked.returncode == 0, checked.stdout + checked.stderr

    lines = good.read_text().splitlines()
    record = json.loads(lines[3])
    record["scheduled"][0]["prefill_tokens"] += 50  # blow the token budget
    lines[3] = json.dumps(record)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    checked = run("check", str(bad))
    assert checked.returncode == 1
    assert "token-budget" in checked.stdout


def test_check_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    good = CASES["kv-pressure-no-thrash"]
    config = json.loads(good.read_text())["config"]
    config.pop("policy")
    path.write_text(json.dumps({"schema_version": 1, "config": config}) + "\n{not json\n")
    result = run("check", str(path))
    assert result.returncode == 2
    assert "t.jsonl:2" in result.stderr


def test_package_main_module_exists():
    assert (Path(__file__).resolve().parents[1] / "schedspec" / "__main__.py").is_file()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device whose writes fail: disk full)")
def test_a_full_standard_output_is_one_line_not_a_traceback():
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "schedspec", "prove", "--list"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["schedspec: error: cannot write the output: No space left on device"]


def test_one_scheduler_registry_feeds_the_help_the_known_names_and_every_command(monkeypatch):
    """An entry added to the registry is in the --scheduler help's source, in the list an unknown name
    prints, and runs in `schedspec lab` and `schedspec replay` (no second table to add it to)."""
    from click.testing import CliRunner

    from schedspec.cli import cli
    from schedspec.cli_common import scheduler_names_help
    from schedspec.reference.scheduler import REGISTRY, SCHEDULERS, RegisteredScheduler, names

    assert list(SCHEDULERS) == names("reference")
    assert set(REGISTRY) == {*names("reference"), *names("engine-adapter"), *names("engine-profile")}
    monkeypatch.setitem(REGISTRY, "fcfs-again", RegisteredScheduler("fcfs-again", "reference", factory=SCHEDULERS["fcfs"]))
    assert "fcfs-again" in scheduler_names_help() and "fcfs-again" in SCHEDULERS
    runner = CliRunner()
    lab = runner.invoke(cli, ["lab", "--scheduler", "fcfs-again", "--max-requests", "5", "--steps", "none", "--json"])
    assert lab.exit_code == 0, lab.output
    assert json.loads(lab.stdout)["figures"]["requests_finished"] == 5
    scenario = str(next(iter(bundled_scenarios())))
    replay = runner.invoke(cli, ["replay", scenario, "--scheduler", "fcfs-again"])
    assert replay.exit_code in (0, 1, 3), replay.output  # judged, not refused as an unknown name
    unknown = runner.invoke(cli, ["lab", "--scheduler", "no-such", "--max-requests", "5"])
    assert unknown.exit_code == 2 and "fcfs-again" in unknown.output
