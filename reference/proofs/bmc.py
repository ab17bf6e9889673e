"""Bounded model checking of the run properties (``progress``, ``bounded-preemptions``) and the cover goals
that make it mean something.

A run property is checked over every run of at most K steps (``--depth``) from every state satisfying the
inductive invariants ``Inv`` (:mod:`schedspec.spec.proofs.theorems`) and ``Ord``
(:func:`.properties.order_invariant`), with a small block size (``--bmc-block-size``, default 2) so that
decodes need new blocks within K steps and preemptions happen. Its **cover goals** are searched from the
initial state (requests arriving at any step, EOS and client aborts free): each must be reached within K
steps, and the run Z3 finds is replayed on the Python reference (:func:`replay_cover`), which must reach it
too; a goal not reached makes the theorem fail (it would check the property only for runs without it).

**Slot order.** The queue-order policies (fcfs, static) are unrolled with ``layout="slot-order"``
(:data:`.policy.LAYOUTS`): the live requests sit in the slots in the order of addition, which under
``Ord`` makes each queue's order the slot order, so the step needs no permutation (at N = 4, K = 6 the
progress query takes about 13 s instead of several minutes). What that rests on is proved in every run
(:func:`layout_lemmas`): ``Inv``, ``Ord`` and the slot order imply the layout's hypothesis, and a step
and arrivals placed after every live request keep the slot order. Placing arrivals so loses no run of
interest: a stalled window ends no request (an ending is progress), so no slot is freed within it and an
arrival may always take the first empty slot after the live ones (the slots are alike); the cover runs
give each slot one request, in arrival order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import z3

from schedspec.spec.proofs.core import (
    COUNTEREXAMPLE,
    PROVED,
    UNCONFIRMED,
    UNKNOWN,
    Coverage,
    Options,
    Result,
    Theorem,
    Timer,
)
from schedspec.spec.proofs.encoding import (
    PREEMPTED,
    Ctx,
    State,
    _sum,
    apply_plan,
    max_blocks_needed,
    rule_atoms,
    symbolic_state,
)
from schedspec.spec.proofs.solve import Prover, minimize, satisfiable, state_values, value, witness_objectives
from schedspec.spec.proofs.theorems import inv_parts, recheck_block_size, setup

from .policy import POLICIES, PolicyStep, plan_step, slot_order_hypothesis
from .properties import (
    Run,
    abort_where,
    arrival_after_live,
    arrivals,
    materialize,
    order_invariant,
    run_from_init,
    seq_sorted,
)


def bmc_layout(policy: str) -> str:
    """``slot-order`` for the queue-order policies, else ``permuted``."""
    return "slot-order" if POLICIES[policy]["order"] == "queue" else "permuted"


def bmc_options(opts: Options, fixed_block: bool = False) -> Options:
    """Bounded model checking runs at ``bmc_n`` slots with the small ``bmc_block_size`` (unless the
    block size is symbolic or uninterpreted and ``fixed_block`` is not asked)."""
    local = dataclasses.replace(opts, slots=opts.bmc_n)
    if local.block == "fixed" or fixed_block:
        local = dataclasses.replace(local, block="fixed", block_size_value=opts.bmc_block_size)
    return local


def layout_lemmas(opts: Options, policy: str) -> tuple[str, str, Any]:
    """Prove what the slot-order unrolling assumes, at the run's N: (1) ``Inv``, ``Ord`` and
    :func:`.properties.seq_sorted` imply :func:`.policy.slot_order_hypothesis`; (2) arrivals placed after
    every live request (:func:`.properties.arrival_after_live`) keep ``seq_sorted``, and so do aborts;
    (3) so does the policy's slot-order step; (4) the step's lemmas (``PolicyStep.ordered_lemmas``: the pool never goes
    negative, prefills never preempt, a decode needs at most one block), each from the ones before, which
    :func:`unroll` then assumes at every step. Returns ``(status, detail, witness)``; ``proved`` without
    work for a permuted layout."""
    if bmc_layout(policy) != "slot-order":
        return PROVED, "", None
    ctx = setup(opts)
    n = opts.slots
    s = symbolic_state(n, "lay")
    hyps = [ctx.cfg.valid(), *inv_parts(ctx, s).values(), *order_invariant(ctx, s).values(), seq_sorted(s)]
    prover = Prover(ctx, hyps, opts.timeout_s)
    flags = [z3.Bool(f"lay_arrives{i}") for i in range(n)]
    p = [z3.Int(f"lay_p{i}") for i in range(n)]
    mt = [z3.Int(f"lay_mt{i}") for i in range(n)]
    arrived = arrivals(s, flags, p, mt)
    step = plan_step(ctx, s, policy, name="lay", layout="slot-order")
    after = apply_plan(ctx, s, step.plan, [z3.Bool(f"lay_eos{i}") for i in range(n)]).state
    cut = [z3.And(z3.Bool(f"lay_abort{i}"), s.slots[i].live) for i in range(n)]
    goals = [
        ("the layout's hypothesis", z3.And(slot_order_hypothesis(s))),
        ("arrivals keep the slot order", z3.Implies(z3.And(arrival_after_live(s, flags)), seq_sorted(arrived))),
        ("aborts keep the slot order", seq_sorted(abort_where(s, cut))),
        ("the step keeps the slot order", z3.Implies(z3.And(step.layout_hypothesis), seq_sorted(after))),
    ]
    goals += [(f"lemma {label}", z3.Implies(z3.And(step.layout_hypothesis), lemma)) for label, lemma in step.ordered_lemmas]
    for label, goal in goals:
        answer = prover.prove(goal)
        if answer.status != PROVED:
            witness = state_values(answer.model, s) if answer.model is not None else None
            return answer.status, f"slot-order layout, {label}: {answer.status} {answer.reason}".strip(), witness
        prover.assume([goal])
    return PROVED, "", None


@dataclass
class BmcStep:
    """One unrolled step: the state after the client's actions (``before``), the policy's step, its
    outcome, and which slots received an arrival (``arrived``) before it."""

    before: State
    step: PolicyStep
    out: Any
    arrived: list[Any]


def unroll(ctx: Ctx, policy: str, s: State, depth: int, hyps: list[Any], arrive: bool, abort: bool
           ) -> list[BmcStep]:
    """``depth`` steps of ``policy`` from ``s``: before each, requests may arrive (``arrive``: in empty
    slots after every live one, for the slot-order layout) and, before each step after the first, the
    client may abort any live request (``abort``; aborts before the first step give another start state
    satisfying the same invariants, and bounded-preemptions ranks the requests live at that step); each
    sampled token may be EOS. ``Inv`` and ``Ord`` are assumed at every later state (they
    are inductive: ``spec/step/*``, ``<policy>/ordering-invariant``), which prunes the search without
    losing a real run; the layout's hypothesis and the step's lemmas are assumed at each state
    (:func:`layout_lemmas` proves they follow). The assumptions go to ``hyps``."""
    n = s.n
    layout = bmc_layout(policy)
    out_steps = []
    state = s
    for t in range(depth):
        flags = [z3.Bool(f"t{t}_arrives{i}") if arrive else z3.BoolVal(False) for i in range(n)]
        before = state
        if arrive:
            prompts = [z3.Int(f"t{t}_p{i}") for i in range(n)]
            mts = [z3.Int(f"t{t}_mt{i}") for i in range(n)]
            for i in range(n):
                hyps.append(z3.Implies(flags[i], z3.And(state.slots[i].st == 0, prompts[i] >= 0, mts[i] >= 0)))
            if layout == "slot-order":
                hyps.extend(arrival_after_live(state, flags))
            before = materialize(ctx, arrivals(state, flags, prompts, mts), f"t{t}b")
        if abort and t > 0:
            cut = [z3.And(z3.Bool(f"t{t}_abort{i}"), before.slots[i].live) for i in range(n)]
            before = materialize(ctx, abort_where(before, cut), f"t{t}c")
        step = plan_step(ctx, before, policy, name=f"t{t}", layout=layout)
        hyps.extend(step.layout_hypothesis)
        hyps.extend(lemma for _, lemma in step.ordered_lemmas)
        eos = [z3.Bool(f"t{t}_eos{i}") for i in range(n)]
        out = apply_plan(ctx, before, step.plan, eos)
        out_steps.append(BmcStep(before, step, out, flags))
        state = materialize(ctx, out.state, f"t{t + 1}")
        if t + 1 < depth:
            hyps += list(inv_parts(ctx, state).values()) + list(order_invariant(ctx, state).values())
    return out_steps


def start_state(ctx: Ctx, n: int) -> tuple[State, list[Any]]:
    """A symbolic state satisfying ``Inv`` and ``Ord`` with its live requests in the first slots in the
    order of addition (the slots are alike: no state is lost), and those hypotheses."""
    s = symbolic_state(n, "s")
    hyps = [ctx.cfg.valid(), *inv_parts(ctx, s).values(), *order_invariant(ctx, s).values()]
    for i in range(1, n):
        prev, sl = s.slots[i - 1], s.slots[i]
        hyps.append(z3.Implies(sl.live, z3.And(prev.live, prev.seq < sl.seq)))
    return s, hyps


# --- progress ------------------------------------------------------------------------------------------------


def progress_query(opts: Options, policy: str, depth: int) -> tuple[str, Any, str]:
    """Is there a stall of ``max_model_len <= depth`` steps from a state satisfying ``Inv`` and ``Ord``?
    (``proved``: none.) High-water marks between computed and sequence length stand for what each live
    request computed before."""
    ctx = setup(opts)
    n = opts.slots
    c = ctx.cfg
    s, hyps = start_state(ctx, n)
    hyps.append(c.max_model_len <= depth)
    hw = [z3.Int(f"hw{i}") for i in range(n)]
    for i, sl in enumerate(s.slots):
        hyps.append(z3.Implies(sl.live, z3.And(hw[i] >= sl.nc, hw[i] <= sl.p + sl.o)))
        hyps.append(z3.Implies(sl.st == 1, hw[i] == 0))
    steps = unroll(ctx, policy, s, depth, hyps, arrive=True, abort=False)
    stalled = [z3.Implies(t < c.max_model_len, stall) for t, stall in enumerate(stalls(ctx, steps, hw, "t"))]
    answer = satisfiable(ctx, hyps + stalled, opts.timeout_s, negate=True)
    if answer.model is None:
        return answer.status, None, answer.reason
    model = minimize(ctx, hyps + stalled, witness_objectives(s), min(opts.timeout_s, 10.0)) or answer.model
    mml = value(model, c.max_model_len)
    return answer.status, run_witness(model, ctx, s, steps[:mml]), f"a stall of max_model_len={mml} steps (the run below)"


def stalls(ctx: Ctx, steps: list[Any], hw: list[Any], name: str) -> list[Any]:
    """Per step of ``steps`` (each with ``before``, ``step`` and ``out``): it is a stall as ``Progress``
    sees it (live requests, and none ends or computes a position past its high-water mark). ``hw``: each
    slot's high-water mark before the first step; a slot that receives an arrival before a step
    (``arrived``, where the steps have it) starts again at 0."""
    n = len(hw)
    out = []
    for t, rec in enumerate(steps):
        plan = rec.step.plan
        if getattr(rec, "arrived", None) is not None:
            hw = [z3.If(rec.arrived[i], 0, hw[i]) for i in range(n)]
        reach = [plan.start[i] + plan.ntok[i] for i in range(n)]
        advanced = z3.Or([z3.Or(rec.out.stops[i], plan.rej[i], z3.And(plan.sched[i], reach[i] > hw[i]))
                          for i in range(n)])
        out.append(z3.And(z3.Or([sl.live for sl in rec.before.slots]), z3.Not(advanced)))
        hw = [ctx.define(f"{name}{t + 1}_hw{i}", z3.If(z3.And(plan.sched[i], reach[i] > hw[i]), reach[i], hw[i]))
              for i in range(n)]
    return out


def run_witness(model: z3.ModelRef, ctx: Ctx, s: State, steps: list[BmcStep], extra: dict[str, list[Any]] | None = None
                ) -> dict[str, Any]:
    """A counterexample run, readable: the config, the starting state (``slots``, with ``extra`` per slot)
    and, per step, the state the step was planned on (after the client's arrivals and aborts) with its
    plan and whether each request ends in it (``steps``)."""
    out = state_values(model, s, extra=extra)
    out["config"] = ctx.cfg.evaluate(model)
    out["steps"] = []
    for rec in steps:
        row = state_values(model, rec.before, rec.step.plan, extra={"ends": rec.out.stops})
        out["steps"].append({"step": len(out["steps"]), "free": row["free"], "slots": row["slots"]})
    return out


# --- bounded preemptions -------------------------------------------------------------------------------------


def preemption_bounds(ctx: Ctx, s: State, cap: int, name: str = "") -> list[Any]:
    """``BoundedPreemptions``' bound ``P`` per slot, capped at ``cap``: the live requests ranked by age
    (slot order: the order of addition, as the monitor's stable sort by arrival step and time),
    ``P(1) = 0``, ``P(i + 1) = P(i) + (P(i) + 1) * max_blocks(i)``. Capped at ``cap`` (a run of ``cap``
    steps preempts a request at most ``cap`` times, so ``count <= P`` iff ``count <= min(P, cap)``), the
    product is a case split on ``P(i)``'s value: linear."""
    total: Any = z3.IntVal(0)
    out = []
    for i, sl in enumerate(s.slots):
        out.append(total)
        blocks = max_blocks_needed(ctx, sl.p, sl.mt)
        grown = total + _sum([z3.If(total == k, (k + 1) * blocks, 0) for k in range(cap + 1)])
        total = ctx.define(f"{name}pbound{i + 1}", z3.If(sl.live, z3.If(grown >= cap, cap, grown), total))
    return out


def bounded_preemptions_query(opts: Options, policy: str, depth: int) -> tuple[str, Any, str]:
    """Is there a run of ``depth`` steps without arrivals (the monitor counts after the last one), EOS
    and client aborts free, from a state satisfying ``Inv`` and ``Ord`` (the state the first counted step
    is planned on, whose live requests the monitor ranks), in which a request is preempted more often than
    its bound? (``proved``: none.)"""
    ctx = setup(opts)
    n = opts.slots
    s, hyps = start_state(ctx, n)
    bounds = preemption_bounds(ctx, s, depth)
    steps = unroll(ctx, policy, s, depth, hyps, arrive=False, abort=True)
    counts = [_sum([z3.If(rec.step.plan.pre[i], 1, 0) for rec in steps]) for i in range(n)]
    over = z3.Or([z3.And(s.slots[i].live, counts[i] > bounds[i]) for i in range(n)])
    answer = satisfiable(ctx, hyps + [over], opts.timeout_s, negate=True)
    if answer.model is None:
        return answer.status, None, answer.reason
    model = minimize(ctx, hyps + [over], witness_objectives(s), min(opts.timeout_s, 10.0)) or answer.model
    witness = run_witness(model, ctx, s, steps, extra={"preemptions": counts, "bound": bounds})
    over_by = [f"slot {i}: {value(model, counts[i])} > {value(model, bounds[i])}" for i in range(n)
               if z3.is_true(model.eval(z3.And(s.slots[i].live, counts[i] > bounds[i]), model_completion=True))]
    return answer.status, witness, "preempted more often than the bound (" + "; ".join(over_by) + "; the run below)"


# --- cover goals ----------------------------------------------------------------------------------------------


CoverGoal = Callable[[Ctx, Run, int], Any]


def _last_arrival_by(r: Run, t: int) -> Any:
    """Every request that arrives within the run has arrived by step ``t`` (``t`` is after the last
    arrival, as ``bounded-preemptions`` counts)."""
    depth = len(r.steps)
    return z3.And([z3.Or(a <= t, a >= depth) for a in r.arrival])


def _preemption(ctx: Ctx, r: Run, t: int) -> Any:
    return r.steps[t].step.any_preempted


def _recompute(ctx: Ctx, r: Run, t: int) -> Any:
    rec = r.steps[t]
    return z3.Or([z3.And(sl.st == PREEMPTED, rec.step.plan.sched[i]) for i, sl in enumerate(rec.before.slots)])


def _admission_at_cap(ctx: Ctx, r: Run, t: int) -> Any:
    rec = r.steps[t]
    atoms = [rule_atoms(rec.before, rec.step.plan, i) for i in range(rec.before.n)]
    after = _sum([a.running - a.preempted + a.admitted for a in atoms])
    return z3.And(_sum([a.admitted for a in atoms]) >= 1, after == ctx.cfg.max_num_seqs)


def _abort_mid_prefill(ctx: Ctx, r: Run, t: int) -> Any:
    arrived = r.arrived[t].slots
    return z3.Or([z3.And(r.aborted[t][i], arrived[i].running, arrived[i].nc >= 1, arrived[i].nc < arrived[i].p)
                  for i in range(len(arrived))])


def _preemption_after_last_arrival(ctx: Ctx, r: Run, t: int) -> Any:
    return z3.And(_last_arrival_by(r, t), _preemption(ctx, r, t))


def _preempted_twice_after_last_arrival(ctx: Ctx, r: Run, t: int) -> Any:
    """A request preempted in step ``t`` and in an earlier step after the last arrival."""
    n = len(r.arrival)
    return z3.Or([z3.And(_last_arrival_by(r, t0), r.steps[t0].step.plan.pre[i], r.steps[t].step.plan.pre[i])
                  for t0 in range(t) for i in range(n)])


PROGRESS_COVERS: dict[str, CoverGoal] = {
    "preemption": _preemption,
    "recompute after a preemption": _recompute,
    "admission at max_num_seqs": _admission_at_cap,
    "abort mid-prefill": _abort_mid_prefill,
}
"""What the progress check must reach from the initial state for its bound to mean something."""

PREEMPTION_COVERS: dict[str, CoverGoal] = {
    "preemption after the last arrival": _preemption_after_last_arrival,
    "a request preempted twice after the last arrival": _preempted_twice_after_last_arrival,
    "recompute after a preemption": _recompute,
}
"""What the bounded-preemptions check must reach: preemptions where the monitor counts them, and a count
above one (so the bound is exercised beyond ``P = 0``)."""

REPLAY_LIMIT = 64
"""The largest ``num_kv_blocks``, prompt and ``max_tokens`` of a run the reference replays (cover goals, and
counterexamples searched from Init): small numbers reach every goal, and an integer a model leaves
unbounded could otherwise be a prompt of billions of tokens to simulate."""

COVER_FIRST_DEPTH = 4
COVER_FIRST_SLOTS = 2
"""Cover goals are searched first with 2 requests in runs of 4 steps, then in runs of K, then with N
requests (a run of fewer requests is a run of the N-slot unrolling too, with slots left empty): a smaller
run is a much smaller query."""


def cover_goals(opts: Options, policy: str, depth: int, goals: dict[str, CoverGoal], bounded_len: bool = True
                ) -> list[Coverage]:
    """Each of ``goals``, searched from ``Init`` (requests arriving at any step, EOS and client aborts
    free; with ``bounded_len``, ``max_model_len <= K`` as in the progress check) within K steps and replayed
    on the reference:
    :class:`Coverage` with the step at which the run found reaches it (``unsat``: not within K;
    ``unconfirmed``: the reference's run does not reach it)."""
    found: dict[str, Coverage] = {}
    sizes = sorted({min(COVER_FIRST_SLOTS, opts.slots), opts.slots})
    for n, d in [(n, d) for n in sizes for d in sorted({min(COVER_FIRST_DEPTH, depth), depth})]:
        missing = {g: f for g, f in goals.items() if g not in found or not found[g].reached}
        if not missing:
            break
        for cover in _cover_run(dataclasses.replace(opts, slots=n), policy, d, depth, missing, bounded_len):
            if cover.case in found:
                cover.seconds += found[cover.case].seconds
            found[cover.case] = cover
    return [found[goal] for goal in goals]


def _cover_run(opts: Options, policy: str, steps: int, depth: int, goals: dict[str, CoverGoal], bounded_len: bool
               ) -> list[Coverage]:
    ctx = setup(opts)
    n = opts.slots
    r = run_from_init(ctx, policy, n, steps, eos=True, aborts=True, layout=bmc_layout(policy))
    c = ctx.cfg
    solver = z3.Solver()
    solver.set("timeout", max(1, int(opts.timeout_s * 1000)))
    # the configs the bounded check covers (progress: max_model_len <= K): a cover reached only with a
    # longer max_model_len would say nothing about them
    solver.add(c.valid(), *ctx.facts, c.num_kv_blocks <= REPLAY_LIMIT)
    solver.add(*[z3.And(p <= REPLAY_LIMIT, mt <= REPLAY_LIMIT) for p, mt in zip(r.prompt, r.max_tokens, strict=True)])
    if bounded_len:
        solver.add(c.max_model_len <= depth)
    out = []
    for goal, at in goals.items():
        timer = Timer()
        per_step = [at(ctx, r, t) for t in range(steps)]
        solver.push()
        solver.add(z3.Or(per_step))
        answer = solver.check()
        reached = None
        status = "sat" if answer == z3.sat else "unsat" if answer == z3.unsat else UNKNOWN
        if answer == z3.sat:
            model = solver.model()
            reached = next(t + 1 for t, g in enumerate(per_step) if z3.is_true(model.eval(g, model_completion=True)))
            if not replay_cover(model, ctx, r, policy, goal, reached - 1):
                status = UNCONFIRMED
        solver.pop()
        out.append(Coverage(goal, status, reached if reached is not None else steps, timer.seconds, n))
    return out


def replay_cover(model: z3.ModelRef, ctx: Ctx, r: Run, policy: str, goal: str, step: int) -> bool:
    """Run the cover witness in ``model`` on the Python reference scheduler of ``policy`` (its ``plan``
    and the spec's actions): the same config, requests, arrivals, aborts and EOS, step by step; True
    when the reference reaches ``goal`` at ``step`` too (the encoding's run is the reference's run)."""
    from schedspec.reference.scheduler import SCHEDULERS
    from schedspec.spec.config import SchedulerConfig
    from schedspec.spec.state import samples_this_step
    from schedspec.spec.workload import EOS_TOKEN_ID, RequestSpec

    config = SchedulerConfig(**ctx.cfg.evaluate(model))
    scheduler = SCHEDULERS[policy](config)
    n = len(r.arrival)
    ids = [f"r{i}" for i in range(n)]
    arrival = [value(model, a) for a in r.arrival]
    last = max((a for a in arrival if a < len(r.steps)), default=0)
    preempted_at: dict[str, list[int]] = {}

    def true(term: Any) -> bool:
        return z3.is_true(model.eval(term, model_completion=True))

    for t in range(step + 1):
        for i in range(n):
            if arrival[i] == t:
                spec = RequestSpec(ids[i], value(model, r.prompt[i]), value(model, r.max_tokens[i]), arrival_step=t)
                scheduler.add_request(spec.to_request(t))
        before_abort = scheduler.state
        aborted = [ids[i] for i in range(n) if true(r.aborted[t][i])]
        for request_id in aborted:
            scheduler.abort_request(request_id)
        state = scheduler.state
        plan = scheduler.schedule()
        for request_id in plan.preempted:
            preempted_at.setdefault(request_id, []).append(t)
        if t == step:
            return _reached(goal, config, before_abort, aborted, state, plan, preempted_at, last, t)
        sampled = {item.request_id: EOS_TOKEN_ID if true(r.eos[t][ids.index(item.request_id)]) else 1
                   for item in plan.scheduled if samples_this_step(state.requests[item.request_id], item)}
        scheduler.update(plan, sampled)
    return False


def _reached(goal: str, config: Any, before_abort: Any, aborted: list[str], state: Any, plan: Any,
             preempted_at: dict[str, list[int]], last: int, t: int) -> bool:
    """Does the reference's step ``t`` (``state`` after the client's actions, ``plan``) reach ``goal``?"""
    from schedspec.spec.request import RequestStatus

    admitted = [i for i in plan.scheduled if i.request_id in state.waiting]
    if goal == "preemption":
        return bool(plan.preempted)
    if goal == "recompute after a preemption":
        return any(state.requests[i.request_id].status is RequestStatus.PREEMPTED for i in admitted)
    if goal == "admission at max_num_seqs":
        return bool(admitted) and len(state.running) - len(plan.preempted) + len(admitted) == config.max_num_seqs
    if goal == "abort mid-prefill":
        return any(rid in before_abort.running and 1 <= before_abort.requests[rid].num_computed_tokens
                   < before_abort.requests[rid].prompt_len for rid in aborted)
    if goal == "preemption after the last arrival":
        return t >= last and bool(plan.preempted)
    if goal == "a request preempted twice after the last arrival":
        return any(len([s for s in steps if s >= last]) >= 2 and t in steps for steps in preempted_at.values())
    raise KeyError(goal)


# --- the same properties on runs from Init (a counterexample found above becomes a scenario) ---------------------


def progress_from_init(ctx: Ctx, r: Run) -> Any:
    """``Progress`` reports on the run from Init: ``max_model_len`` consecutive steps with live requests in
    which no request ends and none computes a position past its high-water mark (0 at its arrival)."""
    c = ctx.cfg
    depth = len(r.steps)
    # each slot receives one request in the run, so its high-water mark starts (and stays until then) at 0
    stalled = stalls(ctx, r.steps, [z3.IntVal(0)] * len(r.arrival), "init_")
    return z3.Or([z3.And(start + c.max_model_len <= depth,
                         *[z3.Implies(t < start + c.max_model_len, stalled[t]) for t in range(start, depth)])
                  for start in range(depth)])


def bounded_preemptions_from_init(ctx: Ctx, r: Run) -> Any:
    """``BoundedPreemptions`` reports on the run from Init: with ``L`` the step of the last arrival, some
    request live at ``L`` is preempted in steps ``L, L + 1, ...`` more often than its bound from the state
    at ``L`` (the monitor's reset at each arrival)."""
    n = len(r.arrival)
    depth = len(r.steps)
    options = []
    for last in range(depth):
        is_last = z3.And(z3.Or([a == last for a in r.arrival]), *[z3.Or(a <= last, a >= depth) for a in r.arrival])
        before = r.steps[last].before
        bounds = preemption_bounds(ctx, before, depth, name=f"init{last}_")
        counts = [_sum([z3.If(r.steps[t].step.plan.pre[i], 1, 0) for t in range(last, depth)]) for i in range(n)]
        options.append(z3.And(is_last, z3.Or([z3.And(before.slots[i].live, counts[i] > bounds[i]) for i in range(n)])))
    return z3.Or(options)


# --- the theorems ---------------------------------------------------------------------------------------------


def _bmc_theorem(name: str, statement: str, policy: str, query: Callable[[Options, str, int], tuple[str, Any, str]],
                 covers: dict[str, CoverGoal], bounded_len: bool, prop: str, from_init: Callable[[Ctx, Run], Any]
                 ) -> Theorem:
    def run(opts: Options) -> Result:
        timer = Timer()
        depth = opts.depth
        local = bmc_options(opts)
        status, detail, witness = layout_lemmas(local, policy)
        scenario, replayed = None, None
        if status == PROVED:
            status, witness, detail = query(local, policy, depth)
            if status == COUNTEREXAMPLE and opts.block == "uninterpreted":
                status, detail = recheck_block_size(local, lambda o: query(o, policy, depth)[:2])
            if status == COUNTEREXAMPLE:
                # the run above starts from a state satisfying Inv and Ord, which need not be reachable: is
                # there a run from Init on which the monitor reports? it becomes a scenario replay reproduces
                from .theorems import search_from_init

                fixed = bmc_options(opts, fixed_block=True)
                found, scenario, replayed, why = search_from_init(
                    fixed, policy, prop, f"counterexample-{name.replace('/', '-')}", f"{statement} (found by Z3)",
                    from_init, bounds=lambda ctx: [ctx.cfg.num_kv_blocks <= REPLAY_LIMIT], slots=local.slots,
                    depth=depth, layout=bmc_layout(policy))
                detail += (f"; reached from Init: scenario {scenario['name']} ({why})" if scenario is not None else
                           f"; not reached from Init with {local.slots} requests in {depth} steps ({found})")
        found_covers = cover_goals(bmc_options(opts, fixed_block=True), policy, depth, covers, bounded_len)
        return Result(name, statement, PROVED, status, local.slots, local.block_label, depth, timer.seconds,
                      detail=detail, witness=witness, vacuity=found_covers, scenario=scenario, replayed=replayed)

    return Theorem(name, statement, run, bmc=True)


def progress_window(policy: str) -> Theorem:
    return _bmc_theorem(
        f"{policy}/progress",
        "progress (window): from any state satisfying Inv and Ord, with any arrivals, no max_model_len "
        "consecutive steps with live requests pass without a request ending or computing a position it never "
        "computed; checked for every config with max_model_len <= K", policy, progress_query, PROGRESS_COVERS,
        bounded_len=True, prop="progress", from_init=progress_from_init)


def bounded_preemptions(policy: str) -> Theorem:
    return _bmc_theorem(
        f"{policy}/bounded-preemptions",
        "bounded-preemptions: from any state satisfying Inv and Ord (after the last arrival), in every run of K "
        "steps with any EOS and client aborts, the i-th oldest live request is preempted at most P(i) times "
        "(P(1) = 0, P(i+1) = P(i) + (P(i) + 1) * max_blocks(i)); checked for every config",
        policy, bounded_preemptions_query, PREEMPTION_COVERS, bounded_len=False, prop="bounded-preemptions",
        from_init=bounded_preemptions_from_init)


__all__ = ["bounded_preemptions", "bmc_options", "cover_goals", "layout_lemmas", "progress_window", "replay_cover",
           "PROGRESS_COVERS", "PREEMPTION_COVERS"]
