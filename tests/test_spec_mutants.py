"""Tests that kill the mutants mutmut found surviving in the spec (issue 28, docs/testing.md "Mutation
score"): each asserts a behaviour of the spec that a surviving mutant changed and no other test pinned.
Grouped by module; each test names the mutants it was written for (``scripts/mutmut.sh`` names)."""

from __future__ import annotations

import attrs
import pytest
from test_rules import CASES, CONFIG, DECODE_A, base_state

from schedspec.spec.request import Request
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
