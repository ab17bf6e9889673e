"""Prefix caching in the spec (:mod:`schedspec.spec.prefix_cache`): the hash, the free-queue order, the
transitions, and one failing case per prefix rule and invariant (registered into ``test_rules.CASES`` and
``test_invariants.STATE_CASES``/``STEP_CASES`` so that every rule and invariant keeps a case).

The states are built with the spec's own transitions from a hand-written history: request ``a`` (prompt
11..19, 9 tokens, block size 4) runs alone and finishes, publishing its two full blocks 0 and 1; then
``b`` arrives whose first 8 tokens equal ``a``'s.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from test_stateful import TWINS, with_twin  # tests/ is on sys.path under pytest

from schedspec.reference.scheduler import SCHEDULERS
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import check_state, check_step
from schedspec.spec.prefix_cache import ROOT_HASH, CacheUpdate, PrefixCache, block_hash, max_hit_blocks
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import violated_rules
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.transitions import abort_request, add_request, apply_plan
from schedspec.testing import machine_for

CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32,
                         enable_prefix_caching=True)
A_PROMPT = tuple(range(11, 20))  # 9 tokens: blocks [11..14], [15..18], [19]
B_PROMPT = tuple(range(11, 19)) + (31, 32)  # the same first 8 tokens, then its own


def warm_state() -> SchedulerState:
    """``a`` ran and finished; ``b`` waits. Free queue: (2, 3, 4, 5, 6, 7, 1, 0): the never-cached block 2 of
    ``a`` went to the front, its cached blocks to the back, last block first (vLLM ``free_blocks``)."""
    state = add_request(SchedulerState.initial(CONFIG), Request("a", 0, A_PROMPT, max_tokens=1))
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("a", 0, 9, (0, 1, 2)),)), {"a": 99}, CONFIG).state
    return add_request(state, Request("b", 1, B_PROMPT, max_tokens=3))


HIT_B = ScheduledRequest("b", 8, 2, (2,), cached_block_ids=(0, 1))


def after_hit() -> tuple[SchedulerState, StepPlan, SchedulerState]:
    before = warm_state()
    plan = StepPlan(scheduled=(HIT_B,))
    return before, plan, apply_plan(before, plan, {"b": 77}, CONFIG).state


# ---- the hash and the lookup


def test_block_hash_is_chained_and_stable() -> None:
    first = block_hash(ROOT_HASH, [1, 2, 3, 4])
    assert first == block_hash(ROOT_HASH, (1, 2, 3, 4)) and len(first) == 32
    assert block_hash(first, [5, 6, 7, 8]) != block_hash(ROOT_HASH, [5, 6, 7, 8])  # the parent matters
    assert block_hash(ROOT_HASH, [1, 2, 3, 5]) != first
    # a fixed value: the hash must not depend on the process (PYTHONHASHSEED) or the platform
    assert first == block_hash("", [1, 2, 3, 4])


def test_max_hit_leaves_one_token() -> None:
    # 8 prompt tokens = 2 full blocks; only 7 may hit, so 1 block (vLLM get_computed_blocks num_tokens - 1)
    assert max_hit_blocks(Request("x", 0, tuple(range(8)), max_tokens=1), 4) == 1
    assert max_hit_blocks(Request("x", 0, tuple(range(9)), max_tokens=1), 4) == 2


def test_finished_request_publishes_full_blocks_only_and_keeps_them_evictable() -> None:
    state = warm_state()
    cache = state.prefix_cache
    assert cache is not None
    assert set(cache.block_hashes) == {0, 1}  # block 2 holds one token: not full, not published
    assert cache.ref_counts == {}
    assert state.free_block_ids == (2, 3, 4, 5, 6, 7, 1, 0)
    assert state.num_free_blocks == 8  # evictable blocks count as free
    assert cache.longest_hit(state.requests["b"], 4) == (0, 1)
    assert check_state(state, CONFIG) == []


def test_hit_references_blocks_and_counts_computed_tokens() -> None:
    before, plan, after = after_hit()
    assert violated_rules(before, plan, CONFIG) == []
    b = after.requests["b"]
    assert b.block_ids == (0, 1, 2) and b.num_computed_tokens == 10 and b.output_token_ids == (77,)
    assert after.prefix_cache.ref_counts == {0: 1, 1: 1, 2: 1}
    assert after.free_block_ids == (3, 4, 5, 6, 7)
    assert check_step(before, plan, after, CONFIG) == []


def test_shared_blocks_and_preemption_release_references() -> None:
    before, plan, after = after_hit()
    c = Request("c", 2, B_PROMPT[:8] + (41, 42, 43), max_tokens=3)
    state = add_request(after, c)
    hit = state.prefix_cache.longest_hit(c, 4)
    assert hit == (0, 1)
    plan = StepPlan(scheduled=(ScheduledRequest("b", 10, 1), ScheduledRequest("c", 8, 3, (3,), cached_block_ids=hit)))
    assert violated_rules(state, plan, CONFIG) == []
    state = apply_plan(state, plan, {"b": 5, "c": 6}, CONFIG).state
    assert state.prefix_cache.ref_counts[0] == 2 and state.prefix_cache.ref_counts[1] == 2
    assert check_state(state, CONFIG) == []
    # preempting b: its shared blocks stay held by c, its own block 2 (now published: 11 computed tokens, 2 full
    # blocks + block 2 holds tokens 8..10, not full) goes to the front
    plan = StepPlan(scheduled=(ScheduledRequest("c", 11, 1),), preempted=("b",))
    assert violated_rules(state, plan, CONFIG) == []
    state = apply_plan(state, plan, {"c": 7}, CONFIG).state
    assert state.prefix_cache.ref_counts.get(0) == 1 and state.free_block_ids[0] == 2
    assert check_state(state, CONFIG) == []
    state = abort_request(state, "c")
    assert state.prefix_cache.ref_counts == {}
    assert check_state(state, CONFIG) == []
    assert state.num_free_blocks == 8


def test_handing_out_a_cached_block_evicts_it() -> None:
    state = warm_state()
    # b misses on purpose is not allowed (prefix-hit-longest); a request with other tokens takes 7 blocks
    other = Request("x", 1, tuple(range(100, 125)), max_tokens=2)
    state = add_request(abort_request(state, "b"), other)
    plan = StepPlan(scheduled=(ScheduledRequest("x", 0, 16, (2, 3, 4, 5, 6, 7, 1)),))
    assert violated_rules(state, plan, CONFIG) == []
    after = apply_plan(state, plan, {}, CONFIG).state
    assert 1 not in after.prefix_cache.block_hashes  # evicted
    assert after.prefix_cache.block_hashes.keys() >= {0}
    assert check_state(after, CONFIG) == []


def test_hit_on_a_block_evicted_earlier_in_the_batch_is_refused() -> None:
    state = warm_state()
    x = Request("x", 1, tuple(range(100, 125)), max_tokens=2)
    state = add_request(state, x)
    # x, earlier in the batch, takes block 0 (evicting it); b then may hit nothing
    plan = StepPlan(scheduled=(ScheduledRequest("x", 0, 6, (2, 3, 4, 5, 6, 7, 0)),
                               ScheduledRequest("b", 8, 2, (1,), cached_block_ids=(0, 1))))
    names = {v.name for v in violated_rules(state, plan, CONFIG)}
    assert "prefix-hit-is-cached-chain" in names and "blocks-from-free-pool" in names


def test_two_requests_with_the_same_new_prefix_publish_duplicates() -> None:
    state = SchedulerState.initial(CONFIG)
    state = add_request(add_request(state, Request("p", 0, A_PROMPT, max_tokens=2)),
                        Request("q", 0, A_PROMPT, max_tokens=2))
    plan = StepPlan(scheduled=(ScheduledRequest("p", 0, 9, (0, 1, 2)), ScheduledRequest("q", 0, 7, (3, 4, 5))))
    assert violated_rules(state, plan, CONFIG) == []
    after = apply_plan(state, plan, {"p": 1}, CONFIG).state
    cache = after.prefix_cache
    # p's blocks 0, 1 and q's block 3 are full; blocks 0 and 3 hold the same tokens: one hash, two blocks
    assert cache.hash_to_blocks[cache.block_hashes[0]] == (0, 3)
    assert check_state(after, CONFIG) == []


def test_cache_update_free_queue_order_matches_vllm() -> None:
    # table (5, 6, 7): 5 and 6 cached, 7 not. free_blocks(reversed): 7 to the front, then 6, 5 appended.
    cache = PrefixCache(block_hashes={5: "h5", 6: "h6"}, hash_to_blocks={"h5": (5,), "h6": (6,)},
                        ref_counts={5: 1, 6: 1, 7: 1})
    update = CacheUpdate(cache, (0, 1))
    update.release((5, 6, 7))
    assert update.free == [7, 0, 1, 6, 5]
    update.touch((5,))
    assert update.free == [7, 0, 1, 6] and update.ref_counts == {5: 1}
    assert update.take_front(4) == (7, 0, 1, 6) and update.evicted == [6]


def test_caching_off_state_has_no_cache() -> None:
    assert SchedulerState.initial(CONFIG.with_changes(enable_prefix_caching=False)).prefix_cache is None


# ---- one failing case per prefix rule (registered in test_rules.CASES)


def case_prefix_hit_at_admission():
    state = attrs.evolve(warm_state(), prefix_cache=None)
    good = StepPlan(scheduled=(ScheduledRequest("b", 0, 10, (2, 3, 4)),))
    return state, StepPlan(scheduled=(HIT_B,)), good, CONFIG.with_changes(enable_prefix_caching=False)


def case_prefix_hit_is_cached_chain():
    # blocks 1 and 0 swapped: block 1 caches tokens 15..18, not 11..14
    bad = StepPlan(scheduled=(ScheduledRequest("b", 8, 2, (2,), cached_block_ids=(1, 0)),))
    return warm_state(), bad, StepPlan(scheduled=(HIT_B,)), CONFIG


def case_prefix_hit_longest():
    # b ignores the 8 cached tokens and computes them again
    bad = StepPlan(scheduled=(ScheduledRequest("b", 0, 10, (2, 3, 4)),))
    return warm_state(), bad, StepPlan(scheduled=(HIT_B,)), CONFIG


PREFIX_RULE_CASES = {
    "prefix-hit-at-admission": case_prefix_hit_at_admission,
    "prefix-hit-is-cached-chain": case_prefix_hit_is_cached_chain,
    "prefix-hit-longest": case_prefix_hit_longest,
}


def test_hit_longer_than_allowed_is_refused() -> None:
    # c's whole prompt (8 tokens) is cached, but only 7 may hit: 1 block
    state = add_request(warm_state(), Request("c", 1, A_PROMPT[:8], max_tokens=2))
    bad = StepPlan(scheduled=(ScheduledRequest("c", 8, 0, (), cached_block_ids=(0, 1)),))
    assert "prefix-hit-is-cached-chain" in {v.name for v in violated_rules(state, bad, CONFIG)}
    good = StepPlan(scheduled=(ScheduledRequest("c", 4, 4, (2,), cached_block_ids=(0,)),))
    assert violated_rules(state, good, CONFIG) == []


def test_shared_block_released_by_one_preemption_is_not_free() -> None:
    before, plan, state = after_hit()
    c = Request("c", 2, B_PROMPT[:8] + (41, 42, 43), max_tokens=2)
    state = add_request(state, c)
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("c", 8, 3, (3,), cached_block_ids=(0, 1)),)),
                       {"c": 1}, CONFIG).state
    # preempting b frees block 2 but not 0 (c holds it)
    x = Request("x", 3, tuple(range(200, 203)), max_tokens=1)
    state = add_request(state, x)
    bad = StepPlan(scheduled=(ScheduledRequest("x", 0, 3, (0,)),), preempted=("b",))
    found = violated_rules(state, bad, CONFIG)
    assert any(v.name == "blocks-from-free-pool" and "block 0" in v.detail for v in found), found


# ---- one failing case per prefix invariant (registered in test_invariants)


def case_prefix_ref_counts():
    _, _, good = after_hit()
    cache = attrs.evolve(good.prefix_cache, ref_counts={0: 2, 1: 1, 2: 1})
    return attrs.evolve(good, prefix_cache=cache), good, CONFIG, CONFIG


def case_prefix_block_partition():
    _, _, good = after_hit()
    # block 7 lost: in neither the free queue nor any table
    return attrs.evolve(good, free_block_ids=good.free_block_ids[:-1]), good, CONFIG, CONFIG


def case_prefix_published_computed():
    _, _, good = after_hit()
    # b's block 1 is cached but b has computed only 4 tokens
    b = attrs.evolve(good.requests["b"], num_computed_tokens=4)
    return attrs.evolve(good, requests={"b": b}), good, CONFIG, CONFIG


def case_released_holds_no_reference():
    _, _, good = after_hit()
    # b preempted, but the reference counts still count its table
    b = attrs.evolve(good.requests["b"], status=RequestStatus.PREEMPTED, num_computed_tokens=0, block_ids=())
    bad = attrs.evolve(good, requests={"b": b}, running=(), waiting=("b",))
    return bad, good, CONFIG, CONFIG


PREFIX_STATE_CASES = {
    "prefix-ref-counts": case_prefix_ref_counts,
    "prefix-block-partition": case_prefix_block_partition,
    "prefix-published-computed": case_prefix_published_computed,
    "released-holds-no-reference": case_released_holds_no_reference,
}


def case_prefix_hit_computed():
    before, plan, after = after_hit()
    # the engine forgot the hit: b computed 2 tokens, not 8 + 2
    bad_after = attrs.evolve(after, requests={"b": attrs.evolve(after.requests["b"], num_computed_tokens=2)})
    return (before, plan, bad_after, CONFIG), (before, plan, after, CONFIG)


PREFIX_STEP_CASES = {"prefix-hit-computed": case_prefix_hit_computed}


@pytest.mark.parametrize("name", sorted(PREFIX_STATE_CASES))
def test_prefix_state_invariant_cases_hold_for_the_good_twin(name: str) -> None:
    bad, good, config, _ = PREFIX_STATE_CASES[name]()
    assert name in {v.name for v in check_state(bad, config)}
    assert check_state(good, config) == []


# ---- the reference schedulers with prefix caching


PREFIX_SCENARIOS = ("abort-during-chunked-prefill", "preempt-then-prefix-hit")


@pytest.mark.parametrize("scheduler", ["fcfs", "static", "shortest-prompt-first", "priority", "vllm-v1",
                                       "vllm-v1-priority"])
@pytest.mark.parametrize("name", PREFIX_SCENARIOS)
def test_prefix_scenarios_pass_on_every_reference_scheduler(name: str, scheduler: str) -> None:
    from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay

    (path,) = [p for p in bundled_scenarios() if p.stem == name]
    result = replay(load_scenario(path), scheduler)
    failed = [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]
    assert not failed, failed
    hits = [r.prefix_hit_tokens for r in result.run.records if r.prefix_hit_tokens]
    assert hits, "the scenario is about prefix hits: at least one must happen"


# ---- the stateful suite with prefix caching


@pytest.mark.parametrize("scheduler_name", sorted(set(SCHEDULERS) - set(TWINS.values())))
def test_policy_refines_spec_with_prefix_caching(scheduler_name: str) -> None:
    """The stateful machine (:mod:`schedspec.testing`) with prefix caching on and shared-prefix requests.
    Examples: the active profile's, at most 40 of at most 30 rules (ci: 40 derandomized examples per policy,
    about 2 minutes for the six on this machine; 100 examples of 50 rules took 9 minutes). Longer runs:
    ``HYPOTHESIS_PROFILE=nightly`` is capped too; run the machine directly for more. The twins of
    ``tests/test_stateful.py`` (``TWINS``: ``fcfs-fast``, which with prefix caching on is the plain fcfs
    scheduler, and ``vllm-v1@0.33``) run in lockstep inside fcfs's and vllm-v1's machines."""
    machine = with_twin(machine_for(scheduler_name, prefix_caching=True), scheduler_name)
    active = settings()
    run_state_machine_as_test(machine, settings=settings(active, max_examples=min(active.max_examples, 40),
                                                         stateful_step_count=min(active.stateful_step_count, 30)))


def test_stateful_machine_reaches_hits_after_preemption() -> None:
    """The machine's workloads reach what prefix caching is about: hits, and re-admission after a
    preemption with a hit (the shared case preempt-then-prefix-hit)."""
    seen: set[str] = set()

    class Watched(machine_for("fcfs", prefix_caching=True)):
        def teardown(self) -> None:
            super().teardown()
            seen.update(self.seen)

    run_state_machine_as_test(Watched, settings=settings(max_examples=60, stateful_step_count=30, deadline=None,
                                                          derandomize=True, database=None,
                                                          suppress_health_check=list(HealthCheck)))
    assert {"prefix-cache hit", "prefix-cache hit after preemption", "preemption"} <= seen, seen


def test_hit_counts_against_pending_tokens() -> None:
    # b has 10 tokens, 8 hit: 2 are left; computing 10 after the hit overcomputes
    bad = StepPlan(scheduled=(ScheduledRequest("b", 8, 10, (2, 3, 4), cached_block_ids=(0, 1)),))
    assert "no-overcompute" in {v.name for v in violated_rules(warm_state(), bad, CONFIG)}
    no_chunking = CONFIG.with_changes(enable_chunked_prefill=False, max_num_batched_tokens=32)
    assert violated_rules(warm_state(), StepPlan(scheduled=(HIT_B,)), no_chunking) == []


# ---- the trace checker on caching traces


def test_caching_trace_round_trips_through_schedspec_check(tmp_path) -> None:
    import json
    import subprocess
    import sys

    from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
    from schedspec.spec.trace import write_trace

    (path,) = [p for p in bundled_scenarios() if p.stem == "preempt-then-prefix-hit"]
    scenario = load_scenario(path)
    result = replay(scenario, "vllm-v1")
    config = SchedulerConfig.from_dict({k: v for k, v in scenario.config.items() if k != "policy"})
    trace = tmp_path / "cached.jsonl"
    with trace.open("w") as out:
        write_trace(out, config, result.run.records, "vllm-v1")
    lines = trace.read_text().splitlines()
    assert any("prefix_hit_blocks" in line for line in lines)

    def check(path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "schedspec", "check", str(path)], capture_output=True, text=True,
                              timeout=120)

    assert check(trace).returncode == 0
    # the first hit claims one block more than the cache holds for it
    records = [json.loads(line) for line in lines]
    index = next(i for i, r in enumerate(records) if r.get("prefix_hit_blocks"))
    record = records[index]
    request_id, blocks = next(iter(record["prefix_hit_blocks"].items()))
    record["prefix_hit_blocks"][request_id] = blocks[:-1] + [blocks[0]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    result = check(bad)
    assert result.returncode == 1 and "prefix-hit" in result.stdout, result.stdout


def test_no_prefix_is_shared_across_lora_adapters() -> None:
    """vLLM keys every block by its LoRA adapter (kv_cache_utils.py generate_block_hash_extra_keys): the same
    prompt under two adapters shares no block hash, under one adapter (or none) every block."""
    from schedspec.spec.prefix_cache import ROOT_HASH, request_block_hash
    from schedspec.spec.request import Request

    prompt = tuple(range(100, 112))

    def chain(request: Request) -> list[str]:
        parent, out = ROOT_HASH, []
        for index in range(3):
            parent = request_block_hash(request, index, parent, 4)
            out.append(parent)
        return out

    plain, plain_again = chain(Request("p", 0, prompt, max_tokens=2)), chain(Request("q", 0, prompt, max_tokens=2))
    one, one_again = (chain(Request(r, 0, prompt, max_tokens=2, lora_int_id=1)) for r in ("l", "m"))
    two = chain(Request("n", 0, prompt, max_tokens=2, lora_int_id=2))
    assert plain == plain_again and one == one_again
    assert not set(plain) & set(one) and not set(one) & set(two) and not set(plain) & set(two)
