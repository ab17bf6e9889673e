"""A real PyTorch token source for the schedulers: a paged, batched Llama-family model.

``Runner(config, model=None | model_dir, device="auto", dtype="float32", debug=False,
eos_at_output=None, seed=0)`` implements ``execute(plan, state) -> (sampled_token_ids, step_seconds)``.
See ``docs/gpu_backend.md``.

Importing this package does not import torch; the torch-backed names below load on first access, so
``BackendError`` can be caught (and ``ModelConfig`` read) on a machine without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from schedspec.gpu_backend.errors import BackendError, BlockTableError

_LAZY = {
    "ModelConfig": "config",
    "SUPPORTED_ARCHITECTURES": "config",
    "TINY_MODEL_SEED": "config",
    "tiny_model_config": "config",
    "Runner": "runner",
    "PagedKVCache": "kv_cache",
    "BlockLedger": "kv_cache",
    "LlamaModel": "model",
    "PackedBatch": "model",
    "resolve_device": "device",
    "resolve_dtype": "device",
    "expected_tensor_shapes": "weights",
    "random_weights": "weights",
    "tiny_model_weights": "weights",
    "save_model_dir": "weights",
    "save_tiny_model": "weights",
    "sample": "sampling",
}

__all__ = ["BackendError", "BlockTableError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
