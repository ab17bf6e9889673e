"""Real traces for time-driven runs: the trace formats' readers, format detection and the packaged traces.

Windows of a workload: :mod:`~schedspec.lab.windows`; synthetic arrival processes:
:mod:`~schedspec.lab.synthetic`.

Every loader returns ``list[RequestSpec]`` sorted by ``arrival_time`` (seconds; the first request
of the file is at 0.0), with ``arrival_step=None``. Request ids are ``{prefix}-{row:06d}``, ``row``
counting data rows of the file from 0 (so the id says where the request came from).

Formats, detected from the first line (:func:`detect_format`; details and statistics in
``schedspec/data/traces/README.md``):

- ``azure``: the Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``), both
  releases: 2023 (CRLF line ends, no newline after the last row; ``YYYY-MM-DD HH:MM:SS.fffffff``,
  seven fractional digits, no zone) and 2024 (the one-week files: six fractional digits and a
  ``+00:00`` offset). Parsed exactly to the nanosecond. ``ContextTokens`` -> ``prompt_len``,
  ``GeneratedTokens`` -> ``max_tokens``.
- ``burstgpt``: the BurstGPT CSV (``Timestamp,Model,Request tokens,Response tokens,Total tokens,
  Log Type``; ``Timestamp`` in seconds). Failed requests (``Response tokens`` = 0) are kept; the
  spec rejects them at arrival with the reason.
- ``mooncake``: Mooncake JSON Lines (``timestamp`` in **milliseconds**, ``input_length``,
  ``output_length``, ``hash_ids``: one id per 512-token prompt block): the conversation, tool/agent
  and synthetic traces of the FAST'25 release and the arxiv trace. ``hash_ids`` become the prompt:
  equal hash ids give equal token ids (:class:`MooncakePrompt`, :func:`load_mooncake_jsonl`).

A row the spec would reject (a token count of 0, a prompt longer than any ``max_model_len``) is kept
as a request, which the spec rejects at arrival with its reason; only a row that is not a request at
all (a field that does not parse, a negative or absurd count, a byte that is not UTF-8) makes the
file unusable. Rows out of time order are sorted, and the loader reports it through ``notes``
(the first line that goes backwards), which ``schedspec lab`` prints.

The packaged traces (:func:`default_trace_path`) are unmodified copies distributed under their
licenses; :func:`trace_info` gives the attribution to show with any result computed from them.

Every bad input raises :class:`~schedspec.lab.workload_checks.WorkloadError` (a ``ValueError``) with a
one-line message naming the file, the line and the field (or the parameter).
"""

from __future__ import annotations

import csv
import datetime
import functools
import hashlib
import math
import re
import stat
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import attrs
import numpy as np

from schedspec.spec.config import blocks_for_tokens
from schedspec.spec.trace import StrictJsonError, strict_json_loads
from schedspec.spec.workload import BlockHashPrompt, RequestSpec

from .workload_checks import DIGITS, MAX_TOKEN_COUNT, WorkloadError

FORMATS = ("azure", "burstgpt", "mooncake")
"""Trace formats :func:`load_trace` reads."""

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per Mooncake ``hash_ids`` block."""

MooncakePrompt = BlockHashPrompt
"""A Mooncake request's prompt (``Sequence[int]`` with ``__len__``, ``__getitem__`` and a vectorised
``array(start, stop)``): block ``k`` of :data:`MOONCAKE_BLOCK_TOKENS` tokens has ids derived from
``hash_ids[k]``, so requests with a common hash-id prefix share exactly those tokens and differ after
(up to id collisions). The class itself is :class:`schedspec.spec.workload.BlockHashPrompt`: the trace
checker, which imports only the spec, rebuilds prompts from arrival records."""


def mooncake_shared_prompt_tokens(requests: Sequence[RequestSpec], block_size: int) -> tuple[int, int]:
    """``(shared, total)`` prompt tokens of ``requests`` taken in the given (arrival) order: ``shared``
    counts the full ``block_size``-token blocks of each prompt whose chained ids (the block and every
    block before it) already appeared in an earlier request, i.e. the prompt tokens an infinite prefix
    cache of ``block_size``-token blocks would hit, ignoring vLLM's "recompute the last token" cap;
    ``total`` all prompt tokens. Computed from the token ids, so it measures what the prompts share,
    not what ``hash_ids`` promise."""
    seen: set[bytes] = set()
    shared = total = 0
    for spec in requests:
        total += spec.prompt_len
        full = spec.prompt_len // block_size * block_size
        ids = spec.prompt_token_ids().array(0, full).tobytes()
        width = block_size * 8  # int64 ids
        parent = b""
        for start in range(0, len(ids), width):
            key = hashlib.blake2b(parent + ids[start:start + width], digest_size=16).digest()
            if key in seen:
                shared += block_size
            seen.add(key)
            parent = key
    return shared, total

DEFAULT_TRACE = "AzureLLMInferenceTrace_conv.csv"
"""File name of the default packaged trace."""

PACKAGED_TRACES: dict[str, str] = {
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
    "mooncake": "mooncake_conversation_trace.jsonl",
}
"""Short names of the packaged traces (``schedspec lab --trace mooncake``) -> file in
``schedspec/data/traces/`` (their sources and licenses: that folder's README.md)."""

AZURE_ATTRIBUTION = (
    "Azure LLM inference trace 2023, Microsoft Azure, https://github.com/Azure/AzurePublicDataset "
    "(AzureLLMInferenceDataset2023.md), licensed CC BY 4.0 (https://creativecommons.org/licenses/by/4.0/). "
    "Unmodified copy."
)
MOONCAKE_ATTRIBUTION = (
    "Mooncake FAST'25 conversation trace, kvcache-ai/Mooncake, https://github.com/kvcache-ai/Mooncake "
    "(FAST25-release/traces/conversation_trace.jsonl), Apache License 2.0. Unmodified copy."
)

_KNOWN_TRACES: dict[str, tuple[str, str, str]] = {
    # sha256 -> (file name, description, attribution)
    "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8": (
        "AzureLLMInferenceTrace_conv.csv", "Azure LLM inference 2023, conversation service", AZURE_ATTRIBUTION),
    "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6": (
        "AzureLLMInferenceTrace_code.csv", "Azure LLM inference 2023, code service", AZURE_ATTRIBUTION),
    "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df": (
        "mooncake_conversation_trace.jsonl", "Mooncake (Kimi) FAST'25 conversation trace", MOONCAKE_ATTRIBUTION),
}


# --------------------------------------------------------------------------------------------------
# Helpers


def _open(path: str | Path, **kwargs):
    path = Path(path)
    try:
        if path.exists() and not path.is_dir() and not stat.S_ISREG(path.stat().st_mode):
            raise WorkloadError(f"{path}: not a regular file (a device or pipe cannot be read as a trace)")
        return path.open(**kwargs)
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WorkloadError(f"{path}: is a directory, not a trace file") from None
    except OSError as error:
        raise WorkloadError(f"{path}: cannot read ({error.strerror})") from None
    except WorkloadError:
        raise
    except ValueError as error:  # a NUL character in the path
        raise WorkloadError(f"{path}: cannot open ({error})") from None


def _not_utf8(path: Path) -> WorkloadError:
    """The error for a file that failed to decode as UTF-8, naming the line of the first bad byte.
    Files are decoded strictly (the fast path); only after a failure is the file read again as bytes
    to find the line."""
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        return WorkloadError(f"{path}:{line}: not UTF-8 text (byte 0x{data[error.start]:02x} at column {column})")
    except OSError as error:
        return WorkloadError(f"{path}: cannot read ({error.strerror})")
    return WorkloadError(f"{path}: not UTF-8 text")


def _token_count(text: str, path: Path, line: int, field: str) -> int:
    if len(text) <= 9 and text.isascii() and text.isdigit():  # the fast path: every count of the real traces
        return int(text)
    where = f"{path}:{line}"
    value = text.strip()
    if not value.isascii() or not DIGITS.fullmatch(value):
        if value.startswith("-") and DIGITS.fullmatch(value[1:]):
            raise WorkloadError(f"{where}: {field}={value!r}: token count must not be negative")
        raise WorkloadError(f"{where}: {field}={value!r}: token count must be a non-negative integer")
    if len(value) > 12 or int(value) > MAX_TOKEN_COUNT:
        raise WorkloadError(f"{where}: {field}={value[:40]}: more than {MAX_TOKEN_COUNT:,} tokens, not a token count")
    return int(value)


def _json_token_count(value: object, where: str, field: str) -> int:
    if isinstance(value, float) and value.is_integer() and 0 <= value <= MAX_TOKEN_COUNT:
        value = int(value)  # 12.0: some JSON writers emit every number as a float
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{where}: {field}={value!r}: token count must be an integer")
    if value < 0:
        raise WorkloadError(f"{where}: {field}={value}: token count must not be negative")
    if value > MAX_TOKEN_COUNT:
        raise WorkloadError(f"{where}: {field}={value}: more than {MAX_TOKEN_COUNT:,} tokens, not a token count")
    return value


_TIMESTAMP = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:(Z)|([+-])(\d{2}):?(\d{2}))?"
)


def parse_azure_timestamp(text: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fffffff][+HH:MM]`` -> integer nanoseconds since 0001-01-01 00:00 UTC.

    Exact: the 2023 files carry 7 fractional digits (100 ns), which ``strptime``'s ``%f`` (6 digits)
    cannot read; 1 to 9 digits are accepted and right-padded. The 2024 files carry 6 digits and a
    ``+00:00`` offset (``2024-05-10 00:00:00.009930+00:00``); an offset (or ``Z``) is subtracted, so
    times in different offsets compare correctly. No offset (the 2023 files) is read as UTC.

    Raises:
        ValueError: not in this form, or not a valid date/time.
    """
    match = _TIMESTAMP.fullmatch(text.strip())
    if match is None:
        raise ValueError("expected YYYY-MM-DD HH:MM:SS.fffffff, optionally with a +HH:MM offset")
    year, month, day, hour, minute, second, fraction, zulu, sign, off_hours, off_minutes = match.groups()
    day_number = _day_number(year, month, day)
    hour, minute, second = int(hour), int(minute), int(second)
    if hour > 23 or minute > 59 or second > 59:
        raise ValueError("time of day out of range")
    seconds = ((day_number * 24 + hour) * 60 + minute) * 60 + second
    if sign is not None:
        if int(off_hours) > 23 or int(off_minutes) > 59:
            raise ValueError("UTC offset out of range")
        offset = (int(off_hours) * 60 + int(off_minutes)) * 60
        seconds -= offset if sign == "+" else -offset
    return seconds * 1_000_000_000 + (int(fraction.ljust(9, "0")) if fraction else 0)


@functools.lru_cache(maxsize=64)
def _day_number(year: str, month: str, day: str) -> int:
    return datetime.date(int(year), int(month), int(day)).toordinal()  # ValueError on a bad date


def _in_order(rows: list, key, path: Path, field: str, lines: list[int], notes: list[str] | None, show) -> list:
    """``rows`` sorted by ``key`` (stable: equal times keep file order). If the file was not already
    in order, a note naming the first line that goes backwards is appended to ``notes``."""
    previous = None
    for index, row in enumerate(rows):
        value = key(row)
        if previous is not None and value < key(previous):
            backwards = sum(1 for a, b in zip(rows, rows[1:], strict=False) if key(b) < key(a))
            if notes is not None:
                notes.append(
                    f"{path}:{lines[index]}: {field} {show(row)} is earlier than the row before it "
                    f"({show(previous)}); {backwards:,} such step(s) back in the file, so its "
                    f"{len(rows):,} rows were sorted by arrival time (ties keep file order)"
                )
            order = sorted(range(len(rows)), key=lambda i: key(rows[i]))
            return [rows[i] for i in order]
        previous = row
    return rows


def _default_prefix(path: Path, fmt: str) -> str:
    if fmt == "azure":
        # AzureLLMInferenceTrace_conv.csv -> "conv"; AzureLLMInferenceTrace_conv_1week.csv -> "conv"
        stem = path.stem.split(".")[0]
        parts = [p for p in stem.split("_") if p and not p.endswith("week")]
        return parts[-1] if parts else "azure"
    if fmt == "burstgpt":
        return "burstgpt"
    return "mooncake" if path.stem.startswith("mooncake") else path.stem


# --------------------------------------------------------------------------------------------------
# CSV formats (Azure 2023/2024, BurstGPT)


def _read_csv(path: Path, required: Sequence[str], expected_header: str):
    """Yield ``(line number, [text of each required column])`` for each data row; checks the header
    and the encoding.

    Raises:
        WorkloadError: missing file, empty file, missing column, a row of the wrong width, a byte that
            is not UTF-8 (with its line), or malformed CSV.
    """
    with _open(path, encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle)
        try:
            header = next(reader)
        except StopIteration:
            raise WorkloadError(f"{path}:1: empty file, expected header {expected_header}") from None
        except csv.Error as error:
            raise WorkloadError(f"{path}:1: header: {error}") from None
        except UnicodeDecodeError:
            raise _not_utf8(path) from None
        names = [name.strip() for name in header]
        for field in required:
            if field not in names:
                raise WorkloadError(f"{path}:1: header: missing column {field!r} (found {','.join(names)!r})")
            if names.count(field) > 1:  # which one is meant is not known: refused, never a silent pick
                raise WorkloadError(f"{path}:1: header: column {field!r} appears {names.count(field)} times")
        columns = [names.index(field) for field in required]
        width = len(names)
        try:
            for fields in reader:
                if len(fields) != width:
                    if not fields or (len(fields) == 1 and not fields[0].strip()):
                        continue
                    raise WorkloadError(f"{path}:{reader.line_num}: expected {width} fields, found {len(fields)}")
                yield reader.line_num, [fields[i] for i in columns]
        except csv.Error as error:
            raise WorkloadError(f"{path}:{reader.line_num}: {error}") from None
        except UnicodeDecodeError:
            raise _not_utf8(path) from None


def load_azure_csv(path: str | Path, id_prefix: str | None = None, notes: list[str] | None = None) -> list[RequestSpec]:
    """Load an Azure LLM inference trace CSV: the 2023 release (``AzureLLMInferenceTrace_conv.csv``,
    timestamps with 7 fractional digits, no zone) or the 2024 release (the one-week files,
    ``AzureLLMInferenceTrace_conv_1week.csv``, 6 fractional digits and a ``+00:00`` offset).

    Args:
        path: the CSV file. Header ``TIMESTAMP,ContextTokens,GeneratedTokens`` (column order free,
            names matched exactly); any line ending; a missing newline after the last row is fine.
        id_prefix: request id prefix; default: the file stem's service name (``conv``, ``code``).
        notes: if given, a note is appended when the rows had to be sorted (a timestamp going back).

    Returns:
        Requests with ``prompt_len = ContextTokens``, ``max_tokens = GeneratedTokens`` and
        ``arrival_time`` = seconds since the file's earliest ``TIMESTAMP`` (exact to 1 ns before
        conversion to float), sorted by arrival time. A row with 0 tokens is kept: the spec rejects
        it at arrival with its reason (empty prompt, or ``max_tokens < 1``).

    Raises:
        WorkloadError: missing file, missing header or column, a row with the wrong number of fields,
            an unparseable timestamp, a token count that is not an integer in ``[0, 2**31-1]``, a
            byte that is not UTF-8, or no rows. The message names the file, line and column.
    """
    path = Path(path)
    prefix = id_prefix if id_prefix is not None else _default_prefix(path, "azure")
    rows: list[tuple[int, int, int, int]] = []  # (ns, prompt, output, row)
    lines: list[int] = []
    for line, (stamp, context, generated) in _read_csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
                                                       "TIMESTAMP,ContextTokens,GeneratedTokens"):
        try:
            ns = parse_azure_timestamp(stamp)
        except ValueError as error:
            raise WorkloadError(f"{path}:{line}: TIMESTAMP={stamp[:80]!r}: {error}") from None
        prompt = _token_count(context, path, line, "ContextTokens")
        output = _token_count(generated, path, line, "GeneratedTokens")
        rows.append((ns, prompt, output, len(rows)))
        lines.append(line)
    if not rows:
        raise WorkloadError(f"{path}: no requests (header only)")
    rows = _in_order(rows, lambda r: r[0], path, "TIMESTAMP", lines, notes,
                     lambda r: _format_ns(r[0]))
    origin = rows[0][0]
    return [
        RequestSpec(request_id=f"{prefix}-{row:06d}", prompt_len=prompt, max_tokens=output,
                    arrival_time=(ns - origin) / 1e9)
        for ns, prompt, output, row in rows
    ]


def _format_ns(ns: int) -> str:
    seconds, rest = divmod(ns, 1_000_000_000)
    days, seconds = divmod(seconds, 86_400)
    date = datetime.date.fromordinal(days) if 1 <= days <= datetime.date.max.toordinal() else None
    hours, seconds = divmod(seconds, 3600)
    minutes, seconds = divmod(seconds, 60)
    return f"{date} {hours:02d}:{minutes:02d}:{seconds:02d}.{rest:09d}".rstrip("0").rstrip(".")


BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
"""The BurstGPT trace header (HPMLL/BurstGPT ``data/BurstGPT_*.csv``)."""


MAX_BURSTGPT_TIMESTAMP = 1e12
"""Largest BurstGPT ``Timestamp`` accepted, seconds (about 31,700 years)."""


def load_burstgpt_csv(path: str | Path, id_prefix: str | None = None, notes: list[str] | None = None) -> list[RequestSpec]:
    """Load a BurstGPT trace CSV (HPMLL/BurstGPT, ``BurstGPT_1.csv`` etc.).

    Header ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``. ``Timestamp``
    is seconds since the start of the trace (integer or decimal, >= 0); ``Request tokens`` ->
    ``prompt_len``, ``Response tokens`` -> ``max_tokens``. ``Model`` (``ChatGPT``, ``GPT-4``),
    ``Log Type`` (``Conversation log``, ``API log``) and ``Total tokens`` are not used (the columns
    must be present; their values are not checked). A failed request of the trace has
    ``Response tokens`` = 0: it is kept, and the spec rejects it at arrival with the reason
    (``max_tokens=0 < 1``), so it is counted among the rejected requests, not dropped.

    Args:
        path: the file.
        id_prefix: request id prefix (default ``burstgpt``).
        notes: if given, a note is appended when the rows had to be sorted.

    Returns:
        Requests with ``arrival_time = Timestamp - min Timestamp`` seconds, sorted by arrival.

    Raises:
        WorkloadError: as :func:`load_azure_csv`, for this header.
    """
    path = Path(path)
    prefix = id_prefix if id_prefix is not None else _default_prefix(path, "burstgpt")
    rows: list[tuple[float, int, int, int]] = []
    lines: list[int] = []
    for line, (stamp_text, request, response) in _read_csv(path, ("Timestamp", "Request tokens", "Response tokens"),
                                                          ",".join(BURSTGPT_COLUMNS)):
        where = f"{path}:{line}"
        text = stamp_text.strip()
        try:
            stamp = float(text) if re.fullmatch(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?", text) else None
        except ValueError:
            stamp = None
        if stamp is None or not math.isfinite(stamp) or stamp > MAX_BURSTGPT_TIMESTAMP:
            raise WorkloadError(f"{where}: Timestamp={text[:80]!r}: expected seconds since the trace start, "
                                f"a number in [0, {MAX_BURSTGPT_TIMESTAMP:g}] (about 31,700 years)")
        prompt = _token_count(request, path, line, "Request tokens")
        output = _token_count(response, path, line, "Response tokens")
        rows.append((stamp, prompt, output, len(rows)))
        lines.append(line)
    if not rows:
        raise WorkloadError(f"{path}: no requests (header only)")
    rows = _in_order(rows, lambda r: r[0], path, "Timestamp", lines, notes, lambda r: f"{r[0]:g} s")
    origin = rows[0][0]
    return [
        RequestSpec(request_id=f"{prefix}-{row:06d}", prompt_len=prompt, max_tokens=output,
                    arrival_time=stamp - origin)
        for stamp, prompt, output, row in rows
    ]


# --------------------------------------------------------------------------------------------------
# Mooncake JSON Lines


def _prefix_groups(block_lists: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """For each request's full-block hash ids, ``(group, blocks)``: group -1 = no shared prefix.

    Builds the trie of full-block hash sequences (a node = one distinct leading block sequence),
    counts the requests through each node, and splits the trie into heavy paths (each node continues
    the path of its parent if it is the parent's child with the most requests; ties: first created).
    A request joins the path of its deepest node with ``blocks`` = its number of full blocks.
    All members of one path lie on one chain of the trie, so two members really share their first
    ``min(blocks)`` blocks: the synthetic prompt ids (same id at the same position within a group)
    never claim sharing the trace does not have. Sharing across paths is lost.
    """
    children: dict[tuple[int, int], int] = {}
    parent: list[int] = []
    count: list[int] = []
    deepest: list[int] = []
    for blocks in block_lists:
        node = -1
        for block in blocks:
            key = (node, block)
            child = children.get(key)
            if child is None:
                child = len(parent)
                children[key] = child
                parent.append(node)
                count.append(0)
            node = child
            count[node] += 1
        deepest.append(node)
    heavy: dict[int, int] = {}
    for node, up in enumerate(parent):
        if up >= 0:
            best = heavy.get(up)
            if best is None or count[node] > count[best]:
                heavy[up] = node
    path = [0] * len(parent)
    paths = 0
    for node, up in enumerate(parent):  # parents are created before their children
        if up >= 0 and heavy[up] == node:
            path[node] = path[up]
        else:
            path[node] = paths
            paths += 1
    members: dict[int, int] = {}
    for node in deepest:
        if node >= 0:
            members[path[node]] = members.get(path[node], 0) + 1
    result = []
    for node, blocks in zip(deepest, block_lists, strict=True):
        if node < 0 or members[path[node]] < 2:
            result.append((-1, 0))
        else:
            result.append((path[node], len(blocks)))
    return result


MAX_MOONCAKE_TIMESTAMP = 1e15
"""Largest Mooncake ``timestamp`` accepted, milliseconds (about 31,700 years)."""


def load_mooncake_jsonl(path: str | Path, id_prefix: str | None = None, notes: list[str] | None = None) -> list[RequestSpec]:
    """Load a Mooncake trace (JSON Lines): the FAST'25 release's ``conversation_trace.jsonl``,
    ``toolagent_trace.jsonl`` and ``synthetic_trace.jsonl`` and the earlier
    ``arxiv-trace/mooncake_trace.jsonl`` all share this layout.

    Each line is an object with ``timestamp`` (milliseconds since the start of the trace; integer or
    float >= 0), ``input_length`` and ``output_length`` (integers >= 0; a 0 is kept, and the spec
    rejects that request at arrival) and optionally ``hash_ids``
    (a list of ``ceil(input_length / 512)`` integers, one per 512-token prompt block; equal ids at
    equal positions mean a reusable prefix). Blank lines are skipped; other keys are ignored.

    The prompt: each request carries its ``hash_ids`` as ``block_hash_ids`` (``hash_block_tokens`` =
    512), so its ids are a :data:`MooncakePrompt`: equal hash ids give equal token ids, and a prefix
    cache hits exactly what the trace shares. A request without ``hash_ids`` gets ids of its own.

    Prefix groups (kept for readers of ``prefix_group``; they no longer shape the prompt ids, which
    ``block_hash_ids`` determine): ``RequestSpec`` can say only "requests of group G share their first
    ``prefix_len`` ids" (the id at position ``p`` is a function of the group and ``p``), while the
    trace's reuse is a tree. The loader keeps the part of the tree a group can state exactly: it
    splits the trie of **full** 512-token blocks into heavy paths (:func:`_prefix_groups`); a
    request's ``prefix_group`` is ``"{prefix}-p{path}"`` and its ``prefix_len`` is
    ``512 * (input_length // 512)`` (its full blocks; never more than ``prompt_len``). Two requests of
    one group truly share their first ``min(prefix_len)`` tokens; none share more in the synthetic ids
    than in the trace. A request alone on its path, or shorter than one block, gets no group. The
    groups are computed over the whole file, before any :func:`select_window`. On the packaged
    conversation trace this keeps 90,906 of the 105,592 full-block prefix hits an infinite cache would
    see in arrival order (86 %); what is lost is mostly the one shared first block (a common system
    prompt) between different conversations.

    Args:
        path: the file.
        id_prefix: request id prefix (default ``mooncake`` for ``mooncake*`` files, else the stem).
        notes: if given, a note is appended when the rows had to be sorted (a timestamp going back).

    Returns:
        Requests with ``arrival_time = (timestamp - min timestamp) / 1000`` seconds, sorted by arrival
        (ties in file order).

    Raises:
        WorkloadError: missing file, a line that is not a JSON object (or gives one key twice:
            :func:`~schedspec.spec.trace.strict_json_loads`), a missing key, a bad timestamp,
            a token count that is not an integer in ``[0, 2**31-1]``, ``hash_ids`` of the wrong type or
            length, a byte that is not UTF-8, or no rows.
    """
    path = Path(path)
    prefix = id_prefix if id_prefix is not None else _default_prefix(path, "mooncake")
    rows: list[tuple[float, int, int, int]] = []  # (ms, prompt, output, row)
    lines: list[int] = []
    blocks: list[list[int]] = []
    hashes: list[tuple[int, ...] | None] = []
    with _open(path, encoding="utf-8") as handle:
        numbered = enumerate(handle, start=1)
        while True:
            try:
                number, line = next(numbered)
            except StopIteration:
                break
            except UnicodeDecodeError:
                raise _not_utf8(path) from None
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:  # a key given twice is refused (json.loads keeps the last); NaN: refused below, by field
                data = strict_json_loads(line, constants=True)
            except StrictJsonError as error:
                raise WorkloadError(f"{where}: not valid JSON: {error}") from None
            if not isinstance(data, dict):
                raise WorkloadError(f"{where}: expected a JSON object, found {type(data).__name__}")
            for key in ("timestamp", "input_length", "output_length"):
                if key not in data:
                    raise WorkloadError(f"{where}: {key}: missing")
            stamp = data["timestamp"]
            if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not 0 <= stamp <= MAX_MOONCAKE_TIMESTAMP:
                raise WorkloadError(f"{where}: timestamp={stamp!r}: must be a number of milliseconds "
                                    f"in [0, {MAX_MOONCAKE_TIMESTAMP:g}]")
            prompt = _json_token_count(data["input_length"], where, "input_length")
            output = _json_token_count(data["output_length"], where, "output_length")
            ids = data.get("hash_ids")
            full: list[int] = []
            hashes.append(None)
            if ids is not None:
                if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
                    raise WorkloadError(f"{where}: hash_ids: must be a list of integers")
                expected = blocks_for_tokens(prompt, MOONCAKE_BLOCK_TOKENS)
                if len(ids) != expected:
                    raise WorkloadError(
                        f"{where}: hash_ids: {len(ids)} ids for input_length={prompt}, expected "
                        f"ceil({prompt}/{MOONCAKE_BLOCK_TOKENS}) = {expected}"
                    )
                full = ids[: prompt // MOONCAKE_BLOCK_TOKENS]
                hashes[-1] = tuple(ids)
            rows.append((float(stamp), prompt, output, len(rows)))
            lines.append(number)
            blocks.append(full)
    if not rows:
        raise WorkloadError(f"{path}: no requests (empty file)")
    groups = _prefix_groups(blocks)  # over file order, before sorting: a function of the file only
    rows = _in_order(rows, lambda r: r[0], path, "timestamp", lines, notes, lambda r: f"{r[0]:g} ms")
    origin = rows[0][0]
    requests = []
    for stamp, prompt, output, index in rows:
        group, num_blocks = groups[index]
        requests.append(RequestSpec(
            request_id=f"{prefix}-{index:06d}",
            prompt_len=prompt,
            max_tokens=output,
            arrival_time=(stamp - origin) / 1000.0,
            prefix_group=f"{prefix}-p{group}" if group >= 0 else None,
            prefix_len=min(prompt, num_blocks * MOONCAKE_BLOCK_TOKENS) if group >= 0 else 0,
            block_hash_ids=hashes[index],
            hash_block_tokens=MOONCAKE_BLOCK_TOKENS if hashes[index] is not None else None,
        ))
    return requests


# --------------------------------------------------------------------------------------------------
# Format detection, loading, packaged traces


def detect_format(path: str | Path) -> str:
    """The format of a trace file, from its first non-blank line:

    - ``mooncake``: a JSON object (Mooncake JSON Lines);
    - ``azure``: a CSV header with ``TIMESTAMP``, ``ContextTokens`` and ``GeneratedTokens`` (Azure LLM
      inference trace 2023 or 2024);
    - ``burstgpt``: a CSV header with ``Timestamp``, ``Request tokens`` and ``Response tokens``
      (BurstGPT).

    Raises:
        WorkloadError: missing file, empty file, or none of these forms.
    """
    path = Path(path)
    with _open(path, encoding="utf-8-sig", errors="replace") as handle:
        first = ""
        try:
            for line in handle:
                if line.strip():
                    first = line.strip()
                    break
        except OSError as error:
            raise WorkloadError(f"{path}: cannot read ({error.strerror})") from None
    if not first:
        raise WorkloadError(f"{path}: empty file, cannot detect the trace format")
    if first.startswith("{"):
        return "mooncake"
    names = {field.strip().strip('"') for field in first.split(",")}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= names:
        return "azure"
    if {"Timestamp", "Request tokens", "Response tokens"} <= names:
        return "burstgpt"
    raise WorkloadError(
        f"{path}:1: cannot detect the trace format: expected an Azure CSV header "
        f"(TIMESTAMP,ContextTokens,GeneratedTokens), a BurstGPT CSV header "
        f"({','.join(BURSTGPT_COLUMNS)}) or a Mooncake JSON object; or give the format "
        f"(--trace-format {'|'.join(FORMATS)})"
    )


LOADERS = {"azure": load_azure_csv, "burstgpt": load_burstgpt_csv, "mooncake": load_mooncake_jsonl}
"""Format name -> loader; every loader takes ``(path, id_prefix=None, notes=None)``."""


def load_trace(path: str | Path, format: str | None = None, id_prefix: str | None = None,
               notes: list[str] | None = None) -> list[RequestSpec]:
    """Load a trace file in ``format`` (one of :data:`FORMATS`; ``None``: :func:`detect_format`).

    Args:
        notes: if given, receives one line per thing the user should know that did not stop the
            load (rows that had to be sorted by arrival time).

    Raises:
        WorkloadError: unknown format, or anything the format's loader raises.
    """
    fmt = detect_format(path) if format is None else format
    loader = LOADERS.get(fmt)
    if loader is None:
        raise WorkloadError(f"format={fmt!r}: unknown trace format; known: {', '.join(FORMATS)}")
    return loader(path, id_prefix, notes)


def packaged_trace_path(name: str) -> Path:
    """Path of a trace shipped in ``schedspec/data/traces/`` (via :mod:`importlib.resources`).

    Raises:
        WorkloadError: no such packaged file.
    """
    resource = resources.files("schedspec").joinpath("data", "traces", name)
    if not resource.is_file():
        raise WorkloadError(f"packaged trace {name!r}: not found in schedspec/data/traces")
    return Path(str(resource))


def resolve_trace(text: str) -> Path:
    """``--trace`` as a path: a short name of :data:`PACKAGED_TRACES` (when no file of that name
    exists in the working directory) is the packaged file; anything else is a path as given."""
    if text in PACKAGED_TRACES and not Path(text).exists():
        return packaged_trace_path(PACKAGED_TRACES[text])
    return Path(text)


def default_trace_path() -> Path:
    """The packaged Azure 2023 conversation trace (19,366 requests over 58 minutes)."""
    return packaged_trace_path(DEFAULT_TRACE)


@attrs.frozen
class TraceInfo:
    """What a trace file is.

    Attributes:
        path: the file.
        format: ``azure`` or ``mooncake``.
        num_requests: rows.
        duration_s: last arrival minus first arrival, seconds.
        description: one line: source, size, rate, median lengths.
        attribution: the attribution the file's license requires (empty for unknown files).
    """

    path: Path
    format: str
    num_requests: int
    duration_s: float
    description: str
    attribution: str

    def __str__(self) -> str:
        return self.description + (f"\nSource: {self.attribution}" if self.attribution else "")


def trace_info(path: str | Path, format: str | None = None, requests: Sequence[RequestSpec] | None = None) -> TraceInfo:
    """Describe ``path`` (loaded again unless its ``requests`` are given); known files (by sha256)
    get their attribution.

    Raises:
        WorkloadError: as :func:`load_trace`.
    """
    path = Path(path)
    if requests is None:
        requests = load_trace(path, format)
    fmt = format or detect_format(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    known = _KNOWN_TRACES.get(digest)
    if known is not None:
        title, attribution = known[1], known[2]
    else:
        title = f"{path.name} ({fmt} format)"
        attribution = ""
        for name, _, text in _KNOWN_TRACES.values():
            if path.name == name:
                title += ", differs from the packaged copy"
                attribution = text.replace("Unmodified copy.", "Modified copy.")
    duration = max(r.arrival_time for r in requests)
    rate = len(requests) / duration if duration > 0 else float("inf")
    prompts = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.max_tokens for r in requests])
    description = (
        f"{title}: {len(requests):,} requests over {duration:,.1f} s ({rate:.2f} req/s); prompt tokens "
        f"p50 {np.percentile(prompts, 50):,.0f} / max {prompts.max():,}; output tokens p50 "
        f"{np.percentile(outputs, 50):,.0f} / max {outputs.max():,}"
    )
    return TraceInfo(path, fmt, len(requests), duration, description, attribution)
