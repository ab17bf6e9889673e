"""The step-time model and the vLLM-default config (schedspec.reference.cost_model)."""

from __future__ import annotations

import pytest

from schedspec.reference.cost_model import (
    DEFAULT_PROFILE,
    MODELS,
    PROFILES,
    CostModel,
    CostModelError,
    default_scheduler_config,
    get_profile,
)
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.trace import ScheduledTokens


def test_step_seconds_is_linear():
    model = CostModel("toy", a=1.0, b=2.0, c=3.0, d=4.0)
    assert model.step_seconds(10, 5, 100) == 1.0 + 20.0 + 15.0 + 400.0
    assert model.step_seconds(0, 0, 0) == 1.0


def test_batch_seconds_counts_context_plus_new_tokens():
    model = CostModel("toy", a=1.0, b=2.0, c=3.0, d=4.0)
    batch = [ScheduledTokens("p", 100, 50, 0), ScheduledTokens("d", 30, 0, 1)]
    # prefill 50, decode 1, attended (100 + 50) + (30 + 1) = 181
    assert model.batch_seconds(batch) == model.step_seconds(50, 1, 181)


def test_negative_counts_are_refused():
    with pytest.raises(CostModelError, match="prefill_tokens=-1"):
        PROFILES[DEFAULT_PROFILE].step_seconds(-1, 0, 0)


def test_llama3_8b_kv_bytes_per_token():
    # 32 layers * 8 KV heads * 128 dims * 2 (K and V) * 2 bytes = 128 KiB
    assert MODELS["llama3-8b"].kv_bytes_per_token == 131_072


def test_a100_profile_from_first_principles():
    model = PROFILES["llama3-8b-a100-80gb"]
    assert get_profile() is model and get_profile(None) is model and get_profile(model) is model
    # weights 16.06 GB / 2.039 TB/s = 7.877 ms, plus 2 ms overhead
    assert model.a == pytest.approx(16.0605e9 / 2.039e12 + 0.002, rel=1e-3)
    # 2 * 8.03e9 FLOP / (312e12 FLOP/s * 0.5)
    assert model.b == pytest.approx(1.0295e-4, rel=1e-3) and model.c == model.b
    # 128 KiB / 2.039 TB/s
    assert model.d == pytest.approx(6.428e-8, rel=1e-3)
    assert "derived" in model.source and model.hardware == "a100-80gb" and model.model == "llama3-8b"


def test_fixed_cost_dominates_small_batches():
    model = PROFILES[DEFAULT_PROFILE]
    small = model.step_seconds(0, 4, 4 * 1000)
    assert model.a / small > 0.8
    assert 0.008 < small < 0.015  # ~80-120 tokens/s per request: single-GPU Llama-3-8B decode
    assert model.step_seconds(2048, 0, 2048) > 10 * model.a  # a full prefill chunk is compute-bound


def test_h100_is_faster():
    a100, h100 = PROFILES["llama3-8b-a100-80gb"], PROFILES["llama3-8b-h100-80gb"]
    for counts in [(0, 1, 500), (2048, 0, 2048), (0, 256, 256_000)]:
        assert h100.step_seconds(*counts) < a100.step_seconds(*counts)


def test_unknown_profile():
    with pytest.raises(CostModelError, match="llama3-8b-a100-80gb"):
        get_profile("gpt-5-tpu")


def test_default_scheduler_config_a100():
    kwargs, derivation = default_scheduler_config()
    # floor((0.9 * 80 GiB - 16,060,522,496 B weights - 2 GiB) / (16 * 131,072 B))
    #   = floor((77,309,411,328 - 16,060,522,496 - 2,147,483,648) / 2,097,152) = floor(28,181.6)
    assert kwargs == {
        "block_size": 16,
        "num_kv_blocks": 28_181,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 256,
        "max_model_len": 8192,
        "enable_chunked_prefill": True,
    }
    SchedulerConfig(**kwargs)
    assert "28,181" in derivation and "get_batch_defaults" in derivation


def test_default_scheduler_config_h100_uses_larger_vllm_defaults():
    kwargs, _ = default_scheduler_config("llama3-8b-h100-80gb")
    assert (kwargs["max_num_batched_tokens"], kwargs["max_num_seqs"]) == (8192, 1024)
    SchedulerConfig(**kwargs)


def test_default_scheduler_config_needs_known_hardware():
    with pytest.raises(CostModelError, match="hardware"):
        default_scheduler_config(CostModel("fitted", 0.01, 1e-4, 1e-4, 0.0, hardware="my-gpu"))


def test_long_context_profile_llama31_128k():
    # Llama-3.1-8B: Llama-3-8B's weights and KV shape with a 131,072-token context; same memory
    # arithmetic, so the same 28,181 blocks on an A100-80GB (hand value above).
    kwargs, derivation = default_scheduler_config("llama3.1-8b-a100-80gb")
    assert kwargs["max_model_len"] == 131_072
    assert kwargs["num_kv_blocks"] == 28_181
    assert (kwargs["max_num_batched_tokens"], kwargs["max_num_seqs"]) == (2048, 256)
    assert "131,072" in derivation
    assert MODELS["llama3.1-8b"].max_model_len == 131_072
    kwargs, _ = default_scheduler_config("llama3.1-8b-h100-80gb")
    assert (kwargs["max_num_batched_tokens"], kwargs["max_num_seqs"]) == (8192, 1024)


def test_derived_fields_follow_overrides():
    # block_size 32: floor(58,101,405,184 B / (32 * 131,072 B)) = floor(14,090.8) = 14,090 blocks.
    kwargs, derivation = default_scheduler_config(overrides={"block_size": 32})
    assert kwargs["block_size"] == 32 and kwargs["num_kv_blocks"] == 14_090
    assert "re-derived" not in derivation.split("num_kv_blocks")[0]
    # Chunked prefill off: vLLM raises max_num_batched_tokens to max_model_len (arg_utils.py).
    kwargs, derivation = default_scheduler_config(overrides={"enable_chunked_prefill": False,
                                                             "max_model_len": 16_384})
    assert kwargs["max_num_batched_tokens"] == 16_384
    assert "re-derived; profile default 2,048" in derivation and "(set)" in derivation
    # A field given is used as given, never re-derived.
    kwargs, _ = default_scheduler_config(overrides={"enable_chunked_prefill": False, "max_num_batched_tokens": 9000})
    assert kwargs["max_num_batched_tokens"] == 9000
    # max_num_seqs defaults to min(GPU default, max_num_batched_tokens).
    kwargs, _ = default_scheduler_config(overrides={"max_num_batched_tokens": 128})
    assert kwargs["max_num_seqs"] == 128
    # Values that are not positive integers are left to the config's own validation.
    kwargs, _ = default_scheduler_config(overrides={"block_size": "x"})
    assert kwargs["block_size"] == 16
