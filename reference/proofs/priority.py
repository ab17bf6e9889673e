"""``no-priority-inversion`` (:class:`schedspec.spec.properties.NoPriorityInversion`) as a Z3 predicate
on one step, and the one-step theorem that the priority policy keeps it.

Blocks are counts (prefix caching off, so no block is shared and a prefix hit takes nothing): what
the monitor computes from block tables becomes sums of the per-slot counts.
"""

from __future__ import annotations

from typing import Any

import z3

from schedspec.spec.proofs.core import Theorem
from schedspec.spec.proofs.encoding import Ctx, Plan, State, _sum, count, fits_alone


def inversion_of(ctx: Ctx, s: State, plan: Plan, i: int) -> Any:
    """The monitor reports slot ``i``: waiting at plan time (not admitted and not rejected, or preempted by
    the plan), able to complete alone, not fitting in what the step leaves (a ``max_num_seqs`` slot, blocks
    for its whole current sequence, one token with chunked prefill or its pending tokens without), but
    fitting once the strictly less urgent (greater ``priority``) requests running after the plan give back
    their blocks (after this step's allocations) and this step's tokens, and there is at least one."""
    c = ctx.cfg
    S = s.slots
    n = s.n
    running_after = [z3.Or(z3.And(S[j].running, z3.Not(plan.pre[j])), z3.And(plan.sched[j], z3.Not(S[j].running)))
                     for j in range(n)]
    slots = c.max_num_seqs - count(running_after)
    blocks = (s.free + _sum([z3.If(plan.pre[j], S[j].b, 0) for j in range(n)])
              - _sum([z3.If(plan.sched[j], plan.nb[j], 0) for j in range(n)]))
    tokens = c.max_num_batched_tokens - plan.tokens()
    w = S[i]
    waiting = z3.Or(z3.And(w.waiting, z3.Not(plan.sched[i]), z3.Not(plan.rej[i])), plan.pre[i])
    needed_blocks = ctx.cdiv(w.p + w.o)
    needed_tokens = z3.If(c.enable_chunked_prefill, 1, w.p + w.o - w.nc)
    fits = z3.And(slots >= 1, blocks >= needed_blocks, tokens >= needed_tokens)
    less_urgent = [z3.And(running_after[j], S[j].prio > w.prio) if j != i else z3.BoolVal(False) for j in range(n)]
    held_blocks = _sum([z3.If(less_urgent[j], S[j].b + z3.If(plan.sched[j], plan.nb[j], 0), 0) for j in range(n)])
    held_tokens = _sum([z3.If(z3.And(less_urgent[j], plan.sched[j]), plan.ntok[j], 0) for j in range(n)])
    return z3.And(w.live, waiting, fits_alone(ctx, w.p, w.mt), z3.Not(fits), count(less_urgent) >= 1,
                  blocks + held_blocks >= needed_blocks, tokens + held_tokens >= needed_tokens)


def priority_inversion_violation(ctx: Ctx, s: State, plan: Plan) -> Any:
    """``NoPriorityInversion.observe`` reports (some slot is kept out only by less urgent running ones)."""
    return z3.Or([inversion_of(ctx, s, plan, i) for i in range(s.n)])


def no_priority_inversion(policy: str) -> Theorem:
    from .theorems import one_step

    return one_step(
        f"{policy}/no-priority-inversion",
        "no-priority-inversion (one step): after the step's preemptions and allocations, no waiting request that "
        "could complete alone is kept out (of a max_num_seqs slot, blocks for its sequence or budget) only by "
        "strictly less urgent running requests", policy,
        lambda st: z3.Not(priority_inversion_violation(st.ctx, st.s, st.plan)),
        vacuity_extra=lambda st: [admits_by_preempting(st.s, st.plan)])


def admits_by_preempting(s: State, plan: Plan) -> Any:
    """The step admits a waiting request and preempts a running one less urgent than it (the path that keeps
    the property where vLLM breaks it): the vacuity checks of ``no-priority-inversion`` add it."""
    S = s.slots
    return z3.Or([z3.And(plan.sched[i], z3.Not(S[i].running), plan.pre[j], S[j].prio > S[i].prio)
                  for i in range(s.n) for j in range(s.n) if i != j])
