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


def test_drafts_for_a_request_that_stopped_or_did_not_sample_are_ignored():
    # as vLLM's update_draft_token_ids skips finished requests and prefill chunks
    cfg = config()
    after = apply_plan(decoding(cfg), verify(0, ()), {"a": EOS}, cfg,
                       SpeculativeOutput(draft_token_ids={"a": (1,), "nobody": (2,)})).state
    assert after.finished["a"].spec_token_ids == () and "nobody" not in after.requests
    state = add_request(SchedulerState.initial(cfg), Request("b", 0, [5, 6, 7, 8, 9], max_tokens=3))
    middle = StepPlan(scheduled=(ScheduledRequest("b", 0, 3, (0,)),))
    after = apply_plan(state, middle, {}, cfg, SpeculativeOutput(draft_token_ids={"b": (1,)})).state
    assert after.requests["b"].spec_token_ids == ()


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


# --- The reference engine loop with speculative decoding, and trace version 3 --------------------------

def _workload(seed: int, n: int = 10, priorities: bool = False):
    import random

    from schedspec.spec.workload import RequestSpec

    rng = random.Random(seed)
    return [RequestSpec(request_id=f"r{i}", arrival_step=rng.randrange(0, 8), prompt_len=rng.randrange(1, 40),
                        max_tokens=rng.randrange(1, 30), eos_at_output=rng.choice([None, None, rng.randrange(1, 20)]),
                        priority=rng.randrange(0, 3) if priorities else 0)
            for i in range(n)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(8))
def test_a_policy_with_drafts_passes_every_check_and_samples_what_it_samples_without(policy, seed, tmp_path):
    """The engine loop checks every step of fcfs and priority with drafts and (for half the seeds) a
    lookahead (rules, invariants, the policy's properties); the policy verifies drafts; its trace is version
    3 and passes both checkers; and, the fake model verifying greedily over its KV cache, every request that
    finishes in both runs has the same outputs with speculative decoding as without."""
    import random

    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS
    from schedspec.spec.checker import check_trace
    from schedspec.spec.trace import open_trace, write_trace

    rng = random.Random(seed)
    base = SchedulerConfig(block_size=4, num_kv_blocks=rng.choice([12, 30, 60]), max_num_seqs=4, max_model_len=64,
                           max_num_batched_tokens=rng.choice([8, 16, 64]), enable_prefix_caching=seed % 3 == 0)
    k = rng.choice([1, 2, 3, 5])
    spec = base.with_changes(num_speculative_tokens=k, num_lookahead_tokens=rng.choice([0, k]))
    outputs = {}
    verified = 0
    for cfg in (base, spec):
        result = Engine(SCHEDULERS[policy](cfg), cfg, incremental=seed % 2 == 0).run(
            _workload(seed, priorities=policy == "priority"))
        assert result.ok, result.violations[:3]
        outputs[cfg.speculative] = {r.request_id: r.output_token_ids for r in result.state.finished.values()
                                    if r.status.outcome == "finished"}
        if cfg.speculative:
            verified = sum(len(record.num_accepted_tokens) for record in result.records)
            path = tmp_path / "trace.jsonl"
            with path.open("w") as out:
                write_trace(out, cfg, result.records, policy)
            trace = open_trace(path)
            assert trace.schema_version == 3 and trace.config == cfg
            for incremental in (False, True):
                report = check_trace(trace.config, trace.records(), incremental=incremental)
                assert report.ok, report.violations[:3]
    assert verified > 0
    both = set(outputs[False]) & set(outputs[True])
    assert both and all(outputs[False][r] == outputs[True][r] for r in both)


def test_k_zero_writes_version_2_and_version_2_refuses_speculative_fields(tmp_path):
    import json

    from schedspec.spec.trace import TraceFormatError, header_line, open_trace

    assert json.loads(header_line(config(num_speculative_tokens=0)))["schema_version"] == 2
    assert json.loads(header_line(config()))["schema_version"] == 3
    header = json.loads(header_line(config()))
    header["schema_version"] = 2
    path = tmp_path / "v2.jsonl"
    path.write_text(json.dumps(header) + "\n")
    with pytest.raises(TraceFormatError, match="needs schema_version 3"):
        open_trace(path)
    plain = json.loads(header_line(config(num_speculative_tokens=0)))
    record = {"step": 0, "start_time": 0.0, "duration": 0.1, "arrivals": [], "aborts": [], "scheduled": [],
              "blocks_allocated": {}, "blocks_freed": {}, "prefix_hit_tokens": {}, "preempted": [], "finished": {},
              "aborted": [], "rejected": {}, "sampled_token_ids": {}, "num_free_blocks": 16, "num_running": 0,
              "num_waiting": 0, "draft_token_ids": {"a": [1]}}
    path.write_text(json.dumps(plain) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(TraceFormatError, match="draft_token_ids"):
        list(open_trace(path).records())
    plain["schema_version"] = 3  # version 3 reads it
    path.write_text(json.dumps(plain) + "\n" + json.dumps(record) + "\n")
    assert list(open_trace(path).records())[0].draft_token_ids == {"a": (1,)}


def test_a_scheduler_without_drafts_is_refused_with_speculative_decoding():
    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS, UnsupportedFeature

    class OldProtocol:
        name, guarantees, state = "old", frozenset(), None

        def __init__(self, cfg):
            self.inner = SCHEDULERS["fcfs"](cfg)

        def update(self, plan, sampled):
            return self.inner.update(plan, sampled)

    cfg = config()
    with pytest.raises(UnsupportedFeature, match="speculative decoding"):
        Engine(OldProtocol(cfg), cfg).run(_workload(0))


def test_a_stop_id_inside_the_accepted_drafts_ends_the_request_but_not_before_min_tokens():
    cfg = config()
    for min_tokens, kept, reason in ((0, (11, 12, 13), "stop"), (4, (11, 12, 13, 14), "stop")):
        state = add_request(SchedulerState.initial(cfg), Request("a", 0, [5, 6, 7, 8, 9], max_tokens=10,
                                                                 stop_token_ids=(13, 14), min_tokens=min_tokens))
        state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("a", 0, 5, (0, 1)),)), {"a": 11}, cfg,
                           SpeculativeOutput(draft_token_ids={"a": (12, 13, 14)})).state
        result = apply_plan(state, verify(3), {"a": 20}, cfg, SpeculativeOutput(num_accepted_tokens={"a": 3}))
        ended = result.state.finished["a"]
        assert (ended.output_token_ids, ended.finish_reason) == (kept, reason)
