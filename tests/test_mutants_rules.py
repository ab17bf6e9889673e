"""Tests that kill the mutants of spec/rules.py that survived ``scripts/mutmut.sh rules`` (issue 28, docs/testing.md
"Mutation score"). Each asserts a verdict (which rule fires, for which request), a count the rules compute, or the
numbers and names a breach's detail gives a user, worked out by hand from the state in the comment beside it (not
copied from the code under test). Each test's docstring names the mutants it kills (``scripts/mutmut.sh`` names,
``schedspec.spec.rules.x_FUNCTION__mutmut_N`` shortened to ``FUNCTION#N``; the names are those of the runs at
4458185 and d8abb68, which differ only in ``_window_frees_skipped``, simplified between them).

The states are the small hand-written ones of the rules' own test files (imported from them): test_rules (block
size 4, running ``a`` decoding, waiting ``b``), test_in_flight (a plan made while step 0 ran, ``c`` ended at its
sample), test_kv_cache_groups (block size 2, a full-attention group and a sliding window of 4 tokens),
test_prefix_dedup (SGLang's publication, ``p`` and ``q`` of one 9-token prompt) and test_remote_kv.
"""

from __future__ import annotations

from types import MappingProxyType

import attrs
import pytest
import test_in_flight as flight
import test_kv_cache_groups as groups
import test_limits as limits
import test_prefix_cache as prefix
import test_prefix_dedup as dedup
import test_prefix_groups as prefix_groups
import test_remote_kv as remote
import test_speculative as speculative
from test_rules import CONFIG, DECODE_A, base_state

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.prefix_cache import NULL_BLOCK
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import (
    eligible_when_planned,
    request_when_planned,
    running_when_planned,
    violated_rules,
)
from schedspec.spec.state import InFlightStep, KVLoad, ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.transitions import add_request, apply_plan


def _details(name: str, state: SchedulerState, plan: StepPlan, config: SchedulerConfig) -> list[tuple[str, str]]:
    """``(request_id, detail)`` of each breach of rule ``name``, in the order the rule found them."""
    return [(v.request_id, v.detail) for v in violated_rules(state, plan, config) if v.name == name]


# --- chunk-continues, no-overcompute, preempt-running-only, prefix-hit-at-admission: what the detail says ---


def test_a_chunk_that_starts_elsewhere_names_the_hit_only_when_there_is_one():
    """``_chunk_continues#9-#12``: the detail gives where the chunk starts and the computed tokens, and adds the
    prefix-cache hit (in tokens) only when the item has one: a's decode from 5 (6 computed) says no more; b's
    admission from 0 with a one-block hit (4 tokens) should start at 4."""
    state = base_state()
    assert _details("chunk-continues", state, StepPlan(scheduled=(ScheduledRequest("a", 5, 1),)), CONFIG) == [
        ("a", "chunk starts at 5 but 6 tokens are computed")]
    hit = StepPlan(scheduled=(ScheduledRequest("b", 0, 1, (3,), (2,)),))
    assert _details("chunk-continues", state, hit, CONFIG) == [
        ("b", "chunk starts at 0 but 0 tokens are computed plus a prefix-cache hit of 4")]


def test_overcompute_names_the_drafts_only_when_the_item_verifies_some():
    """``_no_overcompute#10-#13``: a's decode has 1 pending token; 3 tokens without drafts are 2 too many and
    the detail says just the pending count; 4 tokens with 2 drafts (1 + 2 allowed) name the drafts."""
    state = base_state()
    assert _details("no-overcompute", state, StepPlan(scheduled=(ScheduledRequest("a", 6, 3),)), CONFIG) == [
        ("a", "num_tokens=3 > pending tokens=1")]
    drafts = StepPlan(scheduled=(ScheduledRequest("a", 6, 4, spec_token_ids=(7, 8)),))
    assert _details("no-overcompute", state, drafts, CONFIG) == [("a", "num_tokens=4 > pending tokens=1 plus 2 drafts")]


def test_preempt_running_only_says_exactly_what_is_wrong():
    """``_preempt_running#5, #8``: the two breaches' details, word for word (a mutant that wraps them in other
    characters still contains the words)."""
    state = base_state()
    assert _details("preempt-running-only", state, StepPlan(preempted=("b",)), CONFIG) == [
        ("b", "preempted but not running")]
    assert _details("preempt-running-only", state, StepPlan(scheduled=(DECODE_A,), preempted=("a",)), CONFIG) == [
        ("a", "preempted and scheduled in the same step")]


def test_a_hit_for_a_running_request_names_the_blocks_it_reuses():
    """``_prefix_hit_at_admission#9`` (the blocks made ``list(None)``, a crash): p, running after its prefill,
    may not reuse cached block 0 in a decode; the detail names block 0."""
    state = apply_plan(dedup.two_waiting(dedup.VLLM), StepPlan(scheduled=(dedup.P_ITEM,)), {"p": 1}, dedup.VLLM).state
    plan = StepPlan(scheduled=(ScheduledRequest("p", 9, 1, (), (0,)),))
    assert _details("prefix-hit-at-admission", state, plan, dedup.VLLM) == [
        ("p", "reuses cached blocks [0] while already running")]


# --- the view of the planner with a step in flight (asynchronous scheduling) --------------------------------


def test_the_requests_eligible_when_planned_count_the_ended_and_leave_out_the_arrivals():
    """``eligible_when_planned#4, #7, #8, #14``: step 1 planned while step 0 ran saw a (running), b (waiting) and
    c (ended at step 0's sample since): 3; b arriving before step 1 came after the plan: 2 (a, c); without a step
    in flight a and b: 2; a plan that rejects b: 2."""
    state = flight.in_flight_state()
    assert eligible_when_planned(state, StepPlan()) == 3
    assert eligible_when_planned(flight.in_flight_state(b_arrival=1), StepPlan()) == 2
    assert eligible_when_planned(attrs.evolve(state, in_flight=None), StepPlan()) == 2
    assert eligible_when_planned(state, StepPlan(rejected=(("b", "x"),))) == 2


def test_the_adaptive_long_prefill_threshold_counts_the_requests_eligible_when_planned():
    """``_long_prefill#2`` (the count made ``None``) and the count's effect on the verdict: threshold 2, adaptive,
    budget 16: 3 eligible (a, b, c) floor it at 16 // 3 = 5, so b's 5-token chunk is allowed; b arriving after
    the plan leaves 2 eligible, floor 8, allowed too; without c (no step in flight) a and b: 8. A 6-token chunk
    is over 5 with c counted."""
    config = flight.CONFIG.with_changes(long_prefill_token_threshold=2, long_prefill_token_threshold_adaptive=True,
                                        max_num_batched_tokens=16)
    state = flight.in_flight_state()
    five = StepPlan(scheduled=(flight.DECODE_A, ScheduledRequest("b", 0, 5, (2, 3))))
    assert _details("long-prefill-threshold", state, five, config) == []
    six = attrs.evolve(state, requests={**state.requests, "b": Request("b", 0, tuple(range(31, 37)), max_tokens=3)})
    plan = StepPlan(scheduled=(flight.DECODE_A, ScheduledRequest("b", 0, 6, (2, 3))))
    assert _details("long-prefill-threshold", six, plan, config) == [
        ("b", "chunk of 6 tokens > long_prefill_token_threshold=5")]
    assert _details("long-prefill-threshold", attrs.evolve(six, in_flight=None), plan, config) == []


def test_the_planner_saw_an_ended_request_running_with_the_blocks_it_held():
    """``running_when_planned#3``, ``request_when_planned#5, #6, #8``: c ended at step 0's sample holding blocks
    6 and 7 (free now): the planner saw it running with them, and its table as 2 blocks; a live request is seen
    as it is; an id never added is no request."""
    state = flight.in_flight_state()
    assert running_when_planned(state) == (frozenset({"a", "c"}), frozenset({6, 7}))
    assert running_when_planned(attrs.evolve(state, in_flight=None)) == (frozenset({"a"}), frozenset())
    assert request_when_planned(state, "c") == (state.in_flight.ended["c"], 2)
    assert request_when_planned(state, "a") == (state.requests["a"], 2)
    assert request_when_planned(state, "ghost") is None


def test_a_wasted_item_is_judged_against_the_table_its_request_held():
    """``request_when_planned#5, #6, #8`` through the rules: c's wasted decode (7 computed, 8 tokens) with a new
    block holds 3 blocks as planned, more than the 2 its 8 tokens need (``no-excess-blocks``); without a new
    block it is allowed."""
    state = flight.in_flight_state()
    extra = StepPlan(scheduled=(flight.DECODE_A, ScheduledRequest("c", 7, 1, (2,))))
    assert _details("no-excess-blocks", state, extra, flight.CONFIG) == [("c", "3 blocks > 2 for a sequence of 8 tokens")]
    assert violated_rules(state, StepPlan(scheduled=(flight.DECODE_A, flight.WASTED_C)), flight.CONFIG) == []


def test_a_wasted_item_may_verify_its_drafts():
    """``_wasted_item_continues#6`` (the drafts subtracted from the pending tokens): c's wasted decode from 7 has
    1 pending token plus the 2 drafts it verifies: 3 tokens are allowed, 4 are not."""
    state = flight.in_flight_state()
    three = StepPlan(scheduled=(flight.DECODE_A, ScheduledRequest("c", 7, 3, spec_token_ids=(5, 6))))
    assert _details("wasted-item-continues", state, three, flight.CONFIG) == []
    four = StepPlan(scheduled=(flight.DECODE_A, ScheduledRequest("c", 7, 4, spec_token_ids=(5, 6))))
    assert _details("wasted-item-continues", state, four, flight.CONFIG) == [("c", "wasted chunk of 4 tokens of 3 pending")]


def _ended(request_id: str, reason: str, max_tokens: int, prompt_len: int = 6) -> Request:
    """A request that ended at step 0's sample with two outputs (``prompt_len`` + 2 tokens)."""
    status = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
              "abort": RequestStatus.FINISHED_ABORTED}[reason]
    return Request(request_id, 0, tuple(range(40, 40 + prompt_len)), max_tokens=max_tokens, status=status,
                   finish_reason=reason, num_computed_tokens=prompt_len + 1, output_token_ids=(51, 52), admitted_step=0,
                   first_token_step=0)


def _flight_with(*ended: Request, placeholders: dict[str, int] | None = None,
                 freed: dict[str, tuple[int, ...]] | None = None) -> SchedulerState:
    """Step 1 planned while step 0 ran: a running (one placeholder), the ``ended`` requests ended at its sample
    (one placeholder each unless ``placeholders`` says otherwise), the blocks they held ``freed`` (none unless
    given: free now all the same)."""
    counts = placeholders if placeholders is not None else {"a": 1, **{r.request_id: 1 for r in ended}}
    in_flight = InFlightStep(0, StepPlan(), MappingProxyType(counts), MappingProxyType({r.request_id: r for r in ended}),
                             MappingProxyType(freed or {}))
    return SchedulerState(step=1, running=("a",), requests={"a": flight.running_a()},
                          finished={r.request_id: r for r in ended}, free_block_ids=(2, 3, 4, 5, 6, 7),
                          num_requests_added=1 + len(ended), in_flight=in_flight)


def test_foreseen_length_names_the_limit_and_the_placeholders():
    """``_in_flight_foreseen_length#17, #18, #23-#25``: c's one placeholder of step 0 brought it to max_tokens=2;
    d's (8 tokens, max_tokens 5) to max_model_len=8."""
    state = _flight_with(_ended("c", "length", 2))
    plan = StepPlan(scheduled=(flight.DECODE_A, ScheduledRequest("c", 7, 1)))
    assert _details("in-flight-foreseen-length", state, plan, flight.CONFIG) == [
        ("c", "scheduled although its 1 output placeholder(s) of step 0 bring it to max_tokens=2")]
    config = flight.CONFIG.with_changes(max_model_len=8)
    state = _flight_with(_ended("d", "length", 5))
    plan = StepPlan(scheduled=(flight.DECODE_A, ScheduledRequest("d", 7, 1)))
    assert _details("in-flight-foreseen-length", state, plan, config) == [
        ("d", "scheduled although its 1 output placeholder(s) of step 0 bring it to max_model_len=8")]


def test_foreseen_length_reaches_max_model_len_exactly_and_judges_every_wasted_item():
    """``_in_flight_foreseen_length#14`` (``>=`` made ``>``): d's 8 tokens are max_model_len=8 exactly, foreseen;
    ``#15`` (``continue`` made ``break``): e, first in the batch, stopped on an end-of-sequence token the
    planner could not foresee (max_tokens 5), which does not hide d after it."""
    config = flight.CONFIG.with_changes(max_model_len=8)
    state = _flight_with(_ended("e", "stop", 5, prompt_len=4), _ended("d", "length", 5))
    plan = StepPlan(scheduled=(ScheduledRequest("e", 5, 1), ScheduledRequest("d", 7, 1), flight.DECODE_A))
    assert [r for r, _ in _details("in-flight-foreseen-length", state, plan, config)] == ["d"]


def test_foreseen_length_counts_no_placeholder_for_a_request_the_step_did_not_sample():
    """``_in_flight_foreseen_length#19-#22``: a placeholder count missing from the in-flight step (a hand-made
    record: c sampled nothing there) reads as 0 in the detail, not 1 or ``None``."""
    state = _flight_with(_ended("c", "length", 2), placeholders={"a": 1})
    plan = StepPlan(scheduled=(flight.DECODE_A, ScheduledRequest("c", 7, 1)))
    assert _details("in-flight-foreseen-length", state, plan, flight.CONFIG) == [
        ("c", "scheduled although its 0 output placeholder(s) of step 0 bring it to max_tokens=2")]


def test_an_abort_is_never_foreseen_even_of_a_prompt_of_max_model_len():
    """``_in_flight_foreseen_length#10, #11`` (the ``"abort"`` compared made another word): d's prompt is exactly
    max_model_len=8 tokens (allowed: it samples its one token); its first chunk of 4 was in flight when the
    client aborted it. Its 8 tokens are max_model_len, but the planner could not foresee the abort: the next
    chunk of 4 is wasted work, allowed (vLLM plans it: its guard reads placeholders, and d has none)."""
    config = flight.CONFIG.with_changes(max_model_len=8)
    d = Request("d", 0, tuple(range(40, 48)), max_tokens=3, status=RequestStatus.FINISHED_ABORTED,
                finish_reason="abort", num_computed_tokens=4, admitted_step=0)
    state = _flight_with(d, placeholders={"a": 1}, freed={"d": (6, 7)})
    plan = StepPlan(scheduled=(flight.DECODE_A, ScheduledRequest("d", 4, 4)))
    assert violated_rules(state, plan, config) == []


# --- KV connector loads ---------------------------------------------------------------------------------------


def test_load_blocks_exact_judges_the_load_after_one_for_an_unknown_request():
    """``_load_blocks_exact#2`` (``continue`` made ``break``): a load for an id never added (known-requests names
    it) first does not hide r's load of 8 tokens taking 3 blocks (2 hold them)."""
    state, bad, _, config = remote.case_load_blocks_exact()
    padded = attrs.evolve(bad, loads=(KVLoad("ghost", 4, (5,)), *bad.loads))
    assert _details("load-blocks-exact", state, padded, config) == [("r", "load of 8 tokens takes 3 blocks, not 2")]


# --- SGLang's publication: which blocks an item has computed -------------------------------------------------


def test_a_deduplication_is_judged_on_the_blocks_the_item_computed():
    """``_publication_end#1-#5``: q's whole prompt (9 tokens) fills blocks 0 and 1, so both may be replaced by
    p's twins; a first chunk of 5 tokens fills block 0 only, so de-duplicating block 1 of its table (block 4) is
    refused as not full and computed, and block 0 (block 3) is allowed."""
    state = dedup.two_waiting()
    assert _details("deduplicate-at-publication", state, StepPlan(scheduled=(dedup.P_ITEM, dedup.Q_DEDUP)),
                    dedup.SGLANG) == []
    chunk = StepPlan(scheduled=(dedup.P_ITEM, ScheduledRequest("q", 0, 5, (3, 4), deduplicated_block_ids=((4, 1),))))
    assert _details("deduplicate-at-publication", state, chunk, dedup.SGLANG) == [
        ("q", "de-duplicates block 4 (block 1 of its table), not full and computed")]
    first = StepPlan(scheduled=(dedup.P_ITEM, ScheduledRequest("q", 0, 5, (3, 4), deduplicated_block_ids=((3, 0),))))
    assert _details("deduplicate-at-publication", state, first, dedup.SGLANG) == []


# --- KV cache groups -----------------------------------------------------------------------------------------

THREE_GROUPS = groups.GROUPS + ({"kind": "sliding_window", "sliding_window": 8},)


def _admit_with_hits(config: SchedulerConfig, hits: tuple[tuple[int, ...], ...],
                     new: tuple[tuple[int, ...], ...]) -> tuple[SchedulerState, StepPlan]:
    """w, a fresh 8-token prompt (4 blocks of 2), admitted with a one-block hit in group 0 (block 0) and the
    group hits and new blocks given (group 0 gets blocks 1, 2, 3 and a slot for the 9th token: 4 + 1)."""
    w = Request("w", 0, tuple(range(60, 68)), max_tokens=3)
    state = SchedulerState(step=1, waiting=("w",), requests={"w": w}, free_block_ids=tuple(range(1, 24)),
                           num_requests_added=1)
    item = ScheduledRequest("w", 2, 6, (1, 2, 3), (0,), group_new_block_ids=new, group_cached_block_ids=hits)
    return state, StepPlan(scheduled=(item,))


def test_a_groups_table_counts_its_own_prefix_hit():
    """``_group_hit#2, #4, #6`` and ``_group_table#4, #5``: w (no table yet in any group) is admitted from 2 with
    8 tokens computed after the step: each group needs 4 blocks; group 1's hit of one block plus 3 new covers
    it exactly (no breach of group-table-covers nor group-no-excess-blocks); one more new block is excess (5 >
    4), one fewer leaves 3 < 4."""
    config = groups.CONFIG.with_changes(num_kv_blocks=24)
    state, exact = _admit_with_hits(config, ((10,),), ((11, 12, 13),))
    assert _details("group-table-covers", state, exact, config) == []
    assert _details("group-no-excess-blocks", state, exact, config) == []
    state, excess = _admit_with_hits(config, ((10,),), ((11, 12, 13, 14),))
    assert _details("group-no-excess-blocks", state, excess, config) == [
        ("w", "group 1: 5 blocks > 4 for a sequence of 8 tokens")]
    state, short = _admit_with_hits(config, ((10,),), ((11, 12),))
    assert _details("group-table-covers", state, short, config) == [
        ("w", "group 1: 3 blocks hold fewer than the 4 needed")]


def test_each_group_counts_its_own_hit_not_another_groups():
    """``_group_hit#5`` (group ``index`` read at ``index - 2``): with three groups, a hit of one block in group 1
    and none in group 2 (as if group 2 held no prefix) leaves group 2 with its 3 new blocks only: 3 < 4 needed;
    group 1 (hit + 3 new) is covered."""
    config = groups.CONFIG.with_changes(num_kv_blocks=24, kv_cache_groups=THREE_GROUPS)
    state, plan = _admit_with_hits(config, ((10,), ()), ((11, 12, 13), (14, 15, 16)))
    assert _details("group-table-covers", state, plan, config) == [
        ("w", "group 2: 3 blocks hold fewer than the 4 needed")]


def test_freeing_the_null_block_is_freeing_a_block_it_does_not_hold():
    """``_window_keeps_visible#9``: a's window table holds null entries at indices 0 and 1 (freed earlier); an
    item naming the null block among its frees frees nothing the request holds, even though a null entry sits
    below the window. ``#16`` (``continue`` made ``break``): block 6 after it, at index 2, still attended by
    the token at position 8, is reported too."""
    state = groups.state_of(groups.running_a((NULL_BLOCK, NULL_BLOCK, 6, 7)), free=(4, 5, 8, 9, 10, 11))
    plan = StepPlan(scheduled=(ScheduledRequest("a", 8, 1, (8,), group_new_block_ids=((9,),),
                                                skipped_block_ids=(NULL_BLOCK, 6)),))
    found = _details("window-keeps-visible", state, plan, groups.CONFIG)
    assert [d.split(",")[0] for _, d in found] == [f"frees block {NULL_BLOCK}", "frees block 6 (group 1"]
    assert found[0][1] == f"frees block {NULL_BLOCK}, which it does not hold"


def test_a_block_kept_past_the_window_is_named_with_its_group_and_index():
    """``_window_frees_skipped#16, #18``: a at position 8 (window 4: indices 0 and 1 past it) frees block 5
    (index 1) but keeps block 4, index 0 of group 1."""
    state, bad, _, config = groups.GROUP_RULE_CASES["window-frees-skipped"]()
    assert _details("window-frees-skipped", state, bad, config) == [
        ("a", "keeps 1 block(s) past the window at position 8 (block 4: group 1, index 0)")]



def test_freeing_a_visible_block_names_its_group_index_and_window():
    """``_window_keeps_visible#27-#32``: the detail of a visible block freed says which group and index it is
    at and what that group attends: block 6 is index 2 of the window group (sliding_window=4: only indices 0
    and 1 are past the token at position 8); block 0 is index 0 of the full-attention group, which frees
    nothing."""
    state = groups.state_of()
    plan = StepPlan(scheduled=(ScheduledRequest("a", 8, 1, (8,), group_new_block_ids=((9,),),
                                                skipped_block_ids=(6, 0)),))
    assert _details("window-keeps-visible", state, plan, groups.CONFIG) == [
        ("a", "frees block 6 (group 1, index 2, sliding_window=4), which the token at position 8 still attends "
              "(only the first 2 blocks are past its window)"),
        ("a", "frees block 0 (group 0, index 0, full attention), which the token at position 8 still attends "
              "(only the first 0 blocks are past its window)")]


@pytest.mark.parametrize(("config", "why"), [
    (dedup.VLLM.with_changes(enable_prefix_caching=False), "prefix caching is off"),
    (dedup.VLLM, "prefix_cache_publication is 'vllm', not 'sglang-radix'"),
])
def test_a_deduplication_outside_sglangs_publication_says_which_setting_forbids_it(config, why):
    """``_deduplicate_at_publication#3, #5, #7-#14``: q's de-duplication of blocks 3 and 4 onto p's 0 and 1 is
    SGLang's alone: with prefix caching off the detail says so, with vLLM's publication it names the setting;
    with SGLang's publication the same plan is allowed."""
    state = dedup.two_waiting(config)
    plan = StepPlan(scheduled=(dedup.P_ITEM, dedup.Q_DEDUP))
    assert _details("deduplicate-at-publication", state, plan, config) == [
        ("q", f"de-duplicates [[3, 0], [4, 1]], but {why} (only SGLang's radix cache de-duplicates)")]
    assert _details("deduplicate-at-publication", dedup.two_waiting(), plan, dedup.SGLANG) == []


# --- prefix caching: what a wrong hit is ----------------------------------------------------------------------


def test_a_hit_shorter_than_the_cached_chain_gives_both_lengths_in_tokens():
    """``_prefix_hit_longest`` (the token counts of the detail: blocks times block_size 4): b ignores the 2
    cached blocks (8 tokens) of a's prompt."""
    state, bad, _, config = prefix.PREFIX_RULE_CASES["prefix-hit-longest"]()
    assert _details("prefix-hit-longest", state, bad, config) == [
        ("b", "prefix-cache hit of 0 tokens, but 8 were cached (blocks [0, 1])")]


@pytest.mark.parametrize(("hit", "new", "detail"), [
    ((1, 0), (2,), "hit block 0 is block 1, which caches other tokens"),
    ((5,), (2, 3), "hit block 0 is block 5, which is not cached"),
    ((0, 1), (1,), "hit block 1 is block 1, handed out in the same step"),
    ((0, 2), (3,), "hit block 1 is block 2, which is not cached"),
])
def test_a_hit_that_is_not_the_cached_chain_names_the_first_wrong_block(hit, new, detail):
    """``_prefix_hit_chain``: b's 10-token prompt shares its first 8 tokens (blocks 0 and 1, cached by a) with a;
    each wrong hit is reported once, at its first wrong block, with the block's place in the hit and its id."""
    state = prefix.warm_state()
    plan = StepPlan(scheduled=(ScheduledRequest("b", 4 * len(hit), 10 - 4 * len(hit), new, cached_block_ids=hit),))
    assert _details("prefix-hit-is-cached-chain", state, plan, prefix.CONFIG) == [("b", detail)]


def test_a_hit_past_the_last_token_says_how_many_blocks_may_hit():
    """``_prefix_hit_chain``: c's whole 8-token prompt is cached, but at most (8 - 1) // 4 = 1 block may hit so
    that one token is computed."""
    state = add_request(prefix.warm_state(), Request("c", 1, prefix.A_PROMPT[:8], max_tokens=2))
    plan = StepPlan(scheduled=(ScheduledRequest("c", 8, 0, (), cached_block_ids=(0, 1)),))
    assert _details("prefix-hit-is-cached-chain", state, plan, prefix.CONFIG) == [
        ("c", "hit of 2 blocks, but at most 1 may hit so that one of its 8 tokens is computed")]


def _queued(request: Request) -> SchedulerState:
    """Step 1 with ``request`` in the waiting queue, every block free (test_remote_kv's config)."""
    return SchedulerState(step=1, waiting=(request.request_id,), requests={request.request_id: request},
                          free_block_ids=tuple(range(8)), num_requests_added=1)


@pytest.mark.parametrize(("status", "words"), [
    (RequestStatus.PREEMPTED, "status preempted, admitted at step 0"),
    (RequestStatus.WAITING, "status waiting, admitted at step 0"),
])
def test_a_load_for_a_request_admitted_before_names_its_status_and_admission(status, words):
    """``_load_as_offered#4, #5, #8, #9``: r offers 8 tokens (2 blocks) but was admitted at step 0 (preempted
    since, or re-queued waiting): vLLM asks the connector only for a request that has computed nothing, so a
    load is refused, naming the status and the admission step, also after a load for an unknown id."""
    state = _queued(remote.fresh(status=status, admitted_step=0))
    plan = StepPlan(loads=(KVLoad("ghost", 4, (5,)), KVLoad("r", 8, (0, 1))))
    assert _details("load-as-offered", state, plan, remote.CONFIG) == [("r", f"load started for a request with {words}")]
    assert _details("load-as-offered", _queued(remote.fresh()), plan, remote.CONFIG) == []


def test_a_second_load_while_the_first_is_in_flight_names_the_status_alone():
    """``_load_as_offered#10-#12``: r waits for its remote KV (loaded at step 0, never admitted): a second load
    is refused naming its status, with no admission step (it has none)."""
    state = remote.loading()
    assert _details("load-as-offered", state, remote.LOAD, remote.CONFIG) == [
        ("r", "load started for a request with status waiting_for_remote_kvs")]


def test_a_load_of_no_tokens_is_refused_even_when_nothing_is_offered():
    """``_load_as_offered#18`` (``0 <`` made ``0 <=``): r's connector offers nothing (0 tokens); a load of 0
    tokens matches the offer but loads nothing: refused."""
    state = _queued(remote.fresh(num_external_computed_tokens=0))
    plan = StepPlan(loads=(KVLoad("r", 0, ()),))
    assert _details("load-as-offered", state, plan, remote.CONFIG) == [
        ("r", "load of 0 tokens, but the connector offers 0 of a 10-token sequence")]


def test_a_block_of_a_groups_hit_handed_out_in_the_same_step_is_the_named_case():
    """``blocks_not_from_free_pool#8`` (the group hits' filter made ``== NULL_BLOCK``): w's hit in the window
    group reuses block 10, and the same item hands block 10 out as a new block of that group: the case
    ``reused-by-hit-in-step`` of blocks-from-free-pool, although block 10 is in the free queue."""
    config = groups.CONFIG.with_changes(num_kv_blocks=24)
    state, plan = _admit_with_hits(config, ((10,),), ((10, 12, 13),))
    found = [(v.request_id, v.code) for v in violated_rules(state, plan, config) if v.name == "blocks-from-free-pool"]
    assert found == [("w", "blocks-from-free-pool:reused-by-hit-in-step")]


@pytest.mark.parametrize(("interval", "since"), [(3, 1), (2, 0)])
def test_a_held_step_names_the_steps_since_the_last_prefill_and_the_interval(interval, since):
    """``_prefill_cadence#3`` (the interval's gate made ``<= 2``) and ``#9, #10, #12`` (the count made ``None``):
    a decodes, and ``since`` + 1 executed steps separate this step from the last prefill, fewer than the
    interval: held, so admitting b (8 tokens) is refused, naming the count and the interval."""
    config = limits.CONFIG.with_changes(prefill_schedule_interval=interval)
    state = limits._held_state(since, False, limits._running_a())
    plan = StepPlan(scheduled=(ScheduledRequest("a", 4, 1), ScheduledRequest("b", 0, 8, (4, 5))))
    assert _details("prefill-cadence", state, plan, config) == [
        ("b", f"a prefill of 8 tokens on a held step ({since} executed steps since the last prefill, "
              f"prefill_schedule_interval={interval})")]


def test_drafts_past_max_model_len_name_the_last_position_computed():
    """``_drafts_within_max_model_len#6`` (the position made ``computed - tokens``): a from 5 computes 4 tokens
    (its pending token and 3 drafts), positions up to 9; with the token after them that passes
    max_model_len=9."""
    state, bad, _, config = speculative.case_drafts_within_max_model_len()
    assert _details("drafts-within-max-model-len", state, bad, config) == [
        ("a", "computes positions up to 9 with 3 drafts: its drafts and the token after them pass max_model_len=9")]


def test_a_load_takes_only_free_blocks_and_each_once():
    """``blocks_not_from_free_pool#37, #38`` (the loads' checks): r's load of 8 tokens may not take block 2, which
    a holds (not free, not released), nor block 0 twice."""
    a = Request("a", 0, (1, 2, 3), max_tokens=2, status=RequestStatus.RUNNING, num_computed_tokens=3, block_ids=(2,),
                admitted_step=0)
    r = remote.fresh()
    state = SchedulerState(step=1, waiting=("r",), running=("a",), requests={"a": a, "r": r},
                           free_block_ids=(0, 1, 3, 4, 5, 6, 7), num_requests_added=2)
    held = StepPlan(loads=(KVLoad("r", 8, (2, 3)),))
    assert _details("blocks-from-free-pool", state, held, remote.CONFIG) == [("r", "block 2 is not free")]
    twice = StepPlan(loads=(KVLoad("r", 8, (0, 0)),))
    assert _details("blocks-from-free-pool", state, twice, remote.CONFIG) == [("r", "block 0 handed out twice")]


def test_the_longest_hit_with_groups_names_group_0s_blocks():
    """``_prefix_hit_longest#24`` (group 1's hit table named instead of group 0's): a's 8-token prompt is cached
    in both groups (block size 2); b, sharing it, admitted with no hit, is told the 8 tokens of group 0's blocks
    0 to 3 were cached (group 1's table, as long, has null entries below the window)."""
    state = prefix_groups.after_a()
    plan = prefix_groups.admit_b(hit0=(), hit1=(), num_tokens=10)
    assert _details("prefix-hit-longest", state, plan, prefix_groups.CONFIG) == [
        ("b", "prefix-cache hit of 0 tokens, but 8 were cached (blocks [0, 1, 2, 3])")]


def test_the_longest_hit_leaves_out_blocks_handed_out_earlier_in_the_batch():
    """``_prefix_hit_longest#31`` (the blocks handed out earlier not passed): x, first in the batch, takes block 1
    (a's cached block 1, evictable) as a new block; b's lookup comes after its eviction, so b's longest hit is
    block 0 alone: a hit of block 0 is right, one of blocks 0 and 1 is not."""
    state = add_request(prefix.warm_state(), Request("x", 1, (90, 91), max_tokens=2))
    take_1 = ScheduledRequest("x", 0, 2, (1,))
    one = StepPlan(scheduled=(take_1, ScheduledRequest("b", 4, 6, (3, 4), cached_block_ids=(0,))))
    assert _details("prefix-hit-longest", state, one, prefix.CONFIG) == []
    two = StepPlan(scheduled=(take_1, ScheduledRequest("b", 8, 2, (3,), cached_block_ids=(0, 1))))
    assert _details("prefix-hit-longest", state, two, prefix.CONFIG) == [
        ("b", "prefix-cache hit of 8 tokens, but 4 were cached (blocks [0])")]


def _running_prefill_state() -> tuple[SchedulerState, SchedulerConfig]:
    """Speculative decoding (3 drafts at most): p runs a prefill, 4 of its 12 prompt tokens computed, on block 0."""
    cfg = speculative.config()
    p = Request("p", 0, tuple(range(200, 212)), max_tokens=2, status=RequestStatus.RUNNING, num_computed_tokens=4,
                block_ids=(0,), admitted_step=0)
    return SchedulerState(step=1, running=("p",), requests={"p": p}, free_block_ids=tuple(range(1, 16)),
                          num_requests_added=1), cfg


def test_a_running_prefill_carries_no_drafts_even_computing_one_plus_d():
    """``_drafts_only_in_decodes#8`` (``or`` made ``and``): p is running but a prefill: its item may carry no
    drafts, even when it computes 1 + d tokens. ``#6`` (``continue`` made ``break``): an item for an unknown id
    with drafts, and one without drafts, first in the batch do not hide it."""
    state, cfg = _running_prefill_state()
    item = ScheduledRequest("p", 4, 3, (), spec_token_ids=(7, 8))
    for plan in (StepPlan(scheduled=(item,)),
                 StepPlan(scheduled=(ScheduledRequest("ghost", 0, 3, spec_token_ids=(7, 8)), item))):
        assert _details("drafts-only-in-decodes", state, plan, cfg) == [
            ("p", "carries 2 drafts but is not a running decode")]


def test_the_watermark_breach_names_the_running_count_and_the_free_blocks_left():
    """``_watermark#9`` (each running request counted twice): c is admitted while a and b (admitted before it)
    run; 6 free - 3 for b - 2 for c = 1 free block left, below the watermark's 2 (int(0.3 * 9))."""
    state, bad, _, config = limits.case_watermark()
    assert _details("watermark", state, bad, config) == [
        ("c", "admitted while 2 run, leaving 1 free blocks < watermark_blocks=2 (watermark=0.3)")]


@pytest.mark.parametrize(("watermark", "breach"), [(0.5, False), (0.6, True)])
def test_the_watermark_counts_a_live_request_preempted_with_a_step_in_flight(watermark, breach):
    """``_watermark#15, #17`` (a preempted request that freed nothing in flight read as ``None``: a crash): with
    step 0 in flight, the plan preempts a (live: its blocks 0 and 1 are released) and admits b on blocks 2
    and 3; c, ended in flight, still ran when the plan was made. Free: 2, 3, 4, 5 (6 and 7 were c's) + 0, 1 -
    2 = 4: the watermark int(0.5 * 9) = 4 is kept, int(0.6 * 9) = 5 is not."""
    config = flight.CONFIG.with_changes(watermark=watermark, max_num_seqs=3)
    plan = StepPlan(scheduled=(ScheduledRequest("b", 0, 5, (2, 3)),), preempted=("a",))
    expected = [("b", f"admitted while 1 run, leaving 4 free blocks < watermark_blocks=5 (watermark={watermark})")]
    assert _details("watermark", flight.in_flight_state(), plan, config) == (expected if breach else [])


def test_the_watermark_counts_no_free_block_for_a_hit_on_a_block_another_request_holds():
    """``_watermark#51`` (``and`` made ``or``: every hit block counted as leaving the free queue): r runs on block
    0, p on blocks 1 and 2 (cached, held). q hits block 1, which p holds (not in the free queue), and takes 3
    new blocks: 5 free - 3 = 2 left, the watermark (int(0.3 * 9) = 2) kept."""
    config = limits.CONFIG.with_changes(max_num_batched_tokens=32, enable_prefix_caching=True, watermark=0.3)
    state = SchedulerState.initial(config)
    state = add_request(add_request(state, Request("r", 0, (1, 2, 3), max_tokens=4)),
                        Request("p", 0, tuple(range(10, 18)), max_tokens=4))
    first = StepPlan(scheduled=(ScheduledRequest("r", 0, 3, (0,)), ScheduledRequest("p", 0, 8, (1, 2))))
    state = apply_plan(state, first, {"r": 5, "p": 6}, config).state
    state = add_request(state, Request("q", 1, (10, 11, 12, 13, *range(40, 52)), max_tokens=2))
    plan = StepPlan(scheduled=(ScheduledRequest("r", 3, 1), ScheduledRequest("p", 8, 1),
                               ScheduledRequest("q", 4, 12, (3, 4, 5), (1,))))
    assert _details("watermark", state, plan, config) == []
    stricter = config.with_changes(watermark=0.4)  # int(0.4 * 9) = 3 > 2
    assert _details("watermark", state, plan, stricter) == [
        ("q", "admitted while 2 run, leaving 2 free blocks < watermark_blocks=3 (watermark=0.4)")]


@pytest.mark.parametrize(("watermark", "breach"), [(0.34, False), (0.56, True)])
def test_the_watermark_counts_a_block_two_admissions_hit_once(watermark, breach):
    """``_watermark#54`` (the hit blocks not remembered: each hit counted again): a finished, its blocks 0 and 1
    cached and evictable (8 blocks free or evictable). b, then c (the same prompt), hit both and take one new
    block each: 8 - 2 (the hit, once) - 2 = 4 free after c, admitted while b runs: the watermark int(0.34 * 9) =
    3 is kept, int(0.56 * 9) = 5 is not."""
    config = prefix.CONFIG.with_changes(watermark=watermark)
    state = add_request(prefix.warm_state(), Request("c", 1, prefix.B_PROMPT, max_tokens=3))
    plan = StepPlan(scheduled=(prefix.HIT_B, ScheduledRequest("c", 8, 2, (3,), cached_block_ids=(0, 1))))
    expected = [("c", f"admitted while 1 run, leaving 4 free blocks < watermark_blocks=5 (watermark={watermark})")]
    assert _details("watermark", state, plan, config) == (expected if breach else [])


def test_the_watermark_binds_admissions_only_not_a_running_decode():
    """``_watermark#58`` (``or`` made ``and``: a running request judged as an admission): a runs on blocks 0 and 1
    with 6 blocks free, fewer than the watermark's int(0.8 * 9) = 7; its decode takes block 2 (5 left): vLLM
    adds the watermark only for a request in WAITING or PREEMPTED, so the decode is allowed; admitting b (one
    block) is not."""
    state, _, _, config = limits.case_watermark()
    config = config.with_changes(watermark=0.8)
    decode = ScheduledRequest("a", 4, 1, (2,))
    assert _details("watermark", state, StepPlan(scheduled=(decode,)), config) == []
    admit = StepPlan(scheduled=(decode, ScheduledRequest("b", 0, 4, (3,))))
    assert _details("watermark", state, admit, config) == [
        ("b", "admitted while 1 run, leaving 4 free blocks < watermark_blocks=7 (watermark=0.8)")]


@pytest.mark.parametrize(("what", "plan"), [
    ("scheduled", StepPlan(scheduled=(ScheduledRequest("r", 8, 2),))),
    ("preempted", StepPlan(preempted=("r",))),
    ("rejected", StepPlan(rejected=(("r", "x"),))),
])
def test_a_request_waiting_for_its_remote_kv_names_what_the_plan_did_to_it(what, plan):
    """``_wait_for_remote_kv#4-#9``: r's load of 8 tokens started at step 0 and is in flight; the detail says
    whether the plan scheduled, preempted or rejected it, and when its load started."""
    assert _details("wait-for-remote-kv", remote.loading(), plan, remote.CONFIG) == [
        ("r", f"{what} while its remote KV load (started at step 0) is in flight")]


def test_a_deduplication_of_a_block_published_before_the_step_is_refused():
    """``_deduplicate_at_publication``: p and q prefilled their one prompt without de-duplicating (q's block 3
    published as a twin of p's block 0); q may not de-duplicate block 3 in a later step: it was published before."""
    state = dedup.two_waiting()
    state = apply_plan(state, StepPlan(scheduled=(dedup.P_ITEM, ScheduledRequest("q", 0, 9, (3, 4, 5)))),
                       {"p": 1, "q": 1}, dedup.SGLANG).state
    plan = StepPlan(scheduled=(ScheduledRequest("q", 9, 1, (), deduplicated_block_ids=((3, 0),)),))
    assert _details("deduplicate-at-publication", state, plan, dedup.SGLANG) == [
        ("q", "de-duplicates block 3, published before the step")]


def test_a_deduplication_onto_a_block_itself_deduplicated_is_refused():
    """``_deduplicate_at_publication``: p replaces its block 0 by q's block 3 while q replaces block 3 by p's
    block 0: each cached block is itself an own block of the step."""
    plan = StepPlan(scheduled=(ScheduledRequest("p", 0, 9, (0, 1, 2), deduplicated_block_ids=((0, 3),)),
                               ScheduledRequest("q", 0, 9, (3, 4, 5), deduplicated_block_ids=((3, 0),))))
    assert _details("deduplicate-at-publication", dedup.two_waiting(), plan, dedup.SGLANG) == [
        ("p", "replaces block 0 by block 3, itself de-duplicated in the step"),
        ("q", "replaces block 3 by block 0, itself de-duplicated in the step")]


def test_a_deduplication_onto_a_cached_block_evicted_in_the_step_is_refused():
    """``_deduplicate_at_publication``: p finished (its blocks 0 and 1 cached, evictable); x, first in the batch,
    takes block 0 as a new block (evicting it, and not filling it: nothing published), so q may not replace its
    block 3 by block 0."""
    state = apply_plan(dedup.two_waiting(), StepPlan(scheduled=(dedup.P_ITEM,)), {"p": 1}, dedup.SGLANG).state
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("p", 9, 1),)), {"p": 2}, dedup.SGLANG).state
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("p", 10, 1),)), {"p": 3}, dedup.SGLANG).state
    assert "p" in state.finished
    state = add_request(state, Request("x", state.step, (90, 91), max_tokens=2))
    plan = StepPlan(scheduled=(ScheduledRequest("x", 0, 2, (0,)),
                               ScheduledRequest("q", 0, 9, (3, 4, 5), deduplicated_block_ids=((3, 0),))))
    assert _details("deduplicate-at-publication", state, plan, dedup.SGLANG) == [
        ("q", "replaces block 3 by block 0, handed out in the same step")]


def test_group_table_covers_judges_the_item_after_one_naming_too_many_groups():
    """``_group_table_covers#11`` (``continue`` made ``break``): w, first in the batch, names new blocks for 2
    groups past group 0 (1 is configured); a's decode after it keeps its window table at 4 blocks (block size
    2), fewer than the 5 its 9 tokens need: both reported."""
    w = Request("w", 0, (60, 61), max_tokens=2)
    state = SchedulerState(step=1, waiting=("w",), running=("a",), requests={"a": groups.running_a(), "w": w},
                           free_block_ids=(8, 9, 10, 11), num_requests_added=2)
    plan = StepPlan(scheduled=(ScheduledRequest("w", 0, 2, (9,), group_new_block_ids=((10,), (11,))),
                               ScheduledRequest("a", 8, 1, (8,), skipped_block_ids=(5, 4))))
    assert _details("group-table-covers", state, plan, groups.CONFIG) == [
        ("w", "new blocks for 2 groups past group 0, but 1 are configured"),
        ("a", "group 1: 4 blocks hold fewer than the 5 needed")]


def test_drafts_not_proposed_are_named_with_those_that_were():
    """``_drafts_are_proposed``: a's proposed drafts are 12, 13, 14; an item carrying 13 alone is no prefix of
    them; an item without drafts and one for an unknown id first in the batch do not hide it."""
    state, bad, _, cfg = speculative.case_drafts_are_proposed()
    padded = StepPlan(scheduled=(ScheduledRequest("ghost", 0, 2, spec_token_ids=(1,)), *bad.scheduled))
    for plan in (bad, padded):
        assert _details("drafts-are-proposed", state, plan, cfg) == [
            ("a", "carries drafts [13], not a prefix of those proposed [12, 13, 14]")]


def test_the_active_sequence_cap_names_the_admissions_and_the_running_count():
    """``_active_sequence_cap``: max_num_active_seqs 1; a runs and b is admitted: 2 running after the step."""
    state, bad, good, config = limits.case_active_sequence_cap()
    assert _details("active-sequence-cap", state, bad, config) == [
        (None, "1 admitted: 2 running after the step > max_num_active_seqs=1")]
    assert _details("active-sequence-cap", state, good, config) == []


def test_reject_only_impossible_says_exactly_what_is_wrong():
    """``_reject_impossible``: the three breaches' details word for word: b (which fits) rejected; a rejected
    while running; c (a prompt of 33 tokens past max_model_len 32) left waiting."""
    huge = Request("c", 1, tuple(range(1, 34)), max_tokens=1)
    state = base_state(huge)
    plan = StepPlan(rejected=(("b", "made up"), ("a", "made up")))
    assert _details("reject-only-impossible", state, plan, CONFIG) == [
        ("b", "rejected although it can complete alone"),
        ("a", "rejected while running (only waiting requests can be rejected)"),
        ("c", "not rejected although prompt-exceeds-max-model-len: prompt_len=33 exceeds max_model_len=32")]


def test_a_preemption_releases_only_the_blocks_no_one_else_holds():
    """``released_by_preemptions``: with prefix caching, p and q share cached block 0 (q's hit) and each holds
    its own blocks after it. Preempting q releases its own blocks (reference count 1 to 0) but not block 0
    (2 to 1): handing out q's block 4 is allowed, block 0 is not free."""
    state = dedup.two_waiting(dedup.VLLM)
    state = apply_plan(state, StepPlan(scheduled=(dedup.P_ITEM,)), {"p": 1}, dedup.VLLM).state
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("p", 9, 1),
                                                  ScheduledRequest("q", 8, 1, (4,), (0, 1)))), {"p": 2, "q": 2},
                       dedup.VLLM).state
    assert state.requests["q"].block_ids == (0, 1, 4)
    free = set(state.free_block_ids)
    assert 4 not in free and 0 not in free
    ok = StepPlan(scheduled=(ScheduledRequest("p", 10, 1, (4,)),), preempted=("q",))
    assert _details("blocks-from-free-pool", state, ok, dedup.VLLM) == []
    shared = StepPlan(scheduled=(ScheduledRequest("p", 10, 1, (0,)),), preempted=("q",))
    assert _details("blocks-from-free-pool", state, shared, dedup.VLLM) == [("p", "block 0 is not free")]


def test_each_group_counts_its_own_new_blocks_not_another_groups():
    """``_group_table_covers#28`` (group ``index``'s new blocks read at ``index - 2``): with three groups and a
    one-block hit in each, group 1 gets 3 new blocks (4: covered) and group 2 only 2 (3 < 4)."""
    config = groups.CONFIG.with_changes(num_kv_blocks=24, kv_cache_groups=THREE_GROUPS)
    state, plan = _admit_with_hits(config, ((10,), (17,)), ((11, 12, 13), (14, 15)))
    assert _details("group-table-covers", state, plan, config) == [
        ("w", "group 2: 3 blocks hold fewer than the 4 needed")]


def test_a_group_hit_on_a_block_handed_out_in_the_same_step_is_refused():
    """``_prefix_hit_chain`` with KV cache groups: b's hit in the window group ends with a's cached blocks 6 and 7
    (a good hit, as test_prefix_groups admits it); a's decode, first in the batch, takes block 6 as its window
    group's new block: the hit reuses a block handed out in the same step."""
    state = prefix_groups.after_a()
    good = prefix_groups.admit_b()
    assert _details("prefix-hit-is-cached-chain", state, good, prefix_groups.CONFIG) == []
    a_item, b_item = good.scheduled
    bad = StepPlan(scheduled=(attrs.evolve(a_item, group_new_block_ids=((6,),)), b_item))
    assert _details("prefix-hit-is-cached-chain", state, bad, prefix_groups.CONFIG) == [
        ("b", "hit block 6 handed out in the same step")]


def test_a_hit_without_group_tables_is_no_hit_of_every_group():
    """``_prefix_hit_chain`` with KV cache groups: b's hit names group 0's blocks 0 to 3 and no table for the
    window group: a hit is one only where every group holds the prefix, so the rule refuses it."""
    state = prefix_groups.after_a()
    _, b_item = prefix_groups.admit_b().scheduled
    bad = StepPlan(scheduled=(attrs.evolve(b_item, group_cached_block_ids=()),))
    # ``#17`` (one empty table per group past the first made one fewer): group 1's missing table reads as empty
    assert _details("prefix-hit-is-cached-chain", state, bad, prefix_groups.CONFIG) == [
        ("b", "hit tables of lengths [4, 0] for 2 groups: not one length per group")]


def test_a_hit_of_an_unknown_request_is_left_to_known_requests():
    """``_prefix_hit_chain#7`` (``or`` made ``and``: the chain of an unknown id's hit walked, a crash): an item for
    an id never added names a hit; known-requests reports it, and prefix-hit-is-cached-chain has nothing to
    judge, nor stops judging b's swapped hit after it."""
    state, bad, _, config = prefix.PREFIX_RULE_CASES["prefix-hit-is-cached-chain"]()
    plan = StepPlan(scheduled=(ScheduledRequest("ghost", 4, 1, (), cached_block_ids=(0,)), *bad.scheduled))
    assert _details("prefix-hit-is-cached-chain", state, plan, config) == [
        ("b", "hit block 0 is block 1, which caches other tokens")]
    assert _details("known-requests", state, plan, config) == [("ghost", "not a live request")]


def test_the_active_sequence_cap_stops_admission_only():
    """``_active_sequence_cap``: max_num_active_seqs caps admission, not the running set: with a and p running
    (2 > 1) a plan that admits nothing is allowed; admitting b as well names 1 admitted and 3 running."""
    state, _, _, config = limits.case_active_sequence_cap()
    p = limits._running_prefill()
    state = attrs.evolve(state, running=(*state.running, "p"), requests={**state.requests, "p": p},
                         free_block_ids=tuple(b for b in state.free_block_ids if b != 2))
    decodes = (ScheduledRequest("a", 4, 1), ScheduledRequest("p", 4, 4, (3,)))
    assert _details("active-sequence-cap", state, StepPlan(scheduled=decodes), config) == []
    admit = StepPlan(scheduled=(*decodes, ScheduledRequest("b", 0, 4, (4,))))
    assert _details("active-sequence-cap", state, admit, config) == [
        (None, "1 admitted: 3 running after the step > max_num_active_seqs=1")]


def _finished_p() -> SchedulerState:
    """SGLang's publication: p ran its 9-token prompt and two decodes and finished (its blocks 0 and 1 cached,
    evictable); q, of the same prompt, waits."""
    state = apply_plan(dedup.two_waiting(), StepPlan(scheduled=(dedup.P_ITEM,)), {"p": 1}, dedup.SGLANG).state
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("p", 9, 1),)), {"p": 2}, dedup.SGLANG).state
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("p", 10, 1),)), {"p": 3}, dedup.SGLANG).state
    assert "p" in state.finished
    return state


def test_a_deduplication_onto_a_block_cached_before_the_step_is_allowed_after_an_unknown_item():
    """``_deduplicate_at_publication#69`` (the cached block's hash looked up as ``None``) and ``#23`` (``continue``
    made ``break`` at an unknown id): q replaces its block 3 by p's cached block 0 (same tokens): allowed; its
    replacement of block 4 by block 0 (block 1's tokens) is not, also after an item for an unknown id."""
    state = _finished_p()
    good = ScheduledRequest("q", 0, 9, (3, 4, 5), deduplicated_block_ids=((3, 0),))
    assert _details("deduplicate-at-publication", state, StepPlan(scheduled=(good,)), dedup.SGLANG) == []
    bad = ScheduledRequest("q", 0, 9, (3, 4, 5), deduplicated_block_ids=((4, 0),))
    ghost = ScheduledRequest("ghost", 0, 1, deduplicated_block_ids=((9, 0),))
    assert _details("deduplicate-at-publication", state, StepPlan(scheduled=(ghost, bad)), dedup.SGLANG) == [
        ("q", "replaces block 4 (block 1) by block 0, which does not cache its tokens")]


def test_a_block_an_earlier_item_only_hits_is_not_republished_with_its_tokens():
    """``_deduplicate_at_publication#81`` (``and`` made ``or``: every block of an earlier item's table published
    anew): r (other tokens) names p's cached block 0 as its hit, a hit prefix-hit-is-cached-chain refuses; the
    de-duplication rule still reads block 0 as what the cache holds (p's first 4 tokens), so q may replace its
    block 3 by it."""
    state = add_request(_finished_p(), Request("r", 3, tuple(range(70, 79)), max_tokens=2))
    plan = StepPlan(scheduled=(ScheduledRequest("r", 4, 5, (6, 7), (0,)),
                               ScheduledRequest("q", 0, 9, (3, 4, 5), deduplicated_block_ids=((3, 0),))))
    assert _details("deduplicate-at-publication", state, plan, dedup.SGLANG) == []
    assert [r for r, _ in _details("prefix-hit-is-cached-chain", state, plan, dedup.SGLANG)] == ["r"]


def test_the_cached_chain_judges_every_item_after_a_wrong_hit():
    """``_prefix_hit_chain#41, #56, #58, #60`` (``continue``/``break`` made ``break``/``return``): three wrong
    hits in one batch, each reported: d's block 5 (not cached), then c's hit past its last token, then b's
    swapped blocks; b's hit of a block it is handed, then d's; b's swapped blocks, then d's (the final whole run
    found #58 alive: no item followed b's swapped blocks)."""
    state = prefix.warm_state()
    state = add_request(add_request(state, Request("c", 1, prefix.A_PROMPT[:8], max_tokens=2)),
                        Request("d", 1, prefix.B_PROMPT, max_tokens=2))
    plan = StepPlan(scheduled=(ScheduledRequest("d", 4, 6, (3, 4), cached_block_ids=(5,)),
                               ScheduledRequest("c", 8, 0, (), cached_block_ids=(0, 1)),
                               ScheduledRequest("b", 8, 2, (2,), cached_block_ids=(1, 0))))
    assert _details("prefix-hit-is-cached-chain", state, plan, prefix.CONFIG) == [
        ("d", "hit block 0 is block 5, which is not cached"),
        ("c", "hit of 2 blocks, but at most 1 may hit so that one of its 8 tokens is computed"),
        ("b", "hit block 0 is block 1, which caches other tokens")]
    handed = StepPlan(scheduled=(ScheduledRequest("b", 8, 2, (1,), cached_block_ids=(0, 1)),
                                 ScheduledRequest("d", 4, 6, (3, 4), cached_block_ids=(5,))))
    assert _details("prefix-hit-is-cached-chain", state, handed, prefix.CONFIG) == [
        ("b", "hit block 1 is block 1, handed out in the same step"),
        ("d", "hit block 0 is block 5, which is not cached")]
    swapped_first = StepPlan(scheduled=(ScheduledRequest("b", 8, 2, (2,), cached_block_ids=(1, 0)),
                                        ScheduledRequest("d", 4, 6, (3, 4), cached_block_ids=(5,))))
    assert _details("prefix-hit-is-cached-chain", state, swapped_first, prefix.CONFIG) == [
        ("b", "hit block 0 is block 1, which caches other tokens"),
        ("d", "hit block 0 is block 5, which is not cached")]


def test_a_group_hit_breach_does_not_hide_the_next_item():
    """``_prefix_hit_chain#34`` (``continue`` made ``break`` after a breach with KV cache groups): b's hit on a
    block handed out in the same step is reported, and so is c's hit without group tables after it."""
    state = prefix_groups.after_a()
    state = add_request(state, Request("c", 1, prefix_groups.PROMPT + (40, 41), max_tokens=2))
    a_item, b_item = prefix_groups.admit_b().scheduled
    c_item = ScheduledRequest("c", 8, 2, (20,), (0, 1, 2, 3), group_new_block_ids=((21,),))
    plan = StepPlan(scheduled=(attrs.evolve(a_item, group_new_block_ids=((6,),)), b_item, c_item))
    assert [r for r, _ in _details("prefix-hit-is-cached-chain", state, plan, prefix_groups.CONFIG)] == ["b", "c"]


def test_a_deduplication_onto_a_cached_block_an_earlier_item_refills_is_allowed():
    """``_deduplicate_at_publication#82`` (``or`` made ``and``: a block evicted and refilled in the step not
    published again): p finished, its blocks 0 and 1 cached and evictable; s (the same prompt), first in the
    batch, takes block 0 as a new block (evicting it) and publishes its first 4 tokens there again; q may
    replace its block 3 by block 0, which s publishes in this step."""
    state = add_request(_finished_p(), Request("s", 3, dedup.PROMPT, max_tokens=2))
    plan = StepPlan(scheduled=(ScheduledRequest("s", 0, 9, (0, 6, 7)),
                               ScheduledRequest("q", 0, 9, (3, 4, 5), deduplicated_block_ids=((3, 0),))))
    assert _details("deduplicate-at-publication", state, plan, dedup.SGLANG) == []


def test_reject_only_impossible_judges_the_rejection_after_one_of_a_running_request():
    """``_reject_impossible``: a (running) rejected first does not hide b (which fits) rejected after it."""
    plan = StepPlan(rejected=(("a", "made up"), ("b", "made up")))
    assert _details("reject-only-impossible", base_state(), plan, CONFIG) == [
        ("a", "rejected while running (only waiting requests can be rejected)"),
        ("b", "rejected although it can complete alone")]


def test_preempting_every_request_that_holds_a_shared_block_releases_it():
    """``released_by_preemptions``: p and q share cached block 0 (reference count 2); preempting both brings it
    to 0, so r may take it in the same step."""
    state = dedup.two_waiting(dedup.VLLM)
    state = apply_plan(state, StepPlan(scheduled=(dedup.P_ITEM,)), {"p": 1}, dedup.VLLM).state
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("p", 9, 1),
                                                  ScheduledRequest("q", 8, 1, (4,), (0, 1)))), {"p": 2, "q": 2},
                       dedup.VLLM).state
    state = add_request(state, Request("r", state.step, (90, 91), max_tokens=2))
    plan = StepPlan(scheduled=(ScheduledRequest("r", 0, 2, (0,)),), preempted=("p", "q"))
    assert _details("blocks-from-free-pool", state, plan, dedup.VLLM) == []
    only_q = StepPlan(scheduled=(ScheduledRequest("r", 0, 2, (0,)),), preempted=("q",))
    assert _details("blocks-from-free-pool", state, only_q, dedup.VLLM) == [("r", "block 0 is not free")]


def test_without_prefix_caching_every_preemption_releases_its_blocks():
    """``released_by_preemptions`` without a prefix cache: preempting a (blocks 0, 1) and then c (blocks 6, 7)
    releases all four; b may take blocks 7 and 0."""
    c = Request("c", 0, (1, 2, 3, 4, 5), max_tokens=3, status=RequestStatus.RUNNING, num_computed_tokens=5,
                block_ids=(6, 7), admitted_step=0)
    state = attrs.evolve(base_state(), running=("a", "c"), requests={**base_state().requests, "c": c},
                         free_block_ids=(2, 3, 4, 5))
    plan = StepPlan(scheduled=(ScheduledRequest("b", 0, 5, (7, 0)),), preempted=("a", "c"))
    assert _details("blocks-from-free-pool", state, plan, CONFIG) == []
