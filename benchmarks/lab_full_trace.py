"""Benchmark: replay the full one-hour Azure conversation trace (19,366 requests) through fcfs, with
the spec checks on and off, side by side; print simulated steps per wall second and peak memory.

    .venv/bin/python benchmarks/lab_full_trace.py [--max-requests N] [--only on|off|off-plain]

``off`` runs fcfs as ``fcfs-fast`` (the lab's unchecked path), ``off-plain`` runs the plain fcfs policy
unchecked (what the lab would run without ``fcfs-fast``) and ``on`` the checked path, in the same run, so
that what ``fcfs-fast`` buys is measured beside the paths it would be replaced by.

Targets (issue 3): the full hour under 60 s with checking off, under 5 minutes with checking on, on
a 2-core machine. Not part of the test suite.
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
    parser.add_argument("--only", choices=["on", "off", "off-plain"], default=None)
    args = parser.parse_args()
    requests = windows.select_window(trace_formats.load_trace(trace_formats.default_trace_path()),
                                       max_requests=args.max_requests)
    kwargs, _ = cost_model.default_scheduler_config()
    config = SchedulerConfig(**kwargs)
    print(f"conditions: {len(requests):,} requests of the Azure conv trace; fcfs; {config}; "
          f"cost profile {cost_model.DEFAULT_PROFILE}; python {platform.python_version()}; "
          f"{os.cpu_count()} cpus; {platform.processor() or platform.machine()}")
    for mode in ([args.only] if args.only else ["off", "off-plain", "on"]):
        check = mode == "on"
        started, cpu_started = time.perf_counter(), time.process_time()
        if mode == "off-plain":  # the registry's fcfs without its unchecked implementation
            with _without_unchecked("fcfs"):
                result = run_lab(requests, "fcfs", config, check=False)
        else:
            result = run_lab(requests, "fcfs", config, check=check)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        simulated = result.steps[-1].start_time + result.steps[-1].duration if result.steps else 0.0
        print(f"{mode:>9}: {result.run.num_steps:,} steps ({simulated:,.0f} s simulated) "
              f"in {wall:.1f} s wall ({cpu:.1f} s CPU; load average {os.getloadavg()[0]:.1f}) = "
              f"{result.run.num_steps / wall:,.0f} steps/s; "
              f"{result.run.num_steps_checked:,} steps checked, {len(result.run.violations)} violations; "
              f"peak RSS so far {peak:,.0f} MiB")


if __name__ == "__main__":
    main()
