"""Exhaustive, deterministic agreement of the Z3 encoding with the Python spec and the fcfs policy.

Every state reached by fcfs from every workload of a small grid (1 to 3 requests of prompt length
1 to 5 (5 > max_model_len: rejected) and max_tokens 1 to 3, arriving at step 0 or 1), under
every config of a small grid (``CONFIGS``), deduplicated by what the encoding sees,
is checked:

- the encoded fcfs step (the canonical form the one-step proofs use) has exactly one solution, and
  it is ``policies.fcfs``'s plan (block ids as counts);
- on that state, fcfs's plan and single-field perturbations of
  them (a chunk one token longer, one block fewer, a preemption dropped or added, a
  rejection dropped, an extra admission): each encoded rule is violated exactly when
  ``violated_rules`` names it, and for an allowed plan the encoded update gives ``apply_plan``'s state
  (EOS sampled when a running request is scheduled, so stops are covered).

The five encoding mutants of issue 14 are each caught (deliberate breaks, one test each): the free
pool ignoring released blocks, a strict fits-alone, the preemption order reversed, Python admitting past
``max_num_seqs``, and the policy encoding not returning a victim's blocks to the pool.

Cost: 84 s wall, 74 s CPU for the whole file on the 2-core machine at load ~6 (`pytest -q
tests/test_proofs_exhaustive.py`, before the prefix-caching and slot-order layouts grew it; CI's last
fresh-clone run took 318 s for the rules-and-update agreement alone); the mutant tests stop at the first
disagreement. The three agreements run one test per config of the grid (``BY_CONFIG``), so that
pytest-xdist spreads them over its workers; ``test_the_configs_cover_every_reached_state`` shows the
pieces add up to the whole grid.
"""

from __future__ import annotations

import itertools
from functools import cache

import pytest

z3 = pytest.importorskip("z3")

from schedspec.reference import policies  # noqa: E402
from schedspec.reference.proofs import policy as policy_encoding  # noqa: E402
from schedspec.spec.admission import rejection_reason  # noqa: E402
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens  # noqa: E402
from schedspec.spec.proofs import encoding  # noqa: E402
from schedspec.spec.proofs.concrete import (  # noqa: E402
    concrete_ctx,
    decode_state,
    describe_plan,
    describe_state,
    encode_plan,
    encode_state,
    evaluate,
    slot_assignment,
)
from schedspec.spec.rules import violated_rules  # noqa: E402
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan, samples_this_step  # noqa: E402
from schedspec.spec.transitions import add_request, apply_plan  # noqa: E402
from schedspec.spec.workload import EOS_TOKEN_ID, RequestSpec  # noqa: E402

CONFIGS = [
    SchedulerConfig(block_size=bs, num_kv_blocks=blocks, max_num_batched_tokens=3 if chunked else 4,
                    max_num_seqs=seqs, max_model_len=4, enable_chunked_prefill=chunked,
                    long_prefill_token_threshold=threshold)
    for bs, blocks, seqs, chunked, threshold in [
        (1, 4, 3, True, 0), (1, 3, 2, False, 0), (1, 2, 1, True, 0), (2, 2, 2, True, 0), (2, 2, 1, False, 0),
        (2, 4, 2, False, 0), (2, 6, 3, True, 2)]
]
"""block_size 1 and 2, 2 to 6 KV blocks, max_num_seqs 1 to 3, chunked prefill on (budget 3) and off
(budget 4), max_model_len 4, one config with a long-prefill threshold of 2: every rule binds in some of
them (preemptions need few blocks per token); the last one has room for two decodes beside a running
prefill, where the order of the running phase (decodes first) decides who gets the budget."""
SHAPES = [(1, 3), (2, 2), (3, 1), (4, 3), (5, 1)]
"""(prompt_len, max_tokens) of a request; 5 > max_model_len is rejected."""
MAX_REQUESTS = 3
MAX_STEPS = 8


def _key(config: SchedulerConfig, state: SchedulerState) -> tuple:
    def fields(request_id: str) -> tuple:
        r = state.requests[request_id]
        return (r.status.value, r.prompt_len, r.num_output_tokens, r.max_tokens, r.num_computed_tokens,
                len(r.block_ids), r.admitted_step is not None)

    return (config, tuple(map(fields, state.running)), tuple(map(fields, state.waiting)), len(state.free_block_ids))


@cache
def reached_states() -> tuple[tuple[SchedulerConfig, SchedulerState], ...]:
    """Every state fcfs reaches on the grid, one per distinct encoded view, in a fixed order (config by
    config: the view includes the config, so no state is shared between two configs)."""
    return tuple(pair for config in CONFIGS for pair in reached_states_of(config))


@cache
def reached_states_of(config: SchedulerConfig) -> tuple[tuple[SchedulerConfig, SchedulerState], ...]:
    """The states of :func:`reached_states` under ``config``."""
    found: dict[tuple, tuple[SchedulerConfig, SchedulerState]] = {}
    for k in range(1, MAX_REQUESTS + 1):
        for shapes in itertools.combinations_with_replacement(SHAPES, k):
            for arrivals in itertools.product((0, 1), repeat=k):
                if arrivals[0] != 0:
                    continue
                state = SchedulerState.initial(config)
                for step in range(MAX_STEPS):
                    for j, (prompt_len, max_tokens) in enumerate(shapes):
                        if arrivals[j] == step:
                            spec = RequestSpec(f"r{j}", prompt_len, max_tokens, arrival_step=step)
                            state = add_request(state, spec.to_request(step))
                    if not state.requests and step > 1:
                        break
                    found.setdefault(_key(config, state), (config, state))
                    plan = policies.fcfs(state, config)
                    sampled = {i.request_id: 1 for i in plan.scheduled  # never EOS: requests run long
                               if samples_this_step(state.requests[i.request_id], i)}
                    state = apply_plan(state, plan, sampled, config).state
    return tuple(found.values())


def policy_disagreement(limit: int | None = None, layout: str = "canonical",
                        config: SchedulerConfig | None = None) -> str | None:
    """The first reached state (under ``config``, default every config) where the encoded fcfs step (in
    ``layout``) is not ``policies.fcfs``'s plan, or None."""
    states = reached_states() if config is None else reached_states_of(config)
    for config, state in states[:limit]:
        expected = describe_plan(policies.fcfs(state, config))
        try:
            got = policy_encoding.concrete_step(state, config, "fcfs", max(1, len(state.requests)),
                                                layout=layout)
        except AssertionError as error:
            return f"{config} {state}: {error}"
        if got != expected:
            return f"{config} {state}: encoding {got} != fcfs {expected}"
    return None


def _plan(state: SchedulerState, config: SchedulerConfig, items: list[tuple[str, int, int, int]],
          preempted: list[str], rejected: list[str]) -> StepPlan:
    """A plan handing out blocks in pool order: the free queue, then blocks this step's preemptions
    release (the encoding counts blocks, so its plans take them where the rules allow)."""
    pool = list(state.free_block_ids)
    for request_id in preempted:
        pool.extend(reversed(state.requests[request_id].block_ids))
    scheduled, taken = [], 0
    for request_id, start, ntok, nb in items:
        ids = tuple(pool[k] if k < len(pool) else config.num_kv_blocks + k for k in range(taken, taken + nb))
        scheduled.append(ScheduledRequest(request_id, start, ntok, ids))
        taken += nb
    reasons = []
    for request_id in rejected:
        r = state.requests[request_id]
        reasons.append((request_id, rejection_reason(r.prompt_len, r.max_tokens, config) or "drawn: fits"))
    return StepPlan(scheduled=tuple(scheduled), preempted=tuple(preempted), rejected=tuple(reasons))


def plans_for(state: SchedulerState, config: SchedulerConfig) -> list[StepPlan]:
    """The three policies' plans and their single-field perturbations."""
    out: list[StepPlan] = []
    for policy in (policies.fcfs,):
        base = policy(state, config)
        out.append(base)
        items = [(i.request_id, i.num_computed_tokens, i.num_tokens, len(i.new_block_ids)) for i in base.scheduled]
        pre, rej = list(base.preempted), [r for r, _ in base.rejected]
        if policy is not policies.fcfs:
            continue
        for k, (rid, start, ntok, nb) in enumerate(items):
            for change in ((0, 1, 0), (0, 0, -1)):
                changed = (rid, start + change[0], ntok + change[1], max(0, nb + change[2]))
                out.append(_plan(state, config, items[:k] + [changed] + items[k + 1:], pre, rej))
        for k in range(len(pre)):
            out.append(_plan(state, config, items, pre[:k] + pre[k + 1:], rej))
        named = {i[0] for i in items} | set(pre) | set(rej)
        for rid in state.running:
            if rid not in named:
                out.append(_plan(state, config, items, pre + [rid], rej))
        for rid in rej:
            out.append(_plan(state, config, items, pre, [r for r in rej if r != rid]))
        for rid in state.waiting:
            if rid not in named:
                r = state.requests[rid]
                whole = blocks_for_tokens(r.num_tokens, config.block_size)
                out.append(_plan(state, config, items + [(rid, 0, r.num_tokens, whole)], pre, rej))
    return out


def rule_disagreement(limit: int | None = None, config: SchedulerConfig | None = None) -> str | None:
    """The first (state, plan) where an encoded rule or the encoded update disagrees with Python (states
    under ``config``, default every config)."""
    states = reached_states() if config is None else reached_states_of(config)
    for config, state in states[:limit]:
        ctx = concrete_ctx(config)
        for plan in plans_for(state, config):
            slot_ids = slot_assignment(state, plan, len(state.requests))
            s, p = encode_state(state, slot_ids), encode_plan(plan, slot_ids)
            encoded = {name for name, rule in encoding.allowed_rules(ctx, s, p).items() if not evaluate(rule)}
            python = {v.name for v in violated_rules(state, plan, config)}
            if encoded != python:
                return f"{config} {state} {plan}: encoding breaks {sorted(encoded)}, Python {sorted(python)}"
            if python:
                continue
            for eos in (True,) if any(i.request_id in state.running for i in plan.scheduled) else (False,):
                sampled = {i.request_id: EOS_TOKEN_ID if eos else 1 for i in plan.scheduled
                           if samples_this_step(state.requests[i.request_id], i)}
                after = apply_plan(state, plan, sampled, config).state
                out = encoding.apply_plan(ctx, s, p, [z3.BoolVal(eos)] * len(slot_ids))
                if decode_state(out.state, slot_ids) != describe_state(after):
                    return f"{config} {state} {plan} eos={eos}: the encoded update differs"
    return None


def test_the_grid_reaches_the_interesting_cases():
    """The enumeration is not trivially small: it holds preemptions, recomputation, admission at
    max_num_seqs and rejections (each counted on fcfs's plans)."""
    states = reached_states()
    assert len(states) > 500
    plans = [(c, s, policies.fcfs(s, c)) for c, s in states]
    assert sum(1 for _, _, p in plans if p.preempted) >= 10
    assert sum(1 for _, _, p in plans if len(p.preempted) >= 2) >= 1
    assert sum(1 for _, _, p in plans if p.rejected) >= 10
    assert sum(1 for _, s, _ in plans if any(r.status.value == "preempted" for r in s.requests.values())) >= 10
    assert sum(1 for c, s, p in plans if len(s.running) - len(p.preempted)
               + sum(1 for i in p.scheduled if i.request_id in s.waiting) == c.max_num_seqs
               and any(i.request_id in s.waiting for i in p.scheduled)) >= 10


# One test per config of the grid (together: every reached state), so that pytest-xdist can spread the
# grid over its workers (the rules-and-update agreement was one test of five minutes).
BY_CONFIG = pytest.mark.parametrize("config", CONFIGS, ids=[f"config{i}" for i in range(len(CONFIGS))])


@BY_CONFIG
def test_encoded_fcfs_step_is_the_fcfs_plan_on_every_reached_state(config):
    assert policy_disagreement(config=config) is None


@BY_CONFIG
def test_slot_order_step_is_the_fcfs_plan_on_every_reached_state(config):
    """The layout bounded model checking unrolls (requests in the slots in the order of addition, each
    queue in slot order, no permutation) gives fcfs's plan too."""
    assert policy_disagreement(layout="slot-order", config=config) is None


@BY_CONFIG
def test_encoded_rules_and_update_agree_on_every_reached_state_and_plan(config):
    assert rule_disagreement(config=config) is None


def test_the_configs_cover_every_reached_state():
    """The per-config tests above together cover :func:`reached_states`, every state once."""
    per_config = [pair for config in CONFIGS for pair in reached_states_of(config)]
    assert per_config == list(reached_states()) and len(reached_states()) > 500


# --- the mutants: each deliberate break is caught ----------------------------------------------------


def _pool_ignores_released(monkeypatch):
    original = encoding.allowed_rules

    def mutant(ctx, s, plan):
        rules = original(ctx, s, plan)
        handed = encoding._sum([a.handed for a in (encoding.rule_atoms(s, plan, i) for i in range(s.n))])
        rules["blocks-from-free-pool"] = handed <= s.free
        return rules

    monkeypatch.setattr(encoding, "allowed_rules", mutant)
    return rule_disagreement


def _strict_fits_alone(monkeypatch):
    def mutant(ctx, p, mt):
        c = ctx.cfg
        return z3.And(p > 0, mt >= 1, p <= c.max_model_len, encoding.max_blocks_needed(ctx, p, mt) < c.num_kv_blocks)

    monkeypatch.setattr(encoding, "fits_alone", mutant)
    monkeypatch.setattr(policy_encoding, "fits_alone", mutant)
    return rule_disagreement


def _reversed_preemption_order(monkeypatch):
    original = policy_encoding.plan_step

    def mutant(*args, **kwargs):
        step = original(*args, **kwargs)
        n = step.plan.n
        step.plan.ppos = [n - 1 - x for x in step.plan.ppos]
        return step

    monkeypatch.setattr(policy_encoding, "plan_step", mutant)
    return policy_disagreement


def _python_admits_past_max_num_seqs(monkeypatch):
    """``policies.plan_step`` sees one more sequence slot than the config has (nothing else changes; the
    policies read the slot count as ``active_seq_cap``, ``max_num_seqs`` unless ``max_num_active_seqs`` is set)."""
    original = policies.plan_step

    class OneMoreSeq:
        def __init__(self, config):
            self._config = config
            self.max_num_seqs = config.max_num_seqs + 1
            self.active_seq_cap = config.active_seq_cap + 1

        def __getattr__(self, name):
            return getattr(self._config, name)

    def mutant(state, config, *args, **kwargs):
        return original(state, OneMoreSeq(config), *args, **kwargs)

    monkeypatch.setattr(policies, "plan_step", mutant)
    return policy_disagreement


def released_not_returned(source):
    """``source`` (the policy encoding's ``plan_step``) with the pool after rank k ``avail[k] - nbk``
    instead of ``avail[k] + released - nbk``: a victim's blocks are not returned."""

    def patched(ctx, s, policy, name="", layout="permuted"):
        real_define = ctx.define

        def define(label, expr, sort="int"):
            if "avail" in label:
                plus, nbk = expr.children()
                expr = plus.children()[0] - nbk
            return real_define(label, expr, sort)

        ctx.define = define
        try:
            return source(ctx, s, policy, name, layout)
        finally:
            ctx.define = real_define

    return patched


def _released_not_returned_in_the_policy_encoding(monkeypatch):
    """The policy encoding's pool after rank k is ``avail[k] + released - nbk``: drop ``released``."""
    monkeypatch.setattr(policy_encoding, "plan_step", released_not_returned(policy_encoding.plan_step))
    return policy_disagreement


def _prefills_before_decodes_in_slot_order(monkeypatch):
    """The slot-order layout visits the running prefills before the decodes (the two passes swapped)."""
    original = policy_encoding._plan_step_slot_order

    def mutant(ctx, s, params, p, rejected, pending, decode, processed):
        prefill = [z3.And(processed[i], z3.Not(decode[i])) for i in range(s.n)]
        return original(ctx, s, params, p, rejected, pending, prefill, processed)

    monkeypatch.setattr(policy_encoding, "_plan_step_slot_order", mutant)
    return lambda config=None: policy_disagreement(layout="slot-order", config=config)


MUTANTS = {
    "free pool ignores released blocks": _pool_ignores_released,
    "strict fits-alone": _strict_fits_alone,
    "reversed preemption order": _reversed_preemption_order,
    "Python admits past max_num_seqs": _python_admits_past_max_num_seqs,
    "released blocks not returned in the policy encoding": _released_not_returned_in_the_policy_encoding,
    "slot order: prefills visited before decodes": _prefills_before_decodes_in_slot_order,
}
SLOT_ORDER_TOO = ("reversed preemption order", "Python admits past max_num_seqs",
                  "released blocks not returned in the policy encoding")
"""Policy mutants that apply to the slot-order layout as well (checked there too)."""
BITES_FIRST = {"Python admits past max_num_seqs": 4, "slot order: prefills visited before decodes": 6}
"""The index in ``CONFIGS`` of the config where a mutant is seen first (``max_num_seqs`` 1 with room for two
requests; two decodes beside a running prefill): :func:`search_configs` searches it before the others. The
verdict is the full search's (every config is searched until a disagreement is found), only the time
changes: in grid order these mutants were found after minutes of agreeing states (about 45 s each in CI)."""


def search_configs(check, mutant: str) -> str | None:
    """``check(config=...)`` on every config of the grid, the one of :data:`BITES_FIRST` first; the first
    disagreement found, or None when every config agrees."""
    first = BITES_FIRST.get(mutant, 0)
    for config in [CONFIGS[first]] + CONFIGS[:first] + CONFIGS[first + 1:]:
        found = check(config=config)
        if found is not None:
            return found
    return None


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_mutant_is_caught(mutant, monkeypatch):
    reached_states()  # enumerated with the real policy before any break
    check = MUTANTS[mutant](monkeypatch)
    assert search_configs(check, mutant) is not None, f"mutant {mutant!r} escaped the exhaustive agreement"


@pytest.mark.parametrize("mutant", SLOT_ORDER_TOO)
def test_each_policy_mutant_is_caught_in_slot_order(mutant, monkeypatch):
    reached_states()
    MUTANTS[mutant](monkeypatch)
    found = search_configs(lambda config: policy_disagreement(layout="slot-order", config=config), mutant)
    assert found is not None, f"mutant {mutant!r} escaped in slot order"


def test_the_search_order_covers_every_config():
    """:func:`search_configs` visits each config of the grid once, whatever the mutant."""
    for mutant in MUTANTS:
        visited: list[SchedulerConfig] = []
        assert search_configs(lambda config, seen=visited: seen.append(config), mutant) is None
        assert sorted(map(repr, visited)) == sorted(map(repr, CONFIGS)) and len(visited) == len(CONFIGS)
