"""Bad input: each problem raises BackendError (a ValueError) naming the field or file, before any
weights are loaded or the KV cache is allocated."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

import schedspec.gpu_backend.runner as runner_module  # noqa: E402
from schedspec.gpu_backend import BackendError, Runner, random_weights, save_model_dir, tiny_model_config  # noqa: E402
from schedspec.gpu_backend.testing import device_for_tests, plan_step, state_with  # noqa: E402
from schedspec.spec.config import SchedulerConfig  # noqa: E402
from schedspec.spec.workload import RequestSpec  # noqa: E402

CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=32, max_num_seqs=2, max_model_len=32)
SMALL = tiny_model_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16)
TENSOR = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture
def model_dir(tmp_path):
    return save_model_dir(tmp_path / "small", SMALL, random_weights(SMALL, seed=5))


def _edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _edit_tensors(model_dir, **changes):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(path))


def _raises(model, match, field=None, **kwargs):
    with pytest.raises(BackendError, match=match) as info:
        Runner(kwargs.pop("config", CONFIG), model, device=kwargs.pop("device", "cpu"), **kwargs)
    assert isinstance(info.value, ValueError)
    if field is not None:
        assert info.value.field == field
    return info.value


def test_small_model_dir_loads_and_runs(model_dir):
    runner = Runner(CONFIG, model_dir, device=device_for_tests())
    state = state_with(CONFIG, [RequestSpec("a", 5, 2)])
    sampled, seconds = runner.execute(plan_step(state, CONFIG), state)
    assert 1 <= sampled["a"] < SMALL.vocab_size and seconds > 0


def test_missing_directory(tmp_path):
    missing = tmp_path / "nowhere"
    _raises(missing, f"model directory '{missing}' does not exist", field="model")


def test_missing_config_json(model_dir):
    (model_dir / "config.json").unlink()
    error = _raises(model_dir, r"config\.json not found")
    assert error.path == str(model_dir / "config.json")


def test_config_json_that_is_not_json(model_dir):
    (model_dir / "config.json").write_text("{not json")
    _raises(model_dir, r"config\.json: cannot read JSON")


@pytest.mark.parametrize(
    ("changes", "field", "match"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures", r"'GPT2LMHeadModel'.*unsupported architecture"),
        ({"architectures": None, "model_type": "gpt2"}, "architectures", r"architectures.*is required"),
        ({"hidden_size": None}, "hidden_size", r"hidden_size='<missing>': is required"),
        ({"num_key_value_heads": 3}, "num_key_value_heads", r"must divide num_attention_heads=2"),
        ({"vocab_size": "many"}, "vocab_size", r"vocab_size='many': must be an integer"),
        ({"hidden_act": "gelu"}, "hidden_act", r"only 'silu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling", r"rope_type 'yarn' is not supported"),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "layer_types": "sliding"},
         "layer_types", r"must list \d+ of \['full_attention', 'sliding_attention'\]"),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 0},
         "sliding_window", r"must be an integer >= 1"),
    ],
)
def test_bad_config_fields_are_named(model_dir, changes, field, match):
    _edit_config(model_dir, **changes)
    error = _raises(model_dir, match, field=field)
    assert "config.json" in str(error)


def test_no_safetensors_file(model_dir):
    (model_dir / "model.safetensors").unlink()
    _raises(model_dir, r"no \*\.safetensors file")


def test_missing_tensor_is_named(model_dir):
    _edit_tensors(model_dir, **{TENSOR.replace(".", "__"): None})
    _raises(model_dir, rf"tensor '{TENSOR}' missing from \['model.safetensors'\]", field=TENSOR)


def test_mis_shaped_tensor_is_named_with_its_file(model_dir):
    _edit_tensors(model_dir, **{TENSOR.replace(".", "__"): torch.zeros(64, 31)})
    error = _raises(model_dir, rf"model\.safetensors: tensor '{TENSOR}' has shape \[64, 31\], expected \[64, 32\]",
                    field=TENSOR)
    assert error.path == str(model_dir / "model.safetensors")


def test_integer_tensor_is_refused(model_dir):
    _edit_tensors(model_dir, **{TENSOR.replace(".", "__"): torch.zeros(64, 32, dtype=torch.int32)})
    _raises(model_dir, rf"tensor '{TENSOR}' has dtype I32", field=TENSOR)


def test_corrupt_safetensors_file(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"\x00garbage")
    _raises(model_dir, r"model\.safetensors: cannot read safetensors file")


def test_untied_model_without_lm_head(model_dir):
    _edit_tensors(model_dir, lm_head__weight=None)
    _raises(model_dir, r"tensor 'lm_head.weight' missing", field="lm_head.weight")


@pytest.mark.parametrize("dtype", ["int8", "float64", torch.int32])
def test_unsupported_dtype(dtype):
    _raises(None, r"dtype=.*supported dtypes are float32, bfloat16, float16", field="dtype", dtype=dtype)


def test_bfloat16_runs_on_cpu(model_dir):
    runner = Runner(CONFIG, model_dir, device="cpu", dtype="bf16")
    assert runner.dtype == torch.bfloat16 and runner.kv_cache.key[0].dtype == torch.bfloat16
    state = state_with(CONFIG, [RequestSpec("a", 5, 2)])
    assert 1 <= runner.execute(plan_step(state, CONFIG), state)[0]["a"] < SMALL.vocab_size


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_cuda():
    _raises(None, r"device='cuda': CUDA is not available", field="device", device="cuda")


def test_unknown_device():
    _raises(None, r"device='tpu'", field="device", device="tpu")


def test_kv_cache_too_big_fails_before_any_work(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the memory check")

    for name in ("tiny_model_weights", "load_model_dir", "LlamaModel"):
        monkeypatch.setattr(runner_module, name, forbidden)
    huge = CONFIG.with_changes(num_kv_blocks=2**31 - 1)  # the largest a config takes (spec.config.MAX_CONFIG_INT)
    error = _raises(None, r"num_kv_blocks: the KV cache \(.* GiB\) plus weights", field="num_kv_blocks", config=huge)
    assert "do not fit" in str(error)


def test_max_model_len_beyond_the_model(model_dir):
    _edit_config(model_dir, max_position_embeddings=16)
    _raises(model_dir, r"max_model_len=32: exceeds the model's max_position_embeddings=16", field="max_model_len")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"record_logits": "some"}, "record_logits"),
        ({"eos_at_output": {"a": 0}}, "eos_at_output"),
        ({"config": {"block_size": 4}}, "config"),
    ],
)
def test_bad_runner_arguments(kwargs, field):
    _raises(None, rf"{field}", field=field, **kwargs)


def test_prompt_ids_outside_the_vocabulary_are_named(tmp_path):
    small_vocab = tiny_model_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, vocab_size=64)
    model_dir = save_model_dir(tmp_path / "v64", small_vocab, random_weights(small_vocab, seed=6))
    runner = Runner(CONFIG, model_dir, device=device_for_tests())
    state = state_with(CONFIG, [RequestSpec("a", 20, 2)])  # ids drawn from [1, 4096)
    with pytest.raises(BackendError, match=r"request 'a' has token id \d+ outside the model's vocabulary \[0, 64\)"):
        runner.execute(plan_step(state, CONFIG), state)
