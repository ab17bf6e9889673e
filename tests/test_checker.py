"""``schedspec check`` and the engine loop judge what they are given: the engine traces with known
verdicts, malformed records as unusable input, one verdict per fault at the step that caused it, the
stop conditions stated in the trace, and a scheduler whose own state departs from the spec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from schedspec.reference.engine import Engine
from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
from schedspec.reference.scheduler import ReferenceScheduler, make_scheduler
from schedspec.spec.checker import DEFAULT_PROPERTIES, check_trace
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import INVARIANT_NAMES
from schedspec.spec.rules import RULE_NAMES
from schedspec.spec.state import StepPlan
from schedspec.spec.trace import open_trace, write_trace
from schedspec.spec.workload import RequestSpec

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_TRACES = ROOT / "schedspec" / "data" / "engine-traces"
SHARED_TRACES = ROOT.parent / "shared" / "engine-traces"
CASES = {p.stem: p for p in bundled_scenarios()}


def check(*args: str) -> subprocess.CompletedProcess:
    """``schedspec check ARGS`` in a subprocess; in-process through click's runner when
    SCHEDSPEC_TESTS_IN_PROCESS is set (scripts/mutmut.sh: mutmut only sees code run in its own process)."""
    if os.environ.get("SCHEDSPEC_TESTS_IN_PROCESS"):
        from click.testing import CliRunner

        from schedspec.cli import cli

        result = CliRunner().invoke(cli, ["check", *args], prog_name="schedspec")
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)
    return subprocess.run([sys.executable, "-m", "schedspec", "check", *args], capture_output=True, text=True,
                          timeout=600)


def test_bundled_engine_traces_match_shared():
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"{SHARED_TRACES} is not present on this machine; the bundled copies are checked where it is")
    shared = {p.name: p.read_bytes() for p in SHARED_TRACES.iterdir()}
    bundled = {p.name: p.read_bytes() for p in BUNDLED_TRACES.iterdir()}
    assert bundled == shared


# The verdicts of ../shared/engine-traces/README.md: (first illegal step, words the report must contain).
EXPECTED = {
    "t07-leak-in-blocks-freed-only": (3, "blocks_freed [0, 1], but it released [0, 1, 2]"),
    "t07-blocks-freed-bogus": (3, "blocks_freed [0, 1, 2, 63, 63], but it released [0, 1, 2]"),
    "t11-idle-engine": (None, "property progress"),
    "s18-token-after-abort": (3, "rule known-requests (request A): not a live request"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_engine_traces_give_their_verdict(name):
    result = check(str(BUNDLED_TRACES / f"{name}.jsonl"), "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    verdict = json.loads(result.stdout)
    step, words = EXPECTED[name]
    assert verdict["first_bad_step"] == step
    text = check(str(BUNDLED_TRACES / f"{name}.jsonl")).stdout
    assert words in text
    if step is not None:
        assert {v["step"] for v in verdict["violations"]} == {step}, "every violation blamed on the bad step"


def test_idle_engine_fails_by_default_and_names_progress():
    verdict = json.loads(check(str(BUNDLED_TRACES / "t11-idle-engine.jsonl"), "--json").stdout)
    assert "progress" in verdict["properties"]
    names = [v["name"] for v in verdict["violations"]]
    assert names[0] == "progress" and set(names) == {"progress", "unfinished-request"}, names
    assert verdict["notes"], "a version-1 trace says which convention it was read with"
    window = json.loads(check(str(BUNDLED_TRACES / "t11-idle-engine.jsonl"), "--json", "--allow-unfinished").stdout)
    assert [v["name"] for v in window["violations"]] == ["progress"]


def _good_trace(tmp_path: Path) -> tuple[Path, list[dict]]:
    scenario = load_scenario(CASES["kv-pressure-no-thrash"])
    result = replay(scenario)
    config = SchedulerConfig.from_dict({k: v for k, v in scenario.config.items() if k != "policy"})
    path = tmp_path / "good.jsonl"
    with path.open("w") as out:
        write_trace(out, config, result.run.records, "fcfs")
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def _write(tmp_path: Path, lines: list[dict], name: str = "bad.jsonl", raw: dict[int, str] | None = None) -> Path:
    texts = [json.dumps(line) for line in lines]
    for index, text in (raw or {}).items():
        texts[index] = text
    path = tmp_path / name
    path.write_text("\n".join(texts) + "\n")
    return path


def test_tampered_step_is_the_first_illegal_step_and_nothing_cascades(tmp_path):
    path, lines = _good_trace(tmp_path)
    assert check(str(path)).returncode == 0
    lines[3]["scheduled"][0]["prefill_tokens"] += 50  # blow the token budget in step 2
    result = check(str(_write(tmp_path, lines)), "--json")
    assert result.returncode == 1
    verdict = json.loads(result.stdout)
    assert verdict["first_bad_step"] == 2 and verdict["valid_prefix"] == 2
    assert {v["step"] for v in verdict["violations"]} == {2}
    assert "token-budget" in {v["name"] for v in verdict["violations"]}
    assert {v["kind"] for v in verdict["violations"]} <= {"rule", "invariant", "property", "mismatch"}
    assert "FIRST ILLEGAL STEP 2" in check(str(_write(tmp_path, lines))).stdout


def test_check_prints_each_violations_stable_code(tmp_path):
    """--json gives every violation its ``Violation.code`` (the rule's name for an uncased rule: the
    token-budget break above), the same codes ``check_trace`` reports on the same file."""
    path, lines = _good_trace(tmp_path)
    lines[3]["scheduled"][0]["prefill_tokens"] += 50
    bad = _write(tmp_path, lines)
    verdict = json.loads(check(str(bad), "--json").stdout)
    assert "token-budget" in {v["code"] for v in verdict["violations"]}
    opened = open_trace(str(bad))
    report = check_trace(opened.config, opened.records(), DEFAULT_PROPERTIES)
    assert [(v["name"], v["code"]) for v in verdict["violations"]] == [(v.name, v.code) for v in report.violations]


def test_check_text_names_the_case_of_a_cased_violation(tmp_path, monkeypatch):
    """A violation whose code names a case (``name:case``) shows the code after its message in the text and
    under "code" in --json; one whose code is its name adds nothing to the text."""
    from click.testing import CliRunner

    from schedspec.cli import cli
    from schedspec.commands import check as check_command
    from schedspec.spec.checker import CheckReport
    from schedspec.spec.rules import Violation

    cased = Violation("block-conservation", "r0 finished but owns [3]", 2, "r0", kind="invariant",
                      code="block-conservation:terminal-owns-blocks")
    plain = Violation("token-budget", "9 tokens scheduled > 8", 2, kind="rule")
    monkeypatch.setattr(check_command, "check_trace", lambda *args, **kwargs: CheckReport(
        violations=[cased, plain], steps_checked=3, first_bad_step=2, valid_prefix=2))
    monkeypatch.setenv("SCHEDSPEC_NO_FAST_PATH", "1")  # else the legal trace is certified without check_trace
    path, _ = _good_trace(tmp_path)
    text = CliRunner().invoke(cli, ["check", str(path)]).stdout.splitlines()
    assert f"VIOLATION {cased} [code block-conservation:terminal-owns-blocks]" in text
    assert f"VIOLATION {plain}" in text
    verdict = json.loads(CliRunner().invoke(cli, ["check", str(path), "--json"]).stdout)
    assert [v["code"] for v in verdict["violations"]] == ["block-conservation:terminal-owns-blocks", "token-budget"]


def test_a_trace_that_ends_with_live_requests_fails_unless_it_is_a_window(tmp_path):
    """An engine that crashed (or starves a request) cannot pass by its log ending early: the last steps
    cut off, the requests still live are each an unfinished-request mismatch; --allow-unfinished judges
    the same lines as a window of a running engine's log (the header is line 0)."""
    path, lines = _good_trace(tmp_path)
    assert check(str(path)).returncode == 0
    cut = _write(tmp_path, lines[:6])
    result = check(str(cut), "--json")
    assert result.returncode == 1
    verdict = json.loads(result.stdout)
    assert verdict["first_bad_step"] is None and verdict["violations"]
    assert {v["name"] for v in verdict["violations"]} == {"unfinished-request"}
    assert all(v["step"] == 4 and v["request_id"] for v in verdict["violations"])
    assert check(str(cut), "--allow-unfinished").returncode == 0


@pytest.mark.parametrize("field, value, says", [
    ("arrival_step", 5, "arrival_step 5, but the trace adds it before step 0"),
    ("arrival_time", 1e6, "is after the start of step 0"),
    ("abort_at_step", 1, "abort_at_step 1, but it is still live and not aborted in step 1"),
    ("eos_at_output", 1, "eos_at_output 1, but output 1 was sampled as"),
])
def test_an_arrival_whose_own_fields_disagree_with_the_trace_fails(tmp_path, field, value, says):
    """The fields of an arrival are judged, not only read: its step and time, and the workload's events
    it names (an abort at a step, an EOS at an output) must be what the trace shows happening."""
    path, lines = _good_trace(tmp_path)
    arrival = lines[1]["arrivals"][0]
    assert lines[1]["step"] == 0 and arrival.get(field) in (None, 0, 0.0)
    arrival[field] = value
    result = check(str(_write(tmp_path, lines)), "--json")
    assert result.returncode == 1, result.stdout
    details = [v["detail"] for v in json.loads(result.stdout)["violations"]]
    assert any(says in d for d in details), details


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.pop("scheduled"), "scheduled"),
    (lambda r: r.__setitem__("step", "one"), "step"),
    (lambda r: r.__setitem__("num_free_blocks", -1), "num_free_blocks"),
    (lambda r: r["scheduled"][0].__setitem__("prefill_tokens", 10**20), "scheduled[0].prefill_tokens"),
    (lambda r: r.__setitem__("surprise", 1), "surprise"),
    (lambda r: r["arrivals"][0].pop("eos_token_id") if r["arrivals"] else r.pop("arrivals"), "eos_token_id"),
])
def test_malformed_record_is_unusable_input_naming_line_and_field(tmp_path, edit, field):
    path, lines = _good_trace(tmp_path)
    edit(lines[1])
    result = check(str(_write(tmp_path, lines)))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "bad.jsonl:2: field " in result.stderr
    assert field.split(".")[0].split("[")[0] in result.stderr or "eos_token_id" in result.stderr


@pytest.mark.parametrize("text, words", [
    ('{"step": 0, "start_time": NaN}', "NaN is not a finite number"),
    ('{"step": 0, "step": 1}', "appears twice"),
    ("{not json", "not JSON"),
])
def test_unparseable_record_is_unusable_input(tmp_path, text, words):
    path, lines = _good_trace(tmp_path)
    result = check(str(_write(tmp_path, lines, raw={1: text})))
    assert result.returncode == 2
    assert words in result.stderr and "bad.jsonl:2:" in result.stderr


def test_non_utf8_record_is_unusable_input(tmp_path):
    path, _ = _good_trace(tmp_path)
    data = path.read_bytes().split(b"\n")
    data[2] = data[2].replace(b'"step"', b'"st\xffep"', 1)
    bad = tmp_path / "bytes.jsonl"
    bad.write_bytes(b"\n".join(data))
    result = check(str(bad))
    assert result.returncode == 2 and "bytes.jsonl:3: not UTF-8" in result.stderr


def test_prefix_caching_trace_is_judged(tmp_path):
    """A caching-off run's trace relabelled as caching on is judged, not refused (exit 3 before prefix
    caching was specified): with caching on, a request preempted under KV pressure is re-admitted without
    the hit on its own published blocks (rule prefix-hit-longest), and the cached blocks the run hands out
    are not reported evicted (tests/test_prefix_cache.py checks legal caching traces)."""
    path, lines = _good_trace(tmp_path)
    lines[0]["config"]["enable_prefix_caching"] = True
    result = check(str(_write(tmp_path, lines)))
    assert result.returncode == 1, result.stderr
    assert "prefix-hit-longest" in result.stdout and "blocks_evicted" in result.stdout, result.stdout


def test_stop_conditions_come_from_the_trace(tmp_path):
    """A request that samples token 0 stops only if the trace says 0 is its EOS (no hidden default)."""
    path, lines = _good_trace(tmp_path)
    arrival = lines[1]["arrivals"][0]
    request_id = arrival["request_id"]
    first = next(i for i, line in enumerate(lines[1:], 1) if request_id in line.get("sampled_token_ids", {}))
    for eos, stops in ((0, True), (None, False), (5, False)):
        edited = json.loads(json.dumps(lines))
        edited[1]["arrivals"][0]["eos_token_id"] = eos
        edited[first]["sampled_token_ids"][request_id] = 0
        verdict = json.loads(check(str(_write(tmp_path, edited)), "--json").stdout)
        stopped = any("the spec ends it in this step ('stop')" in v["detail"] for v in verdict["violations"])
        assert stopped == stops, (eos, verdict["violations"][:3])
        assert verdict["first_bad_step"] == (first - 1 if stops else None)


def test_rule_and_invariant_names_are_distinct():
    assert not set(RULE_NAMES) & set(INVARIANT_NAMES)


class IgnoresEos(ReferenceScheduler):
    """A scheduler with a bug: it feeds its own state a non-EOS token where the model sampled EOS."""

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int]) -> tuple[str, ...]:
        return super().update(plan, {r: (t + 1 if t == 0 else t) for r, t in sampled_token_ids.items()})


def test_engine_loop_compares_a_schedulers_own_state_with_the_spec():
    config = SchedulerConfig(block_size=4, num_kv_blocks=32, max_num_batched_tokens=16, max_num_seqs=4,
                             max_model_len=64)
    base = make_scheduler("fcfs", config)
    buggy = IgnoresEos(config, base.plan_function, "ignores-eos", base.guarantees)
    workload = [RequestSpec("A", 6, 10, arrival_step=0, eos_at_output=2)]
    run = Engine(buggy, config).run(workload)
    names = {(v.name, v.kind, v.step) for v in run.violations}
    assert ("refinement", "mismatch", 1) in names, run.violations  # EOS is output 2, sampled in step 1
    assert any(v.name == "state-mismatch" and v.request_id == "A" for v in run.violations)
    assert run.state.finished["A"].finish_reason == "stop", "the shadow follows the spec, not the scheduler"
    clean = Engine(make_scheduler("fcfs", config), config).run(workload)
    assert clean.ok and clean.state.finished["A"].finish_reason == "stop"
