"""Blocks as ids, not counts: an owner per KV block, and the step's block rule and update on ids.

:mod:`.encoding` keeps blocks as counts (``free`` and ``b`` per slot). That abstraction cannot say
"no block is owned twice, or free and owned at once, or out of range" (what the Python invariant
``block-conservation`` checks), and its rule ``blocks-from-free-pool`` (``handed <= free + released``)
allows a plan that gives a waiting request a block a running request still owns, which the Python
rule (:func:`schedspec.spec.rules._blocks_from_free_pool`) refuses.

This module refines it with block ids, for a fixed ``num_kv_blocks = M``:

``owner[k]``   for each block ``k`` in ``[0, M)``: :data:`FREE` or the slot that owns it. A function,
               so no block has two owners, and every block in range is free or owned.
``hand[i][k]`` how many times the plan lists block ``k`` among slot ``i``'s ``new_block_ids``;
``stray[i]``   how many of them are outside ``[0, M)``. The count the rules use is their total,
               ``plan.nb[i] == sum_k hand[i][k] + stray[i]`` (:func:`handout_matches_counts`).

- :func:`ownership_invariant`: ``block-conservation`` at the id level: every owner is a live slot, the
  blocks owned by slot ``i`` number ``b[i]``, and the free ones number ``free``. A Python state
  satisfies the Python invariant iff it has such an ``owner`` (:func:`schedspec.spec.proofs.concrete`
  ``encode_ownership`` builds it, or says which block breaks it).
- :func:`ids_rule`: ``blocks-from-free-pool`` on ids: a scheduled slot gets only blocks in range, each
  free or owned by a live slot this plan preempts, and no block is handed out twice.
- :func:`ownership_after`: the owner of each block after the step (``apply_plan``: a preempted,
  rejected or stopped request returns its blocks, a scheduled one keeps its own and the new ones).

The theorems (:func:`block_theorems`), for every config with ``num_kv_blocks = M`` and every state of
N slots satisfying ``Inv`` and the id-level invariant:

- ``spec/blocks/ids-refine-counts``: the id rule implies the count rule (every plan the id encoding
  allows, the count encoding allows: the count theorems apply to it);
- ``spec/blocks/ownership``: ``Allowed`` (every count rule and the id rule) and the update keep the
  id-level invariant, with the counts the count encoding computes: after every allowed step each block
  is free or owned by exactly one live request, and the counts agree with the ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import z3

from .core import PROVED, Options, Result, Theorem, Timer
from .encoding import (
    Ctx,
    Plan,
    State,
    _sum,
    allowed_rules,
    apply_plan,
    count,
    plan_well_formed,
    state_invariants,
)

FREE = -1
"""The owner of a free block."""

@dataclass
class Handout:
    """The new block ids of a plan, per slot: ``hand[i][k]`` copies of block ``k``, ``stray[i]`` ids
    outside ``[0, M)``."""

    hand: list[list[Any]]
    stray: list[Any]

    @property
    def m(self) -> int:
        return len(self.hand[0]) if self.hand else 0


def symbolic_owner(m: int, prefix: str = "own") -> list[Any]:
    return [z3.Int(f"{prefix}{k}") for k in range(m)]


def symbolic_handout(n: int, m: int, prefix: str = "hand") -> Handout:
    return Handout([[z3.Int(f"{prefix}{i}_{k}") for k in range(m)] for i in range(n)],
                   [z3.Int(f"{prefix}{i}_stray") for i in range(n)])


def handout_matches_counts(plan: Plan, h: Handout) -> Any:
    """What a plan's id lists are: counts >= 0 adding up to the plan's new block count per slot."""
    out = []
    for i in range(plan.n):
        out += [x >= 0 for x in h.hand[i]] + [h.stray[i] >= 0]
        out.append(plan.nb[i] == _sum(h.hand[i]) + h.stray[i])
    return z3.And(out)


def ownership_invariant(s: State, owner: list[Any]) -> dict[str, Any]:
    """``block-conservation`` on ids, by part: owners are :data:`FREE` or live slots; slot ``i`` owns
    ``b[i]`` blocks; ``free`` blocks are free (so ``free + sum(b) == M``: every block in range is
    accounted for exactly once)."""
    n = s.n
    parts: dict[str, list[Any]] = {"owner-is-live": [], "owned-count": [], "free-count": []}
    for o in owner:
        parts["owner-is-live"].append(z3.And(o >= FREE, o < n))
        for i, sl in enumerate(s.slots):
            parts["owner-is-live"].append(z3.Implies(o == i, sl.live))
    for i, sl in enumerate(s.slots):
        parts["owned-count"].append(z3.Implies(sl.live, sl.b == count([o == i for o in owner])))
    parts["free-count"].append(s.free == count([o == FREE for o in owner]))
    return {name: z3.And(v) for name, v in parts.items()}


def ids_rule(s: State, plan: Plan, owner: list[Any], h: Handout) -> Any:
    """``blocks-from-free-pool`` on ids (``rules._blocks_from_free_pool``): every new block of a
    scheduled slot is in range, free or owned by a live slot this plan preempts, and handed out once."""
    n, m = s.n, h.m
    out = []
    for i in range(n):
        out.append(z3.Implies(plan.sched[i], h.stray[i] == 0))
    for k in range(m):
        out.append(_sum([z3.If(plan.sched[i], h.hand[i][k], 0) for i in range(n)]) <= 1)
        released = z3.Or([z3.And(owner[k] == j, plan.pre[j], s.slots[j].live) for j in range(n)])
        for i in range(n):
            out.append(z3.Implies(z3.And(plan.sched[i], h.hand[i][k] >= 1), z3.Or(owner[k] == FREE, released)))
    return z3.And(out)


def ownership_after(s: State, plan: Plan, after: State, owner: list[Any], h: Handout) -> list[Any]:
    """The owner of each block after the step: a block handed to slot ``i`` is ``i``'s if ``i`` is
    still live and not preempted after the step, else free; any other block stays with its owner if the
    owner keeps its blocks (live and not preempted), else it is free."""
    n = s.n
    keeps = [z3.And(after.slots[j].live, z3.Not(plan.pre[j])) for j in range(n)]
    out = []
    for k, o in enumerate(owner):
        kept = z3.Or([z3.And(o == j, keeps[j]) for j in range(n)])
        value: Any = z3.If(kept, o, FREE)
        for i in reversed(range(n)):
            value = z3.If(z3.And(plan.sched[i], h.hand[i][k] >= 1), z3.If(keeps[i], i, FREE), value)
        out.append(value)
    return out


@dataclass
class BlockSetup:
    ctx: Ctx
    s: State
    plan: Plan
    owner: list[Any]
    hand: Handout
    hyps: dict[str, Any]


def block_setup(opts: Options, m: int) -> BlockSetup:
    """Premises of the id-level theorems at ``opts.policy_n`` slots, ``num_kv_blocks = m``."""
    import dataclasses

    from .encoding import symbolic_plan, symbolic_state
    from .theorems import inv_parts, setup

    local = dataclasses.replace(opts, fixed={**opts.fixed, "num_kv_blocks": m})
    ctx = setup(local)
    n = opts.policy_n
    s = symbolic_state(n, "s")
    plan = symbolic_plan(n, "pl")
    owner = symbolic_owner(m)
    h = symbolic_handout(n, m)
    hyps: dict[str, Any] = {"cfg": ctx.cfg.valid(), "wf": plan_well_formed(plan),
                            "ids-match-counts": handout_matches_counts(plan, h)}
    hyps.update(inv_parts(ctx, s))
    hyps.update({f"ids:{k}": v for k, v in ownership_invariant(s, owner).items()})
    return BlockSetup(ctx, s, plan, owner, h, hyps)


def refine_lemmas(s: State, plan: Plan, owner: list[Any], h: Handout) -> list[Any]:
    """Lemmas, per slot and per block, in the count rule's atoms (:func:`.encoding.rule_atoms`): a
    scheduled slot's new block count is the sum of its copies of each block; a live preempted slot
    releases one block per block it owns; a block is handed out at most as often as it is free or
    released. Summed, they give the count rule by linear arithmetic (asked at once, Z3 does not find
    the counting argument: unknown after 60 s at N=4, M=6)."""
    n, m = s.n, h.m
    out = []
    for i in range(n):
        out.append(z3.If(plan.sched[i], plan.nb[i], 0) == _sum([z3.If(plan.sched[i], x, 0) for x in h.hand[i]]))
        sl = s.slots[i]
        out.append(z3.If(z3.And(plan.pre[i], sl.live), sl.b, 0)
                   == _sum([z3.If(z3.And(owner[k] == i, plan.pre[i], sl.live), 1, 0) for k in range(m)]))
    for k in range(m):
        out.append(_sum([z3.If(plan.sched[i], h.hand[i][k], 0) for i in range(n)])
                   <= z3.If(owner[k] == FREE, 1, 0)
                   + _sum([z3.If(z3.And(owner[k] == j, plan.pre[j], s.slots[j].live), 1, 0) for j in range(n)]))
    return out


def ownership_lemmas(s: State, plan: Plan, after: State, owner: list[Any], owner2: list[Any], h: Handout
                     ) -> list[tuple[str, Any]]:
    """Lemmas per block and per slot, proved in order, from which the id-level invariant after the step
    adds up by linear arithmetic: a block is slot ``i``'s after the step iff it was and ``i`` keeps its
    blocks, or it was handed to ``i`` and ``i`` keeps them (at most once: the id rule); summed over the
    blocks, slot ``i`` owns ``b[i] + nb[i]`` after a step that schedules it, ``b[i]`` after one that
    does not; each block is free or owned by one slot. Asked at once the query is unknown after 60 s at
    N=4, M=8."""
    n, m = s.n, h.m
    keeps = [z3.And(after.slots[j].live, z3.Not(plan.pre[j])) for j in range(n)]
    per_block, per_slot, one_owner = [], [], []
    for i in range(n):
        for k in range(m):
            per_block.append(z3.If(owner2[k] == i, 1, 0)
                             == z3.If(z3.And(owner[k] == i, keeps[i]), 1, 0)
                             + z3.If(z3.And(plan.sched[i], keeps[i]), h.hand[i][k], 0))
        per_slot.append(_sum([z3.If(z3.And(owner[k] == i, keeps[i]), 1, 0) for k in range(m)])
                        == z3.If(keeps[i], s.slots[i].b, 0))
        per_slot.append(_sum([z3.If(z3.And(plan.sched[i], keeps[i]), h.hand[i][k], 0) for k in range(m)])
                        == z3.If(z3.And(plan.sched[i], keeps[i]), plan.nb[i], 0))
        per_slot.append(_sum([z3.If(owner2[k] == i, 1, 0) for k in range(m)])
                        == z3.If(after.slots[i].live, after.slots[i].b, 0))
    for k in range(m):
        one_owner.append(z3.If(owner2[k] == FREE, 1, 0) == 1 - _sum([z3.If(owner2[k] == i, 1, 0) for i in range(n)]))
    return [("lemma: per block", z3.And(per_block)), ("lemma: per slot", z3.And(per_slot)),
            ("lemma: one owner", z3.And(one_owner))]


REFINE_STATEMENT = ("ids refine counts: Inv and owner[] consistent with the counts and the id rule "
                    "blocks-from-free-pool (each new block in range, free or released by this plan's preemptions, "
                    "handed out once) => the count rule (handed <= free + released)")
OWNERSHIP_STATEMENT = ("block-conservation on ids: Inv and owner[] (one owner per block, free or a live slot, "
                       "counts agreeing) and Allowed (count rules and id rule) and Update => the same after the step")


def _refine(opts: Options) -> Result:
    from .solve import Prover, state_values

    timer = Timer()
    m = opts.fixed.get("num_kv_blocks", opts.id_blocks)
    bs = block_setup(opts, m)
    rule = ids_rule(bs.s, bs.plan, bs.owner, bs.hand)
    hyps = list(bs.hyps.values()) + [rule]
    prover = Prover(bs.ctx, hyps, opts.timeout_s)
    goal = allowed_rules(bs.ctx, bs.s, bs.plan)["blocks-from-free-pool"]
    answer = None
    for lemma in refine_lemmas(bs.s, bs.plan, bs.owner, bs.hand):
        answer = prover.prove(lemma)
        if answer.status != PROVED:
            break
        prover.assume([lemma])
    if answer is None or answer.status == PROVED:
        answer = prover.prove(goal)
    witness = state_values(answer.model, bs.s, bs.plan) if answer.model is not None else None
    cases = {"a block released by a preemption handed out": z3.Or([
        z3.And(bs.plan.sched[i], bs.hand.hand[i][k] >= 1, bs.owner[k] == j, bs.plan.pre[j])
        for i in range(bs.s.n) for j in range(bs.s.n) for k in range(m)])}
    vacuity = prover.coverage(cases)
    return Result("spec/blocks/ids-refine-counts", REFINE_STATEMENT, PROVED, answer.status, bs.s.n,
                  opts.block_label, seconds=timer.seconds, detail=answer.reason or f"num_kv_blocks={m}",
                  witness=witness, vacuity=vacuity)


def _ownership(opts: Options) -> Result:
    from .solve import Prover, state_values
    from .theorems import step_cases

    timer = Timer()
    m = opts.fixed.get("num_kv_blocks", opts.id_blocks)
    bs = block_setup(opts, m)
    ctx, s, plan = bs.ctx, bs.s, bs.plan
    eos = [z3.Bool(f"eos{i}") for i in range(s.n)]
    hyps = list(bs.hyps.values()) + list(allowed_rules(ctx, s, plan).values()) + [ids_rule(s, plan, bs.owner, bs.hand)]
    out = apply_plan(ctx, s, plan, eos)
    # the owners after the step as named variables (their definitions are hypotheses): the lemmas and
    # goals then mention atoms, not nested if-then-else terms Z3 would split on
    owner2 = [z3.Int(f"own_after{k}") for k in range(m)]
    hyps += [o2 == o for o2, o in zip(owner2, ownership_after(s, plan, out.state, bs.owner, bs.hand), strict=True)]
    # lemma in the count rule's atoms (as spec/step/block-conservation): a slot's blocks after the step
    from .theorems import block_accounting

    prover = Prover(ctx, hyps, opts.timeout_s)
    status, detail, witness = PROVED, "", None
    after_inv = ownership_invariant(out.state, owner2)
    goals = [("lemma: block accounting", block_accounting(s, plan, out)),
             ("counts conserved", state_invariants(ctx, out.state)["block-conservation"]),
             ("owner-is-live", after_inv["owner-is-live"])]
    goals += ownership_lemmas(s, plan, out.state, bs.owner, owner2, bs.hand)
    goals += [("owned-count", after_inv["owned-count"]), ("free-count", after_inv["free-count"])]
    for name, goal in goals:
        parts = goal.children() if z3.is_and(goal) else [goal]
        for part in parts:
            answer = prover.prove(part)
            if answer.status != PROVED:
                status, detail = answer.status, f"{name}: {answer.status} {answer.reason}".strip()
                if answer.model is not None:
                    witness = state_values(answer.model, s, plan)
                    witness["owner"] = [answer.model.eval(o, model_completion=True).as_long() for o in bs.owner]
                break
            prover.assume([part])
        if status != PROVED:
            break
    cases = dict(step_cases(ctx, s, plan, out))
    cases["a released block handed to another request"] = z3.Or([
        z3.And(plan.sched[i], bs.hand.hand[i][k] >= 1, bs.owner[k] == j, plan.pre[j])
        for i in range(s.n) for j in range(s.n) if i != j for k in range(m)])
    vacuity = Prover(ctx, hyps, opts.timeout_s).coverage(cases)
    return Result("spec/blocks/ownership", OWNERSHIP_STATEMENT, PROVED, status, s.n,
                  opts.block_label, seconds=timer.seconds, detail=detail or f"num_kv_blocks={m}",
                  witness=witness, vacuity=vacuity)


def block_theorems() -> list[Theorem]:
    """The id-level theorems, run at ``min(N, policy_slots)`` slots and ``num_kv_blocks = id_blocks``."""
    return [Theorem("spec/blocks/ids-refine-counts", REFINE_STATEMENT, _refine),
            Theorem("spec/blocks/ownership", OWNERSHIP_STATEMENT, _ownership)]


__all__ = ["FREE", "Handout", "block_theorems", "ids_rule", "ownership_after", "ownership_invariant",
           "handout_matches_counts"]
