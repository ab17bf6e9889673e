"""The admission rule (trace property ``rejects-impossible``).

A request that could never run to completion even alone is rejected, with a reason, at its arrival
step, so that no admitted request can outgrow the cache and none blocks the queue forever. vLLM
rejects only an empty prompt or ``prompt_len >= max_model_len`` at the API server
(``vllm/v1/engine/input_processor.py`` ``InputProcessor._validate_prompt_len``) and otherwise lets
such a request preempt others and stall; an engine that does so breaks ``rejects-impossible``, which
is a finding about that engine. (A prompt of exactly ``max_model_len`` tokens, which vLLM refuses, is
admitted here and ends ``max_model_len`` after its first output token; see ``docs/vllm-names.md``.)
"""

from __future__ import annotations

import functools

from schedspec.spec.config import SchedulerConfig, blocks_for_tokens, slot_tokens
from schedspec.spec.kv_cache_groups import min_peak_blocks


def max_sequence_len(prompt_len: int, max_tokens: int, config: SchedulerConfig) -> int:
    """Most tokens the request's sequence can reach: ``min(prompt_len + max_tokens, max_model_len)``."""
    return min(prompt_len + max_tokens, config.max_model_len)


def max_blocks_needed(prompt_len: int, max_tokens: int, config: SchedulerConfig) -> int:
    """Most KV blocks the request can ever hold.

    ``ceil(max(prompt_len, min(prompt_len + max_tokens, max_model_len) - 1) / block_size)``: the last
    sampled token is never fed back, so it needs no KV slot; but the whole prompt is (a prompt of
    exactly ``max_model_len`` tokens still needs all its slots). With speculative decoding, its table
    also holds ``num_lookahead_tokens`` past its last position, capped at ``max_model_len``
    (:func:`~schedspec.spec.config.slot_tokens`); drafts need no more (a decode may verify none).

    With hybrid KV cache groups (``config.kv_cache_groups``), the fewest blocks all groups must hold at once
    from the one shared pool, however the request is scheduled alone
    (:func:`~schedspec.spec.kv_cache_groups.min_peak_blocks`): a sliding-window group holds only its window,
    so a request the full-attention groups can hold is not rejected for its window's blocks, and one whose
    groups together can never fit is (vLLM PR #52530: a pool accepted at start-up that a request can never fit
    was retried forever).
    """
    tokens = max(prompt_len, max_sequence_len(prompt_len, max_tokens, config) - 1)
    if config.kv_cache_groups:
        return min_peak_blocks(tokens, prompt_len, config)
    return blocks_for_tokens(slot_tokens(tokens, config), config.block_size)


REJECTION_CODES = ("empty-prompt", "no-output", "prompt-exceeds-max-model-len", "exceeds-kv-cache")
"""The limit a rejection names, as the first word of its reason (``CODE: detail``): the prompt is empty;
``max_tokens < 1``; the prompt is longer than ``max_model_len`` (vLLM
``InputProcessor._validate_prompt_len`` raises for it); the whole sequence needs more KV blocks than
``num_kv_blocks``. A trace's rejection reason is judged by its code, so an engine may word the detail
its own way."""


def rejection_reasons(prompt_len: int, max_tokens: int, config: SchedulerConfig) -> list[str]:
    """Every limit a request of this shape breaks, each as ``"CODE: detail"`` (``CODE`` one of
    :data:`REJECTION_CODES`), in the order of :data:`REJECTION_CODES`; empty if it can complete alone.

    Args:
        prompt_len: prompt tokens.
        max_tokens: most output tokens.
        config: the scheduler's limits.
    """
    reasons = []
    if prompt_len <= 0:
        reasons.append(f"empty-prompt: prompt_len={prompt_len}")
    if max_tokens < 1:
        reasons.append(f"no-output: max_tokens={max_tokens} < 1")
    if prompt_len > config.max_model_len:
        reasons.append(f"prompt-exceeds-max-model-len: prompt_len={prompt_len} exceeds max_model_len={config.max_model_len}")
    if prompt_len > 0:
        needed = max_blocks_needed(prompt_len, max(max_tokens, 1), config)
        if needed > config.num_kv_blocks:
            groups = f", {len(config.kv_cache_groups)} KV cache groups" if config.kv_cache_groups else ""
            reasons.append(
                f"exceeds-kv-cache: needs {needed} KV blocks (prompt_len={prompt_len}, max_tokens={max_tokens}, "
                f"block_size={config.block_size}{groups}) but num_kv_blocks={config.num_kv_blocks}"
            )
    return reasons


@functools.lru_cache(maxsize=1 << 16)
def rejection_reason(prompt_len: int, max_tokens: int, config: SchedulerConfig) -> str | None:
    """Why a request of this shape can never complete alone (the first of :func:`rejection_reasons`),
    or ``None`` if it can. Remembered (a pure function of immutable arguments): policies and monitors ask
    it for every waiting request at every step.

    Returns:
        ``"CODE: detail"``, ``CODE`` one of :data:`REJECTION_CODES`; or ``None``.
    """
    reasons = rejection_reasons(prompt_len, max_tokens, config)
    return reasons[0] if reasons else None


def rejection_code(reason: str) -> str:
    """The code of a rejection reason: the text before its first ``:`` (the whole text if none)."""
    return reason.partition(":")[0].strip()
