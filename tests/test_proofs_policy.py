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
from test_proofs_encoding import configs, states  # noqa: E402

from schedspec.reference import policies  # noqa: E402
from schedspec.reference.fake_model import FakeModel  # noqa: E402
from schedspec.reference.proofs.policy import concrete_step  # noqa: E402
from schedspec.spec.config import SchedulerConfig  # noqa: E402
from schedspec.spec.proofs.concrete import describe_plan  # noqa: E402
from schedspec.spec.request import Request, RequestStatus  # noqa: E402
from schedspec.spec.state import SchedulerState  # noqa: E402
from schedspec.spec.transitions import add_request, apply_plan  # noqa: E402
from schedspec.spec.workload import RequestSpec  # noqa: E402

PLAN = {"fcfs": policies.fcfs, "static": policies.static, "shortest-prompt-first": policies.shortest_prompt_first}
EXAMPLES = settings(max_examples=min(settings.default.max_examples, 200))
FEW = settings(max_examples=min(settings.default.max_examples, 60))


@st.composite
def reached_states(draw, config, policy: str) -> SchedulerState:
    """A state reached by running ``policy`` on a drawn workload for a drawn number of steps."""
    workload = [
        RequestSpec(f"w{k}", draw(st.integers(0, config.max_model_len + 1)), draw(st.integers(0, 6)),
                    arrival_step=draw(st.integers(0, 4)))
        for k in range(draw(st.integers(1, 5)))
    ]
    model = FakeModel(config)
    state = SchedulerState.initial(config)
    steps = draw(st.integers(0, 12))
    for step in range(steps):
        for spec in workload:
            if spec.arrival_step == step:
                state = add_request(state, spec.to_request(step))
        plan = PLAN[policy](state, config)
        sampled, _ = model.execute(plan, state)
        state = apply_plan(state, plan, sampled, config).state
    for spec in workload:  # late arrivals join before the step we compare
        if spec.arrival_step >= steps and draw(st.booleans()):
            state = add_request(state, spec.to_request(state.step))
    return state


@st.composite
def cases(draw, policy: str):
    config = draw(configs())
    if draw(st.booleans()):
        state = draw(states(config, invariant=draw(st.booleans())))
    else:
        state = draw(reached_states(config, policy))
    extra = draw(st.integers(0, 1))
    return config, state, len(state.requests) + extra


def pressure_case():
    """No free block; the running decode A needs one, so it preempts B (admitted after it) and takes B's
    block. A policy that does not return a victim's blocks to the pool preempts A too."""
    config = SchedulerConfig(block_size=2, num_kv_blocks=2, max_num_batched_tokens=8, max_num_seqs=2,
                             max_model_len=16)
    a = Request("A", 0, (1, 2), 4, status=RequestStatus.RUNNING, num_computed_tokens=2, output_token_ids=(5,),
                block_ids=(0,), admitted_step=0)
    b = Request("B", 0, (3, 4), 4, status=RequestStatus.RUNNING, num_computed_tokens=0, block_ids=(1,),
                admitted_step=1)
    state = SchedulerState(step=2, running=("A", "B"), requests={"A": a, "B": b}, free_block_ids=(),
                           num_requests_added=2)
    return config, state, 2


@EXAMPLES
@example(pressure_case())
@given(cases("fcfs"))
def test_encoded_fcfs_step_is_the_fcfs_plan(case):
    config, state, slots = case
    assert concrete_step(state, config, "fcfs", slots) == describe_plan(policies.fcfs(state, config))


@pytest.mark.parametrize("policy", ["static", "shortest-prompt-first"])
@FEW
@given(data=st.data())
def test_encoded_step_of_the_other_policies(policy, data):
    config, state, slots = data.draw(cases(policy))
    assert concrete_step(state, config, policy, slots) == describe_plan(PLAN[policy](state, config))
