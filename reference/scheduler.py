"""The stateful ``Scheduler`` protocol, the reference schedulers that implement it, and the registry
that ``--scheduler NAME`` reads.

The protocol (engine adapters implement the same one):

- ``add_request(request)``: a fresh :class:`~schedspec.spec.request.Request` arrives (before a step).
- ``abort_request(request_id)``: the client aborts it (before a step); unknown ids are ignored.
- ``schedule() -> StepPlan``: plan the next step. Must not change the scheduler's state.
- ``update(plan, sampled_token_ids) -> tuple[str, ...]``: apply the plan just returned and the tokens
  the model sampled (request id -> token id for each request that samples); returns the ids of the
  requests that finished (stop or length) in this step. With speculative decoding on
  (``num_speculative_tokens > 0``) the engine loop calls ``update(plan, sampled_token_ids, speculative)``,
  ``speculative`` the step's :class:`~schedspec.spec.state.SpeculativeOutput` (drafts accepted, drafts
  proposed); a scheduler whose ``update`` takes no third argument lacks speculative decoding
  (:func:`supports_speculative`, exit 3).
- ``state``: the scheduler's :class:`~schedspec.spec.state.SchedulerState` (reference schedulers), or
  ``None`` for an engine adapter, whose state the engine loop shadows with the spec.
- ``engine_view() -> EngineView`` (engine adapters, optional): the engine's own bookkeeping after the
  last ``update`` (or arrival/abort), in the spec's terms; the engine loop compares it field by field
  with the spec's shadow state and reports ``state-mismatch``.
- ``name`` and ``guarantees``: the registry name and the trace properties it promises.
- ``accept_transition(transition)`` (optional; reference schedulers): the hand-off of the spec
  transition the engine loop computed for the call it makes next
  (:class:`~schedspec.spec.stepper.Transition`), which a scheduler keeping the same spec state may use
  instead of computing it again (:class:`ReferenceScheduler`).
- ``supports_kv_connector`` (optional, default false): the scheduler follows remote KV loads and sends
  (``StepPlan.loads``, WAITING_FOR_REMOTE_KVS); the engine loop then calls ``update(plan, sampled_token_ids,
  speculative, transfers=report)`` with the KV connector's :class:`~schedspec.spec.state.KVTransferOutput`
  whenever a transfer landed or completed in the step. A workload with remote loads or sends on a scheduler
  without it is a feature it lacks (exit 3).
"""

from __future__ import annotations

import importlib
import inspect
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request
from schedspec.spec.state import (
    NO_SPECULATION,
    NO_TRANSFERS,
    KVTransferOutput,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
)
from schedspec.spec.stepper import Transition
from schedspec.spec.transitions import abort_request, add_request, apply_plan

from . import policies, vllm_v1

PlanFunction = Callable[[SchedulerState, SchedulerConfig], StepPlan]


@attrs.frozen
class EngineView:
    """An engine's own view of its state, as an adapter reads it from the engine, in the spec's terms.

    Block ids are the spec's: ``0 .. num_kv_blocks - 1`` (an adapter maps the engine's ids, e.g. vLLM's
    null block 0 is left out and its block ``b`` is spec block ``b - 1``).

    Attributes:
        num_free_blocks: blocks the engine could hand out now (blocks).
        waiting: ids in the engine's waiting queue (fresh and preempted), front first where the engine
            keeps an order; compared as a set.
        running: ids in the engine's running set; compared as a set.
        block_tables: live request id -> its block table (block ids, logical order); requests holding
            no blocks may be left out.
        num_computed_tokens: live request id -> tokens whose KV the engine holds for it (tokens).
    """

    num_free_blocks: int
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    block_tables: Mapping[str, tuple[int, ...]]
    num_computed_tokens: Mapping[str, int]

    @classmethod
    def of_state(cls, state: SchedulerState) -> EngineView:
        """The view a spec state gives (what an engine that agrees with the spec reports)."""
        return cls(
            num_free_blocks=state.num_free_blocks,
            waiting=state.waiting,
            running=state.running,
            block_tables={r: q.block_ids for r, q in state.requests.items() if q.block_ids},
            num_computed_tokens={r: q.num_computed_tokens for r, q in state.requests.items()},
        )



def view_differences(spec: EngineView, own: EngineView) -> list[tuple[str | None, str]]:
    """Field-by-field differences between the view the spec's state gives and an engine's own view.

    Returns:
        ``(request_id or None, "field: engine X, spec Y")`` for each difference; empty when they agree.
        Queues are compared as sets (engines order them differently, e.g. vLLM's priority heap), and an
        id twice in one of the engine's queues is a difference; block tables in logical order.
    """
    found: list[tuple[str | None, str]] = []
    if spec.num_free_blocks != own.num_free_blocks:
        found.append((None, f"num_free_blocks: engine {own.num_free_blocks}, spec {spec.num_free_blocks}"))
    for name in ("waiting", "running"):
        for request_id, count in Counter(getattr(own, name)).items():
            if count > 1:
                found.append((request_id, f"{name}: {count} times in the engine's {name} queue"))
        mine, theirs = set(getattr(own, name)), set(getattr(spec, name))
        for request_id in sorted(mine - theirs):
            found.append((request_id, f"{name}: in the engine's {name} queue, not in the spec's"))
        for request_id in sorted(theirs - mine):
            found.append((request_id, f"{name}: in the spec's {name} queue, not in the engine's"))
    for request_id in sorted(set(spec.block_tables) | set(own.block_tables)):
        mine, theirs = tuple(own.block_tables.get(request_id, ())), tuple(spec.block_tables.get(request_id, ()))
        if mine != theirs:
            found.append((request_id, f"block table: engine {list(mine)}, spec {list(theirs)}"))
    for request_id in sorted(set(spec.num_computed_tokens) | set(own.num_computed_tokens)):
        mine, theirs = own.num_computed_tokens.get(request_id), spec.num_computed_tokens.get(request_id)
        if mine != theirs:
            found.append((request_id, f"num_computed_tokens: engine {mine}, spec {theirs}"))
    return found


_REQUEST_FIELDS = tuple(field.name for field in attrs.fields(Request) if field.init)


def state_differences(spec: SchedulerState, own: SchedulerState,
                      ended: tuple[str, ...] = ()) -> list[tuple[str | None, str]]:
    """Field-by-field differences between the spec's state and a scheduler's own
    :class:`~schedspec.spec.state.SchedulerState` after the same step.

    Compares the step counter, both queues in order, the free queue, the prefix cache (hashes and reference
    counts), the number of requests added, every field of every live request, and the terminal requests listed in ``ended`` (those that ended in the
    step: earlier ones were compared when they ended). Requests that are the same object in both states
    cost one identity test.

    Returns:
        ``(request_id or None, "field: scheduler X, spec Y")`` per difference; empty when they agree.
    """
    if spec is own:
        return []
    found: list[tuple[str | None, str]] = []
    for name in ("step", "waiting", "running", "num_requests_added"):
        if getattr(spec, name) != getattr(own, name):
            found.append((None, f"{name}: scheduler {getattr(own, name)!r}, spec {getattr(spec, name)!r}"))
    if spec.prefix_cache != own.prefix_cache:
        found.append((None, "prefix_cache: the scheduler's block hashes or reference counts differ from the spec's"))
    if spec.free_block_ids != own.free_block_ids:
        # name the blocks that differ, not the whole queues
        only_own = sorted(set(own.free_block_ids) - set(spec.free_block_ids))
        only_spec = sorted(set(spec.free_block_ids) - set(own.free_block_ids))
        if only_own or only_spec:
            what = "; ".join(part for part in (
                f"free only in the scheduler's: {only_own[:8]}{'...' if len(only_own) > 8 else ''}" if only_own else "",
                f"free only in the spec's: {only_spec[:8]}{'...' if len(only_spec) > 8 else ''}" if only_spec else "",
            ) if part)
        else:
            at = next((i for i, (a, b) in enumerate(zip(own.free_block_ids, spec.free_block_ids, strict=False))
                       if a != b), min(own.num_free_blocks, spec.num_free_blocks))
            what = (f"the same blocks in another order: from position {at}, scheduler "
                    f"{list(own.free_block_ids[at:at + 4])}..., spec {list(spec.free_block_ids[at:at + 4])}...")
        found.append((None, f"free_block_ids: scheduler has {own.num_free_blocks}, spec {spec.num_free_blocks}; {what}"))
    for table, label in ((spec.requests, "live"), ({r: spec.finished[r] for r in ended if r in spec.finished}, "ended")):
        other = own.requests if label == "live" else own.finished
        for request_id, request in table.items():
            mine = other.get(request_id)
            if mine is request or mine == request:  # attrs' __eq__: every field but prompt_len
                continue
            if mine is None:
                found.append((request_id, f"{label} in the spec's state, missing from the scheduler's"))
                continue
            for name in _REQUEST_FIELDS:
                if getattr(mine, name) != getattr(request, name):
                    found.append((request_id, f"{name}: scheduler {getattr(mine, name)!r}, spec {getattr(request, name)!r}"))
    for request_id in own.requests:
        if request_id not in spec.requests:
            found.append((request_id, "live in the scheduler's state, not in the spec's"))
    return found

class UnsupportedFeature(Exception):
    """The chosen scheduler cannot express this config or scenario (CLI exit status 3)."""


class EngineEnvironmentError(Exception):
    """The environment an engine adapter needs is unusable: an environment variable names an interpreter
    that does not exist, or the engine's worker process cannot start or dies before its first reply. Unusable
    input (CLI exit status 2, one line naming the variable), unlike an engine that is simply not installed
    (:class:`UnsupportedFeature`, exit 3) or one that crashes while it runs (:class:`EngineFault`, a finding)."""


class EngineFault(Exception):
    """A third-party engine raised an exception inside its own code while an adapter drove it: a crash of
    the engine under test, which is a finding about that engine, not an error of schedspec.

    Adapters catch what the engine raises in their calls into it and re-raise it as this, so that the
    engine loop and the CLI can report it as a violation (``engine-crash``, at ``step``) rather than
    print a traceback. The original exception is the ``__cause__``.

    Attributes:
        engine: the engine and its version, e.g. ``"nano-vllm-fork 20260210"``.
        operation: the engine function the adapter called, e.g. ``"Scheduler.schedule"``.
        step: the step being planned or updated (the spec's numbering), ``None`` outside a step.
        location: the innermost frame of the engine's own code, ``"file:line in function"``.
        detail: the exception type and message.
    """

    def __init__(self, engine: str, operation: str, step: int | None, location: str, detail: str) -> None:
        self.engine = engine
        self.operation = operation
        self.step = step
        self.location = location
        self.detail = detail
        where = f"step {step}: " if step is not None else ""
        super().__init__(f"{where}{engine} crashed in {operation} ({location}): {detail}")


class UnknownScheduler(ValueError):
    """``--scheduler`` names no registered scheduler and no importable ``module:factory``.

    Attributes:
        name: the name given.
        detail: what is wrong with it (``"unknown; known: ..."``, ``"cannot load (...)"``); the message
            is ``--scheduler 'NAME': DETAIL``.
    """

    def __init__(self, name: str, detail: str) -> None:
        self.name = name
        self.detail = detail
        super().__init__(f"--scheduler {name!r}: {detail}")


@runtime_checkable
class Scheduler(Protocol):
    """An iteration-level scheduler driven step by step (module docstring)."""

    name: str
    guarantees: frozenset[str]

    def add_request(self, request: Request) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def schedule(self) -> StepPlan: ...

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int]) -> tuple[str, ...]: ...


GROUP_PLANS: frozenset[PlanFunction] = frozenset({policies.fcfs, policies.static, policies.shortest_prompt_first,
                                                  vllm_v1.vllm_v1, vllm_v1.vllm_v1_033})
"""The plan functions that allocate per KV cache group (``SchedulerConfig.kv_cache_groups``); any other
scheduler lacks hybrid KV cache groups (``supports_kv_cache_groups`` false or absent: the engine loop
refuses it, exit 3)."""


def supports_speculative(scheduler: object) -> bool:
    """Whether ``scheduler.update`` takes the third argument of speculative decoding (module docstring)."""
    import inspect

    try:
        parameters = inspect.signature(scheduler.update).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


ALL_PROPERTIES = frozenset(
    {"progress", "work-conserving", "stall-free-decode", "bounded-wait", "bounded-preemptions", "rejects-impossible"}
)


class ReferenceScheduler:
    """A pure policy wrapped as a stateful :class:`Scheduler`; its state changes only by the spec's
    transitions, so it refines the spec whenever its plans are allowed.

    It accepts the hand-off of a transition (:meth:`accept_transition`): the engine loop, which computes
    the spec's own transition of the same state to check the scheduler, hands it over before it calls
    the scheduler, and the scheduler uses it instead of computing it again when its call is exactly that
    transition (:meth:`~schedspec.spec.stepper.Transition.matches`). Sharing it halves the transitions of a
    checked lab run and makes the engine's comparison of the two states an identity test."""

    def __init__(self, config: SchedulerConfig, plan: PlanFunction, name: str, guarantees: frozenset[str]) -> None:
        self.config = config
        self.plan_function = plan
        self.name = name
        self.guarantees = guarantees
        self.state = SchedulerState.initial(config)
        self._handed: Transition | None = None
        self.supports_kv_cache_groups = plan in GROUP_PLANS
        self.supports_kv_connector = plan in KV_CONNECTOR_PLANS
        """Whether the policy follows remote KV loads (module docstring)."""

    def accept_transition(self, transition: Transition) -> None:
        """The spec transition the engine computed for the call it makes next (module docstring of
        :mod:`schedspec.spec.stepper`); used at most once, by that call if it is exactly this transition."""
        self._handed = transition

    def _take(self, operation: str, argument: object, sampled: Mapping[str, int] | None = None,
              speculative: SpeculativeOutput = NO_SPECULATION) -> object | None:
        handed, self._handed = self._handed, None
        if handed is not None and handed.matches(operation, self.state, argument, self.config, sampled, speculative):
            return handed.result
        return None

    def add_request(self, request: Request) -> None:
        handed = self._take("add_request", request)
        self.state = handed if handed is not None else add_request(self.state, request)

    def abort_request(self, request_id: str) -> None:
        handed = self._take("abort_request", request_id)
        self.state = handed if handed is not None else abort_request(self.state, request_id)

    def schedule(self) -> StepPlan:
        return self.plan_function(self.state, self.config)

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int],
               speculative: SpeculativeOutput = NO_SPECULATION,
               transfers: KVTransferOutput = NO_TRANSFERS) -> tuple[str, ...]:
        result = self._take("apply_plan", plan, sampled_token_ids, speculative) if transfers is NO_TRANSFERS else None
        if result is None:
            result = apply_plan(self.state, plan, sampled_token_ids, self.config, speculative, transfers)
        self.state = result.state
        return result.finished


SchedulerFactory = Callable[[SchedulerConfig], Scheduler]


KV_CONNECTOR_PLANS: frozenset[PlanFunction] = frozenset({policies.fcfs, policies.static, policies.shortest_prompt_first,
                                                         vllm_v1.vllm_v1, vllm_v1.vllm_v1_033})
"""The reference plans that follow remote KV loads (WAITING_FOR_REMOTE_KVS skipped, loads started, the requests
holding loaded blocks admitted first): those built on ``policies.plan_step`` and the FCFS ``vllm-v1`` profiles
(rule 13 of :mod:`~schedspec.reference.vllm_v1`)."""

CADENCE_PLANS: frozenset[PlanFunction] = frozenset({policies.fcfs, policies.static, policies.shortest_prompt_first,
                                                    vllm_v1.vllm_v1_033, vllm_v1.vllm_v1_priority_033})
"""The reference plans that follow vLLM 0.33's prefill cadence (``prefill_schedule_interval`` > 1): those
built on ``policies.plan_step`` and the ``@0.33`` profiles. vLLM 0.32's scheduler has the option but obeys it
only under a data-parallel MoE engine core (``DPEngineCoreProc._should_throttle_prefills``), so its profiles,
like ``priority``, refuse it."""


def refuse_cadence(plan: PlanFunction, name: str, config: SchedulerConfig) -> None:
    """Raises :class:`UnsupportedFeature` when ``config`` turns the prefill cadence on and ``plan`` does not
    follow it (:data:`CADENCE_PLANS`)."""
    if config.prefill_schedule_interval > 1 and plan not in CADENCE_PLANS:
        raise UnsupportedFeature(f"scheduler {name!r} does not follow prefill_schedule_interval="
                                 f"{config.prefill_schedule_interval} (vLLM 0.33's local prefill cadence)")


def _reference(plan: PlanFunction, name: str, guarantees: frozenset[str]) -> SchedulerFactory:
    def factory(config: SchedulerConfig) -> Scheduler:
        refuse_cadence(plan, name, config)
        return ReferenceScheduler(config, plan, name, guarantees)

    factory.__doc__ = plan.__doc__
    return factory


SPECULATIVE_LOSSES = frozenset({"work-conserving", "bounded-preemptions", "stall-free-decode", "bounded-wait"})
"""The properties a ``vllm-v1`` profile does not promise with speculative decoding (:func:`_vllm_profile`)."""


def _vllm_profile(plan: PlanFunction, name: str, guarantees: frozenset[str]) -> SchedulerFactory:
    """A ``vllm-v1`` profile's factory: with speculative decoding on it does not promise ``work-conserving``
    (vLLM stops admission rather than admit a one-token request un-padded when its ``1 + k`` padded
    tokens exceed the budget left: ``reference/vllm_v1.py`` rule 7) nor ``bounded-preemptions`` (vLLM
    schedules drafts past ``max_tokens``, so a request whose whole sequence fits the KV cache may need a
    block it never uses and preempt, itself included: the bundled case ``drafts-past-max-tokens-preempt``;
    the recompute after such a self-preemption can also take the oldest request past ``bounded-wait``'s
    ``max_model_len`` steps, e.g. chunked by a small ``long_prefill_token_threshold``)
    nor ``stall-free-decode`` (the running loop gives each decode all its drafts in list order, so the
    drafts of the decodes ahead can take the budget a later decode needed for its one token: the bundled
    case ``drafts-starve-a-decode``)."""
    def factory(config: SchedulerConfig) -> Scheduler:
        refuse_cadence(plan, name, config)
        kept = guarantees - SPECULATIVE_LOSSES if config.speculative else guarantees
        return ReferenceScheduler(config, plan, name, kept)

    factory.__doc__ = plan.__doc__
    return factory


def _sglang_profile(config: SchedulerConfig) -> Scheduler:
    """``sglang-profile``: :class:`schedspec.reference.sglang_profile.SglangProfile`, SGLang 0.5.23's
    decisions (imported here: that module builds on this one)."""
    from .sglang_profile import SglangProfile

    return SglangProfile(config)


def _sglang_profile_priority(config: SchedulerConfig) -> Scheduler:
    """``sglang-profile-priority``: :class:`schedspec.reference.sglang_profile.SglangProfile` with SGLang's
    priority scheduling and preemption (its rule 12)."""
    from .sglang_profile import sglang_profile_priority

    return sglang_profile_priority(config)


def _fast_fcfs(config: SchedulerConfig) -> Scheduler:
    """``fcfs-fast``: :func:`schedspec.reference.fast_fcfs.fcfs_fast` (imported here: that module builds
    on this one)."""
    from .fast_fcfs import fcfs_fast

    return fcfs_fast(config)


VLLM_V1_GUARANTEES = ALL_PROPERTIES
"""``vllm-v1`` keeps every property (measured with the stateful suite, docs/engines.md): under FCFS a
request that preempts itself is the last running one, and admission's whole-sequence gate is the
work-conserving test."""
VLLM_V1_PRIORITY_GUARANTEES = frozenset({"progress", "stall-free-decode", "rejects-impossible"})
"""``vllm-v1-priority`` starves less urgent requests by design (no ``bounded-wait``), preempts whichever
running request is least urgent (no ``bounded-preemptions``), and a request that preempts itself ends the
running phase, leaving more urgent running requests without a token (no ``work-conserving``), and a waiting
request never preempts, so at ``max_num_seqs`` an urgent request waits behind less urgent running ones (no
``no-priority-inversion``: bundled case ``priority-preempts-at-seq-cap``, tests/test_priority_inversion.py)."""

@attrs.frozen
class RegisteredScheduler:
    """One entry of the scheduler registry (:data:`REGISTRY`), the one table every ``--scheduler NAME``
    (the CLI's commands, ``schedspec lab --compare`` and ``--sweep scheduler=``, the pytest plugin, the
    help text and the generated docs) reads.

    Attributes:
        name: the ``--scheduler`` name.
        kind: ``"reference"`` (a reference scheduler every test suite runs: ``factory`` and ``plan``
            set), ``"engine-adapter"`` (a real engine's scheduler, ``target`` set: it lives in
            ``schedspec.engines``, which ``reference`` must not import, ``tests/test_layering.py``, so
            it is imported by name on first use; it needs its engine installed and promises less),
            ``"engine-profile"`` (a reference scheduler reproducing an engine's decisions, its stalls
            included: it refines the spec at every step but need not end every request, so the suites
            every reference scheduler runs leave it out; ``factory`` set; ``schedspec diff`` judges it
            against its engine) or ``"reserved"`` (a name kept for a scheduler not written yet: choosing it is a missing
            feature, exit 3, not a typo, exit 2; ``reason`` says why).
        factory: ``SchedulerConfig -> Scheduler`` (reference schedulers).
        target: ``"module:factory"`` (engine adapters), resolved by :func:`resolve_factory`.
        plan: the pure plan function of a reference scheduler built on :class:`ReferenceScheduler`
            (``None`` for another implementation such as ``fcfs-fast``).
        unchecked: the registered name of a faster implementation of the same plans (tested step for
            step equal to this one) that unchecked runs (the lab with checks off) use instead; with
            checks on the plain policy runs, sharing the spec's transition with the engine
            (:meth:`ReferenceScheduler.accept_transition`).
        reason: why a reserved name is not implemented yet.
    """

    name: str
    kind: str = attrs.field(validator=attrs.validators.in_(("reference", "engine-adapter", "engine-profile",
                                                            "reserved")))
    factory: SchedulerFactory | None = None
    target: str | None = None
    plan: PlanFunction | None = None
    unchecked: str | None = None
    reason: str | None = None

    @classmethod
    def reference(cls, name: str, plan: PlanFunction, guarantees: frozenset[str],
                  unchecked: str | None = None) -> RegisteredScheduler:
        """A :class:`ReferenceScheduler` running ``plan``, promising ``guarantees``."""
        return cls(name, "reference", factory=_reference(plan, name, guarantees), plan=plan, unchecked=unchecked)

    @classmethod
    def vllm_profile(cls, name: str, plan: PlanFunction, guarantees: frozenset[str]) -> RegisteredScheduler:
        """A ``vllm-v1`` profile running ``plan``: it promises ``guarantees`` less
        :data:`SPECULATIVE_LOSSES` with speculative decoding on (:func:`_vllm_profile`)."""
        return cls(name, "reference", factory=_vllm_profile(plan, name, guarantees), plan=plan)


def _reference_entries() -> list[RegisteredScheduler]:
    return [
        RegisteredScheduler.reference("fcfs", policies.fcfs, ALL_PROPERTIES, unchecked="fcfs-fast"),
        RegisteredScheduler.reference(
            "static", policies.static,
            frozenset({"progress", "stall-free-decode", "bounded-wait", "rejects-impossible", "bounded-preemptions"}),
        ),
        # no work-conserving: Z3 finds a one-step counterexample from a state satisfying the spec's
        # invariant (docs/proofs.md: the shorter prompt tried first does not fit, admission stops, the
        # head of the queue would have fit)
        RegisteredScheduler.reference(
            "shortest-prompt-first", policies.shortest_prompt_first,
            frozenset({"progress", "stall-free-decode", "rejects-impossible"}),
        ),
        # starves less urgent requests by design (no bounded-wait); preempts the least urgent, not the most
        # recently admitted, request (no bounded-preemptions); a waiting request preempts strictly less urgent
        # running ones for a slot, blocks or budget (no-priority-inversion, policies.plan_by_priority)
        RegisteredScheduler.reference(
            "priority", policies.priority,
            frozenset({"progress", "stall-free-decode", "rejects-impossible", "no-priority-inversion"}),
        ),
        # the fcfs policy on mutable tables, tested equal to fcfs step for step (reference/fast_fcfs.py)
        RegisteredScheduler("fcfs-fast", "reference", factory=_fast_fcfs),
        RegisteredScheduler.vllm_profile("vllm-v1", vllm_v1.vllm_v1, VLLM_V1_GUARANTEES),
        RegisteredScheduler.vllm_profile("vllm-v1-priority", vllm_v1.vllm_v1_priority, VLLM_V1_PRIORITY_GUARANTEES),
        # vLLM 0.33's decisions (reference/vllm_v1.py: they differ from 0.32's only under priority)
        RegisteredScheduler.vllm_profile("vllm-v1@0.33", vllm_v1.vllm_v1_033, VLLM_V1_GUARANTEES),
        RegisteredScheduler.vllm_profile("vllm-v1-priority@0.33", vllm_v1.vllm_v1_priority_033,
                                         VLLM_V1_PRIORITY_GUARANTEES),
        # SGLang 0.5.23's decisions in the sglang adapter's configuration (reference/sglang_profile.py); keeps
        # state the spec does not (its queue order, the new-token ratio), so it is no pure plan function
        RegisteredScheduler("sglang-profile", "engine-profile", factory=_sglang_profile),
        RegisteredScheduler("sglang-profile-priority", "engine-profile", factory=_sglang_profile_priority),
    ]


def _engine_adapter_entries() -> list[RegisteredScheduler]:
    adapters = {
        "vllm": "schedspec.engines.vllm:fcfs",
        "vllm-priority": "schedspec.engines.vllm:priority",
        "vllm-async": "schedspec.engines.vllm:fcfs_async",
        "vllm-priority-async": "schedspec.engines.vllm:priority_async",
        "vllm@0.32": "schedspec.engines.vllm:fcfs",
        "vllm-priority@0.32": "schedspec.engines.vllm:priority",
        "vllm-async@0.32": "schedspec.engines.vllm:fcfs_async",
        "vllm-priority-async@0.32": "schedspec.engines.vllm:priority_async",
        "vllm@0.33": "schedspec.engines.vllm:fcfs_033",
        "vllm-priority@0.33": "schedspec.engines.vllm:priority_033",
        "vllm-async@0.33": "schedspec.engines.vllm:fcfs_async_033",
        "vllm-priority-async@0.33": "schedspec.engines.vllm:priority_async_033",
        "nanovllm": "schedspec.engines.nanovllm:NanoVllmScheduler",
        "sglang": "schedspec.engines.sglang:fcfs",
        "sglang-priority": "schedspec.engines.sglang:priority",
    }
    return [RegisteredScheduler(name, "engine-adapter", target=target) for name, target in adapters.items()]


REGISTRY: dict[str, RegisteredScheduler] = {
    entry.name: entry for entry in [*_reference_entries(), *_engine_adapter_entries()]
}
"""Every ``--scheduler`` name -> its :class:`RegisteredScheduler`, reference schedulers first, then the
engine adapters, then names reserved for schedulers not written yet (none today). A name not here may
still be a user's ``module:factory`` (:func:`resolve_factory`)."""


class _Names(Mapping[str, SchedulerFactory]):
    """A live read-only view of :data:`REGISTRY`'s reference schedulers, name -> factory."""

    def __getitem__(self, name: str) -> SchedulerFactory:
        entry = REGISTRY.get(name)
        if entry is None or entry.kind != "reference":
            raise KeyError(name)
        assert entry.factory is not None
        return entry.factory

    def __iter__(self):
        return (name for name, entry in REGISTRY.items() if entry.kind == "reference")

    def __len__(self) -> int:
        return sum(1 for _ in self)


SCHEDULERS: Mapping[str, SchedulerFactory] = _Names()
"""The reference schedulers (every test suite runs them) by ``--scheduler`` name -> factory: a view of
:data:`REGISTRY`; register a scheduler there."""


def names(kind: str) -> list[str]:
    """The registered names of one ``kind`` (:class:`RegisteredScheduler`), in registry order."""
    return [name for name, entry in REGISTRY.items() if entry.kind == kind]


def unchecked_implementation(name: str) -> str:
    """The registered scheduler that unchecked runs use for ``name``: its
    :attr:`RegisteredScheduler.unchecked`, else ``name`` itself."""
    entry = REGISTRY.get(name)
    return entry.unchecked if entry is not None and entry.unchecked is not None else name


def unknown_scheduler_detail() -> str:
    """The end of the message for a name that is neither registered nor ``module:factory``."""
    known = sorted(n for n, entry in REGISTRY.items() if entry.kind != "reserved")
    return f"unknown; known: {', '.join(known)}, or module:factory"


def resolve_factory(name: str) -> SchedulerFactory:
    """The factory for ``name``: a registered reference scheduler's, an engine adapter's (imported here, on
    first use) or a user's ``module:factory``, which must name a Python function or class (not a
    built-in such as ``os:system`` or ``builtins:print``). The one place a ``module:factory`` is imported.

    Raises:
        UnknownScheduler: no such scheduler, or one that cannot be loaded; its ``detail`` is the message
            without the leading ``--scheduler NAME:``.
        UnsupportedFeature: the name is reserved for a scheduler not written yet.
    """
    entry = REGISTRY.get(name)
    if entry is not None and entry.kind == "reserved":
        raise UnsupportedFeature(f"scheduler {name!r}: {entry.reason}")
    if entry is not None and entry.factory is not None:
        return entry.factory
    target = entry.target if entry is not None and entry.target is not None else name
    module_name, colon, attribute = target.partition(":")
    if not colon:
        raise UnknownScheduler(name, unknown_scheduler_detail())
    if not module_name.strip() or not attribute.strip():
        raise UnknownScheduler(name, "expected module:factory")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's input
        raise UnknownScheduler(name, f"cannot load ({type(error).__name__}: {error})") from None
    if inspect.isbuiltin(factory) or not (inspect.isfunction(factory) or inspect.isclass(factory)):
        raise UnknownScheduler(name, "not a scheduler factory (a Python function or class taking a "
                                     f"SchedulerConfig), found {type(factory).__name__}")
    return factory


def make_scheduler(name: str, config: SchedulerConfig) -> Scheduler:
    """Build the scheduler ``name`` (registry name, engine adapter name or ``module:factory``) for
    ``config`` (:func:`resolve_factory`).

    Raises:
        UnknownScheduler: no such scheduler (the message lists the known names).
        UnsupportedFeature: the scheduler cannot run this config (or its engine is not installed).
    """
    return resolve_factory(name)(config)
