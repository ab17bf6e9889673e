"""The spec's transitions (:mod:`schedspec.spec.transitions`) on hand-made states: arrivals, aborts,
preemption, admission, sampling, finishing and the stop reasons. The expected values are worked out
in the comments from the documented semantics (vLLM ``_preempt_request``, ``check_stop``,
``KVCacheManager.free``)."""

from __future__ import annotations

import attrs
import pytest

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import check_state, check_step
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.transitions import PlanError, abort_request, add_request, apply_plan, stop_reason

# block_size 4, 8 blocks, budget 16, 4 sequences, max_model_len 12.
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=12)
EOS = 0


def fresh(request_id: str, prompt_len: int, max_tokens: int = 4, arrival_step: int = 0) -> Request:
    return Request(request_id, arrival_step, tuple(range(100, 100 + prompt_len)), max_tokens=max_tokens,
                   eos_token_id=EOS)


def running(request_id: str, prompt_len: int, outputs: tuple[int, ...], blocks: tuple[int, ...],
            max_tokens: int = 4) -> Request:
    """Prompt computed, ``outputs`` sampled, the last one not yet fed back (a decode is pending)."""
    return Request(
        request_id, 0, tuple(range(100, 100 + prompt_len)), max_tokens=max_tokens, eos_token_id=EOS,
        status=RequestStatus.RUNNING, num_computed_tokens=prompt_len + len(outputs) - 1,
        output_token_ids=outputs, block_ids=blocks, admitted_step=0, first_token_step=0,
    )


def state_with(running_requests: list[Request], waiting: list[Request] = (), free: tuple[int, ...] = (),
               step: int = 3) -> SchedulerState:
    requests = {r.request_id: r for r in list(running_requests) + list(waiting)}
    state = SchedulerState(
        step=step, waiting=tuple(r.request_id for r in waiting), running=tuple(r.request_id for r in running_requests),
        requests=requests, free_block_ids=free, num_requests_added=len(requests),
    )
    assert check_state(state, CONFIG) == [], "hand-made state must be valid"
    return state


# --------------------------------------------------------------------------------------- arrivals
def test_add_request_joins_back_of_waiting_queue() -> None:
    state = SchedulerState.initial(CONFIG)
    state = add_request(state, fresh("x", 3))
    state = add_request(state, fresh("y", 2))
    assert state.waiting == ("x", "y")
    assert state.num_requests_added == 2
    assert state.requests["y"].status is RequestStatus.WAITING
    assert state.free_block_ids == tuple(range(8))
    assert check_state(state, CONFIG) == []


def test_add_request_refuses_a_duplicate_id_even_after_it_ended() -> None:
    state = add_request(SchedulerState.initial(CONFIG), fresh("x", 3))
    with pytest.raises(PlanError, match="already added"):
        add_request(state, fresh("x", 5))
    ended = abort_request(state, "x")
    with pytest.raises(PlanError, match="already added"):
        add_request(ended, fresh("x", 5))


def test_add_request_refuses_a_request_that_is_not_fresh() -> None:
    with pytest.raises(PlanError, match="not a fresh request"):
        add_request(SchedulerState.initial(CONFIG), running("x", 4, (7,), (0,)))


# ----------------------------------------------------------------------------------------- aborts
def test_abort_running_request_frees_its_blocks_last_block_first() -> None:
    a = running("a", 6, (7,), (3, 5))
    state = state_with([a], free=(0, 1, 2, 4, 6, 7))
    after = abort_request(state, "a")
    assert after.running == ()
    assert "a" not in after.requests
    ended = after.finished["a"]
    assert (ended.status, ended.finish_reason, ended.block_ids) == (RequestStatus.FINISHED_ABORTED, "abort", ())
    # Freed blocks go to the front of the free queue, last block of the table first (vLLM 0.32
    # BlockPool.free_blocks: blocks without a hash are prepended).
    assert after.free_block_ids == (5, 3, 0, 1, 2, 4, 6, 7)
    assert check_state(after, CONFIG) == []


def test_abort_waiting_request_leaves_the_queue() -> None:
    state = state_with([], waiting=[fresh("w1", 2), fresh("w2", 2)], free=tuple(range(8)))
    after = abort_request(state, "w1")
    assert after.waiting == ("w2",)
    assert after.finished["w1"].status is RequestStatus.FINISHED_ABORTED
    assert after.free_block_ids == state.free_block_ids


def test_abort_of_unknown_or_finished_request_is_a_no_op() -> None:
    state = state_with([running("a", 6, (7,), (0, 1))], free=(2, 3, 4, 5, 6, 7))
    assert abort_request(state, "never-added") == state
    ended = abort_request(state, "a")
    assert abort_request(ended, "a") == ended
    assert ended.finished["a"].finish_reason == "abort"


# ------------------------------------------------------------------------------------- preemption
def test_preempt_frees_blocks_and_requeues_at_front() -> None:
    a = running("a", 6, (7,), (0, 1))
    b = running("b", 3, (8,), (2,))
    w = fresh("w", 2)
    state = state_with([a, b], waiting=[w], free=(3, 4, 5, 6, 7))
    result = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("a", 6, 1),), preempted=("b",)), {"a": 9}, CONFIG)
    after = result.state
    assert after.waiting == ("b", "w")  # at the front, ahead of the fresh request
    assert after.running == ("a",)
    preempted = after.requests["b"]
    assert preempted.status is RequestStatus.PREEMPTED
    assert (preempted.num_computed_tokens, preempted.block_ids, preempted.num_preemptions) == (0, (), 1)
    assert preempted.output_token_ids == (8,)  # outputs are kept and recomputed
    assert 2 in after.free_block_ids and len(after.free_block_ids) == 6
    assert check_step(state, StepPlan(scheduled=(ScheduledRequest("a", 6, 1),), preempted=("b",)), after, CONFIG) == []


def test_two_preemptions_last_listed_ends_at_front() -> None:
    a = running("a", 3, (7,), (0,))
    b = running("b", 3, (8,), (1,))
    state = state_with([a, b], free=(2, 3, 4, 5, 6, 7))
    after = apply_plan(state, StepPlan(preempted=("a", "b")), {}, CONFIG).state
    assert after.waiting == ("b", "a")
    # Released in plan order, each to the front: b's block ahead of a's, both ahead of the free ones.
    assert after.free_block_ids == (1, 0, 2, 3, 4, 5, 6, 7)


def test_preempted_request_is_readmitted_and_recomputes_prompt_and_outputs() -> None:
    b = running("b", 3, (8,), (2,))
    state = state_with([b], free=(0, 1, 3, 4, 5, 6, 7))
    after = apply_plan(state, StepPlan(preempted=("b",)), {}, CONFIG).state
    assert after.requests["b"].num_pending_tokens == 4  # 3 prompt + 1 output to recompute
    plan = StepPlan(scheduled=(ScheduledRequest("b", 0, 4, (0,)),))
    again = apply_plan(after, plan, {"b": 9}, CONFIG).state
    readmitted = again.requests["b"]
    assert readmitted.status is RequestStatus.RUNNING
    assert readmitted.admitted_step == after.step
    assert readmitted.output_token_ids == (8, 9)
    assert readmitted.first_token_step == 0  # the first token was sampled before the preemption


# --------------------------------------------------------------------------------------- admission
def test_admission_moves_request_to_running_and_takes_blocks_from_the_front() -> None:
    state = state_with([], waiting=[fresh("x", 5)], free=(4, 5, 6, 7, 0, 1, 2, 3), step=2)
    plan = StepPlan(scheduled=(ScheduledRequest("x", 0, 5, (4, 5)),))
    result = apply_plan(state, plan, {"x": 9}, CONFIG)
    x = result.state.requests["x"]
    assert (x.status, x.admitted_step, x.first_token_step) == (RequestStatus.RUNNING, 2, 2)
    assert x.block_ids == (4, 5) and x.num_computed_tokens == 5 and x.output_token_ids == (9,)
    assert result.state.free_block_ids == (6, 7, 0, 1, 2, 3)
    assert result.state.running == ("x",) and result.state.waiting == ()
    assert result.state.step == 3
    assert result.sampled == ("x",) and result.finished == ()


def test_middle_chunk_samples_nothing() -> None:
    state = state_with([], waiting=[fresh("x", 10)], free=tuple(range(8)))
    plan = StepPlan(scheduled=(ScheduledRequest("x", 0, 4, (0, 1, 2)),))
    result = apply_plan(state, plan, {"x": 9}, CONFIG)  # the extra token is ignored
    x = result.state.requests["x"]
    assert x.output_token_ids == () and x.num_computed_tokens == 4 and x.first_token_step is None
    assert result.sampled == ()


def test_rejected_request_ends_with_its_reason() -> None:
    state = state_with([], waiting=[fresh("x", 20)], free=tuple(range(8)))
    after = apply_plan(state, StepPlan(rejected=(("x", "prompt too long"),)), {}, CONFIG).state
    assert after.waiting == ()
    assert (after.finished["x"].status, after.finished["x"].finish_reason) == (RequestStatus.REJECTED, "prompt too long")


def test_apply_plan_refuses_unknown_request_and_missing_sample() -> None:
    state = state_with([running("a", 6, (7,), (0, 1))], free=(2, 3, 4, 5, 6, 7))
    with pytest.raises(PlanError, match="not a live request"):
        apply_plan(state, StepPlan(scheduled=(ScheduledRequest("ghost", 0, 1),)), {}, CONFIG)
    with pytest.raises(PlanError, match="no sampled token"):
        apply_plan(state, StepPlan(scheduled=(ScheduledRequest("a", 6, 1),)), {}, CONFIG)


# --------------------------------------------------------------------------------- finish and stop
def test_finish_frees_blocks_and_leaves_running() -> None:
    # a has 3 of its 4 outputs; this decode samples the 4th: max_tokens reached.
    a = running("a", 5, (7, 8, 9), (0, 1), max_tokens=4)
    b = running("b", 2, (7,), (2,))
    state = state_with([a, b], free=(3, 4, 5, 6, 7))
    plan = StepPlan(scheduled=(ScheduledRequest("a", 7, 1), ScheduledRequest("b", 2, 1)))
    result = apply_plan(state, plan, {"a": 10, "b": 11}, CONFIG)
    after = result.state
    assert result.finished == ("a",)
    assert after.running == ("b",)
    done = after.finished["a"]
    assert (done.status, done.finish_reason, done.block_ids) == (RequestStatus.FINISHED_LENGTH, "length", ())
    assert done.output_token_ids == (7, 8, 9, 10)
    assert sorted(after.free_block_ids) == [0, 1, 3, 4, 5, 6, 7]
    assert after.free_block_ids[:2] == (1, 0)  # freed to the front, last block first
    assert check_step(state, plan, after, CONFIG) == []


def test_eos_stops_with_reason_stop() -> None:
    a = running("a", 3, (7,), (0,), max_tokens=4)
    state = state_with([a], free=(1, 2, 3, 4, 5, 6, 7))
    result = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("a", 3, 1),)), {"a": EOS}, CONFIG)
    done = result.state.finished["a"]
    assert (done.status, done.finish_reason) == (RequestStatus.FINISHED_STOPPED, "stop")
    assert done.output_token_ids == (7, EOS)


def test_eos_stop_comes_before_max_model_len_and_max_tokens() -> None:
    # vLLM 0.32 vllm/v1/core/sched/utils.py check_stop tests EOS and stop ids before the length limits.
    # Prompt 10 + 2 outputs = 12 = max_model_len; the 2nd output is EOS and the max_tokens-th: "stop".
    a = running("a", 10, (7,), (0, 1, 2), max_tokens=2)
    state = state_with([a], free=(3, 4, 5, 6, 7))
    done = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("a", 10, 1),)), {"a": EOS}, CONFIG).state.finished["a"]
    assert (done.status, done.finish_reason) == (RequestStatus.FINISHED_STOPPED, "stop")
    # Any other token there ends it on length (max_model_len is checked before max_tokens).
    other = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("a", 10, 1),)), {"a": 9}, CONFIG).state.finished["a"]
    assert (other.status, other.finish_reason) == (RequestStatus.FINISHED_LENGTH, "max_model_len")


def test_eos_as_the_last_allowed_output_is_a_stop() -> None:
    a = running("a", 3, (7,), (0,), max_tokens=2)
    state = state_with([a], free=(1, 2, 3, 4, 5, 6, 7))
    done = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("a", 3, 1),)), {"a": EOS}, CONFIG).state.finished["a"]
    assert (done.status, done.finish_reason) == (RequestStatus.FINISHED_STOPPED, "stop")


def test_stop_ids_and_min_tokens() -> None:
    def after(outputs: tuple[int, ...], **fields) -> tuple | None:
        return stop_reason(Request("r", 0, (1, 2, 3), max_tokens=10, eos_token_id=EOS, output_token_ids=outputs,
                                   **fields), CONFIG)

    assert after((5, 42), stop_token_ids=(42,)) == (RequestStatus.FINISHED_STOPPED, "stop")
    assert after((5, 43), stop_token_ids=(42,)) is None
    # Before min_tokens outputs neither EOS nor a stop id stops it (vLLM's sampler never samples them).
    assert after((5, EOS), min_tokens=3) is None
    assert after((5, 42), min_tokens=3, stop_token_ids=(42,)) is None
    assert after((5, 6, EOS), min_tokens=3) == (RequestStatus.FINISHED_STOPPED, "stop")


def test_stop_reason_directly() -> None:
    def with_outputs(prompt_len: int, outputs: tuple[int, ...], max_tokens: int, eos: int | None = EOS) -> Request:
        return Request("r", 0, tuple(range(1, prompt_len + 1)), max_tokens=max_tokens, eos_token_id=eos,
                       output_token_ids=outputs)

    assert stop_reason(with_outputs(3, (5,), 4), CONFIG) is None
    assert stop_reason(with_outputs(3, (5, 6, 7, 8), 4), CONFIG) == (RequestStatus.FINISHED_LENGTH, "length")
    assert stop_reason(with_outputs(11, (5,), 4), CONFIG) == (RequestStatus.FINISHED_LENGTH, "max_model_len")
    assert stop_reason(with_outputs(3, (5, EOS), 4), CONFIG) == (RequestStatus.FINISHED_STOPPED, "stop")
    # Without an EOS id the token 0 is an ordinary token.
    assert stop_reason(with_outputs(3, (5, 0), 4, eos=None), CONFIG) is None
    # A prompt of exactly max_model_len still samples one token, then stops on length.
    assert stop_reason(with_outputs(12, (5,), 4), CONFIG) == (RequestStatus.FINISHED_LENGTH, "max_model_len")


def test_add_request_refuses_negative_max_tokens() -> None:
    """The proofs' arrival assumes max_tokens >= 0 (encoding.arrive_precondition); 0 is allowed (it is
    rejected at the next step as no-output), -1 is not a request."""
    state = SchedulerState.initial(CONFIG)
    assert add_request(state, fresh("zero", 3, max_tokens=0)).waiting == ("zero",)
    with pytest.raises(PlanError, match="max_tokens=-1 < 0"):
        add_request(state, fresh("negative", 3, max_tokens=-1))


def test_add_request_refuses_an_arrival_step_other_than_the_states_step() -> None:
    """The proofs' arrival sets arrival_step to the state's step (encoding.arrive), and bounded-wait ranks
    requests by it: a request is added before the step it names, not before an earlier or later one."""
    state = SchedulerState.initial(CONFIG)
    assert add_request(state, fresh("now", 3, arrival_step=0)).waiting == ("now",)
    later = attrs.evolve(state, step=2)
    assert add_request(later, fresh("now2", 3, arrival_step=2)).waiting == ("now2",)
    for step in (0, 1, 3):
        with pytest.raises(PlanError, match=f"arrival_step={step}, but it is added before step 2"):
            add_request(later, fresh(f"off{step}", 3, arrival_step=step))


def test_each_action_docstring_names_exactly_its_guard_rules() -> None:
    """The module docstring of spec/transitions.py lists each action's guard; it must name exactly the
    rules registered for that action (``Rule.action``), so the reading path cannot go stale."""
    import re

    from schedspec.spec import transitions
    from schedspec.spec.rules import ACTIONS, RULES

    doc = transitions.__doc__
    listed: dict[str, set[str]] = {}
    for action in ACTIONS:
        if action == "step":
            match = re.search(r"guard the step itself: (.*?)\.\s", doc, re.S)
        else:
            match = re.search(rf":func:`{action}`:.*?Guard: (.*?)\.\n", doc, re.S)
        assert match, f"no guard listed for {action}"
        listed[action] = set(re.findall(r"``([a-z-]+)``", match.group(1)))
    registered = {action: {r.name for r in RULES if r.action == action} for action in ACTIONS}
    assert listed == registered
    assert all(callable(getattr(transitions, a)) for a in ACTIONS if a != "step")
