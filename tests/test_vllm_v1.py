"""The ``vllm-v1`` profile: one small state per rule of vLLM 0.32's ``Scheduler.schedule`` in which that
rule decides the plan. Each expected plan is worked out by hand from vLLM's source (cited per test,
``vllm/v1/core/sched/scheduler.py`` unless said otherwise), not taken from the policy's output; each
plan must also be allowed by the spec. The stateful suite (tests/test_stateful.py) runs the profile
on random workloads; here the bundled scenarios it supports replay on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from schedspec.reference import policies
from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
from schedspec.reference.vllm_v1 import (
    plan_vllm_v1,
    vllm_v1,
    vllm_v1_033,
    vllm_v1_priority,
    vllm_v1_priority_033,
)
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import violated_rules
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan

# block_size 4, 8 blocks, budget 16 tokens, 4 sequences, max_model_len 64.
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)


def running(request_id: str, prompt_len: int, computed: int, blocks: Sequence[int], outputs: int = 0,
            priority: int = 0, arrival_time: float = 0.0) -> Request:
    """A running request with ``computed`` tokens computed, ``outputs`` sampled tokens and these blocks."""
    return Request(request_id, 0, tuple(range(100, 100 + prompt_len)), max_tokens=32, priority=priority,
                   arrival_time=arrival_time, status=RequestStatus.RUNNING, num_computed_tokens=computed,
                   output_token_ids=tuple(range(200, 200 + outputs)), block_ids=tuple(blocks), admitted_step=0)


def decode(request_id: str, prompt_len: int, blocks: Sequence[int], priority: int = 0,
           arrival_time: float = 0.0) -> Request:
    """A running decode: prompt computed, one output sampled, one token pending."""
    return running(request_id, prompt_len, prompt_len, blocks, outputs=1, priority=priority, arrival_time=arrival_time)


def waiting(request_id: str, prompt_len: int, priority: int = 0, arrival_time: float = 0.0,
            max_tokens: int = 4) -> Request:
    return Request(request_id, 0, tuple(range(300, 300 + prompt_len)), max_tokens=max_tokens, priority=priority,
                   arrival_time=arrival_time)


def state(run: Sequence[Request], wait: Sequence[Request] = (), free: Sequence[int] | None = None,
          config: SchedulerConfig = CONFIG) -> SchedulerState:
    requests = {r.request_id: r for r in [*run, *wait]}
    held = {b for r in run for b in r.block_ids}
    if free is None:
        free = [b for b in range(config.num_kv_blocks) if b not in held]
    return SchedulerState(step=3, running=tuple(r.request_id for r in run), waiting=tuple(r.request_id for r in wait),
                          requests=requests, free_block_ids=tuple(free), num_requests_added=len(requests))


def planned(plan_function, before: SchedulerState, config: SchedulerConfig = CONFIG) -> StepPlan:
    plan = plan_function(before, config)
    assert violated_rules(before, plan, config) == []
    return plan


def test_running_requests_in_list_order_without_decodes_first() -> None:
    """The running loop walks ``self.running`` in order: a prefill chunk first in the list takes the
    whole budget (min(22 pending, 16) = 16 tokens) and the decode after it gets nothing; fcfs puts the
    decode first."""
    before = state([running("p", 30, 8, [0, 1]), decode("d", 4, [3, 4])])
    plan = planned(vllm_v1, before)
    # p: 8 + 16 = 24 tokens need ceil(24 / 4) = 6 blocks, it holds 2: the free queue's first 4, 2 5 6 7
    assert plan == StepPlan(scheduled=(ScheduledRequest("p", 8, 16, (2, 5, 6, 7)),))
    assert [i.request_id for i in policies.fcfs(before, CONFIG).scheduled][0] == "d"


def test_admission_stops_at_the_first_waiting_request_that_does_not_fit() -> None:
    """The waiting loop ``break``s when ``allocate_slots`` fails: ``big`` (20 tokens, 5 blocks > 4 free)
    is not admitted and ``small`` behind it (1 block), which fits, is not admitted either."""
    before = state([decode("r", 13, [0, 1, 2, 3])], [waiting("big", 20, max_tokens=1), waiting("small", 4)])
    assert planned(vllm_v1, before) == StepPlan(scheduled=(ScheduledRequest("r", 13, 1),))


def test_admission_checks_the_whole_sequence_but_allocates_the_first_chunk() -> None:
    """``allocate_slots(..., full_sequence_must_fit=True)`` (kv_cache_manager.py, default
    ``scheduler_reserve_full_isl=True``): a 20-token prompt needs 5 blocks free to be admitted, then gets
    blocks for its first chunk only: 16 tokens, 4 blocks."""
    fits = state([], [waiting("w", 20)], free=[0, 1, 2, 3, 4])
    assert planned(vllm_v1, fits) == StepPlan(scheduled=(ScheduledRequest("w", 0, 16, (0, 1, 2, 3)),))
    short = state([], [waiting("w", 20)], free=[0, 1, 2, 3])  # 4 blocks would hold the chunk, not the prompt
    assert planned(vllm_v1, short) == StepPlan()


def test_long_prefill_token_threshold_caps_waiting_and_running_prefills() -> None:
    """``if 0 < long_prefill_token_threshold < num_new_tokens: num_new_tokens = threshold`` in both
    loops: with threshold 5, the running prefill and each of two waiting prompts get 5 tokens."""
    config = CONFIG.with_changes(long_prefill_token_threshold=5)
    before = state([running("p", 12, 4, [0])], [waiting("a", 9), waiting("b", 9)], config=config)
    plan = planned(vllm_v1, before, config)
    assert [(i.request_id, i.num_tokens, len(i.new_block_ids)) for i in plan.scheduled] == [
        ("p", 5, 2),  # 4 + 5 = 9 tokens: 3 blocks, holds 1
        ("a", 5, 2),
        ("b", 5, 2),
    ]


def test_threshold_applies_even_to_a_lone_request() -> None:
    """Documented departure: vLLM lifts the threshold when only one request is running or waiting
    (``num_eligible_reqs > 1``); the spec's long-prefill-threshold rule does not, so the profile keeps it."""
    config = CONFIG.with_changes(long_prefill_token_threshold=5)
    before = state([], [waiting("a", 9)], config=config)
    assert [i.num_tokens for i in planned(vllm_v1, before, config).scheduled] == [5]


def test_without_chunked_prefill_a_prompt_over_the_budget_left_stops_admission() -> None:
    """``if not enable_chunked_prefill and num_new_tokens > request_token_budget: break``: after the
    two decodes (1 token each), 62 tokens are left; a 63-token prompt stops admission, the 2-token one
    behind it waits."""
    config = CONFIG.with_changes(enable_chunked_prefill=False, max_num_batched_tokens=64, num_kv_blocks=40)
    before = state([decode("d1", 4, [0, 1]), decode("d2", 4, [2, 3])],
                   [waiting("long", 63, max_tokens=1), waiting("short", 2)], config=config)
    plan = planned(vllm_v1, before, config)
    assert [i.request_id for i in plan.scheduled] == ["d1", "d2"]


def test_fcfs_preempts_the_last_running_request_and_reuses_its_blocks_first() -> None:
    """The decode ``a`` needs a 3rd block (8 tokens computed + 1), none is free: vLLM pops
    ``self.running[-1]`` (``c``), whose blocks go to the front of the free queue last block first
    (block_pool.py ``free_blocks`` prepend_n of ``reversed(blocks)``), so ``a`` gets block 7; ``b``
    still runs. No admission in a step that preempted (``if not preempted_reqs``), though ``w`` would fit."""
    a = running("a", 7, 8, [0, 1], outputs=2)  # 9 tokens, 8 computed
    b = decode("b", 3, [2])
    c = decode("c", 9, [5, 6, 7])
    before = state([a, b, c], [waiting("w", 1)], free=[])
    plan = planned(vllm_v1, before)
    assert plan.preempted == ("c",)
    assert plan.scheduled == (ScheduledRequest("a", 8, 1, (7,)), ScheduledRequest("b", 3, 1))


def test_a_request_that_preempts_itself_ends_the_running_phase() -> None:
    """``b`` (last) needs a block, none is free and it is itself ``self.running[-1]``: it is preempted
    (``if preempted_req == request: break``) and not scheduled; ``a`` before it ran."""
    a = decode("a", 3, [0])
    b = running("b", 7, 8, [1, 2], outputs=2)
    plan = planned(vllm_v1, state([a, b], free=[]))
    assert plan == StepPlan(scheduled=(ScheduledRequest("a", 3, 1),), preempted=("b",))


def test_priority_preempts_the_least_urgent_not_the_last() -> None:
    """Priority: the victim is ``max(self.running, key=(priority, arrival_time))``: ``b`` (priority 2),
    not the last one, ``c`` (priority 1)."""
    a = running("a", 7, 8, [0, 1], outputs=2, priority=0)
    b = decode("b", 3, [2], priority=2)
    c = decode("c", 3, [3], priority=1)
    plan = planned(vllm_v1_priority, state([a, b, c], free=[]))
    assert plan == StepPlan(scheduled=(ScheduledRequest("a", 8, 1, (2,)), ScheduledRequest("c", 3, 1)),
                            preempted=("b",))


def test_priority_unschedules_a_victim_already_scheduled_in_the_step() -> None:
    """Priority: ``a`` (priority 1) is scheduled first; ``b`` (priority 0) then needs a block, none is
    free: the victim is ``a``, already scheduled, so vLLM takes back its token (``token_budget +=
    restored``) and frees its blocks; ``b`` gets ``a``'s last block."""
    a = decode("a", 5, [0, 1], priority=1)
    b = running("b", 7, 8, [2, 3], outputs=2, priority=0)
    plan = planned(vllm_v1_priority, state([a, b], free=[]))
    assert plan == StepPlan(scheduled=(ScheduledRequest("b", 8, 1, (1,)),), preempted=("a",))


def test_priority_self_preemption_skips_the_more_urgent_requests_after_it() -> None:
    """Surprise: ``a`` (priority 3, first in the list) needs a block; it is the least urgent, so it
    preempts itself and the loop ``break``s: ``b`` (priority 0) gets no token in this step, although it
    needs no new block."""
    a = running("a", 7, 8, [0, 1], outputs=2, priority=3)
    b = decode("b", 3, [2], priority=0)
    plan = planned(vllm_v1_priority, state([a, b], free=[]))
    assert plan == StepPlan(preempted=("a",))


# ------------------------------------------------------------ vLLM 0.33: ``continue``, not ``break``
def test_033_priority_self_preemption_goes_on_to_the_requests_after_it() -> None:
    """vLLM 0.33 (``if new_blocks is None``: ``self.policy == PRIORITY and request.status == PREEMPTED``
    -> ``continue``): the same state as the 0.32 surprise above; ``a`` preempts itself, then ``b``, next
    in ``self.running`` (``req_index`` unchanged, ``a`` left the list), is scheduled: 3 computed + 1
    token fits its one block."""
    a = running("a", 7, 8, [0, 1], outputs=2, priority=3)
    b = decode("b", 3, [2], priority=0)
    before = state([a, b], free=[])
    assert planned(vllm_v1_priority_033, before) == StepPlan(scheduled=(ScheduledRequest("b", 3, 1),),
                                                            preempted=("a",))
    assert planned(vllm_v1_priority, before) == StepPlan(preempted=("a",))  # 0.32: ``break``


def test_033_the_request_after_a_self_preemption_gets_the_freed_blocks() -> None:
    """``b`` needs a 3rd block (8 computed + 1 = 9 tokens) and none was free before ``a`` preempted
    itself; ``a``'s blocks went to the front of the free queue last block first (``reversed([0, 1])``),
    so ``b`` gets block 1. ``w`` would fit but is not admitted: the step preempted (``if not
    preempted_reqs``, unchanged in 0.33)."""
    a = running("a", 7, 8, [0, 1], outputs=2, priority=3)
    b = running("b", 7, 8, [2, 3], outputs=2, priority=0)
    before = state([a, b], [waiting("w", 1, priority=0)], free=[])
    assert planned(vllm_v1_priority_033, before) == StepPlan(scheduled=(ScheduledRequest("b", 8, 1, (1,)),),
                                                            preempted=("a",))
    assert planned(vllm_v1_priority, before) == StepPlan(preempted=("a",))


def test_033_a_later_request_may_preempt_again_after_a_self_preemption() -> None:
    """After ``a`` (priority 3) preempts itself the loop goes on: ``b`` (priority 2, 12 tokens computed
    of 13, 3 blocks) needs a 4th block; ``a``'s one block (0) is free now, so ``b`` takes it. ``c``
    (priority 0, 8 of 9, 2 blocks) then needs a 3rd, none is free: the least urgent running request is
    ``b``, already scheduled, so its token is taken back and its 4 blocks freed (``reversed([1, 2, 3,
    0])``: 0 first); ``c`` gets block 0."""
    a = running("a", 3, 4, [0], outputs=2, priority=3)  # 5 tokens, 4 computed: needs a 2nd block
    b = running("b", 11, 12, [1, 2, 3], outputs=2, priority=2)
    c = running("c", 7, 8, [4, 5], outputs=2, priority=0)
    config = CONFIG.with_changes(num_kv_blocks=6)
    before = state([a, b, c], free=[], config=config)
    assert planned(vllm_v1_priority_033, before, config) == StepPlan(
        scheduled=(ScheduledRequest("c", 8, 1, (0,)),), preempted=("a", "b"))
    assert planned(vllm_v1_priority, before, config) == StepPlan(preempted=("a",))


def test_033_fcfs_is_unchanged() -> None:
    """Under FCFS a request that preempts itself is ``self.running[-1]``: nothing is after it, so 0.33's
    ``continue`` (priority only) and 0.32's ``break`` plan the same."""
    a = decode("a", 3, [0])
    b = running("b", 7, 8, [1, 2], outputs=2)
    before = state([a, b], free=[])
    assert planned(vllm_v1_033, before) == planned(vllm_v1, before) == StepPlan(
        scheduled=(ScheduledRequest("a", 3, 1),), preempted=("b",))


def test_an_unknown_version_is_refused() -> None:
    with pytest.raises(ValueError, match="0.31"):
        plan_vllm_v1(state([]), CONFIG, version="0.31")


def test_priority_admission_order_is_priority_arrival_time_then_request_id() -> None:
    """``PriorityRequestQueue`` pops by ``Request.__lt__``: (priority, arrival_time, request_id); with
    ``max_num_seqs`` 2 only the first two are admitted: ``x1`` then ``x2`` (same priority and time,
    ids in order), not ``u`` (priority 1) nor ``late`` (priority 0, later arrival)."""
    config = CONFIG.with_changes(max_num_seqs=2)
    wait = [waiting("u", 2, priority=1), waiting("late", 2, arrival_time=2.0), waiting("x2", 2, arrival_time=1.0),
            waiting("x1", 2, arrival_time=1.0)]
    plan = planned(vllm_v1_priority, state([], wait, config=config), config)
    assert [i.request_id for i in plan.scheduled] == ["x1", "x2"]


def test_priority_does_not_preempt_to_admit_an_urgent_request() -> None:
    """vLLM preempts only when a running request's allocation fails: at ``max_num_seqs`` the urgent
    waiting request waits (the ``priority`` reference policy would preempt ``low``)."""
    config = CONFIG.with_changes(max_num_seqs=1)
    before = state([decode("low", 3, [0], priority=5)], [waiting("urgent", 2, priority=0)], config=config)
    plan = planned(vllm_v1_priority, before, config)
    assert plan == StepPlan(scheduled=(ScheduledRequest("low", 3, 1),))
    assert policies.priority(before, config).preempted == ("low",)


def test_impossible_requests_are_rejected_at_arrival() -> None:
    """Documented departure: the spec's reject-only-impossible rule; vLLM's scheduler never rejects."""
    before = state([], [waiting("huge", 40, max_tokens=1), waiting("ok", 4)])  # 40 tokens: 10 blocks > 8
    plan = planned(vllm_v1, before)
    assert [r for r, _ in plan.rejected] == ["huge"]
    assert [i.request_id for i in plan.scheduled] == ["ok"]


SUPPORTED = ["abort-during-chunked-prefill-no-cache", "eos-frees-slot-early", "kv-pressure-no-thrash",
             "no-chunking-budget-below-model-len", "prompt-larger-than-kv-cache", "slot-freed-is-reused",
             "counterexample-bounded-itl"]


@pytest.mark.parametrize("profile", ["vllm-v1", "vllm-v1@0.33"])
@pytest.mark.parametrize("name", SUPPORTED)
def test_bundled_scenario_replays_on_vllm_v1(name: str, profile: str) -> None:
    result = replay(load_scenario(next(p for p in bundled_scenarios() if p.stem == name)), profile)
    failed = [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]
    assert not failed, failed


def test_priority_scenario_fails_only_on_the_seq_cap_preemption_vllm_lacks() -> None:
    """priority-preempts-at-seq-cap asks for what vLLM 0.32 does not do (rule above): on
    vllm-v1-priority exactly the first-token bound of the urgent request fails."""
    scenario = load_scenario(next(p for p in bundled_scenarios() if p.stem == "priority-preempts-at-seq-cap"))
    for profile in ("vllm-v1-priority", "vllm-v1-priority@0.33"):  # 0.33 does not preempt at the cap either
        result = replay(scenario, profile)
        assert [v.name for v in result.verdicts if not v.passed] == ["first_token_by_step[H]"], profile
