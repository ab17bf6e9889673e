"""``check_trace`` called directly (in-process; tests/test_checker.py goes through the CLI): what the
report keeps about the first illegal step, the request a trace mismatch names, the edges of the time
checks, and the plan a record describes. Cost: about a second."""

from __future__ import annotations

import attrs

from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
from schedspec.spec.checker import MISMATCH, check_trace, plan_from_record
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.state import ScheduledRequest
from schedspec.spec.trace import StepRecord

CASES = {p.stem: p for p in bundled_scenarios()}


def _good_run() -> tuple[SchedulerConfig, list[StepRecord]]:
    scenario = load_scenario(CASES["kv-pressure-no-thrash"])
    result = replay(scenario)
    config = SchedulerConfig.from_dict({k: v for k, v in scenario.config.items() if k != "policy"})
    return config, list(result.run.records)


def test_good_run_passes() -> None:
    config, records = _good_run()
    report = check_trace(config, records)
    assert report.ok and report.first_bad_step is None and report.steps_checked == len(records)


def test_report_keeps_the_first_illegal_steps_state_plan_and_record() -> None:
    config, records = _good_run()
    first, second = 2, 4
    for bad in (first, second):
        record = records[bad]
        item = record.scheduled[0]
        records[bad] = attrs.evolve(record, scheduled=(attrs.evolve(item, prefill_tokens=item.prefill_tokens + 50),)
                                    + record.scheduled[1:])
    report = check_trace(config, records, keep_going=True)
    assert report.first_bad_step == first
    assert report.record is records[first]
    assert report.plan == plan_from_record(records[first])
    assert report.state_before is not None and report.state_before.step == first
    assert {v.step for v in report.violations} >= {first, second}


def test_mismatch_about_one_request_names_it() -> None:
    config, records = _good_run()
    index = next(i for i, r in enumerate(records) if r.sampled_token_ids)
    record = records[index]
    request_id = next(iter(record.sampled_token_ids))
    records[index] = attrs.evolve(record, finished={**record.finished, request_id: "made-up"})
    report = check_trace(config, records)
    mismatches = [v for v in report.violations if v.kind == "mismatch"]
    assert mismatches, report.violations
    assert all(v.name == MISMATCH for v in mismatches)
    assert request_id in {v.request_id for v in mismatches}


def test_a_step_may_take_no_time_but_not_negative_time() -> None:
    config, records = _good_run()
    zero = list(records)
    zero[1] = attrs.evolve(zero[1], duration=0.0)
    assert check_trace(config, zero).ok
    negative = list(records)
    negative[1] = attrs.evolve(negative[1], duration=-0.5)
    assert check_trace(config, negative).first_bad_step == 1


def test_plan_from_record_keeps_scheduled_allocations_preemptions_and_rejections() -> None:
    record = StepRecord(
        step=3, start_time=0.0, duration=0.0,
        scheduled=[{"request_id": "a", "num_computed_tokens": 4, "prefill_tokens": 2, "decode_tokens": 0}],
        blocks_allocated={"a": [7]}, preempted=["b"], rejected={"c": "no-output: max_tokens=0 < 1"},
    )
    plan = plan_from_record(record)
    assert plan.scheduled == (ScheduledRequest("a", 4, 2, (7,)),)
    assert plan.preempted == ("b",)
    assert plan.rejected == (("c", "no-output: max_tokens=0 < 1"),)


def _mismatches(report) -> list:
    return [v for v in report.violations if v.kind == "mismatch" and v.name == MISMATCH]


def _first_with(records: list[StepRecord], decode: bool) -> tuple[int, int]:
    """(record index, scheduled index) of the first decode (decode=True) or prefill chunk the run has."""
    for i, record in enumerate(records):
        for j, item in enumerate(record.scheduled):
            if (item.decode_tokens == 1) == decode:
                return i, j
    raise AssertionError("the run has no such step")


def test_wrong_prefill_decode_split_is_a_mismatch_naming_the_request_and_the_spec_split() -> None:
    config, records = _good_run()
    for decode in (True, False):
        changed = list(records)
        i, j = _first_with(changed, decode)
        item = changed[i].scheduled[j]
        # Move one token to the other side: a decode reported as prefill, a chunk's last token as decode.
        wrong = attrs.evolve(item, prefill_tokens=item.prefill_tokens + (1 if decode else -1),
                             decode_tokens=item.decode_tokens + (-1 if decode else 1))
        changed[i] = attrs.evolve(changed[i], scheduled=changed[i].scheduled[:j] + (wrong,) + changed[i].scheduled[j + 1:])
        report = check_trace(config, changed)
        found = [v for v in _mismatches(report) if v.request_id == item.request_id]
        assert found, report.violations
        assert report.first_bad_step == changed[i].step
        detail = found[0].detail
        spec_prefill = item.num_tokens - (item.num_tokens if decode else 0)
        assert f"the spec says prefill_tokens={spec_prefill}, decode_tokens={item.num_tokens - spec_prefill}" in detail
        assert ("a decode" if decode else "a prefill") in detail


def test_sampled_tokens_must_match_the_requests_that_sample() -> None:
    config, records = _good_run()
    index = next(i for i, r in enumerate(records) if r.sampled_token_ids)
    record = records[index]
    sampler = next(iter(record.sampled_token_ids))
    missing = list(records)
    missing[index] = attrs.evolve(record, sampled_token_ids={k: v for k, v in record.sampled_token_ids.items() if k != sampler})
    found = [v for v in _mismatches(check_trace(config, missing)) if v.request_id == sampler]
    assert found and "no sampled token" in found[0].detail
    # A request of the same step that does not sample (a prefill chunk short of the prompt's end), or a
    # request not in the step at all, must not get a token.
    extra = list(records)
    extra[index] = attrs.evolve(record, sampled_token_ids={**record.sampled_token_ids, "nobody": 5})
    found = [v for v in _mismatches(check_trace(config, extra)) if v.request_id == "nobody"]
    assert found and "does not sample this step" in found[0].detail


def _timed(records: list[StepRecord], start: float, duration: float) -> list[StepRecord]:
    """The run with step i starting at start + i * duration and lasting duration (back to back)."""
    return [attrs.evolve(r, start_time=start + i * duration, duration=duration) for i, r in enumerate(records)]


def test_overlapping_steps_are_a_mismatch_beyond_the_relative_tolerance() -> None:
    config, records = _good_run()
    # Steps of 1 s from 99 s: step 1 starts when step 0 ends, at 100 s; the tolerance there is
    # TIME_TOLERANCE * 100 = 1e-7 s.
    timed = _timed(records, 99.0, 1.0)
    assert check_trace(config, timed).ok
    within = list(timed)
    within[1] = attrs.evolve(timed[1], start_time=100.0 - 1e-8)
    assert check_trace(config, within).ok
    beyond = list(timed)
    beyond[1] = attrs.evolve(timed[1], start_time=100.0 - 1e-6)
    report = check_trace(config, beyond)
    assert report.first_bad_step == 1
    assert any("starts at" in v.detail and "before step 0" in v.detail for v in _mismatches(report))
    # Step 1 starting half-way through step 0 overlaps it.
    half = list(timed)
    half[1] = attrs.evolve(timed[1], start_time=99.5)
    assert check_trace(config, half).first_bad_step == 1


def test_overlap_tolerance_is_absolute_below_one_second() -> None:
    config, records = _good_run()
    # Steps of 0.25 s from 0: step 1 starts at 0.25 s, where the tolerance is TIME_TOLERANCE = 1e-9 s.
    timed = _timed(records, 0.0, 0.25)
    assert check_trace(config, timed).ok
    beyond = list(timed)
    beyond[1] = attrs.evolve(timed[1], start_time=0.25 - 1.5e-9)
    assert check_trace(config, beyond).first_bad_step == 1
    negative = list(timed)
    negative[1] = attrs.evolve(timed[1], duration=-0.5)
    (found,) = _mismatches(check_trace(config, negative))
    assert "duration" in found.detail and found.step == 1


def _tamper(records: list[StepRecord], index: int, **changes) -> list[StepRecord]:
    changed = list(records)
    changed[index] = attrs.evolve(records[index], **changes)
    return changed


def _finishing(records: list[StepRecord]) -> tuple[int, str, str]:
    """(index, request id, reason) of the first record in which a request finishes holding blocks."""
    for i, record in enumerate(records):
        for request_id, reason in record.finished.items():
            if record.blocks_freed.get(request_id):
                return i, request_id, reason
    raise AssertionError("the run has no finish that frees blocks")


def _still_running(records: list[StepRecord]) -> tuple[int, str]:
    """(index, request id) of the first scheduled request that neither finishes nor frees in its step."""
    for i, record in enumerate(records):
        for item in record.scheduled:
            if item.request_id not in record.finished and item.request_id not in record.blocks_freed:
                return i, item.request_id
    raise AssertionError("the run has no such step")


def _mismatch_of(config, records, index, request_id=None) -> str:
    report = check_trace(config, records, keep_going=True)
    assert report.first_bad_step == records[index].step, report.violations
    found = [v for v in _mismatches(report) if v.step == records[index].step and v.request_id == request_id]
    assert found, report.violations
    return found[0].detail


def test_finish_reports_are_compared_with_the_spec() -> None:
    config, records = _good_run()
    i, request_id, reason = _finishing(records)
    record = records[i]
    other = "abort" if reason != "abort" else "length"
    detail = _mismatch_of(config, _tamper(records, i, finished={**record.finished, request_id: other}), i, request_id)
    assert repr(other) in detail and repr(reason) in detail
    missing = {k: v for k, v in record.finished.items() if k != request_id}
    assert "not reported finished" in _mismatch_of(config, _tamper(records, i, finished=missing), i, request_id)
    j, live = _still_running(records)
    detail = _mismatch_of(config, _tamper(records, j, finished={**records[j].finished, live: "length"}), j, live)
    assert "does not end it" in detail


def test_freed_blocks_are_compared_with_the_spec() -> None:
    config, records = _good_run()
    i, request_id, _ = _finishing(records)
    record = records[i]
    short = {**record.blocks_freed, request_id: record.blocks_freed[request_id][1:]}
    assert "blocks_freed" in _mismatch_of(config, _tamper(records, i, blocks_freed=short), i, request_id)
    # A request that frees nothing in the step, reported as freeing a block.
    j, live = _still_running(records)
    extra = {**records[j].blocks_freed, live: (0,)}
    assert "blocks_freed [0]" in _mismatch_of(config, _tamper(records, j, blocks_freed=extra), j, live)


def test_allocation_outside_the_batch_and_prefix_hits_without_caching_are_mismatches() -> None:
    config, records = _good_run()
    assert not config.enable_prefix_caching
    index = next(i for i, r in enumerate(records) if r.scheduled)
    request_id = records[index].scheduled[0].request_id
    outside = _tamper(records, index, blocks_allocated={**records[index].blocks_allocated, "nobody": (0,)})
    assert "blocks_allocated [0]" in _mismatch_of(config, outside, index, "nobody")
    hit = _tamper(records, index, prefix_hit_tokens={request_id: 4})
    assert "prefix_hit_tokens=4" in _mismatch_of(config, hit, index, request_id)
    assert check_trace(config, _tamper(records, index, prefix_hit_tokens={request_id: 0})).ok


def test_queue_and_pool_counts_are_compared_with_the_spec() -> None:
    config, records = _good_run()
    index = 2
    for field in ("num_free_blocks", "num_running", "num_waiting"):
        changed = _tamper(records, index, **{field: getattr(records[index], field) + 1})
        detail = _mismatch_of(config, changed, index)
        assert detail.startswith(f"{field} after the step")
        assert f"says {getattr(records[index], field) + 1}" in detail


def test_keep_going_follows_the_engine_past_a_missing_sampled_token() -> None:
    """The checker applies a token that keeps the request going (the record says it did not stop), so
    the steps after the faulty one are judged on the engine's own course: nothing cascades."""
    config, records = _good_run()
    index = next(i for i, r in enumerate(records) if len(r.sampled_token_ids) > 1 and not r.finished)
    record = records[index]
    first, *rest = record.sampled_token_ids
    missing = _tamper(records, index, sampled_token_ids={k: record.sampled_token_ids[k] for k in rest})
    report = check_trace(config, missing, keep_going=True)
    assert {v.step for v in report.violations} == {record.step}, report.violations
    assert {v.request_id for v in report.violations} == {first}


def test_a_skipped_step_number_stops_the_check_there() -> None:
    config, records = _good_run()
    skipped = _tamper(records, 3, step=5)
    report = check_trace(config, skipped, keep_going=True)
    assert report.first_bad_step == 3 and report.record is skipped[3] and report.plan is None
    assert report.state_before is not None and report.state_before.step == 3
    (found,) = report.violations
    assert found.kind == "mismatch" and found.step == 3 and "expected step 3" in found.detail


def test_by_default_the_check_stops_at_the_first_illegal_step() -> None:
    config, records = _good_run()
    for bad in (2, 4):
        item = records[bad].scheduled[0]
        records[bad] = attrs.evolve(records[bad], scheduled=(attrs.evolve(item, prefill_tokens=item.prefill_tokens + 50),)
                                    + records[bad].scheduled[1:])
    report = check_trace(config, records)
    assert {v.step for v in report.violations} == {2}
    assert report.steps_checked < len(records)


def test_aborts_of_live_requests_must_be_reported_aborted() -> None:
    config, records = _good_run()
    j, live = _still_running(records)
    # The engine says it received an abort for a live request but reports nothing aborted.
    report = check_trace(config, _tamper(records, j, aborts=(live,), aborted=()))
    assert report.first_bad_step == records[j].step
    details = [v.detail for v in _mismatches(report)]
    assert any(d.startswith("aborted []") and repr(live) in d for d in details), details
    # An abort of an unknown id is not expected to be reported aborted.
    assert not [v for v in _mismatches(check_trace(config, _tamper(records, j, aborts=("nobody",), aborted=())))
                if v.detail.startswith("aborted")]
    # The same id reported aborted twice.
    report = check_trace(config, _tamper(records, j, aborts=(live,), aborted=(live, live)))
    assert any(v.detail.startswith("aborted") for v in _mismatches(report))


def test_an_arrival_the_spec_cannot_add_is_a_mismatch_naming_it() -> None:
    config, records = _good_run()
    index = next(i for i, r in enumerate(records) if r.arrivals)
    again = records[index].arrivals[0]
    later = index + 1
    report = check_trace(config, _tamper(records, later, arrivals=records[later].arrivals + (again,)), keep_going=True)
    assert again.request_id in {v.request_id for v in _mismatches(report) if v.detail.startswith("arrival:")}
