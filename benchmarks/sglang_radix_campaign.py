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
    parser.add_argument("--shape", choices=("diff", "prefix", "retraction"), default="diff",
                        help="diff: schedspec diff's scenarios; prefix: prefix-heavy ones (prefix_scenarios); "
                             "retraction: two bursts of identical requests that SGLang retracts (retraction_scenarios)")
    args = parser.parse_args()

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    from schedspec.commands import diff
    from schedspec.reference.scheduler import UnsupportedFeature

    changes = {"enable_prefix_caching": True, "prefix_cache_publication": "sglang-radix"}
    counts = {"passed": 0, "violation": 0, "documented": 0, "refused": 0, "steps": 0, "hits": 0, "deduplicated": 0,
              "preempted": 0}
    finding = diff.pair_profile("sglang", "sglang-profile").finding  # the documented findings (clipped max_tokens)
    failures: list[str] = []
    started, load = time.perf_counter(), os.getloadavg()

    max_steps = 20_000 if args.shape == "retraction" else diff.DEFAULT_MAX_STEPS

    def examine(config, requests) -> None:
        try:
            _, findings, _, records = diff._run("sglang", config, requests, max_steps, finding=finding)
        except UnsupportedFeature as refused:
            counts["refused"] += 1
            if counts["refused"] <= 2:
                print("refused:", refused)
            return
        counts["steps"] += len(records)
        counts["hits"] += sum(bool(r.prefix_hit_blocks) for r in records)
        counts["deduplicated"] += sum(bool(r.blocks_deduplicated) for r in records)
        counts["preempted"] += sum(bool(r.preempted) for r in records)
        if findings and all(f.documented for f in findings):
            counts["documented"] += 1
        elif findings:
            counts["violation"] += 1
            failures.append(f"{config.to_dict()} {[(r.request_id, r.prompt_len, r.max_tokens, r.arrival_step, r.prefix_group, r.prefix_len) for r in requests]}: {[str(f) for f in findings]}")
        else:
            counts["passed"] += 1

    @hypothesis_seed(args.seed)
    @settings(max_examples=args.examples, database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(diff.scenarios(changes, 0, diff.pair_profile("sglang", "sglang-profile")))
    def generate(scenario) -> None:
        examine(*scenario[:2])

    if args.shape in ("prefix", "retraction"):
        made = prefix_scenarios(args.examples, args.seed) if args.shape == "prefix" else retraction_scenarios()
        for config, requests in made:
            examine(config, requests)
    else:
        generate()
    wall = time.perf_counter() - started
    total = sum(counts[k] for k in ("passed", "violation", "documented", "refused"))
    print(f"--shape {args.shape} --seed {args.seed}: {total} scenarios: {counts['passed']} passed every check, "
          f"{counts['violation']} stopped at an unexplained violation, {counts['documented']} at a documented finding "
          f"(sglang-clips-max-tokens), {counts['refused']} refused; {counts['steps']:,} steps checked, "
          f"{counts['hits']} with a prefix hit, {counts['deduplicated']} with a de-duplication, "
          f"{counts['preempted']} with a retraction")
    print(f"wall {wall:.0f} s; load average at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    for line in failures[:10]:
        print("VIOLATION", line)


def retraction_scenarios():
    """``benchmarks/sglang_retraction_probe.py``'s first two probes with prefix caching (chunked prefill off,
    ``max_model_len`` 256): long requests decay the new-token ratio, then a burst of identical requests (one
    prefix group, same prompt, so the same outputs) that SGLang over-admits and retracts; they hit, de-duplicate
    and re-admit after retractions."""
    from schedspec.spec.config import SchedulerConfig
    from schedspec.spec.workload import RequestSpec

    for burst, prompt, outputs, seqs, longs, long_outputs in ((8, 12, 100, 8, 3, 200), (16, 8, 200, 16, 4, 150)):
        config = SchedulerConfig(4, 64, 256, seqs, 256, enable_chunked_prefill=False, enable_prefix_caching=True,
                                 prefix_cache_publication="sglang-radix")
        requests = [RequestSpec(f"L{i}", 4, long_outputs, i * (long_outputs + 1), prefix_group="l", prefix_len=4)
                    for i in range(longs)]
        arrival = longs * (long_outputs + 1) + 10
        requests += [RequestSpec(f"B{i}", prompt, outputs, arrival, prefix_group="b", prefix_len=8) for i in range(burst)]
        yield config, requests


def prefix_scenarios(count: int, seed: int):
    """``count`` prefix-heavy ``(config, requests)`` pairs from ``seed``: chunked prefill off (SGLang's chunked
    request with caching is refused), a pool of 6 to 30 blocks of 2 to 8 tokens, 3 to 8 requests in one or two
    prefix groups (shared prefixes of 1 to 5 blocks, plus 1 to 12 tokens of their own), arriving over 0 to 12
    steps: pairs that prefill one new prefix together (SGLang de-duplicates), later ones that hit it, and
    pressure enough for retractions and evictions; configs and requests moved as ``schedspec diff`` moves them
    for this engine (``ProfileDifferences.config``/``shape``: where SGLang's front end and the spec agree)."""
    import random

    from schedspec.commands import diff
    from schedspec.spec.config import SchedulerConfig
    from schedspec.spec.workload import RequestSpec

    moves = diff.pair_profile("sglang", "sglang-profile")  # onto where SGLang and the spec agree, as diff moves them
    rng = random.Random(seed)
    made = 0
    while made < count:
        size = rng.choice((2, 4, 8))
        max_model_len = 8 * size + 24
        config = SchedulerConfig(block_size=size, num_kv_blocks=rng.randrange(6, 31),
                                 max_num_batched_tokens=max_model_len + rng.randrange(0, 64),
                                 max_num_seqs=rng.randrange(2, 7), max_model_len=max_model_len,
                                 enable_chunked_prefill=False, enable_prefix_caching=True,
                                 prefix_cache_publication="sglang-radix")
        prefixes = {f"g{k}": size * rng.randrange(1, 6) for k in range(rng.randrange(1, 3))}
        requests = []
        for k in range(rng.randrange(3, 9)):
            group = rng.choice(sorted(prefixes))
            prompt = prefixes[group] + rng.randrange(1, 13)
            requests.append(RequestSpec(f"r{k}", prompt, rng.randrange(1, 25), arrival_step=rng.randrange(0, 13),
                                        prefix_group=group, prefix_len=prefixes[group]))
        moved = moves.config(config)  # (it turns caching off, for the caching-off profile: on again, as diff's --set)
        if moved is None:
            continue
        moved = moved.with_changes(enable_prefix_caching=True)
        made += 1
        yield moved, [moves.shape(r, moved, True) for r in requests]



if __name__ == "__main__":
    main()
