"""SchedulerConfig validation: every bad field raises ConfigError naming that field, and the cross-field
rules (chunked prefill off needs a budget of max_model_len; the budget must hold a decode per sequence)."""

from __future__ import annotations

import pytest
from hypothesis import given

from schedspec.spec.config import ConfigError, SchedulerConfig, blocks_for_tokens
from schedspec.strategies import scheduler_configs

GOOD = {
    "block_size": 16,
    "num_kv_blocks": 64,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 8,
    "max_model_len": 256,
}


def make(**changes) -> SchedulerConfig:
    return SchedulerConfig(**{**GOOD, **changes})


def test_good_config_builds_with_vllm_like_defaults() -> None:
    config = make()
    assert config.enable_chunked_prefill is True
    assert config.long_prefill_token_threshold == 0
    assert config.enable_prefix_caching is False
    assert config.preemption_mode == "recompute"
    assert config.kv_capacity_tokens == 64 * 16


BAD_FIELDS = [
    ("block_size", 0),
    ("block_size", -16),
    ("block_size", 1.5),
    ("block_size", True),
    ("block_size", "16"),
    ("num_kv_blocks", 0),
    ("num_kv_blocks", None),
    ("max_num_batched_tokens", 0),
    ("max_num_batched_tokens", 2.0),
    ("max_num_seqs", 0),
    ("max_num_seqs", False),
    ("max_model_len", 0),
    ("max_model_len", -1),
    ("enable_chunked_prefill", 1),
    ("enable_chunked_prefill", "true"),
    ("enable_prefix_caching", 0),
    ("long_prefill_token_threshold", -1),
    ("long_prefill_token_threshold", True),
    ("long_prefill_token_threshold", 2.5),
    ("preemption_mode", "swap"),
    ("preemption_mode", ""),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_bad_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        make(**{field: value})
    assert caught.value.field == field
    assert caught.value.value == value or caught.value.value is value
    assert field in str(caught.value)


def test_chunked_prefill_off_needs_budget_of_max_model_len() -> None:
    with pytest.raises(ConfigError) as caught:
        make(enable_chunked_prefill=False, max_num_batched_tokens=255, max_model_len=256)
    assert caught.value.field == "max_num_batched_tokens"
    assert "max_model_len=256" in str(caught.value)
    # The boundary is allowed, and with chunked prefill on a small budget is fine.
    assert make(enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=256)
    assert make(enable_chunked_prefill=True, max_num_batched_tokens=8, max_model_len=256)


def test_budget_must_hold_one_decode_per_sequence() -> None:
    with pytest.raises(ConfigError) as caught:
        make(max_num_batched_tokens=7, max_num_seqs=8)
    assert caught.value.field == "max_num_batched_tokens"
    assert "max_num_seqs=8" in str(caught.value)
    assert make(max_num_batched_tokens=8, max_num_seqs=8)


def test_cache_smaller_than_max_model_len_is_allowed() -> None:
    # vLLM refuses this at engine start; the spec rejects the requests that cannot fit one by one.
    config = make(num_kv_blocks=2, block_size=16, max_model_len=256)
    assert config.kv_capacity_tokens == 32 < config.max_model_len


def test_with_changes_validates_again() -> None:
    config = make()
    with pytest.raises(ConfigError) as caught:
        config.with_changes(max_num_seqs=0)
    assert caught.value.field == "max_num_seqs"
    assert config.with_changes(max_num_seqs=4).max_num_seqs == 4
    assert config.max_num_seqs == 8  # unchanged: frozen


def test_from_dict_names_unknown_and_missing_keys() -> None:
    with pytest.raises(ConfigError) as caught:
        SchedulerConfig.from_dict({**GOOD, "gpu_memory_utilization": 0.9})
    assert caught.value.field == "gpu_memory_utilization"
    missing = dict(GOOD)
    del missing["max_model_len"]
    with pytest.raises(ConfigError) as caught:
        SchedulerConfig.from_dict(missing)
    assert caught.value.field == "max_model_len"
    with pytest.raises(ConfigError) as caught:
        SchedulerConfig.from_dict({**GOOD, "block_size": 0})
    assert caught.value.field == "block_size"


def test_to_dict_round_trips() -> None:
    config = make(enable_chunked_prefill=False, max_num_batched_tokens=300, long_prefill_token_threshold=0)
    assert SchedulerConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("tokens", "block_size", "blocks"),
    [(0, 16, 0), (-5, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3), (7, 1, 7)],
)
def test_blocks_for_tokens_is_a_ceiling(tokens: int, block_size: int, blocks: int) -> None:
    assert blocks_for_tokens(tokens, block_size) == blocks


@given(scheduler_configs())
def test_generated_configs_are_valid_and_round_trip(config: SchedulerConfig) -> None:
    # The strategy the stateful suite uses produces only valid configs (construction validates).
    assert SchedulerConfig.from_dict(config.to_dict()) == config
    assert config.max_num_batched_tokens >= config.max_num_seqs
    if not config.enable_chunked_prefill:
        assert config.max_num_batched_tokens >= config.max_model_len
        assert config.long_prefill_token_threshold == 0
