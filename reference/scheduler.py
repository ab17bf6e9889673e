"""The stateful ``Scheduler`` protocol, the reference schedulers that implement it, and the registry
that ``--scheduler NAME`` reads.

The protocol (engine adapters implement the same one):

- ``add_request(request)``: a fresh :class:`~schedspec.spec.request.Request` arrives (before a step).
- ``abort_request(request_id)``: the client aborts it (before a step); unknown ids are ignored.
- ``schedule() -> StepPlan``: plan the next step. Must not change the scheduler's state.
- ``update(plan, sampled_token_ids) -> tuple[str, ...]``: apply the plan just returned and the tokens
  the model sampled (request id -> token id for each request that samples); returns the ids of the
  requests that finished (stop or length) in this step.
- ``state``: the scheduler's :class:`~schedspec.spec.state.SchedulerState` (reference schedulers), or
  ``None`` for an engine adapter, whose state the engine loop shadows with the spec.
- ``engine_view() -> EngineView`` (engine adapters, optional): the engine's own bookkeeping after the
  last ``update`` (or arrival/abort), in the spec's terms; the engine loop compares it field by field
  with the spec's shadow state and reports ``state-mismatch``.
- ``name`` and ``guarantees``: the registry name and the trace properties it promises.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request
from schedspec.spec.state import SchedulerState, StepPlan
from schedspec.spec.transitions import abort_request, add_request, apply_plan

from . import policies

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


class UnsupportedFeature(Exception):
    """The chosen scheduler cannot express this config or scenario (CLI exit status 3)."""


class UnknownScheduler(ValueError):
    """``--scheduler`` names no registered scheduler and no importable ``module:factory``."""


@runtime_checkable
class Scheduler(Protocol):
    """An iteration-level scheduler driven step by step (module docstring)."""

    name: str
    guarantees: frozenset[str]

    def add_request(self, request: Request) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def schedule(self) -> StepPlan: ...

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int]) -> tuple[str, ...]: ...


ALL_PROPERTIES = frozenset(
    {"progress", "work-conserving", "stall-free-decode", "bounded-wait", "bounded-preemptions", "rejects-impossible"}
)


class ReferenceScheduler:
    """A pure policy wrapped as a stateful :class:`Scheduler`; its state changes only by the spec's
    transitions, so it refines the spec whenever its plans are allowed."""

    def __init__(self, config: SchedulerConfig, plan: PlanFunction, name: str, guarantees: frozenset[str]) -> None:
        if config.enable_prefix_caching:
            raise UnsupportedFeature(
                f"scheduler {name!r} does not implement prefix caching (enable_prefix_caching=true)"
            )
        self.config = config
        self.plan_function = plan
        self.name = name
        self.guarantees = guarantees
        self.state = SchedulerState.initial(config)

    def add_request(self, request: Request) -> None:
        self.state = add_request(self.state, request)

    def abort_request(self, request_id: str) -> None:
        self.state = abort_request(self.state, request_id)

    def schedule(self) -> StepPlan:
        return self.plan_function(self.state, self.config)

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int]) -> tuple[str, ...]:
        result = apply_plan(self.state, plan, sampled_token_ids, self.config)
        self.state = result.state
        return result.finished


SchedulerFactory = Callable[[SchedulerConfig], Scheduler]


def _reference(plan: PlanFunction, name: str, guarantees: frozenset[str]) -> SchedulerFactory:
    def factory(config: SchedulerConfig) -> Scheduler:
        return ReferenceScheduler(config, plan, name, guarantees)

    factory.__doc__ = plan.__doc__
    return factory


SCHEDULERS: dict[str, SchedulerFactory] = {
    "fcfs": _reference(policies.fcfs, "fcfs", ALL_PROPERTIES),
    "static": _reference(
        policies.static, "static",
        frozenset({"progress", "stall-free-decode", "bounded-wait", "rejects-impossible", "bounded-preemptions"}),
    ),
    "shortest-prompt-first": _reference(
        policies.shortest_prompt_first, "shortest-prompt-first",
        frozenset({"progress", "work-conserving", "stall-free-decode", "rejects-impossible"}),
    ),
    "priority": _reference(
        policies.priority, "priority",
        frozenset({"progress", "stall-free-decode", "rejects-impossible"}),
    ),
}
"""Registered schedulers by ``--scheduler`` name. ``module:factory`` names a user's own factory, a
callable taking a :class:`SchedulerConfig` and returning a :class:`Scheduler`."""

PLAN_FUNCTIONS: dict[str, PlanFunction] = {
    "fcfs": policies.fcfs,
    "static": policies.static,
    "shortest-prompt-first": policies.shortest_prompt_first,
    "priority": policies.priority,
}


NOT_YET_IMPLEMENTED: dict[str, str] = {
    "vllm-v1": "the vLLM V1 replica policy is not implemented yet",
    "nanovllm": "the nano-vLLM engine adapter is not implemented yet",
}
"""Names the CLI already reserves; choosing one is a missing feature (exit 3), not a typo (exit 2)."""


ENGINE_ADAPTERS: dict[str, str] = {
    "vllm": "schedspec.engines.vllm:fcfs",
    "vllm-priority": "schedspec.engines.vllm:priority",
    "vllm-async": "schedspec.engines.vllm:fcfs_async",
    "vllm-priority-async": "schedspec.engines.vllm:priority_async",
}
"""Adapters of real engines' schedulers by ``--scheduler`` name, as ``module:factory``. They live in
``schedspec.engines``, which ``reference`` must not import (``tests/test_layering.py``), so the module is
imported by name only when one is chosen. They are not in :data:`SCHEDULERS`, whose entries are the
reference schedulers every test suite runs (an adapter needs its engine installed and promises less)."""


def make_scheduler(name: str, config: SchedulerConfig) -> Scheduler:
    """Build the scheduler ``name`` (registry name, engine adapter name or ``module:factory``) for
    ``config``.

    Raises:
        UnknownScheduler: no such scheduler (the message lists the known names).
        UnsupportedFeature: the scheduler cannot run this config.
    """
    if name in NOT_YET_IMPLEMENTED:
        raise UnsupportedFeature(f"scheduler {name!r}: {NOT_YET_IMPLEMENTED[name]}")
    factory = SCHEDULERS.get(name)
    if factory is None:
        target = ENGINE_ADAPTERS.get(name, name)
        if ":" not in target:
            known = sorted(SCHEDULERS) + sorted(ENGINE_ADAPTERS)
            raise UnknownScheduler(f"--scheduler {name!r}: unknown; known: {', '.join(known)}, or module:factory")
        module_name, _, attribute = target.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise UnknownScheduler(f"--scheduler {name!r}: cannot load ({error})") from None
    return factory(config)
