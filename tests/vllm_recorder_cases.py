"""Cases for the whole-engine recorder's refusals and hooks, run in the vLLM environment by
``tests/test_recorder_refusals.py`` (not collected by pytest: it needs vLLM). vLLM's ``Scheduler`` is
built as the standalone adapter's worker builds it (``engines/vllm_worker.py``, no model runner) with the
recorder's ``RecordingScheduler`` as its class; each case prints ``CASE <name> <JSON>`` with what it saw.
Usage: ``python vllm_recorder_cases.py FOLDER [VLLM_DIR]`` (traces are written under FOLDER; VLLM_DIR, e.g.
``.vllm033``, is put first on ``sys.path``, as the worker's ``--path-ahead``)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("vllm_worker", ROOT / "engines" / "vllm_worker.py")
worker_module = importlib.util.module_from_spec(spec)
ahead = ["--path-ahead", sys.argv[2]] if len(sys.argv) > 2 else []
saved, sys.argv = sys.argv, [str(ROOT / "engines" / "vllm_worker.py"), *ahead]
spec.loader.exec_module(worker_module)
sys.argv = saved
import schedspec_vllm_recorder as recorder  # noqa: E402  (the worker put its folder on sys.path)

CONFIG = {"block_size": 16, "num_kv_blocks": 32, "max_model_len": 512, "max_num_seqs": 4,
          "max_num_batched_tokens": 64, "enable_chunked_prefill": True, "long_prefill_token_threshold": 0,
          "enable_prefix_caching": True}
counter = iter(range(1000))


def fresh_trace() -> str:
    path = str(FOLDER / f"trace-{next(counter)}.jsonl")
    os.environ[recorder.TRACE_VARIABLE] = path
    return path


def worker():
    path = fresh_trace()
    return worker_module.Worker(CONFIG, "fcfs", False, 1000, base=recorder.RecordingScheduler), path


def report(name: str, **found) -> None:
    print(f"CASE {name} {json.dumps(found)}", flush=True)


def refused(call) -> str | None:
    try:
        call()
    except recorder.RecorderError as error:
        return str(error)
    return None


def rebuild(scheduler, *, kv_cache_config=None, cls=None, **changes):
    """A RecordingScheduler (or ``cls``) over ``scheduler``'s configs with ``changes`` (part__field) applied."""
    config = scheduler.vllm_config
    for name, value in changes.items():
        part, field = name.split("__")
        object.__setattr__(getattr(config, part), field, value)
    fresh_trace()
    return (cls or recorder.RecordingScheduler)(vllm_config=config, kv_cache_config=kv_cache_config or scheduler.kv_cache_config,
                                       structured_output_manager=scheduler.structured_output_manager,
                                       block_size=scheduler.block_size, log_stats=False)


def request(w, request_id, prompt, **fields):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=4, ignore_eos=True, **fields.pop("params", {}))
    return Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
                   pooling_params=None, arrival_time=0.0, block_hasher=w.block_hasher, **fields)


def main() -> None:
    # -- the limits the scheduler enforces, in the header
    w, path = worker()
    header = json.loads(Path(path).read_text().splitlines()[0])["config"]
    w.scheduler.shutdown()
    base = w.scheduler
    scheduled = rebuild(base, scheduler_config__max_num_scheduled_tokens=48,
                        scheduler_config__max_num_active_seqs=3)
    limited = json.loads(Path(os.environ[recorder.TRACE_VARIABLE]).read_text().splitlines()[0])["config"]
    scheduled.shutdown()
    report("limits", plain=[header["max_num_batched_tokens"], header["max_num_seqs"]],
           limited=[limited["max_num_batched_tokens"], limited["max_num_seqs"]],
           enforced=[scheduled.max_num_scheduled_tokens, scheduled.max_num_active_reqs])
    object.__setattr__(base.vllm_config.scheduler_config, "max_num_scheduled_tokens", None)
    object.__setattr__(base.vllm_config.scheduler_config, "max_num_active_seqs", None)

    # -- options refused at start
    for option, changes in [("pipeline", {"parallel_config__pipeline_parallel_size": 2}),
                            ("data", {"parallel_config__data_parallel_size": 2})]:
        saved = {k: getattr(getattr(base.vllm_config, k.split("__")[0]), k.split("__")[1]) for k in changes}
        report(f"init-{option}", error=refused(lambda changes=changes: rebuild(base, **changes)))
        for k, v in saved.items():
            object.__setattr__(getattr(base.vllm_config, k.split("__")[0]), k.split("__")[1], v)
    # -- async scheduling: each class only with its own setting; with it, prefix caching and pipeline
    # parallelism refused, and the two batches async scheduling keeps accepted
    asynchronous = recorder.RecordingAsyncScheduler
    configs = base.vllm_config
    saved = (configs.scheduler_config.async_scheduling, configs.cache_config.enable_prefix_caching)
    found = {"sync-class": refused(lambda: rebuild(base, scheduler_config__async_scheduling=True)),
             "async-class-off": refused(lambda: rebuild(base, cls=asynchronous, scheduler_config__async_scheduling=False)),
             "async-caching": refused(lambda: rebuild(base, cls=asynchronous, scheduler_config__async_scheduling=True,
                                                      cache_config__enable_prefix_caching=True)),
             "async-pipeline": refused(lambda: rebuild(base, cls=asynchronous, scheduler_config__async_scheduling=True,
                                                       cache_config__enable_prefix_caching=False,
                                                       parallel_config__pipeline_parallel_size=2))}
    object.__setattr__(configs.parallel_config, "pipeline_parallel_size", 1)
    accepted = rebuild(base, cls=asynchronous, scheduler_config__async_scheduling=True,
                       cache_config__enable_prefix_caching=False)
    header = json.loads(Path(os.environ[recorder.TRACE_VARIABLE]).read_text().splitlines()[0])
    accepted.shutdown()
    report("init-async", **found, max_concurrent_batches=configs.max_concurrent_batches,
           header_async=header.get("async_scheduling"))
    object.__setattr__(configs.scheduler_config, "async_scheduling", saved[0])
    object.__setattr__(configs.cache_config, "enable_prefix_caching", saved[1])
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    sliding = KVCacheConfig(num_blocks=33, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layers.0.self_attn"], SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                                  sliding_window=32))])
    report("init-sliding", error=refused(lambda: rebuild(base, kv_cache_config=sliding)))

    # -- requests refused at add_request (and not held by vLLM), prompt hashes keyed by salt and LoRA
    w, path = worker()
    s = w.scheduler
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

    prompt = list(range(1, 40))
    cases = {"resumable": dict(resumable=True),
             "structured": dict(params=dict(structured_outputs=StructuredOutputsParams(json_object=True))),
             "repetition": dict(params=dict(repetition_detection=RepetitionDetectionParams(
                 max_pattern_size=2, min_count=2)))}
    for name, fields in cases.items():
        try:
            made = request(w, name, prompt, **fields)
        except Exception as error:  # noqa: BLE001
            report(f"add-{name}", error=None, held=False, unbuildable=repr(error))
            continue
        report(f"add-{name}", error=refused(lambda made=made: s.add_request(made)), held=name in s.requests)
    s.add_request(request(w, "plain", prompt))
    s.add_request(request(w, "salted", prompt, cache_salt="a"))
    s.add_request(request(w, "salted-too", prompt, cache_salt="a"))
    s.add_request(request(w, "lora", prompt, lora_request=LoRARequest("x", 1, "/lora/x")))
    # -- reset_prefix_cache refused
    report("reset", error=refused(lambda: s.reset_prefix_cache()))
    # -- an iterator of ids given to finish_requests reaches vLLM too
    from vllm.v1.request import RequestStatus

    s.finish_requests(iter(["lora"]), RequestStatus.FINISHED_ABORTED)
    report("finish-iterator", held="lora" in s.requests)
    w.schedule({})
    w.update({"sampled": {}})
    # -- an engine-initiated finish inside update_from_output is not a client's abort
    output = w.schedule({})
    s.encoder_cache_mismatch_reqs.add("plain")  # a set in 0.32 and 0.33: finished FINISHED_ERROR in the update
    error = refused(lambda: w.update({"sampled": {r: 5 for r in output["scheduled"] and
                                                 [item[0] for item in output["scheduled"]]}}))
    report("update-error", error=error)
    s.recorder_flush()
    records = [json.loads(line) for line in Path(path).read_text().splitlines()[1:]]
    arrivals = {a["request_id"]: a["block_hash_ids"] for r in records for a in r["arrivals"]}
    report("hashes", arrivals=arrivals, aborted=[r["aborted"] for r in records])

    # -- the worker's own refusal keeps its type and message (not re-wrapped as a vLLM refusal)
    try:
        worker_module.Worker(dict(CONFIG, enable_prefix_caching=False, num_lookahead_tokens=1), "fcfs", False, 1000)
        report("config-error", type=None, message=None)
    except worker_module.ConfigRefused as error:
        report("config-error", type=type(error).__name__, message=str(error))

    # -- the threshold's floor is recorded (the spec follows it): three prompts of 100 tokens, threshold 8,
    # budget 64, so vLLM cuts chunks at max(8, 64 // 3) = 21 tokens
    path = fresh_trace()
    w = worker_module.Worker(dict(CONFIG, enable_prefix_caching=False, long_prefill_token_threshold=8,
                                  long_prefill_token_threshold_adaptive=True), "fcfs", False, 1000,
                             base=recorder.RecordingScheduler)
    s = w.scheduler
    for name in ("f0", "f1", "f2"):
        s.add_request(request(w, name, range(1, 101)))
    while s.requests:
        out = w.schedule({})
        w.update({"sampled": {r: 5 for r, computed, count, *_ in out["scheduled"]
                              if computed + count >= s.requests[r].num_tokens}})
    s.shutdown()
    report("floor", trace=path)

    # -- shutdown aborts every live request: written as one last record
    w, path = worker()
    s = w.scheduler
    s.add_request(request(w, "a", prompt))
    out = w.schedule({})
    w.update({"sampled": {item[0]: 5 for item in out["scheduled"]}})
    s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    s.shutdown()
    records = [json.loads(line) for line in Path(path).read_text().splitlines()[1:]]
    report("shutdown", trace=path, aborted=[r["aborted"] for r in records], scheduled=[len(r["scheduled"]) for r in records],
           freed=[r["blocks_freed"] for r in records])


if __name__ == "__main__":
    import vllm

    print(f"VLLM {vllm.__version__}", flush=True)
    main()
