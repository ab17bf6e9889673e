"""``schedspec lab --capacity``: the highest request rate at which each configuration meets a latency SLO.

This is the question Vidur's configuration search answers (MLSys'24, "capacity per dollar" under an
SLO such as TTFT p90 < 2 s and ITL p99 < 200 ms): for a configuration, how much load can it take
before its latency percentiles break the target?

- **Load.** A trace window's arrivals are time-scaled: rate ``r`` (requests/s) means every arrival
  time multiplied by ``natural_rate / r``, where the natural rate is the window's requests / span
  (as ``--sweep rate=``); the requests and their lengths stay the same. For ``--synthetic`` (which must
  give ``n=N``), the window at rate ``r`` is the same seeded draw with its gaps scaled, i.e. a Poisson
  (or gamma, ``cv``) process of rate ``r`` exactly: ``synthetic`` draws the gaps as ``1/rate`` times
  rate-free variates.
- **SLO.** ``--slo`` keys ``METRIC_pNN`` (``ttft_p90=2s``, ``itl_p99=200ms``, ``e2e_p95=...``;
  metrics ``ttft``, ``itl``, ``tpot``, ``e2e``, ``queueing``; any percentile in (0, 100]) are
  percentiles over the finished requests, with the definitions of
  :mod:`schedspec.lab.metrics` (ITL pools every gap of every finished request). Today's goodput
  keys (``ttft``, ``itl``, ``tpot``, ``e2e``) mean their p99 here, as ``--sweep`` judges them. The SLO
  **holds** at a rate when the run completes without a spec violation, at least one request finishes,
  and every target holds.
- **Search** (:func:`search`). From the natural rate, double (or halve) until the SLO fails (holds),
  then bisect geometrically (the midpoint of ``lo`` and ``hi`` is ``sqrt(lo * hi)``) until
  ``hi / lo <= 1 + tolerance``; the capacity is ``lo``, the highest rate seen to hold, and its figures
  are reported. Bisection assumes the SLO predicate is monotone in the rate (more load, no better
  latency), which holds for the reference schedulers on the tests' small cases (checked against a
  brute-force scan in ``tests/test_capacity.py``) but is not a theorem: a different batch composition
  at a higher rate can, rarely, lower a percentile. The search never reports a rate it did not run,
  and ``--json`` lists every rate it ran with its verdict, so a non-monotone configuration can be
  seen. Rates are searched within ``natural_rate * 2**±MAX_DOUBLINGS``;
  an SLO that holds at the top (or fails at the bottom) is reported as such, never extrapolated.
- **Parallel, deterministic.** One job per configuration (the bisection inside a configuration is
  sequential), run by :func:`schedspec.lab.sweep.run_points`' process pool pattern; the simulated clock
  depends only on the window, the config and the cost model, so the result does not depend on
  ``--jobs``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from schedspec.lab import metrics
from schedspec.lab.run import run_lab
from schedspec.reference.engine import ViolationFound
from schedspec.reference.scheduler import EngineFault

PERCENTILE_METRICS = ("ttft", "itl", "tpot", "e2e", "queueing")
_KEY = re.compile(r"(ttft|itl|tpot|e2e|queueing)_p([0-9]+(?:\.[0-9]+)?)")
_VALUE = re.compile(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)?")

DEFAULT_TOLERANCE = 0.02
"""Default relative width of the final bracket: the capacity is within 2 % of the boundary."""
MAX_DOUBLINGS = 12
"""The search stays within ``natural_rate * 2**-12 .. natural_rate * 2**12``."""
REPORTED = (("ttft", 50), ("ttft", 90), ("ttft", 99), ("itl", 50), ("itl", 99), ("e2e", 50), ("e2e", 99))
"""Percentiles shown for each configuration at its capacity (plus every SLO target)."""


@attrs.frozen
class SloTargets:
    """A parsed ``--slo``: today's goodput keys and the percentile keys.

    Attributes:
        goodput: the goodput SLO (``ttft``, ``itl``, ``tpot``, ``e2e`` in seconds), or ``None``.
        percentiles: ``(metric, percentile, seconds)`` per percentile key, in the order given.
    """

    goodput: metrics.Slo | None
    percentiles: tuple[tuple[str, float, float], ...] = ()

    def targets(self) -> tuple[tuple[str, float, float], ...]:
        """Every target as ``(metric, percentile, seconds)``: the percentile keys, and each goodput key
        as its p99 (as ``--sweep`` judges it)."""
        extra = () if self.goodput is None else tuple(
            (key, 99.0, value) for key, value in self.goodput._asdict().items() if value is not None)
        return self.percentiles + extra

    def __str__(self) -> str:
        return ", ".join(f"{m}_p{percentile_label(p)} <= {_seconds(v)}" for m, p, v in self.targets())


def parse_slo(text: str) -> SloTargets:
    """Parse ``--slo``: goodput keys (``ttft=2s``; :func:`schedspec.lab.metrics.parse_slo`) and
    percentile keys (``ttft_p90=2s``, ``itl_p99=200ms``), in any mix.

    Raises:
        MetricsError: an unknown or repeated key, a percentile outside (0, 100], or a bad value (the key
            is named).
    """
    goodput_items, percentiles, seen = [], [], set()
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        match = _KEY.fullmatch(key)
        if match is None:
            goodput_items.append(item)
            continue
        if not sep:
            raise metrics.MetricsError(f"SLO {item.strip()!r}: expected key=value (e.g. ttft_p90=2s)")
        metric, percentile = match.group(1), float(match.group(2))
        if not 0 < percentile <= 100:
            raise metrics.MetricsError(f"SLO key {key!r}: the percentile must be in (0, 100]")
        if (metric, percentile) in seen:
            raise metrics.MetricsError(f"SLO key {key!r}: given twice")
        seen.add((metric, percentile))
        number = _VALUE.fullmatch(value)
        if number is None:
            raise metrics.MetricsError(f"SLO {key}={value!r}: expected a number of seconds, optionally with s or ms")
        seconds = float(number.group(1)) / (1000.0 if number.group(2) == "ms" else 1.0)
        if not 0 < seconds <= 1e9:
            raise metrics.MetricsError(f"SLO {key}={value!r}: must be > 0 and at most 1e9 s")
        percentiles.append((metric, percentile, seconds))
    goodput = metrics.parse_slo(",".join(goodput_items)) if goodput_items or not percentiles else None
    return SloTargets(goodput, tuple(percentiles))


def latency_values(timelines: Sequence[metrics.RequestTimeline], metric: str) -> list[float]:
    """The values of ``metric`` over the finished requests, as :func:`metrics.latency_summary` pools
    them (``itl``: every gap of every finished request)."""
    finished = [t for t in timelines if t.outcome == "finished"]
    if metric == "itl":
        return [gap for t in finished for gap in t.itls]
    attribute = "queueing_delay" if metric == "queueing" else metric
    return [v for t in finished if (v := getattr(t, attribute)) is not None]


def percentile(timelines: Sequence[metrics.RequestTimeline], metric: str, q: float) -> float | None:
    """``numpy.percentile`` (linear, as vLLM and :mod:`metrics`) of ``metric``; ``None`` without values."""
    values = latency_values(timelines, metric)
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


# --------------------------------------------------------------------------------------------------
# The search


@attrs.frozen
class SearchResult:
    """The outcome of :func:`search`.

    Attributes:
        rate: the capacity, requests/s (the highest rate run at which the SLO held), or ``None`` when it
            failed at the lowest rate tried.
        upper: the lowest rate run at which it failed (``None``: it held at every rate tried).
        status: ``"found"`` (``upper / rate <= 1 + tolerance``), ``"above-range"`` (held up to the top
            of the range) or ``"below-range"`` (failed down to the bottom).
        evaluations: every ``(rate, held)`` run, in order.
    """

    rate: float | None
    upper: float | None
    status: str
    evaluations: tuple[tuple[float, bool], ...]


def search(holds: Callable[[float], bool], start: float, tolerance: float = DEFAULT_TOLERANCE,
           max_doublings: int = MAX_DOUBLINGS) -> SearchResult:
    """The highest rate at which ``holds`` is true, to relative ``tolerance`` (module docstring).

    Args:
        holds: rate (requests/s, > 0) -> whether the SLO holds; called at most about
            ``max_doublings + log2(log(2) / log(1 + tolerance)) + 2`` times, never twice for a rate.
        start: the first rate tried (> 0).
        tolerance: the search stops when ``upper / rate <= 1 + tolerance`` (> 0).
        max_doublings: the range is ``start * 2**-max_doublings .. start * 2**max_doublings``.

    Raises:
        ValueError: ``start`` or ``tolerance`` not a finite number > 0.
    """
    if not (math.isfinite(start) and start > 0) or not (math.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"search: start={start!r} and tolerance={tolerance!r} must be finite numbers > 0")
    evaluations: list[tuple[float, bool]] = []

    def run(rate: float) -> bool:
        verdict = bool(holds(rate))
        evaluations.append((rate, verdict))
        return verdict

    if run(start):
        lo, hi = start, None
        for k in range(1, max_doublings + 1):
            rate = start * 2.0 ** k
            if run(rate):
                lo = rate
            else:
                hi = rate
                break
        if hi is None:
            return SearchResult(lo, None, "above-range", tuple(evaluations))
    else:
        lo, hi = None, start
        for k in range(1, max_doublings + 1):
            rate = start * 2.0 ** -k
            if run(rate):
                lo = rate
                break
            hi = rate
        if lo is None:
            return SearchResult(None, hi, "below-range", tuple(evaluations))
    while hi / lo > 1 + tolerance:
        middle = math.sqrt(lo * hi)
        if run(middle):
            lo = middle
        else:
            hi = middle
    return SearchResult(lo, hi, "found", tuple(evaluations))


def scaled_window(window: Sequence[Any], natural_rate: float, rate: float) -> list[Any]:
    """``window`` (arrivals from 0) with its arrival (and ``abort_at_time``) times multiplied by
    ``natural_rate / rate``: the same requests arriving at ``rate`` requests/s on average."""
    factor = natural_rate / rate
    return [attrs.evolve(s, arrival_time=s.arrival_time * factor,
                         abort_at_time=None if s.abort_at_time is None else s.abort_at_time * factor)
            for s in window]


def evaluate(window: Sequence[Any], natural_rate: float, rate: float, scheduler: str, config, cost, check: bool,
             max_steps: int | None, targets: SloTargets) -> dict[str, Any]:
    """One lab run at ``rate``: ``{"rate_req_per_s", "holds", "problem", "figures"}``; ``figures``
    maps ``METRIC_pNN_s`` (every target and :data:`REPORTED`) and ``output_tokens_per_s``,
    ``requests_finished`` to numbers (``None`` when not computable)."""
    try:
        result = run_lab(scaled_window(window, natural_rate, rate), scheduler, config, cost_model=cost, check=check,
                         max_steps=max_steps)
    except ViolationFound as error:
        first = error.violations[0] if error.violations else error
        return {"rate_req_per_s": rate, "holds": False, "figures": {},
                "problem": f"VIOLATION {first} (stopped at step {error.state.step})"}
    except EngineFault as error:
        return {"rate_req_per_s": rate, "holds": False, "figures": {}, "problem": f"ENGINE CRASH {error}"}
    figures: dict[str, Any] = {}
    for metric, q in (*REPORTED, *((m, p) for m, p, _ in targets.targets())):
        figures[f"{metric}_p{percentile_label(q)}_s"] = percentile(result.timelines, metric, q)
    efficiency = metrics.efficiency_summary(result.steps, config.num_kv_blocks, result.timelines)
    figures["output_tokens_per_s"] = efficiency["output_tokens_per_s"]
    figures["requests_finished"] = sum(1 for t in result.timelines if t.outcome == "finished")
    holds = figures["requests_finished"] > 0 and all(
        (value := figures[f"{m}_p{percentile_label(q)}_s"]) is not None and value <= limit for m, q, limit in targets.targets())
    return {"rate_req_per_s": rate, "holds": holds, "figures": figures, "problem": None}


def run_configuration(job: tuple) -> dict[str, Any]:
    """One configuration's search (in a worker process). ``job`` is ``(index, label, scheduler, config,
    window, natural_rate, start_rate, cost, check, max_steps, targets, tolerance)``; returns
    ``{"index", "label", "scheduler", "capacity_req_per_s", "upper_req_per_s", "status", "evaluations",
    "figures", "problem"}``."""
    (index, label, scheduler, config, window, natural_rate, start_rate, cost, check, max_steps, targets,
     tolerance) = job
    runs: dict[float, dict[str, Any]] = {}
    problem: list[str] = []

    def holds(rate: float) -> bool:
        outcome = evaluate(window, natural_rate, rate, scheduler, config, cost, check, max_steps, targets)
        runs[rate] = outcome
        if outcome["problem"] is not None and not problem:
            problem.append(outcome["problem"])
        return outcome["holds"]

    found = search(holds, start_rate, tolerance)
    at = runs[found.rate] if found.rate is not None else None
    return {
        "index": index, "label": label, "scheduler": scheduler, "config": config.to_dict(),
        "capacity_req_per_s": found.rate, "upper_req_per_s": found.upper, "status": found.status,
        "time_scale": None if found.rate is None else natural_rate / found.rate,
        "evaluations": [{"rate_req_per_s": r, "holds": h} for r, h in found.evaluations],
        "figures": None if at is None else at["figures"],
        "problem": problem[0] if problem else None,
    }


def run_all(jobs: Sequence[tuple], workers: int) -> list[dict[str, Any]]:
    """Every configuration's search, ``workers`` processes at a time (1: in this process), in job order.

    Raises:
        concurrent.futures.process.BrokenProcessPool: a worker process died.
    """
    if workers <= 1 or len(jobs) <= 1:
        return [run_configuration(job) for job in jobs]
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        results = list(pool.map(run_configuration, jobs))
    return sorted(results, key=lambda r: r["index"])


def choose_best(results: Sequence[Mapping[str, Any]]) -> tuple[int | None, str]:
    """``(index of the configuration with the highest capacity, the reason)``; ties go to the higher
    output throughput at capacity, then the earlier configuration. ``None`` when none holds at any rate."""
    usable = [i for i, r in enumerate(results) if r["capacity_req_per_s"] is not None]
    if not usable:
        return None, "no configuration meets the SLO at any rate tried"

    def key(i: int) -> tuple:
        r = results[i]
        return (-r["capacity_req_per_s"], -((r["figures"] or {}).get("output_tokens_per_s") or 0.0), i)

    best = min(usable, key=key)
    r = results[best]
    bound = " (held at the top of the range: at least this)" if r["status"] == "above-range" else ""
    return best, (f"highest capacity, {r['capacity_req_per_s']:.3g} requests/s{bound}, of {len(results)} "
                  "configuration(s)")


def write_plot(results: Sequence[Mapping[str, Any]], best: int | None, targets: SloTargets,
               folder: str | Path) -> Path:
    """``capacity.png`` in ``folder`` (created): one horizontal bar per configuration (its capacity in
    requests/s; the best one highlighted; hatched when the SLO held at the top of the range). Written
    whole (temporary file, then rename).

    Raises:
        OSError: the folder cannot be created or written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from schedspec.lab.plots import _label, _save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "capacity.png"
    labels = [_label(r["label"]) for r in results]
    values = [r["capacity_req_per_s"] or 0.0 for r in results]
    figure, axis = plt.subplots(figsize=(8, 1.2 + 0.45 * len(results)))
    colors = ["tab:green" if i == best else "tab:blue" for i in range(len(results))]
    bars = axis.barh(range(len(results)), values, color=colors)
    for bar, r in zip(bars, results, strict=True):
        if r["status"] == "above-range":
            bar.set_hatch("//")
    axis.set_yticks(range(len(results)), labels, fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel("capacity: highest request rate meeting the SLO (requests/s)")
    axis.set_title(f"Capacity under {targets}", fontsize=9)
    axis.grid(True, axis="x", alpha=0.3)
    figure.tight_layout()
    _save(figure, path)
    plt.close(figure)
    return path


def percentile_label(q: float) -> str:
    """``q`` as it appears in figure and SLO keys: ``99`` -> ``"99"``, ``99.9`` -> ``"99_9"``."""
    return f"{q:g}".replace(".", "_") if q != int(q) else str(int(q))


def _seconds(value: float) -> str:
    return f"{value * 1e3:g} ms" if value < 1 else f"{value:g} s"


# --------------------------------------------------------------------------------------------------
# Checking the command's options (``schedspec lab --capacity``; the command itself is in
# schedspec/commands/lab.py)


def option_problem(targets: SloTargets | None, backend: str, compare: str | None, sweep_fields: Sequence[str],
                   time_scale: float, synthetic_spec, outputs: Mapping[str, str | None],
                   tolerance: float) -> str | None:
    """Why the ``lab`` options cannot run ``--capacity`` (one line naming the option), or ``None``."""
    if targets is None:
        return "--capacity: needs --slo (e.g. --slo ttft_p90=2s,itl_p99=200ms)"
    if backend != "cost-model":
        return "--capacity: only with --backend cost-model (it runs the window many times, in parallel)"
    if compare is not None:
        return "--capacity and --compare: give one (--sweep scheduler=A,B searches several schedulers)"
    for field in sweep_fields:
        if field in ("rate", "time_scale"):
            return f"--capacity and --sweep {field}: the capacity search chooses the rate itself"
    if time_scale != 1:
        return "--capacity and --time-scale: the capacity search chooses the rate itself"
    if synthetic_spec is not None and synthetic_spec.num_requests is None:
        return "--capacity with --synthetic: give n=N (a fixed number of requests), not duration=S"
    for option, value in outputs.items():
        if value is not None:
            return f"{option}: not with --capacity (--json prints every configuration's search)"
    if not (math.isfinite(tolerance) and 0 < tolerance <= 1):
        return f"--capacity-tolerance {tolerance:g}: must be in (0, 1]"
    return None
