"""Hypothesis strategies for scheduler configs and requests, for testing any scheduler against the spec.

Used by :class:`schedspec.testing.SchedulerStateMachine` (its hooks call these) and exported for engine
authors who write their own properties::

    from hypothesis import given
    from schedspec.strategies import scheduler_configs, request_shapes

    @given(scheduler_configs(max_model_len=32), st.data())
    def test_my_engine(config, data):
        prompt_len, max_tokens, eos_at_output, priority = data.draw(request_shapes(config))

Every strategy is sized for fast stateful runs: tiny caches, tiny budgets and the edges around
``block_size``, ``max_model_len`` and the cache capacity, where schedulers break.
"""

from __future__ import annotations

import functools

from hypothesis import strategies as st

from schedspec.spec.config import SchedulerConfig, blocks_for_tokens

__all__ = ["eos_positions", "max_tokens_values", "priorities", "prompt_lengths", "request_shapes",
           "scheduler_configs"]


@st.composite
def scheduler_configs(
    draw: st.DrawFn,
    *,
    max_block_size: int = 16,
    max_kv_blocks: int = 32,
    max_model_len: int = 64,
    max_num_seqs: int = 8,
    max_batched_tokens: int = 128,
    chunked_prefill: bool | None = None,
    prefix_caching: bool = False,
) -> SchedulerConfig:
    """Valid :class:`SchedulerConfig` values, small enough for fast stateful runs.

    Tiny caches (one block, one-token blocks), tiny budgets (``max_num_batched_tokens ==
    max_num_seqs``), caches smaller than ``max_model_len``, chunked prefill on and off, and
    ``long_prefill_token_threshold`` off or anywhere up to ``max_model_len + 2`` are all drawn. Every
    value passes :class:`SchedulerConfig` validation by construction (the budget is drawn at or above
    the cross-field lower bounds). Prefix caching is off unless ``prefix_caching``.

    Args:
        max_block_size: largest ``block_size`` drawn (16, vLLM's default, is drawn when allowed).
        max_kv_blocks: largest ``num_kv_blocks``.
        max_model_len: largest ``max_model_len``.
        max_num_seqs: largest ``max_num_seqs``.
        max_batched_tokens: usual upper end of ``max_num_batched_tokens`` (raised to the lower bound
            when chunked prefill is off and ``max_model_len`` is larger).
        chunked_prefill: force ``enable_chunked_prefill``; ``None`` draws it.
        prefix_caching: ``enable_prefix_caching`` of every config drawn.
    """
    block_size = draw(
        st.one_of(
            st.integers(1, min(4, max_block_size)),
            st.sampled_from(sorted({b for b in (1, 2, 4, 8, 16) if b <= max_block_size})),
            st.integers(1, max_block_size),
        )
    )
    model_len = draw(
        st.one_of(
            st.integers(1, max_model_len),
            # multiples of block_size, and one past them (a prompt of max_model_len then needs a block
            # more than max_model_len - 1 tokens do)
            st.integers(0, max_model_len // block_size).map(lambda k: max(1, k * block_size)),
            st.integers(0, (max_model_len - 1) // block_size).map(lambda k: k * block_size + 1),
        )
    )
    # Pools around one sequence of max_model_len (tokens - 1, all tokens, one more block), pools of a few
    # such sequences (requests fit alone but not together, so running requests preempt each other), and
    # tiny or roomy pools.
    per_sequence = blocks_for_tokens(model_len, block_size)
    one_sequence = sorted({max(1, min(max_kv_blocks, b)) for b in (
        blocks_for_tokens(model_len - 1, block_size), per_sequence, per_sequence + 1)})
    num_kv_blocks = draw(
        st.one_of(
            st.sampled_from(one_sequence),
            st.integers(min(per_sequence, max_kv_blocks), min(max_kv_blocks, 2 * per_sequence + 1)),
            st.integers(1, min(max_kv_blocks, 3 * per_sequence + 1)),
            st.integers(1, min(4, max_kv_blocks)),
            st.integers(1, max_kv_blocks),
        )
    )
    num_seqs = draw(st.integers(1, max_num_seqs))
    chunked = draw(st.booleans()) if chunked_prefill is None else chunked_prefill
    low = num_seqs if chunked else max(num_seqs, model_len)
    high = max(low, max_batched_tokens)
    budget = draw(
        st.one_of(
            st.integers(low, min(high, low + 8)),
            st.integers(low, max(low, min(high, model_len))),  # long prompts take several chunks
            st.integers(low, high),
        )
    )
    threshold = draw(st.one_of(st.just(0), st.integers(1, model_len + 2))) if chunked else 0
    return SchedulerConfig(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=num_seqs,
        max_model_len=model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold,
        enable_prefix_caching=prefix_caching,
    )


@functools.lru_cache(maxsize=4096)
def prompt_lengths(config: SchedulerConfig) -> st.SearchStrategy[int]:
    """Prompt lengths (tokens) for ``config``: mostly ones that fit (short, or anywhere below
    ``max_model_len`` and the cache), multiples of ``block_size``, the boundaries around
    ``block_size``, ``max_model_len`` and the cache capacity, and anything up to past the cache,
    0 included (those must be rejected). Cached per config (building a strategy costs more than
    drawing from it)."""
    size, limit, capacity = config.block_size, config.max_model_len, config.kv_capacity_tokens
    fits = max(1, min(limit - 1, capacity))
    edges = sorted(
        {n for n in (1, size - 1, size, size + 1, 2 * size, limit - 1, limit, limit + 1,
                     capacity - 1, capacity, capacity + 1) if n >= 0}
    )
    return st.one_of(
        st.integers(1, max(1, min(fits, 2 * size))),
        st.integers(1, fits),
        st.integers(1, max(1, fits // size)).map(lambda k: k * size),
        st.sampled_from(edges),
        st.integers(0, limit + capacity + 2),
    )


@functools.lru_cache(maxsize=4096)
def max_tokens_values(config: SchedulerConfig) -> st.SearchStrategy[int]:
    """``max_tokens`` values for ``config``: short and long outputs (long ones grow their block tables
    and force preemptions), sometimes 0 (rejected) or past ``max_model_len``."""
    size, limit = config.block_size, config.max_model_len
    return st.one_of(
        st.integers(1, 6),
        st.integers(1, max(1, limit)),
        st.integers(max(1, limit // 2), max(1, limit)),
        st.sampled_from(sorted({0, 1, size, size + 1, limit})),
        st.integers(0, limit + 4),
    )


def eos_positions() -> st.SearchStrategy[int | None]:
    """Output index (1-based) at which the model emits end-of-sequence, or ``None`` (never)."""
    return st.one_of(st.none(), st.integers(1, 8))


def priorities() -> st.SearchStrategy[int]:
    """Request priorities 0..3 (lower is more urgent, vLLM's convention), 0 about half the time: two
    requests often share a priority, where a priority scheduler's order falls back to arrival
    (vLLM's ``(priority, arrival_time, request_id)``)."""
    return st.one_of(st.just(0), st.integers(0, 3))


def request_shapes(config: SchedulerConfig) -> st.SearchStrategy[tuple[int, int, int | None, int]]:
    """``(prompt_len, max_tokens, eos_at_output, priority)`` for ``config``."""
    return st.tuples(prompt_lengths(config), max_tokens_values(config), eos_positions(), priorities())



def acceptance_patterns(k: int) -> st.SearchStrategy[str]:
    """Speculative decoding's per-request acceptance pattern for ``num_speculative_tokens = k``, one of
    :data:`schedspec.reference.fake_model.ACCEPTANCE_PATTERNS`: every draft right, none, each right with a
    probability (so partly), or right up to an output and wrong after (``k`` sizes nothing: the fake model's
    drafter proposes ``min(k, max_model_len - num_tokens)`` drafts)."""
    return st.one_of(
        st.sampled_from(("all", "none")),
        st.sampled_from((0.25, 0.5, 0.75)).map(lambda p: f"rate:{p}"),
        st.integers(0, 12).map(lambda n: f"upto:{n}"),
    )


def speculative_configs(max_speculative_tokens: int = 4, lookahead: bool = False,
                        **limits) -> st.SearchStrategy[SchedulerConfig]:
    """:func:`scheduler_configs` (``limits`` passed on) with speculative decoding on:
    ``num_speculative_tokens`` in ``1..max_speculative_tokens``; ``num_lookahead_tokens`` 0 (the n-gram
    drafter's), or with ``lookahead`` 0 or k (EAGLE's, MTP's and a draft model's, as vLLM 0.32
    ``VllmConfig.num_lookahead_tokens`` derives it)."""
    return scheduler_configs(**limits).flatmap(
        lambda config: st.integers(1, max_speculative_tokens).flatmap(
            lambda k: st.sampled_from((0, k) if lookahead else (0,)).map(
                lambda ahead: config.with_changes(num_speculative_tokens=k, num_lookahead_tokens=ahead))))
