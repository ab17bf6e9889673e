"""The conformance suite: the tests the pytest plugin (:mod:`schedspec.pytest_plugin`) runs against a
scheduler chosen with ``--schedspec-scheduler``.

Run it from any project where schedspec is installed::

    pytest --pyargs schedspec.conformance --schedspec-scheduler=mypkg.adapter:make_scheduler \\
        --schedspec-examples 200 --schedspec-seed 1

(``pytest --schedspec-scheduler=...`` alone runs it too, next to the project's own tests.) Naming the
suite without a scheduler is a usage error (exit status 4), not a run where every test is skipped.

What it checks:

- ``test_state_machine``: :class:`schedspec.testing.SchedulerStateMachine` drives the scheduler
  through random configs and workloads (arrivals, bursts, aborts, steps, a final drain). Every plan
  must pass every allowed-plan rule (:mod:`schedspec.spec.rules`) before it runs, every state and
  step invariant (:mod:`schedspec.spec.invariants`) must hold after it, the scheduler must report
  the finished requests the spec says finished, and the trace properties it guarantees, plus the
  ones every scheduler owes (``progress``, ``rejects-impossible``), are monitored. A failure is a
  :class:`~schedspec.testing.SpecViolation` naming the check and the rule, invariant or property,
  with the shrunk sequence of calls that breaks it.
- ``test_scenario[NAME]``: every bundled scenario (``schedspec/data/cases``, format in its
  ``README.md``) replayed on the scheduler (:func:`schedspec.reference.scenarios.replay`). Judged
  always: every rule and invariant at every step and the properties the scheduler guarantees (the
  ``invariants`` verdict), a config that must be refused, each request's outcome, no token after an
  abort, outputs equal to solo runs, the free blocks at the end. Judged only when the scenario was
  written for this scheduler (its ``scheduler`` or ``config.policy`` names it, or it names neither and
  this is ``fcfs``: :func:`schedspec.reference.scenarios.judged_on`, as ``schedspec replay``): the latency and
  preemption bounds (``first_token_by_step``, ``all_terminal_by_step``,
  ``max_preemptions_per_request``), which differ between correct policies (static batching holds a
  slot that continuous batching reuses). Never judged: ``demonstrates`` and ``finding``, which record
  how one named scheduler fails; here the scheduler under test must not fail. A scenario whose config
  the scheduler cannot run (``UnsupportedFeature``, e.g. prefix caching) is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings
from hypothesis.stateful import run_state_machine_as_test

from schedspec.reference.scenarios import (  # noqa: F401 - ALWAYS_JUDGED, OWN_SCHEDULER_ONLY: re-exported
    ALWAYS_JUDGED,
    OWN_SCHEDULER_ONLY,
    bundled_scenarios,
    judged_on,
    load_scenario,
    replay,
)
from schedspec.reference.scheduler import UnsupportedFeature
from schedspec.spec.checker import DEFAULT_PROPERTIES
from schedspec.testing import SchedulerStateMachine, machine_for

SCENARIO_PATHS = bundled_scenarios()



def conformance_machine(scheduler_name: str, seed: int | None = None) -> type[SchedulerStateMachine]:
    """The state machine the suite runs for ``scheduler_name``: :func:`schedspec.testing.machine_for`'s,
    also enforcing the properties every scheduler owes (:data:`schedspec.spec.checker.DEFAULT_PROPERTIES`),
    seeded with Hypothesis' ``@seed`` when ``seed`` is given."""
    base = machine_for(scheduler_name)

    def guaranteed_properties(self: SchedulerStateMachine, scheduler: Any) -> Iterable[str]:
        return sorted({*getattr(scheduler, "guarantees", ()), *DEFAULT_PROPERTIES})

    machine = type(base.__name__, (base,), {"guaranteed_properties": guaranteed_properties})
    machine.__module__ = __name__
    return hypothesis_seed(seed)(machine) if seed is not None else machine


def test_state_machine(schedspec_scheduler_name: str, schedspec_settings: Settings,
                       schedspec_seed: int | None) -> None:
    """The stateful refinement check (module docstring)."""
    run_state_machine_as_test(conformance_machine(schedspec_scheduler_name, schedspec_seed),
                              settings=schedspec_settings)


@pytest.mark.parametrize("path", SCENARIO_PATHS, ids=[p.stem for p in SCENARIO_PATHS])
def test_scenario(path: Any, schedspec_scheduler_name: str) -> None:
    """One bundled scenario, judged as the module docstring says."""
    scenario = load_scenario(path)
    judged, _ = judged_on(scenario, schedspec_scheduler_name, fault_records=False)
    try:
        result = replay(judged, schedspec_scheduler_name)
    except UnsupportedFeature as error:
        pytest.skip(f"scheduler {schedspec_scheduler_name!r} cannot run this scenario: {error}")
    failed = [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]
    assert not failed, f"scenario {scenario.name} on {schedspec_scheduler_name}: " + "; ".join(failed)
