"""Bad input, second round (issue 28): silent wrong answers, size, misleading verdicts, messages, docs and
defaults. Each cause is fixed as a class; each case of the issue has an explicit test here, and the CLI
fuzz test (``tests/test_bad_input.py``) is extended by :func:`test_cli_fuzz_second_round` to these
surfaces (several-request scenarios with aborts, ``replay --all --scheduler``, Mooncake lines).

The contract is that of ``tests/test_bad_input.py`` (:func:`invoke` asserts it on every run).
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedspec.lab import trace_formats
from schedspec.lab.workload_checks import WorkloadError
from schedspec.reference.scenarios import (
    ScenarioError,
    bundled_scenarios,
    judged_on,
    load_scenario,
    parse_scenario,
    replay,
)
from schedspec.reference.scheduler import SCHEDULERS
from schedspec.spec.workload import RequestSpec
from tests.test_bad_input import MOONCAKE_SYNTHETIC, _mutate, invoke, scenario

# --------------------------------------------------------------------------------------------------
# Silent wrong answers: input accepted whose effect is silently lost


def _aborting(abort: int, arrival: int = 3) -> bytes:
    data = json.loads(scenario())
    data["requests"][0].update(arrival_step=arrival, abort_at_step=abort)
    data["expect"] = {}
    return json.dumps(data).encode()


def test_an_abort_before_the_arrival_is_refused(tmp_path):
    """Before: the engine met the abort while the request did not exist yet, dropped it, and the request
    ran to the end; the replay passed."""
    result = invoke("replay", {"c.json": _aborting(abort=1)}, ("-q", "{c.json}"), tmp_path)
    assert result.exit_code == 2, result.stdout
    assert "c.json: requests[0].abort_at_step: 1 is before arrival_step 3" in result.stderr
    # at the arrival step itself the abort is applied (arrivals come first): accepted, and the request aborted
    ok = parse_scenario(json.loads(_aborting(abort=3)))
    run = replay(ok).run
    assert run.state.finished["A"].status.outcome == "aborted"


def test_a_request_spec_refuses_an_abort_before_its_arrival():
    """The same class where workloads are built in code (the engine's input): steps and seconds."""
    with pytest.raises(ValueError, match="abort_at_step=1 is before arrival_step=2"):
        RequestSpec("a", 4, 4, arrival_step=2, abort_at_step=1)
    with pytest.raises(ValueError, match=r"abort_at_time=0.5 s is before arrival_time=1 s"):
        RequestSpec("a", 4, 4, arrival_time=1.0, abort_at_time=0.5)
    RequestSpec("a", 4, 4, arrival_step=2, abort_at_step=2)
    RequestSpec("a", 4, 4, arrival_time=1.0, abort_at_time=1.0)


def test_a_mooncake_key_given_twice_is_refused(tmp_path):
    """Before: ``json.loads`` kept the last ``input_length``; the step trace and scenario readers refuse a
    repeated key, so the Mooncake reader does too (a NaN is refused naming its field)."""
    line = b'{"timestamp": 0, "input_length": 28, "input_length": 9000, "output_length": 4, "hash_ids": [1]}\n'
    path = tmp_path / "m.jsonl"
    path.write_bytes(MOONCAKE_SYNTHETIC + line)
    with pytest.raises(WorkloadError, match=r"m.jsonl:5: not valid JSON: key .input_length. appears twice"):
        trace_formats.load_mooncake_jsonl(path)
    result = invoke("lab", {"m.jsonl": MOONCAKE_SYNTHETIC + line}, ("--trace", "{m.jsonl}"), tmp_path)
    assert result.exit_code == 2 and "m.jsonl:5: not valid JSON: key 'input_length' appears twice" in result.stderr
    path.write_bytes(MOONCAKE_SYNTHETIC.replace(b'"timestamp": 529', b'"timestamp": NaN'))
    with pytest.raises(WorkloadError, match=r"m.jsonl:1: timestamp=nan"):
        trace_formats.load_mooncake_jsonl(path)


def test_a_csv_column_given_twice_is_refused(tmp_path):
    """The same class in the CSV readers: a required column named twice (the first was silently used)."""
    path = tmp_path / "t.csv"
    path.write_bytes(b"TIMESTAMP,ContextTokens,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,9,44\n")
    with pytest.raises(WorkloadError, match=r"t.csv:1: header: column 'ContextTokens' appears 2 times"):
        trace_formats.load_azure_csv(path)


# --------------------------------------------------------------------------------------------------
# Misleading verdicts


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_replay_all_on_one_scheduler_judges_what_applies(tmp_path, name):
    """Before: ``replay --all --scheduler fcfs`` judged every counterexample and finding on fcfs (10 failed).
    Now a scenario written for another scheduler is judged as the conformance suite judges it."""
    result = invoke("replay", {}, ("--all", "-q", "--scheduler", name), tmp_path)
    assert result.exit_code in (0, 3), result.stdout[-3000:]
    assert re.search(r"\d+ passed, 0 failed", result.stdout), result.stdout[-2000:]
    if name == "fcfs":
        assert "not judged on fcfs (written for static): demonstrates" in result.stdout


def test_a_scenario_on_its_own_scheduler_is_judged_on_everything():
    path = next(p for p in bundled_scenarios() if p.stem == "counterexample-static-work-conserving")
    case = load_scenario(path)
    assert judged_on(case, "static") == (case, ())
    other, left_out = judged_on(case, "fcfs")
    assert "demonstrates" in left_out and "demonstrates" not in other.expect
    conformance, left_out = judged_on(case, "static", fault_records=False)
    assert "demonstrates" in left_out
    # and the judgment can still fail: a bound the scheduler misses on its own scenario is a failure
    data = json.loads(scenario())
    data["expect"]["first_token_by_step"] = {"C": 0}
    assert not replay(parse_scenario(data), "fcfs").passed


def test_the_conformance_suite_without_a_scheduler_is_a_usage_error(pytester):
    """Before: every test skipped and the run exited 0, so a CI with a misspelt option stayed green."""
    result = pytester.runpytest("--pyargs", "schedspec.conformance", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*schedspec.conformance: no scheduler given: pass --schedspec-scheduler=NAME*"])
    # a misspelt ini key is the same run: no scheduler
    pytester.makeini("[pytest]\nschedspec_schedular = fcfs\n")
    result = pytester.runpytest("--pyargs", "schedspec.conformance", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


pytest_plugins = ["pytester"]


# --------------------------------------------------------------------------------------------------
# The fuzz test, extended to these surfaces

MOONCAKE_PIECES = [b'"input_length": 3, ', b'"timestamp": 1, ', b'"output_length": NaN, ', b'"hash_ids": [1], ']


@st.composite
def second_round_cases(draw):
    kind = draw(st.sampled_from(["aborts", "all", "mooncake"]))
    if kind == "aborts":  # several requests, arrivals and aborts in any order
        data = json.loads(scenario())
        for request in data["requests"]:
            request["arrival_step"] = draw(st.integers(0, 6))
            if draw(st.booleans()):
                request["abort_at_step"] = draw(st.integers(0, 8))
        data["expect"] = {k: v for k, v in data["expect"].items() if draw(st.booleans())}
        return "replay", {"c.json": json.dumps(data).encode()}, ("-q", "{c.json}")
    if kind == "all":
        name = draw(st.sampled_from([*sorted(SCHEDULERS), "nope", "fcfs,static"]))
        return "replay", {}, ("--all", "-q", "--scheduler", name)
    data = bytearray(MOONCAKE_SYNTHETIC)
    for _ in range(draw(st.integers(0, 2))):  # keys given twice, NaN, ...
        at = data.index(b"{", draw(st.integers(0, len(data) - 1)) // 2) + 1
        data[at:at] = draw(st.sampled_from(MOONCAKE_PIECES))
    return "lab", {"m.jsonl": _mutate(draw, bytes(data))}, ("--trace", "{m.jsonl}", "--steps", "none")


@settings(max_examples=min(settings().max_examples, 60), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=second_round_cases())
def test_cli_fuzz_second_round(tmp_path_factory, case):
    command, files, args = case
    result = invoke(command, files, args, tmp_path_factory.mktemp("fuzz"))
    if command == "replay" and "--all" in args and result.exit_code != 2:
        assert " 0 failed" in result.stdout, result.stdout[-2000:]  # no scheduler fails what it does not promise


# --------------------------------------------------------------------------------------------------
# Size


def test_arrivals_share_the_live_map_and_equal_the_plain_copy():
    """``add_request`` extended the live map by copying it (a burst of n arrivals cost O(n^2)); now a large
    map is shared (:func:`~schedspec.spec.persistent.with_arrival`). Tested equal to the plain definition
    ``{**requests, id: request}`` across the size where sharing starts, and through a step and an abort."""
    from schedspec.spec.config import SchedulerConfig
    from schedspec.spec.persistent import SHARED_FROM, ArrivedRequests
    from schedspec.spec.state import SchedulerState
    from schedspec.spec.transitions import abort_request, add_request

    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    state, plain = SchedulerState.initial(config), {}
    for index in range(SHARED_FROM + 300):
        request = RequestSpec(f"r{index}", 3, 2, arrival_step=0).to_request(0)
        state = add_request(state, request)
        plain = {**plain, request.request_id: request}
        if index in (0, SHARED_FROM - 1, SHARED_FROM, SHARED_FROM + 299):
            assert dict(state.requests) == plain and list(state.requests) == list(plain)
            assert len(state.requests) == len(plain) and state.waiting == tuple(plain)
    assert isinstance(state.requests, ArrivedRequests)  # shared (the fast path is exercised)
    with pytest.raises(TypeError):
        state.requests["x"] = None  # read-only, as the MappingProxyType it stands for
    aborted = abort_request(state, "r7")
    assert "r7" not in aborted.requests and aborted.finished["r7"].status.outcome == "aborted"
    assert dict(aborted.requests) == {k: v for k, v in plain.items() if k != "r7"}
    assert state == SchedulerState(requests=plain, waiting=tuple(plain), free_block_ids=state.free_block_ids,
                                   num_requests_added=len(plain))


def test_a_scenario_has_a_size_limit(tmp_path, monkeypatch):
    from schedspec.reference import scenarios

    monkeypatch.setattr(scenarios, "MAX_REQUESTS", 2)
    with pytest.raises(ScenarioError, match=r"requests: 3 requests, more than the 2 a scenario may list"):
        parse_scenario(json.loads(scenario()))
    monkeypatch.setattr(scenarios, "MAX_SCENARIO_BYTES", 100)
    path = tmp_path / "c.json"
    path.write_bytes(scenario())
    with pytest.raises(ScenarioError, match=r"larger than the 100 a scenario file may have"):
        load_scenario(path)


# --------------------------------------------------------------------------------------------------
# Messages


def test_messages_carry_no_python_reprs(tmp_path):
    from schedspec.spec.config import ConfigError, SchedulerConfig
    from schedspec.spec.trace import TraceFormatError, open_trace

    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=32)
    with pytest.raises(ConfigError, match="colour='blue': is not a SchedulerConfig field"):  # was attrs' TypeError
        config.with_changes(colour="blue")
    result = invoke("diff", {}, ("--scheduler", "fcfs", "--against", "static", "--set", "colour=blue"), tmp_path)
    assert result.exit_code == 2 and "__init__()" not in result.stderr and "colour" in result.stderr
    with pytest.raises(TraceFormatError) as error:
        open_trace(tmp_path / "s\x00t")
    assert "PosixPath" not in str(error.value)
    result = invoke("prove", {}, ("--only", "no-such-theorem", "--list"), tmp_path)
    assert result.exit_code == 2 and "--only no-such-theorem: no theorem matches" in result.stderr


def test_a_long_schema_error_keeps_what_is_wrong(tmp_path):
    from tests.test_bad_input import step_trace

    data = step_trace(1, lambda r: r.__setitem__("scheduled", [{"request_id": "A" * 300, "prefill_tokens": "x"}]))
    result = invoke("check", {"s.jsonl": data}, ("{s.jsonl}",), tmp_path)
    assert result.exit_code == 2
    assert re.search(r"is not of type|is a required property|not valid", result.stderr), result.stderr


def test_limits_are_stated(tmp_path):
    data = b"Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1e300,ChatGPT,4,4,8,Conversation log\n"
    result = invoke("lab", {"b.csv": data}, ("--trace", "{b.csv}"), tmp_path)
    assert result.exit_code == 2 and "a number in [0, 1e+12] (about 31,700 years)" in result.stderr
    # a trace spanning 10,000 years at time scale 1: the trace's span is the problem, not --time-scale
    far = b"Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n0,ChatGPT,4,4,8,x\n" \
          b"315576000000,ChatGPT,4,4,8,x\n"
    path = tmp_path / "far.csv"
    path.write_bytes(far)
    from schedspec.lab.windows import select_window

    with pytest.raises(WorkloadError, match=r"its arrivals span 3.16e\+11 s \(1e\+04 years\).*shorter window") as error:
        select_window(trace_formats.load_trace(path))
    assert "time_scale" not in str(error.value)
    result = invoke("lab", {}, ("--slo", "queueing=1s"), tmp_path)
    assert result.exit_code == 2 and "queueing" in result.stderr.split("known:")[1]


def test_a_request_id_with_a_newline_stays_on_its_line(tmp_path):
    data = scenario().replace(b'"C"', b'"C\\nFAKE PASS"')
    result = invoke("replay", {"c.json": data}, ("{c.json}",), tmp_path)
    assert result.exit_code == 0, result.stdout
    assert not any(line.startswith("FAKE PASS") for line in result.stdout.splitlines())
    assert "C\\nFAKE PASS" in result.stdout


def test_plural_and_one_line_violations(tmp_path):
    from schedspec.cli_common import plural
    from tests.test_bad_input import step_trace

    assert (plural(1, "violation"), plural(2, "violation"), plural(1000, "step")) == ("1 violation", "2 violations",
                                                                                      "1,000 steps")
    data = step_trace(1, lambda r: r.__setitem__("num_free_blocks", r["num_free_blocks"] + 1))
    result = invoke("check", {"s.jsonl": data}, ("{s.jsonl}", "--max-violations", "1"), tmp_path)
    assert result.exit_code == 1 and " 1 violation " in result.stdout


def _fake_interpreter(tmp_path, stderr: str) -> str:
    (tmp_path / "stderr.txt").write_text(stderr)
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\ncat '{tmp_path / 'stderr.txt'}' >&2\nexit 1\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("stderr", ["", "Traceback (most recent call last):\n  File \"w.py\", line 3, in <module>\n"
                                        "ModuleNotFoundError: No module named vllm\n"])
def test_a_dead_vllm_worker_message(tmp_path, monkeypatch, stderr):
    """Before: ``vLLM worker died (exit 1): `` (empty), or the traceback folded into one long line."""
    from schedspec.engines import vllm

    python = _fake_interpreter(tmp_path, stderr)
    monkeypatch.setenv(vllm.PYTHON_VARIABLE, python)
    worker = vllm._WorkerProcess(vllm.vllm_python())
    try:
        with pytest.raises(vllm.EngineError) as error:
            worker.call({"op": "ping"})
    finally:
        worker.close()
    message = str(error.value)
    assert "\n" not in message and vllm.PYTHON_VARIABLE in message and python in message
    assert ("ModuleNotFoundError: No module named vllm" in message and "File " not in message) if stderr \
        else "printed nothing" in message
