"""Differential test: the backend's logits equal Hugging Face transformers' on the same weights.

The reference is ``transformers``' own ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (fp32, CPU, eager
attention) loaded with ``from_pretrained`` from a directory the backend wrote; the backend runs the
same directory through its paged cache, on ``$SCHEDSPEC_DEVICE`` (default cpu), prefilling in one
piece and in chunks of every size, with a scrambled block order.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from schedspec.gpu_backend import Runner, random_weights, save_model_dir, save_tiny_model, tiny_model_config  # noqa: E402
from schedspec.gpu_backend.testing import device_for_tests, plan_step, run_step, state_with  # noqa: E402
from schedspec.spec.config import SchedulerConfig  # noqa: E402
from schedspec.spec.workload import RequestSpec  # noqa: E402

SEQ_LEN = 24
TOLERANCE = 1e-4
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=40, max_num_batched_tokens=64, max_num_seqs=4,
                         max_model_len=64)
SCRAMBLED = tuple(reversed(range(CONFIG.num_kv_blocks)))  # blocks handed out in descending id order


pytestmark = pytest.mark.usefixtures("exact_fp32_one_thread")


def _hf_model(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def _hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def _backend_logits(runner: Runner, chunk: int, prompt_len: int = SEQ_LEN) -> tuple[list[int], torch.Tensor]:
    """Prefill one request in chunks of ``chunk``; return its prompt ids and ``[prompt_len, vocab]`` logits."""
    runner.reset()
    state = state_with(CONFIG, [RequestSpec("r", prompt_len, 4)], free_block_ids=SCRAMBLED)
    prompt = list(state.requests["r"].prompt_token_ids)
    pieces = []
    while state.requests["r"].num_computed_tokens < prompt_len:
        state, _, _ = run_step(runner, state, CONFIG, plan_step(state, CONFIG, chunk))
        pieces.append(runner.step_logits["r"])
    return prompt, torch.cat(pieces)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _all_chunk_sizes_match(model_dir, prompt_len: int = SEQ_LEN) -> None:
    reference = _hf_model(model_dir)
    runner = Runner(CONFIG, model_dir, device=device_for_tests(), dtype="float32", debug=True, record_logits="all")
    expected = None
    for chunk in range(1, prompt_len + 1):
        prompt, got = _backend_logits(runner, chunk, prompt_len)
        if expected is None:
            expected = _hf_logits(reference, prompt)
        error = (got - expected).abs().max().item()
        assert error <= TOLERANCE, f"chunk={chunk}: max abs logit error {error:.3g} > {TOLERANCE}"


def test_tiny_llama_matches_transformers_for_every_chunk_size(tiny_llama):
    _all_chunk_sizes_match(tiny_llama)


def test_default_runner_is_the_saved_tiny_model(tiny_llama):
    """``Runner(config)`` (no model dir) computes the very weights ``save_tiny_model`` writes."""
    device = device_for_tests()
    from_dir = Runner(CONFIG, tiny_llama, device=device, record_logits="all")
    built_in = Runner(CONFIG, device=device, record_logits="all")
    _, a = _backend_logits(from_dir, SEQ_LEN)
    _, b = _backend_logits(built_in, SEQ_LEN)
    assert torch.equal(a, b)


def test_qwen2_with_qkv_biases_matches_transformers(tmp_path):
    config = tiny_model_config("Qwen2ForCausalLM", num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    assert config.qkv_bias and not config.o_bias
    weights = random_weights(config, seed=1)
    model_dir = save_model_dir(tmp_path / "qwen2", config, weights)
    assert type(_hf_model(model_dir)).__name__ == "Qwen2ForCausalLM"
    _all_chunk_sizes_match(model_dir)


def test_qwen2_with_sliding_window_layers_matches_transformers(tmp_path):
    """Qwen2 whose layers mix sliding-window (window 5 tokens) and full attention: transformers' own window
    convention (``masking_utils.sliding_window_overlay``) against the backend's, every chunk size."""
    config = tiny_model_config("Qwen2ForCausalLM", num_hidden_layers=3, hidden_size=128, intermediate_size=256,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=5)
    model_dir = save_model_dir(tmp_path / "qwen2-sliding", config, random_weights(config, seed=4))
    hf_config = _hf_model(model_dir).config
    assert hf_config.sliding_window == 5 and hf_config.layer_types[0] == "sliding_attention"
    _all_chunk_sizes_match(model_dir)


def test_llama_variant_biases_tied_llama3_rope_matches_transformers(tmp_path):
    """Llama with attention/mlp biases, tied embeddings, MQA (1 kv head) and llama3 rope scaling."""
    config = tiny_model_config(num_hidden_layers=2, hidden_size=128, intermediate_size=192, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=32, qkv_bias=True, o_bias=True, mlp_bias=True,
                               tie_word_embeddings=True, rope_type="llama3", rope_factor=8.0,
                               rope_original_max_position_embeddings=16, rope_theta=500000.0)
    model_dir = save_model_dir(tmp_path / "llama-variant", config, random_weights(config, seed=2))
    _all_chunk_sizes_match(model_dir, prompt_len=20)


def test_greedy_decode_matches_transformers_argmax(tiny_llama):
    """Prefill then decode 12 tokens (with a second request sharing every step); each sampled token is
    the argmax of transformers' logits over the whole sequence so far (EOS excluded), and every decode
    step's logits match."""
    reference = _hf_model(tiny_llama)
    runner = Runner(CONFIG, tiny_llama, device=device_for_tests(), record_logits="last")
    state = state_with(CONFIG, [RequestSpec("r", 10, 12), RequestSpec("other", 7, 12)], free_block_ids=SCRAMBLED)
    prompt = list(state.requests["r"].prompt_token_ids)
    logits = []
    while "r" in state.requests:
        state, _, _ = run_step(runner, state, CONFIG, plan_step(state, CONFIG, chunk=6))
        if "r" in runner.last_logits:
            logits.append(runner.last_logits["r"])
    outputs = list(state.finished["r"].output_token_ids)
    assert len(outputs) == len(logits) == 12
    expected = _hf_logits(reference, prompt + outputs)[len(prompt) - 1:]
    for k, (got, want) in enumerate(zip(logits, expected, strict=False)):
        assert (got - want).abs().max().item() <= TOLERANCE, f"output {k + 1}"
        want = want.clone()
        want[0] = -float("inf")
        assert outputs[k] == int(want.argmax())


def test_prefix_hit_logits_match_transformers(tiny_llama):
    """B shares its first 16 prompt tokens (4 blocks) with A. A is prefilled; B is admitted with
    ``num_computed_tokens`` = 16 and a block table that starts with A's first 4 blocks (shared in place,
    debug mode on), computes only positions 16..21, and its logits there equal transformers' on B's
    whole prompt."""
    from schedspec.spec.state import ScheduledRequest, StepPlan
    from schedspec.spec.transitions import add_request

    reference = _hf_model(tiny_llama)
    runner = Runner(CONFIG, tiny_llama, device=device_for_tests(), debug=True, record_logits="all")
    a = RequestSpec("a", 24, 4, prefix_group="shared", prefix_len=16)
    b = RequestSpec("b", 22, 4, prefix_group="shared", prefix_len=16)
    state = state_with(CONFIG, [a], free_block_ids=SCRAMBLED)
    state, _, _ = run_step(runner, state, CONFIG, plan_step(state, CONFIG))
    hit = state.requests["a"].block_ids[:4]
    state = add_request(state, b.to_request(state.step))
    prompt = list(state.requests["b"].prompt_token_ids)
    assert prompt[:16] == list(state.requests["a"].prompt_token_ids)[:16]
    new = tuple(x for x in state.free_block_ids if x not in hit)[:2]
    plan = StepPlan((ScheduledRequest("b", 16, 6, new),))
    runner.execute(plan, state, prefix_hits={"b": hit}, cached_blocks=set(hit))
    got = runner.step_logits["b"]
    assert got.shape[0] == 6  # only the positions after the hit were computed
    expected = _hf_logits(reference, prompt)[16:]
    error = (got - expected).abs().max().item()
    assert error <= TOLERANCE, f"max abs logit error {error:.3g} > {TOLERANCE}"
