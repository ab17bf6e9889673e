"""Weights: the tensors a :class:`~schedspec.gpu_backend.config.ModelConfig` needs, the built-in tiny
model's deterministic weights, and reading / writing Hugging Face model directories (``config.json``
plus ``*.safetensors``, read with the ``safetensors`` library, never the network).

Tensor names and shapes are Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight`` is
``[num_attention_heads * head_dim, hidden_size]``, ...).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

from schedspec.gpu_backend.config import TINY_MODEL_SEED, ModelConfig, tiny_model_config
from schedspec.gpu_backend.errors import BackendError

_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by Hugging Face name, with its shape.

    ``lm_head.weight`` is absent when ``tie_word_embeddings`` (the embedding is reused).
    """
    h, inter = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            shapes[f"{p}self_attn.{name}.weight"] = (out, h)
            if config.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            shapes[f"{p}mlp.{name}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes the model's weights take in ``dtype``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) for shape in expected_tensor_shapes(config).values()) * itemsize


def _init_std(name: str) -> float:
    # Chosen so the random model is not degenerate: unit-scale embeddings, fairly sharp attention
    # (q/k larger than the rest) and peaked next-token distributions (lm_head logits of std ~4), so
    # greedy top-2 margins sit far above fp32 rounding noise.
    if name.startswith("model.embed_tokens"):
        return 1.0
    if name.startswith("lm_head"):
        return 0.25
    if "q_proj" in name or "k_proj" in name:
        return 0.08
    return 0.04


def random_weights(config: ModelConfig, seed: int = TINY_MODEL_SEED) -> dict[str, torch.Tensor]:
    """Deterministic random fp32 CPU weights for ``config`` (the same on every machine for a seed).

    Norm weights are ``1 + N(0, 0.05)``, biases ``N(0, 0.02)``, matrices normal with a per-kind std.
    Returns a fresh dict of fresh tensors (callers may modify them).
    """
    return {name: t.clone() for name, t in _random_weights_cached(config, seed).items()}


@functools.lru_cache(maxsize=4)
def _random_weights_cached(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_tensor_shapes(config).items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.05 * noise
        elif name.endswith(".bias"):
            weights[name] = 0.02 * noise
        else:
            weights[name] = _init_std(name) * noise
    return weights


def tiny_model_weights(architecture: str = "LlamaForCausalLM") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The built-in tiny model (:func:`~schedspec.gpu_backend.config.tiny_model_config`) and its fp32
    CPU weights, seeded with :data:`~schedspec.gpu_backend.config.TINY_MODEL_SEED`."""
    config = tiny_model_config(architecture)
    return config, random_weights(config, TINY_MODEL_SEED)


def save_model_dir(path: str | Path, config: ModelConfig, weights: dict[str, torch.Tensor],
                   dtype: torch.dtype = torch.float32) -> Path:
    """Write a Hugging Face model directory: ``config.json`` and ``model.safetensors``.

    Args:
        path: the directory (created if needed).
        config: the architecture.
        weights: tensors by Hugging Face name (see :func:`expected_tensor_shapes`).
        dtype: storage dtype of the tensors (float32, bfloat16 or float16).

    Returns:
        The directory, which ``transformers`` ``from_pretrained`` and :class:`Runner` both load.
    """
    from safetensors.torch import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(_DTYPE_NAMES[dtype]), indent=2) + "\n")
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in weights.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def save_tiny_model(path: str | Path, architecture: str = "LlamaForCausalLM",
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write the built-in tiny model as a Hugging Face directory (see :func:`save_model_dir`), so the
    Hugging Face comparison and the benchmarks load exactly the weights the default :class:`Runner`
    uses."""
    config, weights = tiny_model_weights(architecture)
    return save_model_dir(path, config, weights, dtype)


def index_model_dir(model_dir: str | Path, config: ModelConfig) -> dict[str, Path]:
    """Check a model directory's tensors against ``config`` without loading them.

    Returns:
        Tensor name -> the ``.safetensors`` file that holds it, for every needed tensor.

    Raises:
        BackendError: no ``*.safetensors`` file, an unreadable file, a needed tensor missing, a tensor
            of the wrong shape or a non-float dtype; the message names the tensor and the file.
    """
    from safetensors import safe_open

    directory = Path(model_dir)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise BackendError(f"{directory}: no *.safetensors file in the model directory", path=str(directory))
    expected = expected_tensor_shapes(config)
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    if name not in expected:  # extras (tied lm_head, rotary buffers) are not loaded
                        continue
                    info = handle.get_slice(name)
                    shape = tuple(info.get_shape())
                    want = expected[name]
                    if shape != want:
                        raise BackendError(
                            f"{file}: tensor {name!r} has shape {list(shape)}, expected {list(want)}",
                            field=name, path=str(file))
                    if info.get_dtype() not in _FLOAT_DTYPES:
                        raise BackendError(
                            f"{file}: tensor {name!r} has dtype {info.get_dtype()}, expected a float dtype "
                            f"({sorted(_FLOAT_DTYPES)})", field=name, path=str(file))
                    where[name] = file
        except BackendError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise BackendError(f"{file}: cannot read safetensors file ({exc})", path=str(file)) from exc
    missing = [name for name in expected if name not in where]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise BackendError(
            f"{directory}: tensor {shown} missing from {[f.name for f in files]}", field=missing[0],
            path=str(directory))
    return where


def load_model_dir(where: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Load the tensors listed by :func:`index_model_dir` onto the CPU, in their stored dtype."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, file in where.items():
        by_file.setdefault(file, []).append(name)
    weights: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in names:
                weights[name] = handle.get_tensor(name)
    return weights


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str = "weights") -> None:
    """Check an in-memory weight dict against ``config`` (same rules as :func:`index_model_dir`)."""
    for name, want in expected_tensor_shapes(config).items():
        tensor = weights.get(name)
        if tensor is None:
            raise BackendError(f"{source}: tensor {name!r} missing", field=name, path=source)
        if tuple(tensor.shape) != want:
            raise BackendError(f"{source}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(want)}",
                               field=name, path=source)
