"""Bad input on the surfaces added since issue 28's first round: trace format v4 (KV cache groups), the KV
connector's fields (remote loads, sends, transfer reports), speculative decoding, ``check``'s fast path
(``--no-fast-path``, ``SCHEDSPEC_NO_FAST_PATH``), ``diff --remote-kv``, the engines' environment variables
(``SCHEDSPEC_VLLM_PYTHON``, ``SCHEDSPEC_SGLANG_PYTHON``) and the scenario fields of all of these.

The contract is :func:`tests.test_bad_input.invoke`'s (exit 0/1/2/3, one error line, no traceback, no input
changed); each case also states its exit status and a text the output must hold. Every ``check`` case runs on
both paths and must get the same output: the fast path never certifies what the plain path refuses.

One decision for numbers (docs/trace-format.md): a field the format declares an integer must be written as
one; ``5.0``, ``1e3`` or ``true`` there is unusable input naming the file, the line and the field, in traces
and recordings, scenarios, cost profiles and run records alike.

Cost under the ``ci`` profile: about 20 s on one core (about 330 in-process CLI runs on traces of 4 to 25 steps,
and the Hypothesis fuzz of check's new surfaces at 40 examples).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.trace import StepRecord, write_trace
from schedspec.trace_mutations import hybrid_trace
from tests.test_bad_input import STEPS, invoke

CASES_FOLDER = {p.stem: p for p in bundled_scenarios()}


def _scenario_trace(stem: str) -> str:
    case = load_scenario(CASES_FOLDER[stem])
    config = SchedulerConfig.from_dict({k: v for k, v in case.config.items() if k != "policy"})
    out = io.StringIO()
    write_trace(out, config, replay(case).run.records, "fcfs")
    return out.getvalue()


def _hybrid_trace() -> str:
    _, trace = hybrid_trace()
    out = io.StringIO()
    write_trace(out, trace.config, [StepRecord.from_dict(r) for r in trace.records], "fcfs")
    return out.getvalue()


BASES = {
    "plain": STEPS.decode(),  # version 2, preempts
    "remote": _scenario_trace("remote-kv-load-fails-recomputes"),  # KV loads, a failed one
    "send": _scenario_trace("remote-kv-send-holds-blocks"),  # a KV send, delayed frees
    "spec": _scenario_trace("spec-eos-inside-accepted-drafts"),  # version 3
    "hybrid": _hybrid_trace(),  # version 4: KV cache groups, sliding windows
}
BASES["hybrid-window"] = "\n".join(BASES["hybrid"].splitlines()[:13]) + "\n"  # 12 steps: --allow-unfinished


def edited(base: str, line: int, edit) -> str:
    """``BASES[base]`` with line ``line`` (0: the header) parsed, passed to ``edit`` and written back."""
    lines = BASES[base].splitlines()
    data = json.loads(lines[line])
    edit(data)
    lines[line] = json.dumps(data)
    return "\n".join(lines) + "\n"


def with_token(base: str, line: int, path: tuple, token: str) -> str:
    """``BASES[base]`` with the value at ``path`` of line ``line`` written as the raw JSON ``token``."""
    lines = BASES[base].splitlines()
    data = json.loads(lines[line])
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = "@TOKEN@"
    lines[line] = json.dumps(data).replace('"@TOKEN@"', token)
    return "\n".join(lines) + "\n"


def first_line_with(base: str, field: str) -> int:
    return next(i for i, line in enumerate(BASES[base].splitlines()) if i and json.loads(line).get(field))


def _field(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# --------------------------------------------------------------------------------------------------
# 1. Numbers: an integer field written as a float, a bool, a huge value, NaN or Infinity, on every surface

INTEGER_FIELDS = [  # (base, line, path): integer fields of every version and feature
    ("plain", 1, ("arrivals", 0, "prompt_len")), ("plain", 1, ("arrivals", 0, "max_tokens")),
    ("plain", 1, ("arrivals", 0, "eos_token_id")), ("plain", 1, ("arrivals", 0, "priority")),
    ("plain", 1, ("scheduled", 0, "prefill_tokens")), ("plain", 1, ("num_free_blocks",)), ("plain", 1, ("step",)),
    ("remote", 1, ("arrivals", 0, "num_external_computed_tokens")), ("remote", 1, ("arrivals", 0, "kv_load_steps")),
    ("remote", 1, ("arrivals", 0, "kv_load_invalid_block")), ("remote", 1, ("kv_loads", "A")),
    ("send", 1, ("arrivals", 0, "kv_send_steps")),
]
NUMBER_TOKENS = [  # (token, what the message says)
    ("5.0", "is not of type 'integer'"), ("1e3", "is not of type 'integer'"), ("true", "True"),
    ("100000000000000000000", "greater than the maximum"), ("NaN", "NaN is not a finite number"),
    ("-Infinity", "-Infinity is not a finite number"),
    ("5.9999999999999999", "is not of type 'integer'"),  # reads as 6.0 with no ".0" in its text (found in review)
]


def check_both_paths(tmp_path: Path, text: str, *extra: str, env: dict | None = None):
    """``check`` on ``text`` by the default (fast-path-first) and the plain path; both results, asserted equal."""
    results = [invoke("check", {"t.jsonl": text.encode()}, (*extra, "{t.jsonl}", *flag), tmp_path, env)
               for flag in ((), ("--no-fast-path",))]
    fast, plain = results
    assert (fast.exit_code, fast.stdout, fast.stderr) == (plain.exit_code, plain.stdout, plain.stderr)
    return fast


@pytest.mark.parametrize(("base", "line", "path"), INTEGER_FIELDS, ids=lambda v: str(v) if isinstance(v, str) else None)
@pytest.mark.parametrize(("token", "needle"), NUMBER_TOKENS, ids=[t for t, _ in NUMBER_TOKENS])
def test_a_number_that_is_not_an_integer_is_unusable_input_on_both_paths(tmp_path, base, line, path, token, needle):
    result = check_both_paths(tmp_path, with_token(base, line, path, token))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert f"t.jsonl:{line + 1}: " in result.stderr and needle in result.stderr
    if "finite" not in needle:  # NaN and Infinity are refused by the parser, before any field is known
        assert f"field {_field(path)}:" in result.stderr


def test_an_integral_float_in_a_float_field_is_accepted_on_both_paths(tmp_path):
    """The other half of the decision: ``0.0`` and ``1e2`` where the format says a number of seconds are fine, and
    the fast path still certifies such a trace (the line is judged by the definition, not refused)."""
    last = len(BASES["remote"].splitlines()) - 1
    result = check_both_paths(tmp_path, with_token("remote", last, ("duration",), "1e2"))
    assert result.exit_code == 0, result.stdout + result.stderr
    lines = BASES["remote"].splitlines()
    assert '"start_time":0.0' in lines[1]  # the first record of every trace holds an integral float


@pytest.mark.parametrize(("header_path", "value", "needle"), [
    (("config", "block_size"), 16.0, "block_size=16.0: must be an integer"),
    (("config", "num_speculative_tokens"), 2.0, "num_speculative_tokens=2.0"),
    (("config", "kv_cache_groups", 1, "sliding_window"), 8.0, "sliding_window=8.0"),
    (("config", "kv_cache_groups", 1, "sliding_window"), True, "sliding_window=True"),
    (("schema_version",), 4.0, "field schema_version"),
])
def test_a_header_number_that_is_not_an_integer_is_unusable_input(tmp_path, header_path, value, needle):
    base = "spec" if "num_speculative_tokens" in header_path else "hybrid"
    def edit(header):
        target = header
        for key in header_path[:-1]:
            target = target[key]
        target[header_path[-1]] = value
    result = check_both_paths(tmp_path, edited(base, 0, edit))
    assert result.exit_code == 2 and "t.jsonl:1: field" in result.stderr and needle in result.stderr, result.stderr


# --------------------------------------------------------------------------------------------------
# 2. check: the new fields, structure and text

def _check_cases() -> list[tuple[str, str, int, str]]:
    """(what, trace text, exit status, text in the output)."""
    loads, landed = first_line_with("remote", "kv_loads"), first_line_with("remote", "finished_recving")
    sent = first_line_with("send", "finished_sending")
    grouped, skipped = first_line_with("hybrid", "group_blocks_allocated"), first_line_with("hybrid", "blocks_skipped")
    remote = BASES["remote"]
    return [
        ("load for an unknown request", edited("remote", loads, lambda d: d["kv_loads"].update(ghost=4)), 1, "ghost"),
        ("load of 0 tokens", edited("remote", loads, lambda d: d["kv_loads"].update(A=0)), 1, "VIOLATION step 0"),
        ("landing of an unknown request", edited("remote", landed, lambda d: d["finished_recving"].append("ghost")), 1,
         "'ghost': finished_recving at step 1, but it has no remote KV load in flight"),
        ("landing reported twice", edited("remote", landed, lambda d: d["finished_recving"].append(
            d["finished_recving"][0])), 1, "has no remote KV load in flight"),
        ("landing of a request not waiting", edited("remote", 1, lambda d: d.update(finished_recving=["C"])), 1,
         "'C': finished_recving at step 1"),
        ("invalid block not loading", edited("remote", landed, lambda d: d.update(invalid_block_ids=[63])), 1,
         "invalid block 63 at step 1 belongs to no load that lands"),
        ("invalid block negative", edited("remote", landed, lambda d: d.update(invalid_block_ids=[-1])), 1,
         "invalid block -1"),
        ("send of an unknown request", edited("send", sent, lambda d: d["finished_sending"].append("ghost")), 1,
         "'ghost': finished_sending"),
        ("send reported before the request finished", edited("send", 1, lambda d: d.update(finished_sending=["A"])),
         1, "VIOLATION step 0"),
        ("misspelt kv_loads", edited("remote", loads, lambda d: d.update(kv_load=d.pop("kv_loads"))), 2,
         "'kv_load' was unexpected"),
        ("delayed_frees is state, not a field", edited("remote", 1, lambda d: d.update(delayed_frees={"A": [1]})), 2,
         "'delayed_frees' was unexpected"),
        ("group blocks for too few groups", edited("hybrid", grouped, lambda d: d["group_blocks_allocated"].update(
            {k: [v[0]] for k, v in d["group_blocks_allocated"].items()})), 1, "VIOLATION step 0"),
        ("group blocks of a request not scheduled", edited("hybrid", grouped, lambda d: d["group_blocks_allocated"]
                                                           .update(ghost=[[1], [2]])), 1, "not in the step's batch"),
        ("skipped blocks of a request not scheduled", edited("hybrid", skipped, lambda d: d["blocks_skipped"]
                                                             .update(ghost=[1])), 1, "not in the step's batch"),
        ("group fields in version 3", edited("hybrid", 0, lambda d: d.update(schema_version=3)), 2,
         "KV cache groups need schema_version 4"),
        ("group fields without groups", edited("hybrid", 0, lambda d: d["config"].update(kv_cache_groups=[])), 1,
         "but the config has 0"),
        ("window 0", edited("hybrid", 0, lambda d: d["config"]["kv_cache_groups"][1].update(sliding_window=0)), 2,
         "sliding_window=0: must be an integer in [1, 2147483647]"),
        ("misspelt window", edited("hybrid", 0, lambda d: d["config"]["kv_cache_groups"][1].update(sliding_windw=3)),
         2, "t.jsonl:1: field config: kv_cache_groups[]"),
        ("sliding group first", edited("hybrid", 0, lambda d: d["config"]["kv_cache_groups"].reverse()), 2,
         "group 0 must be full_attention"),
        ("drafts in version 2", edited("spec", 0, lambda d: d.update(schema_version=2)), 2,
         "needs schema_version 3"),
        ("asynchronous groups", edited("hybrid", 0, lambda d: d.update(async_scheduling=True)), 3,
         "with async_scheduling: a sliding window"),
        ("asynchronous as a string", edited("plain", 0, lambda d: d.update(async_scheduling="yes")), 2,
         "field async_scheduling"),
        ("unknown header key", edited("plain", 0, lambda d: d.update(colour="blue")), 2, "'colour' was unexpected"),
        ("load before its arrival's transfer exists", edited("remote", 1, lambda d: d["arrivals"][0].update(
            num_external_computed_tokens=0)), 2, "t.jsonl:2: field arrivals[0]: request_id='A': kv_load_steps=1 "
                                                  "without a remote KV load"),
        ("load of more than the prompt", edited("remote", 1, lambda d: d["arrivals"][0].update(
            num_external_computed_tokens=51)), 2, "field arrivals[0]: request_id='A': num_external_computed_tokens=51 "
                                                  "outside [0, prompt_len=50]"),
        ("send schedule without a send", edited("send", 1, lambda d: d["arrivals"][0].pop("kv_send")), 2,
         "kv_send_steps=3 without kv_send"),
        ("id with a lone surrogate", BASES["plain"].replace('"R1"', '"R\\ud800"'), 2,
         "t.jsonl:2: a string holds a lone UTF-16 surrogate"),
        ("id with a surrogate pair", BASES["plain"].replace('"R1"', '"R\\ud83d\\ude00"'), 0, "0 violations"),
        ("id with a newline, in a violation", edited("plain", 1, lambda d: d.update(num_free_blocks=0)).replace(
            '"R1"', '"[red]R\\n1\\u001b[31m"'), 1, "FIRST ILLEGAL STEP 0"),
        ("truncated mid-line", remote[:len(remote) - 40], 2, "not JSON (Unterminated string"),
        ("truncated header", remote[:30], 2, "t.jsonl:1: not JSON"),
        ("empty", "", 2, "t.jsonl:1: empty; expected the header line"),
        ("header only", remote.splitlines()[0] + "\n", 0, "0 steps checked"),
        ("blank lines", remote.replace("\n", "\n\n"), 0, "0 violations"),
        ("CRLF", remote.replace("\n", "\r\n"), 0, "0 violations"),
        ("byte order mark", "\ufeff" + remote, 2, "BOM"),
        ("raw NUL", remote[:200] + "\x00" + remote[200:], 2, "Invalid control character"),
        ("repeated key", remote.replace('"kv_loads":', '"kv_loads":{},"kv_loads":', 1), 2,
         "key 'kv_loads' appears twice"),
        ("record an array", remote.splitlines()[0] + "\n[]\n", 2, "t.jsonl:2: field (the line)"),
        ("nested too deeply", remote.splitlines()[0] + "\n" + "[" * 100000 + "\n", 2, "nested too deeply"),
    ]


CHECK_CASES = _check_cases()


@pytest.mark.parametrize(("what", "text", "status", "needle"), CHECK_CASES, ids=[c[0] for c in CHECK_CASES])
def test_check_case(tmp_path, what, text, status, needle):
    result = check_both_paths(tmp_path, text)
    assert result.exit_code == status, result.stdout + result.stderr
    assert needle in result.stdout + result.stderr


def test_ids_are_printed_escaped_and_as_text(tmp_path):
    """An id with a newline, an ANSI escape and markup, in the state lines of a failing step: one line each,
    escaped, the markup as text."""
    text = edited("plain", 2, lambda d: d.update(num_free_blocks=d["num_free_blocks"] + 1)).replace(
        '"R1"', '"[red]R\\n1\\u001b[31m"')
    result = check_both_paths(tmp_path, text)
    assert result.exit_code == 1
    assert "\x1b" not in result.stdout and "[red]R\\n1\\x1b[31m" in result.stdout, result.stdout


def test_a_folder_and_a_long_line_are_unusable_input(tmp_path, monkeypatch):
    result = invoke("check", {}, ("{folder}",), tmp_path)
    assert result.exit_code == 2 and "not a regular file" in result.stderr
    from schedspec.spec import trace
    monkeypatch.setattr(trace, "MAX_LINE_BYTES", 1000)  # a 100 MB line, scaled down: the same code path
    import schedspec.spec.fast_check as fast_check
    monkeypatch.setattr(fast_check, "MAX_LINE_BYTES", 1000)
    long_id = "x" * 2000
    result = check_both_paths(tmp_path, BASES["plain"].replace('"R1"', f'"{long_id}"'))
    assert result.exit_code == 2 and "t.jsonl:2: a line longer than 1,000 bytes" in result.stderr, result.stderr


@pytest.mark.parametrize("value", ["1", "yes", "0", "", "x\n"])
def test_the_fast_path_variable_changes_no_verdict(tmp_path, value):
    for base, status in (("remote", 0), ("plain", 1)):
        text = BASES[base] if status == 0 else edited(base, 3, lambda d: d.update(num_running=d["num_running"] + 1))
        result = check_both_paths(tmp_path, text, env={"SCHEDSPEC_NO_FAST_PATH": value})
        assert result.exit_code == status


# --------------------------------------------------------------------------------------------------
# 3. Scenarios, --set, schedulers, environment variables, diff, compare, profiles

def scenario(stem: str, edit) -> bytes:
    data = json.loads(CASES_FOLDER[stem].read_text())
    edit(data)
    return json.dumps(data).encode()


def request(index: int, **changes):
    return lambda d: d["requests"][index].update(changes)


def config(**changes):
    return lambda d: d["config"].update(changes)


LOAD = "remote-kv-load-fails-recomputes"
SPEC = "spec-drafts-over-budget"
PLAIN = "slot-freed-is-reused"
GROUPS = [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 4}]

SCENARIO_CASES = [  # (what, edit of which scenario, exit status, text in the output)
    ("load written as a float", LOAD, request(0, num_external_computed_tokens=5.0), 2,
     "requests[0].num_external_computed_tokens: expected an integer in [0, 50], got 5.0"),
    ("load negative", LOAD, request(0, num_external_computed_tokens=-1), 2, "got -1"),
    ("load past the prompt", LOAD, request(0, num_external_computed_tokens=51), 2, "got 51"),
    ("load true", LOAD, request(0, num_external_computed_tokens=True), 2, "got True"),
    ("load steps 0", LOAD, request(0, kv_load_steps=0), 2, "kv_load_steps: expected an integer in [1, 10,000]"),
    ("load steps 1.0", LOAD, request(0, kv_load_steps=1.0), 2, "got 1.0"),
    ("load steps huge", LOAD, request(0, kv_load_steps=10**12), 2, "got 1000000000000"),
    ("invalid block negative", LOAD, request(0, kv_load_invalid_block=-1), 2, "kv_load_invalid_block"),
    ("invalid block past the load", LOAD, request(0, kv_load_invalid_block=3), 2,
     "requests[0].kv_load_invalid_block: 3 is past the load's last block (index 2: num_external_computed_tokens 48 at "
     "block_size 16), so the load would never fail"),
    ("invalid block without a load", PLAIN, request(0, kv_load_invalid_block=0), 2,
     "requests[0]: request_id='A': kv_load_invalid_block=0 without a remote KV load"),
    ("load steps without a load", PLAIN, request(0, kv_load_steps=2), 2, "kv_load_steps=2 without a remote KV load"),
    ("send steps without a send", PLAIN, request(0, kv_send_steps=2), 2, "kv_send_steps=2 without kv_send"),
    ("send as 1", LOAD, request(0, kv_send=1), 2, "kv_send: expected true or false, got 1"),
    ("send steps 2.0", LOAD, request(0, kv_send=True, kv_send_steps=2.0), 2, "got 2.0"),
    ("misspelt load steps", LOAD, request(0, kv_lod_steps=1), 2, "unknown field 'kv_lod_steps'"),
    ("prompt written as a float", LOAD, request(0, prompt_len=50.0), 2, "requests[0].prompt_len"),
    ("drafts negative", SPEC, config(num_speculative_tokens=-1), 2, "config.num_speculative_tokens"),
    ("drafts 3.0", SPEC, config(num_speculative_tokens=3.0), 2, "got 3.0"),
    ("drafts true", SPEC, config(num_speculative_tokens=True), 2, "got True"),
    ("lookahead negative", SPEC, config(num_lookahead_tokens=-2), 2, "config.num_lookahead_tokens"),
    ("misspelt drafts", SPEC, config(num_speculativ_tokens=2), 2, "num_speculativ_tokens: is not a SchedulerConfig"),
    ("window 0", PLAIN, config(kv_cache_groups=[GROUPS[0], {**GROUPS[1], "sliding_window": 0}]), 2,
     "sliding_window: must be an integer in [1, 2147483647]"),
    ("window 4.0", PLAIN, config(kv_cache_groups=[GROUPS[0], {**GROUPS[1], "sliding_window": 4.0}]), 2, "got 4.0"),
    ("misspelt kind", PLAIN, config(kv_cache_groups=[GROUPS[0], {**GROUPS[1], "kind": "sliding_windw"}]), 2,
     "kv_cache_groups[].kind"),
    ("sliding group alone", PLAIN, config(kv_cache_groups=[GROUPS[1]]), 2, "group 0 must be full_attention"),
    ("groups a string", PLAIN, config(kv_cache_groups="full"), 2, "must be a list of groups"),
    ("group with a block size", PLAIN, config(kv_cache_groups=[{"kind": "full_attention", "block_size": 3}]), 2,
     "kv_cache_groups[]: must be"),
    # config integers are bounded by the trace format's 2^31 - 1 (spec.config.MAX_CONFIG_INT)
    ("groups with a huge window", PLAIN, config(kv_cache_groups=[GROUPS[0], {**GROUPS[1], "sliding_window": 10**15}]),
     2, "sliding_window: must be an integer in [1, 2147483647] (tokens) for a sliding_window group (got 10000"),
    ("huge max_model_len", PLAIN, config(max_model_len=10**15), 2,
     "config.max_model_len: must be at most 2147483647 (2^31 - 1) (got 1000000000000000)"),
    ("drafts past 2^31 - 1", SPEC, config(num_speculative_tokens=2**31), 2, "must be at most 2147483647"),
    # vLLM 0.32 SpeculativeConfig.num_speculative_tokens has no maximum (Field(gt=0)): a k of 10^9 runs as no limit
    ("drafts 10^9", SPEC, config(num_speculative_tokens=10**9), 0, "0 failed"),
]


@pytest.mark.parametrize(("what", "stem", "edit", "status", "needle"), SCENARIO_CASES,
                         ids=[c[0] for c in SCENARIO_CASES])
def test_scenario_case(tmp_path, what, stem, edit, status, needle):
    result = invoke("replay", {"c.json": scenario(stem, edit)}, ("-q", "{c.json}"), tmp_path)
    assert result.exit_code == status, result.stdout + result.stderr
    assert needle in result.stdout + result.stderr


SET_CASES = [
    ("num_speculative_tokens=2.0", "num_speculative_tokens=2.0: must be an integer >= 0"),
    ("num_speculative_tokens=1e3", "num_speculative_tokens=1000.0"),
    ("num_speculative_tokens=true", "num_speculative_tokens=True"),
    ('kv_cache_groups=[{"kind":"full_attention"},{"kind":"sliding_window","sliding_window":0}]', "sliding_window=0"),
    ('kv_cache_groups=[{"kind":"full_attention"},{"kind":"sliding_window","sliding_window":2.0}]', "sliding_window=2.0"),
    ("kv_cache_groups=[", "must be a list of groups"),
    ("max_num_seqs=1e2", "max_num_seqs=100.0: must be an integer"),
]


@pytest.mark.parametrize(("command", "args"), [("replay", ("-q", "{c.json}")),
                                               ("lab", ("--max-requests", "3", "--steps", "none"))])
@pytest.mark.parametrize(("setting", "needle"), SET_CASES, ids=[s for s, _ in SET_CASES])
def test_set_case(tmp_path, command, args, setting, needle):
    files = {"c.json": CASES_FOLDER[PLAIN].read_bytes()} if command == "replay" else {}
    result = invoke(command, files, ("--set", setting, *args), tmp_path)
    assert result.exit_code == 2 and result.stderr.startswith("schedspec: error: --set: ") and needle in result.stderr, (
        result.stderr)


ENV_CASES = [  # (variable, value, text in the error)
    ("SCHEDSPEC_VLLM_PYTHON", "/bin/false", "SCHEDSPEC_VLLM_PYTHON=/bin/false: the vLLM worker died before its first reply"),
    ("SCHEDSPEC_VLLM_PYTHON", "/no/such/python", "SCHEDSPEC_VLLM_PYTHON=/no/such/python: no such file"),
    ("SCHEDSPEC_VLLM_PYTHON", "/tmp", "SCHEDSPEC_VLLM_PYTHON=/tmp: is not a file"),
    ("SCHEDSPEC_VLLM_PYTHON", "x\x1b[31m", "SCHEDSPEC_VLLM_PYTHON=x\\x1b[31m: no such file"),
    ("SCHEDSPEC_SGLANG_PYTHON", "/bin/false", "SCHEDSPEC_SGLANG_PYTHON=/bin/false: the SGLang worker died"),
    ("SCHEDSPEC_SGLANG_PYTHON", "/no/such/python", "SCHEDSPEC_SGLANG_PYTHON=/no/such/python: no such file"),
    ("SCHEDSPEC_SGLANG_PYTHON", "[red]x", "SCHEDSPEC_SGLANG_PYTHON=[red]x: no such file"),
]


@pytest.mark.parametrize(("variable", "value", "needle"), ENV_CASES, ids=[f"{v}={x!r}" for v, x, _ in ENV_CASES])
@pytest.mark.parametrize("command", ["replay", "diff"])
def test_an_engine_variable_pointing_nowhere_is_unusable_input(tmp_path, variable, value, needle, command):
    scheduler = "vllm" if "VLLM" in variable else "sglang"
    args = (("-q", "--scheduler", scheduler, "{c.json}") if command == "replay"
            else ("--scheduler", scheduler, "--against", "fcfs", "--examples", "2", "--remote-kv"))
    result = invoke(command, {"c.json": CASES_FOLDER[LOAD].read_bytes()}, args, tmp_path, {variable: value})
    assert result.exit_code == 2 and f"--scheduler {scheduler}: environment variable {needle}" in result.stderr, (
        result.stderr)


@pytest.mark.parametrize(("args", "status", "needle"), [
    (("--scheduler", "fcfs", "--against", "fcfs", "--remote-kv"), 0, "0 divergent"),
    (("--scheduler", "priority", "--against", "fcfs", "--remote-kv"), 3, "does not support remote KV loads"),
    (("--scheduler", "fcfs", "--against", "nope", "--remote-kv"), 2, "--against 'nope': unknown"),
    (("--scheduler", "fcfs", "--against", "fcfs", "--remote-kv", "--out", "{c.json}"), 2, "is a file, not a folder"),
    (("--scheduler", "fcfs", "--against", "static", "--out", "{c.json}/sub"), 2, "is a file, not a folder"),
    (("--scheduler", "[red]x\n", "--against", "fcfs", "--remote-kv"), 2, "--scheduler '[red]x\\\\n': unknown"),
])
def test_diff_case(tmp_path, args, status, needle):
    result = invoke("diff", {"c.json": CASES_FOLDER[PLAIN].read_bytes()}, (*args, "--examples", "2"), tmp_path)
    assert result.exit_code == status, result.stdout + result.stderr
    assert needle in result.stdout + result.stderr


def test_a_diff_case_file_with_a_failed_load_replays(tmp_path):
    """diff --remote-kv draws an invalid block index 0..2 whatever the load's size; a case file it writes leaves
    out an index past the load's blocks (which never fails the load), so that replay accepts the file."""
    from schedspec.commands.diff import case_dict
    from schedspec.spec.workload import RequestSpec
    config = SchedulerConfig(block_size=16, num_kv_blocks=8, max_num_batched_tokens=32, max_num_seqs=2,
                             max_model_len=64)
    specs = [RequestSpec("a", 20, 2, arrival_step=0, num_external_computed_tokens=16, kv_load_steps=1,
                         kv_load_invalid_block=2),
             RequestSpec("b", 20, 2, arrival_step=0, num_external_computed_tokens=17, kv_load_steps=1,
                         kv_load_invalid_block=1)]
    data = case_dict("x", "about", config, specs)
    assert "kv_load_invalid_block" not in data["requests"][0] and data["requests"][1]["kv_load_invalid_block"] == 1
    path = tmp_path / "x.json"
    path.write_text(json.dumps(data))
    assert invoke("replay", {}, ("-q", str(path)), tmp_path).exit_code in (0, 1)


@pytest.fixture(scope="module")
def run_record(tmp_path_factory) -> str:
    """A run record of the lab's default window, 3 requests (``lab --json``)."""
    result = invoke("lab", {}, ("--max-requests", "3", "--steps", "none", "--json"), tmp_path_factory.mktemp("lab"))
    assert result.exit_code == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda d: d["figures"].__setitem__("requests_total", 3.0), "field figures.requests_total: 3.0 is not of type"),
    (lambda d: d["figures"].__setitem__("requests_total", True), "field figures.requests_total: True"),
    (lambda d: d["conditions"]["config"].__setitem__("max_num_seqs", 2.0), "field conditions.config.max_num_seqs"),
], ids=["count-float", "count-bool", "config-float"])
def test_a_run_record_count_written_as_a_float_is_refused(tmp_path, run_record, edit, needle):
    after = json.loads(run_record)
    edit(after)
    result = invoke("compare", {"a.json": run_record.encode(), "b.json": json.dumps(after).encode()},
                    ("{a.json}", "{b.json}"), tmp_path)
    assert result.exit_code == 2 and "b.json:1: " + needle in result.stderr, result.stderr


def test_a_profile_bool_and_its_output_are_refused(tmp_path):
    profile = Path(__file__).resolve().parents[1] / "docs" / "calibration" / "tiny-cpu-profile.json"
    data = json.loads(profile.read_text())
    data["coefficients"][next(iter(data["coefficients"]))] = True
    result = invoke("lab", {"p.json": json.dumps(data).encode()},
                    ("--max-requests", "3", "--steps", "none", "--profile", "{p.json}"), tmp_path)
    assert result.exit_code == 2 and "is not of type 'number'" in result.stderr
    result = invoke("lab", {"p.json": profile.read_bytes()},
                    ("--max-requests", "3", "--steps", "none", "--profile", "{p.json}", "--save", "{p.json}"), tmp_path)
    assert result.exit_code == 2 and "is an input file" in result.stderr


# --------------------------------------------------------------------------------------------------
# 4. The fuzz of check's new surfaces: both paths, byte and field mutations of v3, v4 and KV connector traces

NUMBERS = st.sampled_from(["5.0", "1e3", "true", "-1", "0", "2147483648", "NaN", "1e400", "null", '"7"', "[]", "{}",
                           '"[red]"', '"\\ud800"', '"a\\nb"'])


@st.composite
def check_surface_cases(draw):
    base = draw(st.sampled_from(["remote", "send", "spec", "plain", "hybrid-window"]))
    lines = BASES[base].splitlines()
    line = draw(st.integers(0, len(lines) - 1))
    if draw(st.booleans()):  # one value of one field, written as a raw token
        data = json.loads(lines[line])
        places = []
        def walk(value, path):
            if isinstance(value, dict):
                for key, inner in value.items():
                    places.append((*path, key))
                    walk(inner, (*path, key))
            elif isinstance(value, list):
                for index, inner in enumerate(value[:2]):
                    places.append((*path, index))
                    walk(inner, (*path, index))
        walk(data, ())
        path = draw(st.sampled_from(places))
        return with_token(base, line, path, draw(NUMBERS))
    cut = draw(st.integers(0, len(lines[line])))  # a line truncated, or a piece inserted
    piece = draw(st.sampled_from(["", "5.0", ",", '"', "\\ud800", "\x00", "}", "1e3"]))
    lines[line] = lines[line][:cut] + piece + lines[line][cut + (0 if piece else 1):]
    return "\n".join(lines) + "\n"


CHECK_OPTIONS = st.lists(st.sampled_from(["--allow-unfinished", "--json", "--full", "--keep-going"]), max_size=2,
                         unique=True)


@settings(max_examples=min(settings().max_examples, 40), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=check_surface_cases(), options=CHECK_OPTIONS,
       env=st.sampled_from([None, {"SCHEDSPEC_NO_FAST_PATH": "1"}, {"SCHEDSPEC_NO_FAST_PATH": "0"}]))
def test_check_fuzz_both_paths(tmp_path_factory, text, options, env):
    """The contract on every mutant, and the same output from the fast and the plain path."""
    check_both_paths(tmp_path_factory.mktemp("fuzz"), text, *options, env=env)


ENGINE_VARIABLES = st.sampled_from([
    {}, {"SCHEDSPEC_VLLM_PYTHON": "/bin/false"}, {"SCHEDSPEC_VLLM_PYTHON": "/no/such"}, {"SCHEDSPEC_VLLM_PYTHON": "."},
    {"SCHEDSPEC_SGLANG_PYTHON": "/bin/false"}, {"SCHEDSPEC_SGLANG_PYTHON": "\x1b[31m[red]"}])
NOWHERE = {"SCHEDSPEC_VLLM_PYTHON": "/no/such/python", "SCHEDSPEC_SGLANG_PYTHON": "/no/such/python"}
"""Where the drawn variables leave an engine's variable unset: no engine worker starts (seconds each), the
adapters refuse at once."""
SCHEDULERS = st.sampled_from(["fcfs", "static", "priority", "vllm", "sglang", "vllm-v1", "nope", "[red]", "fcfs\n"])
SETTINGS = st.sampled_from(["num_speculative_tokens=2", "num_speculative_tokens=2.0", "block_size=16",
                            'kv_cache_groups=[{"kind":"full_attention"},{"kind":"sliding_window","sliding_window":4}]',
                            'kv_cache_groups=[{"kind":"full_attention"},{"kind":"sliding_window","sliding_window":0}]',
                            "enable_prefix_caching=true", "max_num_seqs=1e2", "max_model_len=-1"])


@settings(max_examples=min(settings().max_examples, 12), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.nested_given])  # diff runs Hypothesis itself
@given(scheduler=SCHEDULERS, against=SCHEDULERS, sets=st.lists(SETTINGS, max_size=2), env=ENGINE_VARIABLES,
       remote=st.booleans())
def test_diff_and_replay_fuzz_engines_and_remote_kv(tmp_path_factory, scheduler, against, sets, env, remote):
    """``diff`` (``--remote-kv`` or not) and ``replay`` of a remote-KV scenario on drawn schedulers, settings and
    engine variables: the contract (the engine adapters refuse a variable pointing nowhere with one line)."""
    folder = tmp_path_factory.mktemp("fuzz")
    env = {**NOWHERE, **env}
    set_args = tuple(arg for setting in sets for arg in ("--set", setting))
    invoke("diff", {}, ("--scheduler", scheduler, "--against", against, "--examples", "1", *set_args,
                        *(("--remote-kv",) if remote else ())), folder, env)
    invoke("replay", {"c.json": CASES_FOLDER[LOAD].read_bytes()}, ("-q", "--scheduler", scheduler, *set_args,
                                                                   "{c.json}"), folder, env)
