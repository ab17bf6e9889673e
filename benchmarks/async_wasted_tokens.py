"""Wasted tokens of asynchronous scheduling (issue 24, steps in flight): the same workload run by schedulers that
plan step n + 1 while step n is in flight, every step checked against the spec with a step in flight, and the
tokens each computed for requests that had already ended (``RunResult.num_wasted_tokens``) printed beside all
the tokens it computed. The run conditions are printed first (machine, load, Python, schedspec commit).

    nice -n 10 .venv/bin/python benchmarks/async_wasted_tokens.py --requests 200 --seed 11

The workload: ``--requests`` requests arriving over ``2 * requests`` steps, prompts of 16 to 600 tokens,
``max_tokens`` 8 to 200; every second request samples its end-of-sequence token before ``max_tokens`` (a stop
the planner cannot foresee) and every tenth is aborted 5 to 80 steps after it arrives. Schedulers:
``schedspec.reference.in_flight``'s fcfs planned over placeholders, and vLLM's ``AsyncScheduler``
(``vllm-async``, ``vllm-async@0.33``) where its environment is installed. Exit 1 if a run breaks the spec.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import time
from pathlib import Path

from schedspec.reference.engine import Engine
from schedspec.reference.in_flight import fcfs_async
from schedspec.reference.scheduler import UnsupportedFeature, make_scheduler
from schedspec.spec import SchedulerConfig
from schedspec.spec.workload import RequestSpec

CONFIG = SchedulerConfig(block_size=16, num_kv_blocks=400, max_num_batched_tokens=512, max_num_seqs=16,
                         max_model_len=2048)


def workload(requests: int, seed: int) -> list[RequestSpec]:
    """The module docstring's workload."""
    rng = random.Random(seed)
    out = []
    for k in range(requests):
        arrival = rng.randrange(0, 2 * requests)
        max_tokens = rng.randrange(8, 200)
        out.append(RequestSpec(f"r{k:04d}", rng.randrange(16, 600), max_tokens, arrival_step=arrival,
                               eos_at_output=rng.randrange(1, max_tokens) if k % 2 == 0 else None,
                               abort_at_step=arrival + rng.randrange(5, 80) if k % 10 == 3 else None))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"python {platform.python_version()}, schedspec commit {commit}; config {CONFIG.to_dict()}")
    specs = workload(args.requests, args.seed)
    failed = False
    for name in ("fcfs planned in flight (schedspec.reference.in_flight)", "vllm-async", "vllm-async@0.33"):
        try:
            scheduler = fcfs_async(CONFIG) if name.startswith("fcfs") else make_scheduler(name, CONFIG)
        except UnsupportedFeature as error:  # the engine is not installed
            print(f"{name}: not run ({error})")
            continue
        started = time.monotonic()
        result = Engine(scheduler, CONFIG, record_steps=True).run(specs)
        computed = sum(s.prefill_tokens + s.decode_tokens for record in result.records for s in record.scheduled)
        wasted_steps = sum(1 for record in result.records if record.wasted_tokens)
        engine = getattr(scheduler, "engine", None)
        print(f"{name}{f' {engine}' if engine else ''}: spec {'kept' if result.ok else 'BROKEN'}, "
              f"{result.num_steps:,} steps, {computed:,} tokens computed, {result.num_wasted_tokens:,} wasted "
              f"({100 * result.num_wasted_tokens / max(computed, 1):.2f} %) in {wasted_steps:,} steps; "
              f"wall {time.monotonic() - started:.1f} s")
        failed |= not result.ok
        getattr(scheduler, "close", lambda: None)()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
