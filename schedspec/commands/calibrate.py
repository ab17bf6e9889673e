"""``schedspec calibrate``: measure the PyTorch backend's step times over a designed grid and fit the lab's
cost model to them (see :mod:`schedspec.lab.calibrate`)."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from schedspec.cli_common import (
    Count,
    atomic_output,
    check_outputs,
    check_path,
    fail,
    table_width,
    torch_backend_model,
)
from schedspec.cli_common import console as make_console
from schedspec.lab import calibrate as cal
from schedspec.spec.config import ConfigError, SchedulerConfig, blocks_for_tokens

QUICK = {"max_prefill": 128, "max_decodes": 8, "max_context": 256, "repeats": 3, "warmup": 1}
"""The ``--quick`` grid (tests and CI: a few seconds on a CPU with the tiny model)."""


@click.command()
@click.option("--backend", type=click.Choice(["torch"]), default="torch", show_default=True,
              help="The backend whose step times are measured (schedspec.gpu_backend).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--model", "model_dir", default=None, metavar="DIR",
              help="Hugging Face model directory (default: the built-in tiny model).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--threads", type=Count(minimum=1), default=None,
              help="torch intra-op threads (torch.set_num_threads; default: torch's own choice). Recorded.")
@click.option("--out", "out_path", default=None, metavar="PROFILE.json",
              help="Write the profile here (read by `schedspec lab --profile PROFILE.json`). Never an input file.")
@click.option("--name", default=None, help="Profile name (default: derived from the model, dtype and device).")
@click.option("--quick", is_flag=True, help="A small grid (prefill <= 128, 8 decodes, context <= 256; 3 repeats): seconds.")
@click.option("--max-prefill", type=Count(minimum=8), default=None,
              help="Largest prefill chunk in the grid, tokens (default 2048, the lab's max_num_batched_tokens).")
@click.option("--max-decodes", type=Count(minimum=1), default=None, help="Largest decode batch (default 128).")
@click.option("--max-context", type=Count(minimum=8), default=None, help="Longest decode context, tokens (default 2048).")
@click.option("--repeats", type=Count(minimum=1), default=None, help="Measured executions per point (median; default 5).")
@click.option("--warmup", type=Count(minimum=0), default=None, help="Throw-away executions per point (default 2).")
@click.option("--block-size", type=Count(minimum=1), default=16, show_default=True)
@click.option("--form", type=click.Choice(["auto", *cal.FORMS]), default="auto", show_default=True,
              help="The fitted form: linear (the cost model's a,b,c,d), attention (plus e per prefill attention "
                   "pair), piecewise (piecewise linear in the step's tokens, plus d, e and f per prefill chunk), or "
                   "auto (a more complex form only when it cuts the relative RMS error by 20 %).")
@click.option("--clock", type=click.Choice(["wall", "thread"]), default="wall", show_default=True,
              help="Step times on the wall clock, or on the thread's CPU clock (CPU, --threads 1: a shared "
                   "machine's waiting left out). Use the same in `lab --backend torch --clock`.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile document as JSON only.")
def command(backend, device, model_dir, dtype, threads, out_path, name, quick, max_prefill, max_decodes,
            max_context, repeats, warmup, block_size, form, clock, as_json) -> None:
    """Measure the backend's step time over a designed grid (prefill chunks, decode batches over growing
    contexts, mixed steps), each point the median of repeated runs after warm-up; fit the cost model
    a + b*prefill_tokens + c*decode_tokens + d*kv_tokens_attended (non-negative least squares on the
    relative error); print the fit error per region with the run conditions; write the profile.
    Exit 0, or 2 on bad input, 3 without torch."""
    console = make_console(stderr=as_json, width=table_width())
    check_path("--model", model_dir)
    check_outputs([("--out", out_path)], inputs=[model_dir])  # never over a file of the model it reads
    limits = {"max_prefill": max_prefill, "max_decodes": max_decodes, "max_context": max_context,
              "repeats": repeats, "warmup": warmup}
    defaults = QUICK if quick else {"max_prefill": 2048, "max_decodes": 128, "max_context": 2048, "repeats": 5,
                                    "warmup": 2}
    limits = {k: (defaults[k] if v is None else v) for k, v in limits.items()}
    backend_module, model_config = torch_backend_model(model_dir, f"--backend {backend}:")
    import torch

    BackendError, Runner = backend_module.BackendError, backend_module.Runner
    grid = cal.design_grid(limits["max_prefill"], limits["max_decodes"], limits["max_context"], quick=quick)
    longest = max(p.longest for p in grid)
    if longest + 1 > model_config.max_position_embeddings:
        fail(f"--max-prefill/--max-context: the grid needs sequences of {longest + 1:,} tokens; the model's "
             f"max_position_embeddings is {model_config.max_position_embeddings:,}")
    blocks = max(sum(blocks_for_tokens(pr + n, block_size) for pr, n in p.chunks)
                 + p.decodes * blocks_for_tokens(p.context + 1, block_size) for p in grid)
    try:
        config = SchedulerConfig(block_size=block_size, num_kv_blocks=blocks,
                                 max_num_batched_tokens=max(limits["max_prefill"], 8) + limits["max_decodes"],
                                 max_num_seqs=limits["max_decodes"] + 4, max_model_len=longest + 1)
    except ConfigError as error:
        fail(f"--block-size: {error}")
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        runner = Runner(config, model=model_dir, device=device, dtype=dtype, clock=clock)
        runner.warm_up()
    except (BackendError, ValueError) as error:
        fail(f"--backend {backend}: {error}")
    conditions = cal.run_conditions(runner)
    if not as_json:
        console.print(f"Calibrating {conditions['model']}; {conditions['torch_threads']} torch threads, torch "
                      f"{conditions['torch_version']}; load average {conditions['load_average_1m']}; "
                      f"{len(grid)} grid points, {limits['warmup']} warm-up + {limits['repeats']} measured runs each",
                      markup=False, highlight=False)
    progress = None
    if not as_json and sys.stderr.isatty():
        def progress(index, total, point):  # noqa: ANN001
            click.echo(f"\r  point {index + 1}/{total}: {point.label:<40}", err=True, nl=False)
    measurements = cal.measure(runner, grid, config, repeats=limits["repeats"], warmup=limits["warmup"],
                               progress=progress)
    if progress is not None:
        click.echo("", err=True)
    chosen, coefficients, form_rms = cal.choose_form(measurements, form)
    conditions["load_average_1m_end"] = cal.os.getloadavg()[0]
    profile_name = name or (f"{'tiny' if model_dir is None else model_config.architecture}-{conditions['dtype']}-"
                            f"{runner.device.type}-{conditions['torch_threads']}t")
    document = cal.profile_document(
        profile_name, coefficients, measurements, conditions,
        {"quick": quick, **limits, "block_size": block_size, "points": len(grid)},
        {"block_size": block_size, "max_model_len": min(model_config.max_position_embeddings, 8192)},
        chosen, form_rms)
    if out_path is not None:
        try:
            with atomic_output(out_path, encoding="utf-8") as handle:
                handle.write(cal.dumps(document))
        except OSError as error:
            fail(f"--out {out_path}: cannot write ({error.strerror})")
    if as_json:
        click.echo(cal.dumps(document), nl=False)
        return
    print_report(console, document)
    if out_path is not None:
        console.print(f"wrote {out_path} (use: schedspec lab --profile {out_path})", markup=False, highlight=False)


def print_report(console, document) -> None:
    """The fitted coefficients, the conditions and the fit error per region."""
    c = document["coefficients"]
    console.print(f"Profile {document['name']}: a = {c['a_s_per_step'] * 1e3:.3f} ms/step, "
                  f"b = {c['b_s_per_prefill_token'] * 1e6:.2f} us/prefill token, "
                  f"c = {c['c_s_per_decode_token'] * 1e6:.2f} us/decode token, "
                  f"d = {c['d_s_per_kv_token'] * 1e9:.2f} ns/KV token, "
                  f"e = {c['e_s_per_prefill_attention_pair'] * 1e12:.1f} ps/prefill attention pair, "
                  f"f = {c.get('f_s_per_prefill_chunk', 0.0) * 1e3:.3f} ms/prefill chunk", markup=False, highlight=False)
    if document["token_knots"]:
        console.print("Piecewise in the step's tokens: " + ", ".join(f"{t} -> {v * 1e3:.2f} ms"
                                                                      for t, v in document["token_knots"]),
                      markup=False, highlight=False)
    rms = ", ".join(f"{k} {v:.1f}%" for k, v in document["relative_rms_error_percent_by_form"].items())
    console.print(f"Form: {document['form']} ({document['formula']}); relative RMS error by form: {rms}",
                  markup=False, highlight=False)
    conditions = document["conditions"]
    console.print(f"Conditions: device {conditions['device']}, dtype {conditions['dtype']}, "
                  f"{conditions['torch_threads']} torch threads, {conditions['clock']} clock, "
                  f"torch {conditions['torch_version']}, "
                  f"load average {conditions['load_average_1m']:.2f} -> {conditions['load_average_1m_end']:.2f}",
                  markup=False, highlight=False)
    table = Table(title="Fit error per region (predicted - measured) / measured", title_justify="left")
    for column in ("region", "points", "median |error| %", "max |error| %", "mean error %"):
        table.add_column(column, justify="right")
    for region, e in document["fit_error_percent"].items():
        table.add_row(region, str(e["points"]), f"{e['median_abs_percent']:.1f}", f"{e['max_abs_percent']:.1f}",
                      f"{e['mean_percent']:+.1f}")
    console.print(table)
    points = Table(title="Grid points", title_justify="left")
    for column in ("region", "step", "measured ms", "predicted ms", "error %", "spread %"):
        points.add_column(column, justify="right")
    for p in document["points"]:
        predicted = p["measured_s"] * (1 + p["error_percent"] / 100)
        points.add_row(p["region"], p["step"], f"{p['measured_s'] * 1e3:.2f}", f"{predicted * 1e3:.2f}",
                       f"{p['error_percent']:+.1f}", f"{p['spread'] * 100:.0f}")
    console.print(points)
