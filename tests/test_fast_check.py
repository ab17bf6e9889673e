"""The fast path of ``schedspec check`` (``spec/fast_check.py``) in lockstep with the plain spec path.

The fast path may only certify a trace that :func:`~schedspec.spec.checker.check_trace` passes, with the same
steps checked; anything else it must hand back (``None``), and ``schedspec check`` then prints exactly the
plain path's report. Checked on the catalogue's traces and mutants (``schedspec.trace_mutations``), the
engine traces with known verdicts, lines the reader must refuse, and Hypothesis-mutated lab traces. Each
check also asserts the fast path *does* certify the legal traces it supports, so that a fast path that
always falls back cannot pass these tests vacuously.
"""

from __future__ import annotations

import copy
import json
import random
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedspec.cli import cli
from schedspec.spec.checker import check_trace
from schedspec.spec.fast_check import (
    MAP_FIELDS,
    MODELLED_ARRIVAL_FIELDS,
    MODELLED_RECORD_FIELDS,
    fast_check,
    supported,
)
from schedspec.spec.trace import TraceFormatError, open_trace, trace_schema
from schedspec.trace_mutations import MUTATIONS, applicable_steps, standard_traces

ROOT = Path(__file__).resolve().parents[1]
ENGINE_TRACES = sorted((ROOT / "schedspec" / "data" / "engine-traces").glob("*.jsonl"))
SHARED_TRACES = sorted((ROOT.parent / "shared" / "engine-traces").glob("*.jsonl"))
SEED = 20261206


def _driven_trace():
    """A synchronous trace whose arrivals name the workload's events (``eos_at_output``, ``abort_at_step``,
    ``abort_at_time``), stop ids and ``min_tokens``, under KV pressure (preemptions) and without chunked
    prefill: the fast path's arrival model, beside the catalogue's lab windows."""
    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS
    from schedspec.spec.config import SchedulerConfig
    from schedspec.spec.trace import header_line
    from schedspec.spec.workload import RequestSpec
    from schedspec.trace_mutations import Trace

    rng = random.Random(SEED)
    config = SchedulerConfig(block_size=4, num_kv_blocks=24, max_num_batched_tokens=64, max_num_seqs=5,
                             max_model_len=64, enable_chunked_prefill=False)
    workload = []
    for k in range(30):
        arrival = rng.randrange(0, 30)
        prompt_len, max_tokens = rng.randrange(1, 61), rng.randrange(1, 41)
        prompt_len, max_tokens = (0 if k == 4 else prompt_len), (0 if k == 9 else max_tokens)  # two rejections
        workload.append(RequestSpec(f"d{k:03d}", prompt_len, max_tokens,
                                    arrival_step=arrival, eos_at_output=rng.randrange(1, 12) if k % 4 == 1 else None,
                                    abort_at_step=arrival + rng.randrange(0, 20) if k % 5 == 2 else None,
                                    abort_at_time=1e6 if k % 6 == 0 else None, min_tokens=2 if k % 3 == 0 else 0,
                                    stop_token_ids=(7,) if k % 2 else ()))
    result = Engine(SCHEDULERS["fcfs"](config), config, stop_on_violation=True).run(workload)
    return "driven", Trace.of(json.loads(header_line(config, "fcfs")), result.records)


@pytest.fixture(scope="module")
def traces():
    return [*standard_traces(scale=1), _driven_trace()]


def _write(path: Path, header: dict, records: list[dict], separators: tuple[str, str] = (",", ":")) -> Path:
    path.write_text("\n".join([json.dumps(header), *(json.dumps(r, separators=separators) for r in records)]) + "\n")
    return path


def _supported(path: Path) -> bool:
    """The header is one the fast path models, and no record or arrival names a field it does not model."""
    opened = open_trace(path)
    if not supported(opened.config, opened.schema_version, opened.async_scheduling):
        return False
    for line in path.read_text().splitlines()[1:]:
        record = json.loads(line)
        if any(value and name not in MODELLED_RECORD_FIELDS for name, value in record.items()):
            return False
        if any(set(arrival) - MODELLED_ARRIVAL_FIELDS for arrival in record["arrivals"]):
            return False
    return True


def _lockstep(path: Path, allow_unfinished: bool = False):
    """The fast verdict, after asserting it agrees with the plain path: a certified trace is one the plain
    path passes with the same steps checked. Returns ``(fast report or None, plain report)``; the plain
    report is ``None`` for a trace the plain reader refuses (then the fast path must not certify it)."""
    opened = open_trace(path)
    fast = fast_check(opened, allow_unfinished=allow_unfinished)
    try:
        plain = check_trace(opened.config, opened.records(), allow_unfinished=allow_unfinished, incremental=True,
                            async_scheduling=opened.async_scheduling)
    except TraceFormatError:  # unusable input (exit 2): never certified
        assert fast is None, f"{path.name}: the fast path certified a trace the plain reader refuses"
        return fast, None
    if fast is not None:
        assert plain.ok, f"{path.name}: the fast path certified a trace the spec rejects: {plain.violations[:3]}"
        assert (fast.steps_checked, fast.valid_prefix) == (plain.steps_checked, plain.valid_prefix)
    return fast, plain


def _cli(*args: str, fast: bool = True) -> tuple[int, str]:
    env = {} if fast else {"SCHEDSPEC_NO_FAST_PATH": "1"}
    result = CliRunner().invoke(cli, ["check", *args], prog_name="schedspec", env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def test_the_legal_traces_it_supports_are_certified(traces, tmp_path):
    certified = 0
    for label, trace in traces:
        path = _write(tmp_path / f"{label}.jsonl", trace.header, trace.records)
        fast, plain = _lockstep(path)
        assert plain.ok, label
        if _supported(path):
            assert fast is not None, f"{label}: a legal trace the fast path supports was not certified"
            certified += 1
        else:
            assert fast is None, label
    assert certified >= 5


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_no_mutant_the_spec_rejects_is_certified(traces, tmp_path, mutation):
    """Every operator of the catalogue, at one applicable step (any, at random) of every trace: the fast path
    certifies a mutant only if the plain path passes it (a semantic mutant: never)."""
    rng = random.Random(f"{SEED}:{mutation.name}")
    judged = 0
    for label, trace in traces:
        steps = applicable_steps(trace, mutation)
        for step in rng.sample(steps, min(1, len(steps))):
            mutant = mutation.apply(trace, step)
            if mutant is None:
                continue
            header, records, _ = mutant
            fast, plain = _lockstep(_write(tmp_path / f"{label}-{step}.jsonl", header, records))
            if mutation.semantic and plain is not None:
                assert not plain.ok and fast is None, (label, step)
            judged += 1
    assert judged, "applies to no trace"


@pytest.mark.parametrize("path", ENGINE_TRACES + SHARED_TRACES, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_engine_traces_exit_1_with_the_same_output(path):
    fast, plain = _lockstep(path)
    assert fast is None and not plain.ok
    for args in ((str(path),), (str(path), "--json")):
        assert _cli(*args) == _cli(*args, fast=False)
        assert _cli(*args)[0] == 1


def test_a_run_without_progress_is_not_certified():
    """The idle engine's trace, cut as a window (``--allow-unfinished``): every step keeps the rules, but no
    request computes for more than ``max_model_len`` steps, so the default property ``progress`` fails it."""
    path = ROOT / "schedspec" / "data" / "engine-traces" / "t11-idle-engine.jsonl"
    fast, plain = _lockstep(path, allow_unfinished=True)
    assert fast is None and [v.name for v in plain.violations] == ["progress"]
    assert _cli(str(path), "--allow-unfinished") == _cli(str(path), "--allow-unfinished", fast=False)


def test_same_output_with_and_without_the_fast_path(traces, tmp_path):
    """Exit code and every byte printed, on passing, failing and unfinished traces, with and without the options
    that turn the fast path off by themselves."""
    label, trace = traces[3]  # under KV pressure: preemptions
    paths = [_write(tmp_path / "legal.jsonl", trace.header, trace.records),
             _write(tmp_path / "window.jsonl", trace.header, trace.records[:len(trace.records) // 2])]
    for mutation in MUTATIONS[:6]:
        steps = applicable_steps(trace, mutation)
        if steps:
            header, records, _ = mutation.apply(trace, steps[0])
            paths.append(_write(tmp_path / f"{mutation.name}.jsonl", header, records))
    for path in paths:
        for extra in ((), ("--json",), ("--allow-unfinished",), ("--property", "work-conserving"), ("--keep-going",)):
            assert _cli(str(path), *extra) == _cli(str(path), *extra, fast=False), (path.name, extra)
    assert _cli(str(paths[0]))[0] == 0 and _cli(str(paths[1]))[0] == 1


def _one_request_trace(tmp_path: Path) -> Path:
    """A legal one-request fcfs trace (the fast path certifies it)."""
    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS
    from schedspec.spec.config import SchedulerConfig
    from schedspec.spec.trace import header_line
    from schedspec.spec.workload import RequestSpec
    from schedspec.trace_mutations import Trace

    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=4,
                             max_model_len=64)
    result = Engine(SCHEDULERS["fcfs"](config), config).run([RequestSpec("r", 6, 2, arrival_step=0)])
    trace = Trace.of(json.loads(header_line(config, "fcfs")), result.records)
    return _write(tmp_path / "legal.jsonl", trace.header, trace.records)


def test_the_field_allow_lists_name_only_fields_of_the_schema():
    """The fields the fast path models are fields of the trace schema (a misspelt name would let nothing
    through, or, worse, model a field under a name no record carries), and some fields of the schema are left
    to the plain path (the allow-lists are not the whole schema, so a field added later falls back)."""
    defs = trace_schema()["$defs"]
    assert MODELLED_RECORD_FIELDS < set(defs["record"]["properties"])
    assert MODELLED_ARRIVAL_FIELDS < set(defs["arrival"]["properties"])


@pytest.mark.parametrize("field, value", [("kv_loads", {"r": 4}), ("finished_recving", ["r"]), ("future_field", [1])])
def test_a_record_field_it_does_not_model_falls_back(tmp_path, field, value):
    """A record naming a field outside MODELLED_RECORD_FIELDS is never certified, whatever the field (the KV
    connector's fields came after the fast path was written: a deny-list would have ignored them)."""
    path = _one_request_trace(tmp_path)
    assert fast_check(open_trace(path)) is not None  # the legal trace is certified
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    record[field] = value
    lines[1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    assert fast_check(open_trace(path)) is None


def test_an_arrival_field_it_does_not_model_falls_back(tmp_path):
    """An arrival naming a field outside MODELLED_ARRIVAL_FIELDS (here the KV connector's, even at 0) is never
    certified."""
    path = _one_request_trace(tmp_path)
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    record["arrivals"][0]["num_external_computed_tokens"] = 0
    lines[1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    assert fast_check(open_trace(path)) is None


def test_the_repeated_key_screen_knows_every_object_of_a_record():
    """``MAP_FIELDS`` (with ``arrivals[]`` and ``scheduled[]``) are every object a valid record can hold: the
    repeated-key screen counts the keys of exactly these."""
    defs = trace_schema()["$defs"]

    def is_object(schema: dict) -> bool:
        if "$ref" in schema:
            return is_object(defs[schema["$ref"].rsplit("/", 1)[1]])
        return schema.get("type") == "object" or any(is_object(s) for s in schema.get("anyOf", []))

    record = defs["record"]["properties"]
    assert {name for name, schema in record.items() if is_object(schema)} == set(MAP_FIELDS)
    for part in ("arrival", "scheduled"):
        for schema in defs[part]["properties"].values():
            assert not is_object(schema) and not is_object(schema.get("items", {})), part
    for name in MAP_FIELDS:
        values = defs["record"]["properties"][name]
        values = defs[values["$ref"].rsplit("/", 1)[1]] if "$ref" in values else values
        assert not is_object(values.get("additionalProperties", {}).get("items", {})), name
        assert not is_object(values.get("additionalProperties", {})), name


def _line_edit(trace, tmp_path: Path, name: str, edit) -> Path:
    """The trace with record 5 written by ``edit(text) -> text``."""
    lines = [json.dumps(trace.header), *(json.dumps(r, separators=(",", ":")) for r in trace.records)]
    lines[6] = edit(lines[6])
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name,edit,certified", [
    ("repeated-key", lambda t: t.replace('"num_running":', '"num_running":0,"num_running":', 1), False),
    ("repeated-key-spaced", lambda t: t.replace('"num_running":', '"num_running" :0,"num_running" :', 1), False),
    ("nan", lambda t: t.replace('"duration":', '"duration":NaN,"x":', 1), False),
    ("huge-number", lambda t: t.replace('"start_time":', '"start_time":1e400,"x":', 1), False),
    ("spaced", lambda t: json.dumps(json.loads(t), indent=None), True),
    ("colon-in-a-string", lambda t: t.replace('"aborts":[]', '"aborts":["no\\":such"]', 1), True),
    ("integer-as-float", lambda t: t.replace('"step":5,', '"step":5.0,', 1), False),  # refused (trace.StrictValidator)
    ("integer-as-exponent", lambda t: t.replace('"step":5,', '"step":5e0,', 1), False),
    ("float-time-integral", lambda t: t.replace('"duration":', '"duration":1.0,"x":', 1), False),  # the key "x": refused
    ("float-time-zero", lambda t: re.sub(r'"duration":[-0-9.e]+', '"duration":0.0', t, count=1), True),
])
def test_the_reader_certifies_only_what_the_plain_reader_accepts(traces, tmp_path, name, edit, certified):
    label, trace = traces[0]
    path = _line_edit(trace, tmp_path, name, edit)
    fast, _ = _lockstep(path)
    assert (fast is not None) == certified
    assert _cli(str(path)) == _cli(str(path), fast=False)


_INT_FIELDS = ("num_computed_tokens", "prefill_tokens", "decode_tokens")


@st.composite
def _edits(draw, records: list[dict]):
    """One small random change to one record: an integer field moved by -2..2, an entry of a map or list
    removed, duplicated or moved to another request, or a sampled token changed."""
    index = draw(st.integers(0, len(records) - 1))
    record = copy.deepcopy(records[index])
    kind = draw(st.sampled_from(["item", "map-drop", "map-move", "list-drop", "counter", "token", "block"]))
    delta = draw(st.integers(-2, 2).filter(bool))
    if kind == "item" and record["scheduled"]:
        item = draw(st.sampled_from(record["scheduled"]))
        field = draw(st.sampled_from(_INT_FIELDS))
        item[field] = max(0, item[field] + delta)
    elif kind in ("map-drop", "map-move"):
        name = draw(st.sampled_from(["blocks_allocated", "blocks_freed", "finished", "sampled_token_ids", "rejected"]))
        if record[name]:
            key = draw(st.sampled_from(sorted(record[name])))
            value = record[name].pop(key)
            others = [s["request_id"] for s in record["scheduled"] if s["request_id"] != key]
            if kind == "map-move" and others:
                record[name][draw(st.sampled_from(others))] = value
    elif kind == "list-drop":
        name = draw(st.sampled_from(["scheduled", "preempted", "arrivals", "aborted"]))
        if record[name]:
            record[name].pop(draw(st.integers(0, len(record[name]) - 1)))
    elif kind == "counter":
        name = draw(st.sampled_from(["num_free_blocks", "num_running", "num_waiting", "step"]))
        record[name] = max(0, record[name] + delta)
    elif kind == "token" and record["sampled_token_ids"]:
        key = draw(st.sampled_from(sorted(record["sampled_token_ids"])))
        record["sampled_token_ids"][key] = draw(st.sampled_from([0, 1, 7, record["sampled_token_ids"][key]]))
    elif kind == "block" and record["blocks_allocated"]:
        key = draw(st.sampled_from(sorted(record["blocks_allocated"])))
        blocks = record["blocks_allocated"][key]
        if blocks:
            blocks[draw(st.integers(0, len(blocks) - 1))] += delta
    return index, record


@pytest.fixture(scope="module")
def short_traces(traces):
    """The supported traces' first 60 steps (windows: judged with ``allow_unfinished``)."""
    kept = []
    for label, trace in traces:
        if not trace.header.get("async_scheduling") and not trace.config.enable_prefix_caching \
                and not trace.config.speculative:
            kept.append((label, trace.header, trace.records[:60]))
    return kept


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_mutants_of_lab_traces_in_lockstep(short_traces, tmp_path_factory, data):
    """Hypothesis: a random edit of a random record of a lab trace window; the fast path certifies it only if
    the plain path passes it."""
    label, header, records = data.draw(st.sampled_from(short_traces))
    index, record = data.draw(_edits(records))
    mutated = [*records[:index], record, *records[index + 1:]]
    path = _write(tmp_path_factory.mktemp("mutant") / f"{label}.jsonl", header, mutated)
    _lockstep(path, allow_unfinished=True)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet='{}[]",:0123456789.eE+-tfnaulrsIyNx \\\t\n\x00\x7f\ufeff\u00e9', max_size=24))
def test_the_compiled_parser_accepts_only_what_the_plain_reader_accepts(text):
    """``orjson`` (the fast path's parser) accepts a text only if ``json.loads`` does, with the same value
    (repeated keys aside: the repeated-key screen hands those to the strict reader)."""
    from schedspec.spec import fast_check as fast

    try:
        value = fast._loads(text.encode("utf-8", "surrogatepass"))
    except ValueError:
        return
    assert json.loads(text) == value or value != value


@pytest.mark.parametrize("text", [b'\xef\xbb\xbf{"a":1}', b'{"a":01}', b'{"a":1,}', b'{"a":1.}', b'{"a":NaN}',
                                  b'{"a":Infinity}', b'{"a":1e400}', b'{"a":"\xed\xa0\x80"}', b'{"a":"\t"}',
                                  b'{"a":1}\x00', b'\x0c{"a":1}'])
def test_the_compiled_parser_refuses_what_the_strict_reader_refuses(text):
    from schedspec.spec import fast_check as fast
    from schedspec.spec.trace import StrictJsonError, strict_json_loads

    with pytest.raises((StrictJsonError, UnicodeDecodeError)):
        strict_json_loads(text.decode("utf-8"))
    with pytest.raises(ValueError):
        fast._loads(text)


def _consistent_block_fault(trace, extra: bool) -> tuple[list[dict], int]:
    """The trace with one request given one block more (``extra``: a block no request ever takes) or one block
    fewer than the spec allows in one step, every later record kept consistent with it (the counts of free
    blocks, the blocks it frees), so that the fault is visible only to ``no-excess-blocks`` or
    ``block-table-covers`` at that step. Returns ``(records, the step)``."""
    records = copy.deepcopy(trace.records)
    used = {b for r in records for blocks in r["blocks_allocated"].values() for b in blocks}
    spare = max(set(range(trace.config.num_kv_blocks)) - used)
    for i, record in enumerate(records):
        for request_id, blocks in record["blocks_allocated"].items():
            end = next((j for j in range(i + 1, len(records)) if request_id in records[j]["blocks_freed"]), None)
            if not blocks or end is None or records[end]["preempted"]:
                continue
            if extra:
                blocks.append(spare)
                records[end]["blocks_freed"][request_id].append(spare)
            else:
                records[end]["blocks_freed"][request_id].remove(blocks.pop())
            for k in range(i, end):
                records[k]["num_free_blocks"] += -1 if extra else 1
            return records, i
    raise AssertionError("no request frees its blocks in the trace")


@pytest.mark.parametrize("extra", [True, False], ids=["one-block-too-many", "one-block-too-few"])
def test_a_block_table_fault_kept_consistent_is_not_certified(traces, tmp_path, extra):
    label, trace = traces[0]
    records, step = _consistent_block_fault(trace, extra)
    fast, plain = _lockstep(_write(tmp_path / "fault.jsonl", trace.header, records))
    assert plain.first_bad_step == step and fast is None
    names = {v.name for v in plain.violations}
    assert names & {"no-excess-blocks", "block-table-covers"}, names


def _consistent_double_ownership(trace) -> tuple[list[dict], int]:
    """The trace with one request handed, in one step, a block another request holds (instead of a free one),
    every later record kept consistent with it (its blocks freed, the counts of free blocks), so that the fault
    is visible only to ``blocks-from-free-pool`` at that step. Returns ``(records, the step)``."""
    records = copy.deepcopy(trace.records)

    def end_of(request_id: str, after: int) -> int | None:
        return next((j for j in range(after + 1, len(records)) if request_id in records[j]["blocks_freed"]), None)

    tables: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        for other, blocks in record["blocks_allocated"].items():
            end = end_of(other, i)
            if not blocks or end is None or records[end]["preempted"]:
                continue
            for owner, held in tables.items():
                owner_end = end_of(owner, i - 1)
                if owner == other or not held or owner_end is None or owner_end <= end \
                        or owner in record["blocks_freed"]:
                    continue
                taken = blocks[-1]
                blocks[-1] = held[0]
                freed = records[end]["blocks_freed"][other]
                freed[freed.index(taken)] = held[0]
                for k in range(i, owner_end):
                    records[k]["num_free_blocks"] += 1
                return records, i
        for request_id in record["blocks_freed"]:
            tables.pop(request_id, None)
        for request_id, blocks in record["blocks_allocated"].items():
            tables.setdefault(request_id, []).extend(blocks)
    raise AssertionError("no two requests hold blocks at once in the trace")


def test_a_block_held_by_another_kept_consistent_is_not_certified(traces, tmp_path):
    label, trace = traces[0]
    records, step = _consistent_double_ownership(trace)
    fast, plain = _lockstep(_write(tmp_path / "fault.jsonl", trace.header, records))
    assert plain.first_bad_step == step and fast is None
    assert "blocks-from-free-pool" in {v.name for v in plain.violations}, plain.violations


def test_a_rejection_one_step_late_is_not_certified(traces, tmp_path):
    """An impossible request rejected one step after its arrival, the step between kept consistent (it counts as
    waiting): visible only to ``reject-only-impossible`` (and ``rejects-impossible``) at its arrival step."""
    label, trace = traces[0]
    records = copy.deepcopy(trace.records)
    step = next(i for i, r in enumerate(records[:-1]) if r["rejected"])
    moved = records[step]["rejected"]
    records[step]["rejected"] = {}
    records[step]["num_waiting"] += len(moved)
    records[step + 1]["rejected"].update(moved)
    fast, plain = _lockstep(_write(tmp_path / "late.jsonl", trace.header, records))
    assert plain.first_bad_step == step and fast is None
    assert "reject-only-impossible" in {v.name for v in plain.violations}, plain.violations


def test_an_integer_field_written_as_a_float_falls_back(tmp_path):
    """JSON Schema's integer accepts ``5.0``; the plain path builds a prompt from prompt_len and cannot take a
    float, so the fast path must not certify such an arrival (found in review: it did)."""
    path = _one_request_trace(tmp_path)
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    record["arrivals"][0]["prompt_len"] = float(record["arrivals"][0]["prompt_len"])
    lines[1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    assert fast_check(open_trace(path)) is None
