"""Workloads for time-driven runs: real traces and synthetic arrival processes.

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

Every bad input raises :class:`WorkloadError` (a ``ValueError``) with a one-line message naming the
file, the line and the field (or the parameter).
"""

from __future__ import annotations

import csv
import datetime
import functools
import hashlib
import json
import math
import re
import stat
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

import attrs
import numpy as np

from schedspec.spec.workload import BlockHashPrompt, RequestSpec

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


class WorkloadError(ValueError):
    """A workload that cannot be built; the message names the file, line and field (or parameter)."""


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


_DIGITS = re.compile(r"[0-9]+")

MAX_TOKEN_COUNT = 2**31 - 1
"""Largest token count a trace row may carry (int32, the widest any engine's token counters use).
A larger count is not a request the spec could reject but a corrupt field: the file is refused at
that line. A count of 0 is kept (the spec rejects the request at arrival, with the reason)."""


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
    if not value.isascii() or not _DIGITS.fullmatch(value):
        if value.startswith("-") and _DIGITS.fullmatch(value[1:]):
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
        if stamp is None or not math.isfinite(stamp) or stamp > 1e12:
            raise WorkloadError(f"{where}: Timestamp={text[:80]!r}: expected seconds since the trace start, "
                                f"a number >= 0")
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
        WorkloadError: missing file, a line that is not a JSON object, a missing key, a bad timestamp,
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
            try:
                data = json.loads(line)
            except json.JSONDecodeError as error:
                raise WorkloadError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            except RecursionError:
                raise WorkloadError(f"{where}: not valid JSON (nested too deeply)") from None
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
                expected = -(-prompt // MOONCAKE_BLOCK_TOKENS)
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


# --------------------------------------------------------------------------------------------------
# Window selection


def _check_number(name: str, value: object, minimum: float | None = None, strict: bool = False) -> float:
    """``value`` as a float: finite, and ``> minimum`` (``strict``) or ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WorkloadError(f"{name}={value!r}: must be a finite number")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise WorkloadError(f"{name}={value!r}: must be {'>' if strict else '>='} {minimum:g}")
    return float(value)


def _sorted(requests: list[RequestSpec]) -> list[RequestSpec]:
    # Stable: equal arrival times keep their order.
    return sorted(requests, key=lambda r: r.arrival_time)


MAX_WINDOW_SECONDS = 1e9
"""Longest simulated window, seconds (about 31 years). Float seconds keep a resolution under a
microsecond up to here, so millisecond step times still add up; beyond it they would vanish
(a TTFT of 0.0 ms)."""


def select_window(
    requests: Iterable[RequestSpec],
    start: float | None = None,
    duration: float | None = None,
    max_requests: int | None = None,
    time_scale: float = 1.0,
) -> list[RequestSpec]:
    """A time window of a workload, re-based to 0 and optionally sped up or slowed down.

    Keeps the requests with ``start <= arrival_time < start + duration`` (trace seconds; ``start``
    default: the first arrival, ``duration`` default: to the end), then the first ``max_requests``
    of them. Arrival times become ``(arrival_time - first kept arrival) * time_scale``: the first kept
    request arrives at 0.0 and every inter-arrival gap is multiplied by ``time_scale`` (0.5 = arrivals
    twice as fast). ``abort_at_time`` is shifted and scaled the same way. Other fields are unchanged.

    Raises:
        WorkloadError: no requests given, ``start`` negative or not finite, ``duration <= 0``,
            ``max_requests < 1`` or not an integer, ``time_scale <= 0``, a window with no requests,
            or a window that ``time_scale`` stretches beyond :data:`MAX_WINDOW_SECONDS`.
    """
    ordered = _sorted(list(requests))
    if not ordered:
        raise WorkloadError("the workload has no requests")
    if start is not None:
        start = _check_number("start", start, minimum=0)
    if duration is not None:
        duration = _check_number("duration", duration, minimum=0, strict=True)
    if max_requests is not None and (isinstance(max_requests, bool) or not isinstance(max_requests, int)
                                     or max_requests < 1):
        raise WorkloadError(f"max_requests={max_requests!r}: must be an integer >= 1")
    time_scale = _check_number("time_scale", time_scale, minimum=0, strict=True)
    low = ordered[0].arrival_time if start is None else start
    kept = [r for r in ordered if r.arrival_time >= low and (duration is None or r.arrival_time < low + duration)]
    if max_requests is not None:
        kept = kept[:max_requests]
    if not kept:
        end = "end" if duration is None else f"{low + duration:.10g} s"
        raise WorkloadError(
            f"start={low:.10g}, duration={duration if duration is None else f'{duration:.10g}'}: no requests "
            f"arrive in [{low:.10g} s, {end}) (the workload spans {ordered[0].arrival_time:.10g} s to "
            f"{ordered[-1].arrival_time:.10g} s)"
        )
    origin = kept[0].arrival_time
    span = (kept[-1].arrival_time - origin) * time_scale
    if span > MAX_WINDOW_SECONDS:
        raise WorkloadError(
            f"time_scale={time_scale:g}: the window would span {span:.3g} s of simulated time (trace span "
            f"times time scale), more than "
            f"{MAX_WINDOW_SECONDS:g} s (step times of milliseconds would be lost in the clock's rounding)"
        )
    return [
        attrs.evolve(
            r,
            arrival_time=(r.arrival_time - origin) * time_scale,
            abort_at_time=None if r.abort_at_time is None else max(0.0, (r.abort_at_time - origin) * time_scale),
        )
        for r in kept
    ]


# --------------------------------------------------------------------------------------------------
# Synthetic workloads


@attrs.frozen
class LengthDist:
    """A token-length distribution, written as text (the ``prompt=``/``output=`` syntax):

    - ``N``: always ``N`` (integer >= 1).
    - ``uniform:LO:HI``: integers uniform on ``[LO, HI]`` (inclusive; 1 <= LO <= HI).
    - ``normal:MEAN:STD``: ``round(Normal(MEAN, STD))``, values below 1 set to 1 (MEAN >= 1, STD >= 0).
    - ``geom:MEAN``: geometric on ``{1, 2, ...}`` with mean MEAN (the discrete exponential; MEAN >= 1).

    Raises:
        WorkloadError: any other text (naming ``field``).
    """

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, text: str | int, field: str = "length") -> LengthDist:
        if isinstance(text, bool):
            raise WorkloadError(f"{field}={text!r}: expected a token length")
        if isinstance(text, int):
            text = str(text)
        raw = str(text).strip()
        parts = raw.split(":")
        usage = "expected N, uniform:LO:HI, normal:MEAN:STD or geom:MEAN"
        try:
            if len(parts) == 1:
                if not _DIGITS.fullmatch(raw) or len(raw) > 10 or not 1 <= int(raw) <= MAX_TOKEN_COUNT:
                    raise WorkloadError(f"{field}={raw!r}: fixed length must be an integer in [1, {MAX_TOKEN_COUNT:,}] ({usage})")
                return cls("fixed", (int(raw),))
            kind, args = parts[0].strip().lower(), [float(p) for p in parts[1:]]
        except ValueError:
            raise WorkloadError(f"{field}={raw!r}: {usage}") from None
        if not all(math.isfinite(a) for a in args):
            raise WorkloadError(f"{field}={raw!r}: parameters must be finite numbers")
        if any(abs(a) > MAX_TOKEN_COUNT for a in args):
            raise WorkloadError(f"{field}={raw!r}: parameters must be at most {MAX_TOKEN_COUNT:,} tokens")
        if kind == "uniform" and len(args) == 2:
            low, high = args
            if low != int(low) or high != int(high) or not 1 <= low <= high:
                raise WorkloadError(f"{field}={raw!r}: uniform:LO:HI needs integers 1 <= LO <= HI")
            return cls("uniform", (low, high))
        if kind == "normal" and len(args) == 2:
            if args[0] < 1 or args[1] < 0:
                raise WorkloadError(f"{field}={raw!r}: normal:MEAN:STD needs MEAN >= 1 and STD >= 0")
            return cls("normal", tuple(args))
        if kind == "geom" and len(args) == 1:
            if args[0] < 1:
                raise WorkloadError(f"{field}={raw!r}: geom:MEAN needs MEAN >= 1")
            return cls("geom", tuple(args))
        raise WorkloadError(f"{field}={raw!r}: {usage}")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` integer lengths >= 1."""
        if self.kind == "fixed":
            return np.full(size, int(self.params[0]), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.params[0]), int(self.params[1]), size, endpoint=True)
        if self.kind == "normal":
            return np.clip(np.rint(rng.normal(self.params[0], self.params[1], size)), 1, MAX_TOKEN_COUNT).astype(np.int64)
        return np.minimum(rng.geometric(1.0 / self.params[0], size), MAX_TOKEN_COUNT).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.params[0]))
        return ":".join([self.kind, *(f"{p:g}" for p in self.params)])


MAX_CV = 1000.0
"""Largest coefficient of variation of the synthetic gaps (Gamma shape ``1/cv**2`` stays above 1e-6)."""

MAX_SYNTHETIC_REQUESTS = 10_000_000
"""Most requests a synthetic workload may have (``n``, or ``rate * duration``): about 2 GB of
request objects; a larger one is refused before anything is allocated."""


def _arrival_gaps(rng: np.random.Generator, rate: float, cv: float, size: int) -> np.ndarray:
    if cv < 1e-6:  # constant gaps; Gamma(1/cv**2) would overflow
        return np.full(size, 1.0 / rate)
    if cv == 1:
        return rng.exponential(1.0 / rate, size)
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, 1.0 / (rate * shape), size)


def synthetic(
    rate: float,
    cv: float = 1.0,
    prompt: int | str | LengthDist = 512,
    output: int | str | LengthDist = 128,
    num_requests: int | None = None,
    duration: float | None = None,
    seed: int = 0,
    id_prefix: str = "syn",
) -> list[RequestSpec]:
    """A synthetic open-loop workload.

    Inter-arrival gaps are i.i.d. with mean ``1/rate`` seconds and coefficient of variation ``cv``:
    exponential for ``cv == 1`` (a Poisson process, as vLLM's ``benchmark_serving --request-rate``),
    ``Gamma(shape=1/cv**2, scale=cv**2/rate)`` otherwise (``cv > 1`` bursty, ``cv < 1`` smoother, as
    ``--burstiness = 1/cv**2``), constant for ``cv == 0`` (and below 1e-6). The first request arrives at 0.0. Prompt and
    output lengths are drawn independently from :class:`LengthDist` (ints or their text syntax).

    Args:
        rate: mean arrival rate, requests per second (> 0).
        cv: coefficient of variation of the gaps (>= 0).
        prompt, output: token lengths (``prompt_len``, ``max_tokens``).
        num_requests: exactly this many requests; or
        duration: every request arriving in ``[0, duration)`` seconds. Give exactly one.
        seed: the random seed (integer >= 0); equal arguments give equal workloads.
        id_prefix: ids are ``{id_prefix}-{i:06d}``.

    Raises:
        WorkloadError: a bad parameter (named).
    """
    rate = _check_number("rate", rate, minimum=0, strict=True)
    cv = _check_number("cv", cv, minimum=0)
    if cv > MAX_CV:
        raise WorkloadError(f"cv={cv:g}: must be <= {MAX_CV:g}")
    prompt_dist = prompt if isinstance(prompt, LengthDist) else LengthDist.parse(prompt, "prompt")
    output_dist = output if isinstance(output, LengthDist) else LengthDist.parse(output, "output")
    if (num_requests is None) == (duration is None):
        raise WorkloadError("synthetic: give exactly one of n (num_requests) and duration")
    if num_requests is not None and (isinstance(num_requests, bool) or not isinstance(num_requests, int)
                                     or not 1 <= num_requests <= MAX_SYNTHETIC_REQUESTS):
        raise WorkloadError(f"n={num_requests!r}: must be an integer in [1, {MAX_SYNTHETIC_REQUESTS:,}]")
    if duration is not None:
        duration = _check_number("duration", duration, minimum=0, strict=True)
        if rate * duration > MAX_SYNTHETIC_REQUESTS:
            raise WorkloadError(f"rate={rate:g} * duration={duration:g}: about {rate * duration:.3g} requests, more "
                                f"than {MAX_SYNTHETIC_REQUESTS:,}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise WorkloadError(f"seed={seed!r}: must be an integer >= 0")
    arrivals_rng, prompt_rng, output_rng = (np.random.default_rng([seed, stream]) for stream in range(3))
    if num_requests is not None:
        times = np.concatenate([[0.0], np.cumsum(_arrival_gaps(arrivals_rng, rate, cv, num_requests - 1))])
    else:
        chunks = [np.zeros(1)]
        last, total = 0.0, 1
        while last < duration:
            size = max(64, int(rate * (duration - last) * 1.2) + 16)
            block = last + np.cumsum(_arrival_gaps(arrivals_rng, rate, cv, size))
            chunks.append(block)
            last = float(block[-1])
            total += size
            if total > 2 * MAX_SYNTHETIC_REQUESTS + 1000:
                raise WorkloadError(f"rate={rate:g} * duration={duration:g}: more than {MAX_SYNTHETIC_REQUESTS:,} requests")
        times = np.concatenate(chunks)
        times = times[times < duration]
    if not math.isfinite(times[-1]) or times[-1] > MAX_WINDOW_SECONDS:
        raise WorkloadError(f"rate={rate:g}: the arrivals would span {times[-1]:.3g} s, more than "
                            f"{MAX_WINDOW_SECONDS:g} s")
    count = len(times)
    prompts = prompt_dist.sample(prompt_rng, count)
    outputs = output_dist.sample(output_rng, count)
    return [
        RequestSpec(request_id=f"{id_prefix}-{i:06d}", prompt_len=int(p), max_tokens=int(o), arrival_time=float(t))
        for i, (t, p, o) in enumerate(zip(times.tolist(), prompts.tolist(), outputs.tolist(), strict=True))
    ]


@attrs.frozen
class SyntheticSpec:
    """A parsed ``rate=..,cv=..,prompt=..,output=..[,n=..|,duration=..][,seed=..]`` string.

    Attributes mirror :func:`synthetic`'s parameters; :meth:`generate` calls it.
    """

    rate: float
    cv: float = 1.0
    prompt: LengthDist = LengthDist("fixed", (512,))
    output: LengthDist = LengthDist("fixed", (128,))
    num_requests: int | None = None
    duration: float | None = None
    seed: int = 0

    def generate(self, id_prefix: str = "syn") -> list[RequestSpec]:
        return synthetic(self.rate, self.cv, self.prompt, self.output, self.num_requests, self.duration,
                         self.seed, id_prefix)

    def __str__(self) -> str:
        size = f"n={self.num_requests}" if self.num_requests is not None else f"duration={self.duration:g}"
        return f"rate={self.rate:g},cv={self.cv:g},prompt={self.prompt},output={self.output},{size},seed={self.seed}"


_SYNTHETIC_KEYS = ("rate", "cv", "prompt", "output", "n", "duration", "seed")


def parse_synthetic(text: str) -> SyntheticSpec:
    """Parse the CLI form ``rate=R,cv=C,prompt=P,output=O[,n=N][,duration=S][,seed=K]``.

    ``rate`` (req/s, > 0), ``prompt`` and ``output`` (:class:`LengthDist` syntax) are required;
    ``cv`` defaults to 1 (Poisson), ``seed`` to 0; exactly one of ``n`` and ``duration`` (seconds).
    An optional leading ``synthetic:`` is ignored. Spaces around keys and values are ignored.

    Raises:
        WorkloadError: unknown, repeated or missing keys, or bad values (the key is named).
    """
    body = text.strip()
    if body.startswith("synthetic:"):
        body = body[len("synthetic:"):]
    values: dict[str, str] = {}
    for item in body.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise WorkloadError(f"synthetic: {item.strip()!r}: expected key=value")
        if key not in _SYNTHETIC_KEYS:
            raise WorkloadError(f"synthetic: unknown key {key!r}; known: {', '.join(_SYNTHETIC_KEYS)}")
        if key in values:
            raise WorkloadError(f"synthetic: key {key!r} given twice")
        values[key] = value.strip()
    for key in ("rate", "prompt", "output"):
        if key not in values:
            raise WorkloadError(f"synthetic: missing key {key!r} (form: rate=R,cv=C,prompt=P,output=O,n=N,seed=K)")

    def number(key: str) -> float:
        try:
            value = float(values[key])
        except ValueError:
            raise WorkloadError(f"synthetic: {key}={values[key]!r}: not a number") from None
        return value

    def integer(key: str) -> int:
        if not _DIGITS.fullmatch(values[key]) or len(values[key]) > 18:
            raise WorkloadError(f"synthetic: {key}={values[key]!r}: must be a non-negative integer")
        return int(values[key])

    spec = SyntheticSpec(
        rate=number("rate"),
        cv=number("cv") if "cv" in values else 1.0,
        prompt=LengthDist.parse(values["prompt"], "prompt"),
        output=LengthDist.parse(values["output"], "output"),
        num_requests=integer("n") if "n" in values else None,
        duration=number("duration") if "duration" in values else None,
        seed=integer("seed") if "seed" in values else 0,
    )
    # Validate the numbers once, with the same messages as synthetic().
    _check_number("rate", spec.rate, minimum=0, strict=True)
    _check_number("cv", spec.cv, minimum=0)
    if spec.cv > MAX_CV:
        raise WorkloadError(f"synthetic: cv={spec.cv:g}: must be <= {MAX_CV:g}")
    if (spec.num_requests is None) == (spec.duration is None):
        raise WorkloadError("synthetic: give exactly one of n and duration")
    if spec.num_requests is not None and not 1 <= spec.num_requests <= MAX_SYNTHETIC_REQUESTS:
        raise WorkloadError(f"synthetic: n={spec.num_requests}: must be in [1, {MAX_SYNTHETIC_REQUESTS:,}]")
    if spec.duration is not None:
        _check_number("duration", spec.duration, minimum=0, strict=True)
        if spec.rate * spec.duration > MAX_SYNTHETIC_REQUESTS:
            raise WorkloadError(f"synthetic: rate={spec.rate:g} * duration={spec.duration:g}: about "
                                f"{spec.rate * spec.duration:.3g} requests, more than {MAX_SYNTHETIC_REQUESTS:,}")
    return spec
