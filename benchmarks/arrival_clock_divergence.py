"""How often do two schedulers diverge on ``schedspec diff``'s scenarios, with real arrival clocks and without?

Issue 24: scenario requests used to reach every scheduler with ``arrival_time = 0.0``, so vLLM's priority
order ``(priority, arrival_time, request_id)`` (``vllm/v1/request.py`` ``Request.__lt__``) fell back to
the request id, and the ``vllm`` adapters and the ``vllm-v1`` profiles agreed on a clock no engine has.
The engine loop now stamps each arrival with its time on the simulated clock
(:class:`schedspec.spec.workload.ArrivalClock`). This benchmark draws scenarios with ``schedspec diff``'s
strategy (:func:`schedspec.commands.diff.scenarios`, seeded: ids in random order, priorities often equal)
and compares, on each, every ``--pair`` ``SCHEDULER:AGAINST`` with :func:`schedspec.commands.diff.compare`
(every step checked against the spec) under each of the ``--clocks``:

- ``zero``: every arrival at 0 s on both sides (the behaviour before the fix, reproduced by replacing
  ``ArrivalClock.stamped`` for the run): what the profile was validated on;
- ``against-zero``: ``SCHEDULER`` (the engine, as a whole engine stamps arrivals) on the clock,
  ``AGAINST`` (the profile, as validated before the fix) at 0 s: how far apart the two really were;
- ``clock``: both on the engine loop's clock (after the fix).

Unlike ``schedspec diff`` it does not shrink divergences (that would dominate the cost); it counts them.

    SCHEDSPEC_VLLM_PYTHON=/work/main/.venv-vllm/bin/python .venv/bin/python \\
        benchmarks/arrival_clock_divergence.py --examples 2000 --seed 24 \\
        --pair vllm-priority:vllm-v1-priority --clocks zero,against-zero,clock

Prints the run conditions, then one line per pair and clock: examples compared, steps compared,
divergent (unexplained), documented differences (docs/engines.md), findings, unsupported; and the first
few divergent examples (``--show``). ``--progress N`` prints the counts every N examples.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
from collections import Counter

import attrs
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from schedspec.commands import diff
from schedspec.commands.diff import compare, scenarios
from schedspec.reference.scheduler import UnsupportedFeature
from schedspec.spec import workload

CLOCKS = ("zero", "against-zero", "clock")


@contextlib.contextmanager
def _arrivals_at_zero():
    """Every arrival at 0 s for the duration (the engine loop's behaviour before issue 24)."""
    original = workload.ArrivalClock.stamped
    workload.ArrivalClock.stamped = lambda self, spec, now: (
        spec if spec.arrival_time == 0.0 else attrs.evolve(spec, arrival_time=0.0))
    try:
        yield
    finally:
        workload.ArrivalClock.stamped = original


@contextlib.contextmanager
def _clock(mode: str, against: str):
    """The arrival clocks of ``mode`` (module docstring) for the runs of one comparison."""
    if mode == "zero":
        with _arrivals_at_zero():
            yield
        return
    if mode == "clock":
        yield
        return
    original = diff._run

    def run(name, *args, **kwargs):
        with _arrivals_at_zero() if name == against else contextlib.nullcontext():
            return original(name, *args, **kwargs)

    diff._run = run
    try:
        yield
    finally:
        diff._run = original


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--pair", action="append", default=[], metavar="SCHEDULER:AGAINST",
                        help="a pair to compare (repeatable; default vllm-priority:vllm-v1-priority)")
    parser.add_argument("--clocks", default=",".join(CLOCKS), help=f"comma-separated, of {', '.join(CLOCKS)}")
    parser.add_argument("--show", type=int, default=3, help="divergent examples printed per pair and clock")
    parser.add_argument("--progress", type=int, default=0, help="print the counts every N examples")
    args = parser.parse_args()
    pairs = [tuple(p.split(":", 1)) for p in (args.pair or ["vllm-priority:vllm-v1-priority"])]
    clocks = [c for c in args.clocks.split(",") if c]
    if not clocks or any(c not in CLOCKS for c in clocks):
        parser.error(f"--clocks {args.clocks!r}: each must be one of {', '.join(CLOCKS)}")
    counts = {(pair, clock): Counter() for pair in pairs for clock in clocks}
    shown = Counter()
    started = time.perf_counter()
    print(f"conditions: python {platform.python_version()}, {os.cpu_count()} CPUs (shared), load average "
          f"{os.getloadavg()[0]:.1f} at start, seed {args.seed}, {args.examples} examples, pairs {pairs}, "
          f"clocks {clocks}", flush=True)

    def report(final: bool) -> None:
        elapsed = time.perf_counter() - started
        print(f"-- after {counts[(pairs[0], clocks[0])]['examples']} examples, {elapsed:.0f} s wall"
              + (" (final)" if final else ""), flush=True)
        for (pair, clock), c in counts.items():
            print(f"{pair[0]} vs {pair[1]}, arrival times {clock}: {c['examples']} examples, {c['steps']} steps, "
                  f"{c['divergent']} divergent (unexplained), {c['documented']} documented, "
                  f"{c['findings']} findings, {c['unsupported']} unsupported", flush=True)

    @hypothesis_seed(args.seed)
    @settings(max_examples=args.examples, database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(scenarios({}))
    def run(scenario) -> None:
        config, requests = scenario
        for pair in pairs:
            for clock in clocks:
                c = counts[(pair, clock)]
                c["examples"] += 1
                with _clock(clock, pair[1]):
                    try:
                        result = compare(config, requests, pair[0], pair[1])
                    except UnsupportedFeature:
                        c["unsupported"] += 1
                        continue
                c["steps"] += result.steps_compared
                undocumented = [f for f in result.findings if f.documented is None]
                c["findings"] += bool(undocumented)
                divergence = result.divergence
                if divergence is not None and divergence.documented is None:
                    c["divergent"] += 1
                    if shown[(pair, clock)] < args.show:
                        shown[(pair, clock)] += 1
                        print(f"[{pair[0]} vs {pair[1]}, {clock}] example {c['examples'] - 1}: {divergence}\n"
                              f"   config {config.to_dict()}\n   requests {[r.to_dict() for r in requests]}",
                              flush=True)
                elif (divergence is not None and divergence.documented) or any(f.documented for f in result.findings):
                    c["documented"] += 1
        if args.progress and counts[(pairs[0], clocks[0])]["examples"] % args.progress == 0:
            report(False)

    run()
    report(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
