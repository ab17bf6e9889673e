"""Run records: one lab run's full conditions and every figure it produced, as one JSON object.

A number without its conditions cannot be compared. ``schedspec lab --json``, ``--save FILE.json``
and ``--sweep`` all build their output with :func:`build_record` (one definition), and
``schedspec compare`` reads two of them back with :func:`load_record`, which validates them against
the JSON Schema ``run-record-schema.json`` beside this module (``jsonschema``, Draft 2020-12).

Layout (schema version 1)::

    {"record": "schedspec-run-record", "schema_version": 1, "name": "fcfs",
     "conditions": {workload, window, arrivals, scheduler, config, cost_profile, backend, model,
                    checks, max_steps, slo, sweep_point, schedspec_version, python_version, machine,
                    engine},
     "figures": {flat: name -> number or null, the unit in the name},
     "details": {requests, rejected_reasons, latency_s, efficiency, goodput}}

``engine`` is the real engine behind an adapter scheduler and its exact version (``{"name": "vllm",
"version": "0.33.0"}``, ``RunResult.engine``), ``null`` for a reference scheduler; a record without it
(written before it existed) is still valid.

Units are in the key names: ``_s`` seconds, ``_percent`` percent (0-100), ``_tokens_per_s``,
``_req_per_s``; a key without a unit suffix is a count (requests, steps, tokens). A figure that
cannot be computed (no finished request, no SLO given) is ``null``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import jsonschema

from schedspec.lab import metrics
from schedspec.lab.run import LabResult, largest_step
from schedspec.reference.cost_model import CostModel, profile_schema
from schedspec.spec.admission import REJECTION_CODES, rejection_code
from schedspec.spec.config import ConfigError, SchedulerConfig
from schedspec.spec.trace import (
    StrictJsonError,
    StrictValidator,
    json_line,
    schema_problem,
    strict_json_loads,
)

RECORD_KIND = "schedspec-run-record"
SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("run-record-schema.json")

LATENCY_FIGURES = ("ttft", "itl", "tpot", "e2e", "queueing")
STAT_KEYS = ("p50", "p95", "p99", "max", "mean")

INFORMATIONAL_CONDITIONS = ("machine", "python_version")
"""Conditions that cannot change a simulated (cost-model) run's figures other than ``wall_time_s``:
:func:`differing_conditions` leaves them out of the refusal for cost-model runs (they still show).
With ``--backend torch`` the step times are measured, so they count."""


class RunRecordError(ValueError):
    """An unreadable or invalid run record; the message names the file and the field."""


def schedspec_version() -> str:
    """The installed package's version (``0+unknown`` when run from a source tree without metadata)."""
    try:
        return metadata.version("schedspec")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def machine() -> dict[str, Any]:
    """The machine a run ran on: ``platform``, ``machine``, ``processor`` and ``cpu_count``."""
    return {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for piece in iter(lambda: handle.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def cost_profile(cost: CostModel) -> dict[str, Any]:
    """A cost profile as conditions: its name, coefficients in seconds (per step, per prefill token,
    per decode token, per attended KV token), hardware, model and how the coefficients were found."""
    return {"name": cost.name, "a_s_per_step": cost.a, "b_s_per_prefill_token": cost.b,
            "c_s_per_decode_token": cost.c, "d_s_per_kv_token": cost.d,
            "e_s_per_prefill_attention_pair": cost.e, "f_s_per_prefill_chunk": cost.f,
            "token_knots_s": [list(k) for k in cost.token_knots], "hardware": cost.hardware,
            "model": cost.model, "source": cost.source, "kind": cost.kind}


def arrivals(window: Iterable[Any]) -> dict[str, Any]:
    """The window's load: ``num_requests``, ``span_s`` (last minus first arrival) and
    ``rate_req_per_s`` (requests / span; ``null`` for a span of 0)."""
    times = [spec.arrival_time for spec in window]
    span = max(times) - min(times) if times else 0.0
    return {"num_requests": len(times), "span_s": span, "rate_req_per_s": len(times) / span if span > 0 else None}


def slo_conditions(slo: metrics.Slo | None) -> dict[str, float | None] | None:
    """``--slo`` as conditions (seconds), or ``None``."""
    return None if slo is None else {f"{key}_s": value for key, value in slo._asdict().items()}


def _summaries(result: LabResult) -> tuple[dict[str, Any], dict[str, Any]]:
    """The latency and efficiency summaries of a run (computed once per record). A run of a scheduler that
    plans while a step is in flight (``RunResult.async_scheduling``) also has ``wasted_tokens`` in its
    efficiency summary: the tokens its steps computed for requests that had already ended
    (``RunResult.num_wasted_tokens``); a synchronous run's summaries are what they were."""
    efficiency = metrics.efficiency_summary(result.steps, result.config.num_kv_blocks, result.timelines)
    if result.run.async_scheduling:
        efficiency["wasted_tokens"] = result.run.num_wasted_tokens
    return metrics.latency_summary(result.timelines), efficiency


def figures(result: LabResult, slo: metrics.Slo | None,
            summaries: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every figure of a run as a flat dict of numbers (or ``None``), the unit in each name.

    Latency figures (``{ttft,itl,tpot,e2e,queueing}_{p50,p95,p99,max,mean}_s``) cover finished
    requests (:func:`~schedspec.lab.metrics.latency_summary`); throughput is per second of the
    simulated span (:func:`~schedspec.lab.metrics.efficiency_summary`); ``goodput_*`` is
    ``None`` without an SLO; ``rejected_<code>`` counts rejections per
    :data:`~schedspec.spec.admission.REJECTION_CODES` code (``rejected_other``: any other reason);
    ``prefix_hit_rate_percent`` is the prefix cache's hit rate in tokens over first admissions
    (:class:`~schedspec.lab.metrics.PrefixHitCounter`; ``None`` without admissions); with speculative
    decoding (some step verified drafts) ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
    ``draft_acceptance_rate_percent`` and ``mean_acceptance_length`` (tokens per verifying decode,
    :data:`~schedspec.lab.metrics.SPECULATIVE_KEYS`); with asynchronous scheduling ``wasted_tokens``
    (:func:`_summaries`);
    ``wall_time_s`` is the only figure that depends on the machine."""
    latency, efficiency = summaries if summaries is not None else _summaries(result)
    out: dict[str, Any] = {f"requests_{k}": v for k, v in latency["requests"].items()}
    rejected = rejected_by_code(result)
    for code in REJECTION_CODES:
        out[f"rejected_{code.replace('-', '_')}"] = rejected.pop(code, 0)
    out["rejected_other"] = sum(rejected.values())
    for key in ("output_tokens_per_s", "total_tokens_per_s", "computed_tokens_per_s"):
        out[key] = efficiency[key]
    out["requests_per_s"] = efficiency["requests_per_s"]
    for name in LATENCY_FIGURES:
        block = latency["all"][name]
        out[f"{name}_count"] = block["count"]
        for key in STAT_KEYS:
            out[f"{name}_{key}_s"] = block[key]
    good = metrics.goodput(result.timelines, *slo) if slo is not None else None
    out["goodput_percent"] = None if good is None else good["percent"]
    out["goodput_met"] = None if good is None else good["met"]
    out["goodput_admitted"] = None if good is None else good["admitted"]
    out["preemptions"] = efficiency["preemptions"]
    out["max_preemptions_per_request"] = efficiency["max_preemptions_per_request"]
    if "wasted_tokens" in efficiency:  # asynchronous scheduling only
        out["wasted_tokens"] = efficiency["wasted_tokens"]
    for key in ("kv_usage_mean", "kv_usage_max"):
        out[f"{key}_percent"] = None if efficiency[key] is None else 100.0 * efficiency[key]
    for key in ("num_steps", "num_empty_steps", "tokens_per_step_mean", "tokens_per_step_p50",
                "tokens_per_step_p99", "prefill_tokens", "decode_tokens", "running_mean", "running_max", "span_s"):
        out[key] = efficiency[key]
    if "num_drafts" in efficiency:  # speculative decoding: only when some step verified drafts
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length"):
            out[key] = efficiency[key]
        out["draft_acceptance_rate_percent"] = 100.0 * efficiency["draft_acceptance_rate"]
    prefix = result.prefix_hits or {}
    rate = prefix.get("prefix_hit_rate")
    out["prefix_hit_rate_percent"] = None if rate is None else 100.0 * rate
    out["prefix_hit_tokens"] = prefix.get("prefix_hit_tokens")
    out["prefix_query_tokens"] = prefix.get("prefix_query_tokens")
    out["steps_checked"] = result.run.num_steps_checked
    out["violations"] = len(result.run.violations)
    out["wall_time_s"] = result.run.wall_seconds
    return out


def rejected_by_code(result: LabResult) -> dict[str, int]:
    """Rejected requests counted by the code their reason starts with (``prompt-exceeds-max-model-len``)."""
    counts: dict[str, int] = {}
    for timeline in result.timelines:
        if timeline.outcome == "rejected":
            code = rejection_code(timeline.finish_reason or "") or "unknown"
            counts[code] = counts.get(code, 0) + 1
    return counts


def details(result: LabResult, slo: metrics.Slo | None,
            summaries: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The nested summaries the lab prints: requests by outcome, rejections by full reason, the
    latency blocks (seconds: all, long prompts, arrived during a long prefill), batch efficiency
    (``kv_usage_*`` as fractions 0-1, as :func:`~schedspec.lab.metrics.efficiency_summary`),
    the goodput, and the largest step in tokens (:func:`~schedspec.lab.run.largest_step`: what a measured
    cost profile's fitted grid is compared with)."""
    latency, efficiency = summaries if summaries is not None else _summaries(result)
    latency = dict(latency)
    reasons: dict[str, int] = {}
    for t in result.timelines:
        if t.outcome == "rejected":
            reasons[t.finish_reason or ""] = reasons.get(t.finish_reason or "", 0) + 1
    return {
        "requests": latency.pop("requests"),
        "rejected_reasons": reasons,
        "rejected_by_code": rejected_by_code(result),
        "latency_s": latency,
        "efficiency": efficiency,
        "prefix_cache": dict(result.prefix_hits),
        "goodput": metrics.goodput(result.timelines, *slo) if slo is not None else None,
        "largest_step": largest_step(result.steps),
    }


def build_record(name: str, result: LabResult, conditions: Mapping[str, Any], slo: metrics.Slo | None,
                 sweep_point: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run record of one lab run.

    Args:
        name: the run's name (scheduler, variant or sweep point label).
        result: the run.
        conditions: what :func:`shared_conditions` returned for the run's workload, backend and options;
            the run's own scheduler, config, arrivals and sweep point are added here.
        slo: the SLOs of ``--slo`` (seconds) or ``None``.
        sweep_point: the swept fields and their values for this run, or ``None``.

    Returns:
        A JSON-ready dict that :func:`validate_record` accepts.
    """
    own = dict(conditions)
    own["scheduler"] = result.scheduler if sweep_point is None or "scheduler" not in sweep_point else sweep_point["scheduler"]
    own["config"] = result.config.to_dict()
    own["slo"] = slo_conditions(slo)
    own["sweep_point"] = dict(sweep_point) if sweep_point is not None else None
    own["arrivals"] = arrivals(result.timelines)
    own["engine"] = result.run.engine
    if result.config.speculative and result.acceptance is not None:  # absent without speculative decoding
        own["acceptance"] = result.acceptance.to_dict()
    summaries = _summaries(result)
    return {
        "record": RECORD_KIND,
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "conditions": own,
        "figures": figures(result, slo, summaries),
        "details": details(result, slo, summaries),
    }


def shared_conditions(*, workload: Mapping[str, Any], window: Mapping[str, Any], cost: CostModel,
                      backend: Mapping[str, Any], model: str, checks: bool, max_steps: int | None) -> dict[str, Any]:
    """The conditions common to every run of one ``schedspec lab`` call (the per-run ones are added
    by :func:`build_record`).

    Args:
        workload: ``{"kind": "trace", "trace_path", "trace_sha256", "trace_format", "description"}`` or
            ``{"kind": "synthetic", "synthetic": SPEC, ...}`` (the other keys ``None``).
        window: ``start_s``, ``duration_s``, ``max_requests``, ``time_scale``, ``length_scale``
            (``None`` where not given).
        cost: the cost profile.
        backend: ``kind`` (``cost-model`` or ``torch``), ``device``, ``model_dir`` and ``description``.
        model: the model whose step times are simulated or measured.
        checks: whether every step was checked against the spec.
        max_steps: ``--max-steps`` or ``None``.
    """
    return {
        "workload": dict(workload),
        "window": dict(window),
        "cost_profile": cost_profile(cost),
        "backend": dict(backend),
        "model": model,
        "checks": checks,
        "max_steps": max_steps,
        "schedspec_version": schedspec_version(),
        "python_version": platform.python_version(),
        "machine": machine(),
    }


# --------------------------------------------------------------------------------------------------
# Reading and comparing


@cache
def record_schema() -> dict[str, Any]:
    """The JSON Schema of a run record (``run-record-schema.json``)."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


@cache
def _validator() -> jsonschema.Draft202012Validator:
    """The run record validator; the cost profile's coefficients are ``$ref``s into the cost profile
    schema (:func:`schedspec.reference.cost_model.profile_schema`, one definition of their bounds)."""
    from referencing import Registry, Resource

    profile = profile_schema()
    registry = Registry().with_resource(profile["$id"], Resource.from_contents(profile))
    return StrictValidator(record_schema(), registry=registry)  # integers written as integers (spec/trace.py)


def validate_record(data: Any, text: str | None = None) -> str | None:
    """The first problem of ``data`` as a run record, ``"field PATH: message"`` (``"LINE: field PATH:
    message"`` with the file's ``text``, the line of the field), or ``None`` if it is a valid run record:
    the JSON Schema (every figure a number in its unit's range, every count an integer >= 0, typed
    conditions), then the config's own rules (``SchedulerConfig.from_dict``: ``max_num_seqs`` >= 1,
    a budget that fits ``max_model_len``, ...)."""
    problem = schema_problem(_validator(), data, text)
    if problem is None:
        try:
            SchedulerConfig.from_dict(data["conditions"]["config"])
        except (ConfigError, TypeError, ValueError) as error:
            line = json_line(text, ["conditions", "config"]) if text is not None else None
            problem = line, f"field conditions.config: {error}"
    if problem is None:
        return None
    line, message = problem
    return f"{line}: {message}" if line is not None else message


MAX_RECORD_BYTES = 64 * 1024 * 1024
"""Largest run record read (64 MiB)."""


def load_record(path: str | Path) -> dict[str, Any]:
    """Read and validate one run record.

    Raises:
        RunRecordError: the file cannot be read, is not JSON, or is not a valid run record (the
            message names the file and the field).
    """
    path = Path(path)
    try:
        if not path.is_file():
            raise RunRecordError(f"{path}: not a file")
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise RunRecordError(f"{path}: larger than {MAX_RECORD_BYTES >> 20} MiB, not a run record")
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise RunRecordError(f"{path}: cannot read ({error.strerror})") from None
    except UnicodeDecodeError:
        raise RunRecordError(f"{path}: not UTF-8 text, not a run record") from None
    try:
        data = strict_json_loads(text)
    except StrictJsonError as error:
        where = f"{path}:{error.lineno}" if error.lineno is not None else f"{path}"
        raise RunRecordError(f"{where}: {error}, not a run record") from None
    problem = validate_record(data, text)
    if problem is not None:
        raise RunRecordError(f"{path}:{problem}" if problem[:1].isdigit() else f"{path}: {problem}")
    return data


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested conditions as ``{"config.max_num_seqs": 256, ...}`` (lists and scalars are leaves)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def field_matches(path: str, field: str) -> bool:
    """Whether ``--allow-different FIELD`` covers the condition ``path``: the same path, a group above
    it (``config`` covers ``config.max_num_seqs``) or its last part (``max_num_seqs``)."""
    return path == field or path.startswith(field + ".") or path.rpartition(".")[2] == field


def differing_conditions(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(path, before, after)`` for every condition that differs (a missing one is ``None``), in
    order of first appearance."""
    a, b = flatten(before["conditions"]), flatten(after["conditions"])
    keys = list(a) + [k for k in b if k not in a]
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]


def is_informational(path: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """Whether a differing condition cannot change the figures (other than wall time): the machine
    and Python version when both runs took their step times from the cost model; the trace's path
    when both files have the same sha256."""
    if path == "workload.trace_path":
        digests = [r["conditions"]["workload"].get("trace_sha256") for r in (before, after)]
        return digests[0] is not None and digests[0] == digests[1]
    simulated = all(r["conditions"]["backend"]["kind"] == "cost-model" for r in (before, after))
    return simulated and any(path == f or path.startswith(f + ".") for f in INFORMATIONAL_CONDITIONS)
