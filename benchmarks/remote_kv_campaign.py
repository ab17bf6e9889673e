"""A campaign over remote KV loads and sends (issue 27, requests that wait holding blocks): seeded random
configs and workloads in which about half the requests load part of their prompt remotely (landing 1 to 4
steps after the load starts, some failing from an invalid block), some send their KV when they finish, and some
are aborted soon after they arrive (so, at times, while they load). Each run is checked at every step by the
engine loop (rules and invariants; for fcfs also its promised properties), and its trace is checked again by
the full and the incremental checker. Prints the run conditions, then one line per failing seed and the
counts; exit 1 if any seed fails.

    nice -n 10 .venv/bin/python benchmarks/remote_kv_campaign.py --seeds 0:400
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

from schedspec.reference.engine import Engine
from schedspec.reference.scheduler import SCHEDULERS
from schedspec.spec.checker import check_trace
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.workload import RequestSpec

SCHEDULERS_RUN = ("fcfs", "static", "shortest-prompt-first", "vllm-v1", "vllm-v1@0.33")


def workload(rng: random.Random, count: int) -> list[RequestSpec]:
    """``count`` requests arriving over 15 steps (module docstring)."""
    requests = []
    for k in range(count):
        prompt = rng.randrange(1, 40)
        extra: dict = {}
        if rng.random() < 0.5:
            extra = {"num_external_computed_tokens": rng.randrange(1, prompt + 1), "kv_load_steps": rng.randrange(1, 5),
                     "kv_load_invalid_block": rng.choice([None, None, 0, 1, 2, 5])}
        if rng.random() < 0.3:
            extra.update(kv_send=True, kv_send_steps=rng.randrange(1, 4))
        arrival = rng.randrange(0, 15)
        if rng.random() < 0.2:
            extra["abort_at_step"] = arrival + rng.randrange(0, 5)
        requests.append(RequestSpec(f"r{k}", prompt, rng.randrange(1, 10), arrival_step=arrival, **extra))
    return requests


def run_seed(seed: int) -> list[str]:
    """The failures of one seed (empty: it passed)."""
    rng = random.Random(seed)
    config = SchedulerConfig(block_size=rng.choice([2, 4]), num_kv_blocks=rng.randrange(12, 40),
                             max_num_batched_tokens=rng.choice([8, 16, 32]), max_num_seqs=rng.randrange(1, 5),
                             max_model_len=64)
    requests = workload(rng, rng.randrange(1, 16))
    name = rng.choice(SCHEDULERS_RUN)
    failures = []
    result = Engine(SCHEDULERS[name](config), config).run(requests)
    promised = [v for v in result.violations if name == "fcfs" or v.kind != "property"]
    if promised:
        failures.append(f"{name}: {promised[0]}")
    for incremental in (False, True):
        report = check_trace(config, result.records, incremental=incremental)
        if report.first_bad_step is not None:
            failures.append(f"{name} check (incremental={incremental}): {report.violations[0]}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0:400", help="FIRST:LAST (half-open)")
    args = parser.parse_args()
    first, last = (int(x) for x in args.seeds.split(":"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    print(f"# {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"Python {platform.python_version()}, schedspec {commit}")
    started = time.perf_counter()
    failed = 0
    for seed in range(first, last):
        for failure in run_seed(seed):
            failed += 1
            print(f"seed {seed}: {failure}")
    print(f"{last - first} seeds, {failed} failures, {time.perf_counter() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
