"""Tests that kill mutmut mutants of :mod:`schedspec.spec.transitions` (issue 28): each asserts a state, a count
or the key facts of a message that a mutant of one action gets wrong, worked out by hand in the comments from
the documented semantics (vLLM 0.32 ``Scheduler.schedule``, ``_preempt_request``, ``update_from_output``,
``KVCacheManager.free``), not copied from the code under test. Each test's docstring names the mutants'
function and what they break."""

from __future__ import annotations

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import check_state
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.transitions import apply_plan

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
