"""The step trace format: one :class:`StepRecord` per step, as JSON Lines.

A trace file starts with a header line ``{"schema_version": 1, "config": {...SchedulerConfig...},
"scheduler": NAME}`` followed by one JSON object per step. Any engine that writes this format can be
judged against the spec with :func:`schedspec.spec.checker.check_trace`. Serialisation is lossless:
``StepRecord.from_json(record.to_json()) == record``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from schedspec.spec.config import ConfigError, SchedulerConfig
from schedspec.spec.workload import RequestSpec

SCHEMA_VERSION = 1


@attrs.frozen
class ScheduledTokens:
    """One request's tokens in a step.

    Attributes:
        request_id: the request.
        num_computed_tokens: tokens computed before the step (where the chunk starts).
        prefill_tokens: prompt (or recompute) tokens computed this step; 0 for a decode.
        decode_tokens: 1 for a decode step of the request, else 0.
    """

    request_id: str
    num_computed_tokens: int
    prefill_tokens: int
    decode_tokens: int

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
        prefix_hit_tokens: request id -> prompt tokens found in the prefix cache at admission.
        preempted: requests preempted this step.
        finished: request id -> finish reason (``stop``, ``length``, ``max_model_len``) for
            requests that ended after this step's sampling.
        aborted: request ids that ended aborted before this step.
        rejected: request id -> reason, for requests rejected in this step.
        sampled_token_ids: request id -> token sampled after this step.
        num_free_blocks: free KV blocks after the step.
        num_running: running requests after the step.
        num_waiting: waiting requests after the step.
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
    preempted: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    finished: dict[str, str] = attrs.field(factory=dict)
    aborted: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    rejected: dict[str, str] = attrs.field(factory=dict)
    sampled_token_ids: dict[str, int] = attrs.field(factory=dict)
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0

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
        data["scheduled"] = [attrs.asdict(s) for s in self.scheduled]
        data["blocks_allocated"] = {k: list(v) for k, v in self.blocks_allocated.items()}
        data["blocks_freed"] = {k: list(v) for k, v in self.blocks_freed.items()}
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


def write_trace(out: IO[str], config: SchedulerConfig, records: Iterable[StepRecord], scheduler: str = "") -> None:
    """Write the header line and one line per record."""
    header = {"schema_version": SCHEMA_VERSION, "config": config.to_dict(), "scheduler": scheduler}
    out.write(json.dumps(header) + "\n")
    for record in records:
        out.write(record.to_json() + "\n")


def read_trace(path: str | Path) -> tuple[SchedulerConfig, Iterator[StepRecord]]:
    """Read a trace file: its config and an iterator over its records.

    Raises:
        TraceFormatError: unreadable file, bad header, unknown schema version, or a malformed line
            (file, line number and field named).
    """
    path = Path(path)
    try:
        handle = path.open(encoding="utf-8")
    except OSError as error:
        raise TraceFormatError(f"{path}: cannot read ({error.strerror})") from None
    first = handle.readline()
    try:
        header = json.loads(first)
        version = header["schema_version"]
        config = SchedulerConfig.from_dict(header["config"])
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        handle.close()
        raise TraceFormatError(f"{path}:1: bad header ({error})") from None
    except ConfigError as error:
        handle.close()
        raise TraceFormatError(f"{path}:1: config: {error}") from None
    if version != SCHEMA_VERSION:
        handle.close()
        raise TraceFormatError(f"{path}:1: schema_version={version!r}, expected {SCHEMA_VERSION}")

    def records() -> Iterator[StepRecord]:
        with handle:
            for number, line in enumerate(handle, start=2):
                if not line.strip():
                    continue
                try:
                    yield StepRecord.from_json(line)
                except (json.JSONDecodeError, TypeError, ValueError) as error:
                    raise TraceFormatError(f"{path}:{number}: {error}") from None

    return config, records()
