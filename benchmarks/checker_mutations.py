"""Benchmark: the trace-mutation catalogue against both checkers, and the checkers' speed.

    .venv/bin/python benchmarks/checker_mutations.py [--scale 2] [--per-trace 10] [--seed 1] [--speed-only]

Part 1 applies every operator of ``schedspec.trace_mutations.MUTATIONS`` at up to ``--per-trace``
random applicable steps of each of the five standard trace windows (``standard_traces(scale)``: Azure
conversation and code, Mooncake conversation, Azure conversation under KV pressure with preemptions,
Azure code under static batching) and prints, per operator, the mutants, how many each checker
rejected at the step the fault first becomes observable (a non-semantic one: accepted), and the kill rate; non-semantic mutants must
be accepted (a rejection is a false alarm). Part 2 times ``check_trace`` (full and incremental) on the
lab's default window (Azure conversation, first 120 s, vLLM's defaults for Llama-3-8B on an A100)
beside the lab's own steps per second. Not part of the test suite; prints its run conditions.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import random
import time
from collections import defaultdict

from schedspec.lab import trace_formats, windows
from schedspec.lab.run import run_lab
from schedspec.reference import cost_model
from schedspec.spec.checker import check_trace
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.trace import StepRecord
from schedspec.trace_mutations import MUTATIONS, applicable_steps, mutate_and_judge, standard_traces


def conditions() -> str:
    load = os.getloadavg()
    return (f"python {platform.python_version()}; {os.cpu_count()} cpus; {platform.processor() or platform.machine()}; "
            f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


def catalogue(scale: int, per_trace: int, seed: int) -> bool:
    traces = standard_traces(scale)
    print(f"traces (scale {scale}): " + "; ".join(
        f"{label} {len(t.records)} steps, {sum(len(r['preempted']) for r in t.records)} preemptions"
        for label, t in traces))
    rng = random.Random(seed)
    rows: dict[str, list] = defaultdict(list)
    started = time.perf_counter()
    for mutation in MUTATIONS:
        for label, trace in traces:
            steps = applicable_steps(trace, mutation)
            for step in rng.sample(steps, min(per_trace, len(steps))):
                rows[mutation.name].append(mutate_and_judge(trace, label, mutation, step))
    print(f"judged in {time.perf_counter() - started:.0f} s; {conditions()}")
    print()
    print("| operator | models | semantic | mutants | judged as expected (full) | (incremental) | wrong |")
    print("|---|---|---|---|---|---|---|")
    total = correct = false_alarms = 0
    wrong = []
    for mutation in MUTATIONS:
        outcomes = rows[mutation.name]
        semantic = mutation.semantic
        full = sum(1 for o in outcomes if o.full == o.expected)
        inc = sum(1 for o in outcomes if o.incremental == o.expected)
        bad = [o for o in outcomes if not o.correct]
        wrong += bad
        total += len(outcomes)
        correct += len(outcomes) - len(bad)
        if not semantic:
            false_alarms += len(bad)
        label = "yes" if semantic else f"no: {mutation.why_not_semantic}"
        print(f"| `{mutation.name}` | {mutation.models} | {label} | {len(outcomes)} | {full} | {inc} | {len(bad)} |")
    semantic_total = sum(len(rows[m.name]) for m in MUTATIONS if m.semantic)
    semantic_killed = sum(1 for m in MUTATIONS if m.semantic for o in rows[m.name] if o.correct)
    print()
    print(f"semantic mutants: {semantic_total}, killed at their step by both checkers: {semantic_killed} "
          f"({100 * semantic_killed / max(semantic_total, 1):.1f} %); non-semantic mutants: "
          f"{total - semantic_total}, false alarms: {false_alarms}; unmutated traces: "
          f"{'all pass' if all(check_trace(t.config, [StepRecord.from_dict(r) for r in t.records]).ok for _, t in traces) else 'FAIL'}")
    for outcome in wrong[:20]:
        print(f"WRONG {outcome}")
    return not wrong


def speed() -> None:
    requests = windows.select_window(trace_formats.load_trace(trace_formats.default_trace_path()), duration=120.0)
    kwargs, _ = cost_model.default_scheduler_config()
    config = SchedulerConfig(**kwargs)
    out = io.StringIO()
    started = time.perf_counter()
    run_lab(requests, "fcfs", config, steps_out=out)
    lab_seconds = time.perf_counter() - started
    records = [StepRecord.from_json(line) for line in out.getvalue().splitlines()]
    widest = max(len(r.scheduled) for r in records)
    print(f"\nspeed: {len(records):,} steps of the lab's default window (Azure conv, 120 s, {len(requests)} requests, "
          f"up to {widest} scheduled requests per step); {config}; {conditions()}")
    print(f"  lab (fcfs, incremental checks on): {len(records) / lab_seconds:,.0f} steps/s")
    for incremental in (False, True):
        started = time.process_time()
        report = check_trace(config, records, incremental=incremental)
        cpu = time.process_time() - started
        print(f"  check_trace ({'incremental' if incremental else 'full'}): {len(records) / cpu:,.0f} steps/s "
              f"of CPU time, verdict {'legal' if report.ok else 'ILLEGAL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=2)
    parser.add_argument("--per-trace", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--speed-only", action="store_true")
    args = parser.parse_args()
    ok = True
    if not args.speed_only:
        ok = catalogue(args.scale, args.per_trace, args.seed)
    speed()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
