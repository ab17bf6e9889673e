"""A recorded whole engine beside the standalone adapter: replay a trace written by
``engines/recorder/schedspec_vllm_recorder.py`` (a running vLLM engine) through the ``vllm`` adapter
(vLLM's scheduler alone, :mod:`schedspec.engines.vllm`) on the same arrivals, aborts and sampled
tokens, and list where their decisions differ (docs/engines.md, *A whole engine beside the adapter*).

The replay gives every request the step it arrived at in the recording (``arrival_step``), its
recorded ``arrival_time`` (the engine's clock, which the priority policy orders by), its abort at the
step the recording wrote it (``abort_at_step``), and each sampled token the engine's model produced
(:class:`RecordedTokens`, by request and output position, so a token is the engine's even if the
replay samples it in another step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.state import SchedulerState, StepPlan, samples_this_step
from schedspec.spec.trace import StepRecord
from schedspec.spec.workload import RequestSpec


def request_message(spec: RequestSpec, arrive: dict[str, object]) -> dict[str, object]:
    """One request for ``engines/recorder/drive_vllm_engine.py`` (or an HTTP client): id, the prompt's
    token ids (the spec's own, ``BlockHashPrompt``), ``max_tokens``, ``priority``, ``ignore_eos``, and
    ``arrive``'s fields (when it arrives, when its client aborts)."""
    return {"id": spec.request_id, "prompt": [int(t) for t in spec.prompt_token_ids()],
            "max_tokens": spec.max_tokens, "priority": spec.priority, "ignore_eos": True, **arrive}


DECISION_FIELDS = ("scheduled", "preempted", "blocks_allocated", "prefix_hit_blocks")
"""The fields of a step record that are the scheduler's decisions (what :func:`decision_differences`
compares); the rest follow from them, the model and the client."""


def replay_workload(records: Iterable[StepRecord]) -> list[RequestSpec]:
    """The recorded arrivals as a workload for :meth:`schedspec.reference.engine.Engine.run` in steps
    mode: each arrival with ``arrival_step`` the record's step and ``abort_at_step`` the step whose
    record lists it in ``aborts`` (none if it was never aborted)."""
    arrivals: list[RequestSpec] = []
    aborts: dict[str, int] = {}
    for record in records:
        arrivals.extend(attrs.evolve(spec, arrival_step=record.step) for spec in record.arrivals)
        for request_id in record.aborts:
            aborts.setdefault(request_id, record.step)
    return [attrs.evolve(spec, abort_at_step=aborts.get(spec.request_id)) for spec in arrivals]


class RecordedTokens:
    """A token source (:class:`schedspec.reference.fake_model.TokenSource`) that samples what the
    recorded engine sampled: request ``r``'s ``k``-th sampled token is the ``k``-th token the recording
    gives ``r``. Step time: the recorded step's ``duration`` at the same index (0 past the end).

    Raises (from ``execute``):
        KeyError: the replay samples a request more often than the engine did.
    """

    def __init__(self, records: Sequence[StepRecord]) -> None:
        self.tokens: dict[str, list[int]] = {}
        for record in records:
            for request_id, token in record.sampled_token_ids.items():
                self.tokens.setdefault(request_id, []).append(token)
        self.durations = [record.duration for record in records]
        self.step = 0

    def execute(self, plan: StepPlan, state: SchedulerState) -> tuple[dict[str, int], float]:
        sampled = {}
        for item in plan.scheduled:
            request = state.requests[item.request_id]
            if samples_this_step(request, item):
                index = len(request.output_token_ids)
                tokens = self.tokens.get(item.request_id, [])
                if index >= len(tokens):
                    raise KeyError(f"{item.request_id}: output {index} was never sampled by the recorded engine")
                sampled[item.request_id] = tokens[index]
        duration = self.durations[self.step] if self.step < len(self.durations) else 0.0
        self.step += 1
        return sampled, duration


def decisions(record: StepRecord) -> dict[str, object]:
    """One record's :data:`DECISION_FIELDS`, comparable with ``==``."""
    return {
        "scheduled": [(s.request_id, s.num_computed_tokens, s.num_tokens) for s in record.scheduled],
        "preempted": list(record.preempted),
        "blocks_allocated": dict(record.blocks_allocated),
        "prefix_hit_blocks": dict(record.prefix_hit_blocks),
    }


def decision_differences(recorded: Sequence[StepRecord], replayed: Sequence[StepRecord]) -> list[str]:
    """Every step whose decisions differ between the two runs (one line per differing field, naming the
    step), and a last line if one run has more steps."""
    found = []
    for left, right in zip(recorded, replayed, strict=False):
        a, b = decisions(left), decisions(right)
        for name in DECISION_FIELDS:
            if a[name] != b[name]:
                found.append(f"step {left.step}: {name}: engine {a[name]} / standalone {b[name]}")
    if len(recorded) != len(replayed):
        found.append(f"the engine took {len(recorded)} steps, the standalone scheduler {len(replayed)}")
    return found


def replay_standalone(config: SchedulerConfig, records: Sequence[StepRecord], scheduler: str = "vllm") -> list[StepRecord]:
    """Run ``scheduler`` (a registry name; ``vllm`` or ``vllm-priority`` for the standalone adapter) on a
    recording's arrivals, aborts and tokens (module docstring); its step records.

    Raises:
        schedspec.reference.scheduler.UnsupportedFeature: the scheduler cannot run this config (or vLLM's
            environment is missing).
    """
    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import make_scheduler

    engine = Engine(make_scheduler(scheduler, config), config, token_source=RecordedTokens(records), check=False)
    try:
        return engine.run(replay_workload(records), mode="steps").records
    finally:
        close = getattr(engine.scheduler, "close", None)
        if close is not None:
            close()
