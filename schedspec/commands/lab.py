"""``schedspec lab``: watch an iteration-level scheduler work on a real trace, step by step."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import click
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from schedspec.cli_common import (
    EXIT_CHECK_FAILED,
    EXIT_UNSUPPORTED,
    build_config,
    fail,
    parse_sets,
    scheduler_option,
    set_option,
)
from schedspec.reference import cost_model as costs
from schedspec.reference import metrics, workloads
from schedspec.reference.engine import ViolationFound
from schedspec.reference.lab import VARIANTS, LabResult, LabStep, resolve_variant, run_lab
from schedspec.reference.scheduler import EngineFault, UnknownScheduler, UnsupportedFeature
from schedspec.spec.trace import header_line

DEFAULT_DURATION = 120.0
"""Seconds of trace time the default run replays (the first two minutes of the Azure conv trace)."""


def _scale_lengths(window: list, factor: float) -> list:
    """``--length-scale``: every prompt, shared prefix and output length divided by ``factor``, rounded
    up (at least one token); arrival times, ids and everything else unchanged."""
    if factor == 1:
        return window
    scaled = []
    for spec in window:
        prompt = max(1, math.ceil(spec.prompt_len / factor))
        scaled.append(attrs.evolve(spec, prompt_len=prompt, max_tokens=max(1, math.ceil(spec.max_tokens / factor)),
                                   prefix_len=min(prompt, math.ceil(spec.prefix_len / factor))))
    return scaled


def _step_filter(text: str | None, steps: list[LabStep]) -> list[LabStep]:
    """``--steps``: ``N`` (first N), ``A-B`` (range), ``every:K``, ``changed`` (steps where a request
    arrived, was preempted or finished), ``all`` or ``none``."""
    if text is None:
        text = "changed:40"
    try:
        if text == "none":
            return []
        if text == "all":
            return steps
        if text.startswith("changed"):
            limit = int(text.partition(":")[2] or 10**12)
            chosen = [s for s in steps if s.num_arrivals or s.num_preempted or s.num_finished]
            return chosen[:limit]
        if text.startswith("every:"):
            k = int(text.split(":", 1)[1])
            if k < 1:
                raise ValueError
            return steps[::k]
        if "-" in text:
            low, high = (int(x) for x in text.split("-", 1))
            return [s for s in steps if low <= s.step <= high]
        return steps[: int(text)]
    except ValueError:
        fail(f"--steps {text!r}: expected N, A-B, every:K, changed[:N], all or none")


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
              help="Trace file (Azure 2023 CSV or Mooncake JSONL). Default: the packaged Azure conversation trace.")
@click.option("--trace-format", type=click.Choice(list(workloads.FORMATS)), default=None,
              help="Trace format (default: detected).")
@click.option("--synthetic", default=None, metavar="SPEC",
              help="Synthetic arrivals instead of a trace: rate=R,cv=C,prompt=P,output=O[,n=N|,duration=S][,seed=K].")
@click.option("--start", type=float, default=None, help="Window start, seconds of trace time.")
@click.option("--duration", type=float, default=None,
              help=f"Window length, seconds of trace time (default {DEFAULT_DURATION:g} unless --max-requests).")
@click.option("--max-requests", type=int, default=None, help="At most this many requests of the window.")
@click.option("--time-scale", type=float, default=1.0, help="Multiply inter-arrival gaps (0.5 = twice as fast).")
@click.option("--length-scale", type=float, default=1.0, show_default=True,
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
              help="Steps to print: N, A-B, every:K, changed[:N] (default changed:40), all, none.")
@click.option("--steps-out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write every step as StepRecord JSON Lines (trace format) to this file.")
@click.option("--requests-out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write one CSV row per request.")
@click.option("--slo", default=None, metavar="ttft=..,itl=..", help="SLOs for goodput, e.g. ttft=2s,itl=200ms.")
@click.option("--compare", default=None, metavar="A,B,..",
              help=f"Run each scheduler or variant ({', '.join(sorted(VARIANTS))}) on the same window and compare.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None, help="Write PNG plots here.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON only.")
@click.option("--no-check", is_flag=True, help="Skip the spec checks (faster; not recommended).")
@click.option("--max-steps", type=int, default=None, help="Stop after this many steps.")
def command(trace_path, trace_format, synthetic, start, duration, max_requests, time_scale, length_scale,
            scheduler_name, sets,
            profile, backend, device, model_dir, steps_spec, steps_out, requests_out, slo, compare, plot_dir,
            as_json, no_check, max_steps) -> None:
    """Run the scheduler on a real trace and show every step, the latency each request saw and the batch
    efficiency, with the run conditions first. Exit 0 clean, 1 on a spec violation, 2 on bad input,
    3 if the scheduler lacks a feature the config needs."""
    console = Console(stderr=as_json, width=max(shutil.get_terminal_size((120, 24)).columns, 100))
    try:
        cost = costs.get_profile(profile)
        base, derivation = costs.default_scheduler_config(cost)
    except costs.CostModelError as error:
        fail(f"--profile: {error}")
    changes = parse_sets(sets)
    try:
        slo_pair = metrics.parse_slo(slo) if slo else None
    except metrics.MetricsError as error:
        fail(f"--slo: {error}")
    if max_steps is not None and max_steps < 1:
        fail(f"--max-steps={max_steps}: must be >= 1")
    if not length_scale > 0 or not math.isfinite(length_scale):
        fail(f"--length-scale={length_scale:g}: must be a positive number")

    if synthetic and trace_path:
        fail("--trace and --synthetic: give one, not both")
    if duration is None and max_requests is None and not synthetic:
        duration = DEFAULT_DURATION
    try:
        if synthetic:
            spec = workloads.parse_synthetic(synthetic)
            requests = spec.generate()
            trace_text = f"synthetic {spec}"
        else:
            path = Path(trace_path) if trace_path else workloads.default_trace_path()
            requests = workloads.load_trace(path, trace_format)
            info = workloads.trace_info(path, trace_format) if not trace_path else None
            trace_text = str(info) if info else f"{path}"
        window = workloads.select_window(requests, start=start, duration=duration, max_requests=max_requests,
                                         time_scale=time_scale)
    except workloads.WorkloadError as error:
        fail(str(error))
    window = _scale_lengths(window, length_scale)
    window_text = (f"start {start if start is not None else 'first arrival'}, duration "
                   f"{f'{duration:g} s' if duration else 'to the end'}, max requests {max_requests or 'all'}, "
                   f"time scale {time_scale:g}")
    if length_scale != 1:
        window_text += f", length scale {length_scale:g} (prompt and output lengths divided by {length_scale:g})"

    names = [n.strip() for n in compare.split(",") if n.strip()] if compare else [scheduler_name or "fcfs"]
    if compare and scheduler_name:
        fail("--compare and --scheduler: give one, not both")
    runs: list[tuple[str, LabResult]] = []
    for name in names:
        scheduler, raw = resolve_variant(name, {**base, **changes})
        config = build_config(raw, {}, where=f"config for {name}")
        token_source = None
        backend_text = f"cost model ({cost.name})"
        if backend == "torch":
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
        handle = open(steps_out if len(names) == 1 else f"{steps_out}.{name}", "w") if steps_out else None  # noqa: SIM115
        if handle is not None:
            handle.write(header_line(config, scheduler) + "\n")
        started = time.perf_counter()
        progress = Progress(TextColumn(f"[bold]{name}[/]"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} requests ended"),
                            TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                            disable=as_json or not sys.stderr.isatty())
        with progress:
            task = progress.add_task(name, total=len(window))

            def tick(record, _task=task, _progress=progress) -> None:
                ended = len(record.finished) + len(record.rejected) + len(record.aborted)
                if ended:
                    _progress.advance(_task, ended)

            try:
                result = run_lab(window, scheduler, config, token_source=token_source, cost_model=cost,
                                 check=not no_check, steps_out=handle, on_step=tick, max_steps=max_steps)
            except UnsupportedFeature as error:
                fail(str(error), status=EXIT_UNSUPPORTED)
            except UnknownScheduler as error:
                fail(str(error))
            except EngineFault as error:
                # The engine under test crashed inside its own code: a finding, reported as a failed check.
                console.print(f"ENGINE CRASH {error}", style="red", markup=False, highlight=False)
                console.print("Stopped: the engine raised; see docs/findings for known engine faults.")
                sys.exit(EXIT_CHECK_FAILED)
            except ViolationFound as error:
                for violation in error.violations[:10]:
                    console.print(f"[red]VIOLATION[/] {violation}")
                console.print(f"Stopped: the run broke the spec (state at step {error.state.step}: "
                              f"{len(error.state.running)} running, {len(error.state.waiting)} waiting, "
                              f"{len(error.state.free_block_ids)} free blocks).")
                sys.exit(EXIT_CHECK_FAILED)
            finally:
                if handle is not None:
                    handle.close()
        result.scheduler = name
        runs.append((name, result))
        del started
        if not as_json and not compare:
            _print_conditions(console, _conditions(result, cost, trace_text, window_text, backend_text))
            console.print(f"[dim]Config derivation: {derivation}[/]")
            _print_steps(console, result.steps, config, _step_filter(steps_spec, result.steps))

    summaries = []
    for name, result in runs:
        summary = _summaries(result, slo_pair)
        summary["name"] = name
        summaries.append(summary)
    if requests_out:
        for name, result in runs:
            target = requests_out if len(runs) == 1 else f"{requests_out}.{name}"
            metrics.timelines_to_csv(result.timelines, target)
    if plot_dir:
        from schedspec.reference.plots import write_plots

        for path in write_plots([(name, result) for name, result in runs], plot_dir):
            console.print(f"wrote {path}")
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
