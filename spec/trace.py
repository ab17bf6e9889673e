"""The step trace format: one :class:`StepRecord` per step, as JSON Lines.

A trace file starts with a header line ``{"schema_version": 2, "config": {...SchedulerConfig...},
"scheduler": NAME}`` followed by one JSON object per step. The format is published as a JSON Schema,
``trace-schema.json`` beside this module (and ``docs/trace-schema.json``); :func:`open_trace` validates
every line against it before anything is checked, so a malformed record is unusable input naming the
file, the line and the field, never a verdict. Two validators of the one schema do this: the compiled
``jsonschema-rs`` (Rust) screens every line, and only a line it refuses goes to the ``jsonschema``
library, whose verdict and best-matching error are the definition (``tests/test_trace_validation.py``
shows the two agree on valid records and on records mutated to break the schema). Any engine that writes this
format can be judged against the spec with :func:`schedspec.spec.checker.check_trace`. Serialisation
is lossless: ``StepRecord.from_json(record.to_json()) == record``.

Versions: 4 (written with hybrid KV cache groups, ``config.kv_cache_groups``) adds the blocks of groups 1..
each step appends (``group_blocks_allocated``) and those a sliding window freed (``blocks_skipped``), each
written only when not empty. 3 (written with speculative decoding on, ``num_speculative_tokens > 0``) adds speculative
decoding: the drafts each decode verifies (``scheduled[].spec_token_ids``), the drafts each sampler
accepted (``num_accepted_tokens``) and the drafts proposed after the step (``draft_token_ids``), each
written only when not empty. 2 (written with speculative decoding off, so that such a trace keeps every
byte it had before version 3) states every arrival's stop conditions (``eos_token_id``, null for none,
``stop_token_ids``, ``min_tokens``); it cannot carry the speculative fields, and a version-2 header whose
config turns speculative decoding on is refused. 1 (read only) had no stop conditions, and its arrivals
are read with the version-1 convention ``eos_token_id = 0``, said in :attr:`TraceFile.notes`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import IO, Any

import attrs
import jsonschema
import jsonschema_rs

from schedspec.spec.config import ConfigError, SchedulerConfig
from schedspec.spec.state import MAX_STATE_BLOCKS
from schedspec.spec.workload import RequestSpec

SCHEMA_VERSION = 3
"""The newest version: the one :func:`write_trace` writes with speculative decoding on
(:func:`schema_version_for`)."""

PLAIN_SCHEMA_VERSION = 2
"""The version :func:`write_trace` writes with speculative decoding off."""

HYBRID_SCHEMA_VERSION = 4
"""The version :func:`write_trace` writes with hybrid KV cache groups (``config.kv_cache_groups``)."""

HYBRID_RECORD_FIELDS = ("group_blocks_allocated", "blocks_skipped", "group_prefix_hit_blocks")
"""The record fields version 4 adds."""

READABLE_VERSIONS = (1, 2, 3, 4)
"""The versions :func:`open_trace` reads."""

SPECULATIVE_RECORD_FIELDS = ("num_accepted_tokens", "draft_token_ids")
"""The record fields version 3 adds (with ``scheduled[].spec_token_ids``)."""


def schema_version_for(config: SchedulerConfig) -> int:
    """The version a trace of ``config`` is written in: :data:`SCHEMA_VERSION` (3) with speculative decoding
    on, :data:`HYBRID_SCHEMA_VERSION` (4) with KV cache groups, else :data:`PLAIN_SCHEMA_VERSION` (2), byte for
    byte what it was before version 3."""
    if config.kv_cache_groups:
        return HYBRID_SCHEMA_VERSION
    return SCHEMA_VERSION if config.speculative else PLAIN_SCHEMA_VERSION

V1_EOS_TOKEN_ID = 0
"""Version 1 arrivals carried no stop conditions; every writer of version 1 used EOS id 0."""

SCHEMA_PATH = Path(__file__).with_name("trace-schema.json")

KV_CONNECTOR_RECORD_FIELDS = ("kv_loads", "finished_recving", "invalid_block_ids", "finished_sending")
"""The record fields of the KV connector (remote KV loads and sends), optional in every version and written
only when not empty, so a trace without a connector keeps every byte it had before them."""


@attrs.frozen
class ScheduledTokens:
    """One request's tokens in a step.

    Attributes:
        request_id: the request.
        num_computed_tokens: tokens computed before the step (where the chunk starts).
        prefill_tokens: prompt (or recompute) tokens computed this step; 0 for a decode.
        decode_tokens: 1 for a decode step of the request (1 + d when it verifies d drafts), else 0.
        spec_token_ids: speculative decoding (version 3): the drafts the decode verifies; empty otherwise
            (and then not written).
    """

    request_id: str
    num_computed_tokens: int
    prefill_tokens: int
    decode_tokens: int
    spec_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def to_dict(self) -> dict[str, Any]:
        data = {"request_id": self.request_id, "num_computed_tokens": self.num_computed_tokens,
                "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens}
        if self.spec_token_ids:
            data["spec_token_ids"] = list(self.spec_token_ids)
        return data

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


def _to_tuple(value: Iterable[Any]) -> tuple:
    return tuple(value)


def _scheduled(value: Iterable[Any]) -> tuple[ScheduledTokens, ...]:
    return tuple(v if isinstance(v, ScheduledTokens) else ScheduledTokens(**v) for v in value)


def _arrivals(value: Iterable[Any]) -> tuple[RequestSpec, ...]:
    return tuple(v if isinstance(v, RequestSpec) else RequestSpec.from_dict(v) for v in value)


def _blocks(value: dict[str, Iterable[int]]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v) for k, v in value.items()}


def _group_blocks(value: dict[str, Iterable[Iterable[int]]]) -> dict[str, tuple[tuple[int, ...], ...]]:
    return {k: tuple(tuple(group) for group in v) for k, v in value.items()}


@attrs.frozen
class StepRecord:
    """What happened in one step. Units: seconds for times, tokens for token counts, block ids.

    Attributes:
        step: step index, from 0.
        start_time: simulated or wall-clock time at which the step started (seconds).
        duration: time the forward pass took (seconds).
        arrivals: requests added before this step was planned (full descriptors).
        aborts: request ids aborted before this step was planned.
        scheduled: the batch, with each request's tokens split into prefill and decode.
        blocks_allocated: request id -> block ids appended to its table this step.
        blocks_freed: request id -> block ids it released this step (preemption, finish, abort).
        prefix_hit_tokens: request id -> tokens found in the prefix cache at its admission in this step
            (prefix caching; absent or 0 = no hit).
        prefix_hit_blocks: request id -> the cached block ids its hit reuses, in table order (they start its
            block table; not in ``blocks_allocated``). Omitted from the JSON when empty.
        blocks_evicted: block ids handed out this step that were cached (evictable) before it: their hash
            is dropped. Omitted from the JSON when empty.
        preempted: requests preempted this step.
        finished: request id -> finish reason (``stop``, ``length``, ``max_model_len``) for
            requests that ended after this step's sampling.
        aborted: request ids that ended aborted before this step.
        rejected: request id -> reason, for requests rejected in this step.
        sampled_token_ids: request id -> token sampled after this step (with speculative decoding, the
            one sampled after the accepted drafts).
        num_accepted_tokens: speculative decoding: request id -> drafts accepted, for each request that
            verified drafts and sampled. Omitted from the JSON when empty.
        draft_token_ids: speculative decoding: request id -> the drafts proposed after this step. Omitted
            from the JSON when empty.
        num_free_blocks: free KV blocks after the step.
        num_running: running requests after the step.
        num_waiting: waiting requests after the step.
        wasted_tokens: asynchronous scheduling (a trace whose header says ``async_scheduling``): request id
            -> the tokens this step computed for a request that ended after the step was planned (it stopped
            at the previous step's samples, or was aborted before this step): the step's **wasted** work.
            Such an item is in ``scheduled``, its new blocks in ``blocks_allocated`` and again in
            ``blocks_freed`` (freed with its request); it samples nothing. Omitted from the JSON when empty.
        group_blocks_allocated: hybrid KV cache groups (version 4): request id -> the blocks appended to the
            tables of groups 1.. this step, one tuple per group in group order. Omitted from the JSON when empty.
        blocks_skipped: hybrid KV cache groups (version 4): request id -> the blocks its allocation freed
            because a sliding window had passed them (``ScheduledRequest.skipped_block_ids``); they are not in
            ``blocks_freed``. Omitted from the JSON when empty.
        group_prefix_hit_blocks: hybrid KV cache groups with prefix caching (version 4): request id -> the
            tables of groups 1.. its prefix-cache hit starts with, one tuple per group in group order, each as long
            as its ``prefix_hit_blocks``, -1 where a sliding window no longer needs the block (a null entry;
            ``ScheduledRequest.group_cached_block_ids``). Omitted from the JSON when empty.
        blocks_deduplicated: prefix caching with SGLang's publication (``prefix_cache_publication ==
            "sglang-radix"``): request id -> ``[own, cached]`` pairs: a block of its table published in this step
            (a prefill chunk's) replaced there by the cached block of the same hash, ``own`` freed
            (``ScheduledRequest.deduplicated_block_ids``); ``own`` is also in ``blocks_freed``. Omitted when empty.
        kv_loads: KV connector: request id -> the tokens of the remote KV load this step starts for it (its
            blocks are in ``blocks_allocated``; it waits in WAITING_FOR_REMOTE_KVS). Omitted when empty.
        finished_recving: KV connector, reported after this step: the ids whose remote KV load landed (vLLM
            ``KVConnectorOutput.finished_recving``). Omitted when empty.
        invalid_block_ids: KV connector, reported after this step: the blocks a landing load failed to fill
            (vLLM ``KVConnectorOutput.invalid_block_ids``; recomputed from the first). Omitted when empty.
        finished_sending: KV connector, reported after this step: the ids whose KV send completed (vLLM
            ``KVConnectorOutput.finished_sending``); their held blocks are in ``blocks_freed``. Omitted when
            empty.
    """

    step: int
    start_time: float
    duration: float
    arrivals: tuple[RequestSpec, ...] = attrs.field(default=(), converter=_arrivals)
    aborts: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    scheduled: tuple[ScheduledTokens, ...] = attrs.field(default=(), converter=_scheduled)
    blocks_allocated: dict[str, tuple[int, ...]] = attrs.field(factory=dict, converter=_blocks)
    blocks_freed: dict[str, tuple[int, ...]] = attrs.field(factory=dict, converter=_blocks)
    prefix_hit_tokens: dict[str, int] = attrs.field(factory=dict)
    prefix_hit_blocks: dict[str, tuple[int, ...]] = attrs.field(factory=dict, converter=_blocks)
    blocks_evicted: tuple[int, ...] = attrs.field(default=(), converter=_to_tuple)
    preempted: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    finished: dict[str, str] = attrs.field(factory=dict)
    aborted: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    rejected: dict[str, str] = attrs.field(factory=dict)
    sampled_token_ids: dict[str, int] = attrs.field(factory=dict)
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_accepted_tokens: dict[str, int] = attrs.field(factory=dict)
    draft_token_ids: dict[str, tuple[int, ...]] = attrs.field(factory=dict, converter=_blocks)
    wasted_tokens: dict[str, int] = attrs.field(factory=dict)
    group_blocks_allocated: dict[str, tuple[tuple[int, ...], ...]] = attrs.field(factory=dict, converter=_group_blocks)
    blocks_skipped: dict[str, tuple[int, ...]] = attrs.field(factory=dict, converter=_blocks)
    group_prefix_hit_blocks: dict[str, tuple[tuple[int, ...], ...]] = attrs.field(factory=dict,
                                                                                 converter=_group_blocks)
    kv_loads: dict[str, int] = attrs.field(factory=dict)
    blocks_deduplicated: dict[str, tuple[tuple[int, ...], ...]] = attrs.field(factory=dict, converter=_group_blocks)
    finished_recving: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    invalid_block_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_tuple)
    finished_sending: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)

    @property
    def prefill_tokens(self) -> int:
        return sum(s.prefill_tokens for s in self.scheduled)

    @property
    def decode_tokens(self) -> int:
        return sum(s.decode_tokens for s in self.scheduled)

    @property
    def num_prefill_chunks(self) -> int:
        return sum(1 for s in self.scheduled if s.prefill_tokens)

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=False)
        data["arrivals"] = [a.to_dict() for a in self.arrivals]
        data["scheduled"] = [s.to_dict() for s in self.scheduled]
        data["blocks_allocated"] = {k: list(v) for k, v in self.blocks_allocated.items()}
        data["blocks_freed"] = {k: list(v) for k, v in self.blocks_freed.items()}
        # prefix-caching fields are written only when used, so caching-off traces keep their bytes
        if self.prefix_hit_blocks:
            data["prefix_hit_blocks"] = {k: list(v) for k, v in self.prefix_hit_blocks.items()}
        else:
            del data["prefix_hit_blocks"]
        if self.blocks_evicted:
            data["blocks_evicted"] = list(self.blocks_evicted)
        else:
            del data["blocks_evicted"]
        # speculative-decoding fields (version 3) likewise
        if self.num_accepted_tokens:
            data["num_accepted_tokens"] = dict(self.num_accepted_tokens)
        else:
            del data["num_accepted_tokens"]
        if self.draft_token_ids:
            data["draft_token_ids"] = {k: list(v) for k, v in self.draft_token_ids.items()}
        else:
            del data["draft_token_ids"]
        if not self.wasted_tokens:  # asynchronous scheduling only, likewise
            del data["wasted_tokens"]
        if self.group_blocks_allocated:  # hybrid KV cache groups (version 4) likewise
            data["group_blocks_allocated"] = {k: [list(g) for g in v] for k, v in self.group_blocks_allocated.items()}
        else:
            del data["group_blocks_allocated"]
        if self.blocks_skipped:
            data["blocks_skipped"] = {k: list(v) for k, v in self.blocks_skipped.items()}
        else:
            del data["blocks_skipped"]
        if self.group_prefix_hit_blocks:
            data["group_prefix_hit_blocks"] = {k: [list(g) for g in v] for k, v in self.group_prefix_hit_blocks.items()}
        else:
            del data["group_prefix_hit_blocks"]
        if self.blocks_deduplicated:
            data["blocks_deduplicated"] = {k: [list(p) for p in v] for k, v in self.blocks_deduplicated.items()}
        else:
            del data["blocks_deduplicated"]
        for name in KV_CONNECTOR_RECORD_FIELDS:  # KV connector only, likewise
            if data[name]:
                data[name] = dict(data[name]) if name == "kv_loads" else list(data[name])
            else:
                del data[name]
        data["aborts"] = list(self.aborts)
        data["preempted"] = list(self.preempted)
        data["aborted"] = list(self.aborted)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRecord:
        return cls(**data)

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        return cls.from_dict(json.loads(line))


class TraceFormatError(ValueError):
    """A trace file that cannot be read; the message names the file, the line and the field."""


@cache
def trace_schema() -> dict[str, Any]:
    """The published JSON Schema (``trace-schema.json``) as a dict."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def _is_integer(checker: Any, instance: Any) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


StrictValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer))
"""Draft 2020-12 with JSON Schema's ``"integer"`` read as "a number written without a fraction or exponent":
``5.0`` and ``1e3`` are refused where an integer is required (the standard, and ``jsonschema-rs``, accept
them: JSON Schema's data model does not distinguish ``5`` from ``5.0``). One decision for every input file of
the project (traces, recordings, cost profiles, run records; scenarios apply the same rule in their own
reader): a count written as a float is a writer's bug, not a number to round (docs/trace-format.md,
*Numbers*). Every ``jsonschema`` validator of ours is this one."""

_FLOAT_TOKEN = re.compile(rb"-?[0-9]+(?:\.[0-9]+)?[eE][-+]?[0-9]+|-?[0-9]+\.[0-9]+(?![0-9eE])")
"""A JSON number with an exponent or a fraction: the tokens that may read as an integral float (``5.0``,
``1e3``, ``1.5e3``, and ``5.9999999999999999``, which rounds to 6.0). It may also match digits inside a string
(an id ``"x1.0"``): that costs only speed (:func:`has_integral_float`)."""


_FLOAT_HINTS = (re.compile(rb"\.0+(?![0-9])"), re.compile(rb"e[-+0-9]"), re.compile(rb"E[-+0-9]"),
                re.compile(rb"[0-9.]{17}"))
"""What every integral float :data:`_FLOAT_TOKEN` finds shows: a fraction of zeros, an exponent, or at least 16
digits (a decimal of at most 15 significant digits is the double nearest to it and back, DBL_DIG, so one with a
fraction that is not all zeros reads as a whole number only with 16 digits or more: ``5.9999999999999999``,
found in review). Each is a pattern ``re`` scans for fast; a line with none of them is not searched further
(most lines of a trace: times such as ``0.0107`` match none)."""


def has_integral_float(line: bytes) -> bool:
    """Whether the JSON text ``line`` may hold a number written as a float with an integral value (``5.0``,
    ``1e3``), which :data:`StrictValidator` refuses where an integer is required and ``jsonschema-rs``
    accepts. True for such a number anywhere, also in a field that is a float (``"start_time": 0.0``) or
    inside a string: then the line is judged by :data:`StrictValidator` itself (slower, the same verdict)."""
    if not any(hint.search(line) for hint in _FLOAT_HINTS):
        return False
    return any(float(token).is_integer() for token in _FLOAT_TOKEN.findall(line))


@cache
def _validator(part: str, version: int) -> jsonschema.Draft202012Validator:
    schema = json.loads(json.dumps(trace_schema()))  # a private copy
    if version == 1:  # version 1 arrivals carried no stop conditions
        schema["$defs"]["arrival"]["required"].remove("eos_token_id")
    if version < 3:  # nor speculative decoding before version 3: its fields are unknown fields there
        for name in SPECULATIVE_RECORD_FIELDS:
            del schema["$defs"]["record"]["properties"][name]
        del schema["$defs"]["scheduled"]["properties"]["spec_token_ids"]
    if version < HYBRID_SCHEMA_VERSION:  # nor KV cache groups before version 4
        for name in HYBRID_RECORD_FIELDS:
            del schema["$defs"]["record"]["properties"][name]
    return StrictValidator({"$ref": f"#/$defs/{part}", "$defs": schema["$defs"]})


@cache
def _fast_validator(part: str, version: int) -> jsonschema_rs.Draft202012Validator:
    """The compiled validator of the schema :func:`_validator` checks (the same dict), used as a screen."""
    return jsonschema_rs.Draft202012Validator(_validator(part, version).schema)


def _field_path(path: Iterable[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(the line)"


def _schema_error(where: str, part: str, version: int, data: Any, line: bytes) -> TraceFormatError | None:
    """The error of ``data`` (parsed from the JSON text ``line``) against ``$defs/part`` of the schema
    (version ``version``), or ``None``.

    ``jsonschema-rs`` screens first (about 60,000 records a second against ``jsonschema``'s 240 on a
    lab trace of 45 scheduled requests a step); what it accepts is valid, unless the line may hold an
    integral float (:func:`has_integral_float`: the screen reads ``5.0`` as an integer, the definition does
    not). Anything else, a refusal or a failure of the screen itself, is judged by ``jsonschema``
    (:data:`StrictValidator`), the definition, which also names the field (its ``best_match``), so a refused
    line's message is ``jsonschema``'s whichever screen ran.
    """
    try:
        if not has_integral_float(line) and _fast_validator(part, version).is_valid(data):
            return None
    except Exception:  # noqa: BLE001 - the screen cannot decide; the definition below does
        pass
    error = jsonschema.exceptions.best_match(_validator(part, version).iter_errors(data))
    if error is None:
        return None
    message = _error_message(error)
    # jsonschema's message starts with the offending value and ends with what is wrong with it: a long
    # one is cut in the middle, so the part that says what is wrong is kept
    message = message if len(message) <= 200 else message[:60] + " ... " + message[-140:]
    return TraceFormatError(f"{where}: field {_field_path(error.absolute_path)}: {message}")


def _error_message(error: jsonschema.exceptions.ValidationError) -> str:
    """``error``'s message; for a value that fits none of an ``anyOf`` ("5.0 is not valid under any of the given
    schemas"), what each alternative says instead ("5.0 is not of type 'integer'; 5.0 is not of type 'null'")."""
    if error.validator in ("anyOf", "oneOf") and error.context:
        return "; ".join(dict.fromkeys(sub.message for sub in error.context if not sub.path))
    return error.message


def record_schema_errors(data: Any, version: int = HYBRID_SCHEMA_VERSION) -> str | None:
    """The first schema error of one record given as a JSON object (``"field X: message"``), or ``None``."""
    try:
        text = json.dumps(data).encode()
    except (TypeError, ValueError):  # not JSON at all: the definition alone judges it
        text = b"0.0"
    problem = _schema_error("record", "record", version, data, text)
    return None if problem is None else str(problem).partition(": ")[2]


MAX_LINE_BYTES = 64 * 1024 * 1024
"""Longest line read (64 MiB); a longer one is unusable input, not a reason to exhaust memory."""


def _read_line(handle: IO[bytes], where: str) -> bytes:
    line = handle.readline(MAX_LINE_BYTES + 1)
    if len(line) > MAX_LINE_BYTES:
        raise TraceFormatError(f"{where}: a line longer than {MAX_LINE_BYTES:,} bytes")
    return line


class StrictJsonError(ValueError):
    """Text that is not JSON this project accepts: not JSON at all, nested too deeply, NaN or Infinity, or
    a key twice in one object (the standard library would keep the last one silently).

    Attributes:
        lineno: the line (1-based) where the JSON parser stopped, or ``None`` when no line is known.
    """

    def __init__(self, message: str, lineno: int | None = None) -> None:
        super().__init__(message)
        self.lineno = lineno


def _reject_constant(name: str) -> None:
    raise StrictJsonError(f"{name} is not a finite number")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):  # a key repeats: name the first one repeated
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise StrictJsonError(f"key {key!r} appears twice in one object")
            seen.add(key)
    return data


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise StrictJsonError(f"{text[:40]} is out of range for a number (at most about 1.8e308)")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise StrictJsonError(f"an integer of {len(text.lstrip('-')):,} digits ({text[:20]}...) is out of range")
    return int(text)


MAX_JSON_INT_DIGITS = 100
"""The longest integer (in digits) :func:`strict_json_loads` reads; no field of ours needs more (the
standard library's own limit, 4,300 digits, raises a bare ``ValueError``)."""
_LONG_DIGITS = re.compile(f"[0-9]{{{MAX_JSON_INT_DIGITS + 1}}}")


def strict_json_loads(text: str, *, constants: bool = False) -> Any:
    """``json.loads`` that refuses NaN, Infinity, numbers out of a float's range (``1e400``), integers
    longer than :data:`MAX_JSON_INT_DIGITS` digits, repeated keys and lone UTF-16 surrogates in strings
    (``"\\ud800"``), with every failure one exception.

    With ``constants`` the literals ``NaN``, ``Infinity`` and ``-Infinity`` are read as floats (for a reader
    whose range check of each field refuses them, naming the field); repeated keys are still refused.

    Raises:
        StrictJsonError: the message says why ("not JSON (... at column N)", "nested too deeply", "NaN is
            not a finite number", "key 'x' appears twice in one object"); ``lineno`` where known.
    """
    # Integers are read by the parser's own C code unless the text has a run of more digits than an
    # integer may have (then every integer goes through _bounded_int, which names it): the same verdicts.
    parse_int = _bounded_int if _LONG_DIGITS.search(text) else None
    try:
        data = json.loads(text, parse_constant=float if constants else _reject_constant,
                          object_pairs_hook=_no_duplicate_keys, parse_float=_finite_float, parse_int=parse_int)
        _refuse_lone_surrogates(text, data)
        return data
    except json.JSONDecodeError as error:
        raise StrictJsonError(f"not JSON ({error.msg} at column {error.colno})", error.lineno) from None
    except RecursionError:
        raise StrictJsonError("nested too deeply") from None
    except StrictJsonError as error:
        if error.lineno is None:  # a number refused by a hook: find its line by parsing up to it
            error.lineno = _line_of_refused_number(text)
        raise


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
"""A ``\\uD800``..``\\uDFFF`` escape: half of a UTF-16 pair, which JSON allows alone and Unicode text does not."""


def _refuse_lone_surrogates(text: str, data: Any) -> None:
    """:class:`StrictJsonError` if a string of ``data`` (parsed from ``text``) holds a lone surrogate (``"\\ud800"``
    alone: no character, so no file name, id or message can be written with it); a pair is one character."""
    first = _SURROGATE_ESCAPE.search(text)
    if first is None:
        return
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise StrictJsonError("a string holds a lone UTF-16 surrogate (\\ud800 to \\udfff without its pair): not "
                              "Unicode text", text.count("\n", 0, first.start()) + 1) from None


def _line_of_refused_number(text: str) -> int | None:
    """The line of the first number :func:`strict_json_loads` refuses (for its message)."""
    import re

    refused: list[int] = []
    for match in re.finditer(r'"(?:[^"\\]|\\.)*"|-?\d+(\.\d+)?([eE][-+]?\d+)?', text):
        token = match.group(0)
        if token.startswith('"'):  # a string: its digits are no number
            continue
        try:
            (_finite_float if match.group(1) or match.group(2) else _bounded_int)(token)
        except (StrictJsonError, ValueError):
            refused.append(match.start())
            break
    return text.count("\n", 0, refused[0]) + 1 if refused else None


def json_line(text: str, path: Sequence[str | int]) -> int | None:
    """The line (1-based) in the JSON ``text`` where the value at ``path`` (keys and list indexes, as a
    ``jsonschema`` error's ``absolute_path``) starts; ``None`` if the text does not hold that path. For
    messages that name the file, line and field of a value a schema refuses."""
    decoder = json.JSONDecoder()
    whitespace = " \t\n\r"

    def skip(i: int) -> int:
        while i < len(text) and text[i] in whitespace:
            i += 1
        return i

    position = skip(0)
    try:
        for part in path:
            if text[position] == "{" and isinstance(part, str):
                i = skip(position + 1)
                while text[i] != "}":
                    key, i = json.decoder.scanstring(text, i + 1)
                    i = skip(skip(i) + 1)  # the colon
                    if key == part:
                        break
                    i = skip(decoder.raw_decode(text, i)[1])
                    i = skip(i + 1) if text[i] == "," else i
                else:
                    return None
            elif text[position] == "[" and isinstance(part, int):
                i = skip(position + 1)
                for _ in range(part):
                    if text[i] == "]":
                        return None
                    i = skip(decoder.raw_decode(text, i)[1])
                    i = skip(i + 1) if text[i] == "," else i
                if text[i] == "]":
                    return None
            else:
                return None
            position = i
    except (IndexError, ValueError):
        return None
    return text.count("\n", 0, position) + 1


def schema_problem(validator: jsonschema.protocols.Validator, data: Any, text: str | None = None,
                   ) -> tuple[int | None, str] | None:
    """The most relevant error of ``data`` against ``validator`` (``jsonschema.exceptions.best_match``) as
    ``(line, "field PATH: message")``, or ``None`` when it is valid. An unknown key (``additionalProperties``)
    is named as the field itself ("field coefficients.f_s_per_prefill_chunks: unknown; known: ...").
    ``line`` is where the field is in ``text`` (:func:`json_line`), ``None`` without ``text``."""
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is None:
        return None
    path = list(error.absolute_path)
    message = _error_message(error)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        import re

        known = list(error.schema.get("properties", {}))
        patterns = list(error.schema.get("patternProperties", {}))
        extra = [k for k in error.instance if k not in known and not any(re.search(p, k) for p in patterns)]
        if extra:
            path.append(extra[0])
            message = f"unknown field; known: {', '.join(known)}" if known else "unknown field"
    if len(message) > 200:
        message = message[:200] + "..."
    return (json_line(text, path) if text is not None else None), f"field {_field_path(path)}: {message}"


def _parse(line: bytes, where: str) -> Any:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TraceFormatError(f"{where}: not UTF-8 (byte {error.start})") from None
    try:
        return strict_json_loads(text)
    except StrictJsonError as error:
        raise TraceFormatError(f"{where}: {error}") from None


def header_line(config: SchedulerConfig, scheduler: str = "", async_scheduling: bool = False) -> str:
    """The header line of a trace (schema version :func:`schema_version_for` the config), without its newline;
    with ``async_scheduling`` (an engine that plans a step while the one before is in flight) it says
    ``"async_scheduling": true`` (a synchronous engine's header is byte for byte what it was)."""
    header = {"schema_version": schema_version_for(config), "config": config.to_dict(), "scheduler": scheduler}
    if async_scheduling:
        header["async_scheduling"] = True
    return json.dumps(header)


def write_trace(out: IO[str], config: SchedulerConfig, records: Iterable[StepRecord], scheduler: str = "",
                async_scheduling: bool = False) -> None:
    """Write the header line (:func:`header_line`) and one line per record."""
    out.write(header_line(config, scheduler, async_scheduling) + "\n")
    for record in records:
        out.write(record.to_json() + "\n")


@attrs.define
class TraceFile:
    """An opened, header-validated trace file.

    Attributes:
        path: the file.
        config: the header's config.
        scheduler: the header's scheduler name ("" if none).
        schema_version: 1, 2, 3 or 4.
        notes: what the reader assumed, to print beside the verdict (the version-1 convention).
        async_scheduling: the header's ``async_scheduling`` (false when absent): each plan was made while
            the step before was in flight (:class:`~schedspec.spec.state.InFlightStep`).
    """

    path: Path
    config: SchedulerConfig
    scheduler: str
    schema_version: int
    notes: list[str]
    async_scheduling: bool = False

    def records(self) -> Iterator[StepRecord]:
        """The records in file order, each validated against the schema as it is read.

        Raises:
            TraceFormatError: a line that is not UTF-8, not JSON (NaN and Infinity included), repeats a
                key, or breaks the schema (file, line and field named).
        """
        with self.path.open("rb") as handle:
            handle.readline()
            number = 1
            while True:
                number += 1
                where = f"{self.path}:{number}"
                line = _read_line(handle, where)
                if not line:
                    return
                if not line.strip():
                    continue
                data = _parse(line, where)
                problem = _schema_error(where, "record", self.schema_version, data, line)
                if problem is not None:
                    raise problem
                if self.schema_version == 1:
                    for arrival in data["arrivals"]:
                        arrival.setdefault("eos_token_id", V1_EOS_TOKEN_ID)
                yield _record(data, where)


def _record(data: dict[str, Any], where: str) -> StepRecord:
    """The :class:`StepRecord` of a schema-valid line, or :class:`TraceFormatError` naming the line and the field
    where a value the schema allows is still impossible (an arrival's ``abort_at_step`` before its
    ``arrival_step``, ``num_external_computed_tokens`` above its ``prompt_len``: :class:`RequestSpec`'s checks)."""
    try:
        return StepRecord.from_dict(data)
    except (ValueError, TypeError) as error:
        field = "(the line)"
        for index, arrival in enumerate(data.get("arrivals", ())):
            try:
                RequestSpec.from_dict(arrival)
            except (ValueError, TypeError):
                field = f"arrivals[{index}]"
                break
        raise TraceFormatError(f"{where}: field {field}: {error}") from None


def open_trace(path: str | Path) -> TraceFile:
    """Open a trace file and validate its header.

    Raises:
        TraceFormatError: unreadable file, bad header (not JSON, schema, unknown version, invalid
            config); the message names the file, line 1 and the field.
    """
    path = Path(path)
    try:
        regular = not path.exists() or path.is_file()
    except (OSError, ValueError):  # too long a name, a NUL character: open() below names the reason
        regular = True
    if not regular:  # raised outside the try below, which would wrap its message (TraceFormatError is a ValueError)
        raise TraceFormatError(f"{path}: not a regular file (a folder, device or pipe cannot be read as a trace)")
    try:
        with path.open("rb") as handle:
            first = _read_line(handle, f"{path}:1")
    except OSError as error:
        raise TraceFormatError(f"{path}: cannot read ({error.strerror})") from None
    except ValueError as error:  # a NUL character in the path
        raise TraceFormatError(f"{path}: cannot read ({error})") from None
    where = f"{path}:1"
    if not first.strip():
        raise TraceFormatError(f"{where}: empty; expected the header line")
    header = _parse(first, where)
    version = header.get("schema_version") if isinstance(header, dict) else None
    if isinstance(header, dict) and "schema_version" in header and (type(version) is not int
                                                                     or version not in READABLE_VERSIONS):
        raise TraceFormatError(f"{where}: field schema_version: {version!r} is not one of {list(READABLE_VERSIONS)}")
    problem = _schema_error(where, "header", SCHEMA_VERSION, header, first)
    if problem is not None:
        raise problem
    try:
        config = SchedulerConfig.from_dict(header["config"])
    except (ConfigError, TypeError) as error:
        raise TraceFormatError(f"{where}: field config: {error}") from None
    # (with KV cache groups, version 4; groups with speculative decoding are then refused as not specified, exit 3)
    if config.speculative and version != SCHEMA_VERSION and not config.kv_cache_groups:
        raise TraceFormatError(f"{where}: field config.num_speculative_tokens: {config.num_speculative_tokens} "
                               f"(speculative decoding) needs schema_version {SCHEMA_VERSION}, the header says {version}")
    if config.kv_cache_groups and version != HYBRID_SCHEMA_VERSION:
        raise TraceFormatError(f"{where}: field config.kv_cache_groups: KV cache groups need schema_version "
                               f"{HYBRID_SCHEMA_VERSION}, the header says {version}")
    if config.num_kv_blocks > MAX_STATE_BLOCKS:
        raise TraceFormatError(f"{where}: field config.num_kv_blocks: {config.num_kv_blocks:,} is more than the "
                               f"{MAX_STATE_BLOCKS:,} blocks the checker can hold")
    notes = []
    if version == 1:
        notes.append(f"{path}: schema_version 1: arrivals carry no stop conditions; read with eos_token_id "
                     f"{V1_EOS_TOKEN_ID} (the version-1 convention)")
    return TraceFile(path, config, str(header.get("scheduler", "")), version, notes,
                     bool(header.get("async_scheduling", False)))


def read_trace(path: str | Path) -> tuple[SchedulerConfig, Iterator[StepRecord]]:
    """:func:`open_trace`, returning its config and its records.

    Raises:
        TraceFormatError: as :func:`open_trace` and :meth:`TraceFile.records`.
    """
    trace = open_trace(path)
    return trace.config, trace.records()
