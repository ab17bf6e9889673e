"""Does SGLang 0.5.23 retract a request without bound? The probes of docs/findings/sglang-clips-max-tokens.md
(*What it refutes*), run through the ``sglang`` adapter with every step checked by the spec.

Each probe first decays SGLang's ``new_token_ratio`` towards its floor with about 600 decode steps of long
requests arriving one after another (``L*``: 4-token prompts, one at a time), then sends a burst of
requests (``B*``) that SGLang's admission estimate over-admits, so ``ScheduleBatch.retract_decode`` runs.
Prints, per probe: the steps checked, the violations (first three), the retractions in all and the most
retractions of one request. Too long for CI (about a minute per probe on the shared 2-core machine).

    .venv/bin/python benchmarks/sglang_retraction_probe.py
"""

from __future__ import annotations

import time
from collections import Counter

from schedspec.reference.engine import Engine
from schedspec.reference.scheduler import make_scheduler
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.workload import RequestSpec

PROBES = {
    # name: (burst size, burst prompt, burst max_tokens, pages of 4, max_num_seqs, long requests, long max_tokens)
    "8x(8+100) in 64 pages": (8, 8, 100, 64, 8, 3, 200),
    "16x(8+200) in 64 pages": (16, 8, 200, 64, 16, 4, 150),
    "32x(4+120) in 64 pages": (32, 4, 120, 64, 32, 4, 150),
}


def main() -> None:
    for name, (burst, prompt, outputs, pages, seqs, longs, long_outputs) in PROBES.items():
        config = SchedulerConfig(4, pages, 256, seqs, 1024)
        specs = [RequestSpec(f"L{i}", 4, long_outputs, i * (long_outputs + 1)) for i in range(longs)]
        arrival = longs * (long_outputs + 1) + 10
        specs += [RequestSpec(f"B{i}", prompt, outputs, arrival) for i in range(burst)]
        started = time.perf_counter()
        result = Engine(make_scheduler("sglang", config), config).run(specs, max_steps=20_000)
        retracted = Counter(r for record in result.records for r in record.preempted)
        print(f"{name}: {result.num_steps_checked} steps checked in {time.perf_counter() - started:.0f} s, "
              f"{len(result.violations)} violations {[str(v) for v in result.violations[:3]]}, "
              f"{sum(retracted.values())} retractions, most of one request "
              f"{max(retracted.values(), default=0)}")


if __name__ == "__main__":
    main()
