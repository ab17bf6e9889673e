"""Validate a calibrated cost profile against measured runs of the PyTorch backend.

For each held-out window of a packaged real trace (windows that are not the calibration grid), run

    schedspec lab --backend torch --device DEVICE [--model DIR] --trace T --start S --max-requests N \\
        --length-scale L --json --steps-out torch-steps.jsonl

and then the lab with the fitted profile on the same window and the same config (the torch run fits
``num_kv_blocks`` and ``max_model_len`` to the model and window; the same values are passed with --set):

    schedspec lab --profile PROFILE.json --trace T --start S --max-requests N --length-scale L \\
        --set num_kv_blocks=K --set max_model_len=M --json

and print, per window, the relative error (simulated - measured) / measured of TTFT, ITL and
end-to-end latency at p50 / p95 / p99 and of output throughput, plus the per-step error of the profile
on the torch run's own steps (each measured step against ``CostModel.batch_seconds`` of its batch).
The measured run is repeated (``--repeats``, default 3): each figure's median is the measured value and
its spread, (max - min) / median, the run-to-run noise the errors should be read against.
torch's threads are set with OMP_NUM_THREADS / MKL_NUM_THREADS for both calibration and validation
(``--threads``). The load average (``uptime``) is printed before and after: on a shared machine the
measured step times, and so the errors, move with it.

Usage:
    .venv/bin/python scripts/validate_cost_model.py --profile tiny-cpu.json [--model DIR] [--device cpu]
        [--threads 1] [--max-requests 40] [--length-scale 8] [--json OUT.json] [--markdown OUT.md]
    .venv/bin/python scripts/validate_cost_model.py --calibrate [--quick] ...   # calibrate first

The same script runs on a GPU machine with ``--device cuda`` (and ``--length-scale 1`` for a real
model): nothing in it is CPU-specific.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "schedspec" / "data" / "traces"

WINDOWS = (
    ("AzureLLMInferenceTrace_conv.csv", 600.0),
    ("AzureLLMInferenceTrace_conv.csv", 2400.0),
    ("AzureLLMInferenceTrace_code.csv", 900.0),
)
"""Held-out windows: (trace, start second). The calibration grid is synthetic, so every trace window is
held out; these avoid the first 120 s (the lab's default window)."""

FIGURES = tuple((f"{m.upper()} {p}", f"{m}_{p}_s") for m in ("ttft", "itl", "e2e") for p in ("p50", "p95", "p99"))


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "n/a"


def schedspec(args: list[str], env: dict[str, str]) -> dict:
    command = [sys.executable, "-m", "schedspec", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if done.returncode != 0:
        sys.exit(f"validate_cost_model: {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout) if "--json" in args else {}


def step_errors(steps_file: Path, profile_path: str) -> dict[str, float]:
    """The profile's error on the measured steps: median |error| per step and the error of the summed
    busy time (predicted / measured - 1)."""
    sys.path.insert(0, str(ROOT))
    from schedspec.reference.cost_model import load_profile
    from schedspec.spec.trace import StepRecord

    cost = load_profile(profile_path)
    errors, measured, predicted = [], 0.0, 0.0
    lines = steps_file.read_text().splitlines()[1:]
    for line in lines:
        record = StepRecord.from_json(line)
        if not record.scheduled:
            continue
        p = cost.batch_seconds(record.scheduled)
        errors.append(abs(p - record.duration) / record.duration)
        measured += record.duration
        predicted += p
    return {"steps": len(errors), "step_median_abs_percent": 100 * statistics.median(errors) if errors else 0.0,
            "busy_time_percent": 100 * (predicted / measured - 1) if measured else 0.0}


def validate(profile: str, model: str | None, device: str, threads: int, max_requests: int, length_scale: float,
             clock: str = "wall", windows=WINDOWS, repeats: int = 3) -> dict:
    """Per window: ``repeats`` measured runs (each figure's median is the measured value; its spread,
    (max - min) / median, is the run-to-run noise) and one simulated run with the profile."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    rows = []
    keys = [key for _, key in FIGURES] + ["output_tokens_per_s"]
    for trace, start in windows:
        common = ["--trace", str(TRACES / trace), "--start", f"{start:g}", "--max-requests", str(max_requests),
                  "--length-scale", f"{length_scale:g}", "--steps", "none", "--json"]
        runs, per_step, loads = [], [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as folder:
                steps_file = Path(folder) / "torch-steps.jsonl"
                before = load()
                runs.append(schedspec(["lab", "--backend", "torch", "--device", device, "--clock", clock,
                                       *(["--model", model] if model else []), *common, "--steps-out", str(steps_file)],
                                      env))
                loads.append(f"{before}-{load()}")
                per_step.append(step_errors(steps_file, profile))
        measured = {k: statistics.median(r["figures"][k] for r in runs) if all(r["figures"][k] is not None for r in runs)
                    else None for k in keys}
        noise = {k: None if not measured[k] else
                 100 * (max(r["figures"][k] for r in runs) - min(r["figures"][k] for r in runs)) / measured[k]
                 for k in keys}
        config = runs[0]["conditions"]["config"]
        sim = schedspec(["lab", "--profile", profile, *common, "--set", f"num_kv_blocks={config['num_kv_blocks']}",
                         "--set", f"max_model_len={config['max_model_len']}"], env)
        errors, spreads = {}, {}
        for label, key in (*FIGURES, ("output tok/s", "output_tokens_per_s")):
            r, s = measured[key], sim["figures"][key]
            errors[label] = None if not r or s is None else 100 * (s - r) / r
            spreads[label] = noise[key]
        rows.append({"window": f"{trace.removesuffix('.csv').removeprefix('AzureLLMInferenceTrace_')} "
                               f"start {start:g} s, {max_requests} requests, length scale {length_scale:g}",
                     "errors_percent": errors, "run_to_run_spread_percent": spreads,
                     "per_step": {k: statistics.median(p[k] for p in per_step) for k in per_step[0]},
                     "loads": loads, "load_before": loads[0].split("-")[0], "load_after": loads[-1].split("-")[1],
                     "measured": {k: measured[k] for _, k in FIGURES},
                     "simulated": {k: sim["figures"][k] for _, k in FIGURES},
                     "wall_time_s": statistics.median(r["figures"]["wall_time_s"] for r in runs)})
    return {"profile": profile, "model": model or "built-in tiny model", "device": device, "threads": threads,
            "clock": clock, "repeats": repeats, "rows": rows}


def markdown(result: dict, key: str = "errors_percent") -> str:
    """The table of relative errors (``key="errors_percent"``) or of the measured runs' spread
    (``"run_to_run_spread_percent"``), in %."""
    labels = [label for label, _ in FIGURES] + ["output tok/s"]
    extra = " step median abs | busy time | load |" if key == "errors_percent" else ""
    lines = ["| window | " + " | ".join(labels) + " |" + extra,
             "|---|" + "---:|" * (len(labels) + (3 if extra else 0))]
    for row in result["rows"]:
        sign = "+" if key == "errors_percent" else ""
        cells = ["-" if row[key][k] is None else f"{row[key][k]:{sign}.1f}" for k in labels]
        line = f"| {row['window']} | " + " | ".join(cells) + " |"
        if extra:
            step = row["per_step"]
            line += (f" {step['step_median_abs_percent']:.1f} | {step['busy_time_percent']:+.1f} | "
                     f"{row['load_before']} -> {row['load_after']} |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def verdict(result: dict, p50: float = 10.0, p99: float = 20.0) -> list[str]:
    """The figures that miss the targets (|error| > 10 % at p50, > 20 % at p95/p99 and throughput)."""
    misses = []
    for row in result["rows"]:
        for label, value in row["errors_percent"].items():
            limit = p50 if label.endswith("p50") else p99
            if value is not None and abs(value) > limit:
                misses.append(f"{row['window']}: {label} {value:+.1f}% (target {limit:g}%)")
    return misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="PROFILE.json from schedspec calibrate")
    parser.add_argument("--calibrate", action="store_true", help="run schedspec calibrate first (writes --profile)")
    parser.add_argument("--quick", action="store_true", help="with --calibrate: the quick grid")
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "thread"), default="thread",
                        help="step-time clock for calibrate and lab --backend torch (thread: CPU, 1 thread)")
    parser.add_argument("--max-requests", type=int, default=40)
    parser.add_argument("--length-scale", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per window (median; spread reported)")
    parser.add_argument("--calibrate-args", default="", help="extra arguments for schedspec calibrate")
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    profile = args.profile or str(Path(tempfile.mkdtemp()) / "profile.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    if args.calibrate:
        print(f"load before calibration: {load()}", flush=True)
        subprocess.run([sys.executable, "-m", "schedspec", "calibrate", "--device", args.device, "--clock", args.clock,
                        "--threads", str(args.threads), "--out", profile, *(["--model", args.model] if args.model else []),
                        *(["--quick"] if args.quick else []), *args.calibrate_args.split()],
                       cwd=ROOT, env=env, check=True)
    elif not args.profile:
        sys.exit("validate_cost_model: give --profile PROFILE.json or --calibrate")
    result = validate(profile, args.model, args.device, args.threads, args.max_requests, args.length_scale, args.clock,
                      repeats=args.repeats)
    result["misses"] = verdict(result)
    print(markdown(result))
    print(f"run-to-run spread of the {args.repeats} measured runs, (max - min) / median, %:")
    print(markdown(result, "run_to_run_spread_percent"))
    print("targets: |error| <= 10% at p50, <= 20% at p95/p99 and throughput; "
          + (f"{len(result['misses'])} missed:\n  " + "\n  ".join(result["misses"]) if result["misses"] else "all met"))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(result))


if __name__ == "__main__":
    main()
