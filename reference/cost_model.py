"""A linear step-time model of one forward pass, with named hardware/model profiles.

One iteration of an iteration-level scheduler runs one forward pass over the batch. Its time is
modelled as

    step_seconds = a + b * prefill_tokens + c * decode_tokens + d * kv_tokens_attended
                   + e * prefill_attention_pairs

with every coefficient in seconds (per step, per token, per token, per attended KV token, per
query-key pair of prefill attention):

- ``a`` (fixed per step): reading every weight once from HBM (a decode step of a small batch is
  memory-bound: the weights are streamed once whatever the batch size), plus kernel-launch, scheduler,
  sampling and detokenisation overhead. It dominates small batches, as on real GPUs.
- ``b`` (per prefill token) and ``c`` (per decode token): the dense matmul FLOPs of one token,
  ``2 * num_params`` FLOP, at a realistic fraction (MFU) of the GPU's peak bf16 dense throughput.
  A decode token costs the same matmul FLOPs as a prompt token, so the built-in profiles have
  ``c == b``; they are separate so that a profile fitted to measurements can differ.
- ``d`` (per attended KV token): reading one token's K and V for every layer from HBM.
  ``kv_tokens_attended`` is the sum, over the requests in the batch, of the tokens whose KV the request's
  attention reads this step: its ``num_computed_tokens`` before the step plus the tokens it computes
  in the step (for a decode, its whole context; for a prefill chunk, the prefix before the chunk and
  the chunk itself). This is what :class:`~schedspec.reference.fake_model.FakeModel` passes.
- ``e`` (per prefill attention pair): the causal attention of a prefill chunk of ``n`` tokens after
  ``k`` computed ones scores ``n * k + n * (n + 1) / 2`` query-key pairs, quadratic in the chunk. The
  packaged profiles leave it at 0 (the simplification below); ``schedspec calibrate`` fits it when the
  measured residuals call for it (long chunks on a CPU).

Simplifications (deliberate; the model is for comparing schedulers, not for predicting latency to
the millisecond): compute and memory time are added, not overlapped (``max`` would not be linear);
the quadratic attention FLOPs of long prefills are not modelled (for Llama-3-8B at 4k context they
add about 13 % to a prompt token's FLOPs); tensor parallelism, quantisation and CUDA-graph padding
are ignored.

Sources for the hardware numbers: NVIDIA A100 datasheet (80 GB SXM: 2,039 GB/s HBM2e, 312 TFLOP/s
dense bf16), NVIDIA H100 datasheet (80 GB SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16). Model:
Meta Llama-3-8B ``config.json`` (32 layers, 8 KV heads, head dim 128, 8,030,261,248 parameters,
8,192-token context).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import attrs

GiB = 1 << 30
KiB = 1 << 10


class CostModelError(ValueError):
    """An unknown profile, an unusable profile file or a negative token count; the message names it."""


PROFILE_KIND = {"derived": "derived, not measured", "measured": "measured (fitted by schedspec calibrate)"}
"""How a profile's coefficients were found, as the lab labels it."""


@attrs.frozen
class GpuSpec:
    """One accelerator, as the cost model needs it.

    Attributes:
        name: marketing name.
        memory_bytes: device memory in bytes.
        hbm_bytes_per_s: peak HBM bandwidth in bytes/s.
        bf16_flops: peak dense bf16 tensor-core throughput in FLOP/s.
        mfu: fraction of ``bf16_flops`` a well-tuned serving engine reaches on large prefills.
        step_overhead_s: per-step CPU/launch/sampling overhead in seconds (CUDA graphs on).
        vllm_max_num_batched_tokens: vLLM's default for the OpenAI server on this GPU.
        vllm_max_num_seqs: vLLM's default for the OpenAI server on this GPU.
    """

    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    mfu: float
    step_overhead_s: float
    vllm_max_num_batched_tokens: int
    vllm_max_num_seqs: int


@attrs.frozen
class ModelSpec:
    """One model, as the cost model needs it.

    Attributes:
        name: model name.
        num_params: parameter count.
        bytes_per_param: 2 for bf16.
        num_layers, num_kv_heads, head_dim: attention shape (grouped-query attention).
        kv_bytes_per_elem: 2 for a bf16 KV cache.
        max_model_len: the model's context length in tokens.
    """

    name: str
    num_params: int
    bytes_per_param: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_elem: int
    max_model_len: int

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers: ``layers * kv_heads * head_dim * 2 * bytes``."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.kv_bytes_per_elem


# vLLM's batch defaults: ``EngineArgs.get_batch_defaults`` in vllm/engine/arg_utils.py (earlier
# ``_set_default_args``): a GPU with >= 70 GiB whose name does not contain "a100" (H100, H200, MI300x)
# gets max_num_batched_tokens 8192 / max_num_seqs 1024 for the OpenAI server (16384 / 1024 for the
# offline LLM class); every other GPU, the A100 included (vLLM PR #17885: a larger budget lowers A100
# throughput), gets 2048 / 256 for the OpenAI server (8192 / 256 offline).
GPUS: dict[str, GpuSpec] = {
    "a100-80gb": GpuSpec(
        name="NVIDIA A100 80GB SXM",
        memory_bytes=80 * GiB,
        hbm_bytes_per_s=2.039e12,
        bf16_flops=312e12,
        mfu=0.5,
        step_overhead_s=2.0e-3,
        vllm_max_num_batched_tokens=2048,
        vllm_max_num_seqs=256,
    ),
    "h100-80gb": GpuSpec(
        name="NVIDIA H100 80GB SXM",
        memory_bytes=80 * GiB,
        hbm_bytes_per_s=3.35e12,
        bf16_flops=989e12,
        mfu=0.5,
        step_overhead_s=2.0e-3,
        vllm_max_num_batched_tokens=8192,
        vllm_max_num_seqs=1024,
    ),
}
"""Accelerators by key. Memory is the nominal 80 GiB of both parts."""

MODELS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec(
        name="Meta-Llama-3-8B (bf16)",
        num_params=8_030_261_248,
        bytes_per_param=2,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        kv_bytes_per_elem=2,
        max_model_len=8192,
    ),
    # Meta Llama-3.1-8B config.json: the same shape as Llama-3-8B (32 layers, 8 KV heads, head dim
    # 128, 8,030,261,248 parameters) with max_position_embeddings 131,072 (RoPE scaling "llama3").
    "llama3.1-8b": ModelSpec(
        name="Meta-Llama-3.1-8B (bf16, 128k context)",
        num_params=8_030_261_248,
        bytes_per_param=2,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        kv_bytes_per_elem=2,
        max_model_len=131_072,
    ),
}
"""Models by key. Llama-3-8B: 16.06 GB of bf16 weights, 128 KiB of bf16 KV per token, 8,192-token
context; Llama-3.1-8B: the same weights and KV shape, 131,072-token context (for long-context traces
such as the packaged Mooncake trace, half of whose prompts exceed 8,192 tokens)."""


@attrs.frozen
class CostModel:
    """``step_seconds = a + b*prefill_tokens + c*decode_tokens + d*kv_tokens_attended`` (module docstring).

    Attributes:
        name: profile name, e.g. ``llama3-8b-a100-80gb``.
        a: seconds per step.
        b: seconds per prefill (prompt or recompute) token.
        c: seconds per decode token.
        d: seconds per KV token attended.
        hardware: key into :data:`GPUS` (or free text for a fitted profile).
        model: key into :data:`MODELS` (or free text).
        source: how the coefficients were obtained (derivation or measurement).
        measured: ``True`` for a profile fitted to measured step times (``schedspec calibrate``),
            ``False`` for the packaged profiles, derived on paper from datasheets (:func:`derive`).
        scheduler_config: ``(field, value)`` pairs a profile file gives for the lab's default
            :class:`~schedspec.spec.config.SchedulerConfig` (over the default profile's vLLM defaults).
        e: seconds per query-key pair of prefill attention (0 in the packaged profiles).
        f: seconds per prefill chunk (0 in the packaged profiles).
        token_knots: ``(tokens, seconds)`` knots of the piecewise form: when given, they replace
            ``a + b*prefill + c*decode`` by a piecewise-linear function of the step's tokens
            (:meth:`batch_base_seconds`; ``schedspec calibrate --form piecewise``). Empty in the packaged
            profiles.
        fitted_range: for a measured profile, the largest step its measurements cover, ``(field,
            tokens)`` pairs of :data:`FITTED_RANGE_FIELDS`; a step beyond them is extrapolated
            (:meth:`outside_fitted_range`). Empty for the packaged profiles (derived, not fitted).
    """

    name: str
    a: float
    b: float
    c: float
    d: float
    hardware: str = ""
    model: str = ""
    source: str = ""
    measured: bool = False
    scheduler_config: tuple[tuple[str, int | bool], ...] = ()
    e: float = 0.0
    f: float = 0.0
    token_knots: tuple[tuple[int, float], ...] = ()
    fitted_range: tuple[tuple[str, int], ...] = ()

    def __attrs_post_init__(self) -> None:
        knots = [t for t, _ in self.token_knots]
        if any(t < 1 for t in knots) or knots != sorted(set(knots)) or any(v < 0 for _, v in self.token_knots):
            raise CostModelError(f"profile {self.name!r}: token_knots must be (tokens >= 1, seconds >= 0) pairs "
                                 "with increasing tokens")

    def batch_base_seconds(self, tokens: int, prefill_tokens: int = 0, decode_tokens: int = 0) -> float:
        """The part of a step's time that depends on its token counts: ``a + b*prefill + c*decode``, or,
        with ``token_knots`` (the piecewise form), the piecewise-linear interpolation of the knots at
        ``tokens`` (``prefill + decode``), flat below the first knot and continued with the last
        segment's slope (at least 0) above the last."""
        if not self.token_knots:
            return self.a + self.b * prefill_tokens + self.c * decode_tokens
        knots = self.token_knots
        if tokens <= knots[0][0] or len(knots) == 1:
            return knots[0][1]
        for (t0, v0), (t1, v1) in zip(knots, knots[1:], strict=False):
            if tokens <= t1:
                return v0 + (v1 - v0) * (tokens - t0) / (t1 - t0)
        (t0, v0), (t1, v1) = knots[-2], knots[-1]
        return v1 + max(v1 - v0, 0.0) * (tokens - t1) / (t1 - t0)

    def outside_fitted_range(self, largest: dict[str, int], factor: float = 2.0) -> list[str]:
        """Where a run's largest step (``largest``: :data:`FITTED_RANGE_FIELDS` -> tokens) goes beyond
        ``factor`` times the largest step the profile was fitted on, in words (``"prefill_tokens 2,048 per
        step, fitted up to 128"``); empty when within range or when the profile has no fitted range."""
        out = []
        for field, fitted in self.fitted_range:
            value = largest.get(field)
            if value is not None and value > factor * fitted:
                out.append(f"{field} {value:,} per step, fitted up to {fitted:,}")
        return out

    @property
    def kind(self) -> str:
        """``"measured (fitted by schedspec calibrate)"`` or ``"derived, not measured"``."""
        return PROFILE_KIND["measured" if self.measured else "derived"]

    def step_seconds(self, prefill_tokens: int, decode_tokens: int, kv_tokens_attended: int = 0,
                     prefill_attention_pairs: int = 0, prefill_chunks: int = 0) -> float:
        """Duration of one step in seconds.

        Args:
            prefill_tokens: prompt (and recompute) tokens computed in the step, all requests together.
            decode_tokens: decode tokens in the step (one per decoding request, plus the drafts it verifies).
            kv_tokens_attended: sum over the batch of ``num_computed_tokens + tokens this step``.
            prefill_attention_pairs: query-key pairs of the prefill chunks (:class:`StepShape`).
            prefill_chunks: prefill items in the step.

        Raises:
            CostModelError: a negative count.

        An empty step (all zero) costs ``a``; engines do not run empty steps, so callers skip them.
        """
        if prefill_tokens < 0 or decode_tokens < 0 or kv_tokens_attended < 0:
            raise CostModelError(
                f"step_seconds: token counts must be >= 0 (prefill_tokens={prefill_tokens}, "
                f"decode_tokens={decode_tokens}, kv_tokens_attended={kv_tokens_attended})"
            )
        return (self.batch_base_seconds(prefill_tokens + decode_tokens, prefill_tokens, decode_tokens)
                + self.d * kv_tokens_attended + self.e * prefill_attention_pairs + self.f * prefill_chunks)

    def shape_seconds(self, shape: StepShape) -> float:
        """Duration in seconds of a step of this :class:`StepShape` (:meth:`step_seconds` of its counts)."""
        return self.step_seconds(shape.prefill_tokens, shape.decode_tokens, shape.kv_tokens_attended,
                                 shape.prefill_attention_pairs, shape.num_prefill_chunks)

    def plan_seconds(self, plan, state) -> float:
        """Duration in seconds of ``plan`` run on ``state`` (the state before the step): the time the
        lab charges for it, ``shape_seconds(step_shape(plan, state))``."""
        return self.shape_seconds(step_shape(plan, state))

    def batch_seconds(self, scheduled: Iterable) -> float:
        """Duration of a step given its batch as :class:`~schedspec.spec.trace.ScheduledTokens`
        (``prefill_tokens``, ``decode_tokens``, ``num_computed_tokens`` per request)."""
        prefill = decode = attended = pairs = chunks = 0
        for item in scheduled:
            n = item.prefill_tokens
            prefill += n
            decode += item.decode_tokens
            attended += item.num_computed_tokens + n + item.decode_tokens
            pairs += n * item.num_computed_tokens + n * (n + 1) // 2
            chunks += n > 0
        return self.step_seconds(prefill, decode, attended, pairs, chunks)


@attrs.frozen
class StepShape:
    """What one step computes, in the counts the cost model charges (the one definition shared by the
    lab's token sources, the PyTorch backend's runner and ``schedspec calibrate``).

    Attributes:
        prefill_tokens: tokens of prefill items (prompt chunks, and recompute after a preemption),
            all requests together.
        decode_tokens: tokens of decode items: a request with exactly one pending token that has
            computed its whole prompt (``not Request.is_prefill``, as the step trace's ``decode_tokens``)
            computes one, plus the ``d`` drafts it verifies with speculative decoding (charged at the
            decode rate: vLLM runs the verification in the same forward pass, ``num_scheduled_tokens``
            includes the drafts).
        kv_tokens_attended: sum over the scheduled items of ``num_computed_tokens + num_tokens``.
        num_prefill_chunks: prefill items.
        prefill_attention_pairs: query-key pairs of the prefill chunks' causal attention, sum over
            chunks of ``n * num_computed_tokens + n * (n + 1) / 2`` for a chunk of ``n`` tokens (charged
            at ``CostModel.e``, 0 in the packaged profiles).
    """

    prefill_tokens: int
    decode_tokens: int
    kv_tokens_attended: int
    num_prefill_chunks: int = 0
    prefill_attention_pairs: int = 0
    num_draft_tokens: int = 0
    """Of ``decode_tokens``, the drafts verified (speculative decoding; 0 without)."""

    @property
    def num_tokens(self) -> int:
        """All tokens computed in the step."""
        return self.prefill_tokens + self.decode_tokens


def step_shape(plan, state) -> StepShape:
    """The :class:`StepShape` of ``plan`` (a :class:`~schedspec.spec.state.StepPlan`) on ``state``
    (the :class:`~schedspec.spec.state.SchedulerState` before the step).

    An item is a decode when its request's only pending token is past the prompt (``not
    request.is_prefill``, as :func:`schedspec.reference.engine` records ``decode_tokens``); a decode
    that verifies ``d`` drafts (``item.spec_token_ids``) counts ``1 + d`` decode tokens; every other item
    is prefill, recompute included.

    Raises:
        KeyError: a scheduled request that is not live in ``state``.
    """
    prefill = decode = attended = chunks = pairs = drafts = 0
    requests = state.requests
    for item in plan.scheduled:
        request = requests[item.request_id]
        start, n = item.num_computed_tokens, item.num_tokens
        attended += start + n
        d = len(item.spec_token_ids)
        if n == 1 + d and start >= request.prompt_len and start + 1 == request.num_tokens:
            decode += n
            drafts += d
        else:
            prefill += n
            chunks += 1
            pairs += n * start + n * (n + 1) // 2
    return StepShape(prefill, decode, attended, chunks, pairs, drafts)


def derive(model_key: str, gpu_key: str) -> CostModel:
    """The first-principles profile of ``model_key`` on ``gpu_key``:

    - ``a = weight_bytes / hbm_bytes_per_s + step_overhead_s``
    - ``b = c = 2 * num_params / (bf16_flops * mfu)``
    - ``d = kv_bytes_per_token / hbm_bytes_per_s``

    Llama-3-8B on an A100-80GB: ``a = 16.06 GB / 2.039 TB/s + 2 ms = 7.88 ms + 2 ms = 9.88 ms``;
    ``b = c = 16.06 GFLOP / (312 TFLOP/s * 0.5) = 0.103 ms``; ``d = 131,072 B / 2.039 TB/s = 64.3 ns``.
    So a batch of 8 decodes at 1,000 tokens of context takes about 11 ms (≈ 90 tokens/s per
    request, the measured order for single-GPU Llama-3-8B), and a 2,048-token prefill chunk about
    221 ms. On an H100-80GB: a = 6.79 ms, b = c = 32.5 µs, d = 39.1 ns.

    Raises:
        CostModelError: unknown key.
    """
    if model_key not in MODELS:
        raise CostModelError(f"model={model_key!r}: unknown; known: {', '.join(sorted(MODELS))}")
    if gpu_key not in GPUS:
        raise CostModelError(f"hardware={gpu_key!r}: unknown; known: {', '.join(sorted(GPUS))}")
    model, gpu = MODELS[model_key], GPUS[gpu_key]
    weights_s = model.weight_bytes / gpu.hbm_bytes_per_s
    per_token_s = 2 * model.num_params / (gpu.bf16_flops * gpu.mfu)
    kv_s = model.kv_bytes_per_token / gpu.hbm_bytes_per_s
    source = (
        f"derived: a = {model.weight_bytes / 1e9:.2f} GB weights / {gpu.hbm_bytes_per_s / 1e12:.3f} TB/s "
        f"= {weights_s * 1e3:.2f} ms + {gpu.step_overhead_s * 1e3:.1f} ms overhead; "
        f"b = c = 2 * {model.num_params / 1e9:.2f}e9 FLOP / ({gpu.bf16_flops / 1e12:.0f} TFLOP/s * MFU {gpu.mfu}) "
        f"= {per_token_s * 1e6:.1f} us/token; "
        f"d = {model.kv_bytes_per_token // KiB} KiB KV / {gpu.hbm_bytes_per_s / 1e12:.3f} TB/s "
        f"= {kv_s * 1e9:.1f} ns/token"
    )
    return CostModel(
        name=f"{model_key}-{gpu_key}",
        a=weights_s + gpu.step_overhead_s,
        b=per_token_s,
        c=per_token_s,
        d=kv_s,
        hardware=gpu_key,
        model=model_key,
        source=source,
    )


DEFAULT_PROFILE = "llama3-8b-a100-80gb"
"""The profile used when none is named."""

PROFILES: dict[str, CostModel] = {
    profile.name: profile for profile in (derive(model, gpu) for model in MODELS for gpu in GPUS)
}
"""Named profiles, ``MODEL-GPU`` for every model and GPU: ``llama3-8b-a100-80gb`` (default),
``llama3-8b-h100-80gb``, and the 128k-context ``llama3.1-8b-a100-80gb`` and ``llama3.1-8b-h100-80gb``."""


def get_profile(name: str | CostModel | None = None) -> CostModel:
    """The profile called ``name`` (``None``: the default), or the profile file ``name`` when it ends
    in ``.json`` (:func:`load_profile`); a :class:`CostModel` is returned as is.

    Raises:
        CostModelError: unknown name (the message lists the known ones), or an unusable file.
    """
    if isinstance(name, CostModel):
        return name
    key = DEFAULT_PROFILE if name is None else name
    if key.endswith(".json"):
        return load_profile(key)
    if key not in PROFILES:
        raise CostModelError(f"cost profile {key!r}: unknown; known: {', '.join(sorted(PROFILES))} "
                             "(derived, not measured), or a PROFILE.json file written by schedspec calibrate")
    return PROFILES[key]


PROFILE_FILE_FIELDS = ("a_s_per_step", "b_s_per_prefill_token", "c_s_per_decode_token", "d_s_per_kv_token")
PROFILE_OPTIONAL_FIELDS = ("e_s_per_prefill_attention_pair", "f_s_per_prefill_chunk")
PROFILE_CONFIG_FIELDS = ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len")


PROFILE_SCHEMA_PATH = Path(__file__).with_name("cost-profile-schema.json")
"""The JSON Schema of a profile file (``cost-profile-schema.json`` beside this module)."""

MAX_PROFILE_BYTES = 64 * 1024 * 1024
"""Largest profile file read (64 MiB)."""

FITTED_RANGE_FIELDS = ("prefill_tokens", "decode_tokens", "tokens")
"""What :attr:`CostModel.fitted_range` bounds: a step's prefill tokens, decode tokens and all its tokens."""


@cache
def profile_schema() -> dict:
    """The JSON Schema of a profile file (:data:`PROFILE_SCHEMA_PATH`)."""
    return json.loads(PROFILE_SCHEMA_PATH.read_text(encoding="utf-8"))


def _fitted_range(data: dict) -> tuple[tuple[str, int], ...]:
    """The largest step the profile's measurements cover, from its ``points`` (or else its ``grid``)."""
    points = data.get("points") or []
    if points and all("prefill_tokens" in p and "decode_tokens" in p for p in points):
        prefill = max(p["prefill_tokens"] for p in points)
        decode = max(p["decode_tokens"] for p in points)
        tokens = max(p["prefill_tokens"] + p["decode_tokens"] for p in points)
        return (("prefill_tokens", prefill), ("decode_tokens", decode), ("tokens", tokens))
    grid = data.get("grid") or {}
    if "max_prefill" in grid and "max_decodes" in grid:
        return (("prefill_tokens", grid["max_prefill"]), ("decode_tokens", grid["max_decodes"]),
                ("tokens", grid["max_prefill"] + grid["max_decodes"]))
    return ()


def load_profile(path) -> CostModel:
    """Read a profile file written by ``schedspec calibrate`` (``{"record": "schedspec-cost-profile",
    "schema_version": 1, "name", "form", "coefficients": {a_s_per_step, b_s_per_prefill_token,
    c_s_per_decode_token, d_s_per_kv_token, e_s_per_prefill_attention_pair, f_s_per_prefill_chunk},
    "token_knots", "hardware", "model", "source", "scheduler_config", "grid", "points", ...}``), validated
    against its JSON Schema (:data:`PROFILE_SCHEMA_PATH`, ``jsonschema``): every key is known (a misspelt
    coefficient is refused, not ignored), every coefficient a number of seconds within bounds no engine
    exceeds, ``form`` one of the fitted forms and consistent with ``token_knots``.

    Raises:
        CostModelError: the file cannot be read, is not strict JSON, or breaks the schema (the message
            names the file, the line and the field: ``profile p.json:7: field coefficients.x: ...``).
    """
    from schedspec.spec.trace import (
        StrictJsonError,
        StrictValidator,
        json_line,
        schema_problem,
        strict_json_loads,
    )

    where = str(path)
    try:
        if Path(path).is_file() and Path(path).stat().st_size > MAX_PROFILE_BYTES:
            raise CostModelError(f"profile {where}: larger than {MAX_PROFILE_BYTES >> 20} MiB, not a profile")
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise CostModelError(f"profile {where}: cannot read ({error.strerror})") from None
    except UnicodeDecodeError:
        raise CostModelError(f"profile {where}: not UTF-8 text") from None
    try:
        data = strict_json_loads(text)
    except StrictJsonError as error:
        line = f":{error.lineno}" if error.lineno else ""
        raise CostModelError(f"profile {where}{line}: {error}") from None
    if not isinstance(data, dict) or data.get("record") != "schedspec-cost-profile":
        raise CostModelError(f"profile {where}: field record: expected \"schedspec-cost-profile\" (a file written "
                             "by schedspec calibrate)")
    problem = schema_problem(StrictValidator(profile_schema()), data, text)
    if problem is not None:
        line, message = problem
        raise CostModelError(f"profile {where}{f':{line}' if line else ''}: {message}")
    coefficients = data["coefficients"]
    values = [float(coefficients.get(key, 0.0)) for key in (*PROFILE_FILE_FIELDS, *PROFILE_OPTIONAL_FIELDS)]
    try:
        return CostModel(name=data["name"], a=values[0], b=values[1], c=values[2], d=values[3],
                         hardware=data.get("hardware", ""), model=data.get("model", ""),
                         source=data.get("source", ""), measured=True,
                         scheduler_config=tuple(data.get("scheduler_config", {}).items()), e=values[4],
                         f=values[5], token_knots=tuple((int(t), float(v)) for t, v in data.get("token_knots", [])),
                         fitted_range=_fitted_range(data))
    except CostModelError as error:
        line = json_line(text, ["token_knots"])
        raise CostModelError(f"profile {where}{f':{line}' if line else ''}: field token_knots: {error}") from None


GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization``."""
ACTIVATION_RESERVE_BYTES = 2 * GiB
"""Memory kept for activations at the profiling run's peak and for CUDA graphs (an estimate)."""
BLOCK_SIZE = 16
"""vLLM's default ``--block-size`` on CUDA."""


DERIVED_FIELDS = ("num_kv_blocks", "max_num_batched_tokens", "max_num_seqs")
"""Config fields :func:`default_scheduler_config` derives from others (re-derived after overrides)."""


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def default_scheduler_config(profile: str | CostModel | None = None,
                             overrides: dict[str, object] | None = None) -> tuple[dict[str, int | bool], str]:
    """The :class:`~schedspec.spec.config.SchedulerConfig` keyword arguments vLLM would use by default
    for the profile's model on one of the profile's GPUs, and a text saying how each was derived.

    For the default profile (Llama-3-8B, one A100-80GB, ``vllm serve`` defaults):

    - ``block_size = 16`` (vLLM's CUDA default).
    - ``num_kv_blocks = floor((80 GiB * 0.9 - 16.06 GB weights - 2 GiB activations/CUDA graphs)
      / (16 tokens * 128 KiB)) = 28,181`` blocks (450,896 tokens). vLLM sizes the KV cache the same
      way: ``gpu_memory_utilization`` (0.9) of device memory, minus weights and the peak activation
      memory of a profiling run; the 2 GiB reserve is an estimate.
    - ``max_num_batched_tokens = 2048``, ``max_num_seqs = 256``: vLLM's defaults for the OpenAI server
      on GPUs that are not H100-class (``EngineArgs.get_batch_defaults`` in vllm/engine/arg_utils.py;
      A100s are excluded from the larger defaults on purpose, vLLM PR #17885). The H100 profile gets
      8192 and 1024.
    - ``max_model_len = 8192``: Llama-3-8B's context length (131,072 for Llama-3.1-8B).
    - ``enable_chunked_prefill = True``: always on in vLLM V1.

    ``overrides`` (``--set``, a sweep point) are applied first and the fields derived from others are
    derived again from the values actually used, as vLLM's
    ``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`` (vllm/engine/arg_utils.py) does:
    ``num_kv_blocks`` from memory and ``block_size``; ``max_num_batched_tokens`` = the GPU default,
    raised to ``max_model_len`` when chunked prefill is off, capped at ``max_num_seqs * max_model_len``;
    ``max_num_seqs`` = ``min(GPU default, max_num_batched_tokens)``. A field given in ``overrides`` is
    used as given (marked ``(set)`` in the text); a derived field whose value changed is marked
    ``(re-derived)``. Override values that are not positive integers are left for the config's own
    validation to reject.

    Returns:
        ``(kwargs, derivation)``: field -> value (overrides included), ready for
        ``SchedulerConfig(**kwargs)``, and a multi-line text.

    Raises:
        CostModelError: unknown profile, or a profile whose hardware/model is not in
            :data:`GPUS`/:data:`MODELS`, or one whose weights leave no room for a KV cache.
    """
    cost = get_profile(profile)
    if cost.measured:
        kwargs, derivation = default_scheduler_config(DEFAULT_PROFILE)
        kwargs = {**kwargs, **dict(cost.scheduler_config)}
        given = ", ".join(f"{k} = {v}" for k, v in cost.scheduler_config) or "none"
        return kwargs, (f"profile {cost.name} (measured) gives: {given}; the other fields are the default "
                        f"profile's:\n{derivation}")
    if cost.hardware not in GPUS or cost.model not in MODELS:
        raise CostModelError(
            f"profile {cost.name!r}: hardware={cost.hardware!r} / model={cost.model!r} are not known "
            f"hardware ({', '.join(sorted(GPUS))}) and model ({', '.join(sorted(MODELS))}) keys"
        )
    given = dict(overrides or {})
    gpu, model = GPUS[cost.hardware], MODELS[cost.model]
    budget = int(gpu.memory_bytes * GPU_MEMORY_UTILIZATION)
    free = budget - model.weight_bytes - ACTIVATION_RESERVE_BYTES
    if free // (BLOCK_SIZE * model.kv_bytes_per_token) < 1:
        raise CostModelError(f"profile {cost.name!r}: the weights leave no memory for a KV cache")

    def chosen(field: str, default: int) -> int:
        return _int(given.get(field)) or default

    block_size = chosen("block_size", BLOCK_SIZE)
    max_model_len = chosen("max_model_len", model.max_model_len)
    chunked = given.get("enable_chunked_prefill", True)
    chunked = chunked if isinstance(chunked, bool) else True
    block_bytes = block_size * model.kv_bytes_per_token
    num_blocks = max(1, free // block_bytes)
    gpu_seqs = gpu.vllm_max_num_seqs
    batched = gpu.vllm_max_num_batched_tokens
    if not chunked:
        batched = max(max_model_len, batched)
    batched = min(chosen("max_num_seqs", gpu_seqs) * max_model_len, batched)
    batched = chosen("max_num_batched_tokens", batched)
    seqs = chosen("max_num_seqs", min(gpu_seqs, batched))
    defaults = {"block_size": BLOCK_SIZE, "num_kv_blocks": free // (BLOCK_SIZE * model.kv_bytes_per_token),
                "max_num_batched_tokens": gpu.vllm_max_num_batched_tokens, "max_num_seqs": gpu_seqs,
                "max_model_len": model.max_model_len, "enable_chunked_prefill": True}
    kwargs: dict[str, int | bool] = {
        "block_size": block_size,
        "num_kv_blocks": chosen("num_kv_blocks", int(num_blocks)),
        "max_num_batched_tokens": batched,
        "max_num_seqs": seqs,
        "max_model_len": max_model_len,
        "enable_chunked_prefill": chunked,
    }

    def mark(field: str) -> str:
        if field in given:
            return " (set)"
        if kwargs[field] != defaults[field]:
            return f" (re-derived; profile default {defaults[field]:,})"
        return ""

    derivation = "\n".join([
        f"vLLM defaults for {model.name} on one {gpu.name} (vllm serve)" + (", after --set:" if given else ":"),
        f"  block_size = {block_size}{mark('block_size') or ' (vLLM CUDA default)'}",
        f"  num_kv_blocks = floor(({gpu.memory_bytes / GiB:.0f} GiB * {GPU_MEMORY_UTILIZATION} "
        f"- {model.weight_bytes / GiB:.2f} GiB weights - {ACTIVATION_RESERVE_BYTES / GiB:.0f} GiB activations) "
        f"/ ({block_size} tokens * {model.kv_bytes_per_token // KiB} KiB)) = {num_blocks:,} "
        f"({num_blocks * block_size:,} tokens)" if "num_kv_blocks" not in given else
        f"  num_kv_blocks = {kwargs['num_kv_blocks']:,} (set; from memory it would be {num_blocks:,})",
        f"  max_num_batched_tokens = {batched:,}{mark('max_num_batched_tokens')}, max_num_seqs = {seqs:,}"
        f"{mark('max_num_seqs')} (vLLM EngineArgs.get_batch_defaults, OpenAI server: "
        f"{gpu.vllm_max_num_batched_tokens:,} / {gpu_seqs:,}; raised to max_model_len without chunked prefill)",
        f"  max_model_len = {max_model_len:,}{mark('max_model_len') or ' (model context length)'}",
        f"  enable_chunked_prefill = {chunked}{mark('enable_chunked_prefill') or ' (vLLM V1)'}",
    ])
    return kwargs, derivation
