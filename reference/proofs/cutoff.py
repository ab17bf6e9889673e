"""``bounded-wait`` for every number of requests: a cutoff argument for the oldest request's step.

The one-step theorems of :mod:`.theorems` hold for the N slots they run at. For the oldest live
request ``o`` the policy step (fcfs or static) depends on the other requests only through a few
aggregates, so its ranking argument (``rank = max_model_len - computed(o)`` strictly decreases at
every step ``o`` does not end, ``o`` is never preempted) can be proved once for every N:

- an **abstract state** is ``o`` (every field), the config, and aggregates of the other requests:
  ``free`` (free blocks), ``others_running`` (how many run), ``others_decodes`` (how many of those
  are decodes), ``others_blocks`` (blocks they hold), and the running loop's values at ``o``'s rank:
  ``budget_at_o`` (tokens left), ``avail_at_o`` (free blocks in the step's pool) and ``after_o``
  (blocks of the preemption candidates younger than ``o``). Aggregates are unconstrained integers
  except for what the **glue** below derives, so they over-approximate every N;
- **abstract-decrease** (one query, no N in it): the policy's treatment of ``o`` at its rank (the
  running loop's body, or admission at the head of the queue) from every abstract state satisfying
  those constraints schedules ``o`` with at least one token and never preempts it, and
  ``0 <= computed(o) <= max_model_len - 1`` while it lives;
- **pair lemmas** (queries on two generic slots, ``o`` and any other ``v``; the N-slot ``Inv`` and
  ``Ord`` restricted to a pair of slots are these premises, with the free count replaced by a fresh
  variable, so the lemmas hold for every pair of every N-slot state): a request other than ``o``
  that does not run holds no block; if ``o`` waits nothing runs; if both run ``o`` is ahead of ``v``
  in the running queue (so no other rank preempts ``o``: a rank preempts only requests at or after
  its own position); a running ``v`` processed before ``o`` is a decode while ``o`` is a prefill (so
  ``o`` is processed first if it is a decode, after decodes only otherwise); a waiting candidate
  ``v`` comes after ``o`` in the admission order; ``o`` comes first in the monitor's order;
- **glue** (argued, for every N; see docs/proofs.md): a sum over the other slots of terms each 0
  (each ``<= 1``) is 0 (``<=`` their number); so ``o`` waiting gives ``others_running = 0``,
  ``others_blocks = 0``; ``o`` a decode is processed at rank 0 (``budget_at_o = max_num_batched_tokens``,
  ``avail_at_o = free``, ``after_o = others_blocks``); ``o`` a prefill sees ``budget_at_o >=
  max_num_batched_tokens - others_decodes`` (each rank before it, a decode, takes at most one
  token); by induction over the ranks before ``o`` (each a pair lemma) ``o`` is not preempted
  before its rank;
- **assumed** (not mechanized for every N): the running loop's pool never goes negative
  (``avail_at_o >= 0``): Python's ``while needed > pool.available: preempt`` keeps it by
  construction, and ``<policy>/step-lemmas`` proves it (``pool-nonnegative-k``) at the N it runs at;
- **abstraction-at-N** (the N the tool runs at, ``--policy-slots``): every concrete state's
  aggregates (computed from the encoded step of :mod:`.policy`) satisfy the abstract constraints,
  and the concrete step treats ``o`` as the abstract one does: the abstraction and the glue are
  checked against the real encoding there.
"""

from __future__ import annotations

from typing import Any

import z3

from schedspec.spec.proofs.core import PROVED, Options, Result, Theorem, Timer
from schedspec.spec.proofs.encoding import (
    Ctx,
    Plan,
    Slot,
    State,
    _sum,
    apply_plan,
    count,
    fits_alone,
    state_invariants,
    support,
)
from schedspec.spec.proofs.solve import Prover, state_values
from schedspec.spec.proofs.theorems import setup

from .policy import chunk
from .properties import monitor_key_less, order_invariant


def _per_slot_facts(ctx: Ctx, slots: list[Slot], scalars: State, prefix: str) -> list[Any]:
    """``Inv`` and ``Ord`` on these slots alone, the free count a fresh variable: what the N-slot
    ``Inv`` and ``Ord`` imply for any sub-collection of its slots (the sums over a sub-collection are at
    most those over all slots, every block count being >= 0)."""
    sub = State(list(slots), z3.Int(f"{prefix}_free_sub"), scalars.wfront, scalars.wback, scalars.rback,
                scalars.step, scalars.nextseq)
    return (list(state_invariants(ctx, sub).values()) + list(support(ctx, sub).values())
            + list(order_invariant(ctx, sub).values()))


def _scalars(prefix: str) -> State:
    return State([], z3.Int(f"{prefix}_free"), z3.Int(f"{prefix}_wfront"), z3.Int(f"{prefix}_wback"),
                 z3.Int(f"{prefix}_rback"), z3.Int(f"{prefix}_step"), z3.Int(f"{prefix}_nextseq"))


def _slot(prefix: str) -> Slot:
    from schedspec.spec.proofs.encoding import BOOL_SLOT_FIELDS, SLOT_FIELDS

    return Slot(**{name: (z3.Bool if name in BOOL_SLOT_FIELDS else z3.Int)(f"{prefix}_{name}")
                   for name in SLOT_FIELDS})


def is_decode(sl: Slot) -> Any:
    return z3.And(sl.running, sl.pending == 1)


def processed_before(v: Slot, o: Slot) -> Any:
    """``v`` comes before ``o`` in the running loop (both running with pending tokens): decodes first,
    each group by queue position (``policy.plan_step``'s processing order)."""
    both = z3.And(v.running, o.running, v.pending >= 1, o.pending >= 1)
    return z3.And(both, z3.Or(z3.And(is_decode(v), z3.Not(is_decode(o))),
                              z3.And(is_decode(v) == is_decode(o), v.pos < o.pos)))


class Abstract:
    """The abstract state: ``o`` and the aggregates of the other requests (see the module docstring)."""

    def __init__(self, ctx: Ctx, o: Slot, prefix: str = "abs") -> None:
        self.ctx = ctx
        self.o = o
        self.free = z3.Int(f"{prefix}_free")
        self.others_running = z3.Int(f"{prefix}_others_running")
        self.others_decodes = z3.Int(f"{prefix}_others_decodes")
        self.others_blocks = z3.Int(f"{prefix}_others_blocks")
        self.budget_at_o = z3.Int(f"{prefix}_budget_at_o")
        self.avail_at_o = z3.Int(f"{prefix}_avail_at_o")
        self.after_o = z3.Int(f"{prefix}_after_o")

    def values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("free", "others_running", "others_decodes", "others_blocks",
                                                       "budget_at_o", "avail_at_o", "after_o")}

    def constraints(self) -> list[Any]:
        """What the glue derives about the aggregates of any N-slot state (and the assumed pool bound)."""
        c, o = self.ctx.cfg, self.o
        mbt = c.max_num_batched_tokens
        return [
            self.free >= 0, self.others_blocks >= 0, self.others_running >= 0,
            self.others_decodes >= 0, self.others_decodes <= self.others_running,
            self.free + z3.If(o.live, o.b, 0) + self.others_blocks == c.num_kv_blocks,  # block-conservation
            self.others_running + z3.If(o.running, 1, 0) <= c.max_num_seqs,  # running-within-max-num-seqs
            z3.Implies(o.waiting, z3.And(self.others_running == 0, self.others_blocks == 0)),
            z3.Implies(is_decode(o), z3.And(self.budget_at_o == mbt, self.avail_at_o == self.free,
                                            self.after_o == self.others_blocks)),
            z3.Implies(z3.And(o.running, z3.Not(is_decode(o))),
                       z3.And(self.budget_at_o >= mbt - self.others_decodes, self.budget_at_o <= mbt,
                              self.after_o >= 0,
                              self.avail_at_o >= 0)),  # assumed: the pool never goes negative
        ]

    def step(self, policy_idle_only: bool = False) -> dict[str, Any]:
        """The policy's treatment of ``o``: the running loop's body at ``o``'s rank (``o`` running, not
        preempted before it), or admission with ``o`` at the head of the order (``o`` waiting, nothing
        running, so nothing preempted and static admits too)."""
        ctx, c, o = self.ctx, self.ctx.cfg, self.o
        nt = chunk(ctx, o.pending, self.budget_at_o)
        act = z3.And(self.budget_at_o > 0, nt > 0)
        needed = ctx.cdiv(o.nc + nt) - o.b
        pre = z3.And(o.running, o.pending >= 1, act, self.avail_at_o + self.after_o < needed)
        sched_running = z3.And(o.running, o.pending >= 1, act, z3.Not(pre))
        nt_adm = chunk(ctx, o.pending, c.max_num_batched_tokens)
        admitting = z3.Not(z3.And(policy_idle_only, self.others_running > 0))
        admit = z3.And(o.waiting, z3.Or(fits_alone(ctx, o.p, o.mt), o.adm), admitting,
                       self.others_running < c.max_num_seqs, c.max_num_batched_tokens > 0, nt_adm > 0,
                       ctx.cdiv(o.p + o.o) <= self.free)
        return {"pre": pre, "sched": z3.Or(sched_running, admit),
                "ntok": z3.If(sched_running, nt, z3.If(admit, nt_adm, 0))}


def _rejected(ctx: Ctx, o: Slot) -> Any:
    return z3.And(o.waiting, z3.Not(o.adm), z3.Not(fits_alone(ctx, o.p, o.mt)))


def pair_lemmas(ctx: Ctx, o: Slot, v: Slot) -> dict[str, Any]:
    """The facts about ``o`` (the oldest live request) and any other live slot ``v`` the glue uses."""
    return {
        "idle-holds-nothing": z3.Implies(z3.Not(v.running), v.b == 0),
        "waiting-oldest-runs-alone": z3.Implies(o.waiting, z3.Not(v.running)),
        "oldest-ahead-in-running-queue": z3.Implies(z3.And(o.running, v.running), o.pos < v.pos),
        "processed-before-oldest-is-decode": z3.Implies(processed_before(v, o),
                                                         z3.And(is_decode(v), z3.Not(is_decode(o)))),
        "decode-takes-at-most-one": z3.Implies(is_decode(v), v.pending <= 1),
        "oldest-heads-admission": z3.Implies(z3.And(o.waiting, v.waiting), o.pos < v.pos),
        "oldest-first-for-monitor": monitor_key_less(o, v),
    }


def bounded_wait_every_n(policy: str) -> Theorem:
    name = f"{policy}/bounded-wait-every-n"
    statement = ("bounded-wait for every number of requests (cutoff): the oldest live request o is never "
                 "preempted and computes a token in every step it does not end, from every state of any N "
                 "satisfying Inv and Ord; proved on an abstract state (o and aggregates of the others) with "
                 "pair lemmas on two generic slots, the abstraction checked against the encoding at N; "
                 "assumes the running loop's pool never goes negative")

    def run(opts: Options) -> Result:
        from .theorems import Setup, policy_options

        timer = Timer()
        statuses: list[tuple[str, str, str]] = []
        witness = None
        idle_only = policy == "static"
        # (1) abstract-decrease: no N anywhere
        ctx = setup(opts, prefix="cut_")
        scal = _scalars("cut")
        o = _slot("cut_o")
        a = Abstract(ctx, o)
        hyps = [ctx.cfg.valid(), *_per_slot_facts(ctx, [o], scal, "cut_o"), *a.constraints(),
                o.live, z3.Not(_rejected(ctx, o))]
        prover = Prover(ctx, hyps, opts.timeout_s)
        st = a.step(idle_only)
        mml = ctx.cfg.max_model_len
        for part, goal in (("abstract-decrease", z3.And(z3.Not(st["pre"]), st["sched"], st["ntok"] >= 1)),
                           ("abstract-bounds", z3.And(o.nc >= 0, o.nc <= mml - 1))):
            answer = prover.prove(goal)
            statuses.append((part, answer.status, answer.reason))
        # the update: a scheduled o computes its tokens (the slot's own update, no other slot involved)
        t = z3.Int("cut_t")
        one = State([o], scal.free, scal.wfront, scal.wback, scal.rback, scal.step, scal.nextseq)
        plan = Plan(sched=[z3.BoolVal(True)], start=[o.nc], ntok=[t], nb=[z3.Int("cut_nb")], bpos=[z3.IntVal(0)],
                    pre=[z3.BoolVal(False)], ppos=[z3.IntVal(0)], rej=[z3.BoolVal(False)])
        o2 = apply_plan(ctx, one, plan, [z3.Bool("cut_eos")]).state.slots[0]
        answer = prover.prove(z3.Implies(t >= 1, z3.Implies(o2.live, o2.nc > o.nc)))
        statuses.append(("update-advances", answer.status, answer.reason))
        # the running loop's body takes at most a request's pending tokens and the budget left
        budget = z3.Int("cut_budget")
        nt = chunk(ctx, o.pending, budget)
        answer = prover.prove(z3.Implies(budget >= 0, z3.And(nt >= 0, nt <= o.pending, nt <= budget)))
        statuses.append(("chunk-within-pending-and-budget", answer.status, answer.reason))
        vacuity = prover.coverage({"o waiting": o.waiting, "o a running decode": is_decode(o),
                                   "o a running prefill": z3.And(o.running, z3.Not(is_decode(o))),
                                   "o decode, no block free": z3.And(is_decode(o), a.free == 0)})
        # (2) pair lemmas on two generic slots
        v = _slot("cut_v")
        pair_hyps = [ctx.cfg.valid(), *_per_slot_facts(ctx, [o, v], scal, "cut_ov"), o.live, v.live, o.seq < v.seq]
        pair = Prover(ctx, pair_hyps, opts.timeout_s)
        for label, goal in pair_lemmas(ctx, o, v).items():
            answer = pair.prove(goal)
            statuses.append((f"pair {label}", answer.status, answer.reason))
        vacuity += [dataclass_replace(cov, case=f"pair {cov.case}") for cov in pair.coverage(
            {"both running": z3.And(o.running, v.running), "o waiting": o.waiting})]
        # (3) abstraction-at-N: the concrete encoding at N agrees with the abstract step on o
        local = policy_options(opts)
        stn = Setup.get(local, policy)
        status, detail = stn.lemmas()
        if status != PROVED:
            statuses.append(("abstraction-at-N lemmas", status, detail))
        else:
            for w in range(local.slots):
                goal, extra = abstraction_goal(stn, w, idle_only)
                got, wit, reason = stn.prove(goal, extra)
                statuses.append((f"abstraction-at-N o={w}", got, reason))
                witness = witness or wit
        from .theorems import _combine

        result = _combine(name, statement, statuses, local, timer, witness, vacuity=vacuity)
        if result.status == PROVED:
            result.detail = (f"{len(statuses) - local.slots} abstract and pair queries (every N); abstraction "
                             f"checked at N = {local.slots}")
        return result

    return Theorem(name, statement, run)


def dataclass_replace(obj: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **changes)


def abstraction_goal(stn: Any, w: int, idle_only: bool) -> tuple[Any, list[Any]]:
    """For slot ``w`` the oldest live request (not rejected) of the concrete N-slot state: the aggregates
    computed from it and its encoded step satisfy :meth:`Abstract.constraints`, and the concrete step's
    ``pre``, ``sched`` and ``ntok`` of ``w`` are the abstract step's."""
    s, step, plan = stn.s, stn.step, stn.plan
    n = s.n
    S = s.slots
    o = S[w]
    others = [j for j in range(n) if j != w]
    a = Abstract(stn.ctx, o, prefix=f"cutN{w}")
    loop = step.loop
    # canonical order: o's rank is its slot index w
    concrete = {
        "free": s.free,
        "others_running": count([S[j].running for j in others]),
        "others_decodes": count([is_decode(S[j]) for j in others]),
        "others_blocks": _sum([z3.If(S[j].live, S[j].b, 0) for j in others]),
        "budget_at_o": loop["budget"][w],
        "avail_at_o": loop["avail"][w],
        "after_o": loop["after"][w][w],
    }
    subst = [(a.values()[k], v) for k, v in concrete.items()]
    abstract_step = a.step(idle_only)
    same = z3.And(plan.pre[w] == abstract_step["pre"], plan.sched[w] == abstract_step["sched"],
                  z3.Implies(plan.sched[w], plan.ntok[w] == abstract_step["ntok"]))
    goal = z3.substitute(z3.And(*a.constraints(), same), *subst)
    oldest = z3.And(o.live, *[z3.Implies(S[j].live, o.seq < S[j].seq) for j in others])
    return goal, [oldest, z3.Not(step.rejected[w])]


__all__ = ["bounded_wait_every_n", "Abstract", "pair_lemmas", "abstraction_goal", "state_values"]
