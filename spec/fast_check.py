"""A fast screening path for ``schedspec check``, kept in lockstep with the spec.

:func:`fast_check` reads a trace file and replays it on a **mutable shadow** of exactly what the rules,
the record comparison and the default trace properties need, fed straight from each line's parsed JSON
(no :class:`~schedspec.spec.trace.StepRecord`, no immutable :class:`~schedspec.spec.state.SchedulerState`
per step). It only ever answers "every step of this trace is legal" (the :class:`~schedspec.spec.checker.CheckReport`
of a passing trace) or "I cannot tell" (``None``): at the first step it cannot prove legal, for any reason,
the caller judges the whole trace again with the plain path, :func:`~schedspec.spec.checker.check_trace`,
from the start, so that every verdict that is not a pass (the first illegal step, the state before it,
the violations, the exit code, every byte printed) is the plain path's own. It never decides "illegal".

**What it models** (per live request: prompt length, ``max_tokens``, outputs, computed tokens, block
table, running or waiting, stop conditions; globally: the step counter, the clock, the free blocks as a
set, the running and waiting counts, the ids ever added, the waiting requests that must be rejected, and
the ``progress`` monitor's high-water marks), and per step, in the plain path's order
(:func:`~schedspec.spec.checker.check_trace`): the step number and times; each arrival (a fresh id,
``arrival_step``, ``arrival_time``, ``max_tokens >= 0``); the workload's own events (``abort_at_step``: aborted
by that step; ``eos_at_output``: that output sampled as the EOS id; ``abort_at_time`` is not judged); the
client's aborts and ``aborted``; the rules
of :mod:`~schedspec.spec.rules` that can find anything under the allowed features (``known-requests``,
``token-budget``, ``positive-tokens``, ``chunk-continues``, ``no-overcompute``,
``whole-prefill-without-chunking``, ``long-prefill-threshold`` (adaptive too), ``sequence-cap``,
``admit-fits-alone``, ``reject-only-impossible``, ``preempt-running-only``, ``blocks-from-free-pool``,
``block-table-covers``, ``no-excess-blocks``; the prefix-caching, speculative-decoding, in-flight and
per-step-limit rules find nothing with those features off, and a record that names a field of theirs
falls back); the prefill/decode split; the samplers and their ``sampled_token_ids``; the step's
update (preempt, reject, schedule, sample with :func:`~schedspec.spec.stop_rule.stop_reason_of`, the
spec's one stop rule); and the record's derived fields: ``finished`` and its reasons, ``blocks_freed``,
``blocks_allocated`` outside the batch, the prefix-caching fields, ``blocks_evicted``, ``wasted_tokens``,
``num_free_blocks``, ``num_running``, ``num_waiting``. The default properties: ``progress`` is followed
exactly (a window that would report falls back); ``rejects-impossible`` cannot report on a step that
keeps ``reject-only-impossible`` (the rule states the monitor's two cases for the same requests).

**Invariants** are not re-checked: the rules alone imply every invariant is preserved by the spec's
update (:mod:`schedspec.spec.proofs`, the spec's central theorem for synchronous engines), and the
shadow's update is the spec's update restricted to the allowed features; the lockstep tests
(``tests/test_fast_check.py``) compare the two on every catalogue mutant and on generated traces.

**What makes it fall back** (``None``): a config feature outside the allow-list (:func:`supported`: prefix
caching, speculative decoding, asynchronous scheduling, LoRA, the watermark, ``max_num_active_seqs``,
the prefill cadence), properties other than :data:`~schedspec.spec.checker.DEFAULT_PROPERTIES`,
``keep_going``; a record naming a field outside :data:`MODELLED_RECORD_FIELDS` with a non-empty value, an
arrival naming one outside :data:`MODELLED_ARRIVAL_FIELDS` (allow-lists: a field added to the format later
falls back until it is modelled); an arrival with a LoRA adapter, or one the plain reader refuses as it
builds the request (``abort_at_step`` before ``arrival_step``, ``abort_at_time`` before ``arrival_time``,
``hash_block_tokens < 1``); any line that does not parse, breaks the schema, might repeat a key, or
is longer than :data:`~schedspec.spec.trace.MAX_LINE_BYTES`; any rule, comparison or property it doubts;
requests still live at the end of the trace (unless ``allow_unfinished``); and any exception of its own.

**Why a pass is sound**: each check above is the plain path's check on the same values (the shadow holds
the same numbers as the spec's state, by induction over the steps, since both start from the initial
state and apply the same update); a step passes only when every one of them passes; and a line passes
the reader only when the plain reader accepts it too: ``orjson`` (when installed) or ``json.loads``, then
the plain reader's own schema check (``trace._schema_error``: the compiled screen, or ``jsonschema`` for a line
that may hold an integral float such as ``5.0``, which the screen would read as an integer), and a
repeated-key screen: with no ``"`` followed by whitespace on the line, every key's closing quote is
followed by ``:``, so the line's count of ``":`` bounds its keys from above; when it equals the keys of the
parsed objects, no key was read twice. Otherwise the line is parsed by the strict reader
(:func:`~schedspec.spec.trace.strict_json_loads`), which refuses repeated keys, NaN and out-of-range
numbers. ``orjson`` refuses NaN, Infinity, numbers out of a float's range, lone surrogates and control
characters (any refusal falls back: the plain path then names the problem).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import attrs

from schedspec.spec.admission import rejection_code, rejection_reason, rejection_reasons
from schedspec.spec.checker import DEFAULT_PROPERTIES, TIME_TOLERANCE, CheckReport
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens
from schedspec.spec.persistent import EndedIds
from schedspec.spec.stop_rule import stop_reason_of
from schedspec.spec.trace import (
    MAX_LINE_BYTES,
    READABLE_VERSIONS,
    V1_EOS_TOKEN_ID,
    StrictJsonError,
    TraceFile,
    _schema_error,
    strict_json_loads,
)

try:  # a well-kept compiled parser, when installed (pyproject's dependencies pin it); json otherwise
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - the plain json module is as correct, slower
    _loads = json.loads

MAP_FIELDS = ("blocks_allocated", "blocks_freed", "prefix_hit_tokens", "prefix_hit_blocks", "finished", "rejected",
              "sampled_token_ids", "num_accepted_tokens", "draft_token_ids", "wasted_tokens", "group_blocks_allocated",
              "blocks_skipped", "group_prefix_hit_blocks", "kv_loads", "blocks_deduplicated")
"""The record fields whose values are JSON objects (besides ``arrivals[]`` and ``scheduled[]``): with the
record itself, every object a valid record holds (``tests/test_fast_check.py`` reads the schema to check it),
for the repeated-key screen."""

MODELLED_ARRIVAL_FIELDS = frozenset({
    "request_id", "prompt_len", "max_tokens", "arrival_step", "arrival_time", "abort_at_step", "abort_at_time",
    "eos_token_id", "eos_at_output", "stop_token_ids", "min_tokens", "priority", "lora_int_id",
    "hash_block_tokens", "block_hash_ids", "prefix_group", "prefix_len",
})
"""The arrival fields :func:`fast_check` reads or may ignore (the prompt's hash fields matter only with prefix
caching, which falls back; ``priority`` only orders a policy's choices, which the rules do not judge). An
arrival naming any other field makes it fall back, whatever the value: an allow-list, so that a field added
to the trace format later (structured output's ``grammar_compile_steps``, the KV connector's
``num_external_computed_tokens``, ``kv_send``, ...) is judged by the plain path until the fast path models
it (``tests/test_fast_check.py`` checks that every arrival field of the schema is here or falls back)."""

_QUOTE_SPACE = re.compile(rb'"[ \t\r\n]')
"""A ``"`` followed by JSON whitespace (a key might then be written ``"key" :``): the repeated-key screen
hands such a line to the strict reader."""

MODELLED_RECORD_FIELDS = frozenset({
    "step", "start_time", "duration", "arrivals", "aborts", "aborted", "scheduled", "blocks_allocated",
    "blocks_freed", "prefix_hit_tokens", "preempted", "rejected", "sampled_token_ids", "finished",
    "num_free_blocks", "num_running", "num_waiting",
})
"""The record fields :func:`fast_check` models. A record naming any other field with a non-empty value makes it
fall back (speculative decoding's ``num_accepted_tokens``/``draft_token_ids``, prefix caching's
``prefix_hit_blocks``/``blocks_evicted``, asynchronous scheduling's ``wasted_tokens``, the KV cache groups'
``group_blocks_allocated``/``blocks_skipped``, the KV connector's ``kv_loads``, ``finished_recving``,
``invalid_block_ids``, ``finished_sending``, SGLang's de-duplication ``blocks_deduplicated``, and any field added later): an allow-list, so that a new field
is judged by the plain path until the fast path models it. With those features off each such entry is a
violation, or an empty one that the plain path accepts too."""


FAST_CONFIG_FIELDS = ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                      "enable_chunked_prefill", "long_prefill_token_threshold", "long_prefill_token_threshold_adaptive")
"""The config fields :func:`fast_check` models at any value; every other field of
:class:`~schedspec.spec.config.SchedulerConfig` must have its default (so a feature added to the config later
falls back until the fast path models it)."""


def supported(config: SchedulerConfig, schema_version: int, async_scheduling: bool) -> bool:
    """Whether :func:`fast_check` models traces of this header: synchronous, any readable schema version (a
    version-1 arrival's EOS id is :data:`~schedspec.spec.trace.V1_EOS_TOKEN_ID`, as the plain reader sets it),
    and every config field outside :data:`FAST_CONFIG_FIELDS` at its default (prefix caching, speculative
    decoding and the per-step limits off: LoRA, watermark, ``max_num_active_seqs``, prefill cadence). Chunked
    prefill on or off, any ``long_prefill_token_threshold`` (adaptive too), any policy (the rules are
    policy-independent)."""
    if async_scheduling or schema_version not in READABLE_VERSIONS:
        return False
    for field in attrs.fields(type(config)):
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory(config) if default.takes_self else default.factory()
        if field.name not in FAST_CONFIG_FIELDS and getattr(config, field.name) != default:
            return False
    return True


class _Request:
    """The shadow of one live request: what the rules, the update and the record comparison read."""

    __slots__ = ("prompt_len", "max_tokens", "num_outputs", "num_computed", "blocks", "running", "eos",
                 "stops", "min_tokens", "eos_at_output")

    def __init__(self, prompt_len: int, max_tokens: int, eos: int | None, stops: tuple[int, ...],
                 min_tokens: int, eos_at_output: int) -> None:
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.num_outputs = 0
        self.num_computed = 0
        self.blocks: list[int] = []
        self.running = False
        self.eos = eos
        self.stops = stops
        self.min_tokens = min_tokens
        self.eos_at_output = eos_at_output  # the workload's EOS position (0: none, or no EOS id)


class _Doubt(Exception):
    """The fast path cannot prove the step legal: the plain path judges the trace."""


def _parse(line: bytes, version: int) -> dict:
    """One record line as the plain reader would read it (``version``: the trace's schema version, judged by
    the plain reader's own schema check, ``trace._schema_error``), or :class:`_Doubt` (module docstring)."""
    try:
        data = _loads(line)
    except ValueError:  # orjson.JSONDecodeError and json.JSONDecodeError are ValueErrors
        raise _Doubt from None
    if type(data) is not dict:
        raise _Doubt
    if _schema_error("", "record", version, data, line) is not None:
        raise _Doubt
    keys = len(data) + sum(map(len, data["arrivals"])) + sum(map(len, data["scheduled"]))
    for name in MAP_FIELDS:
        value = data.get(name)
        if value:
            keys += len(value)
    if line.count(b'":') != keys or _QUOTE_SPACE.search(line):
        try:  # the strict reader decides (repeated keys, numbers); it accepts nothing json.loads refuses
            data = strict_json_loads(line.decode("utf-8"))
        except (StrictJsonError, UnicodeDecodeError):
            raise _Doubt from None
    return data


class FastChecker:
    """The mutable shadow of a synchronous run and its per-step check (module docstring).

    Args:
        config: the trace header's config (:func:`supported` must hold).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.step = 0
        self.live: dict[str, _Request] = {}
        # every id ever added (a reused id is refused: transitions.add_request), in about one bit per numbered
        # id, so that a long trace's check holds no string per ended request (bounded memory, benchmarks/size.py)
        self.known = EndedIds()
        self.free: set[int] = set(range(config.num_kv_blocks))
        self.num_running = 0
        self.must_reject: set[str] = set()  # waiting, never admitted, and impossible: rejected at once
        self.abort_at_step: dict[str, int] = {}  # live requests whose arrival names abort_at_step
        self.previous_end: float | None = None
        self.high_water: dict[str, int] = {}  # the progress monitor's
        self.stalled_since: int | None = None
        self.window = config.max_model_len  # Progress's default window

    def check(self, data: dict) -> None:
        """Check one record (a parsed, schema-valid line) and apply it; :class:`_Doubt` where it cannot tell."""
        config = self.config
        live = self.live
        step = self.step
        if data["step"] != step:
            raise _Doubt
        start, duration = data["start_time"], data["duration"]
        if duration < 0:
            raise _Doubt
        end = self.previous_end
        if end is not None and start < end - TIME_TOLERANCE * max(1.0, abs(end)):
            raise _Doubt
        self.previous_end = start + max(duration, 0.0)

        for arrival in data["arrivals"]:
            self._arrive(arrival, step, start)

        aborts = data["aborts"]
        if self.abort_at_step:  # checker._compare_driven_aborts
            for request_id, due in list(self.abort_at_step.items()):
                if request_id not in live:
                    if request_id not in aborts:
                        del self.abort_at_step[request_id]
                elif due <= step and request_id not in aborts:
                    raise _Doubt
        freed: dict[str, list[int]] = {}
        aborted = []
        for request_id in aborts:
            request = live.pop(request_id, None)
            if request is None:
                continue
            aborted.append(request_id)
            if request.blocks:
                freed[request_id] = request.blocks
                self.free.update(request.blocks)
            if request.running:
                self.num_running -= 1
            self.must_reject.discard(request_id)
            self.high_water.pop(request_id, None)
        recorded_aborted = data["aborted"]
        if len(recorded_aborted) != len(aborted) or set(recorded_aborted) != set(aborted):
            raise _Doubt
        has_live = bool(live)

        for name, value in data.items():
            if value and name not in MODELLED_RECORD_FIELDS:
                raise _Doubt
        if any(data["prefix_hit_tokens"].values()):
            raise _Doubt

        # A doubt anywhere below abandons the shadow (the plain path judges the whole trace), so each request
        # is checked and updated in one pass; what one item's check reads of the others (the free blocks, the
        # counts) is kept as it was before the step.
        scheduled = data["scheduled"]
        preempted = data["preempted"]
        rejected = data["rejected"]
        allocated = data["blocks_allocated"]
        sampled = data["sampled_token_ids"]
        num_running, num_live = self.num_running, len(live)
        # preempt-running-only, known-requests (each named once); the update: spec.transitions.preempt
        released: set[int] = set()
        for request_id in preempted:
            request = live.get(request_id)
            if request is None or not request.running:  # also a request named twice
                raise _Doubt
            released.update(request.blocks)
            if request.blocks:
                freed[request_id] = request.blocks
            request.blocks = []
            request.num_computed = 0
            request.running = False
        # reject-only-impossible (and rejects-impossible); the update: spec.transitions.reject
        if not self.must_reject.issubset(rejected):
            raise _Doubt
        for request_id, reason in rejected.items():
            request = live.pop(request_id, None)
            if request is None or request.running or request_id in preempted:
                raise _Doubt
            reasons = rejection_reasons(request.prompt_len, request.max_tokens, config)
            if not reasons or rejection_code(reason) not in {rejection_code(r) for r in reasons}:
                raise _Doubt
            self.must_reject.discard(request_id)
            self.high_water.pop(request_id, None)

        threshold = 0
        chunked = config.enable_chunked_prefill
        if chunked:
            threshold = config.effective_long_prefill_threshold(num_live - len(rejected))
        block_size = config.block_size
        free = self.free
        high_water = self.high_water
        batch: set[str] = set()
        handed: set[int] = set()
        total = 0
        admitted = 0
        advanced = False
        samplers: list[tuple[str, _Request]] = []
        for item in scheduled:
            request_id = item["request_id"]
            request = live.get(request_id)
            if request is None or request_id in batch or request_id in preempted or "spec_token_ids" in item:
                raise _Doubt  # known-requests, preempt-running-only; drafts: the plain path
            batch.add(request_id)
            start_at = item["num_computed_tokens"]
            prefill, decode = item["prefill_tokens"], item["decode_tokens"]
            tokens = prefill + decode
            computed = request.num_computed
            num_tokens = request.prompt_len + request.num_outputs
            pending = num_tokens - computed
            # positive-tokens, chunk-continues, no-overcompute, whole-prefill-without-chunking, long-prefill-threshold
            if tokens < 1 or start_at != computed or tokens > pending or (not chunked and tokens != pending) \
                    or (threshold and tokens > threshold):
                raise _Doubt
            if pending == 1 and computed >= request.prompt_len:  # the split: a decode (Request.is_decode)
                if prefill:
                    raise _Doubt
            elif decode:
                raise _Doubt
            new = allocated.get(request_id, ())
            for block_id in new:  # blocks-from-free-pool
                if block_id in handed or (block_id not in free and block_id not in released):
                    raise _Doubt
                handed.add(block_id)
            held = len(request.blocks) + len(new)  # block-table-covers, no-excess-blocks
            if held < blocks_for_tokens(start_at + tokens, block_size) or held > blocks_for_tokens(num_tokens, block_size):
                raise _Doubt
            total += tokens
            # the update: spec.transitions.schedule; the progress monitor's high-water mark
            request.num_computed = computed + tokens
            if new:
                request.blocks = request.blocks + new
            if not request.running:
                if request_id in self.must_reject:  # admit-fits-alone
                    raise _Doubt
                request.running = True
                admitted += 1
            if computed + tokens > high_water.get(request_id, 0):
                high_water[request_id] = computed + tokens
                advanced = True
            if computed + tokens == num_tokens:  # samples (state.samples_this_step)
                if request_id not in sampled:
                    raise _Doubt
                samplers.append((request_id, request))
        if len(sampled) != len(samplers) or total > config.max_num_batched_tokens:  # token-budget
            raise _Doubt
        if num_running - len(preempted) + admitted > config.max_num_seqs:  # sequence-cap
            raise _Doubt
        for request_id, blocks in allocated.items():  # only scheduled requests get blocks
            if blocks and request_id not in batch:
                raise _Doubt
        free.update(released)
        free.difference_update(handed)

        # the update: spec.transitions.sample (the spec's stop rule), in batch order
        finished: dict[str, str] = {}
        max_model_len = config.max_model_len
        for request_id, request in samplers:
            token = sampled[request_id]
            if request.eos_at_output == request.num_outputs + 1 and token != request.eos:  # _compare_driven_eos
                raise _Doubt
            request.num_outputs += 1
            reason = stop_reason_of(token, request.num_outputs, request.prompt_len + request.num_outputs,
                                    request.eos, request.stops, request.min_tokens, request.max_tokens, max_model_len)
            if reason is None:
                continue
            finished[request_id] = reason
            del live[request_id]
            high_water.pop(request_id, None)
            if request.blocks:
                freed[request_id] = request.blocks
                free.update(request.blocks)
        self.num_running = num_running - len(preempted) + admitted - len(finished)
        ended = len(rejected) + len(finished)

        # the record's derived fields (checker._compare_record)
        if data["finished"] != finished:
            raise _Doubt
        recorded_freed = data["blocks_freed"]
        for request_id, blocks in recorded_freed.items():
            if sorted(blocks) != sorted(freed.get(request_id, ())):
                raise _Doubt
        for request_id in freed:
            if request_id not in recorded_freed:
                raise _Doubt
        if (data["num_free_blocks"] != len(free) or data["num_running"] != self.num_running
                or data["num_waiting"] != len(live) - self.num_running):
            raise _Doubt

        # progress (properties.Progress, its default window); rejects-impossible: see the module docstring
        if ended or advanced or not has_live:
            self.stalled_since = None
        else:
            if self.stalled_since is None:
                self.stalled_since = step
            if step - self.stalled_since + 1 >= self.window:
                raise _Doubt
        self.step = step + 1

    def _arrive(self, arrival: dict, step: int, start: float) -> None:
        """An arrival before ``step`` (``checker._compare_arrival`` and ``transitions.add_request``)."""
        for name in arrival:
            if name not in MODELLED_ARRIVAL_FIELDS:
                raise _Doubt
        if arrival.get("lora_int_id"):
            raise _Doubt
        arrival_step = arrival.get("arrival_step")
        arrival_time = arrival.get("arrival_time", 0.0)
        abort_at_step, abort_at_time = arrival.get("abort_at_step"), arrival.get("abort_at_time")
        hash_block_tokens = arrival.get("hash_block_tokens")
        if ((abort_at_step is not None and arrival_step is not None and abort_at_step < arrival_step)
                or (abort_at_time is not None and abort_at_time < arrival_time)
                or (hash_block_tokens is not None and hash_block_tokens < 1)):
            raise _Doubt  # RequestSpec or its prompt refuses it: the plain reader stops there its own way
        if arrival_step not in (None, step):
            raise _Doubt
        if arrival_time > start + TIME_TOLERANCE * max(1.0, abs(start)):
            raise _Doubt
        request_id = arrival["request_id"]
        max_tokens = arrival["max_tokens"]
        prompt_len = arrival["prompt_len"]
        # a backstop: the reader refuses an integer written as a float (spec/trace.py has_integral_float); an
        # arrival whose counts are not ints is the plain path's to judge, never certified here
        if type(prompt_len) is not int or type(max_tokens) is not int:
            raise _Doubt
        if request_id in self.known or max_tokens < 0:
            raise _Doubt
        self.known.add(request_id)
        eos = arrival.get("eos_token_id", V1_EOS_TOKEN_ID)
        eos_at_output = arrival.get("eos_at_output") or 0
        self.live[request_id] = _Request(prompt_len, max_tokens, eos, tuple(arrival.get("stop_token_ids", ())),
                                         arrival.get("min_tokens", 0), eos_at_output if eos is not None else 0)
        if abort_at_step is not None:
            self.abort_at_step[request_id] = abort_at_step
        if rejection_reason(prompt_len, max_tokens, self.config) is not None:
            self.must_reject.add(request_id)


def fast_check(trace: TraceFile, properties: Iterable[str] = DEFAULT_PROPERTIES, keep_going: bool = False,
               allow_unfinished: bool = False) -> CheckReport | None:
    """The report of a trace every step of which is legal, or ``None`` when the plain path
    (:func:`~schedspec.spec.checker.check_trace`) must judge it (module docstring): the report is then
    the one :func:`~schedspec.spec.checker.check_trace` gives the same trace with the same arguments.

    Args:
        trace: the opened trace (:func:`~schedspec.spec.trace.open_trace`: its header already validated).
        properties: the properties asked for; anything but :data:`~schedspec.spec.checker.DEFAULT_PROPERTIES`
            falls back.
        keep_going, allow_unfinished: as for :func:`~schedspec.spec.checker.check_trace` (``keep_going``
            falls back).
    """
    names = tuple(dict.fromkeys(properties))
    if (keep_going or names != DEFAULT_PROPERTIES
            or not supported(trace.config, trace.schema_version, trace.async_scheduling)):
        return None
    checker = FastChecker(trace.config)
    steps = 0
    try:
        with trace.path.open("rb") as handle:
            handle.readline()
            while True:
                line = handle.readline(MAX_LINE_BYTES + 1)
                if not line:
                    break
                if len(line) > MAX_LINE_BYTES:
                    return None
                if not line.strip():
                    continue
                checker.check(_parse(line, trace.schema_version))
                steps += 1
    except _Doubt:
        return None
    except Exception:  # noqa: BLE001 - anything unexpected: the plain path judges (and reports it its way)
        return None
    if checker.live and not allow_unfinished:
        return None
    return CheckReport(steps_checked=steps, valid_prefix=steps, properties=names)


__all__ = ["FAST_CONFIG_FIELDS", "MAP_FIELDS", "MODELLED_ARRIVAL_FIELDS", "MODELLED_RECORD_FIELDS", "FastChecker",
           "fast_check", "supported"]
