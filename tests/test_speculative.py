"""Speculative decoding in the spec (issue 23): the config fields, the drafts a state keeps, what a step
does with the drafts it verifies (accepted prefix, rejected drafts taken back, a stop inside the accepted
tokens), and the bounds on the inputs (``SpeculativeOutput``)."""

from __future__ import annotations

import attrs
import pytest

from schedspec.spec import (
    ConfigError,
    PlanError,
    Request,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
    add_request,
    apply_plan,
    check_state,
    check_step,
    violated_rules,
)
from schedspec.spec.transitions import abort_request

EOS = 2


def config(**changes) -> SchedulerConfig:
    base = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=40,
                num_speculative_tokens=3)
    base.update(changes)
    return SchedulerConfig(**base)


def decoding(cfg: SchedulerConfig, drafts=(12, 13, 14), max_tokens=10) -> SchedulerState:
    """Request ``a`` (5 prompt tokens) after its prefill step: one output (11), 5 computed, blocks 0 and 1,
    holding ``drafts``."""
    state = add_request(SchedulerState.initial(cfg), Request("a", 0, [5, 6, 7, 8, 9], max_tokens=max_tokens,
                                                             eos_token_id=EOS))
    plan = StepPlan(scheduled=(ScheduledRequest("a", 0, 5, new_block_ids=(0, 1)),))
    return apply_plan(state, plan, {"a": 11}, cfg, SpeculativeOutput(draft_token_ids={"a": drafts})).state


def verify(d: int, new_blocks=(2,)) -> StepPlan:
    return StepPlan(scheduled=(ScheduledRequest("a", 5, 1 + d, new_block_ids=new_blocks,
                                                spec_token_ids=(12, 13, 14)[:d]),))


@pytest.mark.parametrize("field", ["num_speculative_tokens", "num_lookahead_tokens"])
@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_the_speculative_fields_must_be_integers_at_least_zero(field, value):
    with pytest.raises(ConfigError, match=field):
        config(**{field: value})


def test_a_lookahead_needs_speculative_decoding():
    with pytest.raises(ConfigError, match="num_lookahead_tokens"):
        config(num_speculative_tokens=0, num_lookahead_tokens=2)


def test_the_speculative_fields_are_written_only_when_on():
    off = config(num_speculative_tokens=0)
    assert "num_speculative_tokens" not in off.to_dict() and "num_lookahead_tokens" not in off.to_dict()
    on = config(num_lookahead_tokens=3)
    assert on.to_dict()["num_speculative_tokens"] == 3 and on.to_dict()["num_lookahead_tokens"] == 3
    assert SchedulerConfig.from_dict(on.to_dict()) == on and SchedulerConfig.from_dict(off.to_dict()) == off


def test_the_state_keeps_the_proposed_drafts():
    assert decoding(config()).requests["a"].spec_token_ids == (12, 13, 14)


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_the_accepted_drafts_and_the_sampled_token_are_appended_and_the_rejected_taken_back(accepted):
    cfg = config()
    state = decoding(cfg)
    plan = verify(3)
    assert violated_rules(state, plan, cfg) == []
    after = apply_plan(state, plan, {"a": 20}, cfg, SpeculativeOutput(num_accepted_tokens={"a": accepted})).state
    request = after.requests["a"]
    assert request.output_token_ids == (11, *(12, 13, 14)[:accepted], 20)
    assert request.num_computed_tokens == 5 + 1 + accepted  # the pending token, then the accepted drafts
    assert request.num_pending_tokens == 1 and request.is_decode
    assert request.spec_token_ids == ()  # scheduling consumed them; nothing proposed
    assert request.block_ids == (0, 1, 2)  # blocks past the computed tokens are kept, as vLLM does
    assert check_state(after, cfg) == []


def test_a_stop_inside_the_accepted_drafts_ends_the_request_there():
    cfg = config()
    state = decoding(cfg, drafts=(12, EOS, 14))
    plan = StepPlan(scheduled=(ScheduledRequest("a", 5, 4, new_block_ids=(2,), spec_token_ids=(12, EOS, 14)),))
    result = apply_plan(state, plan, {"a": 20}, cfg, SpeculativeOutput(num_accepted_tokens={"a": 3}))
    ended = result.state.finished["a"]
    assert result.finished == ("a",)
    assert ended.finish_reason == "stop" and ended.output_token_ids == (11, 12, EOS)
    assert ended.num_computed_tokens == 8  # the position after the last kept token (EOS, a computed draft)
    assert ended.block_ids == () and result.state.num_free_blocks == cfg.num_kv_blocks


def test_max_tokens_inside_the_accepted_drafts_ends_the_request_there():
    cfg = config()
    state = decoding(cfg, max_tokens=3)
    result = apply_plan(state, verify(3), {"a": 20}, cfg, SpeculativeOutput(num_accepted_tokens={"a": 3}))
    ended = result.state.finished["a"]
    assert ended.finish_reason == "length" and ended.output_token_ids == (11, 12, 13)


def test_max_model_len_inside_the_accepted_drafts_ends_the_request_there():
    cfg = config(max_model_len=8)
    state = decoding(cfg)
    plan = StepPlan(scheduled=(ScheduledRequest("a", 5, 2, spec_token_ids=(12,)),))
    result = apply_plan(state, plan, {"a": 20}, cfg, SpeculativeOutput(num_accepted_tokens={"a": 1}))
    ended = result.state.finished["a"]
    assert ended.finish_reason == "max_model_len" and ended.num_tokens == 8


def test_scheduling_consumes_every_draft_even_those_not_scheduled():
    cfg = config()
    after = apply_plan(decoding(cfg), verify(1), {"a": 20}, cfg).state
    assert after.requests["a"].spec_token_ids == () and after.requests["a"].output_token_ids == (11, 20)


def test_a_preemption_and_an_abort_drop_the_drafts():
    cfg = config()
    state = decoding(cfg)
    preempted = apply_plan(state, StepPlan(preempted=("a",)), {}, cfg).state
    assert preempted.requests["a"].spec_token_ids == ()
    assert abort_request(state, "a").finished["a"].spec_token_ids == ()


@pytest.mark.parametrize("speculative, message", [
    (SpeculativeOutput(num_accepted_tokens={"a": 4}), "4 drafts accepted"),
    (SpeculativeOutput(num_accepted_tokens={"a": -1}), "-1 drafts accepted"),
    (SpeculativeOutput(draft_token_ids={"a": (1, 2, 3, 4)}), "num_speculative_tokens=3"),
    (SpeculativeOutput(draft_token_ids={"b": (1,)}), "did not sample"),
])
def test_inputs_out_of_bounds_are_refused(speculative, message):
    cfg = config()
    with pytest.raises(PlanError, match=message):
        apply_plan(decoding(cfg), verify(3), {"a": 20}, cfg, speculative)


def test_an_acceptance_without_drafts_is_refused():
    cfg = config()
    plan = StepPlan(scheduled=(ScheduledRequest("a", 5, 1, new_block_ids=()),))
    with pytest.raises(PlanError, match="verified no drafts"):
        apply_plan(decoding(cfg), plan, {"a": 20}, cfg, SpeculativeOutput(num_accepted_tokens={"a": 1}))


def test_drafts_for_a_request_that_stopped_are_refused():
    cfg = config()
    with pytest.raises(PlanError, match="did not sample"):
        apply_plan(decoding(cfg), verify(0, ()), {"a": EOS}, cfg, SpeculativeOutput(draft_token_ids={"a": (1,)}))


# --- One failing case per speculative-decoding rule and invariant (registered into test_rules.CASES and
# test_invariants.STATE_CASES / STEP_CASES, so that every rule and invariant keeps a case) ----------------

# Request "a" of decoding(config()): 6 tokens (5 prompt, output 11), 5 computed, blocks 0 and 1 (8 slots),
# drafts 12, 13, 14; free blocks 2..15.


def case_drafts_only_in_decodes():
    # A decode carrying 2 drafts computes 1 + 2 tokens, not 2.
    cfg = config()
    state = decoding(cfg)
    bad = StepPlan(scheduled=(ScheduledRequest("a", 5, 2, (), spec_token_ids=(12, 13)),))
    good = StepPlan(scheduled=(ScheduledRequest("a", 5, 3, (), spec_token_ids=(12, 13)),))
    return state, bad, good, cfg


def case_drafts_are_proposed():
    # The drafts proposed are 12, 13, 14: an item may carry 12 (a prefix), not 13.
    cfg = config()
    state = decoding(cfg)
    bad = StepPlan(scheduled=(ScheduledRequest("a", 5, 2, (), spec_token_ids=(13,)),))
    good = StepPlan(scheduled=(ScheduledRequest("a", 5, 2, (), spec_token_ids=(12,)),))
    return state, bad, good, cfg


def case_drafts_within_max_model_len():
    # max_model_len 9: 3 drafts accepted and the token after them would make 6 + 3 + 1 = 10 tokens; 2 make 9.
    cfg = config(max_model_len=9)
    state = decoding(cfg)
    bad = StepPlan(scheduled=(ScheduledRequest("a", 5, 4, (2,), spec_token_ids=(12, 13, 14)),))
    good = StepPlan(scheduled=(ScheduledRequest("a", 5, 3, (), spec_token_ids=(12, 13)),))
    return state, bad, good, cfg


SPEC_RULE_CASES = {
    "drafts-only-in-decodes": case_drafts_only_in_decodes,
    "drafts-are-proposed": case_drafts_are_proposed,
    "drafts-within-max-model-len": case_drafts_within_max_model_len,
}


def case_drafts_on_running_decodes():
    # After a preemption that kept a's drafts, a waits holding them.
    cfg = config()
    good = apply_plan(decoding(cfg), StepPlan(preempted=("a",)), {}, cfg).state
    bad = attrs.evolve(good, requests={"a": attrs.evolve(good.requests["a"], spec_token_ids=(12, 13, 14))})
    return bad, good, cfg, cfg


def verified(accepted: int, sampled: int = 20):
    cfg = config()
    before = decoding(cfg)
    plan = verify(3)
    after = apply_plan(before, plan, {"a": sampled}, cfg, SpeculativeOutput(num_accepted_tokens={"a": accepted})).state
    return before, plan, after, cfg


def with_a(state: SchedulerState, **changes) -> SchedulerState:
    return attrs.evolve(state, requests={**state.requests, "a": attrs.evolve(state.requests["a"], **changes)})


def case_rejected_drafts_uncomputed():
    # 1 of 3 drafts accepted: 5 + 1 + 1 = 7 computed after the step, not 9 (the 2 rejected kept as computed).
    before, plan, after, cfg = verified(1)
    return (before, plan, with_a(after, num_computed_tokens=9), cfg), (before, plan, after, cfg)


def case_accepted_drafts_prefix():
    # Outputs 11, then 12 (draft 1 accepted) and 20: keeping 13 instead of 12 is no prefix of the drafts.
    before, plan, after, cfg = verified(1)
    return (before, plan, with_a(after, output_token_ids=(11, 13, 20)), cfg), (before, plan, after, cfg)


SPEC_STATE_CASES = {"drafts-on-running-decodes": case_drafts_on_running_decodes}
SPEC_STEP_CASES = {
    "rejected-drafts-uncomputed": case_rejected_drafts_uncomputed,
    "accepted-drafts-prefix": case_accepted_drafts_prefix,
}


def test_drafts_count_in_the_token_budget():
    # Budget 8: a's 1 + 3 drafts and a 5-token prompt are 9 tokens; with 2 drafts, 8.
    cfg = config(max_num_batched_tokens=8)
    state = add_request(decoding(cfg), Request("b", 1, [1, 2, 3, 4, 5], max_tokens=2))
    admit = ScheduledRequest("b", 0, 5, (3, 4))
    bad = StepPlan(scheduled=(ScheduledRequest("a", 5, 4, (2,), spec_token_ids=(12, 13, 14)), admit))
    good = StepPlan(scheduled=(ScheduledRequest("a", 5, 3, (), spec_token_ids=(12, 13)), admit))
    assert {v.name for v in violated_rules(state, bad, cfg)} == {"token-budget"}
    assert violated_rules(state, good, cfg) == []


def test_the_block_table_covers_the_drafts_and_the_lookahead():
    # Lookahead 3 (EAGLE): 5 computed + 1 + 1 draft + 3 = 10 slots: 3 blocks; capped at max_model_len 8: 2.
    cfg = config(num_lookahead_tokens=3)
    state = decoding(cfg)
    short = StepPlan(scheduled=(ScheduledRequest("a", 5, 2, (), spec_token_ids=(12,)),))
    assert "block-table-covers" in {v.name for v in violated_rules(state, short, cfg)}
    assert violated_rules(state, StepPlan(scheduled=(ScheduledRequest("a", 5, 2, (2,), spec_token_ids=(12,)),)),
                          cfg) == []
    capped = config(num_lookahead_tokens=3, max_model_len=8)
    assert violated_rules(decoding(capped), short, capped) == []
    # and no more blocks than that: a fourth block is an excess
    excess = StepPlan(scheduled=(ScheduledRequest("a", 5, 2, (2, 3), spec_token_ids=(12,)),))
    assert "no-excess-blocks" in {v.name for v in violated_rules(state, excess, cfg)}


def test_blocks_kept_after_rejected_drafts_need_no_new_block():
    # All 3 drafts rejected: a holds 3 blocks for 7 tokens (2 needed); its next decode takes no block.
    before, plan, after, cfg = verified(0)
    assert after.requests["a"].block_ids == (0, 1, 2)
    assert violated_rules(after, StepPlan(scheduled=(ScheduledRequest("a", 6, 1),)), cfg) == []


def test_a_stop_kept_past_is_an_accepted_drafts_prefix_breach():
    cfg = config()
    state = decoding(cfg, drafts=(12, EOS, 14))
    plan = StepPlan(scheduled=(ScheduledRequest("a", 5, 4, (2,), spec_token_ids=(12, EOS, 14)),))
    good = apply_plan(state, plan, {"a": 20}, cfg, SpeculativeOutput(num_accepted_tokens={"a": 3})).state
    assert check_step(state, plan, good, cfg) == []
    # an engine that kept the tokens after the EOS: the request goes on with outputs 11, 12, EOS, 14, 20
    kept = attrs.evolve(good, running=("a",), finished={},
                        requests={"a": attrs.evolve(state.requests["a"], output_token_ids=(11, 12, EOS, 14, 20),
                                                    num_computed_tokens=9, block_ids=(0, 1, 2), spec_token_ids=())},
                        free_block_ids=good.free_block_ids[3:])
    found = {v.name for v in check_step(state, plan, kept, cfg)}
    assert "accepted-drafts-prefix" in found


def test_published_blocks_hold_no_draft_position():
    # Prefix caching: a decode at 7 computed tokens of 8 with 3 drafts computes positions 7..10; block 1
    # (positions 4..7) is full of sequence tokens and published, block 2 (8..11) holds only drafts: not.
    cfg = config(enable_prefix_caching=True)
    state = add_request(SchedulerState.initial(cfg), Request("a", 0, [5, 6, 7, 8, 9, 10, 11], max_tokens=10))
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("a", 0, 7, (0, 1)),)), {"a": 12}, cfg,
                       SpeculativeOutput(draft_token_ids={"a": (13, 14, 15)})).state
    plan = StepPlan(scheduled=(ScheduledRequest("a", 7, 4, (2,), spec_token_ids=(13, 14, 15)),))
    assert violated_rules(state, plan, cfg) == []
    after = apply_plan(state, plan, {"a": 30}, cfg, SpeculativeOutput(num_accepted_tokens={"a": 0})).state
    assert set(after.prefix_cache.block_hashes) == {0, 1}
    assert check_state(after, cfg) == []
    # publishing the block of draft positions 8..11 breaks prefix-published-computed: 8 tokens computed
    cache = after.prefix_cache
    leaked = attrs.evolve(cache, block_hashes={**cache.block_hashes, 2: "leaked"},
                          hash_to_blocks={**cache.hash_to_blocks, "leaked": (2,)})
    assert "prefix-published-computed" in {v.name for v in check_state(attrs.evolve(after, prefix_cache=leaked), cfg)}
