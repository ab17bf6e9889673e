"""The whole-engine recorder (``engines/recorder/schedspec_vllm_recorder.py``) never records what the
spec cannot judge: options and request fields it refuses with ``RecorderError``, prompt hashes keyed as
vLLM keys its block hashes, the limits the scheduler enforces in the header, the engine's own finishes
kept apart from client aborts, and the shutdown's aborts written. The pure functions run here; the
scheduler-level cases run once per vLLM version (0.32 and 0.33) in the vLLM environment
(``tests/vllm_recorder_cases.py``, vLLM's ``Scheduler`` without a model runner, about 25 s each on the
2-core machine at load 10)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "vllm_recorder_cases.py"


def _recorder():
    spec = importlib.util.spec_from_file_location("schedspec_vllm_recorder_refusals",
                                                  ROOT / "engines" / "recorder" / "schedspec_vllm_recorder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_block_hash_ids_keep_salts_and_loras_apart():
    """Same tokens under another ``cache_salt`` or LoRA adapter share no block id (vLLM's extra keys,
    ``kv_cache_utils.generate_block_hash_extra_keys``); the same salt and adapter share all; a LoRA is
    keyed by name and path as vLLM keys it."""
    module = _recorder()
    table: dict = {}
    prompt = tuple(range(40))

    def ids(**fields):
        request = SimpleNamespace(lora_request=fields.get("lora"), cache_salt=fields.get("salt"))
        return module.block_hash_ids(prompt, 16, module.hash_extra(request), table)

    lora = SimpleNamespace(lora_name="x", lora_path="/x", lora_int_id=1)
    plain, salted, lora_ids = ids(), ids(salt="a"), ids(lora=lora)
    assert len(plain) == 3
    assert not set(plain) & set(salted) and not set(plain) & set(lora_ids) and not set(salted) & set(lora_ids)
    assert ids(salt="a") == salted and ids() == plain
    assert ids(lora=SimpleNamespace(lora_name="x", lora_path="/x", lora_int_id=2)) == lora_ids
    assert not set(ids(salt="b")) & set(salted)


def test_recorder_stop_rule_is_the_spec_one():
    """The recorder decides an in-flight abort's fate by the spec's own rule (``spec/stop_rule.py``, loaded
    by path), the one ``spec.transitions.stop_reason`` applies."""
    from schedspec.spec import stop_rule

    loaded = _recorder()._load_stop_rule()
    assert loaded.__code__.co_filename == stop_rule.stop_reason_of.__code__.co_filename
    request = SimpleNamespace(sampling_params=SimpleNamespace(ignore_eos=False, eos_token_id=7,
                                                              stop_token_ids=[9], min_tokens=2),
                              output_token_ids=[1], num_tokens=11, max_tokens=5)
    assert _recorder()._spec_stop_reason(loaded, request, 7, 100) == "stop"
    request.output_token_ids = []
    assert _recorder()._spec_stop_reason(loaded, request, 7, 100) is None  # before min_tokens
    assert _recorder()._spec_stop_reason(loaded, request, 3, 12) == "max_model_len"


@pytest.fixture(scope="module", params=["0.32", "0.33"])
def cases(request, tmp_path_factory):
    """The cases' findings by name, for each vLLM version (both refuse and hash alike)."""
    from schedspec.engines.vllm import EngineUnavailable, vllm_path_ahead, vllm_python

    try:
        python = vllm_python()
        ahead = vllm_path_ahead(request.param)
    except EngineUnavailable as error:
        pytest.skip(f"vLLM {request.param} is not installed: {error}")
    folder = tmp_path_factory.mktemp("recorder-cases")
    done = subprocess.run([str(python), str(CASES), str(folder), *([str(ahead)] if ahead else [])],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    version = next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("VLLM "))
    assert version.startswith(request.param), version
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("CASE "):
            _, name, body = line.split(" ", 2)
            found[name] = json.loads(body)
    return found


def test_header_has_the_limits_the_scheduler_enforces(cases):
    """``max_num_scheduled_tokens`` and ``max_num_active_seqs`` (48 and 3, under 64 and 4) are what
    vLLM's ``Scheduler.__init__`` enforces; the header writes them as ``max_num_batched_tokens`` and
    ``max_num_seqs``."""
    assert cases["limits"]["plain"] == [64, 4]
    assert cases["limits"]["limited"] == [48, 3] == cases["limits"]["enforced"]


@pytest.mark.parametrize(("case", "option"), [("init-pipeline", "pipeline_parallel_size=2"),
                                              ("init-data", "data_parallel_size=2"),
                                              ("init-sliding", "SlidingWindowSpec")])
def test_options_the_spec_cannot_judge_are_refused_at_start(cases, case, option):
    assert option in (cases[case]["error"] or ""), cases[case]


def test_the_threshold_floor_is_recorded_and_judged(cases):
    """long_prefill_token_threshold_adaptive is recorded (it was refused while the spec's threshold was fixed):
    the header says it, vLLM cut the three 100-token prompts above the threshold of 8 (its floor, 64 // 3 = 21),
    and the trace passes schedspec check, whose rule long-prefill-threshold follows the floor. The same records
    judged without the floor fail there."""
    import attrs

    from schedspec.spec.checker import check_trace
    from schedspec.spec.trace import open_trace

    trace = open_trace(cases["floor"]["trace"])
    records = list(trace.records())
    assert trace.config.long_prefill_token_threshold_adaptive and trace.config.long_prefill_token_threshold == 8
    assert max(s.prefill_tokens for r in records for s in r.scheduled) > 8
    assert check_trace(trace.config, records).ok
    fixed = attrs.evolve(trace.config, long_prefill_token_threshold_adaptive=False)
    assert "long-prefill-threshold" in {v.name for v in check_trace(fixed, records, keep_going=True).violations}


def test_async_scheduling_is_recorded_by_its_own_class(cases):
    """``RecordingScheduler`` refuses ``async_scheduling`` (naming the async class), the async class refuses
    it off; with it, prefix caching (not planned over placeholders by the spec) and pipeline parallelism are
    refused, and async scheduling's own two batches (``VllmConfig.max_concurrent_batches``) are accepted,
    with ``async_scheduling`` in the header."""
    found = cases["init-async"]
    assert "RecordingAsyncScheduler" in (found["sync-class"] or ""), found
    assert "needs async_scheduling on" in (found["async-class-off"] or ""), found
    assert "prefix caching" in (found["async-caching"] or ""), found
    assert "pipeline_parallel_size=2" in (found["async-pipeline"] or ""), found
    assert found["max_concurrent_batches"] == 2 and found["header_async"] is True, found


@pytest.mark.parametrize(("case", "field"), [("add-resumable", "resumable"),
                                             ("add-structured", "structured_outputs"),
                                             ("add-repetition", "repetition_detection")])
def test_request_fields_the_spec_cannot_judge_are_refused(cases, case, field):
    """Refused before vLLM holds the request, so the trace never lacks a live one."""
    assert field in (cases[case]["error"] or ""), cases[case]
    assert cases[case]["held"] is False


def test_reset_prefix_cache_is_refused(cases):
    assert "reset_prefix_cache" in (cases["reset"]["error"] or "")


def test_an_iterator_of_ids_reaches_vllm(cases):
    """``finish_requests`` given a one-pass iterator: the recorder reads it once and hands vLLM the list."""
    assert cases["finish-iterator"]["held"] is False


def test_engine_error_finish_is_refused_not_recorded_as_an_abort(cases):
    """A ``FINISHED_ERROR`` inside ``update_from_output`` stops the recorder; it is never written as a
    client's abort."""
    assert "'error'" in (cases["update-error"]["error"] or "")
    assert all("plain" not in aborted for aborted in cases["hashes"]["aborted"])


def test_prompts_are_hashed_with_salt_and_lora(cases):
    arrivals = cases["hashes"]["arrivals"]
    assert arrivals["salted"] == arrivals["salted-too"]
    assert not set(arrivals["plain"]) & set(arrivals["salted"])
    assert not set(arrivals["plain"]) & set(arrivals["lora"])


def test_worker_config_error_is_not_rewrapped(cases):
    """``engines/vllm_worker.py``: its own ``ConfigError`` (here ``num_lookahead_tokens`` the n-gram drafter
    lacks) reaches the client as itself, not re-wrapped by the ``except`` for vLLM's refusals."""
    found = cases["config-error"]
    assert found["type"] == "ConfigError" and found["message"].startswith("num_lookahead_tokens=1"), found


def test_shutdown_aborts_are_written(cases):
    """The engine core's shutdown aborts every live request (``finish_requests(None)``) after its last
    step; the recorder writes them in one last, empty step, with the blocks freed."""
    from schedspec.spec.checker import check_trace
    from schedspec.spec.trace import open_trace

    found = cases["shutdown"]
    assert found["aborted"][-1] == ["a"] and found["scheduled"][-1] == 0 and found["freed"][-1]["a"]
    trace = open_trace(found["trace"])
    assert check_trace(trace.config, list(trace.records())).first_bad_step is None  # a legal last step


def test_the_writer_refuses_a_step_after_close(tmp_path):
    """A step given to the writer after close() (shutdown, or the exit hook) would be lost silently, and with
    a full queue the engine thread would wait forever on a thread that is gone: RecorderError."""
    module = _recorder()
    with (tmp_path / "t.jsonl").open("w") as trace:
        writer = module._Writer(trace, 16, 512)
        writer.close()
    with pytest.raises(module.RecorderError, match="step 3 recorded after the trace was closed"):
        writer.put((3,))
    assert writer.queue.empty()


def test_a_header_that_cannot_be_written_leaves_no_open_file(tmp_path, monkeypatch):
    """The header's write fails (here a value json cannot write, as a full disk would fail it): the trace
    file is closed before RecorderError is raised, not left open for the process's life."""
    module = _recorder()
    opened = []

    def tracked_open(*args, **kwargs):
        opened.append(open(*args, **kwargs))  # noqa: SIM115  (the test checks that the recorder closes it)
        return opened[-1]

    monkeypatch.setattr(module, "open", tracked_open, raising=False)
    monkeypatch.setattr(module, "_refuse_config", lambda scheduler, asynchronous: None)
    monkeypatch.setattr(module, "_vllm_version", lambda: "0.0-test")
    monkeypatch.setenv(module.TRACE_VARIABLE, str(tmp_path / "trace.jsonl"))

    class Base:  # the attributes of vLLM's Scheduler the header reads
        def __init__(self) -> None:
            self.block_size = 16
            self.kv_cache_manager = SimpleNamespace(block_pool=SimpleNamespace(num_gpu_blocks=33))
            self.vllm_config = SimpleNamespace(
                scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=True,
                                                 long_prefill_token_threshold=object(), policy="fcfs"),
                model_config=SimpleNamespace(max_model_len=512), cache_config=SimpleNamespace(enable_prefix_caching=False),
                lora_config=None)

    with pytest.raises(module.RecorderError, match="writing the trace header to .* failed"):
        module._make_recording_class(Base)()
    assert len(opened) == 1 and opened[0].closed


@pytest.mark.parametrize(("option", "value"), [("--abort-every", "0"), ("--requests", "0"), ("--speed", "0"),
                                               ("--deadline", "-1")])
def test_record_vllm_serve_refuses_a_bad_option_in_one_line(option, value, tmp_path):
    """``scripts/record_vllm_serve.py --abort-every 0`` divided by zero once the clients started; every
    count it divides or sleeps by is checked first: one line naming the option, exit 2, nothing started."""
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "record_vllm_serve.py"), "--out",
                           str(tmp_path / "out"), option, value], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines() == [f"record_vllm_serve: error: {option} must be positive, got {float(value) if option in ('--speed', '--deadline') else int(value)}"]
    assert not (tmp_path / "out").exists()
