"""SGLang's prefix-cache publication in the spec (``SchedulerConfig.prefix_cache_publication == "sglang-radix"``,
:mod:`schedspec.spec.prefix_cache`): prefill chunks publish at the end of their step, decoded blocks only at the
finish, a hit is a bound (``prefix-hit-longest`` does not apply), and a publication may **de-duplicate**
(``ScheduledRequest.deduplicated_block_ids``, rule ``deduplicate-at-publication``), as SGLang 0.5.23's
``RadixCache._insert_cache`` frees a request's copies of pages the tree already holds and writes the tree's pages
into the request's row. Each new rule has a failing case here, registered in ``test_rules.CASES``.

The states are the SGLang probe's (``benchmarks/sglang_radix_probe.py``) in small: block size 4, two requests
``p`` and ``q`` of one 9-token prompt prefilled together; ``q``'s two full blocks are ``p``'s twins.
"""

from __future__ import annotations

import pytest

from schedspec.spec.config import ConfigError, SchedulerConfig
from schedspec.spec.invariants import check_state, check_step
from schedspec.spec.request import Request
from schedspec.spec.rules import violated_rules
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.trace import StepRecord
from schedspec.spec.transitions import add_request, apply_plan

VLLM = SchedulerConfig(block_size=4, num_kv_blocks=10, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32,
                       enable_prefix_caching=True)
SGLANG = VLLM.with_changes(prefix_cache_publication="sglang-radix")
PROMPT = tuple(range(11, 20))  # 9 tokens: blocks [11..14], [15..18], [19]


def two_waiting(config: SchedulerConfig = SGLANG) -> SchedulerState:
    state = SchedulerState.initial(config)
    return add_request(add_request(state, Request("p", 0, PROMPT, max_tokens=3)), Request("q", 0, PROMPT, max_tokens=3))


P_ITEM = ScheduledRequest("p", 0, 9, (0, 1, 2))
Q_DEDUP = ScheduledRequest("q", 0, 9, (3, 4, 5), deduplicated_block_ids=((3, 0), (4, 1)))


def names(state: SchedulerState, plan: StepPlan, config: SchedulerConfig = SGLANG) -> set[str]:
    return {v.name for v in violated_rules(state, plan, config)}


def test_config_names_the_policy_and_keeps_vllm_by_default() -> None:
    assert VLLM.prefix_cache_publication == "vllm"
    assert "prefix_cache_publication" not in VLLM.to_dict()  # traces of vLLM's runs unchanged
    assert SGLANG.to_dict()["prefix_cache_publication"] == "sglang-radix"
    with pytest.raises(ConfigError, match="prefix_cache_publication"):
        VLLM.with_changes(prefix_cache_publication="lru")


def test_same_step_twins_are_deduplicated_and_their_copies_freed() -> None:
    before = two_waiting()
    plan = StepPlan(scheduled=(P_ITEM, Q_DEDUP))
    assert names(before, plan) == set()
    after = apply_plan(before, plan, {"p": 1, "q": 1}, SGLANG).state
    assert after.requests["q"].block_ids == (0, 1, 5)
    assert after.prefix_cache.ref_counts[0] == after.prefix_cache.ref_counts[1] == 2
    assert after.free_block_ids[:2] == (4, 3)  # q's copies, never published, at the front (last released first)
    assert len(after.free_block_ids) == 10 - 4  # p: 0, 1, 2; q: 5 (+ the shared 0, 1)
    assert after.prefix_cache.hash_to_blocks[after.prefix_cache.block_hashes[0]] == (0,)  # no duplicate
    assert check_state(after, SGLANG) == [] and check_step(before, plan, after, SGLANG) == []


def test_without_deduplication_twins_stay_duplicates() -> None:
    before = two_waiting()
    plan = StepPlan(scheduled=(P_ITEM, ScheduledRequest("q", 0, 9, (3, 4, 5))))
    after = apply_plan(before, plan, {"p": 1, "q": 1}, SGLANG).state
    assert after.prefix_cache.hash_to_blocks[after.prefix_cache.block_hashes[0]] == (0, 3)


def test_decoded_blocks_publish_only_at_the_finish() -> None:
    # p: 7-token prompt; its decodes fill block 1 at position 7: published at its finish, not before
    state = add_request(SchedulerState.initial(SGLANG), Request("p", 0, PROMPT[:7], max_tokens=3))
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("p", 0, 7, (0, 1)),)), {"p": 5}, SGLANG).state
    assert set(state.prefix_cache.block_hashes) == {0}  # the prefill chunk's full block
    decode = StepPlan(scheduled=(ScheduledRequest("p", 7, 1, ()),))
    state = apply_plan(state, decode, {"p": 6}, SGLANG).state
    assert state.requests["p"].num_computed_tokens == 8 and set(state.prefix_cache.block_hashes) == {0}
    vllm_twin = add_request(SchedulerState.initial(VLLM), Request("p", 0, PROMPT[:7], max_tokens=3))
    vllm_twin = apply_plan(vllm_twin, StepPlan(scheduled=(ScheduledRequest("p", 0, 7, (0, 1)),)), {"p": 5}, VLLM).state
    vllm_twin = apply_plan(vllm_twin, decode, {"p": 6}, VLLM).state
    assert set(vllm_twin.prefix_cache.block_hashes) == {0, 1}  # vLLM publishes it at the end of its step
    final = StepPlan(scheduled=(ScheduledRequest("p", 8, 1, (2,)),))
    after = apply_plan(state, final, {"p": 7}, SGLANG)
    assert after.finished == ("p",)
    assert set(after.state.prefix_cache.block_hashes) == {0, 1}  # published at the finish, then evictable
    assert check_state(after.state, SGLANG) == []


def test_a_finish_keeps_its_copies_cached_and_a_decode_names_no_deduplication() -> None:
    # r computed block 1 while decoding; s (same sequence) finished before and published it as block 5
    tokens = PROMPT[:7]
    state = SchedulerState.initial(SGLANG)
    state = add_request(add_request(state, Request("s", 0, tokens, max_tokens=2)), Request("r", 0, tokens, max_tokens=3))
    first = StepPlan(scheduled=(ScheduledRequest("s", 0, 7, (4, 5)), ScheduledRequest("r", 0, 7, (0, 1),
                                                                                        deduplicated_block_ids=((0, 4),))))
    state = apply_plan(state, first, {"s": 5, "r": 5}, SGLANG).state
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("s", 7, 1, ()), ScheduledRequest("r", 7, 1, ()))),
                       {"s": 6, "r": 6}, SGLANG).state
    assert "s" in state.finished and 5 in state.prefix_cache.block_hashes and 1 not in state.prefix_cache.block_hashes
    last = StepPlan(scheduled=(ScheduledRequest("r", 8, 1, (2,)),))
    named = StepPlan(scheduled=(ScheduledRequest("r", 8, 1, (2,), deduplicated_block_ids=((1, 5),)),))
    found = [v.detail for v in violated_rules(state, named, SGLANG) if v.name == "deduplicate-at-publication"]
    assert found and "publishes only at its finish" in found[0]
    result = apply_plan(state, last, {"r": 7}, SGLANG)
    assert result.finished == ("r",)
    cache = result.state.prefix_cache
    # SGLang frees r's copy of block 1's tokens; the spec keeps it cached, evictable: a superset of SGLang's tree,
    # counted free all the same
    assert cache.hash_to_blocks[cache.block_hashes[5]] == (5, 1)
    assert len(result.state.free_block_ids) == 10  # nothing held: every block free or evictable
    assert check_state(result.state, SGLANG) == []


def test_hit_is_a_bound_for_sglang_only() -> None:
    before = two_waiting()
    state = apply_plan(before, StepPlan(scheduled=(P_ITEM,)), {"p": 1}, SGLANG).state
    no_hit = StepPlan(scheduled=(ScheduledRequest("q", 0, 9, (3, 4, 5)),))
    assert names(state, no_hit) == set()
    vllm_state = apply_plan(two_waiting(VLLM), StepPlan(scheduled=(P_ITEM,)), {"p": 1}, VLLM).state
    assert "prefix-hit-longest" in names(vllm_state, no_hit, VLLM)


@pytest.mark.parametrize(("pairs", "detail"), [
    (((3, 1),), "does not cache its tokens"),  # block 1 holds p's block 1, q's block 0 is another position
    (((5, 2),), "not full and computed"),  # block 2 of the table (token 19) is not full
    (((3, 0), (3, 0)), "twice"),
    (((6, 0),), "not in its table"),
])
def test_deduplication_rule_refuses(pairs, detail) -> None:
    plan = StepPlan(scheduled=(P_ITEM, ScheduledRequest("q", 0, 9, (3, 4, 5), deduplicated_block_ids=pairs)))
    found = [v for v in violated_rules(two_waiting(), plan, SGLANG) if v.name == "deduplicate-at-publication"]
    assert found and detail in found[0].detail


def test_deduplication_onto_a_block_published_later_in_the_batch_is_refused() -> None:
    plan = StepPlan(scheduled=(ScheduledRequest("q", 0, 9, (3, 4, 5), deduplicated_block_ids=((3, 0),)), P_ITEM))
    assert "deduplicate-at-publication" in names(two_waiting(), plan)


def test_record_round_trips_and_frees_the_copies() -> None:
    from schedspec.spec.stepper import Stepper, step_checker

    stepper = Stepper(SGLANG, step_checker(SGLANG, incremental=True))
    for request in (Request("p", 0, PROMPT, max_tokens=3), Request("q", 0, PROMPT, max_tokens=3)):
        stepper.arrive(request)
    outcome = stepper.step(StepPlan(scheduled=(P_ITEM, Q_DEDUP)), {"p": 1, "q": 1})
    assert outcome.error is None and outcome.rule_violations == outcome.invariant_violations == []
    record = stepper.record(outcome, 0.0, 1.0)
    assert record.blocks_deduplicated == {"q": ((3, 0), (4, 1))}
    assert sorted(record.blocks_freed["q"]) == [3, 4]
    assert StepRecord.from_json(record.to_json()) == record


def case_deduplicate_at_publication():
    """q's copies replaced by p's blocks: allowed with SGLang's publication, refused with vLLM's."""
    bad = StepPlan(scheduled=(P_ITEM, Q_DEDUP))
    good = StepPlan(scheduled=(P_ITEM, ScheduledRequest("q", 0, 9, (3, 4, 5))))
    return two_waiting(VLLM), bad, good, VLLM


DEDUP_RULE_CASES = {"deduplicate-at-publication": case_deduplicate_at_publication}
