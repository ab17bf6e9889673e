"""PNG plots of lab runs (matplotlib, Agg backend): tokens per step (prefill/decode stacked), running
and waiting over time, KV usage, and TTFT and ITL CDFs per run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .lab import LabResult


def write_plots(runs: Sequence[tuple[str, LabResult]], folder: str | Path) -> list[Path]:
    """Write the plots for one or more named runs into ``folder`` (created); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, result in runs:
        steps = result.steps
        if not steps:
            continue
        time = np.array([s.start_time for s in steps])
        figure, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
        axes[0].fill_between(time, 0, [s.decode_tokens for s in steps], step="post", label="decode", alpha=0.7)
        axes[0].fill_between(time, [s.decode_tokens for s in steps],
                             [s.decode_tokens + s.prefill_tokens for s in steps], step="post", label="prefill", alpha=0.7)
        axes[0].axhline(result.config.max_num_batched_tokens, color="k", lw=0.8, ls="--", label="max_num_batched_tokens")
        axes[0].set_ylabel("tokens per step")
        axes[0].legend(loc="upper right")
        axes[1].step(time, [s.num_running for s in steps], where="post", label="running")
        axes[1].step(time, [s.num_waiting for s in steps], where="post", label="waiting")
        axes[1].set_ylabel("requests")
        axes[1].legend(loc="upper right")
        axes[2].step(time, [1 - s.num_free_blocks / result.config.num_kv_blocks for s in steps], where="post")
        axes[2].set_ylabel("KV blocks used")
        axes[2].set_xlabel("simulated time (s)")
        figure.suptitle(f"{name}: steps over time")
        path = folder / f"steps-{name}.png"
        figure.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(figure)
        written.append(path)
    for metric, label in (("ttft", "TTFT (s)"), ("itl", "ITL (s)")):
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for name, result in runs:
            if metric == "ttft":
                values = [t.ttft for t in result.timelines if t.ttft is not None]
            else:
                values = [gap for t in result.timelines for gap in t.itls]
            if values:
                ordered = np.sort(values)
                axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=name)
        axis.set_xscale("log")
        axis.set_xlabel(label)
        axis.set_ylabel("fraction of requests" if metric == "ttft" else "fraction of gaps")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
        path = folder / f"{metric}-cdf.png"
        figure.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(figure)
        written.append(path)
    return written
