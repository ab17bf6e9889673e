"""The n-gram drafter (prompt lookup decoding) of the PyTorch backend's speculative decoding: drafts from
the request's own tokens, no draft model.

Source: vLLM 0.32 ``vllm/v1/spec_decode/ngram_proposer.py`` (``NgramProposer.propose``,
``_find_longest_matched_ngram_and_propose_tokens``), the method ``"ngram"`` of ``--speculative-config``;
Saxena, "Prompt Lookup Decoding" (2023). The rule, written here over numpy rather than vLLM's reversed-KMP
scan, which finds the same match:

- find the longest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` such that the sequence's last ``n``
  tokens occur earlier in it (an occurrence that ends before the last token; occurrences may overlap);
- among the occurrences of that length, take the earliest;
- propose the tokens that follow it, at most ``k``, at most up to the end of the sequence and at most
  ``max_model_len - len(sequence)``; nothing when no ``n`` matches or the sequence is shorter than
  ``prompt_lookup_min``.

vLLM's defaults for the n-gram method are ``prompt_lookup_min = prompt_lookup_max = 5``
(``SpeculativeConfig.__post_init__``): :data:`DEFAULT_LOOKUP`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_LOOKUP = (5, 5)
"""``(prompt_lookup_min, prompt_lookup_max)``: vLLM 0.32's defaults for ``method="ngram"``."""


def ngram_drafts(token_ids: Sequence[int] | np.ndarray, k: int, max_model_len: int,
                 lookup: tuple[int, int] = DEFAULT_LOOKUP) -> tuple[int, ...]:
    """The drafts the n-gram drafter proposes after ``token_ids`` (module docstring).

    Args:
        token_ids: the request's whole sequence (prompt, outputs, and this step's accepted drafts and
            sampled token), ``[num_tokens]`` ids.
        k: ``num_speculative_tokens``, the most drafts (>= 0).
        max_model_len: the longest sequence (tokens); no draft goes past it.
        lookup: ``(prompt_lookup_min, prompt_lookup_max)``, n-gram lengths (1 <= min <= max).

    Returns:
        Up to ``k`` token ids, possibly none.

    Raises:
        ValueError: ``lookup`` is not ``1 <= min <= max``.
    """
    low, high = lookup
    if not 1 <= low <= high:
        raise ValueError(f"n-gram lookup {lookup!r}: expected 1 <= prompt_lookup_min <= prompt_lookup_max")
    tokens = np.asarray(token_ids, dtype=np.int64)
    total = tokens.shape[0]
    k = min(k, max_model_len - total)
    if total < low or k <= 0:
        return ()
    for n in range(min(high, total - 1), low - 1, -1):
        # windows tokens[s:s + n] for s + n <= total - 1: every occurrence that ends before the last token
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        found = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
        if found.size:
            start = int(found[0]) + n
            return tuple(int(t) for t in tokens[start:start + min(k, total - start)])
    return ()
