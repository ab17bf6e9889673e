"""``schedspec diff --scheduler vllm --against vllm-v1 --set num_speculative_tokens=K`` at benchmark size (issue
23: 10,000 scenarios), with the run conditions printed first (machine, load, Python, schedspec commit, the vLLM
version the worker imported) and the counts last: examples, steps compared, unexplained divergences,
documented differences (each kind), findings (each kind), wall time. Nothing is timed per example; the
wall time is the run's.

    SCHEDSPEC_VLLM_PYTHON=.venv-vllm/bin/python nice -n 10 .venv/bin/python benchmarks/vllm_speculative_diff.py \\
        --examples 10000 --seed 23 --speculative-tokens 3

Exit 1 if any unexplained divergence or a finding other than vLLM's padding/threshold crash
(docs/findings/vllm-spec-padding-threshold-crash.md) was seen.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from schedspec.commands.diff import run_diff
from schedspec.reference.scheduler import make_scheduler
from schedspec.spec import SchedulerConfig


def conditions(scheduler: str) -> list[str]:
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    probe = make_scheduler(scheduler, SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16,
                                                      max_num_seqs=2, max_model_len=16, num_speculative_tokens=1))
    engine = getattr(probe, "engine", {})
    getattr(probe, "close", lambda: None)()
    return [
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, {platform.platform()}",
        f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"python {platform.python_version()}, schedspec commit {commit}, engine {engine}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", default="vllm")
    parser.add_argument("--against", default="vllm-v1")
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--speculative-tokens", type=int, default=3)
    args = parser.parse_args()
    for line in conditions(args.scheduler):
        print(line, flush=True)
    lines: list[str] = []
    started = time.monotonic()
    report = run_diff(args.scheduler, args.against, args.examples, args.seed,
                      {"num_speculative_tokens": args.speculative_tokens}, None, echo=lines.append)
    wall = time.monotonic() - started
    documented = Counter(line.split("documented difference: ", 1)[1].split(": ", 1)[-1][:60]
                         for line in lines if "documented difference" in line)
    findings = Counter(f"{f.side} {f.name}" for _, f in report.findings)
    print(f"{args.scheduler} vs {args.against}, num_speculative_tokens={args.speculative_tokens}, seed {args.seed}: "
          f"{report.examples:,} examples, {report.steps_compared:,} steps compared, {report.divergent} divergent "
          f"(unexplained), {report.documented} documented, {len(report.findings)} findings, "
          f"{len(report.unsupported)} unsupported, {wall:,.0f} s wall")
    for kind, count in documented.most_common():
        print(f"  documented {count}: {kind}")
    for kind, count in findings.most_common():
        print(f"  finding {count}: {kind}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    known = all(f.side == args.scheduler and "AssertionError" in f.detail for _, f in report.findings)
    return 0 if report.divergent == 0 and known else 1


if __name__ == "__main__":
    sys.exit(main())
