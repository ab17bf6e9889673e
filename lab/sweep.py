"""``schedspec lab --sweep``: run one window under every configuration of a cartesian product, in
parallel, and choose the configuration that meets a latency target.

- ``--sweep FIELD=v1,v2,...`` (repeatable): any :class:`~schedspec.spec.config.SchedulerConfig` field,
  ``scheduler`` (a scheduler or ``--compare`` variant name), or the load: ``rate`` (arrivals rescaled
  so that the window's mean rate, requests / span, is ``v`` requests/s) or ``time_scale`` (the
  inter-arrival gaps multiplied by ``v``, as ``--time-scale``). The points are the cartesian product,
  in the order the options were given (the last field varies fastest).
- Each point is one :func:`~schedspec.lab.run.run_lab` with the spec checks on (unless
  ``--no-check``), run by :class:`concurrent.futures.ProcessPoolExecutor` with ``--jobs`` workers,
  or with ``--ray ADDRESS`` as Ray tasks on an existing Ray cluster (:func:`run_points_ray`).
  The simulated clock depends only on the workload, the config and the cost model, so the figures do
  not depend on the number of workers; results are ordered by point, never by completion.
- A configuration **meets the SLO** when, for every SLO given, the p99 of that latency over the
  finished requests is within it (``ttft`` against ``ttft_p99_s``, ``itl`` against ``itl_p99_s``,
  ``tpot``, ``e2e`` likewise) and its run broke no spec rule. The **best** one is the meeting
  configuration with the highest output throughput (tokens/s); ties go to the lower p99 ITL, then
  the earlier point.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from schedspec.lab import metrics
from schedspec.lab.run import run_lab
from schedspec.reference.engine import ViolationFound
from schedspec.reference.scheduler import EngineFault

from . import run_record

LOAD_FIELDS = ("rate", "time_scale")
"""Sweep fields that change the load rather than the config."""

SLO_FIGURES = {"ttft": "ttft_p99_s", "itl": "itl_p99_s", "tpot": "tpot_p99_s", "e2e": "e2e_p99_s"}
"""The figure each SLO is judged against (p99 over finished requests)."""


def default_jobs() -> int:
    """All the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def cartesian(sweeps: Sequence[tuple[str, Sequence[Any]]]) -> list[dict[str, Any]]:
    """Every point of the product of ``sweeps`` (``[(field, values), ...]``) as ``{field: value}``,
    the last field varying fastest."""
    fields = [field for field, _ in sweeps]
    return [dict(zip(fields, values, strict=True)) for values in itertools.product(*(v for _, v in sweeps))]


def point_label(point: Mapping[str, Any]) -> str:
    """``max_num_seqs=64,max_num_batched_tokens=512``."""
    return ",".join(f"{k}={value_text(v)}" for k, v in point.items())


def value_text(value: Any) -> str:
    """A swept value as the user wrote it: ``0.5``, ``true``, ``2048``."""
    return f"{value:g}" if isinstance(value, float) else str(value).lower() if isinstance(value, bool) else str(value)


def short_label(point: Mapping[str, Any]) -> str:
    """The values only, ``512/64``: a plot label (the field order is in the plot title)."""
    return "/".join(value_text(v) for v in point.values())


# --------------------------------------------------------------------------------------------------
# Running the points


def run_point(job: tuple) -> tuple[int, dict[str, Any] | None, str | None]:
    """Run one point (in a worker process): ``(index, run record, None)``, or ``(index, None, why)``
    when the run broke the spec or the engine under test crashed.

    ``job`` is ``(index, name, scheduler, config, window, cost, check, max_steps, shared conditions,
    slo, point[, acceptance model])``, everything picklable."""
    index, name, scheduler, config, window, cost, check, max_steps, shared, slo, point, *rest = job
    try:
        result = run_lab(window, scheduler, config, cost_model=cost, check=check, max_steps=max_steps,
                         acceptance=rest[0] if rest else None)
    except ViolationFound as error:
        first = error.violations[0] if error.violations else error
        return index, None, f"VIOLATION {first} (stopped at step {error.state.step})"
    except EngineFault as error:
        return index, None, f"ENGINE CRASH {error}"
    result.scheduler = scheduler
    return index, run_record.build_record(name, result, shared, slo, sweep_point=point), None


def run_points(jobs: Sequence[tuple], workers: int) -> list[tuple[int, dict[str, Any] | None, str | None]]:
    """Run every job, ``workers`` at a time (1: in this process); results in job order.

    Raises:
        concurrent.futures.process.BrokenProcessPool: a worker process died (killed, out of memory).
    """
    if workers <= 1 or len(jobs) <= 1:
        return [run_point(job) for job in jobs]
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        results = list(pool.map(run_point, jobs))
    return sorted(results, key=lambda r: r[0])


class RayUnavailable(Exception):
    """``--ray``: the cluster cannot be reached, or a task could not run on it (unusable input or
    environment: CLI exit 2; the message says which)."""


class RayNotInstalled(RayUnavailable):
    """``--ray``: the ``ray`` extra is not installed (a feature this installation lacks: CLI exit 3)."""


def _run_point_with_window(head: tuple, window: list) -> tuple[int, dict[str, Any] | None, str | None]:
    """:func:`run_point` with the window passed separately (a Ray object, shipped once per window)."""
    return run_point((*head[:4], window, *head[4:]))


def run_points_ray(jobs: Sequence[tuple], address: str) -> list[tuple[int, dict[str, Any] | None, str | None]]:
    """Run every job as a Ray task (one CPU each, no retries) on the existing Ray cluster at
    ``address`` (``ray.init(address=...)``: ``HOST:PORT`` of the head's GCS, ``ray://HOST:PORT`` for
    Ray Client, or ``auto``); results in job order, equal to :func:`run_points`' whatever the cluster's
    size, since each run depends only on its job. Each distinct window is put in the object store
    once (``ray.put``), not once per task. The cluster's workers need schedspec installed (the same
    version). If this process is already connected to Ray (a test's local instance), that connection
    is used and left open.

    Raises:
        RayNotInstalled: ray is not installed.
        RayUnavailable: the cluster cannot be reached, or a task failed there.
    """
    try:
        import ray
    except ImportError as error:
        raise RayNotInstalled(f"needs the ray extra (pip install 'schedspec[ray]'): {error}") from None
    connected_here = False
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        except Exception as error:  # noqa: BLE001  (ray raises ConnectionError, ValueError, RuntimeError)
            raise RayUnavailable(f"cannot connect to the Ray cluster at {address!r}: "
                                 f"{type(error).__name__}: {error}") from None
        connected_here = True
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(_run_point_with_window)
        windows: dict[int, Any] = {}
        refs = []
        for job in jobs:
            window = job[4]
            if id(window) not in windows:
                windows[id(window)] = ray.put(window)
            refs.append(task.remote(job[:4] + job[5:], windows[id(window)]))
        try:
            results = ray.get(refs)
        except ray.exceptions.RayError as error:  # a task could not run (e.g. schedspec missing there)
            raise RayUnavailable(f"a Ray task failed: {type(error).__name__}: "
                                 f"{str(error).strip().splitlines()[-1] if str(error).strip() else ''}") from None
    finally:
        if connected_here:
            ray.shutdown()
    return sorted(results, key=lambda r: r[0])


# --------------------------------------------------------------------------------------------------
# Judging


def meets_slo(figures: Mapping[str, Any], slo: metrics.Slo | None) -> bool | None:
    """Whether a run's p99 latencies are within every SLO given (``None`` without an SLO)."""
    if slo is None:
        return None
    if figures.get("violations"):
        return False
    for key, limit in slo._asdict().items():
        if limit is None:
            continue
        value = figures.get(SLO_FIGURES[key])
        if value is None or value > limit:
            return False
    return True


def choose_best(records: Sequence[dict[str, Any] | None], slo: metrics.Slo | None) -> tuple[int | None, str]:
    """``(index of the best record, the reason in words)``; ``None`` when no run completed or none
    meets the SLO (the reason then says which came closest).

    Without an SLO: the highest output throughput, then the lowest p99 ITL. With one, among the
    configurations whose p99 latencies meet it (:func:`meets_slo`): the highest **goodput** (the share of
    admitted requests that meet the SLO each, what a user of the service sees), then the highest output
    throughput, then the lowest p99 ITL; so a configuration whose p99 passes but that serves fewer
    requests within the SLO never wins over one that serves more at the same throughput."""

    def throughput(i: int) -> float:
        return records[i]["figures"]["output_tokens_per_s"] or 0.0  # type: ignore[index]

    def itl(i: int) -> float:
        value = records[i]["figures"]["itl_p99_s"]  # type: ignore[index]
        return float("inf") if value is None else value

    done = [i for i, r in enumerate(records) if r is not None]
    if not done:
        return None, "no configuration completed"
    key = lambda i: (-throughput(i), itl(i), i)  # noqa: E731
    if slo is None:
        best = min(done, key=key)
        return best, (f"highest output throughput ({throughput(best):,.1f} tokens/s); no --slo given, so no "
                      "latency target was applied")
    limits = ", ".join(f"p99 {k.upper()} <= {_seconds(v)}" for k, v in slo._asdict().items() if v is not None)
    meeting = [i for i in done if meets_slo(records[i]["figures"], slo)]  # type: ignore[index]
    if not meeting:
        closest = max(done, key=lambda i: (records[i]["figures"]["goodput_percent"] or 0.0, -i))  # type: ignore[index]
        return None, (f"no configuration meets {limits}; the highest goodput is point {closest + 1} "
                      f"({records[closest]['figures']['goodput_percent'] or 0:.1f}% of admitted requests)")  # type: ignore[index]
    def goodput(i: int) -> float:
        return records[i]["figures"]["goodput_percent"] or 0.0  # type: ignore[index]

    best = min(meeting, key=lambda i: (-goodput(i), *key(i)))
    tied = [i for i in meeting if i != best and goodput(i) == goodput(best)]
    return best, (f"highest goodput ({goodput(best):.1f}% of admitted requests meet the SLO) of the {len(meeting)} of "
                  f"{len(records)} configurations that meet {limits}"
                  + (f", then highest output throughput ({throughput(best):,.1f} tokens/s)" if tied else
                     f"; output throughput {throughput(best):,.1f} tokens/s"))


def _seconds(value: float) -> str:
    return f"{value * 1e3:g} ms" if value < 1 else f"{value:g} s"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points ``(latency, throughput)`` no other point beats on both (lower latency
    and higher throughput, one strictly), sorted by latency."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 <= x and y2 >= y) and (x2 < x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


# --------------------------------------------------------------------------------------------------
# Plots


def plot_files(folder: str | Path) -> list[Path]:
    """The files :func:`write_plots` writes."""
    folder = Path(folder)
    return [folder / "sweep-itl-p99.png", folder / "sweep-ttft-p99.png"]


def write_plots(records: Sequence[dict[str, Any] | None], points: Sequence[Mapping[str, Any]],
                slo: metrics.Slo | None, folder: str | Path) -> list[Path]:
    """Output throughput (tokens/s) against p99 ITL and against p99 TTFT, one labelled point per
    completed configuration, the Pareto front as a line and the SLO (when given) as a vertical dashed
    line. Written whole (temporary file, then rename) into ``folder`` (created).

    Raises:
        OSError: the folder cannot be created or written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from schedspec.lab.plots import _label, _save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fields = list(points[0]) if points else []
    written = []
    for path, figure_key, slo_key, name in zip(plot_files(folder), ("itl_p99_s", "ttft_p99_s"), ("itl", "ttft"),
                                               ("ITL", "TTFT"), strict=True):
        figure, axis = plt.subplots(figsize=(8, 5.5))
        shown = [(i, r["figures"][figure_key], r["figures"]["output_tokens_per_s"]) for i, r in enumerate(records)
                 if r is not None and r["figures"][figure_key] is not None
                 and r["figures"]["output_tokens_per_s"] is not None]
        if shown:
            xs = [x * 1e3 for _, x, _ in shown]
            ys = [y for _, _, y in shown]
            meets = [meets_slo(records[i]["figures"], slo) for i, _, _ in shown]  # type: ignore[index]
            for verdict, color, label in ((True, "tab:green", "meets the SLO (p99)"),
                                          (False, "tab:red", "misses the SLO (p99)"),
                                          (None, "tab:blue", "configuration")):
                chosen = [k for k, m in enumerate(meets) if m is verdict]
                if chosen:
                    axis.scatter([xs[k] for k in chosen], [ys[k] for k in chosen], c=color, zorder=3, label=label)
            front = pareto_front(list(zip(xs, ys, strict=True)))
            axis.plot([xs[i] for i in front], [ys[i] for i in front], color="k", lw=1, ls="-", zorder=2,
                      label="Pareto front")
            # Configurations at the same point (equal figures) share one label, "A; B", instead of
            # labels printed over each other.
            at: dict[tuple[float, float], list[str]] = {}
            for (i, _, _), x, y in zip(shown, xs, ys, strict=True):
                at.setdefault((round(x, 9), round(y, 9)), []).append(short_label(points[i]))
            for (x, y), labels in at.items():
                axis.annotate(_label("; ".join(labels)), (x, y), textcoords="offset points", xytext=(4, 4),
                              fontsize=7)
        limit = getattr(slo, slo_key) if slo is not None else None
        if limit is not None:
            axis.axvline(limit * 1e3, color="tab:red", ls="--", lw=1, label=f"SLO {name} {_seconds(limit)}")
        axis.margins(0.1)  # room for the labels of the outermost points
        axis.set_xlabel(f"p99 {name} (ms)")
        axis.set_ylabel("output throughput (tokens/s)")
        axis.set_title(f"Throughput against p99 {name}; labels: {_label('/'.join(fields))}", fontsize=9)
        axis.grid(True, alpha=0.3)
        if shown or limit is not None:
            axis.legend(loc="best", fontsize=8)
        _save(figure, path)
        plt.close(figure)
        written.append(path)
    return written
