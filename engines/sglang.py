"""The ``sglang`` adapter: SGLang 0.5.23's own scheduler (``sglang/srt/managers/scheduler.py``
``Scheduler``) driven step by step through the :class:`~schedspec.reference.scheduler.Scheduler`
protocol, with no model, on the CPU, in SGLang's own environment over a worker process
(:mod:`schedspec.engines.sglang_worker`, run by ``.venv-sglang/bin/python`` or
``$SCHEDSPEC_SGLANG_PYTHON``; the process and its JSON Lines pipe are the vLLM adapter's
``_WorkerProcess``, shared).

**What runs is SGLang's code.** Each step the worker calls SGLang's own
``Scheduler.get_next_batch_to_run`` (``process_pending_chunked_abort``, the stash of the chunked
request, the merge of the last prefill batch into the running batch, ``get_new_batch_prefill`` with
``SchedulePolicy.calc_priority`` and ``PrefillAdder.add_chunked_req`` / ``add_one_req``,
``ScheduleBatch.init_new`` and ``prepare_for_extend``; else ``update_running_batch`` with
``ScheduleBatch.check_decode_mem``, ``retract_decode``, the ``NewTokenRatioTracker`` update and
``prepare_for_decode``) on a ``Scheduler`` object, and feeds the sampled tokens back through SGLang's
own ``SchedulerBatchResultProcessor.process_batch_result_prefill`` / ``process_batch_result_decode``
with a ``GenerationBatchResult`` holding them, as ``Scheduler.process_batch_result`` dispatches. An
arrival goes through ``Scheduler.init_req_max_new_tokens``, ``validate_input_length`` and
``Scheduler._add_request_to_queue``, as ``handle_generate_request`` does. The pools, the allocator,
the radix cache, the policy and the ratio tracker are SGLang's (``sglang_worker.Components``).

**What is replaced, and why** (``sglang_worker._headless_scheduler``):

- ``Scheduler.__init__`` is not run: it starts a model worker (``init_model_worker``: weights, a
  device), ZMQ sockets to the tokenizer and detokenizer, the Rust front end, watchdogs and profilers.
  The object is made with ``object.__new__`` and given the attributes its ``init_*`` methods set for
  one CPU rank with every optional feature off (the dict in ``_headless_scheduler`` names the
  ``init_*`` method each block comes from). ``max_req_len``/``max_req_input_len`` are computed as the
  model worker's ``get_worker_info`` does (``managers/tp_worker.py``), with ``context_len =
  max_model_len`` and the pool's token count.
- Components of features kept off are stand-ins (``_Record``): the grammar manager (no constrained
  decoding: ``has_waiting_grammars`` is ``False``), the DP-attention adapter and the n-gram embedding
  manager (identity on the batch: no DP attention, no n-gram embedding), the beam coordinator (no
  beam search: 0 pending rows), the metrics reporter and load inquirer (no metrics), the model
  runner's attention backend (``None``: the tile-budget fallback of 64 that
  ``_get_new_batch_prefill_raw`` takes for non-Triton back ends; it only sizes logging) and the output
  streamer (no detokenizer: the finish state is read from the ``Req``). ``send_abort_output`` is
  overridden to record the abort instead of sending it, and ``_add_request_to_queue`` to record a
  retraction (then it runs SGLang's own). None of them decides anything in the default configuration.
- The model's forward pass: the sampled token of each request comes from the caller (our token
  source) as ``next_token_ids``. The model config is a stand-in with the fields the batch and the
  result processor read (vocabulary size, no encoder, no reasoning tokens).

**Mapping onto the spec** (docs/engines.md, *SGLang 0.5.23*):

- *Pages as blocks*: ``page_size = block_size``; the token pool holds ``num_kv_blocks * block_size``
  tokens, pages ``1..num_kv_blocks`` (SGLang's page 0 is padding), SGLang page ``p`` is spec block
  ``p - 1``; the view's free blocks are the allocator's ``available_size() // page_size``.
- *Limits*: ``max_running_requests = max_num_seqs``; ``chunked_prefill_size = max_num_batched_tokens``
  with chunked prefill on (``-1``, no chunking, with it off) and ``max_prefill_tokens =
  max_num_batched_tokens``. They differ from the spec's one budget: ``max_prefill_tokens`` bounds only
  the input tokens of a prefill pass (the first request of a pass may exceed it, ``PrefillAdder``), and
  a decode step is not bounded by either (it runs every running request, one token each). So a decode
  batch larger than ``max_num_batched_tokens`` breaks the spec's ``token-budget`` rule: reported as it is.
- *A step* is SGLang's batch: an extend batch (prefill chunks: each request's ``prefix_lens`` as
  ``num_computed_tokens``, ``extend_lens`` as its tokens) or a decode batch (one token each, at
  ``seq_len - 1``). New blocks are the pages its row of the request-to-token pool gained in the step.
  Steps are all prefill or all decode (``enable_mixed_chunk`` is off): the spec allows that.
- *Retraction as preemption*: ``retract_decode``'s victims, in the order SGLang re-queued them. SGLang
  re-queues a retracted request at the back of its waiting queue and keeps its output tokens; the spec
  puts it at the front with nothing computed. Queues are compared as sets, so the order is not judged.
- *Rejection*: the front end's checks (:func:`front_end_rejection`: empty prompt, prompt of
  ``max_model_len`` or more, prompt plus ``max_tokens`` past ``max_model_len``, which the spec admits and
  ends at ``max_model_len``: a documented difference), then a request whose prompt SGLang's scheduler refuses (``validate_input_length``: ``prompt_len >=
  max_req_input_len``) or whose prompt alone exceeds the pool (``init_req_max_new_tokens``: "exceeds
  the KV memory budget") is reported as rejected in the next plan, with the spec's code for the limit it
  breaks if it breaks one, else ``prompt-exceeds-max-model-len`` (SGLang's limit is
  ``min(max_model_len, pool tokens) - 6``): the spec's ``reject-only-impossible`` judges it.
- *Output clipping*: ``init_req_max_new_tokens`` lowers ``max_new_tokens`` to what an empty pool can
  hold (``max_new_tokens_for_memory``: pool tokens minus the page-rounded prompt, one page and one
  token) and to ``max_req_len - prompt_len - 1``. Such a request ends with a length finish before its
  ``max_tokens``, which the engine loop reports as a ``refinement`` mismatch: a finding
  (docs/findings/sglang-clips-max-tokens.md), not hidden.
- *Stop conditions*: ``eos_token_id`` and ``stop_token_ids`` go to SGLang's ``Req`` (``ignore_eos`` only
  when it has neither); SGLang's finish type (``stop``, ``length``) is compared with the spec's reason
  (:meth:`SglangScheduler.finish_reason_mismatches`). ``min_tokens`` binds only SGLang's sampler, not run
  here: a stop id sampled before it is refused (``StopBeforeMinTokens``, exit 3), as is ``min_tokens >
  max_tokens``. A request the spec did not sample gets no token: the worker raises instead.
- *Engine aborts*: a request ``retract_decode`` aborts ("out of memory even after retracting") is
  raised as :class:`~schedspec.reference.scheduler.EngineFault` (the spec has no such transition).

**Priority** (``sglang-priority``, :func:`priority`): ``--enable-priority-scheduling`` with
``--schedule-low-priority-values-first`` (SGLang's default takes a *greater* value as more urgent; this flag
gives the spec's convention, a lower value more urgent) and ``--priority-scheduling-preemption-threshold 0``
(``sglang_worker.PREEMPTION_THRESHOLD``: SGLang's default 10 never preempts among the spec's priorities 0..3);
the request's ``priority`` goes to its ``Req`` (the plain ``sglang`` sends none, as a client of a server without
priority scheduling must). A request ``PrefillAdder.preempt_to_schedule`` releases for a more urgent one is
reported as preempted in the step that admits that one (SGLang re-queues it without ``is_retracted``; the
worker knows it by ``Req.is_retracted``, which ``reset_for_retract`` sets). Retraction keeps its ``length``
order (``--retraction-policy`` default).

**Prefix caching** (``RadixCache``, ``page_size = block_size``) runs under ``prefix_cache_publication =
"sglang-radix"`` only (the spec's SGLang publication: docs/engines.md, *The radix cache*): a hit is the pages
``match_prefix`` gave at admission; each prefill chunk's plan names the de-duplications SGLang's checkpoint will
make (``sglang_worker.Engine.deduplications``, read from the tree without touching it); the view counts the
tree's evictable pages as free (``available_size() + evictable_size()``) and rereads each row after the
checkpoint rewrote it. A chunked prefill with caching is refused when it happens (SGLang inserts a middle chunk
only in the next ``get_next_batch_to_run``, ``stash_chunked_request``: not mapped yet).

**Refused** (:class:`~schedspec.reference.scheduler.UnsupportedFeature`, CLI exit 3): prefix caching with
vLLM's publication, a chunked prefill with prefix caching (above), speculative decoding,
``long_prefill_token_threshold > 0`` (SGLang has no such limit), vLLM's per-step limits
(``max_loras``, ``watermark``, ``max_num_active_seqs``, the threshold floor, ``prefill_schedule_interval``)
and requests with a LoRA adapter or structured output, and aborting a request SGLang has
admitted (its ``abort_request`` finishes it at the next result, not at once).

``guarantees`` is empty: SGLang promises none of the spec's trace properties.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from schedspec.reference.scheduler import EngineFault, EngineView, UnsupportedFeature
from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request, printable
from schedspec.spec.state import ScheduledRequest, StepPlan
from schedspec.spec.workload import token_ids

from .vllm import (
    EngineStartError,
    EngineUnavailable,
    StopBeforeMinTokens,
    _worker,
    _WorkerClient,
    finish_reason_differences,
)

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().with_name("sglang_worker.py")
DEFAULT_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
PYTHON_VARIABLE = "SCHEDSPEC_SGLANG_PYTHON"
SGLANG_VERSION = "0.5.23"


INSTALL_WAIT_S = 1200.0
"""How long :func:`sglang_python` waits for an install of the environment in progress (seconds)."""


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs; a zombie (ended, not yet reaped by its parent) does not."""
    proc = Path("/proc")
    if proc.is_dir():
        try:
            stat = (proc / str(pid) / "stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[0] != "Z"  # the state field follows the command's ")"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_install(environment: Path, timeout_s: float = INSTALL_WAIT_S) -> None:
    """Wait while ``scripts/engines_setup.sh`` installs the environment ``environment`` (the folder of a venv).

    The set-up writes its process id into ``environment/.schedspec-installing`` before it installs and removes
    the file after the environment passed its import check (``scripts/engines_setup.sh``, ``setup_sglang``), so
    ``scripts/test.sh`` can build ``.venv-sglang`` in the background while the suite runs: a test (or any
    run) that reaches the adapter first waits here. Returns at once when no install is in progress.

    Raises:
        EngineUnavailable: the file names a process that has ended (an install that failed or was cut short:
            its own ``ENGINES SETUP: FAIL`` line says why), or the install still runs after ``timeout_s``
            seconds.
    """
    marker = environment / ".schedspec-installing"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid = int(marker.read_text().strip() or 0)
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            pid = 0
        if not pid or not _process_alive(pid):
            raise EngineUnavailable(f"scheduler 'sglang': the install of {environment} (scripts/engines_setup.sh, "
                                    f"process {pid}) ended without completing; its log says why (scripts/test.sh: "
                                    "build/sglang-setup.log); run `bash scripts/engines_setup.sh --only sglang`")
        if time.monotonic() > deadline:
            raise EngineUnavailable(f"scheduler 'sglang': {environment} is still being installed by process {pid} "
                                    f"after {timeout_s:.0f} s")
        time.sleep(0.5)


def sglang_python() -> Path:
    """The interpreter of the SGLang environment: ``$SCHEDSPEC_SGLANG_PYTHON`` or ``.venv-sglang/bin/python``,
    once an install of it in progress has ended (:func:`wait_for_install`).

    Raises:
        EngineUnavailable: the variable is not set and the default does not exist (not installed), or its
            install failed or is still running after :data:`INSTALL_WAIT_S`.
        EngineStartError: the variable names a path that is not a file.
    """
    named = os.environ.get(PYTHON_VARIABLE)
    python = Path(named) if named else DEFAULT_PYTHON
    wait_for_install(python.parent.parent)
    if named and not python.is_file():
        raise EngineStartError(f"environment variable {PYTHON_VARIABLE}={named}: no such file (the Python of an "
                               f"environment with sglang=={SGLANG_VERSION}; `bash scripts/engines_setup.sh --only sglang` "
                               f"builds one at {DEFAULT_PYTHON})")
    if not python.exists():
        raise EngineUnavailable(f"scheduler 'sglang': no SGLang environment at {python}; run `bash "
                                f"scripts/engines_setup.sh --only sglang` (builds .venv-sglang) or set {PYTHON_VARIABLE}")
    return python


def _spec_code(request: Request, config: SchedulerConfig) -> str:
    """The spec's rejection code for a request SGLang refuses (``spec.admission.rejection_reason``'s, before
    its colon), or ``prompt-exceeds-max-model-len`` where the spec would admit it (SGLang's front end is
    stricter: docs/engines.md)."""
    spec = rejection_reason(request.prompt_len, request.max_tokens, config)
    return spec.partition(":")[0] if spec is not None else "prompt-exceeds-max-model-len"


def front_end_rejection(request: Request, config: SchedulerConfig) -> str | None:
    """Why SGLang's front end refuses ``request`` before its scheduler sees it, or ``None``: an empty
    prompt (``managers/io_struct.py`` ``GenerateReqInput``: "input_ids cannot be empty"), a prompt of
    ``max_model_len`` tokens or more, or a prompt plus ``max_tokens`` past ``max_model_len``
    (``managers/tokenizer_manager.py`` ``TokenizerManager._validate_one_request``, ``context_len =
    max_model_len``, ``validate_total_tokens`` on, ``allow_auto_truncate`` off). The last is a
    documented difference: the spec admits such a request and ends it at ``max_model_len``.

    Returns:
        ``"CODE: SGLang's message"``, the code the spec's for the limit (``reject-only-impossible`` judges it).
    """
    prompt_len, context_len = request.prompt_len, config.max_model_len
    if prompt_len == 0:
        return "empty-prompt: SGLang GenerateReqInput: input_ids cannot be empty."
    if prompt_len >= context_len:
        return (f"prompt-exceeds-max-model-len: SGLang tokenizer manager: the input ({prompt_len} tokens) is longer "
                f"than the model's context length ({context_len} tokens).")
    if prompt_len + request.max_tokens > context_len:
        return (f"{_spec_code(request, config)}: SGLang tokenizer manager: requested token count exceeds the model's maximum context "
                f"length of {context_len} tokens ({prompt_len} input + {request.max_tokens} new)")
    return None


class SglangScheduler(_WorkerClient):
    """SGLang 0.5.23's ``Scheduler`` as a :class:`~schedspec.reference.scheduler.Scheduler` (module
    docstring).

    Args:
        config: the limits (mapping in the module docstring).
        policy: SGLang's ``--schedule-policy`` (``"fcfs"``; with prefix caching off every cache-aware
            policy falls back to it, ``SchedulePolicy._determine_active_policy``).
        priority: priority scheduling with preemption (module docstring, *Priority*; name ``sglang-priority``).

    Raises:
        UnsupportedFeature: a refused feature (module docstring) or no SGLang environment.
        EngineStartError: ``$SCHEDSPEC_SGLANG_PYTHON`` names no file, or the worker died before its first reply.
    """

    state = None

    def __init__(self, config: SchedulerConfig, policy: str = "fcfs", priority: bool = False) -> None:
        self.name = ("sglang" if policy == "fcfs" else f"sglang-{policy}") + ("-priority" if priority else "")
        self.priority = priority
        for refused, why in (
            (config.enable_prefix_caching and config.prefix_cache_publication != "sglang-radix",
             "prefix caching with prefix_cache_publication="
             f"{config.prefix_cache_publication!r}: SGLang's radix tree publishes and de-duplicates as "
             "prefix_cache_publication='sglang-radix' says (docs/engines.md, The radix cache)"),
            (config.speculative, "speculative decoding (num_speculative_tokens>0)"),
            (config.long_prefill_token_threshold > 0,
             f"long_prefill_token_threshold={config.long_prefill_token_threshold}: SGLang has no such limit"),
            (config.limits_on,
             f"{', '.join(config.limits_on)}: vLLM's per-step limits (spec.config.LIMIT_DEFAULTS), which SGLang "
             "0.5.23 does not apply (prefill_schedule_interval is vLLM 0.33's prefill cadence)"),
        ):
            if refused:
                raise UnsupportedFeature(f"scheduler {self.name!r}: {why}")
        self.config = config
        self.guarantees: frozenset[str] = frozenset()
        self.engine: dict[str, str] = {"name": "sglang", "version": SGLANG_VERSION}
        self.worker = _worker(sglang_python(), None, WORKER, "SGLang", PYTHON_VARIABLE)
        self.handle = self.worker.next_handle
        self.worker.next_handle += 1
        self.closed = False  # from here on the worker may hold a scheduler for this handle: close() drops it
        reply = self.worker.call({"op": "init", "handle": self.handle, "config": config.to_dict(), "policy": policy,
                                  "priority": priority})
        if "refused" in reply:
            raise UnsupportedFeature(f"scheduler {self.name!r}: SGLang refuses this config: {reply['refused']}")
        if reply["sglang_version"] != SGLANG_VERSION:
            self.close()
            raise EngineUnavailable(f"scheduler {self.name!r}: the worker imported sglang {reply['sglang_version']}, "
                                    f"expected {SGLANG_VERSION}; run `bash scripts/engines_setup.sh --only sglang --force`")
        self.requests: dict[str, Request] = {}
        self.stops = StopBeforeMinTokens("SGLang")
        self.finish_reasons: dict[str, str] = {}  # the last update's finished ids -> SGLang's finish type
        self.refused: dict[str, str] = {}  # refused by the front end, reported in the next plan
        self.admitted: set[str] = set()
        self.plan: StepPlan | None = None
        self.step = 0

    def add_request(self, request: Request) -> None:
        """The front end's checks (:func:`front_end_rejection`), then ``handle_generate_request`` in the
        worker (module docstring)."""
        if request.lora_int_id or request.grammar_ready_step is not None:
            raise UnsupportedFeature(f"scheduler {self.name!r}: request {printable(request.request_id)} has a LoRA "
                                     "adapter or structured output (lora_int_id, grammar_compile_steps), which the "
                                     "adapter does not pass to SGLang")
        self.requests[request.request_id] = request
        refused = front_end_rejection(request, self.config)
        if refused is not None:
            self.refused[request.request_id] = refused
            return
        if request.min_tokens > request.max_tokens:
            raise UnsupportedFeature(
                f"scheduler {self.name!r}: request {printable(request.request_id)}: min_tokens={request.min_tokens} > "
                f"max_tokens={request.max_tokens}: SGLang's SamplingParams.verify refuses it; the spec runs it to max_tokens")
        self.stops.add(request)
        self._send({"op": "add", "id": request.request_id, "prompt": token_ids(request, 0, request.prompt_len).tolist(),
                    "max_tokens": request.max_tokens, "eos": request.eos_token_id,
                    "stop_token_ids": list(request.stop_token_ids),
                    # a client sends no priority to a server without priority scheduling (SGLang aborts it)
                    "priority": request.priority if self.priority else None})

    def abort_request(self, request_id: str) -> None:
        """A waiting request leaves SGLang's queue; unknown ids are ignored.

        Raises:
            UnsupportedFeature: the request was admitted (module docstring)."""
        if self.refused.pop(request_id, None) is not None:
            self.requests.pop(request_id, None)
            return
        if request_id in self.admitted:
            raise UnsupportedFeature(f"scheduler {self.name!r}: aborting an admitted request ({request_id}): SGLang "
                                     "finishes it at its next result, which the spec's abort cannot express")
        if self.requests.pop(request_id, None) is not None:
            self.stops.discard(request_id)
            self._send({"op": "abort", "id": request_id})

    def _reason(self, request_id: str, sglang_message: str) -> str:
        return f"{_spec_code(self.requests[request_id], self.config)}: SGLang: {sglang_message}"

    def schedule(self) -> StepPlan:
        """SGLang's ``get_next_batch_to_run`` as a plan; the same plan until ``update``.

        Raises:
            EngineFault: SGLang aborted a running request (``retract_decode``: out of memory even after
                retracting)."""
        if self.plan is None:
            reply = self._call({"op": "schedule"})
            if "refused" in reply:
                raise UnsupportedFeature(f"scheduler {self.name!r}: {reply['refused']}")
            if reply["engine_aborted"]:
                request_id, message = reply["engine_aborted"][0]
                raise EngineFault(f"sglang {SGLANG_VERSION}", "Scheduler.update_running_batch", self.step,
                                  "schedule_batch.py ScheduleBatch.retract_decode",
                                  f"aborted request {request_id}: {message}")
            scheduled = tuple(ScheduledRequest(r, computed, count, tuple(new), cached_block_ids=tuple(hit),
                                               deduplicated_block_ids=tuple(tuple(p) for p in pairs))
                              for r, computed, count, new, hit, pairs in reply["scheduled"])
            rejected = tuple(self.refused.items()) + tuple((r, self._reason(r, message))
                                                          for r, message in reply["rejected"])
            self.plan = StepPlan(scheduled=scheduled, preempted=tuple(reply["preempted"]), rejected=rejected)
        return self.plan

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int]) -> tuple[str, ...]:
        """Feed the sampled tokens to SGLang's result processor; the ids that finished in this step.

        Raises:
            ValueError: ``plan`` is not the plan ``schedule`` returned.
        """
        if self.plan is None or plan != self.plan:
            raise ValueError("update: the plan is not the one schedule() returned")
        for request_id, _ in plan.rejected:
            self.requests.pop(request_id, None)
            self.refused.pop(request_id, None)
        self.admitted.update(item.request_id for item in plan.scheduled)
        self.admitted.difference_update(plan.preempted)
        scheduled = {item.request_id for item in plan.scheduled}
        sampled = {r: int(t) for r, t in sampled_token_ids.items() if r in scheduled}
        for request_id, token in sampled.items():
            self.stops.sampled(request_id, [token])
        reply = self._call({"op": "update", "sampled": sampled})
        self.plan = None
        self.step += 1
        self.finish_reasons = dict(reply["finished"])
        finished = tuple(self.finish_reasons)
        for request_id in finished:
            self.requests.pop(request_id, None)
            self.admitted.discard(request_id)
        return finished

    def finish_reason_mismatches(self, ended: Mapping[str, Request]) -> list[tuple[str, str]]:
        """The requests the last :meth:`update` finished whose SGLang finish type is not the spec's reason,
        as ``(request id, text)`` pairs (the engine loop reports them as ``refinement`` mismatches). ``ended``: the spec's
        terminal requests after the step, by id. SGLang's types are ``BaseFinishReason.to_json()["type"]``
        (``sglang/srt/managers/schedule_batch.py``: ``stop`` for ``FINISH_MATCHED_TOKEN``, ``length`` for
        ``FINISH_LENGTH``, ``abort``); both of the spec's length limits are ``length``
        (``engines/vllm.py`` ``ENGINE_FINISH_REASONS``)."""
        return finish_reason_differences("SGLang", self.finish_reasons, ended)

    def engine_view(self) -> EngineView:
        """SGLang's own bookkeeping in spec terms: the allocator's free tokens over ``page_size``
        (``PagedTokenToKVPoolAllocator.available_size``), its waiting queue (with requests whose refusal
        the next plan reports), the running batch with the chunked request (and the last prefill batch,
        which ``get_next_batch_to_run`` merges into it at the next step), each live request's pages
        (its row of ``ReqToTokenPool``) and its computed tokens (``seq_len - 1`` once running: the last
        sampled token has no KV yet; the chunked request's ``extend_end``)."""
        reply = self._call({"op": "view"})
        return EngineView(num_free_blocks=reply["num_free_tokens"] // self.config.block_size,
                          waiting=tuple(reply["waiting"]) + tuple(self.refused), running=tuple(reply["running"]),
                          block_tables={r: tuple(b) for r, b in reply["block_tables"].items()},
                          num_computed_tokens={**reply["num_computed_tokens"], **dict.fromkeys(self.refused, 0)})


def fcfs(config: SchedulerConfig) -> SglangScheduler:
    """SGLang 0.5.23's scheduler with ``--schedule-policy fcfs`` (registry name ``sglang``)."""
    return SglangScheduler(config, "fcfs")


def priority(config: SchedulerConfig) -> SglangScheduler:
    """SGLang 0.5.23's scheduler with ``--schedule-policy fcfs --enable-priority-scheduling
    --schedule-low-priority-values-first --priority-scheduling-preemption-threshold 0`` (registry name
    ``sglang-priority``; module docstring, *Priority*)."""
    return SglangScheduler(config, "fcfs", priority=True)
