"""SGLang 0.5.23's radix cache under the spec: the ``sglang`` adapter with prefix caching
(``prefix_cache_publication = "sglang-radix"``, docs/engines.md, *The radix cache*) on random scenarios,
every rule, invariant and engine-view comparison on every step.

The scenarios are ``schedspec diff``'s (:func:`schedspec.commands.diff.scenarios`, shared prefixes drawn
with caching on, moved by the ``sglang``/``sglang-profile`` pair's shapes), reproducible from ``--seed``.
The ``sglang-profile`` does not reproduce the radix cache yet, so this is not a diff: it counts the scenarios
SGLang runs to the end with no violation, those that stop at one (printed), and those the adapter refuses
(a chunked prefill with caching: its middle chunks reach the tree a step late, not mapped yet).

Run (SGLang's environment built)::

    SCHEDSPEC_SGLANG=1 nice -n 10 .venv/bin/python benchmarks/sglang_radix_campaign.py --examples 300 --seed 25
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=25)
    args = parser.parse_args()

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    from schedspec.commands import diff
    from schedspec.reference.scheduler import UnsupportedFeature

    changes = {"enable_prefix_caching": True, "prefix_cache_publication": "sglang-radix"}
    counts = {"passed": 0, "violation": 0, "documented": 0, "refused": 0, "steps": 0, "hits": 0, "deduplicated": 0}
    finding = diff.pair_profile("sglang", "sglang-profile").finding  # the documented findings (clipped max_tokens)
    failures: list[str] = []
    started, load = time.perf_counter(), os.getloadavg()

    @hypothesis_seed(args.seed)
    @settings(max_examples=args.examples, database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(diff.scenarios(changes, 0, diff.pair_profile("sglang", "sglang-profile")))
    def generate(scenario) -> None:
        config, requests, _ = scenario
        try:
            result, findings, _, records = diff._run("sglang", config, requests, diff.DEFAULT_MAX_STEPS,
                                                     finding=finding)
        except UnsupportedFeature as refused:
            counts["refused"] += 1
            if counts["refused"] <= 2:
                print("refused:", refused)
            return
        counts["steps"] += len(records)
        counts["hits"] += sum(bool(r.prefix_hit_blocks) for r in records)
        counts["deduplicated"] += sum(bool(r.blocks_deduplicated) for r in records)
        if findings and all(f.documented for f in findings):
            counts["documented"] += 1
        elif findings:
            counts["violation"] += 1
            failures.append(f"{config.to_dict()} {[r.request_id for r in requests]}: {[str(f) for f in findings]}")
        else:
            counts["passed"] += 1

    generate()
    wall = time.perf_counter() - started
    print(f"seed {args.seed}: {sum(counts[k] for k in ('passed', 'violation', 'documented', 'refused'))} scenarios: "
          f"{counts['passed']} passed every check, {counts['violation']} stopped at an unexplained violation, "
          f"{counts['documented']} at a documented finding (sglang-clips-max-tokens), "
          f"{counts['refused']} refused; {counts['steps']:,} steps checked, {counts['hits']} with a prefix hit, "
          f"{counts['deduplicated']} with a de-duplication")
    print(f"wall {wall:.0f} s; load average at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    for line in failures[:10]:
        print("VIOLATION", line)


if __name__ == "__main__":
    main()
