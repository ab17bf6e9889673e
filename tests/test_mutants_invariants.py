"""Tests that kill the mutants mutmut found surviving in spec/invariants.py (issue 28, docs/testing.md
"Mutation score"): each asserts which invariant fires, for which request, with the numbers of its detail,
on a hand-made state whose breach is counted by hand here (not read back from the invariant). Each test
names the mutants it was written for (``scripts/mutmut.sh`` names, ``x_FUNCTION__mutmut_N``)."""

from __future__ import annotations

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import check_state
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import DelayedFree, SchedulerState

# block_size 4, 8 blocks: a running (blocks 0, 1), d finished, blocks 2..7 free (as tests/test_invariants.py)
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32)


def running(request_id: str, computed: int, block_ids: tuple[int, ...], groups: tuple[tuple[int, ...], ...] = (),
            prompt_len: int = 10) -> Request:
    """A running prefill with ``computed`` of its ``prompt_len`` prompt tokens computed."""
    return Request(request_id, 0, tuple(range(100, 100 + prompt_len)), max_tokens=4, status=RequestStatus.RUNNING,
                   num_computed_tokens=computed, block_ids=block_ids, group_block_ids=groups, admitted_step=0)


def done(request_id: str) -> Request:
    return Request(request_id, 0, (41, 42), max_tokens=1, status=RequestStatus.FINISHED_LENGTH,
                   finish_reason="length", num_computed_tokens=2, output_token_ids=(43,), admitted_step=0,
                   first_token_step=0)


def base(**changes) -> SchedulerState:
    """a running with 6 of 10 prompt tokens computed in blocks 0, 1; d finished; blocks 2..7 free."""
    state = SchedulerState(step=1, running=("a",), requests={"a": running("a", 6, (0, 1))}, finished={"d": done("d")},
                           free_block_ids=(2, 3, 4, 5, 6, 7), num_requests_added=2)
    return attrs.evolve(state, **changes)


def breaches(name: str, state: SchedulerState, config: SchedulerConfig = CONFIG) -> list[tuple[str | None, str]]:
    return [(v.request_id, v.detail) for v in check_state(state, config) if v.name == name]


def test_kv_capacity_counts_the_blocks_a_transfer_holds_for_an_ended_request() -> None:
    """``kv-capacity`` adds the blocks of ``delayed_frees`` to the requests' (a send of an ended request still
    holds them: vLLM ``_free_request(delay_free_blocks=True)``): 2 held by a + 7 by d's send = 9 > 8.
    Kills ``x_kv_capacity__mutmut_6`` (``+=`` made ``-=``: 2 - 7 passed)."""
    state = base(free_block_ids=(), delayed_frees={"d": DelayedFree((2, 3, 4, 5, 6, 7, 7), "sending")})
    assert breaches("kv-capacity", state) == [(None, "9 blocks held > num_kv_blocks=8")]


def test_a_block_both_free_and_held_for_a_transfer_is_blamed_on_the_ended_request() -> None:
    """A block held for d's send that is also in the free queue: ``block-conservation`` blames d, the request
    whose transfer holds it (the owner the user must look at). Kills ``x_block_conservation__mutmut_12`` (the
    owner of a delayed free recorded as ``None``: the breach named no request)."""
    state = base(delayed_frees={"d": DelayedFree((2,), "sending")})
    assert ("d", "block 2 is both free and owned") in breaches("block-conservation", state)


GROUPS3 = SchedulerConfig(block_size=2, num_kv_blocks=40, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32,
                          kv_cache_groups=({"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 4},
                                           {"kind": "full_attention"}))
"""Three KV cache groups, block_size 2: 8 computed tokens need 4 blocks in every group's table (a window's
null entries count: they keep the table's length)."""


def test_every_groups_table_must_hold_the_computed_tokens_and_each_is_named() -> None:
    """``table-covers-computed`` with three KV cache groups, 8 computed tokens (4 blocks of 2 per table):
    a's group 1 table has 2 blocks and its group 2 table 3: both are named, with their own counts; c's
    group 1 table holds exactly 8 tokens (no breach) and it has no group 2 table (0 blocks); a running id
    that is not a live request is passed over, not the end of the check.
    Kills ``x_table_covers_computed__mutmut_7, 8, 9`` (no group checked), ``_10`` (``continue`` made ``break``
    at the unknown id), ``_13`` (group 0 read as the last group), ``_14`` (no group), ``_15`` (group 1 left out),
    ``_18`` (a missing table indexed: IndexError), ``_20`` (each group read as the one before it), ``_22, _23``
    (a missing table indexed), ``_26, _27`` (the detail's last words)."""
    a = running("a", 8, (0, 1, 2, 3), ((4, 5), (6, 7, 8)))
    c = running("c", 8, (10, 11, 12, 13), ((14, 15, 16, 17),))
    state = SchedulerState(step=1, running=("ghost", "a", "c"), requests={"a": a, "c": c},
                           free_block_ids=tuple(range(18, 40)), num_requests_added=2)
    assert breaches("table-covers-computed", state, GROUPS3) == [
        ("a", "group 1: 2 blocks cannot hold 8 computed tokens"),
        ("a", "group 2: 3 blocks cannot hold 8 computed tokens"),
        ("c", "group 2: 0 blocks cannot hold 8 computed tokens"),
    ]


LOADING = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32)


def remote(request_id: str, **changes) -> Request:
    """A waiting request whose connector offers its first 8 prompt tokens (2 blocks of 4)."""
    return attrs.evolve(Request(request_id, 0, tuple(range(100, 110)), max_tokens=3, num_external_computed_tokens=8),
                        **changes)


def test_a_request_waiting_for_remote_kv_must_have_started_its_load() -> None:
    """``preempted-holds-nothing``: a request in WAITING_FOR_REMOTE_KVS with no load started (no
    ``kv_load_step``, no blocks) is named with that reason; a waiting id that is not a live request is
    passed over. Kills ``x_preempted_holds_nothing__mutmut_5`` (``continue`` made ``break`` at the unknown
    id), ``_6`` (``loading = None``: nothing reported, it holds no blocks) and ``_10`` (the detail)."""
    r = remote("r", status=RequestStatus.WAITING_FOR_REMOTE_KVS)
    state = SchedulerState(step=1, waiting=("ghost", "r"), requests={"r": r}, free_block_ids=tuple(range(8)),
                           num_requests_added=1)
    assert breaches("preempted-holds-nothing", state, LOADING) == [("r", "waiting for remote KV without a load started")]


def test_a_load_in_flight_has_computed_exactly_its_loaded_tokens() -> None:
    """While its load is in flight (WAITING_FOR_REMOTE_KVS) a request's computed tokens are the loaded ones
    (8, vLLM sets ``num_computed_tokens`` to the external hit at ``allocate_slots``): 4 with the load's 2
    blocks is a breach, 8 is not. Kills ``x_preempted_holds_nothing__mutmut_6`` (``loading = None``: the
    in-flight count was never compared)."""

    def state(computed: int) -> SchedulerState:
        r = remote("r", status=RequestStatus.WAITING_FOR_REMOTE_KVS, kv_load_step=0, block_ids=(0, 1),
                   num_computed_tokens=computed)
        return SchedulerState(step=1, waiting=("r",), requests={"r": r}, free_block_ids=(2, 3, 4, 5, 6, 7),
                              num_requests_added=1)

    assert breaches("preempted-holds-nothing", state(4), LOADING) == [
        ("r", "waiting on its remote KV load of 8 tokens with 2 blocks and 4 computed tokens")]
    assert breaches("preempted-holds-nothing", state(8), LOADING) == []


def waiting_state(*requests: Request) -> SchedulerState:
    held = {b for r in requests for table in (r.block_ids, *r.group_block_ids) for b in table}
    return SchedulerState(step=1, waiting=tuple(r.request_id for r in requests),
                          requests={r.request_id: r for r in requests},
                          free_block_ids=tuple(b for b in range(8) if b not in held), num_requests_added=len(requests))


def test_which_waiting_requests_may_hold_blocks_and_what_each_breach_says() -> None:
    """``preempted-holds-nothing``, one request per case (block_size 4, the connector offers 8 tokens = 2
    blocks), each breach with its own detail:

    - ``p``: a plain waiting request (no load) holding 2 blocks: "waiting with 2 blocks and 0 computed tokens";
    - ``g``: a plain waiting request holding only a KV cache group's table (1 block): a breach too;
    - ``w``: its load landed (WAITING, ``kv_load_step`` set) with 1 block instead of 2: a breach of the load's
      table, though its 4 computed tokens fit the block;
    - ``x``: its load landed with its 2 blocks and 9 computed tokens (8 slots): a breach;
    - ``ok``: its load landed with its 2 blocks and nothing computed: no breach (the table is the load's
      and holds the computed tokens).

    Kills ``x_preempted_holds_nothing__mutmut_13`` (p judged as a load: another detail), ``_16`` (ok judged
    as a plain waiting request), ``_17`` (g passed), ``_19, _20`` (the detail's last words), ``_21`` (x passed:
    only a load in flight compared its computed tokens), ``_22`` (w passed: a wrong table needed too many
    computed tokens as well)."""
    landed = {"status": RequestStatus.WAITING, "kv_load_step": 0}
    state = waiting_state(
        Request("p", 0, (1, 2, 3, 4, 5), max_tokens=3, block_ids=(0, 1)),
        Request("g", 0, (1, 2, 3, 4, 5), max_tokens=3, group_block_ids=((2,),)),
        remote("w", block_ids=(3,), num_computed_tokens=4, **landed),
        remote("x", block_ids=(4, 5), num_computed_tokens=9, **landed),
        remote("ok", block_ids=(6, 7), **landed),
    )
    assert breaches("preempted-holds-nothing", state, LOADING) == [
        ("p", "waiting with 2 blocks and 0 computed tokens"),
        ("g", "waiting with 1 blocks and 0 computed tokens"),
        ("w", "waiting on its remote KV load of 8 tokens with 1 blocks and 4 computed tokens"),
        ("x", "waiting on its remote KV load of 8 tokens with 2 blocks and 9 computed tokens"),
    ]


def test_blocks_held_for_a_transfer_belong_to_an_ended_request_and_are_some() -> None:
    """``delayed-frees-ended``: blocks held for the transfer of an id that is neither live nor terminal
    (``ghost``) are a breach as much as those of a live request (``a``); an entry of an ended request with no
    block is named with its own detail. Kills ``x_delayed_frees_ended__mutmut_1`` (``or`` made ``and``: the
    unknown id passed) and ``_5, _6`` (the detail)."""
    state = base(delayed_frees={"ghost": DelayedFree((2,), "sending"), "a": DelayedFree((3,), "recving"),
                                "d": DelayedFree((), "sending")})
    assert breaches("delayed-frees-ended", state) == [
        ("ghost", "1 blocks held for the transfer of a request that has not ended"),
        ("a", "1 blocks held for the transfer of a request that has not ended"),
        ("d", "held for its transfer with no block"),
    ]


WINDOW = SchedulerConfig(block_size=2, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32,
                         kv_cache_groups=({"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 4}))
"""Block size 2, full attention and a sliding window of 4 tokens: at 8 computed tokens the window's next token
(position 8) no longer sees table indices 0 and 1 ((8 - 4 + 1) // 2 = 2), and still sees index 2 on."""


def test_a_window_must_hold_what_it_sees_and_a_table_past_the_groups_is_named() -> None:
    """``window-sees-held`` over three running ids: ``ghost`` (not a live request) is passed over; ``x`` holds
    a table for a third group with two configured: named once, and its other tables are not judged past it;
    ``a``'s window freed index 2, which the token at position 8 still sees. Kills
    ``x_window_sees_held__mutmut_5`` (``continue`` made ``break`` at the unknown id), ``_8`` (``>=`` made
    ``>``: the third table indexed a group that does not exist, IndexError) and ``_9`` (``break`` made
    ``return``: a was not judged after x)."""
    from schedspec.spec.kv_cache_groups import NULL_BLOCK

    x = running("x", 8, (0, 1, 2, 3), ((NULL_BLOCK, NULL_BLOCK, 4, 5), (6,)))
    a = running("a", 8, (7, 8, 9, 10), ((NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 11),))
    state = SchedulerState(step=1, running=("ghost", "x", "a"), requests={"x": x, "a": a},
                           free_block_ids=(12, 13, 14, 15), num_requests_added=2)
    assert breaches("window-sees-held", state, WINDOW) == [
        ("x", "holds a table for group 2, but 2 groups are configured"),
        ("a", "group 1: table index 2 was freed, but the window of the token at position 8 still sees it"),
    ]


def cached_window_state() -> SchedulerState:
    """Prefix caching with the two groups of ``WINDOW``: after step 0, ``a`` computed its 8-token prompt in
    group 0's blocks 0..3 and the window's 4..7, all published (each group's under its own key)."""
    from schedspec.spec.state import ScheduledRequest, StepPlan
    from schedspec.spec.transitions import add_request, apply_plan

    config = attrs.evolve(WINDOW, enable_prefix_caching=True)
    state = add_request(SchedulerState.initial(config), Request("a", 0, tuple(range(10, 18)), max_tokens=4))
    plan = StepPlan(scheduled=(ScheduledRequest("a", 0, 8, (0, 1, 2, 3), group_new_block_ids=((4, 5, 6, 7),)),))
    state = apply_plan(state, plan, {"a": 21}, config).state
    assert check_state(state, config) == []
    return state


def test_a_groups_cached_blocks_are_judged_under_that_groups_key() -> None:
    """``prefix-published-computed`` with KV cache groups: the window group's blocks, published under group 1's
    key (vLLM ``BlockHashWithGroupId``), pass; with two of them swapped in a's window table (block 5 at index 0)
    the breach names a, the group, the block and its index. Kills
    ``x_prefix_published_computed__mutmut_22, _23`` (the groups numbered from 0 or 2: every window block
    under the wrong key), ``_24`` (the groups' breach dropped) and ``_25`` (no request given: TypeError)."""
    state = cached_window_state()
    config = attrs.evolve(WINDOW, enable_prefix_caching=True)
    assert breaches("prefix-published-computed", state, config) == []
    a = state.requests["a"]
    swapped = attrs.evolve(state, requests={"a": attrs.evolve(a, group_block_ids=((5, 4, 6, 7),))})
    assert breaches("prefix-published-computed", swapped, config) == [
        ("a", "group 1: block 5 at index 0 is cached under another key than its tokens'")]


def test_a_table_holding_a_block_twice_is_named() -> None:
    """``prefix-ref-counts``: a's group 0 table holds block 2 twice (index 2 and 3): named with the table.
    Kills ``x_prefix_ref_counts__mutmut_7`` (only null entries compared: the duplicate passed)."""
    state = cached_window_state()
    config = attrs.evolve(WINDOW, enable_prefix_caching=True)
    a = state.requests["a"]
    twice = attrs.evolve(state, requests={"a": attrs.evolve(a, block_ids=(0, 1, 2, 2))})
    assert [b for b in breaches("prefix-ref-counts", twice, config) if b[0] == "a"] == [
        ("a", "holds a block twice in its table [0, 1, 2, 2]")]
