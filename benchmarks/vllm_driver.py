"""vLLM side of ``benchmarks/backend_throughput.py``: run one token-id workload through vLLM's offline
``LLM`` and print a JSON result line.

Runs in the separate vLLM environment made by ``scripts/engines_setup.sh`` (``.venv-vllm``),
not in the project's venv: it imports nothing from ``schedspec``. The workload comes as a JSON file
written by the main benchmark::

    {"model": "/path/to/hf_dir", "requests": [{"prompt_token_ids": [...], "max_tokens": 44}, ...],
     "block_size": 16, "max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 1024,
     "threads": 2, "warmup": true, "repeat": 1}

    .venv-vllm/bin/python benchmarks/vllm_driver.py workload.json

The last line of stdout is ``VLLM_RESULT {json}`` with the wall seconds of each timed ``generate`` call
(``"repeat"`` of them), output tokens and the output token ids of each request (to compare with the other
runs).

vLLM's ``LLM`` starts its engine core in a worker process with ``spawn``, which re-imports this file:
everything runs under the ``if __name__ == "__main__":`` guard. ``skip_tokenizer_init=True`` with
token-id prompts means the model directory needs no tokenizer files.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(path: str) -> None:
    with open(path) as handle:
        job = json.load(handle)
    threads = int(job.get("threads") or os.cpu_count() or 1)
    # vLLM's CPU backend sizes the KV cache from VLLM_CPU_KVCACHE_SPACE (GiB) and binds its OpenMP
    # threads from VLLM_CPU_OMP_THREADS_BIND; both are read when the engine starts.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 1)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=job.get("block_size"),
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_model_len=job["max_model_len"],
        enable_prefix_caching=False,
        seed=0,
    )
    requests = job["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
              for r in requests]
    if job.get("warmup", True):
        # Same shapes, a few tokens each: first-call costs (allocation, kernel selection) leave the timing.
        short = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
                 for _ in requests]
        llm.generate(prompts, short, use_tqdm=False)
    seconds = []
    for _ in range(int(job.get("repeat", 1))):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    result = {
        "seconds": seconds,
        "output_tokens": sum(len(t) for t in tokens),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "token_ids": tokens,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "torch_threads_driver": torch.get_num_threads(),
        "env": {k: os.environ[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")},
    }
    print("VLLM_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} WORKLOAD.json")
    main(sys.argv[1])
