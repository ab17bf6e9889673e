"""Synthetic workloads: open-loop arrival processes (Poisson or gamma gaps) with prompt and output
lengths drawn from :class:`LengthDist`, and the CLI form ``--synthetic rate=..,cv=..,prompt=..,output=..``
(:func:`parse_synthetic`).

Every bad input raises :class:`~schedspec.lab.workload_checks.WorkloadError` naming the parameter.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from schedspec.spec.workload import RequestSpec

from .windows import MAX_WINDOW_SECONDS
from .workload_checks import DIGITS, MAX_TOKEN_COUNT, WorkloadError, check_number


@attrs.frozen
class LengthDist:
    """A token-length distribution, written as text (the ``prompt=``/``output=`` syntax):

    - ``N``: always ``N`` (integer >= 1).
    - ``uniform:LO:HI``: integers uniform on ``[LO, HI]`` (inclusive; 1 <= LO <= HI).
    - ``normal:MEAN:STD``: ``round(Normal(MEAN, STD))``, values below 1 set to 1 (MEAN >= 1, STD >= 0).
    - ``geom:MEAN``: geometric on ``{1, 2, ...}`` with mean MEAN (the discrete exponential; MEAN >= 1).

    Raises:
        WorkloadError: any other text (naming ``field``).
    """

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, text: str | int, field: str = "length") -> LengthDist:
        if isinstance(text, bool):
            raise WorkloadError(f"{field}={text!r}: expected a token length")
        if isinstance(text, int):
            text = str(text)
        raw = str(text).strip()
        parts = raw.split(":")
        usage = "expected N, uniform:LO:HI, normal:MEAN:STD or geom:MEAN"
        try:
            if len(parts) == 1:
                if not DIGITS.fullmatch(raw) or len(raw) > 10 or not 1 <= int(raw) <= MAX_TOKEN_COUNT:
                    raise WorkloadError(f"{field}={raw!r}: fixed length must be an integer in [1, {MAX_TOKEN_COUNT:,}] ({usage})")
                return cls("fixed", (int(raw),))
            kind, args = parts[0].strip().lower(), [float(p) for p in parts[1:]]
        except ValueError:
            raise WorkloadError(f"{field}={raw!r}: {usage}") from None
        if not all(math.isfinite(a) for a in args):
            raise WorkloadError(f"{field}={raw!r}: parameters must be finite numbers")
        if any(abs(a) > MAX_TOKEN_COUNT for a in args):
            raise WorkloadError(f"{field}={raw!r}: parameters must be at most {MAX_TOKEN_COUNT:,} tokens")
        if kind == "uniform" and len(args) == 2:
            low, high = args
            if low != int(low) or high != int(high) or not 1 <= low <= high:
                raise WorkloadError(f"{field}={raw!r}: uniform:LO:HI needs integers 1 <= LO <= HI")
            return cls("uniform", (low, high))
        if kind == "normal" and len(args) == 2:
            if args[0] < 1 or args[1] < 0:
                raise WorkloadError(f"{field}={raw!r}: normal:MEAN:STD needs MEAN >= 1 and STD >= 0")
            return cls("normal", tuple(args))
        if kind == "geom" and len(args) == 1:
            if args[0] < 1:
                raise WorkloadError(f"{field}={raw!r}: geom:MEAN needs MEAN >= 1")
            return cls("geom", tuple(args))
        raise WorkloadError(f"{field}={raw!r}: {usage}")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` integer lengths >= 1."""
        if self.kind == "fixed":
            return np.full(size, int(self.params[0]), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.params[0]), int(self.params[1]), size, endpoint=True)
        if self.kind == "normal":
            return np.clip(np.rint(rng.normal(self.params[0], self.params[1], size)), 1, MAX_TOKEN_COUNT).astype(np.int64)
        return np.minimum(rng.geometric(1.0 / self.params[0], size), MAX_TOKEN_COUNT).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.params[0]))
        return ":".join([self.kind, *(f"{p:g}" for p in self.params)])


MAX_CV = 1000.0
"""Largest coefficient of variation of the synthetic gaps (Gamma shape ``1/cv**2`` stays above 1e-6)."""

MAX_SYNTHETIC_REQUESTS = 10_000_000
"""Most requests a synthetic workload may have (``n``, or ``rate * duration``): about 2 GB of
request objects; a larger one is refused before anything is allocated."""


def _arrival_gaps(rng: np.random.Generator, rate: float, cv: float, size: int) -> np.ndarray:
    if cv < 1e-6:  # constant gaps; Gamma(1/cv**2) would overflow
        return np.full(size, 1.0 / rate)
    if cv == 1:
        return rng.exponential(1.0 / rate, size)
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, 1.0 / (rate * shape), size)


def synthetic(
    rate: float,
    cv: float = 1.0,
    prompt: int | str | LengthDist = 512,
    output: int | str | LengthDist = 128,
    num_requests: int | None = None,
    duration: float | None = None,
    seed: int = 0,
    id_prefix: str = "syn",
) -> list[RequestSpec]:
    """A synthetic open-loop workload.

    Inter-arrival gaps are i.i.d. with mean ``1/rate`` seconds and coefficient of variation ``cv``:
    exponential for ``cv == 1`` (a Poisson process, as vLLM's ``benchmark_serving --request-rate``),
    ``Gamma(shape=1/cv**2, scale=cv**2/rate)`` otherwise (``cv > 1`` bursty, ``cv < 1`` smoother, as
    ``--burstiness = 1/cv**2``), constant for ``cv == 0`` (and below 1e-6). The first request arrives at 0.0. Prompt and
    output lengths are drawn independently from :class:`LengthDist` (ints or their text syntax).

    Args:
        rate: mean arrival rate, requests per second (> 0).
        cv: coefficient of variation of the gaps (>= 0).
        prompt, output: token lengths (``prompt_len``, ``max_tokens``).
        num_requests: exactly this many requests; or
        duration: every request arriving in ``[0, duration)`` seconds. Give exactly one.
        seed: the random seed (integer >= 0); equal arguments give equal workloads.
        id_prefix: ids are ``{id_prefix}-{i:06d}``.

    Raises:
        WorkloadError: a bad parameter (named).
    """
    rate = check_number("rate", rate, minimum=0, strict=True)
    cv = check_number("cv", cv, minimum=0)
    if cv > MAX_CV:
        raise WorkloadError(f"cv={cv:g}: must be <= {MAX_CV:g}")
    prompt_dist = prompt if isinstance(prompt, LengthDist) else LengthDist.parse(prompt, "prompt")
    output_dist = output if isinstance(output, LengthDist) else LengthDist.parse(output, "output")
    if (num_requests is None) == (duration is None):
        raise WorkloadError("synthetic: give exactly one of n (num_requests) and duration")
    if num_requests is not None and (isinstance(num_requests, bool) or not isinstance(num_requests, int)
                                     or not 1 <= num_requests <= MAX_SYNTHETIC_REQUESTS):
        raise WorkloadError(f"n={num_requests!r}: must be an integer in [1, {MAX_SYNTHETIC_REQUESTS:,}]")
    if duration is not None:
        duration = check_number("duration", duration, minimum=0, strict=True)
        if rate * duration > MAX_SYNTHETIC_REQUESTS:
            raise WorkloadError(f"rate={rate:g} * duration={duration:g}: about {rate * duration:.3g} requests, more "
                                f"than {MAX_SYNTHETIC_REQUESTS:,}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise WorkloadError(f"seed={seed!r}: must be an integer >= 0")
    arrivals_rng, prompt_rng, output_rng = (np.random.default_rng([seed, stream]) for stream in range(3))
    if num_requests is not None:
        times = np.concatenate([[0.0], np.cumsum(_arrival_gaps(arrivals_rng, rate, cv, num_requests - 1))])
    else:
        chunks = [np.zeros(1)]
        last, total = 0.0, 1
        while last < duration:
            size = max(64, int(rate * (duration - last) * 1.2) + 16)
            block = last + np.cumsum(_arrival_gaps(arrivals_rng, rate, cv, size))
            chunks.append(block)
            last = float(block[-1])
            total += size
            if total > 2 * MAX_SYNTHETIC_REQUESTS + 1000:
                raise WorkloadError(f"rate={rate:g} * duration={duration:g}: more than {MAX_SYNTHETIC_REQUESTS:,} requests")
        times = np.concatenate(chunks)
        times = times[times < duration]
    if not math.isfinite(times[-1]) or times[-1] > MAX_WINDOW_SECONDS:
        raise WorkloadError(f"rate={rate:g}: the arrivals would span {times[-1]:.3g} s, more than "
                            f"{MAX_WINDOW_SECONDS:g} s")
    count = len(times)
    prompts = prompt_dist.sample(prompt_rng, count)
    outputs = output_dist.sample(output_rng, count)
    return [
        RequestSpec(request_id=f"{id_prefix}-{i:06d}", prompt_len=int(p), max_tokens=int(o), arrival_time=float(t))
        for i, (t, p, o) in enumerate(zip(times.tolist(), prompts.tolist(), outputs.tolist(), strict=True))
    ]


@attrs.frozen
class SyntheticSpec:
    """A parsed ``rate=..,cv=..,prompt=..,output=..[,n=..|,duration=..][,seed=..]`` string.

    Attributes mirror :func:`synthetic`'s parameters; :meth:`generate` calls it.
    """

    rate: float
    cv: float = 1.0
    prompt: LengthDist = LengthDist("fixed", (512,))
    output: LengthDist = LengthDist("fixed", (128,))
    num_requests: int | None = None
    duration: float | None = None
    seed: int = 0

    def generate(self, id_prefix: str = "syn") -> list[RequestSpec]:
        return synthetic(self.rate, self.cv, self.prompt, self.output, self.num_requests, self.duration,
                         self.seed, id_prefix)

    def __str__(self) -> str:
        size = f"n={self.num_requests}" if self.num_requests is not None else f"duration={self.duration:g}"
        return f"rate={self.rate:g},cv={self.cv:g},prompt={self.prompt},output={self.output},{size},seed={self.seed}"


_SYNTHETIC_KEYS = ("rate", "cv", "prompt", "output", "n", "duration", "seed")


def parse_synthetic(text: str) -> SyntheticSpec:
    """Parse the CLI form ``rate=R,cv=C,prompt=P,output=O[,n=N][,duration=S][,seed=K]``.

    ``rate`` (req/s, > 0), ``prompt`` and ``output`` (:class:`LengthDist` syntax) are required;
    ``cv`` defaults to 1 (Poisson), ``seed`` to 0; exactly one of ``n`` and ``duration`` (seconds).
    An optional leading ``synthetic:`` is ignored. Spaces around keys and values are ignored.

    Raises:
        WorkloadError: unknown, repeated or missing keys, or bad values (the key is named).
    """
    body = text.strip()
    if body.startswith("synthetic:"):
        body = body[len("synthetic:"):]
    values: dict[str, str] = {}
    for item in body.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise WorkloadError(f"synthetic: {item.strip()!r}: expected key=value")
        if key not in _SYNTHETIC_KEYS:
            raise WorkloadError(f"synthetic: unknown key {key!r}; known: {', '.join(_SYNTHETIC_KEYS)}")
        if key in values:
            raise WorkloadError(f"synthetic: key {key!r} given twice")
        values[key] = value.strip()
    for key in ("rate", "prompt", "output"):
        if key not in values:
            raise WorkloadError(f"synthetic: missing key {key!r} (form: rate=R,cv=C,prompt=P,output=O,n=N,seed=K)")

    def number(key: str) -> float:
        try:
            value = float(values[key])
        except ValueError:
            raise WorkloadError(f"synthetic: {key}={values[key]!r}: not a number") from None
        return value

    def integer(key: str) -> int:
        if not DIGITS.fullmatch(values[key]) or len(values[key]) > 18:
            raise WorkloadError(f"synthetic: {key}={values[key]!r}: must be a non-negative integer")
        return int(values[key])

    spec = SyntheticSpec(
        rate=number("rate"),
        cv=number("cv") if "cv" in values else 1.0,
        prompt=LengthDist.parse(values["prompt"], "prompt"),
        output=LengthDist.parse(values["output"], "output"),
        num_requests=integer("n") if "n" in values else None,
        duration=number("duration") if "duration" in values else None,
        seed=integer("seed") if "seed" in values else 0,
    )
    # Validate the numbers once, with the same messages as synthetic().
    check_number("rate", spec.rate, minimum=0, strict=True)
    check_number("cv", spec.cv, minimum=0)
    if spec.cv > MAX_CV:
        raise WorkloadError(f"synthetic: cv={spec.cv:g}: must be <= {MAX_CV:g}")
    if (spec.num_requests is None) == (spec.duration is None):
        raise WorkloadError("synthetic: give exactly one of n and duration")
    if spec.num_requests is not None and not 1 <= spec.num_requests <= MAX_SYNTHETIC_REQUESTS:
        raise WorkloadError(f"synthetic: n={spec.num_requests}: must be in [1, {MAX_SYNTHETIC_REQUESTS:,}]")
    if spec.duration is not None:
        check_number("duration", spec.duration, minimum=0, strict=True)
        if spec.rate * spec.duration > MAX_SYNTHETIC_REQUESTS:
            raise WorkloadError(f"synthetic: rate={spec.rate:g} * duration={spec.duration:g}: about "
                                f"{spec.rate * spec.duration:.3g} requests, more than {MAX_SYNTHETIC_REQUESTS:,}")
    return spec
