"""The Z3 encoding of the reference policies' step agrees with the Python policies.

Hypothesis draws configs and states (drawn directly, queue positions and slots included, or reached by
running the policy on a drawn workload, which brings preemptions and recomputation). The encoded step
of fcfs (and of static and shortest-prompt-first, which share its mechanism) is solved by Z3 on the
state; the solution must be unique and equal to the plan
:func:`schedspec.reference.policies.fcfs` returns (block ids compared as counts).
"""

from __future__ import annotations

import pytest

z3 = pytest.importorskip("z3")

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_proofs_encoding import (  # noqa: E402
    PLAN,
    configs,
    double_preemption_case,
    pressure_case,
    pressured,
    reached_states,
    states,
)

from schedspec.reference import policies  # noqa: E402
from schedspec.reference.proofs.policy import concrete_step  # noqa: E402
from schedspec.spec.proofs.concrete import describe_plan  # noqa: E402

EXAMPLES = settings(max_examples=min(settings.default.max_examples, 200))
FEW = settings(max_examples=min(settings.default.max_examples, 60))


@st.composite
def cases(draw, policy: str):
    kind = draw(st.integers(0, 2))
    if kind == 0:
        config, state = draw(pressured(policy))
    else:
        config = draw(configs())
        state = draw(states(config, invariant=draw(st.booleans())) if kind == 1 else reached_states(config, policy))
    extra = draw(st.integers(0, 1))
    return config, state, len(state.requests) + extra


@EXAMPLES
@example(pressure_case())
@example(double_preemption_case())
@given(cases("fcfs"))
def test_encoded_fcfs_step_is_the_fcfs_plan(case):
    check_fcfs_step(case)


def check_fcfs_step(case) -> None:
    """The property (also run against the mutants in ``tests/test_proofs_mutants.py``)."""
    config, state, slots = case
    assert concrete_step(state, config, "fcfs", slots) == describe_plan(policies.fcfs(state, config))


@pytest.mark.parametrize("policy", ["static", "shortest-prompt-first"])
@FEW
@given(data=st.data())
def test_encoded_step_of_the_other_policies(policy, data):
    config, state, slots = data.draw(cases(policy))
    assert concrete_step(state, config, policy, slots) == describe_plan(PLAN[policy](state, config))


@pytest.mark.parametrize("policy", ["fcfs", "static"])
@FEW
@given(data=st.data())
def test_slot_order_step_is_the_policy_plan_on_reached_states(policy, data):
    """The layout bounded model checking unrolls (each queue in slot order: requests in the order of
    addition) gives the policy's plan on the states the policy reaches (where ``Ord`` holds)."""
    kind = data.draw(st.integers(0, 1))
    if kind == 0:
        config, state = data.draw(pressured(policy))
    else:
        config = data.draw(configs())
        state = data.draw(reached_states(config, policy))
    slots = len(state.requests) + data.draw(st.integers(0, 1))
    got = concrete_step(state, config, policy, max(1, slots), layout="slot-order")
    assert got == describe_plan(PLAN[policy](state, config))
