"""Tests that kill mutmut mutants of :mod:`schedspec.spec.transitions` (issue 28): each asserts a state, a count
or the key facts of a message that a mutant of one action gets wrong, worked out by hand in the comments from
the documented semantics (vLLM 0.32 ``Scheduler.schedule``, ``_preempt_request``, ``update_from_output``,
``KVCacheManager.free``), not copied from the code under test. Each test's docstring names the mutants'
function and what they break."""

from __future__ import annotations

import attrs
import pytest

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import check_state
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import (
    DelayedFree,
    InFlightStep,
    KVLoad,
    KVTransferOutput,
    PrefillCadence,
    ScheduledRequest,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
)
from schedspec.spec.transitions import PlanError, abort_request, add_request, apply_plan

# block_size 4, 8 blocks, budget 16, 4 sequences, max_model_len 12.
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=12)
EOS = 0


def running(request_id: str, prompt_len: int, outputs: tuple[int, ...], blocks: tuple[int, ...],
            max_tokens: int = 4) -> Request:
    """Prompt computed, ``outputs`` sampled, the last one not yet fed back (a decode is pending)."""
    return Request(request_id, 0, tuple(range(100, 100 + prompt_len)), max_tokens=max_tokens, eos_token_id=EOS,
                   status=RequestStatus.RUNNING, num_computed_tokens=prompt_len + len(outputs) - 1,
                   output_token_ids=outputs, block_ids=blocks, admitted_step=0, first_token_step=0)


def test_a_step_orders_the_free_queue_released_then_taken_then_freed() -> None:
    """Kills mutants of ``StepInProgress.end`` without a prefix cache that drop or reorder one of the free
    queue's three changes (the order of vLLM 0.32: a victim's blocks freed inside ``Scheduler.schedule`` before
    the batch's blocks are taken, a finished request's in ``update_from_output`` after).

    b (1 block) is preempted: its block 1 goes to the front, (1, 0, 2, 4, 6, 7); the waiting c takes block 1 for
    its 4-token prompt, (0, 2, 4, 6, 7); a decodes and samples EOS, so its blocks (3, 5) go to the front last
    block first: (5, 3, 0, 2, 4, 6, 7)."""
    a = running("a", 6, (7,), (3, 5))
    b = running("b", 3, (8,), (1,))
    c = Request("c", 0, (1, 2, 3, 4), max_tokens=4, eos_token_id=EOS)
    state = SchedulerState(step=3, waiting=("c",), running=("a", "b"), requests={"a": a, "b": b, "c": c},
                           free_block_ids=(0, 2, 4, 6, 7), num_requests_added=3)
    assert check_state(state, CONFIG) == []
    plan = StepPlan(scheduled=(ScheduledRequest("a", 6, 1), ScheduledRequest("c", 0, 4, new_block_ids=(1,))),
                    preempted=("b",))
    result = apply_plan(state, plan, {"a": EOS, "c": 9}, CONFIG)
    after = result.state
    assert tuple(after.free_block_ids) == (5, 3, 0, 2, 4, 6, 7)
    assert after.step == 4
    assert result.finished == ("a",)
    assert result.sampled == ("a", "c")
    assert after.waiting == ("b",)
    assert after.running == ("c",)
    assert after.requests["c"].block_ids == (1,)
    assert after.finished["a"].status is RequestStatus.FINISHED_STOPPED


# --- KV connector: what a report of transfers that cannot be applied names ------------------------------------
KV_CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2,
                            max_model_len=32)


def loading_state() -> SchedulerState:
    """After step 0: r (a 10-token prompt, the connector offering its first 8) waits for its remote KV in blocks
    0 and 1 (the load of tests/test_remote_kv.py)."""
    r = Request("r", 0, tuple(range(100, 110)), max_tokens=3, num_external_computed_tokens=8)
    state = add_request(SchedulerState.initial(KV_CONFIG), r)
    return apply_plan(state, StepPlan(loads=(KVLoad("r", 8, (0, 1)),)), {}, KV_CONFIG).state


def sent_state() -> SchedulerState:
    """After step 0: s (3-token prompt, max_tokens 1, ``kv_send``) finished at its first sample; its block 0 is
    held for the send (``delayed_frees``)."""
    s = Request("s", 0, (1, 2, 3), max_tokens=1, kv_send=True)
    state = add_request(SchedulerState.initial(KV_CONFIG), s)
    after = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("s", 0, 3, (0,)),)), {"s": 9}, KV_CONFIG).state
    assert after.delayed_frees == {"s": DelayedFree((0,), "sending")}
    return after


def test_a_transfer_report_of_nothing_in_flight_names_the_request_the_step_and_the_transfer() -> None:
    """Kills the mutants of ``StepInProgress.free_delayed``'s message (``PlanError(None)``, the load/send words
    swapped or garbled): a user reading a refused trace needs the request, the report field, the step and which
    transfer it lacks. A send reported for r, which loads: "no KV send"; a load reported twice for s, whose
    send is in flight: "no remote KV load"."""
    with pytest.raises(PlanError, match=r"^request_id='r': finished_sending at step 1, but it has no KV send in "
                                        r"flight$"):
        apply_plan(loading_state(), StepPlan(), {}, KV_CONFIG, transfers=KVTransferOutput(finished_sending=("r",)))
    with pytest.raises(PlanError, match=r"^request_id='s': finished_recving at step 1, but it has no remote KV "
                                        r"load in flight$"):
        apply_plan(sent_state(), StepPlan(), {}, KV_CONFIG, transfers=KVTransferOutput(finished_recving=("s",)))


def test_a_send_reported_twice_in_one_report_is_refused() -> None:
    """Kills ``StepInProgress.free_delayed``'s mutant that looks the held blocks up in the state before the step
    even after this step freed them (``or True``): the second report of s's send would free block 0 a second
    time (block 0 twice in the free queue). The first completion frees it; the second names no send in
    flight."""
    with pytest.raises(PlanError, match=r"request_id='s': finished_sending at step 1, but it has no KV send"):
        apply_plan(sent_state(), StepPlan(), {}, KV_CONFIG, transfers=KVTransferOutput(finished_sending=("s", "s")))


def test_an_invalid_block_of_no_landing_load_is_named() -> None:
    """Kills ``land_transfers``' ``PlanError(None)``: the refusal names the block and the step (block 5 is no
    block of r's load in blocks 0 and 1)."""
    with pytest.raises(PlanError, match=r"^invalid block 5 at step 1 belongs to no load that lands$"):
        apply_plan(loading_state(), StepPlan(), {}, KV_CONFIG,
                   transfers=KVTransferOutput(finished_recving=("r",), invalid_block_ids=(5,)))


def test_a_remote_load_with_a_step_in_flight_is_refused() -> None:
    """Kills ``start_load``'s mutants that accept a load while a step is in flight (``or`` made ``and`` with the
    KV cache groups' test) and garble the message: remote loads under asynchronous scheduling are not
    specified, so the spec refuses rather than judge them (exit 3 upstream, not a wrong verdict)."""
    r = Request("r", 0, tuple(range(100, 110)), max_tokens=3, num_external_computed_tokens=8)
    state = add_request(SchedulerState.initial(KV_CONFIG), r)
    state = attrs.evolve(state, in_flight=InFlightStep())
    with pytest.raises(PlanError, match=r"^request_id='r': remote KV loads with enable_prefix_caching, a step in "
                                        r"flight or kv_cache_groups are not specified$"):
        apply_plan(state, StepPlan(loads=(KVLoad("r", 8, (0, 1)),)), {}, KV_CONFIG)


# --- a step in flight (asynchronous scheduling) -----------------------------------------------------------------
def test_the_step_in_flight_records_its_landed_plan_and_one_placeholder_per_sample_plus_its_drafts() -> None:
    """Kills ``in_flight_after``'s mutants that record ``1 - d`` placeholders for a decode verifying d drafts,
    and that record no plan: the state after step 1 carries step 1 as the step in flight when step 2 was
    planned, with its landed plan and, per request that samples, 1 + d output placeholders (vLLM
    ``AsyncScheduler._update_after_schedule``: ``num_output_placeholders`` counts the sampled token and the
    drafts), which rule ``in-flight-foreseen-length`` reads.

    a (6-token prompt, one output, 6 computed, blocks 0 and 1) decodes its pending token and verifies drafts
    (5, 6): 3 tokens, positions 6..8, so block 2 is taken; the model accepts one draft. Nothing ended meanwhile,
    so nothing was freed: placeholders {a: 1 + 2}."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2,
                             max_model_len=32, num_speculative_tokens=2)
    a = Request("a", 0, (11, 12, 13, 14, 15, 16), max_tokens=8, status=RequestStatus.RUNNING, num_computed_tokens=6,
                output_token_ids=(21,), block_ids=(0, 1), admitted_step=0, first_token_step=0, spec_token_ids=(5, 6))
    state = SchedulerState(step=1, running=("a",), requests={"a": a}, free_block_ids=(2, 3, 4, 5, 6, 7),
                           num_requests_added=1, in_flight=InFlightStep(0, StepPlan(), {"a": 1}))
    item = ScheduledRequest("a", 6, 3, new_block_ids=(2,), spec_token_ids=(5, 6))
    plan = StepPlan(scheduled=(item,))
    result = apply_plan(state, plan, {"a": 30}, config, SpeculativeOutput(num_accepted_tokens={"a": 1}))
    assert result.state.in_flight == InFlightStep(1, plan, {"a": 3}, {}, {})
    assert result.state.requests["a"].output_token_ids == (21, 5, 30)
    assert result.wasted == ()


# --- hybrid KV cache groups ------------------------------------------------------------------------------------
def test_an_item_naming_group_blocks_without_groups_is_refused_before_the_step() -> None:
    """Kills ``group_tables_after``'s mutant that counts at least one group past group 0 when the config has
    none (``max(..., 1)``): c's prefill names new blocks for a group 1 the config lacks; the spec refuses the
    plan, naming the request and both counts, instead of growing a table for a group that does not exist."""
    c = Request("c", 0, (1, 2, 3, 4), max_tokens=4, eos_token_id=EOS)
    state = SchedulerState(step=0, waiting=("c",), requests={"c": c}, free_block_ids=tuple(range(8)),
                           num_requests_added=1)
    item = ScheduledRequest("c", 0, 4, new_block_ids=(0,), group_new_block_ids=((1,),))
    with pytest.raises(PlanError, match=r"^request_id='c': blocks for 1 groups past group 0, but the config has 0$"):
        apply_plan(state, StepPlan(scheduled=(item,)), {"c": 9}, CONFIG)


def test_an_abort_while_a_step_is_in_flight_records_freed_blocks_only_for_a_request_that_held_some() -> None:
    """Kills ``abort_request``'s mutant that records an empty entry in ``in_flight.freed_blocks`` for an aborted
    request that held no blocks (``if held`` made ``or True``): ``InFlightStep.freed_blocks`` lists the requests
    of ``ended`` that held blocks, which rule ``in-flight-blocks-held-when-planned`` reads.

    While step 0 is in flight, the client aborts the waiting w (no blocks) and the running a (blocks 0, 1): both
    join ``ended``; only a's blocks are recorded as freed, and they go to the front of the free queue last block
    first."""
    a = running("a", 6, (7,), (0, 1))
    w = Request("w", 0, (1, 2, 3), max_tokens=4, eos_token_id=EOS)
    state = SchedulerState(step=1, waiting=("w",), running=("a",), requests={"a": a, "w": w},
                           free_block_ids=tuple(range(2, 8)), num_requests_added=2,
                           in_flight=InFlightStep(0, StepPlan(), {"a": 1}))
    after = abort_request(abort_request(state, "w"), "a")
    assert dict(after.in_flight.freed_blocks) == {"a": (0, 1)}
    assert set(after.in_flight.ended) == {"w", "a"}
    assert after.in_flight.ended["w"].status is RequestStatus.FINISHED_ABORTED
    assert tuple(after.free_block_ids) == (1, 0, 2, 3, 4, 5, 6, 7)
    assert after.waiting == () and after.running == ()


def test_a_kv_send_with_a_step_in_flight_is_refused() -> None:
    """Kills ``sample``'s mutants that accept a finishing request's KV send while a step is in flight (either
    ``or`` of the guard made ``and``): KV sends under asynchronous scheduling are not specified, so the spec
    refuses the step, naming the request, rather than judge it. s (3-token prompt, max_tokens 1, ``kv_send``)
    finishes at its first sample."""
    s = Request("s", 1, (1, 2, 3), max_tokens=1, kv_send=True)
    state = SchedulerState(step=1, waiting=("s",), requests={"s": s}, free_block_ids=tuple(range(8)),
                           num_requests_added=1, in_flight=InFlightStep(0, StepPlan()))
    with pytest.raises(PlanError, match=r"^request_id='s': KV sends with enable_prefix_caching, a step in flight or "
                                        r"kv_cache_groups are not specified$"):
        apply_plan(state, StepPlan(scheduled=(ScheduledRequest("s", 0, 3, (0,)),)), {"s": 9}, KV_CONFIG)


# --- the prefill cadence (vLLM 0.33 prefill_schedule_interval) ----------------------------------------------------
def test_a_step_records_the_prefill_cadence_from_an_interval_of_two() -> None:
    """Kills ``apply_plan``'s mutant that records the cadence's step history only from an interval of 3
    (``> 1`` made ``> 2``): with ``prefill_schedule_interval=2`` the state after a step carries the
    :class:`~schedspec.spec.state.PrefillCadence` the next plan is judged by (rule ``prefill-cadence``); without it
    a held step could not be told from a free one. vLLM 0.33 ``Scheduler.schedule``: a step carrying a prefill
    restarts the count (0 steps since), a decode-only step adds one; with the option off the state has none.

    c (4-token prompt) is admitted whole at step 0 (a prefill: 0 steps since), then decodes at step 1 (1 step
    since)."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4,
                             max_model_len=12, prefill_schedule_interval=2)
    c = Request("c", 0, (1, 2, 3, 4), max_tokens=4, eos_token_id=EOS)
    state = add_request(SchedulerState.initial(config), c)
    first = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("c", 0, 4, (0,)),)), {"c": 9}, config).state
    assert first.prefill_cadence == PrefillCadence(0)
    second = apply_plan(first, StepPlan(scheduled=(ScheduledRequest("c", 4, 1, (1,)),)), {"c": 8}, config).state
    assert second.prefill_cadence == PrefillCadence(1)
    off = apply_plan(add_request(SchedulerState.initial(CONFIG), c),
                     StepPlan(scheduled=(ScheduledRequest("c", 0, 4, (0,)),)), {"c": 9}, CONFIG).state
    assert off.prefill_cadence is None


# --- SGLang's publication: de-duplications a step cannot apply ----------------------------------------------------
SGLANG = SchedulerConfig(block_size=4, num_kv_blocks=10, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32,
                         enable_prefix_caching=True, prefix_cache_publication="sglang-radix")
TWIN_PROMPT = tuple(range(11, 20))  # 9 tokens: blocks [11..14], [15..18], [19] (tests/test_prefix_dedup.py's twins)


@pytest.mark.parametrize(("pairs", "message"), [
    # q's block 3 (its tokens 11..14) replaced by p's block 1, which caches tokens 15..18
    (((3, 1),), r"^request_id='q' at step 0: block 3 replaced by block 1, which does not cache its tokens$"),
    # q's block 5 holds only token 19: not full, so this step does not publish it
    (((5, 2),), r"^request_id='q': blocks \[5\] de-duplicated at step 0, but not published in it$"),
])
def test_a_deduplication_the_step_cannot_apply_names_the_request_the_blocks_and_the_step(pairs, message) -> None:
    """Kills ``schedule``'s mutants of its two refusals of a de-duplication (``PlanError(None)``, the pending blocks
    not listed): onto a cached block of other tokens, and of a block the step does not publish. p and q prefill
    the same 9-token prompt together (blocks 0-2 and 3-5); the message names q, the blocks and the step, as rule
    ``deduplicate-at-publication`` does for a plan a checker judges."""
    state = SchedulerState.initial(SGLANG)
    for request_id in ("p", "q"):
        state = add_request(state, Request(request_id, 0, TWIN_PROMPT, max_tokens=3))
    plan = StepPlan(scheduled=(ScheduledRequest("p", 0, 9, (0, 1, 2)),
                               ScheduledRequest("q", 0, 9, (3, 4, 5), deduplicated_block_ids=pairs)))
    with pytest.raises(PlanError, match=message):
        apply_plan(state, plan, {"p": 1, "q": 1}, SGLANG)
