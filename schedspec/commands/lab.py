"""``schedspec lab``: watch an iteration-level scheduler work on a real trace, step by step."""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import attrs
import click
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from schedspec.cli_common import (
    EXIT_CHECK_FAILED,
    EXIT_UNSUPPORTED,
    Count,
    Number,
    atomic_output,
    build_config,
    check_outputs,
    check_path,
    check_scheduler,
    fail,
    input_files,
    note,
    numbered_output,
    one_line,
    parse_sets,
    parse_value,
    plural,
    run_labels,
    scheduler_option,
    set_option,
    table_width,
    torch_backend_model,
    wide_console,
)
from schedspec.cli_common import (
    console as make_console,
)
from schedspec.lab import capacity as capacities
from schedspec.lab import metrics, run_record, trace_formats
from schedspec.lab import sweep as sweeping
from schedspec.lab.executor import RayNotInstalled, RayUnavailable, execute
from schedspec.lab.run import VARIANTS, LabResult, LabStep, largest_step, resolve_variant, run_lab
from schedspec.lab.synthetic import parse_synthetic
from schedspec.lab.windows import select_window
from schedspec.lab.workload_checks import MAX_TOKEN_COUNT, WorkloadError
from schedspec.reference import cost_model as costs
from schedspec.reference.engine import ViolationFound
from schedspec.reference.fake_model import AcceptanceModel
from schedspec.reference.scheduler import EngineFault, UnknownScheduler, UnsupportedFeature
from schedspec.spec.admission import rejection_code, rejection_reason
from schedspec.spec.config import SchedulerConfig

DEFAULT_DURATION = 120.0
"""Seconds of trace time the default run replays (the first two minutes of the Azure conv trace)."""


def _scale_lengths(window: list, factor: float) -> list:
    """``--length-scale``: every prompt, shared prefix, hashed prompt block and output length divided by
    ``factor``, rounded up (at least one token; a length of 0 stays 0, so the spec still rejects that request); arrival
    times, ids and everything else unchanged. Exits 2 if a length would exceed
    :data:`~schedspec.lab.workload_checks.MAX_TOKEN_COUNT`."""
    if factor == 1:
        return window

    def scale(length: int) -> int:
        return 0 if length == 0 else max(1, math.ceil(length / factor))

    longest = max(max(s.prompt_len, s.max_tokens) for s in window)
    if longest / factor > MAX_TOKEN_COUNT:
        fail(f"--length-scale {factor:g}: makes a length of {longest:,} tokens {longest / factor:.3g}, more than "
             f"{MAX_TOKEN_COUNT:,}")
    scaled = []
    for spec in window:
        prompt = scale(spec.prompt_len)
        block_tokens = spec.hash_block_tokens
        scaled.append(attrs.evolve(spec, prompt_len=prompt, max_tokens=scale(spec.max_tokens),
                                   prefix_len=min(prompt, math.ceil(spec.prefix_len / factor)),
                                   hash_block_tokens=None if block_tokens is None else scale(block_tokens)))
    return scaled


StepFilter = Callable[[list[LabStep]], list[LabStep]]

STEPS_USAGE = "expected N, A-B, every:K, changed[:N], all or none"


def parse_steps(text: str | None) -> StepFilter:
    """``--steps``, parsed before the run: ``N`` (first N), ``A-B`` (steps A to B, A <= B),
    ``every:K`` (K >= 1), ``changed[:N]`` (steps where a request arrived, was preempted or finished;
    the first N, default all), ``all`` or ``none``. Default (``None``): ``changed:40``.

    Exits 2 naming ``--steps`` on anything else (a negative count, ``10-5``)."""
    spec = "changed:40" if text is None else text.strip()

    def count(value: str, minimum: int) -> int:
        if not value.isascii() or not value.isdigit() or len(value) > 18 or int(value) < minimum:
            fail(f"--steps {text!r}: {value!r} must be an integer >= {minimum} ({STEPS_USAGE})")
        return int(value)

    if spec == "none":
        return lambda steps: []
    if spec == "all":
        return lambda steps: steps
    if spec == "changed" or spec.startswith("changed:"):
        limit = count(spec.partition(":")[2], 1) if ":" in spec else None
        return lambda steps: [s for s in steps if s.num_arrivals or s.num_preempted or s.num_finished][:limit]
    if spec.startswith("every:"):
        k = count(spec.partition(":")[2], 1)
        return lambda steps: steps[::k]
    if "-" in spec:
        low_text, _, high_text = spec.partition("-")
        low, high = count(low_text.strip(), 0), count(high_text.strip(), 0)
        if low > high:
            fail(f"--steps {text!r}: A-B needs A <= B")
        return lambda steps: [s for s in steps if low <= s.step <= high]
    first = count(spec, 0)
    return lambda steps: steps[:first]


def _conditions(result: LabResult, profile: costs.CostModel, trace_text: str, window: str, backend: str) -> list[tuple[str, str]]:
    config = result.config
    arrivals = [t.arrival_time for t in result.timelines]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    rate = f"{len(arrivals) / span:.2f} req/s" if span > 0 else "n/a"
    return [
        ("policy", result.scheduler),
        *([("engine", f"{result.run.engine['name']} {result.run.engine['version']}")] if result.run.engine else []),
        ("block_size", f"{config.block_size} tokens"),
        ("num_kv_blocks", f"{config.num_kv_blocks:,} ({config.kv_capacity_tokens:,} tokens of KV)"),
        ("max_num_batched_tokens", f"{config.max_num_batched_tokens:,}"),
        ("max_num_seqs", str(config.max_num_seqs)),
        ("max_model_len", f"{config.max_model_len:,}"),
        ("chunked prefill", "on" + (f" (long_prefill_token_threshold {config.long_prefill_token_threshold})"
                                    if config.long_prefill_token_threshold else "") if config.enable_chunked_prefill else "off"),
        ("prefix caching", "on" if config.enable_prefix_caching else "off"),
        ("execution", backend),
        ("cost profile", f"{profile.name} ({profile.kind}): " + (
            f"piecewise in the step's tokens ({len(profile.token_knots)} knots: "
            + ", ".join(f"{t} -> {v * 1e3:.2f} ms" for t, v in profile.token_knots) + "), "
            if profile.token_knots else "") + f"a={profile.a * 1e3:.2f} ms, b={profile.b * 1e6:.1f} us/prefill token, "
                         f"c={profile.c * 1e6:.1f} us/decode token, d={profile.d * 1e9:.1f} ns/KV token"
                         + (f", e={profile.e * 1e9:.3f} ns/prefill attention pair" if profile.e else "")
                         + (f", f={profile.f * 1e3:.3f} ms/prefill chunk" if profile.f else "")),
        ("hardware / model", f"{profile.hardware} / {profile.model}"),
        ("trace", trace_text),
        ("window", window),
        ("arrival rate", f"{len(arrivals):,} requests, {rate} over {span:,.1f} s"),
    ]


def admission_preview(window: list, config: SchedulerConfig) -> dict[str, int]:
    """How many requests of ``window`` the spec will reject at arrival under ``config``, by
    :data:`~schedspec.spec.admission.REJECTION_CODES` code (``spec/admission.py``
    ``rejection_reason``), known before the run because admission depends only on the request's shape
    and the config."""
    counts: dict[str, int] = {}
    for spec in window:
        reason = rejection_reason(spec.prompt_len, spec.max_tokens, config)
        if reason is not None:
            code = rejection_code(reason)
            counts[code] = counts.get(code, 0) + 1
    return counts


def _print_admission_preview(console: Console, window: list, configs: list[SchedulerConfig]) -> None:
    """Before the run: how many requests of the window exceed ``max_model_len`` (or the KV cache) and
    will be rejected, with a hint for long-context traces; one line per distinct config limit."""
    seen = set()
    for config in configs:
        key = (config.max_model_len, config.num_kv_blocks, config.block_size)
        if key in seen:
            continue
        seen.add(key)
        counts = admission_preview(window, config)
        over = counts.get("prompt-exceeds-max-model-len", 0)
        text = (f"Admission: {over:,} of {len(window):,} requests in the window have a prompt longer than "
                f"max_model_len {config.max_model_len:,} tokens")
        others = {k: v for k, v in counts.items() if k != "prompt-exceeds-max-model-len"}
        if others:
            text += "; also rejected: " + ", ".join(f"{k} {v:,}" for k, v in sorted(others.items()))
        text += "; the spec rejects them at arrival." if counts else "."
        if over and len(window) and over / len(window) >= 0.01:
            longer = sorted(name for name, profile in costs.PROFILES.items()
                            if profile.model in costs.MODELS
                            and costs.MODELS[profile.model].max_model_len > config.max_model_len)
            if longer:
                text += f" For a long-context trace try --profile {longer[0]} (or --set max_model_len=N)."
        console.print(Text(text, style="yellow" if over else ""))


def _print_conditions(console: Console, rows: list[tuple[str, str]]) -> None:
    table = Table(title="Run conditions", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)


def _print_steps(console: Console, steps: list[LabStep], config, shown: list[LabStep]) -> None:
    if not shown:
        return
    table = Table(title=f"Steps ({len(shown)} of {len(steps):,} shown; --steps to choose)", title_justify="left")
    for column in ("step", "time s", "prefill", "decode", "chunks", "running", "waiting", "KV used",
                   "preempted", "finished"):
        table.add_column(column, justify="right")
    for s in shown:
        used = 1 - s.num_free_blocks / config.num_kv_blocks
        table.add_row(str(s.step), f"{s.start_time:.3f}", str(s.prefill_tokens), str(s.decode_tokens),
                      str(s.num_prefill_chunks), str(s.num_running), str(s.num_waiting), f"{used:.1%}",
                      str(s.num_preempted or ""), str(s.num_finished or ""))
    console.print(table)


def _fmt(value: float | None, unit: str = "s") -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "-"
    if unit == "s":
        return f"{value * 1e3:,.1f} ms" if value < 1 else f"{value:,.2f} s"
    return f"{value:,.2f}"


def _print_latency(console: Console, title: str, summary: dict[str, Any], empty_reason: str = "") -> None:
    """One latency table; a group with no finished request prints one line saying why instead of a
    table of dashes."""
    if all(not isinstance(stats, dict) or not stats.get("count") for stats in summary.values()):
        console.print(Text(f"{title}: none. {empty_reason}".rstrip(), style="italic"))
        return
    table = Table(title=title, title_justify="left")
    for column in ("metric", "count", "p50", "p95", "p99", "max", "mean"):
        table.add_column(column, justify="right")
    for name, stats in summary.items():
        if not isinstance(stats, dict) or "p50" not in stats:
            continue
        table.add_row(name, f"{stats['count']:,}", *(_fmt(stats[k]) for k in ("p50", "p95", "p99", "max", "mean")))
    console.print(table)


def _print_summary(console: Console, record: dict[str, Any]) -> None:
    details, figures = record["details"], record["figures"]
    latency = details["latency_s"]
    requests = details["requests"]
    _print_latency(console, "Per-request latency (finished requests)", latency["all"],
                   f"No request finished in the window ({', '.join(f'{k} {v:,}' for k, v in requests.items())}).")
    groups = (
        ("long_prompts", f"Long prompts (top decile of admitted prompts: >= {latency['long_prompt_len']:,} tokens)",
         "No request with a prompt in the top decile finished in the window."),
        ("arrived_during_long_prefill", "Requests that arrived while a long prompt was prefilled",
         "No request arrived during a step that prefilled a long prompt (or none of those finished)."),
    )
    for key, title, why in groups:
        if key in latency:
            _print_latency(console, title, latency[key], why)
    efficiency = details["efficiency"]
    table = Table(title="Batch efficiency", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in efficiency.items():
        if key.startswith("kv_usage") and isinstance(value, float):  # percent, as the step table and plots
            table.add_row(key + " %", _percent(100 * value))
            continue
        table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else str(value))
    table.add_row("requests", ", ".join(f"{k} {v:,}" for k, v in requests.items()))
    for code, count in details["rejected_by_code"].items():
        example = next((reason for reason in details["rejected_reasons"] if rejection_code(reason) == code), "")
        table.add_row("rejected", f"{count:,}: {code}" + (f" (e.g. {example.partition(':')[2].strip()})"
                                                          if example.partition(":")[2].strip() else ""))
    if details.get("goodput") is not None:
        g = details["goodput"]
        slos = ", ".join(f"{k[:-4]} <= {v:g} s" for k, v in g.items() if k.endswith("_slo") and v is not None)
        table.add_row("goodput", f"{_fmt(g['percent'], '')}% of {g['admitted']:,} admitted requests meet {slos}")
    console.print(table)
    prefix = details.get("prefix_cache")
    if prefix:
        rate = prefix["prefix_hit_rate"]
        console.print(Text(
            f"Prefix cache (enable_prefix_caching={str(prefix['enable_prefix_caching']).lower()}, "
            f"block_size={prefix['block_size']}): hit rate "
            f"{'n/a' if rate is None else f'{100 * rate:.1f}%'} in tokens, {prefix['prefix_hit_tokens']:,} of "
            f"{prefix['prefix_query_tokens']:,} prompt tokens at {prefix['prefix_admissions']:,} first admissions; "
            f"re-admissions after a preemption excluded ({prefix['prefix_hit_tokens_after_preemption']:,} of "
            f"{prefix['prefix_query_tokens_after_preemption']:,} tokens hit at {prefix['prefix_readmissions']:,})."
        ))
    console.print(
        f"Checked {figures['steps_checked']:,} of {figures['num_steps']:,} steps against every spec invariant: "
        f"{plural(figures['violations'], 'violation')}. Wall time {figures['wall_time_s']:.1f} s."
    )


def _print_compare_conditions(console: Console, names: list[str], rows: list[list[tuple[str, str]]]) -> None:
    """The conditions of a ``--compare``: those every run shares once, then each run's own where they
    differ (chunking, budget, policy), one column per run."""
    shared = [(key, value) for (key, value) in rows[0] if all(dict(r).get(key) == value for r in rows)]
    _print_conditions(console, shared + [("compared", ", ".join(names))])
    differing = [key for key, _ in rows[0] if key not in dict(shared)]
    if differing:
        table = Table(title="Conditions that differ between the runs", title_justify="left")
        table.add_column("condition", style="bold")
        for name in names:
            table.add_column(name)
        for key in differing:
            table.add_row(key, *(dict(r).get(key, "") for r in rows))
        console.print(table)


def _count(value: Any) -> str:
    """An integer as an integer (``1,234``), a float with two decimals, ``None`` as ``-``."""
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else f"{value:,.2f}"


def _compare_table(console: Console, records: list[dict[str, Any]]) -> None:
    table = Table(title="Comparison (same window, same cost model)", title_justify="left")
    table.add_column("metric", style="bold")
    for r in records:
        table.add_column(r["name"], justify="right")
    for label, key in (("TTFT p50", "ttft_p50_s"), ("TTFT p99", "ttft_p99_s"), ("ITL p50", "itl_p50_s"),
                       ("ITL p99", "itl_p99_s"), ("ITL max", "itl_max_s"), ("TPOT p50", "tpot_p50_s"),
                       ("E2E p50", "e2e_p50_s"), ("E2E p99", "e2e_p99_s"), ("queueing p99", "queueing_p99_s")):
        table.add_row(label, *(_fmt(r["figures"][key]) for r in records))
    for key in records[0]["details"]["efficiency"]:
        values = [r["details"]["efficiency"].get(key) for r in records]
        if key.startswith("kv_usage"):
            table.add_row(key + " %", *(_percent(None if v is None else 100 * v) for v in values))
        else:
            table.add_row(key, *(_count(v) for v in values))
    if records[0]["figures"]["goodput_percent"] is not None:
        table.add_row("goodput %", *(_fmt(r["figures"]["goodput_percent"], "") for r in records))
    table.add_row("prefix hit % (tokens)", *(_percent(r["figures"].get("prefix_hit_rate_percent")) for r in records))
    table.add_row("violations", *(str(r["figures"]["violations"]) for r in records))
    console.print(table)


@attrs.frozen(kw_only=True)
class LabOptions:
    """``schedspec lab``'s command line, one typed value per option (click has parsed each one:
    numbers, counts, choices); :func:`_parse` checks how they combine and parses the structured ones.
    Field names are click's parameter names; every default is the option's."""

    trace_path: str | None = None
    trace_format: str | None = None
    synthetic: str | None = None
    start: float | None = None
    duration: float | None = None
    max_requests: int | None = None
    time_scale: float = 1.0
    length_scale: float = 1.0
    scheduler_name: str | None = None
    sets: tuple[str, ...] = ()
    profile: str = costs.DEFAULT_PROFILE
    backend: str = "cost-model"
    device: str = "auto"
    model_dir: str | None = None
    clock: str = "wall"
    steps_spec: str | None = None
    steps_out: str | None = None
    requests_out: str | None = None
    slo: str | None = None
    compare: str | None = None
    plot_dir: str | None = None
    as_json: bool = False
    save_path: str | None = None
    sweeps: tuple[str, ...] = ()
    jobs: int | None = None
    ray_address: str | None = None
    no_check: bool = False
    max_steps: int | None = None
    capacity_search: bool = False
    capacity_tolerance: float | None = None
    acceptance_rate: float | None = None


@attrs.frozen(kw_only=True)
class ParsedOptions:
    """The options :func:`_parse` accepted, parsed: each structured option as the value it stands for."""

    changes: dict[str, Any]
    """``--set`` fields."""
    cost: costs.CostModel
    base: dict[str, Any]
    """The profile's config fields (derived fields derived again from ``changes``)."""
    derivation: Any
    slo_targets: capacities.SloTargets | None
    slo_pair: metrics.Slo | None
    step_filter: StepFilter
    names: list[str]
    """The schedulers or variants of a run or ``--compare`` (one for a run)."""
    sweep_fields: list[tuple[str, list[Any]]]
    points: list[dict[str, Any]]
    """The ``--sweep`` points (empty without ``--sweep``)."""
    synthetic: Any
    """The ``--synthetic`` spec, or ``None``."""
    tolerance: float
    acceptance: AcceptanceModel | None = None
    """``--acceptance-rate``: the drafts' acceptance model, or ``None`` (the engine loop's default)."""


@attrs.frozen
class LabRun:
    """One run of a plain ``schedspec lab`` or of ``--compare``: a run specification (it runs in this
    process: it streams its progress and ``--steps-out``, and ``--backend torch`` holds the device).

    Attributes:
        index: its place in the comparison.
        name: the scheduler or variant name shown (the run record's name).
        scheduler: the registered scheduler it runs.
        config: its :class:`SchedulerConfig`.
        window: the requests it replays.
        steps_out: the ``--steps-out`` file, or ``None``.
        requests_out: the ``--requests-out`` file, or ``None``.
    """

    index: int
    name: str
    scheduler: str
    config: SchedulerConfig
    window: Any
    steps_out: str | None
    requests_out: str | None


@attrs.frozen(kw_only=True)
class LabPlan:
    """Everything a ``schedspec lab`` command runs, validated before the first run: the mode and one
    list of typed run specifications (:class:`LabRun`, :class:`~schedspec.lab.sweep.SweepRun` or
    :class:`~schedspec.lab.capacity.CapacityRun`), with what the renderers print around them."""

    mode: str
    """``"run"``, ``"compare"``, ``"sweep"`` or ``"capacity"``."""
    runs: list[Any]
    save_names: list[str]
    trace_text: str
    window_text: str
    conditions: dict[str, Any]
    """The run records' shared conditions with the cost model as the backend."""
    window_conditions: dict[str, Any]
    workload: dict[str, Any]
    natural_rate: float | None = None
    """``--capacity``: the window's own rate (requests/s)."""


def _parse(o: LabOptions) -> ParsedOptions:
    """Every option on its own and in combination (no work yet); exits 2 naming the option."""
    changes = parse_sets(o.sets)
    try:
        cost = costs.get_profile(o.profile)
        # Fields derived from others (num_kv_blocks from block_size, max_num_batched_tokens from
        # max_model_len without chunked prefill, ...) are derived from the values --set gives.
        base, derivation = costs.default_scheduler_config(cost, overrides=changes)
    except costs.CostModelError as error:
        fail(f"--profile: {error}")
    try:
        slo_targets = capacities.parse_slo(o.slo) if o.slo is not None else None
        slo_pair = slo_targets.goodput if slo_targets is not None else None
    except metrics.MetricsError as error:
        fail(f"--slo: {error}")
    step_filter = parse_steps(o.steps_spec)
    if o.synthetic is not None and o.trace_path is not None:
        fail("--trace and --synthetic: give one, not both")
    if o.synthetic is not None and o.trace_format is not None:
        fail("--trace-format and --synthetic: --trace-format describes a --trace file")
    if o.compare is not None and o.scheduler_name is not None:
        fail("--compare and --scheduler: give one, not both")
    if o.compare is not None:
        names = [n.strip() for n in o.compare.split(",")]
        if not any(names):
            fail(f"--compare {o.compare!r}: no scheduler named (expected A,B,.. e.g. static,fcfs)")
        if not all(names):
            fail(f"--compare {o.compare!r}: an empty name between commas")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            fail(f"--compare {o.compare!r}: {repeated[0]!r} given twice")
    else:
        names = [o.scheduler_name if o.scheduler_name is not None else "fcfs"]
    sweep_fields = _parse_sweeps(o.sweeps)
    if o.clock != "wall" and o.backend != "torch":
        fail("--clock: only with --backend torch (the cost model's step times are not measured)")
    if slo_targets is not None and slo_targets.percentiles and not o.capacity_search:
        metric, q, _ = slo_targets.percentiles[0]
        fail(f"--slo {metric}_p{q:g}: percentile keys are judged by --capacity; a run or --sweep judges "
             "ttft, itl, tpot, e2e (goodput, and p99 for --sweep)")
    if o.capacity_tolerance is not None and not o.capacity_search:
        fail("--capacity-tolerance: only with --capacity")
    acceptance = None if o.acceptance_rate is None else AcceptanceModel(rate=float(o.acceptance_rate))
    if acceptance is not None and o.backend != "cost-model":
        fail("--acceptance-rate: only with --backend cost-model (the torch backend verifies drafts on its model)")
    points = sweeping.cartesian(sweep_fields) if sweep_fields else []
    if sweep_fields:
        fields = [field for field, _ in sweep_fields]
        if o.compare is not None:
            fail("--sweep and --compare: give one, not both (--sweep scheduler=A,B runs several schedulers)")
        if o.backend != "cost-model":
            fail("--sweep: only with --backend cost-model (measured step times of parallel runs on one device "
                 "would disturb each other)")
        for option, value in (("--steps-out", o.steps_out), ("--requests-out", o.requests_out)):
            if value is not None:
                fail(f"{option}: not with --sweep (--save writes one run record per configuration)")
        if "time_scale" in fields and o.time_scale != 1:
            fail("--sweep time_scale and --time-scale: give one, not both")
        if "rate" in fields and (o.time_scale != 1 or "time_scale" in fields):
            fail("--sweep rate: sets the time scale itself; give neither --time-scale nor --sweep time_scale")
        if "scheduler" in fields and o.scheduler_name is not None:
            fail("--sweep scheduler and --scheduler: give one, not both")
        for field in fields:
            if field in changes:
                fail(f"--sweep {field} and --set {field}: give one, not both")
        if o.ray_address is not None and o.jobs is not None:
            fail("--ray and --jobs: give one, not both (the Ray cluster decides how many run at once)")
        if o.ray_address is not None and not o.ray_address.strip():
            fail("--ray: empty address (HOST:PORT, ray://HOST:PORT or auto)")
    elif o.jobs is not None and not o.capacity_search:
        fail("--jobs: only with --sweep")
    elif o.ray_address is not None:
        fail("--ray: only with --sweep")
    try:
        spec = parse_synthetic(o.synthetic) if o.synthetic is not None else None
    except WorkloadError as error:
        fail(f"--synthetic: {error}".replace("--synthetic: synthetic: ", "--synthetic: "))

    tolerance = capacities.DEFAULT_TOLERANCE if o.capacity_tolerance is None else o.capacity_tolerance
    if o.capacity_search:
        problem = capacities.option_problem(
            slo_targets, o.backend, o.compare, [field for field, _ in sweep_fields], o.time_scale, spec,
            {"--save": o.save_path, "--steps-out": o.steps_out, "--requests-out": o.requests_out}, tolerance)
        if problem is not None:
            fail(problem)
    return ParsedOptions(changes=changes, cost=cost, base=base, derivation=derivation, slo_targets=slo_targets,
                         slo_pair=slo_pair, step_filter=step_filter, names=names, sweep_fields=sweep_fields,
                         points=points, synthetic=spec, tolerance=tolerance, acceptance=acceptance)


def _plan(o: LabOptions, p: ParsedOptions, console: Console) -> LabPlan:
    """The outputs checked, the configs and schedulers built, the workload read and every run's window
    chosen: one list of run specifications, before the first run (exit 2 naming the option, 3 for a
    missing feature)."""
    names, points, spec, cost, changes, base = p.names, p.points, p.synthetic, p.cost, p.changes, p.base
    mode = "capacity" if o.capacity_search else "sweep" if points else "compare" if o.compare is not None else "run"

    # Outputs: never an input, never each other, and writable, before anything runs.
    check_path("--trace", o.trace_path)
    check_path("--model", o.model_dir)
    check_path("--save", o.save_path)
    path = (trace_formats.resolve_trace(o.trace_path) if o.trace_path is not None
            else trace_formats.default_trace_path()) if spec is None else None

    def output_name(base_path: str | None, name: str) -> str | None:
        return None if base_path is None else base_path if len(names) == 1 else numbered_output(base_path, name)

    labels = run_labels(len(points)) if points else names
    save_names = [o.save_path if len(labels) == 1 else numbered_output(o.save_path, label) for label in labels] \
        if o.save_path else []
    # every file the command reads is an input: the trace, a profile file, the model's files
    read = [path, o.profile if o.profile.endswith(".json") else None, o.model_dir if o.backend == "torch" else None]
    check_outputs(
        [(option, output_name(base_path, name)) for option, base_path in (("--steps-out", o.steps_out),
                                                                            ("--requests-out", o.requests_out))
         for name in names] + [("--save", target) for target in save_names],
        inputs=read,
        folders=[("--plot", o.plot_dir)],
    )
    if o.plot_dir is not None:
        from schedspec.lab.plots import plot_files

        planned = sweeping.plot_files(o.plot_dir) if points else plot_files(names, o.plot_dir)
        for plot in planned:
            for source in input_files(read):
                if plot.exists() and source.exists() and plot.samefile(source):
                    fail(f"--plot {o.plot_dir}: would overwrite the input file {plot}")
    if len(names) > 1 and any("/" in n or n.startswith(".") for n in names) and (
            o.steps_out or o.requests_out or o.save_path):
        fail(f"--compare {o.compare!r}: a name with '/' or a leading '.' cannot name an output file")

    # The configs and schedulers.
    where = "--set" if changes else f"--profile {cost.name}"
    build_config(base, changes, where=where)
    configs: dict[str, tuple[str, SchedulerConfig]] = {}
    for name in names:
        scheduler, raw = resolve_variant(name, {**base, **changes})
        config = build_config(raw, {}, where=f"--compare {name} (with {where})" if o.compare else where)
        check_scheduler(scheduler, config, where="--compare" if o.compare else "--scheduler")
        configs[name] = (scheduler, config)
    point_configs: list[tuple[str, SchedulerConfig]] = []
    for point in points:
        label = sweeping.point_label(point)
        fields_changed = {k: v for k, v in point.items() if k not in sweeping.LOAD_FIELDS and k != "scheduler"}
        point_base = base
        if fields_changed:
            point_base, _ = costs.default_scheduler_config(cost, overrides={**changes, **fields_changed})
        scheduler, raw = resolve_variant(point.get("scheduler", names[0]), {**point_base, **changes, **fields_changed})
        config = build_config(raw, {}, where=f"--sweep {label}")
        check_scheduler(scheduler, config, where=f"--sweep {label}:" if "scheduler" in point else "--scheduler")
        point_configs.append((scheduler, config))

    # The workload.
    duration = o.duration
    if duration is None and o.max_requests is None and spec is None:
        duration = DEFAULT_DURATION
    notes: list[str] = []
    try:
        if spec is not None:
            requests = spec.generate()
            trace_text = f"synthetic {spec}"
            workload = {"kind": "synthetic", "trace_path": None, "trace_sha256": None, "trace_format": None,
                        "synthetic": str(spec), "description": trace_text}
        else:
            assert path is not None
            requests = trace_formats.load_trace(path, o.trace_format, notes=notes)
            info = trace_formats.trace_info(path, o.trace_format, requests)
            trace_text = str(info)
            workload = {"kind": "trace", "trace_path": str(path), "trace_sha256": run_record.file_sha256(path),
                        "trace_format": info.format, "synthetic": None, "description": trace_text}
    except WorkloadError as error:
        fail(f"--trace: {error}" if spec is None else f"--synthetic: {error}")
    except OSError as error:
        fail(f"--trace {path}: cannot read ({error.strerror})")
    for line in notes:
        note(line)

    def make_window(scale: float, option: str = "--time-scale ") -> list:
        try:
            chosen = select_window(requests, start=o.start, duration=duration, max_requests=o.max_requests,
                                   time_scale=scale)
        except WorkloadError as error:
            message = str(error)
            for key, replacement in (("start=", "--start "), ("duration=", "--duration "), ("time_scale=", option)):
                message = message.replace(key, replacement)
            fail(message)
        return _scale_lengths(chosen, o.length_scale)

    window = make_window(o.time_scale)
    window_text = (f"start {o.start if o.start is not None else 'first arrival'}, duration "
                   f"{f'{duration:g} s' if duration else 'to the end'}, max requests {o.max_requests or 'all'}, "
                   f"time scale {o.time_scale:g}")
    if o.length_scale != 1:
        window_text += (f", length scale {o.length_scale:g} (prompt and output lengths divided by "
                        f"{o.length_scale:g})")
    window_conditions = {"start_s": o.start, "duration_s": duration, "max_requests": o.max_requests,
                         "time_scale": o.time_scale, "length_scale": o.length_scale}
    conditions = _shared(o, workload, p.cost, _cost_backend(cost), cost.model, window_conditions)

    if not o.as_json:
        _print_admission_preview(console, window, [config for _, config in
                                                  (point_configs or list(configs.values()))])

    plan = functools.partial(LabPlan, save_names=save_names, trace_text=trace_text, window_text=window_text,
                             conditions=conditions, window_conditions=window_conditions, workload=workload)
    if mode == "capacity":
        natural = _natural_rate(window, spec.rate if spec is not None else None, "--capacity")
        runs: list[Any] = [
            capacities.CapacityRun(i, sweeping.point_label(point) if point else scheduler, scheduler, config,
                                   list(window), natural, natural, cost, not o.no_check, o.max_steps,
                                   p.slo_targets, p.tolerance, p.acceptance)
            for i, (point, (scheduler, config)) in enumerate(zip(points or [{}], point_configs or [configs[names[0]]],
                                                                 strict=True))]
        return plan(mode=mode, runs=runs, natural_rate=natural)
    if mode == "sweep":
        windows: dict[float, list] = {o.time_scale: window}
        natural_rate = None
        runs = []
        for index, (point, (scheduler, config)) in enumerate(zip(points, point_configs, strict=True)):
            scale = o.time_scale
            if "time_scale" in point:
                scale = point["time_scale"]
            elif "rate" in point:
                if natural_rate is None:
                    natural_rate = _natural_rate(window, None, "--sweep rate")
                scale = natural_rate / point["rate"]
            if scale not in windows:
                windows[scale] = make_window(scale, option=f"--sweep {sweeping.point_label(point)}: time_scale=")
            own = dict(conditions)
            own["window"] = {**window_conditions, "time_scale": scale}
            runs.append(sweeping.SweepRun(index, sweeping.point_label(point), scheduler, config, windows[scale], cost,
                                          not o.no_check, o.max_steps, own, p.slo_pair, point, p.acceptance))
        return plan(mode=mode, runs=runs)
    runs = [LabRun(i, name, *configs[name], window, output_name(o.steps_out, name), output_name(o.requests_out, name))
            for i, name in enumerate(names)]
    return plan(mode=mode, runs=runs)


def _cost_backend(cost: costs.CostModel) -> dict[str, Any]:
    """The run record's backend conditions for the cost model."""
    return {"kind": "cost-model", "device": None, "model_dir": None, "description": f"cost model ({cost.name})"}


def _shared(o: LabOptions, workload: dict[str, Any], cost: costs.CostModel, backend: dict[str, Any], model: str,
            window: dict[str, Any]) -> dict[str, Any]:
    return run_record.shared_conditions(workload=workload, window=window, cost=cost, backend=backend, model=model,
                                        checks=not o.no_check, max_steps=o.max_steps)


def _natural_rate(window: Sequence[Any], synthetic_rate: float | None, option: str) -> float:
    """The window's own rate, requests / span (requests/s), or ``--synthetic``'s rate; exits 2 when every
    request arrives at once."""
    if synthetic_rate is not None:
        return synthetic_rate
    span = window[-1].arrival_time - window[0].arrival_time
    if span <= 0:
        fail(f"{option}: every request of the window arrives at the same time; no rate to scale")
    return len(window) / span


@click.command()
@click.option("--trace", "trace_path", default=None, metavar="PATH",
              help="Trace file: Azure LLM inference 2023 or 2024 CSV, BurstGPT CSV or Mooncake JSONL "
                   "(detected from the first line), or a packaged trace by name: "
                   f"{', '.join(trace_formats.PACKAGED_TRACES)}. Default: azure-conv (the Azure 2023 "
                   "conversation trace). Long prompts (mooncake): --profile llama3.1-8b-a100-80gb.")
@click.option("--trace-format", type=click.Choice(list(trace_formats.FORMATS)), default=None,
              help="Trace format (default: detected).")
@click.option("--synthetic", default=None, metavar="SPEC",
              help="Synthetic arrivals instead of a trace: rate=R,cv=C,prompt=P,output=O[,n=N|,duration=S][,seed=K].")
@click.option("--start", type=Number(minimum=0), default=None,
              help="Window start, seconds of trace time after the first arrival (>= 0).")
@click.option("--duration", type=Number(minimum=0, strict=True), default=None,
              help=f"Window length, seconds of trace time (default {DEFAULT_DURATION:g} unless --max-requests).")
@click.option("--max-requests", type=Count(minimum=1), default=None, help="At most this many requests of the window.")
@click.option("--time-scale", type=Number(minimum=0, strict=True), default=1.0,
              help="Multiply inter-arrival gaps (0.5 = twice as fast); the window may span at most 1e9 s.")
@click.option("--length-scale", type=Number(minimum=0, strict=True), default=1.0, show_default=True,
              help="Divide every prompt and output length by this (rounded up, at least 1 token); e.g. 8 to fit "
                   "the trace to the tiny model of --backend torch on a CPU.")
@scheduler_option
@set_option
@click.option("--profile", default=costs.DEFAULT_PROFILE, metavar="NAME|PROFILE.json",
              help=f"Cost profile: {', '.join(sorted(costs.PROFILES))} (derived on paper, not measured), or a "
                   "PROFILE.json fitted to measured step times by `schedspec calibrate`.")
@click.option("--backend", type=click.Choice(["cost-model", "torch"]), default="cost-model",
              help="Step times from the cost model (default) or a real model (schedspec.gpu_backend).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", help="Device for --backend torch.")
@click.option("--model", "model_dir", default=None, metavar="DIR",
              help="Hugging Face model directory for --backend torch (default: the built-in tiny model).")
@click.option("--clock", type=click.Choice(["wall", "thread"]), default="wall",
              help="--backend torch: measure step times on the wall clock (default) or on the thread's CPU clock "
                   "(CPU, one torch thread: leaves out waiting for a shared core; as `schedspec calibrate --clock`).")
@click.option("--steps", "steps_spec", default=None, metavar="SPEC",
              help="Steps to print: N, A-B, every:K, changed[:N] (default changed:40: the first 40 steps where "
                   "a request arrived, was preempted or finished), all, none.")
@click.option("--steps-out", default=None, metavar="FILE",
              help="Write every step as StepRecord JSON Lines (trace format) to this file (with --compare: "
                   "FILE-NAME.jsonl per scheduler). Never an input file; written only when the run completes.")
@click.option("--requests-out", default=None, metavar="FILE",
              help="Write one CSV row per request (with --compare: FILE-NAME.csv per scheduler).")
@click.option("--slo", default=None, metavar="ttft=..,itl=..", help="SLOs for goodput, e.g. ttft=2s,itl=200ms.")
@click.option("--compare", default=None, metavar="A,B,..",
              help=f"Run each scheduler or variant ({', '.join(sorted(VARIANTS))}) on the same window and compare.")
@click.option("--plot", "plot_dir", default=None, metavar="DIR", help="Write PNG plots into this folder.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the run record as JSON only (a list with --compare or --sweep): every condition "
                   "and every figure, units in the key names.")
@click.option("--save", "save_path", default=None, metavar="FILE.json",
              help="Write the run record (conditions and figures) to this file; with --compare or --sweep, one "
                   "file per run: FILE-NAME.json (--compare) or FILE-N.json, N the point's number in the table, zero-padded "
                   "to the width of the largest (FILE-01.json .. FILE-12.json). Read back by `schedspec compare`.")
@click.option("--sweep", "sweeps", multiple=True, metavar="FIELD=V1,V2,..",
              help="Run every combination (cartesian product, repeatable) of SchedulerConfig fields, "
                   "`scheduler`, or the load (`rate` in req/s, `time_scale`) and print one row per "
                   "configuration; with --slo, mark those that meet it and name the best.")
@click.option("--jobs", type=Count(minimum=1), default=None,
              help="Worker processes for --sweep (default: all cores); the results do not depend on it.")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Run the --sweep's runs as Ray tasks on an existing Ray cluster (HOST:PORT, ray://HOST:PORT "
                   "or auto; needs the ray extra, and schedspec installed on the cluster). Results equal "
                   "local runs.")
@click.option("--no-check", is_flag=True, help="Skip the spec checks (faster; not recommended).")
@click.option("--max-steps", type=Count(minimum=1), default=None, help="Stop after this many steps.")
@click.option("--capacity", "capacity_search", is_flag=True,
              help="For each configuration (--sweep), the highest request rate at which --slo holds (arrivals "
                   "time-scaled; a Poisson rate for --synthetic n=N), found by bisection; a table, the best named.")
@click.option("--acceptance-rate", type=Number(minimum=0, maximum=1), default=None,
              help="Speculative decoding (--set num_speculative_tokens=K): probability that the drafter is right "
                   "at an output position, each draw seeded by request and position (default 0.7).")
@click.option("--capacity-tolerance", type=Number(minimum=0, strict=True), default=None,
              help="Relative width of the capacity search's final bracket (default 0.02).")
def command(**options: Any) -> None:
    """Run the scheduler on a real trace and show the run conditions, the steps (by default the first
    40 where a request arrived, was preempted or finished; --steps to choose), the latency each request
    saw and the batch efficiency, with every step checked against the spec. Every option and the trace
    are validated before the run. Exit 0 clean, 1 on a spec violation, 2 on bad input, 3 if the
    scheduler lacks a feature the config needs."""
    o = LabOptions(**options)
    console = make_console(stderr=o.as_json, width=table_width())
    parsed = _parse(o)
    plan = _plan(o, parsed, console)
    if plan.mode == "capacity":
        sys.exit(_run_capacity(console, o, parsed, plan))
    if plan.mode == "sweep":
        _run_sweep(console, o, parsed, plan)
        return
    _run_plain(console, o, parsed, plan)


def _run_plain(console: Console, o: LabOptions, p: ParsedOptions, plan: LabPlan) -> None:
    """A run or ``--compare``: every :class:`LabRun` in this process, then its outputs and tables."""
    cost = p.cost
    compare = plan.mode == "compare"

    def run(spec: LabRun) -> tuple[LabResult, dict[str, Any], str, SchedulerConfig]:
        config, token_source = spec.config, None
        backend_text = f"cost model ({cost.name})"
        backend_conditions, model = _cost_backend(cost), cost.model
        if o.backend == "torch":
            config, token_source, backend_text = _torch_backend(config, p.changes, spec.window, o.model_dir, o.device,
                                                                o.clock)
            backend_conditions = {"kind": "torch", "device": o.device, "model_dir": o.model_dir,
                                  "description": backend_text}
            model = o.model_dir if o.model_dir is not None else "built-in tiny model (schedspec.gpu_backend)"
        result = _run_one(spec.name, spec.scheduler, config, spec.window, token_source, cost, o.no_check, o.max_steps,
                          o.as_json, spec.steps_out, console, p.acceptance)
        result.scheduler = spec.name
        if o.backend == "cost-model":
            _warn_outside_fitted_range(cost, largest_step(result.steps), spec.name if compare else None)
        shared = _shared(o, plan.workload, cost, backend_conditions, model, plan.window_conditions)
        record = run_record.build_record(spec.name, result, shared, p.slo_pair)
        return result, record, backend_text, config  # config: fitted to the model with --backend torch

    # in this process, one after the other: each streams its progress and --steps-out
    outcomes = execute(run, plan.runs)
    runs = [(spec.name, outcome[0]) for spec, outcome in zip(plan.runs, outcomes, strict=True)]
    records = [outcome[1] for outcome in outcomes]
    run_conditions = [_conditions(result, cost, plan.trace_text, plan.window_text, backend_text)
                      for result, _, backend_text, _ in outcomes]
    if not o.as_json and not compare:
        ((result, _, _, config),) = outcomes
        _print_conditions(console, run_conditions[0])
        console.print(Text(f"Config derivation: {p.derivation}", style="dim"))
        _print_steps(console, result.steps, config, p.step_filter(result.steps))

    for spec, (_, result) in zip(plan.runs, runs, strict=True):
        if spec.requests_out is not None:
            try:
                with atomic_output(spec.requests_out, encoding="utf-8", newline="") as handle:
                    metrics.write_timelines_csv(result.timelines, handle)
            except OSError as error:
                fail(f"--requests-out {spec.requests_out}: cannot write ({error.strerror})")
    _save_records(records, plan.save_names, console, quiet=o.as_json)
    if o.plot_dir:
        from schedspec.lab.plots import write_plots

        try:
            for written in write_plots(runs, o.plot_dir):
                console.print(f"wrote {written}")
        except OSError as error:
            fail(f"--plot {o.plot_dir}: cannot write ({error.strerror})")
    if o.as_json:
        click.echo(json.dumps(records if compare else records[0], indent=2, default=str))
    elif compare:
        _print_compare_conditions(console, [spec.name for spec in plan.runs], run_conditions)
        _compare_table(console, records)
    else:
        _print_summary(console, records[0])
    if any(r["figures"]["violations"] for r in records):
        sys.exit(EXIT_CHECK_FAILED)


MAX_SWEEP_POINTS = 1000
"""Most configurations one ``--sweep`` may run (the product of the value counts)."""


def _parse_sweeps(items: tuple[str, ...]) -> list[tuple[str, list[Any]]]:
    """``--sweep FIELD=V1,V2,..`` options as ``[(field, [values])]``; exits 2 naming the option on an
    unknown or repeated field, an empty or repeated value, a load value that is not a number > 0, or
    more than :data:`MAX_SWEEP_POINTS` configurations."""
    known = [f.name for f in attrs.fields(SchedulerConfig)] + ["scheduler", *sweeping.LOAD_FIELDS]
    out: list[tuple[str, list[Any]]] = []
    total = 1
    for item in items:
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep or not field:
            fail(f"--sweep {item!r}: expected FIELD=V1,V2,.. (e.g. max_num_seqs=64,128)")
        if field not in known:
            fail(f"--sweep {field!r}: unknown field; known: {', '.join(known)}")
        if any(field == f for f, _ in out):
            fail(f"--sweep {field!r}: given twice")
        raw = [v.strip() for v in text.split(",")]
        if not all(raw):
            fail(f"--sweep {item!r}: an empty value")
        values: list[Any] = []
        for value in raw:
            if field in sweeping.LOAD_FIELDS:
                try:
                    number = float(value)
                except ValueError:
                    fail(f"--sweep {field}={value!r}: not a number")
                if not math.isfinite(number) or number <= 0:
                    fail(f"--sweep {field}={value!r}: must be a finite number > 0")
                values.append(number)
            else:
                values.append(value if field == "scheduler" else parse_value(value))
        if len(set(map(repr, values))) != len(values):
            fail(f"--sweep {item!r}: a value given twice")
        total *= len(values)
        if total > MAX_SWEEP_POINTS:
            fail(f"--sweep: more than {MAX_SWEEP_POINTS:,} configurations")
        out.append((field, values))
    return out


def _save_records(records: list[dict[str, Any]], targets: list[str], console: Console, quiet: bool) -> None:
    for record, target in zip(records, targets, strict=False):
        if record is None:
            continue
        try:
            with atomic_output(target, encoding="utf-8") as handle:
                handle.write(json.dumps(record, indent=2, default=str) + "\n")
        except OSError as error:
            fail(f"--save {target}: cannot write ({error.strerror})")
        if not quiet:
            console.print(f"wrote {target}")


def _run_capacity(console: Console, o: LabOptions, p: ParsedOptions, plan: LabPlan) -> int:
    """``--capacity``: every configuration's search (:func:`schedspec.lab.capacity.run_all`), then the table
    (or the JSON). Returns the exit status: 0, or 1 when a run broke the spec or the engine crashed."""
    targets, natural = p.slo_targets, plan.natural_rate
    assert targets is not None and natural is not None
    workers = o.jobs if o.jobs is not None else sweeping.default_jobs()
    if not o.as_json:
        heading = f"{plan.trace_text.splitlines()[0]}; window {plan.window_text}"
        console.print(f"Capacity search: {len(plan.runs)} configuration(s); {heading}; SLO {targets}; natural rate "
                      f"{natural:.3g} requests/s; bisection to a relative tolerance of {p.tolerance:g}; "
                      f"{min(workers, len(plan.runs))} worker processes", markup=False, highlight=False)
    results = capacities.run_all(plan.runs, workers)
    for r in results:
        _warn_outside_fitted_range(p.cost, r["largest_step"], r["label"])
    best, reason = capacities.choose_best(results)
    if o.plot_dir is not None:
        written = capacities.write_plot(results, best, targets, o.plot_dir)
        if not o.as_json:
            console.print(f"wrote {written}", markup=False, highlight=False)
    if o.as_json:
        click.echo(json.dumps({"conditions": dict(plan.conditions), "slo": str(targets), "tolerance": p.tolerance,
                               "natural_rate_req_per_s": natural, "best": best, "reason": reason,
                               "configurations": results}, indent=2, default=str))
    else:
        _print_capacity_table(console, results, targets, best, reason)
    return 1 if any(r["problem"] for r in results) else 0


def _print_capacity_table(console: Console, results: Sequence[Mapping[str, Any]], targets: capacities.SloTargets,
                          best: int | None, reason: str) -> None:
    shown = [(m, q) for m, q in capacities.REPORTED]
    for m, q, _ in targets.targets():
        if (m, q) not in shown:
            shown.append((m, q))
    table = Table(title=f"Capacity under {targets} (latency in ms at the capacity rate)", title_justify="left")
    for column in ("#", "configuration", "capacity req/s", "bracket", "runs", "output tok/s",
                   *(f"{m.upper()} p{capacities.percentile_label(q)}" for m, q in shown)):
        table.add_column(column, justify="right", no_wrap=True)
    for i, r in enumerate(results):
        f = r["figures"] or {}
        rate = r["capacity_req_per_s"]
        capacity_text = "-" if rate is None else f"{rate:.3g}" + (" (or more)" if r["status"] == "above-range" else "")
        if r["status"] == "found":
            bracket = f"< {r['upper_req_per_s']:.3g}"
        elif r["status"] == "above-range":
            bracket = "held at the top of the range"
        else:
            bracket = f"fails at {r['upper_req_per_s']:.3g}, the bottom of the range"
        table.add_row(str(i + 1), r["label"], capacity_text, bracket, str(len(r["evaluations"])),
                      "-" if f.get("output_tokens_per_s") is None else f"{f['output_tokens_per_s']:,.0f}",
                      *("-" if f.get(f"{m}_p{capacities.percentile_label(q)}_s") is None else f"{f[f'{m}_p{capacities.percentile_label(q)}_s'] * 1e3:,.1f}"
                        for m, q in shown),
                      style="bold" if i == best else None)
    wide_console().print(table)
    for r in results:
        if r["problem"] is not None:
            console.print(f"FAILED {r['label']}: {r['problem']}", markup=False, highlight=False)
    console.print(f"Best: {'none' if best is None else results[best]['label']}: {reason}", markup=False,
                  highlight=False)


def _run_sweep(console: Console, o: LabOptions, p: ParsedOptions, plan: LabPlan) -> None:
    """``--sweep``: every point run (in parallel: local processes or Ray), one table, the best configuration
    named."""
    points = [run.point for run in plan.runs]
    workers = o.jobs if o.jobs is not None else sweeping.default_jobs()
    if not o.as_json:
        where = f"Ray tasks on the cluster at {o.ray_address}" if o.ray_address else \
            f"{min(workers, len(points))} worker processes"
        console.print(Text(f"Sweep: {len(points)} configurations of {plan.trace_text.splitlines()[0]}; window "
                           f"{plan.window_text}; checks {'off' if o.no_check else 'on'}; {where}"))
    try:
        results = sweeping.run_points(plan.runs, workers, o.ray_address)
    except RayNotInstalled as error:
        fail(f"--ray {o.ray_address}: {error}", status=EXIT_UNSUPPORTED)
    except RayUnavailable as error:  # no cluster there, or a task failed on it: unusable input (2)
        fail(f"--ray {o.ray_address}: {error}")
    except BrokenProcessPool as error:
        fail(f"--sweep: a worker process died ({error}); try fewer --jobs or a smaller window",
             status=EXIT_CHECK_FAILED)
    records = [record for _, record, _ in results]
    for record in records:
        if record is not None:
            _warn_outside_fitted_range(p.cost, record["details"]["largest_step"], record["name"])
    problems = [(i, why) for i, _, why in results if why is not None]
    best, reason = sweeping.choose_best(records, p.slo_pair)
    _save_records(records, plan.save_names, console, quiet=o.as_json)  # type: ignore[arg-type]
    if o.plot_dir is not None:
        try:
            for written in sweeping.write_plots(records, points, p.slo_pair, o.plot_dir):
                if not o.as_json:
                    console.print(f"wrote {written}")
        except OSError as error:
            fail(f"--plot {o.plot_dir}: cannot write ({error.strerror})")
    if o.as_json:
        click.echo(json.dumps([r for r in records if r is not None], indent=2, default=str))
    else:
        _print_sweep_table(console, points, records, p.slo_pair, best)
        for index, why in problems:
            console.print(Text.assemble(("FAILED", "red"), f" point {index + 1} ({sweeping.point_label(points[index])}): ",
                                        one_line(why)))
        console.print(f"Best: {'point ' + str(best + 1) + ' (' + sweeping.point_label(points[best]) + ')' if best is not None else 'none'}: {reason}")
    if problems or any(r is not None and r["figures"]["violations"] for r in records):
        sys.exit(EXIT_CHECK_FAILED)


def _print_sweep_table(console: Console, points: list[dict[str, Any]], records: list, slo, best: int | None) -> None:
    table = Table(title="Sweep: one row per configuration (latency over finished requests, in ms: p50 / p95 / p99)",
                  title_justify="left")
    table.add_column("#", justify="right")
    for field in points[0]:
        table.add_column(field, justify="right", no_wrap=True, min_width=len(field))
    # speculative decoding (some point verified drafts): vLLM's draft figures, "-" for a point without drafts
    speculative = any(r is not None and "mean_acceptance_length" in r["figures"] for r in records)
    columns = ["output tok/s", "total tok/s", "TTFT ms", "ITL ms", "TPOT ms", "goodput %", "preemptions",
               "KV mean/max %"]
    if speculative:
        columns += ["draft accept %", "mean accept len"]
    for column in (*columns, "SLO"):
        table.add_column(column, justify="right", no_wrap=True)
    for index, (point, record) in enumerate(zip(points, records, strict=True)):
        values = [sweeping.value_text(v) for v in point.values()]
        if record is None:
            table.add_row(str(index + 1), *values, "failed", *([""] * len(columns)))
            continue
        f = record["figures"]
        meets = sweeping.meets_slo(f, slo)
        mark = "" if meets is None else "meets" if meets else "misses"
        if index == best:
            mark = "BEST" if meets is not False else mark
        drafts = []
        if speculative:
            rate, length = f.get("draft_acceptance_rate_percent"), f.get("mean_acceptance_length")
            drafts = ["-" if rate is None else f"{rate:.1f}", "-" if length is None else f"{length:.2f}"]
        table.add_row(
            str(index + 1), *values, _count(f["output_tokens_per_s"]), _count(f["total_tokens_per_s"]),
            *(" / ".join(_ms(f[f"{m}_{p}_s"]) for p in ("p50", "p95", "p99")) for m in ("ttft", "itl", "tpot")),
            "-" if f["goodput_percent"] is None else f"{f['goodput_percent']:.1f}", f"{f['preemptions']:,}",
            f"{_percent(f['kv_usage_mean_percent'])[:-1]} / {_percent(f['kv_usage_max_percent'])[:-1]}", *drafts,
            mark, style="bold" if index == best else None)
    wide_console().print(table)  # its natural width: one line per configuration, nothing cut (MIN_TABLE_WIDTH)


def _warn_outside_fitted_range(cost: costs.CostModel, largest: Mapping[str, int], run: str | None = None) -> None:
    """A note (stderr) when a measured profile was applied to steps far larger than those it was fitted on
    (:meth:`~schedspec.reference.cost_model.CostModel.outside_fitted_range` of the run's
    :func:`~schedspec.lab.run.largest_step`): their times are extrapolated. ``run`` names the run (compare,
    sweep point, capacity configuration)."""
    if not cost.fitted_range or not largest:
        return
    beyond = cost.outside_fitted_range(dict(largest))
    if beyond:
        grid = ", ".join(f"{field} <= {value:,}" for field, value in cost.fitted_range)
        note(f"--profile {cost.name}: {'run ' + run + ': ' if run else ''}steps far outside the grid the profile "
             f"was fitted on ({grid} per step): {'; '.join(beyond)}; their step times are extrapolated "
             "(calibrate with a larger --max-prefill / --max-decodes)")


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    value = seconds * 1e3
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def _run_one(name: str, scheduler: str, config: SchedulerConfig, window: list, token_source, cost, no_check: bool,
             max_steps: int | None, as_json: bool, steps_out: str | None, console: Console,
             acceptance: AcceptanceModel | None = None) -> LabResult:
    """One run; the step trace goes to a temporary file renamed to ``steps_out`` only when the run
    completes (a violation or an error leaves no half file)."""
    progress = Progress(TextColumn("{task.description}", markup=False, style="bold"), BarColumn(),
                        TextColumn("{task.completed:,}/{task.total:,} requests ended"),
                        TimeElapsedColumn(), console=make_console(stderr=True), transient=True,
                        disable=as_json or not sys.stderr.isatty())
    with progress:
        task = progress.add_task(name, total=len(window))

        def tick(ended: int, _task=task, _progress=progress) -> None:
            _progress.advance(_task, ended)

        def run(handle) -> LabResult:
            return run_lab(window, scheduler, config, token_source=token_source, cost_model=cost,
                           check=not no_check, steps_out=handle, on_progress=tick, max_steps=max_steps,
                           acceptance=acceptance, steps_header=True)

        try:
            if steps_out is None:
                return run(None)
            try:
                with atomic_output(steps_out, encoding="utf-8") as handle:
                    return run(handle)
            except OSError as error:
                fail(f"--steps-out {steps_out}: cannot write ({error.strerror})")
        except UnsupportedFeature as error:
            fail(str(error), status=EXIT_UNSUPPORTED)
        except UnknownScheduler as error:
            fail(str(error))
        except EngineFault as error:
            # The engine under test crashed inside its own code: a finding, reported as a failed check.
            # one line whatever the terminal's width (soft_wrap: rich would wrap a long message, e.g. a long path)
            console.print(Text.assemble(("ENGINE CRASH", "red"), " ", one_line(error)), soft_wrap=True)
            console.print("Stopped: the engine raised; see docs/findings for known engine faults.")
            sys.exit(EXIT_CHECK_FAILED)
        except ViolationFound as error:
            for violation in error.violations[:10]:
                console.print(Text.assemble(("VIOLATION", "red"), " ", one_line(violation)))
            console.print(f"Stopped: the run broke the spec (state at step {error.state.step}: "
                          f"{len(error.state.running)} running, {len(error.state.waiting)} waiting, "
                          f"{len(error.state.free_block_ids)} free blocks).")
            sys.exit(EXIT_CHECK_FAILED)


def _torch_backend(config: SchedulerConfig, changes: dict[str, Any], window: list, model_dir: str | None,
                   device: str, clock: str = "wall"):
    """``--backend torch``: the config fitted to the model and window, the runner, and its description."""
    backend_module, model_config = torch_backend_model(model_dir, "--backend torch")
    BackendError, Runner = backend_module.BackendError, backend_module.Runner
    from schedspec.spec.config import ConfigError, blocks_for_tokens

    # Fit the profile's config to the model, unless --set gave the field: max_model_len at most
    # the model's max_position_embeddings; num_kv_blocks at most what the whole window needs at
    # once (every request at its full length), which changes no scheduling decision (no request
    # can run short of blocks with either size) but keeps the cache as small as it can be.
    fitted: dict[str, int] = {}
    if "max_model_len" not in changes:
        fitted["max_model_len"] = min(config.max_model_len, model_config.max_position_embeddings)
    if "num_kv_blocks" not in changes:
        limit = fitted.get("max_model_len", config.max_model_len)
        demand = sum(blocks_for_tokens(min(s.prompt_len + s.max_tokens, limit), config.block_size)
                     for s in window)
        fitted["num_kv_blocks"] = max(1, min(config.num_kv_blocks, demand))
    notes = [f"{key} {config_value:,} -> {fitted[key]:,}" for key, config_value in
             (("max_model_len", config.max_model_len), ("num_kv_blocks", config.num_kv_blocks))
             if key in fitted and fitted[key] != config_value]
    try:
        config = config.with_changes(**fitted)
    except ConfigError as error:
        fail(f"--backend torch: config fitted to the model: {error}")
    try:
        if clock == "thread":
            import torch

            torch.set_num_threads(1)
        token_source = Runner(config, model=model_dir, device=device, clock=clock)
        token_source.warm_up()  # one-time costs outside the measured steps (as schedspec calibrate)
    except (BackendError, ValueError) as error:
        fail(f"--backend torch: {error}")
    backend_text = f"torch backend, measured step times ({token_source.describe()})"
    if notes:
        backend_text += ("; config fitted to the model and window: " + ", ".join(notes)
                         + " (model limit / the window's whole demand)")
    return config, token_source, backend_text
