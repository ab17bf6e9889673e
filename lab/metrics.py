"""Per-request latency timelines, latency and efficiency summaries, and SLO attainment (goodput).

Definitions follow vLLM's serving benchmark (``benchmarks/benchmark_serving.py``,
``vllm bench serve``); all times are seconds on the run's clock (simulated or wall clock):

- **TTFT** (time to first token) = time of the first output token - arrival time.
- **ITL** (inter-token latency) = each gap between consecutive output token times of one request;
  a request with ``n`` tokens has ``n - 1`` ITLs. Summaries pool the ITLs of all requests. With
  speculative decoding a step can give a request several tokens at once (its accepted drafts and the
  sampled token): they arrive together, so they count as one arrival and one ITL, as vLLM's benchmark
  measures ITL per streamed chunk (``benchmarks/lib/endpoint_request_func.py``: one ``itl`` entry per
  chunk); TPOT stays per token, so it is the figure speculation improves.
- **TPOT** (time per output token) = (last token time - first token time) / (n - 1), for requests
  with ``n >= 2`` tokens (vLLM: ``(latency - ttft) / (output_len - 1)``; the same thing, since a
  request finishes at its last token).
- **E2E** (end-to-end latency) = finish time - arrival time.
- **Queueing delay** = start of the step that first scheduled any of the request's tokens - arrival.

A token's time is the **end** of the step that sampled it (``start_time + duration`` of its
:class:`~schedspec.spec.trace.StepRecord`). Latency summaries use finished requests only (vLLM
counts successful requests only); the request counts by outcome are reported next to them so a
survivor bias (many requests aborted or still live) is visible.

Percentiles are ``numpy.percentile`` with its default linear interpolation (as vLLM).
"""

from __future__ import annotations

import csv
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import attrs
import numpy as np

OUTCOMES = ("finished", "aborted", "rejected", "live")
"""Request outcomes (:attr:`schedspec.spec.request.RequestStatus.outcome`)."""

LATENCY_METRICS = ("ttft", "itl", "tpot", "e2e", "queueing")
"""Metric keys of :func:`latency_summary`."""

PERCENTILES = (50, 95, 99)


class MetricsError(ValueError):
    """Unusable metric input (bad SLO text, bad argument); the message names the field."""


@attrs.define
class RequestTimeline:
    """What happened to one request, in seconds on the run's clock.

    Attributes:
        request_id: the request.
        prompt_len: prompt tokens.
        arrival_time: when it arrived.
        first_scheduled_time: start of the first step that computed any of its tokens; ``None`` if it
            never ran.
        token_times: the time of every output token, in order: the end of the step that sampled it
            (after a recompute preemption the recomputed step that samples the next token counts once;
            tokens a speculative step kept share its end time).
        finish_time: when it ended (finished: end of its last step; aborted/rejected: start of the step
            before which that happened); ``None`` while live.
        outcome: ``finished``, ``aborted``, ``rejected`` or ``live``.
        finish_reason: ``stop``, ``length``, ``max_model_len`` for finished requests, else ``None`` or
            the engine's reason.
        num_preemptions: times it was preempted.
        arrived_during_long_prefill: set by the caller (the lab: it arrived while a step containing a
            prefill chunk of a long prompt was running).
    """

    request_id: str
    prompt_len: int
    arrival_time: float
    first_scheduled_time: float | None = None
    token_times: list[float] = attrs.field(factory=list, converter=list)
    finish_time: float | None = None
    outcome: str = "live"
    finish_reason: str | None = None
    num_preemptions: int = 0
    arrived_during_long_prefill: bool = False
    speculative: bool = False
    """Set by the caller when some step gave the request several tokens at once (speculative decoding):
    ITLs then count tokens of equal times once."""

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        """First token time - arrival; ``None`` without tokens."""
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive token arrivals: ``n - 1`` values for ``n`` tokens from ``n`` steps;
        tokens of one speculative step (equal times) arrive once (module docstring)."""
        times = self.token_times
        gaps = [times[i + 1] - times[i] for i in range(len(times) - 1)]
        return [gap for gap in gaps if gap > 0] if self.speculative else gaps

    @property
    def max_itl(self) -> float | None:
        """Largest ITL; ``None`` with fewer than 2 tokens (or, speculative, fewer than 2 arrivals)."""
        itls = self.itls
        return max(itls) if len(self.token_times) >= 2 and itls else None

    @property
    def tpot(self) -> float | None:
        """(last - first token time) / (n - 1); ``None`` with fewer than 2 tokens."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n >= 2 else None

    @property
    def e2e(self) -> float | None:
        """Finish time - arrival; ``None`` while live."""
        return self.finish_time - self.arrival_time if self.finish_time is not None else None

    @property
    def queueing_delay(self) -> float | None:
        """First scheduled time - arrival; ``None`` if never scheduled."""
        return self.first_scheduled_time - self.arrival_time if self.first_scheduled_time is not None else None


# --------------------------------------------------------------------------------------------------
# Latency


def stats(values: Iterable[float]) -> dict[str, float | int | None]:
    """``{"count", "mean", "p50", "p95", "p99", "max"}`` of ``values``; all but count ``None`` when
    empty."""
    array = np.asarray(list(values), dtype=float)
    if array.size == 0:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    return {
        "count": int(array.size),
        "mean": float(array.mean()),
        **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES},
        "max": float(array.max()),
    }


def long_prompt_threshold(prompt_lens: Iterable[int]) -> int:
    """The top-decile prompt length: ``ceil(numpy.percentile(prompt_lens, 90))``, the percentile rounded
    to 6 decimals first so that floating-point noise (``760.0000000000001``) does not move it; prompts at
    or above it are "long" (0 for no prompts)."""
    lens = list(prompt_lens)
    return int(math.ceil(round(float(np.percentile(lens, 90)), 6))) if lens else 0


def _latency_block(timelines: Sequence[RequestTimeline]) -> dict[str, dict[str, float | int | None]]:
    return {
        "ttft": stats(t.ttft for t in timelines if t.ttft is not None),
        "itl": stats(gap for t in timelines for gap in t.itls),
        "tpot": stats(t.tpot for t in timelines if t.tpot is not None),
        "e2e": stats(t.e2e for t in timelines if t.e2e is not None),
        "queueing": stats(t.queueing_delay for t in timelines if t.queueing_delay is not None),
    }


def latency_summary(timelines: Sequence[RequestTimeline], long_prompt_len: int | None = None) -> dict[str, Any]:
    """Latency statistics of the finished requests, overall and for two groups.

    Args:
        timelines: every request of the run (all outcomes).
        long_prompt_len: prompts of at least this many tokens are "long"; default
            :func:`long_prompt_threshold` over the admitted ``timelines`` (the top decile of the
            requests that were not rejected: a rejected prompt, e.g. one longer than
            ``max_model_len``, would otherwise set a threshold no admitted prompt reaches).

    Returns:
        ``{"requests": {outcome: count, ..., "total": n}, "long_prompt_len": int,
        "all": BLOCK, "long_prompts": BLOCK, "arrived_during_long_prefill": BLOCK}`` where ``BLOCK`` maps
        each of :data:`LATENCY_METRICS` to :func:`stats` (seconds; ``queueing`` is the queueing delay). Only finished requests enter a
        ``BLOCK``; ``itl`` pools every gap of every request in the group; ``tpot`` covers requests
        with >= 2 tokens.
    """
    counts = Counter(t.outcome for t in timelines)
    threshold = (long_prompt_threshold(t.prompt_len for t in timelines if t.outcome != "rejected")
                 if long_prompt_len is None else long_prompt_len)
    finished = [t for t in timelines if t.outcome == "finished"]
    return {
        "requests": {**{outcome: counts.get(outcome, 0) for outcome in OUTCOMES}, "total": len(timelines)},
        "long_prompt_len": threshold,
        "all": _latency_block(finished),
        "long_prompts": _latency_block([t for t in finished if t.prompt_len >= threshold]),
        "arrived_during_long_prefill": _latency_block([t for t in finished if t.arrived_during_long_prefill]),
    }


# --------------------------------------------------------------------------------------------------
# Efficiency


EFFICIENCY_KEYS = (
    "num_steps", "num_empty_steps", "tokens_per_step_mean", "tokens_per_step_p50", "tokens_per_step_p99",
    "prefill_tokens", "decode_tokens", "running_mean", "running_max", "preemptions",
    "max_preemptions_per_request", "kv_usage_mean", "kv_usage_max", "span_s", "output_tokens_per_s",
    "total_tokens_per_s", "computed_tokens_per_s", "requests_per_s",
)
"""Keys of :func:`efficiency_summary`, in display order."""

SPECULATIVE_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "draft_acceptance_rate",
                    "mean_acceptance_length")
"""Keys :func:`efficiency_summary` adds after ``tokens_per_step_p99`` when some step verified drafts
(speculative decoding), vLLM 0.32 ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingStats``,
``SpecDecodingLogging.log``): ``num_drafts`` decodes that verified at least one draft,
``num_draft_tokens`` drafts verified, ``num_accepted_tokens`` of them accepted, ``draft_acceptance_rate``
= accepted / drafted (a fraction 0-1; vLLM logs it as a percent), ``mean_acceptance_length`` = 1 +
accepted / ``num_drafts`` (tokens a verifying decode yields, the sampled token included)."""


def draft_counts(record: Any) -> tuple[int, int, int]:
    """``(num_drafts, num_draft_tokens, num_accepted_tokens)`` of one step: a ``LabStep``'s counts, or a
    :class:`StepRecord`'s scheduled items' ``spec_token_ids`` and its ``num_accepted_tokens``; zeros for a
    step without speculative decoding."""
    if hasattr(record, "num_draft_tokens"):
        return record.num_drafts, record.num_draft_tokens, record.num_accepted_tokens
    drafts = [len(ids) for item in getattr(record, "scheduled", ()) if (ids := getattr(item, "spec_token_ids", ()))]
    accepted = getattr(record, "num_accepted_tokens", None) or {}
    return len(drafts), sum(drafts), sum(accepted.values())


def efficiency_summary(
    records: Sequence[Any], num_kv_blocks: int, timelines: Sequence[RequestTimeline] | None = None
) -> dict[str, float | int | None]:
    """How well the steps used the GPU and the KV cache, as a flat dict (keys :data:`EFFICIENCY_KEYS`).

    Args:
        records: the run's steps in order: :class:`StepRecord` s, or any objects with ``start_time``,
            ``duration``, ``prefill_tokens``, ``decode_tokens``, ``num_running``, ``num_free_blocks``
            and either ``preempted``/``finished`` (ids) or ``num_preempted``/``num_finished`` (counts),
            such as the lab's ``LabStep``.
        num_kv_blocks: the KV pool size of the run's config.
        timelines: the run's requests; when given, output tokens, finished requests and per-request
            preemptions come from them (needed for steps that carry only counts).

    Returns:
        - ``num_steps``; ``num_empty_steps``: steps that scheduled no token.
        - ``tokens_per_step_mean/p50/p99``: prefill + decode tokens per non-empty step (a decode's
          drafts are decode tokens).
        - with speculative decoding only (some step verified drafts), :data:`SPECULATIVE_KEYS` next.
        - ``prefill_tokens``, ``decode_tokens``: totals (recompute counts as prefill).
        - ``running_mean/max``: ``num_running`` after each non-empty step.
        - ``preemptions``: total; ``max_preemptions_per_request``: the most any request had.
        - ``kv_usage_mean/max``: ``1 - num_free_blocks / num_kv_blocks`` after each step; the mean is
          weighted by step duration (time while steps ran; idle gaps are not counted), unweighted if
          every duration is 0.
        - ``span_s``: first step's start to the latest step end (idle gaps included).
        - per second of ``span_s``: ``output_tokens_per_s`` (sampled tokens), ``total_tokens_per_s``
          (vLLM's "total token throughput": prompt plus output tokens of finished requests),
          ``computed_tokens_per_s`` (every scheduled token, recomputation included), ``requests_per_s``
          (finished requests).

        A value that cannot be computed (no steps, zero span, counts-only steps without
        ``timelines``) is ``None``.

    Raises:
        MetricsError: ``num_kv_blocks < 1``.
    """
    if isinstance(num_kv_blocks, bool) or not isinstance(num_kv_blocks, int) or num_kv_blocks < 1:
        raise MetricsError(f"num_kv_blocks={num_kv_blocks!r}: must be an integer >= 1")
    prompt_len: dict[str, int] = {}
    outputs: Counter[str] = Counter()
    preempted: Counter[str] = Counter()
    finished: list[str] = []
    has_ids = has_outputs = True
    preemptions = finished_count = 0
    tokens: list[int] = []
    running: list[int] = []
    usage: list[float] = []
    weights: list[float] = []
    prefill_total = decode_total = 0
    num_drafts = num_draft_tokens = num_accepted = 0
    start = end = None
    for record in records:
        drafts, drafted, accepted = draft_counts(record)
        num_drafts += drafts
        num_draft_tokens += drafted
        num_accepted += accepted
        for spec in getattr(record, "arrivals", ()):
            prompt_len[spec.request_id] = spec.prompt_len
        prefill, decode = record.prefill_tokens, record.decode_tokens
        prefill_total += prefill
        decode_total += decode
        if prefill + decode:
            tokens.append(prefill + decode)
            running.append(record.num_running)
        ids = getattr(record, "preempted", None)
        if ids is None:
            has_ids = False
            preemptions += record.num_preempted
            finished_count += record.num_finished
        else:
            preempted.update(ids)
            preemptions += len(ids)
            finished.extend(record.finished)
            finished_count += len(record.finished)
        sampled = getattr(record, "sampled_token_ids", None)
        if sampled is None:
            has_outputs = False
        else:
            outputs.update(sampled.keys())
        usage.append(1.0 - record.num_free_blocks / num_kv_blocks)
        weights.append(record.duration)
        start = record.start_time if start is None else min(start, record.start_time)
        step_end = record.start_time + record.duration
        end = step_end if end is None else max(end, step_end)
    span = (end - start) if start is not None else 0.0

    num_output: int | None
    finished_tokens: int | None
    most_preempted: int | None
    if timelines is not None:
        num_output = sum(len(t.token_times) for t in timelines)
        done = [t for t in timelines if t.outcome == "finished"]
        finished_count = len(done)
        finished_tokens = sum(t.prompt_len + len(t.token_times) for t in done)
        most_preempted = max((t.num_preemptions for t in timelines), default=0)
    else:
        num_output = sum(outputs.values()) if has_outputs else None
        finished_tokens = (sum(prompt_len.get(rid, 0) + outputs[rid] for rid in finished)
                           if has_ids and has_outputs else None)
        most_preempted = max(preempted.values(), default=0) if has_ids else None

    def rate(amount: float | None) -> float | None:
        return amount / span if span > 0 and amount is not None else None

    token_array = np.asarray(tokens, dtype=float)
    usage_mean = usage_max = None
    if usage:
        weight_array = np.asarray(weights, dtype=float)
        usage_array = np.asarray(usage, dtype=float)
        usage_mean = float(np.average(usage_array, weights=weight_array) if weight_array.sum() > 0
                           else usage_array.mean())
        usage_max = float(usage_array.max())
    speculative: dict[str, float | int | None] = {}
    if num_drafts:
        speculative = {
            "num_drafts": num_drafts,
            "num_draft_tokens": num_draft_tokens,
            "num_accepted_tokens": num_accepted,
            "draft_acceptance_rate": num_accepted / num_draft_tokens,
            "mean_acceptance_length": 1.0 + num_accepted / num_drafts,
        }
    return {
        "num_steps": len(usage),
        "num_empty_steps": len(usage) - len(tokens),
        "tokens_per_step_mean": float(token_array.mean()) if tokens else None,
        "tokens_per_step_p50": float(np.percentile(token_array, 50)) if tokens else None,
        "tokens_per_step_p99": float(np.percentile(token_array, 99)) if tokens else None,
        **speculative,
        "prefill_tokens": prefill_total,
        "decode_tokens": decode_total,
        "running_mean": float(np.mean(running)) if running else None,
        "running_max": int(max(running)) if running else None,
        "preemptions": preemptions,
        "max_preemptions_per_request": most_preempted,
        "kv_usage_mean": usage_mean,
        "kv_usage_max": usage_max,
        "span_s": span,
        "output_tokens_per_s": rate(num_output),
        "total_tokens_per_s": rate(finished_tokens),
        "computed_tokens_per_s": rate(prefill_total + decode_total),
        "requests_per_s": rate(finished_count),
    }


# --------------------------------------------------------------------------------------------------
# Prefix cache hit rate

PREFIX_HIT_KEYS = (
    "enable_prefix_caching", "block_size", "prefix_hit_rate", "prefix_hit_tokens", "prefix_query_tokens",
    "prefix_admissions", "prefix_hit_tokens_after_preemption", "prefix_query_tokens_after_preemption",
    "prefix_readmissions",
)
"""Keys of :meth:`PrefixHitCounter.summary`, in display order."""


class PrefixHitCounter:
    """Counts prefix-cache hits in tokens from a run's :class:`~schedspec.spec.trace.StepRecord` s, fed one
    at a time (:meth:`observe`), so the lab need not keep its records.

    An **admission** is a step that schedules a request that was waiting (arrived, or preempted
    earlier). Its **query** is the tokens looked up in the cache: the prompt for a first admission;
    prompt plus the outputs sampled so far for a re-admission after a preemption. Its **hit** is the
    record's ``prefix_hit_tokens`` for it (0 when absent). The hit rate covers first admissions only:
    a re-admission mostly finds the blocks it computed itself before its preemption, which measures
    recomputation saved, not prompts shared, so those are counted apart (as vLLM V1's
    ``PrefixCacheStats`` keeps preempted requests' queries and hits apart, ``vllm/v1/metrics/stats.py``).
    """

    def __init__(self) -> None:
        self.prompt_len: dict[str, int] = {}
        self.outputs: Counter[str] = Counter()
        self.waiting: set[str] = set()
        self.preempted_once: set[str] = set()
        self.hits = self.queries = self.admissions = 0
        self.hits_after = self.queries_after = self.readmissions = 0

    def observe(self, record: Any) -> None:
        """One step, in order: a :class:`StepRecord` or any object with ``arrivals`` (items with
        ``request_id`` and ``prompt_len``), ``aborts``, ``scheduled`` (items with ``request_id``),
        ``prefix_hit_tokens``, ``preempted``, ``rejected`` and ``sampled_token_ids``."""
        for spec in record.arrivals:
            self.prompt_len[spec.request_id] = spec.prompt_len
            self.waiting.add(spec.request_id)
        for request_id in record.aborts:
            self.waiting.discard(request_id)
        hits = record.prefix_hit_tokens
        for item in record.scheduled:
            request_id = item.request_id
            if request_id not in self.waiting:
                continue
            self.waiting.discard(request_id)
            query = self.prompt_len.get(request_id, 0) + self.outputs[request_id]
            hit = int(hits.get(request_id, 0))
            if request_id in self.preempted_once:
                self.readmissions += 1
                self.queries_after += query
                self.hits_after += hit
            else:
                self.admissions += 1
                self.queries += query
                self.hits += hit
        for request_id in record.rejected:
            self.waiting.discard(request_id)
        for request_id in record.preempted:
            self.waiting.add(request_id)
            self.preempted_once.add(request_id)
        self.outputs.update(record.sampled_token_ids.keys())

    def summary(self, enable_prefix_caching: bool, block_size: int) -> dict[str, Any]:
        """The counts with their conditions (keys :data:`PREFIX_HIT_KEYS`).

        Returns:
            ``enable_prefix_caching`` and ``block_size`` (the conditions: a hit is whole blocks of
            ``block_size`` tokens, capped so that one prompt token is still computed);
            ``prefix_hit_rate`` = ``prefix_hit_tokens / prefix_query_tokens`` over first admissions
            (fraction 0-1; ``None`` without admissions); ``prefix_admissions``; the same counts for
            re-admissions after a preemption (``*_after_preemption``, ``prefix_readmissions``),
            left out of the rate.
        """
        return {
            "enable_prefix_caching": enable_prefix_caching,
            "block_size": block_size,
            "prefix_hit_rate": self.hits / self.queries if self.queries else None,
            "prefix_hit_tokens": self.hits,
            "prefix_query_tokens": self.queries,
            "prefix_admissions": self.admissions,
            "prefix_hit_tokens_after_preemption": self.hits_after,
            "prefix_query_tokens_after_preemption": self.queries_after,
            "prefix_readmissions": self.readmissions,
        }


def prefix_hit_summary(records: Iterable[Any], enable_prefix_caching: bool, block_size: int) -> dict[str, Any]:
    """:meth:`PrefixHitCounter.summary` of a whole run's records (in step order)."""
    counter = PrefixHitCounter()
    for record in records:
        counter.observe(record)
    return counter.summary(enable_prefix_caching, block_size)


# --------------------------------------------------------------------------------------------------
# SLOs and goodput


def meets_slo(
    timeline: RequestTimeline,
    ttft_slo: float | None = None,
    itl_slo: float | None = None,
    tpot_slo: float | None = None,
    e2e_slo: float | None = None,
) -> bool:
    """Whether one request attained its SLOs: it finished, and TTFT <= ``ttft_slo``, **every** ITL <=
    ``itl_slo`` (its maximum ITL), TPOT <= ``tpot_slo``, E2E <= ``e2e_slo``, for each SLO given
    (``None``: not checked). A request with one token has no ITL or TPOT and meets those SLOs."""
    if timeline.outcome != "finished":
        return False
    checks = (
        (ttft_slo, timeline.ttft),
        (itl_slo, timeline.max_itl),
        (tpot_slo, timeline.tpot),
        (e2e_slo, timeline.e2e),
    )
    for slo, value in checks:
        if slo is not None and value is not None and value > slo:
            return False
    if ttft_slo is not None and timeline.ttft is None:
        return False
    return True


class Slo(NamedTuple):
    """Per-request latency objectives in seconds; ``None``: not checked. Unpacks in the order of
    :func:`goodput`'s parameters, so ``goodput(timelines, *slo)`` works."""

    ttft: float | None = None
    itl: float | None = None
    tpot: float | None = None
    e2e: float | None = None


def goodput(
    timelines: Sequence[RequestTimeline],
    ttft_slo: float | None = None,
    itl_slo: float | None = None,
    tpot_slo: float | None = None,
    e2e_slo: float | None = None,
) -> dict[str, Any]:
    """SLO attainment: the share of **non-rejected** requests (finished, aborted or still live) that
    :func:`meets_slo` (SLOs in seconds).

    This is DistServe's per-request SLO attainment: a request attains its SLO when its TTFT and all of
    its token gaps do ("every ITL <= slo", i.e. its maximum ITL, is the strict form of a per-token
    deadline: one stall fails the request). Rejected requests are left out of the denominator: the
    system declined them at arrival (they could never fit) and no scheduler could serve them. Aborted
    and live requests count as missing the SLO. vLLM's ``--goodput`` reports the *rate* of such
    requests (requests/s); ``met / span`` gives that.

    Returns:
        ``{"percent": 100 * met / admitted (None if admitted == 0), "met": int, "admitted": int,
        "ttft_slo", "itl_slo", "tpot_slo", "e2e_slo": the SLOs (None if not checked)}``.

    Raises:
        MetricsError: no SLO given, or an SLO that is not a number > 0.
    """
    slos = {"ttft_slo": ttft_slo, "itl_slo": itl_slo, "tpot_slo": tpot_slo, "e2e_slo": e2e_slo}
    if all(value is None for value in slos.values()):
        raise MetricsError("goodput: give at least one SLO (ttft, itl, tpot or e2e)")
    for name, value in slos.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not math.isfinite(value) or value <= 0):
            raise MetricsError(f"{name}={value!r}: SLO must be a number of seconds > 0")
    admitted = [t for t in timelines if t.outcome != "rejected"]
    met = sum(1 for t in admitted if meets_slo(t, ttft_slo, itl_slo, tpot_slo, e2e_slo))
    return {
        "percent": 100.0 * met / len(admitted) if admitted else None,
        "met": met,
        "admitted": len(admitted),
        **slos,
    }


_SLO_VALUE = re.compile(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)?")


def parse_slo(text: str) -> Slo:
    """Parse ``"ttft=2,itl=100ms"`` into ``Slo(ttft=2.0, itl=0.1)``.

    Keys: ``ttft``, ``itl``, ``tpot``, ``e2e`` (at least one; case-insensitive). Values: a number of
    seconds, with an optional ``s`` or ``ms`` suffix, > 0.

    Raises:
        MetricsError: empty text, an item without ``=``, an unknown or repeated key, or a bad value
            (the key is named).
    """
    result: dict[str, float] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep:
            raise MetricsError(f"SLO {item.strip()!r}: expected key=value (e.g. ttft=2s,itl=100ms)")
        if key not in Slo._fields:
            raise MetricsError(f"SLO key {key!r}: unknown; known: {', '.join(Slo._fields)} (goodput), or "
                               f"METRIC_pN for a percentile (e.g. ttft_p90), METRIC one of "
                               f"{', '.join(LATENCY_METRICS)}")
        if key in result:
            raise MetricsError(f"SLO key {key!r}: given twice")
        match = _SLO_VALUE.fullmatch(value)
        if match is None:
            raise MetricsError(f"SLO {key}={value!r}: expected a number of seconds, optionally with s or ms")
        seconds = float(match.group(1)) / (1000.0 if match.group(2) == "ms" else 1.0)
        if not 0 < seconds <= 1e9:
            raise MetricsError(f"SLO {key}={value!r}: must be > 0 and at most 1e9 s")
        result[key] = seconds
    if not result:
        raise MetricsError(f"SLO {text!r}: empty; expected e.g. ttft=2s,itl=100ms")
    return Slo(**result)


# --------------------------------------------------------------------------------------------------
# Export

CSV_COLUMNS = (
    "request_id", "outcome", "finish_reason", "prompt_len", "num_output_tokens", "arrival_time",
    "first_scheduled_time", "first_token_time", "finish_time", "queueing_delay", "ttft", "tpot",
    "max_itl", "e2e", "num_preemptions", "arrived_during_long_prefill",
)
"""Columns of :func:`timelines_to_csv` (times in seconds; empty cell = not applicable)."""


def timelines_to_csv(timelines: Iterable[RequestTimeline], path: str | Path) -> int:
    """Write one row per request with :data:`CSV_COLUMNS` (header first, LF line ends, floats with
    full precision, ``None`` as an empty cell). Returns the number of rows written.

    Raises:
        MetricsError: the file cannot be written.
    """
    path = Path(path)
    try:
        with path.open("w", encoding="utf-8", newline="") as handle:
            return write_timelines_csv(timelines, handle)
    except OSError as error:
        raise MetricsError(f"{path}: cannot write ({error.strerror})") from None


def write_timelines_csv(timelines: Iterable[RequestTimeline], handle: TextIO) -> int:
    """:func:`timelines_to_csv` into an open text file (opened with ``newline=""``). Returns the
    number of rows written."""
    rows = 0
    writer = csv.writer(handle, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for t in timelines:
        values = [getattr(t, column) for column in CSV_COLUMNS]
        writer.writerow(["" if v is None else (repr(v) if isinstance(v, float) else v) for v in values])
        rows += 1
    return rows
