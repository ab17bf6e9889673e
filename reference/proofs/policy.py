"""The reference policies' step (:func:`schedspec.reference.policies.plan_step`) as Z3 constraints.

The Python step is a loop over a symbolic order (running decodes, then running prefill chunks, each
in admission order; then waiting requests in the policy's order). The encoding makes the order
explicit: ``perm[k]`` is the slot processed k-th (``rank`` its inverse), constrained to list the
processed slots sorted by the loop's key, then the others by slot index. The running phase is then
unrolled over ranks ``k = 0..n-1`` with the loop's state carried from rank to rank (token budget,
free blocks, the set of requests already scheduled or preempted). The victims of rank ``k`` are the
running requests not yet gone, from the most recently admitted down to the request itself, for as long
as the blocks available stay below what it needs: ``v`` is preempted iff ``pos[v] >= pos[me]`` and
``avail[k] + blocks of the candidates after v < needed[k]``.

Admission takes a prefix of the policy's order: slot ``i`` is admitted iff it and every candidate
before it pass the checks (sequence slot, budget, chunk > 0, blocks for the whole sequence), each
computed assuming all before it were admitted.

These are constraints on fresh variables with exactly one solution for every state whose queue
positions are distinct (``tests/test_proofs_policy.py`` checks that the solution is unique and is the
plan the Python policy returns). :attr:`PolicyStep.lemmas` are consequences the proofs need and Z3
does not find alone (induction over the ranks, exchanging sums over ranks and slots); every theorem
proves them before using them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import z3

from schedspec.spec.proofs.encoding import Ctx, Plan, State, _sum, count, fits_alone, zmax, zmin

POLICIES = {
    "fcfs": {"order": "queue", "idle_only": False},
    "static": {"order": "queue", "idle_only": True},
    "shortest-prompt-first": {"order": "shortest_prompt", "idle_only": False},
    "priority": {"order": "priority", "idle_only": False},
}
"""The reference policies that have a proof encoding: each is ``plan_step`` with an admission order
and whether it admits only when nothing runs."""


@dataclass
class PolicyStep:
    """The plan, and the loop's values the property proofs refer to."""

    plan: Plan
    rejected: list[Any]
    processed: list[Any]
    perm: list[Any]
    any_preempted: Any
    admitting: Any
    lemmas: list[tuple[str, Any]]
    ordered_lemmas: list[tuple[str, Any]]
    layout_hypothesis: list[Any]
    """What the layout assumes of the state (:data:`LAYOUTS`): with ``canonical``, the slots are in
    processing order; with ``slot-order``, each queue is in slot order; empty for ``permuted``."""
    admission_order: list[list[Any]] = field(default_factory=list)
    """``admission_order[j][i]``: slot ``j`` comes before slot ``i`` in the admission order (both candidates)."""
    admission_index: dict[int, int] = field(default_factory=dict)
    """The admission loop's variables (by z3 id) and the slot each belongs to: their definitions refer to
    another slot's only under ``admission_order`` (the loop visits the slots in that order)."""
    loop: dict[str, Any] = field(default_factory=dict)
    """The running phase's carried values, for the cutoff argument (:mod:`.cutoff`): ``budget[k]`` and
    ``avail[k]`` (tokens and blocks left before rank ``k``), ``after[k][v]`` (blocks of the preemption
    candidates younger than slot ``v`` at rank ``k``), ``preby[k][v]`` (rank ``k`` preempts slot ``v``)."""


def chunk(ctx: Ctx, pending: Any, budget: Any) -> Any:
    """``policies._chunk``: the pending tokens capped by the long-prefill threshold (chunked prefill) and
    the budget; 0 without chunked prefill if they do not fit."""
    c = ctx.cfg
    t = c.long_prefill_token_threshold
    capped = z3.If(z3.And(t > 0, pending > t), t, pending)
    return z3.If(c.enable_chunked_prefill, zmin(capped, budget), z3.If(pending <= budget, pending, 0))


LAYOUTS = ("permuted", "canonical", "slot-order")
"""How :func:`plan_step` relates slots to the order it processes them in.

- ``permuted``: any slot may hold any request; the processing order is a symbolic permutation.
- ``canonical``: the slots are in processing order (running decodes, then running prefills, each by
  queue position, then the rest): a hypothesis on one state, which every state satisfies up to a
  permutation of its slots. The one-step theorems use it.
- ``slot-order``: the live requests sit in the slots in the order of addition, so that (under the
  ordering invariant ``Ord``) each queue's order is the slot order. The running phase is then two passes
  over the slots, decodes first, then prefills, and the admission order is the slot order: no
  permutation, and the hypothesis holds on every state of a run that puts each arrival after every live
  request (bounded model checking: :func:`.properties.run_from_init` and the progress and
  preemption runs). Queue order (fcfs, static) only.
"""


def plan_step(ctx: Ctx, s: State, policy: str, name: str = "", layout: str = "permuted") -> PolicyStep:
    """The step of ``policy`` from ``s`` (definitions go to ``ctx.facts``).

    ``layout`` (one of :data:`LAYOUTS`) says how slots map to the processing order. With ``canonical``, the
    slots are taken to be in processing order already (``perm`` is the identity): the constraints that
    say so are returned in :attr:`PolicyStep.layout_hypothesis`, a hypothesis about the state, not a definition.
    The one-step theorems use it: their hypotheses and goals are symmetric in the slots, so every state
    has a slot permutation satisfying it, and the ``pick`` chains over a symbolic order vanish (the step
    is then linear in N instead of quadratic). Runs of several steps cannot order every state in processing order at once;
    they keep the permutation or, for the queue-order policies, use ``slot-order`` (the hypothesis that
    each queue is in slot order, returned in :attr:`PolicyStep.layout_hypothesis` too).

    Raises:
        ValueError: an unknown layout, or ``slot-order`` for a policy that does not admit in queue order.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    canonical = layout == "canonical"
    slot_order = layout == "slot-order"
    params = POLICIES[policy]
    if slot_order and params["order"] != "queue":
        raise ValueError(f"layout 'slot-order' needs a policy admitting in queue order, not {policy!r}")
    if params["order"] == "priority":
        return plan_priority(ctx, s, name, canonical)
    c = ctx.cfg
    n = s.n
    S = s.slots
    p = name + "_" if name else ""

    def var(label: str, i: int | None = None, sort: str = "int", j: int | None = None) -> Any:
        suffix = "" if i is None else str(i) + ("" if j is None else f"_{j}")
        return ctx.fresh(f"{p}{label}{suffix}", sort)

    rejected = [z3.And(sl.waiting, z3.Not(sl.adm), z3.Not(fits_alone(ctx, sl.p, sl.mt))) for sl in S]
    pending = [sl.pending for sl in S]
    decode = [z3.And(sl.running, pending[i] == 1) for i, sl in enumerate(S)]
    processed = [z3.And(sl.running, pending[i] >= 1) for i, sl in enumerate(S)]
    facts = ctx.facts

    # The processing order as a permutation: perm[k] is the slot processed k-th. The first P entries are
    # the processed slots (decodes first, each group by queue position); the others follow in slot order.
    n_proc = count(processed)
    order_facts: list[Any] = []
    if slot_order:
        return _plan_step_slot_order(ctx, s, params, p, rejected, pending, decode, processed)
    if canonical:
        perm = [z3.IntVal(k) for k in range(n)]
        rank = [z3.IntVal(i) for i in range(n)]

        def pick(values: list[Any], k: int) -> Any:
            return values[k]
    else:
        perm = [var("perm", k) for k in range(n)]

        def pick(values: list[Any], k: int) -> Any:
            out = values[n - 1]
            for i in range(n - 2, -1, -1):
                out = z3.If(perm[k] == i, values[i], out)
            return out

        rank = [var("rank", i) for i in range(n)]  # the inverse permutation
        for k in range(n):
            facts.append(z3.And(perm[k] >= 0, perm[k] < n, rank[k] >= 0, rank[k] < n))
            for i in range(n):
                facts.append((perm[k] == i) == (rank[i] == k))
    for k in range(n):
        order_facts.append(pick(processed, k) == (k < n_proc))
    pos = [sl.pos for sl in S]
    for k in range(n - 1):
        dec_k, dec_next = pick(decode, k), pick(decode, k + 1)
        sorted_ = z3.Or(z3.And(dec_k, z3.Not(dec_next)), z3.And(dec_k == dec_next, pick(pos, k) < pick(pos, k + 1)))
        order_facts.append(z3.Implies(k + 1 < n_proc, sorted_))
        if not canonical:
            order_facts.append(z3.Implies(k >= n_proc, perm[k] < perm[k + 1]))
    if not canonical:
        facts.extend(order_facts)

    # the loop, one processed slot per rank k
    budget = [c.max_num_batched_tokens]
    avail = [s.free]
    gone = [[z3.BoolVal(False)] * n]
    sched_k, nt_k, nbk_k, tok_k, rel_k, needed_k, preby, after_k = [], [], [], [], [], [], [], []
    for k in range(n):
        is_slot = [perm[k] == i for i in range(n)]
        nt = ctx.define(f"{p}nt{k}", chunk(ctx, pick(pending, k), budget[k]))
        act = ctx.define(f"{p}act{k}", z3.And(k < n_proc, z3.Not(pick(gone[k], k)), budget[k] > 0, nt > 0), "bool")
        needed = ctx.define(f"{p}needed{k}", ctx.cdiv(pick([sl.nc for sl in S], k) + nt) - pick([sl.b for sl in S], k))
        cand = [z3.And(S[v].running, z3.Not(gone[k][v])) for v in range(n)]
        me = pick(pos, k)
        row = []
        after_k.append([])
        for v in range(n):
            after_v = _sum([z3.If(z3.And(cand[u], S[u].pos > S[v].pos), S[u].b, 0) for u in range(n) if u != v])
            after_k[k].append(after_v)
            row.append(ctx.define(f"{p}preby{k}_{v}",
                                  z3.And(act, cand[v], S[v].pos >= me, avail[k] + after_v < needed), "bool"))
        self_pre = z3.Or([z3.And(is_slot[v], row[v]) for v in range(n)])
        sched = ctx.define(f"{p}sched{k}", z3.And(act, z3.Not(self_pre)), "bool")
        tok = z3.If(sched, nt, 0)
        nbk = ctx.define(f"{p}nbk{k}", z3.If(sched, zmax(needed, 0), 0))
        released = _sum([z3.If(row[v], S[v].b, 0) for v in range(n)])
        budget.append(ctx.define(f"{p}budget{k + 1}", budget[k] - tok))
        avail.append(ctx.define(f"{p}avail{k + 1}", avail[k] + released - nbk))
        gone.append([ctx.define(f"{p}gone{k + 1}_{v}", z3.Or(gone[k][v], row[v], z3.And(is_slot[v], sched)), "bool")
                     for v in range(n)])
        sched_k.append(sched)
        nt_k.append(nt)
        nbk_k.append(nbk)
        tok_k.append(tok)
        rel_k.append(released)
        needed_k.append(needed)
        preby.append(row)

    def at_rank(values: list[Any], i: int) -> Any:
        if canonical:
            return values[i]
        out = values[n - 1]
        for k in range(n - 2, -1, -1):
            out = z3.If(rank[i] == k, values[k], out)
        return out

    sched = [at_rank(sched_k, i) for i in range(n)]
    nt = [at_rank(nt_k, i) for i in range(n)]
    nbk = [at_rank(nbk_k, i) for i in range(n)]
    pre = [z3.Or([preby[k][v] for k in range(n)]) for v in range(n)]
    any_pre = z3.Or(pre)
    admitting = z3.And(z3.Not(any_pre), z3.Not(z3.And(params["idle_only"], z3.Or([sl.running for sl in S]))))
    budget_r = budget[n]
    free_r = avail[n]
    n_run = count([sl.running for sl in S])

    candidate = [z3.And(sl.waiting, z3.Not(rejected[i])) for i, sl in enumerate(S)]

    def aord(j: int, i: int) -> Any:
        if i == j:
            return z3.BoolVal(False)
        if params["order"] == "queue":
            key = S[j].pos < S[i].pos
        else:
            key = z3.Or(S[j].p < S[i].p, z3.And(S[j].p == S[i].p, S[j].pos < S[i].pos))
        return z3.And(candidate[j], candidate[i], key)

    A = [[aord(j, i) for i in range(n)] for j in range(n)]
    budget_a = [var("budget_adm", i) for i in range(n)]
    nt_a = [var("nt_adm", i) for i in range(n)]
    ok = [var("ok_adm", i, "bool") for i in range(n)]
    admit = [var("admit", i, "bool") for i in range(n)]
    whole = [ctx.cdiv(sl.p + sl.o) for sl in S]
    for i in range(n):
        facts.append(budget_a[i] == budget_r - _sum([z3.If(A[j][i], nt_a[j], 0) for j in range(n)]))
        facts.append(nt_a[i] == chunk(ctx, pending[i], budget_a[i]))
        blocks_before = _sum([z3.If(A[j][i], whole[j], 0) for j in range(n)])
        facts.append(ok[i] == z3.And(n_run + count([A[j][i] for j in range(n)]) < c.max_num_seqs,
                                     budget_a[i] > 0, nt_a[i] > 0, whole[i] <= free_r - blocks_before))
        facts.append(admit[i] == z3.And(admitting, candidate[i], ok[i],
                                        *[z3.Implies(A[j][i], ok[j]) for j in range(n) if j != i]))

    scheduled = [z3.Or(sched[i], admit[i]) for i in range(n)]
    ntok = [z3.If(sched[i], nt[i], z3.If(admit[i], nt_a[i], 0)) for i in range(n)]
    nb = [z3.If(sched[i], nbk[i], z3.If(admit[i], whole[i], 0)) for i in range(n)]
    # batch order: running requests by rank, then admissions in the policy's order (indices < 2n)
    bpos = [z3.If(sched[i], rank[i], n + count([A[j][i] for j in range(n)])) for i in range(n)]
    ppos = [count([z3.And(pre[u], S[u].pos > S[v].pos) for u in range(n) if u != v]) for v in range(n)]
    plan = Plan(sched=scheduled, start=[sl.nc for sl in S], ntok=ntok, nb=nb, bpos=bpos, pre=pre, ppos=ppos,
                rej=rejected)

    # Lemmas: consequences of the definitions, each proved (in order, each using the ones before) by the
    # theorems that rely on them. Z3 does not find the induction over the ranks or the exchange of
    # sums over ranks and slots by itself.
    lemmas: list[tuple[str, Any]] = []
    for k in range(n):
        lemmas.append((f"victims-suffice-{k}", z3.Implies(sched_k[k], avail[k] + rel_k[k] >= needed_k[k])))
        lemmas.append((f"pool-nonnegative-{k + 1}", z3.Implies(avail[k] >= 0, avail[k + 1] >= 0)))
        if not canonical:
            for label, x in (("tokens", tok_k[k]), ("blocks", nbk_k[k])):
                lemmas.append((f"rank-{label}-{k}", _sum([z3.If(perm[k] == i, x, 0) for i in range(n)]) == x))
    for i in range(n if not canonical else 0):
        for label, x, per_rank in (("tokens", z3.If(sched[i], nt[i], 0), tok_k), ("blocks", nbk[i], nbk_k)):
            lemmas.append((f"slot-{label}-{i}", x == _sum([z3.If(perm[k] == i, per_rank[k], 0) for k in range(n)])))
    for v in range(n):
        once = [z3.Not(z3.And(preby[k][v], preby[k2][v])) for k in range(n) for k2 in range(k + 1, n)]
        lemmas.append((f"preempted-once-{v}", z3.And(once) if once else z3.BoolVal(True)))
        lemmas.append((f"slot-released-{v}", z3.If(pre[v], S[v].b, 0)
                       == _sum([z3.If(preby[k][v], S[v].b, 0) for k in range(n)])))
    admitted_tokens = _sum([z3.If(admit[i], nt_a[i], 0) for i in range(n)])
    admitted_blocks = _sum([z3.If(admit[i], whole[i], 0) for i in range(n)])
    lemmas.append(("tokens-by-rank", plan.tokens() == _sum(tok_k) + admitted_tokens))
    lemmas.append(("blocks-by-rank", _sum([z3.If(scheduled[i], nb[i], 0) for i in range(n)])
                   == _sum(nbk_k) + admitted_blocks))
    lemmas.append(("released-by-rank", _sum([z3.If(pre[v], S[v].b, 0) for v in range(n)]) == _sum(rel_k)))
    # admission takes a prefix of the policy's order: the admitted requests before an admitted one are
    # all those before it, so the last admitted one's checks cover the whole batch
    for i in range(n):
        before_i = [j for j in range(n) if j != i]
        lemmas.append((f"admitted-prefix-{i}", z3.Implies(admit[i], z3.And(
            [z3.Implies(A[j][i], admit[j]) for j in before_i]
            + [z3.Implies(admit[j], z3.Or(A[j][i], A[i][j])) for j in before_i]))))
    last = [z3.And(admit[i], *[z3.Implies(admit[j], A[j][i]) for j in range(n) if j != i]) for i in range(n)]
    lemmas.append(("admitted-has-last", z3.Implies(z3.Or(admit), z3.Or(last))))
    for i in range(n):
        lemmas.append((f"admitted-up-to-{i}", z3.Implies(last[i], z3.And(
            admitted_blocks == _sum([z3.If(A[j][i], whole[j], 0) for j in range(n)]) + whole[i],
            admitted_tokens == _sum([z3.If(A[j][i], nt_a[j], 0) for j in range(n)]) + nt_a[i]))))
    lemmas.append(("admission-fits", z3.And(admitted_blocks <= free_r, admitted_tokens <= budget_r)))

    # Lemmas that need the ordering invariant (running prefills hold blocks for their whole sequence):
    # only a decode preempts, everything scheduled before it sits below its victims, so the preempted
    # requests are the most recently admitted ones.
    ordered_lemmas: list[tuple[str, Any]] = []
    for k in range(n):
        ordered_lemmas.append((f"only-decodes-preempt-{k}", z3.Implies(z3.Or(preby[k]), pick(decode, k))))
        for k2 in range(k):
            ordered_lemmas.append((f"scheduled-below-victims-{k2}-{k}", z3.And([
                z3.Implies(z3.And(preby[k][v], sched_k[k2]), pick(pos, k2) < S[v].pos) for v in range(n)])))
    # the victims are the youngest: per pair, first within the rank that preempts v (the candidates
    # after v have fewer blocks after them), then across ranks (a younger request already gone was
    # preempted: it was not scheduled below a victim)
    for u in range(n):
        for v in range(n):
            if u == v:
                continue
            younger = z3.And(S[u].running, S[u].pos > S[v].pos)
            ordered_lemmas.append((f"victims-are-youngest-{u}-{v}", z3.Implies(z3.And(pre[v], younger), pre[u])))
    index = {v.get_id(): i for group in (budget_a, nt_a, ok, admit) for i, v in enumerate(group)}
    loop = {"budget": budget, "avail": avail, "after": after_k, "preby": preby}
    return PolicyStep(plan, rejected, processed, perm, any_pre, admitting, lemmas, ordered_lemmas,
                      order_facts if canonical else [], A, index, loop)


def slot_order_hypothesis(s: State) -> list[Any]:
    """What ``layout="slot-order"`` assumes of ``s``: within each queue, positions grow with the slot index
    (the ordering invariant's sorted queues, with the live requests in the slots in the order of
    addition)."""
    S = s.slots
    out = []
    for i in range(s.n):
        for j in range(i + 1, s.n):
            out.append(z3.Implies(z3.And(S[i].running, S[j].running), S[i].pos < S[j].pos))
            out.append(z3.Implies(z3.And(S[i].waiting, S[j].waiting), S[i].pos < S[j].pos))
    return out


def _plan_step_slot_order(ctx: Ctx, s: State, params: dict[str, Any], p: str, rejected: list[Any],
                          pending: list[Any], decode: list[Any], processed: list[Any]) -> PolicyStep:
    """:func:`plan_step` with ``layout="slot-order"``: the same loop as the other layouts, visiting slot
    ``i``'s decode at visit ``i`` and its prefill at visit ``n + i`` (each queue in slot order, so queue
    position comparisons become slot index comparisons); admission in slot order.

    Its :attr:`PolicyStep.ordered_lemmas` (consequences under ``Inv`` and ``Ord``, proved by
    :func:`.bmc.layout_lemmas` and then assumed at every step of a run, which prunes the search): the
    pool never goes negative, a running prefill never preempts (it holds blocks for its whole sequence),
    a decode needs at most one new block."""
    c = ctx.cfg
    n = s.n
    S = s.slots
    visits = [(i, decode[i]) for i in range(n)] + [(i, z3.And(processed[i], z3.Not(decode[i]))) for i in range(n)]
    budget = [c.max_num_batched_tokens]
    avail = [s.free]
    gone = [[z3.BoolVal(False)] * n]
    sched_v, nt_v, nbk_v, preby = [], [], [], []
    lemmas: list[tuple[str, Any]] = []
    for k, (i, in_group) in enumerate(visits):
        nt = ctx.define(f"{p}nt{k}", chunk(ctx, pending[i], budget[k]))
        act = ctx.define(f"{p}act{k}", z3.And(in_group, z3.Not(gone[k][i]), budget[k] > 0, nt > 0), "bool")
        needed = ctx.define(f"{p}needed{k}", ctx.cdiv(S[i].nc + nt) - S[i].b)
        cand = [z3.And(S[v].running, z3.Not(gone[k][v])) for v in range(n)]
        row = []
        for v in range(n):
            if v < i:  # ahead of the requester in the running queue: never its victim
                row.append(z3.BoolVal(False))
                continue
            after_v = _sum([z3.If(cand[u], S[u].b, 0) for u in range(v + 1, n)])
            row.append(ctx.define(f"{p}preby{k}_{v}", z3.And(act, cand[v], avail[k] + after_v < needed), "bool"))
        sched = ctx.define(f"{p}sched{k}", z3.And(act, z3.Not(row[i])), "bool")
        tok = z3.If(sched, nt, 0)
        nbk = ctx.define(f"{p}nbk{k}", z3.If(sched, zmax(needed, 0), 0))
        released = _sum([z3.If(row[v], S[v].b, 0) for v in range(n)])
        budget.append(ctx.define(f"{p}budget{k + 1}", budget[k] - tok))
        avail.append(ctx.define(f"{p}avail{k + 1}", avail[k] + released - nbk))
        gone.append([ctx.define(f"{p}gone{k + 1}_{v}", z3.Or(gone[k][v], row[v], z3.And(v == i, sched)), "bool")
                     for v in range(n)])
        if k < n:
            lemmas.append((f"decode-needs-one-{k}", z3.Implies(act, needed <= 1)))
        else:
            lemmas.append((f"prefill-never-preempts-{k}", z3.Not(z3.Or(row))))
        lemmas.append((f"pool-nonnegative-{k + 1}", avail[k + 1] >= 0))
        sched_v.append(sched)
        nt_v.append(nt)
        nbk_v.append(nbk)
        preby.append(row)

    def at_slot(values: list[Any], i: int) -> Any:
        return z3.If(decode[i], values[i], values[n + i])

    sched = [at_slot(sched_v, i) for i in range(n)]
    nt = [at_slot(nt_v, i) for i in range(n)]
    nbk = [at_slot(nbk_v, i) for i in range(n)]
    pre = [z3.Or([row[v] for row in preby]) for v in range(n)]
    any_pre = z3.Or(pre)
    admitting = z3.And(z3.Not(any_pre), z3.Not(z3.And(params["idle_only"], z3.Or([sl.running for sl in S]))))
    budget_r, free_r = budget[-1], avail[-1]
    n_run = count([sl.running for sl in S])
    candidate = [z3.And(sl.waiting, z3.Not(rejected[i])) for i, sl in enumerate(S)]
    A = [[z3.And(candidate[j], candidate[i]) if j < i else z3.BoolVal(False) for i in range(n)] for j in range(n)]
    whole = [ctx.cdiv(sl.p + sl.o) for sl in S]
    nt_a, admit = [], []
    tokens_before, blocks_before, admitted_before = z3.IntVal(0), z3.IntVal(0), z3.IntVal(0)
    all_ok = z3.BoolVal(True)
    for i in range(n):
        # admission stops at the first candidate that does not fit: slot i is admitted iff every candidate
        # before it was, and it fits in what they left
        budget_a = budget_r - tokens_before
        nt_i = ctx.define(f"{p}nt_adm{i}", chunk(ctx, pending[i], budget_a))
        ok = z3.And(n_run + admitted_before < c.max_num_seqs, budget_a > 0, nt_i > 0,
                    whole[i] <= free_r - blocks_before)
        adm_i = ctx.define(f"{p}admit{i}", z3.And(admitting, candidate[i], ok, all_ok), "bool")
        all_ok = ctx.define(f"{p}all_ok{i}", z3.And(all_ok, z3.Implies(candidate[i], ok)), "bool")
        tokens_before = ctx.define(f"{p}adm_tokens{i}", tokens_before + z3.If(candidate[i], nt_i, 0))
        blocks_before = ctx.define(f"{p}adm_blocks{i}", blocks_before + z3.If(candidate[i], whole[i], 0))
        admitted_before = admitted_before + z3.If(candidate[i], 1, 0)
        nt_a.append(nt_i)
        admit.append(adm_i)
    scheduled = [z3.Or(sched[i], admit[i]) for i in range(n)]
    ntok = [z3.If(sched[i], nt[i], z3.If(admit[i], nt_a[i], 0)) for i in range(n)]
    nb = [z3.If(sched[i], nbk[i], z3.If(admit[i], whole[i], 0)) for i in range(n)]

    def processed_before(j: int, i: int) -> Any:
        return z3.And(processed[j], z3.Or(z3.And(decode[j], z3.Not(decode[i])), z3.And(decode[j] == decode[i], j < i)))

    # batch order: running requests in processing order, then admissions in slot order (indices < 2n)
    bpos = [z3.If(sched[i], count([processed_before(j, i) for j in range(n) if j != i]),
                  n + count([A[j][i] for j in range(n)])) for i in range(n)]
    ppos = [count([pre[u] for u in range(v + 1, n)]) for v in range(n)]
    plan = Plan(sched=scheduled, start=[sl.nc for sl in S], ntok=ntok, nb=nb, bpos=bpos, pre=pre, ppos=ppos,
                rej=rejected)
    return PolicyStep(plan, rejected, processed, [z3.IntVal(k) for k in range(n)], any_pre, admitting, [], lemmas,
                      slot_order_hypothesis(s), A, {}, {"budget": budget, "avail": avail, "preby": preby})


def processing_order(state: Any, n: int) -> list[str | None]:
    """Slot ids in the order the policy's running phase processes them (running decodes, then running
    prefills, each in queue order), then the other requests, then empty slots: the order
    ``plan_step(layout="canonical")`` assumes."""
    running = [r for r in state.running if state.requests[r].num_pending_tokens >= 1]
    decodes = [r for r in running if state.requests[r].num_pending_tokens == 1]
    ids: list[str | None] = decodes + [r for r in running if r not in decodes]
    ids += [r for r in list(state.running) + list(state.waiting) if r not in ids]
    if len(ids) > n:
        raise ValueError(f"{len(ids)} requests need more than {n} slots")
    return ids + [None] * (n - len(ids))


def pass_order(state: Any, config: Any, n: int) -> list[str | None]:
    """Slot ids in ``plan_by_priority``'s pass order (running and waiting requests not rejected, by
    urgency, running first on ties), then the rejected ones, then empty slots: the order
    :func:`plan_priority` assumes."""
    from schedspec.reference.policies import _priority_order, _urgency, reject_impossible

    rejected = {r for r, _ in reject_impossible(state, config)}
    waiting = [r for r in _priority_order(state) if r not in rejected]
    ids: list[str | None] = sorted([*state.running, *waiting], key=lambda r: _urgency(state.requests[r]))
    ids += [r for r in state.waiting if r in rejected]
    if len(ids) > n:
        raise ValueError(f"{len(ids)} requests need more than {n} slots")
    return ids + [None] * (n - len(ids))


def concrete_step(state: Any, config: Any, policy: str, slots: int | None = None, unique: bool = True,
                  layout: str = "permuted") -> dict[str, Any]:
    """The encoded step of ``policy`` on a concrete state, solved by Z3, as
    :func:`schedspec.spec.proofs.concrete.describe_plan` would show it.

    With ``unique``, also checks that no other plan satisfies the encoding from this state. ``layout``
    (:data:`LAYOUTS`): ``canonical``, the encoding the one-step proofs use, puts the requests in the slots
    in :func:`processing_order`; ``slot-order`` (bounded model checking) in queue order, running then
    waiting (the order of addition under fcfs's ordering invariant); the layout's hypothesis must hold.

    Raises:
        AssertionError: the encoding has no solution, or (``unique``) more than one.
    """
    from schedspec.spec.proofs.concrete import concrete_ctx, decode_plan, encode_state, slot_assignment
    from schedspec.spec.proofs.encoding import PLAN_FIELDS

    n = slots if slots is not None else max(1, len(state.requests))
    if POLICIES[policy]["order"] == "priority":
        slot_ids = pass_order(state, config, n)
    else:
        slot_ids = processing_order(state, n) if layout == "canonical" else slot_assignment(state, None, n)
    ctx = concrete_ctx(config)
    s = encode_state(state, slot_ids)
    if POLICIES[policy]["order"] == "priority":
        times = sorted({r.arrival_time for r in state.requests.values()})
        tkey = [z3.IntVal(times.index(state.requests[r].arrival_time) if r is not None else 0) for r in slot_ids]
        step = plan_priority(ctx, s, canonical=True, tkey=tkey)
    else:
        step = plan_step(ctx, s, policy, layout=layout)
    solver = z3.Solver()
    solver.add(ctx.facts)
    solver.add(step.layout_hypothesis)
    result = solver.check()
    assert result == z3.sat, f"the encoding of {policy} has no solution from this state ({result})"
    model = solver.model()
    values = {name: [model.eval(t, model_completion=True) for t in getattr(step.plan, name)] for name in PLAN_FIELDS}
    if unique:
        differs = [t != v for name in PLAN_FIELDS for t, v in zip(getattr(step.plan, name), values[name], strict=True)]
        solver.add(z3.Or(differs))
        again = solver.check()
        assert again == z3.unsat, f"the encoding of {policy} allows a second plan from this state ({again})"
    py_values = {name: [z3.is_true(v) if z3.is_bool(v) else v.as_long() for v in vals] for name, vals in values.items()}
    return decode_plan(py_values, slot_ids)


# --- the priority policy (policies.plan_by_priority) ---------------------------------------------------


def arrival_ranks(s: State, name: str = "") -> list[Any]:
    """The third component of the urgency key (``arrival_time``) as an integer per slot: symbolic here
    (any order); :func:`concrete_step` passes the ranks of the requests' arrival times."""
    return [z3.Int(f"{name}_tkey{i}" if name else f"tkey{i}") for i in range(s.n)]


def urgency_less(S: list[Any], t: list[Any], a: int, b: int) -> Any:
    """Slot ``a`` is strictly more urgent than slot ``b``: ``(priority, arrival_step, arrival_time)``
    lexicographically smaller (``policies._urgency``)."""
    A, B = S[a], S[b]
    return z3.Or(A.prio < B.prio, z3.And(A.prio == B.prio, z3.Or(
        A.arr < B.arr, z3.And(A.arr == B.arr, t[a] < t[b]))))


def urgency_equal(S: list[Any], t: list[Any], a: int, b: int) -> Any:
    return z3.And(S[a].prio == S[b].prio, S[a].arr == S[b].arr, t[a] == t[b])


def preempted_before(less: list[list[Any]], equal: list[list[Any]], u: int, v: int) -> Any:
    """Slot ``u`` is preempted before slot ``v`` (both candidates): ``u`` is less urgent, or as urgent and
    earlier in the running queue (``max(running, key=urgency)`` takes the first of the least urgent)."""
    return z3.Or(less[v][u], z3.And(equal[u][v], z3.BoolVal(u < v)))


def plan_priority(ctx: Ctx, s: State, name: str = "", canonical: bool = True, tkey: list[Any] | None = None
                  ) -> PolicyStep:
    """The step of :func:`schedspec.reference.policies.plan_by_priority` (prefix caching off) from ``s``,
    with the slots in its pass order (``canonical``, the only form encoded: a hypothesis on the state,
    returned in :attr:`PolicyStep.layout_hypothesis`): the running requests and the waiting ones not rejected,
    sorted by urgency (running first on ties, then queue position), then the rest.

    The pass is unrolled over the slots, each rank ``k`` carrying the budget, the reserve (one token per
    running decode not yet visited, when they all fit the budget), the pool's free blocks, the running
    count and which requests are preempted so far. A running request that lacks blocks preempts, in
    order of least urgency (ties: the earlier in the running queue first), the running requests after it
    in the pass, down to itself; slot ``v`` is preempted at rank ``k`` iff the blocks of those ahead of
    it in that order do not suffice (as in :func:`plan_step`). A waiting request (none more urgent
    preempted in this step) is admitted if it fits, or if it fits once every strictly less urgent
    running request after it is preempted; then exactly the shortest prefix of them (least urgent
    first) that makes it fit is preempted: ``v`` iff the prefix before it does not suffice (fitting is
    monotone in the prefix).
    """
    if not canonical:
        raise NotImplementedError("the priority step is encoded with the slots in pass order only")
    c = ctx.cfg
    n = s.n
    S = s.slots
    p = name + "_" if name else ""
    t = tkey if tkey is not None else arrival_ranks(s, name)

    def define(label: str, expr: Any, sort: str = "int") -> Any:
        return ctx.define(f"{p}{label}", expr, sort)

    rejected = [z3.And(sl.waiting, z3.Not(sl.adm), z3.Not(fits_alone(ctx, sl.p, sl.mt))) for sl in S]
    in_pass = [z3.Or(sl.running, z3.And(sl.waiting, z3.Not(rejected[i]))) for i, sl in enumerate(S)]
    decode = [z3.And(sl.running, sl.pending == 1) for sl in S]
    less = [[urgency_less(S, t, a, b) if a != b else z3.BoolVal(False) for b in range(n)] for a in range(n)]
    equal = [[urgency_equal(S, t, a, b) for b in range(n)] for a in range(n)]
    # the pass order, stated for every pair (it is a sort): running first on equal urgency, then position
    order_facts: list[Any] = []
    for j in range(n):
        for k in range(j + 1, n):
            tie = z3.Or(z3.And(S[j].running, z3.Not(S[k].running)),
                        z3.And(S[j].running == S[k].running, S[j].pos < S[k].pos))
            order_facts.append(z3.Implies(in_pass[k], in_pass[j]))
            order_facts.append(z3.Implies(z3.And(in_pass[j], in_pass[k]), z3.Or(less[j][k], z3.And(equal[j][k], tie))))

    def victim_before(u: int, v: int) -> Any:
        return preempted_before(less, equal, u, v)

    n_dec = count(decode)
    reserving = define("reserving", n_dec <= c.max_num_batched_tokens, "bool")
    budget = [c.max_num_batched_tokens]
    reserve = [define("reserve0", z3.If(reserving, n_dec, 0))]
    avail = [s.free]
    nrun = [count([sl.running for sl in S])]
    pre_so_far = [[z3.BoolVal(False)] * n]
    sched, ntok, nblocks, preby, after = [], [], [], [], []
    for k in range(n):
        me = S[k]
        gone = pre_so_far[k]
        live_run = [z3.And(S[v].running, z3.Not(gone[v])) for v in range(n)]
        here = define(f"here{k}", z3.And(in_pass[k], z3.Not(gone[k])), "bool")
        is_run = z3.And(here, me.running)
        is_wait = z3.And(here, z3.Not(me.running))
        reserved = [z3.And(reserving, decode[v]) for v in range(n)]
        # a running request
        reserve_me = define(f"reserve_me{k}", reserve[k] - z3.If(z3.And(is_run, reserved[k]), 1, 0))
        nt_run = define(f"nt_run{k}", z3.If(decode[k], zmin(budget[k], 1),
                                            chunk(ctx, me.pending, zmax(budget[k] - reserve_me, 0))))
        act = define(f"act{k}", z3.And(is_run, nt_run > 0), "bool")
        needed = define(f"needed{k}", ctx.cdiv(me.nc + nt_run) - me.b)
        later = [v for v in range(k + 1, n)]
        row_run: list[Any] = [z3.BoolVal(False)] * n
        after_k: list[Any] = [z3.IntVal(0)] * n
        for v in later:
            ahead = _sum([z3.If(z3.And(live_run[u], victim_before(u, v)), S[u].b, 0) for u in later if u != v])
            after_k[v] = ahead
            row_run[v] = define(f"prer{k}_{v}", z3.And(act, live_run[v], less[k][v], avail[k] + ahead < needed), "bool")
        ahead_me = _sum([z3.If(z3.And(live_run[u], less[k][u]), S[u].b, 0) for u in later])
        after_k[k] = ahead_me
        self_pre = define(f"self_pre{k}", z3.And(act, avail[k] + ahead_me < needed), "bool")
        sched_run = z3.And(act, z3.Not(self_pre))
        # a waiting request
        blocked = z3.Or([z3.And(gone[v], less[v][k]) for v in range(n) if v != k] or [z3.BoolVal(False)])
        lu = [z3.And(live_run[v], less[k][v]) if v > k else z3.BoolVal(False) for v in range(n)]
        whole = ctx.cdiv(me.p + me.o)

        def fits(members: list[Any], k: int = k, reserved: list[Any] = reserved, whole: Any = whole,
                 me: Any = me) -> Any:
            tokens = budget[k] - reserve[k] + count([z3.And(members[v], reserved[v]) for v in range(n)])
            return z3.And(c.max_num_seqs - nrun[k] + count(members) >= 1, tokens >= 1,
                          whole <= avail[k] + _sum([z3.If(members[v], S[v].b, 0) for v in range(n)]),
                          chunk(ctx, me.pending, tokens) > 0)

        none = [z3.BoolVal(False)] * n
        fits_now = define(f"fits_now{k}", fits(none), "bool")
        fits_all = define(f"fits_all{k}", fits(lu), "bool")
        try_w = z3.And(is_wait, z3.Not(blocked))
        row_wait: list[Any] = [z3.BoolVal(False)] * n
        for v in later:
            before_v = [z3.And(lu[u], victim_before(u, v)) if u > k and u != v else z3.BoolVal(False) for u in range(n)]
            row_wait[v] = define(f"prew{k}_{v}", z3.And(try_w, lu[v], z3.Not(fits_now), fits_all,
                                                        z3.Not(fits(before_v))), "bool")
        admit = define(f"admit{k}", z3.And(try_w, z3.Or(fits_now, fits_all)), "bool")
        reserve_w = reserve[k] - count([z3.And(row_wait[v], reserved[v]) for v in range(n)])
        nt_adm = chunk(ctx, me.pending, budget[k] - reserve_w)
        # carried to the next rank
        row = [z3.Or(row_run[v], row_wait[v]) for v in range(n)]
        row[k] = self_pre
        released = _sum([z3.If(row[v], S[v].b, 0) for v in range(n)])
        sched_k = define(f"sched{k}", z3.Or(sched_run, admit), "bool")
        ntok_k = define(f"ntok{k}", z3.If(sched_run, nt_run, z3.If(admit, nt_adm, 0)))
        nb_k = define(f"nb{k}", z3.If(sched_run, zmax(needed, 0), z3.If(admit, whole, 0)))
        reserved_gone = count([z3.And(row[v], reserved[v]) for v in later])
        reserve.append(define(f"reserve{k + 1}", z3.If(is_run, reserve_me, reserve[k]) - reserved_gone))
        budget.append(define(f"budget{k + 1}", budget[k] - ntok_k))
        avail.append(define(f"avail{k + 1}", avail[k] + released - nb_k))
        nrun.append(define(f"nrun{k + 1}", nrun[k] - count(row) + z3.If(admit, 1, 0)))
        pre_so_far.append([define(f"pre{k + 1}_{v}", z3.Or(gone[v], row[v]), "bool") for v in range(n)])
        sched.append(sched_k)
        ntok.append(ntok_k)
        nblocks.append(nb_k)
        preby.append(row)
        after.append(after_k)

    pre = pre_so_far[n]
    # the order of preemption: by the rank that preempts, then in the order of preemption within it
    by_rank = [_sum([z3.If(preby[k][v], k, 0) for k in range(n)]) for v in range(n)]
    ppos = [count([z3.And(pre[u], z3.Or(by_rank[u] < by_rank[v], z3.And(by_rank[u] == by_rank[v], victim_before(u, v))))
                   for u in range(n) if u != v]) for v in range(n)]
    plan = Plan(sched=sched, start=[sl.nc for sl in S], ntok=ntok, nb=nblocks, bpos=[z3.IntVal(i) for i in range(n)],
                pre=pre, ppos=ppos, rej=rejected)
    admitted = [z3.And(sched[i], z3.Not(S[i].running)) for i in range(n)]
    none = [[z3.BoolVal(False)] * n for _ in range(n)]
    loop = {"budget": budget, "avail": avail, "after": after, "preby": preby, "reserve": reserve, "nrun": nrun,
            "tkey": t, "admitted": admitted}
    return PolicyStep(plan, rejected, [sl.running for sl in S], [z3.IntVal(k) for k in range(n)], z3.Or(pre),
                      z3.BoolVal(True), [], [], order_facts, none, {}, loop)
