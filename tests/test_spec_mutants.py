"""Tests that kill the mutants mutmut found surviving in the spec (issue 28, docs/testing.md "Mutation
score"): each asserts a behaviour of the spec that a surviving mutant changed and no other test pinned.
Grouped by module; each test names the mutants it was written for (``scripts/mutmut.sh`` names of the run
it was written against: a mutant's number shifts whenever its function changes, so a name here may now be
another mutant's; the behaviour each test pins is what counts). The survivors of later runs are killed by
``tests/test_mutants_MODULE.py``, one file per module."""

from __future__ import annotations

import collections

import attrs
import pytest
from test_rules import ADMIT_B, CASES, CONFIG, DECODE_A, base_state, running_a, waiting_b

from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import RULES, coded, violated_rules
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan, landed_plan

# --- spec/rules.py ----------------------------------------------------------------------------------


def _breaches(name: str, state: SchedulerState, plan: StepPlan, config) -> set:
    return {(v.request_id, v.detail) for v in violated_rules(state, plan, config) if v.name == name}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rule_judges_every_item_after_one_it_skips(name):
    """Each rule goes on past an item it has nothing to say about (an unknown id, a live request without a
    prefix-cache hit): the breach of the case is still found with such an item first in the batch, the
    preempted and the rejected lists (``continue`` made ``break``: ``_chunk_continues#4``,
    ``_no_overcompute#4``, ``_whole_prefill#4``, ``_prefix_hit_at_admission#2``, ``_prefix_hit_chain#9,
    #16``, ``_reject_impossible``, ``blocks_not_from_free_pool#9``)."""
    state, bad, _, config = CASES[name]()
    alone = {r for r, _ in _breaches(name, state, bad, config)}
    assert alone
    named = {item.request_id for item in bad.scheduled} | set(bad.preempted) | {r for r, _ in bad.rejected}
    others = [r for r in state.requests if r not in named]
    fillers = [ScheduledRequest("ghost", 0, 1)] + [
        ScheduledRequest(r, state.requests[r].num_computed_tokens, 1) for r in others[:1]]
    for filler in fillers:
        padded = attrs.evolve(bad, scheduled=(filler, *bad.scheduled), preempted=("ghost", *bad.preempted),
                              rejected=(("ghost", "x"), *bad.rejected))
        assert alone <= {r for r, _ in _breaches(name, state, padded, config)}, (name, filler)


def test_codes_name_the_rule_and_the_case():
    """``coded`` (``#1-#3``) and the code ``violated_rules`` gives each breach (``violated_rules#16, #22,
    #25, #26, #29, #31``): the rule's name, and ``name:case`` for a named case."""
    assert coded("token-budget", None) == "token-budget"
    assert coded("blocks-from-free-pool", "reused-by-hit-in-step") == "blocks-from-free-pool:reused-by-hit-in-step"
    state = base_state()
    # block 2 is handed to b and reused by a's (made-up) hit in the same step: the named case
    plan = StepPlan(scheduled=(ScheduledRequest("a", 6, 1, (), (2,)), ScheduledRequest("b", 0, 5, (2, 3))))
    codes = {v.code for v in violated_rules(state, plan, CONFIG) if v.name == "blocks-from-free-pool"}
    assert codes == {"blocks-from-free-pool:reused-by-hit-in-step"}
    found = violated_rules(state, StepPlan(scheduled=(ScheduledRequest("ghost", 0, 1),)), CONFIG)
    assert [v.code for v in found if v.name == "known-requests"] == ["known-requests"]


def test_skipping_one_rule_checks_the_others():
    """``violated_rules(skip=...)`` leaves out only the rules named (``violated_rules#3``: ``continue`` made
    ``break`` stopped at the first skipped rule)."""
    state, bad, _, config = CASES["token-budget"]()
    first = RULES[0].name
    assert first != "token-budget"
    assert "token-budget" in {v.name for v in violated_rules(state, bad, config, skip={first})}


@pytest.mark.parametrize("name, words", [
    ("preempt-running-only", "preempted but not running"),
    ("reject-only-impossible", "rejected although it can complete alone"),
])
def test_rule_details_say_what_is_wrong(name, words):
    """The detail names the breach (``_preempt_running#5, #6``, ``_reject_impossible#19``)."""
    state, bad, _, config = CASES[name]()
    assert any(words in detail for _, detail in _breaches(name, state, bad, config))


def test_preempted_and_scheduled_and_rejected_while_running_are_named():
    """``_preempt_running#8, #9``, ``_reject_impossible#8``."""
    state = base_state()
    both = StepPlan(scheduled=(DECODE_A,), preempted=("a",))
    assert any("preempted and scheduled in the same step" in d for _, d in _breaches("preempt-running-only", state, both, CONFIG))
    running = StepPlan(rejected=(("a", "made up"),))
    assert any("rejected while running (only waiting requests can be rejected)" in d
               for _, d in _breaches("reject-only-impossible", state, running, CONFIG))


def test_a_wrong_rejection_reason_lists_the_limits_it_breaks():
    """``_reject_impossible#25``: the limits broken, separated by "; "."""
    huge = Request("c", 1, tuple(range(1, 34)), max_tokens=40)  # prompt and prompt+max_tokens past 32
    state = base_state(huge)
    found = _breaches("reject-only-impossible", state, StepPlan(rejected=(("c", "made up"),)), CONFIG)
    (detail,) = [d for r, d in found if r == "c"]
    assert "which names no limit it breaks; it breaks '" in detail
    assert "'; '" in detail or detail.count("'") == 2


def _hit_state(chunked: bool = True) -> tuple[SchedulerState, object]:
    """A waiting request of a 6-token prompt whose first block (4 tokens) is a prefix-cache hit: 2 tokens
    pending after the hit."""
    config = CONFIG.with_changes(enable_chunked_prefill=chunked, max_num_batched_tokens=32)
    request = Request("h", 1, (41, 42, 43, 44, 45, 46), max_tokens=3)
    state = SchedulerState(step=1, waiting=("h",), requests={"h": request}, free_block_ids=(2, 3, 4, 5, 6, 7),
                           num_requests_added=1)
    return state, config


def test_pending_tokens_count_the_prefix_hit_off():
    """``no-overcompute`` and ``whole-prefill-without-chunking`` count the pending tokens less the hit
    (``_no_overcompute#6, #7``, ``_whole_prefill#6, #7``: ``-`` made ``+``, ``*`` made ``/``); and
    ``no-excess-blocks`` counts the hit blocks in the table (``_no_excess_blocks#7``)."""
    state, config = _hit_state()
    over = StepPlan(scheduled=(ScheduledRequest("h", 4, 3, (2,), (0,)),))  # 3 > the 2 pending after the hit
    assert _breaches("no-overcompute", state, over, config)
    exact = StepPlan(scheduled=(ScheduledRequest("h", 4, 2, (2,), (0,)),))
    assert not _breaches("no-overcompute", state, exact, config)
    state, whole = _hit_state(chunked=False)
    assert not _breaches("whole-prefill-without-chunking", state, exact, whole)
    part = StepPlan(scheduled=(ScheduledRequest("h", 4, 1, (2,), (0,)),))
    assert _breaches("whole-prefill-without-chunking", state, part, whole)
    excess = StepPlan(scheduled=(ScheduledRequest("h", 4, 2, (2, 3), (0,)),))  # 1 hit + 2 new > 2 blocks
    assert _breaches("no-excess-blocks", state, excess, config)
    assert not _breaches("no-excess-blocks", state, exact, config)


# --- spec/transitions.py ----------------------------------------------------------------------------


def test_requests_finishing_in_the_same_step_free_every_block():
    """Two requests that end in one step both release their tables, the last one's blocks at the front
    (``_sample#28``: ``freed[:0] =`` made ``freed[:1] =`` dropped the first request's first block)."""
    from schedspec.spec.request import RequestStatus
    from schedspec.spec.transitions import apply_plan

    def running(request_id: str, blocks: tuple[int, ...]) -> Request:
        return Request(request_id, 0, (11, 12, 13, 14, 15, 16), max_tokens=2, status=RequestStatus.RUNNING,
                       num_computed_tokens=6, output_token_ids=(21,), block_ids=blocks, admitted_step=0,
                       first_token_step=0)

    state = SchedulerState(step=1, running=("a", "b"), requests={"a": running("a", (0, 1)), "b": running("b", (2, 3))},
                           free_block_ids=(4, 5, 6, 7), num_requests_added=2)
    plan = StepPlan(scheduled=(ScheduledRequest("a", 6, 1), ScheduledRequest("b", 6, 1)))
    result = apply_plan(state, plan, {"a": 30, "b": 31}, CONFIG)
    assert set(result.finished) == {"a", "b"}
    after = result.state
    assert sorted(after.free_block_ids) == list(range(8)) and len(after.free_block_ids) == 8
    assert tuple(after.free_block_ids)[:4] == (3, 2, 1, 0)  # b's table (last first), then a's, then the old queue


# --- spec/properties.py -----------------------------------------------------------------------------


def _progress_run(prune: bool) -> list:
    """A live request ``a`` that reached position 6 and is then preempted and recomputed from 0 in chunks of
    one token for ``window`` steps (never past its high-water mark: no progress), with, when ``prune``,
    100 ended requests known to the monitor and ``forget_ended`` called between steps."""
    from schedspec.spec.properties import Progress

    config = CONFIG.with_changes(max_model_len=32)
    monitor = Progress(config, window=4)
    a = Request("a", 0, (1, 2, 3, 4, 5, 6, 7, 8), max_tokens=2)
    state = SchedulerState(step=0, waiting=("a",), requests={"a": a}, free_block_ids=tuple(range(8)),
                           num_requests_added=1)
    monitor.observe(state, StepPlan(scheduled=(ScheduledRequest("a", 0, 6),)), state)
    if prune:
        for k in range(100):
            monitor.high_water[f"gone{k}"] = 3
    for step in range(1, 6):
        before = attrs.evolve(state, step=step)
        if prune:
            monitor.forget_ended(before)
        monitor.observe(before, StepPlan(scheduled=(ScheduledRequest("a", step - 1, 1),)), before)
    return monitor.violations


@pytest.mark.parametrize("prune", [False, True], ids=["kept", "pruned"])
def test_progress_counts_recomputation_as_no_progress_even_after_pruning(prune):
    """Recomputing positions already computed is not progress (``progress``), also after ``forget_ended``
    dropped the ended requests' marks: it keeps the live request's (``Progress.forget_ended``: ``in`` made
    ``not in`` dropped it, and the recomputation looked like progress)."""
    found = _progress_run(prune)
    assert [v.name for v in found] == ["progress"] and found[0].step == 4, found


def test_progress_forgets_only_ended_requests():
    from schedspec.spec.properties import Progress

    monitor = Progress(CONFIG)
    monitor.high_water = {f"r{k}": 1 for k in range(70)} | {"live": 5}
    state = SchedulerState(requests={"live": Request("live", 0, (1, 2), max_tokens=1)}, waiting=("live",))
    monitor.forget_ended(state)
    assert monitor.high_water == {"live": 5}
    few = Progress(CONFIG)
    few.high_water = {f"r{k}": 1 for k in range(10)}
    few.forget_ended(state)
    assert len(few.high_water) == 10  # pruned only when the ended outnumber the live (amortized O(1))


@pytest.mark.parametrize("change, words", [
    ({"max_tokens": -1}, "max_tokens=-1 < 0"),
    ({"arrival_step": 0}, "arrival_step=0, but it is added before step 1"),
    ({"status": "RUNNING"}, "is not a fresh request"),
    ({"num_computed_tokens": 2}, "is not a fresh request"),
    ({"output_token_ids": (9,)}, "is not a fresh request"),
    ({"block_ids": (4,)}, "is not a fresh request"),
    ({"request_id": "a"}, "request_id='a' was already added"),
], ids=["negative-max-tokens", "arrival-step", "status", "computed-only", "outputs-only", "blocks-only", "live-id"])
def test_add_request_refuses_each_unfresh_field_alone(change, words):
    """``add_request`` refuses a request whose one field says it is not fresh, each alone (the and/or of its
    check: ``add_request#11-#13``)."""
    from schedspec.spec.request import RequestStatus
    from schedspec.spec.transitions import PlanError, add_request

    if change.get("status") == "RUNNING":
        change = {"status": RequestStatus.RUNNING}
    fresh = Request("n", 1, (1, 2, 3), max_tokens=2)
    state = base_state()
    add_request(state, fresh)  # the fresh one is accepted
    with pytest.raises(PlanError, match=None) as raised:
        add_request(state, attrs.evolve(fresh, **change))
    assert words in str(raised.value), str(raised.value)


# --- spec/invariants.py -----------------------------------------------------------------------------


def _running(request_id: str, blocks: tuple[int, ...], computed: int = 6) -> Request:
    from schedspec.spec.request import RequestStatus

    return Request(request_id, 0, (11, 12, 13, 14, 15, 16), max_tokens=4, status=RequestStatus.RUNNING,
                   num_computed_tokens=computed, output_token_ids=(21,), block_ids=blocks, admitted_step=0,
                   first_token_step=0)


def _invariant(state: SchedulerState, name: str) -> list:
    from schedspec.spec.invariants import check_state

    return [(v.request_id, v.detail) for v in check_state(state, CONFIG) if v.name == name]


def test_block_conservation_names_the_request_of_each_fault():
    """A block owned twice is blamed on the second owner and names the first; an out-of-range block on its
    owner; block 0 and the blocks owned once are never reported (``block_conservation``: the owner named,
    the range check, what is reported when another fault is present)."""
    twice = SchedulerState(running=("a", "b"), requests={"a": _running("a", (0, 1)), "b": _running("b", (1, 2))},
                           free_block_ids=(3, 4, 5, 6, 7), num_requests_added=2)
    found = _invariant(twice, "block-conservation")
    assert [(r, d) for r, d in found if r is not None] == [("b", "block 1 also owned by a")], found
    assert [r for r, _ in found if r is None] == [None]  # free 5 + owned 4 != 8
    out = SchedulerState(running=("a",), requests={"a": _running("a", (0, 9))}, free_block_ids=(1, 2, 3, 4, 5, 6, 7),
                         num_requests_added=1)
    found = _invariant(out, "block-conservation")
    named = [(r, d) for r, d in found if r is not None]
    assert named == [("a", "block id 9 out of range [0, 8)")], found
    assert not any("block 0 " in d or d.endswith("block 0") for _, d in found), found
    free_out = SchedulerState(running=("a",), requests={"a": _running("a", (0, 1))},
                              free_block_ids=(2, 3, 4, 5, 6, 7, -1), num_requests_added=1)
    found = _invariant(free_out, "block-conservation")
    assert [(r, d) for r, d in found if "out of range" in d] == [(None, "block id -1 out of range [0, 8)")], found


def test_queues_disjoint_checks_each_queue_entrys_status():
    """A waiting entry whose request is running, a running entry whose request is waiting (``queues_disjoint``)."""
    waiting_running = SchedulerState(waiting=("a",), requests={"a": _running("a", (0, 1))},
                                     free_block_ids=(2, 3, 4, 5, 6, 7), num_requests_added=1)
    assert _invariant(waiting_running, "queues-disjoint") == [("a", "in waiting with status running")]
    b = Request("b", 0, (1, 2), max_tokens=1)
    running_waiting = SchedulerState(running=("b",), requests={"b": b}, free_block_ids=tuple(range(8)),
                                     num_requests_added=1)
    assert _invariant(running_waiting, "queues-disjoint") == [("b", "in running with status waiting")]


@pytest.mark.parametrize("computed, broken", [(7, False), (8, True), (-1, True), (0, False)])
def test_computed_bound_allows_exactly_the_known_tokens(computed, broken):
    """``0 <= num_computed_tokens <= num_tokens`` (7 here: a prompt of 6 and one output), both ends allowed."""
    state = SchedulerState(running=("a",), requests={"a": _running("a", (0, 1), computed)},
                           free_block_ids=(2, 3, 4, 5, 6, 7), num_requests_added=1)
    assert bool(_invariant(state, "computed-bound")) == broken


def test_a_step_invariant_reports_after_a_skipped_item_with_its_step_and_request():
    """``chunks-in-order`` goes on past an unknown id (``continue`` made ``break``) and its violation carries
    the name, detail, request, the step that caused it and its code (``check_step``)."""
    from schedspec.spec.invariants import check_step

    before = SchedulerState(step=5, running=("a",), requests={"a": _running("a", (0, 1))},
                            free_block_ids=(2, 3, 4, 5, 6, 7), num_requests_added=1)
    after = attrs.evolve(before, step=6)  # a's computed tokens did not move: the chunk is not applied
    plan = StepPlan(scheduled=(ScheduledRequest("ghost", 0, 1), ScheduledRequest("a", 6, 1)))
    found = [v for v in check_step(before, plan, after, CONFIG) if v.name == "chunks-in-order"]
    assert [(v.request_id, v.step, v.kind, v.code) for v in found] == [("a", 5, "invariant", "chunks-in-order")]
    assert "computed 6 + 1 != 6 after the step" in found[0].detail


# --- spec/incremental.py ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_screen_never_holds_for_a_plan_a_screened_rule_refuses(name):
    """``screened_rules_hold`` is False for the bad plan of every screened rule's case (a screen that holds
    there skips the rules and loses the violation: the loosened conditions of ``screened_rules_hold``), and
    True for a legal twin without a prefix hit (too strict costs only time, but the screen must pass
    correct steps, or the incremental checker is the full one: ``screened_rules_hold`` made stricter)."""
    from schedspec.spec.incremental import SCREENED, screened_rules_hold

    state, bad, good, config = CASES[name]()
    if name in SCREENED and not config.enable_prefix_caching:
        assert not screened_rules_hold(state, bad, config)
    # with speculative decoding too: the screen counts drafts and lookahead as the rules do; never for a plan
    # with wasted items (a step in flight): it names requests that are not live, so every rule runs
    wasted = landed_plan(state, good)[1]
    if not violated_rules(state, good, config) and not any(i.cached_block_ids for i in good.scheduled) \
            and not wasted:
        assert screened_rules_hold(state, good, config), name
    if wasted:
        assert not screened_rules_hold(state, good, config), name


@pytest.mark.parametrize("change, plan", [
    ({"long_prefill_token_threshold": 4}, StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 4, (2,))))),
    ({"max_num_batched_tokens": 5}, StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 4, (2,))))),
    ({}, StepPlan(scheduled=(ScheduledRequest("a", 6, 1),), preempted=())),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 32}, StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (2, 3))))),
], ids=["chunk-at-the-threshold", "budget-exactly-used", "one-token-decode", "whole-prefill"])
def test_the_screen_holds_at_every_limit_exactly_met(change, plan):
    """Each screened limit met exactly (a chunk of exactly the threshold, the budget used to the token, a
    decode of one token, a whole prompt without chunking) is legal, and the screen passes it."""
    from schedspec.spec.incremental import screened_rules_hold

    config = CONFIG.with_changes(**change)
    state = base_state()
    assert not violated_rules(state, plan, config)
    assert screened_rules_hold(state, plan, config)


def _three_running() -> SchedulerState:
    """a (blocks 0, 1), c (2, 3) and e (4, 5) running, each a decode of 1 token; b and d waiting, 5 tokens each;
    blocks 6 and 7 free."""
    c, e = (attrs.evolve(running_a(), request_id=r, arrival_step=0, block_ids=blocks)
            for r, blocks in (("c", (2, 3)), ("e", (4, 5))))
    d = attrs.evolve(waiting_b(), request_id="d", arrival_step=2)
    return attrs.evolve(base_state(c, e, d), waiting=("b", "d"), running=("a", "c", "e"), free_block_ids=(6, 7))


def _screen_cases():
    """(config, state, plan, whether the screened rules pass it): plans on which the screen's answer must be the
    screened rules' answer exactly."""
    three = _three_running()
    excess = attrs.evolve(base_state(), requests={**base_state().requests, "a": attrs.evolve(running_a(), block_ids=(0, 1, 2))},
                          free_block_ids=(3, 4, 5, 6, 7))
    spec = CONFIG.with_changes(num_speculative_tokens=2, max_num_batched_tokens=32)
    fresh = SchedulerState(step=0, waiting=("f",), requests={"f": Request("f", 0, tuple(range(8)), max_tokens=3)},
                           free_block_ids=tuple(range(8)), num_requests_added=1)
    return {
        # the budget broken only by the sum of the items (#85: total = num_tokens)
        "budget-by-the-sum": (CONFIG.with_changes(max_num_batched_tokens=5), base_state(),
                              StepPlan(scheduled=(DECODE_A, ADMIT_B)), False),
        # a request preempted and scheduled (#92), preempted twice (#97), rejected twice (#105)
        "preempted-and-scheduled": (CONFIG, base_state(), StepPlan(scheduled=(DECODE_A,), preempted=("a",)), False),
        "preempted-twice": (CONFIG, base_state(), StepPlan(preempted=("a", "a")), False),
        "rejected-twice": (CONFIG, base_state(), StepPlan(rejected=(("b", "x"), ("b", "x"))), False),
        # sequence-cap with preemptions: two preempted make room for two admitted (#98, #99, #111), one does
        # not (#100: each preemption counted twice)
        "two-out-two-in": (CONFIG.with_changes(max_num_seqs=3), three,
                           StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (2, 3)),
                                               ScheduledRequest("d", 0, 5, (4, 5))), preempted=("c", "e")), True),
        "one-out-two-in": (CONFIG.with_changes(max_num_seqs=3), three,
                           StepPlan(scheduled=(DECODE_A, ScheduledRequest("e", 6, 1), ScheduledRequest("b", 0, 5, (2, 3)),
                                               ScheduledRequest("d", 0, 5, (6, 7))), preempted=("c",)), False),
        # without chunked prefill the long-prefill threshold does not apply (#8: applied anyway)
        "whole-prefill-over-an-unused-threshold": (
            CONFIG.with_changes(enable_chunked_prefill=False, long_prefill_token_threshold=4, max_num_batched_tokens=32),
            base_state(), StepPlan(scheduled=(DECODE_A, ADMIT_B)), True),
        # a table holding more than its sequence needs, decoding without a new block: refused without speculative
        # decoding (#70, #71), allowed with it (drafts rejected leave such tables: #10, #71)
        "excess-table-without-drafts": (CONFIG, excess, StepPlan(scheduled=(DECODE_A,)), False),
        "excess-table-with-drafts": (spec, excess, StepPlan(scheduled=(DECODE_A,)), True),
        # without chunking a whole prompt with two drafts is 8 + 2 tokens, not 8 - 2 (#40)
        "whole-prefill-less-its-drafts": (spec.with_changes(enable_chunked_prefill=False), fresh,
                                          StepPlan(scheduled=(ScheduledRequest("f", 0, 6, (0, 1), spec_token_ids=(5, 5)),)),
                                          False),
    }


@pytest.mark.parametrize("case", sorted(_screen_cases()))
def test_the_screen_answers_as_the_screened_rules_on_hand_made_plans(case):
    """``screened_rules_hold`` is True exactly when no rule of ``SCREENED`` refuses the plan, on plans each aimed at
    one condition of the screen (the mutants named in ``_screen_cases``): a looser screen skips the rules and
    loses a violation; a stricter one makes every such step pay for the full rules."""
    from schedspec.spec.incremental import SCREENED, screened_rules_hold

    config, state, plan, passes = _screen_cases()[case]
    assert (not {v.name for v in violated_rules(state, plan, config)} & SCREENED) == passes
    assert screened_rules_hold(state, plan, config) == passes


def _every_field(violations) -> collections.Counter:
    """Violations as a multiset of all their fields (name, detail, step, request, kind, code)."""
    return collections.Counter((v.name, v.detail, v.step, v.request_id, v.kind, v.code) for v in violations)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_incremental_rules_are_the_rules_field_for_field(name):
    """``IncrementalChecker.rules`` returns what ``violated_rules`` returns, every field of every violation
    (its own ``blocks-from-free-pool`` violations, built from the ledger's free set, included: ``rules#36-#56``
    left out or changed the rule's name, detail, step, request, kind or code, and ``#33`` ran the plain
    free-pool rule beside the ledger's), on the bad plan and the legal twin of every rule's case."""
    from schedspec.spec.incremental import IncrementalChecker

    state, bad, good, config = CASES[name]()
    checker = IncrementalChecker(config)
    checker.sync(state)
    for plan in (bad, good):
        assert _every_field(checker.rules(state, plan)) == _every_field(violated_rules(state, plan, config)), plan


def test_the_incremental_free_pool_check_names_the_case_of_a_block_reused_by_a_hit():
    """The ledger's ``blocks-from-free-pool`` violations carry the code ``violated_rules`` gives them: the plain
    rule's name for a block that is not free, ``name:reused-by-hit-in-step`` for a block handed out and hit in
    the same step (``rules#50-#56``: the case dropped, or read from an empty case)."""
    from schedspec.spec.incremental import IncrementalChecker

    state = base_state()
    checker = IncrementalChecker(CONFIG)
    checker.sync(state)
    assert checker.sound  # the ledger followed base_state: its free set, not the plain rule, judges below
    not_free = StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (0, 2))))
    reused = StepPlan(scheduled=(ScheduledRequest("a", 6, 1, (), (2,)), ScheduledRequest("b", 0, 5, (2, 3))))
    for plan, code in ((not_free, "blocks-from-free-pool"),
                       (reused, "blocks-from-free-pool:reused-by-hit-in-step")):
        found = [v for v in checker.rules(state, plan) if v.name == "blocks-from-free-pool"]
        assert [(v.code, v.request_id, v.step, v.kind) for v in found] == [(code, "b", state.step, "rule")]
        assert _every_field(found) == _every_field(
            v for v in violated_rules(state, plan, CONFIG) if v.name == "blocks-from-free-pool")


def test_the_incremental_rules_run_in_full_once_the_ledger_is_unsound():
    """A checker whose ledger could not follow a state (here a request holds a block that is still in the free
    queue, so ``sync`` fails) judges plans with the plain rules: the same violations as ``violated_rules``,
    with the state and the plan it was given (``rules#7-#12``: the plain rules called with ``None`` or without
    an argument)."""
    from schedspec.spec.incremental import IncrementalChecker

    state = base_state()
    broken = attrs.evolve(state, free_block_ids=(0, *state.free_block_ids))  # block 0 held by a and free
    checker = IncrementalChecker(CONFIG)
    checker.sync(broken)
    assert not checker.sound
    for plan in (StepPlan(scheduled=(DECODE_A, ADMIT_B)), StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (0, 2))))):
        assert _every_field(checker.rules(broken, plan)) == _every_field(violated_rules(broken, plan, CONFIG))


def test_a_remote_kv_load_switches_the_incremental_checker_to_full_checks():
    """The first plan with a remote KV load (or a state with a delayed free) makes the checker run the rules
    and the ledger's invariants in full from then on (``remote``; ``rules#1-#3``: ``or`` made ``and``, the flag
    left False); the step after is judged by the full invariants (a fallback)."""
    from schedspec.spec.incremental import IncrementalChecker
    from schedspec.spec.state import DelayedFree, KVLoad
    from schedspec.spec.transitions import apply_plan

    state = attrs.evolve(base_state(), requests={**base_state().requests, "b": attrs.evolve(
        waiting_b(), num_external_computed_tokens=4)})
    # block 7 held by a finished request's KV send (a delayed free), so not free: handing it out is refused
    sending = attrs.evolve(state, delayed_frees={"z": DelayedFree((7,), "sending")}, free_block_ids=(2, 3, 4, 5, 6))
    for plan, before in ((StepPlan(scheduled=(DECODE_A,), loads=(KVLoad("b", 4, (2,)),)), state),
                         (StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (7, 2)))), sending)):
        checker = IncrementalChecker(CONFIG)
        checker.sync(before)
        # the plain rules' verdict (#5: the ledger's free set, which knows no delayed free, judged block 7 free)
        assert _every_field(checker.rules(before, plan)) == _every_field(violated_rules(before, plan, CONFIG))
        assert checker.remote is True, plan
    assert "blocks-from-free-pool" in {v.name for v in violated_rules(sending, plan, CONFIG)}
    checker = IncrementalChecker(CONFIG)
    checker.sync(state)
    plan = StepPlan(scheduled=(DECODE_A,), loads=(KVLoad("b", 4, (2,)),))
    assert _every_field(checker.rules(state, plan)) == _every_field(violated_rules(state, plan, CONFIG))
    after = apply_plan(state, plan, {"a": 22}, CONFIG).state
    assert checker.invariants(state, plan, after) == []
    assert checker.fallbacks == 1


# --- spec/properties.py, second round (issue 28: every monitor's survivors, scripts/mutmut.sh properties) ------


def _seen(monitor) -> list[tuple[str, int, str | None, str, str]]:
    """What a monitor reported: (name, step, request, detail, kind) per violation."""
    return [(v.name, v.step, v.request_id, v.detail, v.kind) for v in monitor.violations]


def _watch(cls, config, state: SchedulerState, plan: StepPlan, after: SchedulerState | None = None, **kwargs):
    monitor = cls(config, **kwargs)
    monitor.observe(state, plan, attrs.evolve(state, step=state.step + 1) if after is None else after)
    return _seen(monitor)


def _fresh(request_id: str, tokens: int, **fields) -> Request:
    return Request(request_id, fields.pop("arrival_step", 1), tuple(range(100, 100 + tokens)),
                   max_tokens=fields.pop("max_tokens", 1), **fields)


def test_oldest_live_breaks_ties_by_queue_place_and_reads_every_preempted_request():
    """``_oldest_live``: none for no request (``#14``); a running request ahead of a waiting one of the same
    arrival (the waiting queue's places start after the running set's: ``#8``); every preempted request at the
    head of the waiting queue is a candidate, up to the first fresh one (``#11``)."""
    from schedspec.spec.properties import _oldest_live

    assert _oldest_live(SchedulerState()) is None
    tie = SchedulerState(running=("z",), waiting=("a",),
                         requests={"z": _running("z", (0, 1)), "a": _fresh("a", 3, arrival_step=0)})
    assert _oldest_live(tie) == "z"
    line = SchedulerState(step=9, waiting=("p1", "p2", "f"), requests={
        "p1": _fresh("p1", 3, arrival_step=6, num_preemptions=1),
        "p2": _fresh("p2", 3, arrival_step=2, num_preemptions=1), "f": _fresh("f", 3, arrival_step=7)})
    assert _oldest_live(line) == "p2"


def test_trace_property_registers_name_statement_source_and_monitor_once():
    """``trace_property`` (``#1-#13``): the entry is the class's name, stripped docstring (empty without one),
    source and class; a second registration of the name is refused."""
    from schedspec.spec.properties import PROPERTIES, Monitor, TraceProperty, trace_property

    class Told(Monitor):
        """  Says what it checks.  """

        name = "test-told"

    class Untold(Monitor):
        name = "test-untold"

    try:
        assert trace_property("a source")(Told) is Told
        assert PROPERTIES["test-told"] == TraceProperty("test-told", "Says what it checks.", "a source", Told)
        trace_property("elsewhere")(Untold)
        assert PROPERTIES["test-untold"] == TraceProperty("test-untold", "", "elsewhere", Untold)
        with pytest.raises(ValueError, match="trace property 'test-told' registered twice"):
            trace_property("again")(Told)
    finally:
        PROPERTIES.pop("test-told", None)
        PROPERTIES.pop("test-untold", None)


def test_monitors_refuse_an_unknown_property_naming_the_known_ones():
    """``monitors#3, #4``."""
    from schedspec.spec.properties import monitors

    with pytest.raises(KeyError) as raised:
        monitors(["progress", "no-such-property"], CONFIG)
    message = raised.value.args[0]
    assert message.startswith("unknown trace property 'no-such-property'; known: [") and "'progress'" in message


def test_progress_counts_new_positions_ends_and_grammar_waits():
    """``progress`` with a window of one step (each step without progress is reported): a request's first
    position, or one past its high-water mark, is progress, reaching it again is not (``observe#4-#10``); a
    request that ends is progress (``#1``); a step where every live request waits for its grammar starts no
    window (``#14``, ``#19``); the report names the step and the window (``#27``, ``#28``)."""
    from schedspec.spec.properties import Progress

    monitor = Progress(CONFIG, window=1)
    a = _fresh("a", 6, max_tokens=2)
    state = SchedulerState(step=1, waiting=("a",), requests={"a": a}, free_block_ids=tuple(range(8)),
                           num_requests_added=1)

    def step(n: int, *items: ScheduledRequest, ended: bool = False, requests=None) -> None:
        before = attrs.evolve(state, step=n, requests=requests or state.requests)
        after = attrs.evolve(before, step=n + 1, finished={"x": a} if ended else {})
        monitor.observe(before, StepPlan(scheduled=items), after)

    step(1, ScheduledRequest("a", 0, 1))  # position 1: new
    step(2, ScheduledRequest("a", 1, 5))  # positions up to 6: new
    step(3, ScheduledRequest("a", 5, 1))  # position 6 again (after a preemption): no progress
    step(4, ended=True)  # a request ended: progress
    waits = {"g": _fresh("g", 3, grammar_ready_step=50)}
    step(5, requests=waits)  # every live request waits for its grammar
    assert _seen(monitor) == [
        ("progress", 3, None, "no new token position and no request ended for 1 steps", "property")]


def test_progress_reports_on_the_last_step_of_its_window():
    """A window of 3 steps without progress is reported on its third step, not before (``observe#23, #25,
    #26``); the default window is ``max_model_len`` (``__init__#1``)."""
    from schedspec.spec.properties import Progress

    assert Progress(CONFIG).window == CONFIG.max_model_len
    monitor = Progress(CONFIG, window=3)
    state = SchedulerState(step=1, waiting=("a",), requests={"a": _fresh("a", 6)}, num_requests_added=1)
    for n in (1, 2, 3):
        monitor.observe(attrs.evolve(state, step=n), StepPlan(), attrs.evolve(state, step=n + 1))
    assert [(v.step, v.detail) for v in monitor.violations] == [
        (3, "no new token position and no request ended for 3 steps")]


@pytest.mark.parametrize("marks, pruned", [(66, False), (67, True)])
def test_progress_prunes_marks_past_twice_the_live_requests_plus_64(marks, pruned):
    """With one live request, 66 marks are kept and 67 pruned to the live one's (``forget_ended#1-#7``)."""
    from schedspec.spec.properties import Progress

    monitor = Progress(CONFIG)
    monitor.high_water = {f"r{k}": 1 for k in range(marks - 1)} | {"live": 5}
    monitor.forget_ended(SchedulerState(requests={"live": _fresh("live", 2)}, waiting=("live",)))
    assert monitor.high_water == ({"live": 5} if pruned else {f"r{k}": 1 for k in range(marks - 1)} | {"live": 5})


def _work(config, state, plan) -> list:
    from schedspec.spec.properties import WorkConserving

    return _watch(WorkConserving, config, state, plan)


def _fits(step: int, request_id: str, free: int, left: int, slots: int) -> tuple:
    return ("work-conserving", step, request_id, f"head of the waiting queue fits ({free} free blocks, {left} tokens, "
            f"{slots} slots left) but was not admitted", "property")


def test_work_conserving_names_the_left_out_request_and_the_head_that_fits():
    """The left-out running request and the waiting head that fits, each with the step and the numbers of
    what is left (``observe#3``, ``#17``, ``#24-#29``, ``#39``, ``#84-#90``)."""
    state = base_state()
    assert _work(CONFIG, state, StepPlan()) == [
        ("work-conserving", 1, "a", "running request left out with 16 tokens of budget unused", "property"),
        _fits(1, "b", 6, 16, 1)]
    # a's decode takes one block: 5 free, 15 tokens, one slot left
    assert _work(CONFIG, state, StepPlan(scheduled=(ScheduledRequest("a", 6, 1, (2,)),))) == [_fits(1, "b", 5, 15, 1)]


@pytest.mark.parametrize("budget, fits", [(3, False), (4, True)])
def test_work_conserving_judges_a_step_with_one_token_left(budget, fits):
    """No token left: nothing is judged (``#4``); one left: the head c fits with chunked prefill (``#5``)."""
    plan = StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 2, (2,))))
    found = _work(CONFIG.with_changes(max_num_batched_tokens=budget, max_num_seqs=3), base_state(_fresh("c", 5)), plan)
    assert found == ([_fits(1, "c", 5, 1, 1)] if fits else [])


def test_work_conserving_allows_a_step_that_preempts():
    """vLLM admits nothing in a step that preempted (``#30``)."""
    assert _work(CONFIG, base_state(), StepPlan(preempted=("a",))) == []


def test_work_conserving_judges_the_waiting_request_after_the_admitted_one():
    """The head after an admitted request is judged, with the admitted one counted as running (``#34``,
    ``#54``)."""
    state = base_state(_fresh("c", 5))
    plan = StepPlan(scheduled=(DECODE_A, ADMIT_B))
    assert _work(CONFIG.with_changes(max_num_seqs=3), state, plan) == [_fits(1, "c", 4, 10, 1)]


def test_work_conserving_skips_the_held_prefills_of_the_prefill_cadence():
    """On a step the prefill cadence holds, a running prefill chunk may be left out and the waiting queue is
    not judged (``#9``, ``#10``, ``#18-#23``); on a step it does not hold, the same plan is judged (``#19``)."""
    from schedspec.spec.state import PrefillCadence

    chunk = attrs.evolve(_running("c", (2, 3), computed=2), output_token_ids=())  # a prefill chunk, 4 pending
    state = attrs.evolve(base_state(chunk), running=("a", "c"), waiting=("b",), free_block_ids=(4, 5, 6, 7))
    config = CONFIG.with_changes(max_num_seqs=3, prefill_schedule_interval=2)
    held = attrs.evolve(state, prefill_cadence=PrefillCadence(0))  # 0 + 1 < 2 steps since a prefill: held
    assert _work(config, held, StepPlan(scheduled=(DECODE_A,))) == []
    left_out = ("work-conserving", 1, "c", "running request left out with 15 tokens of budget unused", "property")
    assert _work(config.with_changes(prefill_schedule_interval=1), state, StepPlan(scheduled=(DECODE_A,))) == [
        left_out, _fits(1, "b", 4, 15, 1)]


def test_work_conserving_counts_a_prefix_hit_on_a_free_block_as_taken():
    """A hit on an evictable cached block takes it from the free queue (``#41-#43``): 6 free, one new block
    and one hit leave 4."""
    from schedspec.spec.prefix_cache import PrefixCache

    cache = PrefixCache(block_hashes={5: "h5"}, hash_to_blocks={"h5": (5,)}, ref_counts={0: 1, 1: 1})
    state = attrs.evolve(base_state(_fresh("c", 5)), waiting=("c", "b"), prefix_cache=cache)
    plan = StepPlan(scheduled=(DECODE_A, ScheduledRequest("c", 4, 1, (2,), (5,))))
    assert _work(CONFIG.with_changes(max_num_seqs=3), state, plan) == [_fits(1, "b", 4, 14, 1)]


@pytest.mark.parametrize("budget, tokens, fits", [(10, 9, True), (10, 10, False)])
def test_work_conserving_without_chunking_needs_the_whole_prompt_in_the_budget(budget, tokens, fits):
    """Chunked prefill off: a head of 9 pending tokens fits in the 9 left, one of 10 does not, however many
    blocks are free (``#81-#83``)."""
    config = CONFIG.with_changes(enable_chunked_prefill=False, max_num_batched_tokens=budget, max_model_len=budget)
    state = attrs.evolve(base_state(_fresh("w", tokens, max_tokens=0 if tokens == budget else 1)), waiting=("w",))
    assert _work(config, state, StepPlan(scheduled=(DECODE_A,))) == ([_fits(1, "w", 6, 9, 1)] if fits else [])


def test_work_conserving_with_chunking_admits_a_head_larger_than_the_budget_left():
    """Chunked prefill on: a head of 5 tokens with 3 left fits (a chunk) (``#81``)."""
    config = CONFIG.with_changes(max_num_batched_tokens=4)
    assert _work(config, base_state(), StepPlan(scheduled=(DECODE_A,))) == [_fits(1, "b", 6, 3, 1)]


def test_work_conserving_keeps_the_watermark_free_only_while_others_run():
    """``watermark`` 0.25 keeps int(0.25 * 9) = 2 blocks free when a request runs: b's 2 blocks and the 2 kept
    do not fit in 3 free (``#66``, ``#70``); with nothing running the watermark is not kept: 2 free fit b's 2
    (``#67``, ``#68``)."""
    config = CONFIG.with_changes(watermark=0.25, max_num_seqs=3)
    assert config.watermark_blocks == 2
    state = attrs.evolve(base_state(_running("d", (2, 3, 4))), running=("a", "d"), waiting=("b",),
                         free_block_ids=(5, 6, 7))
    assert _work(config, state, StepPlan(scheduled=(DECODE_A, ScheduledRequest("d", 6, 1)))) == []
    alone = SchedulerState(step=1, waiting=("b",), requests={"b": waiting_b()}, free_block_ids=(6, 7),
                           num_requests_added=1)
    assert _work(config, alone, StepPlan()) == [_fits(1, "b", 2, 16, 3)]


def test_work_conserving_passes_over_a_request_whose_grammar_compiles():
    """A waiting request whose grammar is not ready is passed over; the next one is the head (``#63``,
    ``#64``)."""
    state = attrs.evolve(base_state(_fresh("g", 3, grammar_ready_step=10)), waiting=("g", "b"))
    assert _work(CONFIG, state, StepPlan(scheduled=(DECODE_A,))) == [_fits(1, "b", 6, 15, 1)]


def test_work_conserving_passes_over_an_adapter_one_too_many():
    """``max_loras``: a waiting request whose adapter would be one too many is passed over (``#44``, ``#45``,
    ``#47``, ``#50``, ``#58-#61``); the adapters are those of the running set and of the admitted requests
    (``#48``, ``#49``); with LoRA off an adapter passes nothing over (``#58``)."""
    a = attrs.evolve(running_a(), lora_int_id=1)
    x = _fresh("x", 3, lora_int_id=2)
    state = attrs.evolve(base_state(x), requests={"a": a, "b": waiting_b(), "x": x}, waiting=("x", "b"))
    plan = StepPlan(scheduled=(DECODE_A,))
    assert _work(CONFIG.with_changes(max_loras=1), state, plan) == [_fits(1, "b", 6, 15, 1)]
    assert _work(CONFIG, state, plan) == [_fits(1, "x", 6, 15, 1)]  # LoRA off
    y = _fresh("y", 3, lora_int_id=3)
    two = attrs.evolve(state, requests={**state.requests, "y": y}, waiting=("y", "x", "b"))
    admit_y = StepPlan(scheduled=(DECODE_A, ScheduledRequest("y", 0, 3, (2,))))
    assert _work(CONFIG.with_changes(max_loras=2, max_num_seqs=4), two, admit_y) == [_fits(1, "b", 5, 12, 2)]


def test_stall_free_decode_reports_a_decode_without_its_token_at_the_budget():
    """One decode and a budget of one token: the decode is owed its token (``#2``); the report names the step
    and the request (``#7-#14``)."""
    from schedspec.spec.properties import StallFreeDecode

    found = _watch(StallFreeDecode, CONFIG.with_changes(max_num_batched_tokens=1, max_num_seqs=1), base_state(),
                   StepPlan())
    assert found == [("stall-free-decode", 1, "a", "running decode got no token", "property")]


def test_bounded_itl_reports_the_running_decode_not_the_prefill():
    """A step over the budget reports the running decode that rides in it (``observe#9-#14``), not a
    prefill (``#6``)."""
    from schedspec.spec.properties import BoundedItl

    both = StepPlan(scheduled=(ScheduledRequest("b", 0, 4, (2,)), DECODE_A))
    assert _watch(BoundedItl, CONFIG, base_state(), both, budget=4) == [
        ("bounded-itl", 1, "a", "a running decode rides in a step of 5 tokens > 4", "property")]
    alone = StepPlan(scheduled=(ScheduledRequest("b", 0, 5, (2, 3)),))
    assert _watch(BoundedItl, CONFIG, base_state(), alone, budget=4) == []


def _wait(config, states: list[SchedulerState]) -> list:
    from schedspec.spec.properties import BoundedWait

    monitor = BoundedWait(config)
    for state in states:
        monitor.observe(state, StepPlan(), attrs.evolve(state, step=state.step + 1))
    return _seen(monitor)


def test_bounded_wait_reports_the_oldest_request_at_its_bound():
    """``max_model_len`` 2: the oldest request live for 2 steps is reported once, with its step and wait
    (``observe#18``, ``#21-#27``); an empty state has no oldest (``#7``)."""
    config = CONFIG.with_changes(max_model_len=2)
    state = base_state()
    found = _wait(config, [SchedulerState(), *(attrs.evolve(state, step=n) for n in (1, 2, 3))])
    assert found == [("bounded-wait", 2, "a", "oldest live request for 2 steps without ending", "property")]


def test_bounded_wait_bound_grows_with_the_prefill_cadence_and_waits_for_grammars():
    """With ``prefill_schedule_interval`` 2 the bound is 2 * ``max_model_len`` (``#14``); an oldest request
    whose grammar compiles is not waiting yet (``#4``, ``#9``)."""
    config = CONFIG.with_changes(max_model_len=2, prefill_schedule_interval=2)
    assert _wait(config, [attrs.evolve(base_state(), step=n) for n in (1, 2, 3)]) == []
    g = _fresh("g", 3, arrival_step=0, grammar_ready_step=50)
    alone = SchedulerState(waiting=("g",), requests={"g": g}, num_requests_added=1)
    assert _wait(CONFIG.with_changes(max_model_len=2), [attrs.evolve(alone, step=n) for n in (1, 2, 3, 4)]) == []


def _line() -> tuple[SchedulerState, dict[str, int]]:
    """Running a, waiting b then c; the bounds of ``bounded-preemptions`` by hand from each one's
    ``max_blocks_needed``: a 0, b A(a) = m_a, c m_a + (m_a + 1) * m_b."""
    from schedspec.spec.admission import max_blocks_needed

    state = base_state(_fresh("c", 5, max_tokens=3))
    m = {r: max_blocks_needed(q.prompt_len, q.max_tokens, CONFIG) for r, q in state.requests.items()}
    return state, {"a": 0, "b": m["a"], "c": m["a"] + (m["a"] + 1) * m["b"]}


def _preempt(monitor, state: SchedulerState, step: int, *preempted: str, scheduled=(DECODE_A,)) -> None:
    before = attrs.evolve(state, step=step)
    monitor.observe(before, StepPlan(scheduled=scheduled, preempted=preempted), attrs.evolve(before, step=step + 1))


@pytest.mark.parametrize("max_loras", [0, 1])
def test_bounded_preemptions_counts_to_the_bound_of_each_place_in_line(max_loras):
    """c (third in line) preempted once more than its bound is reported once, with the count and the
    bound (``observe#3``, ``#4``, ``#18``, ``#27-#31``, ``#42-#61``); a at the head may not be preempted at
    all; a first step with no request compiles no grammar (``__init__#6``); with ``max_loras`` a step that
    admits past no skip keeps the counts (``#63-#67``)."""
    from schedspec.spec.properties import BoundedPreemptions

    config = CONFIG.with_changes(max_loras=max_loras)
    state, bounds = _line()
    assert bounds["c"] == 3 + 4 * 2  # a: 6 + 4 tokens, 3 blocks; b: 5 + 3, 2 blocks
    monitor = BoundedPreemptions(config)
    monitor.observe(SchedulerState(), StepPlan(), SchedulerState(step=1))
    for n in range(1, bounds["c"] + 2):
        _preempt(monitor, state, n, "c")
    last = bounds["c"] + 1
    assert _seen(monitor) == [("bounded-preemptions", last, "c",
                               f"preempted {last} times after the last arrival > bound {bounds['c']}", "property")]
    head = BoundedPreemptions(config)
    _preempt(head, state, 1, "a", scheduled=())
    assert [(v.request_id, v.detail) for v in head.violations] == [
        ("a", "preempted 1 times after the last arrival > bound 0")]


def test_bounded_preemptions_starts_again_at_an_arrival_and_at_a_grammar_ready_step():
    """An arrival (``#1``, ``#2``) and the step a grammar becomes ready (``#3``, ``#8``) start the count
    again: b preempted up to its bound, then once more after either, is within its bound."""
    from schedspec.spec.properties import BoundedPreemptions

    state, bounds = _line()
    for arrival in (True, False):
        monitor = BoundedPreemptions(CONFIG)
        g = _fresh("g", 3, grammar_ready_step=bounds["b"] + 2)
        start = attrs.evolve(state, requests={**state.requests, "g": g}, waiting=(*state.waiting, "g"))
        for n in range(1, bounds["b"] + 1):
            _preempt(monitor, start, n, "b")
        later = attrs.evolve(start, num_requests_added=start.num_requests_added + 1) if arrival else start
        _preempt(monitor, later, bounds["b"] + (1 if arrival else 2), "b")
        assert _seen(monitor) == [], arrival


@pytest.mark.parametrize("max_loras", [0, 1])
def test_bounded_preemptions_starts_again_after_an_admission_past_a_lora_skip(max_loras):
    """With ``max_loras``, a step that admits c past b (skipped) starts the count again from the next step
    (``#62``, ``#68``, ``#69``); with LoRA off it does not."""
    from schedspec.spec.properties import BoundedPreemptions

    state, bounds = _line()
    monitor = BoundedPreemptions(CONFIG.with_changes(max_loras=max_loras))
    for n in range(1, bounds["c"] + 1):
        _preempt(monitor, state, n, "c")
    _preempt(monitor, state, bounds["c"] + 1, scheduled=(DECODE_A, ScheduledRequest("c", 0, 5, (2, 3))))
    _preempt(monitor, state, bounds["c"] + 2, "c")
    assert [v.request_id for v in monitor.violations] == ([] if max_loras else ["c"])


@pytest.mark.parametrize("admitted, rejected, past", [
    ((), (), False), (("b",), (), False), (("c",), (), True), (("c",), ("b",), False), (("ghost",), ("b", "c"), False),
    (("b", "c"), (), False),
], ids=["none", "head", "past-b", "past-rejected-b", "unknown", "both"])
def test_admitted_past_a_skip(admitted, rejected, past):
    """Whether a plan admits a waiting request past one that stays (``_admitted_past_a_skip#1-#15``)."""
    from schedspec.spec.properties import _admitted_past_a_skip

    state = base_state(_fresh("c", 5))
    plan = StepPlan(scheduled=(DECODE_A, *(ScheduledRequest(r, 0, 1) for r in admitted)),
                    rejected=tuple((r, "x") for r in rejected))
    assert _admitted_past_a_skip(state, plan) is past


def test_rejects_impossible_judges_each_fresh_waiting_request():
    """A fresh impossible request not rejected, and a possible one rejected, are each reported with the step
    and the reason (``observe#4-#30``); a request admitted before (preempted) is passed over, not the end of
    the queue (``#5``); an impossible request rejected is right (``#15``, ``#23``)."""
    from schedspec.spec.admission import rejection_reason
    from schedspec.spec.properties import RejectsImpossible

    huge = _fresh("huge", 40)
    back = attrs.evolve(_fresh("p", 3, arrival_step=0), admitted_step=0, num_preemptions=1)
    state = attrs.evolve(base_state(back, huge), waiting=("p", "huge", "b"))
    reason = rejection_reason(40, 1, CONFIG)
    assert reason is not None
    found = _watch(RejectsImpossible, CONFIG, state, StepPlan(rejected=(("b", "made up"),)))
    assert found == [
        ("rejects-impossible", 1, "huge", f"not rejected although {reason}", "property"),
        ("rejects-impossible", 1, "b", "rejected (made up) although it can complete alone", "property")]
    assert _watch(RejectsImpossible, CONFIG, state, StepPlan(rejected=(("huge", reason),))) == []


def _inversion(config, state: SchedulerState, plan: StepPlan) -> list:
    from schedspec.spec.properties import NoPriorityInversion

    return [(request_id, detail) for _, _, request_id, detail, _ in _watch(NoPriorityInversion, config, state, plan)]


def _urgent(request_id: str, tokens: int, priority: int = 0, **fields) -> Request:
    return _fresh(request_id, tokens, priority=priority, **fields)


def _less(request_id: str, blocks: tuple[int, ...], priority: int = 1) -> Request:
    return attrs.evolve(_running(request_id, blocks), priority=priority)


def _prio(running: dict[str, Request], waiting: dict[str, Request], free: tuple[int, ...], **state) -> SchedulerState:
    return SchedulerState(step=1, running=tuple(running), waiting=tuple(waiting), requests={**running, **waiting},
                          free_block_ids=free, num_requests_added=len(running) + len(waiting), **state)


def test_no_priority_inversion_names_what_is_lacking_and_who_holds_it():
    """W (priority 0) lacks a slot (``max_num_seqs`` 2, both held by less urgent L1, L2) and blocks (1 free
    of the 2 it needs): the report lists both, and the holders, in order (``observe#107``, ``#121``,
    ``#123``); with 2 free it lacks only the slot (``#111``); an empty state has nothing to invert
    (``#4``)."""
    assert _inversion(CONFIG, SchedulerState(), StepPlan()) == []
    running = {"L2": _less("L2", (3, 4)), "L1": _less("L1", (0, 1))}
    plan = StepPlan(scheduled=(ScheduledRequest("L2", 6, 1), ScheduledRequest("L1", 6, 1)))
    state = _prio(running, {"W": _urgent("W", 5)}, (2,))
    assert _inversion(CONFIG, state, plan) == [
        ("W", "priority 0 waits for a max_num_seqs slot, 2 blocks (1 free) held by less urgent running L1, L2")]
    state = _prio(running, {"W": _urgent("W", 5)}, (2, 5))
    assert _inversion(CONFIG, state, plan) == [
        ("W", "priority 0 waits for a max_num_seqs slot held by less urgent running L1, L2")]


def test_no_priority_inversion_with_one_slot_and_one_token_left():
    """A slot left is not lacking (``#109``, ``#110``); one token left with chunked prefill is enough
    (``#76``, ``#112``); a request that fits is passed over, not the end of the queue (``#77``); so is one
    that can never complete (``#56``) and one with no less urgent request running (``#100``)."""
    config = CONFIG.with_changes(max_num_batched_tokens=2)
    running = {"L": _less("L", (0, 1))}
    waiting = {"I": _urgent("I", 40), "F": _urgent("F", 3), "Z": _urgent("Z", 5, priority=5), "W": _urgent("W", 5)}
    plan = StepPlan(scheduled=(ScheduledRequest("L", 6, 1),))
    assert _inversion(config, _prio(running, waiting, (2,)), plan) == [
        ("W", "priority 0 waits for 2 blocks (1 free) held by less urgent running L")]
    assert _inversion(config, _prio(running, {"W": _urgent("W", 5)}, (2, 3)), plan) == []  # fits: 1 token left
    assert _inversion(config.with_changes(max_num_seqs=1), _prio(running, {"W": _urgent("W", 5)}, (2, 3)), plan) == [
        ("W", "priority 0 waits for a max_num_seqs slot held by less urgent running L")]


def test_no_priority_inversion_without_chunking_needs_the_whole_prompt_of_budget():
    """Chunked prefill off: W's 5 pending tokens; 4 left, and L's 1 would make exactly 5 (``#68``,
    ``#105``)."""
    config = CONFIG.with_changes(enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=8,
                                 max_num_seqs=3)
    x = attrs.evolve(_running("X", (2, 3), computed=2), output_token_ids=())
    state = _prio({"L": _less("L", (0, 1)), "X": x}, {"W": _urgent("W", 5, max_tokens=3)}, (4, 5, 6, 7))
    plan = StepPlan(scheduled=(ScheduledRequest("L", 6, 1), ScheduledRequest("X", 2, 3)))
    assert _inversion(config, state, plan) == [
        ("W", "priority 0 waits for 5 tokens of budget (4 left) held by less urgent running L")]


def test_no_priority_inversion_counts_no_token_for_a_less_urgent_request_left_out():
    """L runs but is not scheduled: it holds no token of the budget (``#94``, ``#96``, ``#97``), and its
    table is its request's (``_table#3``, ``_held_only_by#5, #13``): W, lacking the one token, is not kept
    out by L."""
    config = CONFIG.with_changes(max_num_batched_tokens=4, max_num_seqs=4)
    y = attrs.evolve(_running("Y", (6,)), priority=0)
    x = attrs.evolve(_running("X", (2, 3), computed=2), output_token_ids=(), priority=0)
    state = _prio({"L": _less("L", (0, 1)), "X": x, "Y": y}, {"W": _urgent("W", 5)}, (4, 5))
    assert _inversion(config, state, StepPlan(scheduled=(ScheduledRequest("X", 2, 4),))) == []


def test_no_priority_inversion_counts_the_blocks_preemptions_release():
    """P's preemption releases its blocks (``#31``): W fits after it (3 free of the 2 it needs), though L
    alone would hold 3; a block P shares with L is not released (``_released#2``): W needing 3 then lacks
    one, which L holds."""
    running = {"L": _less("L", (0, 1, 5)), "P": attrs.evolve(_running("P", (2, 3)), priority=0)}
    plan = StepPlan(scheduled=(ScheduledRequest("L", 6, 1),), preempted=("P",))
    assert _inversion(CONFIG, _prio(running, {"W": _urgent("W", 5)}, (4,)), plan) == []
    shared = {"L": _less("L", (0, 1, 2)), "P": attrs.evolve(_running("P", (2, 3)), priority=0)}
    assert _inversion(CONFIG, _prio(shared, {"W": _urgent("W", 9)}, (4,)), plan) == [
        ("W", "priority 0 waits for 3 blocks (2 free) held by less urgent running L")]


def _hits(with_cache: bool, needed: int) -> list:
    """Free 4, 5, 6 (4 and 5 cached, evictable); H admitted with hits on 0 (L's, held), 4 and 5: 3 - 2 = 1
    block left; L's blocks 0, 1, of which only 1 is L's alone."""
    from schedspec.spec.prefix_cache import PrefixCache

    cache = PrefixCache(block_hashes={0: "h0", 4: "h4", 5: "h5"}, hash_to_blocks={"h0": (0,), "h4": (4,), "h5": (5,)},
                        ref_counts={0: 1, 1: 1})
    h = attrs.evolve(_urgent("H", 13), priority=0)
    state = _prio({"L": _less("L", (0, 1))}, {"H": h, "W": _urgent("W", needed * 4)}, (4, 5, 6),
                  prefix_cache=cache if with_cache else None)
    plan = StepPlan(scheduled=(ScheduledRequest("L", 6, 1), ScheduledRequest("H", 12, 1, (), (0, 4, 5))))
    return _inversion(CONFIG.with_changes(max_num_seqs=3), state, plan)


def test_no_priority_inversion_counts_prefix_hits_on_free_blocks_and_shared_blocks():
    """Hits on free cached blocks take them from the free queue, a hit on a held block does not
    (``observe#29``, ``_hits_on_free_blocks#1-#20``): 1 block left, W needs 2, L alone holds 1 (block 0 is
    H's too: ``observe#81, #87, #88``); without a prefix cache no hit takes a free block (``#11``)."""
    assert _hits(True, 2) == [("W", "priority 0 waits for 2 blocks (1 free) held by less urgent running L")]
    assert _hits(True, 3) == []  # 1 + L's 1 < 3
    assert _hits(False, 2) == []  # 3 free: fits


# --- spec/checker.py (issue 28: survivors of scripts/mutmut.sh checker) ------------------------------------


def test_unfinished_requests_are_named_with_their_queue_last_step_and_progress():
    """``_unfinished#2-#27``: each live request at the end, its queue, the last step, when it was last
    scheduled (or never) and what it computed."""
    from schedspec.spec.checker import _unfinished

    state = attrs.evolve(base_state(), step=5)
    found = [(v.name, v.step, v.request_id, v.kind, v.detail.split(": every request")[0])
             for v in _unfinished(state, {"a": 3})]
    assert found == [
        ("unfinished-request", 4, "a", "mismatch", "still running when the trace ends after step 4 (last scheduled "
                                                   "at step 3; computed 6 of 7 tokens, 2 blocks held)"),
        ("unfinished-request", 4, "b", "mismatch", "still waiting when the trace ends after step 4 (never scheduled; "
                                                   "computed 0 of 5 tokens, 0 blocks held)")]


def test_step_times_may_meet_but_not_overlap_beyond_the_tolerance():
    """``_compare_times#12, #22, #23``: a step that starts exactly at the tolerance before the previous one's
    end is allowed; one just earlier is reported, saying why."""
    from schedspec.spec.checker import TIME_TOLERANCE, _compare_times, _StepComparison
    from schedspec.spec.trace import StepRecord

    previous = StepRecord(3, 10.0, 2.0)
    edge = 12.0 - TIME_TOLERANCE * 12.0
    ok = _StepComparison(4)
    _compare_times(StepRecord(4, edge, 1.0), previous, ok)
    assert ok.found == []
    bad = _StepComparison(4)
    _compare_times(StepRecord(4, 11.0, 1.0), previous, bad)
    assert [v.detail for v in bad.found] == [
        "starts at 11.0 s, before step 3 ended at 12.0 s (time runs backwards or steps overlap)"]


@pytest.mark.parametrize("start, arrival, late", [
    (100.0, 100.0 + 50e-9, False), (0.5, 0.5 + 1.5e-9, True), (4.0, 4.0 + 1e-9 * 4.0, False), (7.0, 7.5, True)])
def test_an_arrival_may_follow_its_step_start_only_within_the_relative_tolerance(start, arrival, late):
    """``_compare_arrival#8-#20``: the tolerance is 1e-9 of the start time (at least 1e-9 s); the report
    names the request."""
    from schedspec.spec.checker import _compare_arrival, _StepComparison
    from schedspec.spec.trace import StepRecord
    from schedspec.spec.workload import RequestSpec

    found = _StepComparison(2)
    _compare_arrival(RequestSpec("r", 3, 2, arrival_step=1, arrival_time=arrival), StepRecord(2, start, 0.1), found)
    assert [(v.request_id, v.detail.split(",")[0]) for v in found.found] == [
        ("r", "arrival_step 1")] + ([("r", f"arrival_time {arrival} s is after the start of step 2 ({start} s)")]
                                    if late else [])


def test_a_sampler_the_record_omits_gets_a_token_that_stops_it_as_recorded():
    """``_sampled_for_update#4-#27``: a recorded token is kept; a sampler the record says stopped gets its
    eos (or first stop) token; one that did not stop gets the smallest token that is neither, after a
    sampler whose token is recorded."""
    from schedspec.spec.checker import _sampled_for_update
    from schedspec.spec.trace import StepRecord

    requests = {"a": running_a(), "s": attrs.evolve(running_a(), request_id="s", eos_token_id=None,
                                                       stop_token_ids=(9,)),
                "e": attrs.evolve(running_a(), request_id="e", eos_token_id=7),
                "n": attrs.evolve(running_a(), request_id="n", eos_token_id=0, stop_token_ids=(1,))}
    before = SchedulerState(step=3, running=tuple(requests), requests=requests)
    record = StepRecord(3, 0.0, 0.1, sampled_token_ids={"a": 42}, finished={"s": "stop", "e": "stop", "n": "length"})
    assert _sampled_for_update(["a", "s", "e", "n"], record, before) == {"a": 42, "s": 9, "e": 7, "n": 2}


def _compared(compare, *args, step: int = 3) -> list[tuple[str | None, str]]:
    from schedspec.spec.checker import _StepComparison

    found = _StepComparison(step)
    compare(*args, found)
    assert all(v.step == step and v.name == "trace-mismatch" for v in found.found)
    return [(v.request_id, v.detail) for v in found.found]


def test_record_prefix_hits_and_wasted_tokens_are_compared_with_the_spec():
    """``_compare_record#51-#101``: hit blocks and hit tokens of a request outside the batch, hit tokens that
    differ from what the spec's hit blocks hold, and the wasted tokens, each named; the requests whose hit
    agrees are passed over (not the end of the check)."""
    from schedspec.spec.checker import _compare_record
    from schedspec.spec.trace import ScheduledTokens, StepRecord

    config = CONFIG.with_changes(enable_prefix_caching=True)
    agree = [f"q{k}" for k in range(6)]
    batch = tuple(ScheduledTokens(r, 0, 1, 0) for r in ["a", *agree])
    expected = StepRecord(3, 0.0, 0.1, scheduled=batch, prefix_hit_tokens={"a": 4}, prefix_hit_blocks={"a": (5,)},
                          wasted_tokens={"x": 2})
    record = StepRecord(3, 0.0, 0.1, scheduled=batch, prefix_hit_blocks={"a": (5,), "ghost": (3,), "z": ()},
                        prefix_hit_tokens={"a": 2, "ghost": 3, **dict.fromkeys(agree, 0), "q0": 1}, wasted_tokens={"x": 3})
    found = _compared(_compare_record, record, expected, config)
    assert found[0] == ("ghost", "prefix_hit_blocks [3] for a request that is not in the step's batch")
    assert sorted(found[1:4]) == [("a", "prefix_hit_tokens=2, but its hit blocks [5] hold 4 tokens"),
                                  ("ghost", "prefix_hit_tokens=3 for a request that is not in the step's batch"),
                                  ("q0", "prefix_hit_tokens=1, but its hit blocks [] hold 0 tokens")]
    assert found[4:] == [(None, "wasted_tokens {'x': 3}, but the tokens computed for requests that had ended "
                                "were {'x': 2}")]


def test_accepted_counts_name_exactly_the_samplers_that_verified_drafts():
    """``_compare_accepted#1-#17``: a count for a request without drafts, or for a verifier that does not
    sample, and none for a sampler that verified drafts."""
    from schedspec.spec.checker import _compare_accepted
    from schedspec.spec.trace import StepRecord

    plan = StepPlan(scheduled=(ScheduledRequest("a", 6, 3, (), (), (5, 6)), ScheduledRequest("b", 6, 1),
                               ScheduledRequest("c", 6, 2, (), (), (7,))))
    record = StepRecord(3, 0.0, 0.1, num_accepted_tokens={"b": 1, "c": 1})
    assert sorted(_compared(_compare_accepted, plan, ["a", "b"], record)) == [
        ("a", "no num_accepted_tokens, but it verified drafts and samples this step"),
        ("b", "num_accepted_tokens for a request that verified no drafts or does not sample this step"),
        ("c", "num_accepted_tokens for a request that verified no drafts or does not sample this step")]


def test_speculative_output_of_a_record_with_either_field():
    """``speculative_of#1-#6``."""
    from schedspec.spec.checker import speculative_of
    from schedspec.spec.state import NO_SPECULATION
    from schedspec.spec.trace import StepRecord

    assert speculative_of(StepRecord(3, 0.0, 0.1)) is NO_SPECULATION
    accepted = speculative_of(StepRecord(3, 0.0, 0.1, num_accepted_tokens={"a": 1}))
    assert (dict(accepted.num_accepted_tokens), dict(accepted.draft_token_ids)) == ({"a": 1}, {})
    drafts = speculative_of(StepRecord(3, 0.0, 0.1, draft_token_ids={"a": (1, 2)}))
    assert (dict(drafts.num_accepted_tokens), dict(drafts.draft_token_ids)) == ({}, {"a": (1, 2)})


def test_a_driven_abort_that_is_due_is_named_after_an_ended_request_is_dropped():
    """``_compare_driven_aborts#4-#17``: an ended request is dropped from the driven ones and the check goes
    on; a live request past its abort_at_step and not aborted is named."""
    from schedspec.spec.checker import _compare_driven_aborts
    from schedspec.spec.trace import StepRecord
    from schedspec.spec.workload import RequestSpec

    driven = {"gone": RequestSpec("gone", 3, 2, abort_at_step=1), "a": RequestSpec("a", 6, 4, abort_at_step=2)}
    found = _compared(_compare_driven_aborts, driven, base_state(), StepRecord(3, 0.0, 0.1))
    assert found == [("a", "its arrival says abort_at_step 2, but it is still live and not aborted in step 3")]
    assert list(driven) == ["a"]


def test_a_driven_eos_is_read_at_its_output_among_the_accepted_drafts():
    """``_compare_driven_eos#13-#38``: the outputs a step appends are the accepted drafts then the sampled
    token; output 3 of r (one output before) is its second appended token; q, without an accepted count, appends
    only its sampled token; w's output is past what this step appends; x is not driven."""
    from schedspec.spec.checker import _compare_driven_eos
    from schedspec.spec.trace import ScheduledTokens, StepRecord
    from schedspec.spec.workload import RequestSpec

    r, q = attrs.evolve(running_a(), request_id="r"), attrs.evolve(running_a(), request_id="q")
    w = attrs.evolve(running_a(), request_id="w", output_token_ids=())
    state = SchedulerState(step=3, running=("x", "w", "q", "r"),
                           requests={"x": running_a(), "w": w, "q": q, "r": r})
    driven = {"r": RequestSpec("r", 6, 4, eos_at_output=3, eos_token_id=2),
              "q": RequestSpec("q", 6, 4, eos_at_output=2, eos_token_id=5),
              "w": RequestSpec("w", 6, 4, eos_at_output=2, eos_token_id=5)}
    record = StepRecord(3, 0.0, 0.1, scheduled=(ScheduledTokens("r", 7, 0, 3, (7, 8)), ScheduledTokens("q", 7, 0, 2, (4,))),
                        num_accepted_tokens={"r": 1}, sampled_token_ids={"x": 1, "w": 3, "q": 5, "r": 9})
    assert _compared(_compare_driven_eos, driven, state, record) == [
        ("r", "its arrival says eos_at_output 3, but output 3 was sampled as 9, not its eos_token_id 2")]


def test_token_split_is_checked_after_an_item_it_passes_over():
    """``_compare_split#13, #14, #24, #26``: an unknown item and one whose computed tokens disagree (no hit)
    are passed over; a decode or a prefill split the wrong way is named with its kind."""
    from schedspec.spec.checker import _compare_split
    from schedspec.spec.trace import ScheduledTokens, StepRecord

    record = StepRecord(3, 0.0, 0.1, scheduled=(ScheduledTokens("ghost", 0, 1, 0), ScheduledTokens("a", 6, 1, 0),
                                                 ScheduledTokens("b", 0, 0, 5)))
    assert _compared(_compare_split, base_state(), record) == [
        ("a", "prefill_tokens=1, decode_tokens=0, but the step is a decode of 1 tokens: the spec says "
              "prefill_tokens=0, decode_tokens=1"),
        ("b", "prefill_tokens=0, decode_tokens=5, but the step is a prefill (or recompute) chunk of 5 tokens: the "
              "spec says prefill_tokens=5, decode_tokens=0")]
    skewed = StepRecord(3, 0.0, 0.1, scheduled=(ScheduledTokens("a", 5, 1, 0),))
    assert _compared(_compare_split, base_state(), skewed) == []


def test_sampled_tokens_mismatches_say_why():
    """``_compare_sampled#8-#17``."""
    from schedspec.spec.checker import _compare_sampled
    from schedspec.spec.trace import StepRecord

    record = StepRecord(3, 0.0, 0.1, sampled_token_ids={"b": 4})
    assert _compared(_compare_sampled, ["a"], record) == [
        ("b", "a token was sampled for a request that does not sample this step (not scheduled, not live, or its "
              "chunk does not reach the end of its sequence)"),
        ("a", "no sampled token, but its chunk reaches the end of its sequence, so it samples one")]


def test_the_plan_of_a_record_carries_its_hit_blocks_and_drafts():
    """``plan_from_record#18, #19, #24``."""
    from schedspec.spec.checker import plan_from_record
    from schedspec.spec.trace import ScheduledTokens, StepRecord

    record = StepRecord(3, 0.0, 0.1, scheduled=(ScheduledTokens("a", 6, 0, 3, (5, 6)), ScheduledTokens("b", 4, 1, 0)),
                        prefix_hit_blocks={"b": (0,)}, blocks_allocated={"b": (2,)})
    assert plan_from_record(record).scheduled == (ScheduledRequest("a", 6, 3, (), (), (5, 6)),
                                                  ScheduledRequest("b", 4, 1, (2,), (0,)))


def test_keep_going_stops_at_an_arrival_the_spec_refuses():
    """``check_trace#75, #76, #191``: with ``keep_going`` the check still stops after a step whose arrival the
    spec refuses (the same id twice): the state after it is not the engine's, so later steps cannot be
    judged."""
    from schedspec.spec.checker import check_trace
    from schedspec.spec.trace import StepRecord
    from schedspec.spec.workload import RequestSpec

    twice = (RequestSpec("r", 3, 2, arrival_step=0), RequestSpec("r", 3, 2, arrival_step=0))
    records = [StepRecord(0, 0.0, 0.1, arrivals=twice), StepRecord(1, 0.1, 0.1)]
    report = check_trace(CONFIG, records, keep_going=True)
    assert report.steps_checked == 1
    assert any(v.request_id == "r" and v.detail.startswith("arrival: ") for v in report.violations)


def test_bounded_preemptions_caps_the_bounds_of_a_long_line_at_10_to_the_18():
    """The bounds grow at least twofold per place in line; they are capped at 10**18 so that a long line
    stays cheap (``observe#37-#39``): from the 60th place on every bound is exactly 10**18."""
    from schedspec.spec.properties import BoundedPreemptions

    line = {f"r{k}": _fresh(f"r{k}", 5, arrival_step=0) for k in range(70)}  # each needs 2 blocks at most
    state = SchedulerState(step=1, waiting=tuple(line), requests=line, num_requests_added=70)
    monitor = BoundedPreemptions(CONFIG)
    monitor.observe(state, StepPlan(), attrs.evolve(state, step=2))
    assert monitor.bounds["r1"] == 2 and monitor.bounds["r2"] == 2 + 3 * 2
    assert [monitor.bounds[f"r{k}"] for k in range(60, 70)] == [10**18] * 10


def test_a_wasted_item_of_a_request_that_ended_in_flight_is_split_as_that_request():
    """``_compare_split#2, #8``: with a step in flight, an item of a request that ended since (a wasted item)
    is split as the request it was: a decode of 1 token recorded as prefill is named."""
    from schedspec.spec.checker import _compare_split
    from schedspec.spec.state import InFlightStep
    from schedspec.spec.trace import ScheduledTokens, StepRecord

    ended = attrs.evolve(running_a(), request_id="gone")
    state = attrs.evolve(base_state(), in_flight=InFlightStep(step=2, ended={"gone": ended}))
    record = StepRecord(3, 0.0, 0.1, scheduled=(ScheduledTokens("gone", 6, 1, 0),))
    assert _compared(_compare_split, state, record) == [
        ("gone", "prefill_tokens=1, decode_tokens=0, but the step is a decode of 1 tokens: the spec says "
                 "prefill_tokens=0, decode_tokens=1")]


def test_a_speculative_record_without_its_accepted_counts_is_named():
    """``check_trace#130, #135, #156, #157``: with speculative decoding on, a step whose record drops both
    ``num_accepted_tokens`` and ``draft_token_ids`` (so it carries no speculative output at all) still has its
    verifying samplers' counts asked for."""
    from test_speculative import _workload

    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS
    from schedspec.spec.checker import check_trace
    from schedspec.spec.config import SchedulerConfig

    config = SchedulerConfig(block_size=4, num_kv_blocks=30, max_num_seqs=4, max_model_len=64,
                             max_num_batched_tokens=16, num_speculative_tokens=2)
    records = Engine(SCHEDULERS["fcfs"](config), config).run(_workload(1)).records
    k = next(k for k, record in enumerate(records) if record.num_accepted_tokens)
    verifier = sorted(records[k].num_accepted_tokens)[0]
    kept = records[k]
    records[k] = attrs.evolve(kept, num_accepted_tokens={}, draft_token_ids={})
    report = check_trace(config, records)
    assert (k, verifier, "no num_accepted_tokens, but it verified drafts and samples this step") in {
        (v.step, v.request_id, v.detail) for v in report.violations}
    # more drafts accepted than verified: no rule judges the count, the spec cannot apply the step
    # (check_trace#156, #157: that is reported, with the spec's reason)
    records[k] = attrs.evolve(kept, num_accepted_tokens={**kept.num_accepted_tokens, verifier: 99})
    report = check_trace(config, records)
    assert not report.ok and report.first_bad_step == k
    assert any(v.step == k and v.detail.startswith("the spec cannot apply the recorded step: ")
               for v in report.violations), report.violations


def test_some_blocks_are_named_with_their_count_and_how_many_more():
    """``invariants._some#1-#21``: the leaked-block list of ``block-conservation``."""
    from schedspec.spec.invariants import _some

    assert _some([3]) == "block 3"
    assert _some([3, 7]) == "blocks 3, 7"
    assert _some(list(range(8))) == "blocks 0, 1, 2, 3, 4, 5, 6, 7"
    assert _some(list(range(11))) == "blocks 0, 1, 2, 3, 4, 5, 6, 7 and 3 more"


def test_block_conservation_names_only_the_block_twice_in_the_free_queue():
    """``block_conservation#12``: a block twice in the free queue is named, the others once there are not."""
    state = SchedulerState(running=("a",), requests={"a": _running("a", (0, 1))},
                           free_block_ids=(2, 3, 3, 4, 5, 6, 7), num_requests_added=1)
    found = [d for _, d in _invariant(state, "block-conservation") if "in the free queue" in d]
    assert found == ["block 3 is 2 times in the free queue"]


def test_published_chain_counts_the_leading_published_blocks_and_stops_after_a_gap():
    """``published_chain#3, #14, #15, #33``: the published blocks before the first breach are counted (one
    per block), and a cached block after one that is not is a breach."""
    from schedspec.spec.invariants import published_chain
    from schedspec.spec.prefix_cache import ROOT_HASH, request_block_hash

    request = attrs.evolve(_running("a", (0, 1, 2)), prompt_token_ids=tuple(range(1, 13)), num_computed_tokens=12,
                           output_token_ids=())
    h0 = request_block_hash(request, 0, ROOT_HASH, 4)
    h1 = request_block_hash(request, 1, h0, 4)
    assert published_chain(request, {0: h0, 1: h1}, 4) == (None, 2, h1)
    gap = request_block_hash(request, 2, h1, 4)
    assert published_chain(request, {0: h0, 2: gap}, 4) == (
        "block 2 at index 2 is cached after a block that is not", 1, h0)
    assert published_chain(request, {1: h1}, 4) == ("block 1 at index 1 is cached after a block that is not", 0,
                                                    ROOT_HASH)


def test_block_conservation_names_leaked_blocks_only_when_some_are():
    """``block_conservation#33-#46``: a count that does not add up names the blocks neither free nor owned,
    and nothing more when there are none (a block twice in the free queue); a terminal request given apart
    (the incremental checker's ``terminal``) is judged, not the state's finished ones."""
    from schedspec.spec.invariants import block_conservation

    leak = SchedulerState(running=("a",), requests={"a": _running("a", (0, 1))}, free_block_ids=(2, 3, 4, 5, 6),
                          num_requests_added=1)
    assert _invariant(leak, "block-conservation") == [
        (None, "free 5 + owned 2 != num_kv_blocks=8; neither free nor owned: block 7")]
    twice = attrs.evolve(leak, free_block_ids=(2, 3, 3, 4, 5, 6, 7))
    assert (None, "free 7 + owned 2 != num_kv_blocks=8") in _invariant(twice, "block-conservation")
    ended = attrs.evolve(_running("z", (7,)), status=RequestStatus.FINISHED_STOPPED)
    found = list(block_conservation(attrs.evolve(leak, free_block_ids=(2, 3, 4, 5, 6, 7)), CONFIG, {"z": ended}))
    assert [(f[0], f[1]) for f in found] == [("z", "terminal request still owns 1 blocks")]


def test_a_step_invariant_judges_the_item_after_a_decode_that_verified_drafts():
    """``chunks_in_order#9``: the check goes on past an item with drafts (judged by
    ``rejected-drafts-uncomputed``) to the next one."""
    from schedspec.spec.invariants import check_step

    before = SchedulerState(step=5, running=("d", "a"), requests={"d": _running("d", (2, 3)), "a": _running("a", (0, 1))},
                            free_block_ids=(4, 5, 6, 7), num_requests_added=2)
    plan = StepPlan(scheduled=(ScheduledRequest("d", 6, 3, (), (), (8, 9)), ScheduledRequest("a", 6, 1)))
    found = [v.request_id for v in check_step(before, plan, attrs.evolve(before, step=6), CONFIG)
             if v.name == "chunks-in-order"]
    assert found == ["a"]


def test_an_invariant_name_is_registered_once():
    """``state_invariant#1``: a second state invariant of a registered name is refused."""
    from schedspec.spec.invariants import state_invariant

    with pytest.raises(ValueError, match="invariant 'block-conservation' registered twice"):
        state_invariant("block-conservation", "a source")(lambda state, config: iter(()))


def test_accepted_drafts_prefix_passes_over_a_request_gone_after_the_step():
    """``_appended#1``: a drafting decode that is neither live nor ended after the step appended nothing (the
    lost request is ``no-request-lost``'s to report), not a crash of the check."""
    from schedspec.spec.invariants import check_step

    config = CONFIG.with_changes(num_speculative_tokens=2)
    before = SchedulerState(step=5, running=("a",), requests={"a": _running("a", (0, 1))},
                            free_block_ids=(2, 3, 4, 5, 6, 7), num_requests_added=1)
    after = SchedulerState(step=6, free_block_ids=tuple(range(8)), num_requests_added=1)
    plan = StepPlan(scheduled=(ScheduledRequest("a", 6, 3, (), (), (8, 9)),))
    names = {v.name for v in check_step(before, plan, after, config)}
    assert "accepted-drafts-prefix" not in names


def test_prefix_hit_computed_judges_the_item_after_those_it_passes_over():
    """``prefix_hit_computed#2, #8, #14, #18``: past an item without a hit, an unknown one and one that ended,
    a table that does not start with its hit blocks is named with the table."""
    from schedspec.spec.invariants import check_step

    g, h = _fresh("g", 6, max_tokens=2), _fresh("h", 6, max_tokens=2)
    before = SchedulerState(step=5, running=("a",), waiting=("g", "h"), requests={"a": _running("a", (0, 1)), "g": g, "h": h},
                            free_block_ids=(2, 3, 4, 5, 6, 7), num_requests_added=3)
    after_h = attrs.evolve(h, status=RequestStatus.RUNNING, num_computed_tokens=6, block_ids=(3, 4), admitted_step=5)
    after = SchedulerState(step=6, running=("a", "h"), requests={"a": before.requests["a"], "h": after_h},
                           free_block_ids=(5, 6, 7), num_requests_added=3)
    plan = StepPlan(scheduled=(DECODE_A, ScheduledRequest("ghost", 4, 1, (), (0,)),
                               ScheduledRequest("g", 4, 2, (5,), (0,)), ScheduledRequest("h", 4, 2, (4,), (2,))))
    found = [(v.request_id, v.detail) for v in check_step(before, plan, after, CONFIG) if v.name == "prefix-hit-computed"]
    assert found == [("h", "block table [3, 4] does not start with the hit blocks")]


def test_rejected_drafts_uncomputed_judges_the_decode_after_one_without_drafts():
    """``rejected_drafts_uncomputed#3``: past a decode without drafts, a decode that computed a rejected draft
    is named."""
    from schedspec.spec.invariants import check_step

    config = CONFIG.with_changes(num_speculative_tokens=2)
    before = SchedulerState(step=5, running=("a", "d"), requests={"a": _running("a", (0, 1)), "d": _running("d", (2, 3))},
                            free_block_ids=(4, 5, 6, 7), num_requests_added=2)
    d = attrs.evolve(before.requests["d"], output_token_ids=(21, 30), num_computed_tokens=9)
    after = attrs.evolve(before, step=6, requests={**before.requests, "d": d})
    plan = StepPlan(scheduled=(DECODE_A, ScheduledRequest("d", 6, 3, (), (), (8, 9))))
    found = [(v.request_id, v.detail) for v in check_step(before, plan, after, config)
             if v.name == "rejected-drafts-uncomputed"]
    assert found == [("d", "computed 9 after verifying 2 drafts and accepting 0: 7 (the 2 rejected are not computed)")]


def _drafting() -> tuple[SchedulerState, object]:
    """Running decodes a (no drafts), e, w, d, f (each verifying drafts 8, 9), speculative decoding on."""
    config = CONFIG.with_changes(num_speculative_tokens=2, num_kv_blocks=16)
    ids = {"a": (0, 1), "e": (2, 3), "w": (4, 5), "d": (6, 7), "f": (8, 9)}
    requests = {r: _running(r, blocks) for r, blocks in ids.items()}
    before = SchedulerState(step=5, running=tuple(ids), requests=requests, free_block_ids=tuple(range(10, 16)),
                            num_requests_added=5)
    return before, config


def _drafts_plan(*ids: str) -> StepPlan:
    return StepPlan(scheduled=(DECODE_A, *(ScheduledRequest(r, 6, 3, (), (), (8, 9)) for r in ids)))


def test_rejected_drafts_uncomputed_judges_each_live_drafting_decode():
    """``rejected_drafts_uncomputed#8, #9, #13, #20, #29, #34``: past an unknown item, one that appended
    nothing (named) and one no longer running, a decode that accepted one draft and computed the rejected one
    is named with the counts."""
    from schedspec.spec.invariants import check_step

    before, config = _drafting()
    ghost = attrs.evolve(_running("ghost", ()), output_token_ids=(21, 30), num_computed_tokens=9)
    requests = {**before.requests, "ghost": ghost,
                "w": attrs.evolve(before.requests["w"], output_token_ids=(21, 30), num_computed_tokens=9),
                "d": attrs.evolve(before.requests["d"], output_token_ids=(21, 8, 30), num_computed_tokens=9)}
    after = attrs.evolve(before, step=6, running=("a", "ghost", "e", "d", "f"), waiting=("w",), requests=requests)
    found = [(v.request_id, v.detail) for v in check_step(before, _drafts_plan("ghost", "e", "w", "d"), after, config)
             if v.name == "rejected-drafts-uncomputed"]
    assert found == [("e", "verified 2 drafts but appended no token"),
                     ("d", "computed 9 after verifying 2 drafts and accepting 1: 8 (the 1 rejected are not computed)")]


def test_accepted_drafts_prefix_judges_a_request_that_ended_in_the_step():
    """``accepted_drafts_prefix#3, #7, #11, #19``: past a decode without drafts, an unknown item and one that
    appended nothing, a request that ended in the step is judged from its finished record: its appended
    tokens before the last must be its first drafts."""
    from schedspec.spec.invariants import check_step

    before, config = _drafting()
    ended = attrs.evolve(before.requests["f"], output_token_ids=(21, 99, 30), num_computed_tokens=8,
                         status=RequestStatus.FINISHED_STOPPED, block_ids=())
    requests = {r: q for r, q in before.requests.items() if r != "f"}
    after = attrs.evolve(before, step=6, running=("a", "e", "w", "d"), requests=requests, finished={"f": ended})
    found = [(v.request_id, v.detail) for v in check_step(before, _drafts_plan("ghost", "e", "f"), after, config)
             if v.name == "accepted-drafts-prefix"]
    assert found == [("f", "appended [99, 30]: the tokens before the last are not the first of its drafts [8, 9]")]


def test_accepted_drafts_prefix_counts_and_cuts_the_appended_tokens_at_a_stop():
    """``accepted_drafts_prefix#20-#57``, one decode per case, each verifying drafts 8, 9: x appends 4 tokens
    (too many); y's first is not its first draft; z appends both drafts and a token (legal); m reaches
    max_tokens at its second token and keeps a third; n reaches it at its last and goes on. Each breach is
    named, and the check goes on to the next decode."""
    from schedspec.spec.invariants import check_step
    from schedspec.spec.transitions import stop_reason

    config = CONFIG.with_changes(num_speculative_tokens=2, num_kv_blocks=16)
    ids = {"x": (0, 1), "y": (2, 3), "z": (4, 5), "m": (6, 7), "n": (8, 9)}
    requests = {r: _running(r, blocks) for r, blocks in ids.items()}
    requests["z"] = attrs.evolve(requests["z"], max_tokens=10)
    requests["m"] = attrs.evolve(requests["m"], max_tokens=3)
    requests["n"] = attrs.evolve(requests["n"], max_tokens=3)
    before = SchedulerState(step=5, running=tuple(ids), requests=requests, free_block_ids=tuple(range(10, 16)),
                            num_requests_added=5)
    appended = {"x": (8, 9, 30, 31), "y": (7, 30), "z": (8, 9, 30), "m": (8, 9, 30), "n": (8, 30)}
    after = attrs.evolve(before, step=6, requests={
        r: attrs.evolve(q, output_token_ids=q.output_token_ids + appended[r]) for r, q in requests.items()})
    plan = StepPlan(scheduled=tuple(ScheduledRequest(r, 6, 3, (), (), (8, 9)) for r in ids))
    found = [(v.request_id, v.detail) for v in check_step(before, plan, after, config) if v.name == "accepted-drafts-prefix"]
    length = stop_reason(attrs.evolve(requests["m"], output_token_ids=(21, 8, 9)), config)[1]
    assert found == [
        ("x", "appended 4 tokens after verifying 2 drafts"),
        ("y", "appended [7, 30]: the tokens before the last are not the first of its drafts [8, 9]"),
        ("m", f"token 2 of the 3 appended stops it ({length}), but the tokens after it were kept"),
        ("n", f"its last appended token stops it ({length}), but it goes on")]


def test_queue_and_lost_request_invariants_say_which_queue_and_what_is_wrong():
    """``queues_disjoint#1-#24``, ``no_request_lost#7-#15``, ``check_step#34``: duplicates named with their
    queue, an id in both queues, a live request in no queue, a queued id that is not live, one both live and
    terminal; a terminal set given apart is the one judged (``check_state`` and ``check_step``)."""
    from schedspec.spec.invariants import check_state, check_step

    a, b = _running("a", (0, 1)), _fresh("b", 3, arrival_step=0)
    dup = SchedulerState(waiting=("b", "b", "a"), running=("a", "a"), requests={"a": a, "b": b},
                         free_block_ids=(2, 3, 4, 5, 6, 7), num_requests_added=2)
    assert sorted(_invariant(dup, "queues-disjoint")) == [
        ("a", "2 times in running"), ("a", "both waiting and running"), ("a", "in waiting with status running"),
        ("b", "2 times in waiting")]
    lost = SchedulerState(waiting=("ghost",), running=("a",), requests={"a": a, "b": b}, finished={"a": a},
                          free_block_ids=(2, 3, 4, 5, 6, 7), num_requests_added=3)
    assert sorted(d for _, d in _invariant(lost, "no-request-lost")) == [
        "both live and terminal", "live but in neither waiting nor running", "queued but not a live request"]
    state = SchedulerState(running=("a",), requests={"a": a}, free_block_ids=(2, 3, 4, 5, 6, 7), num_requests_added=1)
    apart = {"z": _fresh("z", 3)}  # "terminal" but waiting
    judged = [(v.request_id, v.detail) for v in check_state(state, CONFIG, apart) if v.name == "queues-disjoint"]
    assert judged == [("z", "in finished with status waiting")]
    after = attrs.evolve(state, step=1)
    judged = [(v.request_id, v.detail) for v in check_step(state, StepPlan(), after, CONFIG, apart)
              if v.name == "queues-disjoint"]
    assert judged == [("z", "in finished with status waiting")]


def test_prefix_ref_counts_compare_every_block_counted_or_held():
    """``prefix_ref_counts#8-#25``: a held block without a count, a count above the tables holding it, a count
    for a block no table holds are each named with both numbers; a count of 0 for a block no table holds is
    right."""
    from schedspec.spec.prefix_cache import PrefixCache

    cache = PrefixCache(ref_counts={1: 2, 5: 1, 6: 0})
    state = SchedulerState(running=("a",), requests={"a": _running("a", (0, 1))}, free_block_ids=(2, 3, 4, 5, 6, 7),
                           num_requests_added=1, prefix_cache=cache)
    assert _invariant(state, "prefix-ref-counts") == [
        (None, "block 0 has reference count 0 but 1 block tables hold it"),
        (None, "block 1 has reference count 2 but 1 block tables hold it"),
        (None, "block 5 has reference count 1 but 0 block tables hold it")]


def test_output_bound_judges_a_terminal_set_given_apart():
    """``output_bound#2``: the terminal requests given apart (the incremental checker's) are judged."""
    from schedspec.spec.invariants import check_state

    state = SchedulerState(running=("a",), requests={"a": _running("a", (0, 1))}, free_block_ids=(2, 3, 4, 5, 6, 7),
                           num_requests_added=1)
    long = attrs.evolve(_running("z", ()), output_token_ids=(1, 2, 3, 4, 5), status=RequestStatus.FINISHED_LENGTH)
    found = [(v.request_id, v.detail) for v in check_state(state, CONFIG, {"z": long}) if v.name == "output-bound"]
    assert found == [("z", "5 outputs > max_tokens=4")]


def test_prefix_block_partition_names_a_block_twice_in_the_free_queue():
    """``prefix_block_partition#6, #7``: with prefix caching, a block twice in the free queue is named."""
    from schedspec.spec.prefix_cache import PrefixCache

    state = SchedulerState(running=("a",), requests={"a": _running("a", (0, 1))},
                           free_block_ids=(2, 3, 3, 4, 5, 6, 7), num_requests_added=1,
                           prefix_cache=PrefixCache(ref_counts={0: 1, 1: 1}))
    assert [d for _, d in _invariant(state, "prefix-block-partition")] == ["block 3 is 2 times in the free queue"]


def test_state_invariant_codes_name_the_case():
    """``check_state#10-#23``: a terminal request that still owns blocks is ``block-conservation`` with the
    code ``block-conservation:terminal-owns-blocks``; a count that does not add up has the plain code."""
    from schedspec.spec.invariants import check_state

    ended = attrs.evolve(_running("z", (2,)), status=RequestStatus.FINISHED_STOPPED)
    state = SchedulerState(running=("a",), requests={"a": _running("a", (0, 1))}, finished={"z": ended},
                           free_block_ids=(3, 4, 5, 6, 7), num_requests_added=2)
    codes = sorted((v.request_id or "", v.code) for v in check_state(state, CONFIG) if v.name == "block-conservation")
    assert codes == [("", "block-conservation"), ("z", "block-conservation:terminal-owns-blocks")]


def test_prefix_block_partition_counts_free_evictable_and_held_blocks():
    """``prefix_block_partition#8-#24``: a held block in the free queue is named; a count of 0 is not held;
    the sum names free (in the queue, no hash), evictable (in the queue, hashed) and held (not in the queue)."""
    from schedspec.spec.prefix_cache import PrefixCache

    cache = PrefixCache(block_hashes={2: "h2"}, hash_to_blocks={"h2": (2,)}, ref_counts={0: 1, 1: 1, 6: 1, 5: 0})
    state = SchedulerState(running=("a",), requests={"a": _running("a", (0, 1))}, free_block_ids=(2, 3, 4, 5, 6),
                           num_requests_added=1, prefix_cache=cache)
    assert [d for _, d in _invariant(state, "prefix-block-partition")] == [
        "block 6 is in the free queue with reference count 1",
        "free 4 + evictable 1 + held 2 blocks != num_kv_blocks=8"]


def test_released_and_draft_invariants_judge_each_request():
    """``released_holds_no_reference#3-#6``: a waiting request holding blocks is named (after an unknown id);
    ``drafts_on_running_decodes#2-#9``: drafts on a request that is not a running decode, and more than
    ``num_speculative_tokens`` on one, are named; exactly that many is allowed; a request without drafts is
    passed over."""
    from schedspec.spec.invariants import check_state
    from schedspec.spec.prefix_cache import PrefixCache

    held = attrs.evolve(_fresh("w", 3, arrival_step=0), block_ids=(2,))
    state = SchedulerState(running=("a",), waiting=("ghost", "w"), requests={"a": _running("a", (0, 1)), "w": held},
                           free_block_ids=(3, 4, 5, 6, 7), num_requests_added=2,
                           prefix_cache=PrefixCache(ref_counts={0: 1, 1: 1}))
    assert _invariant(state, "released-holds-no-reference") == [("w", "waiting but holds 1 blocks")]
    config = CONFIG.with_changes(num_speculative_tokens=2, num_kv_blocks=16)
    requests = {"plain": _running("plain", (0, 1)), "two": attrs.evolve(_running("two", (2, 3)), spec_token_ids=(5, 6)),
                "three": attrs.evolve(_running("three", (4, 5)), spec_token_ids=(5, 6, 7)),
                "prefill": attrs.evolve(_running("prefill", (6, 7), computed=2), output_token_ids=(),
                                        spec_token_ids=(5,)),
                "waiting": attrs.evolve(_fresh("waiting", 3, arrival_step=0), spec_token_ids=(5,))}
    drafted = SchedulerState(running=("plain", "two", "three", "prefill"), waiting=("waiting",), requests=requests,
                             free_block_ids=tuple(range(8, 16)), num_requests_added=5)
    found = sorted((v.request_id, v.detail) for v in check_state(drafted, config) if v.name == "drafts-on-running-decodes")
    assert found == [("prefill", "holds 1 drafts but is not a running decode (running)"),
                     ("three", "holds 3 drafts > num_speculative_tokens=2"),
                     ("waiting", "holds 1 drafts but is not a running decode (waiting)")]


# --- spec/prefix_cache.py (issue 28: survivors of scripts/mutmut.sh prefix_cache) ----------------------------


def _published_cache():
    """A cache where blocks 0 and 1 carry the hashes of a 2-block prompt's blocks, block 0 held by one table,
    block 1 evictable (count 0, in the free queue); the free queue is (2, 3, 1)."""
    from schedspec.spec.prefix_cache import ROOT_HASH, CacheUpdate, PrefixCache, request_block_hash

    request = Request("p", 0, tuple(range(8)), max_tokens=2)
    first = request_block_hash(request, 0, ROOT_HASH, 4)
    second = request_block_hash(request, 1, first, 4)
    cache = PrefixCache({0: first, 1: second}, {first: (0,), second: (1,)}, {0: 1})
    return CacheUpdate(cache, (2, 3, 1)), request


def test_a_block_is_evictable_only_published_and_held_by_no_table():
    """``PrefixCache.is_evictable`` (``#1``, ``#4``): published with count 0 (block 1) yes; published and held
    (block 0), or never published (block 2), no."""
    update, _ = _published_cache()
    cache = update.freeze_cache()
    assert [cache.is_evictable(b) for b in (0, 1, 2, 3)] == [False, True, False, False]


def test_a_cloned_working_copy_is_independent_of_its_source():
    """``CacheUpdate.clone`` (``#1-#4``: a policy trying a choice out): the clone starts as the source is now,
    free queue and cache, and edits of either leave the other as it was."""
    update, request = _published_cache()
    update.touch((1,))  # a hit on the evictable block: out of the free queue, count 1
    clone = update.clone()
    assert clone.free == [2, 3] and clone.freeze() == update.freeze()
    assert clone.longest_hit(request, 4) == update.longest_hit(request, 4) == (0,)  # (num_tokens - 1) // 4 = 1 block
    clone.take((2,))
    clone.release((0,))
    assert update.free == [2, 3] and update.ref_counts == {0: 1, 1: 1}
    assert clone.free == [3, 0] and dict(clone.ref_counts) == {1: 1, 2: 1}
    update.take_front(2)
    assert clone.free == [3, 0]


def test_a_hit_counts_its_blocks_in_the_free_queue_against_the_free_blocks():
    """``CacheUpdate.num_evictable`` (``#1-#3``) and ``available``: of a hit's blocks, those with no reference
    (evictable block 1, and block 2, free) leave the free queue; block 0, held, does not. ``available`` is the
    free queue's length, evictable blocks included."""
    update, _ = _published_cache()
    assert update.num_evictable((0, 1, 2)) == 2
    assert update.num_evictable((0,)) == 0 and update.num_evictable(()) == 0
    assert update.available == 3
    update.touch((1,))
    assert update.num_evictable((0, 1, 2)) == 1 and update.available == 2


def test_the_blocks_evicted_in_a_step_are_those_handed_out_that_carried_a_hash():
    """``evicted_blocks`` (``#1``: the test inverted): of the blocks handed out, in their order, those published
    before the step (the record's ``blocks_evicted``)."""
    from schedspec.spec.prefix_cache import evicted_blocks

    update, _ = _published_cache()
    cache = update.freeze_cache()
    assert evicted_blocks(cache, (2, 1, 3, 0)) == [1, 0]
    assert evicted_blocks(cache, (2, 3)) == []


@pytest.mark.parametrize("prompt_len, block_size, blocks", [(1, 1, 0), (2, 1, 1), (4, 4, 0), (5, 4, 1), (9, 4, 2)])
def test_a_hit_leaves_at_least_the_last_token_to_compute(prompt_len, block_size, blocks):
    """``max_hit_blocks`` (``#8``: ``max(num_tokens - 1, 1)``): a 1-token prompt with 1-token blocks gets no hit
    (a hit of its only block would leave no token to compute, and no logits to sample from); otherwise
    ``(num_tokens - 1) // block_size`` blocks."""
    from schedspec.spec.prefix_cache import max_hit_blocks

    assert max_hit_blocks(Request("p", 0, tuple(range(prompt_len)), max_tokens=1), block_size) == blocks


def test_taking_blocks_from_anywhere_in_the_free_queue_removes_exactly_them():
    """``CacheUpdate.take`` (``#3``, ``#5-#7``: the fast path taken for blocks that are not the queue's front, or
    the general path broken): blocks handed out from the middle or the back leave the queue and nothing else
    does; a block taken from the front too; each gets count 1, and a published one loses its hash (evicted)."""
    update, _ = _published_cache()  # free queue (2, 3, 1); block 1 evictable
    update.take((3,))
    assert update.free == [2, 1] and update.ref_counts[3] == 1
    update.take((1,))
    assert update.free == [2] and update.evicted == [1] and 1 not in update.block_hashes
    update.take((2,))
    assert update.free == [] and update.ref_counts[2] == 1


def test_a_hit_skips_the_blocks_it_is_told_to_exclude():
    """``PrefixCache.longest_hit`` (``#22``: ``excluded`` not passed on): with two published copies of a block,
    the hit takes the first not excluded (blocks handed out earlier in the same step are evicted)."""
    from schedspec.spec.prefix_cache import ROOT_HASH, PrefixCache, request_block_hash

    request = Request("p", 0, tuple(range(8)), max_tokens=2)
    first = request_block_hash(request, 0, ROOT_HASH, 4)
    cache = PrefixCache({0: first, 5: first}, {first: (0, 5)}, {})
    assert cache.longest_hit(request, 4) == (0,)
    assert cache.longest_hit(request, 4, excluded=frozenset({0})) == (5,)
    assert cache.longest_hit(request, 4, excluded=frozenset({0, 5})) == ()


def test_a_frozen_cache_cannot_be_written():
    """``CacheUpdate.freeze_cache`` (``#4``, ``#8``, ``#12``: the working copy's dicts handed out as they are): the
    cache it returns is read-only in each mapping it changed, so no later write can alter a state's cache."""
    update, _ = _published_cache()
    update.take((2,))  # a count written
    update.publish(Request("q", 0, tuple(range(100, 108)), max_tokens=1), (2,), 4, 4)  # a hash and a listing written
    cache = update.freeze_cache()
    for mapping, key, value in ((cache.ref_counts, 2, 5), (cache.block_hashes, 2, "x"), (cache.hash_to_blocks, "x", (2,))):
        with pytest.raises(TypeError):
            mapping[key] = value


def test_a_block_hash_is_the_chained_hash_of_its_tokens_for_any_parent_block_size_and_adapter():
    """``request_block_hash`` (``#8``, ``#14``, ``#20``, ``#21``: its memo keyed without the block size and index,
    or used for another parent; the LoRA key put into every block, or into a request without an adapter): block
    ``i`` hashes its own tokens after the parent given, whatever was asked of the same request before; only the
    first block of a request with an adapter carries the adapter's key."""
    from schedspec.spec.prefix_cache import ROOT_HASH, block_hash, request_block_hash

    tokens = tuple(range(40, 56))
    plain = Request("p", 0, tokens, max_tokens=1)
    assert request_block_hash(plain, 0, ROOT_HASH, 4) == block_hash(ROOT_HASH, tokens[:4])
    assert request_block_hash(plain, 0, ROOT_HASH, 8) == block_hash(ROOT_HASH, tokens[:8])  # another block size
    first = request_block_hash(plain, 0, ROOT_HASH, 4)
    assert request_block_hash(plain, 1, first, 4) == block_hash(first, tokens[4:8])
    assert request_block_hash(plain, 1, "f" * 32, 4) == block_hash("f" * 32, tokens[4:8])  # another parent
    adapter = Request("l", 0, tokens, max_tokens=1, lora_int_id=3)
    assert request_block_hash(adapter, 0, ROOT_HASH, 4) == block_hash(f"{ROOT_HASH}|lora:3", tokens[:4])
    assert request_block_hash(adapter, 1, first, 4) == block_hash(first, tokens[4:8])


def test_block_hash_is_the_documented_blake2b():
    """``block_hash`` (``#11``: another separator) is what its docstring defines, computed here from that text:
    blake2b with a 16-byte digest over the parent hash (ASCII), ``|`` and the token ids as little-endian int64,
    as hex (trace files carry these hashes, so they must not drift)."""
    import hashlib
    import struct

    from schedspec.spec.prefix_cache import block_hash

    parent, tokens = "ab" * 16, (1, 70000, 2**40, 0)
    digest = hashlib.blake2b(parent.encode("ascii") + b"|" + struct.pack("<4q", *tokens), digest_size=16)
    assert block_hash(parent, tokens) == digest.hexdigest()
