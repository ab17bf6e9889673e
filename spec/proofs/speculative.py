"""The central theorem with speculative decoding: the local rules still suffice for the invariants when
decodes verify drafts.

The count encoding of :mod:`.encoding` with a :class:`~.encoding.Speculative` context: every slot holds
``d`` drafts, every scheduled item verifies ``nd`` of them (``ntok = 1 + nd`` for a decode), and each step
takes the model's and the drafter's choices as free inputs (:class:`~.encoding.DraftInputs`: the drafts
accepted, ``0 <= acc <= nd``; which appended token is the EOS, if any; the drafts proposed,
``0 <= prop <= k``). ``num_speculative_tokens = k >= 1`` and ``num_lookahead_tokens = L >= 0`` are
variables, so each theorem holds for every k and every lookahead, for every config that validation
accepts and every state of N slots.

Theorems ``spec/speculative/<name>``: ``init``, ``arrive``, ``abort`` and ``step/<goal>`` for every state
invariant (``kv-capacity``, ``block-conservation``, ``table-covers-computed`` ... and
``drafts-on-running-decodes``), every support fact and the step invariants (``chunks-in-order``,
``rejected-drafts-uncomputed``, ``accepted-drafts-prefix``, ``ended-requests``), each from ``Inv`` and every
rule (each obligation first from a slice of them, :data:`SLICES`, then, if that does not prove it, from
all; the sequence-cap and block-accounting lemmas are proved as without drafts, and the drafts count in
``token-budget`` since an item's ``ntok`` includes them). The vacuity checks ask the premises
to allow a step that rejects drafts, one that accepts them all, a stop inside the accepted drafts, a
preemption of a request holding drafts, an admission at ``max_num_seqs`` and a rejection.

Not modelled (as in :mod:`.encoding`): block ids and prefix caching (the prefix-cache encoding,
:mod:`.prefix`, has no drafts); which drafts are verified (a prefix of the proposed ones: only the count).
"""

from __future__ import annotations

from typing import Any

import z3

from .core import PROVED, Options, Result, Theorem, Timer
from .encoding import (
    PREEMPTED,
    STATE_INVARIANT_ORDER,
    SUPPORT_ORDER,
    Ctx,
    DraftInputs,
    abort,
    arrive,
    arrive_precondition,
    initial_state,
    rule_atoms,
    symbolic_state,
)
from .solve import Prover, check
from .theorems import (
    GOAL_STATEMENTS,
    STEP_SLICES,
    StepGoals,
    StepVariant,
    _step_goals,
    config_valid,
    inv_parts,
    step_theorem,
)
from .theorems import setup as _setup

SPECULATIVE_GOALS = {
    **GOAL_STATEMENTS,
    "inv:drafts-on-running-decodes": "only a running decode holds drafts, at most num_speculative_tokens",
    "step:rejected-drafts-uncomputed": "a decode that verified drafts and goes on has computed no rejected one",
    "step:accepted-drafts-prefix": "a decode that verified nd drafts appends between 1 and 1 + nd tokens",
}
"""Each goal's statement: those of :data:`.theorems.GOAL_STATEMENTS` (now with drafts) and the new ones."""


def setup(opts: Options, prefix: str = "") -> Ctx:
    """A context with the symbolic config the options describe and symbolic k and lookahead."""
    return _setup(opts, prefix, speculative=True)


def step_cases(ctx: Ctx, s: Any, plan: Any, inputs: DraftInputs, out: Any) -> dict[str, Any]:
    """The interesting cases of a step with drafts, each of which the premises must allow."""
    c = ctx.cfg
    n = s.n
    atoms = [rule_atoms(s, plan, i) for i in range(n)]
    admitted = z3.Sum([a.admitted for a in atoms] + [z3.IntVal(0)])
    after = z3.Sum([a.running - a.preempted + a.admitted for a in atoms] + [z3.IntVal(0)])
    verify = [z3.And(plan.sched[i], plan.nd[i] >= 1, out.samples[i]) for i in range(n)]
    return {
        "a step that rejects drafts": z3.Or([z3.And(verify[i], inputs.acc[i] < plan.nd[i],
                                                    out.state.slots[i].live) for i in range(n)]),
        "a step that accepts every draft": z3.Or([z3.And(verify[i], inputs.acc[i] == plan.nd[i], plan.nd[i] >= 2)
                                                  for i in range(n)]),
        "a stop inside the accepted drafts": z3.Or([z3.And(verify[i], out.stops[i], inputs.acc[i] >= 1,
                                                           out.final_o[i] - s.slots[i].o <= inputs.acc[i])
                                                    for i in range(n)]),
        "a preemption of a request holding drafts": z3.Or([z3.And(plan.pre[i], sl.running, s.drafts[i] >= 1)
                                                           for i, sl in enumerate(s.slots)]),
        "admission at max_num_seqs": z3.And(admitted >= 1, after == c.max_num_seqs),
        "rejection": z3.Or([z3.And(plan.rej[i], sl.live) for i, sl in enumerate(s.slots)]),
    }


DRAFT_HYPOTHESES = ("inputs", "rule:drafts-only-in-decodes", "rule:drafts-are-proposed", "inv:drafts-on-running-decodes")
"""Added to every slice of :data:`.theorems.STEP_SLICES`: what the drafts bring to each obligation."""

SLICES = {
    **{goal: ("cfg",) + names + DRAFT_HYPOTHESES for goal, names in STEP_SLICES.items()},
    # the running count after a step does not depend on drafts (a stop only ends a request, and the count
    # lemma is per slot): with the drafts' hypotheses the query is unknown after 2 x 300 s at N = 32 under
    # load, without them proved in 24 s
    "inv:running-within-max-num-seqs": ("cfg",) + STEP_SLICES["inv:running-within-max-num-seqs"],
    "inv:drafts-on-running-decodes": ("cfg", "wf", "sup:ranges", "rule:known-requests", "rule:chunk-continues",
                                      "rule:preempt-running-only", "rule:no-overcompute", "inv:computed-bound",
                                      "sup:running-has-pending") + DRAFT_HYPOTHESES,
    "step:rejected-drafts-uncomputed": ("cfg", "rule:chunk-continues", "rule:known-requests", "sup:ranges")
                                       + DRAFT_HYPOTHESES,
    "step:accepted-drafts-prefix": ("cfg", "rule:chunk-continues", "rule:known-requests", "sup:ranges",
                                    "sup:live-below-limits") + DRAFT_HYPOTHESES,
}
"""Each obligation's hypotheses, asked first (a slice); an obligation a slice does not prove is asked again
with every hypothesis, so a slice only saves time, never changes a verdict."""


def _witness_fields(step: StepGoals) -> dict[str, list[Any]]:
    assert step.inputs is not None
    return {"d": step.s.drafts, "plan_nd": step.plan.nd, "acc": step.inputs.acc, "ej": step.inputs.ej,
            "prop": step.inputs.prop}


SPECULATIVE = StepVariant(
    speculative=True,
    name_prefix="spec/speculative/step",
    premise="Inv and Allowed(plan) and Update with drafts (any k >= 1, any lookahead, any acceptances)",
    statements=SPECULATIVE_GOALS,
    slices=SLICES,
    # a goal over slots (and pairs of slots) with drafts: one part at a time
    split_every_conjunction=True,
    cases=lambda step: step_cases(step.ctx, step.s, step.plan, step.inputs, step.out),
    witness_fields=_witness_fields,
)
"""The step with drafts, for :func:`.theorems.step_theorem`: the same builder, runner and vacuity check as
the step without them."""


def step_goals(opts: Options) -> StepGoals:
    """The step with drafts' hypotheses and goals at ``opts.slots`` slots (built once per options)."""
    return _step_goals(opts, opts.slots, SPECULATIVE)


INIT_STATEMENT = "Init => Inv with drafts: the initial state holds no draft"
ARRIVE_STATEMENT = "Inv and a request arrives => Inv' (with drafts)"
ABORT_STATEMENT = "Inv and a live request, possibly holding drafts, is aborted => Inv' (with drafts)"


def _init(opts: Options) -> Result:
    timer = Timer()
    ctx = setup(opts)
    s0 = initial_state(ctx, opts.slots)
    s0.drafts = [z3.IntVal(0)] * opts.slots
    answer = check(ctx, [config_valid(ctx)], z3.And(list(inv_parts(ctx, s0).values())), opts.timeout_s)
    vacuity = Prover(ctx, [config_valid(ctx)], opts.timeout_s).coverage({})
    return Result("spec/speculative/init", INIT_STATEMENT, PROVED, answer.status, opts.slots, opts.block_label,
                  seconds=timer.seconds, detail=answer.reason, vacuity=vacuity)


def _env_action(name: str, statement: str, action: str, opts: Options) -> Result:
    timer = Timer()
    ctx = setup(opts)
    s = symbolic_state(opts.slots, "s", speculative=True)
    hyps = [config_valid(ctx), z3.And(list(inv_parts(ctx, s).values()))]
    sl = s.slots[0]
    if action == "arrive":
        p, mt = z3.Int("new_p"), z3.Int("new_mt")
        hyps.append(arrive_precondition(s, 0, p, mt))
        hyps.append(s.drafts[0] == 0)  # an empty slot holds no draft (support: ranges)
        after = arrive(ctx, s, 0, p, mt)
        cases = {"others live": z3.And([other.live for other in s.slots[1:]])}
    else:
        hyps.append(sl.live)
        after = abort(ctx, s, 0)
        cases = {"abort of a decode holding drafts": z3.And(sl.running, s.drafts[0] >= 1),
                 "abort of a preempted request": sl.st == PREEMPTED}
    answer = check(ctx, hyps, z3.And(list(inv_parts(ctx, after).values())), opts.timeout_s)
    vacuity = Prover(ctx, hyps, opts.timeout_s).coverage(cases)
    return Result(name, statement, PROVED, answer.status, opts.slots, opts.block_label, seconds=timer.seconds,
                  detail=answer.reason, vacuity=vacuity)


def speculative_theorems() -> list[Theorem]:
    """Every theorem with drafts, in the order ``schedspec prove`` lists them."""
    out = [
        Theorem("spec/speculative/init", INIT_STATEMENT, _init),
        Theorem("spec/speculative/arrive", ARRIVE_STATEMENT,
                lambda o: _env_action("spec/speculative/arrive", ARRIVE_STATEMENT, "arrive", o)),
        Theorem("spec/speculative/abort", ABORT_STATEMENT,
                lambda o: _env_action("spec/speculative/abort", ABORT_STATEMENT, "abort", o)),
    ]
    goal_names = ([f"inv:{k}" for k in STATE_INVARIANT_ORDER]
                  + [f"step:{k}" for k in ("chunks-in-order", "rejected-drafts-uncomputed", "accepted-drafts-prefix",
                                          "ended-requests")]
                  + [f"sup:{k}" for k in SUPPORT_ORDER])
    out.extend(step_theorem(g, SPECULATIVE) for g in goal_names)
    return out
