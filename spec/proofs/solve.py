"""Running one proof obligation: assert hypotheses and the negated goal, ask Z3, read a witness."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import z3

from .core import COUNTEREXAMPLE, PROVED, UNKNOWN
from .encoding import (
    BOOL_SLOT_FIELDS,
    PLAN_FIELDS,
    SLOT_FIELDS,
    STATE_SCALARS,
    STATUS_NAMES,
    Ctx,
    Plan,
    State,
    py,
)


@dataclass
class Answer:
    status: str
    model: z3.ModelRef | None = None
    reason: str = ""


def _apps_of(exprs: Iterable[Any], decl: Any) -> list[Any]:
    """Every application of ``decl`` in ``exprs`` (arguments included), each once."""
    seen: set[int] = set()
    found: dict[int, Any] = {}
    stack = list(exprs)
    while stack:
        e = stack.pop()
        key = e.get_id()
        if key in seen:
            continue
        seen.add(key)
        if z3.is_app(e):
            if e.decl() == decl:
                found[key] = e
            stack.extend(e.children())
    return list(found.values())


def cdiv_facts(ctx: Ctx, exprs: list[Any]) -> list[Any]:
    """True facts about ``ceil(x / block_size)`` for every application in ``exprs`` (uninterpreted
    mode): ``f(x) = 0`` for ``x <= 0``; ``1 <= f(x) <= x`` for ``x >= 1``; for each pair, monotone with
    slope at most 1 (``x <= y => f(x) <= f(y) <= f(x) + (y - x)``)."""
    f = ctx._f
    if f is None:
        return []
    apps = _apps_of(exprs, f)
    args = [a.arg(0) for a in apps]
    out = []
    for x in args:
        out.append(z3.If(x <= 0, f(x) == 0, z3.And(f(x) >= 1, f(x) <= x)))
    for i, x in enumerate(args):
        for y in args[i + 1:]:
            out.append(z3.Implies(x <= y, z3.And(f(x) <= f(y), f(y) <= f(x) + (y - x))))
            out.append(z3.Implies(y <= x, z3.And(f(y) <= f(x), f(x) <= f(y) + (x - y))))
    return out


def check(ctx: Ctx, hypotheses: list[Any], goal: Any, timeout_s: float) -> Answer:
    """Is ``hypotheses => goal`` valid? ``proved`` (the negation is unsat), ``counterexample`` with a
    model, or ``unknown`` with Z3's reason (timeout included)."""
    return satisfiable(ctx, list(hypotheses) + [z3.Not(goal)], timeout_s, negate=True)


def satisfiable(ctx: Ctx, constraints: list[Any], timeout_s: float, negate: bool = False) -> Answer:
    """Find a model of ``constraints`` (plus the context's definitions). With ``negate`` the answer
    is phrased for a validity check: unsat -> proved, sat -> counterexample."""
    solver = z3.Solver()
    solver.set("timeout", max(1, int(timeout_s * 1000)))
    asserted = list(constraints) + list(ctx.facts)
    solver.add(asserted)
    solver.add(cdiv_facts(ctx, asserted))
    result = solver.check()
    if result == z3.unsat:
        return Answer(PROVED if negate else "unsat")
    if result == z3.sat:
        return Answer(COUNTEREXAMPLE if negate else "sat", solver.model())
    return Answer(UNKNOWN, reason=solver.reason_unknown())


def value(model: z3.ModelRef, term: Any) -> Any:
    return py(model.eval(term, model_completion=True))


def state_values(model: z3.ModelRef, s: State, plan: Plan | None = None, extra: dict[str, list[Any]] | None = None,
                 live_only: bool = True) -> dict[str, Any]:
    """A readable dump of a symbolic state (and plan) in ``model``."""
    slots = []
    for i, sl in enumerate(s.slots):
        row = {name: value(model, getattr(sl, name)) for name in SLOT_FIELDS}
        if live_only and row["st"] == 0:
            continue
        row["slot"] = i
        row["st"] = STATUS_NAMES.get(row["st"], row["st"])
        for name in BOOL_SLOT_FIELDS:
            row[name] = bool(row[name])
        if plan is not None:
            for name in PLAN_FIELDS:
                row["plan_" + name] = value(model, getattr(plan, name)[i])
        for name, terms in (extra or {}).items():
            row[name] = value(model, terms[i])
        slots.append(row)
    out: dict[str, Any] = {name: value(model, getattr(s, name)) for name in STATE_SCALARS}
    out["slots"] = slots
    return out


class Prover:
    """An incremental solver: hypotheses are asserted once; each goal is checked in its own scope.

    Keeps the facts about an uninterpreted ``ceil`` complete: every application met in a hypothesis
    or goal gets its facts, pairwise with every application met before.
    """

    def __init__(self, ctx: Ctx, hypotheses: list[Any], timeout_s: float) -> None:
        self.ctx = ctx
        self.timeout_s = timeout_s
        self.solver = z3.Solver()
        self._args: list[Any] = []
        self._seen: set[int] = set()
        self._facts_done = 0
        self.assume(hypotheses)

    def _cdiv_facts(self, exprs: list[Any]) -> list[Any]:
        f = self.ctx._f
        if f is None:
            return []
        out = []
        for app in _apps_of(exprs, f):
            x = app.arg(0)
            if x.get_id() in self._seen:
                continue
            self._seen.add(x.get_id())
            out.append(z3.If(x <= 0, f(x) == 0, z3.And(f(x) >= 1, f(x) <= x)))
            for y in self._args:
                out.append(z3.Implies(x <= y, z3.And(f(x) <= f(y), f(y) <= f(x) + (y - x))))
                out.append(z3.Implies(y <= x, z3.And(f(y) <= f(x), f(x) <= f(y) + (x - y))))
            self._args.append(x)
        return out

    def assume(self, formulas: list[Any]) -> None:
        new_facts = self.ctx.facts[self._facts_done:]
        self._facts_done = len(self.ctx.facts)
        formulas = list(formulas) + list(new_facts)
        self.solver.add(formulas)
        self.solver.add(self._cdiv_facts(formulas))

    def prove(self, goal: Any) -> Answer:
        self.assume([])
        self.solver.push()
        try:
            negated = z3.Not(goal)
            self.solver.add(negated)
            self.solver.add(self._cdiv_facts([negated]))
            self.solver.set("timeout", max(1, int(self.timeout_s * 1000)))
            result = self.solver.check()
            if result == z3.unsat:
                return Answer(PROVED)
            if result == z3.sat:
                return Answer(COUNTEREXAMPLE, self.solver.model())
            return Answer(UNKNOWN, reason=self.solver.reason_unknown())
        finally:
            self.solver.pop()
            self._reset_facts()  # the facts met in the goal were added inside the scope

    def satisfiable(self, constraint: Any) -> str:
        """Is ``constraint`` satisfiable together with everything assumed? ``sat``, ``unsat`` or
        ``unknown`` (a vacuity check: ``prove(Not(constraint))`` read the other way)."""
        answer = self.prove(z3.Not(constraint))
        return {PROVED: "unsat", COUNTEREXAMPLE: "sat"}.get(answer.status, UNKNOWN)

    def coverage(self, cases: dict[str, Any], premise: Any = None) -> list[Any]:
        """:class:`~.core.Coverage` of the premises (everything assumed, and ``premise`` if given) and of
        each case added to them."""
        from .core import Coverage, Timer

        premise = z3.BoolVal(True) if premise is None else premise
        out = []
        for name, case in {"premises": z3.BoolVal(True), **cases}.items():
            timer = Timer()
            status = self.satisfiable(z3.And(premise, case))
            out.append(Coverage(name if name == "premises" else f"premises + {name}", status, None, timer.seconds))
        return out

    def _reset_facts(self) -> None:
        """Re-derive the known applications from what is asserted outside any scope."""
        f = self.ctx._f
        if f is None:
            return
        base = list(self.solver.assertions())
        self._seen = set()
        self._args = []
        for app in _apps_of(base, f):
            x = app.arg(0)
            if x.get_id() not in self._seen:
                self._seen.add(x.get_id())
                self._args.append(x)


def minimize(ctx: Ctx, constraints: list[Any], objectives: list[Any], timeout_s: float, rounds: int = 8
             ) -> z3.ModelRef | None:
    """A model of ``constraints`` with small ``objectives``, by iterative tightening: each objective in
    turn (fewest live requests first, then the smallest numbers) is pushed below its value in the last
    model while the solver finds one (at most ``rounds`` times, ``timeout_s`` per query), then held at
    its best value. None if the constraints have no model within the time."""
    solver = z3.Solver()
    solver.set("timeout", max(1, int(timeout_s * 1000)))
    asserted = list(constraints) + list(ctx.facts)
    solver.add(asserted)
    solver.add(cdiv_facts(ctx, asserted))
    if solver.check() != z3.sat:
        return None
    model = solver.model()
    for objective in objectives:
        for _ in range(rounds):
            best = model.eval(objective, model_completion=True)
            solver.push()
            solver.add(objective < best)
            if solver.check() == z3.sat:
                model = solver.model()
                solver.pop()
                solver.add(objective <= model.eval(objective, model_completion=True))
                continue
            solver.pop()
            break
        solver.add(objective <= model.eval(objective, model_completion=True))
    return model


def witness_objectives(s: State, plan: Plan | None = None) -> list[Any]:
    """What a readable witness keeps small: the live requests, then their lengths, blocks and positions."""
    live = [z3.If(sl.live, 1, 0) for sl in s.slots]
    sizes = [z3.If(sl.live, sl.p + sl.o + sl.mt + sl.nc + sl.b, 0) for sl in s.slots]
    spread = [z3.If(sl.live, z3.If(sl.pos >= 0, sl.pos, -sl.pos), 0) for sl in s.slots]
    out = [z3.Sum(live + [z3.IntVal(0)]), z3.Sum(sizes + [z3.IntVal(0)]), s.free, z3.Sum(spread + [z3.IntVal(0)])]
    if plan is not None:
        out.append(z3.Sum([z3.If(plan.sched[i], plan.ntok[i] + plan.nb[i], 0) for i in range(plan.n)] + [z3.IntVal(0)]))
    return out
