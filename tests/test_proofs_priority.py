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

import itertools  # noqa: E402
from functools import cache  # noqa: E402

import attrs  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
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
    config = draw(configs())
    seqs = draw(st.integers(1, 2))
    config = attrs.evolve(config, block_size=draw(st.sampled_from([1, 2])), num_kv_blocks=draw(st.integers(2, 4)),
                          max_num_seqs=seqs, max_num_batched_tokens=max(config.max_num_batched_tokens, seqs))
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


GRID_CONFIGS = (
    SchedulerConfig(block_size=1, num_kv_blocks=3, max_num_batched_tokens=4, max_num_seqs=2, max_model_len=4),
    SchedulerConfig(block_size=1, num_kv_blocks=3, max_num_batched_tokens=4, max_num_seqs=1, max_model_len=4,
                    enable_chunked_prefill=False),
    SchedulerConfig(block_size=2, num_kv_blocks=2, max_num_batched_tokens=2, max_num_seqs=2, max_model_len=4),
    SchedulerConfig(block_size=1, num_kv_blocks=3, max_num_batched_tokens=4, max_num_seqs=3, max_model_len=4),
)


@cache
def preemption_states() -> tuple[tuple[SchedulerConfig, SchedulerState], ...]:
    """Every state the priority policy reaches, in at most 6 steps, from every workload of a grid (2 or 3
    requests, prompt length 1 or 3, ``max_tokens`` 2, arriving at step 0 or 1, priority 0 or 1) under
    :data:`GRID_CONFIGS`, in which its plan preempts (duplicates of what the encoding sees removed)."""
    found: dict[tuple, tuple[SchedulerConfig, SchedulerState]] = {}
    for config in GRID_CONFIGS:
        for n in (2, 3):
            for drawn_requests in itertools.product(itertools.product((1, 3), (0, 1), (0, 1)), repeat=n):
                workload = [RequestSpec(f"r{k}", p, 2, arrival_step=a, priority=pr)
                            for k, (p, a, pr) in enumerate(drawn_requests)]
                model = FakeModel(config)
                state = SchedulerState.initial(config)
                for step in range(6):
                    for spec in workload:
                        if spec.arrival_step == step:
                            state = add_request(state, spec.to_request(step))
                    plan = policies.priority(state, config)
                    if plan.preempted:
                        def seen(r, state=state):
                            q = state.requests[r]
                            return (q.status, q.priority, q.arrival_step, q.prompt_len, q.num_output_tokens,
                                    q.num_computed_tokens, len(q.block_ids), q.admitted_step is None)
                        key = (config, tuple(map(seen, state.running)), tuple(map(seen, state.waiting)),
                               len(state.free_block_ids))
                        found.setdefault(key, (config, state))
                    sampled, _ = model.execute(plan, state)
                    state = py_apply_plan(state, plan, sampled, config).state
    return tuple(found.values())


def test_exhaustive_preemption_states():
    """Every grid state whose priority plan preempts (for a running request's blocks or for a waiting
    request: both occur): the encoded step's solution is the Python plan."""
    cases = preemption_states()
    plans = [policies.priority(state, config) for config, state in cases]
    assert len(cases) >= 50
    assert any(any(item.request_id in state.waiting for item in plan.scheduled) for (_, state), plan in zip(cases, plans, strict=True))
    assert any(not any(item.request_id in state.waiting for item in plan.scheduled) for (_, state), plan in zip(cases, plans, strict=True))
    for (config, state), plan in zip(cases, plans, strict=True):
        assert concrete_step(state, config, "priority", len(state.requests), unique=False) == describe_plan(plan)


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
    urgent one. The grid's preemption states and the explicit example catch it."""
    def most_urgent_first(less, equal, u, v):
        return z3.Or(less[u][v], z3.And(equal[u][v], z3.BoolVal(u < v)))

    monkeypatch.setattr(encoded, "preempted_before", most_urgent_first)
    caught = next((state for config, state in preemption_states()
                   if concrete_step(state, config, "priority", len(state.requests), unique=False)
                   != describe_plan(policies.priority(state, config))), None)
    assert caught is not None
    with pytest.raises(AssertionError):
        check_priority_step(decode_preempts_case())


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
