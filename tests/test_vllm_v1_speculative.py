"""The ``vllm-v1`` profile with speculative decoding (``reference/vllm_v1.py`` rule 7): drafts scheduled as
vLLM 0.32's ``Scheduler.schedule`` schedules them, trimmed by the budget, ``max_model_len`` and (only with
more than one live request) ``long_prefill_token_threshold``; admission stopped where vLLM would pad a
one-token request past the budget. The expected plans are worked out by hand from vLLM's source
(docs/engines.md, *Speculative decoding in vLLM 0.32 and 0.33*); every plan must also be allowed by the
spec. The same decisions are compared with vLLM itself by ``tests/test_engine_vllm_speculative.py``."""

from __future__ import annotations

import pytest

from schedspec.reference.scheduler import make_scheduler
from schedspec.reference.vllm_v1 import vllm_v1, vllm_v1_033, vllm_v1_priority
from schedspec.spec import (
    Request,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
    add_request,
    apply_plan,
    violated_rules,
)

PROFILES = [vllm_v1, vllm_v1_priority, vllm_v1_033]


def config(**changes) -> SchedulerConfig:
    base = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=40,
                num_speculative_tokens=3)
    base.update(changes)
    return SchedulerConfig(**base)


def decoding(cfg: SchedulerConfig, ids=("a",), drafts=(12, 13, 14), prompt_len=5, max_tokens=20) -> SchedulerState:
    """``ids`` prefilled in one step (``prompt_len`` tokens each), each holding ``drafts``."""
    state = SchedulerState.initial(cfg)
    for request_id in ids:
        state = add_request(state, Request(request_id, 0, list(range(5, 5 + prompt_len)), max_tokens=max_tokens,
                                           eos_token_id=2))
    plan = vllm_v1(state, cfg)
    assert [item.num_tokens for item in plan.scheduled] == [prompt_len] * len(ids)
    sampled = {request_id: 11 for request_id in ids}
    proposed = dict.fromkeys(ids, drafts) if drafts else {}
    return apply_plan(state, plan, sampled, cfg, SpeculativeOutput(draft_token_ids=proposed)).state


def item(plan: StepPlan, request_id: str) -> ScheduledRequest:
    return next(i for i in plan.scheduled if i.request_id == request_id)


@pytest.mark.parametrize("profile", PROFILES)
def test_a_decode_carries_its_drafts(profile):
    cfg = config()
    state = decoding(cfg)
    plan = profile(state, cfg)
    assert violated_rules(state, plan, cfg) == []
    assert item(plan, "a") == ScheduledRequest("a", 5, 4, new_block_ids=(2,), spec_token_ids=(12, 13, 14))


@pytest.mark.parametrize("budget, drafts", [(8, 3), (7, 2), (6, 1), (5, 0)])
def test_the_budget_trims_the_drafts_of_the_decode_it_reaches_last(budget, drafts):
    cfg = config(max_num_batched_tokens=budget, max_num_seqs=2)
    state = decoding(cfg, ids=("a", "b"), prompt_len=2)
    plan = vllm_v1(state, cfg)
    assert violated_rules(state, plan, cfg) == []
    assert item(plan, "a").spec_token_ids == (12, 13, 14)  # running order: a first, all its drafts
    if budget - 4 >= 1:
        assert item(plan, "b").spec_token_ids == (12, 13, 14)[:drafts] and item(plan, "b").num_tokens == 1 + drafts
    else:
        assert [i.request_id for i in plan.scheduled] == ["a"]


def test_max_model_len_trims_the_drafts_to_what_it_can_still_accept():
    cfg = config(max_model_len=9)
    state = decoding(cfg)  # 6 tokens, 5 computed: at most 9 - 5 - 1 = 3 tokens, 1 pending + 2 drafts
    plan = vllm_v1(state, cfg)
    assert violated_rules(state, plan, cfg) == []
    assert item(plan, "a").num_tokens == 3 and item(plan, "a").spec_token_ids == (12, 13)


def test_the_threshold_caps_a_decode_only_while_another_request_is_live():
    cfg = config(long_prefill_token_threshold=2)
    alone = decoding(config())  # prefilled without the threshold; the state does not hold it
    assert item(vllm_v1(alone, cfg), "a").num_tokens == 4  # vLLM: nobody to starve, the threshold is off
    crowded = add_request(alone, Request("b", 1, [5, 6, 7], max_tokens=5, eos_token_id=2))
    plan = vllm_v1(crowded, cfg)
    assert violated_rules(crowded, plan, cfg) == []
    assert item(plan, "a").num_tokens == 2 and item(plan, "a").spec_token_ids == (12,)


def test_drafts_past_max_tokens_are_scheduled():
    cfg = config()
    state = decoding(cfg)
    a = state.requests["a"]
    state = add_request(SchedulerState.initial(cfg), Request("a", 0, list(a.prompt_token_ids), max_tokens=2,
                                                             eos_token_id=2))
    state = apply_plan(state, vllm_v1(state, cfg), {"a": 11}, cfg,
                       SpeculativeOutput(draft_token_ids={"a": (12, 13, 14)})).state
    plan = vllm_v1(state, cfg)  # one output token left: vLLM 0.32 still verifies all three drafts
    assert violated_rules(state, plan, cfg) == []
    assert item(plan, "a").spec_token_ids == (12, 13, 14)


def test_blocks_kept_after_rejected_drafts_are_not_allocated_again():
    cfg = config()
    state = decoding(cfg)
    plan = vllm_v1(state, cfg)
    state = apply_plan(state, plan, {"a": 20}, cfg, SpeculativeOutput(num_accepted_tokens={"a": 0},
                                                                        draft_token_ids={"a": (21, 22, 23)})).state
    assert state.requests["a"].block_ids == (0, 1, 2) and state.requests["a"].num_computed_tokens == 6
    plan = vllm_v1(state, cfg)  # positions 6..9 need blocks 1 and 2, held: nothing new
    assert violated_rules(state, plan, cfg) == []
    assert item(plan, "a") == ScheduledRequest("a", 6, 4, new_block_ids=(), spec_token_ids=(21, 22, 23))


def test_admission_stops_where_vllm_would_pad_a_one_token_request_past_the_budget():
    """vLLM ``Scheduler.schedule``, waiting loop: ``if padded_num_tokens > request_token_budget: break``."""
    cfg = config(max_num_batched_tokens=6, max_num_seqs=3)
    state = decoding(cfg)  # a: 1 + 3 drafts = 4 tokens, 2 left
    state = add_request(state, Request("one", 1, [7], max_tokens=3, eos_token_id=2))
    plan = vllm_v1(state, cfg)
    assert violated_rules(state, plan, cfg) == []
    assert [i.request_id for i in plan.scheduled] == ["a"]
    # without speculative decoding (a decodes one token) the one-token prompt is admitted in the same state
    plain = config(max_num_batched_tokens=6, max_num_seqs=3, num_speculative_tokens=0)
    fresh = add_request(decoding(plain, drafts=()), Request("one", 1, [7], max_tokens=3, eos_token_id=2))
    assert [i.request_id for i in vllm_v1(fresh, plain).scheduled] == ["a", "one"]


def test_a_one_token_request_that_fits_padded_is_admitted_with_one_token_and_no_drafts():
    cfg = config(max_num_batched_tokens=12)
    state = decoding(cfg)
    state = add_request(state, Request("one", 1, [7], max_tokens=3, eos_token_id=2))
    plan = vllm_v1(state, cfg)  # vLLM pads it to 1 + 3 (placeholder drafts); the profile cannot
    assert violated_rules(state, plan, cfg) == []
    assert item(plan, "one") == ScheduledRequest("one", 0, 1, new_block_ids=(3,))


def test_with_speculative_decoding_the_profile_promises_neither_work_conserving_nor_bounded_preemptions():
    assert "work-conserving" in make_scheduler("vllm-v1", config(num_speculative_tokens=0)).guarantees
    assert not {"work-conserving", "bounded-preemptions", "stall-free-decode", "bounded-wait"} & make_scheduler("vllm-v1", config()).guarantees


def test_admission_stops_where_the_padded_tokens_would_not_fit_the_free_blocks():
    """vLLM allocates slots for the 1 + k padded tokens (``allocate_slots`` returns ``None``: ``break``),
    although the request's one token would fit: ``schedspec diff`` seed 1 example 245, shrunk."""
    cfg = config(block_size=1, num_kv_blocks=8)
    state = decoding(cfg, prompt_len=3, max_tokens=4)  # a: 3 blocks held, 1 + 3 drafts needs blocks for positions 3..6
    state = add_request(state, Request("one", 1, [7], max_tokens=1, eos_token_id=2))
    plan = vllm_v1(state, cfg)  # 4 new blocks for a, 1 left: "one" fits unpadded (1), not padded (4)
    assert violated_rules(state, plan, cfg) == []
    assert [i.request_id for i in plan.scheduled] == ["a"]
