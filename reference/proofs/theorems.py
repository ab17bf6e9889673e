"""Per-policy theorems: the policy refines the spec and keeps the trace properties it declares; and
counterexamples, as replayable scenarios, for properties a policy is known to break.

One-step theorems quantify over every state satisfying the spec's inductive invariant ``Inv`` (proved
by :mod:`schedspec.spec.proofs.theorems`) and, for fcfs and static, the ordering invariant ``Ord``
(:func:`.properties.order_invariant`, proved inductive here). What is not inductive on its own is
checked by bounded model checking to depth K (``progress`` as the window property) or searched for
from the initial state (counterexamples).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import z3

from schedspec.spec.proofs.core import (
    COUNTEREXAMPLE,
    PROVED,
    UNKNOWN,
    Coverage,
    Options,
    Result,
    Theorem,
    Timer,
)
from schedspec.spec.proofs.encoding import (
    PLAN_FIELDS,
    RULE_ORDER,
    Ctx,
    State,
    _sum,
    abort,
    allowed_rules,
    apply_plan,
    arrive,
    arrive_precondition,
    fits_alone,
    plan_well_formed,
    symbolic_state,
)
from schedspec.spec.proofs.solve import Prover, minimize, satisfiable, state_values, witness_objectives
from schedspec.spec.proofs.theorems import inv_parts, recheck_block_size, setup, step_cases
from schedspec.spec.properties import ITL_TOKEN_BUDGET

from .bmc import bounded_preemptions, progress_window
from .policy import POLICIES, plan_step
from .properties import (
    ORDER_INVARIANT_NAMES,
    bounded_itl_violation,
    monitor_key_less,
    monitor_oldest,
    order_invariant,
    rejects_impossible_violation,
    run_from_init,
    stall_free_violation,
    work_conserving_violation,
)
from .scenarios import confirm, scenario_from_run

ORDERED = ("fcfs", "static")
"""Policies that keep the ordering invariant (admission in queue order)."""


class Setup:
    """A symbolic state of N slots, the policy's step from it, and the hypotheses about it, with an
    incremental prover. Built once per (policy, options) and shared by the theorems of one run."""

    _cache: dict[tuple[Any, ...], Setup] = {}

    def __init__(self, opts: Options, policy: str, ordered: bool) -> None:
        self.opts = opts
        self.policy = policy
        self.ctx: Ctx = setup(opts)
        self.s: State = symbolic_state(opts.slots, "s")
        self.step = plan_step(self.ctx, self.s, policy, layout="canonical")
        self.plan = self.step.plan
        # the slots in processing order: every state has such a slot permutation, and every hypothesis and
        # goal below is symmetric in the slots (goals about one slot are stated for each slot)
        self.hyps = [self.ctx.cfg.valid()] + list(self.step.layout_hypothesis) + list(inv_parts(self.ctx, self.s).values())
        if ordered:
            self.hyps += list(order_invariant(self.ctx, self.s).values())
        self.prover = Prover(self.ctx, self.hyps, opts.timeout_s)
        self.lemma_status: tuple[str, str] | None = None
        self._vacuity: dict[str, list[Coverage]] = {}
        self.lemma_witness: dict[str, Any] | None = None
        self.all_lemmas = self.step.lemmas + (self.step.ordered_lemmas if ordered else [])

    @classmethod
    def get(cls, opts: Options, policy: str, ordered: bool | None = None, fixed: dict[str, Any] | None = None
            ) -> Setup:
        if fixed:
            opts = dataclasses.replace(opts, fixed={**opts.fixed, **fixed})
        ordered = policy in ORDERED if ordered is None else ordered
        key = (policy, ordered, repr(opts))
        if key not in cls._cache:
            cls._cache.clear()  # one at a time: each holds a solver
            cls._cache[key] = cls(opts, policy, ordered)
        return cls._cache[key]

    def lemmas(self) -> tuple[str, str]:
        """Prove the step's lemmas in order (each from the hypotheses and the lemmas before it) and assume
        them. Returns ``(status, detail)``: proved unless one is not."""
        if self.lemma_status is None:
            self.lemma_status = (PROVED, f"{len(self.all_lemmas)} lemmas")
            for name, lemma in self.all_lemmas:
                answer = self.prover.prove(lemma)
                if answer.status != PROVED:
                    refuted = answer.status == COUNTEREXAMPLE
                    self.lemma_status = (answer.status if refuted else UNKNOWN,
                                         f"lemma {name}: {'refuted (witness attached)' if refuted else answer.status} "
                                         f"{answer.reason}".strip())
                    if answer.model is not None:
                        self.lemma_witness = state_values(answer.model, self.s, self.plan)
                    break
                self.prover.assume([lemma])
        return self.lemma_status

    def cases(self) -> dict[str, Any]:
        """The interesting cases of the policy's step (:func:`schedspec.spec.proofs.theorems.step_cases`):
        a preemption, an admission filling the last sequence slot, a stop, a rejection."""
        eos = [z3.Bool(f"vac_eos{i}") for i in range(self.s.n)]
        out = apply_plan(self.ctx, self.s, self.plan, eos)
        return step_cases(self.ctx, self.s, self.plan, out)

    def vacuity(self, extra: list[Any] | None = None) -> list[Coverage]:
        """The premises (with ``extra``) are satisfiable, alone and with each of :meth:`cases`."""
        key = repr(extra)
        if key not in self._vacuity:
            if self.lemmas()[0] != PROVED:
                return []
            self._vacuity[key] = self.prover.coverage(self.cases(), z3.And(extra) if extra else None)
        return self._vacuity[key]

    def prove(self, goal: Any, extra: list[Any] | None = None) -> tuple[str, Any, str]:
        status, detail = self.lemmas()
        if status != PROVED:
            return status, self.lemma_witness, detail
        if extra:
            goal = z3.Implies(z3.And(extra), goal)
        answer = self.prover.prove(goal)
        model = answer.model
        if model is not None:  # the reported witness: fewest live requests, smallest numbers
            lemmas = [lemma for _, lemma in self.all_lemmas]
            model = minimize(self.ctx, self.hyps + lemmas + [z3.Not(goal)], witness_objectives(self.s, self.plan),
                             min(self.opts.timeout_s, 10.0)) or model
        witness = state_values(model, self.s, self.plan) if model is not None else None
        if witness is not None:
            witness["config"] = self.ctx.cfg.evaluate(model)
        return answer.status, witness, answer.reason


def _constants(exprs: list[Any]) -> list[Any]:
    """The uninterpreted constants (variables) of ``exprs``, each once."""
    seen: set[int] = set()
    found: dict[int, Any] = {}
    stack = list(exprs)
    while stack:
        e = stack.pop()
        if e.get_id() in seen:
            continue
        seen.add(e.get_id())
        if z3.is_const(e) and e.decl().kind() == z3.Z3_OP_UNINTERPRETED:
            found[e.get_id()] = e
        elif z3.is_app(e):
            stack.extend(e.children())
    return list(found.values())


def step_unique(policy: str) -> Theorem:
    name = f"{policy}/step-unique"
    statement = (f"the encoded {policy} step is a function of the state: from every state satisfying the premises "
                 "(Inv, Ord, slots in processing order), two solutions of its constraints give the same plan; "
                 "proved by induction: layer by layer along the definitions' order, then slot by slot along the "
                 "admission order (the one recursion), each step a solver query")

    def run(opts: Options) -> Result:
        timer = Timer()
        opts = policy_options(opts)
        ctx = setup(opts)
        s = symbolic_state(opts.slots, "s")
        step = plan_step(ctx, s, policy, layout="canonical")
        premises = [ctx.cfg.valid(), *step.layout_hypothesis, *inv_parts(ctx, s).values()]
        if policy in ORDERED:
            premises += list(order_invariant(ctx, s).values())
        n = opts.slots
        A = step.admission_order
        guards = {A[j][i].get_id(): (j, i) for j in range(n) for i in range(n) if j != i and A}
        order, why = definitional_order(list(ctx.facts), _constants(premises), guards, step.admission_index)
        prover = Prover(ctx, premises, opts.timeout_s)
        vacuity = prover.coverage({})
        if not order:
            return Result(name, statement, PROVED, UNKNOWN, opts.slots, opts.block_label, seconds=timer.seconds,
                          detail=why, vacuity=vacuity)
        defined = [f.arg(0) for f in order]
        primed = [(v, z3.Const(v.decl().name() + "'", v.sort())) for v in defined]
        prover.assume([z3.substitute(z3.And(ctx.facts), *primed)])

        def same(variables: list[Any]) -> Any:
            return z3.And([v == z3.substitute(v, *primed) for v in variables])

        # the layers: a variable's depth is one more than the deepest variable its definition uses outside
        # the admission order's guards; the admission loop's variables (guarded uses) come last, by slot
        index = step.admission_index
        depth: dict[int, int] = {}
        for f in order:
            v = f.arg(0)
            if v.get_id() in index:
                continue
            used = _guarded_uses(f.arg(1), guards, index, None)[0]
            depth[v.get_id()] = 1 + max((depth[u] for u in used if u in depth), default=0)
        layers: dict[int, list[Any]] = {}
        for v in defined:
            if v.get_id() in depth:
                layers.setdefault(depth[v.get_id()], []).append(v)
        by_slot: dict[int, list[Any]] = {}
        for v in defined:
            if v.get_id() in index:
                by_slot.setdefault(index[v.get_id()], []).append(v)
        status, detail, witness = PROVED, "", None
        steps: list[tuple[str, Any, Any]] = []
        if by_slot:  # the induction along the admission order needs it well founded
            steps.append(("admission order a strict order", strict_order(A, n), True))
        steps += [(f"layer {d}", layers[d], None) for d in sorted(layers)]
        steps += [(f"admission slot {i}", by_slot[i],
                   z3.And([z3.Implies(A[j][i], same(by_slot.get(j, []))) for j in range(n) if j != i]))
                  for i in sorted(by_slot)]
        for label, variables, hypothesis in steps:
            if hypothesis is True:  # a plain goal
                goal = variables
            else:
                goal = same(variables) if hypothesis is None else z3.Implies(hypothesis, same(variables))
            answer = prover.prove(goal)
            if answer.status != PROVED:
                status, detail = answer.status, f"{label}: {answer.status} {answer.reason}".strip()
                witness = state_values(answer.model, s) if answer.model is not None else None
                break
            if hypothesis is None:
                prover.assume([same(variables)])
        if status == PROVED:
            # every slot's admission variables agree (well-founded induction along the strict admission
            # order, step-total), so the plan, a term over the state and the variables, is one plan
            prover.assume([same(v) for v in by_slot.values()])
            differs = [t != z3.substitute(t, *primed) for f in PLAN_FIELDS for t in getattr(step.plan, f)]
            answer = prover.prove(z3.Not(z3.Or(differs)))
            status = answer.status
            detail = (f"{len(defined)} step variables in {len(layers)} layers and {len(by_slot)} admission slots"
                      if status == PROVED else f"plan: {answer.status} {answer.reason}".strip())
        return Result(name, statement, PROVED, status, opts.slots, opts.block_label, seconds=timer.seconds,
                      detail=detail, witness=witness, vacuity=vacuity)

    return Theorem(name, statement, run)


def _guarded_uses(expr: Any, guards: dict[int, tuple[int, int]], index: dict[int, int], owner: int | None
                  ) -> tuple[set[int], list[tuple[int, int]]]:
    """The constants ``expr`` uses outside guarded positions, and the guarded uses ``(j, i)``: a variable
    of slot ``j`` used only under ``If(order[j][i], ...)`` or ``Implies(order[j][i], ...)`` in the
    definition of a variable of slot ``i == owner``. A branch under a literal ``False`` is never used."""
    free: set[int] = set()
    guarded: list[tuple[int, int]] = []
    stack: list[tuple[Any, int | None]] = [(expr, None)]
    seen: set[tuple[int, int | None]] = set()
    while stack:
        e, under = stack.pop()
        key = (e.get_id(), under)
        if key in seen:
            continue
        seen.add(key)
        if z3.is_const(e) and e.decl().kind() == z3.Z3_OP_UNINTERPRETED:
            if under is not None and index.get(e.get_id()) == under:
                guarded.append((under, owner))
            else:
                free.add(e.get_id())
            continue
        if not z3.is_app(e):
            continue
        children = e.children()
        branching = z3.is_app_of(e, z3.Z3_OP_ITE) or z3.is_app_of(e, z3.Z3_OP_IMPLIES)
        g = guards.get(children[0].get_id()) if branching else None
        if branching and z3.is_false(children[0]):
            stack.extend((c, under) for c in children[2:])
        elif g is not None and owner is not None and g[1] == owner:
            stack.append((children[0], under))
            stack.append((children[1], g[0]))
            stack.extend((c, under) for c in children[2:])
        else:
            stack.extend((c, under) for c in children)
    return free, guarded


def definitional_order(facts: list[Any], known: list[Any], guards: dict[int, tuple[int, int]] | None = None,
                       index: dict[int, int] | None = None) -> tuple[list[Any], str]:
    """If ``facts`` are definitions ``v == e``, each variable ``v`` (not in ``known``) defined once, and
    ordering them so that each ``e`` mentions only ``known`` constants and variables defined before exists,
    return ``(that order, "")``; else ``([], why not)``. With ``guards`` (z3 id of ``order[j][i]`` ->
    ``(j, i)``) and ``index`` (variable -> slot), a use of slot ``j``'s variable under ``order[j][i]`` in
    a definition for slot ``i`` is left out of the order (the caller proves ``order`` a strict order,
    which makes those uses well founded); the returned order then lists the rest."""
    guards = guards or {}
    index = index or {}
    known_ids = {c.get_id() for c in known}
    defs: dict[int, Any] = {}
    for f in facts:
        if not (z3.is_eq(f) and z3.is_const(f.arg(0)) and f.arg(0).decl().kind() == z3.Z3_OP_UNINTERPRETED):
            return [], f"not a definition: {str(f)[:80]}"
        v = f.arg(0)
        if v.get_id() in known_ids or v.get_id() in defs:
            return [], f"{v} defined twice or constrained by the premises"
        defs[v.get_id()] = f
    uses = {k: _guarded_uses(f.arg(1), guards, index, index.get(k))[0] for k, f in defs.items()}
    for k, used in uses.items():
        stray = used - known_ids - set(defs)
        if stray:
            return [], f"{defs[k].arg(0)} uses a variable neither known nor defined"
    order: list[Any] = []
    done: set[int] = set()
    pending = dict(uses)
    while pending:
        ready = [k for k, used in pending.items() if (used & set(defs)) <= done]
        if not ready:
            return [], f"circular definitions among {len(pending)} variables"
        for k in ready:
            order.append(defs[k])
            done.add(k)
            del pending[k]
    return order, ""


def strict_order(A: list[list[Any]], n: int) -> Any:
    """``A[j][i]`` (slot ``j`` before slot ``i``) is a strict order: asymmetric and transitive (irreflexive by
    construction, ``A[i][i]`` is false); on finitely many slots it is then well founded, so an induction
    along it (or a recursion guarded by it) is sound."""
    return z3.And([z3.Implies(z3.And(A[a][b], A[b][c]), A[a][c])
                   for a in range(n) for b in range(n) for c in range(n) if len({a, b, c}) == 3]
                  + [z3.Not(z3.And(A[a][b], A[b][a])) for a in range(n) for b in range(n) if a < b])


def step_total(policy: str) -> Theorem:
    name = f"{policy}/step-total"
    statement = (f"step existence: the encoded {policy} step is total and a function: each of its variables is "
                 "defined once by an equation over the state, the config and variables defined before (checked on "
                 "the formulas), so every state has exactly one plan; with refines, every Inv state has an allowed "
                 "plan, the one the policy returns")

    def run(opts: Options) -> Result:
        timer = Timer()
        opts = policy_options(opts)
        ctx = setup(opts)
        s = symbolic_state(opts.slots, "s")
        step = plan_step(ctx, s, policy, layout="canonical")
        premises = [ctx.cfg.valid(), *step.layout_hypothesis, *inv_parts(ctx, s).values()]
        n = opts.slots
        A = step.admission_order
        guards = {A[j][i].get_id(): (j, i) for j in range(n) for i in range(n) if j != i}
        order, why = definitional_order(list(ctx.facts), _constants(premises), guards, step.admission_index)
        prover = Prover(ctx, premises, opts.timeout_s)
        status, detail = (PROVED, f"{len(order)} definitions, acyclic") if order else (UNKNOWN, why)
        if order:
            # the admission loop's definitions use another slot's only under the admission order: it must be
            # a strict order (irreflexive by construction; transitive), so those uses are well founded
            answer = prover.prove(strict_order(A, n))
            if answer.status != PROVED:
                status, detail = answer.status, f"admission order not a strict order: {answer.status} {answer.reason}"
            else:
                detail += "; the admission order is a strict order"
        vacuity = prover.coverage({})
        return Result(name, statement, PROVED, status, opts.slots, opts.block_label, seconds=timer.seconds,
                      detail=detail, vacuity=vacuity)

    return Theorem(name, statement, run)


def step_lemmas(policy: str) -> Theorem:
    name = f"{policy}/step-lemmas"
    statement = (f"lemmas of the encoded {policy} step (used by the theorems below): the free pool never goes "
                 "negative, the victims preempted always free enough blocks, sums over slots equal sums over "
                 "the processing order, admission fits the budget and the pool")

    def run(opts: Options) -> Result:
        timer = Timer()
        opts = policy_options(opts)
        st = Setup.get(opts, policy)
        status, detail = st.lemmas()
        return Result(name, statement, PROVED, status, opts.slots, opts.block_label, seconds=timer.seconds,
                      detail=detail if status != PROVED else "", vacuity=st.vacuity(), witness=st.lemma_witness)

    return Theorem(name, statement, run)


def one_step(name: str, statement: str, policy: str, goal: Callable[[Setup], Any],
             extra: Callable[[Setup], list[Any]] | None = None, fixed: dict[str, Any] | None = None,
             ordered: bool | None = None, monitor: tuple[str, Callable[[Ctx, Any, Any], Any]] | None = None,
             vacuity_extra: Callable[[Setup], list[Any]] | None = None) -> Theorem:
    """A theorem ``Inv (and Ord) and Step => goal`` checked in one query (re-checked with a fixed block
    size when an uninterpreted ``ceil`` gives a counterexample)."""

    def attempt(opts: Options) -> tuple[str, Any, str]:
        st = Setup.get(opts, policy, ordered, fixed)
        return st.prove(goal(st), extra(st) if extra else None)

    def run(opts: Options) -> Result:
        timer = Timer()
        opts = policy_options(opts)
        status, witness, detail = attempt(opts)
        st = Setup.get(opts, policy, ordered, fixed)
        vacuity = st.vacuity((extra(st) if extra else []) + (vacuity_extra(st) if vacuity_extra else []) or None)
        scenario, replayed = None, None
        if status == COUNTEREXAMPLE and not detail.startswith("lemma"):  # a refuted lemma keeps its name
            detail = "a state satisfying the hypotheses from which the step breaks it (witness attached)"
            if opts.block == "uninterpreted":
                status, detail = recheck_block_size(opts, lambda o: attempt(o)[:2])
        if status == COUNTEREXAMPLE and monitor is not None and not detail.startswith("lemma"):
            # is it reachable? a run from Init whose monitor reports becomes a scenario replay reproduces
            prop, violation = monitor
            found, scenario, replayed, why = search_from_init(
                opts, policy, prop, f"counterexample-{name.replace('/', '-')}", f"{statement} (found by Z3)",
                lambda ctx, r: z3.Or([violation(ctx, rec.before, rec.step.plan) for rec in r.steps]), bounds=_small)
            detail += ("; reached from Init: scenario " + scenario["name"] + f" ({why})" if scenario is not None else
                       f"; not reached from Init with 3 requests in 3 steps ({found})")
        return Result(name, statement, PROVED, status, opts.slots, opts.block_label, seconds=timer.seconds,
                      detail=detail, witness=witness, vacuity=vacuity, scenario=scenario, replayed=replayed)

    return Theorem(name, statement, run)


# --- refinement and the ordering invariant -------------------------------------------------------------


def refines(policy: str) -> Theorem:
    name = f"{policy}/refines"
    statement = (f"Inv and Ord and plan = {policy}(s) => the plan is allowed: each of the {len(RULE_ORDER)} local "
                 "rules holds (and the plan is well formed)")

    def run(opts: Options) -> Result:
        timer = Timer()
        local = policy_options(opts)
        st = Setup.get(local, policy)
        goals = dict(allowed_rules(st.ctx, st.s, st.plan))
        goals["well-formed"] = plan_well_formed(st.plan)
        statuses = []
        witness = None
        for rule, goal in goals.items():
            status, w, reason = st.prove(goal)
            statuses.append((rule, status, reason))
            witness = witness or w
            if status != PROVED and reason.startswith("lemma"):
                break
        return _combine(name, statement, statuses, local, timer, witness, vacuity=st.vacuity())

    return Theorem(name, statement, run)


def policy_options(opts: Options) -> Options:
    """One-step policy theorems run at ``min(N, policy_slots)`` slots."""
    return dataclasses.replace(opts, slots=opts.policy_n)


def order_inductive(policy: str) -> Theorem:
    name = f"{policy}/ordering-invariant"
    statement = ("Ord is inductive: queues stay in arrival order, running requests are older than waiting ones, "
                 "running prefills hold blocks for their whole sequence (step, arrival, abort)")

    def run(opts: Options) -> Result:
        timer = Timer()
        opts = policy_options(opts)
        statuses = []
        witness = None
        # the step
        st = Setup.get(opts, policy)
        eos = [z3.Bool(f"eos{i}") for i in range(opts.slots)]
        out = apply_plan(st.ctx, st.s, st.plan, eos)
        goal = z3.And(list(order_invariant(st.ctx, out.state).values()))
        status, w, reason = st.prove(goal)
        statuses.append(("step", status, reason))
        witness = witness or w
        # an arrival (into the last slot: an empty slot is not processed, so the processing order may put
        # it last) and an abort (of each slot)
        st = Setup.get(opts, policy)
        ctx, s = st.ctx, st.s
        last = opts.slots - 1
        p, mt = z3.Int("new_p"), z3.Int("new_mt")
        actions = [("arrive", arrive_precondition(s, last, p, mt), arrive(ctx, s, last, p, mt))]
        actions += [(f"abort-{i}", s.slots[i].live, abort(ctx, s, i)) for i in range(opts.slots)]
        for action, pre, after in actions:
            status, _, reason = st.prove(z3.Implies(pre, z3.And(list(order_invariant(ctx, after).values()))))
            statuses.append((action, status, reason))
        return _combine(name, statement, statuses, opts, timer, witness, vacuity=st.vacuity())

    return Theorem(name, statement, run)


def _combine(name: str, statement: str, statuses: list[tuple[str, str, str]], opts: Options, timer: Timer,
             witness: Any = None, depth: int | None = None, vacuity: list[Coverage] | None = None) -> Result:
    vacuity = vacuity or []
    bad = [(part, status, reason) for part, status, reason in statuses if status != PROVED]
    if not bad:
        return Result(name, statement, PROVED, PROVED, opts.slots, opts.block_label, depth, timer.seconds,
                      witness=None, vacuity=vacuity)
    status = COUNTEREXAMPLE if any(s == COUNTEREXAMPLE for _, s, _ in bad) else UNKNOWN
    detail = "; ".join(f"{part}: {s}{' (' + r + ')' if r else ''}" for part, s, r in bad)
    return Result(name, statement, PROVED, status, opts.slots, opts.block_label, depth, timer.seconds,
                  detail=detail, witness=witness, vacuity=vacuity)


# --- one-step properties ---------------------------------------------------------------------------------


def work_conserving(policy: str) -> Theorem:
    return one_step(
        f"{policy}/work-conserving",
        "work-conserving: with budget left, every running request is scheduled or preempted, and (no preemption, "
        "a sequence slot free) the head of the waiting queue does not fit",
        policy, lambda st: z3.Not(work_conserving_violation(st.ctx, st.s, st.plan)),
        monitor=("work-conserving", work_conserving_violation))


def stall_free(policy: str) -> Theorem:
    return one_step(
        f"{policy}/stall-free-decode",
        "stall-free-decode: in a step without preemption whose running decodes fit the budget, each gets "
        "exactly one token", policy, lambda st: z3.Not(stall_free_violation(st.ctx, st.s, st.plan)),
        monitor=("stall-free-decode", stall_free_violation))


def rejects_impossible(policy: str) -> Theorem:
    return one_step(
        f"{policy}/rejects-impossible",
        "rejects-impossible: a waiting, never-admitted request is rejected iff it could never complete alone",
        policy, lambda st: z3.Not(rejects_impossible_violation(st.ctx, st.s, st.plan)),
        monitor=("rejects-impossible", rejects_impossible_violation))


def progress_step(policy: str) -> Theorem:
    def goal(st: Setup) -> Any:
        S = st.s.slots
        someone = z3.Or([sl.running for sl in S] + [z3.And(sl.waiting, z3.Not(st.step.rejected[i]))
                                                      for i, sl in enumerate(S)])
        return z3.Implies(someone, z3.Or(st.plan.tokens() > 0, st.step.any_preempted))

    return one_step(
        f"{policy}/progress-step",
        "one-step progress: if a request runs, or a waiting request is not rejected (so it fits alone), the step "
        "schedules tokens or preempts", policy, goal)


def itl_chunked(policy: str) -> Theorem:
    return one_step(
        f"{policy}/bounded-itl",
        f"bounded-itl with chunked prefill and max_num_batched_tokens <= {ITL_TOKEN_BUDGET}: a step carrying "
        f"a running decode computes <= {ITL_TOKEN_BUDGET} tokens",
        policy, lambda st: z3.Not(bounded_itl_violation(st.ctx, st.s, st.plan)),
        extra=lambda st: [st.ctx.cfg.enable_chunked_prefill,
                          st.ctx.cfg.max_num_batched_tokens <= ITL_TOKEN_BUDGET])


# --- bounded wait: a ranking function -----------------------------------------------------------------------


def bounded_wait(policy: str) -> Theorem:
    name = f"{policy}/bounded-wait"
    statement = ("bounded-wait by ranking: for the oldest live request o, rank = max_model_len - computed(o) "
                 "is in [1, max_model_len] while o lives and strictly decreases at every step o does not end "
                 "(o is never preempted), so o ends within max_model_len steps of becoming the oldest")

    def oldest(s: State, i: int) -> Any:
        S = s.slots
        return z3.And(S[i].live, *[z3.Implies(S[j].live, S[i].seq < S[j].seq) for j in range(s.n) if j != i])

    def run(opts: Options) -> Result:
        timer = Timer()
        opts = policy_options(opts)
        statuses = []
        witness = None
        # (1) decrease, for the oldest live request in each slot i
        st = Setup.get(opts, policy)
        eos = [z3.Bool(f"eos{i}") for i in range(opts.slots)]
        out = apply_plan(st.ctx, st.s, st.plan, eos)
        for i in range(opts.slots):
            o, o2 = st.s.slots[i], out.state.slots[i]
            decrease = z3.And(z3.Not(st.plan.pre[i]), z3.Implies(o2.live, o2.nc > o.nc))
            status, w, reason = st.prove(decrease, [oldest(st.s, i), z3.Not(st.step.rejected[i])])
            statuses.append((f"decrease-{i}", status, reason))
            witness = witness or w
        # (2) bounds: every live request has 0 <= computed <= max_model_len - 1
        st = Setup.get(opts, policy)
        mml = st.ctx.cfg.max_model_len
        bounds = z3.And([z3.Implies(sl.live, z3.And(sl.nc >= 0, sl.nc <= mml - 1)) for sl in st.s.slots])
        status, w, reason = st.prove(bounds)
        statuses.append(("bounds", status, reason))
        witness = witness or w
        # (3) the oldest by arrival order is the monitor's oldest (arrival step, running first, position)
        st = Setup.get(opts, policy)
        S = st.s.slots
        same = z3.And([z3.Implies(z3.And(S[i].live, S[j].live, S[i].seq < S[j].seq), monitor_key_less(S[i], S[j]))
                       for i in range(opts.slots) for j in range(opts.slots) if i != j])
        status, w, reason = st.prove(same)
        statuses.append(("oldest", status, reason))
        witness = witness or w
        oldest_waits = z3.Or([z3.And(oldest(st.s, i), z3.Not(st.step.rejected[i])) for i in range(opts.slots)])
        return _combine(name, statement, statuses, opts, timer, witness, vacuity=st.vacuity([oldest_waits]))

    return Theorem(name, statement, run)


def older_count(s: State, i: int) -> Any:
    """``older(i)``: the live requests added before request ``i`` (the first component of the measure)."""
    return _sum([z3.If(z3.And(s.slots[j].live, s.slots[j].seq < s.slots[i].seq), 1, 0)
                 for j in range(s.n) if j != i])


def oldest_by_seq(s: State, o: int) -> Any:
    S = s.slots
    return z3.And(S[o].live, *[z3.Implies(S[j].live, S[o].seq < S[j].seq) for j in range(s.n) if j != o])


def measure_glue() -> Any:
    """The arithmetic that turns the lexicographic decrease into the step bound, for all integers (no state):
    with ``0 <= q' <= q <= k`` (older requests), ``1 <= r, r' <= m`` (``m = max_model_len``, ``r =
    max_model_len - computed(oldest)``), ``M = q * m + r`` lies in ``[1, (k + 1) * m]``, a lexicographic
    decrease of ``(q, r)`` makes ``M`` drop by at least 1 and a lexicographic non-increase never raises it."""
    q, q2, r, r2, m, k = z3.Ints("glue_q glue_q2 glue_r glue_r2 glue_m glue_k")
    ranges = z3.And(m >= 1, q2 >= 0, q2 <= q, q <= k, r >= 1, r <= m, r2 >= 1, r2 <= m)
    big, big2 = q * m + r, q2 * m + r2
    return z3.Implies(ranges, z3.And(
        big >= 1, big <= (k + 1) * m,
        z3.Implies(z3.Or(q2 < q, z3.And(q2 == q, r2 < r)), big2 <= big - 1),
        z3.Implies(z3.Or(q2 < q, z3.And(q2 == q, r2 <= r)), big2 <= big)))


def bounded_wait_induction(policy: str) -> Theorem:
    name = f"{policy}/bounded-wait-induction"
    statement = ("bounded wait of every request i, by induction over the k live requests added before it: the "
                 "measure (older(i), max_model_len - computed(oldest)) decreases lexicographically in every step "
                 "i does not end, and no arrival or abort raises it; its first part never grows from k, its "
                 "second lies in [1, max_model_len], so M = older(i) * max_model_len + (max_model_len - "
                 "computed(oldest)) lies in [1, (k+1) * max_model_len] and drops by at least 1 per step: i ends "
                 "within (k+1) * max_model_len steps")

    def run(opts: Options) -> Result:
        timer = Timer()
        opts = policy_options(opts)
        st = Setup.get(opts, policy)
        ctx, s, n = st.ctx, st.s, opts.slots
        mml = ctx.cfg.max_model_len
        eos = [z3.Bool(f"eos{i}") for i in range(n)]
        after = apply_plan(ctx, s, st.plan, eos).state
        statuses: list[tuple[str, str, str]] = []
        witness = None

        def ask(prover: Any, label: str, goal: Any, premise: list[Any] | None = None) -> bool:
            nonlocal witness
            if prover is st:
                status, w, reason = st.prove(goal, premise)
            else:
                answer = prover.prove(z3.Implies(z3.And(premise), goal) if premise else goal)
                status, reason = answer.status, answer.reason
                w = state_values(answer.model, s) if answer.model is not None else None
            statuses.append((label, status, reason))
            witness = witness or w
            return status == PROVED

        # a context without the step's definitions, for the queries about no step: the arithmetic glue and
        # the client's actions
        env_ctx = setup(opts)
        # (0) the arithmetic glue, for all integers (nonlinear, no state)
        ask(Prover(env_ctx, [], opts.timeout_s), "glue", measure_glue())
        # (1) lemmas, proved and then assumed: the step makes no slot live; the oldest live request is never
        # preempted and computes at least one more token if it stays (the ranking of bounded-wait); and its
        # rank max_model_len - computed lies in [1, max_model_len]
        lemmas = [("no-new-live", z3.And([z3.Implies(after.slots[j].live, s.slots[j].live) for j in range(n)]))]
        for o in range(n):
            lemmas.append((f"oldest-advances-{o}", z3.Implies(
                z3.And(oldest_by_seq(s, o), z3.Not(st.step.rejected[o])),
                z3.And(z3.Not(st.plan.pre[o]), z3.Implies(after.slots[o].live, after.slots[o].nc > s.slots[o].nc)))))
        lemmas.append(("rank-bounds", z3.And([z3.Implies(sl.live, z3.And(sl.nc >= 0, sl.nc <= mml - 1))
                                              for sl in s.slots])))
        for label, lemma in lemmas:
            if not ask(st, f"lemma {label}", lemma):
                return _combine(name, statement, statuses, opts, timer, witness)
            st.prover.assume([lemma])
        # (2) the step: for each request i and oldest o (o == i allowed), lexicographic decrease while i lives
        for i in range(n):
            for o in range(n):
                q, q2 = older_count(s, i), older_count(after, i)
                keeps = z3.And(q2 == q, oldest_by_seq(after, o), after.slots[o].nc > s.slots[o].nc)
                ask(st, f"decrease-{i}-{o}", z3.Implies(after.slots[i].live, z3.Or(q2 < q, keeps)),
                    [s.slots[i].live, oldest_by_seq(s, o)])
        # (3) the client: an arrival (into an empty slot) or an abort (of another request) never raises the
        # measure
        env_hyps = [env_ctx.cfg.valid(), *inv_parts(env_ctx, s).values()]
        if policy in ORDERED:
            env_hyps += list(order_invariant(env_ctx, s).values())
        env = Prover(env_ctx, env_hyps, opts.timeout_s)
        p, mt = z3.Int("new_p"), z3.Int("new_mt")
        for i in range(n):
            for o in range(n):
                q = older_count(s, i)
                goals = []
                for a in range(n):
                    if a == i:
                        continue
                    for pre, later in ((arrive_precondition(s, a, p, mt), arrive(env_ctx, s, a, p, mt)),
                                       (s.slots[a].live, abort(env_ctx, s, a))):
                        q2 = older_count(later, i)
                        same = z3.And(q2 == q, oldest_by_seq(later, o), later.slots[o].nc >= s.slots[o].nc)
                        goals.append(z3.Implies(pre, z3.Or(q2 < q, same)))
                ask(env, f"client-{i}-{o}", z3.And(goals), [s.slots[i].live, oldest_by_seq(s, o)])
        older_waits = z3.Or([z3.And(s.slots[0].live, oldest_by_seq(s, o)) for o in range(1, n)])
        return _combine(name, statement, statuses, opts, timer, witness, vacuity=st.vacuity([older_waits]))

    return Theorem(name, statement, run)


# --- counterexamples from the initial state ------------------------------------------------------------------


def counterexample(name: str, case: str, policy: str, prop: str, statement: str,
                   violation: Callable[[Ctx, Any], Any], about: str, fixed: dict[str, Any] | None = None, bounds: Callable[[Ctx], list[Any]] | None = None,
                   slots: int = 3, depth: int = 3) -> Theorem:
    """A property ``policy`` is expected to break: search a run from Init (``slots`` requests, ``depth``
    steps) whose monitor reports, turn it into a scenario and replay it on the reference."""

    def run(opts: Options) -> Result:
        timer = Timer()
        status, scenario, replayed, detail = search_from_init(opts, policy, prop, case, about, violation, fixed,
                                                              bounds, slots, depth)
        result = Result(name, statement, COUNTEREXAMPLE, status, slots, f"fixed {opts.block_size_value}", depth,
                        0.0, detail=detail, scenario=scenario, replayed=replayed)
        result.seconds = timer.seconds
        return result

    return Theorem(name, statement, run, expected=COUNTEREXAMPLE, bmc=True)


def search_from_init(opts: Options, policy: str, prop: str, case: str, about: str,
                     violation: Callable[[Ctx, Any], Any], fixed: dict[str, Any] | None = None,
                     bounds: Callable[[Ctx], list[Any]] | None = None, slots: int = 3, depth: int = 3,
                     layout: str = "permuted") -> tuple[str, dict[str, Any] | None, bool | None, str]:
    """Search a run from Init (``slots`` requests, ``depth`` steps, the policy step in ``layout``) on which
    ``violation`` holds; turn it into a scenario (the smallest found: fewest requests, then shortest prompts
    and outputs) and replay it on the reference. Returns ``(status, scenario, replayed, detail)``:
    ``counterexample`` with the scenario, ``proved`` (no such run within the bound) or ``unknown``."""
    # the user's --set values win over the theorem's own config: with them no counterexample may exist, and
    # the result then says so (not as expected) instead of showing one for another config
    local = dataclasses.replace(opts, slots=slots, block="fixed", depth=depth, fixed={**(fixed or {}), **opts.fixed})
    ctx = setup(local)
    r = run_from_init(ctx, policy, slots, depth, layout=layout)
    constraints = [ctx.cfg.valid(), violation(ctx, r)] + (bounds(ctx) if bounds else [])
    # a readable witness: every request that arrives could complete alone (none is rejected)
    constraints += [z3.Implies(r.arrival[i] < depth, fits_alone(ctx, r.prompt[i], r.max_tokens[i]))
                    for i in range(slots)]
    answer = satisfiable(ctx, constraints, local.timeout_s)
    status = {"sat": COUNTEREXAMPLE, "unsat": PROVED}.get(answer.status, UNKNOWN)
    if answer.model is None:
        detail = answer.reason
        if status == PROVED:
            detail = f"no run of {slots} requests and {depth} steps breaks it (search depth too small?)"
        return status, None, None, detail
    arrived = _sum([z3.If(r.arrival[i] < depth, 1, 0) for i in range(slots)])
    sizes = _sum([z3.If(r.arrival[i] < depth, r.prompt[i] + r.max_tokens[i], 0) for i in range(slots)])
    model = minimize(ctx, constraints, [arrived, sizes], min(local.timeout_s, 10.0)) or answer.model
    scenario = scenario_from_run(model, ctx, r, policy, prop, case, about)
    replayed, detail = confirm(scenario, prop)
    return status, scenario, replayed, detail


def _small(ctx: Ctx, limit: int = 16) -> list[Any]:
    c = ctx.cfg
    return [c.num_kv_blocks <= limit, c.max_num_batched_tokens <= limit, c.max_num_seqs <= 4,
            c.max_model_len <= limit, c.long_prefill_token_threshold == 0]


def _itl_violation(ctx: Ctx, r: Any) -> Any:
    # searched with twice the budget, so that the witness shows a clearly long prompt; the monitor (512)
    # reports it all the more
    return z3.Or([bounded_itl_violation(ctx, rec.before, rec.step.plan, 2 * ITL_TOKEN_BUDGET) for rec in r.steps])


ITL_CONFIG = {"enable_chunked_prefill": False, "max_model_len": 2048, "max_num_batched_tokens": 2048,
              "max_num_seqs": 4, "num_kv_blocks": 256}
"""The counterexample's config: vLLM's A100 defaults (2,048-token budget) without chunked prefill."""


def _wc_violation(ctx: Ctx, r: Any) -> Any:
    return z3.Or([work_conserving_violation(ctx, rec.before, rec.step.plan) for rec in r.steps])


def _bw_violation(ctx: Ctx, r: Any) -> Any:
    """``BoundedWait`` reports: one request is the oldest in ``max_model_len`` consecutive steps and is
    still live after the last."""
    depth = len(r.steps)
    mml = ctx.cfg.max_model_len
    n = len(r.arrival)
    options = []
    for start in range(depth):
        for i in range(n):
            parts = [start + mml <= depth]
            for t in range(start, depth):
                rec = r.steps[t]
                inside = t < start + mml
                parts.append(z3.Implies(inside, z3.And(monitor_oldest(rec.before, i, rec.step.rejected),
                                                       rec.out.state.slots[i].live)))
            options.append(z3.And(parts))
    return z3.Or(options)


def policy_theorems(policy: str) -> list[Theorem]:
    """The theorems ``schedspec prove --scheduler policy`` runs after the spec's."""
    if policy not in POLICIES:
        raise KeyError(policy)
    from schedspec.reference.scheduler import SCHEDULERS
    from schedspec.spec.config import SchedulerConfig

    guarantees = SCHEDULERS[policy](SchedulerConfig(16, 8, 8, 1, 8)).guarantees
    out = [step_total(policy), step_unique(policy), step_lemmas(policy), refines(policy)]
    if POLICIES[policy]["order"] == "priority":  # its encoding needs no lemmas
        out.remove(out[2])
    if policy in ORDERED:
        out.append(order_inductive(policy))
    if "work-conserving" in guarantees:
        out.append(work_conserving(policy))
    if "stall-free-decode" in guarantees:
        out.append(stall_free(policy))
    if "rejects-impossible" in guarantees:
        out.append(rejects_impossible(policy))
    if "progress" in guarantees:
        out.append(progress_step(policy))
        if policy in ORDERED:
            out.append(progress_window(policy))
    if "bounded-preemptions" in guarantees and policy in ORDERED:
        out.append(bounded_preemptions(policy))
    if "no-priority-inversion" in guarantees:
        from .priority import no_priority_inversion

        out.append(no_priority_inversion(policy))
    if "bounded-wait" in guarantees and policy in ORDERED:
        out.append(bounded_wait(policy))
        out.append(bounded_wait_induction(policy))
        from .cutoff import bounded_wait_every_n

        out.append(bounded_wait_every_n(policy))
    out += EXPECTED_COUNTEREXAMPLES.get(policy, [])
    if policy == "fcfs":
        out.insert(len(out) - 1, itl_chunked(policy))
    return out


EXPECTED_COUNTEREXAMPLES: dict[str, list[Theorem]] = {
    "fcfs": [counterexample(
        "fcfs/bounded-itl-without-chunking", "counterexample-bounded-itl", "fcfs", "bounded-itl",
        f"without chunked prefill, fcfs keeps bounded-itl ({ITL_TOKEN_BUDGET} tokens per step carrying a decode)",
        _itl_violation,
        "Without chunked prefill, a step that carries a running decode also carries a whole long prompt, so the "
        "decode's inter-token latency is the time of that whole prefill; chunked prefill with a 512-token budget "
        "keeps every such step to 512 tokens (found by Z3, replayed on fcfs).",
        fixed=ITL_CONFIG, bounds=lambda ctx: [ctx.cfg.long_prefill_token_threshold == 0], slots=2, depth=2)],
    "static": [counterexample(
        "static/work-conserving", "counterexample-static-work-conserving", "static", "work-conserving",
        "static batching is work-conserving", _wc_violation,
        "Static batching admits only when the whole batch has ended, so a waiting request that fits (budget, "
        "sequence slot and blocks all free) is held back while the batch runs (found by Z3, replayed on static).",
        bounds=_small, slots=2, depth=2)],
    "shortest-prompt-first": [counterexample(
        "shortest-prompt-first/bounded-wait", "counterexample-shortest-prompt-first-bounded-wait",
        "shortest-prompt-first", "bounded-wait",
        "shortest-prompt-first bounds the wait of the oldest request", _bw_violation,
        "Shortest-prompt-first admits shorter prompts ahead of an older long one, so the oldest request can wait "
        "more than max_model_len steps while short requests keep arriving (found by Z3, replayed on "
        "shortest-prompt-first).",
        bounds=_small, slots=3, depth=3)],
}


def supported() -> tuple[str, ...]:
    return tuple(POLICIES)


__all__ = ["policy_theorems", "supported", "ORDER_INVARIANT_NAMES"]
