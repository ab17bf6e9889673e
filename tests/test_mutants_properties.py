"""Tests that kill the mutants mutmut found surviving in spec/properties.py (issue 28, docs/testing.md
"Mutation score"): each asserts a property's verdict (or the verdict of the pieces it is made of:
``TransfersInFlight``, ``free_at_plan``, ``whole_sequence_need``) on hand-made states whose blocks are
counted by hand here, at the boundaries the statement names. Each test names the mutants it was written for
(``scripts/mutmut.sh`` names, ``x_FUNCTION__mutmut_N`` or ``xǁClassǁmethod__mutmut_N``).

Block counts below: block_size 4, so a sequence of n tokens needs ceil(n / 4) blocks."""

from __future__ import annotations

import attrs
import pytest

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.properties import TransfersInFlight, free_at_plan, monitors, whole_sequence_need
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import (
    DelayedFree,
    KVLoad,
    KVTransferOutput,
    ScheduledRequest,
    SchedulerState,
    StepPlan,
)
from schedspec.spec.transitions import abort_request, add_request, apply_plan

CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32)
WFRK = RequestStatus.WAITING_FOR_REMOTE_KVS


def fresh(request_id: str, tokens: int, **changes) -> Request:
    """A waiting request with a prompt of ``tokens`` tokens."""
    return attrs.evolve(Request(request_id, 0, tuple(range(100, 100 + tokens)), max_tokens=3), **changes)


def loading(request_id: str, blocks: tuple[int, ...]) -> Request:
    """A request whose remote KV load of 8 tokens into ``blocks`` is in flight (WAITING_FOR_REMOTE_KVS)."""
    return fresh(request_id, 10, num_external_computed_tokens=8, status=WFRK, kv_load_step=0, block_ids=blocks,
                 num_computed_tokens=8)


def landed(request_id: str, tokens: int, blocks: tuple[int, ...]) -> Request:
    """A waiting request whose remote KV load into ``blocks`` landed, never admitted since (holds loaded KV)."""
    return fresh(request_id, tokens, num_external_computed_tokens=4 * len(blocks), kv_load_step=0, block_ids=blocks,
                 num_computed_tokens=4 * len(blocks))


def running(request_id: str, computed: int, blocks: tuple[int, ...]) -> Request:
    """A running prefill of 20 prompt tokens with ``computed`` of them computed."""
    return fresh(request_id, 20, status=RequestStatus.RUNNING, num_computed_tokens=computed, block_ids=blocks,
                 admitted_step=0)


def state_of(waiting: tuple[Request, ...] = (), running_: tuple[Request, ...] = (), free: int = 0,
             delayed: dict[str, DelayedFree] | None = None) -> SchedulerState:
    """A state at step 1 with ``free`` free blocks (ids 50..), the requests in the queues as given."""
    requests = {r.request_id: r for r in waiting + running_}
    return SchedulerState(step=1, waiting=tuple(r.request_id for r in waiting),
                          running=tuple(r.request_id for r in running_), requests=requests,
                          free_block_ids=tuple(range(50, 50 + free)), num_requests_added=len(requests),
                          delayed_frees=delayed or {})


NOTHING = StepPlan()
"""A plan that schedules, preempts, rejects and loads nothing."""


def holds_back(state: SchedulerState, plan: StepPlan = NOTHING) -> bool:
    return TransfersInFlight(CONFIG).holds_back(state, plan)


# --- TransfersInFlight.during ------------------------------------------------------------------------


def test_during_follows_a_load_from_its_start_until_it_lands() -> None:
    """``during`` is true for the step that starts a load, each step it is in flight, and the step whose report
    lands it; false from the next step on, and on a run that never had a transfer. Kills the mutants of
    ``xǁTransfersInFlightǁduring`` that lose the load between steps (``loading`` not kept, or not
    followed: ``or`` made ``and``, the status compared wrong) or keep it after it landed."""
    config = CONFIG
    start = add_request(SchedulerState.initial(config), fresh("r", 10, num_external_computed_tokens=8))
    load = StepPlan(loads=(KVLoad("r", 8, (0, 1)),))
    inflight = apply_plan(start, load, {}, config).state
    still = apply_plan(inflight, StepPlan(), {}, config).state
    done = apply_plan(still, StepPlan(), {}, config, transfers=KVTransferOutput(finished_recving=("r",))).state
    after = apply_plan(done, StepPlan(), {}, config).state
    assert done.requests["r"].status is RequestStatus.WAITING

    transfers = TransfersInFlight(config)
    assert not transfers.during(SchedulerState.initial(config), StepPlan(), SchedulerState.initial(config))
    assert transfers.during(start, load, inflight) and transfers.loading == {"r"}
    assert transfers.during(inflight, StepPlan(), still) and transfers.loading == {"r"}
    assert transfers.during(still, StepPlan(), done) and transfers.loading == set()
    assert not transfers.during(done, StepPlan(), after)


def test_during_drops_an_aborted_load_and_follows_its_delayed_free() -> None:
    """A load aborted in flight leaves the live requests (its blocks wait in ``delayed_frees`` until the load
    lands): ``during`` stops following the request and is true while ``delayed_frees`` holds blocks. Kills the
    mutants of ``during`` that keep an id no longer live, or forget ``before.delayed_frees``."""
    config = CONFIG
    start = add_request(SchedulerState.initial(config), fresh("r", 10, num_external_computed_tokens=8))
    load = StepPlan(loads=(KVLoad("r", 8, (0, 1)),))
    inflight = apply_plan(start, load, {}, config).state
    aborted = abort_request(inflight, "r")
    assert "r" in aborted.delayed_frees
    transfers = TransfersInFlight(config)
    transfers.during(start, load, inflight)
    assert transfers.during(inflight, StepPlan(), aborted) and transfers.loading == set()
    assert transfers.during(aborted, StepPlan(), aborted)


# --- TransfersInFlight.holds_back ----------------------------------------------------------------------


def test_every_live_request_waiting_on_its_own_load_or_grammar_holds_the_step_back() -> None:
    """Case (a): the only live request waits on its load (in flight, or started by the plan), or the others
    wait on their grammar: held back. A request whose load the plan does not start is work (held back only if
    blocks are held, none here). Kills ``holds_back``'s mutants of (a): the plan's loads not counted, the
    grammar test inverted or ``all`` made of the wrong test."""
    r = fresh("r", 10, num_external_computed_tokens=8)
    assert holds_back(state_of((loading("r", (0, 1)),), free=6))
    assert holds_back(state_of((r,), free=8), StepPlan(loads=(KVLoad("r", 8, (50, 51)),)))
    assert not holds_back(state_of((r,), free=8))
    compiling = fresh("g", 4, grammar_ready_step=5)  # not ready at step 1
    assert holds_back(state_of((loading("r", (0, 1)), compiling), free=6))
    assert not holds_back(state_of((loading("r", (0, 1)), fresh("g", 4)), free=6))


@pytest.mark.parametrize(("free", "tokens", "held_back"), [
    (1, 4, False),   # needs 1 block, 1 free: it fits
    (1, 5, True),    # needs 2 > 1 free, <= 1 + 2 held by the load
    (1, 12, True),   # needs 3 = 1 free + 2 held
    (1, 13, False),  # needs 4 > 1 + 2: the load is not what keeps it out
    (2, 8, False),   # needs 2, 2 free
    (2, 9, True),    # needs 3 > 2, <= 4
])
def test_a_head_the_blocks_of_a_load_keep_out_holds_the_step_back(free: int, tokens: int, held_back: bool) -> None:
    """Case (b): ``o`` (``tokens`` prompt tokens, its whole sequence ceil(tokens / 4) blocks) heads the queue
    behind ``r``, whose load in flight holds 2 blocks: held back exactly when o needs more than the free blocks
    and no more than those plus 2. Kills ``holds_back``'s comparison and ``held`` mutants of case (b)."""
    state = state_of((loading("r", (0, 1)), fresh("o", tokens)), free=free)
    assert holds_back(state) is held_back


def test_the_blocks_held_count_delayed_frees_and_the_loads_the_plan_starts() -> None:
    """``held`` sums the blocks of ``delayed_frees`` (an ended request's send), of loads in flight and of loads
    the plan starts: with each alone holding 2 blocks and the head ``o`` needing 3 with 1 free (at plan
    time), the step is held back; with a send of 1 block it is not (3 > 1 + 1). Kills the mutants that drop or
    miscount one term of ``held``, or return before (b) with blocks held."""
    o = fresh("o", 12)  # 3 blocks
    assert holds_back(state_of((o,), free=1, delayed={"d": DelayedFree((0, 1), "sending")}))
    assert not holds_back(state_of((o,), free=1, delayed={"d": DelayedFree((0,), "sending")}))
    r = fresh("r", 10, num_external_computed_tokens=8)
    assert holds_back(state_of((r, o), free=3), StepPlan(loads=(KVLoad("r", 8, (50, 51)),)))  # 1 free at plan
    assert not holds_back(state_of((r, o), free=5), StepPlan(loads=(KVLoad("r", 8, (50, 51)),)))  # 3 at plan: fits


def test_the_head_is_the_first_request_left_waiting_that_could_be_admitted() -> None:
    """The head (b) judges: the queue in ``holding_first`` order, past requests loading, admitted by the plan,
    rejected by it, or whose grammar is not ready. Here each request passed over needs 1 block (it would fit
    in the 2 free) and ``h`` needs 3 (2 < 3 <= 2 + 2 held by ``r``'s load): held back only when h is the head.
    Kills the mutants that take a passed-over request as the head (each skip's test inverted or dropped)."""
    r = loading("r", (0, 1))
    grammar = fresh("g", 4, grammar_ready_step=5)
    rejected = fresh("x", 4)
    admitted = fresh("s", 4)
    h = fresh("h", 12)
    state = state_of((r, grammar, rejected, admitted, h), free=3)
    plan = StepPlan(scheduled=(ScheduledRequest("s", 0, 4, (50,)),), rejected=(("x", "prompt-too-long"),))
    assert holds_back(state, plan)  # 3 free - 1 for s = 2 < 3 <= 4
    assert not holds_back(attrs.evolve(state, waiting=("r", "g", "x", "s", "h"),
                                       requests={**state.requests, "g": fresh("g", 4)}), plan)


def test_a_request_holding_loaded_blocks_heads_the_queue() -> None:
    """A request whose load landed (``l``, 10 tokens holding 2 of its 3 blocks: it needs 1 more) comes first
    (vLLM drains ``kv_holding_waiting`` first) though it is behind ``o`` (3 blocks) in the queue: it fits in the
    1 free block, so the step is not held back; judged in queue order ``o`` would be (1 < 3 <= 1 + 2 held by
    a send). Kills the mutants that judge the queue in its own order or count a landed request's need without
    the blocks it holds."""
    state = state_of((fresh("o", 12), landed("l", 10, (2, 3))), free=1, delayed={"d": DelayedFree((0, 1), "sending")})
    assert not holds_back(state)
    assert holds_back(attrs.evolve(state, requests={**state.requests, "l": fresh("l", 4)}))


@pytest.mark.parametrize(("free", "computed", "held_back"), [
    (0, 4, True),    # o needs 1 block for its next position (5 tokens in 2 blocks), 0 free, 2 held
    (1, 4, False),   # 1 free: it had a block
    (0, 3, False),   # its next position (4 tokens) fits its 1 block: no need
])
def test_leaving_a_running_request_out_is_excused_only_when_the_loads_blocks_are_what_it_lacks(
        free: int, computed: int, held_back: bool) -> None:
    """Case (c): the plan leaves running ``o`` out (or preempts it) while ``r``'s load holds 2 blocks: held back
    exactly when the running requests need more blocks for one more position each than are free, and no more
    than those plus the 2 held. Kills the mutants of (c)'s demand (``+ 1`` changed, ``max`` changed) and
    comparison."""
    state = state_of((loading("r", (0, 1)),), (running("o", computed, (2,)),), free=free)
    assert holds_back(state) is held_back
    assert holds_back(state, StepPlan(preempted=("o",))) is held_back


def test_the_demand_of_the_running_counts_only_the_requests_short_of_blocks() -> None:
    """(c) adds up what each running request lacks, never less than 0: ``p`` holds 3 blocks for 4 computed
    tokens (2 more than it needs) and ``o`` lacks 1; with 0 free and 1 held the demand is 1: held back; a demand
    taken as 1 - 2 or 2 + 1 would not be. And a demand above free + held is not the load's doing: three
    requests lacking 1 each with 2 held. Kills ``max(0, ...)``'s mutants and (c)'s upper bound."""
    state = state_of((loading("r", (0,)),), (running("p", 4, (2, 3, 4)), running("o", 4, (5,))), free=0)
    assert holds_back(state)
    three = state_of((loading("r", (0, 1)),), (running("o", 4, (2,)), running("p", 4, (3,)), running("q", 4, (4,))),
                     free=0)
    assert not holds_back(three)


def test_a_plan_that_schedules_every_running_request_is_judged_by_its_head() -> None:
    """With every running request scheduled, (c) does not apply: the step is judged by the head (b). ``o``
    runs and is scheduled; ``w`` waits needing 3 blocks with 1 free at plan time and 2 held: held back.
    And a plan that leaves ``o`` out with a block free for it is not held back, though its head is (a running
    request left out may have been the work); nor is a plan that schedules every running request with no head
left waiting. Kills the mutants of the test that picks (c), and ``xǁTransfersInFlightǁholds_back__mutmut_62``
(no head: held back)."""
    o = running("o", 4, (2,))
    state = state_of((loading("r", (0, 1)), fresh("w", 12)), (o,), free=2)
    assert holds_back(state, StepPlan(scheduled=(ScheduledRequest("o", 4, 4, (50,)),)))
    assert not holds_back(state)
    alone = state_of((loading("r", (0, 1)),), (o,), free=2)  # no head: the load keeps nothing out
    assert not holds_back(alone, StepPlan(scheduled=(ScheduledRequest("o", 4, 4, (50,)),)))


# --- free_at_plan and whole_sequence_need ----------------------------------------------------------------

GROUPS = SchedulerConfig(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32,
                         kv_cache_groups=({"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 4}))


def test_whole_sequence_need_counts_every_group_and_the_lookahead_less_the_blocks_held() -> None:
    """10 tokens need 3 blocks per group: 3 alone, 6 with two KV cache groups, 1 for a request holding 2
    (a landed load), and with 3 lookahead tokens (speculative decoding) 13 tokens: 4 blocks. Kills the mutants
    of ``x_whole_sequence_need`` (a group count, the lookahead, the held blocks)."""
    request = fresh("o", 10)
    assert whole_sequence_need(request, CONFIG) == 3
    assert whole_sequence_need(request, GROUPS) == 6
    assert whole_sequence_need(landed("l", 10, (0, 1)), CONFIG) == 1
    speculative = attrs.evolve(CONFIG, num_speculative_tokens=3, num_lookahead_tokens=3)
    assert whole_sequence_need(request, speculative) == 4


def test_free_at_plan_takes_the_plans_blocks_and_gives_back_the_windows() -> None:
    """Free blocks at plan time (no prefix caching): 10 free, less 2 new blocks of group 0 and 1 of group 1
    for ``a``, less 2 of ``r``'s load, plus the 2 blocks ``a``'s window frees: 7. Without KV cache groups the
    group terms are absent: 10 - 2 - 2 = 6. Kills the mutants of ``x_free_at_plan`` on the groups' and the
    loads' terms."""
    a = attrs.evolve(running("a", 8, (0, 1)), group_block_ids=((2, 3),))
    state = state_of((fresh("r", 10, num_external_computed_tokens=8),), (a,), free=10)
    item = ScheduledRequest("a", 8, 8, (50, 51), group_new_block_ids=((52,),), skipped_block_ids=(2, 3))
    plan = StepPlan(scheduled=(item,), loads=(KVLoad("r", 8, (53, 54)),))
    assert free_at_plan(state, plan, GROUPS) == 10 - 2 - 1 - 2 + 2
    plain = StepPlan(scheduled=(ScheduledRequest("a", 8, 8, (50, 51)),), loads=(KVLoad("r", 8, (53, 54)),))
    assert free_at_plan(state, plain, CONFIG) == 10 - 2 - 2


# --- the monitors with a KV connector -------------------------------------------------------------------


def violations(name: str, steps, config: SchedulerConfig = CONFIG) -> list[tuple[str, int, str | None, str]]:
    """Run the monitor of property ``name`` over ``steps`` (``(before, plan, after)`` triples; the monitors read
    only these, so a hand-made step may repeat a state at later step numbers); its violations as
    ``(name, step, request_id, detail)``."""
    (monitor,) = monitors([name], config)
    last = None
    for before, plan, after in steps:
        monitor.observe(before, plan, after)
        last = after
    return [(v.name, v.step, v.request_id, v.detail) for v in monitor.finish(last)]


def at(state: SchedulerState, step: int) -> SchedulerState:
    return attrs.evolve(state, step=step)


def stalled(before: SchedulerState, load: StepPlan, steps: int):
    """Step 1 starts the load of ``load`` (``before`` -> ``before`` with ``r`` loading into blocks 0, 1), then
    ``steps`` steps that do nothing while the load never lands."""
    r = before.requests["r"]
    after = attrs.evolve(before, requests={**before.requests, "r": attrs.evolve(
        r, status=WFRK, kv_load_step=1, block_ids=(0, 1), num_computed_tokens=8)},
        free_block_ids=before.free_block_ids[2:])
    return [(at(before, 1), load, at(after, 2))] + [(at(after, k), NOTHING, at(after, k + 1)) for k in range(2, 2 + steps)]


def _o_then_r(free: int, o_tokens: int) -> SchedulerState:
    """``o`` (``o_tokens`` tokens) waits ahead of ``r``, whose connector offers 8 tokens; ``free`` blocks 0..."""
    o, r = fresh("o", o_tokens), fresh("r", 10, num_external_computed_tokens=8, arrival_step=1)
    return SchedulerState(step=1, waiting=("o", "r"), requests={"o": o, "r": r}, free_block_ids=tuple(range(free)),
                          num_requests_added=2)


LOAD_R = StepPlan(loads=(KVLoad("r", 8, (0, 1)),))


@pytest.mark.parametrize(("name", "first"), [("progress", (32, None)), ("bounded-wait", (64, "o"))])
def test_a_stall_is_excused_only_while_the_loads_blocks_keep_the_head_out(name: str, first: tuple) -> None:
    """``o`` (5 tokens: 2 blocks) is never admitted during 70 steps while ``r``'s load holds 2 of 3 blocks: the
    load holds the engine back (1 block free), no violation; with 4 blocks (2 free, o fits) the stall counts
    and the property fails (``progress``: at step 32, its window of 32 steps; ``bounded-wait``: naming o, at
    step 64, its bound of 32 steps doubled once a transfer was seen). Kills the mutants of ``xǁProgressǁobserve`` and
    ``xǁBoundedWaitǁobserve`` that excuse every step a transfer is in flight or none."""
    assert violations(name, stalled(_o_then_r(3, 5), LOAD_R, 70)) == []
    assert violations(name, stalled(_o_then_r(4, 5), LOAD_R, 70))[0][1:3] == first


def test_bounded_wait_doubles_its_bound_once_a_transfer_was_seen() -> None:
    """With a transfer seen the bound is 2 * max_model_len = 64 steps: ``o`` starved 60 steps after the load
    started passes, 70 steps fails, at the step 64 steps after its wait started (step 1). Kills the mutants of
    the doubled bound (``2`` changed, the flag never set or always set)."""
    assert violations("bounded-wait", stalled(_o_then_r(4, 5), LOAD_R, 60)) == []
    assert violations("bounded-wait", stalled(_o_then_r(4, 5), LOAD_R, 70)) == [
        ("bounded-wait", 64, "o", "oldest live request for 64 steps without ending")]
    plain = _o_then_r(4, 5)
    steps = [(at(plain, k), NOTHING, at(plain, k + 1)) for k in range(1, 40)]
    assert [v[1:3] for v in violations("bounded-wait", steps)] == [(32, "o")]


def test_an_oldest_request_waiting_on_its_own_load_is_not_counted() -> None:
    """``r`` arrived first and loads for 70 steps while ``o``, admitted past it, decodes every step (nothing
    holds the engine back): r's wait is not counted until its load lands (vLLM skips it in the waiting loop).
    Kills the ``xǁBoundedWaitǁobserve`` mutants that drop that test."""
    r = fresh("r", 10, num_external_computed_tokens=8)
    o = running("o", 20, (2, 3, 4, 5, 6))
    before = SchedulerState(step=1, waiting=("r",), running=("o",), requests={"r": r, "o": attrs.evolve(o, arrival_step=1)},
                            free_block_ids=(0, 1, 7), num_requests_added=2)
    decode = StepPlan(scheduled=(ScheduledRequest("o", 20, 1, ()),))
    steps = stalled(before, StepPlan(scheduled=decode.scheduled, loads=LOAD_R.loads), 70)
    steps = steps[:1] + [(b, decode, a) for b, _, a in steps[1:]]
    assert violations("bounded-wait", steps) == []


def test_bounded_preemptions_does_not_judge_steps_while_blocks_are_held_outside_the_line() -> None:
    """``a`` runs first in line (bound 0 preemptions). Preempting it while ``r``'s load holds blocks, or while
    an ended request's send holds blocks (``delayed_frees``), is not judged; once r was admitted (it holds
    nothing outside the line) a preemption of a is judged again, against a fresh baseline. A load that failed
    from its first block leaves r holding nothing: the next step is judged. No request is added after step 0, so
    the fresh baseline comes from the connector's branch alone. Kills the mutants of
    ``xǁBoundedPreemptionsǁobserve``'s KV connector branch (``_8, _9``: the baseline left as ``""`` or ``None``,
    an AttributeError at the next preemption judged)."""
    a = running("a", 8, (2, 3))
    before = SchedulerState(step=1, waiting=("r",), running=("a",), requests={"a": a, "r": fresh(
        "r", 10, num_external_computed_tokens=8)}, free_block_ids=(0, 1, 4, 5, 6, 7), num_requests_added=2)
    held = attrs.evolve(before, requests={**before.requests, "r": attrs.evolve(
        before.requests["r"], status=WFRK, kv_load_step=1, block_ids=(0, 1), num_computed_tokens=8)})
    admitted = attrs.evolve(held, waiting=(), running=("a", "r"), requests={**held.requests, "r": attrs.evolve(
        held.requests["r"], status=RequestStatus.RUNNING, admitted_step=3)})
    empty = attrs.evolve(held, requests={**held.requests, "r": attrs.evolve(
        held.requests["r"], status=RequestStatus.WAITING, block_ids=(), num_computed_tokens=0)})
    preempt = StepPlan(preempted=("a",))
    steps = [(at(before, 0), NOTHING, at(before, 1)),  # judged: the baseline of the 2 requests added
             (at(before, 1), LOAD_R, at(held, 2)), (at(held, 2), preempt, at(held, 3))]
    assert violations("bounded-preemptions", steps) == []
    judged = ("bounded-preemptions", 5, "a", "preempted 1 times after the last arrival > bound 0")
    assert violations("bounded-preemptions", steps + [(at(held, 3), NOTHING, at(admitted, 4)),
                                                      (at(admitted, 4), NOTHING, at(admitted, 5)),
                                                      (at(admitted, 5), preempt, at(admitted, 6))]) == [judged]
    assert violations("bounded-preemptions", steps + [(at(held, 3), NOTHING, at(empty, 4)),
                                                      (at(empty, 4), NOTHING, at(empty, 5)),
                                                      (at(empty, 5), preempt, at(empty, 6))]) == [judged]
    sending = attrs.evolve(admitted, delayed_frees={"d": DelayedFree((7,), "sending")})
    assert violations("bounded-preemptions", [(at(sending, k), preempt, at(sending, k + 1)) for k in (1, 2)]) == []


def test_work_conserving_passes_over_loads_and_judges_the_requests_holding_loaded_blocks_first() -> None:
    """The head ``work-conserving`` judges with a KV connector (6 blocks free, 16 tokens of budget): ``r``,
    whose load the plan starts, or in flight (WAITING_FOR_REMOTE_KVS), is passed over and ``o`` behind it is the
    head: o fits and is left waiting, a violation naming o; a head whose load may start is not judged (the
    policy may hold it back); a request whose load landed comes first though it is behind o (o needs 5 blocks
    of the 2 free, l 1 of its 3). Kills the mutants of ``xǁWorkConservingǁobserve`` on the ``loaded`` set, the
    WAITING_FOR_REMOTE_KVS skip, the ``offers_load`` break and the ``holding_first`` order."""
    r = fresh("r", 10, num_external_computed_tokens=8)
    o = fresh("o", 4)
    state = SchedulerState(step=1, waiting=("r", "o"), requests={"r": r, "o": o}, free_block_ids=tuple(range(8)),
                           num_requests_added=2)
    fits = ("work-conserving", 1, "o", "head of the waiting queue fits (6 free blocks, 16 tokens, 4 slots left) but "
            "was not admitted")
    assert violations("work-conserving", [(state, LOAD_R, state)]) == [fits]
    inflight = attrs.evolve(state, requests={"r": loading("r", (0, 1)), "o": o}, free_block_ids=tuple(range(2, 8)))
    assert violations("work-conserving", [(inflight, NOTHING, inflight)]) == [fits]
    assert violations("work-conserving", [(state, NOTHING, state)]) == []
    behind = SchedulerState(step=1, waiting=("o", "l"), requests={"o": fresh("o", 20), "l": landed("l", 10, (0, 1))},
                            free_block_ids=(2, 3), num_requests_added=2)
    assert [v[2] for v in violations("work-conserving", [(behind, NOTHING, behind)])] == ["l"]


@pytest.mark.parametrize(("live", "marks", "pruned"), [(0, 64, False), (0, 65, True), (3, 70, False), (3, 71, True)])
def test_progress_prunes_marks_past_twice_the_live_requests_plus_64(live: int, marks: int, pruned: bool) -> None:
    """``Progress.forget_ended`` keeps at most 2 * live + 64 high-water marks (its memory does not grow with the
    trace; ``tests/test_spec_mutants.py`` pins the case of 1 live request, where ``2 *`` and ``2 /`` agree):
    with 0 live requests 64 marks are kept and 65 pruned, with 3 live 70 kept and 71 pruned to the live ones'.
    Kills ``xǁProgressǁforget_ended__mutmut_3`` (``2 *`` made ``2 /``: a ZeroDivisionError with none live, a
    prune at 65 with 3)."""
    from schedspec.spec.properties import Progress

    requests = {f"live{k}": fresh(f"live{k}", 2) for k in range(live)}
    marks_of = {f"r{k}": 1 for k in range(marks - live)} | {r: 5 for r in requests}
    monitor = Progress(CONFIG)
    monitor.high_water = dict(marks_of)
    monitor.forget_ended(SchedulerState(requests=requests, waiting=tuple(requests)))
    assert monitor.high_water == ({r: 5 for r in requests} if pruned else marks_of)


CACHING = attrs.evolve(CONFIG, enable_prefix_caching=True)


def _a_published_and_b_waiting(abort_a: bool) -> SchedulerState:
    """Prefix caching: ``a`` computed its 8-token prompt in blocks 0, 1 (published) and runs on, or was aborted
    (its blocks then evictable: free, still cached); ``b`` (the same 8 tokens and 3 more) waits."""
    prompt = tuple(range(100, 108))
    state = add_request(SchedulerState.initial(CACHING), Request("a", 0, prompt, max_tokens=4))
    state = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("a", 0, 8, (0, 1)),)), {"a": 7}, CACHING).state
    if abort_a:
        state = abort_request(state, "a")
    return add_request(state, Request("b", 1, prompt + (1, 2, 3), max_tokens=2))


def test_free_at_plan_takes_out_the_hits_on_evictable_blocks_only() -> None:
    """With prefix caching, ``b``'s hit on blocks 0, 1 leaves the free queue only if they were evictable: with
    ``a`` running (holding them) the free blocks at plan time are the 6 free less b's 1 new block: 5; with ``a``
    aborted (8 free, 0 and 1 evictable among them) 8 - 1 - 2 = 5 as well, but 7 if the hits were not counted.
    Kills ``x_free_at_plan__mutmut_7`` (``window_freed = None``: a hit on a held block tested ``in None``,
    TypeError) and the mutants of the evictable-hits term."""
    for abort_a, free in ((False, 6), (True, 8)):
        state = _a_published_and_b_waiting(abort_a)
        assert len(state.free_block_ids) == free
        new = tuple(b for b in state.free_block_ids if b not in (0, 1))[:1]
        plan = StepPlan(scheduled=(ScheduledRequest("b", 8, 3, new, (0, 1)),))
        assert free_at_plan(state, plan, CACHING) == 5, abort_a


def test_priority_inversion_counts_a_landed_requests_pending_tokens_without_its_loaded_ones() -> None:
    """``no-priority-inversion`` with chunked prefill off: ``w`` (priority 0) waits holding the 8 tokens its
    remote KV load computed, so it needs its 20 pending tokens (28 - 8) of budget, not 28 (nor 36); the step gives
    16 of 32 to less urgent ``l`` (priority 5): w is kept out only by l (16 left, 32 with l's). Kills
    ``xǁNoPriorityInversionǁobserve__mutmut_70`` (the pending tokens as ``num_tokens + num_computed_tokens``:
    36 never fits, the inversion passed; a waiting request without a load has nothing computed, where both
    agree)."""
    config = attrs.evolve(CONFIG, enable_chunked_prefill=False, max_num_batched_tokens=32, num_kv_blocks=40)
    w = attrs.evolve(landed("w", 28, (0, 1)), priority=0)
    low = fresh("l", 20, priority=5, status=RequestStatus.RUNNING, admitted_step=0)
    state = SchedulerState(step=1, waiting=("w",), running=("l",), requests={"w": w, "l": low},
                           free_block_ids=tuple(range(10, 40)), num_requests_added=2)
    plan = StepPlan(scheduled=(ScheduledRequest("l", 0, 16, (10, 11, 12, 13)),))
    assert violations("no-priority-inversion", [(state, plan, state)], config) == [
        ("no-priority-inversion", 1, "w", "priority 0 waits for 20 tokens of budget (16 left) held by less urgent "
                                          "running l")]
