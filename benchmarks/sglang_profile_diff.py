"""``schedspec diff --scheduler sglang --against sglang-profile`` at scale (issue 25: 10,000 scenarios), with
what the scenarios exercised: how many had a retraction, a chunked prefill, a request SGLang ended at its
clipped ``max_new_tokens`` (the documented finding), a priority preemption and one that took more requests
than it needed (``sglang_profile.ExcessPreemption``), as the profile ran them. ``--scheduler sglang-priority
--against sglang-profile-priority`` compares SGLang's priority scheduling.

Run (SGLang's environment built: ``bash scripts/engines_setup.sh --only sglang``, which ``scripts/test.sh`` runs)::

    nice -n 10 .venv/bin/python benchmarks/sglang_profile_diff.py --examples 10000 --seed 25
    nice -n 10 .venv/bin/python benchmarks/sglang_profile_diff.py --examples 10000 --seed 25 \
        --scheduler sglang-priority --against sglang-profile-priority
    # retractions (the generated scenarios almost never make SGLang retract: 1 of 10,000): one-token pages, a small pool
    nice -n 10 .venv/bin/python benchmarks/sglang_profile_diff.py --examples 500 --seed 25 --set block_size=1 \
        --set num_kv_blocks=48 --set max_num_seqs=8 --set max_num_batched_tokens=64 --set max_model_len=64

Prints the diff's own summary line, the counts, wall and CPU seconds (this process; the SGLang worker's CPU
from ``/proc``) and the load average, so that the run conditions go with the numbers.
"""

from __future__ import annotations

import argparse
import os
import resource
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--scheduler", default="sglang", help="the SGLang adapter (sglang, sglang-priority)")
    parser.add_argument("--against", default="sglang-profile", help="its profile (sglang-profile-priority)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="fix a SchedulerConfig field in every scenario, as schedspec diff --set")
    args = parser.parse_args()

    from schedspec.cli_common import parse_sets
    from schedspec.commands import diff
    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import make_scheduler

    seen: list[tuple] = []
    original = diff.compare

    def recording(config, requests, *rest, **options):
        result = original(config, requests, *rest, **options)
        seen.append((config, requests, result))
        return result

    diff.compare = recording
    started, load = time.perf_counter(), os.getloadavg()
    lines: list[str] = []
    report = diff.run_diff(args.scheduler, args.against, args.examples, args.seed, parse_sets(tuple(args.sets)), None,
                           echo=lines.append)
    wall = time.perf_counter() - started
    diff.compare = original

    retracted = chunked = clipped = preempted_for = excess = 0
    for config, requests, result in seen[:report.examples]:  # the shrinking's reruns come after, if any
        profile = make_scheduler(args.against, config)
        run = Engine(profile, config, properties=()).run(requests, mode="steps", max_steps=diff.DEFAULT_MAX_STEPS)
        # a preemption in a prefill step is PrefillAdder.preempt_to_schedule's (priority), in a decode step
        # retract_decode's (or a priority preemption that admitted nothing)
        prefill = [any(item.prefill_tokens for item in record.scheduled) for record in run.records]
        retracted += any(record.preempted and not p for record, p in zip(run.records, prefill, strict=True))
        preempted_for += any(record.preempted and p for record, p in zip(run.records, prefill, strict=True))
        excess += bool(getattr(profile, "excess_preemptions", ()))
        chunked += any(item.num_computed_tokens and item.prefill_tokens for record in run.records
                       for item in record.scheduled)
        clipped += any(finding.documented for finding in result.findings)
    worker = _worker_cpu_seconds()
    print(f"{report.examples:,} examples, {report.steps_compared:,} steps compared, {report.divergent} divergent "
          f"(unexplained), {report.documented} documented, {len(report.findings)} findings, "
          f"{len(report.unsupported)} unsupported")
    print(f"scenarios with a retraction: {retracted}, with a chunk after the first: {chunked}, "
          f"stopped at a clipped max_new_tokens: {clipped}; with a priority preemption: {preempted_for}, "
          f"one that took more than it needed (sglang_profile.ExcessPreemption): {excess}")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"wall {wall:.0f} s; CPU of this process {usage.ru_utime + usage.ru_stime:.0f} s; SGLang worker CPU "
          f"{worker if worker is not None else 'unknown'} s; load average at start {load[0]:.1f}, at end "
          f"{os.getloadavg()[0]:.1f}")
    for line in lines:
        if "DIVERGENCE" in line or "FINDING" in line:
            print(line)


def _worker_cpu_seconds() -> float | None:
    """CPU seconds of the SGLang worker process (``/proc/PID/stat``), while it is still alive."""
    from schedspec.engines import vllm

    ticks = os.sysconf("SC_CLK_TCK")
    for worker in vllm._WORKERS.values():
        pid = getattr(getattr(worker, "process", None), "pid", None)
        if pid is None:
            continue
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        return round((int(fields[11]) + int(fields[12])) / ticks, 1)
    return None


if __name__ == "__main__":
    main()
