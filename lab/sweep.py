"""``schedspec lab --sweep``: run one window under every configuration of a cartesian product, in
parallel, and choose the configuration that meets a latency target.

- ``--sweep FIELD=v1,v2,...`` (repeatable): any :class:`~schedspec.spec.config.SchedulerConfig` field,
  ``scheduler`` (a scheduler or ``--compare`` variant name), or the load: ``rate`` (arrivals rescaled
  so that the window's mean rate, requests / span, is ``v`` requests/s) or ``time_scale`` (the
  inter-arrival gaps multiplied by ``v``, as ``--time-scale``). The points are the cartesian product,
  in the order the options were given (the last field varies fastest).
- Each point is one :func:`~schedspec.lab.run.run_lab` with the spec checks on (unless
  ``--no-check``), run by :class:`concurrent.futures.ProcessPoolExecutor` with ``--jobs`` workers,
  or with ``--ray ADDRESS`` as Ray tasks on an existing Ray cluster (:mod:`schedspec.lab.executor`).
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
from pathlib import Path
from typing import Any

import attrs

from schedspec.lab import metrics
from schedspec.lab.executor import execute
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


@attrs.frozen
class SweepRun:
    """One point of a ``--sweep``: a run specification, everything picklable (a worker process or a Ray
    task runs it: :func:`run_point` through :func:`schedspec.lab.executor.execute`).

    Attributes:
        index: the point's place in the sweep (0-based; the table shows ``index + 1``).
        name: the run record's name (:func:`point_label`).
        scheduler: the registered scheduler (or ``module:factory``) it runs.
        config: its :class:`~schedspec.spec.config.SchedulerConfig`.
        window: the requests it replays (the window at the point's time scale).
        cost: the cost model (:class:`~schedspec.reference.cost_model.CostModel`).
        check: whether every step is checked against the spec.
        max_steps: stop after this many steps (``None``: run to the end).
        conditions: the run record's shared conditions (:func:`run_record.shared_conditions`).
        slo: the goodput SLO (:class:`~schedspec.lab.metrics.Slo`) or ``None``.
        point: ``{field: value}`` of the point.
        acceptance: the drafts' acceptance model (:class:`~schedspec.reference.fake_model.AcceptanceModel`)
            with speculative decoding, else ``None``.
    """

    index: int
    name: str
    scheduler: str
    config: Any
    window: Any
    cost: Any
    check: bool
    max_steps: int | None
    conditions: Mapping[str, Any]
    slo: metrics.Slo | None
    point: Mapping[str, Any]
    acceptance: Any = None


def run_point(job: SweepRun) -> tuple[int, dict[str, Any] | None, str | None]:
    """Run one point (in a worker process): ``(index, run record, None)``, or ``(index, None, why)``
    when the run broke the spec or the engine under test crashed."""
    try:
        result = run_lab(job.window, job.scheduler, job.config, cost_model=job.cost, check=job.check,
                         max_steps=job.max_steps, acceptance=job.acceptance)
    except ViolationFound as error:
        first = error.violations[0] if error.violations else error
        return job.index, None, f"VIOLATION {first} (stopped at step {error.state.step})"
    except EngineFault as error:
        return job.index, None, f"ENGINE CRASH {error}"
    result.scheduler = job.scheduler
    return job.index, run_record.build_record(job.name, result, job.conditions, job.slo, sweep_point=job.point), None


def run_points(jobs: Sequence[SweepRun], workers: int = 1,
               ray_address: str | None = None) -> list[tuple[int, dict[str, Any] | None, str | None]]:
    """Run every point through :func:`schedspec.lab.executor.execute` (``workers`` local processes, or
    Ray tasks on the cluster at ``ray_address``); results in point order.

    Raises:
        concurrent.futures.process.BrokenProcessPool: a worker process died (killed, out of memory).
        RayNotInstalled, RayUnavailable: with ``ray_address``.
    """
    return execute(run_point, jobs, workers, ray_address)


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
