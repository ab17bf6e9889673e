"""The backend runs sliding-window layers: its paged, batched, chunked logits equal a dense reference.

The model is a tiny random ``Qwen2ForCausalLM`` whose layers mix ``full_attention`` and ``sliding_attention``
(window ``WINDOW`` tokens, not a multiple of the block size). The schedule is the reference ``fcfs`` scheduler's
with ``kv_cache_groups`` (chunked prefill, a pool small enough that the blocks a window frees are handed to other
requests, and preemptions), run by the :class:`~schedspec.reference.engine.Engine` with the spec's checks on; the
backend pages each layer's KV through its group's block tables, and the groups' layers share cache tensors as in
vLLM, so a block freed while its window still saw it would be overwritten by its next holder. The reference is a
plain dense forward pass written here (torch only: no paging, no batching, the mask
``j <= i and i - j < window`` written out), teacher-forced on each request's final tokens.

Deliberate breaks: the backend's window off by one in either direction, and a scheduler that frees a block its
window still sees, each fail.
"""

from __future__ import annotations

import math

import attrs
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from schedspec.gpu_backend import BackendError, BlockTableError, Runner, random_weights, save_model_dir  # noqa: E402
from schedspec.gpu_backend import runner as runner_module  # noqa: E402
from schedspec.gpu_backend.config import tiny_model_config  # noqa: E402
from schedspec.gpu_backend.model import visible  # noqa: E402
from schedspec.gpu_backend.testing import device_for_tests  # noqa: E402
from schedspec.reference.engine import Engine  # noqa: E402
from schedspec.reference.scheduler import make_scheduler  # noqa: E402
from schedspec.spec import kv_cache_groups, transitions  # noqa: E402
from schedspec.spec.config import SchedulerConfig  # noqa: E402
from schedspec.spec.workload import EOS_TOKEN_ID, RequestSpec  # noqa: E402

WINDOW = 6
BLOCK_SIZE = 4
TOLERANCE = 1e-4
S, F = "sliding_attention", "full_attention"
FULL = {"kind": "full_attention"}
SLIDING = {"kind": "sliding_window", "sliding_window": WINDOW}

LAYOUTS = {
    # two groups of two layers: layer k of each group shares a cache tensor
    "two-groups": ((S, F, S, F), (FULL, SLIDING)),
    # vLLM's layout for 1 full : 2 sliding layers: three groups of one layer, all sharing one tensor
    "three-groups": ((F, S, S), (FULL, SLIDING, SLIDING)),
    # no groups: the sliding layers read the full-attention tables through their window mask
    "no-groups": ((S, F, S), ()),
}


pytestmark = pytest.mark.usefixtures("exact_fp32_one_thread")


def _model(tmp_path_factory, layer_types):
    cfg = tiny_model_config("Qwen2ForCausalLM", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_hidden_layers=len(layer_types),
                            layer_types=layer_types, sliding_window=WINDOW)
    weights = random_weights(cfg, seed=3)
    path = save_model_dir(tmp_path_factory.mktemp("sliding"), cfg, weights)
    return cfg, weights, path


def _config(groups, num_kv_blocks: int) -> SchedulerConfig:
    return SchedulerConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=16,
                           max_num_seqs=4, max_model_len=64, kv_cache_groups=groups)


WORKLOAD = [RequestSpec(f"r{i}", prompt, out, arrival_step=arrival)
            for i, (prompt, out, arrival) in enumerate([(19, 9, 0), (7, 12, 0), (30, 5, 1), (13, 10, 2), (25, 8, 3),
                                                        (3, 14, 5)])]


def dense_logits(cfg, weights, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]`` logits of one sequence, every position at once, with the plain masks."""
    w = {name: t.double() for name, t in weights.items()}
    n, heads, kv_heads, d = len(token_ids), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rotate(x, cos, sin):
        half = d // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    angles = torch.arange(n, dtype=torch.float64)[:, None] / cfg.rope_theta ** (torch.arange(0, d, 2) / d)
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q, k, v = (h @ w[f"{p}self_attn.{m}_proj.weight"].T + w[f"{p}self_attn.{m}_proj.bias"] for m in "qkv")
        q = rotate(q.view(n, heads, d), cos, sin)
        k = rotate(k.view(n, kv_heads, d), cos, sin).repeat_interleave(heads // kv_heads, dim=1)
        v = v.view(n, kv_heads, d).repeat_interleave(heads // kv_heads, dim=1)
        allowed = j <= i
        if cfg.layer_types[layer] == S:
            allowed = allowed & (i - j < cfg.sliding_window)
        scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(d)
        attn = torch.einsum("hij,jhd->ihd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)
        x = x + attn.reshape(n, heads * d) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return (rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T).float()


class _Recorder:
    """A token source around the runner: keeps each sampled token's logits and which blocks the windows freed
    and which of those were handed out again."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
        self.skipped: set[int] = set()
        self.reused: set[int] = set()

    def execute(self, plan, state):
        for item in plan.scheduled:
            new = set(item.new_block_ids).union(*map(set, item.group_new_block_ids))
            self.reused |= new & self.skipped
            self.skipped |= set(item.skipped_block_ids)
        sampled, seconds = self.runner.execute(plan, state)
        for request_id, token in sampled.items():
            request = state.requests[request_id]
            self.prompts[request_id] = list(request.prompt_token_ids)
            self.outputs.setdefault(request_id, {})[request.num_output_tokens] = (
                token, self.runner.last_logits[request_id])
        return sampled, seconds


def _run(cfg, path, groups, num_kv_blocks: int = 26, ok: bool = True):
    """Run the workload under the spec's checks (which must pass if ``ok``); returns the recorder and the
    engine's result."""
    config = _config(groups, num_kv_blocks)
    runner = Runner(config, model=path, device=device_for_tests(), record_logits="last")
    runner.warm_up(tokens=12)  # allocates in every group; a run after it must not see its KV
    recorder = _Recorder(runner)
    result = Engine(make_scheduler("fcfs", config), config, token_source=recorder).run(WORKLOAD)
    if ok:
        assert result.ok, [str(v) for v in result.violations[:3]]
    return recorder, result


def _max_difference(cfg, weights, recorder: _Recorder) -> float:
    worst = 0.0
    assert set(recorder.outputs) == {spec.request_id for spec in WORKLOAD}
    for spec in WORKLOAD:
        outputs = recorder.outputs[spec.request_id]
        assert sorted(outputs) == list(range(spec.max_tokens))
        tokens = [outputs[k][0] for k in range(spec.max_tokens)]
        sequence = recorder.prompts[spec.request_id] + tokens
        dense = dense_logits(cfg, weights, sequence[:-1])[spec.prompt_len - 1:]
        backend = torch.stack([outputs[k][1] for k in range(spec.max_tokens)])
        worst = max(worst, float((backend - dense).abs().max()))
        dense[:, EOS_TOKEN_ID] = -math.inf
        if worst <= TOLERANCE:  # greedy: each sampled token is the dense argmax
            assert tokens == dense.argmax(-1).tolist(), spec.request_id
    return worst


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request, tmp_path_factory):
    layer_types, groups = LAYOUTS[request.param]
    cfg, weights, path = _model(tmp_path_factory, layer_types)
    return request.param, cfg, weights, path, groups


def test_paged_chunked_sliding_window_equals_the_dense_reference(layout) -> None:
    name, cfg, weights, path, groups = layout
    recorder, result = _run(cfg, path, groups)
    assert _max_difference(cfg, weights, recorder) <= TOLERANCE
    chunks = sum(1 for r in result.records for s in r.scheduled if s.prefill_tokens and s.num_computed_tokens)
    assert chunks, "no prefill chunk that reads the cache in the schedule"
    assert any(r.preempted for r in result.records) or name == "no-groups", "no preemption in the schedule"
    if groups:  # the windows freed blocks and other tables got them while the sequences went on
        assert recorder.skipped and recorder.reused, (recorder.skipped, recorder.reused)


@pytest.mark.parametrize("shift", [1, -1])
def test_a_window_off_by_one_fails(layout, monkeypatch, shift: int) -> None:
    name, cfg, weights, path, groups = layout

    def off_by_one(query_positions, key_positions, window):
        return visible(query_positions, key_positions, None if window is None else window + shift)

    monkeypatch.setattr(runner_module, "visible", off_by_one)
    recorder, _ = _run(cfg, path, groups)
    assert _max_difference(cfg, weights, recorder) > TOLERANCE


def test_a_block_freed_while_the_window_sees_it_is_caught(layout, monkeypatch) -> None:
    """The scheduler's window frees one block early (the spec's count of skipped blocks, as the reference
    scheduler uses it, shifted by one once the window is full): the backend finds the null entry where the
    window still reads. With tables that keep the freed ids (the blocks go to the free queue and are handed
    on while their old tables still read them), the outputs go wrong: the pool is really shared and reused
    (the spec's checker names ``window-keeps-visible`` among others)."""
    name, cfg, weights, path, groups = layout
    if not groups:
        pytest.skip("without kv_cache_groups no window frees blocks")
    real = kv_cache_groups.num_skipped_blocks

    def early(group, num_computed_tokens, block_size):
        skipped = real(group, num_computed_tokens, block_size)
        return skipped + 1 if group.sliding_window is not None and num_computed_tokens >= group.sliding_window else skipped

    monkeypatch.setattr(kv_cache_groups, "num_skipped_blocks", early)
    with pytest.raises(BlockTableError, match=r"block table of KV cache group 1 \[-1, .* names a block outside"):
        _run(cfg, path, groups)

    tables_after = transitions.group_tables_after

    def keep_freed_ids(request, item, config):  # the blocks go to the free queue, but the tables keep their ids
        return tables_after(request, attrs.evolve(item, skipped_block_ids=()), config)

    monkeypatch.setattr(transitions, "group_tables_after", keep_freed_ids)
    monkeypatch.setattr(runner_module, "group_tables_after", keep_freed_ids)
    recorder, result = _run(cfg, path, groups, ok=False)
    assert "window-keeps-visible" in {v.name for v in result.violations}
    assert _max_difference(cfg, weights, recorder) > TOLERANCE


def test_groups_that_do_not_match_the_layers_are_refused(tmp_path_factory) -> None:
    cfg, _, path = _model(tmp_path_factory, (F, S, S))
    other = {"kind": "sliding_window", "sliding_window": WINDOW + 1}
    with pytest.raises(BackendError, match=r"kv_cache_groups=.*0 group\(s\) of sliding window 6"):
        Runner(_config((FULL, other), 26), model=path, device=device_for_tests())
    with pytest.raises(BackendError, match="debug=True with kv_cache_groups"):
        Runner(_config((FULL, SLIDING), 26), model=path, device=device_for_tests(), debug=True)


@pytest.mark.parametrize("changes", [
    {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": 7, "layer_types": [S, F, F, S]},
    {"use_sliding_window": False, "sliding_window": 7, "layer_types": [S, F, F, S]},
    {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 4},
    {},
])
def test_qwen2_config_fields_read_as_transformers_reads_them(changes) -> None:
    transformers = pytest.importorskip("transformers")
    from schedspec.gpu_backend.config import ModelConfig

    data = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, **changes}
    ours = ModelConfig.from_hf_dict(data)
    theirs = transformers.Qwen2Config(**{k: v for k, v in data.items() if k != "architectures"})
    windows = [theirs.sliding_window if kind == S else None for kind in theirs.layer_types]
    assert [ours.layer_window(layer) for layer in range(4)] == windows


def test_layers_split_into_groups_of_one_size_as_vllm() -> None:
    """Gemma-3-like 5 sliding : 1 full over 12 layers with vLLM's six groups of two layers: the full layers (5
    and 11) in group 0, the ten sliding ones strided over groups 1..5 (vLLM's ``layers[i::num_groups]``: layers
    0 and 6 in group 1, 1 and 7 in group 2, ...); a layer's tensor is its index in its group."""
    from schedspec.gpu_backend.kv_cache import layer_groups

    kinds = ((S,) * 5 + (F,)) * 2
    cfg = tiny_model_config("Qwen2ForCausalLM", num_hidden_layers=12, layer_types=kinds, sliding_window=WINDOW)
    got = layer_groups(cfg, _config((FULL,) + (SLIDING,) * 5, 26))
    assert got == ((1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (0, 0), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (0, 1))
    with pytest.raises(BackendError, match=r"6 group\(s\) of sliding window 6 for the model's 5 layer"):
        layer_groups(attrs.evolve(cfg, layer_types=(S,) * 5 + (F,) * 7), _config((FULL,) + (SLIDING,) * 6, 26))
