"""The two validators of a trace line agree (issue 26): the compiled ``jsonschema-rs`` screen that
:mod:`schedspec.spec.trace` runs on every line, and ``jsonschema``, the definition that judges every line
the screen refuses and names its field. A record the screen accepts is read without asking
``jsonschema``, so a screen looser than the schema would let a malformed record be judged: here both
are asked about valid records (real traces, caching on and off, both schema versions, every optional
field) and about records mutated to break the schema at every place, systematically and at random.
``test_a_looser_screen_is_caught`` shows the comparison fails for a screen built from a loosened schema.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import jsonschema_rs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
from schedspec.spec import trace
from schedspec.spec.trace import TraceFormatError, open_trace, record_schema_errors

ROOT = Path(__file__).resolve().parents[1]
ENGINE_TRACES = sorted((ROOT / "schedspec" / "data" / "engine-traces").glob("*.jsonl"))

EVERY_ARRIVAL_FIELD = {
    "request_id": "r-every-field", "prompt_len": 1030, "max_tokens": 7, "arrival_step": 0, "arrival_time": 0.0,
    "priority": -3, "prefix_group": "g", "prefix_len": 512, "abort_at_step": None, "eos_at_output": 2,
    "abort_at_time": 1.5, "eos_token_id": None, "stop_token_ids": [5, 6], "min_tokens": 1,
    "block_hash_ids": [1, 2, 3], "hash_block_tokens": 512,
}

REPLACEMENTS: tuple[Any, ...] = (
    None, True, 0, -1, 1.0, 1.5, 2**31 - 1, 2**31, -(2**31) - 1, 10**20, 1e15, 1e16, -1e16, "", "x", "x" * 1001,
    [], [1], ["x"], {}, {"x": 1}, {"": 1},
)
"""Values put in place of a field (or an element) by the systematic mutations: each breaks some part of
the schema (types, bounds of count/int/time/id, empty and long ids, nested shapes) and fits another."""


@cache
def valid_records() -> tuple[tuple[int, str], ...]:
    """(schema version, record line) for records known valid: real replays (one with prefix caching),
    the bundled engine traces (schema version 1), a record with every optional arrival field, a version-1 arrival."""
    lines: list[tuple[int, str]] = []
    for name, scheduler in (("kv-pressure-no-thrash", None), ("preempt-then-prefix-hit", "vllm-v1")):
        (path,) = [p for p in bundled_scenarios() if p.stem == name]
        result = replay(load_scenario(path), scheduler) if scheduler else replay(load_scenario(path))
        lines += [(2, record.to_json()) for record in result.run.records]
    assert any("prefix_hit_blocks" in line for _, line in lines)
    for path in ENGINE_TRACES:
        header, *records = path.read_text().splitlines()
        lines += [(json.loads(header)["schema_version"], line) for line in records if line.strip()]
    first = json.loads(lines[0][1])
    lines.append((2, json.dumps({**first, "arrivals": [EVERY_ARRIVAL_FIELD]})))
    version_1 = {k: v for k, v in EVERY_ARRIVAL_FIELD.items() if k not in ("eos_token_id", "stop_token_ids",
                                                                             "min_tokens")}
    lines.append((1, json.dumps({**first, "arrivals": [version_1]})))
    return tuple(lines)


def _verdicts(data: Any, version: int, part: str = "record") -> tuple[bool, bool]:
    """(the screen's verdict, the definition's verdict) on ``data``. A line that may hold an integral float
    (``trace.has_integral_float``: ``1.0`` at an integer field, which the compiled screen reads as an integer and
    the definition refuses) is not screened: the definition's verdict is the reader's."""
    definition = trace._validator(part, version).is_valid(data)
    if trace.has_integral_float(json.dumps(data).encode()):
        return definition, definition
    return trace._fast_validator(part, version).is_valid(data), definition


def test_the_screen_alone_reads_an_integral_float_as_an_integer():
    """Why integral floats bypass the screen: ``jsonschema-rs`` takes ``5.0`` for an integer (JSON Schema's
    data model), the definition (``trace.StrictValidator``) does not; the reader refuses the line."""
    version, line = valid_records()[1]
    data = json.loads(line)
    data["num_running"] = float(data["num_running"])
    assert trace._fast_validator("record", version).is_valid(data)
    assert not trace._validator("record", version).is_valid(data)
    assert "num_running" in (record_schema_errors(data, version) or "")


def _places(data: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every path into ``data`` (dict keys and list indexes), the whole value first."""
    yield path
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _places(value, (*path, key))
    elif isinstance(data, list):
        for index, value in enumerate(data[:3]):  # the first elements stand for the rest
            yield from _places(value, (*path, index))


def _at(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def _mutants(data: dict) -> Iterator[tuple[str, Any]]:
    """(what was done, the mutated copy) for each place: each replacement value, the key (or element)
    deleted, an unknown key added to an object, an element appended to a list."""
    for path in _places(data):
        if not path:
            continue
        *parents, last = path
        original = _at(data, path)
        for value in REPLACEMENTS:
            if original == value and type(original) is type(value):
                continue
            mutant = copy.deepcopy(data)
            _at(mutant, tuple(parents))[last] = value
            yield f"{path} = {value!r}", mutant
        mutant = copy.deepcopy(data)
        del _at(mutant, tuple(parents))[last]
        yield f"del {path}", mutant
        if isinstance(original, (dict, list)):
            mutant = copy.deepcopy(data)
            inner = _at(mutant, path)
            if isinstance(inner, dict):
                inner["surprise"] = 1
            else:
                inner.append("surprise")
            yield f"{path} += surprise", mutant


def test_valid_records_are_valid_to_both():
    for version, line in valid_records():
        data = json.loads(line)
        assert _verdicts(data, version) == (True, True), line[:200]
        assert record_schema_errors(data, version) is None


def test_systematic_mutants_get_the_same_verdict():
    """Every place of three records (caching off and on, every optional arrival field) mutated; the
    mutants that break the schema are most of them, and each gets the same verdict from both."""
    records = valid_records()
    chosen = [records[1], next(r for r in records if "prefix_hit_blocks" in r[1]), records[-2]]
    refused = 0
    for version, line in chosen:
        for what, mutant in _mutants(json.loads(line)):
            screen, definition = _verdicts(mutant, version)
            assert screen == definition, what
            refused += not definition
    assert refused > 500, refused


def test_header_mutants_get_the_same_verdict():
    header = {**json.loads(ENGINE_TRACES[0].read_text().splitlines()[0]), "scheduler": "fcfs"}
    assert _verdicts(header, 2, "header") == (True, True)
    for what, mutant in _mutants(header):
        screen, definition = _verdicts(mutant, 2, "header")
        assert screen == definition, what


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_mutants_get_the_same_verdict(data):
    version, line = data.draw(st.sampled_from(valid_records()))
    record = json.loads(line)
    places = [p for p in _places(record) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        *parents, last = data.draw(st.sampled_from(places))
        try:
            _at(record, tuple(parents))[last] = data.draw(JSON)
        except (KeyError, IndexError, TypeError):  # an earlier mutation replaced a parent
            continue
    screen, definition = _verdicts(record, version)
    assert screen == definition


def test_a_refused_line_names_file_line_and_field_as_jsonschema_does(tmp_path):
    """The message of a refused line is ``jsonschema``'s best match, with the file, the line and the field."""
    lines = ENGINE_TRACES[0].read_text().splitlines()
    record = json.loads(lines[1])
    record["scheduled"] = [{**record["scheduled"][0], "prefill_tokens": -1}] if record["scheduled"] else [{}]
    version = json.loads(lines[0])["schema_version"]
    error = jsonschema.exceptions.best_match(trace._validator("record", version).iter_errors(record))
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(record)]) + "\n")
    with pytest.raises(TraceFormatError) as raised:
        list(open_trace(path).records())
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    assert str(raised.value) == f"{path}:2: field {field}: {error.message}"


def test_a_screen_that_fails_is_judged_by_jsonschema(monkeypatch):
    """A screen that cannot decide (it raises) leaves the verdict to ``jsonschema``, both ways."""

    class Broken:
        def is_valid(self, data: Any) -> bool:
            raise ValueError("cannot convert")

    monkeypatch.setattr(trace, "_fast_validator", lambda part, version: Broken())
    version, line = valid_records()[0]
    record = json.loads(line)
    assert record_schema_errors(record, version) is None
    record["step"] = -1
    assert record_schema_errors(record, version).startswith("field step: -1 is less than the minimum")


def test_a_looser_screen_is_caught():
    """A deliberate break: a screen built from the schema with ``count``'s maximum and ``id``'s
    ``minLength`` dropped accepts records the definition refuses, and the systematic mutants find it."""
    schema = copy.deepcopy(trace._validator("record", 2).schema)
    del schema["$defs"]["count"]["maximum"]
    del schema["$defs"]["id"]["minLength"]
    loose = jsonschema_rs.Draft202012Validator(schema)
    disagreements = [what for what, mutant in _mutants(json.loads(valid_records()[1][1]))
                     if loose.is_valid(mutant) != trace._validator("record", 2).is_valid(mutant)]
    assert any("10000000000" in what or "2147483648" in what for what in disagreements), disagreements[:5]
    assert any("= ''" in what for what in disagreements), disagreements[:5]


@pytest.mark.parametrize("text, words", [
    ('{"a": 1, "a": 2}', "key 'a' appears twice in one object"),
    ('{"a": {"b": 1, "c": 2, "b": 3}}', "key 'b' appears twice in one object"),
    ('[{"x": 1}, {"y": 1, "y": 1}]', "key 'y' appears twice in one object"),
    ('{"a": NaN}', "NaN is not a finite number"),
    ('{"a": -Infinity}', "-Infinity is not a finite number"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_strict_json_still_refuses(text, words):
    with pytest.raises(trace.StrictJsonError, match=words):
        trace.strict_json_loads(text)


def test_strict_json_keeps_distinct_keys():
    assert trace.strict_json_loads('{"a": 1, "b": {"a": 2}, "c": [{"a": 3}]}') == {"a": 1, "b": {"a": 2}, "c": [{"a": 3}]}
