"""Errors of the PyTorch backend. Torch-free, so callers can catch them without importing torch."""

from __future__ import annotations


class BackendError(ValueError):
    """The backend cannot start or run with what it was given.

    Raised before any work starts (before weights are loaded or the KV cache is allocated) for a bad
    model directory, missing or mis-shaped tensors, an unsupported architecture, a dtype or device the
    machine cannot run, or a KV cache that does not fit in memory. The message names the file or the
    field; ``field`` and ``path`` hold them too (``None`` when not applicable).
    """

    def __init__(self, message: str, *, field: str | None = None, path: str | None = None) -> None:
        self.field = field
        self.path = path
        super().__init__(message)


class BlockTableError(BackendError):
    """A step would write or read KV-cache blocks the request does not own (debug mode), or a block
    table is unusable (too short for the chunk, or a block id outside the pool).

    The message names the request and the block; ``field`` is ``"block_ids"`` / ``"new_block_ids"``
    where that is the culprit.
    """
