"""PNG plots of lab runs (matplotlib, Agg backend): tokens per step (prefill/decode stacked), running
and waiting over time, KV usage, and TTFT and ITL CDFs per run."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .run import LabResult


def _save(figure, path: Path) -> None:
    """Save to a temporary file in the same folder, then rename: never a half-written PNG."""
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".png", delete=False)  # noqa: SIM115
    handle.close()
    try:
        figure.savefig(handle.name, dpi=90, bbox_inches="tight", format="png")
        # NamedTemporaryFile makes the file private (0600); give the plot the mode a plain write would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(handle.name, 0o666 & ~umask)
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


def _file_name(name: str) -> str:
    """A run name as part of a file name: characters other than letters, digits, ``.``, ``_`` and
    ``-`` become ``_`` (``my.module:factory`` -> ``my.module_factory``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "run"


def _label(name: str) -> str:
    """A run name as matplotlib text: ``$`` would start math mode."""
    return name.replace("$", r"\$")


def plot_files(names: Sequence[str], folder: str | Path) -> list[Path]:
    """The files :func:`write_plots` may write for runs called ``names`` into ``folder``."""
    folder = Path(folder)
    return [folder / f"steps-{_file_name(n)}.png" for n in names] + [folder / "ttft-cdf.png", folder / "itl-cdf.png"]


def write_plots(runs: Sequence[tuple[str, LabResult]], folder: str | Path) -> list[Path]:
    """Write the plots for one or more named runs into ``folder`` (created); returns the files written.

    Each file is written whole (temporary file, then rename). Files: ``steps-NAME.png`` per run (NAME
    with characters other than letters, digits, ``.``, ``_``, ``-`` replaced by ``_``),
    ``ttft-cdf.png``, ``itl-cdf.png``.

    Raises:
        OSError: the folder cannot be created or written.
    """
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
        axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # outside: never over the bars
        axes[1].step(time, [s.num_running for s in steps], where="post", label="running")
        axes[1].step(time, [s.num_waiting for s in steps], where="post", label="waiting")
        axes[1].set_ylabel("requests")
        axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
        axes[2].step(time, [100 * (1 - s.num_free_blocks / result.config.num_kv_blocks) for s in steps], where="post")
        axes[2].set_ylabel(f"KV cache used (% of {result.config.num_kv_blocks:,} blocks)")
        axes[2].set_ylim(0, 100)
        axes[2].set_xlabel("simulated time (s)")
        figure.suptitle(f"{_label(name)}: steps over time ({len(steps):,} steps)")
        path = folder / f"steps-{_file_name(name)}.png"
        _save(figure, path)
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
                axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=_label(name))
        axis.set_xscale("log")
        axis.set_xlabel(label)
        axis.set_ylabel("fraction of requests" if metric == "ttft" else "fraction of gaps")
        axis.grid(True, which="both", alpha=0.3)
        axis.set_title(f"{'TTFT of finished requests' if metric == 'ttft' else 'Gaps between output tokens (ITL)'}: "
                       "cumulative distribution", fontsize=10)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(loc="lower right")
        path = folder / f"{metric}-cdf.png"
        _save(figure, path)
        plt.close(figure)
        written.append(path)
    return written
