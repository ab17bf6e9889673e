"""``schedspec lab``: watch an iteration-level scheduler work on a real trace, step by step."""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
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
    note,
    one_line,
    parse_sets,
    scheduler_option,
    set_option,
)
from schedspec.cli_common import (
    console as make_console,
)
from schedspec.reference import cost_model as costs
from schedspec.reference import metrics, workloads
from schedspec.reference.engine import ViolationFound
from schedspec.reference.lab import VARIANTS, LabResult, LabStep, resolve_variant, run_lab
from schedspec.reference.scheduler import EngineFault, UnknownScheduler, UnsupportedFeature
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.trace import header_line

DEFAULT_DURATION = 120.0
"""Seconds of trace time the default run replays (the first two minutes of the Azure conv trace)."""


def _scale_lengths(window: list, factor: float) -> list:
    """``--length-scale``: every prompt, shared prefix and output length divided by ``factor``, rounded
    up (at least one token; a length of 0 stays 0, so the spec still rejects that request); arrival
    times, ids and everything else unchanged. Exits 2 if a length would exceed
    :data:`~schedspec.reference.workloads.MAX_TOKEN_COUNT`."""
    if factor == 1:
        return window

    def scale(length: int) -> int:
        return 0 if length == 0 else max(1, math.ceil(length / factor))

    longest = max(max(s.prompt_len, s.max_tokens) for s in window)
    if longest / factor > workloads.MAX_TOKEN_COUNT:
        fail(f"--length-scale {factor:g}: makes a length of {longest:,} tokens {longest / factor:.3g}, more than "
             f"{workloads.MAX_TOKEN_COUNT:,}")
    scaled = []
    for spec in window:
        prompt = scale(spec.prompt_len)
        scaled.append(attrs.evolve(spec, prompt_len=prompt, max_tokens=scale(spec.max_tokens),
                                   prefix_len=min(prompt, math.ceil(spec.prefix_len / factor))))
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
        ("block_size", f"{config.block_size} tokens"),
        ("num_kv_blocks", f"{config.num_kv_blocks:,} ({config.kv_capacity_tokens:,} tokens of KV)"),
        ("max_num_batched_tokens", f"{config.max_num_batched_tokens:,}"),
        ("max_num_seqs", str(config.max_num_seqs)),
        ("max_model_len", f"{config.max_model_len:,}"),
        ("chunked prefill", "on" + (f" (long_prefill_token_threshold {config.long_prefill_token_threshold})"
                                    if config.long_prefill_token_threshold else "") if config.enable_chunked_prefill else "off"),
        ("prefix caching", "on" if config.enable_prefix_caching else "off"),
        ("execution", backend),
        ("cost profile", f"{profile.name}: a={profile.a * 1e3:.2f} ms, b={profile.b * 1e6:.1f} us/prefill token, "
                         f"c={profile.c * 1e6:.1f} us/decode token, d={profile.d * 1e9:.1f} ns/KV token"),
        ("hardware / model", f"{profile.hardware} / {profile.model}"),
        ("trace", trace_text),
        ("window", window),
        ("arrival rate", f"{len(arrivals):,} requests, {rate} over {span:,.1f} s"),
    ]


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


def _print_latency(console: Console, title: str, summary: dict[str, Any]) -> None:
    table = Table(title=title, title_justify="left")
    for column in ("metric", "count", "p50", "p95", "p99", "max", "mean"):
        table.add_column(column, justify="right")
    for name, stats in summary.items():
        if not isinstance(stats, dict) or "p50" not in stats:
            continue
        table.add_row(name, f"{stats['count']:,}", *(_fmt(stats[k]) for k in ("p50", "p95", "p99", "max", "mean")))
    console.print(table)


def _summaries(result: LabResult, slo: tuple[float, float] | None) -> dict[str, Any]:
    latency = metrics.latency_summary(result.timelines)
    efficiency = metrics.efficiency_summary(result.steps, result.config.num_kv_blocks, result.timelines)
    outcomes = latency.pop("requests")
    reasons: dict[str, int] = {}
    for t in result.timelines:
        if t.outcome == "rejected":
            reasons[t.finish_reason or ""] = reasons.get(t.finish_reason or "", 0) + 1
    summary: dict[str, Any] = {
        "scheduler": result.scheduler,
        "config": result.config.to_dict(),
        "requests": outcomes,
        "rejected_reasons": reasons,
        "latency": latency,
        "efficiency": efficiency,
        "checks": {
            "steps_checked": result.run.num_steps_checked,
            "violations": len(result.run.violations),
        },
        "steps": result.run.num_steps,
        "wall_seconds": result.run.wall_seconds,
    }
    if slo is not None:
        summary["goodput"] = metrics.goodput(result.timelines, *slo)
    return summary


def _print_summary(console: Console, summary: dict[str, Any]) -> None:
    latency = summary["latency"]
    _print_latency(console, "Per-request latency (all requests)", latency["all"])
    for key, title in (("long_prompts", f"Long prompts (top decile: >= {latency['long_prompt_len']:,} tokens)"),
                       ("arrived_during_long_prefill", "Requests that arrived while a long prompt was prefilled")):
        if key in latency:
            _print_latency(console, title, latency[key])
    efficiency = summary["efficiency"]
    table = Table(title="Batch efficiency", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in efficiency.items():
        table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else str(value))
    requests = summary["requests"]
    table.add_row("requests", ", ".join(f"{k} {v:,}" for k, v in requests.items()))
    for reason, count in summary["rejected_reasons"].items():
        table.add_row("rejected", f"{count:,}: {reason}")
    if "goodput" in summary:
        g = summary["goodput"]
        slos = ", ".join(f"{k[:-4]} <= {v:g} s" for k, v in g.items() if k.endswith("_slo") and v is not None)
        table.add_row("goodput", f"{_fmt(g['percent'], '')}% of {g['admitted']:,} admitted requests meet {slos}")
    console.print(table)
    checks = summary["checks"]
    console.print(
        f"Checked {checks['steps_checked']:,} of {summary['steps']:,} steps against every spec invariant: "
        f"{checks['violations']} violations. Wall time {summary['wall_seconds']:.1f} s."
    )


def _compare_table(console: Console, summaries: list[dict[str, Any]]) -> None:
    table = Table(title="Comparison (same window, same cost model)", title_justify="left")
    table.add_column("metric", style="bold")
    for s in summaries:
        table.add_column(s["name"], justify="right")
    rows = [
        ("TTFT p50", lambda s: _fmt(s["latency"]["all"]["ttft"]["p50"])),
        ("TTFT p99", lambda s: _fmt(s["latency"]["all"]["ttft"]["p99"])),
        ("ITL p50", lambda s: _fmt(s["latency"]["all"]["itl"]["p50"])),
        ("ITL p99", lambda s: _fmt(s["latency"]["all"]["itl"]["p99"])),
        ("ITL max", lambda s: _fmt(s["latency"]["all"]["itl"]["max"])),
        ("TPOT p50", lambda s: _fmt(s["latency"]["all"]["tpot"]["p50"])),
        ("E2E p50", lambda s: _fmt(s["latency"]["all"]["e2e"]["p50"])),
        ("E2E p99", lambda s: _fmt(s["latency"]["all"]["e2e"]["p99"])),
        ("queueing p99", lambda s: _fmt(s["latency"]["all"]["queueing"]["p99"])),
    ]
    for name, get in rows:
        table.add_row(name, *(get(s) for s in summaries))
    for key in summaries[0]["efficiency"]:
        table.add_row(key, *(_fmt(s["efficiency"].get(key), "") for s in summaries))
    if "goodput" in summaries[0]:
        table.add_row("goodput %", *(_fmt(s["goodput"].get("percent"), "") for s in summaries))
    table.add_row("steps", *(f"{s['steps']:,}" for s in summaries))
    table.add_row("violations", *(str(s["checks"]["violations"]) for s in summaries))
    console.print(table)


@click.command()
@click.option("--trace", "trace_path", default=None, metavar="PATH",
              help="Trace file: Azure LLM inference 2023 or 2024 CSV, BurstGPT CSV or Mooncake JSONL "
                   "(detected from the first line). Default: the packaged Azure 2023 conversation trace.")
@click.option("--trace-format", type=click.Choice(list(workloads.FORMATS)), default=None,
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
@click.option("--profile", default=costs.DEFAULT_PROFILE, help=f"Cost profile: {', '.join(sorted(costs.PROFILES))}.")
@click.option("--backend", type=click.Choice(["cost-model", "torch"]), default="cost-model",
              help="Step times from the cost model (default) or a real model (schedspec.gpu_backend).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", help="Device for --backend torch.")
@click.option("--model", "model_dir", default=None, metavar="DIR",
              help="Hugging Face model directory for --backend torch (default: the built-in tiny model).")
@click.option("--steps", "steps_spec", default=None, metavar="SPEC",
              help="Steps to print: N, A-B, every:K, changed[:N] (default changed:40: the first 40 steps where "
                   "a request arrived, was preempted or finished), all, none.")
@click.option("--steps-out", default=None, metavar="FILE",
              help="Write every step as StepRecord JSON Lines (trace format) to this file (with --compare: "
                   "FILE.NAME per scheduler). Never an input file; written only when the run completes.")
@click.option("--requests-out", default=None, metavar="FILE",
              help="Write one CSV row per request (with --compare: FILE.NAME per scheduler).")
@click.option("--slo", default=None, metavar="ttft=..,itl=..", help="SLOs for goodput, e.g. ttft=2s,itl=200ms.")
@click.option("--compare", default=None, metavar="A,B,..",
              help=f"Run each scheduler or variant ({', '.join(sorted(VARIANTS))}) on the same window and compare.")
@click.option("--plot", "plot_dir", default=None, metavar="DIR", help="Write PNG plots into this folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON only.")
@click.option("--no-check", is_flag=True, help="Skip the spec checks (faster; not recommended).")
@click.option("--max-steps", type=Count(minimum=1), default=None, help="Stop after this many steps.")
def command(trace_path, trace_format, synthetic, start, duration, max_requests, time_scale, length_scale,
            scheduler_name, sets,
            profile, backend, device, model_dir, steps_spec, steps_out, requests_out, slo, compare, plot_dir,
            as_json, no_check, max_steps) -> None:
    """Run the scheduler on a real trace and show the run conditions, the steps (by default the first
    40 where a request arrived, was preempted or finished; --steps to choose), the latency each request
    saw and the batch efficiency, with every step checked against the spec. Every option and the trace
    are validated before the run. Exit 0 clean, 1 on a spec violation, 2 on bad input, 3 if the
    scheduler lacks a feature the config needs."""
    console = make_console(stderr=as_json, width=max(shutil.get_terminal_size((120, 24)).columns, 100))

    # 1. Options, each on its own (no work yet).
    try:
        cost = costs.get_profile(profile)
        base, derivation = costs.default_scheduler_config(cost)
    except costs.CostModelError as error:
        fail(f"--profile: {error}")
    changes = parse_sets(sets)
    try:
        slo_pair = metrics.parse_slo(slo) if slo is not None else None
    except metrics.MetricsError as error:
        fail(f"--slo: {error}")
    step_filter = parse_steps(steps_spec)
    if synthetic is not None and trace_path is not None:
        fail("--trace and --synthetic: give one, not both")
    if synthetic is not None and trace_format is not None:
        fail("--trace-format and --synthetic: --trace-format describes a --trace file")
    if compare is not None and scheduler_name is not None:
        fail("--compare and --scheduler: give one, not both")
    if compare is not None:
        names = [n.strip() for n in compare.split(",")]
        if not any(names):
            fail(f"--compare {compare!r}: no scheduler named (expected A,B,.. e.g. static,fcfs)")
        if not all(names):
            fail(f"--compare {compare!r}: an empty name between commas")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            fail(f"--compare {compare!r}: {repeated[0]!r} given twice")
    else:
        names = [scheduler_name if scheduler_name is not None else "fcfs"]
    try:
        spec = workloads.parse_synthetic(synthetic) if synthetic is not None else None
    except workloads.WorkloadError as error:
        fail(f"--synthetic: {error}".replace("--synthetic: synthetic: ", "--synthetic: "))

    # 2. Outputs: never an input, never each other, and writable, before anything runs.
    check_path("--trace", trace_path)
    check_path("--model", model_dir)
    path = (Path(trace_path) if trace_path is not None else workloads.default_trace_path()) if spec is None else None

    def output_name(base_path: str | None, name: str) -> str | None:
        return None if base_path is None else base_path if len(names) == 1 else f"{base_path}.{name}"

    check_outputs(
        [(option, output_name(base_path, name)) for option, base_path in (("--steps-out", steps_out),
                                                                            ("--requests-out", requests_out))
         for name in names],
        inputs=[path] if path is not None else [],
        folders=[("--plot", plot_dir)],
    )
    if plot_dir is not None and path is not None:
        from schedspec.reference.plots import plot_files

        for plot in plot_files(names, plot_dir):
            if plot.exists() and path.exists() and plot.samefile(path):
                fail(f"--plot {plot_dir}: would overwrite the input file {plot}")
    if len(names) > 1 and any("/" in n or n.startswith(".") for n in names) and (steps_out or requests_out):
        fail(f"--compare {compare!r}: a name with '/' or a leading '.' cannot name an output file")

    # 3. The configs and schedulers (exit 2 naming the option, or 3 for a missing feature).
    where = "--set" if changes else f"--profile {cost.name}"
    build_config(base, changes, where=where)
    configs: dict[str, tuple[str, SchedulerConfig]] = {}
    for name in names:
        scheduler, raw = resolve_variant(name, {**base, **changes})
        config = build_config(raw, {}, where=f"--compare {name} (with {where})" if compare else where)
        check_scheduler(scheduler, config, where="--compare" if compare else "--scheduler")
        configs[name] = (scheduler, config)

    # 4. The workload.
    if duration is None and max_requests is None and spec is None:
        duration = DEFAULT_DURATION
    notes: list[str] = []
    try:
        if spec is not None:
            requests = spec.generate()
            trace_text = f"synthetic {spec}"
        else:
            assert path is not None
            requests = workloads.load_trace(path, trace_format, notes=notes)
            trace_text = str(workloads.trace_info(path, trace_format, requests))
    except workloads.WorkloadError as error:
        fail(f"--trace: {error}" if spec is None else f"--synthetic: {error}")
    for line in notes:
        note(line)
    try:
        window = workloads.select_window(requests, start=start, duration=duration, max_requests=max_requests,
                                         time_scale=time_scale)
    except workloads.WorkloadError as error:
        message = str(error)
        for key, option in (("start=", "--start "), ("duration=", "--duration "), ("time_scale=", "--time-scale ")):
            message = message.replace(key, option)
        fail(message)
    window = _scale_lengths(window, length_scale)
    window_text = (f"start {start if start is not None else 'first arrival'}, duration "
                   f"{f'{duration:g} s' if duration else 'to the end'}, max requests {max_requests or 'all'}, "
                   f"time scale {time_scale:g}")
    if length_scale != 1:
        window_text += f", length scale {length_scale:g} (prompt and output lengths divided by {length_scale:g})"

    # 5. The runs.
    runs: list[tuple[str, LabResult]] = []
    for name in names:
        scheduler, config = configs[name]
        token_source = None
        backend_text = f"cost model ({cost.name})"
        if backend == "torch":
            config, token_source, backend_text = _torch_backend(config, changes, window, model_dir, device)
        target = output_name(steps_out, name)
        result = _run_one(name, scheduler, config, window, token_source, cost, no_check, max_steps, as_json,
                          target, console)
        result.scheduler = name
        runs.append((name, result))
        if not as_json and not compare:
            _print_conditions(console, _conditions(result, cost, trace_text, window_text, backend_text))
            console.print(Text(f"Config derivation: {derivation}", style="dim"))
            _print_steps(console, result.steps, config, step_filter(result.steps))

    summaries = []
    for name, result in runs:
        summary = _summaries(result, slo_pair)
        summary["name"] = name
        summaries.append(summary)
    for name, result in runs:
        target = output_name(requests_out, name)
        if target is not None:
            try:
                with atomic_output(target, encoding="utf-8", newline="") as handle:
                    metrics.write_timelines_csv(result.timelines, handle)
            except OSError as error:
                fail(f"--requests-out {target}: cannot write ({error.strerror})")
    if plot_dir:
        from schedspec.reference.plots import write_plots

        try:
            for written in write_plots([(name, result) for name, result in runs], plot_dir):
                console.print(f"wrote {written}")
        except OSError as error:
            fail(f"--plot {plot_dir}: cannot write ({error.strerror})")
    if as_json:
        click.echo(json.dumps(summaries if compare else summaries[0], indent=2, default=str))
    elif compare:
        _print_conditions(console, _conditions(runs[0][1], cost, trace_text, window_text, "cost model")
                          + [("compared", ", ".join(names))])
        _compare_table(console, summaries)
    else:
        _print_summary(console, summaries[0])
    if any(s["checks"]["violations"] for s in summaries):
        sys.exit(EXIT_CHECK_FAILED)


def _run_one(name: str, scheduler: str, config: SchedulerConfig, window: list, token_source, cost, no_check: bool,
             max_steps: int | None, as_json: bool, steps_out: str | None, console: Console) -> LabResult:
    """One run; the step trace goes to a temporary file renamed to ``steps_out`` only when the run
    completes (a violation or an error leaves no half file)."""
    progress = Progress(TextColumn("{task.description}", markup=False, style="bold"), BarColumn(),
                        TextColumn("{task.completed:,}/{task.total:,} requests ended"),
                        TimeElapsedColumn(), console=make_console(stderr=True), transient=True,
                        disable=as_json or not sys.stderr.isatty())
    with progress:
        task = progress.add_task(name, total=len(window))

        def tick(record, _task=task, _progress=progress) -> None:
            ended = len(record.finished) + len(record.rejected) + len(record.aborted)
            if ended:
                _progress.advance(_task, ended)

        def run(handle) -> LabResult:
            if handle is not None:
                handle.write(header_line(config, scheduler) + "\n")
            return run_lab(window, scheduler, config, token_source=token_source, cost_model=cost,
                           check=not no_check, steps_out=handle, on_step=tick, max_steps=max_steps)

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
            console.print(Text.assemble(("ENGINE CRASH", "red"), " ", one_line(error)))
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
                   device: str):
    """``--backend torch``: the config fitted to the model and window, the runner, and its description."""
    try:
        from schedspec.gpu_backend import BackendError, ModelConfig, Runner, tiny_model_config
    except ImportError as error:
        fail(f"--backend torch needs the torch extra (pip install 'schedspec[torch]'): {error}",
             status=EXIT_UNSUPPORTED)
    from schedspec.spec.config import ConfigError, blocks_for_tokens

    # Fit the profile's config to the model, unless --set gave the field: max_model_len at most
    # the model's max_position_embeddings; num_kv_blocks at most what the whole window needs at
    # once (every request at its full length), which changes no scheduling decision (no request
    # can run short of blocks with either size) but keeps the cache as small as it can be.
    try:
        model_config = tiny_model_config() if model_dir is None else ModelConfig.from_model_dir(model_dir)
    except BackendError as error:
        fail(f"--model: {error}")
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
        token_source = Runner(config, model=model_dir, device=device)
    except (BackendError, ValueError) as error:
        fail(f"--backend torch: {error}")
    backend_text = f"torch backend, measured step times ({token_source.describe()})"
    if notes:
        backend_text += ("; config fitted to the model and window: " + ", ".join(notes)
                         + " (model limit / the window's whole demand)")
    return config, token_source, backend_text
