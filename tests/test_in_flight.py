"""A step in flight (asynchronous scheduling, vLLM ``AsyncScheduler``): the rules of a plan made while the step
before it ran, what an abort or a stop that lands meanwhile does to that plan, and the wasted tokens.

The states are written out by hand (as in ``test_rules.py``); the numbers in the comments are the arithmetic
the spec does. ``IN_FLIGHT_RULE_CASES`` joins ``test_rules.CASES``, so each new rule also runs through
``test_rules``' bad-plan / good-twin tests.
"""

from __future__ import annotations

from types import MappingProxyType

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import IN_FLIGHT_RULES, RULE_NAMES, violated_rules
from schedspec.spec.state import InFlightStep, ScheduledRequest, SchedulerState, StepPlan, landed_plan
from schedspec.spec.stepper import FullChecker, Stepper
from schedspec.spec.transitions import abort_request, add_request, apply_plan

# block_size 4, 8 blocks, budget 16 tokens, 2 sequences, max_model_len 32 (test_rules.CONFIG).
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32)


def running_a() -> Request:
    """Prompt of 6, one output: 7 tokens, 6 computed (a decode); blocks 0 and 1."""
    return Request("a", 0, (11, 12, 13, 14, 15, 16), max_tokens=4, status=RequestStatus.RUNNING,
                   num_computed_tokens=6, output_token_ids=(21,), block_ids=(0, 1), admitted_step=0, first_token_step=0)


def waiting_b(arrival_step: int = 0) -> Request:
    return Request("b", arrival_step, (31, 32, 33, 34, 35), max_tokens=3)


def ended_c(reason: str, max_tokens: int | None = None) -> Request:
    """c ended at step 0's sample: prompt of 6, two outputs (8 tokens), 7 computed, as the spec leaves a
    request that samples its last token; it held blocks 6 and 7 (freed since). ``max_tokens``: 2 for a
    length stop, else 3 (an end-of-sequence stop the planner could not foresee) unless given."""
    status = RequestStatus.FINISHED_ABORTED if reason == "abort" else (
        RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH)
    return Request("c", 0, (41, 42, 43, 44, 45, 46), max_tokens=max_tokens or (2 if reason == "length" else 3),
                   status=status, finish_reason=reason,
                   num_computed_tokens=7, output_token_ids=(51, 52), admitted_step=0, first_token_step=0)


def in_flight_state(reason: str = "stop", b_arrival: int = 0, c_max_tokens: int | None = None) -> SchedulerState:
    """Step 1, planned while step 0 ran (one placeholder each for a and c); c ended at step 0's sample
    (``reason``) and freed blocks 6 and 7, which are free now."""
    c = ended_c(reason, c_max_tokens)
    in_flight = InFlightStep(0, StepPlan(), MappingProxyType({"a": 1, "c": 1}), MappingProxyType({"c": c}),
                             MappingProxyType({"c": (6, 7)}))
    return SchedulerState(step=1, waiting=("b",), running=("a",), requests={"a": running_a(), "b": waiting_b(b_arrival)},
                          finished={"c": c}, free_block_ids=(7, 6, 2, 3, 4, 5), num_requests_added=3,
                          in_flight=in_flight)


DECODE_A = ScheduledRequest("a", 6, 1)
ADMIT_B = ScheduledRequest("b", 0, 5, (2, 3))
WASTED_C = ScheduledRequest("c", 7, 1)  # c's decode as the planner made it: at the placeholder's position


def case_in_flight_foreseen_length():
    # c's placeholder brought it to max_tokens=2: the planner knew, so scheduling it again is wrong. Had c
    # stopped on an end-of-sequence token (unforeseeable) the same item would be wasted work, allowed.
    state = in_flight_state("length")
    return state, StepPlan(scheduled=(DECODE_A, WASTED_C)), StepPlan(scheduled=(DECODE_A,)), CONFIG


def test_an_end_of_sequence_at_max_tokens_was_foreseen_too() -> None:
    # vLLM's guard counts tokens whatever ends the request: c's placeholder brought it to max_tokens=2, so
    # the planner knew it ends at step 0's sample even though the token it sampled there was end-of-sequence
    foreseen = in_flight_state("stop", c_max_tokens=2)
    assert [v.name for v in violated_rules(foreseen, StepPlan(scheduled=(DECODE_A, WASTED_C)), CONFIG)] == [
        "in-flight-foreseen-length"]
    unforeseen = in_flight_state("stop")  # max_tokens 3: the stop at output 2 was a sample no one foresaw
    assert violated_rules(unforeseen, StepPlan(scheduled=(DECODE_A, WASTED_C)), CONFIG) == []


def case_in_flight_blocks_held_when_planned():
    # blocks 6 and 7 were c's when the plan was made (freed at step 0's sample, after it); c still held its
    # slot then too, so admitting b takes a third (max_num_seqs 3)
    state = in_flight_state()
    bad = StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (6, 7))))
    return state, bad, StepPlan(scheduled=(DECODE_A, ADMIT_B)), attrs.evolve(CONFIG, max_num_seqs=3)


def case_in_flight_arrivals_wait():
    # b arrived before step 1, after step 1's plan was made (while step 0 ran): the plan cannot admit it
    state = in_flight_state(b_arrival=1)
    return state, StepPlan(scheduled=(DECODE_A, ADMIT_B)), StepPlan(scheduled=(DECODE_A,)), CONFIG


def test_blocks_released_by_preempting_an_ended_request_may_be_handed_out() -> None:
    # vLLM's AsyncScheduler may preempt a request whose placeholder ends it (it still holds its blocks when
    # the plan is made) and hand its blocks to another: that preemption released them
    state = in_flight_state("length")
    plan = StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (6, 7))), preempted=("c",))
    assert violated_rules(state, plan, CONFIG) == []
    assert landed_plan(state, plan)[0] == StepPlan(scheduled=plan.scheduled)  # the stale preemption does nothing


def case_wasted_item_continues():
    # c had computed 7 tokens: a wasted chunk from 6 is not one vLLM's scheduler makes
    state = in_flight_state()
    bad = StepPlan(scheduled=(DECODE_A, ScheduledRequest("c", 6, 1)))
    return state, bad, StepPlan(scheduled=(DECODE_A, WASTED_C)), CONFIG


IN_FLIGHT_RULE_CASES = {
    "in-flight-foreseen-length": case_in_flight_foreseen_length,
    "in-flight-blocks-held-when-planned": case_in_flight_blocks_held_when_planned,
    "in-flight-arrivals-wait": case_in_flight_arrivals_wait,
    "wasted-item-continues": case_wasted_item_continues,
}


def test_in_flight_rules_are_registered() -> None:
    assert set(IN_FLIGHT_RULES) <= set(RULE_NAMES)
    assert set(IN_FLIGHT_RULE_CASES) == set(IN_FLIGHT_RULES)


def test_without_a_step_in_flight_the_in_flight_rules_find_nothing() -> None:
    # each bad plan, on the same state without in_flight: none of the in-flight rules fires (the plan may
    # break others: c is not live then, so known-requests fires for the wasted item)
    for case in IN_FLIGHT_RULE_CASES.values():
        state, bad, _good, config = case()
        synchronous = attrs.evolve(state, in_flight=None)
        assert not {v.name for v in violated_rules(synchronous, bad, config)} & set(IN_FLIGHT_RULES)


def test_known_requests_allows_only_requests_ended_in_flight() -> None:
    state = in_flight_state()
    assert violated_rules(state, StepPlan(scheduled=(DECODE_A, WASTED_C)), CONFIG) == []
    # the same ended request without a step in flight: not live, not excused
    synchronous = attrs.evolve(state, in_flight=None)
    assert [v.name for v in violated_rules(synchronous, StepPlan(scheduled=(DECODE_A, WASTED_C)), CONFIG)] == [
        "known-requests"]
    # an ended request may be wasted work, never rejected
    rejected = violated_rules(state, StepPlan(scheduled=(DECODE_A,), rejected=(("c", "x"),)), CONFIG)
    assert [v.name for v in rejected] == ["known-requests"]


def test_a_wasted_item_does_nothing_but_counts_its_tokens() -> None:
    state = in_flight_state()
    plan = StepPlan(scheduled=(DECODE_A, ScheduledRequest("c", 7, 1, (6,))), preempted=())
    landed, wasted = landed_plan(state, plan)
    assert landed == StepPlan(scheduled=(DECODE_A,)) and wasted == (plan.scheduled[1],)
    result = apply_plan(state, plan, {"a": 22}, CONFIG)
    expected = apply_plan(attrs.evolve(state, in_flight=None), landed, {"a": 22}, CONFIG)
    assert result.num_wasted_tokens == 1 and result.wasted == wasted
    # apart from in_flight, the state is the one the landed plan gives: c untouched, block 6 still free
    assert attrs.evolve(result.state, in_flight=None) == expected.state
    assert 6 in result.state.free_block_ids and result.state.finished["c"] == state.finished["c"]


def test_the_state_after_records_the_step_as_in_flight() -> None:
    # a samples 22 and goes on; its placeholder is 1; nothing ended
    state = in_flight_state()
    after = apply_plan(state, StepPlan(scheduled=(DECODE_A, ADMIT_B)), {"a": 22, "b": 61}, CONFIG).state
    assert after.in_flight is not None
    assert after.in_flight.step == 1 and dict(after.in_flight.num_output_placeholders) == {"a": 1, "b": 1}
    assert not after.in_flight.ended and not after.in_flight.freed_blocks
    # a reaches max_tokens=4 after three more samples; the step it ends in lists it with its blocks
    a = attrs.evolve(running_a(), output_token_ids=(21, 22, 23), num_computed_tokens=8)
    state = SchedulerState(step=3, running=("a",), requests={"a": a}, free_block_ids=(2, 3, 4, 5, 6, 7),
                           num_requests_added=1, in_flight=InFlightStep(2))
    after = apply_plan(state, StepPlan(scheduled=(ScheduledRequest("a", 8, 1, (2,)),)), {"a": 24}, CONFIG).state
    assert set(after.in_flight.ended) == {"a"} and after.in_flight.ended["a"].finish_reason == "length"
    assert dict(after.in_flight.freed_blocks) == {"a": (0, 1, 2)}


def test_an_abort_with_a_step_in_flight_lands_after_the_plan() -> None:
    state = attrs.evolve(in_flight_state(), in_flight=InFlightStep(0))
    after = abort_request(state, "a")
    assert set(after.in_flight.ended) == {"a"} and dict(after.in_flight.freed_blocks) == {"a": (0, 1)}
    # its blocks are free (vLLM Scheduler.finish_requests frees them at once) but the plan made before the
    # abort hands none out; its decode in that plan is wasted
    assert {0, 1} <= set(after.free_block_ids)
    plan = StepPlan(scheduled=(DECODE_A, ADMIT_B))
    assert violated_rules(after, plan, CONFIG) == []
    assert apply_plan(after, plan, {"b": 61}, CONFIG).num_wasted_tokens == 1
    bad = StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (0, 1))))
    assert [v.name for v in violated_rules(after, bad, CONFIG)] == ["in-flight-blocks-held-when-planned"] * 2
    # without a step in flight an abort is what it always was
    synchronous = abort_request(attrs.evolve(state, in_flight=None), "a")
    assert synchronous.in_flight is None
    assert attrs.evolve(after, in_flight=None) == synchronous


def test_a_synchronous_step_is_unchanged() -> None:
    state = attrs.evolve(in_flight_state(), in_flight=None)
    result = apply_plan(state, StepPlan(scheduled=(DECODE_A, ADMIT_B)), {"a": 22, "b": 61}, CONFIG)
    assert result.state.in_flight is None and result.wasted == () and result.num_wasted_tokens == 0


def test_stepper_checks_an_asynchronous_run() -> None:
    # two requests; the stepper starts asynchronous; b stops (EOS) at step 1's sample while step 2's plan,
    # made during step 1, decodes it again: one wasted token, no violation, the invariants hold
    config = CONFIG
    stepper = Stepper(config, FullChecker(config), state=SchedulerState.initial(config, asynchronous=True))
    a = Request("a", 0, (1, 2, 3), max_tokens=5)
    b = Request("b", 0, (4, 5, 6), max_tokens=5, eos_token_id=9)
    stepper.arrive(a)
    stepper.arrive(b)
    first = StepPlan(scheduled=(ScheduledRequest("a", 0, 3, (0,)), ScheduledRequest("b", 0, 3, (1,))))
    assert stepper.check_plan(first) == []
    outcome = stepper.step(first, {"a": 7, "b": 8})
    assert outcome.invariant_violations == [] and outcome.num_wasted_tokens == 0
    second = StepPlan(scheduled=(ScheduledRequest("a", 3, 1), ScheduledRequest("b", 3, 1)))  # 4 tokens: 1 block
    outcome = stepper.step(second, {"a": 7, "b": 9})  # b samples EOS
    assert outcome.rule_violations == [] and outcome.invariant_violations == [] and outcome.finished == ("b",)
    # the plan made while step 1 ran: b's decode at position 4 (wasted, with the block it needed); handing
    # a block 1, which b held until step 1's sample, is caught
    held = StepPlan(scheduled=(ScheduledRequest("a", 4, 1, (1,)), ScheduledRequest("b", 4, 1, (3,))))
    assert [v.name for v in stepper.check_plan(held)] == ["in-flight-blocks-held-when-planned"]
    third = StepPlan(scheduled=(ScheduledRequest("a", 4, 1, (2,)), ScheduledRequest("b", 4, 1, (3,))))
    outcome = stepper.step(third, {"a": 7})
    assert outcome.rule_violations == [] and outcome.invariant_violations == []
    assert outcome.num_wasted_tokens == 1 and outcome.landed_plan.scheduled == third.scheduled[:1]
    assert 3 in outcome.after.free_block_ids  # the wasted item's block is freed with its request
    record = stepper.record(outcome, 0.0, 0.0)
    assert [s.request_id for s in record.scheduled] == ["a", "b"] and record.sampled_token_ids == {"a": 7}
    # two steps after b's stop its blocks were free when the plan was made
    fourth = StepPlan(scheduled=(ScheduledRequest("a", 5, 1),))
    assert stepper.check_plan(fourth) == []


def test_add_request_keeps_the_step_in_flight() -> None:
    state = in_flight_state()
    after = add_request(state, Request("d", 1, (1,), max_tokens=1))
    assert after.in_flight is state.in_flight


def _asynchronous_run_records():
    """The run of test_stepper_checks_an_asynchronous_run, recorded: b stops at step 1, step 2 wastes its decode."""
    from schedspec.spec.workload import RequestSpec

    config = CONFIG
    stepper = Stepper(config, FullChecker(config), state=SchedulerState.initial(config, asynchronous=True))
    specs = [RequestSpec("a", 3, 3, arrival_step=0), RequestSpec("b", 3, 5, arrival_step=0, eos_at_output=2)]
    for spec in specs:
        stepper.arrive(spec.to_request(0), spec)
    plans = [
        (StepPlan(scheduled=(ScheduledRequest("a", 0, 3, (0,)), ScheduledRequest("b", 0, 3, (1,)))), {"a": 7, "b": 8}),
        (StepPlan(scheduled=(ScheduledRequest("a", 3, 1), ScheduledRequest("b", 3, 1))), {"a": 7, "b": 0}),
        (StepPlan(scheduled=(ScheduledRequest("a", 4, 1, (2,)), ScheduledRequest("b", 4, 1, (3,)))), {"a": 7}),
    ]
    records = []
    for number, (plan, sampled) in enumerate(plans):
        outcome = stepper.step(plan, sampled)
        assert outcome.rule_violations == [] and outcome.invariant_violations == [], outcome.rule_violations
        records.append(stepper.record(outcome, float(number), 1.0))
    return config, records


def test_check_judges_an_asynchronous_trace(tmp_path) -> None:
    from schedspec.spec.checker import check_trace
    from schedspec.spec.trace import StepRecord, open_trace, write_trace

    config, records = _asynchronous_run_records()
    assert records[2].wasted_tokens == {"b": 1} and records[2].blocks_freed["b"] == (3,)
    assert "wasted_tokens" not in records[1].to_dict()
    path = tmp_path / "async.jsonl"
    with path.open("w") as out:
        write_trace(out, config, records, "hand", async_scheduling=True)
    opened = open_trace(path)
    assert opened.async_scheduling
    read = list(opened.records())
    assert read == records
    assert check_trace(config, read, async_scheduling=True).ok
    # the same records judged as a synchronous engine's: b's wasted decode is not a live request
    report = check_trace(config, read)
    assert not report.ok and report.first_bad_step == 2
    # a record that hides the waste, or claims some that was not
    hidden = [*read[:2], StepRecord.from_dict({**read[2].to_dict(), "wasted_tokens": {}})]
    assert check_trace(config, hidden, async_scheduling=True).first_bad_step == 2
    claimed = [read[0], StepRecord.from_dict({**read[1].to_dict(), "wasted_tokens": {"a": 1}}), read[2]]
    assert check_trace(config, claimed, async_scheduling=True).first_bad_step == 1


def test_a_synchronous_header_is_unchanged() -> None:
    from schedspec.spec.trace import header_line

    assert "async_scheduling" not in header_line(CONFIG, "fcfs")
    assert '"async_scheduling": true' in header_line(CONFIG, "vllm-async", async_scheduling=True)


# --- a whole asynchronous run: the pure-Python in-flight scheduler ------------------------------------------


def _eos_and_abort_workload(n: int = 40):
    import random

    from schedspec.spec.workload import RequestSpec

    rng = random.Random(5)
    workload = []
    for k in range(n):
        arrival = rng.randrange(0, n)
        workload.append(RequestSpec(f"q{k:03d}", rng.randrange(1, 40), rng.randrange(1, 20), arrival_step=arrival,
                                    eos_at_output=rng.randrange(1, 10) if k % 3 == 1 else None,
                                    abort_at_step=arrival + rng.randrange(1, 20) if k % 7 == 2 else None))
    return workload


ASYNC_CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=40, max_num_batched_tokens=32, max_num_seqs=6,
                               max_model_len=64)


def test_an_in_flight_scheduler_run_is_legal_and_counts_its_waste() -> None:
    from schedspec.reference.engine import Engine
    from schedspec.reference.in_flight import fcfs_async

    result = Engine(fcfs_async(ASYNC_CONFIG), ASYNC_CONFIG, record_steps=True).run(_eos_and_abort_workload())
    assert result.ok, [str(v) for v in result.violations[:3]]
    assert result.async_scheduling
    per_record = sum(sum(r.wasted_tokens.values()) for r in result.records)
    assert result.num_wasted_tokens == per_record > 0
    # every wasted item is for a request that ended by end-of-sequence or an abort, never by length
    for record in result.records:
        for request_id in record.wasted_tokens:
            assert result.state.finished[request_id].finish_reason in ("stop", "abort")


def test_an_in_flight_scheduler_that_frees_blocks_early_is_caught() -> None:
    # a deliberate break: plan over placeholders from a state whose free queue holds the blocks of the
    # requests the step in flight brings to their length (vLLM frees them only after the plan)
    import schedspec.reference.in_flight as in_flight
    from schedspec.reference.engine import Engine
    from schedspec.reference.policies import fcfs
    from schedspec.spec.state import samples_this_step

    class Eager(in_flight.InFlightScheduler):
        def update(self, plan, sampled_token_ids, speculative=None):
            before = self.spec_state
            landed = landed_plan(before, plan)[0]
            placeholders = {i.request_id: in_flight.placeholder_token(before.requests[i.request_id])
                            for i in landed.scheduled if samples_this_step(before.requests[i.request_id], i)}
            self.prepared = self.plan_function(apply_plan(before, plan, placeholders, self.config).state, self.config)
            result = apply_plan(before, plan, sampled_token_ids, self.config)
            self.spec_state, self.plan = result.state, None
            return result.finished

    result = Engine(Eager(ASYNC_CONFIG, fcfs, "eager"), ASYNC_CONFIG).run(_eos_and_abort_workload())
    assert "in-flight-blocks-held-when-planned" in {v.name for v in result.violations}


def test_the_lab_reports_wasted_tokens_only_for_an_asynchronous_scheduler() -> None:
    import io

    from schedspec.lab.run import run_lab
    from schedspec.lab.run_record import figures

    workload = [attrs.evolve(spec, arrival_time=0.01 * spec.arrival_step) for spec in _eos_and_abort_workload()]
    out = io.StringIO()
    result = run_lab(workload, "schedspec.reference.in_flight:fcfs_async", ASYNC_CONFIG, steps_out=out,
                     steps_header=True)
    assert figures(result, None)["wasted_tokens"] == result.run.num_wasted_tokens > 0
    assert out.getvalue().splitlines()[0].endswith('"async_scheduling": true}')
    assert "wasted_tokens" not in figures(run_lab(workload, "fcfs", ASYNC_CONFIG), None)


def test_the_machine_drives_an_in_flight_scheduler() -> None:
    from hypothesis import settings as hypothesis_settings
    from hypothesis.stateful import run_state_machine_as_test

    from schedspec.reference.in_flight import fcfs_async
    from schedspec.testing import SchedulerStateMachine

    seen: set[str] = set()

    class InFlightMachine(SchedulerStateMachine):
        @classmethod
        def build_scheduler(cls, config):
            return fcfs_async(config)

        def teardown(self) -> None:
            seen.update(self.seen)
            super().teardown()

    run_state_machine_as_test(InFlightMachine, settings=hypothesis_settings(
        max_examples=40, stateful_step_count=30, derandomize=True, database=None, deadline=None))
    assert "work wasted on a request that ended in flight" in seen


def test_requests_that_ended_in_flight_still_held_their_slot_when_the_plan_was_made() -> None:
    """vLLM's AsyncScheduler plans step n + 1 while the requests step n's samples end are still running and
    hold their blocks: a plan that admits into such a slot passes max_num_seqs in vLLM's count (sequence-cap
    counts them: rules.running_when_planned), and the same admission with a free slot is allowed."""
    state = in_flight_state("length")  # a runs, c ended at step 0's sample holding blocks 6 and 7
    admit = StepPlan(scheduled=(DECODE_A, ADMIT_B))
    assert "sequence-cap" in [v.name for v in violated_rules(state, admit, CONFIG)]  # a, c and b: 3 > 2
    roomy = attrs.evolve(CONFIG, max_num_seqs=3)
    assert "sequence-cap" not in [v.name for v in violated_rules(state, admit, roomy)]


def test_a_wasted_item_is_judged_with_the_table_it_had_when_planned() -> None:
    """c ended at step 0's sample holding blocks 6 and 7 (8 tokens, 7 computed); the planner scheduled its
    decode at position 7 with that table: enough, and no new block is due (block-table-covers and
    no-excess-blocks judge the wasted item with the blocks it held then, rules.request_when_planned)."""
    state = in_flight_state("stop")
    assert violated_rules(state, StepPlan(scheduled=(DECODE_A, WASTED_C)), CONFIG) == []
    extra = ScheduledRequest("c", 7, 1, (2,))  # one more block for a sequence its two blocks hold
    assert "no-excess-blocks" in [v.name for v in violated_rules(state, StepPlan(scheduled=(DECODE_A, extra)), CONFIG)]


# --- the threshold's floor counts the requests the planner saw -----------------------------------------------


FLOOR_CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4,
                               max_model_len=32, long_prefill_token_threshold=2,
                               long_prefill_token_threshold_adaptive=True)


def _floor_run(chunk: int):
    """Step 0 (nothing in flight) admits a (3 tokens) and b's first 8 of 20 (floor max(2, 16 // 2) = 8); c and
    d arrive after step 1's plan was made (while step 0 ran). Step 1's plan decodes a and gives b ``chunk``
    tokens: its planner saw a and b, floor 8 (counting c and d it would be 16 // 4 = 4). Returns the records of
    the steps and the rule violations of step 1's plan."""
    from schedspec.spec.workload import RequestSpec

    config = FLOOR_CONFIG
    stepper = Stepper(config, FullChecker(config), state=SchedulerState.initial(config, asynchronous=True))
    for spec in (RequestSpec("a", 3, 5, arrival_step=0), RequestSpec("b", 20, 2, arrival_step=0)):
        stepper.arrive(spec.to_request(0), spec)
    first = StepPlan(scheduled=(ScheduledRequest("a", 0, 3, (0,)), ScheduledRequest("b", 0, 8, (1, 2))))
    outcome = stepper.step(first, {"a": 7})
    assert outcome.rule_violations == []
    records = [stepper.record(outcome, 0.0, 1.0)]
    for spec in (RequestSpec("c", 2, 2, arrival_step=1), RequestSpec("d", 2, 2, arrival_step=1)):
        stepper.arrive(spec.to_request(1), spec)
    second = StepPlan(scheduled=(ScheduledRequest("a", 3, 1),
                                 ScheduledRequest("b", 8, chunk, tuple(range(3, 3 + (8 + chunk + 3) // 4 - 2)))))
    violations = stepper.check_plan(second)
    outcome = stepper.step(second, {"a": 7})
    records.append(stepper.record(outcome, 1.0, 1.0))
    return records, violations


def test_the_threshold_floor_counts_only_the_requests_the_planner_saw(tmp_path) -> None:
    """vLLM's floor (long_prefill_token_threshold_adaptive) divides the budget by Scheduler.get_request_counts
    at the start of Scheduler.schedule: with a step in flight, requests that arrived since are not counted
    (rules.eligible_when_planned). Counting them, the spec raised a false alarm on b's chunk of 8."""
    from schedspec.spec.checker import check_trace
    from schedspec.spec.trace import open_trace, write_trace

    records, violations = _floor_run(8)
    assert violations == []
    path = tmp_path / "async-floor.jsonl"
    with path.open("w") as out:
        write_trace(out, FLOOR_CONFIG, records, "hand", async_scheduling=True)
    opened = open_trace(path)
    for incremental in (False, True):  # a window cut from a run: c and d wait, a and b run
        assert check_trace(opened.config, list(opened.records()), incremental=incremental, allow_unfinished=True,
                           async_scheduling=True).ok
    # a real breach of the planner's floor of 8 still fails, in the trace too
    records, violations = _floor_run(9)
    assert [(v.name, v.request_id) for v in violations] == [("long-prefill-threshold", "b")]
    for incremental in (False, True):
        report = check_trace(FLOOR_CONFIG, records, incremental=incremental, allow_unfinished=True,
                             async_scheduling=True)
        assert report.first_bad_step == 1 and [v.name for v in report.violations] == ["long-prefill-threshold"]


def test_the_threshold_floor_counts_the_requests_that_ended_in_flight() -> None:
    """The requests that ended since the plan was made were still in vLLM's queues when it was made: they
    lower the floor. a runs, b waits (7 tokens) and c ended at step 0's sample: the planner saw 3, floor
    max(1, 16 // 3) = 5 (without c, 16 // 2 = 8 passed b's chunk of 6: a false pass)."""
    config = attrs.evolve(CONFIG, max_num_seqs=3, long_prefill_token_threshold=1,
                          long_prefill_token_threshold_adaptive=True)
    state = in_flight_state("stop")
    b = Request("b", 0, tuple(range(31, 38)), max_tokens=3)
    state = attrs.evolve(state, requests={**state.requests, "b": b})
    names = [v.name for v in violated_rules(state, StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 6, (2, 3)))),
                                            config)]
    assert names == ["long-prefill-threshold"]  # 6 > 5
    assert violated_rules(state, StepPlan(scheduled=(DECODE_A, ScheduledRequest("b", 0, 5, (2, 3)))), config) == []


def test_an_in_flight_scheduler_plans_with_the_floor_the_spec_judges() -> None:
    """fcfs planned in flight with the threshold's floor: legal at every step. Before the floor counted what
    the planner saw, the spec raised false alarms on this run from step 1 (arrivals since the plan counted); the
    planner must count the requests its in-flight step brings to their length (vLLM still holds them)."""
    from schedspec.reference.engine import Engine
    from schedspec.reference.in_flight import fcfs_async

    config = attrs.evolve(ASYNC_CONFIG, long_prefill_token_threshold=2, long_prefill_token_threshold_adaptive=True)
    result = Engine(fcfs_async(config), config).run(_eos_and_abort_workload())
    assert result.ok, [str(v) for v in result.violations[:3]]


def test_the_incremental_screen_counts_the_slots_held_when_planned() -> None:
    """The incremental checker's one-pass screen (spec/incremental.py screened_rules_hold) skips the rules it
    screens when it holds, so it must be as strict as they are: with c ended in flight holding its slot, a
    plan that admits b passes max_num_seqs=2 in vLLM's count (sequence-cap). The screen counted only the
    requests running now and held, so `check --incremental` passed the plan."""
    from schedspec.spec.incremental import screened_rules_hold

    state = in_flight_state("length")
    admit = StepPlan(scheduled=(DECODE_A, ADMIT_B))
    assert [v.name for v in violated_rules(state, admit, CONFIG)] == ["sequence-cap"]
    assert not screened_rules_hold(state, admit, CONFIG)
    assert screened_rules_hold(state, admit, attrs.evolve(CONFIG, max_num_seqs=3))  # a free slot: it holds
