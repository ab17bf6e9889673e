"""Prefix caching for Z3: shared blocks, reference counts, evictable blocks, hits and publication.

:mod:`.encoding` counts blocks and :mod:`.blocks` gives each block one owner; with
``enable_prefix_caching`` neither is enough: a cached block is shared by every block table that hit
it. This module encodes :mod:`schedspec.spec.prefix_cache` for a fixed ``num_kv_blocks = M`` on top
of the request slots of :mod:`.encoding` (their status, lengths, ``nc`` and ``b`` = the table length):

``rc[k]``      for each block ``k`` in ``[0, M)``: its reference count (``PrefixCache.ref_counts``)
``hashed[k]``  whether it carries a hash (``PrefixCache.block_hashes``); ``cls[k]`` the hash, as an
               integer **content class** (abstract: only equality of hashes matters)
``tab[i][j]``  block id at index ``j < L`` of slot ``i``'s block table (``L = M`` in the theorems: a
               table holds a block at most once); entries at ``j >= b[i]`` mean nothing
``pc[i][j]``   the content class of slot ``i``'s block ``j``, that is the chained hash of its first
               ``(j + 1) * block_size`` tokens (``request_block_hash``); classes of different indices
               of one request differ (a chain of other length); the tokens not yet sampled are free
``free``       the length of the free queue (free plus evictable blocks)

A block is **free** (``rc == 0``, no hash), **evictable** (``rc == 0`` with a hash: still in the free
queue, counted as free) or **held** (``rc >= 1``). A plan adds to :class:`.encoding.Plan`, per slot,
``hit[i]`` (``len(cached_block_ids)``) and ``ids[i][j]``: the table entries after the step at
``b[i] <= j < b[i] + hit[i] + nb[i]`` (the hit blocks, then the new ones).

Rules (:func:`prefix_rules`, the 17 rules of :mod:`schedspec.spec.rules` by name): the count rules with
the hit (a chunk starts at ``nc + hit * block_size``, ...); ``blocks-from-free-pool`` on ids (each new
block in range, with count 0 or brought to 0 by this plan's preemptions, not a hit block, handed out
once); the three prefix rules (a hit only at admission; each hit block cached with the class of the
request's block at that index, not handed out in the step, at most ``(num_tokens - 1) // block_size``
blocks; the longest such chain, blocks handed to requests earlier in the batch excluded).

Update (:func:`prefix_apply`, as ``transitions.apply_plan`` with a ``CacheUpdate``): a hit adds one
reference per hit block; a new block is taken (its hash dropped: an eviction) with count 1; a
preempted or stopping request releases its table (count - 1 per block; a block reaching 0 keeps its
hash, so it is evictable if it had one, else free); the blocks a scheduled request has fully computed
after its chunk are published (get the class of their index). The free queue's order is not modelled
(only its length).

Invariant (:func:`prefix_invariant`): the request-level invariants of :mod:`.encoding` except the two
block counts (which count shared blocks once per table), plus ``prefix-ref-counts`` (every count is
the number of live tables holding the block; no table holds a block twice; ids in range),
``prefix-block-partition`` (``free`` is the number of blocks with count 0, so free + evictable + held
= M), ``prefix-published-computed`` (a table's cached blocks are a prefix of it, each with its
request's class at that index and fully computed) and the support fact ``shared-blocks-cached`` (a
block held twice carries a hash: only hits share blocks, and a held block is never evicted).

Theorems (:func:`prefix_theorems`), for every config (caching on, the block size fixed) with
``num_kv_blocks = M`` and every state of N slots: ``spec/prefix/init``, ``spec/prefix/arrive``,
``spec/prefix/abort`` and ``spec/prefix/step/<part>``: ``Inv and Allowed and Update => <part>'``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import z3

from .core import PROVED, UNKNOWN, Coverage, Options, Result, Theorem, Timer
from .encoding import (
    EMPTY,
    PREEMPTED,
    RUNNING,
    WAITING,
    Ctx,
    Plan,
    State,
    _sum,
    count,
    fits_alone,
    plan_well_formed,
    rule_atoms,
    state_invariants,
    support,
    symbolic_plan,
    symbolic_state,
)


@dataclass
class Cache:
    """The prefix-cache layer of a state (see the module docstring)."""

    rc: list[Any]
    hashed: list[Any]
    cls: list[Any]
    tab: list[list[Any]]
    pc: list[list[Any]]

    @property
    def m(self) -> int:
        return len(self.rc)

    @property
    def length(self) -> int:
        return len(self.tab[0]) if self.tab else 0


@dataclass
class Hits:
    """A plan's prefix-cache part, per slot: ``hit[i]`` cached blocks reused, ``ids[i][j]`` the table
    entry at index ``j`` for ``b[i] <= j < b[i] + hit[i] + nb[i]`` (hit blocks first, then new ones)."""

    hit: list[Any]
    ids: list[list[Any]]


def symbolic_cache(n: int, m: int, length: int, prefix: str = "c") -> Cache:
    return Cache(rc=[z3.Int(f"{prefix}_rc{k}") for k in range(m)],
                 hashed=[z3.Bool(f"{prefix}_h{k}") for k in range(m)],
                 cls=[z3.Int(f"{prefix}_cls{k}") for k in range(m)],
                 tab=[[z3.Int(f"{prefix}_tab{i}_{j}") for j in range(length)] for i in range(n)],
                 pc=[[z3.Int(f"{prefix}_pc{i}_{j}") for j in range(length)] for i in range(n)])


def symbolic_hits(n: int, length: int, prefix: str = "ph") -> Hits:
    return Hits(hit=[z3.Int(f"{prefix}_hit{i}") for i in range(n)],
                ids=[[z3.Int(f"{prefix}_id{i}_{j}") for j in range(length)] for i in range(n)])


def _bs(ctx: Ctx) -> int:
    if not z3.is_int_value(ctx.cfg.block_size):
        raise ValueError("the prefix-cache encoding needs a fixed block_size")
    return ctx.cfg.block_size.as_long()


def max_hit_blocks(ctx: Ctx, sl: Any) -> Any:
    """``prefix_cache.max_hit_blocks``: ``max(num_tokens - 1, 0) // block_size``."""
    tokens = sl.p + sl.o
    return z3.If(tokens >= 1, (tokens - 1) / _bs(ctx), 0)


def held_count(s: State, c: Cache, i: int, k: int) -> Any:
    """How often slot ``i``'s live table holds block ``k`` (one term shape everywhere: the lemmas and the
    invariant add up by linear arithmetic only if their atoms are the same terms)."""
    sl = s.slots[i]
    return count([z3.And(z3.And(sl.live, j < sl.b), c.tab[i][j] == k) for j in range(c.length)])


def _at(values: list[Any], index: Any, default: Any) -> Any:
    """``values[index]`` for a symbolic index (``default`` out of range)."""
    out = default
    for k in reversed(range(len(values))):
        out = z3.If(index == k, values[k], out)
    return out


class Terms:
    """The per-slot, per-block terms of one step, built once (z3 hash-conses equal terms, so the rules,
    the update and the lemmas share atoms and the lemmas add up by linear arithmetic)."""

    def __init__(self, ctx: Ctx, s: State, c: Cache, plan: Plan, h: Hits, named: str | None = None) -> None:
        n, m, length = s.n, c.m, c.length
        self.named = named
        self.defs: list[Any] = []
        """With ``named``: the per-slot, per-block counts are variables, defined here (hypotheses): sums
        of them are then linear in variables, and Z3 adds them up without splitting cases per slot."""
        self.n, self.m, self.length = n, m, length
        bs = _bs(ctx)
        self.live_sched = [z3.And(plan.sched[i], s.slots[i].live) for i in range(n)]
        # positions of the plan's entries: hit blocks at [b, b + hit), new blocks at [b + hit, b + hit + nb)
        self.is_hit = [[z3.And(plan.sched[i], j >= s.slots[i].b, j < s.slots[i].b + h.hit[i]) for j in range(length)]
                       for i in range(n)]
        self.is_new = [[z3.And(plan.sched[i], j >= s.slots[i].b + h.hit[i], j < s.slots[i].b + h.hit[i] + plan.nb[i])
                        for j in range(length)] for i in range(n)]
        self.in_old = [[z3.And(s.slots[i].live, j < s.slots[i].b) for j in range(length)] for i in range(n)]
        # per slot and block: how often the old table, the hit and the new blocks hold it
        self.old = [[self.name(f"old{i}_{k}", held_count(s, c, i, k)) for k in range(m)] for i in range(n)]
        self.hitc = [[self.name(f"hitc{i}_{k}", count([z3.And(self.is_hit[i][j], h.ids[i][j] == k)
                                                        for j in range(length)])) for k in range(m)] for i in range(n)]
        self.newc = [[self.name(f"newc{i}_{k}", count([z3.And(self.is_new[i][j], h.ids[i][j] == k)
                                                        for j in range(length)])) for k in range(m)] for i in range(n)]
        self.pre_live = [z3.And(plan.pre[i], s.slots[i].live) for i in range(n)]
        self.pre_ref = [[self.name(f"preref{i}_{k}", z3.If(self.pre_live[i], self.old[i][k], 0)) for k in range(m)]
                        for i in range(n)]
        self.preempted_refs = [_sum([self.pre_ref[i][k] for i in range(n)]) for k in range(m)]
        self.hits_of = [_sum([self.hitc[i][k] for i in range(n)]) for k in range(m)]
        self.new_of = [_sum([self.newc[i][k] for i in range(n)]) for k in range(m)]
        # count 0 now, or brought to 0 by this plan's preemptions (rules._blocks_from_free_pool)
        self.poolable = [z3.Or(c.rc[k] == 0, c.rc[k] - self.preempted_refs[k] <= 0) for k in range(m)]
        self.hashed_at = lambda x: z3.Or([z3.And(x == k, c.hashed[k]) for k in range(m)])  # noqa: E731
        self.cls_at = lambda x: _at(c.cls, x, z3.IntVal(-1))  # noqa: E731
        # the table while the step applies (old entries, then the plan's) and its computed tokens
        self.tab1 = [[z3.If(z3.And(plan.sched[i], j >= s.slots[i].b), h.ids[i][j], c.tab[i][j]) for j in range(length)]
                     for i in range(n)]
        self.len1 = [z3.If(plan.sched[i], s.slots[i].b + h.hit[i] + plan.nb[i], s.slots[i].b) for i in range(n)]
        self.nc1 = [z3.If(plan.sched[i], plan.start[i] + plan.ntok[i], s.slots[i].nc) for i in range(n)]
        # publication: the entries a scheduled request has fully computed after its chunk
        self.full = [z3.If(self.nc1[i] >= 0, self.nc1[i] / bs, 0) for i in range(n)]
        self.publishes = [[z3.And(self.live_sched[i], j < self.full[i], j < self.len1[i]) for j in range(length)]
                          for i in range(n)]
        self.bs = bs


def _name(self: Terms, label: str, expr: Any) -> Any:
    """``expr``, or with ``named`` a variable defined equal to it."""
    if self.named is None:
        return expr
    var = z3.Int(f"{self.named}_{label}")
    self.defs.append(var == expr)
    return var


Terms.name = _name  # type: ignore[attr-defined]


def prefix_rules(ctx: Ctx, s: State, c: Cache, plan: Plan, h: Hits, t: Terms | None = None) -> dict[str, Any]:
    """Each rule of :mod:`schedspec.spec.rules` (caching on) by name, as a formula over the state, its
    cache layer and the plan. The plan is allowed iff all hold."""
    t = t or Terms(ctx, s, c, plan, h)
    cfg = ctx.cfg
    n, m, length, bs = s.n, c.m, c.length, t.bs
    rules: dict[str, list[Any]] = {name: [] for name in PREFIX_RULE_ORDER}
    for i in range(n):
        sl = s.slots[i]
        sch, pre, rej = plan.sched[i], plan.pre[i], plan.rej[i]
        hit = h.hit[i]
        rules["known-requests"].append(z3.Implies(z3.Or(sch, pre, rej), sl.live))
        rules["known-requests"].append(count([sch, pre, rej]) <= 1)
        rules["positive-tokens"].append(z3.Implies(sch, plan.ntok[i] >= 1))
        rules["long-prefill-threshold"].append(z3.Implies(
            z3.And(sch, cfg.enable_chunked_prefill, cfg.long_prefill_token_threshold > 0),
            plan.ntok[i] <= cfg.long_prefill_token_threshold))
        ls = t.live_sched[i]
        rules["chunk-continues"].append(z3.Implies(ls, plan.start[i] == sl.nc + hit * bs))
        rules["no-overcompute"].append(z3.Implies(ls, plan.ntok[i] <= sl.pending - hit * bs))
        rules["whole-prefill-without-chunking"].append(
            z3.Implies(z3.And(ls, z3.Not(cfg.enable_chunked_prefill)), plan.ntok[i] == sl.pending - hit * bs))
        rules["admit-fits-alone"].append(z3.Implies(z3.And(ls, z3.Not(sl.running)), fits_alone(ctx, sl.p, sl.mt)))
        rules["reject-only-impossible"].append(z3.Implies(
            z3.And(rej, sl.live), z3.And(z3.Not(sl.running), z3.Not(fits_alone(ctx, sl.p, sl.mt)))))
        rules["reject-only-impossible"].append(z3.Implies(
            z3.And(sl.waiting, z3.Not(sl.adm), z3.Not(fits_alone(ctx, sl.p, sl.mt))), rej))
        rules["preempt-running-only"].append(z3.Implies(pre, z3.And(z3.Implies(sl.live, sl.running), z3.Not(sch))))
        blocks = sl.b + hit + plan.nb[i]
        rules["block-table-covers"].append(z3.Implies(ls, blocks >= ctx.cdiv(plan.start[i] + plan.ntok[i])))
        rules["no-excess-blocks"].append(z3.Implies(ls, blocks <= ctx.cdiv(sl.p + sl.o)))
        # blocks-from-free-pool, per new entry: in range, count 0 (free or evictable) or released by this
        # plan's preemptions; and a table never exceeds M distinct blocks (implied by the Python rule)
        rules["blocks-from-free-pool"].append(z3.Implies(ls, blocks <= m))
        for j in range(length):
            new_ok = z3.Or([z3.And(h.ids[i][j] == k, t.poolable[k]) for k in range(m)])
            rules["blocks-from-free-pool"].append(z3.Implies(z3.And(t.is_new[i][j], sl.live), new_ok))
        # prefix-hit-at-admission: a hit only for a waiting request
        rules["prefix-hit-at-admission"].append(z3.Implies(z3.And(ls, hit >= 1), z3.Not(sl.running)))
        # prefix-hit-is-cached-chain
        chain = [z3.Implies(hit >= 1, hit <= max_hit_blocks(ctx, sl))]
        for j in range(length):
            x = h.ids[i][j]
            in_hit = z3.And(ls, t.is_hit[i][j])
            k_at = j - sl.b  # the hit's own index (b == 0 at admission)
            chain.append(z3.Implies(in_hit, z3.And(
                t.hashed_at(x), t.cls_at(x) == _at(c.pc[i], k_at, z3.IntVal(-2)),
                z3.And([z3.Implies(x == k, t.new_of[k] == 0) for k in range(m)]))))
        rules["prefix-hit-is-cached-chain"].append(z3.Implies(ls, z3.And(chain)))
        rules["blocks-from-free-pool"].append(z3.Implies(ls, z3.And(
            [z3.Implies(z3.And(t.is_new[i][j], h.ids[i][j] == k), t.hits_of[k] == 0)
             for j in range(length) for k in range(m)])))
    for k in range(m):
        rules["blocks-from-free-pool"].append(t.new_of[k] <= 1)
    rules["token-budget"].append(plan.tokens() <= cfg.max_num_batched_tokens)
    atoms = [rule_atoms(s, plan, i) for i in range(n)]
    running = _sum([a.running for a in atoms])
    preempted = _sum([a.preempted for a in atoms])
    admitted = _sum([a.admitted for a in atoms])
    rules["sequence-cap"].append(running - preempted + admitted <= cfg.max_num_seqs)
    rules["prefix-hit-longest"].append(z3.Or(z3.Not(z3.Or(c.hashed)), z3.And(longest_hit(ctx, s, c, plan, h, t))))
    return {name: z3.And(parts) for name, parts in rules.items()}


def longest_hit(ctx: Ctx, s: State, c: Cache, plan: Plan, h: Hits, t: Terms) -> list[Any]:
    """``prefix-hit-longest``: an admitted request's hit is the longest run of indices ``0, 1, ...`` (at
    most ``max_hit_blocks``) at which some cached block has the request's class and was not handed out
    to a request earlier in the batch."""
    n, m, length = s.n, c.m, c.length
    out = []
    for i in range(n):
        sl = s.slots[i]
        earlier = [[z3.Or([z3.And(plan.sched[i2], plan.bpos[i2] < plan.bpos[i], t.newc[i2][k] >= 1)
                           for i2 in range(n) if i2 != i]) for k in range(m)]]
        avail = [z3.Or([z3.And(c.hashed[k], c.cls[k] == c.pc[i][j], z3.Not(earlier[0][k])) for k in range(m)])
                 for j in range(length)]
        limit = max_hit_blocks(ctx, sl)
        hit = h.hit[i]
        cases = []
        for v in range(length + 1):
            ok = z3.And([avail[j] for j in range(v)]
                        + [z3.Or(limit == v, z3.Not(avail[v]) if v < length else z3.BoolVal(True))])
            cases.append(z3.And(hit == v, v <= limit, ok) if v else z3.And(hit == 0, z3.Or(limit == 0, z3.Not(avail[0]))))
        out.append(z3.Implies(z3.And(t.live_sched[i], z3.Not(sl.running)), z3.Or(cases)))
    return out


PREFIX_RULE_ORDER = (
    "known-requests", "token-budget", "positive-tokens", "chunk-continues", "no-overcompute",
    "whole-prefill-without-chunking", "long-prefill-threshold", "sequence-cap", "admit-fits-alone",
    "reject-only-impossible", "preempt-running-only", "blocks-from-free-pool", "block-table-covers",
    "no-excess-blocks", "prefix-hit-at-admission", "prefix-hit-is-cached-chain", "prefix-hit-longest",
    "drafts-only-in-decodes", "drafts-are-proposed", "drafts-within-max-model-len",
)
"""Every rule of :mod:`schedspec.spec.rules`, in its order (the agreement test checks it). The prefix-cache
layer has no drafts: the ``drafts-*`` rules are ``True`` here (no item carries drafts without speculative
decoding; drafts with prefix caching are proved in the count encoding, :mod:`.speculative`)."""


def hits_well_formed(s: State, plan: Plan, h: Hits) -> Any:
    """What a plan's ``cached_block_ids`` are by construction: a list (``hit >= 0``)."""
    return z3.And([x >= 0 for x in h.hit])


# --- the update ------------------------------------------------------------------------------------


@dataclass
class PrefixOutcome:
    state: State
    cache: Cache
    stops: list[Any]
    final_o: list[Any]
    released: list[Any]
    """Per block: the references the step's preemptions and stops release."""


def prefix_apply(ctx: Ctx, s: State, c: Cache, plan: Plan, h: Hits, eos: list[Any], t: Terms | None = None,
                 mutant: str | None = None) -> PrefixOutcome:
    """The state after an allowed plan (``transitions.apply_plan`` with prefix caching). ``mutant``
    (tests only) breaks the update on purpose: ``"release-drops-hash"`` (a released block reaching count
    0 loses its hash: never evictable), ``"hit-not-referenced"`` (a hit adds no reference)."""
    t = t or Terms(ctx, s, c, plan, h)
    cfg = ctx.cfg
    n, m, length = s.n, c.m, c.length
    new_slots, stops, final_o = [], [], []
    for i in range(n):
        sl = s.slots[i]
        sch, pre, rej = plan.sched[i], plan.pre[i], plan.rej[i]
        samp = z3.And(sch, plan.start[i] + plan.ntok[i] == sl.p + sl.o)
        o1 = z3.If(samp, sl.o + 1, sl.o)
        stop = z3.And(samp, z3.Or(sl.p + o1 >= cfg.max_model_len, o1 >= sl.mt, eos[i]))
        admit = z3.And(sch, z3.Not(sl.running))
        st = z3.If(pre, PREEMPTED, z3.If(rej, EMPTY, z3.If(sch, z3.If(stop, EMPTY, RUNNING), sl.st)))
        nc = z3.If(pre, 0, t.nc1[i])
        b = z3.If(z3.Or(pre, rej, stop), 0, t.len1[i])
        pos = z3.If(pre, s.wfront - 1 - plan.ppos[i], z3.If(admit, s.rback + 1 + plan.bpos[i], sl.pos))
        new_slots.append(dataclasses.replace(sl, st=st, nc=nc, b=b, pos=pos, o=o1, adm=z3.Or(sl.adm, admit),
                                             npre=z3.If(pre, sl.npre + 1, sl.npre)))
        stops.append(stop)
        final_o.append(o1)
    released = []
    rc2, hashed2, cls2 = [], [], []
    t.stop_ref = [[t.name(f"stopref{i}_{k}", z3.If(stops[i], t.old[i][k] + t.hitc[i][k] + t.newc[i][k], 0))
                   for k in range(m)] for i in range(n)]
    for k in range(m):
        # a stopping request releases its whole table (old entries, hit and new blocks)
        rel = t.preempted_refs[k] + _sum([t.stop_ref[i][k] for i in range(n)])
        released.append(rel)
        hits = 0 if mutant == "hit-not-referenced" else t.hits_of[k]
        rc2.append(c.rc[k] + hits + t.new_of[k] - rel)
        kept = z3.And(c.hashed[k], t.new_of[k] == 0)  # a new block is evicted (its hash dropped)
        published = z3.Or([z3.And(t.publishes[i][j], t.tab1[i][j] == k) for i in range(n) for j in range(length)])
        cls_pub: Any = c.cls[k]
        for i in reversed(range(n)):
            for j in reversed(range(length)):
                cls_pub = z3.If(z3.And(t.publishes[i][j], t.tab1[i][j] == k), c.pc[i][j], cls_pub)
        value = z3.Or(kept, published)
        if mutant == "release-drops-hash":
            value = z3.And(value, z3.Not(z3.And(rc2[k] == 0, rel >= 1)))
        hashed2.append(value)
        cls2.append(z3.If(kept, c.cls[k], cls_pub))
    free2 = count([r == 0 for r in rc2])
    after = State(new_slots, free2, s.wfront - n, s.wback, s.rback + 2 * n, s.step + 1, s.nextseq)
    cache2 = Cache(rc2, hashed2, cls2, [list(row) for row in t.tab1], c.pc)
    return PrefixOutcome(after, cache2, stops, final_o, released)


def prefix_arrive(s: State, c: Cache, i: int, p: Any, mt: Any, pc: list[Any]) -> tuple[State, Cache]:
    """``add_request`` into empty slot ``i``: a fresh request (table empty) with content classes ``pc``."""
    from .encoding import arrive

    cache = dataclasses.replace(c, pc=[pc if j == i else row for j, row in enumerate(c.pc)])
    return arrive(None, s, i, p, mt), cache  # type: ignore[arg-type]


def prefix_abort(s: State, c: Cache, i: int) -> tuple[State, Cache]:
    """``abort_request`` of slot ``i``: it releases its table (count - 1 per block; hashes kept)."""
    sl = s.slots[i]
    length = c.length
    rc2 = [c.rc[k] - count([z3.And(sl.live, j < sl.b, c.tab[i][j] == k) for j in range(length)])
           for k in range(c.m)]
    slots = list(s.slots)
    slots[i] = dataclasses.replace(sl, st=z3.IntVal(EMPTY), b=z3.IntVal(0))
    after = dataclasses.replace(s, slots=slots, free=count([r == 0 for r in rc2]))
    return after, dataclasses.replace(c, rc=rc2)


# --- the invariant ---------------------------------------------------------------------------------


def _entry_views(s: State, c: Cache, prefix: str) -> tuple[list[list[Any]], list[list[Any]], list[Any]]:
    """Named views of each table entry: ``th[i][j]`` whether it carries a hash, ``tc[i][j]`` its class,
    with their definitions (so goals mention atoms, not if-then-else chains over the blocks)."""
    n, m, length = s.n, c.m, c.length
    th = [[z3.Bool(f"{prefix}_th{i}_{j}") for j in range(length)] for i in range(n)]
    tc = [[z3.Int(f"{prefix}_tc{i}_{j}") for j in range(length)] for i in range(n)]
    defs = []
    for i in range(n):
        for j in range(length):
            for k in range(m):
                defs.append(z3.Implies(c.tab[i][j] == k, z3.And(th[i][j] == c.hashed[k], tc[i][j] == c.cls[k])))
    return th, tc, defs


def prefix_parts(ctx: Ctx, s: State, c: Cache, th: list[list[Any]], tc: list[list[Any]]) -> dict[str, Any]:
    """The prefix-cache invariants by name (``th``/``tc``: :func:`_entry_views` of the tables)."""
    n, m, length, bs = s.n, c.m, c.length, _bs(ctx)
    parts: dict[str, list[Any]] = {name: [] for name in PREFIX_PARTS}
    for k in range(m):
        held = _sum([held_count(s, c, i, k) for i in range(n)])
        parts["prefix-ref-counts"].append(c.rc[k] == held)
        # no table holds a block twice (entries are in range: below)
        parts["prefix-ref-counts"].append(z3.And([held_count(s, c, i, k) <= 1 for i in range(n)]))
        parts["shared-blocks-cached"].append(z3.Implies(c.rc[k] >= 2, c.hashed[k]))
    for i in range(n):
        sl = s.slots[i]
        parts["prefix-ref-counts"].append(z3.Implies(sl.live, sl.b <= length))
        for j in range(length):
            entry = z3.And(sl.live, j < sl.b)
            parts["prefix-ref-counts"].append(z3.Implies(entry, z3.And(c.tab[i][j] >= 0, c.tab[i][j] < m)))
            published = [tc[i][j] == c.pc[i][j], (j + 1) * bs <= sl.nc]
            if j:
                published.append(th[i][j - 1])
            parts["prefix-published-computed"].append(z3.Implies(z3.And(entry, th[i][j]), z3.And(published)))
            for j2 in range(j + 1, length):
                parts["distinct-classes"].append(c.pc[i][j] != c.pc[i][j2])
    parts["prefix-block-partition"].append(s.free == count([r == 0 for r in c.rc]))
    parts["prefix-block-partition"].append(z3.And([r >= 0 for r in c.rc]))
    return {name: z3.And(v) if v else z3.BoolVal(True) for name, v in parts.items()}


PREFIX_PARTS = ("prefix-ref-counts", "prefix-block-partition", "prefix-published-computed", "shared-blocks-cached",
                "distinct-classes")


REQUEST_INVARIANTS = ("running-within-max-num-seqs", "table-covers-computed", "queues-disjoint", "output-bound",
                      "computed-bound", "preempted-holds-nothing")
"""The invariants of :func:`.encoding.state_invariants` that hold with prefix caching as they are;
``kv-capacity`` and ``block-conservation`` count shared blocks once per table, and are replaced by
``prefix-block-partition`` and ``prefix-ref-counts``."""


def request_parts(ctx: Ctx, s: State) -> dict[str, Any]:
    inv = state_invariants(ctx, s)
    parts = {f"inv:{k}": inv[k] for k in REQUEST_INVARIANTS}
    parts["inv:table-length"] = z3.And([z3.Implies(sl.live, sl.b >= 0) for sl in s.slots])
    parts.update({f"sup:{k}": v for k, v in support(ctx, s).items()})
    return parts


def prefix_invariant_parts(ctx: Ctx, s: State, c: Cache, view: str) -> tuple[dict[str, Any], list[Any]]:
    """``Inv`` with caching on, by part, and the definitions of the entry views it uses."""
    th, tc, defs = _entry_views(s, c, view)
    parts = request_parts(ctx, s)
    parts.update({f"prefix:{k}": v for k, v in prefix_parts(ctx, s, c, th, tc).items()})
    return parts, defs


# --- the theorems ----------------------------------------------------------------------------------


def prefix_options(opts: Options) -> tuple[Options, int]:
    """The options the prefix theorems run with: the block size fixed (``--set block_size=B``, else
    16: the hit length ``hit * block_size`` is linear only then), ``num_kv_blocks = M``."""
    m = opts.fixed.get("num_kv_blocks", opts.id_blocks)
    fixed = {k: v for k, v in opts.fixed.items() if k != "enable_prefix_caching"}
    fixed["num_kv_blocks"] = m
    return dataclasses.replace(opts, block="fixed", fixed=fixed), m


@dataclass
class StepSetup:
    ctx: Ctx
    s: State
    c: Cache
    plan: Plan
    h: Hits
    t: Terms
    out: PrefixOutcome
    hyps: dict[str, Any]
    goals: list[tuple[str, str, Any]]
    """(theorem part, name, goal)."""


_SETUP: dict[str, StepSetup] = {}


def step_setup(opts: Options) -> StepSetup:
    """The step's premises and goals at ``opts.policy_n`` slots, built once per options."""
    from .theorems import setup

    local, m = prefix_options(opts)
    key = repr(local)
    if key in _SETUP:
        return _SETUP[key]
    ctx = setup(local)
    n, length = local.policy_n, m
    s = symbolic_state(n, "s")
    c = symbolic_cache(n, m, length, "c")
    plan = symbolic_plan(n, "pl")
    h = symbolic_hits(n, length, "ph")
    t = Terms(ctx, s, c, plan, h, named="t")
    eos = [z3.Bool(f"eos{i}") for i in range(n)]
    inv, defs = prefix_invariant_parts(ctx, s, c, "v")
    hyps: dict[str, Any] = {"cfg": ctx.cfg.valid(), "wf": z3.And(plan_well_formed(plan), hits_well_formed(s, plan, h)),
                            "views": z3.And(defs)}
    hyps.update(inv)
    hyps.update({f"rule:{k}": v for k, v in prefix_rules(ctx, s, c, plan, h, t).items()})
    out = prefix_apply(ctx, s, c, plan, h, eos, t)
    # the cache after the step as named variables (their definitions are hypotheses): goals then mention
    # atoms, not the update's nested terms
    c2 = Cache(rc=[z3.Int(f"c2_rc{k}") for k in range(m)], hashed=[z3.Bool(f"c2_h{k}") for k in range(m)],
               cls=[z3.Int(f"c2_cls{k}") for k in range(m)],
               tab=[[z3.Int(f"c2_tab{i}_{j}") for j in range(length)] for i in range(n)], pc=c.pc)
    after_defs = []
    for k in range(m):
        after_defs += [c2.rc[k] == out.cache.rc[k], c2.hashed[k] == out.cache.hashed[k], c2.cls[k] == out.cache.cls[k]]
    for i in range(n):
        for j in range(length):
            after_defs.append(c2.tab[i][j] == out.cache.tab[i][j])
    s2 = out.state
    named_slots = []
    for i, sl in enumerate(s2.slots):
        fields_ = {f: z3.Int(f"s2_{f}{i}") for f in ("st", "b", "nc", "o")}
        after_defs += [v == getattr(sl, f) for f, v in fields_.items()]
        named_slots.append(dataclasses.replace(sl, **fields_))
    s2 = dataclasses.replace(s2, slots=named_slots)
    hyps["after"] = z3.And(after_defs)
    inv2, defs2 = prefix_invariant_parts(ctx, s2, c2, "w")
    hyps["views after"] = z3.And(defs2)
    lemmas = step_lemmas(s, c, plan, h, t, out, s2, c2)
    goals: list[tuple[str, str, Any]] = []
    goals += [("ref-counts", name, lemma) for name, lemma in lemmas]
    for name in PREFIX_PARTS:
        if name == "prefix-published-computed":
            goals += [("published-computed", lname, lemma)
                      for lname, lemma in publication_lemmas(s, c, plan, h, t, s2, c2)]
        goals.append((THEOREM_OF_PART[name], name, inv2[f"prefix:{name}"]))
    for name in [k for k in inv2 if not k.startswith("prefix:")]:
        goals.append(("request-invariants", name, inv2[name]))
    hyps["named counts"] = z3.And(t.defs)  # after every lemma: the lemmas name counts too
    built = StepSetup(ctx, s, c, plan, h, t, out, hyps, goals)
    _SETUP.clear()
    _PROVED.clear()
    _SETUP[key] = built
    return built


THEOREM_OF_PART = {"prefix-ref-counts": "ref-counts", "prefix-block-partition": "block-partition",
                   "prefix-published-computed": "published-computed", "shared-blocks-cached": "shared-blocks-cached",
                   "distinct-classes": "request-invariants"}


def step_lemmas(s: State, c: Cache, plan: Plan, h: Hits, t: Terms, out: PrefixOutcome, s2: State, c2: Cache
                ) -> list[tuple[str, Any]]:
    """Lemmas per slot and block, in the update's atoms, from which ``prefix-ref-counts`` after the step
    adds up by linear arithmetic: slot ``i``'s table after the step holds block ``k`` as often as before
    (if it keeps its table), plus its hit and new blocks, less what it releases."""
    n, m = s.n, c.m
    pool, hits = [], []
    for i in range(n):
        for k in range(m):
            # a block handed out new is in no table that keeps its blocks
            pool.append(z3.Implies(z3.And(z3.Not(t.pre_live[i]), t.poolable[k]), t.old[i][k] == 0))
            # a hit takes a block once (its blocks have the classes of distinct indices)
            hits.append(t.hitc[i][k] <= 1)
    per = []
    for i in range(n):
        keeps = z3.And(s2.slots[i].live, z3.Not(plan.pre[i]))
        for k in range(m):
            after = held_count(s2, c2, i, k)
            kept = t.name(f"kept{i}_{k}", z3.If(keeps, t.old[i][k] + t.hitc[i][k] + t.newc[i][k], 0))
            per.append(after == kept)
            per.append(t.old[i][k] + t.hitc[i][k] + t.newc[i][k] - t.pre_ref[i][k] - t.stop_ref[i][k] == kept)
    return [("lemma: new blocks come from no kept table", z3.And(pool)), ("lemma: a hit takes a block once", z3.And(hits)),
            ("lemma: per slot and block", z3.And(per))]


def publication_lemmas(s: State, c: Cache, plan: Plan, h: Hits, t: Terms, s2: State, c2: Cache
                       ) -> list[tuple[str, Any]]:
    """Lemmas for ``prefix-published-computed`` after the step: a block with no hash, or handed out new,
    sits at most at one entry of the tables that keep their blocks (so no other entry publishes it with
    another class); then, entry by entry of a table kept after the step, it carries a hash iff it did
    before, is a hit block, or is published now, and then has the request's class at its index."""
    n, m, length = s.n, c.m, c.length
    occ = [[t.name(f"occ{i}_{k}", z3.If(t.pre_live[i], 0, t.old[i][k] + t.hitc[i][k] + t.newc[i][k]))
            for k in range(m)] for i in range(n)]
    unique = [z3.Implies(z3.Or(z3.Not(c.hashed[k]), t.new_of[k] >= 1), _sum([occ[i][k] for i in range(n)]) <= 1)
              for k in range(m)]
    where = []
    for i in range(n):
        for j in range(length):
            at = z3.And(s.slots[i].live, z3.Not(t.pre_live[i]), j < t.len1[i])
            where += [z3.Implies(z3.And(at, t.tab1[i][j] == k), occ[i][k] >= 1) for k in range(m)]
    th = [[z3.Bool(f"v_th{i}_{j}") for j in range(length)] for i in range(n)]
    th2 = [[z3.Bool(f"w_th{i}_{j}") for j in range(length)] for i in range(n)]
    tc2 = [[z3.Int(f"w_tc{i}_{j}") for j in range(length)] for i in range(n)]
    entries = []
    for i in range(n):
        sl, sl2 = s.slots[i], s2.slots[i]
        for j in range(length):
            kept_entry = z3.And(sl2.live, z3.Not(plan.pre[i]), j < sl2.b)
            was = z3.Or(z3.And(j < sl.b, th[i][j]), t.is_hit[i][j], t.publishes[i][j])
            for k in range(m):
                here = z3.And(kept_entry, c2.tab[i][j] == k)
                entries.append(z3.Implies(here, th2[i][j] == was))
                entries.append(z3.Implies(z3.And(here, th2[i][j]), tc2[i][j] == c.pc[i][j]))
    return [("lemma: an uncached or new block sits at one kept entry", z3.And(unique)),
            ("lemma: an entry of a table kept or scheduled counts", z3.And(where)),
            ("lemma: entries kept after the step", z3.And(entries))]


FIRST_TRY_S = 5.0
"""Seconds a part gets on the incremental solver before it is asked again on a fresh one."""


_PROVED: dict[str, int] = {}
"""Per options: how many of the step's goals (in their fixed order) are proved in this process."""


def _prove_goals(opts: Options, theorem: str) -> tuple[str, str, dict[str, Any] | None]:
    """Prove the step's goals in their fixed order up to the last of ``theorem``'s, part by part, each
    part then assumed. The goals before it are assumed only if an earlier theorem proved them in this
    process with the same options (a full run proves each goal once); else they are proved here too, so
    a theorem run alone (``--only``) stands alone.

    A part is first asked on one incremental solver (fast for the many small per-entry parts) with
    :data:`FIRST_TRY_S`; if unknown, again on a fresh solver with the same hypotheses (the sums over
    slots: an incremental solver does not preprocess, and ``rc'[k] == sum of held'`` is unknown after
    60 s there at N=8, M=4, proved in 2 s on a fresh one)."""
    from .solve import Prover, check, state_values

    bs = step_setup(opts)
    key = repr(prefix_options(opts))
    last = max(k for k, (owner, _, _) in enumerate(bs.goals) if owner == theorem)
    done = min(_PROVED.get(key, 0), last + 1)
    hypotheses = list(bs.hyps.values()) + [goal for _, _, goal in bs.goals[:done]]
    prover = Prover(bs.ctx, hypotheses, min(FIRST_TRY_S, opts.timeout_s))
    for index in range(done, last + 1):
        _, name, goal = bs.goals[index]
        for part in goal.children() if z3.is_and(goal) else [goal]:
            answer = prover.prove(part)
            if answer.status == UNKNOWN:
                answer = check(bs.ctx, hypotheses, part, opts.timeout_s)
            if answer.status != PROVED:
                witness = state_values(answer.model, bs.s, bs.plan) if answer.model is not None else None
                return answer.status, f"{name}: {answer.status} {answer.reason}".strip(), witness
            prover.assume([part])
            hypotheses.append(part)
        if _PROVED.get(key, 0) == index:
            _PROVED[key] = index + 1
    return PROVED, "", None


def step_cases(bs: StepSetup) -> dict[str, Any]:
    """The cases the step's premises must allow: a hit, an eviction, a release to the evictable pool, a
    preemption, a stop."""
    s, c, plan, h, t, out = bs.s, bs.c, bs.plan, bs.h, bs.t, bs.out
    n, m = s.n, c.m
    return {
        "a hit": z3.Or([z3.And(t.live_sched[i], h.hit[i] >= 1) for i in range(n)]),
        "a shared block (hit on a held block)": z3.Or([z3.And(t.hits_of[k] >= 1, c.rc[k] >= 1) for k in range(m)]),
        "an eviction": z3.Or([z3.And(t.new_of[k] >= 1, c.hashed[k]) for k in range(m)]),
        "a release to the evictable pool": z3.Or([z3.And(c.rc[k] >= 1, out.cache.rc[k] == 0, out.cache.hashed[k])
                                                  for k in range(m)]),
        "a publication": z3.Or([z3.And(z3.Not(c.hashed[k]), out.cache.hashed[k]) for k in range(m)]),
        "a preemption": z3.Or([z3.And(plan.pre[i], s.slots[i].running) for i in range(n)]),
        "a stop": z3.Or(out.stops),
    }


_VACUITY: dict[str, list[Coverage]] = {}


def step_vacuity(opts: Options) -> list[Coverage]:
    from .solve import Prover

    key = repr(prefix_options(opts))
    if key not in _VACUITY:
        bs = step_setup(opts)
        _VACUITY.clear()
        _VACUITY[key] = Prover(bs.ctx, list(bs.hyps.values()), opts.timeout_s).coverage(step_cases(bs))
    return _VACUITY[key]


STEP_THEOREMS = {
    "ref-counts": ("every block's reference count is the number of live block tables holding it; no table holds "
                   "a block twice; ids in [0, M)"),
    "block-partition": ("each block is exactly one of free (count 0, no hash), evictable (count 0, hash) or held "
                        "(count >= 1): the free queue's length is the number of blocks with count 0, so "
                        "free + evictable + held == num_kv_blocks"),
    "published-computed": ("a table's cached blocks are a prefix of it; block j's hash is the chained hash of the "
                           "request's first j + 1 blocks, and they are computed"),
    "shared-blocks-cached": "a block held by two tables carries a hash (support: only hits share blocks)",
    "request-invariants": ("the request invariants with hits: running-within-max-num-seqs, table-covers-computed, "
                           "queues-disjoint, output-bound, computed-bound, preempted-holds-nothing and the support "
                           "facts of spec/step"),
}


def _step_theorem(short: str) -> Theorem:
    name = f"spec/prefix/step/{short}"
    statement = f"caching on: Inv and Allowed(plan, 17 rules) and Update => {STEP_THEOREMS[short]} after the step"

    def run(opts: Options) -> Result:
        timer = Timer()
        local, m = prefix_options(opts)
        status, detail, witness = _prove_goals(local, short)
        vacuity = step_vacuity(local)
        return Result(name, statement, PROVED, status, local.policy_n, local.block_label, seconds=timer.seconds,
                      detail=detail or f"num_kv_blocks={m}", witness=witness, vacuity=vacuity)

    return Theorem(name, statement, run)


def initial_cache(n: int, m: int, length: int) -> Cache:
    zero = z3.IntVal(0)
    pc = [[z3.Int(f"init_pc{i}_{j}") for j in range(length)] for i in range(n)]
    return Cache([zero] * m, [z3.BoolVal(False)] * m, [zero] * m, [[zero] * length for _ in range(n)], pc)


INIT_STATEMENT = ("caching on: Init => Inv: no request, every block free with no hash and count 0, the prefix "
                  "invariants hold")
ARRIVE_STATEMENT = "caching on: Inv and a request arrives (its content classes free) => Inv'"
ABORT_STATEMENT = "caching on: Inv and a live request is aborted (its table released, hashes kept) => Inv'"


def _init(opts: Options) -> Result:
    from .encoding import initial_state
    from .solve import Prover, check
    from .theorems import setup

    timer = Timer()
    local, m = prefix_options(opts)
    ctx = setup(local)
    n = local.policy_n
    s0 = initial_state(ctx, n)
    c0 = initial_cache(n, m, m)
    inv, defs = prefix_invariant_parts(ctx, s0, c0, "v")
    hyps = [ctx.cfg.valid(), z3.And(defs), prefix_parts_premise(c0)]
    answer = check(ctx, hyps, z3.And(list(inv.values())), local.timeout_s)
    vacuity = Prover(ctx, hyps, local.timeout_s).coverage({})
    return Result("spec/prefix/init", INIT_STATEMENT, PROVED, answer.status, n, local.block_label,
                  seconds=timer.seconds, detail=answer.reason or f"num_kv_blocks={m}", vacuity=vacuity)


def prefix_parts_premise(c: Cache) -> Any:
    """Content classes of different indices of one request differ (hashes of chains of other lengths)."""
    out = []
    for row in c.pc:
        for j in range(len(row)):
            for j2 in range(j + 1, len(row)):
                out.append(row[j] != row[j2])
    return z3.And(out) if out else z3.BoolVal(True)


def _env(name: str, statement: str, action: str, opts: Options) -> Result:
    from .solve import Prover, state_values
    from .theorems import setup

    timer = Timer()
    local, m = prefix_options(opts)
    ctx = setup(local)
    n = local.policy_n
    s = symbolic_state(n, "s")
    c = symbolic_cache(n, m, m, "c")
    inv, defs = prefix_invariant_parts(ctx, s, c, "v")
    hyps = [ctx.cfg.valid(), z3.And(defs), z3.And(list(inv.values()))]
    sl = s.slots[0]
    if action == "arrive":
        p, mt = z3.Int("new_p"), z3.Int("new_mt")
        pc = [z3.Int(f"new_pc{j}") for j in range(m)]
        hyps += [sl.st == EMPTY, p >= 0, mt >= 0, prefix_parts_premise(Cache([], [], [], [], [pc]))]
        s2, c2 = prefix_arrive(s, c, 0, p, mt, pc)
        cases = {"others live": z3.And([other.live for other in s.slots[1:]])}
    else:
        hyps.append(sl.live)
        s2, c2 = prefix_abort(s, c, 0)
        cases = {"abort of a request holding a cached block": z3.Or([
                     z3.And(j < sl.b, c.tab[0][j] == k, c.hashed[k], c.rc[k] == 1) for j in range(m) for k in range(m)]),
                 "abort of a request sharing a block": z3.Or([
                     z3.And(j < sl.b, c.tab[0][j] == k, c.rc[k] >= 2) for j in range(m) for k in range(m)])}
    inv2, defs2 = prefix_invariant_parts(ctx, s2, c2, "w")
    hyps.append(z3.And(defs2))
    prover = Prover(ctx, hyps, local.timeout_s)
    answer = None
    for part in inv2.values():
        for piece in (part.children() if z3.is_and(part) else [part]):
            answer = prover.prove(piece)
            if answer.status != PROVED:
                break
            prover.assume([piece])
        if answer is not None and answer.status != PROVED:
            break
    assert answer is not None
    witness = state_values(answer.model, s) if answer.model is not None else None
    vacuity = Prover(ctx, hyps, local.timeout_s).coverage(cases)
    return Result(name, statement, PROVED, answer.status, n, local.block_label, seconds=timer.seconds,
                  detail=answer.reason or f"num_kv_blocks={m}", witness=witness, vacuity=vacuity)


def prefix_theorems() -> list[Theorem]:
    """The prefix-cache theorems, run at ``min(N, policy_slots)`` slots and ``num_kv_blocks = id_blocks``
    (``--set num_kv_blocks=M`` overrides it), caching on, block size fixed."""
    out = [Theorem("spec/prefix/init", INIT_STATEMENT, _init),
           Theorem("spec/prefix/arrive", ARRIVE_STATEMENT, lambda o: _env("spec/prefix/arrive", ARRIVE_STATEMENT, "arrive", o)),
           Theorem("spec/prefix/abort", ABORT_STATEMENT, lambda o: _env("spec/prefix/abort", ABORT_STATEMENT, "abort", o))]
    out += [_step_theorem(short) for short in STEP_THEOREMS]
    return out


# --- concrete values (the agreement test, tests/test_proofs_prefix.py) ------------------------------


class ConcreteCache:
    """Numerals for a Python state with prefix caching: hashes as content classes (one integer per
    distinct hash, shared across states through ``classes``), request slots as :mod:`.concrete` lays
    them out, tables padded to ``length`` entries."""

    def __init__(self, config: Any, length: int) -> None:
        self.config = config
        self.length = length
        self.classes: dict[str, int] = {}

    def cls(self, hash_value: str) -> int:
        return self.classes.setdefault(hash_value, len(self.classes) + 1)

    def encode(self, state: Any, slot_ids: list[str | None]) -> tuple[State, Cache]:
        """The state and its cache layer; raises ``ValueError`` if a table is longer than ``length``."""
        from schedspec.spec.prefix_cache import ROOT_HASH, request_block_hash

        from .concrete import encode_state

        cache = state.prefix_cache
        m, length, bs = self.config.num_kv_blocks, self.length, self.config.block_size
        V = z3.IntVal
        tab, pc = [], []
        for i, request_id in enumerate(slot_ids):
            request = state.requests.get(request_id) if request_id is not None else None
            table = list(request.block_ids) if request is not None else []
            if len(table) > length:
                raise ValueError(f"table of {len(table)} blocks > {length}")
            tab.append([V(table[j] if j < len(table) else 0) for j in range(length)])
            row, parent = [], ROOT_HASH
            known = request.num_tokens // bs if request is not None else 0
            for j in range(length):
                if j < known:
                    parent = request_block_hash(request, j, parent, bs)
                    row.append(V(self.cls(parent)))
                else:  # tokens not sampled yet: a class no hash has
                    row.append(V(-(1 + i * length + j)))
            pc.append(row)
        rc = [V(cache.ref_counts.get(k, 0)) for k in range(m)]
        hashed = [z3.BoolVal(k in cache.block_hashes) for k in range(m)]
        cls = [V(self.cls(cache.block_hashes[k]) if k in cache.block_hashes else 0) for k in range(m)]
        return encode_state(state, slot_ids), Cache(rc, hashed, cls, tab, pc)

    def encode_plan(self, state: Any, plan: Any, slot_ids: list[str | None]) -> tuple[Plan, Hits]:
        """The plan and its hits; raises ``ValueError`` if a table would be longer than ``length``."""
        from .concrete import encode_plan

        V = z3.IntVal
        n, length = len(slot_ids), self.length
        index = {r: i for i, r in enumerate(slot_ids) if r is not None}
        hit = [V(0)] * n
        ids = [[V(0)] * length for _ in range(n)]
        for item in plan.scheduled:
            i = index[item.request_id]
            request = state.requests.get(item.request_id)
            b = len(request.block_ids) if request is not None else 0
            entries = list(item.cached_block_ids) + list(item.new_block_ids)
            if b + len(entries) > length:
                raise ValueError(f"table of {b + len(entries)} blocks > {length}")
            hit[i] = V(len(item.cached_block_ids))
            for j, block_id in enumerate(entries):
                ids[i][b + j] = V(block_id)
        return encode_plan(plan, slot_ids), Hits(hit, ids)

    def decode(self, s: State, c: Cache, slot_ids: list[str | None]) -> dict[str, Any]:
        """What the encoding says about a ground state's cache: counts, hashes (as classes), live tables."""
        from .concrete import evaluate

        m = self.config.num_kv_blocks
        tables = {}
        for i, request_id in enumerate(slot_ids):
            if evaluate(s.slots[i].st) != EMPTY:
                tables[request_id] = [evaluate(x) for x in c.tab[i][:evaluate(s.slots[i].b)]]
        hashes = {k: evaluate(c.cls[k]) for k in range(m) if evaluate(c.hashed[k])}
        return {"ref_counts": [evaluate(c.rc[k]) for k in range(m)], "hashes": hashes, "tables": tables}

    def describe(self, state: Any) -> dict[str, Any]:
        """The same view of a Python state."""
        cache = state.prefix_cache
        m = self.config.num_kv_blocks
        return {"ref_counts": [cache.ref_counts.get(k, 0) for k in range(m)],
                "hashes": {k: self.cls(h) for k, h in sorted(cache.block_hashes.items())},
                "tables": {r: list(q.block_ids) for r, q in state.requests.items()}}


__all__ = ["Cache", "ConcreteCache", "Hits", "PREFIX_RULE_ORDER", "Terms", "prefix_apply", "prefix_invariant_parts", "prefix_rules",
           "prefix_theorems"]
_ = WAITING
