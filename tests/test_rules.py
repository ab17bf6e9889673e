"""Every local rule of :mod:`schedspec.spec.rules` can fail: a hand-made bad plan is reported under the
rule's registered name, and its good twin (the same state, a plan that differs only in the broken
part) is allowed. Every registered rule must have a case here (``test_every_rule_has_a_case``).

The states are written out by hand; the numbers in the comments are the arithmetic the rule does.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_in_flight import IN_FLIGHT_RULE_CASES
from test_kv_cache_groups import GROUP_RULE_CASES
from test_limits import LIMIT_RULE_CASES
from test_prefix_cache import PREFIX_RULE_CASES
from test_prefix_dedup import DEDUP_RULE_CASES
from test_remote_kv import REMOTE_KV_RULE_CASES
from test_speculative import SPEC_RULE_CASES

from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import RULE_NAMES, RULES, is_allowed, violated_rules
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan

# block_size 4, 8 blocks, budget 16 tokens, 2 sequences, max_model_len 32.
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32)


def running_a() -> Request:
    """Prompt of 6 tokens, computed, one output sampled: 7 tokens, 1 pending (a decode); blocks 0 and 1
    hold 8 slots."""
    return Request(
        "a", 0, (11, 12, 13, 14, 15, 16), max_tokens=4, status=RequestStatus.RUNNING,
        num_computed_tokens=6, output_token_ids=(21,), block_ids=(0, 1), admitted_step=0, first_token_step=0,
    )


def waiting_b() -> Request:
    """A fresh prompt of 5 tokens: it needs ceil(5 / 4) = 2 blocks."""
    return Request("b", 1, (31, 32, 33, 34, 35), max_tokens=3)


def base_state(*extra: Request) -> SchedulerState:
    requests = {"a": running_a(), "b": waiting_b()}
    for request in extra:
        requests[request.request_id] = request
    waiting = ("b",) + tuple(r.request_id for r in extra)
    return SchedulerState(
        step=1, waiting=waiting, running=("a",), requests=requests,
        free_block_ids=(2, 3, 4, 5, 6, 7), num_requests_added=len(requests),
    )


DECODE_A = ScheduledRequest("a", 6, 1)
ADMIT_B = ScheduledRequest("b", 0, 5, (2, 3))

Case = Callable[[], tuple[SchedulerState, StepPlan, StepPlan, SchedulerConfig]]
"""Returns (state, bad plan, good twin, config)."""


def case_known_requests():
    state = base_state()
    bad = StepPlan(scheduled=(DECODE_A, ScheduledRequest("ghost", 0, 1)))
    return state, bad, StepPlan(scheduled=(DECODE_A,)), CONFIG


def case_token_budget():
    # Budget 4: the decode (1) plus the whole prompt of b (5) is 6 > 4; a chunk of 3 makes 4.
    config = CONFIG.with_changes(max_num_batched_tokens=4)
    state = base_state()
    bad = StepPlan(scheduled=(DECODE_A, ADMIT_B))
    good = StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 3, (2,))))
    return state, bad, good, config


def case_positive_tokens():
    state = base_state()
    return state, StepPlan(scheduled=(ScheduledRequest("a", 6, 0),)), StepPlan(scheduled=(DECODE_A,)), CONFIG


def case_chunk_continues():
    state = base_state()
    return state, StepPlan(scheduled=(ScheduledRequest("a", 5, 1),)), StepPlan(scheduled=(DECODE_A,)), CONFIG


def case_no_overcompute():
    # A decode has exactly one pending token; 2 is one too many (it still fits the 8 slots it holds).
    state = base_state()
    return state, StepPlan(scheduled=(ScheduledRequest("a", 6, 2),)), StepPlan(scheduled=(DECODE_A,)), CONFIG


def case_whole_prefill_without_chunking():
    config = CONFIG.with_changes(enable_chunked_prefill=False, max_num_batched_tokens=32)
    state = base_state()
    bad = StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 3, (2,))))
    return state, bad, StepPlan(scheduled=(DECODE_A, ADMIT_B)), config


def case_long_prefill_threshold():
    config = CONFIG.with_changes(long_prefill_token_threshold=4)
    state = base_state()
    bad = StepPlan(scheduled=(DECODE_A, ADMIT_B))  # a chunk of 5 > 4
    good = StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 4, (2,))))
    return state, bad, good, config


def case_sequence_cap():
    # One sequence: admitting b next to running a makes 2 > 1.
    config = CONFIG.with_changes(max_num_seqs=1)
    state = base_state()
    return state, StepPlan(scheduled=(DECODE_A, ADMIT_B)), StepPlan(scheduled=(DECODE_A,)), config


def case_admit_fits_alone():
    # c's prompt of 33 tokens exceeds max_model_len = 32: it can never run, so admitting it is wrong.
    huge = Request("c", 1, tuple(range(1, 34)), max_tokens=1)
    state = base_state(huge)
    reason = "prompt-exceeds-max-model-len: prompt_len=33 exceeds max_model_len=32"
    bad = StepPlan(scheduled=(ScheduledRequest("c", 0, 16, (2, 3, 4, 5)),))
    return state, bad, StepPlan(rejected=(("c", reason),)), CONFIG


def case_reject_only_impossible():
    # b can complete alone (2 blocks of 8), so rejecting it is wrong.
    state = base_state()
    return state, StepPlan(rejected=(("b", "made up"),)), StepPlan(), CONFIG


def case_preempt_running_only():
    state = base_state()
    return state, StepPlan(preempted=("b",)), StepPlan(preempted=("a",)), CONFIG


def case_blocks_from_free_pool():
    # Block 0 belongs to a.
    state = base_state()
    bad = StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (0, 2))))
    return state, bad, StepPlan(scheduled=(DECODE_A, ADMIT_B)), CONFIG


def case_block_table_covers():
    # 5 tokens need ceil(5 / 4) = 2 blocks; one block holds 4.
    state = base_state()
    bad = StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (2,))))
    return state, bad, StepPlan(scheduled=(DECODE_A, ADMIT_B)), CONFIG


def case_no_excess_blocks():
    # A sequence of 5 tokens needs 2 blocks, not 3.
    state = base_state()
    bad = StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (2, 3, 4))))
    return state, bad, StepPlan(scheduled=(DECODE_A, ADMIT_B)), CONFIG


CASES: dict[str, Case] = {
    "known-requests": case_known_requests,
    "token-budget": case_token_budget,
    "positive-tokens": case_positive_tokens,
    "chunk-continues": case_chunk_continues,
    "no-overcompute": case_no_overcompute,
    "whole-prefill-without-chunking": case_whole_prefill_without_chunking,
    "long-prefill-threshold": case_long_prefill_threshold,
    "sequence-cap": case_sequence_cap,
    "admit-fits-alone": case_admit_fits_alone,
    "reject-only-impossible": case_reject_only_impossible,
    "preempt-running-only": case_preempt_running_only,
    "blocks-from-free-pool": case_blocks_from_free_pool,
    "block-table-covers": case_block_table_covers,
    "no-excess-blocks": case_no_excess_blocks,
}
CASES.update(PREFIX_RULE_CASES)  # the prefix-caching rules' cases live with the other prefix tests
CASES.update(DEDUP_RULE_CASES)  # and SGLang's de-duplication's (test_prefix_dedup.py)
CASES.update(SPEC_RULE_CASES)  # and the speculative-decoding rules' with the speculative-decoding tests
CASES.update(IN_FLIGHT_RULE_CASES)  # and the rules of a step in flight with its tests (test_in_flight.py)
CASES.update(LIMIT_RULE_CASES)  # and the per-step limits' (max_loras, ...) with their tests
CASES.update(GROUP_RULE_CASES)  # and the KV cache groups' (test_kv_cache_groups.py)
CASES.update(REMOTE_KV_RULE_CASES)  # and the remote KV loads' (test_remote_kv.py)


def test_every_rule_has_a_case() -> None:
    assert set(CASES) == set(RULE_NAMES), "add a case for every rule in spec.rules.RULES"
    assert len(RULE_NAMES) == len(set(RULE_NAMES)), "rule names must be unique"


def test_base_plan_is_allowed() -> None:
    state = base_state()
    plan = StepPlan(scheduled=(DECODE_A, ADMIT_B))
    assert violated_rules(state, plan, CONFIG) == []
    assert is_allowed(state, plan, CONFIG)
    assert violated_rules(state, StepPlan(), CONFIG) == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_reports_bad_plan_by_name(name: str) -> None:
    state, bad, good, config = CASES[name]()
    found = violated_rules(state, bad, config)
    assert name in {v.name for v in found}, found
    assert all(v.step == state.step for v in found)
    assert not is_allowed(state, bad, config)
    assert violated_rules(state, good, config) == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rule_check_alone(name: str) -> None:
    """The registered check of the rule itself (not another rule) flags the bad plan and passes the twin."""
    (registered,) = [r for r in RULES if r.name == name]
    state, bad, good, config = CASES[name]()
    assert list(registered.check(state, bad, config))
    assert not list(registered.check(state, good, config))
    assert registered.statement and registered.source


def test_violation_names_the_request() -> None:
    state, bad, _, config = case_chunk_continues()
    (found,) = [v for v in violated_rules(state, bad, config) if v.name == "chunk-continues"]
    assert found.request_id == "a"
    assert "chunk-continues" in str(found) and "step 1" in str(found)


def test_scheduling_a_request_twice_is_reported() -> None:
    state = base_state()
    found = violated_rules(state, StepPlan(scheduled=(DECODE_A, DECODE_A)), CONFIG)
    assert ("known-requests", "a") in {(v.name, v.request_id) for v in found}


def test_preempted_and_scheduled_in_one_step_is_reported() -> None:
    state = base_state()
    found = violated_rules(state, StepPlan(scheduled=(DECODE_A,), preempted=("a",)), CONFIG)
    assert "preempt-running-only" in {v.name for v in found}


def test_block_handed_out_twice_is_reported() -> None:
    state = base_state(Request("c", 1, (41, 42), max_tokens=1))
    plan = StepPlan(scheduled=(ScheduledRequest("b", 0, 5, (2, 3)), ScheduledRequest("c", 0, 2, (3,))))
    found = violated_rules(state, plan, CONFIG)
    assert any(v.name == "blocks-from-free-pool" and "twice" in v.detail for v in found), found


def test_blocks_released_by_preemption_may_be_reused_in_the_same_step() -> None:
    # Only block 2 is free; preempting a frees 0 and 1, so b may take 2 and 0.
    state = attrs.evolve(base_state(), free_block_ids=(2,))
    plan = StepPlan(scheduled=(ScheduledRequest("b", 0, 5, (2, 0)),), preempted=("a",))
    assert violated_rules(state, plan, CONFIG) == []


def test_impossible_request_left_waiting_is_reported() -> None:
    # max_tokens = 0 can never complete; a plan that ignores it breaks reject-only-impossible.
    state = base_state(Request("c", 1, (41,), max_tokens=0))
    found = violated_rules(state, StepPlan(scheduled=(DECODE_A,)), CONFIG)
    assert ("reject-only-impossible", "c") in {(v.name, v.request_id) for v in found}


def test_rejecting_a_running_request_is_reported() -> None:
    state = base_state()
    found = violated_rules(state, StepPlan(rejected=(("a", "no"),)), CONFIG)
    assert ("reject-only-impossible", "a") in {(v.name, v.request_id) for v in found}


def test_threshold_does_not_apply_without_chunked_prefill() -> None:
    # The threshold is a chunked-prefill knob; with chunking off the whole prompt is computed at once.
    config = CONFIG.with_changes(enable_chunked_prefill=False, max_num_batched_tokens=32, long_prefill_token_threshold=4)
    state = base_state()
    assert violated_rules(state, StepPlan(scheduled=(DECODE_A, ADMIT_B)), config) == []


@settings(max_examples=300)
@given(st.data())
def test_admission_agrees_with_block_arithmetic(data: st.DataObject) -> None:
    """``admit-fits-alone`` / ``reject-only-impossible`` rest on ``rejection_reason``: a request it calls
    possible must be able to run alone. Worked out independently: a request ends when it reaches
    ``max_tokens`` outputs or ``max_model_len`` tokens (a prompt of exactly ``max_model_len`` still samples
    one token), and its KV must hold the whole prompt and every output but the last (never fed back).
    Pools are drawn at that boundary (one block short, exact, one block more)."""
    block_size = data.draw(st.integers(1, 16), label="block_size")
    limit = data.draw(st.one_of(st.integers(1, 64), st.integers(0, 6).map(lambda k: k * block_size + 1)),
                      label="max_model_len")
    prompt_len = data.draw(st.one_of(st.sampled_from([limit - 1, limit, limit + 1]), st.integers(-2, 2 * limit)),
                           label="prompt_len")
    max_tokens = data.draw(st.one_of(st.sampled_from([1, limit - prompt_len, limit]), st.integers(-2, 2 * limit)),
                           label="max_tokens")
    final_tokens = min(prompt_len + max_tokens, max(limit, prompt_len + 1))
    kv_tokens = max(prompt_len, final_tokens - 1)
    need = blocks_for_tokens(kv_tokens, block_size)
    num_kv_blocks = data.draw(st.one_of(st.sampled_from([max(1, need - 1), max(1, need), need + 1]), st.integers(1, 40)),
                              label="num_kv_blocks")
    config = SchedulerConfig(block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=limit,
                             max_num_seqs=1, max_model_len=limit)
    reason = rejection_reason(prompt_len, max_tokens, config)
    if prompt_len < 1 or max_tokens < 1 or prompt_len > limit:
        assert reason
        return
    fits = need <= config.num_kv_blocks
    assert (reason is None) == fits, (reason, kv_tokens, need)


def test_rejection_reason_is_the_first_of_every_limit_broken():
    """One definition of the reasons (``rejection_reasons``); ``rejection_reason``'s fast path agrees with it
    on every small shape."""
    import itertools

    from schedspec.spec.admission import rejection_reasons

    config = SchedulerConfig(block_size=4, num_kv_blocks=3, max_num_batched_tokens=16, max_num_seqs=2,
                             max_model_len=16)
    for prompt_len, max_tokens in itertools.product(range(-1, 20), range(-1, 20)):
        reasons = rejection_reasons(prompt_len, max_tokens, config)
        assert rejection_reason(prompt_len, max_tokens, config) == (reasons[0] if reasons else None)
    # A request breaking two limits may be rejected naming either (an engine checks in its own order).
    both = rejection_reasons(20, 0, config)
    assert [r.partition(":")[0] for r in both] == ["no-output", "prompt-exceeds-max-model-len", "exceeds-kv-cache"]


# --- Cases found by mutation testing (scripts/mutmut.sh, docs/testing.md) ---------------------


def _check(name: str, state: SchedulerState, plan: StepPlan, config: SchedulerConfig = CONFIG) -> list:
    (registered,) = [r for r in RULES if r.name == name]
    return list(registered.check(state, plan, config))


def test_violation_text_names_step_kind_rule_request_and_detail() -> None:
    """``str(v)`` reads "step N: KIND NAME (request R): DETAIL"; the parts that are unknown are left out,
    and a mismatch is not labelled with its kind (its name, trace-mismatch, already says it)."""
    from schedspec.spec.rules import Violation

    full = Violation("token-budget", "17 > 16", 3, "r1", kind="rule")
    assert str(full) == "step 3: rule token-budget (request r1): 17 > 16"
    assert str(Violation("token-budget", "17 > 16", kind="rule")) == "rule token-budget: 17 > 16"
    assert str(Violation("trace-mismatch", "free blocks 3 != 4", 2, kind="mismatch")) == (
        "step 2: trace-mismatch: free blocks 3 != 4")
    assert str(Violation("kv-capacity", "x", 0, kind="invariant")).startswith("step 0: invariant kv-capacity")


def _two_running_state() -> SchedulerState:
    """a and c running (a holds blocks 0-1, c block 2); b and d waiting; 2 sequences allowed."""
    c = Request("c", 1, (41, 42), max_tokens=3, status=RequestStatus.RUNNING, num_computed_tokens=2,
                output_token_ids=(51,), block_ids=(2,), admitted_step=0, first_token_step=0)
    d = Request("d", 2, (61, 62), max_tokens=3)
    requests = {"a": running_a(), "b": waiting_b(), "c": c, "d": d}
    return SchedulerState(step=1, waiting=("b", "d"), running=("a", "c"), requests=requests,
                          free_block_ids=(3, 4, 5, 6, 7), num_requests_added=4)


def test_sequence_cap_counts_each_preempted_running_request_once() -> None:
    state = _two_running_state()
    # 2 running - 1 preempted + 1 admitted = 2 <= 2.
    swap = StepPlan(scheduled=(DECODE_A, ADMIT_B), preempted=("c",))
    assert _check("sequence-cap", state, swap) == []
    # 2 - 1 + 2 = 3 > 2: one preemption makes room for one admission, not two.
    two_for_one = StepPlan(scheduled=(DECODE_A, ADMIT_B, ScheduledRequest("d", 0, 2, (4,))), preempted=("c",))
    assert _check("sequence-cap", state, two_for_one)
    # Preempting a request that is not running frees no seat: 2 - 0 + 1 = 3 > 2.
    assert _check("sequence-cap", state, StepPlan(scheduled=(DECODE_A, ADMIT_B), preempted=("d",)))


def test_reject_only_impossible_judges_every_rejection() -> None:
    """A rejection of an unknown id or of a running request does not stop the check of the next one."""
    state = base_state()
    after_unknown = _check("reject-only-impossible", state, StepPlan(rejected=(("ghost", "x"), ("b", "made up"))))
    assert [request_id for request_id, _ in after_unknown] == ["b"]
    after_running = _check("reject-only-impossible", state, StepPlan(rejected=(("a", "no"), ("b", "made up"))))
    assert sorted(request_id for request_id, _ in after_running) == ["a", "b"]
    details = dict(after_running)
    assert "running" in details["a"]
    assert "can complete" in details["b"]


def test_rejection_with_the_wrong_code_is_reported_naming_the_right_one() -> None:
    # c's prompt of 33 tokens exceeds max_model_len = 32: the reason's code must be
    # prompt-exceeds-max-model-len; the detail after the colon is the engine's own wording.
    state = base_state(Request("c", 1, tuple(range(1, 34)), max_tokens=1))
    right = StepPlan(rejected=(("c", "prompt-exceeds-max-model-len: too long for this engine"),))
    assert _check("reject-only-impossible", state, right) == []
    wrong = StepPlan(rejected=(("c", "empty-prompt: the prompt is empty"),))  # it is not: a limit c does not break
    (found,) = _check("reject-only-impossible", state, wrong)
    assert found[0] == "c"
    assert "names no limit it breaks" in found[1] and "'prompt-exceeds-max-model-len:" in found[1]


def test_unknown_request_does_not_hide_the_next_scheduled_one() -> None:
    """block-table-covers and no-excess-blocks skip ids that are not live (known-requests reports them)
    and go on with the rest of the plan."""
    state = base_state()
    ghost = ScheduledRequest("ghost", 0, 1)
    too_few = StepPlan(scheduled=(ghost, ScheduledRequest("b", 0, 5, (2,))))
    assert [r for r, _ in _check("block-table-covers", state, too_few)] == ["b"]
    too_many = StepPlan(scheduled=(ghost, ScheduledRequest("b", 0, 5, (2, 3, 4))))
    assert [r for r, _ in _check("no-excess-blocks", state, too_many)] == ["b"]


def test_unknown_request_detail_says_it_is_not_live() -> None:
    state = base_state()
    found = dict(_check("known-requests", state, StepPlan(scheduled=(DECODE_A, ScheduledRequest("ghost", 0, 1)))))
    assert "not a live request" in found["ghost"]


def test_rule_decorator_registers_the_check_unchanged() -> None:
    from schedspec.spec.rules import Rule, rule

    def probe(state, plan, config):
        yield from ()

    count = len(RULES)
    try:
        assert rule("probe-rule", "A statement.", "a source", action="step")(probe) is probe
        assert RULES[count:] == [Rule("probe-rule", "A statement.", "a source", probe, "step")]
    finally:
        del RULES[count:]


def test_rules_invariants_and_properties_register_one_way_and_refuse_a_name_twice():
    """The three registries take the same form (a decorator on the check naming its source) and each
    refuses a name it holds already, leaving the registry as it was."""
    from schedspec.spec import invariants, properties
    from schedspec.spec.rules import rule

    def check(*args):
        yield from ()

    taken_rule, taken_invariant = RULES[0].name, invariants.STATE_INVARIANTS[0].name
    before = (len(RULES), len(invariants.STATE_INVARIANTS), len(invariants.STEP_INVARIANTS), dict(properties.PROPERTIES))
    with pytest.raises(ValueError, match="registered twice"):
        rule(taken_rule, "again", "a test", action=RULES[0].action)(check)
    with pytest.raises(ValueError, match="registered twice"):
        invariants.step_invariant(taken_invariant, "a test")(check)

    class Again(properties.Monitor):
        name = "progress"

    with pytest.raises(ValueError, match="registered twice"):
        properties.trace_property("a test")(Again)
    assert before == (len(RULES), len(invariants.STATE_INVARIANTS), len(invariants.STEP_INVARIANTS),
                      dict(properties.PROPERTIES))
