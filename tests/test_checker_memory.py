"""A check of a long trace forgets the requests that ended (bounded memory, ``Stepper.forget_ended``) and
judges as before: an id reused long after its request ended, an ended request scheduled, sampled or
reported finished again, are each caught by both checkers at their step; the report's state is exact."""

from __future__ import annotations

import json

import pytest

from schedspec.spec.checker import check_trace, plan_from_record
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.state import SchedulerState
from schedspec.spec.stepper import Stepper, step_checker
from schedspec.spec.trace import StepRecord
from schedspec.spec.transitions import add_request, apply_plan
from schedspec.trace_mutations import LONG_TRACE_CONFIG, long_trace

CONFIG = SchedulerConfig.from_dict(LONG_TRACE_CONFIG)
STEPS = 400


def records(edit=None) -> list[StepRecord]:
    raw = list(long_trace(STEPS))
    if edit is not None:
        edit(raw)
    return [StepRecord.from_dict(r) for r in raw]


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_a_long_correct_trace_passes(incremental):
    report = check_trace(CONFIG, records(), incremental=incremental)
    assert report.ok and report.steps_checked == STEPS


def _reuse_r0(raw):
    raw[-2]["arrivals"][0]["request_id"] = "r0"  # r0 ended at step 1, 397 steps before


def _schedule_ended(raw):
    last = raw[-1]
    last["scheduled"].append({"request_id": "r5", "num_computed_tokens": 4, "prefill_tokens": 0, "decode_tokens": 1})


def _sample_ended(raw):
    raw[-1]["sampled_token_ids"]["r7"] = 3


def _finish_ended(raw):
    raw[-1]["finished"]["r9"] = "length"


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
@pytest.mark.parametrize("edit, step, words", [
    (_reuse_r0, STEPS - 2, "request_id='r0' was already added"),
    (_schedule_ended, STEPS - 1, "known-requests"),
    (_sample_ended, STEPS - 1, "a token was sampled for a request that does not sample this step"),
    (_finish_ended, STEPS - 1, "finished ('length') but the spec does not end it in this step"),
], ids=["reused-id", "scheduled-after-end", "sampled-after-end", "finished-twice"])
def test_an_ended_request_long_forgotten_is_still_judged(incremental, edit, step, words):
    report = check_trace(CONFIG, records(edit), incremental=incremental)
    assert report.first_bad_step == step, report.violations
    assert any(words in str(v) for v in report.violations), [str(v) for v in report.violations]
    finished = report.state_before.finished
    # every ended request counted and known by id, almost none held (forgotten after its step)
    assert len(finished) == step // 2 and finished.num_held <= 1 and "r0" in finished and "r1" in finished


def test_keep_going_past_a_failure_judges_the_rest_with_every_request_held():
    """After the first illegal step nothing more is forgotten (the report's states stay exact); the
    checks after it see every request ended since."""
    def edit(raw):
        raw[100]["sampled_token_ids"]["r1"] = 3  # r1 ended at step 3
        _reuse_r0(raw)
    report = check_trace(CONFIG, records(edit), keep_going=True)
    steps = sorted({v.step for v in report.violations})
    assert steps[0] == 100 and STEPS - 2 in steps, steps
    assert report.state_before.finished.num_held <= 1 and len(report.state_before.finished) == 50


def test_forgetting_leaves_the_spec_state_of_the_definition_unchanged_but_for_held_requests():
    """The same trace checked with forgetting (check_trace) and replayed on the spec without it end in
    states that agree on everything but the held terminal requests: the live map, queues, free blocks,
    the count and the ids of ended requests."""
    stepper = Stepper(CONFIG, step_checker(CONFIG, True))
    plain = SchedulerState.initial(CONFIG)
    for record in records():
        for spec in record.arrivals:
            stepper.arrive(spec.to_request(record.step), spec)
            plain = add_request(plain, spec.to_request(record.step))
        outcome = stepper.step(plan_from_record(record), record.sampled_token_ids)
        assert not outcome.rule_violations and not outcome.invariant_violations
        plain = apply_plan(plain, plan_from_record(record), record.sampled_token_ids, CONFIG).state
        stepper.forget_ended()
    state = stepper.state
    assert (state.step, state.waiting, state.running, dict(state.requests), tuple(state.free_block_ids),
            state.num_requests_added) == (plain.step, plain.waiting, plain.running, dict(plain.requests),
                                          tuple(plain.free_block_ids), plain.num_requests_added)
    assert len(state.finished) == len(plain.finished) == STEPS // 2 and state.finished.num_held == 0
    assert all(request_id in state.finished for request_id in plain.finished)


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_a_request_left_live_at_the_end_of_a_long_trace_is_named_with_its_last_step(incremental):
    """What check_trace keeps per live request survives the pruning of what it kept per ended one: the
    last request, prefilled at step STEPS - 2 and never finished, is reported with that step."""
    report = check_trace(CONFIG, records()[:-1], incremental=incremental)
    (unfinished,) = [v for v in report.violations if v.name == "unfinished-request"]
    assert unfinished.request_id == f"r{(STEPS - 2) // 2}"
    assert f"last scheduled at step {STEPS - 2}" in unfinished.detail, unfinished.detail


def _retained_growth(run, steps: int) -> tuple[int, int]:
    """Bytes still allocated (tracemalloc) as ``run`` reads :func:`long_trace`'s records (each a fresh copy,
    as read from a line), from step ``steps`` to ``2 * steps`` and from ``2 * steps`` to ``3 * steps`` (the
    first ``steps`` warm up caches and free lists); the bounded id-parse cache is emptied before each reading."""
    import gc
    import tracemalloc

    from schedspec.spec.persistent import _numbered

    readings = []

    def records():
        for index, record in enumerate(long_trace(3 * steps + 2)):  # ends with its last request finished
            if index and index % steps == 0:
                _numbered.cache_clear()
                gc.collect()
                readings.append(tracemalloc.get_traced_memory()[0])
            yield json.loads(json.dumps(record))  # json, not orjson (orjson keeps a cache of keys)

    tracemalloc.start()
    try:
        run(records())
    finally:
        tracemalloc.stop()
    return readings[1] - readings[0], readings[2] - readings[1]


# A string id in a set costs over 50 bytes (the str object and its slot); an id kept as a bit of a bitmap
# (spec.persistent.EndedIds) costs one bit plus 128 bytes per 1,024 ids: 8 bytes per ended request is far
# below the first and far above the second (and the measurement's noise over 250 requests).
BYTES_PER_ENDED_REQUEST = 8
GROWTH_STEPS = 2_000  # 1,000 requests ended per reading


def test_the_fast_path_retains_no_memory_per_ended_request():
    """What FastChecker holds does not grow with the trace: per live request only, and the ids of the
    ended ones (a reused id is refused) at about one bit each."""
    from schedspec.spec.fast_check import FastChecker

    checker = FastChecker(CONFIG)

    def run(records):
        for record in records:
            checker.check(record)

    growth = _retained_growth(run, GROWTH_STEPS)
    assert max(growth) <= BYTES_PER_ENDED_REQUEST * GROWTH_STEPS // 2, growth
    assert not checker.live and "r0" in checker.known and f"r{3 * GROWTH_STEPS // 2}" in checker.known


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_the_plain_path_retains_no_memory_per_ended_request(incremental):
    """What check_trace holds does not grow with the trace either (Stepper.forget_ended: per live request
    only, and the ended requests' count and ids, EndedIds)."""
    steps = GROWTH_STEPS // 4  # the plain path is slower; 250 requests per reading still tell a string from a bit
    reports = []
    growth = _retained_growth(
        lambda records: reports.append(check_trace(CONFIG, (StepRecord.from_dict(r) for r in records),
                                                   incremental=incremental)), steps)
    assert reports[0].ok and reports[0].steps_checked == 3 * steps + 2
    assert max(growth) <= BYTES_PER_ENDED_REQUEST * steps // 2, growth
