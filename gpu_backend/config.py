"""Model architecture description, read from a Hugging Face ``config.json`` or built in (tiny model).

Torch-free. Only the decoder-only Llama family is supported: ``LlamaForCausalLM`` (RMSNorm, rotary
embeddings, grouped-query attention, SwiGLU MLP; optional ``attention_bias`` / ``mlp_bias``) and
``Qwen2ForCausalLM`` (the same with q/k/v biases; its layers may mix full and sliding-window attention,
``layer_types`` / ``use_sliding_window`` / ``sliding_window``, see :attr:`ModelConfig.layer_types`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

from schedspec.gpu_backend.errors import BackendError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
"""Values of ``config.json`` ``architectures`` the backend runs."""

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_ROPE_TYPES = ("default", "linear", "llama3")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
"""Values of Hugging Face ``layer_types`` the backend runs."""

TINY_MODEL_SEED = 0
"""Seed of the built-in tiny model's weights (fixed: the tiny model is the same everywhere)."""


@attrs.frozen
class ModelConfig:
    """The shape of a Llama-family decoder. Sizes in elements, lengths in tokens.

    Attributes:
        architecture: one of :data:`SUPPORTED_ARCHITECTURES`.
        vocab_size: rows of the embedding and of ``lm_head`` (token ids are ``[0, vocab_size)``).
        hidden_size: width of the residual stream.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA); divides ``num_attention_heads``.
        head_dim: width of one head (even, for rotary embeddings).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: rotary base wavelength.
        rope_type: ``"default"``, ``"linear"`` or ``"llama3"`` (Hugging Face ``rope_type``).
        rope_factor: scaling factor of ``linear`` / ``llama3`` rope (1.0 for ``default``).
        rope_low_freq_factor, rope_high_freq_factor, rope_original_max_position_embeddings: the
            ``llama3`` rope parameters (unused otherwise).
        max_position_embeddings: longest sequence the model supports (tokens).
        tie_word_embeddings: ``lm_head`` shares the embedding matrix.
        qkv_bias: q/k/v projections have biases (Qwen2; Llama ``attention_bias``).
        o_bias: the output projection has a bias (Llama ``attention_bias``).
        mlp_bias: gate/up/down projections have biases (Llama ``mlp_bias``).
        layer_types: per layer, ``"full_attention"`` or ``"sliding_attention"`` (Hugging Face ``layer_types``);
            empty: every layer is full attention.
        sliding_window: the window of the ``"sliding_attention"`` layers in tokens (Hugging Face
            ``sliding_window``): the token at position ``i`` attends positions ``j`` with
            ``i - sliding_window < j <= i`` (transformers ``masking_utils.sliding_window_overlay``,
            ``kv_idx > q_idx - sliding_window``, on top of the causal mask; vLLM's ``SlidingWindowSpec`` and the
            spec's ``KVCacheGroup`` use the same window). ``None`` without sliding layers.

    Raises:
        BackendError: ``layer_types`` of the wrong length or with another kind, sliding layers without a
            window (an integer >= 1) or a window without sliding layers, or sliding layers in a Llama
            (transformers' ``LlamaForCausalLM`` has no sliding window).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    layer_types: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    sliding_window: int | None = None

    def __attrs_post_init__(self) -> None:
        types = self.layer_types
        if types and len(types) != self.num_hidden_layers:
            raise BackendError(f"layer_types={list(types)!r}: must name {self.num_hidden_layers} layers "
                               "(num_hidden_layers)", field="layer_types")
        if any(t not in LAYER_TYPES for t in types):
            raise BackendError(f"layer_types={list(types)!r}: each must be one of {list(LAYER_TYPES)}",
                               field="layer_types")
        window = self.sliding_window
        if SLIDING_ATTENTION in types:
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise BackendError(f"sliding_window={window!r}: must be an integer >= 1 (tokens) for the "
                                   "sliding_attention layers", field="sliding_window")
            if self.architecture != "Qwen2ForCausalLM":
                raise BackendError(f"layer_types: sliding_attention layers are not supported for {self.architecture} "
                                   "(only Qwen2ForCausalLM)", field="layer_types")
        elif window is not None:
            raise BackendError(f"sliding_window={window!r}: no layer is sliding_attention", field="sliding_window")

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` in tokens, ``None`` for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """The ``config.json`` content Hugging Face ``from_pretrained`` reads for this model."""
        data: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype,
            "bos_token_id": None,
            "eos_token_id": 0,
            "use_cache": True,
        }
        if self.rope_type != "default":
            rope: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.rope_factor}
            if self.rope_type == "llama3":
                rope.update(
                    low_freq_factor=self.rope_low_freq_factor,
                    high_freq_factor=self.rope_high_freq_factor,
                    original_max_position_embeddings=self.rope_original_max_position_embeddings,
                )
            data["rope_scaling"] = rope
        if self.architecture == "LlamaForCausalLM":
            data["attention_bias"] = self.qkv_bias
            data["mlp_bias"] = self.mlp_bias
        elif self.sliding_window is not None:
            data.update(use_sliding_window=True, sliding_window=self.sliding_window, layer_types=list(self.layer_types),
                        max_window_layers=self.num_hidden_layers)
        else:
            data["use_sliding_window"] = False
        return data

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict.

        Args:
            data: the parsed JSON object.
            source: the file it came from, named in errors.

        Raises:
            BackendError: an unsupported architecture, a missing or ill-typed field, or a feature the
                backend does not implement (other activations, other rope types, other layer types);
                the message names ``source`` and the field.
        """

        def fail(field: str, reason: str) -> BackendError:
            value = data.get(field, "<missing>")
            return BackendError(f"{source}: {field}={value!r}: {reason}", field=field, path=source)

        if not isinstance(data, dict):
            raise BackendError(f"{source}: must hold a JSON object", path=source)
        architectures = data.get("architectures")
        if architectures is None:
            by_type = {v: k for k, v in _MODEL_TYPES.items()}
            if data.get("model_type") in by_type:
                architectures = [by_type[data["model_type"]]]
            else:
                raise fail("architectures", f"is required; supported: {list(SUPPORTED_ARCHITECTURES)}")
        if not isinstance(architectures, list) or not architectures:
            raise fail("architectures", "must be a non-empty list")
        supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise fail("architectures", f"unsupported architecture; supported: {list(SUPPORTED_ARCHITECTURES)}")
        architecture = supported[0]

        def integer(field: str, default: Any = attrs.NOTHING, minimum: int = 1) -> int:
            value = data.get(field)
            if value is None:
                if default is attrs.NOTHING:
                    raise fail(field, "is required")
                return default
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise fail(field, f"must be an integer >= {minimum}")
            return value

        def number(field: str, default: float, source_dict: dict[str, Any] | None = None) -> float:
            where = data if source_dict is None else source_dict
            value = where.get(field)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise fail(field, "must be a positive number")
            return float(value)

        def flag(field: str, default: bool) -> bool:
            value = data.get(field, default)
            if value is None:
                return default
            if not isinstance(value, bool):
                raise fail(field, "must be true or false")
            return value

        vocab_size = integer("vocab_size")
        hidden_size = integer("hidden_size")
        intermediate_size = integer("intermediate_size")
        num_layers = integer("num_hidden_layers")
        num_heads = integer("num_attention_heads")
        num_kv_heads = integer("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise fail("num_key_value_heads", f"must divide num_attention_heads={num_heads}")
        if data.get("head_dim") is None and hidden_size % num_heads:
            raise fail("hidden_size", f"must be a multiple of num_attention_heads={num_heads} when head_dim is absent")
        head_dim = integer("head_dim", hidden_size // num_heads)
        if head_dim % 2:
            raise fail("head_dim", "must be even (rotary embeddings rotate pairs)")
        act = data.get("hidden_act", "silu")
        if act != "silu":
            raise fail("hidden_act", "only 'silu' (SwiGLU) is supported")
        if data.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise fail("partial_rotary_factor", "only 1.0 (full rotary) is supported")
        if data.get("pretraining_tp") not in (None, 1):
            raise fail("pretraining_tp", "only 1 is supported")

        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise fail("rope_scaling", "must be a JSON object")
        if any(isinstance(v, dict) for v in rope.values()):
            raise fail("rope_parameters", "per-layer rope parameters are not supported")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise fail("rope_scaling", f"rope_type {rope_type!r} is not supported; supported: {list(_ROPE_TYPES)}")
        if rope.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise fail("rope_parameters", "only partial_rotary_factor 1.0 is supported")
        rope_theta = number("rope_theta", number("rope_theta", 10000.0), rope)
        max_pos = integer("max_position_embeddings", 32768 if architecture == "Qwen2ForCausalLM" else 2048)
        rope_factor = number("factor", 1.0, rope) if rope_type != "default" else 1.0
        original = rope.get("original_max_position_embeddings", max_pos)
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise fail("rope_scaling", "original_max_position_embeddings must be a positive integer")

        layer_types: tuple[str, ...] = ()
        window = None
        if architecture == "Qwen2ForCausalLM":
            # As transformers' Qwen2Config: the window only with use_sliding_window; layer_types given, or the
            # layers from max_window_layers on are sliding.
            if flag("use_sliding_window", False):
                window = integer("sliding_window", 4096)
            given = data.get("layer_types")
            if given is not None:
                if not isinstance(given, list) or len(given) != num_layers or any(t not in LAYER_TYPES for t in given):
                    raise fail("layer_types", f"must list {num_layers} of {list(LAYER_TYPES)}")
                kinds = given
            else:
                first = integer("max_window_layers", 28, 0)
                kinds = [SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION
                         for i in range(num_layers)]
            if window is not None and SLIDING_ATTENTION in kinds:
                layer_types = tuple(kinds)
            else:  # transformers: a sliding_attention layer without a window attends like a full one
                window = None
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            qkv_bias = o_bias = flag("attention_bias", False)
            mlp_bias = flag("mlp_bias", False)

        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_factor=rope_factor,
            rope_low_freq_factor=number("low_freq_factor", 1.0, rope),
            rope_high_freq_factor=number("high_freq_factor", 4.0, rope),
            rope_original_max_position_embeddings=original,
            max_position_embeddings=max_pos,
            tie_word_embeddings=flag("tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            layer_types=layer_types,
            sliding_window=window,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``<model_dir>/config.json``.

        Raises:
            BackendError: the directory or ``config.json`` is missing or not valid JSON, or see
                :meth:`from_hf_dict`. The message names the path.
        """
        directory = Path(model_dir)
        if not directory.is_dir():
            raise BackendError(f"model directory {str(directory)!r} does not exist or is not a directory",
                               field="model", path=str(directory))
        path = directory / "config.json"
        if not path.is_file():
            raise BackendError(f"{path}: config.json not found in the model directory", path=str(path))
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BackendError(f"{path}: cannot read JSON ({exc})", path=str(path)) from exc
        return cls.from_hf_dict(data, str(path))


def tiny_model_config(architecture: str = "LlamaForCausalLM", **changes: Any) -> ModelConfig:
    """The built-in tiny model: 4 layers, hidden 256, 4 query / 2 key-value heads of 64, SwiGLU 512,
    vocab 4096 (= ``schedspec.spec.workload.DEFAULT_VOCAB_SIZE``), rope base 10000, up to 131072
    positions. ``architecture="Qwen2ForCausalLM"`` gives the same shape with q/k/v biases.
    ``changes`` override fields (e.g. ``num_hidden_layers=2``).
    """
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise BackendError(f"architecture={architecture!r}: supported: {list(SUPPORTED_ARCHITECTURES)}",
                           field="architecture")
    base = ModelConfig(
        architecture=architecture,
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=131072,
        qkv_bias=architecture == "Qwen2ForCausalLM",
    )
    return attrs.evolve(base, **changes)
