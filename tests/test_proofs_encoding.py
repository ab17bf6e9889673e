"""The Z3 encoding of the spec agrees with the Python spec on concrete states.

Hypothesis draws configs, states (statuses, lengths, blocks, queue positions, the slot each request
sits in) and plans (the reference policies' plans, mutated, and random ones, allowed or not). The
encoding of each local rule is evaluated on them and must be violated exactly when
:func:`schedspec.spec.rules.violated_rules` names that rule; for an allowed plan, the encoded update
must give the state :func:`schedspec.spec.transitions.apply_plan` gives (queue orders, per-request
fields, free block count). Block ids are abstracted as counts by the encoding, so the drawn plans hand
out blocks in pool order (the free queue, then blocks released by this step's preemptions) and, when
they take more than the pool holds, blocks that are not free.
"""

from __future__ import annotations

import pytest

z3 = pytest.importorskip("z3")

import attrs  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from schedspec.reference import policies  # noqa: E402
from schedspec.reference.fake_model import FakeModel  # noqa: E402
from schedspec.spec.admission import rejection_reason  # noqa: E402
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens  # noqa: E402
from schedspec.spec.proofs import encoding  # noqa: E402
from schedspec.spec.proofs.concrete import (  # noqa: E402
    concrete_ctx,
    decode_state,
    describe_state,
    encode_plan,
    encode_state,
    evaluate,
    slot_assignment,
)
from schedspec.spec.proofs.encoding import RULE_ORDER, apply_plan  # noqa: E402
from schedspec.spec.request import Request, RequestStatus  # noqa: E402
from schedspec.spec.rules import (  # noqa: E402
    GROUP_RULES,
    IN_FLIGHT_RULES,
    LIMIT_RULES,
    PUBLICATION_RULES,
    REMOTE_KV_RULES,
    RULE_NAMES,
    violated_rules,
)
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan, samples_this_step  # noqa: E402
from schedspec.spec.transitions import add_request  # noqa: E402
from schedspec.spec.transitions import apply_plan as py_apply_plan  # noqa: E402
from schedspec.spec.workload import EOS_TOKEN_ID, RequestSpec  # noqa: E402


@st.composite
def configs(draw) -> SchedulerConfig:
    max_num_seqs = draw(st.integers(1, 4))
    max_model_len = draw(st.integers(1, 24))
    chunked = draw(st.booleans())
    budget = draw(st.integers(max_num_seqs, 24))
    if not chunked:
        budget = max(budget, max_model_len)
    return SchedulerConfig(
        block_size=draw(st.sampled_from([1, 2, 3, 4, 16])),
        num_kv_blocks=draw(st.integers(1, 12)),
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 2, 5])) if chunked else 0,
    )


@st.composite
def states(draw, config: SchedulerConfig, max_requests: int = 5, invariant: bool = False) -> SchedulerState:
    """A state; with ``invariant`` one that satisfies the spec's invariants (waiting requests hold
    nothing, running ones hold blocks covering their computed tokens and at most their sequence)."""
    # mostly several requests (an empty state checks little); 0 stays possible
    count = draw(st.integers(1, max_requests)) if max_requests and draw(st.integers(0, 7)) else 0
    ids = list(range(config.num_kv_blocks))
    ids = draw(st.permutations(ids))
    free = list(ids)
    requests, running, waiting = {}, [], []
    for k in range(count):
        kind = draw(st.sampled_from(["fresh", "preempted", "running", "running"]))
        prompt_len = draw(st.integers(0 if not invariant else 1, config.max_model_len + 2))
        max_tokens = draw(st.integers(0 if not invariant else 1, 8))
        outputs = 0 if kind == "fresh" else draw(st.integers(0, 4))
        computed = 0
        blocks: tuple[int, ...] = ()
        if kind == "running":
            total = prompt_len + outputs
            computed = draw(st.integers(0, max(total - 1, 0) if invariant else total))
            low = blocks_for_tokens(computed, config.block_size) if invariant else 0
            high = blocks_for_tokens(total, config.block_size) + (0 if invariant else 1)
            want = draw(st.integers(min(low, high), high))
            if invariant and want > len(free):
                if low > len(free):  # no room to run: it waits, preempted
                    kind, computed, want = "preempted", 0, 0
                else:
                    want = len(free)
            blocks = tuple(free[:want])
            free = free[want:]
        status = {"fresh": RequestStatus.WAITING, "preempted": RequestStatus.PREEMPTED,
                  "running": RequestStatus.RUNNING}[kind]
        request_id = f"r{k}"
        requests[request_id] = Request(
            request_id=request_id, arrival_step=draw(st.integers(0, 3)), prompt_token_ids=tuple(range(1, prompt_len + 1)),
            max_tokens=max_tokens, eos_token_id=EOS_TOKEN_ID, status=status, num_computed_tokens=computed,
            output_token_ids=(7,) * outputs, block_ids=blocks, admitted_step=None if kind == "fresh" else 0,
        )
        (running if kind == "running" else waiting).append(request_id)
    running = draw(st.permutations(running))
    waiting = draw(st.permutations(waiting))
    return SchedulerState(step=draw(st.integers(0, 5)), waiting=tuple(waiting), running=tuple(running),
                          requests=requests, free_block_ids=tuple(free), num_requests_added=len(requests))


def _blocks(pool: list[int], taken: int, count: int, config: SchedulerConfig) -> tuple[int, ...]:
    """``count`` block ids handed out after ``taken`` others: pool order first, then ids not in the pool."""
    out = []
    for k in range(taken, taken + count):
        out.append(pool[k] if k < len(pool) else config.num_kv_blocks + k)
    return tuple(out)


@st.composite
def plans(draw, state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    policy = draw(st.sampled_from(["fcfs", "static", "shortest_prompt_first", "random", "random"]))
    if policy != "random":
        plan = getattr(policies, policy)(state, config)
        if draw(st.booleans()):
            return plan
        items = [(i.request_id, i.num_computed_tokens, i.num_tokens, len(i.new_block_ids)) for i in plan.scheduled]
        preempted = list(plan.preempted)
        rejected = [r for r, _ in plan.rejected]
        if items and draw(st.booleans()):
            k = draw(st.integers(0, len(items) - 1))
            rid, start, ntok, nb = items[k]
            items[k] = (rid, start + draw(st.sampled_from([0, 0, 1, -1])), ntok + draw(st.sampled_from([0, 1, -1])),
                        max(0, nb + draw(st.sampled_from([0, 1, -1]))))
        if rejected and draw(st.booleans()):
            rejected.pop()
    else:
        live = list(state.requests)
        chosen = draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        unknown = ["ghost"] if draw(st.integers(0, 9)) == 0 else []
        items, preempted, rejected = [], [], []
        for rid in chosen + unknown:
            request = state.requests.get(rid)
            role = draw(st.sampled_from(["schedule", "schedule", "schedule", "preempt", "reject"]))
            if role == "preempt" and request is not None:
                preempted.append(rid)
                continue
            if role == "reject" and request is not None:
                rejected.append(rid)
                continue
            computed = request.num_computed_tokens if request is not None else 0
            pending = request.num_pending_tokens if request is not None else 1
            start = computed + draw(st.sampled_from([0, 0, 0, 0, 1]))
            ntok = draw(st.integers(0, max(pending, 0) + 1))
            held = len(request.block_ids) if request is not None else 0
            need = max(blocks_for_tokens(start + ntok, config.block_size) - held, 0)
            items.append((rid, start, ntok, max(0, need + draw(st.sampled_from([0, 0, 0, 1, -1])))))
        if rejected and draw(st.booleans()):
            preempted.append(rejected.pop())  # preempting a waiting request is a violation too
    pool = list(state.free_block_ids)
    for rid in preempted:
        if rid in state.requests:
            pool.extend(reversed(state.requests[rid].block_ids))
    scheduled, taken = [], 0
    for rid, start, ntok, nb in items:
        scheduled.append(ScheduledRequest(rid, start, ntok, _blocks(pool, taken, nb, config)))
        taken += nb
    return StepPlan(scheduled=tuple(scheduled), preempted=tuple(preempted),
                    rejected=tuple((r, _reason(state, r, config)) for r in rejected))


def _reason(state: SchedulerState, request_id: str, config: SchedulerConfig) -> str:
    """The spec's rejection reason (the encoding does not model reasons, only that one exists)."""
    request = state.requests.get(request_id)
    reason = rejection_reason(request.prompt_len, request.max_tokens, config) if request is not None else None
    return reason or "drawn: can complete alone"


PLAN = {"fcfs": policies.fcfs, "static": policies.static, "shortest-prompt-first": policies.shortest_prompt_first}


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
        state = py_apply_plan(state, plan, sampled, config).state
    for spec in workload:  # late arrivals join before the step we compare
        if spec.arrival_step >= steps and draw(st.booleans()):
            state = add_request(state, spec.to_request(state.step))
    return state


@st.composite
def pressured(draw, policy: str = "fcfs") -> tuple[SchedulerConfig, SchedulerState]:
    """A config with few blocks (block_size 1 or 2, 2 to 4 blocks) and a state ``policy`` reaches in it:
    running requests need blocks the pool lacks, so the policies preempt and hand out released blocks
    (the case the free-pool mutants get wrong)."""
    config = attrs.evolve(draw(configs()), block_size=draw(st.sampled_from([1, 2])),
                          num_kv_blocks=draw(st.integers(2, 4)))
    return config, draw(reached_states(config, policy))


@st.composite
def cases(draw):
    if draw(st.integers(0, 2)) == 0:
        config, state = draw(pressured())
    else:
        config = draw(configs())
        state = draw(states(config, invariant=draw(st.booleans())))
    plan = draw(plans(state, config))
    n = len(state.requests) + sum(1 for i in plan.scheduled if i.request_id not in state.requests)
    n += draw(st.integers(0, 1))
    order = draw(st.permutations(list(range(n))))
    slot_ids = slot_assignment(state, plan, n, order)
    eos = {rid: draw(st.booleans()) for rid in state.requests}
    return config, state, plan, slot_ids, eos


EXAMPLES = settings(max_examples=min(settings.default.max_examples, 200))
"""The loaded profile's settings (``ci``: derandomized), at most 200 examples: each evaluates the encoding."""


def test_rule_registry_matches_the_encoding():
    # the count encoding has every rule except the prefix-cache rules, which only constrain plans with
    # caching on: spec/proofs/prefix.py encodes all 17 (tests/test_proofs_prefix.py)
    not_encoded = tuple(name for name in RULE_NAMES if name.startswith("prefix-hit-"))
    assert not_encoded == ("prefix-hit-at-admission", "prefix-hit-is-cached-chain", "prefix-hit-longest")
    # nor the rules of a step in flight: the proofs model synchronous engines, where those find nothing
    not_encoded += IN_FLIGHT_RULES
    # nor the rules of hybrid KV cache groups (tests/test_kv_cache_groups.py): without groups they find nothing
    not_encoded += GROUP_RULES
    # nor the remote KV loads' rules (tests/test_remote_kv.py): with no request offering a load they find nothing
    not_encoded += REMOTE_KV_RULES
    # nor SGLang's de-duplication at publication (tests/test_prefix_dedup.py): a plan without one meets it
    not_encoded += PUBLICATION_RULES
    # nor the per-step limits' rules (tests/test_limits.py): with their options off (the default) they constrain
    # nothing, and each only removes plans, so a proof over the encoded rules holds with them too
    assert set(LIMIT_RULES) <= set(RULE_NAMES)
    assert tuple(RULE_ORDER) == tuple(name for name in RULE_NAMES if name not in not_encoded + LIMIT_RULES)


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


def double_preemption_case():
    """No free block; running decodes A and B each need one, so fcfs preempts D (the youngest) for A
    and then C for B: ``preempted == ("D", "C")``, the order a reversed preemption order gets wrong."""
    config = SchedulerConfig(block_size=1, num_kv_blocks=4, max_num_batched_tokens=8, max_num_seqs=4,
                             max_model_len=16)
    running = {}
    for k, name in enumerate("ABCD"):
        decode = name in "AB"
        running[name] = Request(name, 0, (1,), 4, status=RequestStatus.RUNNING, num_computed_tokens=1 if decode else 0,
                                output_token_ids=(5,) if decode else (), block_ids=(k,), admitted_step=k)
    state = SchedulerState(step=4, running=tuple("ABCD"), requests=running, free_block_ids=(), num_requests_added=4)
    return config, state, 4


def as_rule_case(case):
    """A (config, state, slots) case with fcfs's plan, as a case of the rule agreement."""
    config, state, _ = case
    plan = policies.fcfs(state, config)
    slot_ids = slot_assignment(state, plan, len(state.requests))
    return config, state, plan, slot_ids, dict.fromkeys(state.requests, False)


@EXAMPLES
@example(as_rule_case(pressure_case()))
@example(as_rule_case(double_preemption_case()))
@given(cases())
def test_encoded_rules_and_update_agree_with_the_spec(case):
    check_rules_and_update(case)


def check_rules_and_update(case) -> None:
    """The property (also run against the mutants in ``tests/test_proofs_mutants.py``)."""
    config, state, plan, slot_ids, eos = case
    ctx = concrete_ctx(config)
    s = encode_state(state, slot_ids)
    p = encode_plan(plan, slot_ids)
    encoded = {name: evaluate(rule) for name, rule in encoding.allowed_rules(ctx, s, p).items()}  # patchable
    broken_in_z3 = {name for name, holds in encoded.items() if not holds}
    broken_in_python = {v.name for v in violated_rules(state, plan, config)}
    assert broken_in_z3 == broken_in_python
    if broken_in_python:
        return
    sampled = {}
    for item in plan.scheduled:
        request = state.requests[item.request_id]
        if samples_this_step(request, item):
            sampled[item.request_id] = EOS_TOKEN_ID if eos[item.request_id] else 1
    after = py_apply_plan(state, plan, sampled, config).state
    eos_terms = [z3.BoolVal(bool(rid is not None and eos.get(rid, False))) for rid in slot_ids]
    out = apply_plan(ctx, s, p, eos_terms)
    assert decode_state(out.state, slot_ids) == describe_state(after)
