"""Block ids in the proofs (:mod:`schedspec.spec.proofs.blocks`) agree with the Python spec.

Hypothesis draws configs, states (some with a corrupted block table: a block owned twice, free and
owned, out of range, or lost) and plans (the policies' plans, random ones, and plans that give a
scheduled request a block another live request still owns, or the same block twice):

- a state has an owner function iff ``block-conservation`` holds on it in Python;
- the id-level ``blocks-from-free-pool`` holds iff the Python rule does;
- for an allowed plan, the encoded owner after the step is the owner in ``apply_plan``'s state.

The deliberate break: the count-level rule (``handed <= free + released``) accepts a plan that gives a
waiting request a block a running request owns; the Python rule and the id rule refuse it.
"""

from __future__ import annotations

import attrs
import pytest

z3 = pytest.importorskip("z3")

from hypothesis import event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_proofs_encoding import configs, plans, states  # noqa: E402

from schedspec.spec.config import SchedulerConfig  # noqa: E402
from schedspec.spec.invariants import block_conservation  # noqa: E402
from schedspec.spec.proofs.blocks import ids_rule, ownership_after  # noqa: E402
from schedspec.spec.proofs.concrete import (  # noqa: E402
    concrete_ctx,
    encode_handout,
    encode_ownership,
    encode_plan,
    encode_state,
    evaluate,
    ownership_of,
    slot_assignment,
)
from schedspec.spec.proofs.encoding import allowed_rules, apply_plan  # noqa: E402
from schedspec.spec.request import Request, RequestStatus  # noqa: E402
from schedspec.spec.rules import violated_rules  # noqa: E402
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan, samples_this_step  # noqa: E402
from schedspec.spec.transitions import apply_plan as py_apply_plan  # noqa: E402
from schedspec.spec.workload import EOS_TOKEN_ID  # noqa: E402


@st.composite
def corrupted(draw, state: SchedulerState, config: SchedulerConfig) -> SchedulerState:
    """The state, or one with its block table broken in one of four ways."""
    how = draw(st.sampled_from(["none", "none", "twice", "free-and-owned", "out-of-range", "lost"]))
    owners = [r for r, q in state.requests.items() if q.block_ids]
    if how == "none" or (how in ("twice", "free-and-owned") and not owners):
        return state
    requests = dict(state.requests)
    free = state.free_block_ids
    if how == "twice":
        victim = draw(st.sampled_from(owners))
        other = draw(st.sampled_from(list(requests)))
        block = requests[victim].block_ids[0]
        requests[other] = attrs.evolve(requests[other], block_ids=requests[other].block_ids + (block,))
        free = tuple(b for b in free if b != block) if other == victim else free
    elif how == "free-and-owned":
        free = free + (requests[draw(st.sampled_from(owners))].block_ids[0],)
    elif how == "out-of-range":
        free = free + (config.num_kv_blocks + draw(st.integers(0, 2)),)
    elif how == "lost":
        if not free:
            return state
        free = free[1:]
    return SchedulerState(step=state.step, waiting=state.waiting, running=state.running, requests=requests,
                          free_block_ids=free, num_requests_added=state.num_requests_added)


@st.composite
def stolen(draw, state: SchedulerState, plan: StepPlan) -> StepPlan:
    """The plan, or one whose scheduled request gets, in place of one of its new blocks (so the counts
    stay those of the plan), a block a live request owns, or a block it already gets."""
    if not plan.scheduled or draw(st.integers(0, 2)) == 0:
        return plan
    kept = [b for r, q in state.requests.items() if r not in plan.preempted for b in q.block_ids]
    owned = kept or [b for q in state.requests.values() for b in q.block_ids]
    k = draw(st.integers(0, len(plan.scheduled) - 1))
    item = plan.scheduled[k]
    handed = [b for i in plan.scheduled for b in i.new_block_ids]
    choices = owned + handed
    if not choices:
        return plan
    block = draw(st.sampled_from(choices))
    ids = item.new_block_ids[1:] + (block,) if item.new_block_ids else (block,)
    scheduled = list(plan.scheduled)
    scheduled[k] = ScheduledRequest(item.request_id, item.num_computed_tokens, item.num_tokens, ids)
    return StepPlan(scheduled=tuple(scheduled), preempted=plan.preempted, rejected=plan.rejected)


@st.composite
def cases(draw):
    config = draw(configs())
    state = draw(states(config, invariant=True, max_requests=4))
    plan = draw(stolen(state, draw(plans(state, config))))
    state = draw(corrupted(state, config))
    ghosts = sum(1 for i in plan.scheduled if i.request_id not in state.requests)
    n = len(state.requests) + ghosts
    order = draw(st.permutations(list(range(n))))
    slot_ids = slot_assignment(state, plan, n, order)
    eos = {rid: draw(st.booleans()) for rid in state.requests}
    return config, state, plan, slot_ids, eos


EXAMPLES = settings(max_examples=min(settings.default.max_examples, 200))


@EXAMPLES
@given(cases())
def test_block_ids_agree_with_the_spec(case):
    check_block_ids(case)


def check_block_ids(case) -> None:
    """The property (also run against a mutant in ``tests/test_proofs_mutants.py``)."""
    config, state, plan, slot_ids, eos = case
    m = config.num_kv_blocks
    breaches = list(block_conservation(state, config))
    try:
        owner = encode_ownership(state, slot_ids, m)
    except ValueError:
        assert breaches, "the encoding found no owner function for a state the Python invariant accepts"
        event("state with a broken block table")
        return
    assert not breaches, breaches
    s = encode_state(state, slot_ids)
    p = encode_plan(plan, slot_ids)
    h = encode_handout(plan, slot_ids, m)
    python = {v.name for v in violated_rules(state, plan, config)}
    ids_ok = evaluate(ids_rule(s, p, owner, h))
    assert ids_ok == ("blocks-from-free-pool" not in python)
    event("id rule refuses" if not ids_ok else "id rule allows")
    if python:
        return
    event("allowed: owners after the step compared")
    sampled = {}
    for item in plan.scheduled:
        if samples_this_step(state.requests[item.request_id], item):
            sampled[item.request_id] = EOS_TOKEN_ID if eos[item.request_id] else 1
    after = py_apply_plan(state, plan, sampled, config).state
    ctx = concrete_ctx(config)
    eos_terms = [z3.BoolVal(bool(r is not None and eos.get(r, False))) for r in slot_ids]
    out = apply_plan(ctx, s, p, eos_terms)
    encoded = [evaluate(o) for o in ownership_after(s, p, out.state, owner, h)]
    assert encoded == ownership_of(after, slot_ids, m)


def _owned_block_case():
    """Block 0 is owned by running r0; waiting r1 is scheduled with block 0 as its new block (block 1 is
    free, so the counts allow one new block)."""
    config = SchedulerConfig(block_size=1, num_kv_blocks=3, max_num_batched_tokens=8, max_num_seqs=2,
                             max_model_len=8, enable_chunked_prefill=True)
    r0 = Request(request_id="r0", arrival_step=0, prompt_token_ids=(1, 2), max_tokens=4, eos_token_id=EOS_TOKEN_ID,
                 status=RequestStatus.RUNNING, num_computed_tokens=2, output_token_ids=(7,), block_ids=(0, 2),
                 admitted_step=0)
    r1 = Request(request_id="r1", arrival_step=0, prompt_token_ids=(1,), max_tokens=2, eos_token_id=EOS_TOKEN_ID)
    state = SchedulerState(step=1, waiting=("r1",), running=("r0",), requests={"r0": r0, "r1": r1},
                           free_block_ids=(1,), num_requests_added=2)
    plan = StepPlan(scheduled=(ScheduledRequest("r1", 0, 1, (0,)),))
    return config, state, plan


def test_a_plan_giving_away_an_owned_block_is_refused_by_ids_and_was_allowed_by_counts():
    config, state, plan = _owned_block_case()
    slot_ids = slot_assignment(state, plan, 2)
    python = {v.name for v in violated_rules(state, plan, config)}
    assert python == {"blocks-from-free-pool"}
    s, p = encode_state(state, slot_ids), encode_plan(plan, slot_ids)
    counts = {name: evaluate(rule) for name, rule in allowed_rules(concrete_ctx(config), s, p).items()}
    assert all(counts.values()), "the count encoding was expected to allow this plan (the gap block ids close)"
    owner = encode_ownership(state, slot_ids, config.num_kv_blocks)
    assert evaluate(ids_rule(s, p, owner, encode_handout(plan, slot_ids, config.num_kv_blocks))) is False
    # with the free block instead, all three allow it
    fair = StepPlan(scheduled=(ScheduledRequest("r1", 0, 1, (1,)),))
    assert not violated_rules(state, fair, config)
    assert evaluate(ids_rule(s, encode_plan(fair, slot_ids), owner, encode_handout(fair, slot_ids, 3))) is True
