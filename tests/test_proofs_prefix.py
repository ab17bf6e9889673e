"""Exhaustive, deterministic agreement of the prefix-cache encoding (``spec/proofs/prefix.py``) with the
Python spec (``spec/prefix_cache.py``, ``spec/rules.py``, ``spec/transitions.py``).

Every state fcfs reaches, with ``enable_prefix_caching`` on, from every workload of a small grid (1 to
3 requests sharing a prompt prefix or not, arriving at steps 0 to 2) under a few configs with 3 or 4
blocks of 1 or 2 tokens (so hits, evictions and releases to the evictable pool all happen), is checked:
on fcfs's plan and perturbations of it (a hit one block shorter, a hit block swapped for an uncached or
a held block, a new block swapped for a held one, a chunk one token longer, a preemption dropped or
added, an extra admission without its hit), each encoded rule is violated exactly when
``violated_rules`` names it, and for an allowed plan the encoded update gives ``apply_plan``'s state:
request fields and queues, reference counts, which blocks carry which hash (as classes) and every
live block table. Two deliberate breaks of the update (a released block losing its hash instead of
becoming evictable; a hit not adding a reference) are each caught.

Cost: 25 s wall, 21 s CPU on the 2-core machine at load ~1.5 (``pytest -q tests/test_proofs_prefix.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import cache

import pytest

z3 = pytest.importorskip("z3")

from schedspec.reference import policies  # noqa: E402
from schedspec.spec.config import SchedulerConfig  # noqa: E402
from schedspec.spec.proofs import prefix  # noqa: E402
from schedspec.spec.proofs.concrete import (  # noqa: E402
    concrete_ctx,
    decode_state,
    describe_state,
    slot_assignment,
)
from schedspec.spec.proofs.encoding import PLAN_FIELDS, SLOT_FIELDS, STATE_SCALARS  # noqa: E402
from schedspec.spec.rules import (  # noqa: E402
    GROUP_RULES,
    IN_FLIGHT_RULES,
    LIMIT_RULES,
    PUBLICATION_RULES,
    REMOTE_KV_RULES,
    RULE_NAMES,
    violated_rules,
)
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan, samples_this_step  # noqa: E402
from schedspec.spec.transitions import add_request, apply_plan  # noqa: E402
from schedspec.spec.workload import EOS_TOKEN_ID, RequestSpec  # noqa: E402

CONFIGS = [
    SchedulerConfig(block_size=bs, num_kv_blocks=blocks, max_num_batched_tokens=budget, max_num_seqs=seqs,
                    max_model_len=6, enable_chunked_prefill=chunked, enable_prefix_caching=True)
    for bs, blocks, seqs, chunked, budget in [(1, 4, 2, True, 3), (2, 4, 2, False, 6), (1, 3, 3, False, 6),
                                              (2, 3, 1, True, 4)]
]
SHAPES = [(3, 2, "g", 3), (4, 1, "g", 3), (4, 2, "g", 2), (2, 2, None, 0), (5, 1, "g", 4)]
"""(prompt_len, max_tokens, prefix group, prefix_len): group "g" shares its first prefix_len prompt ids."""
MAX_STEPS = 7
LENGTH = 8
"""Table entries the concrete encoding lays out (more than num_kv_blocks: perturbed plans may ask more)."""


def _key(state: SchedulerState) -> tuple:
    cache_ = state.prefix_cache
    return (tuple((r, q.status.value, q.prompt_len, q.num_output_tokens, q.max_tokens, q.num_computed_tokens,
                   q.block_ids, q.prompt_token_ids[:6]) for r, q in sorted(state.requests.items())),
            state.waiting, state.running, tuple(sorted(cache_.ref_counts.items())),
            tuple(sorted(cache_.block_hashes.items())), tuple(sorted(state.free_block_ids)))


@cache
def reached_states() -> tuple[tuple[SchedulerConfig, SchedulerState], ...]:
    """Every state fcfs reaches on the grid (caching on), one per distinct view, in a fixed order."""
    found: dict[tuple, tuple[SchedulerConfig, SchedulerState]] = {}
    for config in CONFIGS:
        for k in (1, 2, 3):
            for shapes in itertools.combinations(SHAPES, k):
                for arrivals in itertools.product((0, 2), repeat=k):
                    if arrivals[0] != 0:
                        continue
                    state = SchedulerState.initial(config)
                    for step in range(MAX_STEPS):
                        for j, (prompt_len, max_tokens, group, shared) in enumerate(shapes):
                            if arrivals[j] == step:
                                spec = RequestSpec(f"r{j}", prompt_len, max_tokens, arrival_step=step,
                                                   prefix_group=group, prefix_len=shared)
                                state = add_request(state, spec.to_request(step))
                        found.setdefault((config, _key(state)), (config, state))
                        plan = policies.fcfs(state, config)
                        sampled = {i.request_id: 1 for i in plan.scheduled
                                   if samples_this_step(state.requests[i.request_id], i)}
                        state = apply_plan(state, plan, sampled, config).state
    return tuple(found.values())


def _pool(state: SchedulerState, plan_hits: set[int], preempted: list[str]) -> list[int]:
    """Blocks a perturbed plan may hand out: the free queue (less hit blocks), then blocks the preemptions
    bring to count 0."""
    pool = [b for b in state.free_block_ids if b not in plan_hits]
    counts = dict(state.prefix_cache.ref_counts)
    for request_id in preempted:
        for b in state.requests[request_id].block_ids:
            counts[b] = counts.get(b, 0) - 1
            if counts[b] == 0 and b not in plan_hits:
                pool.append(b)
    return pool


def _rebuild(state, config, items, preempted, rejected) -> StepPlan:
    """A plan from (request, start, tokens, new block count, hit blocks) items, new blocks in pool order."""
    hits = {b for *_, cached in items for b in cached}
    pool = _pool(state, hits, preempted)
    scheduled, taken = [], 0
    for request_id, start, ntok, nb, cached in items:
        ids = tuple(pool[k] if k < len(pool) else config.num_kv_blocks + k for k in range(taken, taken + nb))
        scheduled.append(ScheduledRequest(request_id, start, ntok, ids, tuple(cached)))
        taken += nb
    return StepPlan(scheduled=tuple(scheduled), preempted=tuple(preempted), rejected=tuple(rejected))


def plans_for(state: SchedulerState, config: SchedulerConfig) -> list[StepPlan]:
    """fcfs's plan and perturbations of it aimed at the prefix rules and the block rules."""
    base = policies.fcfs(state, config)
    out = [base]
    bs = config.block_size
    items = [(i.request_id, i.num_computed_tokens, i.num_tokens, len(i.new_block_ids), list(i.cached_block_ids))
             for i in base.scheduled]
    pre, rej = list(base.preempted), list(base.rejected)
    cache_ = state.prefix_cache
    held = sorted(b for b, n in cache_.ref_counts.items() if n > 0)
    uncached = [b for b in range(config.num_kv_blocks) if b not in cache_.block_hashes]
    for k, (rid, start, ntok, nb, cached) in enumerate(items):
        def put(item, k=k):
            return items[:k] + [item] + items[k + 1:]
        out.append(_rebuild(state, config, put((rid, start, ntok + 1, nb, cached)), pre, rej))
        if cached:
            # a hit one block shorter (its tokens computed instead)
            out.append(_rebuild(state, config, put((rid, start - bs, ntok + bs, nb + 1, cached[:-1])), pre, rej))
            for other in uncached[:1] + held[:1]:
                swapped = cached[:-1] + [other]
                out.append(_rebuild(state, config, put((rid, start, ntok, nb, swapped)), pre, rej))
        if nb and held:
            plan = _rebuild(state, config, items, pre, rej)
            item = plan.scheduled[k]
            swapped_item = ScheduledRequest(item.request_id, item.num_computed_tokens, item.num_tokens,
                                            (held[-1],) + item.new_block_ids[1:], item.cached_block_ids)
            out.append(StepPlan(plan.scheduled[:k] + (swapped_item,) + plan.scheduled[k + 1:], plan.preempted,
                                plan.rejected))
    for k in range(len(pre)):
        out.append(_rebuild(state, config, items, pre[:k] + pre[k + 1:], rej))
    named = {i[0] for i in items} | set(pre) | {r for r, _ in rej}
    for rid in state.running:
        if rid not in named:
            out.append(_rebuild(state, config, [i for i in items if i[0] != rid], pre + [rid], rej))
    for rid in state.waiting:
        if rid not in named:
            r = state.requests[rid]
            whole = -(-r.num_tokens // bs)
            out.append(_rebuild(state, config, items + [(rid, 0, r.num_tokens, whole, [])], pre, rej))
    return out


class Symbolic:
    """The encoding built once per (config, slots, mutant) on variables; a concrete (state, plan) is then
    a model of equalities to its numerals, and each encoded rule and updated field is evaluated in it
    (building the encoding's terms on numerals for every case costs about 0.3 s; this, a few ms)."""

    def __init__(self, config: SchedulerConfig, n: int, mutant: str | None) -> None:
        from schedspec.spec.proofs.encoding import symbolic_plan, symbolic_state

        self.ctx = concrete_ctx(config)
        m = config.num_kv_blocks
        self.s, self.c = symbolic_state(n, "s"), prefix.symbolic_cache(n, m, LENGTH, "c")
        self.p, self.h = symbolic_plan(n, "pl"), prefix.symbolic_hits(n, LENGTH, "ph")
        self.eos = [z3.Bool(f"eos{i}") for i in range(n)]
        terms = prefix.Terms(self.ctx, self.s, self.c, self.p, self.h)
        self.rules = prefix.prefix_rules(self.ctx, self.s, self.c, self.p, self.h, terms)
        self.out = prefix.prefix_apply(self.ctx, self.s, self.c, self.p, self.h, self.eos, terms, mutant=mutant)
        self.solver = z3.Solver()

    def model(self, s, c, p, h, eos: bool) -> z3.ModelRef:
        pairs = [(self.eos[i], z3.BoolVal(eos)) for i in range(self.s.n)]
        for mine, theirs in zip(self.s.slots, s.slots, strict=True):
            pairs += [(getattr(mine, f), getattr(theirs, f)) for f in SLOT_FIELDS]
        pairs += [(getattr(self.s, f), getattr(s, f)) for f in STATE_SCALARS]
        for f in ("rc", "hashed", "cls"):
            pairs += list(zip(getattr(self.c, f), getattr(c, f), strict=True))
        for f in ("tab", "pc"):
            for mine, theirs in zip(getattr(self.c, f), getattr(c, f), strict=True):
                pairs += list(zip(mine, theirs, strict=True))
        for f in PLAN_FIELDS:
            pairs += list(zip(getattr(self.p, f), getattr(p, f), strict=True))
        pairs += list(zip(self.h.hit, h.hit, strict=True))
        for mine, theirs in zip(self.h.ids, h.ids, strict=True):
            pairs += list(zip(mine, theirs, strict=True))
        self.solver.reset()
        self.solver.add([a == b for a, b in pairs])
        assert self.solver.check() == z3.sat
        return self.solver.model()

    def after(self, model: z3.ModelRef):
        """The encoded state after the step, as numerals."""
        ev = lambda term: model.eval(term, model_completion=True)  # noqa: E731
        out = self.out
        slots = [dataclasses.replace(sl, **{f: ev(getattr(sl, f)) for f in SLOT_FIELDS}) for sl in out.state.slots]
        state = dataclasses.replace(out.state, slots=slots, free=ev(out.state.free))
        c = out.cache
        cache_ = prefix.Cache([ev(x) for x in c.rc], [ev(x) for x in c.hashed], [ev(x) for x in c.cls],
                              [[ev(x) for x in row] for row in c.tab], c.pc)
        return state, cache_


@cache
def symbolic(config: SchedulerConfig, n: int, mutant: str | None) -> Symbolic:
    return Symbolic(config, n, mutant)


def disagreement(limit: int | None = None, mutant: str | None = None) -> str | None:
    """The first (state, plan) where an encoded rule or the encoded update disagrees with Python."""
    for config, state in reached_states()[:limit]:
        layout = prefix.ConcreteCache(config, LENGTH)
        for plan in plans_for(state, config):
            slot_ids = slot_assignment(state, plan, len(state.requests))
            try:
                s, c = layout.encode(state, slot_ids)
                p, h = layout.encode_plan(state, plan, slot_ids)
            except ValueError:
                continue
            sym = symbolic(config, len(slot_ids), mutant)
            model = sym.model(s, c, p, h, False)
            encoded = {name for name, rule in sym.rules.items() if not z3.is_true(model.eval(rule, model_completion=True))}
            python = {v.name for v in violated_rules(state, plan, config)}
            if encoded != python:
                return f"{config} {state} {plan}: encoding breaks {sorted(encoded)}, Python {sorted(python)}"
            if python:
                continue
            for eos in (False, True):
                sampled = {i.request_id: EOS_TOKEN_ID if eos else 1 for i in plan.scheduled
                           if samples_this_step(state.requests[i.request_id], i)}
                after = apply_plan(state, plan, sampled, config).state
                s2, c2 = sym.after(model if not eos else sym.model(s, c, p, h, True))
                got = (decode_state(s2, slot_ids), layout.decode(s2, c2, slot_ids))
                want = (describe_state(after), layout.describe(after))
                if got != want:
                    return f"{config} {state} {plan} eos={eos}: the encoded update gives {got}, Python {want}"
    return None


def test_the_encoding_has_every_rule():
    # synchronous engines only (no rule of a step in flight), and not the per-step limits' (tests/test_limits.py):
    # off by default they constrain nothing, and each only removes plans, so a proof over the encoded rules holds
    assert set(prefix.PREFIX_RULE_ORDER) == (set(RULE_NAMES) - set(IN_FLIGHT_RULES) - set(LIMIT_RULES) - set(GROUP_RULES)
                                             - set(REMOTE_KV_RULES) - set(PUBLICATION_RULES))


def test_the_grid_reaches_hits_evictions_and_releases_to_the_evictable_pool():
    """The enumeration is not trivial: fcfs's plans hit the cache (some on a block another table holds),
    evict cached blocks, and release cached blocks that stay evictable."""
    states = reached_states()
    assert len(states) > 150
    hits = shared = evictions = to_evictable = preemptions = 0
    for config, state in states:
        plan = policies.fcfs(state, config)
        cache_ = state.prefix_cache
        hit_blocks = [b for i in plan.scheduled for b in i.cached_block_ids]
        hits += bool(hit_blocks)
        shared += any(cache_.ref_counts.get(b, 0) >= 1 for b in hit_blocks)
        evictions += any(b in cache_.block_hashes for i in plan.scheduled for b in i.new_block_ids)
        preemptions += bool(plan.preempted)
        sampled = {i.request_id: 1 for i in plan.scheduled if samples_this_step(state.requests[i.request_id], i)}
        after = apply_plan(state, plan, sampled, config).state.prefix_cache
        to_evictable += any(cache_.ref_counts.get(b, 0) >= 1 and not after.ref_counts.get(b) and b in after.block_hashes
                            for b in range(config.num_kv_blocks))
    assert hits >= 10 and shared >= 3 and evictions >= 5 and to_evictable >= 10 and preemptions >= 3, (
        hits, shared, evictions, to_evictable, preemptions)


def test_encoded_rules_and_update_agree_on_every_reached_state_and_plan():
    assert disagreement() is None


@pytest.mark.parametrize("mutant", ["release-drops-hash", "hit-not-referenced"])
def test_each_mutant_of_the_update_is_caught(mutant):
    reached_states()
    assert disagreement(mutant=mutant) is not None, f"mutant {mutant!r} escaped the exhaustive agreement"


# --- the theorems (`schedspec prove --set enable_prefix_caching=true`) -------------------------------


def _prove(*args: str):
    from click.testing import CliRunner

    from schedspec.cli import cli

    return CliRunner().invoke(cli, ["prove", "--set", "enable_prefix_caching=true", *args])


def test_prove_with_prefix_caching_runs_the_prefix_theorems():
    """With caching on, `prove` runs the spec/prefix/* theorems (at 2 slots, 3 blocks here: a few seconds)
    and each is proved with every vacuity case satisfiable (a hit, a shared block, an eviction, a
    release to the evictable pool, a publication, a preemption, a stop)."""
    import json

    run = _prove("--policy-slots", "2", "--id-blocks", "3", "--json")
    assert run.exit_code == 0, run.output
    found = {r["name"]: r for r in json.loads(run.stdout)["results"]}
    assert set(found) == {t.name for t in prefix.prefix_theorems()}
    for name, result in found.items():
        assert result["status"] == "proved" and result["ok"], (name, result["detail"])
        assert result["slots"] == 2 and result["block_size"] == "fixed 16"
        assert all(c["status"] == "sat" for c in result["vacuity"]), (name, result["vacuity"])
    cases = {c["case"] for c in found["spec/prefix/step/ref-counts"]["vacuity"]}
    assert {"premises", "premises + a hit", "premises + an eviction",
            "premises + a release to the evictable pool"} <= cases


def test_prove_list_shows_the_prefix_theorems():
    from click.testing import CliRunner

    from schedspec.cli import cli

    plain = CliRunner().invoke(cli, ["prove", "--list"])
    assert plain.exit_code == 0 and "enable_prefix_caching=true" in plain.output
    assert "spec/prefix/step/ref-counts" in plain.output and "spec/step/block-conservation" in plain.output
    listed = _prove("--list")
    assert listed.exit_code == 0 and "spec/prefix/step/ref-counts" in listed.output
    assert "spec/step/block-conservation" not in listed.output and "fcfs/" not in listed.output


def _run_broken(mutant: str, theorem: str, monkeypatch):
    import functools

    from schedspec.spec.proofs.core import Options

    monkeypatch.setattr(prefix, "prefix_apply", functools.partial(prefix.prefix_apply, mutant=mutant))
    monkeypatch.setattr(prefix, "_SETUP", {})
    monkeypatch.setattr(prefix, "_VACUITY", {})
    monkeypatch.setattr(prefix, "_PROVED", {})
    chosen = next(t for t in prefix.prefix_theorems() if t.name == theorem)
    return chosen.run(Options(policy_slots=2, id_blocks=3))


def test_a_hit_that_adds_no_reference_breaks_ref_counts(monkeypatch):
    """Deliberate break of the update: the reference counts no longer match the tables."""
    result = _run_broken("hit-not-referenced", "spec/prefix/step/ref-counts", monkeypatch)
    assert result.status == "counterexample" and not result.ok, (result.status, result.detail)


def test_a_release_that_drops_the_hash_is_caught_by_the_vacuity_check(monkeypatch):
    """Deliberate break: a released block losing its hash keeps every safety invariant (an evictable block
    is in no table), but no step then releases a block to the evictable pool: that vacuity case is
    unsatisfiable and the theorem is not as expected."""
    result = _run_broken("release-drops-hash", "spec/prefix/step/block-partition", monkeypatch)
    assert result.status == "proved" and not result.ok
    assert [c.case for c in result.vacuous] == ["premises + a release to the evictable pool"], result.vacuity
