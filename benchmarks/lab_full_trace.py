"""Benchmark: replay the full one-hour Azure conversation trace (19,366 requests) through fcfs, with
the spec checks on and off, side by side; then a checked run with prefix caching beside the same run
without it. Prints each figure beside its target, CPU and wall seconds, steps per second and peak memory.

    .venv/bin/python benchmarks/lab_full_trace.py [--max-requests N] [--only on|off|off-plain|prefix]

``off`` runs fcfs as ``fcfs-fast`` (the lab's unchecked path), ``off-plain`` runs the plain fcfs policy
unchecked (what the lab would run without ``fcfs-fast``) and ``on`` the checked path, in the same run, so
that what ``fcfs-fast`` buys is measured beside the paths it would be replaced by.

Targets (issue 26, on one core): the full hour under 10 s of CPU with checks off and under 30 s with
checks on; a checked run with ``enable_prefix_caching`` within 1.5x of the same checked run without it
(the prefix pair runs on the first ``--prefix-requests`` requests, default 2,000, since the pair is a
ratio). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import time

import attrs

from schedspec.lab import trace_formats, windows
from schedspec.lab.run import run_lab
from schedspec.reference import cost_model
from schedspec.spec.config import SchedulerConfig

TARGET_CPU_S = {False: 10.0, True: 30.0}
"""Issue 26: CPU seconds for the full hour with checks off / on."""
TARGET_PREFIX_RATIO = 1.5
"""Issue 26: a checked run with prefix caching at most this many times the CPU of one without."""


def _run(requests, config: SchedulerConfig, check: bool) -> tuple[float, float, object]:
    started, cpu_started = time.perf_counter(), time.process_time()
    result = run_lab(requests, "fcfs", config, check=check)
    return time.process_time() - cpu_started, time.perf_counter() - started, result


def _line(label: str, cpu: float, wall: float, result, target: str) -> str:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    simulated = result.steps[-1].start_time + result.steps[-1].duration if result.steps else 0.0
    steps = result.run.num_steps
    return (f"{label}: {steps:,} steps ({simulated:,.0f} s simulated) in {cpu:.1f} s CPU, {wall:.1f} s wall "
            f"(load average {os.getloadavg()[0]:.1f}) = {steps / cpu:,.0f} steps per CPU second; "
            f"{result.run.num_steps_checked:,} steps checked, {len(result.run.violations)} violations; "
            f"peak RSS so far {peak:,.0f} MiB; {target}")


@contextlib.contextmanager
def _without_unchecked(name: str):
    from schedspec.reference import scheduler as registry

    entry = registry.REGISTRY[name]
    registry.REGISTRY[name] = attrs.evolve(entry, unchecked=None)
    try:
        yield
    finally:
        registry.REGISTRY[name] = entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--prefix-requests", type=int, default=2000)
    parser.add_argument("--only", choices=["on", "off", "off-plain", "prefix"], default=None)
    args = parser.parse_args()
    trace = trace_formats.load_trace(trace_formats.default_trace_path())
    requests = windows.select_window(trace, max_requests=args.max_requests)
    kwargs, _ = cost_model.default_scheduler_config()
    config = SchedulerConfig(**kwargs)
    print(f"conditions: {len(requests):,} requests of the Azure conv trace; fcfs; {config}; "
          f"cost profile {cost_model.DEFAULT_PROFILE}; python {platform.python_version()}; "
          f"{os.cpu_count()} cpus; {platform.processor() or platform.machine()}; "
          f"load average {os.getloadavg()[0]:.1f} at start; CPU = this process's user + system seconds")
    modes = [args.only] if args.only else ["off", "off-plain", "on", "prefix"]
    for mode in (m for m in modes if m != "prefix"):
        check = mode == "on"
        if mode == "off-plain":  # the registry's fcfs without its unchecked implementation
            with _without_unchecked("fcfs"):
                cpu, wall, result = _run(requests, config, False)
        else:
            cpu, wall, result = _run(requests, config, check)
        target = TARGET_CPU_S[check]
        met = ("met" if cpu < target else "not met") if args.max_requests is None else \
            "not judged (the target is for the full hour; --max-requests cut it)"
        print(_line(f"{mode:>9}", cpu, wall, result, f"target < {target:.0f} s CPU: {met}"), flush=True)
    if "prefix" in modes:
        window = windows.select_window(trace, max_requests=args.prefix_requests)
        without_cpu, wall, result = _run(window, config, True)
        print(_line(f"prefix pair ({len(window):,} requests), caching off", without_cpu, wall, result, "peer"),
              flush=True)
        cached = config.with_changes(enable_prefix_caching=True)
        with_cpu, wall, result = _run(window, cached, True)
        ratio = with_cpu / without_cpu
        met = "met" if ratio <= TARGET_PREFIX_RATIO else "not met"
        print(_line(f"prefix pair ({len(window):,} requests), caching on ", with_cpu, wall, result,
                    f"{ratio:.2f}x the run without; target <= {TARGET_PREFIX_RATIO}x: {met}"))


if __name__ == "__main__":
    main()
