"""Benchmark: input size (issue 28). Each part runs in its own process, so that its peak memory is its own;
each prints its run conditions and its target beside its figure.

    .venv/bin/python benchmarks/size.py [--part replay|check|mooncake|burstgpt] [--requests N] [--steps N] [--no-fast-path]

- ``replay``: ``schedspec replay`` of a generated scenario of ``--requests`` requests (default 100,000),
  ten arrivals per step over 10,000 steps, every check on. Target: under a minute. Also, side by side,
  a burst (``--burst N`` requests all arriving at step 0, default 6,000): before the fix ``add_request``
  copied the live map per arrival (O(n^2)); a burst's steps still cost O(live requests) each.
- ``check``: ``schedspec check`` of a generated correct trace of ``--steps`` steps (default 10^6, one
  request every two steps), and of a tenth and a hundredth of it, side by side: peak RSS of each
  (``ru_maxrss``). Target: bounded memory (the larger traces' peaks no larger than the smallest's: the
  plain path forgets ended requests, ``Stepper.forget_ended``; the fast path, ``spec/fast_check.py``, keeps
  only live requests and the ids ever added as ``EndedIds``). ``--no-fast-path``: the plain path only.
- ``mooncake``: ``schedspec lab`` on the whole Mooncake conversation trace (12,031 requests, ``--max-requests``
  all of them: lab's default window is the first 120 s), checks on: time and peak RSS.
- ``burstgpt``: a BurstGPT-format file of 10^6 generated rows: loading it (time, peak RSS), then ``lab``
  on its first ``--burstgpt-requests`` requests (default 20,000), checks on.

CPU seconds (``process_time`` of the part) are printed beside wall seconds: on a shared machine the wall
time depends on the other processes (the load average is printed). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MOONCAKE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
CONFIG = {"block_size": 16, "num_kv_blocks": 4096, "max_num_batched_tokens": 2048, "max_num_seqs": 128,
          "max_model_len": 256}


def conditions() -> str:
    return (f"python {platform.python_version()}; {os.cpu_count()} cpus; "
            f"{platform.processor() or platform.machine()}; load average {os.getloadavg()[0]:.1f}")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cli(*args: str) -> tuple[int, str]:
    """Run ``schedspec ARGS`` in this process; (exit status, standard output)."""
    from click.testing import CliRunner

    from schedspec.cli import cli as schedspec

    result = CliRunner().invoke(schedspec, list(args), prog_name="schedspec")
    return result.exit_code, result.stdout


def timed(label: str, target: str, function) -> None:
    started, cpu = time.perf_counter(), time.process_time()
    detail = function()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(f"  {label}: {wall:.1f} s wall, {cpu:.1f} s CPU, peak RSS {peak_mib():,.0f} MiB; {detail}"
          f"  [target: {target}]", flush=True)


def scenario_file(folder: Path, n: int, burst: bool) -> Path:
    requests = [{"id": f"r{i}", "arrival_step": 0 if burst else (i * 10_000) // n,
                 "prompt_len": 16 + i % 48, "max_tokens": 4 + i % 13} for i in range(n)]
    path = folder / f"scenario-{n}{'-burst' if burst else ''}.json"
    path.write_text(json.dumps({"name": path.stem, "config": CONFIG, "requests": requests, "max_steps": 100_000}))
    return path


def part_replay(args: argparse.Namespace, folder: Path) -> None:
    for n, burst in ((args.requests, False), (args.burst, True)):
        path = scenario_file(folder, n, burst)
        shape = "all at step 0" if burst else f"{n / 10_000:g} arrivals per step over 10,000 steps"
        print(f"replay: {n:,} requests, {shape}; fcfs; {CONFIG}; every rule, invariant and guaranteed property "
              f"checked at every step; {conditions()}")

        def run(path=path):
            status, out = cli("replay", "-q", str(path))
            return f"exit {status}; " + " ".join(line.strip() for line in out.splitlines()[-2:])

        timed("replay", "under 60 s" if not burst else "peer of the spread scenario (no target)", run)


def trace_file(path: Path, steps: int) -> None:
    """A correct step trace (``schedspec.trace_mutations.long_trace``): request k arrives at step 2k
    (prompt 3, max_tokens 2), prefills, decodes, ends."""
    from schedspec.trace_mutations import LONG_TRACE_CONFIG, long_trace

    with path.open("w") as out:
        out.write(json.dumps({"schema_version": 2, "config": LONG_TRACE_CONFIG, "scheduler": "fcfs"}) + "\n")
        for record in long_trace(steps):
            out.write(json.dumps(record, separators=(",", ":")) + "\n")


def part_check(args: argparse.Namespace, folder: Path) -> None:
    steps = args.steps
    path = folder / f"trace-{steps}.jsonl"
    trace_file(path, steps)
    print(f"check: a correct trace of {steps:,} steps ({path.stat().st_size / 2**20:,.0f} MiB, "
          f"{steps // 2:,} requests); default properties; {'plain path only' if args.no_fast_path else 'fast path'}; "
          f"{conditions()}")

    def run():
        status, out = cli("check", str(path), *(["--no-fast-path"] if args.no_fast_path else []))
        return f"exit {status}; " + " ".join(line.strip() for line in out.splitlines()[-2:])[:200]

    timed(f"check {steps:,} steps", "bounded memory: peak RSS no larger than the smaller traces'", run)
    path.unlink()


def ends(figures: dict) -> str:
    """How the requests of a lab run ended (every one finished, aborted or rejected, or still live at the end)."""
    return ", ".join(f"{figures.get(f'requests_{key}', '?'):,} {key}" for key in ("total", "finished", "aborted",
                                                                                 "rejected", "live"))


def part_mooncake(args: argparse.Namespace, folder: Path) -> None:
    print(f"lab: the whole Mooncake conversation trace ({MOONCAKE}); fcfs; checks on; {conditions()}")

    from schedspec.lab import trace_formats

    count = len(trace_formats.load_trace(MOONCAKE))

    def run():  # every request (lab's default window is the first 120 s)
        status, out = cli("lab", "--trace", str(MOONCAKE), "--max-requests", str(count), "--json")
        figures = json.loads(out)["figures"] if status == 0 else {}
        return f"exit {status}; {ends(figures)}"

    timed("lab on the Mooncake trace", "memory stated (no target)", run)


def part_burstgpt(args: argparse.Namespace, folder: Path) -> None:
    from schedspec.lab import trace_formats

    path = folder / "BurstGPT_synthetic.csv"
    rng = random.Random(1)
    with path.open("w") as out:
        out.write("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n")
        stamp = 0.0
        for _ in range(1_000_000):
            stamp += rng.expovariate(2.0)
            prompt, response = rng.randint(1, 2000), rng.randint(0, 500)
            out.write(f"{stamp:.3f},ChatGPT,{prompt},{response},{prompt + response},Conversation log\n")
    print(f"burstgpt: a BurstGPT-format file of 1,000,000 generated rows ({path.stat().st_size / 2**20:,.0f} MiB, "
          f"2 requests/s); {conditions()}")
    timed("load 10^6 rows", "memory stated (no target)", lambda: f"{len(trace_formats.load_trace(path)):,} requests")

    def run():
        status, out = cli("lab", "--trace", str(path), "--max-requests", str(args.burstgpt_requests), "--json")
        figures = json.loads(out)["figures"] if status == 0 else {}
        return f"exit {status}; {ends(figures)}"

    timed(f"lab on its first {args.burstgpt_requests:,} requests", "memory stated (no target)", run)


PARTS = {"replay": part_replay, "check": part_check, "mooncake": part_mooncake, "burstgpt": part_burstgpt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=sorted(PARTS), action="append")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--burst", type=int, default=6_000)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--burstgpt-requests", type=int, default=20_000)
    parser.add_argument("--no-fast-path", action="store_true", help="check: judge with the plain path only")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    parts = args.part or ["replay", "check", "mooncake", "burstgpt"]
    if args.child:
        with tempfile.TemporaryDirectory() as folder:
            PARTS[parts[0]](args, Path(folder))
        return
    forwarded = [f"--requests={args.requests}", f"--burst={args.burst}",
                 f"--burstgpt-requests={args.burstgpt_requests}", *(["--no-fast-path"] if args.no_fast_path else [])]
    for part in parts:
        runs = [args.steps // 100, args.steps // 10, args.steps] if part == "check" else [args.steps]
        for steps in runs:  # one process per figure: its peak RSS is its own
            subprocess.run([sys.executable, __file__, "--child", "--part", part, f"--steps={steps}", *forwarded],
                           check=False)


if __name__ == "__main__":
    main()
