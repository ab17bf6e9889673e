"""Speculative decoding in the spec (issue 23): the config fields, the drafts a state keeps, what a step
does with the drafts it verifies (accepted prefix, rejected drafts taken back, a stop inside the accepted
tokens), and the bounds on the inputs (``SpeculativeOutput``)."""

from __future__ import annotations

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
