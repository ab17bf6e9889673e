"""Window selection: the part of a workload a lab run replays (``--start``, ``--duration``,
``--max-requests``, ``--time-scale``), re-based to 0.

Every bad input raises :class:`~schedspec.lab.workload_checks.WorkloadError` naming the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from schedspec.spec.workload import RequestSpec

from .workload_checks import WorkloadError, check_number


def _sorted(requests: list[RequestSpec]) -> list[RequestSpec]:
    # Stable: equal arrival times keep their order.
    return sorted(requests, key=lambda r: r.arrival_time)


MAX_WINDOW_SECONDS = 1e9
YEAR_SECONDS = 365.25 * 24 * 3600
"""Longest simulated window, seconds (about 31 years). Float seconds keep a resolution under a
microsecond up to here, so millisecond step times still add up; beyond it they would vanish
(a TTFT of 0.0 ms)."""


def select_window(
    requests: Iterable[RequestSpec],
    start: float | None = None,
    duration: float | None = None,
    max_requests: int | None = None,
    time_scale: float = 1.0,
) -> list[RequestSpec]:
    """A time window of a workload, re-based to 0 and optionally sped up or slowed down.

    Keeps the requests with ``start <= arrival_time < start + duration`` (trace seconds; ``start``
    default: the first arrival, ``duration`` default: to the end), then the first ``max_requests``
    of them. Arrival times become ``(arrival_time - first kept arrival) * time_scale``: the first kept
    request arrives at 0.0 and every inter-arrival gap is multiplied by ``time_scale`` (0.5 = arrivals
    twice as fast). ``abort_at_time`` is shifted and scaled the same way. Other fields are unchanged.

    Raises:
        WorkloadError: no requests given, ``start`` negative or not finite, ``duration <= 0``,
            ``max_requests < 1`` or not an integer, ``time_scale <= 0``, a window with no requests,
            or a window longer than :data:`MAX_WINDOW_SECONDS` (its arrivals' span times ``time_scale``).
    """
    ordered = _sorted(list(requests))
    if not ordered:
        raise WorkloadError("the workload has no requests")
    if start is not None:
        start = check_number("start", start, minimum=0)
    if duration is not None:
        duration = check_number("duration", duration, minimum=0, strict=True)
    if max_requests is not None and (isinstance(max_requests, bool) or not isinstance(max_requests, int)
                                     or max_requests < 1):
        raise WorkloadError(f"max_requests={max_requests!r}: must be an integer >= 1")
    time_scale = check_number("time_scale", time_scale, minimum=0, strict=True)
    low = ordered[0].arrival_time if start is None else start
    kept = [r for r in ordered if r.arrival_time >= low and (duration is None or r.arrival_time < low + duration)]
    if max_requests is not None:
        kept = kept[:max_requests]
    if not kept:
        end = "end" if duration is None else f"{low + duration:.10g} s"
        raise WorkloadError(
            f"start={low:.10g}, duration={duration if duration is None else f'{duration:.10g}'}: no requests "
            f"arrive in [{low:.10g} s, {end}) (the workload spans {ordered[0].arrival_time:.10g} s to "
            f"{ordered[-1].arrival_time:.10g} s)"
        )
    origin = kept[0].arrival_time
    span = (kept[-1].arrival_time - origin) * time_scale
    if span > MAX_WINDOW_SECONDS:
        limit = f"more than the {MAX_WINDOW_SECONDS:g} s (about 31 years) a run can time (step times of " \
                "milliseconds would be lost in the clock's rounding)"
        arrivals = (f"its arrivals span {kept[-1].arrival_time - origin:.3g} s "
                    f"({(kept[-1].arrival_time - origin) / YEAR_SECONDS:,.3g} years)")
        if time_scale == 1:  # the trace itself: its timestamps, not the time scale, are the problem
            raise WorkloadError(f"the window is too long: {arrivals}, {limit}; choose a shorter window "
                                "(start, duration, max_requests) or check the trace's timestamps")
        raise WorkloadError(f"time_scale={time_scale:g}: the window would span {span:.3g} s of simulated time "
                            f"({arrivals}, times the time scale), {limit}")
    return [
        attrs.evolve(
            r,
            arrival_time=(r.arrival_time - origin) * time_scale,
            abort_at_time=None if r.abort_at_time is None else max(0.0, (r.abort_at_time - origin) * time_scale),
        )
        for r in kept
    ]


TOKEN_SCALE = 16
"""Trace tokens per engine token in :func:`scaled_mooncake_window`: a Mooncake hash block of 512 tokens
becomes 32, one vLLM block of the CPU engine."""


def scaled_mooncake_window(start: float, max_requests: int) -> list[RequestSpec]:
    """A window of the bundled Mooncake conversation trace scaled to a tiny whole engine (the recorder's
    tests, ``scripts/record_vllm_serve.py``): from ``start`` seconds, at most ``max_requests`` requests;
    prompts and their hashed blocks divided by :data:`TOKEN_SCALE` (so requests that share hash ids
    share token prefixes), outputs by 8 (at most 64), prompts over 600 tokens left out."""
    from schedspec.lab.trace_formats import load_trace, packaged_trace_path

    window = select_window(load_trace(packaged_trace_path("mooncake_conversation_trace.jsonl")), start=start,
                           max_requests=max_requests)
    scaled = []
    for spec in window:
        prompt_len = max(1, spec.prompt_len // TOKEN_SCALE)
        if prompt_len > 600:
            continue
        scaled.append(attrs.evolve(spec, prompt_len=prompt_len, max_tokens=min(64, max(1, spec.max_tokens // 8)),
                                   hash_block_tokens=512 // TOKEN_SCALE))
    return scaled
