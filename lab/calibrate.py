"""Calibrating the cost model: measure the PyTorch backend's step time over a designed grid of steps and
fit the cost model's coefficients to it.

The step time is the one :class:`~schedspec.gpu_backend.runner.Runner` reports and ``schedspec lab
--backend torch`` uses (packing the inputs, the forward pass, sampling; see the Runner's docstring), and
each measured step is described by :func:`~schedspec.reference.cost_model.step_shape`, the counts the lab
charges for. So the fit answers: which ``a + b*prefill_tokens + c*decode_tokens + d*kv_tokens_attended``
reproduces the backend's step times.

The grid (:func:`design_grid`) covers the four kinds of step an iteration-level scheduler makes:

- ``prefill``: one prompt chunk of ``P`` tokens from position 0, and chunks of ``P`` tokens after a
  prefix of ``S`` computed tokens (chunked prefill), and several chunks in one step;
- ``decode``: ``D`` decoding sequences, each with ``L`` tokens of context;
- ``mixed``: a prefill chunk together with decodes (what chunked prefill batches).

Every point runs ``warmup`` throw-away executions, then ``repeats`` measured ones, round-robin over
the grid; the point's time is their median (robust to another process taking the core for a moment,
which happens on a shared machine). The fit (:func:`fit`) minimises the **relative** squared error (each row divided by its
measured time, so a 2 ms decode step counts as much as a 200 ms prefill) with every coefficient
``>= 0`` (non-negative least squares, solved exactly for four unknowns by trying every set of active
coefficients with ``numpy.linalg.lstsq``). The error is reported per region.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from schedspec.reference.cost_model import PROFILE_KIND, CostModel, StepShape, step_shape
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.transitions import add_request, apply_plan
from schedspec.spec.workload import RequestSpec

REGIONS = ("prefill", "decode", "mixed")
FEATURES = ("a_s_per_step", "b_s_per_prefill_token", "c_s_per_decode_token", "d_s_per_kv_token",
            "e_s_per_prefill_attention_pair")
FORMS = {
    "linear": "step_seconds = a + b*prefill_tokens + c*decode_tokens + d*kv_tokens_attended",
    "attention": "step_seconds = a + b*prefill_tokens + c*decode_tokens + d*kv_tokens_attended "
                 "+ e*prefill_attention_pairs",
    "piecewise": "step_seconds = g(prefill_tokens + decode_tokens) + d*kv_tokens_attended "
                 "+ e*prefill_attention_pairs + f*prefill_chunks, g piecewise linear between knots",
}
"""The forms :func:`fit` knows, simplest first: the cost model's linear form; the same plus the
quadratic prefill attention term (``StepShape.prefill_attention_pairs``); and a piecewise-linear
function of the step's tokens (knots at the grid's token counts, :func:`knots_for`; real matrix
products are not linear in small batches: a batch of 4 decodes costs far less than 4 of 1, and the
kernel chosen changes with the number of rows) plus the KV, attention and per-chunk terms."""
BETTER_FORM_GAIN = 0.8
"""``--form auto`` moves to a more complex form only when its relative RMS error is below this fraction
of the simpler chosen form's (the residuals say the extra terms matter)."""


@attrs.frozen
class GridPoint:
    """One designed step.

    Attributes:
        region: ``prefill``, ``decode`` or ``mixed``.
        chunks: ``(prefix, tokens)`` per prefill chunk: ``tokens`` prompt tokens computed after
            ``prefix`` already computed ones.
        decodes: number of decoding sequences.
        context: tokens of context of each decoding sequence (its ``num_computed_tokens``).
    """

    region: str
    chunks: tuple[tuple[int, int], ...] = ()
    decodes: int = 0
    context: int = 0

    @property
    def label(self) -> str:
        parts = [f"prefill {n}" + (f"@{p}" if p else "") for p, n in self.chunks]
        if self.decodes:
            parts.append(f"decode {self.decodes}x{self.context}")
        return " + ".join(parts)

    @property
    def kv_tokens(self) -> int:
        """KV slots the point needs."""
        return sum(p + n for p, n in self.chunks) + self.decodes * (self.context + 1)

    @property
    def longest(self) -> int:
        """Longest sequence in the point (tokens)."""
        return max([p + n for p, n in self.chunks] + ([self.context + 1] if self.decodes else []))


def design_grid(max_prefill: int = 2048, max_decodes: int = 128, max_context: int = 2048,
                quick: bool = False) -> list[GridPoint]:
    """The calibration grid, limited by the largest chunk (``max_prefill`` tokens, e.g. the lab's
    ``max_num_batched_tokens``), decode batch (``max_decodes`` sequences) and context (tokens).
    ``quick``: a few points per region (for tests and CI; seconds on a CPU).

    Raises:
        ValueError: a limit below 8.
    """
    if min(max_prefill, max_decodes, max_context) < 1 or max_prefill < 8 or max_context < 8:
        raise ValueError("design_grid: max_prefill and max_context must be >= 8, max_decodes >= 1")

    def powers(low: int, high: int, factor: int) -> list[int]:
        values, v = [], low
        while v < high:
            values.append(v)
            v *= factor
        return [*values, high]

    if quick:
        prefill_sizes = sorted({min(16, max_prefill), min(128, max_prefill)})
        decode_counts = sorted({1, min(8, max_decodes)})
        contexts = sorted({min(16, max_context), min(256, max_context)})
        prefixes = [min(128, max_context)]
    else:
        # Dense in the batch where real matrix products are least linear (kernel choice changes with the
        # number of rows): every power of 2 and the point half-way between, up to the limits.
        prefill_sizes = powers(8, max_prefill, 2) if max_prefill > 8 else [8]
        dense = sorted({v for k in range(0, 20) for v in (2 ** k, 3 * 2 ** k) if v <= max_decodes})
        decode_counts = sorted({*dense, max_decodes})
        contexts = powers(16, max_context, 4) if max_context > 16 else [16]
        prefixes = sorted({min(256, max_context), max_context // 2})
    points: list[GridPoint] = []
    points += [GridPoint("prefill", chunks=((0, n),)) for n in prefill_sizes]
    middle = prefill_sizes[len(prefill_sizes) // 2]
    points += [GridPoint("prefill", chunks=((p, middle),)) for p in prefixes if p > 0]
    points += [GridPoint("prefill", chunks=tuple((0, middle // 4) for _ in range(4)))] if middle >= 8 else []
    points += [GridPoint("decode", decodes=d, context=c) for d in decode_counts for c in contexts]
    small = prefill_sizes[max(0, len(prefill_sizes) // 2 - 1)]
    for d in decode_counts[-2:]:
        for n in sorted({small, prefill_sizes[-1]}):
            points.append(GridPoint("mixed", chunks=((0, n),), decodes=d, context=contexts[len(contexts) // 2]))
    if not quick:
        points.append(GridPoint("mixed", chunks=((prefixes[-1], middle),), decodes=decode_counts[-1],
                                context=contexts[-1]))
    return points


def point_state(point: GridPoint, config: SchedulerConfig) -> tuple[SchedulerState, StepPlan]:
    """A spec state and a legal plan that computes exactly ``point``: every request's earlier tokens are
    applied as computed (with :func:`~schedspec.spec.transitions.apply_plan`, without running a model),
    so the measured step is the only one that runs. Requests take blocks from the front of the pool.

    Raises:
        ValueError: the point needs more KV blocks than ``config.num_kv_blocks`` or a sequence longer
            than ``config.max_model_len``.
    """
    size = config.block_size
    need = sum(blocks_for_tokens(p + n, size) for p, n in point.chunks)
    need += point.decodes * blocks_for_tokens(point.context + 1, size)
    if need > config.num_kv_blocks or point.longest >= config.max_model_len:
        raise ValueError(f"grid point {point.label}: needs {need} KV blocks and {point.longest} tokens; the config "
                         f"has {config.num_kv_blocks} blocks and max_model_len {config.max_model_len}")
    state = SchedulerState.initial(config)
    earlier: list[ScheduledRequest] = []
    measured: list[tuple[str, int, int]] = []
    free = list(state.free_block_ids)

    def take(count: int) -> tuple[int, ...]:
        nonlocal free
        blocks, free = tuple(free[:count]), free[count:]
        return blocks

    for i, (prefix, n) in enumerate(point.chunks):
        rid = f"prefill-{i}"
        state = add_request(state, RequestSpec(rid, prompt_len=prefix + n, max_tokens=1).to_request(0))
        if prefix:
            earlier.append(ScheduledRequest(rid, 0, prefix, take(blocks_for_tokens(prefix, size))))
        measured.append((rid, prefix, n))
    for i in range(point.decodes):
        rid = f"decode-{i}"
        state = add_request(state, RequestSpec(rid, prompt_len=point.context, max_tokens=2).to_request(0))
        earlier.append(ScheduledRequest(rid, 0, point.context, take(blocks_for_tokens(point.context, size))))
        measured.append((rid, point.context, 1))
    if earlier:
        plan = StepPlan(scheduled=tuple(earlier))
        sampled = {item.request_id: 1 for item in earlier
                   if item.num_computed_tokens + item.num_tokens == state.requests[item.request_id].num_tokens}
        state = apply_plan(state, plan, sampled, config).state
    scheduled = []
    for rid, start, n in measured:
        have = len(state.requests[rid].block_ids)
        scheduled.append(ScheduledRequest(rid, start, n, take(blocks_for_tokens(start + n, size) - have)))
    return state, StepPlan(scheduled=tuple(scheduled))


@attrs.frozen
class Measurement:
    """One grid point's measured step time (seconds) and its shape."""

    point: GridPoint
    shape: StepShape
    seconds: float
    spread: float
    """(max - min) / median of the repeats."""


def measure(runner, points: Sequence[GridPoint], config: SchedulerConfig, repeats: int = 5, warmup: int = 2,
            progress: Callable[[int, int, GridPoint], None] | None = None) -> list[Measurement]:
    """Measure every point on ``runner`` (a :class:`~schedspec.gpu_backend.runner.Runner` built with
    ``config``): ``warmup`` throw-away executions of each point, then ``repeats`` rounds that execute
    every point once each (round-robin, so a slow spell of a shared machine touches every point a
    little rather than a few points a lot); a point's time is the median of its ``repeats`` step times
    as the Runner reports them (``Runner.execute``'s seconds)."""
    prepared = [point_state(point, config) for point in points]
    for index, (point, (state, plan)) in enumerate(zip(points, prepared, strict=True)):
        if progress is not None:
            progress(index, len(points), point)
        for _ in range(warmup):
            runner.execute(plan, state)
    times: list[list[float]] = [[] for _ in points]
    for _ in range(repeats):
        for index, (state, plan) in enumerate(prepared):
            times[index].append(runner.execute(plan, state)[1])
    results = []
    for point, (state, plan), samples in zip(points, prepared, times, strict=True):
        median = statistics.median(samples)
        results.append(Measurement(point, step_shape(plan, state), median,
                                   (max(samples) - min(samples)) / median if median > 0 else 0.0))
    return results


def _design(shapes: Sequence[StepShape]) -> np.ndarray:
    return np.array([[1.0, s.prefill_tokens, s.decode_tokens, s.kv_tokens_attended, s.prefill_attention_pairs]
                     for s in shapes], dtype=float)


def knots_for(shapes: Sequence[StepShape]) -> list[int]:
    """Knots of the piecewise form: the token counts of the grid's steps, thinned so that consecutive
    knots differ by at least 20 % (every knot has a measured step on it), and the largest."""
    counts = sorted({s.num_tokens for s in shapes})
    knots = [counts[0]]
    for t in counts[1:]:
        if t >= 1.2 * knots[-1]:
            knots.append(t)
    if knots[-1] != counts[-1]:
        knots[-1] = counts[-1]
    return knots


def _hats(tokens: np.ndarray, knots: Sequence[int]) -> np.ndarray:
    """``[len(tokens), len(knots)]``: the piecewise-linear interpolation weights (hat functions) of each
    token count on the knots (flat below the first knot, the last segment continued above the last)."""
    k = np.asarray(knots, dtype=float)
    out = np.zeros((len(tokens), len(k)))
    for row, t in enumerate(tokens):
        if t <= k[0] or len(k) == 1:
            out[row, 0] = 1.0
            continue
        j = min(int(np.searchsorted(k, t)) - 1, len(k) - 2)
        w = (t - k[j]) / (k[j + 1] - k[j])
        out[row, j], out[row, j + 1] = 1 - w, w
    return out


def _piecewise_design(shapes: Sequence[StepShape], knots: Sequence[int]) -> np.ndarray:
    tokens = np.array([s.num_tokens for s in shapes], dtype=float)
    rest = np.array([[s.kv_tokens_attended, s.prefill_attention_pairs, s.num_prefill_chunks] for s in shapes],
                    dtype=float)
    return np.hstack([_hats(tokens, knots), rest])


def lawson_hanson(matrix: np.ndarray, target: np.ndarray, max_iterations: int = 500) -> np.ndarray:
    """Non-negative least squares by Lawson and Hanson's active-set method ("Solving Least Squares
    Problems", 1974, ch. 23), with ``numpy.linalg.lstsq`` for the passive-set solves; for the many
    columns of the piecewise form. Tested equal to :func:`nonnegative_least_squares` on small problems."""
    rows, columns = matrix.shape
    x = np.zeros(columns)
    passive = np.zeros(columns, dtype=bool)
    scale = max(1.0, float(np.abs(matrix).max()))
    tolerance = 1e-12 * scale * max(rows, columns)
    for _ in range(max_iterations):
        gradient = matrix.T @ (target - matrix @ x)
        if passive.all() or np.max(np.where(passive, -np.inf, gradient)) <= tolerance:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, gradient)))] = True
        while True:
            z = np.zeros(columns)
            z[passive], *_ = np.linalg.lstsq(matrix[:, passive], target, rcond=None)
            if np.all(z[passive] > 0):
                x = z
                break
            negative = passive & (z <= 0)
            alpha = np.min(x[negative] / (x[negative] - z[negative]))
            x = x + alpha * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
    return x

def nonnegative_least_squares(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``argmin ||matrix @ x - target||`` subject to ``x >= 0``, exactly, for a few columns: every subset
    of free columns is solved with ``numpy.linalg.lstsq``; the best feasible solution wins (the NNLS
    optimum is the unconstrained optimum on its set of positive coefficients). ``2**columns`` solves."""
    columns = matrix.shape[1]
    best, best_cost = np.zeros(columns), float(np.sum(target ** 2))
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            solution, *_ = np.linalg.lstsq(matrix[:, subset], target, rcond=None)
            if np.any(solution < 0):
                continue
            x = np.zeros(columns)
            x[list(subset)] = solution
            cost = float(np.sum((matrix @ x - target) ** 2))
            if cost < best_cost - 1e-18:
                best, best_cost = x, cost
    return best


def fit(measurements: Sequence[Measurement], form: str = "linear") -> dict[str, float]:
    """The non-negative coefficients of ``form`` (:data:`FORMS`) minimising the relative squared error
    over ``measurements`` (keys :data:`FEATURES`, seconds; ``e`` is 0 in the linear form).

    Raises:
        ValueError: an unknown form, fewer measurements than coefficients, or a step time that is not > 0.
    """
    if form not in FORMS:
        raise ValueError(f"fit: form {form!r}: known: {', '.join(FORMS)}")
    if form == "piecewise":
        return _fit_piecewise(measurements)
    used = 4 if form == "linear" else 5
    if len(measurements) < used:
        raise ValueError(f"fit: {len(measurements)} measurements; at least {len(FEATURES)} are needed")
    times = np.array([m.seconds for m in measurements], dtype=float)
    if not np.all(times > 0):
        raise ValueError("fit: every measured step time must be > 0")
    matrix = _design([m.shape for m in measurements])[:, :used] / times[:, None]
    x = np.zeros(len(FEATURES))
    x[:used] = nonnegative_least_squares(matrix, np.ones(len(times)))
    return dict(zip(FEATURES, (float(v) for v in x), strict=True))


def _fit_piecewise(measurements: Sequence[Measurement]) -> dict[str, Any]:
    shapes = [m.shape for m in measurements]
    times = np.array([m.seconds for m in measurements], dtype=float)
    if not np.all(times > 0):
        raise ValueError("fit: every measured step time must be > 0")
    knots = knots_for(shapes)
    matrix = _piecewise_design(shapes, knots) / times[:, None]
    if len(measurements) < matrix.shape[1]:
        raise ValueError(f"fit: {len(measurements)} measurements; the piecewise form needs {matrix.shape[1]}")
    x = lawson_hanson(matrix, np.ones(len(times)))
    values = x[:len(knots)]
    return {"a_s_per_step": 0.0, "b_s_per_prefill_token": 0.0, "c_s_per_decode_token": 0.0,
            "d_s_per_kv_token": float(x[-3]), "e_s_per_prefill_attention_pair": float(x[-2]),
            "f_s_per_prefill_chunk": float(x[-1]),
            "token_knots": [[int(t), float(v)] for t, v in zip(knots, values, strict=True)]}


def cost_model_of(coefficients: dict[str, Any], name: str = "fit") -> CostModel:
    """The :class:`CostModel` of fitted coefficients (any form)."""
    return CostModel(name=name, a=coefficients["a_s_per_step"], b=coefficients["b_s_per_prefill_token"],
                     c=coefficients["c_s_per_decode_token"], d=coefficients["d_s_per_kv_token"],
                     e=coefficients.get("e_s_per_prefill_attention_pair", 0.0),
                     f=coefficients.get("f_s_per_prefill_chunk", 0.0),
                     token_knots=tuple((t, v) for t, v in coefficients.get("token_knots", ())))


def relative_rms(coefficients: dict[str, float], measurements: Sequence[Measurement]) -> float:
    """Root mean square of the relative errors."""
    return float(np.sqrt(np.mean(relative_errors(coefficients, measurements) ** 2)))


def choose_form(measurements: Sequence[Measurement], form: str = "auto") -> tuple[str, dict[str, float], dict[str, float]]:
    """``(form, coefficients, {form: relative RMS error})``: with ``form="auto"`` every form is fitted and,
    going from the simplest, a more complex one is taken only when it cuts the relative RMS error below
    :data:`BETTER_FORM_GAIN` times the form chosen so far."""
    forms = list(FORMS) if form == "auto" else [form]
    fits = {name: fit(measurements, name) for name in forms}
    rms = {name: relative_rms(c, measurements) for name, c in fits.items()}
    chosen = forms[0]
    for name in forms[1:]:
        if rms[name] < BETTER_FORM_GAIN * rms[chosen]:
            chosen = name
    return chosen, fits[chosen], rms


def relative_errors(coefficients: dict[str, Any], measurements: Sequence[Measurement]) -> np.ndarray:
    """``(predicted - measured) / measured`` per measurement, predicted by the cost model itself."""
    cost = cost_model_of(coefficients)
    return np.array([(cost.shape_seconds(m.shape) - m.seconds) / m.seconds for m in measurements])


def region_errors(coefficients: dict[str, float], measurements: Sequence[Measurement]) -> dict[str, dict[str, float]]:
    """Per region (and ``all``): ``points``, ``median_abs_percent``, ``max_abs_percent`` and
    ``mean_percent`` (the bias: positive when the fit predicts slower steps than measured)."""
    errors = relative_errors(coefficients, measurements)
    out = {}
    for region in (*REGIONS, "all"):
        chosen = np.array([region in ("all", m.point.region) for m in measurements])
        if not chosen.any():
            continue
        e = errors[chosen] * 100
        out[region] = {"points": int(chosen.sum()), "median_abs_percent": float(np.median(np.abs(e))),
                       "max_abs_percent": float(np.max(np.abs(e))), "mean_percent": float(np.mean(e))}
    return out


def run_conditions(runner) -> dict[str, Any]:
    """The conditions a calibration ran under: device, dtype, torch threads and version, the model's
    shape, the machine and the load average (``os.getloadavg``) when it started."""
    import torch

    c = runner.model_config
    return {
        "device": str(runner.device) + (f" ({torch.cuda.get_device_name(runner.device)})"
                                        if runner.device.type == "cuda" else ""),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "clock": runner.clock,
        "torch_version": torch.__version__,
        "model": runner.describe(),
        "model_shape": {"architecture": c.architecture, "layers": c.num_hidden_layers, "hidden": c.hidden_size,
                        "intermediate": c.intermediate_size, "heads": c.num_attention_heads,
                        "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab": c.vocab_size},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count()},
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


PROFILE_RECORD = "schedspec-cost-profile"
PROFILE_SCHEMA_VERSION = 1


def profile_document(name: str, coefficients: dict[str, float], measurements: Sequence[Measurement],
                     conditions: dict[str, Any], grid: dict[str, Any], scheduler_config: dict[str, Any],
                     form: str = "linear", form_rms: dict[str, float] | None = None) -> dict[str, Any]:
    """The profile file's content (loaded by :func:`schedspec.reference.cost_model.load_profile`)."""
    errors = region_errors(coefficients, measurements)
    source = (f"measured: schedspec calibrate ({form} form), {len(measurements)} grid points (median of {grid['repeats']} after "
              f"{grid['warmup']} warm-up), non-negative least squares on relative error; fit error median "
              f"{errors['all']['median_abs_percent']:.1f}% / max {errors['all']['max_abs_percent']:.1f}%; "
              f"{conditions['model']}, {conditions['torch_threads']} torch threads, torch {conditions['torch_version']}")
    predicted = relative_errors(coefficients, measurements)
    return {
        "record": PROFILE_RECORD,
        "schema_version": PROFILE_SCHEMA_VERSION,
        "name": name,
        "kind": PROFILE_KIND["measured"],
        "form": form,
        "formula": FORMS[form],
        "token_knots": coefficients.get("token_knots", []),
        "relative_rms_error_percent_by_form": {k: 100 * v for k, v in (form_rms or {}).items()},
        "coefficients": {k: v for k, v in coefficients.items() if k != "token_knots"},
        "hardware": conditions["device"],
        "model": conditions["model"],
        "source": source,
        "scheduler_config": scheduler_config,
        "conditions": conditions,
        "grid": grid,
        "fit_error_percent": errors,
        "points": [
            {"region": m.point.region, "step": m.point.label, "prefill_tokens": m.shape.prefill_tokens,
             "decode_tokens": m.shape.decode_tokens, "kv_tokens_attended": m.shape.kv_tokens_attended,
             "prefill_attention_pairs": m.shape.prefill_attention_pairs, "measured_s": m.seconds,
             "spread": m.spread, "error_percent": float(e * 100)}
            for m, e in zip(measurements, predicted, strict=True)
        ],
    }


def to_cost_model(document: dict[str, Any]) -> CostModel:
    """The :class:`CostModel` of a profile document."""
    return attrs.evolve(cost_model_of({**document["coefficients"], "token_knots": document.get("token_knots", [])},
                                      document["name"]),
                        hardware=document["hardware"], model=document["model"], source=document["source"],
                        measured=True)


def dumps(document: dict[str, Any]) -> str:
    """The profile as JSON text (no NaN)."""
    return json.dumps(document, indent=2, allow_nan=False) + "\n"


def finite(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
