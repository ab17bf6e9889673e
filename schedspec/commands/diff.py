"""``schedspec diff --scheduler A --against B``: differential testing of two schedulers, step by step.

Generates random scenarios (Hypothesis, reproducible from ``--seed``), runs both schedulers on each
through the engine loop (:class:`~schedspec.reference.engine.Engine`, every step checked against the
spec) with the same token source (a fresh :class:`~schedspec.reference.fake_model.FakeModel` each),
and compares the two runs step by step: per step the scheduled requests (``num_computed_tokens``,
``num_tokens`` and the number of new blocks, or the block ids themselves with ``--exact-blocks``), the
preempted, rejected and finished requests (as sets: an engine need not report an order). Block ids
may legitimately differ between two schedulers that both refine the spec, so only counts are
compared by default.

For each example whose runs diverge, the scenario is shrunk (greedy: fewer requests, shorter prompts
and outputs, earlier arrivals, no aborts or end-of-sequence, while the runs still diverge) and written
in the ``schedspec/data/cases`` format to ``--out`` (never over an existing file); the first divergence
is printed. A **finding** is a spec violation (rule, invariant, guaranteed property), a crash, or a run
that does not end within ``--max-steps`` steps, by either side.

Scenarios contain only requests that vLLM's front door accepts and the spec does not reject
(``0 < prompt_len < max_model_len``, able to complete alone), so that differences come from
scheduling decisions, not from admission control (docs/engines.md).

Exit status: 0 no divergence and no finding (scenarios a scheduler cannot express are counted and
named, not compared); 1 a divergence or a finding; 2 bad input; 3 a scheduler could express none of
the scenarios (``UnsupportedFeature``), e.g. an engine whose adapter is not installed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import click
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from schedspec.cli_common import (
    EXIT_CHECK_FAILED,
    EXIT_UNSUPPORTED,
    check_outputs,
    check_scheduler,
    fail,
    parse_sets,
    plural,
)
from schedspec.engines.vllm import PADDING_RULES, SAME_STEP_HIT_RULES
from schedspec.reference.engine import (
    ENDED_BY_SCHEDULER_ONLY,
    FINISH_REASON_MISMATCH,
    Engine,
    RunResult,
    ViolationFound,
)
from schedspec.reference.fake_model import AcceptanceModel, FakeModel
from schedspec.reference.scheduler import (
    REGISTRY,
    EngineEnvironmentError,
    UnknownScheduler,
    UnsupportedFeature,
    make_scheduler,
)
from schedspec.reference.sglang_profile import (
    clipped_finishes,
    clipped_stops,
    comparable_config,
    comparable_request,
)
from schedspec.reference.vllm_v1 import startup_blocks
from schedspec.spec.config import ConfigError, SchedulerConfig, blocks_for_tokens
from schedspec.spec.rules import Violation
from schedspec.spec.state import SchedulerState
from schedspec.spec.trace import StepRecord
from schedspec.spec.workload import RequestSpec
from schedspec.strategies import acceptance_patterns, priorities, scheduler_configs

Acceptance = dict[str, str]
"""Speculative decoding: request id -> its acceptance pattern (:data:`schedspec.reference.fake_model.ACCEPTANCE_PATTERNS`;
the others follow the :class:`~schedspec.reference.fake_model.AcceptanceModel` default)."""

DEFAULT_MAX_STEPS = 2_000


@attrs.frozen
class ComparedStep:
    """What two schedulers are compared on in one step (sets where an engine need not keep an order): a
    projection of each one's :class:`~schedspec.spec.trace.StepRecord` (not the engine's
    :class:`~schedspec.reference.engine.StepView`, which holds the states around a step).

    ``scheduled`` maps request id -> ``(num_computed_tokens, num_tokens, blocks)`` where ``blocks`` is
    the number of new blocks, or their ids with exact block comparison.
    """

    scheduled: dict[str, tuple[int, int, Any]]
    preempted: frozenset[str]
    rejected: frozenset[str]
    finished: frozenset[str]

    @classmethod
    def of(cls, record: StepRecord, exact_blocks: bool) -> ComparedStep:
        scheduled = {}
        for item in record.scheduled:
            blocks = tuple(record.blocks_allocated.get(item.request_id, ()))
            scheduled[item.request_id] = (
                item.num_computed_tokens, item.num_tokens,
                blocks if exact_blocks else len(blocks),
            )
        return cls(scheduled, frozenset(record.preempted), frozenset(record.rejected), frozenset(record.finished))

    def describe(self) -> str:
        parts = [" ".join(f"{r}:{c}+{n}/{b}" for r, (c, n, b) in self.scheduled.items()) or "-"]
        for name in ("preempted", "rejected", "finished"):
            value = getattr(self, name)
            if value:
                parts.append(f"{name} {' '.join(sorted(value))}")
        return "; ".join(parts)


@attrs.frozen
class Divergence:
    """The first step at which the two runs differ, and how (``scheduler`` vs ``against``).
    ``documented`` names the documented difference of the engine's profile it is (docs/engines.md,
    :data:`PROFILES`), or is ``None`` for an unexplained divergence."""

    step: int
    scheduler: str
    against: str
    documented: str | None = None

    def __str__(self) -> str:
        text = f"step {self.step}: {self.scheduler} | against: {self.against}"
        return text + (f" (documented: {self.documented})" if self.documented else "")


LONE_REQUEST = "long_prefill_token_threshold lifted for a lone request (vLLM Scheduler.schedule num_eligible_reqs > 1)"
PADDED_ADMISSION = ("one-token admission padded to 1 + num_speculative_tokens with placeholder drafts (vLLM "
                    "Scheduler.schedule pad_spec_decode, for a uniform decode batch)")
SAME_STEP_HIT = ("prefix-cache hit on blocks published earlier in the same step (vLLM KVCacheManager.allocate_slots "
                 "caches blocks at schedule time, the spec at the end of the step)")


def _live_before(records: Sequence[StepRecord], index: int) -> int:
    """Live requests (running and waiting) just before step ``records[index]`` was planned."""
    before = records[index - 1].num_running + records[index - 1].num_waiting if index else 0
    return before + len(records[index].arrivals) - len(records[index].aborted)


def documented_difference(config: SchedulerConfig, records: Sequence[StepRecord], index: int,
                          mine: ComparedStep, other: ComparedStep) -> str | None:
    """Whether the divergence at ``records[index]`` between an engine and a ``vllm-v1`` profile is one of
    the profile's documented differences from vLLM (docs/engines.md), and which. Only the one that
    ``schedspec diff``'s scenarios can show is recognized: vLLM lifts ``long_prefill_token_threshold``
    when one request is live, the profile does not (spec rule ``long-prefill-threshold``)."""
    if not (config.enable_chunked_prefill and config.long_prefill_token_threshold):
        return None
    if _live_before(records, index) != 1 or len(mine.scheduled) != 1 or mine.scheduled.keys() != other.scheduled.keys():
        return None
    (request_id, (_, tokens, _)), = mine.scheduled.items()
    larger = other.scheduled[request_id][1]
    threshold = config.long_prefill_token_threshold
    # one side capped at the threshold (the profile), the other above it (the engine)
    if min(tokens, larger) == threshold < max(tokens, larger):
        return LONE_REQUEST
    return None


FAILED_LOAD_HELD = ("a remote KV load failed from its first block keeps its blocks in vLLM until a waiting loop reaches "
                    "the request (Scheduler._update_waiting_for_remote_kv frees them), the spec frees them at the report "
                    "(land_transfers): vLLM preempts or stops admission where the profile has the blocks")


def _waiting_loop_skipped(config: SchedulerConfig, records: Sequence[StepRecord], index: int) -> bool:
    """Whether vLLM's waiting loop cannot have run in step ``records[index]`` as the record shows it: the step
    preempted (``if not preempted_reqs``), spent the whole token budget (``while token_budget > 0``), or began
    with every sequence slot taken and no abort (``num_running >= max_num_active_reqs``); nothing else (a loop
    that ran and broke elsewhere is not recognized)."""
    record = records[index]
    if record.preempted:
        return True
    if sum(item.num_tokens for item in record.scheduled) >= config.max_num_batched_tokens:
        return True
    return bool(index) and not record.aborts and not record.aborted and (
        records[index - 1].num_running >= config.active_seq_cap)


def _load_step(records: Sequence[StepRecord], index: int, request_id: str) -> int | None:
    """The last step before ``records[index]`` (inclusive) that started a remote KV load for ``request_id``."""
    return next((j for j in range(index, -1, -1) if request_id in records[j].kv_loads), None)


def _holder_ahead(records: Sequence[StepRecord], index: int, request_id: str, behind: str, load_step: int) -> bool:
    """Whether ``request_id`` waits ahead of ``behind`` in vLLM's ``kv_holding_waiting`` at ``records[index]``: its
    remote load started before ``behind``'s (at step ``load_step``), or in the same step ahead of it, and landed
    before the step without failing from its first block (so it still holds its blocks)."""
    own = _load_step(records, index - 1, request_id) if index else None
    if own is None or own > load_step:
        return False
    if own == load_step:
        order = list(records[own].kv_loads)
        if order.index(request_id) > order.index(behind):
            return False
    first = records[own].blocks_allocated.get(request_id, ())[:1]
    landed = [k for k in range(own, index) if request_id in records[k].finished_recving]
    if not landed or set(first) & set(records[landed[0]].invalid_block_ids):
        return False
    # still in kv_holding_waiting: not admitted since it landed
    return not any(request_id in {item.request_id for item in records[k].scheduled}
                   for k in range(landed[0] + 1, index))


def failed_load_held(config: SchedulerConfig, records: Sequence[StepRecord], index: int,
                     mine: ComparedStep, other: ComparedStep) -> str | None:
    """Whether the divergence at ``records[index]`` between an engine (``mine``, its ``records``) and a
    ``vllm-v1`` profile (``other``) is the profile's documented difference of a failed remote KV load
    (``reference/vllm_v1.py`` rule 14, docs/engines.md): vLLM 0.32/0.33 frees the blocks of a load that failed
    from its first block only when a waiting loop reaches the request (``Scheduler._handle_blocked_waiting_request``
    → ``_update_waiting_for_remote_kv`` → ``kv_cache_manager.free``), the spec at the report that says it failed
    (``spec.transitions.land_transfers``), so until then vLLM has those blocks fewer: it may preempt, or stop
    admission, where the profile does not. Recognized only when all of these hold:

    - some request's load (``kv_loads``, its blocks in ``blocks_allocated``) landed in the report after a step
      ``k < index`` with its first block in ``invalid_block_ids``, and the request was neither aborted nor
      scheduled in steps ``k + 1 .. index`` on either side (it still waits, holding its blocks in vLLM);
    - vLLM's waiting loop cannot have reached it in steps ``k + 1 .. index - 1`` (:func:`_waiting_loop_skipped`);
    - at ``index`` either the engine preempted a strict superset of what the profile preempted and scheduled
      nothing the profile did not (the extra preemption is the only loss), or neither preempted and the engine
      scheduled a strict subset of the profile's items, the common ones alike, the first item only the profile
      has being a request that waits ahead of the failed one in ``kv_holding_waiting`` (:func:`_holder_ahead`:
      vLLM's admission stopped there, before its loop reached the failed load).
    """
    same = all(other.scheduled.get(r) == item for r, item in mine.scheduled.items())
    alike = all(r in other.scheduled and other.scheduled[r][:2] == item[:2] for r, item in mine.scheduled.items())
    only_profile = other.scheduled.keys() - mine.scheduled.keys()
    # nothing else differs: the same rejections, and the engine ends only what the profile ends, the profile
    # more only among the requests the engine did not schedule
    rest_alike = (mine.rejected == other.rejected and mine.finished <= other.finished
                  and other.finished - mine.finished <= only_profile)
    more_preempted = (other.preempted < mine.preempted and mine.scheduled.keys() <= other.scheduled.keys()
                      and alike and rest_alike)
    fewer_admitted = (not mine.preempted and not other.preempted and same and rest_alike
                      and mine.scheduled.keys() < other.scheduled.keys())
    if fewer_admitted:  # admission stopped: nothing after the first request it did not admit was admitted
        order = list(other.scheduled)
        first_missing = next(i for i, r in enumerate(order) if r not in mine.scheduled)
        fewer_admitted = not any(r in mine.scheduled for r in order[first_missing + 1:])
    if not (more_preempted or fewer_admitted):
        return None
    for k in range(index):
        invalid = set(records[k].invalid_block_ids)
        for request_id in records[k].finished_recving:
            load_step = _load_step(records, k, request_id)
            if load_step is None:
                continue
            blocks = records[load_step].blocks_allocated.get(request_id, ())
            if not blocks or blocks[0] not in invalid:
                continue
            later = records[k + 1:index + 1]
            if any(request_id in {s.request_id for s in r.scheduled} or request_id in r.aborts
                   or request_id in r.aborted for r in later):
                continue
            if request_id in mine.scheduled or request_id in other.scheduled:
                continue
            if not all(_waiting_loop_skipped(config, records, m) for m in range(k + 1, index)):
                continue
            if more_preempted:
                return FAILED_LOAD_HELD
            first = next(r for r in other.scheduled if r not in mine.scheduled)
            if _holder_ahead(records, index, first, request_id, load_step):
                return FAILED_LOAD_HELD
    return None


def vllm_v1_divergence(config: SchedulerConfig, records: Sequence[StepRecord], index: int,
                       mine: ComparedStep, other: ComparedStep) -> str | None:
    """The documented differences of the ``vllm-v1`` profiles (:func:`documented_difference`,
    :func:`failed_load_held`): the name of the one the divergence is, or ``None``."""
    return (documented_difference(config, records, index, mine, other)
            or failed_load_held(config, records, index, mine, other))


def _sglang_finding(config: SchedulerConfig, violations: Sequence[Violation], state: SchedulerState) -> str | None:
    """Whether the violations that stopped an ``sglang`` run are the finding ``sglang-clips-max-tokens``:
    SGLang ended requests at their clipped ``max_new_tokens`` (``reference/sglang_profile.py`` rule 1, the
    precise condition :func:`~schedspec.reference.sglang_profile.clipped_finishes`), and nothing else broke:
    the ``refinement`` mismatches are requests SGLang alone ended (code ``ENDED_BY_SCHEDULER_ONLY``), all of
    them clipped, or requests clipped to 0 new tokens that both ended at their first output, SGLang with
    ``length`` where the spec stops on the EOS sampled there (code ``FINISH_REASON_MISMATCH``,
    :func:`~schedspec.reference.sglang_profile.clipped_stops`); ``state-mismatch`` only for those requests or
    for the free blocks they left. Decided by the violations' codes and request ids, never their wording."""
    clipped, stopped = clipped_finishes(state, config), clipped_stops(state, config)
    refinements = [violation for violation in violations if violation.name == "refinement"]
    if not (clipped or stopped) or not refinements:
        return None
    for violation in violations:
        if violation.name == "refinement":
            if not ((violation.code == ENDED_BY_SCHEDULER_ONLY and violation.request_id in clipped)
                    or (violation.code == FINISH_REASON_MISMATCH and violation.request_id in stopped)):
                return None
        elif not (violation.name == "state-mismatch" and (
                violation.request_id in clipped
                # the free blocks: a request SGLang ended early gave its blocks back; both ended a stopped one
                or (violation.request_id is None and any(v.code == ENDED_BY_SCHEDULER_ONLY for v in refinements)))):
            return None
    return CLIPPED_MAX_TOKENS


CLIPPED_MAX_TOKENS = ("request ended at its clipped max_new_tokens (SGLang Scheduler.init_req_max_new_tokens; "
                      "finding sglang-clips-max-tokens)")


@attrs.frozen
class ProfileDifferences:
    """What ``schedspec diff`` knows about a reference profile of an engine: its documented differences
    from the engine (docs/engines.md), recognized by precise conditions, and where scenarios are moved so
    that the two can be compared at all. Each profile names its own (:data:`PROFILES`).

    Attributes:
        engine: the engine the profile reproduces: its documented differences apply only against that engine's
            adapters (registry targets ``schedspec.engines.ENGINE:...``), never against another engine's.
        divergence: ``(config, records, index, mine, other) -> name or None``: whether a divergence between
            the engine (``mine``, its ``records``) and the profile (``other``) at ``records[index]`` is
            documented.
        finding: ``(config, violations, state) -> name or None``: whether the violations that stopped the
            engine's run are documented (``state``: the spec's after the step).
        config: moves a drawn config onto where the engine and the spec agree, or ``None`` to discard it
            (``None``: configs are drawn as they are).
        shape: ``(request, config, unclip) -> request``: moves a drawn :class:`RequestSpec` onto what the
            engine's adapter takes unchanged (``None``: vLLM's front door, which the generator draws);
            ``unclip`` (drawn true for 9 requests in 10) also onto what the engine runs to its
            ``max_tokens``, so that most runs are compared to their end.
    """

    engine: str = "vllm"
    divergence: Callable[..., str | None] = lambda *args: None
    finding: Callable[..., str | None] = lambda *args: None
    config: Callable[[SchedulerConfig], SchedulerConfig | None] | None = None
    shape: Callable[[RequestSpec, SchedulerConfig, bool], RequestSpec] | None = None


PROFILES: dict[str, ProfileDifferences] = {
    "vllm-v1": ProfileDifferences(divergence=vllm_v1_divergence),
    "vllm-v1-priority": ProfileDifferences(divergence=vllm_v1_divergence),
    "vllm-v1@0.33": ProfileDifferences(divergence=vllm_v1_divergence),
    "vllm-v1-priority@0.33": ProfileDifferences(divergence=vllm_v1_divergence),
    "sglang-profile": ProfileDifferences(engine="sglang", finding=_sglang_finding, config=comparable_config,
                                         shape=comparable_request),
    "sglang-profile-priority": ProfileDifferences(engine="sglang", finding=_sglang_finding, config=comparable_config,
                                                  shape=comparable_request),
}
"""The reference profiles of engines, by registry name, with what :class:`ProfileDifferences` says of each:
their documented differences apply only between an engine adapter and the profile."""


def pair_profile(scheduler: str, against: str) -> ProfileDifferences | None:
    """The profile of a ``--scheduler``/``--against`` pair when one side is a profile of :data:`PROFILES`
    and the other is an adapter of the engine it reproduces (registry kind ``engine-adapter``, target in
    ``schedspec.engines.<engine>``), else ``None``: an engine is never excused by another engine's profile."""
    for profile, other in ((scheduler, against), (against, scheduler)):
        entry = REGISTRY.get(other)
        if profile in PROFILES and entry is not None and entry.kind == "engine-adapter" \
                and entry.target.startswith(f"schedspec.engines.{PROFILES[profile].engine}:"):
            return PROFILES[profile]
    return None


@attrs.frozen
class Finding:
    """A spec violation, crash or hang of one side. ``documented`` names the documented behaviour of
    vLLM it is (docs/engines.md), or is ``None``."""

    side: str
    name: str
    detail: str
    documented: str | None = None


@attrs.frozen
class Comparison:
    """Both runs of one scenario compared. ``steps_compared`` counts steps up to and including the
    first divergence (or all steps of the shorter run)."""

    steps_compared: int
    divergence: Divergence | None
    findings: tuple[Finding, ...]

    @property
    def failed(self) -> bool:
        return self.divergence is not None or bool(self.findings)


def _run(name: str, config: SchedulerConfig, requests: Sequence[RequestSpec], max_steps: int,
         acceptance: Acceptance | None = None, finding: Callable[..., str | None] | None = None,
         ) -> tuple[RunResult | None, list[Finding], bool, list[StepRecord]]:
    """Run one scheduler (raises UnsupportedFeature / UnknownScheduler from ``make_scheduler``); the
    flag says whether it is an engine adapter (no spec ``state`` of its own); the records are those of the
    steps before a violation stopped the run (all of them otherwise). ``finding``: the documented findings
    of the engine's profile (:attr:`ProfileDifferences.finding`), asked when an engine adapter's run stops."""
    try:
        scheduler = make_scheduler(name, config)
    except (UnsupportedFeature, UnknownScheduler, EngineEnvironmentError):
        raise
    except Exception as error:  # a factory that crashes on this config is a finding, as a crash in a run
        return None, [Finding(name, "crash", f"building the scheduler: {type(error).__name__}: {error}")], False, []
    engine = getattr(scheduler, "state", None) is None
    result, findings, records = _run_scheduler(scheduler, name, config, requests, max_steps, engine, acceptance,
                                               finding if engine else None)
    return result, findings, engine, records


def _run_scheduler(scheduler, name: str, config: SchedulerConfig, requests: Sequence[RequestSpec],
                   max_steps: int, engine: bool, acceptance: Acceptance | None = None,
                   finding: Callable[..., str | None] | None = None,
                   ) -> tuple[RunResult | None, list[Finding], list[StepRecord]]:
    token_source = None
    if config.speculative:  # the default token source with the scenario's acceptance patterns
        token_source = FakeModel(config, eos_at_output={s.request_id: s.eos_at_output for s in requests
                                                        if s.eos_at_output},
                                 acceptance=AcceptanceModel(patterns=acceptance))
    try:
        result = Engine(scheduler, config, token_source=token_source, stop_on_violation=True).run(
            requests, mode="steps", max_steps=max_steps)
    except UnsupportedFeature:
        raise
    except ViolationFound as error:  # a rule or invariant broken: the run cannot go on meaningfully
        documented = None
        if (engine and config.enable_chunked_prefill and len(error.state.requests) == 1
                and all(v.name == "long-prefill-threshold" for v in error.violations)):
            documented = LONE_REQUEST  # vLLM's SchedulerConfig docstring: not applied to a lone request
        known = getattr(scheduler, "is_known_divergence", None)
        if (documented is None and engine and config.speculative and callable(known)
                and all(v.name in PADDING_RULES and known(v, error.state) for v in error.violations)):
            documented = PADDED_ADMISSION  # engines/vllm.py padded_admission: the precise condition
        if (documented is None and engine and config.enable_prefix_caching and callable(known)
                and all(v.name in SAME_STEP_HIT_RULES and known(v, error.state) for v in error.violations)):
            documented = SAME_STEP_HIT  # engines/vllm.py same_step_hits: the precise condition
        if documented is None and finding is not None:
            documented = finding(config, error.violations, error.state)
        return None, [Finding(name, v.name, str(v), documented) for v in error.violations[:3]], error.records
    except Exception as error:  # an engine that crashes is a finding, not a crash of diff
        return None, [Finding(name, "crash", f"{type(error).__name__}: {error}")], []
    findings = [Finding(name, v.name, str(v)) for v in result.violations[:3]]
    if result.state.requests:
        findings.append(Finding(name, "no-termination",
                                f"requests still live after {result.num_steps} steps: {sorted(result.state.requests)}"))
    return result, findings, result.records


def compare(config: SchedulerConfig, requests: Sequence[RequestSpec], scheduler: str, against: str,
            exact_blocks: bool = False, max_steps: int = DEFAULT_MAX_STEPS,
            acceptance: Acceptance | None = None) -> Comparison:
    """Run ``scheduler`` and ``against`` on the same scenario and compare them step by step. With
    speculative decoding both runs get the same drafts and acceptances (``acceptance``: request id -> its
    pattern; every draft accepted for the others). A run stopped by a documented finding is compared up to
    the step before it (the other run's later steps are not compared); one stopped by any other finding is
    not compared.

    Raises:
        UnsupportedFeature: either scheduler cannot run this config or scenario.
        UnknownScheduler: either name is not a scheduler.
    """
    # documented differences apply between an engine and the profile that reproduces it (PROFILES)
    findings_of = {name: PROFILES[other].finding for name, other in ((scheduler, against), (against, scheduler))
                   if other in PROFILES}
    ours, findings, ours_engine, our_records = _run(scheduler, config, requests, max_steps, acceptance,
                                                    findings_of.get(scheduler))
    theirs, more, theirs_engine, their_records = _run(against, config, requests, max_steps, acceptance,
                                                      findings_of.get(against))
    findings += [f for f in more if not (against == scheduler and f in findings)]
    stopped = ours is None or theirs is None
    if stopped and (any(f.documented is None for f in findings) or not (our_records or their_records)):
        return Comparison(0, None, tuple(findings))
    profile = (PROFILES.get(scheduler) if theirs_engine else None) or (PROFILES.get(against) if ours_engine else None)
    compared = 0
    for index, (mine, other) in enumerate(zip(our_records, their_records, strict=False)):
        compared += 1
        a, b = ComparedStep.of(mine, exact_blocks), ComparedStep.of(other, exact_blocks)
        if a != b:
            # the engine's records and step first (a profile's recognizers read the engine's run)
            engine_first = (our_records, a, b) if ours_engine else (their_records, b, a)
            documented = (profile.divergence(config, engine_first[0], index, *engine_first[1:])
                          if profile is not None else None)
            return Comparison(compared, Divergence(mine.step, a.describe(), b.describe(), documented),
                              tuple(findings))
    if not stopped and len(our_records) != len(their_records):
        step = compared
        return Comparison(compared, Divergence(step, f"{len(our_records)} steps in all",
                                               f"{len(their_records)} steps in all"), tuple(findings))
    return Comparison(compared, None, tuple(findings))


# ----------------------------------------------------------------------------------- generation
def _possible_requests(config: SchedulerConfig, grammar_steps: int = 0,
                       shape: Callable[[RequestSpec, SchedulerConfig, bool], RequestSpec] | None = None,
                       remote_kv: bool = False) -> st.SearchStrategy[tuple[list[RequestSpec], Acceptance]]:
    """1 to 8 requests that vLLM's input processor accepts (``0 < prompt_len < max_model_len``) and
    that can complete alone (the spec does not reject them), arriving in steps 0..8, sometimes
    aborted, sometimes stopping early (end-of-sequence), with ``max_loras`` on a LoRA adapter of 0 (none) to
    ``max_loras + 1`` each, with ``grammar_steps > 0`` structured output for about half of them (a grammar
    ready 0 to ``grammar_steps`` steps after arrival), with ``remote_kv`` (and prefix caching off) about half
    of them loading 1 to all of their prompt tokens remotely (landing 1 to 4 steps after the load starts, a third
    of those failing from one of their first three blocks) and about a third sending their KV when they finish
    (completing 1 to 3 steps later), priorities from
    :func:`schedspec.strategies.priorities` (often equal); with prefix caching on, most share a prefix
    of 1..prompt_len tokens with others of one of two groups. The ids ``r0`` .. ``r{n-1}`` are a random
    permutation, independent of the order of arrival and of the workload's order (which orders the
    arrivals of one step), so that an order that falls back to the id where it should follow the
    arrival shows up (vLLM's ``(priority, arrival_time, request_id)``). ``shape`` moves each drawn
    request onto what another engine's adapter takes (:attr:`ProfileDifferences.shape`)."""
    capacity = config.kv_capacity_tokens
    longest = max(1, min(config.max_model_len - 1, capacity))

    @st.composite
    def one(draw: st.DrawFn, request_id: str) -> RequestSpec:
        prompt_len = draw(st.integers(1, longest))
        max_tokens = draw(st.integers(1, max(1, min(config.max_model_len, capacity + 1 - prompt_len))))
        arrival = draw(st.integers(0, 8))
        abort = draw(st.one_of(st.none(), st.none(), st.integers(arrival, arrival + 12)))
        eos = draw(st.one_of(st.none(), st.none(), st.integers(1, 6)))
        group, prefix_len = None, 0
        if config.enable_prefix_caching:
            # shared prefixes, so that the prefix cache is exercised (drawn only with caching on, so that
            # caching-off scenarios stay what they were for a given seed)
            group = draw(st.one_of(st.none(), st.sampled_from(("a", "b"))))
            prefix_len = draw(st.integers(1, prompt_len)) if group is not None else 0
        # with max_loras on, adapters 0 (none) .. max_loras + 1, so that the limit binds (drawn only then)
        lora = draw(st.integers(0, config.max_loras + 1)) if config.max_loras else 0
        # structured output, drawn only when asked for (--grammar-steps)
        grammar = draw(st.one_of(st.none(), st.integers(0, grammar_steps))) if grammar_steps else None
        remote: dict[str, Any] = {}
        if remote_kv and not config.enable_prefix_caching:  # drawn only when asked for (--remote-kv)
            if draw(st.booleans()):
                remote.update(num_external_computed_tokens=draw(st.integers(1, prompt_len)),
                              kv_load_steps=draw(st.integers(1, 4)),
                              kv_load_invalid_block=draw(st.one_of(st.none(), st.none(), st.integers(0, 2))))
            if draw(st.integers(0, 2)) == 0:
                remote.update(kv_send=True, kv_send_steps=draw(st.integers(1, 3)))
        spec = RequestSpec(request_id, prompt_len, max_tokens, arrival_step=arrival,
                           priority=draw(priorities()), abort_at_step=abort, eos_at_output=eos,
                           prefix_group=group, prefix_len=prefix_len, lora_int_id=lora,
                           grammar_compile_steps=grammar, **remote)
        if shape is not None:  # drawn only for such a profile, so that other scenarios stay what they were
            spec = shape(spec, config, draw(st.integers(0, 9)) > 0)
        # drawn only with speculative decoding on, so that other scenarios stay what they were for a seed
        pattern = draw(acceptance_patterns(config.num_speculative_tokens)) if config.speculative else None
        return spec, pattern

    def split(pairs: tuple) -> tuple[list[RequestSpec], Acceptance]:
        return [spec for spec, _ in pairs], {spec.request_id: p for spec, p in pairs if p is not None}

    # uniform request counts (Hypothesis's integers favour the small end): most scenarios have several
    # requests competing for slots, budget and blocks; ids in a random order
    return (st.sampled_from(range(1, 9)).flatmap(lambda n: st.permutations(range(n)))
            .flatmap(lambda ids: st.tuples(*(one(f"r{i}") for i in ids))).map(split))


def scenarios(changes: dict[str, Any], grammar_steps: int = 0, profile: ProfileDifferences | None = None,
              remote_kv: bool = False) -> st.SearchStrategy[tuple[SchedulerConfig, list[RequestSpec], Acceptance]]:
    """``(config, requests, acceptance)``: a config from :func:`schedspec.testing.scheduler_configs` (with
    ``long_prefill_token_threshold`` at most ``max_model_len``, as vLLM requires), moved by ``profile``'s
    :attr:`~ProfileDifferences.config` when it has one, with ``changes`` applied (drawn configs that
    ``changes`` make invalid are discarded; at least two tokens of ``max_model_len``; with KV cache groups,
    at least the blocks vLLM's start-up check asks for, :func:`~schedspec.reference.vllm_v1.startup_blocks`),
    and :func:`_possible_requests` for it (``grammar_steps`` and ``profile``'s request shapes passed on)."""
    move = profile.config if profile is not None else None

    def apply(config: SchedulerConfig) -> SchedulerConfig | None:
        try:
            if config.long_prefill_token_threshold > config.max_model_len:
                # vLLM refuses a threshold above max_model_len (SchedulerConfig.verify_max_model_len);
                # the spec allows it, with the same effect as max_model_len
                config = config.with_changes(long_prefill_token_threshold=config.max_model_len)
            if move is not None and (config := move(config)) is None:
                return None
            config = config.with_changes(**changes) if changes else config
        except (ConfigError, TypeError):
            return None
        if config.kv_cache_groups and config.num_kv_blocks < startup_blocks(config):
            # vLLM's start-up check refuses a pool a max_model_len request cannot fit (its gate included)
            config = config.with_changes(num_kv_blocks=startup_blocks(config))
        return config

    shape = profile.shape if profile is not None else None
    configs = scheduler_configs().map(apply).filter(lambda c: c is not None and c.max_model_len >= 2)
    return configs.flatmap(lambda c: _possible_requests(c, grammar_steps, shape, remote_kv).map(
        lambda drawn: (c, *drawn)))


# ------------------------------------------------------------------------------------ shrinking
def _candidates(requests: list[RequestSpec]) -> list[list[RequestSpec]]:
    """Smaller variants of a scenario, most drastic first."""
    out: list[list[RequestSpec]] = []
    for i in range(len(requests)):
        out.append(requests[:i] + requests[i + 1:])
    for i, r in enumerate(requests):
        simpler = []
        if r.abort_at_step is not None:
            simpler.append(attrs.evolve(r, abort_at_step=None))
        if r.eos_at_output is not None:
            simpler.append(attrs.evolve(r, eos_at_output=None))
        if r.prefix_group is not None:
            simpler.append(attrs.evolve(r, prefix_group=None, prefix_len=0))
        if r.num_external_computed_tokens:  # no remote KV load
            simpler.append(attrs.evolve(r, num_external_computed_tokens=0, kv_load_steps=None,
                                        kv_load_invalid_block=None))
        if r.kv_send:
            simpler.append(attrs.evolve(r, kv_send=False, kv_send_steps=None))
        for field in ("prompt_len", "max_tokens"):
            value = getattr(r, field)
            for smaller in sorted({1, value // 2, value - 1}):
                if 1 <= smaller < value:
                    changes: dict[str, Any] = {field: smaller}
                    if field == "prompt_len":  # what counts prompt tokens stays within the prompt
                        changes.update(prefix_len=min(r.prefix_len, smaller),
                                       num_external_computed_tokens=min(r.num_external_computed_tokens, smaller))
                    simpler.append(attrs.evolve(r, **changes))
        if r.arrival_step:
            simpler.append(attrs.evolve(r, arrival_step=0))
            simpler.append(attrs.evolve(r, arrival_step=r.arrival_step - 1))
        if r.priority:
            simpler.append(attrs.evolve(r, priority=0))
        for variant in simpler:
            if variant.abort_at_step is not None and variant.abort_at_step < (variant.arrival_step or 0):
                continue
            out.append(requests[:i] + [variant] + requests[i + 1:])
    return out


def shrink(requests: list[RequestSpec], still_fails: Callable[[list[RequestSpec]], bool],
           budget: int = 400) -> list[RequestSpec]:
    """Greedy shrinking: take the first smaller variant that still fails, until none does or
    ``budget`` attempts are spent. Returns the smallest failing scenario found."""
    current = list(requests)
    attempts = 0
    improved = True
    while improved and attempts < budget:
        improved = False
        for candidate in _candidates(current):
            attempts += 1
            if still_fails(candidate):
                current = candidate
                improved = True
                break
            if attempts >= budget:
                break
    return current


# --------------------------------------------------------------------------------- case output
def case_dict(name: str, about: str, config: SchedulerConfig, requests: Sequence[RequestSpec],
              scheduler: str | None = None, acceptance: Acceptance | None = None) -> dict[str, Any]:
    """A scenario in the ``schedspec/data/cases`` format. Its expectations follow from the request
    shapes alone (every request can complete alone): ``finished``, or ``aborted`` (or ``finished``
    if it ends before its abort)."""
    rows = []
    outcome: dict[str, Any] = {}
    for r in requests:
        row: dict[str, Any] = {"id": r.request_id, "arrival_step": r.arrival_step, "prompt_len": r.prompt_len,
                               "max_tokens": r.max_tokens}
        if r.priority:
            row["priority"] = r.priority
        if r.abort_at_step is not None:
            row["abort_at_step"] = r.abort_at_step
        if r.eos_at_output is not None:
            row["eos_at_output"] = r.eos_at_output
        if r.prefix_group is not None and r.prefix_len:
            row["prefix"] = {"group": r.prefix_group, "len": r.prefix_len}
        if acceptance and r.request_id in acceptance:
            row["acceptance"] = acceptance[r.request_id]
        if r.lora_int_id:
            row["lora_int_id"] = r.lora_int_id
        if r.grammar_compile_steps is not None:
            row["grammar_compile_steps"] = r.grammar_compile_steps
        for field in ("num_external_computed_tokens", "kv_load_steps", "kv_load_invalid_block", "kv_send",
                      "kv_send_steps"):  # remote KV (the scenario fields of the same names)
            if getattr(r, field) is not None and getattr(r, field) is not False:
                row[field] = getattr(r, field)
        if ("kv_load_invalid_block" in row
                and row["kv_load_invalid_block"] >= blocks_for_tokens(r.num_external_computed_tokens, config.block_size)):
            del row["kv_load_invalid_block"]  # past the load's blocks it never fails it (a case file refuses it)
        rows.append(row)
        outcome[r.request_id] = ["finished", "aborted"] if r.abort_at_step is not None else "finished"
    data: dict[str, Any] = {"name": name, "about": about, "config": config.to_dict(), "requests": rows,
                            "expect": {"outcome": outcome}}
    if scheduler is not None:
        data["scheduler"] = scheduler
    return data


def write_case(folder: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as ``folder/NAME.json``, or ``NAME-2.json`` ... if that exists (never overwrites)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = data["name"]
    path = folder / f"{base}.json"
    suffix = 2
    while path.exists():
        path = folder / f"{base}-{suffix}.json"
        suffix += 1
    with path.open("x", encoding="utf-8") as handle:
        handle.write(json.dumps(data, indent=1) + "\n")
    return path


# ------------------------------------------------------------------------------------- command
@attrs.define
class DiffReport:
    """Totals of a diff run."""

    examples: int = 0
    steps_compared: int = 0
    divergent: int = 0
    documented: int = 0
    findings: list[tuple[int, Finding]] = attrs.field(factory=list)
    unsupported: list[str] = attrs.field(factory=list)
    cases: list[Path] = attrs.field(factory=list)


def run_diff(scheduler: str, against: str, examples: int, seed: int, changes: dict[str, Any],
             out: Path | None, exact_blocks: bool = False, max_steps: int = DEFAULT_MAX_STEPS,
             echo: Callable[[str], None] = print, grammar_steps: int = 0, remote_kv: bool = False) -> DiffReport:
    """Generate ``examples`` scenarios from ``seed``, compare the two schedulers on each, shrink and
    write each divergence (module docstring). Deterministic for a given seed and Hypothesis version.
    ``grammar_steps > 0``: about half the requests have structured output; ``remote_kv``: remote KV loads and
    sends (:func:`_possible_requests`)."""
    report = DiffReport()

    def examine(config: SchedulerConfig, requests: list[RequestSpec], acceptance: Acceptance) -> None:
        index = report.examples
        report.examples += 1
        try:
            result = compare(config, requests, scheduler, against, exact_blocks, max_steps, acceptance)
        except UnsupportedFeature as error:
            report.unsupported.append(str(error))
            return
        report.steps_compared += result.steps_compared
        findings = [f for f in result.findings if f.documented is None]
        for finding in findings:
            report.findings.append((index, finding))
            echo(f"example {index}: FINDING {finding.side} {finding.name}: {finding.detail}")
        documented = [f"{f.side} {f.name}: {f.documented}" for f in result.findings if f.documented]
        if result.divergence is not None and result.divergence.documented:
            documented.append(str(result.divergence))
        if documented and not findings and (result.divergence is None or result.divergence.documented):
            report.documented += 1
            echo(f"example {index}: documented difference: {documented[0]}")
            return
        if not result.failed:
            return

        def diverges(candidate: list[RequestSpec]) -> bool:
            try:
                found = compare(config, candidate, scheduler, against, exact_blocks, max_steps, acceptance).divergence
            except UnsupportedFeature:
                return False
            return found is not None and found.documented is None

        if result.divergence is not None and result.divergence.documented is None:
            report.divergent += 1
            small = shrink(requests, diverges)
            first = compare(config, small, scheduler, against, exact_blocks, max_steps, acceptance).divergence
            assert first is not None
            echo(f"example {index}: DIVERGENCE ({len(requests)} requests, shrunk to {len(small)}) at {first}")
            kind = "divergence"
        else:
            small, first = requests, None
            kind = "finding"
            result = attrs.evolve(result, findings=tuple(findings))
        if out is not None:
            name = f"diff-{scheduler}-vs-{against}-seed{seed}-{kind}{index}".replace(":", "_").replace("/", "_")
            about = (f"schedspec diff --scheduler {scheduler} --against {against} --seed {seed}, example {index}: "
                     + (f"first divergence at {first}" if first is not None
                        else "; ".join(f"{f.side} {f.name}: {f.detail}" for f in result.findings)))
            path = write_case(out, case_dict(name, about, config, small, acceptance=acceptance))
            report.cases.append(path)
            echo(f"  wrote {path}")

    @hypothesis_seed(seed)
    @settings(max_examples=examples, database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(scenarios(changes, grammar_steps, pair_profile(scheduler, against), remote_kv))
    def generate(scenario: tuple[SchedulerConfig, list[RequestSpec], Acceptance]) -> None:
        examine(*scenario)

    generate()
    return report


PREFLIGHT_CONFIG = SchedulerConfig(block_size=16, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                                   max_model_len=64)
"""A small config every engine adapter is built for once before the scenarios, to find an unusable engine
environment before any work (:func:`_check_environment`)."""


def _check_environment(option: str, name: str) -> None:
    """Exit 2 (one line naming the variable) if ``name``'s engine environment is unusable (a vLLM worker
    that cannot start: :class:`~schedspec.reference.scheduler.EngineEnvironmentError`), before any scenario
    is generated. Any other failure to build it for :data:`PREFLIGHT_CONFIG` is left to the scenarios (a
    scheduler may refuse some configs, a factory may crash on some: counted or reported per scenario)."""
    if name not in REGISTRY or REGISTRY[name].kind != "engine-adapter":  # only an engine adapter needs an environment of its own
        return
    try:
        scheduler = make_scheduler(name, PREFLIGHT_CONFIG)
    except EngineEnvironmentError as error:
        fail(f"{option} {name}: {error}")
    except Exception:  # noqa: BLE001 - judged per scenario
        return
    close = getattr(scheduler, "close", None)
    if callable(close):
        close()


@click.command()
@click.option("--scheduler", "scheduler_name", required=True, metavar="NAME", help="The scheduler under test.")
@click.option("--against", "against", required=True, metavar="NAME", help="The scheduler it is compared with.")
@click.option("--examples", type=click.IntRange(min=1), default=100, show_default=True, help="Scenarios to generate.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Generation seed.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Fix a SchedulerConfig field in every scenario (repeatable).")
@click.option("--out", "out", default=None, metavar="DIR",
              help="Write each shrunk divergence here as a case file (never overwrites).")
@click.option("--exact-blocks", is_flag=True, help="Compare block ids, not only block counts.")
@click.option("--max-steps", type=click.IntRange(min=1), default=DEFAULT_MAX_STEPS, show_default=True,
              help="Steps after which a run that has not ended is a finding.")
@click.option("--grammar-steps", type=click.IntRange(min=0, max=1000), default=0, show_default=True,
              help="Structured output: about half the requests wait 0..N steps for their grammar (0: none).")
@click.option("--remote-kv", is_flag=True,
              help="KV connector: about half the requests load part of their prompt remotely (some loads fail), "
                   "some send their KV when they finish (scenarios with prefix caching off).")
def command(scheduler_name: str, against: str, examples: int, seed: int, sets: tuple[str, ...],
            out: str | None, exact_blocks: bool, max_steps: int, grammar_steps: int, remote_kv: bool) -> None:
    """Compare two schedulers step by step on generated scenarios.

    Exit 0 if they agree and neither breaks the spec (unsupported scenarios are counted, not
    compared), 1 on a divergence or finding, 2 on bad input, 3 if a scheduler could express none.
    """
    changes = parse_sets(sets)
    if changes:
        # field-level validation only (cross-field rules are checked per drawn config)
        permissive = SchedulerConfig(block_size=16, num_kv_blocks=64, max_num_batched_tokens=1 << 20,
                                     max_num_seqs=1, max_model_len=1)
        try:
            permissive.with_changes(**changes)
        except (ConfigError, TypeError) as error:
            fail(f"--set: {error}")
    for option, name in (("--scheduler", scheduler_name), ("--against", against)):
        # The name only: a scheduler that refuses some configs is counted per scenario.
        check_scheduler(name, None, where=option)
    for option, name in (("--scheduler", scheduler_name), ("--against", against)):
        _check_environment(option, name)
    folder = Path(out) if out is not None else None
    check_outputs([], [], folders=[("--out", out)])  # before any work (cli_common: one rule for outputs)
    try:
        report = run_diff(scheduler_name, against, examples, seed, changes, folder, exact_blocks, max_steps,
                          echo=click.echo, grammar_steps=grammar_steps, remote_kv=remote_kv)
    except Unsatisfiable:
        fail(f"--set {' '.join(sets)}: no generated config satisfies it")
    except EngineEnvironmentError as error:  # e.g. a vLLM worker that dies at start: one line, exit 2
        fail(str(error))
    except OSError as error:  # the --out folder became unwritable during the run
        fail(f"--out {out}: cannot write ({error.strerror or error})")
    click.echo(
        f"{plural(report.examples, 'example')}, {plural(report.steps_compared, 'step')} compared, "
        f"{report.divergent} divergent (unexplained), {plural(report.documented, 'documented difference')}, "
        f"{plural(len(report.findings), 'finding')}, {len(report.unsupported)} unsupported"
    )
    if report.unsupported:
        click.echo(f"unsupported (first): {report.unsupported[0]}")
    if report.divergent or report.findings:
        sys.exit(EXIT_CHECK_FAILED)
    if report.unsupported and len(report.unsupported) == report.examples:
        sys.exit(EXIT_UNSUPPORTED)
