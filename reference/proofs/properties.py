"""Trace properties of :mod:`schedspec.spec.properties` as Z3 predicates on one step, the ordering
invariant the FCFS-family policies keep, and bounded unrollings of runs.

Every predicate mirrors the monitor's ``observe`` on ``(before, plan)``; a violation predicate is true
exactly when the monitor would report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import z3

from schedspec.spec.proofs.encoding import (
    EMPTY,
    WAITING,
    Ctx,
    Plan,
    Slot,
    State,
    StepOutcome,
    _sum,
    apply_plan,
    count,
    fits_alone,
    initial_state,
)
from schedspec.spec.properties import ITL_TOKEN_BUDGET

from .policy import PolicyStep, plan_step

# --- the ordering invariant of fcfs and static ------------------------------------------------------


def order_invariant(ctx: Ctx, s: State) -> dict[str, Any]:
    """What fcfs and static keep beyond the spec's invariant (``seq`` is the order of addition):

    - ``running-sorted``, ``waiting-sorted``: each queue is in arrival order;
    - ``running-older``: every running request arrived before every waiting one;
    - ``seq-below-next``, ``arrival-monotone``: arrival steps grow with the order of addition;
    - ``prefill-reserved``: a running request with more than one pending token holds blocks for its
      whole sequence (admission reserves them), so only decodes ever need a block.
    """
    S = s.slots
    n = s.n
    parts: dict[str, list[Any]] = {k: [] for k in ORDER_INVARIANT_NAMES}
    for i in range(n):
        a = S[i]
        parts["seq-below-next"].append(z3.Implies(a.live, z3.And(a.seq < s.nextseq, a.arr <= s.step)))
        parts["prefill-reserved"].append(z3.Implies(z3.And(a.running, a.pending > 1), ctx.covers(a.b, a.p + a.o)))
        for j in range(n):
            if i == j:
                continue
            b = S[j]
            parts["running-sorted"].append(z3.Implies(z3.And(a.running, b.running, a.pos < b.pos), a.seq < b.seq))
            parts["waiting-sorted"].append(z3.Implies(z3.And(a.waiting, b.waiting, a.pos < b.pos), a.seq < b.seq))
            parts["running-older"].append(z3.Implies(z3.And(a.running, b.waiting), a.seq < b.seq))
            parts["arrival-monotone"].append(z3.Implies(z3.And(a.live, b.live, a.seq < b.seq), a.arr <= b.arr))
    return {k: z3.And(v) for k, v in parts.items()}


ORDER_INVARIANT_NAMES = ("running-sorted", "waiting-sorted", "running-older", "seq-below-next", "arrival-monotone",
                         "prefill-reserved")


# --- monitors as predicates -------------------------------------------------------------------------


def monitor_decode(s: State, i: int) -> Any:
    """A running decode as the monitors see it: one pending token, prompt computed."""
    sl = s.slots[i]
    return z3.And(sl.running, sl.pending == 1, sl.nc >= sl.p)


def work_conserving_violation(ctx: Ctx, s: State, plan: Plan) -> Any:
    """``WorkConserving.observe`` reports."""
    c = ctx.cfg
    n = s.n
    S = s.slots
    left = c.max_num_batched_tokens - plan.tokens()
    left_out = z3.Or([z3.And(S[i].running, z3.Not(plan.sched[i]), z3.Not(plan.pre[i])) for i in range(n)])
    running_after = count([sl.running for sl in S]) + count([z3.And(plan.sched[i], z3.Not(S[i].running))
                                                             for i in range(n)])
    free_at_plan = s.free - _sum([z3.If(plan.sched[i], plan.nb[i], 0) for i in range(n)])
    open_ = [z3.And(S[i].waiting, z3.Not(plan.rej[i]), z3.Not(plan.sched[i])) for i in range(n)]
    heads = []
    for i in range(n):
        first = z3.And([z3.Implies(open_[j], S[i].pos < S[j].pos) for j in range(n) if j != i])
        fits = z3.And(ctx.cdiv(S[i].p + S[i].o) <= free_at_plan,
                      z3.Or(c.enable_chunked_prefill, S[i].pending <= left))
        heads.append(z3.And(open_[i], first, fits))
    no_pre = z3.Not(z3.Or(plan.pre))
    return z3.And(left > 0, z3.Or(left_out, z3.And(no_pre, running_after < c.max_num_seqs, z3.Or(heads))))


def stall_free_violation(ctx: Ctx, s: State, plan: Plan) -> Any:
    """``StallFreeDecode.observe`` reports."""
    n = s.n
    decodes = [monitor_decode(s, i) for i in range(n)]
    starved = z3.Or([z3.And(decodes[i], z3.Not(z3.And(plan.sched[i], plan.ntok[i] == 1))) for i in range(n)])
    return z3.And(z3.Not(z3.Or(plan.pre)), count(decodes) <= ctx.cfg.max_num_batched_tokens, starved)


def rejects_impossible_violation(ctx: Ctx, s: State, plan: Plan) -> Any:
    """``RejectsImpossible.observe`` reports."""
    bad = []
    for i, sl in enumerate(s.slots):
        fits = fits_alone(ctx, sl.p, sl.mt)
        bad.append(z3.And(sl.waiting, z3.Not(sl.adm), z3.Or(z3.And(z3.Not(fits), z3.Not(plan.rej[i])),
                                                            z3.And(fits, plan.rej[i]))))
    return z3.Or(bad)


def bounded_itl_violation(ctx: Ctx, s: State, plan: Plan, budget: int = ITL_TOKEN_BUDGET) -> Any:
    """``BoundedItl.observe`` reports: a step carrying a running decode computes more than ``budget``
    tokens."""
    carries = z3.Or([z3.And(monitor_decode(s, i), plan.sched[i]) for i in range(s.n)])
    return z3.And(carries, plan.tokens() > budget)


def monitor_key_less(a: Slot, b: Slot) -> Any:
    """``_oldest_live``'s order: arrival step, then running before waiting, then queue position."""
    aw = z3.If(a.running, 0, 1)
    bw = z3.If(b.running, 0, 1)
    return z3.Or(a.arr < b.arr, z3.And(a.arr == b.arr, z3.Or(aw < bw, z3.And(aw == bw, a.pos < b.pos))))


def monitor_oldest(s: State, i: int, rejected: Sequence[Any]) -> Any:
    """Slot ``i`` is ``BoundedWait``'s oldest live request in this step (not rejected in it)."""
    S = s.slots
    first = z3.And([z3.Implies(S[j].live, monitor_key_less(S[i], S[j])) for j in range(s.n) if j != i])
    return z3.And(S[i].live, first, z3.Not(rejected[i]))


# --- runs ---------------------------------------------------------------------------------------------


def materialize(ctx: Ctx, s: State, name: str) -> State:
    """The same state with every field a named variable (keeps unrolled terms small)."""
    slots = []
    for i, sl in enumerate(s.slots):
        values = {}
        for field in ("st", "p", "o", "mt", "nc", "b", "pos", "npre", "arr", "prio", "seq"):
            values[field] = ctx.define(f"{name}_{field}{i}", z3.simplify(getattr(sl, field)))
        values["adm"] = ctx.define(f"{name}_adm{i}", z3.simplify(sl.adm), "bool")
        slots.append(Slot(**values))
    scalars = {f: ctx.define(f"{name}_{f}", z3.simplify(getattr(s, f)))
               for f in ("free", "wfront", "wback", "rback", "step", "nextseq")}
    return State(slots, **scalars)


def arrivals(s: State, flags: Sequence[Any], prompts: Sequence[Any], max_tokens: Sequence[Any]) -> State:
    """Requests arrive in every slot whose flag is set, added in slot order (``add_request`` each)."""
    slots = []
    for i, sl in enumerate(s.slots):
        k = count(flags[:i])
        new = Slot(st=z3.IntVal(WAITING), p=prompts[i], o=z3.IntVal(0), mt=max_tokens[i], nc=z3.IntVal(0),
                   b=z3.IntVal(0), pos=s.wback + 1 + k, adm=z3.BoolVal(False), npre=z3.IntVal(0), arr=s.step,
                   prio=z3.IntVal(0), seq=s.nextseq + k)
        slots.append(Slot(**{f: z3.If(flags[i], getattr(new, f), getattr(sl, f))
                             for f in ("st", "p", "o", "mt", "nc", "b", "pos", "adm", "npre", "arr", "prio", "seq")}))
    total = count(flags)
    return replace(s, slots=slots, wback=s.wback + total, nextseq=s.nextseq + total)


@dataclass
class SymbolicStep:
    """One unrolled step of a :class:`Run` in Z3 terms (the state after arrivals, the policy's step and
    its outcome): symbolic, so not the trace's :class:`~schedspec.spec.trace.StepRecord`."""

    before: State
    step: PolicyStep
    out: StepOutcome


@dataclass
class Run:
    """An unrolled run: per step the state after arrivals (``before``), the policy's step and the
    outcome; the per-slot arrival step, prompt and max_tokens when the run starts from ``Init``."""

    steps: list[SymbolicStep]
    arrival: list[Any]
    prompt: list[Any]
    max_tokens: list[Any]
    eos: list[list[Any]]
    aborted: list[list[Any]]
    """Per step and slot: the live request there was aborted before the step (``aborts`` runs)."""
    arrived: list[State]
    """Per step: the state after arrivals, before aborts."""


def abort_where(s: State, flags: Sequence[Any]) -> State:
    """``abort_request`` of the live request in every slot whose flag is set: it ends, its blocks return."""
    slots = [replace(sl, st=z3.If(flags[i], z3.IntVal(EMPTY), sl.st), b=z3.If(flags[i], z3.IntVal(0), sl.b))
             for i, sl in enumerate(s.slots)]
    freed = _sum([z3.If(z3.And(flags[i], sl.live), sl.b, 0) for i, sl in enumerate(s.slots)])
    return replace(s, slots=slots, free=s.free + freed)


def seq_sorted(s: State) -> Any:
    """The live requests sit in the slots in the order of addition (what ``layout="slot-order"`` builds
    on): ``i < j``, both live => ``seq[i] < seq[j]``."""
    S = s.slots
    return z3.And([z3.Implies(z3.And(S[i].live, S[j].live), S[i].seq < S[j].seq)
                   for i in range(s.n) for j in range(i + 1, s.n)])


def arrival_after_live(s: State, flags: Sequence[Any]) -> list[Any]:
    """Arrivals keep :func:`seq_sorted`: a request arrives only in a slot after every live one (the
    arrivals of one step are added in slot order)."""
    return [z3.Implies(flags[i], z3.And([s.slots[j].st == EMPTY for j in range(i, s.n)])) for i in range(s.n)]


def run_from_init(ctx: Ctx, policy: str, n: int, depth: int, eos: bool = False, aborts: bool = False,
                  layout: str = "permuted") -> Run:
    """``depth`` steps from the initial state; slot ``i`` receives one request before step
    ``arrival[i]`` (``arrival[i] == depth``: never), requests of one step added in slot order. With
    ``eos``, each sampled token may be EOS; with ``aborts``, the client may abort any live request
    before each step (after that step's arrivals).

    With ``layout="slot-order"`` (queue-order policies) the slots receive their requests in arrival
    order (``arrival[i] <= arrival[i + 1]``: no loss, the slots are alike), so the live requests are in
    the order of addition at every step and the policy's step needs no permutation; its hypothesis
    (each queue in slot order) and its lemmas, implied on every reachable state by ``Inv`` and ``Ord``
    (:func:`.bmc.layout_lemmas` proves so), are added to ``ctx.facts``."""
    arrival = [z3.Int(f"arrival{i}") for i in range(n)]
    prompt = [z3.Int(f"prompt{i}") for i in range(n)]
    max_tokens = [z3.Int(f"max_tokens{i}") for i in range(n)]
    for i in range(n):
        ctx.facts.append(z3.And(arrival[i] >= 0, arrival[i] <= depth, prompt[i] >= 0, max_tokens[i] >= 0))
        if layout == "slot-order" and i + 1 < n:
            ctx.facts.append(arrival[i] <= arrival[i + 1])
    s = initial_state(ctx, n)
    steps = []
    eos_vars = []
    abort_vars: list[list[Any]] = []
    arrived_states = []
    for t in range(depth):
        flags = [arrival[i] == t for i in range(n)]
        before = materialize(ctx, arrivals(s, flags, prompt, max_tokens), f"t{t}a")
        arrived_states.append(before)
        cut = [z3.And(z3.Bool(f"t{t}_abort{i}"), before.slots[i].live) if aborts else z3.BoolVal(False)
               for i in range(n)]
        abort_vars.append(cut)
        if aborts:
            before = materialize(ctx, abort_where(before, cut), f"t{t}b")
        step = plan_step(ctx, before, policy, name=f"t{t}", layout=layout)
        ctx.facts.extend(step.layout_hypothesis)
        if layout == "slot-order":  # consequences of Inv and Ord (reachable states keep both)
            ctx.facts.extend(lemma for _, lemma in step.ordered_lemmas)
        e = [z3.Bool(f"t{t}_eos{i}") if eos else z3.BoolVal(False) for i in range(n)]
        out = apply_plan(ctx, before, step.plan, e)
        steps.append(SymbolicStep(before, step, out))
        eos_vars.append(e)
        s = materialize(ctx, out.state, f"t{t + 1}")
    return Run(steps, arrival, prompt, max_tokens, eos_vars, abort_vars, arrived_states)
