"""The spec as quantifier-free integer arithmetic for Z3: state, config, allowed-plan rules, update.

A state has ``n`` request **slots**. A slot holds at most one live request; an empty slot stands for
"no live request here" (never added, or terminal: terminal requests never change again, so the
proofs drop them and check their last values in the step that ends them). Per slot:

``st``        status: :data:`EMPTY`, :data:`WAITING`, :data:`PREEMPTED` or :data:`RUNNING`
``p``         prompt length; ``o`` outputs so far; ``mt`` ``max_tokens``
``nc``        ``num_computed_tokens``; ``b`` blocks held (``len(block_ids)``)
``pos``       position in its queue (waiting or running); only the order matters
``adm``       ``admitted_step is not None``; ``npre`` ``num_preemptions``
``arr``       ``arrival_step``; ``prio`` priority; ``seq`` order of addition (arrival order)

Blocks are abstracted as counts: a free count ``free`` plus ``b`` per slot, so block conservation
reads ``free + sum(b) == num_kv_blocks``; block ids (which block, in which order) are not modelled.
Queue positions are sparse integers: a preempted request gets ``wfront - 1 - k`` (in front of every
waiting request), an admitted one ``rback + 1 + k``, an arrival ``wback + 1``; so the update never
renumbers and stays linear. ``ceil(x / block_size)`` is :meth:`Ctx.cdiv` (see ``BLOCK_MODES``).

Everything here is built from z3 terms; given numerals (``z3.IntVal``) it evaluates to numerals, which
is how ``tests/test_proofs_encoding.py`` compares it with the Python spec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import z3

EMPTY, WAITING, PREEMPTED, RUNNING = 0, 1, 2, 3
STATUS_NAMES = {EMPTY: "empty", WAITING: "waiting", PREEMPTED: "preempted", RUNNING: "running"}

BLOCK_MODES = ("fixed", "symbolic", "uninterpreted")
"""How ``ceil(x / block_size)`` is encoded.

- ``fixed``: ``block_size`` is a numeral; ``(x + bs - 1) div bs`` is linear.
- ``symbolic``: ``block_size`` is a variable; the division is nonlinear (Z3 may answer unknown).
- ``uninterpreted``: ``ceil(x / block_size)`` is an uninterpreted function ``f`` constrained only by
  true facts about every term the query uses: ``f(x) = 0`` for ``x <= 0``, ``1 <= f(x) <= x`` for
  ``x >= 1``, ``f(x + 1) <= f(x) + 1`` and monotonicity. A proof then holds for every block size; a
  counterexample may be spurious and is re-checked with a concrete block size.
"""

Bool = z3.BoolRef
Int = z3.ArithRef


def _sum(terms: Sequence[Any]) -> Any:
    terms = list(terms)
    if not terms:
        return z3.IntVal(0)
    return z3.Sum(terms) if len(terms) > 1 else terms[0]


def ite(c: Any, a: Any, b: Any) -> Any:
    return z3.If(c, a, b)


def count(conds: Sequence[Any]) -> Any:
    return _sum([z3.If(c, 1, 0) for c in conds])


def zmax(a: Any, b: Any) -> Any:
    return z3.If(a >= b, a, b)


def zmin(a: Any, b: Any) -> Any:
    return z3.If(a <= b, a, b)


@dataclass
class SymConfig:
    """A ``SchedulerConfig`` as z3 terms (numerals where a field is fixed)."""

    block_size: Any
    num_kv_blocks: Any
    max_num_batched_tokens: Any
    max_num_seqs: Any
    max_model_len: Any
    enable_chunked_prefill: Any
    long_prefill_token_threshold: Any

    def valid(self) -> Any:
        """What ``SchedulerConfig.__attrs_post_init__`` accepts (prefix caching off, recompute)."""
        return z3.And(
            self.block_size >= 1,
            self.num_kv_blocks >= 1,
            self.max_num_batched_tokens >= 1,
            self.max_num_seqs >= 1,
            self.max_model_len >= 1,
            self.long_prefill_token_threshold >= 0,
            z3.Implies(z3.Not(self.enable_chunked_prefill), self.max_num_batched_tokens >= self.max_model_len),
            self.max_num_batched_tokens >= self.max_num_seqs,
        )

    @classmethod
    def symbolic(cls, prefix: str = "", fixed: dict[str, Any] | None = None) -> SymConfig:
        """Every field a variable, except those in ``fixed`` (Python values)."""
        fixed = fixed or {}
        values = {}
        for f in fields(cls):
            if f.name in fixed:
                values[f.name] = _val(fixed[f.name])
            elif f.name == "enable_chunked_prefill":
                values[f.name] = z3.Bool(prefix + f.name)
            else:
                values[f.name] = z3.Int(prefix + f.name)
        return cls(**values)

    @classmethod
    def concrete(cls, config: Any) -> SymConfig:
        """From a :class:`~schedspec.spec.config.SchedulerConfig`."""
        return cls(**{f.name: _val(getattr(config, f.name)) for f in fields(cls)})

    def evaluate(self, model: z3.ModelRef) -> dict[str, Any]:
        """The field values in ``model`` as Python values."""
        return {f.name: py(model.eval(getattr(self, f.name), model_completion=True)) for f in fields(self)}


def _val(value: Any) -> Any:
    if isinstance(value, bool):
        return z3.BoolVal(value)
    if isinstance(value, int):
        return z3.IntVal(value)
    return value


def py(term: Any) -> Any:
    """A z3 numeral or boolean value as a Python value."""
    if z3.is_true(term):
        return True
    if z3.is_false(term):
        return False
    if z3.is_int_value(term):
        return term.as_long()
    raise ValueError(f"not a value: {term}")


@dataclass
class Speculative:
    """Speculative decoding's config terms: ``k`` (``num_speculative_tokens``, >= 1 when on) and ``L``
    (``num_lookahead_tokens``). A :class:`Ctx` with one encodes drafts: a state's slots hold ``d`` drafts
    (:attr:`State.drafts`), a plan's ``nd`` (:attr:`Plan.nd`), and a step's inputs are the accepted drafts
    ``acc``, the appended token that is the EOS ``ej`` (0: none) and the drafts proposed ``prop``
    (:class:`DraftInputs`). Without one (the default) the encoding is exactly the one without drafts."""

    k: Any
    L: Any

    def valid(self) -> Any:
        """What ``SchedulerConfig`` accepts with speculative decoding on."""
        return z3.And(self.k >= 1, self.L >= 0)

    @classmethod
    def symbolic(cls, prefix: str = "") -> Speculative:
        return cls(z3.Int(prefix + "num_speculative_tokens"), z3.Int(prefix + "num_lookahead_tokens"))


class Ctx:
    """One query's encoding context: the config, the block mode, fresh names and side facts.

    ``facts`` collects constraints that define auxiliary variables (policy encodings); a query asserts
    them all, with the facts about the uninterpreted ``ceil`` (``solve.cdiv_facts``). ``spec``: speculative
    decoding's terms (:class:`Speculative`), or ``None`` for the encoding without drafts.
    """

    def __init__(self, config: SymConfig, block_mode: str = "fixed", prefix: str = "",
                 spec: Speculative | None = None) -> None:
        self.spec = spec
        if block_mode not in BLOCK_MODES:
            raise ValueError(f"block mode {block_mode!r}: expected one of {BLOCK_MODES}")
        if block_mode == "fixed" and not z3.is_int_value(config.block_size):
            raise ValueError("block mode 'fixed' needs a numeral block_size")
        self.cfg = config
        self.block_mode = block_mode
        self.prefix = prefix
        self.facts: list[Any] = []
        self._names: dict[str, int] = {}
        self._f = z3.Function(prefix + "cdiv", z3.IntSort(), z3.IntSort()) if block_mode == "uninterpreted" else None

    def fresh(self, name: str, sort: str = "int") -> Any:
        index = self._names.get(name, 0)
        self._names[name] = index + 1
        full = f"{self.prefix}{name}" + (f"!{index}" if index else "")
        return z3.Bool(full) if sort == "bool" else z3.Int(full)

    def define(self, name: str, expr: Any, sort: str = "int") -> Any:
        """A fresh variable equal to ``expr`` (kept in ``facts``): names a shared subterm."""
        if z3.is_int_value(expr) or z3.is_true(expr) or z3.is_false(expr):
            return expr
        var = self.fresh(name, sort)
        self.facts.append(var == expr)
        return var

    def cdiv(self, x: Any) -> Any:
        """``ceil(x / block_size)``, 0 for ``x <= 0`` (``blocks_for_tokens``)."""
        if self._f is not None:
            return self._f(x)
        bs = self.cfg.block_size
        return z3.If(x <= 0, 0, (x + bs - 1) / bs)

    def slot_tokens(self, end: Any) -> Any:
        """``config.slot_tokens``: ``end`` plus the lookahead, capped at ``max_model_len`` (``end`` without
        speculative decoding)."""
        if self.spec is None:
            return end
        return zmax(end, zmin(end + self.spec.L, self.cfg.max_model_len))

    def covers(self, blocks: Any, tokens: Any) -> Any:
        """``blocks * block_size >= tokens`` (equivalently ``blocks >= ceil(tokens / block_size)``)."""
        if self._f is not None:
            return blocks >= self.cdiv(tokens)
        return blocks * self.cfg.block_size >= tokens


@dataclass
class Slot:
    st: Any
    p: Any
    o: Any
    mt: Any
    nc: Any
    b: Any
    pos: Any
    adm: Any
    npre: Any
    arr: Any
    prio: Any
    seq: Any

    @property
    def live(self) -> Any:
        return self.st != EMPTY

    @property
    def running(self) -> Any:
        return self.st == RUNNING

    @property
    def waiting(self) -> Any:
        return z3.Or(self.st == WAITING, self.st == PREEMPTED)

    @property
    def pending(self) -> Any:
        return self.p + self.o - self.nc


SLOT_FIELDS = tuple(f.name for f in fields(Slot))
BOOL_SLOT_FIELDS = ("adm",)


@dataclass
class State:
    slots: list[Slot]
    free: Any
    wfront: Any
    wback: Any
    rback: Any
    step: Any
    nextseq: Any
    drafts: list[Any] | None = None
    """Speculative decoding (:class:`Speculative`): per slot, the drafts the request holds
    (``len(spec_token_ids)``); ``None`` without."""

    @property
    def n(self) -> int:
        return len(self.slots)


STATE_SCALARS = ("free", "wfront", "wback", "rback", "step", "nextseq")


def symbolic_state(n: int, prefix: str = "s", speculative: bool = False) -> State:
    if speculative:
        base = symbolic_state(n, prefix)
        return replace(base, drafts=[z3.Int(f"{prefix}_d{i}") for i in range(n)])
    slots = []
    for i in range(n):
        values = {
            name: (z3.Bool if name in BOOL_SLOT_FIELDS else z3.Int)(f"{prefix}_{name}{i}") for name in SLOT_FIELDS
        }
        slots.append(Slot(**values))
    return State(slots, *(z3.Int(f"{prefix}_{name}") for name in STATE_SCALARS))


@dataclass
class Plan:
    """A step plan, per slot: scheduled (with its chunk start, tokens, new blocks and batch index),
    preempted (with its index in ``plan.preempted``), rejected."""

    sched: list[Any]
    start: list[Any]
    ntok: list[Any]
    nb: list[Any]
    bpos: list[Any]
    pre: list[Any]
    ppos: list[Any]
    rej: list[Any]
    nd: list[Any] | None = None
    """Speculative decoding: per slot, the drafts its item verifies (``len(spec_token_ids)``); ``None``
    without."""

    @property
    def n(self) -> int:
        return len(self.sched)

    def tokens(self) -> Any:
        return _sum([z3.If(self.sched[i], self.ntok[i], 0) for i in range(self.n)])


PLAN_FIELDS = tuple(f.name for f in fields(Plan) if f.name != "nd")
BOOL_PLAN_FIELDS = ("sched", "pre", "rej")


def symbolic_plan(n: int, prefix: str = "pl", speculative: bool = False) -> Plan:
    plan = Plan(**{
        name: [(z3.Bool if name in BOOL_PLAN_FIELDS else z3.Int)(f"{prefix}_{name}{i}") for i in range(n)]
        for name in PLAN_FIELDS
    })
    return replace(plan, nd=[z3.Int(f"{prefix}_nd{i}") for i in range(n)]) if speculative else plan


@dataclass
class DraftInputs:
    """Speculative decoding's inputs to a step, per slot (the model's and the drafter's choices):
    ``acc`` the drafts accepted, ``ej`` which appended token is the EOS (1 for the first; 0 for none), and
    ``prop`` the drafts proposed after the step."""

    acc: list[Any]
    ej: list[Any]
    prop: list[Any]

    @classmethod
    def symbolic(cls, n: int, prefix: str = "in") -> DraftInputs:
        return cls(*([z3.Int(f"{prefix}_{name}{i}") for i in range(n)] for name in ("acc", "ej", "prop")))

    def valid(self, ctx: Ctx, plan: Plan) -> Any:
        """The bounds ``apply_plan`` puts on them: ``0 <= acc <= nd``, ``ej >= 0``, ``0 <= prop <= k``."""
        assert ctx.spec is not None and plan.nd is not None
        return z3.And([z3.And(self.acc[i] >= 0, self.acc[i] <= plan.nd[i], self.ej[i] >= 0, self.prop[i] >= 0,
                              self.prop[i] <= ctx.spec.k) for i in range(plan.n)])


def plan_well_formed(plan: Plan) -> Any:
    """What a ``StepPlan`` value is by construction: batch indices distinct in ``[0, 2n)``, preemption
    indices distinct in ``[0, n)`` (only their order matters), new block counts >= 0."""
    n = plan.n
    out = []
    for i in range(n):
        out.append(plan.nb[i] >= 0)
        out.append(z3.Implies(plan.sched[i], z3.And(plan.bpos[i] >= 0, plan.bpos[i] < 2 * n)))
        out.append(z3.Implies(plan.pre[i], z3.And(plan.ppos[i] >= 0, plan.ppos[i] < n)))
        for j in range(i + 1, n):
            out.append(z3.Implies(z3.And(plan.sched[i], plan.sched[j]), plan.bpos[i] != plan.bpos[j]))
            out.append(z3.Implies(z3.And(plan.pre[i], plan.pre[j]), plan.ppos[i] != plan.ppos[j]))
    return z3.And(out)


# --- admission (schedspec.spec.admission) -------------------------------------------------------


def max_sequence_len(ctx: Ctx, p: Any, mt: Any) -> Any:
    return zmin(p + mt, ctx.cfg.max_model_len)


def max_blocks_needed(ctx: Ctx, p: Any, mt: Any) -> Any:
    """``admission.max_blocks_needed``: ``ceil(max(prompt_len, min(prompt_len + max_tokens,
    max_model_len) - 1) / block_size)``."""
    return ctx.cdiv(ctx.slot_tokens(zmax(p, max_sequence_len(ctx, p, mt) - 1)))


def fits_alone(ctx: Ctx, p: Any, mt: Any) -> Any:
    """``admission.rejection_reason(p, mt, config) is None``."""
    c = ctx.cfg
    return z3.And(p > 0, mt >= 1, p <= c.max_model_len, max_blocks_needed(ctx, p, mt) <= c.num_kv_blocks)


# --- the allowed-plan predicate (schedspec.spec.rules) -------------------------------------------


@dataclass
class RuleAtoms:
    """The per-slot terms the counting rules add up, built once so that the rules, the update and the
    per-slot sum lemmas of :mod:`.theorems` share them (z3 hash-conses equal terms, so a lemma stated in
    these atoms adds up to the rule by linear arithmetic alone, with no case split per slot).

    ``running``: 1 if the slot runs before the step; ``preempted``: 1 if it runs and the plan preempts
    it; ``admitted``: 1 if it is live, not running, and scheduled (``sequence-cap``); ``handed``: the
    new blocks the plan gives it; ``released``: the blocks it holds if the plan preempts it while live
    (``blocks-from-free-pool``)."""

    running: Any
    preempted: Any
    admitted: Any
    handed: Any
    released: Any


def rule_atoms(s: State, plan: Plan, i: int) -> RuleAtoms:
    sl = s.slots[i]
    return RuleAtoms(
        running=z3.If(sl.running, 1, 0),
        preempted=z3.If(z3.And(plan.pre[i], sl.running), 1, 0),
        admitted=z3.If(z3.And(plan.sched[i], z3.Not(sl.running), sl.live), 1, 0),
        handed=z3.If(plan.sched[i], plan.nb[i], 0),
        released=z3.If(z3.And(plan.pre[i], sl.live), sl.b, 0),
    )


def allowed_rules(ctx: Ctx, s: State, plan: Plan) -> dict[str, Any]:
    """Each local rule of :mod:`schedspec.spec.rules` by name, as a z3 formula over the state before the
    step and the plan. The plan is allowed iff all hold."""
    c = ctx.cfg
    n = s.n
    S = s.slots
    rules: dict[str, list[Any]] = {name: [] for name in RULE_ORDER}
    for i in range(n):
        sl = S[i]
        sch, pre, rej = plan.sched[i], plan.pre[i], plan.rej[i]
        named = z3.Or(sch, pre, rej)
        rules["known-requests"].append(z3.Implies(named, sl.live))
        rules["known-requests"].append(count([sch, pre, rej]) <= 1)
        rules["positive-tokens"].append(z3.Implies(sch, plan.ntok[i] >= 1))
        rules["long-prefill-threshold"].append(z3.Implies(
            z3.And(sch, c.enable_chunked_prefill, c.long_prefill_token_threshold > 0),
            plan.ntok[i] <= c.long_prefill_token_threshold))
        ls = z3.And(sch, sl.live)
        nd = plan.nd[i] if ctx.spec is not None else 0
        most = sl.pending + nd if ctx.spec is not None else sl.pending  # without drafts: the terms as before
        rules["chunk-continues"].append(z3.Implies(ls, plan.start[i] == sl.nc))
        rules["no-overcompute"].append(z3.Implies(ls, plan.ntok[i] <= most))
        rules["whole-prefill-without-chunking"].append(
            z3.Implies(z3.And(ls, z3.Not(c.enable_chunked_prefill)), plan.ntok[i] == most))
        rules["admit-fits-alone"].append(z3.Implies(z3.And(ls, z3.Not(sl.running)), fits_alone(ctx, sl.p, sl.mt)))
        rules["reject-only-impossible"].append(z3.Implies(
            z3.And(rej, sl.live), z3.And(z3.Not(sl.running), z3.Not(fits_alone(ctx, sl.p, sl.mt)))))
        rules["reject-only-impossible"].append(z3.Implies(
            z3.And(sl.waiting, z3.Not(sl.adm), z3.Not(fits_alone(ctx, sl.p, sl.mt))), rej))
        rules["preempt-running-only"].append(z3.Implies(pre, z3.And(z3.Implies(sl.live, sl.running), z3.Not(sch))))
        blocks = sl.b + plan.nb[i]
        rules["block-table-covers"].append(
            z3.Implies(ls, blocks >= ctx.cdiv(ctx.slot_tokens(plan.start[i] + plan.ntok[i]))))
        if ctx.spec is None:
            rules["no-excess-blocks"].append(z3.Implies(ls, blocks <= ctx.cdiv(sl.p + sl.o)))
            continue
        held = s.drafts[i]
        rules["no-excess-blocks"].append(z3.Implies(z3.And(ls, plan.nb[i] > 0),
                                                    blocks <= ctx.cdiv(ctx.slot_tokens(sl.p + sl.o + nd))))
        rules["drafts-only-in-decodes"].append(z3.Implies(z3.And(ls, nd > 0), z3.And(
            sl.running, sl.pending == 1, sl.nc >= sl.p, plan.ntok[i] == 1 + nd)))
        rules["drafts-are-proposed"].append(z3.Implies(sch, z3.And(nd >= 0, z3.Implies(sl.live, nd <= held))))
        rules["drafts-within-max-model-len"].append(
            z3.Implies(z3.And(sch, nd > 0), plan.start[i] + plan.ntok[i] + 1 <= c.max_model_len))
    rules["token-budget"].append(plan.tokens() <= c.max_num_batched_tokens)
    atoms = [rule_atoms(s, plan, i) for i in range(n)]
    running = _sum([a.running for a in atoms])
    preempted = _sum([a.preempted for a in atoms])
    admitted = _sum([a.admitted for a in atoms])
    rules["sequence-cap"].append(running - preempted + admitted <= c.max_num_seqs)
    handed = _sum([a.handed for a in atoms])
    released = _sum([a.released for a in atoms])
    rules["blocks-from-free-pool"].append(handed <= s.free + released)
    return {name: z3.And(parts) for name, parts in rules.items()}


RULE_ORDER = (
    "known-requests", "token-budget", "positive-tokens", "chunk-continues", "no-overcompute",
    "whole-prefill-without-chunking", "long-prefill-threshold", "sequence-cap", "admit-fits-alone",
    "reject-only-impossible", "preempt-running-only", "blocks-from-free-pool", "block-table-covers",
    "no-excess-blocks", "drafts-only-in-decodes", "drafts-are-proposed", "drafts-within-max-model-len",
)
"""The rules of :mod:`schedspec.spec.rules`, in its order (the encoding test checks the two agree); the
``drafts-*`` rules are ``True`` without speculative decoding (a :class:`Ctx` without :class:`Speculative`),
as they are in Python (no item carries drafts)."""


def allowed(ctx: Ctx, s: State, plan: Plan) -> Any:
    return z3.And(list(allowed_rules(ctx, s, plan).values()))


# --- the update (schedspec.spec.transitions.apply_plan) --------------------------------------------


@dataclass
class StepOutcome:
    """The state after a step and, per slot, whether the request sampled and whether it stopped (with
    the values it ends with)."""

    state: State
    samples: list[Any]
    stops: list[Any]
    final_o: list[Any]
    returned: list[Any]
    """Per slot: the blocks a request that stops in the step returns (its old blocks plus the new ones)."""


def apply_plan(ctx: Ctx, s: State, plan: Plan, eos: Sequence[Any], inputs: DraftInputs | None = None) -> StepOutcome:
    """The state after an allowed ``plan``; ``eos[i]``: the token slot ``i`` samples is its EOS. With
    speculative decoding (``ctx.spec``), ``inputs`` gives the accepted drafts, where the EOS is among the
    appended tokens (``eos`` is then unused) and the drafts proposed (:class:`DraftInputs`): a sampler
    appends ``min(acc + 1, first length stop, ej)`` tokens, stops if a stop falls among its ``acc + 1``,
    gives back its ``nd - acc`` rejected drafts and, going on, holds ``prop`` drafts
    (``transitions.sample``, ``propose_drafts``)."""
    c = ctx.cfg
    n = s.n
    spec = ctx.spec is not None
    new_slots = []
    new_drafts: list[Any] = []
    samples, stops, final_o = [], [], []
    released: list[Any] = []
    returned: list[Any] = []
    for i in range(n):
        sl = s.slots[i]
        sch, pre, rej = plan.sched[i], plan.pre[i], plan.rej[i]
        if not spec:
            samp = z3.And(sch, plan.start[i] + plan.ntok[i] == sl.p + sl.o)
            o1 = z3.If(samp, sl.o + 1, sl.o)
            stop = z3.And(samp, z3.Or(sl.p + o1 >= c.max_model_len, o1 >= sl.mt, eos[i]))
            computed = sl.nc + plan.ntok[i]
        else:
            assert inputs is not None and plan.nd is not None and s.drafts is not None
            nd, acc, ej = plan.nd[i], inputs.acc[i], inputs.ej[i]
            samp = z3.And(sch, plan.start[i] + plan.ntok[i] - nd == sl.p + sl.o)
            length_stop = zmax(1, zmin(sl.mt - sl.o, c.max_model_len - sl.p - sl.o))
            kept = zmin(acc + 1, length_stop)
            kept = z3.If(ej >= 1, zmin(kept, ej), kept)
            o1 = z3.If(samp, sl.o + kept, sl.o)
            stop = z3.And(samp, z3.Or(length_stop <= acc + 1, z3.And(ej >= 1, ej <= acc + 1)))
            computed = sl.nc + plan.ntok[i] - z3.If(samp, nd - acc, 0)
            new_drafts.append(z3.If(pre, 0, z3.If(sch, z3.If(z3.And(samp, z3.Not(stop)), inputs.prop[i], 0),
                                                  z3.If(rej, 0, s.drafts[i]))))
        admit = z3.And(sch, z3.Not(sl.running))
        st = z3.If(pre, PREEMPTED, z3.If(rej, EMPTY, z3.If(sch, z3.If(stop, EMPTY, RUNNING), sl.st)))
        nc = z3.If(pre, 0, z3.If(sch, computed, sl.nc))
        b = z3.If(z3.Or(pre, rej, stop), 0, z3.If(sch, sl.b + plan.nb[i], sl.b))
        pos = z3.If(pre, s.wfront - 1 - plan.ppos[i], z3.If(admit, s.rback + 1 + plan.bpos[i], sl.pos))
        new_slots.append(replace(
            sl, st=st, nc=nc, b=b, pos=pos, o=o1,
            adm=z3.Or(sl.adm, admit), npre=z3.If(pre, sl.npre + 1, sl.npre),
        ))
        atoms = rule_atoms(s, plan, i)
        returned.append(z3.If(stop, sl.b + plan.nb[i], 0))
        released.append(atoms.released - atoms.handed + returned[i])
        samples.append(samp)
        stops.append(stop)
        final_o.append(o1)
    after = State(
        new_slots, s.free + _sum(released), s.wfront - n, s.wback, s.rback + 2 * n, s.step + 1, s.nextseq,
        new_drafts if spec else None,
    )
    return StepOutcome(after, samples, stops, final_o, returned)


def arrive(ctx: Ctx, s: State, i: int, p: Any, mt: Any, prio: Any = 0) -> State:
    """``add_request``: a fresh request enters empty slot ``i`` at the back of the waiting queue."""
    slots = list(s.slots)
    slots[i] = Slot(st=z3.IntVal(WAITING), p=p, o=z3.IntVal(0), mt=mt, nc=z3.IntVal(0), b=z3.IntVal(0),
                    pos=s.wback + 1, adm=z3.BoolVal(False), npre=z3.IntVal(0), arr=s.step, prio=prio,
                    seq=s.nextseq)
    drafts = None if s.drafts is None else [z3.IntVal(0) if j == i else d for j, d in enumerate(s.drafts)]
    return replace(s, slots=slots, wback=s.wback + 1, nextseq=s.nextseq + 1, drafts=drafts)


def arrive_precondition(s: State, i: int, p: Any, mt: Any) -> Any:
    """The slot is free and the request is well formed (``prompt_len >= 0``, ``max_tokens >= 0``)."""
    return z3.And(s.slots[i].st == EMPTY, p >= 0, mt >= 0)


def abort(ctx: Ctx, s: State, i: int) -> State:
    """``abort_request`` of the live request in slot ``i``: it ends and releases every block."""
    slots = list(s.slots)
    sl = s.slots[i]
    slots[i] = replace(sl, st=z3.IntVal(EMPTY), b=z3.IntVal(0))
    drafts = None if s.drafts is None else [z3.IntVal(0) if j == i else d for j, d in enumerate(s.drafts)]
    return replace(s, slots=slots, free=s.free + z3.If(sl.live, sl.b, 0), drafts=drafts)


# --- invariants (schedspec.spec.invariants) ------------------------------------------------------


def state_invariants(ctx: Ctx, s: State) -> dict[str, Any]:
    """The state invariants of :mod:`schedspec.spec.invariants` on live slots, by name.

    ``no-request-lost`` holds by construction (a slot is in exactly one queue or empty).
    """
    c = ctx.cfg
    S = s.slots
    n = s.n
    inv: dict[str, list[Any]] = {name: [] for name in STATE_INVARIANT_ORDER}
    inv["running-within-max-num-seqs"].append(count([sl.running for sl in S]) <= c.max_num_seqs)
    held = _sum([z3.If(sl.live, sl.b, 0) for sl in S])
    inv["kv-capacity"].append(held <= c.num_kv_blocks)
    inv["block-conservation"].append(s.free >= 0)
    inv["block-conservation"].append(s.free + held == c.num_kv_blocks)
    for i in range(n):
        sl = S[i]
        inv["block-conservation"].append(z3.Implies(sl.live, sl.b >= 0))
        inv["table-covers-computed"].append(z3.Implies(sl.running, ctx.covers(sl.b, sl.nc)))
        inv["output-bound"].append(z3.Implies(sl.live, sl.o <= sl.mt))
        inv["output-bound"].append(z3.Implies(z3.And(sl.live, sl.o >= 1),
                                              sl.p + sl.o <= zmax(c.max_model_len, sl.p + 1)))
        inv["computed-bound"].append(z3.Implies(sl.live, z3.And(sl.nc >= 0, sl.nc <= sl.p + sl.o)))
        inv["preempted-holds-nothing"].append(z3.Implies(sl.waiting, z3.And(sl.b == 0, sl.nc == 0)))
        if ctx.spec is not None:
            d = s.drafts[i]
            inv["drafts-on-running-decodes"].append(z3.And(d >= 0, z3.Implies(d > 0, z3.And(
                sl.running, sl.nc == sl.p + sl.o - 1, sl.nc >= sl.p, d <= ctx.spec.k))))
        for j in range(i + 1, n):
            other = S[j]
            inv["queues-disjoint"].append(z3.Implies(z3.And(sl.waiting, other.waiting), sl.pos != other.pos))
            inv["queues-disjoint"].append(z3.Implies(z3.And(sl.running, other.running), sl.pos != other.pos))
    return {name: z3.And(parts) for name, parts in inv.items()}


STATE_INVARIANT_ORDER = (
    "running-within-max-num-seqs", "kv-capacity", "block-conservation", "table-covers-computed", "queues-disjoint",
    "output-bound", "computed-bound", "preempted-holds-nothing", "drafts-on-running-decodes",
)
"""``drafts-on-running-decodes`` is ``True`` without speculative decoding (no state holds drafts)."""


def support(ctx: Ctx, s: State) -> dict[str, Any]:
    """Facts that make the invariants inductive (the naive invariant is not), by name."""
    c = ctx.cfg
    out: dict[str, list[Any]] = {name: [] for name in SUPPORT_ORDER}
    for sl in s.slots:
        live = sl.live
        out["ranges"].append(z3.And(sl.st >= EMPTY, sl.st <= RUNNING))
        out["ranges"].append(z3.Implies(live, z3.And(sl.p >= 0, sl.mt >= 0, sl.o >= 0)))
        out["ranges"].append(z3.Implies(z3.Not(live), sl.b == 0))
        out["admission"].append(z3.Implies(sl.running, sl.adm))
        out["admission"].append(z3.Implies(sl.st == WAITING, z3.Not(sl.adm)))
        out["admission"].append(z3.Implies(sl.st == PREEMPTED, sl.adm))
        out["admission"].append(z3.Implies(z3.And(live, z3.Not(sl.adm)), z3.And(sl.o == 0, sl.nc == 0, sl.b == 0)))
        out["admission"].append(z3.Implies(z3.And(live, sl.adm), fits_alone(ctx, sl.p, sl.mt)))
        out["live-below-limits"].append(z3.Implies(z3.And(live, sl.o >= 1),
                                                   z3.And(sl.o < sl.mt, sl.p + sl.o < c.max_model_len)))
        out["running-has-pending"].append(z3.Implies(sl.running, sl.nc < sl.p + sl.o))
        out["running-has-pending"].append(z3.Implies(z3.And(sl.running, z3.Not(c.enable_chunked_prefill)),
                                                     sl.nc == sl.p + sl.o - 1))
        if ctx.spec is None:
            out["no-excess-blocks"].append(z3.Implies(live, sl.b <= ctx.cdiv(sl.p + sl.o)))
        else:  # blocks kept after rejected drafts, and the lookahead: at most k - 1 positions past the sequence
            out["no-excess-blocks"].append(
                z3.Implies(live, sl.b <= ctx.cdiv(ctx.slot_tokens(sl.p + sl.o - 1 + ctx.spec.k))))
        out["queue-bounds"].append(z3.Implies(sl.waiting, z3.And(sl.pos >= s.wfront, sl.pos <= s.wback)))
        out["queue-bounds"].append(z3.Implies(sl.running, sl.pos <= s.rback))
    out["queue-bounds"].append(s.wfront <= s.wback + 1)
    for a in s.slots:
        for b in s.slots:
            if a is not b:
                out["preempted-first"].append(z3.Implies(z3.And(a.st == PREEMPTED, b.st == WAITING), a.pos < b.pos))
    return {name: z3.And(parts) for name, parts in out.items()}


SUPPORT_ORDER = (
    "ranges", "admission", "live-below-limits", "running-has-pending", "no-excess-blocks", "queue-bounds",
    "preempted-first",
)


def invariant(ctx: Ctx, s: State) -> Any:
    """Every state invariant and every support fact."""
    return z3.And(list(state_invariants(ctx, s).values()) + list(support(ctx, s).values()))


def initial_state(ctx: Ctx, n: int) -> State:
    """``SchedulerState.initial``: no request, every block free."""
    zero = z3.IntVal(0)
    slots = [Slot(st=z3.IntVal(EMPTY), p=zero, o=zero, mt=zero, nc=zero, b=zero, pos=zero,
                  adm=z3.BoolVal(False), npre=zero, arr=zero, prio=zero, seq=zero) for _ in range(n)]
    return State(slots, ctx.cfg.num_kv_blocks, zero, zero, zero, zero, zero)


def step_invariants(ctx: Ctx, s: State, plan: Plan, out: StepOutcome) -> dict[str, Any]:
    """Step invariants: ``chunks-in-order``, and the invariants on the requests that end in the step
    (``output-bound`` on their final outputs; they release every block). The token budget is a rule
    (``token-budget``), not an invariant: stating it again here would prove it from itself. With
    speculative decoding also ``rejected-drafts-uncomputed`` and ``accepted-drafts-prefix`` (as counts: a
    sampler that verified drafts appends at most ``1 + nd`` tokens)."""
    c = ctx.cfg
    parts: dict[str, list[Any]] = {"chunks-in-order": [], "ended-requests": []}
    if ctx.spec is not None:
        parts.update({"rejected-drafts-uncomputed": [], "accepted-drafts-prefix": []})
    for i in range(s.n):
        sl = s.slots[i]
        new = out.state.slots[i]
        parts["chunks-in-order"].append(z3.Implies(plan.sched[i], plan.start[i] == sl.nc))
        if ctx.spec is None:
            parts["chunks-in-order"].append(
                z3.Implies(z3.And(plan.sched[i], new.live), new.nc == sl.nc + plan.ntok[i]))
        else:
            nd = plan.nd[i]
            parts["chunks-in-order"].append(z3.Implies(z3.And(plan.sched[i], nd == 0, new.live),
                                                       new.nc == sl.nc + plan.ntok[i]))
            parts["rejected-drafts-uncomputed"].append(z3.Implies(
                z3.And(plan.sched[i], nd > 0, new.live), z3.And(new.nc == sl.nc + 1 + (new.o - sl.o - 1),
                                                                 new.nc == new.p + new.o - 1)))
            parts["accepted-drafts-prefix"].append(z3.Implies(
                z3.And(plan.sched[i], nd > 0), z3.And(out.final_o[i] - sl.o >= 1, out.final_o[i] - sl.o <= 1 + nd)))
        o1 = out.final_o[i]
        parts["ended-requests"].append(z3.Implies(out.stops[i], z3.And(
            o1 <= sl.mt, sl.p + o1 <= zmax(c.max_model_len, sl.p + 1))))
    return {name: z3.And(v) for name, v in parts.items()}


StateFn = Callable[[Ctx, State], Any]
