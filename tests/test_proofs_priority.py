"""The Z3 encoding of the priority policy (``reference/proofs/policy.py`` ``plan_priority``) agrees with
:func:`schedspec.reference.policies.plan_by_priority`, and a mutant of it is caught.

States are drawn (``test_proofs_encoding.states`` with the spec's invariants, then priorities and
arrival times drawn per request) or reached by running the priority policy on a drawn workload with
priorities under a config with few blocks and one or two sequence slots, so that running requests
preempt less urgent ones for blocks and waiting requests preempt them for a slot, blocks or budget.
On each, Z3 solves the encoded step (slots in pass order); the solution must be unique and equal to
the Python plan (block ids as counts). Cost: about 10 s under the ``ci`` profile (60 examples).
"""

from __future__ import annotations

import pytest

z3 = pytest.importorskip("z3")

import attrs  # noqa: E402
from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_proofs_encoding import configs, states  # noqa: E402

from schedspec.reference import policies  # noqa: E402
from schedspec.reference.fake_model import FakeModel  # noqa: E402
from schedspec.reference.proofs import policy as encoded  # noqa: E402
from schedspec.reference.proofs.policy import concrete_step  # noqa: E402
from schedspec.spec.config import SchedulerConfig  # noqa: E402
from schedspec.spec.proofs.concrete import describe_plan  # noqa: E402
from schedspec.spec.state import SchedulerState  # noqa: E402
from schedspec.spec.transitions import add_request  # noqa: E402
from schedspec.spec.transitions import apply_plan as py_apply_plan  # noqa: E402
from schedspec.spec.workload import RequestSpec  # noqa: E402

FEW = settings(max_examples=min(settings.default.max_examples, 60), deadline=None)


def run_workload(config: SchedulerConfig, workload: list[RequestSpec], steps: int) -> SchedulerState:
    """The state the priority policy reaches after ``steps`` steps of ``workload`` (arrivals of the next
    step added)."""
    model = FakeModel(config)
    state = SchedulerState.initial(config)
    for step in range(steps + 1):
        for spec in workload:
            if spec.arrival_step == step:
                state = add_request(state, spec.to_request(step))
        if step == steps:
            break
        plan = policies.priority(state, config)
        sampled, _ = model.execute(plan, state)
        state = py_apply_plan(state, plan, sampled, config).state
    return state


@st.composite
def reached(draw) -> tuple[SchedulerConfig, SchedulerState]:
    config = attrs.evolve(draw(configs()), block_size=draw(st.sampled_from([1, 2])),
                          num_kv_blocks=draw(st.integers(2, 4)), max_num_seqs=draw(st.integers(1, 2)))
    config = attrs.evolve(config, max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs))
    workload = [RequestSpec(f"w{k}", draw(st.integers(1, config.max_model_len)), draw(st.integers(1, 6)),
                            arrival_step=draw(st.integers(0, 6)), priority=draw(st.integers(0, 2)))
                for k in range(draw(st.integers(2, 5)))]
    return config, run_workload(config, workload, draw(st.integers(0, 12)))


@st.composite
def drawn(draw) -> tuple[SchedulerConfig, SchedulerState]:
    config = draw(configs())
    state = draw(states(config, invariant=True))
    requests = {r: attrs.evolve(q, priority=draw(st.integers(0, 2)), arrival_time=float(draw(st.integers(0, 1))))
                for r, q in state.requests.items()}
    return config, attrs.evolve(state, requests=requests)


@st.composite
def cases(draw):
    config, state = draw(reached() if draw(st.booleans()) else drawn())
    return config, state, len(state.requests) + draw(st.integers(0, 1))


def preempt_for_waiting_case():
    """max_num_seqs = 1: a running request of priority 2, then an urgent (priority 0) one arrives; the
    policy preempts the running one for the slot and admits the urgent one."""
    config = SchedulerConfig(block_size=1, num_kv_blocks=8, max_num_batched_tokens=8, max_num_seqs=1, max_model_len=8)
    workload = [RequestSpec("slow", 3, 4, arrival_step=0, priority=2), RequestSpec("urgent", 2, 2, arrival_step=2)]
    state = run_workload(config, workload, 2)
    assert describe_plan(policies.priority(state, config))["preempted"] == ["slow"]
    return config, state, 2


def decode_preempts_case():
    """Three blocks of size 1: three requests of priorities 0, 1 and 2 hold one each; their decodes need a
    block each and none is free: the priority-0 decode preempts the least urgent (priority 2), not the
    priority-1 one."""
    config = SchedulerConfig(block_size=1, num_kv_blocks=3, max_num_batched_tokens=8, max_num_seqs=3, max_model_len=8)
    workload = [RequestSpec("a", 1, 3, arrival_step=0, priority=0), RequestSpec("b", 1, 3, arrival_step=0, priority=1),
                RequestSpec("c", 1, 3, arrival_step=0, priority=2)]
    for steps in range(1, 8):
        state = run_workload(config, workload, steps)
        if describe_plan(policies.priority(state, config))["preempted"]:
            return config, state, 3
    raise AssertionError("no preemption in this workload")


def check_priority_step(case) -> None:
    config, state, slots = case
    assert concrete_step(state, config, "priority", slots) == describe_plan(policies.priority(state, config))


@FEW
@example(preempt_for_waiting_case())
@example(decode_preempts_case())
@given(cases())
def test_encoded_priority_step_is_the_priority_plan(case):
    check_priority_step(case)


def test_most_urgent_victim_mutant_is_caught(monkeypatch):
    """Deliberate break: the encoding preempts the most urgent candidate first instead of the least
    urgent one. The explicit examples, or the drawn cases within the ``ci`` budget, catch it."""
    def most_urgent_first(less, equal, u, v):
        return z3.Or(less[u][v], z3.And(equal[u][v], z3.BoolVal(u < v)))

    monkeypatch.setattr(encoded, "preempted_before", most_urgent_first)
    failures = []
    for case in (preempt_for_waiting_case(), decode_preempts_case()):
        try:
            check_priority_step(case)
        except AssertionError as error:
            failures.append(str(error))

    @settings(max_examples=60, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def run(case):
        check_priority_step(case)

    if not failures:
        with pytest.raises(AssertionError):
            run()


@FEW
@example(preempt_for_waiting_case(), "vllm-v1-priority")
@given(cases(), st.sampled_from(["priority", "priority", "fcfs", "vllm-v1-priority"]))
def test_inversion_predicate_is_the_monitor(case, planner):
    """The Z3 predicate of ``no-priority-inversion`` (``reference/proofs/priority.py``) is true exactly when
    the Python monitor reports, on the priority plan and on plans of policies that invert priorities (fcfs,
    vLLM's priority policy, which never preempts for a waiting request)."""
    from schedspec.reference.policies import fcfs
    from schedspec.reference.proofs.priority import priority_inversion_violation
    from schedspec.reference.vllm_v1 import vllm_v1_priority
    from schedspec.spec.proofs.concrete import concrete_ctx, encode_plan, encode_state, slot_assignment
    from schedspec.spec.properties import NoPriorityInversion

    config, state, slots = case
    plan = {"priority": policies.priority, "fcfs": fcfs, "vllm-v1-priority": vllm_v1_priority}[planner](state, config)
    monitor = NoPriorityInversion(config)
    monitor.observe(state, plan, state)
    slot_ids = slot_assignment(state, plan, slots)
    predicate = priority_inversion_violation(concrete_ctx(config), encode_state(state, slot_ids),
                                             encode_plan(plan, slot_ids))
    assert z3.is_true(z3.simplify(predicate)) == bool(monitor.violations), (monitor.violations, plan)
