"""Token sampling: greedy, or temperature / top-p with one seeded generator per (request, output index).

Each sampled row uses a uniform number drawn from a CPU ``torch.Generator`` seeded from
``(seed, request_id, output index)``, and every other operation is row-wise, so a request's tokens do
not depend on which other requests share its batch (nor on preemptions: a recomputed request draws the
same numbers again).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def request_seed(seed: int, request_id: str, output_index: int) -> int:
    """The 63-bit generator seed of one sample: a hash of the run seed, the request and the 1-based
    output index."""
    digest = hashlib.blake2b(f"{seed}:{request_id}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def uniforms(seed: int, request_ids: Sequence[str], output_indices: Sequence[int]) -> torch.Tensor:
    """``[S]`` float64 numbers in ``[0, 1)``, one per (request, output index)."""
    values = []
    for request_id, index in zip(request_ids, output_indices, strict=True):
        generator = torch.Generator(device="cpu").manual_seed(request_seed(seed, request_id, index))
        values.append(torch.rand((), generator=generator, dtype=torch.float64))
    return torch.stack(values) if values else torch.empty(0, dtype=torch.float64)


def sample(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor | None = None) -> torch.Tensor:
    """Sample one token per row.

    Args:
        logits: ``[S, V]`` float32; masked tokens are ``-inf``.
        temperature: 0 means greedy (argmax, the lowest id on ties); otherwise logits are divided by it.
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (0, 1].
        u: ``[S]`` uniforms from :func:`uniforms` (required when ``temperature > 0``).

    Returns:
        ``[S]`` int64 token ids on the logits' device.
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)
    assert u is not None, "temperature sampling needs uniforms"
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    keep = (cumulative - sorted_probs) < top_p
    keep[:, 0] = True
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    cumulative = kept.cumsum(dim=-1)
    target = u.to(device=logits.device, dtype=cumulative.dtype)[:, None] * cumulative[:, -1:]
    choice = torch.searchsorted(cumulative, target, right=True)
    # Rounding can put the target at the very end: fall back to the last token of positive probability
    # (sorted first), never a masked one.
    last_positive = ((kept > 0).sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    choice = torch.minimum(choice, last_positive)
    return order.gather(1, choice).squeeze(1)
