"""The lab: run an iteration-level scheduler on a real trace and collect what every step did.

:func:`run_lab` drives :class:`~schedspec.reference.engine.Engine` in time mode (a simulated clock
advanced by each step's duration from the cost model, or measured by a real backend), collects one
:class:`LabStep` per step and one :class:`~schedspec.lab.metrics.RequestTimeline` per request,
and returns them with the run's checks. ``schedspec lab`` prints them.

Named variants (``--compare``) are schedulers with config changes:

====================  =========  ============================================================
name                  scheduler  changes
====================  =========  ============================================================
fcfs                  fcfs       none
static                static     none
fcfs-no-chunking      fcfs       enable_chunked_prefill=false, max_num_batched_tokens raised
                                 to at least max_model_len (vLLM requires it without chunking)
static-no-chunking    static     same as fcfs-no-chunking
fcfs-prefix-cache     fcfs       enable_prefix_caching=true
fcfs-no-prefix-cache  fcfs       enable_prefix_caching=false
====================  =========  ============================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TextIO

import attrs
import numpy as np

from schedspec.reference.engine import Engine, RunResult, StepView
from schedspec.reference.fake_model import AcceptanceModel, CostOnlyModel, FakeModel, TokenSource
from schedspec.reference.scheduler import make_scheduler, unchecked_implementation
from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.stepper import prefix_hit_tokens
from schedspec.spec.trace import StepRecord, header_line
from schedspec.spec.workload import RequestSpec

from .metrics import PrefixHitCounter, RequestTimeline, long_prompt_threshold


def _no_chunking(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(config["max_num_batched_tokens"], config["max_model_len"]),
    }


VARIANTS: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "fcfs-no-chunking": ("fcfs", _no_chunking),
    "static-no-chunking": ("static", _no_chunking),
    "fcfs-prefix-cache": ("fcfs", lambda config: {"enable_prefix_caching": True}),
    "fcfs-no-prefix-cache": ("fcfs", lambda config: {"enable_prefix_caching": False}),
}
"""Variant name -> (scheduler name, function from config dict to the fields it changes)."""


def resolve_variant(name: str, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(scheduler name, config dict)`` for a scheduler or variant name."""
    if name in VARIANTS:
        scheduler, changes = VARIANTS[name]
        return scheduler, {**config, **changes(config)}
    return name, dict(config)


@attrs.frozen(slots=True)
class LabStep:
    """One step, in the units the step table shows (seconds, tokens, blocks): a row derived once from
    the engine's :class:`~schedspec.reference.engine.StepView` and kept for the whole run (the step
    table, the plots, the efficiency figures). Apart from the view because a view holds the two spec
    states around the step, which a run of 10,000s of steps must not keep."""

    step: int
    start_time: float
    duration: float
    prefill_tokens: int
    decode_tokens: int
    num_prefill_chunks: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_preempted: int
    num_finished: int
    num_arrivals: int
    long_prefill: bool
    num_drafts: int = 0
    """Speculative decoding: decodes that verified drafts (``num_draft_tokens`` drafts, of which
    ``num_accepted_tokens`` were accepted); 0 without."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def largest_step(steps: Sequence[LabStep]) -> dict[str, int]:
    """The largest step of a run in tokens: ``{"prefill_tokens", "decode_tokens", "tokens"}`` (each the
    most any one step computed; ``tokens`` prefill and decode together), ``{}`` without steps. What a
    measured profile's fitted range is compared with
    (:meth:`~schedspec.reference.cost_model.CostModel.outside_fitted_range`)."""
    if not steps:
        return {}
    return {"prefill_tokens": max(s.prefill_tokens for s in steps),
            "decode_tokens": max(s.decode_tokens for s in steps),
            "tokens": max(s.prefill_tokens + s.decode_tokens for s in steps)}


@attrs.define
class LabResult:
    """A lab run: its steps, per-request timelines, the engine's run (checks, final state) and the
    prefix cache's hits (:meth:`~schedspec.lab.metrics.PrefixHitCounter.summary`)."""

    scheduler: str
    config: SchedulerConfig
    steps: list[LabStep]
    timelines: list[RequestTimeline]
    run: RunResult
    prefix_hits: dict[str, Any] = attrs.field(factory=dict)
    acceptance: AcceptanceModel | None = None
    """Speculative decoding: the token source's acceptance model (``None`` without, or when it has none)."""


@attrs.frozen
class _HitView:
    """A step as :meth:`PrefixHitCounter.observe` reads it (the fields it names), from a StepView: an
    adapter, not a step type of its own. The counter reads :class:`~schedspec.spec.trace.StepRecord`
    values of a recorded trace (``metrics.prefix_hit_summary``) and, through this, the lab's views, so
    that a lab run builds no StepRecord per step."""

    view: StepView
    block_size: int

    @property
    def arrivals(self):
        return self.view.arrivals

    @property
    def aborts(self):
        return self.view.aborted

    @property
    def scheduled(self):
        return self.view.plan.scheduled

    @property
    def prefix_hit_tokens(self) -> dict[str, int]:
        return prefix_hit_tokens(self.view.plan, self.block_size)

    @property
    def preempted(self):
        return self.view.plan.preempted

    @property
    def rejected(self):
        return dict(self.view.plan.rejected)

    @property
    def sampled_token_ids(self):
        return self.view.sampled


class _Collector:
    def __init__(self, workload: Sequence[RequestSpec], long_prompt_len: int, steps_out: TextIO | None,
                 block_size: int) -> None:
        self.block_size = block_size
        self.specs = {s.request_id: s for s in workload}
        self.long_prompt_len = long_prompt_len
        self.steps_out = steps_out
        self.steps: list[LabStep] = []
        self.first_scheduled: dict[str, float] = {}
        self.token_times: dict[str, list[float]] = {}
        self.finish_time: dict[str, float] = {}
        self.long_prefill_spans: list[tuple[float, float]] = []
        self._span_starts: np.ndarray | None = None
        self.prefix_hits = PrefixHitCounter()
        self.speculative: set[str] = set()
        """Requests that got several tokens in one step (speculative decoding)."""

    def __call__(self, view: StepView) -> None:
        """Take one step's statistics from the states and plan directly (no StepRecord is built; a
        decode is :attr:`Request.is_decode`, as in the StepRecord)."""
        start = view.start_time
        end = start + view.duration
        self.prefix_hits.observe(_HitView(view, self.block_size))
        long_prefill = False
        prefill = decode = chunks = 0
        requests = view.before.requests
        first = self.first_scheduled
        for item in view.plan.scheduled:
            request_id = item.request_id
            request = requests[request_id]
            if not request.is_decode:
                prompt_len = request.prompt_len
                prefill += item.num_tokens
                chunks += 1
                if prompt_len >= self.long_prompt_len:
                    long_prefill = True
            else:
                decode += item.num_tokens
            if request_id not in first:
                first[request_id] = start
        if long_prefill:
            self.long_prefill_spans.append((start, end))
        token_times = self.token_times
        for request_id in view.sampled:
            times = token_times.get(request_id)
            if times is None:
                token_times[request_id] = [end]
            else:
                times.append(end)
        num_drafts = num_draft_tokens = num_accepted = 0
        if view.speculative.num_accepted_tokens:  # speculative decoding: the tokens each decode kept
            after_requests, after_finished = view.after.requests, view.after.finished
            for item in view.plan.scheduled:
                if not item.spec_token_ids or item.request_id not in view.sampled:
                    continue
                request_id = item.request_id
                accepted = view.speculative.num_accepted_tokens.get(request_id, 0)
                num_drafts += 1
                num_draft_tokens += len(item.spec_token_ids)
                num_accepted += accepted
                now = after_requests.get(request_id) or after_finished.get(request_id)
                kept = now.num_output_tokens - requests[request_id].num_output_tokens
                token_times[request_id].extend([end] * (kept - 1))  # a stop may drop some accepted
                self.speculative.add(request_id)
        finish_time = self.finish_time
        for request_id in view.finished:
            finish_time[request_id] = end
        for request_id, _ in view.plan.rejected:
            finish_time[request_id] = start
        for request_id in view.aborted:
            finish_time[request_id] = start
        after = view.after
        self.steps.append(LabStep(
            view.step, start, view.duration, prefill, decode, chunks, len(after.running),
            len(after.waiting), len(after.free_block_ids), len(view.plan.preempted), len(view.finished),
            len(view.arrivals), long_prefill, num_drafts, num_draft_tokens, num_accepted,
        ))

    def arrived_during_long_prefill(self, arrival: float) -> bool:
        """Whether ``arrival`` falls inside a step that prefilled a long prompt."""
        spans = self.long_prefill_spans
        if not spans:
            return False
        if self._span_starts is None or len(self._span_starts) != len(spans):
            self._span_starts = np.fromiter((s for s, _ in spans), dtype=float, count=len(spans))
        index = int(np.searchsorted(self._span_starts, arrival, side="right")) - 1
        return index >= 0 and spans[index][0] <= arrival < spans[index][1]


def run_lab(
    workload: Sequence[RequestSpec],
    scheduler_name: str,
    config: SchedulerConfig,
    token_source: TokenSource | None = None,
    cost_model=None,
    check: bool = True,
    steps_out: TextIO | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    max_steps: int | None = None,
    on_progress: Callable[[int], None] | None = None,
    acceptance: AcceptanceModel | None = None,
    steps_header: bool = False,
) -> LabResult:
    """Replay a time-stamped workload through a scheduler.

    Args:
        workload: requests with ``arrival_time`` in seconds.
        scheduler_name: registry name or ``module:factory``.
        config: the limits.
        token_source: default :class:`FakeModel` with ``cost_model`` (with ``check`` off,
            :class:`CostOnlyModel`: no fake KV, since nothing checks the outputs).
        cost_model: step-time model for the default token source.
        check: check every plan, invariant and guaranteed property (stops at the first violation).
        steps_out: write every step as a StepRecord JSON line here.
        steps_header: first write the trace's header line to ``steps_out``
            (:func:`~schedspec.spec.trace.header_line`, saying ``async_scheduling`` for a scheduler that plans
            while a step is in flight, so that ``schedspec check`` judges the file as such).
        on_step: also called with each record (built only when this or ``steps_out`` is given).
        on_progress: called with the number of requests that ended (finished, rejected, aborted) in
            each step where some did (progress bars; no record is built for it).
        max_steps: stop after this many steps.
        acceptance: speculative decoding (``config.num_speculative_tokens > 0``): the default token source's
            :class:`~schedspec.reference.fake_model.AcceptanceModel` (default: its defaults).

    Raises:
        UnknownScheduler, UnsupportedFeature: from :func:`make_scheduler`.
        ViolationFound: with ``check``, at the first violated rule or invariant.
    """
    # unchecked: the same plans from a faster implementation where one exists (fcfs -> fcfs-fast), which has no
    # KV cache groups (the plain policy runs with them)
    fast = not check and not config.kv_cache_groups
    scheduler = make_scheduler(unchecked_implementation(scheduler_name) if fast else scheduler_name, config)
    # The top decile of the prompts the spec admits (a prompt over max_model_len is rejected at arrival
    # and must not set the threshold; metrics.latency_summary takes the same decile after the run).
    long_prompt_len = long_prompt_threshold(s.prompt_len for s in workload
                                            if rejection_reason(s.prompt_len, s.max_tokens, config) is None)
    collector = _Collector(workload, long_prompt_len, steps_out, config.block_size)
    if steps_out is not None and steps_header:
        steps_out.write(header_line(config, scheduler_name, bool(getattr(scheduler, "async_scheduling", False))) + "\n")

    def observe(record: StepRecord) -> None:
        if steps_out is not None:
            steps_out.write(record.to_json() + "\n")
        if on_step is not None:
            on_step(record)

    def progress(view: StepView) -> None:
        collector(view)
        if on_progress is not None:
            ended = len(view.finished) + len(view.plan.rejected) + len(view.aborted)
            if ended:
                on_progress(ended)

    if token_source is not None:
        source = token_source
    elif acceptance is not None:
        source = (FakeModel if check else CostOnlyModel)(config, cost_model=cost_model, acceptance=acceptance)
    else:
        source = (FakeModel if check else CostOnlyModel)(config, cost_model=cost_model)
    engine = Engine(
        scheduler, config,
        token_source=source,
        check=check,
        properties=None if check else (),
        record_steps=False,
        stop_on_violation=check,
        # StepRecords are built only when someone reads them (--steps-out, on_step).
        on_step=observe if steps_out is not None or on_step is not None else None,
        on_step_view=progress,
        incremental=True,
    )
    run = engine.run(workload, mode="time", max_steps=max_steps)
    state = run.state
    timelines = []
    for spec in workload:
        request = state.finished.get(spec.request_id) or state.requests.get(spec.request_id)
        if request is None:
            continue
        timelines.append(RequestTimeline(
            request_id=spec.request_id,
            prompt_len=spec.prompt_len,
            arrival_time=spec.arrival_time,
            first_scheduled_time=collector.first_scheduled.get(spec.request_id),
            token_times=collector.token_times.get(spec.request_id, []),
            finish_time=collector.finish_time.get(spec.request_id),
            outcome=request.status.outcome,
            finish_reason=request.finish_reason,
            num_preemptions=request.num_preemptions,
            arrived_during_long_prefill=collector.arrived_during_long_prefill(spec.arrival_time),
            speculative=spec.request_id in collector.speculative,
        ))
    return LabResult(scheduler_name, config, collector.steps, timelines, run,
                     collector.prefix_hits.summary(config.enable_prefix_caching, config.block_size),
                     getattr(source, "acceptance", None) if config.speculative else None)
