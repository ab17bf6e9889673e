"""A Llama-family decoder that runs one packed, paged batch per call (pure PyTorch).

The batch packs ``T`` new tokens of several requests: prefill chunks at any offset into their sequence
and single decode tokens. Each new token attends to its request's cached tokens plus the causal part of
its own chunk; keys and values are written to, then gathered from, the paged KV cache through the
request's block table (a sliding-window layer: through its KV cache group's table, attending only to the
positions its window sees, :func:`visible`). Numerics follow Hugging Face ``modeling_llama`` (fp32 RMSNorm, fp32 rotary
angles, ``rotate_half`` rotary embedding, SwiGLU) so logits match ``transformers`` to rounding.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F

from schedspec.gpu_backend.config import ModelConfig
from schedspec.gpu_backend.kv_cache import PagedKVCache


def visible(query_positions, key_positions, window: int | None):
    """Which keys each query attends: ``[Q, K]`` bool (numpy or torch, as the inputs), True where the key's
    position ``j`` is at most the query's ``i`` and, with a sliding ``window`` (tokens), ``i - window < j``:
    the window holds the query and the ``window - 1`` positions before it. transformers
    ``masking_utils.causal_mask_function`` and ``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``);
    vLLM ``SlidingWindowSpec`` and the spec's ``KVCacheGroup`` (position ``p`` attends ``[p - w + 1, p]``).

    Args:
        query_positions: ``[Q]`` int positions.
        key_positions: ``[K]`` int positions.
        window: the window in tokens, ``None`` for full (causal) attention.
    """
    mask = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        mask = mask & (key_positions[None, :] > query_positions[:, None] - window)
    return mask


@attrs.define
class PrefillChunk:
    """One request's chunk of more than one token in a packed batch.

    Attributes:
        token_start: index of its first token in the packed batch.
        num_tokens: ``n``, tokens in the chunk.
        seq_len: ``L``, positions ``[0, L)`` computed after the chunk (cached plus new), tokens.
        block_ids: ``[ceil(L / block_size) - key_start / block_size]`` int64, its block table from the
            block of position ``key_start`` to the one of ``L - 1`` (``None`` for a chunk that starts at position 0
            and whose every query sees all the chunk's earlier tokens: it attends only to its own new keys and
            values, causally, without reading the cache).
        mask: ``[G * n, L - key_start]`` bool, True where query ``i`` (repeated for the ``G`` query heads of each
            key/value head) may attend key position ``key_start + j`` (:func:`visible`); ``None`` without
            ``block_ids``.
        key_start: the first position read from the cache, a multiple of ``block_size`` (0, or for a
            sliding-window layer the start of the block of the first position its window sees).
    """

    token_start: int
    num_tokens: int
    seq_len: int
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None
    key_start: int = 0


@attrs.define
class DecodeGroup:
    """Single-token items of similar length attended in one batched call.

    Attributes:
        index: ``[R]`` int64 batch index of each item's token.
        block_ids: ``[R * B]`` int64 block tables, row-major, padded with the row's first block (``B`` blocks
            cover the group's longest sequence).
        num_blocks: ``B``.
        mask: ``[R, 1, 1, B * block_size]`` additive mask in the model dtype: 0 where the item may read
            (positions below its length, and in its window for a sliding-window layer; :func:`visible`),
            ``-inf`` elsewhere.
        invalid: ``[R, B * block_size, 1, 1]`` bool, True at the positions the mask hides; set only when the
            cache may hold NaN or inf there (debug mode's poisoned blocks; float16): the gathered copy is
            zeroed at them, since a masked-out NaN would otherwise leak through ``0 * NaN``.
    """

    index: torch.Tensor
    block_ids: torch.Tensor
    num_blocks: int
    mask: torch.Tensor
    invalid: torch.Tensor | None = None


@attrs.define
class AttentionView:
    """The attention metadata of the layers of one KV cache group and one window.

    Attributes:
        slot_mapping: ``[T]`` int64 KV-cache slot each token's key/value is written to (in the group's tables).
        decode_groups: the single-token items, in groups of similar length (see :class:`DecodeGroup`).
        prefills: the chunks of more than one token.
    """

    slot_mapping: torch.Tensor
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


@attrs.define
class PackedBatch:
    """Inputs and attention metadata of one step, on the model device.

    Attributes:
        input_ids: ``[T]`` int64 token ids.
        positions: ``[T]`` int64 position of each token in its sequence.
        views: the :class:`AttentionView` of each layer kind (``LlamaModel.layer_view`` says which a layer
            uses); one for a model of full-attention layers only.
        logits_index: ``[S]`` int64 batch indices whose logits are returned.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    views: list[AttentionView]
    logits_index: torch.Tensor


@attrs.define
class _Layer:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim / 2]`` float32, as Hugging Face computes them
    (``default``, ``linear`` and ``llama3`` rope types)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if config.rope_type == "linear":
        inv_freq = inv_freq / config.rope_factor
    elif config.rope_type == "llama3":
        factor = config.rope_factor
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        old_context = config.rope_original_max_position_embeddings
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Weights of a Llama / Qwen2 decoder on a device, and the paged forward pass.

    Args:
        config: the architecture.
        weights: tensors by Hugging Face name (CPU or device, any float dtype); checked by the caller.
        device: where to run.
        dtype: compute and storage dtype (float32, bfloat16 or float16).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype

        def get(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        def maybe_cat(names: list[str]) -> torch.Tensor | None:
            if names[0] not in weights:
                return None
            return torch.cat([get(n) for n in names], dim=0).contiguous()

        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else get("lm_head.weight")
        self.layers: list[_Layer] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
            mlp = [f"{p}mlp.{n}_proj" for n in ("gate", "up")]
            self.layers.append(_Layer(
                input_norm=get(p + "input_layernorm.weight"),
                qkv_weight=maybe_cat([n + ".weight" for n in attn]),
                qkv_bias=maybe_cat([n + ".bias" for n in attn]),
                o_weight=get(p + "self_attn.o_proj.weight"),
                o_bias=get(p + "self_attn.o_proj.bias") if config.o_bias else None,
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up_weight=maybe_cat([n + ".weight" for n in mlp]),
                gate_up_bias=maybe_cat([n + ".bias" for n in mlp]),
                down_weight=get(p + "mlp.down_proj.weight"),
                down_bias=get(p + "mlp.down_proj.bias") if config.mlp_bias else None,
            ))
        self.layer_view = [0] * config.num_hidden_layers
        """Per layer, the index of its :class:`AttentionView` in ``PackedBatch.views`` (set by the runner)."""
        self.inv_freq = rope_inv_freq(config).to(device)
        self._rope_cos: torch.Tensor | None = None
        self._rope_sin: torch.Tensor | None = None

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def prepare_rotary(self, max_len: int) -> None:
        """Precompute ``cos``/``sin`` for positions ``[0, max_len)`` (the same values :meth:`rotary` computes
        otherwise), so each step looks them up instead of recomputing them."""
        positions = torch.arange(max_len, device=self.device)
        self._rope_cos, self._rope_sin = self._rope(positions)

    def rotary(self, positions: torch.Tensor, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, 1, head_dim]`` in the model dtype for positions ``[T]``
        (``max_position``: their maximum, when known, to use the table of :meth:`prepare_rotary`)."""
        table = self._rope_cos
        if table is not None and max_position is not None and max_position < table.shape[0]:
            return self._rope_cos[positions][:, None, :], self._rope_sin[positions][:, None, :]
        cos, sin = self._rope(positions)
        return cos[:, None, :], sin[:, None, :]

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, kv_cache: PagedKVCache, max_position: int | None = None) -> torch.Tensor:
        """One forward pass over a packed batch; writes the batch's keys/values to ``kv_cache``.

        Args:
            max_position: the largest of ``batch.positions``, when the caller knows it (rotary table lookup).

        Returns:
            ``[S, vocab_size]`` float32 logits of the tokens in ``batch.logits_index``.
        """
        cfg = self.config
        num_tokens = batch.input_ids.shape[0]
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        q_size = heads * cfg.head_dim
        kv_size = kv_heads * cfg.head_dim
        cos, sin = self.rotary(batch.positions, max_position)
        x = F.embedding(batch.input_ids, self.embed)
        for index, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)
            # Rotary embedding of queries and keys together (one pass over both).
            qk = qkv[:, :q_size + kv_size].view(num_tokens, heads + kv_heads, cfg.head_dim)
            qk = qk * cos + _rotate_half(qk) * sin
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, q_size + kv_size:].view(num_tokens, kv_heads, cfg.head_dim)
            view = batch.views[self.layer_view[index]]
            kv_cache.write(index, view.slot_mapping, k, v)
            attn = self._attention(index, q, k, v, view, kv_cache)
            x = x + F.linear(attn.reshape(num_tokens, q_size), layer.o_weight, layer.o_bias)
            h = _rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate, up = F.linear(h, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)
        x = _rms_norm(x[batch.logits_index], self.norm, cfg.rms_norm_eps)
        return F.linear(x, self.lm_head).to(torch.float32)

    def _attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionView,
                   kv_cache: PagedKVCache) -> torch.Tensor:
        """Attention output ``[T, num_attention_heads, head_dim]`` for queries ``q`` of the same shape
        (``k``, ``v``: the batch's own new keys and values, ``[T, num_key_value_heads, head_dim]``).

        Single-token items: per :class:`DecodeGroup`, the blocks of the group's tables are gathered and
        attended in one batched call; grouped-query attention folds the ``G`` query heads of a key/value head
        into the query-length dimension, so keys and values are never repeated. Chunks that start at
        position 0 attend causally to their own new keys/values; other chunks read their prefix from the cache.
        """
        cfg = self.config
        groups, kv_heads, head_dim = cfg.num_queries_per_kv, cfg.num_key_value_heads, cfg.head_dim
        key_cache, value_cache = kv_cache.key[layer], kv_cache.value[layer]
        num_blocks, block_size = key_cache.shape[:2]
        # Blocks as rows: index_select copies whole rows (2-3x faster than on the 4-d view).
        key_rows, value_rows = key_cache.view(num_blocks, -1), value_cache.view(num_blocks, -1)
        out = torch.empty_like(q)
        for group in batch.decode_groups:
            rows, length = group.index.shape[0], group.num_blocks * block_size
            keys = key_rows.index_select(0, group.block_ids).view(rows, length, kv_heads, head_dim)
            values = value_rows.index_select(0, group.block_ids).view(rows, length, kv_heads, head_dim)
            if group.invalid is not None:
                keys.masked_fill_(group.invalid, 0)
                values.masked_fill_(group.invalid, 0)
            query = q.index_select(0, group.index).view(rows, kv_heads, groups, head_dim)
            result = F.scaled_dot_product_attention(
                query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.mask)
            out.index_copy_(0, group.index, result.reshape(rows, kv_heads * groups, head_dim))
        for chunk in batch.prefills:
            start, n, length = chunk.token_start, chunk.num_tokens, chunk.seq_len - chunk.key_start
            if chunk.block_ids is None:
                result = F.scaled_dot_product_attention(
                    q[start:start + n].transpose(0, 1)[None], k[start:start + n].transpose(0, 1)[None],
                    v[start:start + n].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
                out[start:start + n] = result[0].transpose(0, 1)
                continue
            keys = key_cache[chunk.block_ids].view(-1, kv_heads, head_dim)[:length].transpose(0, 1)
            values = value_cache[chunk.block_ids].view(-1, kv_heads, head_dim)[:length].transpose(0, 1)
            query = q[start:start + n].reshape(n, kv_heads, groups, head_dim).permute(1, 2, 0, 3)
            query = query.reshape(1, kv_heads, groups * n, head_dim)
            result = F.scaled_dot_product_attention(query, keys[None], values[None], attn_mask=chunk.mask)
            out[start:start + n] = result.view(kv_heads, groups, n, head_dim).permute(2, 0, 1, 3).reshape(
                n, kv_heads * groups, head_dim)
        return out
