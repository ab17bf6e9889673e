"""Scheduler configuration: the limits every step of an iteration-level scheduler must respect.

Field names follow vLLM's ``SchedulerConfig`` and ``CacheConfig`` (``vllm/config/scheduler.py``,
``vllm/config/cache.py``) so that a config can be read off an engine's arguments unchanged.

Construction validates every field and every cross-field rule and raises :class:`ConfigError`
naming the field and the value. A KV cache that holds fewer tokens than ``max_model_len`` is
allowed (vLLM refuses it only at engine start): the requests that cannot fit are rejected one by one
at arrival (see :func:`schedspec.spec.admission.rejection_reason`).
"""

from __future__ import annotations

from typing import Any

import attrs

PREEMPTION_MODES = ("recompute",)
"""Preemption modes the spec defines. vLLM V1 has only recompute (``vllm/v1/core/sched/scheduler.py``
``_preempt_request``); swap was removed with V0, so the spec does not define it."""


SPECULATIVE_FIELDS = ("num_speculative_tokens", "num_lookahead_tokens")
"""The speculative-decoding fields of :class:`SchedulerConfig` (both 0 = off)."""


MAX_CONFIG_INT = 2**31 - 1
"""Largest integer a config field may hold (tokens, blocks, requests, steps): the trace format's bound on every
integer (``spec/trace-schema.json``: "at most 2^31 - 1"; vLLM's model runner keeps positions, block ids and
FlashAttention's ``window_size`` as 32-bit ints). A larger value is refused as unusable input, not run."""


KV_CACHE_GROUP_KINDS = ("full_attention", "sliding_window")
"""The kinds of KV cache group the spec defines: vLLM ``FullAttentionSpec`` and ``SlidingWindowSpec``
(``vllm/v1/kv_cache_interface.py``). vLLM's ``MambaSpec`` (a per-request state group) is not specified yet."""


@attrs.frozen
class KVCacheGroup:
    """One KV cache group of a hybrid model: the layers of one attention kind, with a block table per request.
    vLLM ``KVCacheGroupSpec`` (``vllm/v1/kv_cache_interface.py``), managed by a ``SingleTypeKVCacheManager``
    (``vllm/v1/core/single_type_kv_cache_manager.py``).

    Attributes:
        kind: ``"full_attention"`` (vLLM ``FullAttentionSpec``: every computed token's KV is kept until the
            request ends) or ``"sliding_window"`` (vLLM ``SlidingWindowSpec``: the token at position p attends
            positions ``[p - sliding_window + 1, p]``; blocks wholly before that are freed,
            ``SlidingWindowManager.remove_skipped_blocks``).
        sliding_window: the window in tokens (``SlidingWindowSpec.sliding_window``), an integer >= 1 for a
            sliding-window group; ``None`` for full attention.

    Raises:
        ConfigError: an unknown kind, or a window missing, not an integer >= 1, or given to full attention.
    """

    kind: str
    sliding_window: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind not in KV_CACHE_GROUP_KINDS:
            raise ConfigError("kv_cache_groups[].kind", self.kind, f"must be one of {list(KV_CACHE_GROUP_KINDS)}")
        window = self.sliding_window
        if self.kind == "sliding_window":
            if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_CONFIG_INT:
                raise ConfigError("kv_cache_groups[].sliding_window", window,
                                  f"must be an integer in [1, {MAX_CONFIG_INT}] (tokens) for a sliding_window group")
        elif window is not None:
            raise ConfigError("kv_cache_groups[].sliding_window", window, "is only for a sliding_window group")

    def to_dict(self) -> dict[str, Any]:
        """``{"kind": ...}`` plus ``"sliding_window"`` for a sliding-window group."""
        return {"kind": self.kind} if self.sliding_window is None else {"kind": self.kind,
                                                                        "sliding_window": self.sliding_window}


def _kv_cache_groups(value: Any) -> tuple[KVCacheGroup, ...]:
    """The converter of ``SchedulerConfig.kv_cache_groups``: a sequence of groups or of their dicts."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ConfigError("kv_cache_groups", value, "must be a list of groups")
    groups = []
    for group in value:
        if isinstance(group, KVCacheGroup):
            groups.append(group)
        elif isinstance(group, dict) and set(group) <= {"kind", "sliding_window"} and "kind" in group:
            groups.append(KVCacheGroup(**group))
        else:
            raise ConfigError("kv_cache_groups[]", group, 'must be {"kind": ..., "sliding_window": ...}')
    return tuple(groups)


PREFIX_CACHE_PUBLICATIONS = ("vllm", "sglang-radix")
"""The values of ``SchedulerConfig.prefix_cache_publication``: vLLM 0.32's automatic prefix caching
(``block_pool.py`` ``BlockPool.cache_full_blocks``) and SGLang 0.5.23's radix cache
(``mem_cache/radix_cache.py`` ``RadixCache``)."""


LIMIT_DEFAULTS: dict[str, Any] = {"max_loras": 0, "watermark": 0.0, "max_num_active_seqs": None,
                                   "long_prefill_token_threshold_adaptive": False, "prefill_schedule_interval": 1}
"""The per-step limits of vLLM's scheduler that are off by default, each with its default (off): a field
at its default is left out of :meth:`SchedulerConfig.to_dict`, so traces and run records of runs without
it are what they were before it existed."""


class ConfigError(ValueError):
    """A scheduler configuration is unusable. The message names the field(s) and the value(s)."""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{field}={value!r}: {reason}")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, value, "must be an integer")
    if value < 1:
        raise ConfigError(name, value, "must be >= 1")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(name, value, "must be true or false")


@attrs.frozen(cache_hash=True)  # hashed once: it keys remembered results (admission.rejection_reason)
class SchedulerConfig:
    """The limits a scheduler works under. Units are given per field.

    Attributes:
        block_size: tokens per KV-cache block (vLLM ``--block-size``, default 16).
        num_kv_blocks: usable KV-cache blocks in the pool (vLLM's ``num_gpu_blocks``).
        max_num_batched_tokens: token budget per step, prefill and decode tokens together.
        max_num_seqs: most requests in the running set at once.
        max_model_len: most tokens (prompt plus output) one request may reach.
        enable_chunked_prefill: a prompt may be computed over several steps (Sarathi-Serve §4).
        long_prefill_token_threshold: with chunked prefill, cap on one prefill chunk in tokens;
            0 means no cap (vLLM ``--long-prefill-token-threshold``).
        enable_prefix_caching: reuse the KV blocks of identical prompt prefixes (vLLM's automatic
            prefix caching; the spec's model is :mod:`schedspec.spec.prefix_cache`).
        preemption_mode: how a running request gives up its blocks; only ``"recompute"``.
        num_speculative_tokens: speculative decoding: most draft tokens a decode verifies in one step
            (k >= 0; 0 = off). vLLM ``SpeculativeConfig.num_speculative_tokens`` (``--speculative-config
            '{"num_speculative_tokens": k, ...}'``, read as ``VllmConfig.num_speculative_tokens``). A decode
            that carries d <= k drafts computes 1 + d tokens (:class:`~schedspec.spec.state.ScheduledRequest`).
        num_lookahead_tokens: speculative decoding: KV slots every scheduled request is given past the
            tokens it computes, for a drafter that writes KV ahead (tokens; 0 without speculative
            decoding). vLLM 0.32 derives it from the method (``VllmConfig.num_lookahead_tokens``: 0 for
            n-gram, k for EAGLE, MTP and a draft model, k + 1 for DFlash) and passes it to every
            ``KVCacheManager.allocate_slots`` of ``Scheduler.schedule``, which allocates
            ``min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, max_model_len)`` slots.
        max_loras: LoRA: most distinct LoRA adapters (``Request.lora_int_id > 0``) the requests of one
            step may use (vLLM ``LoRAConfig.max_loras``, ``--max-loras``); 0 = LoRA off (no
            ``LoRAConfig``: vLLM has no limit then; its own default with ``--enable-lora`` is 1).
        watermark: a fraction in [0, 1) of the KV cache kept free when a waiting request is admitted while
            another request runs (vLLM ``SchedulerConfig.watermark``, default 0 = off):
            :attr:`watermark_blocks` blocks; rule ``watermark``.
        max_num_active_seqs: most requests admission fills the running set to (vLLM
            ``SchedulerConfig.max_num_active_seqs``, at most ``max_num_seqs``; ``None`` = ``max_num_seqs``):
            :attr:`active_seq_cap`; rule ``active-sequence-cap``.
        long_prefill_token_threshold_adaptive: the threshold's floor (vLLM's field of that name, default
            false): a positive ``long_prefill_token_threshold`` is raised to a fair share of the budget,
            :meth:`effective_long_prefill_threshold`.
        prefill_schedule_interval: vLLM 0.33's local prefill cadence (``SchedulerConfig.prefill_schedule_interval``,
            default 1 = off; in 0.32 the option exists but only the data-parallel MoE engine core obeys it):
            with N > 1, a step is *held* while fewer than N executed steps separate it from the last step that
            carried a prefill, some running request decodes, and the last release step drained the queue;
            a held step carries no prefill (:func:`~schedspec.spec.state.prefill_held`; rule ``prefill-cadence``).
        prefix_cache_publication: with ``enable_prefix_caching``, when a computed block becomes hittable and what
            a publication may do (:data:`PREFIX_CACHE_PUBLICATIONS`; :mod:`~schedspec.spec.prefix_cache`).
            ``"vllm"`` (the default): every full computed block is published at the end of the step that
            computed it, a hit is the longest published chain (rule ``prefix-hit-longest``), no de-duplication
            (vLLM ``BlockPool.cache_full_blocks``). ``"sglang-radix"``: SGLang 0.5.23's ``RadixCache``: a prefill
            chunk's blocks are published at the end of its step (``Scheduler.process_batch_result_prefill`` ->
            ``RadixCache.cache_unfinished_req``), decoded blocks only when the request finishes
            (``cache_finished_req``), never at a retraction; a hit is at most the longest published chain (a
            bound: ``prefix-hit-longest`` does not apply); and a publication may **de-duplicate**
            (``ScheduledRequest.deduplicated_block_ids``, rule ``deduplicate-at-publication``).
        kv_cache_groups: a hybrid model's KV cache groups (:class:`KVCacheGroup`), in vLLM's group order;
            empty (the default) = one full-attention group, the spec as it was before groups. Group 0 must be
            full attention: its block table is ``Request.block_ids``, those of groups 1.. are
            ``Request.group_block_ids``. As vLLM 0.32 (``KVCacheCoordinator.__init__`` builds one
            ``BlockPool`` of ``kv_cache_config.num_blocks``), every group takes its blocks from the one pool of
            ``num_kv_blocks`` blocks, and every group has ``block_size`` tokens per block (vLLM allows
            different block sizes whose least common multiple is the scheduling granularity; the spec does
            not yet). See :mod:`schedspec.spec.kv_cache_groups`.

    Raises:
        ConfigError: a field has the wrong type or range, or two fields contradict each other: any
            integer field (``kv_cache_groups[].sliding_window`` too) above :data:`MAX_CONFIG_INT` (2^31 - 1,
            the trace format's bound; no tighter one on ``num_speculative_tokens``: vLLM 0.32
            ``SpeculativeConfig.num_speculative_tokens`` is ``Field(gt=0)`` with no maximum, and
            ``Scheduler.schedule`` never lets drafts reach past ``max_model_len``, so a k of 10^9 runs as
            "no limit", as in vLLM);
            with chunked prefill off, ``max_num_batched_tokens < max_model_len`` (vLLM
            ``SchedulerConfig._verify_args``: a prompt could never be scheduled); or
            ``max_num_batched_tokens < max_num_seqs`` (vLLM, same function: a full batch of
            decodes would not fit in one step); ``num_speculative_tokens`` or ``num_lookahead_tokens``
            not an integer >= 0, or ``num_lookahead_tokens > 0`` with ``num_speculative_tokens == 0``
            (vLLM derives no lookahead without a ``speculative_config``); ``max_loras`` not an integer
            >= 0; ``watermark`` not a number in [0, 1) (vLLM ``Field(ge=0.0, lt=1.0)``);
            ``max_num_active_seqs`` not ``None`` or an integer in [1, ``max_num_seqs``] (vLLM ``Field(ge=1)`` and
            ``SchedulerConfig._verify_args``); ``prefill_schedule_interval`` not an integer >= 1 (vLLM
            ``Field(ge=1)``); ``prefix_cache_publication`` not one of :data:`PREFIX_CACHE_PUBLICATIONS`, or not
            ``"vllm"`` with ``kv_cache_groups``; ``kv_cache_groups`` not a list of groups, or group 0 not full attention. (A valid
            config the spec does not specify yet, e.g. groups with speculative decoding, is refused where it
            runs or is checked, as a feature the scheduler lacks:
            :func:`~schedspec.spec.kv_cache_groups.unspecified_with_groups`.)
    """

    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0
    max_loras: int = 0
    watermark: float = 0.0
    max_num_active_seqs: int | None = None

    long_prefill_token_threshold_adaptive: bool = False
    prefill_schedule_interval: int = 1
    prefix_cache_publication: str = "vllm"
    kv_cache_groups: tuple[KVCacheGroup, ...] = attrs.field(default=(), converter=_kv_cache_groups)

    def __attrs_post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            _positive_int(name, getattr(self, name))
        _bool("enable_chunked_prefill", self.enable_chunked_prefill)
        _bool("enable_prefix_caching", self.enable_prefix_caching)
        _bool("long_prefill_token_threshold_adaptive", self.long_prefill_token_threshold_adaptive)
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ConfigError("long_prefill_token_threshold", threshold, "must be an integer >= 0 (0 = off)")
        for name in SPECULATIVE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(name, value, "must be an integer >= 0 (0 = off)")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ConfigError("max_loras", self.max_loras, "must be an integer >= 0 (0 = LoRA off)")
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)) \
                or not 0 <= self.watermark < 1:
            raise ConfigError("watermark", self.watermark, "must be a number in [0, 1) (0 = off)")
        active = self.max_num_active_seqs
        if active is not None and (isinstance(active, bool) or not isinstance(active, int)
                                   or not 1 <= active <= self.max_num_seqs):
            raise ConfigError("max_num_active_seqs", active,
                              f"must be null or an integer in [1, max_num_seqs={self.max_num_seqs}]")
        interval = self.prefill_schedule_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError("prefill_schedule_interval", interval, "must be an integer >= 1 (1 = off)")
        if self.prefix_cache_publication not in PREFIX_CACHE_PUBLICATIONS:
            raise ConfigError("prefix_cache_publication", self.prefix_cache_publication,
                              f"must be one of {list(PREFIX_CACHE_PUBLICATIONS)}")
        if self.prefix_cache_publication != "vllm" and self.kv_cache_groups:
            raise ConfigError("prefix_cache_publication", self.prefix_cache_publication,
                              "SGLang's publication with kv_cache_groups is not specified")
        if self.kv_cache_groups:
            if self.kv_cache_groups[0].kind != "full_attention":
                raise ConfigError("kv_cache_groups", [g.to_dict() for g in self.kv_cache_groups],
                                  "group 0 must be full_attention (its block table is Request.block_ids)")
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if type(value) is int and value > MAX_CONFIG_INT:
                raise ConfigError(field.name, value, f"must be at most {MAX_CONFIG_INT} (2^31 - 1)")
        if self.num_lookahead_tokens and not self.num_speculative_tokens:
            raise ConfigError("num_lookahead_tokens", self.num_lookahead_tokens,
                              "must be 0 when num_speculative_tokens=0 (no speculative decoding, no lookahead)")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError("preemption_mode", self.preemption_mode, f"must be one of {list(PREEMPTION_MODES)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"is smaller than max_model_len={self.max_model_len} with enable_chunked_prefill=false: "
                "a prompt of max_model_len tokens could never be scheduled; raise max_num_batched_tokens, "
                "lower max_model_len or enable chunked prefill",
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"must be >= max_num_seqs={self.max_num_seqs} so that every running decode fits in one step",
            )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds: ``num_kv_blocks * block_size``."""
        return self.num_kv_blocks * self.block_size

    @property
    def speculative(self) -> bool:
        """Whether speculative decoding is on (``num_speculative_tokens > 0``)."""
        return self.num_speculative_tokens > 0

    @property
    def watermark_blocks(self) -> int:
        """Blocks the watermark keeps free: ``int(watermark * (num_kv_blocks + 1))``, as vLLM 0.32/0.33
        ``KVCacheManager.__init__`` computes ``int(watermark * kv_cache_config.num_blocks)``, whose
        ``num_blocks`` counts its null block (never handed out) beside the ``num_kv_blocks`` usable ones."""
        return int(self.watermark * (self.num_kv_blocks + 1))

    def effective_long_prefill_threshold(self, num_eligible: int) -> int:
        """The threshold a step applies with ``num_eligible`` requests live at its start (running and waiting,
        less those it rejects): ``long_prefill_token_threshold``, or with
        ``long_prefill_token_threshold_adaptive`` and a positive threshold ``max(threshold,
        max_num_batched_tokens // num_eligible)`` (0 = no cap stays 0). vLLM 0.32/0.33
        ``Scheduler.schedule``: "Floor the cap at a fair share of the input budget so it never cuts a request
        below max_num_batched_tokens / num requests" (``input_budget = max_num_batched_tokens``)."""
        threshold = self.long_prefill_token_threshold
        if not threshold or not self.long_prefill_token_threshold_adaptive:
            return threshold
        return max(threshold, self.max_num_batched_tokens // max(num_eligible, 1))

    @property
    def active_seq_cap(self) -> int:
        """The running-set size admission stops at: ``max_num_active_seqs``, or ``max_num_seqs`` when unset
        (vLLM ``Scheduler.__init__`` ``max_num_active_reqs``)."""
        return self.max_num_seqs if self.max_num_active_seqs is None else self.max_num_active_seqs

    @property
    def limits_on(self) -> tuple[str, ...]:
        """The per-step limits (:data:`LIMIT_DEFAULTS`) this config turns on, in that order."""
        return tuple(name for name, default in LIMIT_DEFAULTS.items() if getattr(self, name) != default)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (the header of a trace file, a run record's config). The
        speculative-decoding fields (:data:`SPECULATIVE_FIELDS`) are left out while they are 0, and the
        per-step limits (:data:`LIMIT_DEFAULTS`) while they are off, so the output of a run without them
        is what it was before they existed."""
        data = attrs.asdict(self)
        for name in SPECULATIVE_FIELDS:
            if not data[name]:
                del data[name]
        for name, default in LIMIT_DEFAULTS.items():
            if data[name] == default:
                del data[name]
        if data["prefix_cache_publication"] == "vllm":  # likewise: traces of vLLM's publication unchanged
            del data["prefix_cache_publication"]
        if self.kv_cache_groups:
            data["kv_cache_groups"] = [group.to_dict() for group in self.kv_cache_groups]
        else:
            del data["kv_cache_groups"]
        return data

    @property
    def hybrid(self) -> bool:
        """Whether the config names KV cache groups (:attr:`kv_cache_groups` not empty)."""
        return bool(self.kv_cache_groups)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SchedulerConfig:
        """Build from a dict; unknown keys raise :class:`ConfigError` naming the key."""
        cls._known_fields(data)
        missing = [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING and f.name not in data]
        if missing:
            raise ConfigError(missing[0], None, "is required")
        return cls(**data)

    @classmethod
    def _known_fields(cls, data: dict[str, Any]) -> None:
        known = [f.name for f in attrs.fields(cls)]
        for key in data:
            if key not in known:
                raise ConfigError(key, data[key], f"is not a SchedulerConfig field (known: {', '.join(known)})")

    def with_changes(self, **changes: Any) -> SchedulerConfig:
        """A copy with some fields changed, validated again; an unknown field raises :class:`ConfigError`
        naming it (as :meth:`from_dict`), not ``attrs.evolve``'s ``TypeError``."""
        self._known_fields(changes)
        return attrs.evolve(self, **changes)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """KV blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``.

    vLLM ``vllm/v1/core/kv_cache_utils.py`` (``cdiv``). ``num_tokens <= 0`` needs 0 blocks.
    """
    if num_tokens <= 0:
        return 0
    return -(-num_tokens // block_size)


def slot_tokens(end: int, config: SchedulerConfig) -> int:
    """Tokens a request's block table must hold once a chunk that ends at position ``end`` (its
    ``num_computed_tokens`` plus the step's tokens, drafts included) is scheduled: ``end``, plus with
    speculative decoding ``num_lookahead_tokens`` more, capped at ``max_model_len`` (never below ``end``).

    vLLM 0.32 ``KVCacheManager.allocate_slots``: ``num_tokens_need_slot = min(num_computed_tokens +
    num_new_tokens + num_lookahead_tokens, max_model_len)``. With ``num_lookahead_tokens == 0`` this is
    ``end``.
    """
    ahead = config.num_lookahead_tokens
    if not ahead:
        return end
    return max(end, min(end + ahead, config.max_model_len))
