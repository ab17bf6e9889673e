"""The counterexample scenarios the solver produced (``schedspec/data/cases/counterexample-*.json``) are
replayed by the executable reference: each property's monitor reports on the named scheduler while
every rule and invariant holds; and the bounded-itl one costs what it claims under the cost model."""

from __future__ import annotations

import attrs
import pytest

from schedspec.reference.engine import Engine
from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
from schedspec.reference.scheduler import make_scheduler
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.properties import ITL_TOKEN_BUDGET

COUNTEREXAMPLES = {p.stem: p for p in bundled_scenarios() if p.stem.startswith("counterexample-")}
EXPECTED = {
    "counterexample-bounded-itl": ("fcfs", "bounded-itl"),
    "counterexample-static-work-conserving": ("static", "work-conserving"),
    "counterexample-shortest-prompt-first-bounded-wait": ("shortest-prompt-first", "bounded-wait"),
    "counterexample-fcfs-priority-inversion": ("fcfs", "no-priority-inversion"),
    "counterexample-priority-inversion-second-urgent": ("fcfs", "no-priority-inversion"),
}


def test_the_three_counterexamples_are_bundled():
    assert set(EXPECTED) <= set(COUNTEREXAMPLES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_counterexample_replays_on_the_reference(name):
    scheduler, prop = EXPECTED[name]
    scenario = load_scenario(COUNTEREXAMPLES[name])
    assert scenario.scheduler == scheduler and scenario.expect == {"demonstrates": prop}
    result = replay(scenario)
    verdicts = {v.name: v for v in result.verdicts}
    assert verdicts["invariants"].passed, verdicts["invariants"].detail
    assert verdicts["demonstrates"].passed, verdicts["demonstrates"].detail
    # and directly with the engine, watching the property
    config = SchedulerConfig.from_dict(scenario.config)
    run = Engine(make_scheduler(scheduler, config), config, properties=[], watch=[prop]).run(list(scenario.requests))
    assert run.property_violations[prop]
    assert not run.violations


def _decode_itl(config: SchedulerConfig, requests) -> float:
    """The longest step that carries a running decode, in seconds under the default cost model."""
    run = Engine(make_scheduler("fcfs", config), config, properties=[]).run(list(requests))
    worst = 0.0
    for record in run.records:
        if any(s.decode_tokens for s in record.scheduled):
            worst = max(worst, record.duration)
    return worst


def test_chunked_prefill_keeps_the_inter_token_latency_that_whole_prefills_break():
    scenario = load_scenario(COUNTEREXAMPLES["counterexample-bounded-itl"])
    whole = SchedulerConfig.from_dict(scenario.config)
    assert not whole.enable_chunked_prefill
    chunked = attrs.evolve(whole, enable_chunked_prefill=True, max_num_batched_tokens=ITL_TOKEN_BUDGET)
    slow = _decode_itl(whole, scenario.requests)
    fast = _decode_itl(chunked, scenario.requests)
    assert slow > fast > 0
    run = Engine(make_scheduler("fcfs", chunked), chunked, properties=[], watch=["bounded-itl"]).run(
        list(scenario.requests))
    assert not run.property_violations["bounded-itl"]
