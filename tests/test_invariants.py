"""Every named invariant of :mod:`schedspec.spec.invariants` can fail: a hand-made bad state (or step)
is reported under the invariant's registered name, and its good twin is clean. Every registered
invariant must have a case here (``test_every_invariant_has_a_case``).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
from test_kv_cache_groups import GROUP_STATE_CASES
from test_prefix_cache import PREFIX_STATE_CASES, PREFIX_STEP_CASES
from test_remote_kv import REMOTE_KV_STATE_CASES
from test_speculative import SPEC_STATE_CASES, SPEC_STEP_CASES

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import (
    INVARIANT_NAMES,
    STATE_INVARIANTS,
    STEP_INVARIANTS,
    check_state,
    check_step,
)
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan

# block_size 4, 8 blocks, budget 16 tokens, 2 sequences, max_model_len 32.
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32)


def running_a(**changes) -> Request:
    """6 prompt tokens computed, 1 output: 7 tokens, a decode pending; blocks 0, 1 (8 slots)."""
    request = Request(
        "a", 0, (11, 12, 13, 14, 15, 16), max_tokens=4, status=RequestStatus.RUNNING,
        num_computed_tokens=6, output_token_ids=(21,), block_ids=(0, 1), admitted_step=0, first_token_step=0,
    )
    return attrs.evolve(request, **changes)


def waiting_b(**changes) -> Request:
    return attrs.evolve(Request("b", 1, (31, 32, 33, 34, 35), max_tokens=3), **changes)


def done_d() -> Request:
    return Request("d", 0, (41, 42), max_tokens=1, status=RequestStatus.FINISHED_LENGTH, finish_reason="length",
                   num_computed_tokens=2, output_token_ids=(43,), admitted_step=0, first_token_step=0)


def state_of(a: Request | None = None, b: Request | None = None, **changes) -> SchedulerState:
    """a running, b waiting, d finished; blocks 2..7 free."""
    a = a or running_a()
    b = b or waiting_b()
    state = SchedulerState(
        step=1, waiting=("b",), running=("a",), requests={"a": a, "b": b}, finished={"d": done_d()},
        free_block_ids=(2, 3, 4, 5, 6, 7), num_requests_added=3,
    )
    return attrs.evolve(state, **changes)


def two_running() -> SchedulerState:
    c = Request("c", 0, (51, 52), max_tokens=4, status=RequestStatus.RUNNING, num_computed_tokens=2,
                output_token_ids=(53,), block_ids=(2,), admitted_step=0, first_token_step=0)
    state = state_of()
    return attrs.evolve(state, running=("a", "c"), requests={**state.requests, "c": c},
                        free_block_ids=(3, 4, 5, 6, 7), num_requests_added=4)


StateCase = Callable[[], tuple[SchedulerState, SchedulerState, SchedulerConfig, SchedulerConfig]]
"""(bad state, good twin, config for the bad one, config for the good one)."""


def case_sequence_cap():
    return two_running(), two_running(), CONFIG.with_changes(max_num_seqs=1), CONFIG


def case_kv_capacity():
    # a holds 2 blocks; a pool of 1 block cannot hold them.
    return state_of(), state_of(), CONFIG.with_changes(num_kv_blocks=1), CONFIG


def case_block_conservation():
    # Block 0 is owned by a and also in the free queue.
    return state_of(free_block_ids=(2, 3, 4, 5, 6, 7, 0)), state_of(), CONFIG, CONFIG


def case_table_covers_computed():
    # 6 computed tokens in one block of 4 slots.
    bad = state_of(a=running_a(block_ids=(0,)), free_block_ids=(1, 2, 3, 4, 5, 6, 7))
    return bad, state_of(), CONFIG, CONFIG


def case_queues_disjoint():
    return state_of(waiting=("b", "b")), state_of(), CONFIG, CONFIG


def case_no_request_lost():
    # Four were added, three are known.
    return state_of(num_requests_added=4), state_of(), CONFIG, CONFIG


def case_output_bound():
    # a's prompt is 6 tokens and it has 2 outputs: 8 tokens. With max_model_len 7 the second output
    # should never have been sampled (8 > max(7, 6 + 1)); with max_model_len 8 it fits.
    a = running_a(num_computed_tokens=7, output_token_ids=(21, 22))
    return state_of(a=a), state_of(a=a), CONFIG.with_changes(max_model_len=7), CONFIG.with_changes(max_model_len=8)


def case_computed_bound():
    # 8 computed tokens of a 7-token sequence (its blocks hold 8 slots, so only this bound is broken).
    return state_of(a=running_a(num_computed_tokens=8)), state_of(), CONFIG, CONFIG


def case_preempted_holds_nothing():
    # Waiting b holds block 2.
    bad = state_of(b=waiting_b(block_ids=(2,)), free_block_ids=(3, 4, 5, 6, 7))
    return bad, state_of(), CONFIG, CONFIG


STATE_CASES: dict[str, StateCase] = {
    "running-within-max-num-seqs": case_sequence_cap,
    "kv-capacity": case_kv_capacity,
    "block-conservation": case_block_conservation,
    "table-covers-computed": case_table_covers_computed,
    "queues-disjoint": case_queues_disjoint,
    "no-request-lost": case_no_request_lost,
    "output-bound": case_output_bound,
    "computed-bound": case_computed_bound,
    "preempted-holds-nothing": case_preempted_holds_nothing,
}
STATE_CASES.update(PREFIX_STATE_CASES)  # the prefix-caching invariants' cases live with the other prefix tests
STATE_CASES.update(SPEC_STATE_CASES)  # the speculative-decoding ones with the speculative-decoding tests
STATE_CASES.update(GROUP_STATE_CASES)  # the KV cache groups' with their tests (test_kv_cache_groups.py)
STATE_CASES.update(REMOTE_KV_STATE_CASES)  # the remote KV loads' with their tests (test_remote_kv.py)

DECODE_A = ScheduledRequest("a", 6, 1)


def after_decode(computed: int) -> SchedulerState:
    """The state after a decodes (token 22 sampled), with a's computed tokens set to ``computed``."""
    return state_of(a=running_a(num_computed_tokens=computed, output_token_ids=(21, 22)), step=2)


StepCase = Callable[[], tuple[tuple, tuple]]
"""(bad (before, plan, after, config), good twin)."""


def case_chunks_in_order():
    # a decodes 1 token from 6 computed; afterwards it must have 7 computed, not 6.
    before = state_of()
    plan = StepPlan(scheduled=(DECODE_A,))
    return (before, plan, after_decode(6), CONFIG), (before, plan, after_decode(7), CONFIG)


STEP_CASES: dict[str, StepCase] = {
    "chunks-in-order": case_chunks_in_order,
}
STEP_CASES.update(PREFIX_STEP_CASES)
STEP_CASES.update(SPEC_STEP_CASES)


def test_every_invariant_has_a_case() -> None:
    assert {i.name for i in STATE_INVARIANTS} == set(STATE_CASES), "add a case for every state invariant"
    assert {i.name for i in STEP_INVARIANTS} == set(STEP_CASES), "add a case for every step invariant"
    assert set(INVARIANT_NAMES) == set(STATE_CASES) | set(STEP_CASES)


def test_hand_made_base_state_is_clean() -> None:
    assert check_state(state_of(), CONFIG) == []
    assert check_state(two_running(), CONFIG) == []
    assert check_state(SchedulerState.initial(CONFIG), CONFIG) == []


@pytest.mark.parametrize("name", sorted(STATE_CASES))
def test_state_invariant_reports_bad_state_by_name(name: str) -> None:
    bad, good, bad_config, good_config = STATE_CASES[name]()
    found = check_state(bad, bad_config)
    assert name in {v.name for v in found}, found
    assert all(v.step == bad.step for v in found)
    assert check_state(good, good_config) == []
    (registered,) = [i for i in STATE_INVARIANTS if i.name == name]
    assert list(registered.check(bad, bad_config))
    assert not list(registered.check(good, good_config))
    assert registered.kind == "state" and registered.statement and registered.source


@pytest.mark.parametrize("name", sorted(STEP_CASES))
def test_step_invariant_reports_bad_step_by_name(name: str) -> None:
    bad, good = STEP_CASES[name]()
    found = check_step(*bad)
    assert name in {v.name for v in found}, found
    assert check_step(*good) == []
    (registered,) = [i for i in STEP_INVARIANTS if i.name == name]
    assert list(registered.check(*bad))
    assert not list(registered.check(*good))
    assert registered.kind == "step" and registered.statement and registered.source


def test_check_step_also_checks_the_state_after() -> None:
    before = state_of()
    plan = StepPlan(scheduled=(DECODE_A,))
    after = attrs.evolve(after_decode(7), num_requests_added=9)
    assert "no-request-lost" in {v.name for v in check_step(before, plan, after, CONFIG)}


def test_terminal_request_owning_blocks_breaks_conservation() -> None:
    done = attrs.evolve(done_d(), block_ids=(7,))
    bad = state_of(finished={"d": done}, free_block_ids=(2, 3, 4, 5, 6))
    found = check_state(bad, CONFIG)
    assert ("block-conservation", "d") in {(v.name, v.request_id) for v in found}


def test_block_id_out_of_range_is_reported() -> None:
    bad = state_of(free_block_ids=(2, 3, 4, 5, 6, 8))
    found = check_state(bad, CONFIG)
    assert any(v.name == "block-conservation" and "out of range" in v.detail for v in found), found


def test_running_request_with_waiting_status_is_reported() -> None:
    bad = state_of(a=running_a(status=RequestStatus.WAITING))
    assert ("queues-disjoint", "a") in {(v.name, v.request_id) for v in check_state(bad, CONFIG)}


def test_live_request_outside_both_queues_is_lost() -> None:
    bad = state_of(waiting=())
    assert ("no-request-lost", "b") in {(v.name, v.request_id) for v in check_state(bad, CONFIG)}


def test_too_many_outputs_breaks_output_bound() -> None:
    bad = state_of(a=running_a(max_tokens=0))
    assert ("output-bound", "a") in {(v.name, v.request_id) for v in check_state(bad, CONFIG)}


def test_prompt_of_max_model_len_may_sample_one_token() -> None:
    # vLLM check_stop runs after sampling: a 6-token prompt with max_model_len 6 ends with 7 tokens.
    a = running_a()  # prompt 6, one output
    config = CONFIG.with_changes(max_model_len=6)
    assert "output-bound" not in {v.name for v in check_state(state_of(a=a), config)}
    two = running_a(num_computed_tokens=7, output_token_ids=(21, 22))
    assert "output-bound" in {v.name for v in check_state(state_of(a=two), config)}


@pytest.mark.parametrize("kind", ["state", "step"])
def test_invariant_decorators_register_the_check_with_its_docstring(kind: str) -> None:
    """``@state_invariant`` / ``@step_invariant`` append an Invariant whose statement is the check's
    docstring without surrounding blank space (empty when it has none), and return the check itself."""
    from schedspec.spec.invariants import (
        STATE_INVARIANTS,
        STEP_INVARIANTS,
        Invariant,
        state_invariant,
        step_invariant,
    )

    registry, decorator = (STATE_INVARIANTS, state_invariant) if kind == "state" else (STEP_INVARIANTS, step_invariant)

    def documented(*args):
        """
        Nothing breaks.
        """
        yield from ()

    def bare(*args):
        yield from ()

    count = len(registry)
    try:
        assert decorator("probe-documented", "a source")(documented) is documented
        assert decorator("probe-bare", "another source")(bare) is bare
        assert registry[count:] == [
            Invariant("probe-documented", "Nothing breaks.", "a source", documented, kind),
            Invariant("probe-bare", "", "another source", bare, kind),
        ]
    finally:
        del registry[count:]
