"""The spec's central theorem, policy-independent: its local rules suffice for its invariants.

``Inv`` is the conjunction of the state invariants of :mod:`schedspec.spec.invariants` (encoded in
:func:`.encoding.state_invariants`) and the support facts that make it inductive
(:func:`.encoding.support`). The theorems, for every config that validation accepts and every state
of N slots:

- ``spec/init``: ``Init => Inv``.
- ``spec/arrive``, ``spec/abort``: the environment's actions preserve ``Inv``.
- ``spec/step/<invariant>``: ``Inv and Allowed(plan) and Update => <invariant>'`` for each invariant,
  each support fact and each step invariant, whatever the plan and whichever requests sample EOS.
  ``Allowed`` is the conjunction of the local rules of :mod:`schedspec.spec.rules` (never "the
  invariants hold afterwards", which would make the theorem circular).

Each step obligation is first asked with only the hypotheses it needs (a slice); a counterexample
found on a slice is checked again with every hypothesis before it is reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import z3

from .core import COUNTEREXAMPLE, PROVED, UNKNOWN, Coverage, Options, Result, Theorem, Timer
from .encoding import (
    PREEMPTED,
    RULE_ORDER,
    STATE_INVARIANT_ORDER,
    SUPPORT_ORDER,
    Ctx,
    DraftInputs,
    Speculative,
    SymConfig,
    abort,
    allowed_rules,
    apply_plan,
    arrive,
    arrive_precondition,
    initial_state,
    plan_well_formed,
    rule_atoms,
    state_invariants,
    step_invariants,
    support,
    symbolic_plan,
    symbolic_state,
)
from .solve import Answer, Prover, check, minimize, state_values, witness_objectives


def setup(opts: Options, prefix: str = "", speculative: bool = False) -> Ctx:
    """A context with the symbolic config the options describe; with ``speculative``, also a symbolic
    ``num_speculative_tokens`` and ``num_lookahead_tokens`` (:class:`.encoding.Speculative`)."""
    fixed = opts.config_fixed()
    cfg = SymConfig.symbolic(prefix=prefix, fixed=fixed)
    return Ctx(cfg, opts.block, prefix=prefix, spec=Speculative.symbolic(prefix) if speculative else None)


def config_valid(ctx: Ctx) -> Any:
    """The ``cfg`` hypothesis: the config validation accepts (with drafts, also k >= 1 and L >= 0)."""
    if ctx.spec is None:
        return ctx.cfg.valid()
    return z3.And(ctx.cfg.valid(), ctx.spec.valid())


def inv_parts(ctx: Ctx, s: Any) -> dict[str, Any]:
    parts = {f"inv:{k}": v for k, v in state_invariants(ctx, s).items()}
    parts.update({f"sup:{k}": v for k, v in support(ctx, s).items()})
    return parts


def recheck_block_size(opts: Options, rerun: Any) -> tuple[str, str]:
    """For an uninterpreted ``ceil``, a counterexample may be spurious: run the same obligation with the
    fixed block size and say whether it confirms it."""
    fixed = dataclasses.replace(opts, block="fixed")
    status, _ = rerun(fixed)
    if status == COUNTEREXAMPLE:
        return COUNTEREXAMPLE, f"confirmed with block_size={opts.block_size_value}"
    return UNKNOWN, (f"counterexample under uninterpreted ceil, not confirmed with block_size={opts.block_size_value} "
                     f"({status}); possibly spurious")


STEP_SLICES: dict[str, tuple[str, ...]] = {
    "inv:running-within-max-num-seqs": ("inv:running-within-max-num-seqs", "rule:sequence-cap", "rule:known-requests", "rule:preempt-running-only",
                         "rule:reject-only-impossible", "sup:ranges"),
    "inv:kv-capacity": ("inv:block-conservation", "inv:preempted-holds-nothing", "rule:known-requests",
                        "rule:preempt-running-only", "rule:reject-only-impossible", "rule:blocks-from-free-pool",
                        "sup:ranges", "wf"),
    "inv:block-conservation": ("inv:block-conservation", "inv:preempted-holds-nothing", "rule:known-requests",
                               "rule:preempt-running-only", "rule:reject-only-impossible",
                               "rule:blocks-from-free-pool", "sup:ranges", "wf"),
    "inv:table-covers-computed": ("inv:table-covers-computed", "rule:block-table-covers", "rule:chunk-continues",
                                  "rule:known-requests", "rule:preempt-running-only", "sup:ranges", "wf"),
    "inv:queues-disjoint": ("inv:queues-disjoint", "sup:queue-bounds", "wf", "rule:known-requests",
                            "rule:preempt-running-only", "rule:reject-only-impossible"),
    "inv:output-bound": ("inv:output-bound", "sup:live-below-limits", "sup:ranges", "rule:known-requests"),
    "inv:computed-bound": ("inv:computed-bound", "rule:no-overcompute", "rule:chunk-continues",
                           "rule:positive-tokens", "rule:known-requests", "sup:ranges"),
    "inv:preempted-holds-nothing": ("inv:preempted-holds-nothing", "rule:known-requests"),
    "sup:ranges": ("sup:ranges", "wf", "rule:known-requests", "inv:block-conservation"),
    "sup:admission": ("sup:admission", "rule:admit-fits-alone", "rule:known-requests", "rule:preempt-running-only",
                      "inv:preempted-holds-nothing"),
    "sup:live-below-limits": ("sup:live-below-limits", "sup:ranges", "rule:known-requests"),
    "sup:running-has-pending": ("sup:running-has-pending", "rule:no-overcompute", "rule:chunk-continues",
                                "rule:whole-prefill-without-chunking", "rule:positive-tokens", "rule:known-requests",
                                "sup:ranges", "inv:computed-bound", "inv:preempted-holds-nothing"),
    "sup:no-excess-blocks": ("sup:no-excess-blocks", "rule:no-excess-blocks", "rule:known-requests", "sup:ranges"),
    "sup:queue-bounds": ("sup:queue-bounds", "wf", "rule:known-requests", "rule:preempt-running-only"),
    "sup:preempted-first": ("sup:preempted-first", "sup:queue-bounds", "wf", "rule:known-requests",
                            "rule:preempt-running-only"),
    "step:chunks-in-order": ("rule:chunk-continues", "rule:known-requests"),
    "step:ended-requests": ("inv:output-bound", "sup:live-below-limits", "sup:ranges", "rule:known-requests",
                             "rule:admit-fits-alone", "sup:admission"),
}

GOAL_STATEMENTS = {
    "inv:running-within-max-num-seqs": "len(running) <= max_num_seqs",
    "inv:kv-capacity": "blocks held <= num_kv_blocks",
    "inv:block-conservation": "free + sum(held) == num_kv_blocks, free >= 0, ended requests hold nothing",
    "inv:table-covers-computed": "a running request's blocks * block_size >= its computed tokens",
    "inv:queues-disjoint": "no request twice in waiting or running (queue positions distinct)",
    "inv:output-bound": "outputs <= max_tokens and prompt + outputs <= max(max_model_len, prompt + 1)",
    "inv:computed-bound": "0 <= num_computed_tokens <= prompt + outputs",
    "inv:preempted-holds-nothing": "a waiting (or preempted) request holds no block and no computed token",
    "sup:ranges": "support: lengths >= 0, empty slots hold no block",
    "sup:admission": ("support: running => admitted => fits alone; fresh waiting => never admitted, and a "
                      "never-admitted request has no output, no computed token, no block"),
    "sup:live-below-limits": "support: a live request with outputs has outputs < max_tokens and length < max_model_len",
    "sup:running-has-pending": "support: a running request has >= 1 pending token (exactly 1 without chunking)",
    "sup:no-excess-blocks": "support: a request holds <= ceil((prompt + outputs) / block_size) blocks",
    "sup:queue-bounds": "support: queue positions lie within the queue's bounds",
    "sup:preempted-first": "support: every preempted request is ahead of every fresh one in the waiting queue",
    "step:chunks-in-order": "a chunk starts at the computed tokens and advances them by its size",
    "step:ended-requests": "a request ending in the step satisfies output-bound with its final outputs",
}


def block_accounting(s: Any, plan: Any, out: Any) -> Any:
    """Lemma, slot by slot, in the rule's own atoms (``blocks-from-free-pool`` adds up ``handed`` and
    ``released``, :func:`.encoding.rule_atoms`): the blocks a slot holds after the step are those it held,
    less what a preemption releases, plus what the plan hands it, less what it returns when it stops;
    and what it returns is >= 0. Summed over slots by linear arithmetic alone, these give conservation
    and capacity from the rule (stated in other atoms, Z3 splits cases per slot: exponential in N)."""
    local = []
    for i, (old, new) in enumerate(zip(s.slots, out.state.slots, strict=True)):
        atoms = rule_atoms(s, plan, i)
        local.append(z3.If(new.live, new.b, 0)
                     == z3.If(old.live, old.b, 0) - atoms.released + atoms.handed - out.returned[i])
        local.append(out.returned[i] >= 0)
    return z3.And(local)


def running_accounting(s: Any, plan: Any, out: Any) -> Any:
    """Lemma, slot by slot, in the atoms ``sequence-cap`` counts (:func:`.encoding.rule_atoms`): a slot
    runs after the step at most if it ran and was not preempted, or was admitted; so the count after the
    step is at most running - preempted + admitted by linear arithmetic alone."""
    local = []
    for i, new in enumerate(out.state.slots):
        atoms = rule_atoms(s, plan, i)
        local.append(z3.If(new.running, 1, 0) <= atoms.running - atoms.preempted + atoms.admitted)
    return z3.And(local)


LEMMAS = {"inv:block-conservation": block_accounting, "inv:kv-capacity": block_accounting,
          "inv:running-within-max-num-seqs": running_accounting}


class StepGoals(NamedTuple):
    """One step's symbolic problem: the context, the hypotheses and goals by name, the state before the
    step, the plan, the EOS flags (without drafts), the drafts' inputs (with drafts, else ``None``) and the
    update's output."""

    ctx: Ctx
    hyps: dict[str, Any]
    goals: dict[str, Any]
    s: Any
    plan: Any
    eos: list[Any]
    inputs: DraftInputs | None
    out: Any


@dataclasses.dataclass(frozen=True)
class StepVariant:
    """Which step the step theorems reason about: :data:`PLAIN` (one token per decode) or, in
    :mod:`.speculative`, the step with drafts. One builder (:func:`_build_step_goals`), one runner
    (:func:`_run_step_goal`), one vacuity check and one theorem maker (:func:`step_theorem`) serve both.

    Attributes:
        speculative: encode drafts (a :class:`.encoding.Speculative` context, a slot's ``d``, a plan's
            ``nd``, the step's :class:`.encoding.DraftInputs` as the hypothesis ``inputs``).
        name_prefix: the theorems' name prefix (``spec/step``).
        premise: the statements' left-hand side.
        statements: each goal's statement.
        slices: each goal's hypotheses asked first (``cfg`` included).
        split_every_conjunction: prove every goal that is a conjunction one part at a time (else only
            :data:`SPLIT_GOALS`).
        cases: the vacuity cases of a step, from its :class:`StepGoals`.
        witness_fields: the per-slot terms a witness shows beside the state and plan.
    """

    speculative: bool
    name_prefix: str
    premise: str
    statements: Mapping[str, str]
    slices: Mapping[str, tuple[str, ...]]
    split_every_conjunction: bool
    cases: Callable[[StepGoals], dict[str, Any]]
    witness_fields: Callable[[StepGoals], dict[str, list[Any]]]


_STEP_GOALS: dict[str, StepGoals] = {}


def _step_goals(opts: Options, slots: int, variant: StepVariant | None = None) -> StepGoals:
    """The step's hypotheses and goals, built once per options and variant (one at a time: building them
    is most of a small theorem's time)."""
    variant = variant or PLAIN
    key = repr((opts, slots, variant.speculative))
    if key not in _STEP_GOALS:
        _STEP_GOALS.clear()
        _STEP_GOALS[key] = _build_step_goals(opts, slots, variant.speculative)
    return _STEP_GOALS[key]


def _build_step_goals(opts: Options, slots: int, speculative: bool = False) -> StepGoals:
    """``Inv`` and every rule of a symbolic state and plan of ``slots`` slots as hypotheses, and ``Inv``,
    the step invariants and the lemmas after the update as goals; with ``speculative``, the state holds
    drafts, the plan verifies some, and the step's inputs (accepted drafts, where the EOS falls, the drafts
    proposed) are free within their bounds (hypothesis ``inputs``)."""
    ctx = setup(opts, speculative=speculative)
    s = symbolic_state(slots, "s", speculative=speculative)
    plan = symbolic_plan(slots, "pl", speculative=speculative)
    inputs = DraftInputs.symbolic(slots) if speculative else None
    # with drafts the EOS flags are unused: inputs.ej says which appended token is the EOS
    eos = [z3.BoolVal(False)] * slots if speculative else [z3.Bool(f"eos{i}") for i in range(slots)]
    hyps: dict[str, Any] = {"cfg": config_valid(ctx), "wf": plan_well_formed(plan)}
    if inputs is not None:
        hyps["inputs"] = inputs.valid(ctx, plan)
    hyps.update(inv_parts(ctx, s))
    hyps.update({f"rule:{k}": v for k, v in allowed_rules(ctx, s, plan).items()})
    out = apply_plan(ctx, s, plan, eos, inputs)
    goals = inv_parts(ctx, out.state)
    goals.update({f"step:{k}": v for k, v in step_invariants(ctx, s, plan, out).items()})
    for name, lemma in LEMMAS.items():
        goals["lemma:" + name] = lemma(s, plan, out)
    return StepGoals(ctx, hyps, goals, s, plan, eos, inputs, out)


SPLIT_GOALS = ("inv:queues-disjoint", "sup:preempted-first")
"""Goals that are conjunctions over pairs of slots: each pair is proved on its own (one incremental
solver, the hypotheses asserted once). Asked as one query, the negated conjunction of N^2 pairs is a
disjunction Z3 explores as a whole (queues-disjoint is unknown after 60 s at N = 32)."""


def prove_parts(ctx: Ctx, hypotheses: list[Any], parts: list[Any], timeout_s: float) -> Answer:
    """Prove each of ``parts`` from ``hypotheses``; the first part not proved gives the answer."""
    prover = Prover(ctx, hypotheses, timeout_s)
    for part in parts:
        answer = prover.prove(part)
        if answer.status != PROVED:
            return answer
    return Answer(PROVED)


def _run_step_goal(goal_name: str, opts: Options, use_slice: bool = True,
                   variant: StepVariant | None = None) -> tuple[str, Any]:
    """One step obligation of ``variant`` from its slice (``use_slice``) or every hypothesis; a lemma
    (:data:`LEMMAS`) is proved first and then assumed. Returns ``(status, (reason, witness))``, the
    witness minimized when every hypothesis was asked."""
    variant = variant or PLAIN
    step = _step_goals(opts, opts.slots, variant)
    ctx, hyps, goals = step.ctx, step.hyps, step.goals
    names = variant.slices[goal_name] if use_slice else tuple(hyps)
    hypotheses = [hyps[n] for n in dict.fromkeys(names)]
    answer = None
    failed = None
    if goal_name in LEMMAS:
        failed = goals["lemma:" + goal_name]
        answer = check(ctx, hypotheses, failed, opts.timeout_s)
        hypotheses.append(goals["lemma:" + goal_name])
    if answer is None or answer.status == PROVED:
        failed = goals[goal_name]
        if (variant.split_every_conjunction or goal_name in SPLIT_GOALS) and z3.is_and(failed):
            answer = prove_parts(ctx, hypotheses, failed.children(), opts.timeout_s)
        else:
            answer = check(ctx, hypotheses, failed, opts.timeout_s)
    witness = None
    model = answer.model
    if model is not None and not use_slice:
        # the reported witness: fewest live requests, smallest numbers (iterative tightening)
        model = minimize(ctx, hypotheses + [z3.Not(failed)], witness_objectives(step.s, step.plan),
                         min(opts.timeout_s, 10.0)) or model
    if model is not None:
        witness = state_values(model, step.s, step.plan, variant.witness_fields(step))
        witness["config"] = ctx.cfg.evaluate(model)
    return answer.status, (answer.reason, witness)


_STEP_VACUITY: dict[str, list[Coverage]] = {}


def step_cases(ctx: Ctx, s: Any, plan: Any, out: Any) -> dict[str, Any]:
    """The interesting cases of a step, each of which the premises must allow: a preemption, an
    admission that fills the last sequence slot, a request that stops, a rejection."""
    c = ctx.cfg
    atoms = [rule_atoms(s, plan, i) for i in range(s.n)]
    admitted = z3.Sum([a.admitted for a in atoms] + [z3.IntVal(0)])
    after = z3.Sum([a.running - a.preempted + a.admitted for a in atoms] + [z3.IntVal(0)])
    return {
        "preemption": z3.Or([z3.And(plan.pre[i], sl.running) for i, sl in enumerate(s.slots)]),
        "admission at max_num_seqs": z3.And(admitted >= 1, after == c.max_num_seqs),
        "stop": z3.Or(out.stops),
        "rejection": z3.Or([z3.And(plan.rej[i], sl.live) for i, sl in enumerate(s.slots)]),
    }


def step_vacuity(opts: Options, variant: StepVariant | None = None) -> list[Coverage]:
    """The step theorems' premises (``Inv``, every rule, a well-formed plan, with drafts the inputs'
    bounds) are satisfiable, alone and with each of the variant's cases (shared by every step theorem of
    the variant: each uses a subset of them)."""
    variant = variant or PLAIN
    key = repr((opts, variant.speculative))
    if key not in _STEP_VACUITY:
        step = _step_goals(opts, opts.slots, variant)
        prover = Prover(step.ctx, list(step.hyps.values()), opts.timeout_s)
        _STEP_VACUITY.clear()
        _STEP_VACUITY[key] = prover.coverage(variant.cases(step))
    return _STEP_VACUITY[key]


def step_theorem(goal_name: str, variant: StepVariant | None = None) -> Theorem:
    """The theorem ``<variant prefix>/<goal>``: the obligation from its slice, then, if the slice does not
    prove it, from every hypothesis (a slice only saves time, never changes a verdict); a counterexample
    under an uninterpreted ``ceil`` is confirmed with the fixed block size (:func:`recheck_block_size`)."""
    variant = variant or PLAIN
    kind, _, short = goal_name.partition(":")
    name = f"{variant.name_prefix}/{short}" if kind != "sup" else f"{variant.name_prefix}/support-{short}"
    statement = f"{variant.premise} => {variant.statements[goal_name]} after the step"

    def run(opts: Options) -> Result:
        timer = Timer()
        status, (reason, witness) = _run_step_goal(goal_name, opts, variant=variant)
        detail = reason
        if status != PROVED:
            status, (reason, witness) = _run_step_goal(goal_name, opts, use_slice=False, variant=variant)
            detail = reason
            if status == COUNTEREXAMPLE and opts.block == "uninterpreted":
                status, detail = recheck_block_size(
                    opts, lambda o: _run_step_goal(goal_name, o, use_slice=False, variant=variant))
            if status == COUNTEREXAMPLE:
                detail = "the rules allow a step that breaks it (witness state and plan attached)"
        vacuity = step_vacuity(opts, variant)
        return Result(name, statement, PROVED, status, opts.slots, opts.block_label, seconds=timer.seconds,
                      detail=detail, witness=witness, vacuity=vacuity)

    return Theorem(name, statement, run)


PLAIN = StepVariant(
    speculative=False,
    name_prefix="spec/step",
    premise="Inv and Allowed(plan) and Update",
    statements=GOAL_STATEMENTS,
    slices={goal: ("cfg",) + names for goal, names in STEP_SLICES.items()},
    split_every_conjunction=False,
    cases=lambda step: step_cases(step.ctx, step.s, step.plan, step.out),
    witness_fields=lambda step: {"eos": step.eos},
)
"""The step without drafts: every decode computes one token; a request samples an EOS or not."""


def _init(opts: Options) -> Result:
    timer = Timer()
    ctx = setup(opts)
    s0 = initial_state(ctx, opts.slots)
    answer = check(ctx, [ctx.cfg.valid()], z3.And(list(inv_parts(ctx, s0).values())), opts.timeout_s)
    vacuity = Prover(ctx, [ctx.cfg.valid()], opts.timeout_s).coverage({})
    return Result("spec/init", INIT_STATEMENT, PROVED, answer.status, opts.slots, opts.block_label,
                  seconds=timer.seconds, detail=answer.reason, vacuity=vacuity)


INIT_STATEMENT = "Init => Inv: the initial state (no request, every block free) satisfies every invariant"
ARRIVE_STATEMENT = "Inv and a request arrives (add_request, prompt_len >= 0, max_tokens >= 0) => Inv'"
ABORT_STATEMENT = "Inv and a live request is aborted (abort_request) => Inv'"


def _env_action(name: str, statement: str, action: str, opts: Options) -> Result:
    timer = Timer()
    ctx = setup(opts)
    s = symbolic_state(opts.slots, "s")
    hyps = [ctx.cfg.valid(), z3.And(list(inv_parts(ctx, s).values()))]
    sl = s.slots[0]
    if action == "arrive":
        p, mt = z3.Int("new_p"), z3.Int("new_mt")
        hyps.append(arrive_precondition(s, 0, p, mt))
        after = arrive(ctx, s, 0, p, mt)
        cases = {"others live": z3.And([other.live for other in s.slots[1:]])}
    else:
        hyps.append(sl.live)
        after = abort(ctx, s, 0)
        cases = {"abort mid-prefill": z3.And(sl.running, sl.nc < sl.p, sl.nc >= 1),
                 "abort of a preempted request": sl.st == PREEMPTED}
    answer = check(ctx, hyps, z3.And(list(inv_parts(ctx, after).values())), opts.timeout_s)
    witness = state_values(answer.model, s) if answer.model is not None else None
    vacuity = Prover(ctx, hyps, opts.timeout_s).coverage(cases)
    return Result(name, statement, PROVED, answer.status, opts.slots, opts.block_label, seconds=timer.seconds,
                  detail=answer.reason, witness=witness, vacuity=vacuity)


def spec_theorems() -> list[Theorem]:
    """Every spec theorem, in the order ``schedspec prove`` lists them."""
    out = [
        Theorem("spec/init", INIT_STATEMENT, _init),
        Theorem("spec/arrive", ARRIVE_STATEMENT, lambda o: _env_action("spec/arrive", ARRIVE_STATEMENT, "arrive", o)),
        Theorem("spec/abort", ABORT_STATEMENT, lambda o: _env_action("spec/abort", ABORT_STATEMENT, "abort", o)),
    ]
    # drafts-on-running-decodes holds trivially without drafts: proved with them (spec/speculative/...)
    goal_names = ([f"inv:{k}" for k in STATE_INVARIANT_ORDER if k != "drafts-on-running-decodes"] + [f"step:{k}" for k in
                  ("chunks-in-order", "ended-requests")] + [f"sup:{k}" for k in SUPPORT_ORDER])
    out.extend(step_theorem(g) for g in goal_names)
    from .blocks import block_theorems

    out.extend(block_theorems())
    from .speculative import speculative_theorems

    out.extend(speculative_theorems())
    return out


assert set(STEP_SLICES) == set(GOAL_STATEMENTS)
assert {k.partition(":")[2] for k in STEP_SLICES if k.startswith("rule:")} <= set(RULE_ORDER)
