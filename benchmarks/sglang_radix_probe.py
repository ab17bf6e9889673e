"""SGLang 0.5.23's radix cache under the spec, in small (issue 25, the radix tree as the spec's prefix cache;
docs/engines.md, *SGLang 0.5.23*, *The radix cache*).

Four requests of one prefix group (16 shared tokens, 4 pages of 4) through the ``sglang`` adapter with
``enable_prefix_caching`` and ``prefix_cache_publication = "sglang-radix"``, under every spec check, printing
each step (computed tokens, tokens, the hit reported) and the first violations: A and B prefill the prefix
together (SGLang frees B's copies: a de-duplication), C and D hit it. Before the spec had SGLang's publication
this probe went around the adapter's refusal and stopped at ``state-mismatch: num_free_blocks`` at step 0.

Run (SGLang's environment built: ``SCHEDSPEC_SGLANG=1 bash scripts/engines_setup.sh``)::

    nice -n 10 .venv/bin/python benchmarks/sglang_radix_probe.py [NUM_KV_BLOCKS]
"""

from __future__ import annotations

import sys


def main() -> None:
    import schedspec.engines.sglang as adapter
    from schedspec.reference.engine import Engine
    from schedspec.spec.config import SchedulerConfig
    from schedspec.spec.workload import RequestSpec

    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    config = SchedulerConfig(block_size=4, num_kv_blocks=blocks, max_num_batched_tokens=64, max_num_seqs=4,
                             max_model_len=128, enable_prefix_caching=True, prefix_cache_publication="sglang-radix")
    scheduler = adapter.SglangScheduler(config)
    specs = [RequestSpec("A", 20, 6, arrival_step=0, prefix_group="g", prefix_len=16),
             RequestSpec("B", 20, 6, arrival_step=0, prefix_group="g", prefix_len=16),
             RequestSpec("C", 20, 6, arrival_step=3, prefix_group="g", prefix_len=16),
             RequestSpec("D", 18, 6, arrival_step=12, prefix_group="g", prefix_len=16)]
    run = Engine(scheduler, config, properties=()).run(specs, mode="steps", max_steps=60)
    for record in run.records:
        print(record.step, [(i.request_id, i.num_computed_tokens, i.prefill_tokens + i.decode_tokens)
                            for i in record.scheduled], dict(record.prefix_hit_tokens), dict(record.finished))
    print("violations:", [str(v) for v in run.violations[:4]])


if __name__ == "__main__":
    main()
