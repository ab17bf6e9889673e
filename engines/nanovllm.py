"""The nano-vLLM adapter: the scheduler and block manager of ``nano-vllm-fork==20260210`` driven through
the :class:`~schedspec.reference.scheduler.Scheduler` protocol, with no model runner.

What is driven. nano-vLLM's ``nanovllm/engine/scheduler.py`` ``Scheduler`` (``add``, ``schedule``,
``postprocess``) over its ``nanovllm/engine/block_manager.py`` ``BlockManager`` and
``nanovllm/engine/sequence.py`` ``Sequence``; exactly what ``nanovllm/engine/llm_engine.py``
``LLMEngine.step`` does, with the model runner's ``run`` replaced by the tokens our token source
sampled. Each ``schedule()`` returns the engine's batch as a :class:`~schedspec.spec.state.StepPlan`;
each ``update()`` feeds the sampled tokens back through ``Scheduler.postprocess``.

Importing without the GPU code. ``nanovllm/__init__.py`` imports ``nanovllm.llm`` and with it
``engine/model_runner.py`` and ``layers/*`` (torch.distributed, CUDA, triton, flash-attn): it fails on
a CPU machine. :func:`load_engine` therefore puts an *unexecuted* module object for the package
``nanovllm`` into ``sys.modules`` (``importlib.util.find_spec`` locates the installed package and
``importlib.util.module_from_spec`` builds the module with its ``__path__`` without running
``__init__.py``), then imports the submodules it needs normally: ``nanovllm.engine.scheduler``
(which imports ``nanovllm.config``: ``transformers.AutoConfig``, importable on the CPU),
``nanovllm.engine.block_manager`` (``xxhash``, ``numpy``), ``nanovllm.engine.sequence`` and
``nanovllm.sampling_params``. Side effect: in this process ``import nanovllm`` then gives that empty
shell (no ``nanovllm.LLM``). If ``nanovllm`` is already imported (a machine where the whole package
imports), that module is used as it is.

The engine's limits and how the adapter handles each:

- ``Sequence.block_size`` is a class attribute (256), read by ``Sequence.num_blocks`` and
  ``Sequence.block``. Setting it would be global state shared by every adapter in the process, so each
  adapter instance defines its own subclass of ``Sequence`` whose class attribute is the config's
  ``block_size``; nothing global is changed. ``block_size`` must be at least 2:
  ``BlockManager.can_append`` / ``may_append`` detect "this token opens a new block" by
  ``len(seq) % block_size == 1``, never true for 1 (nano-vLLM's ``Config`` itself demands a multiple of
  256, for its flash-attn kernels; the scheduler and block manager work for any size >= 2).
- The engine's ``Config`` (``nanovllm/config.py``) needs a model folder; ``Scheduler.__init__`` reads
  only ``max_num_seqs``, ``max_num_batched_tokens``, ``eos``, ``num_kvcache_blocks`` and
  ``kvcache_block_size``, so the adapter passes an object with just those.
- Prefix caching is always on (``BlockManager.allocate`` looks every full block up by the hash of its
  tokens and prefix). Its cache differs from the one the spec models (:mod:`schedspec.spec.prefix_cache`,
  vLLM's): ``BlockManager.can_allocate`` asks for a free block for every block of the sequence, hits
  included, and ``deallocate`` drops a freed block's hash, so a block is shared only between requests
  live at once (nano-vllm-fork 20260210 ``nanovllm/engine/block_manager.py``). The adapter does not map
  that cache onto the spec's, so configs with ``enable_prefix_caching=true`` are refused (:class:`UnsupportedFeature`), and the adapter gives the
  engine its own prompt ids, unique to each request and position (request index * 2**32 + position +
  1), so no two requests ever have an equal block and no block is shared. Prefix groups of a workload
  are thereby remapped to distinct ids, which is exactly the spec's view with prefix caching off. The
  engine never reads prompt ids otherwise (the model runner, which would, is not run). Sampled tokens
  are appended unchanged (the end-of-sequence check reads them).
- A step is all-prefill or all-decode (``Scheduler.schedule``: the decode branch runs only when no
  prefill was scheduled), and there is no chunked prefill: each prefill computes the whole sequence.
  With ``enable_chunked_prefill=true`` such plans are still allowed by the spec (a chunk may be the
  whole prompt); the adapter accepts the config when that is honest, i.e. when every prompt fits one
  step (``max_num_batched_tokens >= max_model_len``) and ``long_prefill_token_threshold`` is 0 or at
  least ``max_model_len``; otherwise it refuses with :class:`UnsupportedFeature` (CLI exit 3): the
  engine cannot run those prompts at all.
- No abort: neither ``Scheduler`` nor ``LLMEngine`` can remove a sequence. Aborting a request the
  engine holds raises :class:`UnsupportedFeature`; aborting an id that already ended, or was never
  added, changes nothing (the protocol's rule).
- ``max_num_seqs`` caps each step's batch (both loops of ``Scheduler.schedule`` count ``num_seqs`` per
  step), not the running set: the engine admits up to ``max_num_seqs`` new prefills every step, so its
  running set can exceed ``max_num_seqs``, which the spec's ``sequence-cap`` rule reports. That is the
  engine's behaviour and is reported as it is, not hidden.
- No ``max_model_len`` stop and no request validation: ``Scheduler.postprocess`` ends a sequence only
  on end-of-sequence or ``max_tokens``, and ``LLMEngine.add_request`` checks nothing, while the model
  runner sizes its buffers by ``max_model_len`` (``model_runner.py`` ``_allocate_sample_buffers``), so
  a caller must keep sequences within it. The adapter plays that caller (the API server): it gives the
  engine ``max_tokens = min(max_tokens, max(1, max_model_len - prompt_len))`` (the step at which the
  spec ends the request with ``max_model_len``), and rejects, at arrival and without passing them to the
  engine, the requests vLLM's API server rejects (empty prompt, ``max_tokens < 1``, prompt longer than
  ``max_model_len``; ``vllm/v1/engine/processor.py``). A request that fits ``max_model_len`` but can
  never fit the KV cache is a scheduling matter and goes to the engine unchanged, which never rejects
  it (the spec's ``reject-only-impossible`` rule reports that).
- Every request must use the workload's end-of-sequence id (:data:`~schedspec.spec.workload.EOS_TOKEN_ID`,
  the engine has one global ``eos``) or none (``ignore_eos``); others are refused.

Engine crashes. Whatever the engine raises inside ``schedule`` or ``postprocess`` (an ``AssertionError``,
an ``IndexError`` from a corrupted queue) is re-raised as
:class:`~schedspec.reference.scheduler.EngineFault` naming the step, the engine function and the
innermost engine frame, so that callers report a finding instead of a traceback.

Protocol notes. nano-vLLM's ``schedule`` changes the engine (it allocates blocks and moves queues), so
the adapter calls it once per step and returns the same plan if ``schedule()`` is called again before
``update()``. :meth:`NanoVllmScheduler.engine_view` reads the engine's own queues and block tables;
between ``schedule()`` and ``update()`` it shows the engine mid-step.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import traceback
import types
from collections.abc import Mapping
from typing import Any

from schedspec.reference.scheduler import EngineFault, EngineView, UnsupportedFeature
from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request, printable
from schedspec.spec.state import ScheduledRequest, StepPlan
from schedspec.spec.workload import EOS_TOKEN_ID

DISTRIBUTION = "nano-vllm-fork"
VERSION = "20260210"
ENGINE = f"{DISTRIBUTION} {VERSION}"
"""The engine and version this adapter was written and checked against."""

_ID_STRIDE = 2**32
"""Prompt ids given to the engine: request index * _ID_STRIDE + position + 1 (unique, never EOS)."""


def load_engine() -> types.SimpleNamespace:
    """Import nano-vLLM's engine modules without running ``nanovllm/__init__.py`` (module docstring).

    Returns:
        A namespace with ``Scheduler``, ``Sequence``, ``SequenceStatus``, ``SamplingParams``.

    Raises:
        UnsupportedFeature: ``nano-vllm-fork`` is not installed, is another version than
            :data:`VERSION` (the conversions here were checked against that one), or its engine modules
            do not import (``xxhash`` or ``transformers`` missing).
    """
    try:
        installed = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedFeature(
            f"scheduler 'nanovllm' needs {DISTRIBUTION}=={VERSION}: "
            "pip install --no-deps -r engines/requirements-nanovllm.txt (scripts/test.sh does)"
        ) from None
    if installed != VERSION:
        raise UnsupportedFeature(f"scheduler 'nanovllm' was checked against {DISTRIBUTION}=={VERSION}, found {installed}")
    if "nanovllm" not in sys.modules:
        spec = importlib.util.find_spec("nanovllm")
        if spec is None or spec.submodule_search_locations is None:
            raise UnsupportedFeature(f"{DISTRIBUTION} is installed but its package 'nanovllm' cannot be found")
        shell = importlib.util.module_from_spec(spec)  # sets __path__; __init__.py is not executed
        sys.modules["nanovllm"] = shell
    try:
        scheduler = importlib.import_module("nanovllm.engine.scheduler")
        sequence = importlib.import_module("nanovllm.engine.sequence")
        sampling = importlib.import_module("nanovllm.sampling_params")
    except ImportError as error:
        raise UnsupportedFeature(
            f"scheduler 'nanovllm': cannot import nano-vLLM's engine modules ({error}); "
            "pip install --no-deps -r engines/requirements-nanovllm.txt"
        ) from None
    return types.SimpleNamespace(
        Scheduler=scheduler.Scheduler,
        Sequence=sequence.Sequence,
        SequenceStatus=sequence.SequenceStatus,
        SamplingParams=sampling.SamplingParams,
    )


def check_config(config: SchedulerConfig) -> None:
    """Refuse configs nano-vLLM cannot run as the spec means them (module docstring).

    Raises:
        UnsupportedFeature: speculative decoding, prefix caching or a per-step limit (``max_loras``, ...) on; ``block_size < 2``; chunked prefill on with a budget
            below ``max_model_len`` or a ``long_prefill_token_threshold`` below it.
    """
    if config.speculative:
        raise UnsupportedFeature(
            f"scheduler 'nanovllm': num_speculative_tokens={config.num_speculative_tokens}: nano-vLLM has no "
            "speculative decoding")
    if config.limits_on:
        raise UnsupportedFeature(f"scheduler 'nanovllm': {config.limits_on[0]}={getattr(config, config.limits_on[0])}: "
                                 "nano-vLLM has no such limit")
    if config.enable_prefix_caching:
        raise UnsupportedFeature(
            "scheduler 'nanovllm': its prefix caching is always on and is not the spec's (hits need free blocks, "
            "freed blocks leave the cache); "
            "the adapter runs it with distinct prompt ids per request, so set enable_prefix_caching=false"
        )
    if config.block_size < 2:
        raise UnsupportedFeature(
            f"scheduler 'nanovllm': block_size={config.block_size}; its BlockManager.may_append detects a new "
            "block by len % block_size == 1, so block_size must be >= 2"
        )
    if config.enable_chunked_prefill:
        threshold = config.long_prefill_token_threshold
        if config.max_num_batched_tokens < config.max_model_len:
            raise UnsupportedFeature(
                "scheduler 'nanovllm' has no chunked prefill: with enable_chunked_prefill=true it runs only if "
                f"every prompt fits one step, but max_num_batched_tokens={config.max_num_batched_tokens} < "
                f"max_model_len={config.max_model_len}; set enable_chunked_prefill=false (and a budget >= "
                "max_model_len)"
            )
        if 0 < threshold < config.max_model_len:
            raise UnsupportedFeature(
                f"scheduler 'nanovllm' has no chunked prefill: it cannot cap a prefill at "
                f"long_prefill_token_threshold={threshold}; set it to 0"
            )


def _frame(error: BaseException) -> str:
    """``file:line in function: source line`` of the innermost frame inside the ``nanovllm`` package."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        marker = frame.filename.replace("\\", "/").rfind("/nanovllm/")
        if marker >= 0:
            code = f": {frame.line}" if frame.line else ""
            return f"{frame.filename[marker + 1:]}:{frame.lineno} in {frame.name}{code}"
    return "outside nanovllm"


class NanoVllmScheduler:
    """nano-vLLM's scheduler as a :class:`~schedspec.reference.scheduler.Scheduler` (module docstring).

    Args:
        config: the spec's limits; ``block_size``, ``num_kv_blocks`` (the engine's
            ``num_kvcache_blocks``; its block ids are the spec's, 0 .. num_kv_blocks - 1, with no
            reserved block), ``max_num_batched_tokens`` and ``max_num_seqs`` are given to the engine.

    Raises:
        UnsupportedFeature: see :func:`check_config` and :func:`load_engine`.
    """

    name = "nanovllm"
    guarantees: frozenset[str] = frozenset()
    """nano-vLLM promises none of the spec's trace properties; every rule and invariant is still checked."""
    state = None

    def __init__(self, config: SchedulerConfig) -> None:
        check_config(config)
        self.config = config
        self._nano = load_engine()
        # Per-instance subclass: block_size without touching the global Sequence.block_size.
        self._sequence_class = type(
            "Sequence", (self._nano.Sequence,), {"block_size": config.block_size, "__module__": __name__}
        )
        engine_config = types.SimpleNamespace(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            eos=EOS_TOKEN_ID,
            num_kvcache_blocks=config.num_kv_blocks,
            kvcache_block_size=config.block_size,
        )
        self.engine = self._nano.Scheduler(engine_config)
        self._sequences: dict[str, Any] = {}  # live request id -> its Sequence in the engine
        self._request_ids: dict[int, str] = {}  # id(Sequence) -> request id
        self._front_end_rejected: dict[str, str] = {}  # request id -> reason, reported in the next plan
        self._pending: tuple[StepPlan, list[Any]] | None = None
        self._num_added = 0
        self._step = 0

    # ----------------------------------------------------------------------------- protocol
    def add_request(self, request: Request) -> None:
        """Give the request to the engine (``Scheduler.add``), or reject it at the front end.

        Raises:
            UnsupportedFeature: an end-of-sequence id other than the workload's; structured output
                (``grammar_ready_step``), which nano-vLLM lacks.
            ValueError: the id is live already.
        """
        request_id = request.request_id
        if request.grammar_ready_step is not None:
            raise UnsupportedFeature(f"scheduler 'nanovllm': request {printable(request_id)!r} has structured "
                                     "output (grammar_compile_steps): nano-vLLM has no grammar wait")
        if request_id in self._sequences or request_id in self._front_end_rejected:
            raise ValueError(f"request_id={request_id!r} is live already")
        prompt_len, max_tokens = request.prompt_len, request.max_tokens
        if prompt_len < 1 or max_tokens < 1 or prompt_len > self.config.max_model_len:
            reason = rejection_reason(prompt_len, max_tokens, self.config)
            assert reason is not None
            self._front_end_rejected[request_id] = reason
            return
        if request.eos_token_id not in (None, EOS_TOKEN_ID):
            raise UnsupportedFeature(
                f"scheduler 'nanovllm' has one end-of-sequence id for all requests ({EOS_TOKEN_ID}); "
                f"request {request_id!r} uses {request.eos_token_id}"
            )
        index = self._num_added
        self._num_added += 1
        base = index * _ID_STRIDE + 1
        params = self._nano.SamplingParams(
            max_tokens=min(max_tokens, max(1, self.config.max_model_len - prompt_len)),
            ignore_eos=request.eos_token_id is None,
        )
        sequence = self._sequence_class(list(range(base, base + prompt_len)), params)
        self._call("Scheduler.add", self.engine.add, sequence)
        self._sequences[request_id] = sequence
        self._request_ids[id(sequence)] = request_id

    def abort_request(self, request_id: str) -> None:
        """Abort: only for requests the engine does not hold (module docstring).

        Raises:
            UnsupportedFeature: the engine holds the request (nano-vLLM has no abort).
        """
        if request_id in self._front_end_rejected:
            del self._front_end_rejected[request_id]
            return
        if request_id in self._sequences:
            raise UnsupportedFeature(
                f"scheduler 'nanovllm' cannot abort {request_id!r}: nano-vLLM's Scheduler and LLMEngine have no "
                "abort (no way to remove a sequence and free its blocks)"
            )

    def schedule(self) -> StepPlan:
        """The engine's next batch (``Scheduler.schedule``) as a plan; the same plan again until
        :meth:`update`.

        Conversion: a prefill step schedules each sequence from ``num_cached_tokens`` (0: nothing is
        shared) for ``len(seq) - num_cached_tokens`` tokens, with its whole new block table; a decode
        step schedules each from ``len(seq) - 1`` for 1 token, with the block ``may_append`` added, if
        any; sequences that were running and came out ``WAITING`` were preempted, listed in the order
        ``Scheduler.preempt`` was called (it prepends to ``waiting``, so the reverse of their order
        there); front-end rejections are listed as rejected.

        Raises:
            EngineFault: the engine raised.
        """
        if self._pending is not None:
            return self._pending[0]
        step = self._step
        self._step += 1
        rejected = tuple(self._front_end_rejected.items())
        engine = self.engine
        if not engine.waiting and not engine.running:
            plan = StepPlan(rejected=rejected)  # Scheduler.schedule asserts it has work
            self._pending = (plan, [])
            return plan
        running = self._nano.SequenceStatus.RUNNING
        before = {id(seq): (seq.status, len(seq.block_table)) for seq in self._sequences.values()}
        sequences, is_prefill = self._call("Scheduler.schedule", engine.schedule, step=step)
        scheduled = []
        for seq in sequences:
            request_id = self._request_ids[id(seq)]
            old_blocks = before[id(seq)][1]
            if is_prefill:
                computed, tokens = seq.num_cached_tokens, len(seq) - seq.num_cached_tokens
            else:
                computed, tokens = len(seq) - 1, 1
            scheduled.append(ScheduledRequest(request_id, computed, tokens, tuple(seq.block_table[old_blocks:])))
        waiting_order = {}
        for position, seq in enumerate(engine.waiting):
            waiting_order.setdefault(id(seq), position)
        victims = [
            seq for seq in self._sequences.values()
            if before[id(seq)][0] is running and seq.status is not running and not seq.is_finished
        ]
        victims.sort(key=lambda seq: -waiting_order.get(id(seq), -1))
        plan = StepPlan(
            scheduled=tuple(scheduled),
            preempted=tuple(self._request_ids[id(seq)] for seq in victims),
            rejected=rejected,
        )
        self._pending = (plan, list(sequences))
        return plan

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int]) -> tuple[str, ...]:
        """Feed the sampled tokens back (``Scheduler.postprocess``); returns the ids that finished.

        Raises:
            RuntimeError: no plan is pending, or ``plan`` is not the one :meth:`schedule` returned.
            ValueError: a scheduled request has no sampled token (every nano-vLLM step samples for
                every sequence in the batch).
            EngineFault: the engine raised.
        """
        if self._pending is None or plan is not self._pending[0] and plan != self._pending[0]:
            raise RuntimeError("update() must be given the plan the last schedule() returned")
        _, sequences = self._pending
        self._pending = None
        for request_id, _ in plan.rejected:
            self._front_end_rejected.pop(request_id, None)
        tokens = []
        for seq in sequences:
            request_id = self._request_ids[id(seq)]
            if request_id not in sampled_token_ids:
                raise ValueError(f"no sampled token for {request_id!r}: nano-vLLM samples for every sequence it ran")
            tokens.append(int(sampled_token_ids[request_id]))
        if sequences:
            self._call("Scheduler.postprocess", self.engine.postprocess, sequences, tokens, step=self._step - 1)
        finished = []
        for seq in sequences:
            if seq.is_finished:
                request_id = self._request_ids.pop(id(seq))
                self._sequences.pop(request_id, None)
                finished.append(request_id)
        return tuple(dict.fromkeys(finished))

    def engine_view(self) -> EngineView:
        """The engine's own bookkeeping in the spec's terms.

        ``num_free_blocks``: ``len(BlockManager.free_block_ids)``. ``waiting`` / ``running``: the ids in
        the engine's ``waiting`` / ``running`` deques in order, duplicates kept (nano-vLLM can hold a
        sequence twice, see docs/findings), with front-end rejections not yet reported appended to
        ``waiting``. ``block_tables``: each sequence's ``block_table`` (block ids are the spec's).
        ``num_computed_tokens``: nano-vLLM keeps no such count; a sequence with blocks that is
        ``RUNNING`` has computed all its tokens but the last sampled one (``len(seq) - 1``), any
        other has computed ``num_cached_tokens`` (0 here).
        """
        running = self._nano.SequenceStatus.RUNNING

        def label(seq: Any) -> str:
            return self._request_ids.get(id(seq), f"<nano seq {seq.seq_id}>")

        computed = {}
        tables = {}
        for request_id, seq in self._sequences.items():
            if seq.status is running and seq.block_table:
                computed[request_id] = len(seq) - 1
            else:
                computed[request_id] = seq.num_cached_tokens
            if seq.block_table:
                tables[request_id] = tuple(seq.block_table)
        for request_id in self._front_end_rejected:
            computed[request_id] = 0
        return EngineView(
            num_free_blocks=len(self.engine.block_manager.free_block_ids),
            waiting=tuple(label(seq) for seq in self.engine.waiting) + tuple(self._front_end_rejected),
            running=tuple(label(seq) for seq in self.engine.running),
            block_tables=tables,
            num_computed_tokens=computed,
        )

    # ------------------------------------------------------------------------------ helpers
    def _call(self, operation: str, function: Any, *args: Any, step: int | None = None) -> Any:
        try:
            return function(*args)
        except Exception as error:  # the engine's own failure: report it as a finding
            raise EngineFault(ENGINE, operation, step, _frame(error), f"{type(error).__name__}: {error}") from error


def factory(config: SchedulerConfig) -> NanoVllmScheduler:
    """``--scheduler nanovllm`` (also ``schedspec.engines.nanovllm:factory``)."""
    return NanoVllmScheduler(config)
