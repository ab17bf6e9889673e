"""Robustness, second round (issue 28), the files and environment part: inputs never overwritten, every
output checked before any work with one rule, no traceback from a huge number or a dead engine worker,
schemas that refuse the impossible (cost profiles, run records) naming the file, line and field, exit 2
for an unusable environment, and the defaults (output names, file modes, the sweep's best, a profile
used outside its grid, readable figures).

The contract is :func:`tests.test_bad_input.invoke`'s: exit 0/1/2/3; on exit 2 exactly one line
``schedspec: error: ...``; never a traceback; no input file changed. The fuzz test at the end extends
``tests/test_bad_input.py``'s to profiles, run records, ``diff``, ``compare`` and environment variables.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from schedspec.commands.compare import figure_text
from schedspec.lab import run_record, sweep
from schedspec.reference import cost_model
from schedspec.spec.trace import StrictJsonError, json_line, strict_json_loads
from tests.test_bad_input import FUZZ_EXAMPLES, JSON_VALUES, VALUES, _mutate, invoke

# A measured profile as `schedspec calibrate` writes it, cut to what the loader reads (linear form, a grid of
# at most 128 prefill tokens and 8 decodes per step).
PROFILE_DATA = {
    "record": "schedspec-cost-profile", "schema_version": 1, "name": "hand-made", "kind": "measured",
    "form": "linear", "formula": "step_seconds = a + b*prefill_tokens + c*decode_tokens + d*kv_tokens_attended",
    "token_knots": [],
    "coefficients": {"a_s_per_step": 0.002, "b_s_per_prefill_token": 1e-4, "c_s_per_decode_token": 1e-4,
                     "d_s_per_kv_token": 1e-8, "e_s_per_prefill_attention_pair": 0.0, "f_s_per_prefill_chunk": 0.0},
    "hardware": "cpu", "model": "tiny", "source": "by hand, for tests",
    "scheduler_config": {"block_size": 16, "max_model_len": 8192},
    "grid": {"quick": True, "max_prefill": 128, "max_decodes": 8, "max_context": 256, "repeats": 3, "warmup": 1,
             "block_size": 16, "points": 2},
    "points": [{"region": "prefill", "step": "prefill 128", "prefill_tokens": 128, "decode_tokens": 0,
                "kv_tokens_attended": 128, "prefill_attention_pairs": 8256, "measured_s": 0.015, "spread": 0.01,
                "error_percent": 0.0},
               {"region": "decode", "step": "decode 8x256", "prefill_tokens": 0, "decode_tokens": 8,
                "kv_tokens_attended": 2056, "prefill_attention_pairs": 0, "measured_s": 0.003, "spread": 0.01,
                "error_percent": 0.0}],
}


def profile(**changes) -> bytes:
    """:data:`PROFILE_DATA` (indented, one field a line, as calibrate writes it) with dotted-path changes
    (``coefficients__a_s_per_step``); a value of ``...`` deletes the field."""
    data = json.loads(json.dumps(PROFILE_DATA))
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = data
        for key in parents:
            target = target[key]
        if value is ...:
            del target[last]
        else:
            target[last] = value
    return (json.dumps(data, indent=2) + "\n").encode()


PROFILE = profile()


def line_of(data: bytes, needle: str) -> int:
    """The line of ``data`` holding ``needle`` first (found in the text, not by the code under test)."""
    return next(i for i, line in enumerate(data.decode().splitlines(), 1) if needle in line)


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    """A real run record (`lab --save`)."""
    folder = tmp_path_factory.mktemp("record")
    result = invoke("lab", {}, ("--max-requests", "6", "--steps", "none", "--slo", "ttft=2s,itl=200ms",
                                "--save", str(folder / "r.json")), folder)
    assert result.exit_code == 0, result.stderr
    return json.loads((folder / "r.json").read_text())


def record_bytes(record: dict, edit=None) -> bytes:
    data = json.loads(json.dumps(record))
    if edit is not None:
        edit(data)
    return (json.dumps(data, indent=2) + "\n").encode()


@contextlib.contextmanager
def environment(**values: str):
    """Environment variables set for the block (and restored), for commands run in this process."""
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if not line.startswith("schedspec: note: ")]
    assert result.exit_code == 2 and len(lines) == 1, (result.exit_code, result.stdout, result.stderr)
    return lines[0]


# --------------------------------------------------------------------------------------------------
# An input overwritten: every file a command reads is an input (the trace, the profile, the model's files)

@pytest.mark.parametrize("option", ["--save", "--steps-out", "--requests-out"])
def test_no_output_over_the_cost_profile(tmp_path, option):
    result = invoke("lab", {"p.json": PROFILE}, ("--profile", "{p.json}", option, "{p.json}", "--max-requests", "3"),
                    tmp_path)
    assert "is an input file" in one_error_line(result) and option in result.stderr
    assert "Run conditions" not in result.stdout  # refused before the run


def test_no_output_over_the_profile_through_a_symbolic_link(tmp_path):
    (tmp_path / "link.json").symlink_to(tmp_path / "p.json")
    result = invoke("lab", {"p.json": PROFILE}, ("--profile", "{p.json}", "--save", str(tmp_path / "link.json"),
                                                 "--max-requests", "3"), tmp_path)
    assert "--save" in one_error_line(result) and "is an input file" in result.stderr
    assert (tmp_path / "link.json").is_symlink()


def test_no_multi_run_output_over_the_profile(tmp_path):
    """--compare fcfs,static --save run.json writes run-fcfs.json: refused when that is the profile."""
    result = invoke("lab", {"run-fcfs.json": PROFILE},
                    ("--profile", "{run-fcfs.json}", "--compare", "fcfs,static", "--save", str(tmp_path / "run.json"),
                     "--max-requests", "3"), tmp_path)
    assert "is an input file" in one_error_line(result)


@pytest.mark.parametrize("command", ["lab", "calibrate"])
def test_no_output_over_a_file_of_the_model_folder(tmp_path, command):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = ("--backend", "torch", "--model", str(model), "--save", str(model / "config.json"), "--max-requests", "2") \
        if command == "lab" else ("--model", str(model), "--out", str(model / "config.json"))
    result = invoke(command, {}, args, tmp_path)
    assert "is an input file" in one_error_line(result)
    assert (model / "config.json").read_text() == "{}"


# --------------------------------------------------------------------------------------------------
# Outputs checked before the work, one rule: what you name is created, the folder it goes in must exist

def test_diff_out_under_a_file_is_refused_before_the_run(tmp_path):
    result = invoke("diff", {"f.txt": b"x"}, ("--scheduler", "fcfs", "--against", "vllm-v1", "--examples", "3",
                                              "--out", "{f.txt}/cases"), tmp_path)
    assert "--out" in one_error_line(result) and "is a file" in result.stderr
    assert "examples" not in result.stdout  # nothing ran


@pytest.mark.parametrize(("command", "args"), [
    ("diff", ("--scheduler", "fcfs", "--against", "vllm-v1", "--examples", "3", "--out", "/proc/cases")),
    ("lab", ("--max-requests", "3", "--save", "/proc/run.json")),
    ("lab", ("--max-requests", "3", "--plot", "/proc/plots")),
    ("calibrate", ("--out", "/proc/p.json")),
    ("prove", ("--only", "no-such-theorem", "--save-cases", "/proc/cases")),
])
def test_an_unwritable_output_folder_is_refused_before_any_work(tmp_path, command, args):
    """/proc takes no new file, even from root (whom permission bits do not stop): the check tries."""
    if not Path("/proc").is_dir():
        pytest.skip("needs Linux's /proc, a folder no one can create files in")
    result = invoke(command, {}, args, tmp_path)
    assert "not writable" in one_error_line(result)
    assert "Run conditions" not in result.stdout and "examples" not in result.stdout


@pytest.mark.parametrize(("command", "args"), [
    ("lab", ("--max-requests", "3", "--steps", "none", "--plot", "{folder}/missing/plots")),
    ("lab", ("--max-requests", "3", "--steps", "none", "--save", "{folder}/missing/run.json")),
    ("diff", ("--scheduler", "fcfs", "--against", "static", "--examples", "2", "--out", "{folder}/missing/cases")),
    ("prove", ("--only", "no-such-theorem", "--save-cases", "{folder}/missing/cases")),
])
def test_a_missing_parent_folder_is_refused_by_every_command(tmp_path, command, args):
    result = invoke(command, {}, args, tmp_path)
    assert "does not exist" in one_error_line(result)
    assert not (tmp_path / "missing").exists()


def test_a_missing_output_folder_itself_is_created(tmp_path):
    result = invoke("diff", {}, ("--scheduler", "fcfs", "--against", "vllm-v1", "--examples", "40", "--seed", "1",
                                 "--out", str(tmp_path / "cases")), tmp_path)
    assert result.exit_code == 1 and list((tmp_path / "cases").glob("*.json")), result.stdout
    result = invoke("lab", {}, ("--max-requests", "3", "--steps", "none", "--plot", str(tmp_path / "plots")), tmp_path)
    assert result.exit_code == 0 and list((tmp_path / "plots").glob("*.png")), result.stderr


# --------------------------------------------------------------------------------------------------
# Tracebacks

@pytest.mark.parametrize(("number", "needle"), [("9" * 5000, "5,000 digits"), ("1e400", "out of range"),
                                                ("-1e999", "out of range")])
def test_compare_on_a_number_out_of_range_is_one_line(tmp_path, record, number, needle):
    text = record_bytes(record).decode().replace('"preemptions": 0', f'"preemptions": {number}', 1).encode()
    assert number.encode() in text
    result = invoke("compare", {"a.json": text, "b.json": record_bytes(record)}, ("{a.json}", "{b.json}"), tmp_path)
    line = one_error_line(result)
    assert needle in line and f"a.json:{line_of(text, number[:20])}:" in line


def test_strict_json_refuses_numbers_out_of_range():
    for text in ("1e400", "[1, -1e309]", "1" * 101):
        with pytest.raises(StrictJsonError):
            strict_json_loads(text)
    assert strict_json_loads("[1e308, " + "9" * 100 + "]") == [1e308, int("9" * 100)]


@pytest.mark.parametrize("command", ["diff", "lab", "replay"])
def test_a_vllm_worker_that_dies_at_start_is_one_line_exit_2(tmp_path, command):
    """SCHEDSPEC_VLLM_PYTHON=/bin/false: the worker exits before its first reply. Before: diff printed a
    61-line traceback with a Hypothesis dump, lab and replay one line with exit 2 naming no variable."""
    from schedspec.reference.scenarios import bundled_scenarios

    case = next(p for p in bundled_scenarios() if p.stem == "slot-freed-is-reused")
    args = {"diff": ("--scheduler", "vllm", "--against", "vllm-v1", "--examples", "3"),
            "lab": ("--scheduler", "vllm", "--max-requests", "3"),
            "replay": ("--scheduler", "vllm", str(case))}[command]
    with environment(SCHEDSPEC_VLLM_PYTHON="/bin/false"):
        result = invoke(command, {}, args, tmp_path)
    line = one_error_line(result)
    assert "SCHEDSPEC_VLLM_PYTHON=/bin/false" in line and "before its first reply" in line


# --------------------------------------------------------------------------------------------------
# Silent wrong answers: every input file has a schema that refuses the impossible, naming file, line, field

@pytest.mark.parametrize(("changes", "field", "needle"), [
    ({"coefficients__f_s_per_prefill_chunks": 0.05}, "coefficients.f_s_per_prefill_chunks", "unknown field"),
    ({"coefficients__a_s_per_stepp": 0.05}, "coefficients.a_s_per_stepp", "unknown field"),
    ({"token_knot": [[1, 0.1]]}, "token_knot", "unknown field"),
    ({"form": "cubic"}, "form", "is not one of"),
    ({"coefficients__a_s_per_step": 1e300}, "coefficients.a_s_per_step", "maximum"),
    ({"coefficients__b_s_per_prefill_token": -1e-6}, "coefficients.b_s_per_prefill_token", "minimum"),
    ({"coefficients__c_s_per_decode_token": "0.001"}, "coefficients.c_s_per_decode_token", "is not of type"),
    ({"coefficients__d_s_per_kv_token": ...}, "coefficients", "required"),
    ({"form": "piecewise"}, "token_knots", "should be non-empty"),
    ({"token_knots": [[1, 0.01], [64, 0.02]]}, "token_knots", "expected to be empty"),
    ({"scheduler_config__max_num_seqs": 0}, "scheduler_config.max_num_seqs", "minimum"),
    ({"schema_version": 2}, "schema_version", "1 was expected"),
])
def test_a_cost_profile_is_checked_against_its_schema(tmp_path, changes, field, needle):
    data = profile(**changes)
    result = invoke("lab", {"p.json": data}, ("--profile", "{p.json}", "--max-requests", "3"), tmp_path)
    line = one_error_line(result)
    key = field.rpartition(".")[2]
    where = line_of(data, f'"{key}"') if f'"{key}"' in data.decode() else None
    assert f"field {field}: " in line and needle in line, line
    if where is not None:
        assert f"p.json:{where}: " in line, line


def test_the_misspelt_coefficient_of_the_issue_changed_the_answer_before(tmp_path):
    """The issue's example: a profile whose f is misspelt ran with f = 0 (TTFT p50 0.074 s instead of
    0.709 s). Spelt right, f changes the run; misspelt, it is refused."""
    right = profile(coefficients__f_s_per_prefill_chunk=0.5)
    runs = []
    for data in (PROFILE, right):
        result = invoke("lab", {"p.json": data}, ("--profile", "{p.json}", "--max-requests", "6", "--json"), tmp_path)
        assert result.exit_code == 0, result.stderr
        runs.append(json.loads(result.stdout)["figures"]["ttft_p50_s"])
    assert runs[1] > runs[0] + 0.4  # f charged per prefill chunk: the loader reads it
    wrong = right.replace(b'"f_s_per_prefill_chunk"', b'"f_s_per_prefill_chunks"')
    assert invoke("lab", {"p.json": wrong}, ("--profile", "{p.json}", "--max-requests", "6"), tmp_path).exit_code == 2


def test_the_cost_profile_schema_accepts_what_calibrate_writes():
    """The document `schedspec calibrate` builds (lab/calibrate.py profile_document), every form."""
    from schedspec.lab import calibrate as cal

    assert set(cal.FORMS) == set(cost_model.profile_schema()["properties"]["form"]["enum"])
    keys = set(cost_model.profile_schema()["properties"])
    document_keys = {"record", "schema_version", "name", "kind", "form", "formula", "token_knots",
                     "relative_rms_error_percent_by_form", "coefficients", "hardware", "model", "source",
                     "scheduler_config", "conditions", "grid", "fit_error_percent", "points"}
    assert document_keys <= keys  # a key calibrate writes that the schema did not know would be refused


def _set(path: str, value):
    def edit(data):
        *parents, last = path.split(".")
        target = data
        for key in parents:
            target = target[key]
        target[last] = value
    return edit


@pytest.mark.parametrize(("path", "value", "field"), [
    ("conditions.config.max_num_seqs", -5, "conditions.config.max_num_seqs"),
    ("conditions.config.max_num_seqs", "8", "conditions.config.max_num_seqs"),
    ("conditions.config.max_num_batched_tokens", 3, "conditions.config"),  # below max_num_seqs: from_dict's rule
    ("figures.preemptions", 30.5, "figures.preemptions"),
    ("figures.requests_total", -1, "figures.requests_total"),
    ("figures.ttft_p50_s", -0.5, "figures.ttft_p50_s"),
    ("figures.goodput_percent", 250.0, "figures.goodput_percent"),
    ("figures.output_tokens_per_s", "fast", "figures.output_tokens_per_s"),
    ("conditions.cost_profile.a_s_per_step", 1e300, "conditions.cost_profile.a_s_per_step"),
    ("conditions.window.time_scale", 0, "conditions.window.time_scale"),
    ("conditions.arrivals.span_s", -3, "conditions.arrivals.span_s"),
    ("conditions.max_steps", 0, "conditions.max_steps"),
    ("conditions.slo.ttft_s", -2, "conditions.slo.ttft_s"),
])
def test_compare_refuses_an_impossible_run_record(tmp_path, record, path, value, field):
    data = record_bytes(record, _set(path, value))
    result = invoke("compare", {"a.json": data, "b.json": record_bytes(record)}, ("{a.json}", "{b.json}"), tmp_path)
    line = one_error_line(result)
    assert f"field {field}" in line, line
    key = field.rpartition(".")[2]
    assert f"a.json:{line_of(data, chr(34) + key + chr(34))}: " in line, line
    assert "-inf" not in result.stdout and "better" not in result.stdout


def test_a_valid_record_still_compares(tmp_path, record):
    result = invoke("compare", {"a.json": record_bytes(record), "b.json": record_bytes(record)},
                    ("{a.json}", "{b.json}"), tmp_path)
    assert result.exit_code == 0, result.stderr
    assert run_record.validate_record(record) is None


def test_json_line_finds_nested_fields_and_list_items():
    text = '{\n  "a": {\n    "b": [\n      1,\n      {"c": 2}\n    ]\n  },\n  "d": "x, \\"y\\""\n}\n'
    assert json_line(text, []) == 1
    assert json_line(text, ["a", "b"]) == 3
    assert json_line(text, ["a", "b", 1, "c"]) == 5
    assert json_line(text, ["d"]) == 8
    assert json_line(text, ["a", "b", 2]) is None and json_line(text, ["nope"]) is None


# --------------------------------------------------------------------------------------------------
# Wrong exit codes: an unusable environment or option is 2, naming the variable or option

@pytest.mark.parametrize("command", ["lab", "diff"])
def test_a_missing_vllm_python_is_exit_2_naming_the_variable(tmp_path, command):
    args = ("--scheduler", "vllm", "--max-requests", "3") if command == "lab" else \
        ("--scheduler", "vllm", "--against", "fcfs", "--examples", "2")
    with environment(SCHEDSPEC_VLLM_PYTHON=str(tmp_path / "no-such-python")):
        result = invoke(command, {}, args, tmp_path)
    line = one_error_line(result)
    assert "SCHEDSPEC_VLLM_PYTHON=" in line and "no such file" in line


def test_ray_without_a_cluster_is_exit_2(tmp_path, monkeypatch):
    """A ray that cannot connect (ray.init raises ConnectionError, as with no cluster at the address):
    unusable input, exit 2, naming --ray; ray not installed stays exit 3 (tests/test_sweep_ray.py)."""
    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: False

    def init(**kwargs):
        raise ConnectionError(f"could not connect to {kwargs['address']}")

    fake.init = init
    monkeypatch.setitem(sys.modules, "ray", fake)
    result = invoke("lab", {}, ("--max-requests", "4", "--sweep", "max_num_seqs=2,4", "--ray", "127.0.0.1:1"),
                    tmp_path)
    line = one_error_line(result)
    assert line.startswith("schedspec: error: --ray 127.0.0.1:1: cannot connect"), line


# --------------------------------------------------------------------------------------------------
# Docs and defaults

def test_one_naming_rule_for_every_multi_run_output(tmp_path):
    result = invoke("lab", {}, ("--max-requests", "3", "--steps", "none", "--compare", "fcfs,static",
                                "--steps-out", str(tmp_path / "s.jsonl"), "--requests-out", str(tmp_path / "r.csv"),
                                "--save", str(tmp_path / "run.json")), tmp_path)
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "r-fcfs.csv", "r-static.csv", "run-fcfs.json", "run-static.json", "s-fcfs.jsonl", "s-static.jsonl"]
    out = tmp_path / "sweep"
    out.mkdir()
    result = invoke("lab", {}, ("--max-requests", "3", "--no-check", "--jobs", "1", "--sweep",
                                "max_num_seqs=1,2,3,4,5,6,7,8,9,10", "--save", str(out / "run.json")), tmp_path)
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"run-{i:02d}.json" for i in range(1, 11)]


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_output_files_respect_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        result = invoke("lab", {}, ("--max-requests", "3", "--steps", "none", "--save", str(tmp_path / "r.json"),
                                    "--steps-out", str(tmp_path / "s.jsonl")), tmp_path)
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.stderr
    for name in ("r.json", "s.jsonl"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


def test_an_overwritten_output_keeps_its_mode(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old")
    target.chmod(0o600)
    result = invoke("lab", {}, ("--max-requests", "3", "--steps", "none", "--save", str(target)), tmp_path)
    assert result.exit_code == 0, result.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.read_text() != "old"


def _record(throughput: float, goodput: float) -> dict:
    return {"figures": {"output_tokens_per_s": throughput, "itl_p99_s": 0.01, "ttft_p99_s": 0.1,
                        "goodput_percent": goodput, "violations": 0}}


def test_the_sweeps_best_ranks_by_goodput_first():
    """At equal throughput (a load every configuration serves), the one whose requests meet the SLO more
    often is best, and the reason says so; before, the first row won on a tie of throughput and ITL."""
    from schedspec.lab.metrics import Slo

    slo = Slo(ttft=2.0, itl=0.2)
    best, reason = sweep.choose_best([_record(955.0, 18.9), _record(955.0, 100.0), _record(900.0, 100.0)], slo)
    assert best == 1 and "highest goodput (100.0%" in reason and "then highest output throughput" in reason
    best, reason = sweep.choose_best([_record(955.0, 40.0), _record(700.0, 90.0)], slo)
    assert best == 1 and "highest goodput (90.0%" in reason
    best, reason = sweep.choose_best([_record(955.0, 40.0), _record(700.0, 90.0)], None)
    assert best == 0 and "highest output throughput" in reason  # no SLO, no goodput: throughput


def test_a_profile_applied_far_outside_its_grid_warns(tmp_path):
    result = invoke("lab", {"p.json": PROFILE}, ("--profile", "{p.json}", "--max-requests", "6", "--steps", "none"),
                    tmp_path)
    assert result.exit_code == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("schedspec: note: ")]
    assert len(notes) == 1 and "prefill_tokens <= 128" in notes[0] and "fitted up to 128" in notes[0], result.stderr
    # within the grid (a budget of 128 tokens, 8 sequences): no note
    result = invoke("lab", {"p.json": PROFILE}, ("--profile", "{p.json}", "--max-requests", "6", "--steps", "none",
                                                 "--set", "max_num_batched_tokens=128", "--set", "max_num_seqs=8"),
                    tmp_path)
    assert result.exit_code == 0 and "schedspec: note: " not in result.stderr, result.stderr


@pytest.mark.parametrize("mode", [("--sweep", "max_num_batched_tokens=1024,2048"),
                                  ("--capacity", "--slo", "ttft_p99=100s", "--sweep", "max_num_batched_tokens=1024,2048")],
                         ids=["sweep", "capacity"])
def test_a_profile_applied_far_outside_its_grid_warns_in_sweeps_and_capacity_searches(tmp_path, mode):
    """As single runs and --compare: one note per configuration whose steps go far beyond the grid (named by
    its point), none within it (a budget of 128 tokens and 8 sequences keep every step inside the grid's 128
    prefill tokens and 8 decodes); before, --sweep and --capacity said nothing."""
    result = invoke("lab", {"p.json": PROFILE}, ("--profile", "{p.json}", "--max-requests", "6", "--jobs", "1",
                                                 *mode), tmp_path)
    assert result.exit_code == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("schedspec: note: ")]
    assert len(notes) == 2, result.stderr
    for note, point in zip(notes, ("max_num_batched_tokens=1024", "max_num_batched_tokens=2048"), strict=True):
        assert f"run {point}: " in note and "prefill_tokens <= 128" in note and "fitted up to 128" in note, note
    result = invoke("lab", {"p.json": PROFILE}, ("--profile", "{p.json}", "--max-requests", "6", "--jobs", "1",
                                                 "--set", "max_num_seqs=8", *mode[:-1], "max_num_batched_tokens=64,128"),
                    tmp_path)
    assert result.exit_code == 0 and "schedspec: note: " not in result.stderr, result.stderr


def test_compare_prints_readable_numbers_with_units(tmp_path, record):
    after = record_bytes(record, _set("figures.ttft_p50_s", record["figures"]["ttft_p50_s"] - 2.27837e-06))
    result = invoke("compare", {"a.json": record_bytes(record), "b.json": after}, ("{a.json}", "{b.json}"), tmp_path)
    assert result.exit_code == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if "ttft_p50_s" in line)
    assert "-2.28 µs" in row and "e-0" not in result.stdout and " ms" in row, row
    assert figure_text("goodput_percent", 56.666) == "56.7%" and figure_text("goodput_percent", -3.0, True) == "-3.0 pp"
    assert figure_text("output_tokens_per_s", 1234.5) == "1,234/s" or figure_text("output_tokens_per_s", 1234.5) == "1,235/s"
    assert figure_text("preemptions", 12345) == "12,345" and figure_text("e2e_p50_s", 1.5) == "1.5 s"


# --------------------------------------------------------------------------------------------------
# The fuzz test, extended to profiles, run records, diff, compare and environment variables

PROFILE_FIELDS = ["name", "form", "token_knots", "coefficients__a_s_per_step", "coefficients__b_s_per_prefill_token",
                  "coefficients__c_s_per_decode_token", "coefficients__d_s_per_kv_token",
                  "coefficients__e_s_per_prefill_attention_pair", "coefficients__f_s_per_prefill_chunk",
                  "coefficients__f_s_per_prefill_chunks", "scheduler_config__max_num_seqs",
                  "scheduler_config__block_size", "grid__max_prefill", "points", "hardware", "schema_version"]
NUMBERS = st.one_of(JSON_VALUES, st.sampled_from([1e300, -1e-9, 1e-300, 0, 3600.5, [[1, 0.1]], [[0, 1]], "linear"]))
RECORD_FIELDS = ["figures.preemptions", "figures.ttft_p50_s", "figures.goodput_percent", "figures.requests_total",
                 "figures.tokens_per_step_mean", "figures.output_tokens_per_s", "conditions.config.max_num_seqs",
                 "conditions.config.block_size", "conditions.config.enable_chunked_prefill", "conditions.window.time_scale",
                 "conditions.cost_profile.a_s_per_step", "conditions.scheduler", "conditions.max_steps", "name",
                 "schema_version", "conditions.backend.kind", "figures.new_figure_s"]


@st.composite
def profile_cases(draw):
    if draw(st.booleans()):
        data = _mutate(draw, PROFILE)
    else:
        data = profile(**{draw(st.sampled_from(PROFILE_FIELDS)): draw(NUMBERS) for _ in range(draw(st.integers(1, 2)))})
    args = ["--profile", "{p.json}", "--max-requests", "3", "--steps", "none"]
    if draw(st.booleans()):
        args += [draw(st.sampled_from(["--save", "--steps-out", "--requests-out", "--plot"])),
                 draw(st.sampled_from(["{p.json}", "out.json", "{folder}", "{p.json}/x", "", "new/x.json"]))]
    return "lab", {"p.json": data}, tuple(args), {}


@st.composite
def compare_cases(draw, base: bytes):
    if draw(st.booleans()):
        data = _mutate(draw, base)
    else:
        record = json.loads(base)
        for _ in range(draw(st.integers(1, 2))):
            with contextlib.suppress(KeyError, TypeError):
                _set(draw(st.sampled_from(RECORD_FIELDS)), draw(NUMBERS))(record)
        data = record_bytes(record)
    args = ["{a.json}", "{b.json}"]
    if draw(st.booleans()):
        args = [draw(st.sampled_from(["--allow-different", "--json"])), *args]
        if args[0] == "--allow-different":
            args.insert(1, draw(st.one_of(st.sampled_from(["config", "max_num_seqs", "window.time_scale"]), VALUES)))
    return "compare", {"a.json": data, "b.json": base}, tuple(args), {}


DIFF_OPTIONS = ["--examples", "--seed", "--set", "--out", "--max-steps", "--scheduler", "--against"]


@st.composite
def diff_cases(draw):
    args = ["--scheduler", draw(st.sampled_from(["fcfs", "static", "vllm-v1"])),
            "--against", draw(st.sampled_from(["fcfs", "vllm-v1"])), "--examples", "2", "--max-steps", "300"]
    for _ in range(draw(st.integers(0, 2))):
        option = draw(st.sampled_from(DIFF_OPTIONS))
        value = draw(st.one_of(VALUES, st.sampled_from(["{f.txt}/cases", "{f.txt}", "cases", "new/cases"])))
        if option in ("--examples", "--max-steps") and value.isdigit() and int(value) > 3:
            value = "3"  # keep the run short; large values are the option type's business
        args += [option, value]
    return "diff", {"f.txt": b"x"}, tuple(args), {}


@st.composite
def environment_cases(draw):
    """SCHEDSPEC_VLLM_PYTHON set to something that is no vLLM environment, with every command that starts it."""
    value = draw(st.sampled_from(["/bin/false", "/bin/true", "/tmp", "/no/such/python", "relative/python",
                                  "[red]x", ":100:", " ", "/dev/null", "é", "/etc/passwd"]))
    command = draw(st.sampled_from(["lab", "diff"]))
    args = ("--scheduler", "vllm", "--max-requests", "2", "--steps", "none") if command == "lab" else \
        ("--scheduler", "vllm", "--against", "vllm-v1", "--examples", "2")
    return command, {}, args, {"SCHEDSPEC_VLLM_PYTHON": value}


@pytest.fixture(scope="module")
def record_text(record) -> bytes:
    return record_bytes(record)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.nested_given])  # diff runs Hypothesis
@given(data=st.data())
@example(data=None)
def test_cli_fuzz_files_and_environment(tmp_path_factory, record_text, data):
    if data is None:  # the issue's own example first
        case = ("lab", {"p.json": PROFILE}, ("--profile", "{p.json}", "--save", "{p.json}", "--max-requests", "3"), {})
    else:
        case = data.draw(st.one_of(profile_cases(), compare_cases(record_text), diff_cases(), environment_cases()))
    command, files, args, env = case
    folder = tmp_path_factory.mktemp("fuzz")
    previous = os.getcwd()
    os.chdir(folder)  # relative output paths land in the temporary folder
    try:
        with environment(**env):
            result = invoke(command, files, args, folder)
    finally:
        os.chdir(previous)
    if env:  # no vLLM environment there: never a pass, never "the scheduler lacks a feature"
        assert result.exit_code == 2, (args, env, result.stdout, result.stderr)
        assert "SCHEDSPEC_VLLM_PYTHON" in result.stderr, result.stderr


@pytest.mark.parametrize("columns", ["80", "100", "190"])
def test_tables_follow_one_width_rule(tmp_path, record, columns):
    """lab and compare: the terminal's width, at least 100 columns (cli_common.MIN_TABLE_WIDTH); before,
    lab printed at least 100 and compare at least 120 columns."""
    from click.testing import CliRunner

    from schedspec.cli import cli
    from schedspec.cli_common import MIN_TABLE_WIDTH

    width = max(int(columns), MIN_TABLE_WIDTH)
    path = tmp_path / "r.json"
    path.write_bytes(record_bytes(record))
    for argv in (["lab", "--max-requests", "6", "--steps", "5"], ["compare", str(path), str(path)]):
        result = CliRunner().invoke(cli, argv, env={"COLUMNS": columns})
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert max(len(line) for line in lines) <= width, (argv, max(lines, key=len))
        assert any(len(line) > 80 for line in lines)  # the width is used, not Rich's default 80
