"""Device and dtype choice, and the memory check done before anything is allocated."""

from __future__ import annotations

import os

import torch

from schedspec.gpu_backend.errors import BackendError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
"""Accepted dtype names."""

MEMORY_HEADROOM = 0.9
"""Fraction of the free memory the weights plus the KV cache may take (the rest is for activations)."""


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` is CUDA when available, else CPU; ``"cuda"``, ``"cuda:N"`` and ``"cpu"`` are taken as is.

    Raises:
        BackendError: (field ``device``) an unknown name, or CUDA asked for but not available.
    """
    if isinstance(device, torch.device):
        name = str(device)
    else:
        name = str(device).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise BackendError(f"device={device!r}: not a device name (use auto, cuda, cuda:N or cpu)",
                           field="device") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendError(f"device={device!r}: CUDA is not available on this machine (torch "
                               f"{torch.__version__}); use device='cpu' or 'auto'", field="device")
        index = resolved.index or 0
        if index >= torch.cuda.device_count():
            raise BackendError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s)",
                               field="device")
        return torch.device("cuda", index)
    if resolved.type != "cpu":
        raise BackendError(f"device={device!r}: only cuda and cpu are supported", field="device")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The torch dtype for a name (``float32``/``bfloat16``/``float16`` or short forms) or dtype.

    Raises:
        BackendError: (field ``dtype``) an unknown dtype, or one the device cannot run (bfloat16 on a
            GPU without bfloat16 support).
    """
    if isinstance(dtype, torch.dtype):
        resolved = dtype
        if resolved not in DTYPES.values():
            raise BackendError(f"dtype={dtype}: supported dtypes are float32, bfloat16, float16", field="dtype")
    else:
        resolved = DTYPES.get(str(dtype).lower())
        if resolved is None:
            raise BackendError(f"dtype={dtype!r}: supported dtypes are float32, bfloat16, float16", field="dtype")
    if device.type == "cuda" and resolved == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise BackendError(f"dtype={dtype!r}: {torch.cuda.get_device_name(device)} does not support bfloat16; "
                           "use float16 or float32", field="dtype")
    return resolved


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device in bytes (CUDA: ``mem_get_info``; CPU: ``MemAvailable``)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def check_fits(weight_bytes: int, kv_cache_bytes: int, device: torch.device) -> None:
    """Raise unless weights plus KV cache fit in :data:`MEMORY_HEADROOM` of the free memory.

    Raises:
        BackendError: (field ``num_kv_blocks``) with the sizes in GiB.
    """
    free = available_memory_bytes(device)
    need = weight_bytes + kv_cache_bytes
    if need > MEMORY_HEADROOM * free:
        gib = 1024**3
        raise BackendError(
            f"num_kv_blocks: the KV cache ({kv_cache_bytes / gib:.2f} GiB) plus weights ({weight_bytes / gib:.2f} GiB) "
            f"do not fit in {MEMORY_HEADROOM:.0%} of the {free / gib:.2f} GiB free on {device}; lower num_kv_blocks "
            "or block_size, or use a smaller dtype", field="num_kv_blocks")
