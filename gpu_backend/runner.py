"""The token source: runs each scheduler step as one packed forward pass and samples the tokens.

:class:`Runner` implements the interface the engine loop calls,
``execute(plan, state) -> (sampled_token_ids, step_seconds)``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import torch

from schedspec.gpu_backend.config import SLIDING_ATTENTION, ModelConfig, tiny_model_config
from schedspec.gpu_backend.device import check_fits, resolve_device, resolve_dtype
from schedspec.gpu_backend.errors import BackendError, BlockTableError
from schedspec.gpu_backend.kv_cache import BlockLedger, PagedKVCache, layer_groups
from schedspec.gpu_backend.model import (
    AttentionView,
    DecodeGroup,
    LlamaModel,
    PackedBatch,
    PrefillChunk,
    visible,
)
from schedspec.gpu_backend.ngram import DEFAULT_LOOKUP, ngram_drafts
from schedspec.gpu_backend.sampling import sample, uniforms
from schedspec.gpu_backend.weights import (
    index_model_dir,
    load_model_dir,
    tiny_model_weights,
    weight_bytes,
)
from schedspec.reference.cost_model import step_shape
from schedspec.reference.fake_model import greedy_verify
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens
from schedspec.spec.kv_cache_groups import group_tables, groups_of, num_skipped_blocks
from schedspec.spec.state import SchedulerState, SpeculativeOutput, StepPlan, samples_this_step
from schedspec.spec.transitions import group_tables_after
from schedspec.spec.workload import EOS_TOKEN_ID, token_id_at, token_ids

RECORD_LOGITS = ("none", "last", "all")

CLOCKS = ("wall", "thread")
"""How a step's time is measured: ``"wall"`` (``time.perf_counter``; the default, and the only choice on
CUDA) or ``"thread"`` (``time.thread_time``, the CPU time of the calling thread; CPU device with one torch
thread only). On a CPU shared with other processes, wall time includes the time the thread waited for a
core; the thread's CPU time is the step's own work, as on an unshared core."""

DECODE_GROUP_BYTES = 1 << 20
"""On CPU, single-token items are attended in groups of similar length whose gathered keys plus values
take at most this many bytes per layer (one item at least), so each group's copy is still in the CPU cache
when attention reads it; on CUDA all of them form one group."""

ROTARY_TABLE_MAX_LEN = 1 << 16
"""Rotary ``cos``/``sin`` are precomputed for positions below ``min(max_model_len, this)``."""


def _prefix_hits(plan: StepPlan) -> dict[str, tuple[int, ...]]:
    """Request id -> hit blocks, from the plan items' ``cached_block_ids`` (absent before prefix caching)."""
    hits = {}
    for item in plan.scheduled:
        blocks = getattr(item, "cached_block_ids", ())
        if blocks:
            hits[item.request_id] = tuple(blocks)
    return hits


def _cached_blocks(state: SchedulerState) -> Collection[int]:
    """The blocks the spec state publishes in its prefix cache (``state.prefix_cache.block_hashes``), or
    none when the state has no prefix cache."""
    cache = getattr(state, "prefix_cache", None)
    hashes = getattr(cache, "block_hashes", None)
    return () if hashes is None else hashes.keys()


class Runner:
    """A paged, batched Llama-family model that samples the next token of each scheduled request.

    Args:
        config: the scheduler limits; the KV cache has ``num_kv_blocks`` blocks of ``block_size`` tokens.
        model: ``None`` for the built-in tiny model (no download), or a local Hugging Face model
            directory (``config.json`` + ``*.safetensors``; ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``, the
            latter's layers possibly mixing full and sliding-window attention). With
            ``config.kv_cache_groups`` each layer's KV is paged through its group's block tables
            (:func:`~schedspec.gpu_backend.kv_cache.layer_groups`); without, a sliding-window layer reads the
            full-attention tables through its window mask.
        device: ``"auto"`` (CUDA if available), ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (weights, activations and KV cache).
        debug: check every step's block tables against the blocks each request was given (raise
            :class:`BlockTableError`), fill freed blocks with NaN, and raise when logits come out NaN.
        eos_at_output: request id -> k: output token k (1-based) of that request is EOS
            (``EOS_TOKEN_ID``). EOS is masked (logit ``-inf``) at every other sample, so requests
            without an entry end only at their length limits.
        seed: seed of the per-request sampling generators (temperature sampling only).
        temperature: 0 for greedy; otherwise sampling temperature.
        top_p: nucleus sampling threshold in (0, 1].
        clock: ``"wall"`` or ``"thread"`` (:data:`CLOCKS`): how step times are measured.
        record_logits: ``"none"``; ``"last"``: keep the raw logits of each sampled position in
            :attr:`last_logits`; ``"all"``: also keep every computed position's logits in
            :attr:`step_logits` (computes ``lm_head`` on the whole batch).
        ngram_lookup: ``(prompt_lookup_min, prompt_lookup_max)`` of the n-gram drafter
            (:meth:`execute_speculative`, :mod:`schedspec.gpu_backend.ngram`); vLLM's defaults.

    Raises:
        BackendError: before anything is loaded or allocated, naming the field or file: a bad model
            directory or tensor, an unsupported architecture, a device/dtype the machine cannot run,
            ``max_model_len`` beyond the model's ``max_position_embeddings``, ``kv_cache_groups`` that do not
            match the model's layer kinds (or with ``debug``: the debug ledger tracks group 0's tables only),
            or a KV cache (plus weights) that does not fit in free memory.

    Attributes:
        model_config: the architecture in use.
        device, dtype: where and in what precision it runs.
        kv_cache: the :class:`PagedKVCache`.
        num_forward_calls: forward passes so far (one per non-empty step).
        last_logits: request id -> ``[vocab_size]`` float32 CPU logits (before EOS masking) of the
            requests that sampled in the last step (``record_logits`` ``"last"`` or ``"all"``); for an item
            with ``d`` drafts, ``[d + 1, vocab_size]``, the logits of every verified position.
        last_num_accepted_tokens: request id -> accepted drafts ``a`` (``0 <= a <= d``) of each item that
            verified ``d >= 1`` drafts in the last step: the spec's ``SpeculativeOutput.num_accepted_tokens``.
        step_logits: request id -> ``[num_tokens, vocab_size]`` float32 CPU logits of every position the
            last step computed (``record_logits="all"``).
        last_step_seconds: wall time of the last step in seconds (the step time, defined below).
        last_step_shape: the :class:`~schedspec.reference.cost_model.StepShape` of the last step (what
            the cost model charges for), ``None`` before the first step or after an empty one.

    The step time (one definition, shared with the cost model the lab charges and with
    ``schedspec calibrate``, which fits the cost model to it): the time (wall, or the thread's CPU time
    with ``clock="thread"``) from the plan to the
    sampled token ids, i.e. packing the batch's inputs, the forward pass and sampling, with CUDA
    synchronised before and after. It leaves out the scheduler's own time, the debug-mode ledger checks
    and the copies of ``record_logits``. The lab's cost model charges
    ``CostModel.shape_seconds(step_shape(plan, state))`` for the same step.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        model: str | os.PathLike[str] | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "float32",
        debug: bool = False,
        eos_at_output: Mapping[str, int] | None = None,
        seed: int = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        record_logits: str = "none",
        clock: str = "wall",
        ngram_lookup: tuple[int, int] = DEFAULT_LOOKUP,
    ) -> None:
        if not isinstance(config, SchedulerConfig):
            raise BackendError(f"config={config!r}: must be a SchedulerConfig", field="config")
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not temperature >= 0:
            raise BackendError(f"temperature={temperature!r}: must be a number >= 0", field="temperature")
        if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
            raise BackendError(f"top_p={top_p!r}: must be in (0, 1]", field="top_p")
        if clock not in CLOCKS:
            raise BackendError(f"clock={clock!r}: must be one of {list(CLOCKS)}", field="clock")
        if (not isinstance(ngram_lookup, tuple) or len(ngram_lookup) != 2
                or any(isinstance(n, bool) or not isinstance(n, int) for n in ngram_lookup)
                or not 1 <= ngram_lookup[0] <= ngram_lookup[1]):
            raise BackendError(f"ngram_lookup={ngram_lookup!r}: must be (min, max) with 1 <= min <= max",
                               field="ngram_lookup")
        if record_logits not in RECORD_LOGITS:
            raise BackendError(f"record_logits={record_logits!r}: must be one of {list(RECORD_LOGITS)}",
                               field="record_logits")
        eos = dict(eos_at_output or {})
        for request_id, k in eos.items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise BackendError(f"eos_at_output[{request_id!r}]={k!r}: must be an integer >= 1 (1-based)",
                                   field="eos_at_output")

        self.config = config
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        # Everything is checked before anything is generated, loaded or allocated.
        if model is None:
            model_config, where = tiny_model_config(), None
        else:
            model_config = ModelConfig.from_model_dir(model)
            where = index_model_dir(model, model_config)
        if config.max_model_len > model_config.max_position_embeddings:
            raise BackendError(
                f"max_model_len={config.max_model_len}: exceeds the model's max_position_embeddings="
                f"{model_config.max_position_embeddings}", field="max_model_len")
        self.layer_groups = layer_groups(model_config, config)
        """Per layer, ``(KV cache group, cache tensor)`` (:func:`~schedspec.gpu_backend.kv_cache.layer_groups`)."""
        if debug and config.kv_cache_groups:
            raise BackendError("debug=True with kv_cache_groups: the debug ledger checks group 0's block tables only "
                               "(not implemented for several groups)", field="kv_cache_groups")
        self.views = list(dict.fromkeys((group, model_config.layer_window(layer))
                                        for layer, (group, _) in enumerate(self.layer_groups)))
        """The distinct ``(KV cache group, window)`` of the layers: one ``AttentionView`` each per step."""
        num_tensors = 1 + max(tensor for _, tensor in self.layer_groups)
        kv_bytes = PagedKVCache.size_bytes(num_tensors, config.num_kv_blocks, config.block_size,
                                           model_config.num_key_value_heads, model_config.head_dim, self.dtype)
        check_fits(weight_bytes(model_config, self.dtype), kv_bytes, self.device)

        weights = tiny_model_weights()[1] if where is None else load_model_dir(where)
        self.model_config = model_config
        self.model_path = None if model is None else os.fspath(model)
        """The model directory, or ``None`` for the built-in tiny model."""
        self.model = LlamaModel(model_config, weights, self.device, self.dtype)
        self.model.layer_view = [self.views.index((group, model_config.layer_window(layer)))
                                 for layer, (group, _) in enumerate(self.layer_groups)]
        del weights
        if config.max_model_len <= ROTARY_TABLE_MAX_LEN:
            self.model.prepare_rotary(config.max_model_len)
        self.decode_group_bytes = DECODE_GROUP_BYTES if self.device.type == "cpu" else 0
        """Bytes of gathered keys plus values per decode group and layer (0: one group); see
        :data:`DECODE_GROUP_BYTES`."""
        self.debug = debug
        self.check_block_tables = debug
        """In debug mode, raise on ownership violations (tests may turn this off to see NaN poisoning)."""
        self.kv_cache = PagedKVCache(num_tensors, config.num_kv_blocks, config.block_size,
                                     model_config.num_key_value_heads, model_config.head_dim, self.dtype,
                                     self.device, fill=float("nan") if debug else 0.0,
                                     tensor_of_layer=[tensor for _, tensor in self.layer_groups])
        self.ledger = BlockLedger(config.num_kv_blocks, config.block_size) if debug else None
        self.eos_at_output = eos
        self.seed = seed
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.record_logits = record_logits
        self.ngram_lookup = ngram_lookup
        """``(prompt_lookup_min, prompt_lookup_max)`` of the n-gram drafter (:meth:`execute_speculative`)."""
        if clock == "thread":
            if self.device.type != "cpu":
                raise BackendError(f"clock='thread': only on a CPU device, not {self.device}", field="clock")
            if torch.get_num_threads() != 1:
                raise BackendError(f"clock='thread': needs torch.set_num_threads(1) (it has {torch.get_num_threads()} "
                                   "threads; the others' CPU time would be missed)", field="clock")
        self.clock = clock
        """``"wall"`` or ``"thread"`` (:data:`CLOCKS`)."""
        self._now = time.perf_counter if clock == "wall" else time.thread_time
        self.num_forward_calls = 0
        self.last_logits: dict[str, torch.Tensor] = {}
        self.step_logits: dict[str, torch.Tensor] = {}
        self.last_step_seconds = 0.0
        self.last_step_shape = None
        self.last_num_accepted_tokens: dict[str, int] = {}

    @property
    def vocab_size(self) -> int:
        """Token ids the model knows: ``[0, vocab_size)``."""
        return self.model_config.vocab_size

    def describe(self) -> str:
        """One line naming the model, its shape, the dtype and the device (for run-condition headers),
        e.g. ``built-in tiny model (LlamaForCausalLM, 4 layers, hidden 256, 4/2 heads, vocab 4096),
        float32 on cpu``."""
        c = self.model_config
        name = "built-in tiny model" if self.model_path is None else f"model {self.model_path}"
        device = str(self.device)
        if self.device.type == "cuda":
            device += f" ({torch.cuda.get_device_name(self.device)})"
        dtype = str(self.dtype).removeprefix("torch.")
        clock = "" if self.clock == "wall" else ", step times on the thread's CPU clock"
        layers = f"{c.num_hidden_layers} layers"
        if c.sliding_window is not None:
            layers += f" ({sum(1 for t in c.layer_types if t == SLIDING_ATTENTION)} sliding window {c.sliding_window})"
        return (f"{name} ({c.architecture}, {layers}, hidden {c.hidden_size}, "
                f"{c.num_attention_heads}/{c.num_key_value_heads} heads, vocab {c.vocab_size}), {dtype} on {device}"
                f"{clock}")

    def reset(self) -> None:
        """Forget all requests (a new run with the same weights): clears the ledger, counters and
        recorded logits; in debug mode the whole cache is NaN again."""
        if self.debug:
            self.kv_cache.fill_blocks(range(self.config.num_kv_blocks))
            self.ledger = BlockLedger(self.config.num_kv_blocks, self.config.block_size)
        self.num_forward_calls = 0
        self.last_logits = {}
        self.step_logits = {}
        self.last_num_accepted_tokens = {}
        self.last_step_seconds = 0.0
        self.last_step_shape = None

    def warm_up(self, tokens: int | None = None, decodes: int = 4) -> float:
        """Run a few throw-away steps (a prefill of ``tokens`` tokens, default
        ``max_num_batched_tokens``, then ``decodes`` decode steps of it) so that one-time costs (memory
        first touched by the largest step's tensors, lazy kernel and library initialisation) fall
        outside the measured steps, then :meth:`reset`. Uses blocks from the start of the pool, which a
        run overwrites before reading (in debug mode they are NaN again after the reset). Returns the
        warm-up's wall time in seconds.

        The prefill is shortened to fit a small KV cache or ``max_model_len``; with room for fewer
        than two tokens nothing runs (0.0).
        """
        from schedspec.spec.state import ScheduledRequest
        from schedspec.spec.transitions import add_request, apply_plan
        from schedspec.spec.workload import RequestSpec

        size = self.config.block_size
        if tokens is None:
            tokens = self.config.max_num_batched_tokens
        total = tokens + decodes
        num_groups = len(groups_of(self.config))  # each group's table covers the request (no window frees here)
        room = min(self.config.num_kv_blocks // num_groups * size, self.config.max_model_len)
        if total > room:
            decodes = min(decodes, max(room - 1, 0) // 2)
            tokens = room - decodes
            if tokens < 1 or room < 2:
                return 0.0
        started = time.perf_counter()
        state = add_request(SchedulerState.initial(self.config),
                            RequestSpec("warm-up", prompt_len=tokens, max_tokens=decodes + 1).to_request(0))
        saved, self.ledger = self.ledger, None
        try:
            for _ in range(decodes + 1):
                request = state.requests.get("warm-up")
                if request is None:  # ended early (max_model_len)
                    break
                start = request.num_computed_tokens
                n = request.num_tokens - start
                free = state.free_block_ids
                new = []
                for table in group_tables(request) + ((),) * (num_groups - 1 - len(request.group_block_ids)):
                    need = blocks_for_tokens(start + n, size) - len(table)
                    new.append(tuple(free[:need]))
                    free = free[need:]
                plan = StepPlan(scheduled=(ScheduledRequest("warm-up", start, n, new[0],
                                                            group_new_block_ids=tuple(new[1:])),))
                sampled, _ = self.execute(plan, state)
                state = apply_plan(state, plan, sampled, self.config).state
        finally:
            self.ledger = saved
        self.reset()
        return time.perf_counter() - started

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute(self, plan: StepPlan, state: SchedulerState, *,
                prefix_hits: Mapping[str, Sequence[int]] | None = None,
                cached_blocks: Collection[int] | None = None) -> tuple[dict[str, int], float]:
        """Run one step: one forward pass over every scheduled chunk, then sample.

        Speculative decoding (greedy verification): a decode item with ``d >= 1`` drafts
        (``item.spec_token_ids``) computes ``1 + d`` tokens, positions ``[c, c + 1 + d)`` for ``c =
        num_computed_tokens = request.num_tokens - 1``: its pending token then the drafts, in the same
        forward pass as the rest of the batch (vLLM 0.32 ``GPUModelRunner._prepare_inputs``:
        ``num_scheduled_tokens`` includes the drafts). The ``d + 1`` greedy tokens ``g`` of those
        positions decide (:func:`schedspec.reference.fake_model.greedy_verify`, the fake models' too): ``a``
        drafts are accepted (:attr:`last_num_accepted_tokens`) and ``g[a]`` is the request's sampled token, which is what the
        spec's ``apply_plan`` takes (``sampled_token_ids`` and ``SpeculativeOutput.num_accepted_tokens``).
        Only positions ``[c, c + 1 + a)`` stay computed; in debug mode the KV of the ``d - a`` rejected
        positions is overwritten with NaN at once and the ledger counts the request's written positions up
        to ``c + 1 + a`` only, so a later step that reads them (kept as computed, or published to the
        prefix cache) is caught. Stops among the accepted tokens are the scheduler's to apply (vLLM
        ``Scheduler.update_from_output`` checks each token).

        Prefix caching shares KV blocks, never copies them: a request admitted with a prefix hit has
        ``num_computed_tokens`` = the hit length and a block table that starts with the hit blocks,
        which another request computed (and may still hold); the step computes only the positions
        after the hit and attends to the shared blocks' keys and values where they are.

        Args:
            plan: the step; each scheduled chunk computes positions ``[num_computed_tokens,
                num_computed_tokens + num_tokens)`` and its block table is ``request.block_ids +
                prefix_hits[request] + new_block_ids``. Blocks of ``plan.preempted`` are released first.
            state: the scheduler state before the step.
            prefix_hits: request id -> the cached blocks that start its block table this step (vLLM
                ``KVCacheManager.get_computed_blocks``). Default: each scheduled item's
                ``cached_block_ids`` where the plan's items carry one (the prefix-cache design's
                ``ScheduledRequest`` field), else none.
            cached_blocks: in debug mode, the free blocks whose KV the scheduler keeps for later hits
                (published, refcount 0: vLLM's evictable blocks); freed blocks outside it are poisoned
                at once, cached ones when handed out again. Default: the blocks of
                ``state.prefix_cache.block_hashes`` when the state has a prefix cache, else none.

        Returns:
            ``(sampled, seconds)``: token id for each request that samples this step
            (:func:`~schedspec.spec.state.samples_this_step`; after its accepted drafts for an item with
            drafts), in ``[1, vocab_size)`` or ``EOS_TOKEN_ID`` where ``eos_at_output`` says so; and the
            step's wall time in seconds (input preparation, forward, sampling and verification; 0.0 for a
            step with nothing scheduled).

        Raises:
            BlockTableError: a block table too short for its chunk or naming a block outside the pool;
                in debug mode also any write or read of a block the request does not own, or NaN logits.
            BackendError: a scheduled request is not live, a chunk is out of the request's range, a token
                id is outside the model's vocabulary, drafts on an item that is not a decode of ``1 + d``
                tokens, or drafts with ``temperature > 0`` (only greedy verification is implemented: vLLM's
                rejection sampling of ``rejection_sampler.py`` is not).
        """
        hits = _prefix_hits(plan) if prefix_hits is None else {r: tuple(b) for r, b in prefix_hits.items() if b}
        drafts = {item.request_id: item.spec_token_ids for item in plan.scheduled if item.spec_token_ids}
        if drafts and self.temperature > 0:
            raise BackendError(f"step {state.step}: draft tokens for {sorted(drafts)} with temperature="
                               f"{self.temperature}: only greedy verification (temperature 0) is implemented",
                               field="spec_token_ids")
        if self.ledger is not None:
            kept = frozenset(_cached_blocks(state) if cached_blocks is None else cached_blocks)
            freed, problems = self.ledger.check_step(plan, state, hits, kept)
            self.kv_cache.fill_blocks(freed)
            if problems and self.check_block_tables:
                raise BlockTableError(f"step {state.step}: " + "; ".join(problems), field="block_ids")
        self.last_logits = {}
        self.step_logits = {}
        self.last_num_accepted_tokens = {}
        if not plan.scheduled:
            self.last_step_seconds = 0.0
            self.last_step_shape = None
            return {}, 0.0
        self._sync()
        started = self._now()
        batch, spans, samplers, max_position, slots = self._build_batch(plan, state, hits, drafts)
        logits = self.model.forward(batch, self.kv_cache, max_position)
        self.num_forward_calls += 1
        if self.record_logits == "all":
            rows = logits[[index for _, index, _ in samplers]] if samplers else logits[:0]
        else:
            rows = logits
        tokens = self._sample(rows, samplers)
        sampled: dict[str, int] = {}
        targets: dict[str, list[int]] = {}
        first_row: dict[str, int] = {}
        for row, ((request_id, _, _), token) in enumerate(zip(samplers, tokens, strict=True)):
            if request_id in drafts:
                first_row.setdefault(request_id, row)
                targets.setdefault(request_id, []).append(token)
            else:
                sampled[request_id] = token
        rejected_slots: list[int] = []
        computed_ends: dict[str, int] = {}
        starts = {item.request_id: item.num_computed_tokens for item in plan.scheduled}
        for request_id, ids in drafts.items():
            accepted, sampled[request_id] = greedy_verify(ids, targets[request_id].__getitem__)
            self.last_num_accepted_tokens[request_id] = accepted
            offset, n = spans[request_id]
            rejected_slots.extend(slots[offset + 1 + accepted:offset + n].tolist())
            computed_ends[request_id] = starts[request_id] + 1 + accepted
        self._sync()
        self.last_step_seconds = self._now() - started
        self.last_step_shape = step_shape(plan, state)

        if self.record_logits != "none":
            cpu = rows.cpu()
            self.last_logits = {request_id: cpu[i] for i, (request_id, _, _) in enumerate(samplers)
                                if request_id not in drafts}
            for request_id, ids in drafts.items():
                row = first_row[request_id]
                self.last_logits[request_id] = cpu[row:row + len(ids) + 1]
            if self.record_logits == "all":
                everything = logits.cpu()
                self.step_logits = {rid: everything[start:start + n] for rid, (start, n) in spans.items()}
        if self.ledger is not None:
            if rejected_slots:
                self.kv_cache.fill_slots(rejected_slots)
            self.ledger.commit(plan, state, hits, computed_ends)
            bad = torch.isnan(logits).any(dim=-1).cpu()
            if bool(bad.any()):
                if self.record_logits == "all":
                    culprits = [rid for rid, (start, n) in spans.items() if bool(bad[start:start + n].any())]
                else:
                    culprits = [samplers[i][0] for i in torch.nonzero(bad).flatten().tolist()]
                raise BlockTableError(
                    f"step {state.step}: NaN logits for request(s) {culprits}: the step read a freed "
                    "(NaN-poisoned) KV block", field="block_ids")
        return sampled, self.last_step_seconds

    def execute_speculative(self, plan: StepPlan,
                            state: SchedulerState) -> tuple[dict[str, int], float, SpeculativeOutput]:
        """:meth:`execute` with speculative decoding, the engine loop's token source protocol
        (``schedspec.reference.engine``): the step verifies the drafts its items carry (greedily, as
        :meth:`execute`), then the n-gram drafter (:func:`~schedspec.gpu_backend.ngram.ngram_drafts`,
        vLLM's method ``"ngram"``, :attr:`ngram_lookup`) proposes up to ``num_speculative_tokens`` drafts
        for each request that sampled, from its own tokens after the step (prompt, outputs, the accepted
        drafts and the sampled token). The spec ignores the drafts of a request that stops in the step.

        Returns:
            ``(sampled_token_ids, step_seconds, SpeculativeOutput(num_accepted_tokens, draft_token_ids))``.
        """
        sampled, seconds = self.execute(plan, state)
        accepted = dict(self.last_num_accepted_tokens)
        verified = {item.request_id: item.spec_token_ids for item in plan.scheduled if item.spec_token_ids}
        k, max_model_len = self.config.num_speculative_tokens, self.config.max_model_len
        proposals: dict[str, tuple[int, ...]] = {}
        for request_id, token in sampled.items():
            request = state.requests[request_id]
            kept = (*verified.get(request_id, ())[:accepted.get(request_id, 0)], token)
            sequence = np.concatenate([token_ids(request, 0, request.num_tokens), np.asarray(kept, dtype=np.int64)])
            drafts = ngram_drafts(sequence, k, max_model_len, self.ngram_lookup)
            if drafts:
                proposals[request_id] = drafts
        return sampled, seconds, SpeculativeOutput(accepted, proposals)

    def _build_batch(self, plan: StepPlan, state: SchedulerState, hits: Mapping[str, tuple[int, ...]],
                     drafts: Mapping[str, tuple[int, ...]]):
        """Pack the plan's chunks. Returns the :class:`PackedBatch`, request id -> (batch offset, tokens),
        ``(request id, batch index, output index)`` for each sampled position (the last token of each
        sampling request; every position of an item with drafts, in order), the largest position in the
        batch, and the ``[T]`` int64 slot of each batch token."""
        block_size = self.config.block_size
        num_groups = len(groups_of(self.config))
        total = sum(item.num_tokens for item in plan.scheduled)
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slots = [np.empty(total, dtype=np.int64) for _ in range(num_groups)]
        spans: dict[str, tuple[int, int]] = {}
        samplers: list[tuple[str, int, int]] = []
        decode_index: list[int] = []
        decode_tables: list[list[tuple[int, ...]]] = [[] for _ in range(num_groups)]
        decode_lens: list[int] = []
        decode_ids: list[int] = []
        decode_slots: list[list[int]] = [[] for _ in range(num_groups)]
        prefills: list[tuple[int, int, int, list[np.ndarray]]] = []
        offset = 0
        max_end = 0
        for item in plan.scheduled:
            request_id = item.request_id
            request = state.requests.get(request_id)
            if request is None:
                raise BackendError(f"step {state.step}: scheduled request {request_id!r} is not a live request",
                                   field="scheduled")
            start, n = item.num_computed_tokens, item.num_tokens
            end = start + n
            num_tokens = request.num_tokens
            draft = drafts.get(request_id, ())
            if draft and (start + 1 != num_tokens or n != 1 + len(draft)):
                raise BackendError(
                    f"step {state.step}: request {request_id!r}: {len(draft)} draft token(s) on a chunk "
                    f"[{start}, {end}) of a request with {num_tokens} tokens; drafts ride only on a decode "
                    f"item of 1 + {len(draft)} tokens starting at position {num_tokens - 1}",
                    field="spec_token_ids")
            if n < 1 or start < 0 or end - len(draft) > num_tokens:
                raise BackendError(
                    f"step {state.step}: request {request_id!r}: chunk [{start}, {end}) is outside its "
                    f"{num_tokens} tokens", field="num_tokens")
            tables = self._item_tables(state, request, item, hits.get(request_id, ()), end)
            spans[request_id] = (offset, n)
            if end > max_end:
                max_end = end
            if n == 1:  # decode: plain Python ints, written into the arrays below in one go
                decode_index.append(offset)
                decode_lens.append(end)
                decode_ids.append(token_id_at(request, start))
                for group, blocks in enumerate(tables):
                    decode_tables[group].append(blocks)
                    decode_slots[group].append(blocks[start // block_size] * block_size + start % block_size)
            else:
                pos = np.arange(start, end, dtype=np.int64)
                if draft:
                    input_ids[offset] = token_id_at(request, start)
                    input_ids[offset + 1:offset + n] = draft
                else:
                    input_ids[offset:offset + n] = token_ids(request, start, end)
                positions[offset:offset + n] = pos
                arrays = [np.asarray(blocks, dtype=np.int64) for blocks in tables]
                for group, block_array in enumerate(arrays):
                    slots[group][offset:offset + n] = block_array[pos // block_size] * block_size + pos % block_size
                prefills.append((offset, n, end, arrays))
            if draft:
                first_output = request.num_output_tokens + 1
                samplers.extend((request_id, offset + i, first_output + i) for i in range(n))
            elif samples_this_step(request, item):
                samplers.append((request_id, offset + n - 1, request.num_output_tokens + 1))
            offset += n
        if decode_index:
            input_ids[decode_index] = decode_ids
            positions[decode_index] = np.asarray(decode_lens, dtype=np.int64) - 1
            for group in range(num_groups):
                slots[group][decode_index] = decode_slots[group]

        if input_ids.min() < 0 or input_ids.max() >= self.vocab_size:
            for request_id, (first, n) in spans.items():
                bad = input_ids[first:first + n]
                if bad.min() < 0 or bad.max() >= self.vocab_size:
                    raise BackendError(
                        f"step {state.step}: request {request_id!r} has token id {int(bad.max())} outside the "
                        f"model's vocabulary [0, {self.vocab_size})", field="prompt_token_ids")

        device = self.device

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        slot_tensors = [tensor(array) for array in slots]
        views = []
        for group, window in self.views:
            decode_groups = (self._decode_groups(decode_index, decode_tables[group], decode_lens, window)
                             if decode_index else [])
            chunks = [self._prefill_chunk(first, n, end, arrays[group], window) for first, n, end, arrays in prefills]
            views.append(AttentionView(slot_tensors[group], decode_groups, chunks))
        if self.record_logits == "all":
            logits_index = np.arange(offset, dtype=np.int64)
        else:
            logits_index = np.asarray([index for _, index, _ in samplers], dtype=np.int64)
        batch = PackedBatch(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            views=views,
            logits_index=tensor(logits_index),
        )
        return batch, spans, samplers, max_end - 1, slots[0]

    def _item_tables(self, state: SchedulerState, request, item, hits: tuple[int, ...], end: int) -> list[tuple[int, ...]]:
        """Per KV cache group, the item's block table after the step, cut to the ``ceil(end / block_size)``
        blocks that cover positions ``[0, end)``: group 0's is ``request.block_ids + hits + new_block_ids``,
        groups 1..'s the spec's :func:`~schedspec.spec.transitions.group_tables_after`. In a sliding-window
        group, the first :func:`~schedspec.spec.kv_cache_groups.num_skipped_blocks` entries (at the item's
        ``num_computed_tokens``: wholly before the window of its first token, null or freed) are replaced
        by the first visible block, which the window mask hides.

        Raises:
            BlockTableError: a table too short for the chunk, or a block the chunk reads or writes outside
                ``[0, num_kv_blocks)`` (a null entry the window still sees included).
        """
        block_size, num_blocks = self.config.block_size, self.config.num_kv_blocks
        needed = blocks_for_tokens(end, block_size)
        tables = [request.block_ids + hits + item.new_block_ids]
        if self.config.kv_cache_groups:
            tables.extend(group_tables_after(request, item, self.config))
        result = []
        for group, (kind, table) in enumerate(zip(groups_of(self.config), tables, strict=True)):
            where = "" if group == 0 else f" of KV cache group {group}"
            if len(table) < needed:
                raise BlockTableError(
                    f"step {state.step}: request {item.request_id!r}: block table{where} {list(table)} holds "
                    f"{len(table) * block_size} tokens but the chunk ends at position {end}", field="new_block_ids")
            skipped = min(num_skipped_blocks(kind, item.num_computed_tokens, block_size), needed - 1)
            blocks = table[skipped:needed]
            if min(blocks) < 0 or max(blocks) >= num_blocks:
                raise BlockTableError(
                    f"step {state.step}: request {item.request_id!r}: block table{where} {list(table)} names a block "
                    f"outside [0, {num_blocks}) that the chunk reads or writes", field="new_block_ids")
            result.append((blocks[0],) * skipped + blocks)
        return result

    def _prefill_chunk(self, first: int, n: int, end: int, blocks: np.ndarray, window: int | None) -> PrefillChunk:
        """The :class:`PrefillChunk` of ``n`` tokens at batch index ``first`` ending at position ``end``, for
        layers of ``window`` (tokens, ``None``: full attention) reading the block table ``blocks``: the
        cache is read from the block of the first position the chunk's first token sees."""
        if end == n and (window is None or n <= window):  # starts at 0 and sees its whole self: no cache read
            return PrefillChunk(first, n, end, None, None)
        block_size, device = self.config.block_size, self.device
        key_start = 0 if window is None else max(0, end - n - window + 1) // block_size * block_size
        mask = visible(torch.arange(end - n, end, device=device), torch.arange(key_start, end, device=device), window)
        block_ids = torch.from_numpy(blocks[key_start // block_size:]).to(device, non_blocking=True)
        return PrefillChunk(first, n, end, block_ids, mask.repeat(self.model_config.num_queries_per_kv, 1), key_start)

    def _decode_groups(self, index: list[int], tables: list[tuple[int, ...]], lengths: list[int],
                       window: int | None = None) -> list[DecodeGroup]:
        """Split the single-token items into :class:`DecodeGroup` s: sorted by length, each group as large as
        ``decode_group_bytes`` allows (one group when it is 0). Tables are padded with their first block;
        each item sees the positions :func:`~schedspec.gpu_backend.model.visible` gives its token for
        ``window``."""
        block_size = self.config.block_size
        cfg = self.model_config
        block_bytes = 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * self.kv_cache.key[0].element_size()
        widths = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
        lens = np.asarray(lengths, dtype=np.int64)
        order = np.argsort(widths, kind="stable")
        width = int(widths.max())
        padded = np.repeat(np.fromiter((t[0] for t in tables), dtype=np.int64, count=len(tables))[:, None],
                           width, axis=1)
        for row, table in enumerate(tables):
            padded[row, :len(table)] = table
        valid = visible(lens - 1, np.arange(width * block_size), window)
        additive = np.where(valid, np.float32(0), np.float32(-np.inf))
        # Masked positions hold stale but finite keys/values, which the -inf mask removes exactly; only a
        # NaN-poisoned cache (debug) or an fp16 one (which may hold inf) needs them zeroed in the copy.
        zero_invalid = self.debug or self.dtype == torch.float16
        budget = self.decode_group_bytes
        batch_index = np.asarray(index, dtype=np.int64)
        device = self.device
        result = []
        start = 0
        while start < len(order):
            stop = len(order)
            if budget > 0:
                stop = start + 1
                while stop < len(order) and (stop + 1 - start) * widths[order[stop]] * block_bytes <= budget:
                    stop += 1
            members = order[start:stop]
            group_width = int(widths[members[-1]])
            length = group_width * block_size
            rows = len(members)
            mask = torch.from_numpy(additive[members, :length]).to(device=device, dtype=self.dtype)
            invalid = None
            if zero_invalid:
                invalid = torch.from_numpy(~valid[members, :length]).to(device).view(rows, length, 1, 1)
            result.append(DecodeGroup(
                index=torch.from_numpy(batch_index[members]).to(device),
                block_ids=torch.from_numpy(np.ascontiguousarray(padded[members, :group_width]).reshape(-1)).to(device),
                num_blocks=group_width,
                mask=mask.view(rows, 1, 1, length),
                invalid=invalid,
            ))
            start = stop
        return result

    def _sample(self, rows: torch.Tensor, samplers: list[tuple[str, int, int]]) -> list[int]:
        """Sample from ``rows`` ``[S, vocab]`` (one per entry of ``samplers``), EOS masked except where
        ``eos_at_output`` forces it. Returns one token id per entry of ``samplers``."""
        if not samplers:
            return []
        u = None
        if self.temperature > 0:
            u = uniforms(self.seed, [rid for rid, _, _ in samplers], [k for _, _, k in samplers])
        with torch.inference_mode():
            # ``rows`` is this step's own tensor: mask in place unless its raw values are kept (record_logits).
            masked = rows.clone() if self.record_logits != "none" else rows
            masked[:, EOS_TOKEN_ID] = -math.inf
            tokens = sample(masked, self.temperature, self.top_p, u).tolist()
        return [EOS_TOKEN_ID if self.eos_at_output.get(request_id) == output_index else int(token)
                for (request_id, _, output_index), token in zip(samplers, tokens, strict=True)]
