"""The reference policies' step (:func:`schedspec.reference.policies.plan_step`) as Z3 constraints.

The Python step is a loop over a symbolic order (running decodes, then running prefill chunks, each
in admission order; then waiting requests in the policy's order). The encoding gives every slot the
values the loop has *when it reaches that slot*, as sums over the slots processed before it:

- ``budget[i] = max_num_batched_tokens - sum(tokens of the slots processed before i)``;
- ``avail[i] = free + blocks released by earlier preemptions - blocks taken by earlier slots``;
- ``preby[m][v]``: processing ``m`` preempted ``v``. The victims of ``m`` are the running requests,
  not yet scheduled or preempted, from the most recently admitted down to ``m`` itself, for as long as
  the blocks available stay below what ``m`` needs: ``v`` is preempted iff ``pos[v] >= pos[m]`` and
  ``avail[m] + blocks of the candidates after v < needed[m]``.

Admission takes a prefix of the policy's order: slot ``i`` is admitted iff it and every candidate
before it pass the checks (sequence slot, budget, chunk > 0, blocks for the whole sequence), each
computed assuming all before it were admitted.

These are constraints on fresh variables; the order makes them have exactly one solution for every
state whose queue positions are distinct (``tests/test_proofs_policy.py`` checks the solution is the
plan :func:`schedspec.reference.policies.fcfs` returns, and that it is unique).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import z3

from schedspec.spec.proofs.encoding import Ctx, Plan, State, _sum, count, fits_alone, zmax, zmin

POLICIES = {
    "fcfs": {"order": "queue", "idle_only": False},
    "static": {"order": "queue", "idle_only": True},
    "shortest-prompt-first": {"order": "shortest_prompt", "idle_only": False},
}
"""The reference policies that have a proof encoding: each is ``plan_step`` with an admission order
and whether it admits only when nothing runs."""


@dataclass
class PolicyStep:
    """The plan, and the loop's values the property proofs refer to."""

    plan: Plan
    rejected: list[Any]
    processed: list[Any]
    budget: list[Any]
    avail: list[Any]
    preby: list[list[Any]]
    any_preempted: Any
    admitting: Any
    budget_left: Any
    free_left: Any


def chunk(ctx: Ctx, pending: Any, budget: Any) -> Any:
    """``policies._chunk``: the pending tokens capped by the long-prefill threshold (chunked prefill) and
    the budget; 0 without chunked prefill if they do not fit."""
    c = ctx.cfg
    t = c.long_prefill_token_threshold
    capped = z3.If(z3.And(t > 0, pending > t), t, pending)
    return z3.If(c.enable_chunked_prefill, zmin(capped, budget), z3.If(pending <= budget, pending, 0))


def plan_step(ctx: Ctx, s: State, policy: str, name: str = "") -> PolicyStep:
    """The step of ``policy`` from ``s`` (definitions go to ``ctx.facts``)."""
    params = POLICIES[policy]
    c = ctx.cfg
    n = s.n
    S = s.slots
    p = name + "_" if name else ""

    def var(label: str, i: int | None = None, sort: str = "int", j: int | None = None) -> Any:
        suffix = "" if i is None else str(i) + ("" if j is None else f"_{j}")
        return ctx.fresh(f"{p}{label}{suffix}", sort)

    rejected = [z3.And(sl.waiting, z3.Not(sl.adm), z3.Not(fits_alone(ctx, sl.p, sl.mt))) for sl in S]
    pending = [sl.pending for sl in S]
    decode = [z3.And(sl.running, pending[i] == 1) for i, sl in enumerate(S)]
    processed = [z3.And(sl.running, pending[i] >= 1) for i, sl in enumerate(S)]

    def before(j: int, i: int) -> Any:
        if i == j:
            return z3.BoolVal(False)
        return z3.And(processed[j], processed[i],
                      z3.If(decode[j] == decode[i], S[j].pos < S[i].pos, decode[j]))

    B = [[before(j, i) for i in range(n)] for j in range(n)]
    budget = [var("budget", i) for i in range(n)]
    avail = [var("avail", i) for i in range(n)]
    nt = [var("nt", i) for i in range(n)]
    act = [var("act", i, "bool") for i in range(n)]
    sched = [var("sched", i, "bool") for i in range(n)]
    tok = [var("tok", i) for i in range(n)]
    nbk = [var("nbk", i) for i in range(n)]
    needed = [var("needed", i) for i in range(n)]
    preby = [[var("preby", m, "bool", v) for v in range(n)] for m in range(n)]
    released = [_sum([z3.If(preby[m][v], S[v].b, 0) for v in range(n)]) for m in range(n)]

    def gone_before(i: int, v: int) -> Any:
        return z3.Or([z3.And(B[m][i], preby[m][v]) for m in range(n)] + [z3.And(B[v][i], sched[v])])

    facts = ctx.facts
    for i in range(n):
        sl = S[i]
        facts.append(budget[i] == c.max_num_batched_tokens - _sum([z3.If(B[j][i], tok[j], 0) for j in range(n)]))
        facts.append(avail[i] == s.free + _sum([z3.If(B[m][i], released[m], 0) for m in range(n)])
                     - _sum([z3.If(B[j][i], nbk[j], 0) for j in range(n)]))
        facts.append(nt[i] == chunk(ctx, pending[i], budget[i]))
        facts.append(act[i] == z3.And(processed[i], z3.Not(gone_before(i, i)), budget[i] > 0, nt[i] > 0))
        facts.append(needed[i] == ctx.cdiv(sl.nc + nt[i]) - sl.b)
        cand = [z3.And(S[v].running, z3.Not(gone_before(i, v))) for v in range(n)]
        for v in range(n):
            after_v = _sum([z3.If(z3.And(cand[u], S[u].pos > S[v].pos), S[u].b, 0) for u in range(n) if u != v])
            facts.append(preby[i][v] == z3.And(act[i], cand[v], S[v].pos >= sl.pos, avail[i] + after_v < needed[i]))
        facts.append(sched[i] == z3.And(act[i], z3.Not(preby[i][i])))
        facts.append(tok[i] == z3.If(sched[i], nt[i], 0))
        facts.append(nbk[i] == z3.If(sched[i], zmax(needed[i], 0), 0))

    pre = [z3.Or([preby[m][v] for m in range(n)]) for v in range(n)]
    any_pre = z3.Or(pre)
    admitting = z3.And(z3.Not(any_pre), z3.Not(z3.And(params["idle_only"], z3.Or([sl.running for sl in S]))))
    budget_r = var("budget_run")
    facts.append(budget_r == c.max_num_batched_tokens - _sum(tok))
    free_r = var("free_run")
    facts.append(free_r == s.free + _sum([z3.If(pre[v], S[v].b, 0) for v in range(n)]) - _sum(nbk))
    n_run = count([sl.running for sl in S])

    candidate = [z3.And(sl.waiting, z3.Not(rejected[i])) for i, sl in enumerate(S)]

    def aord(j: int, i: int) -> Any:
        if i == j:
            return z3.BoolVal(False)
        if params["order"] == "queue":
            key = S[j].pos < S[i].pos
        else:
            key = z3.Or(S[j].p < S[i].p, z3.And(S[j].p == S[i].p, S[j].pos < S[i].pos))
        return z3.And(candidate[j], candidate[i], key)

    A = [[aord(j, i) for i in range(n)] for j in range(n)]
    budget_a = [var("budget_adm", i) for i in range(n)]
    nt_a = [var("nt_adm", i) for i in range(n)]
    ok = [var("ok_adm", i, "bool") for i in range(n)]
    admit = [var("admit", i, "bool") for i in range(n)]
    whole = [ctx.cdiv(sl.p + sl.o) for sl in S]
    for i in range(n):
        sl = S[i]
        facts.append(budget_a[i] == budget_r - _sum([z3.If(A[j][i], nt_a[j], 0) for j in range(n)]))
        facts.append(nt_a[i] == chunk(ctx, pending[i], budget_a[i]))
        blocks_before = _sum([z3.If(A[j][i], whole[j], 0) for j in range(n)])
        facts.append(ok[i] == z3.And(n_run + count([A[j][i] for j in range(n)]) < c.max_num_seqs,
                                     budget_a[i] > 0, nt_a[i] > 0, whole[i] <= free_r - blocks_before))
        facts.append(admit[i] == z3.And(admitting, candidate[i], ok[i],
                                        *[z3.Implies(A[j][i], ok[j]) for j in range(n) if j != i]))

    scheduled = [z3.Or(sched[i], admit[i]) for i in range(n)]
    ntok = [z3.If(sched[i], nt[i], z3.If(admit[i], nt_a[i], 0)) for i in range(n)]
    nb = [z3.If(sched[i], zmax(needed[i], 0), z3.If(admit[i], whole[i], 0)) for i in range(n)]
    n_sched_run = count(sched)
    bpos = [z3.If(sched[i], count([z3.And(B[j][i], sched[j]) for j in range(n)]),
                  n_sched_run + count([z3.And(A[j][i], admit[j]) for j in range(n)])) for i in range(n)]
    ppos = [count([z3.And(pre[u], S[u].pos > S[v].pos) for u in range(n) if u != v]) for v in range(n)]
    plan = Plan(sched=scheduled, start=[sl.nc for sl in S], ntok=ntok, nb=nb, bpos=bpos, pre=pre, ppos=ppos,
                rej=rejected)
    budget_left = c.max_num_batched_tokens - plan.tokens()
    free_left = s.free + _sum([z3.If(pre[v], S[v].b, 0) for v in range(n)]) - _sum(nb)
    return PolicyStep(plan, rejected, processed, budget, avail, preby, any_pre, admitting, budget_left, free_left)


def concrete_step(state: Any, config: Any, policy: str, slots: int | None = None, unique: bool = True
                  ) -> dict[str, Any]:
    """The encoded step of ``policy`` on a concrete state, solved by Z3, as
    :func:`schedspec.spec.proofs.concrete.describe_plan` would show it.

    With ``unique``, also checks that no other plan satisfies the encoding from this state.

    Raises:
        AssertionError: the encoding has no solution, or (``unique``) more than one.
    """
    from schedspec.spec.proofs.concrete import concrete_ctx, decode_plan, encode_state, slot_assignment
    from schedspec.spec.proofs.encoding import PLAN_FIELDS

    n = slots if slots is not None else max(1, len(state.requests))
    slot_ids = slot_assignment(state, None, n)
    ctx = concrete_ctx(config)
    s = encode_state(state, slot_ids)
    step = plan_step(ctx, s, policy)
    solver = z3.Solver()
    solver.add(ctx.facts)
    result = solver.check()
    assert result == z3.sat, f"the encoding of {policy} has no solution from this state ({result})"
    model = solver.model()
    values = {name: [model.eval(t, model_completion=True) for t in getattr(step.plan, name)] for name in PLAN_FIELDS}
    if unique:
        differs = [t != v for name in PLAN_FIELDS for t, v in zip(getattr(step.plan, name), values[name], strict=True)]
        solver.add(z3.Or(differs))
        again = solver.check()
        assert again == z3.unsat, f"the encoding of {policy} allows a second plan from this state ({again})"
    py_values = {name: [z3.is_true(v) if z3.is_bool(v) else v.as_long() for v in vals] for name, vals in values.items()}
    return decode_plan(py_values, slot_ids)
