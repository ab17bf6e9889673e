"""SGLang 0.5.23's scheduling layer run standalone, no model, in SGLang's own environment: the worker
half of the ``sglang`` adapter (:mod:`schedspec.engines.sglang` is the other half).

This file is run as a script by the Python of the SGLang environment (``.venv-sglang``, made by
``scripts/engines_setup.sh`` from ``engines/requirements-sglang.txt``); it imports only the standard
library, ``torch``, ``transformers`` and ``sglang``, never ``schedspec``. It speaks the JSON Lines
protocol of ``worker_pipe.py`` (beside this file, shared with ``vllm_worker.py``).

``--check`` (used by ``scripts/engines_setup.sh``): import the scheduling modules, print one line
``ENGINES SETUP: OK sglang ...`` naming the ``torchvision`` modules the stub answered, and exit.

Without arguments (the ``sglang`` adapter, ``engines/sglang.py``): serve the commands ``init``, ``add``,
``abort``, ``schedule``, ``update``, ``view``, ``probe`` (``--probe``'s cases) and ``close`` over the pipe (:class:`Engine`; replies in SGLang's
page numbering mapped to spec blocks, ``p - 1``). *Step loop*: ``schedule`` is SGLang's own
``Scheduler.get_next_batch_to_run`` on a headless ``Scheduler`` (:func:`_headless_scheduler`: what is set and
what is a stand-in, and why, is listed there and in the adapter's module docstring); ``update`` passes the
sampled tokens to SGLang's own ``SchedulerBatchResultProcessor.process_batch_result_prefill`` / ``_decode``.

``--probe CASES_JSON`` (a list of ``{"config", "requests"}``, one output line each; ``tests/test_engine_sglang.py``
sends the same cases to the serving worker's ``probe`` command): build SGLang's scheduling components
for a schedspec config (:class:`Components`), admit the given requests through SGLang's own
``SchedulePolicy.calc_priority``, ``PrefillAdder.add_one_req``, ``ScheduleBatch.init_new`` and
``prepare_for_extend`` (which allocates the pages), and print one JSON line: what was admitted, the
chunked request, the pages each row holds and the allocator's free tokens (the admission pass alone,
without the arrival path's clipping of ``max_new_tokens``).

**What is replaced: torchvision** (:func:`install_torchvision_stub`). The torchvision builds pip picks
(0.28.0 for torch 2.13) do not load beside torch 2.13.0+cpu (``import torchvision`` fails with
"operator torchvision::nms does not exist"), and a plain stub module is not enough: sglang's configs
import names from it at module level. So the worker puts an import hook first on ``sys.meta_path``
that answers every ``torchvision`` and ``torchvision.*`` import with an empty module whose every
attribute is a placeholder that raises if called. Who imports it, on the path of the scheduling
modules: ``sglang/srt/managers/schedule_policy.py`` -> ``sglang/srt/dllm/config.py`` ->
``sglang/srt/configs/__init__.py``, which imports every model config, among them
``configs/nano_nemotron_vl.py`` -> ``multimodal/internvl_utils.py`` (``import
torchvision.transforms as T``, used only by ``build_transform``, image preprocessing of InternVL) and
``configs/deepseek_ocr.py`` (``from torchvision.transforms import InterpolationMode`` and
``functional``, used only by its image processor). Why the scheduling path never calls it: those
names are used only to preprocess images of multimodal models; the adapter's requests are token ids,
no model config is built and no processor runs, so no placeholder is ever called (one that were would
raise, never decide silently). The hook is installed only after transformers'
``is_torchvision_available()`` has been called once (it is ``lru_cache``-d), so transformers keeps
seeing torchvision as absent and takes none of its torchvision paths.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

# This file sits beside the adapter ``sglang.py``; as a script its folder is sys.path[0], where
# ``import sglang`` would find the adapter instead of the engine.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PREEMPTION_THRESHOLD = 0
"""``--priority-scheduling-preemption-threshold`` of the ``sglang-priority`` adapter: a waiting request preempts a
running one whose priority value is greater by more than this (``PrefillAdder.preempt_to_schedule``). SGLang's
default is 10; the spec's scenarios draw priorities 0..3, under which 10 would never preempt."""

SCHEDULING_MODULES = (
    "sglang.srt.managers.schedule_policy",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.scheduler_components.new_token_ratio_tracker",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.allocator",
)
"""The modules the adapter drives; ``--check`` imports them."""


class _Placeholder:
    """A ``torchvision`` name that exists but does nothing: any attribute is another placeholder,
    calling it raises (module docstring)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{self._name} called: torchvision is replaced by an empty stub in the schedspec "
                           "SGLang worker (engines/sglang_worker.py); the scheduling path must not use it")


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``torchvision`` and ``torchvision.*`` with empty modules; records what it answered."""

    def __init__(self) -> None:
        self.answered: list[str] = []

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001  (importlib's signature)
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: ANN001
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr, _name=spec.name: _Placeholder(f"{_name}.{attr}")  # type: ignore[attr-defined]
        self.answered.append(spec.name)
        return module

    def exec_module(self, module) -> None:  # noqa: ANN001
        pass


def install_torchvision_stub() -> _TorchvisionStub:
    """Ask transformers once whether torchvision is available (cached: it stays "no"), then answer
    every ``torchvision*`` import with an empty module (module docstring). Returns the hook.

    Raises:
        RuntimeError: a real torchvision is importable (the environment is not the pinned one).
    """
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():
        raise RuntimeError("a real torchvision is installed in the SGLang environment; "
                           "engines/requirements-sglang.txt leaves it out (run scripts/engines_setup.sh --force)")
    stub = _TorchvisionStub()
    sys.meta_path.insert(0, stub)
    return stub


class Components:
    """SGLang 0.5.23's scheduling components for one schedspec config, built as
    ``Scheduler.init_memory_pools`` / ``init_cache`` would on one CPU rank with no model:

    - ``ServerArgs`` published to the runtime context (``sglang/srt/runtime_context.py``
      ``RuntimeContext.set_server_args``: ``get_schedule()`` is what ``NewTokenRatioTracker.from_config``,
      ``retract_decode`` and ``preempt_to_schedule`` read), with ``page_size = block_size``,
      ``max_running_requests = max_num_seqs``, ``chunked_prefill_size = max_num_batched_tokens`` (or -1
      when chunked prefill is off) and ``max_prefill_tokens = max_num_batched_tokens``;
    - ``ReqToTokenPool(size=max_num_seqs, max_context_len=max_model_len + 4)`` (``mem_cache/memory_pool.py``);
    - ``MHATokenToKVPool`` with one layer, one head of dimension 1 (the KV tensors are never read) and
      ``PagedTokenToKVPoolAllocator(size=num_kv_blocks * block_size, page_size=block_size)``
      (``mem_cache/allocator/paged.py``): pages ``1..num_kv_blocks`` (page 0 is padding), SGLang page
      ``p`` is spec block ``p - 1``;
    - ``RadixCache`` (``mem_cache/radix_cache.py``) with ``disable = not enable_prefix_caching``;
    - ``SchedulePolicy(policy, ...)`` and ``NewTokenRatioTracker.from_config()``;
    - with ``priority`` (the ``sglang-priority`` adapter): ``enable_priority_scheduling``,
      ``schedule_low_priority_values_first`` (a lower value is more urgent, the spec's convention) and
      ``priority_scheduling_preemption_threshold =`` :data:`PREEMPTION_THRESHOLD`, which ``preempt_to_schedule``
      reads from ``get_schedule()``; the headless scheduler's ``enable_priority_preemption`` follows.
    """

    def __init__(self, config: dict, policy: str = "fcfs", priority: bool = False) -> None:
        self.priority = priority
        import torch
        from sglang.srt.managers.schedule_policy import SchedulePolicy
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.runtime_context import get_context
        from sglang.srt.server_args import ServerArgs

        self.page_size = config["block_size"]
        self.num_tokens = config["num_kv_blocks"] * self.page_size
        self.max_running_requests = config["max_num_seqs"]
        self.chunked_prefill_size = config["max_num_batched_tokens"] if config["enable_chunked_prefill"] else None
        self.max_prefill_tokens = config["max_num_batched_tokens"]
        server_args = ServerArgs(
            model_path="/schedspec-no-model", device="cpu", page_size=self.page_size,
            max_running_requests=self.max_running_requests,
            chunked_prefill_size=self.chunked_prefill_size or -1, max_prefill_tokens=self.max_prefill_tokens,
            schedule_policy=policy, skip_tokenizer_init=True,
            disable_radix_cache=not config.get("enable_prefix_caching", False),
            # priority scheduling in the spec's convention (a lower value is more urgent), with a request
            # preempting any running one of a strictly greater value (SGLang's default threshold is 10)
            enable_priority_scheduling=priority, schedule_low_priority_values_first=priority,
            priority_scheduling_preemption_threshold=PREEMPTION_THRESHOLD if priority else 10,
        )
        get_context().set_server_args(server_args)
        self.req_to_token_pool = ReqToTokenPool(size=self.max_running_requests,
                                                max_context_len=config["max_model_len"] + 4, device="cpu",
                                                enable_memory_saver=False)
        self.kv_pool = MHATokenToKVPool(size=self.num_tokens, page_size=self.page_size, dtype=torch.float32,
                                        head_num=1, head_dim=1, layer_num=1, device="cpu",
                                        enable_memory_saver=False, enable_alt_stream=False)
        self.allocator = PagedTokenToKVPoolAllocator(size=self.num_tokens, page_size=self.page_size,
                                                     dtype=torch.float32, device="cpu", kvcache=self.kv_pool,
                                                     need_sort=False)
        self.tree_cache = RadixCache(CacheInitParams(
            disable=not config.get("enable_prefix_caching", False), req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator, page_size=self.page_size))
        self.policy = SchedulePolicy(policy, self.tree_cache, False, priority, priority)
        self.new_token_ratio = NewTokenRatioTracker.from_config()

    def request(self, message: dict):
        """An SGLang ``Req`` for a spec request: its token ids, ``max_new_tokens = max_tokens``,
        ``stop_token_ids``, and ``ignore_eos`` when it has neither an end-of-sequence id nor a stop id
        (``Req._check_token_based_finish`` skips the stop ids too under ``ignore_eos``; without a tokenizer no
        other id stops it). ``min_tokens`` is not set as ``min_new_tokens``: only the sampler's penalizer
        reads it (``penaltylib/min_new_tokens.py``, which needs a tokenizer: ``normalize`` refuses it without
        one, ``raise_if_tokenizer_required``), and the scheduler only clips it to ``max_new_tokens``
        (``Scheduler.init_req_max_new_tokens``); the stop check ignores it, as the adapter's
        ``StopBeforeMinTokens`` accounts for."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        eos = message.get("eos")
        stop_ids = message.get("stop_token_ids") or None
        params = SamplingParams(max_new_tokens=message["max_tokens"], ignore_eos=eos is None and not stop_ids,
                                stop_token_ids=stop_ids)
        params.normalize(None)
        return Req(message["id"], "", array("q", message["prompt"]), params,
                   eos_token_ids=None if eos is None else {eos}, vocab_size=message.get("vocab_size", 32000),
                   priority=message.get("priority"))

    def cached_pages(self, token_ids) -> list[int]:
        """The pages the radix tree holds for the page-aligned prefix of ``token_ids``, read without touching
        the tree (``RadixCache._match_prefix_helper`` walked by hand: it would split a node and stamp access
        times, which decide SGLang's eviction order)."""
        from array import array

        from sglang.srt.mem_cache.radix_cache import RadixKey

        size = self.page_size
        key = RadixKey(array("q", token_ids)).page_aligned(size)  # the tree's keys hold arrays (RadixKey.match)
        node, slots = self.tree_cache.root_node, []
        while len(key) and key.child_key(size) in node.children:
            child = node.children[key.child_key(size)]
            matched = child.key.match(key, page_size=size)
            slots += child.value[:matched].tolist()
            if matched < len(child.key):
                break
            node, key = child, key[matched:]
        return [slot // size for slot in slots[::size]]

    def pages(self, req, length: int | None = None) -> list[int]:
        """The pages of the first ``length`` tokens (default ``req.extend_end``, its allocated tokens) of
        ``req``'s row of the request-to-token pool, in order; none for a request without a row."""
        length = req.extend_end if length is None else length
        if req.kv.req_pool_idx is None or length <= 0:
            return []
        slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx][:length].tolist()
        return list(dict.fromkeys(slot // self.page_size for slot in slots))


class _Record:
    """A stand-in for a component of a feature the adapter keeps off (grammar, DP attention, n-gram
    embedding, beam search, metrics, load reporting, the output stream): every method is a no-op that
    returns its first argument (the batch, for the DP-attention and n-gram passes) or ``None``/``False``;
    what is sent out (``send_abort_output``) is recorded instead. Module docstring, *What is replaced*."""

    def __init__(self, name: str, **fields) -> None:
        self._name = name
        self.__dict__.update(fields)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def call(*args, **kwargs):
            return args[0] if args and attr.startswith(("maybe_", "prepare_for_forward")) else None

        return call


def _headless_scheduler(parts: Components):
    """SGLang's own ``Scheduler`` (``sglang/srt/managers/scheduler.py``) without its ``__init__`` (which
    starts a model worker, sockets and the tokenizer): ``object.__new__`` of a subclass that records
    retractions and engine aborts, with the attributes its ``init_*`` methods would set for one CPU rank
    with every optional feature off (module docstring, *What is replaced*)."""
    from collections import deque

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    class HeadlessScheduler(Scheduler):
        def __getattr__(self, name):  # only reached for an attribute the adapter did not set
            raise AttributeError(f"schedspec's headless SGLang Scheduler has no attribute {name!r} "
                                 "(engines/sglang_worker.py _headless_scheduler)")

        def _add_request_to_queue(self, req, is_retracted: bool = False):
            # retract_decode passes is_retracted; a request PrefillAdder.preempt_to_schedule released for a
            # more urgent one is re-queued without it, but Req.reset_for_retract has set req.is_retracted
            # (cleared only by ScheduleBatch.prepare_for_extend, at its re-admission)
            if is_retracted or req.is_retracted:
                self.retracted.append(req.rid)
            return super()._add_request_to_queue(req, is_retracted)

        def send_abort_output(self, abort_req, req) -> None:
            self.engine_aborted.append([req.rid, str(getattr(req.to_finish, "message", req.to_finish))])

    class _ModelConfig:  # the fields ScheduleBatch.init_new and the result processor read
        vocab_size = 32000
        is_encoder_decoder = False
        hf_eos_token_id = None
        is_multimodal = False
        self_opened_think_start_ids = None  # no reasoning parser
        think_end_ids = None

    from sglang.srt.runtime_context import get_context, get_parallel, get_schedule

    if not get_parallel().pp_max_micro_batch_size:  # as Scheduler.init_model_worker does (one pipeline stage)
        get_context().override("scheduler.pp_max_micro_batch_size_default",
                               pp_max_micro_batch_size=max(parts.max_running_requests, 1))
    s = object.__new__(HeadlessScheduler)
    s.__dict__.update(
        # __init__'s "Parse args" block and init_model_config
        server_args=None, schedule_policy=parts.policy.policy,
        abort_on_priority_when_disabled=get_schedule().abort_on_priority_when_disabled,
        schedule_low_priority_values_first=get_schedule().schedule_low_priority_values_first, enable_priority_scheduling=parts.priority,
        priority_scheduling_preemption_threshold=get_schedule().priority_scheduling_preemption_threshold,
        enable_lora=False, enable_overlap=False,
        spec_algorithm=SpeculativeAlgorithm.NONE, page_size=parts.page_size, enable_hierarchical_cache=False,
        enable_lmcache=False, enable_hicache_storage=False, enable_unified_cache_external_linker=False,
        enable_hisparse=False, model_config=_ModelConfig(), is_generation=True,
        disaggregation_mode=DisaggregationMode.NULL, dllm_config=None, is_hybrid_swa=False,
        # kv_cache_builder.build_kv_cache
        req_to_token_pool=parts.req_to_token_pool, token_to_kv_pool_allocator=parts.allocator,
        tree_cache=parts.tree_cache, decode_offload_manager=None, hisparse_coordinator=None,
        # init_running_status
        waiting_queue=[], running_batch=ScheduleBatch(reqs=[], batch_is_full=False), last_batch=None,
        result_queue=deque(), enable_skip_finishing_decode=False, forward_ct=0, processed_tokens_counter=0,
        # init_chunked_prefill, maybe_init_dynamic_chunk_sizer
        chunked_prefill_size=parts.chunked_prefill_size, prefill_decode_interval=0,
        _prefill_decode_interval_remaining=0, prefill_decode_interval_min_bs=0, chunked_req=None,
        _pending_chunked_abort_req=None, is_mixed_chunk=False, dynamic_chunk_sizer=None,
        # init_schedule_policy
        policy=parts.policy, prefill_delayer=None, max_prefill_bs=0,
        enable_priority_preemption=parts.priority, new_token_ratio_tracker=parts.new_token_ratio,
        max_prefill_tokens=parts.max_prefill_tokens, max_running_requests=parts.max_running_requests,
        min_free_slots_delayer=None, truncation_align_size=None, require_mlp_sync=False,
        max_queued_requests=None,
        # components of features kept off (_Record)
        scheduler_stage_metrics=None,
        grammar_manager=_Record("grammar_manager", has_waiting_grammars=lambda: False),
        dp_attn_adapter=_Record("dp_attn_adapter", maybe_prepare_mlp_sync_batch=lambda batch, **kw: batch,
                                maybe_convert_decode_to_extend=lambda batch: batch),
        ngram_embedding_manager=_Record("ngram_embedding_manager", prepare_for_forward=lambda batch, **kw: batch),
        beam_coordinator=_Record("beam_coordinator", pending_member_rows=lambda batch: 0),
        metrics_reporter=_Record("metrics_reporter", enable_metrics=False, num_retracted_reqs=0,
                                 num_generated_tokens=0, forward_ct_decode=0),
        load_inquirer=_Record("load_inquirer", _get_num_pending_tokens=lambda **kw: 0),
        tp_worker=_Record("tp_worker", model_runner=_Record("model_runner", attn_backend=None,
                                                              prefill_aware_swa=False)),
        retracted=[], engine_aborted=[],
    )
    return s


class Engine:
    """One headless SGLang scheduler driven step by step over the pipe (module docstring, *Step loop*).

    Commands (``worker_pipe.serve``): ``add``, ``abort``, ``schedule``, ``update``, ``view``, ``probe``."""

    def __init__(self, config: dict, policy: str, priority: bool = False) -> None:
        import torch  # noqa: F401
        from sglang.srt.managers.scheduler_components.batch_result_processor import (
            SchedulerBatchResultProcessor,
        )
        from sglang.srt.managers.scheduler_components.logprob_result_processor import (
            SchedulerLogprobResultProcessor,
        )

        self.parts = Components(config, policy, priority)
        self.scheduler = s = _headless_scheduler(self.parts)
        # Scheduler.init_model_worker, from the model worker's get_worker_info (managers/tp_worker.py):
        # max_req_len = min(context_len - 1, kv_capacity - 1), max_req_input_len = max_req_len - 5.
        s.max_total_num_tokens = self.parts.num_tokens
        s.max_req_len = min(config["max_model_len"] - 1, self.parts.num_tokens - 1)
        s.max_req_input_len = s.max_req_len - 5
        s.max_new_tokens_limit = None  # SGLANG_MAX_NEW_TOKENS_LIMIT unset
        s.sliding_window_size = None
        s.batch_result_processor = SchedulerBatchResultProcessor(
            is_generation=True, disaggregation_mode=s.disaggregation_mode, enable_overlap=False,
            enable_overlap_mlx=False, model_config=s.model_config, token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
            tree_cache=s.tree_cache, hisparse_coordinator=None, req_to_token_pool=s.req_to_token_pool,
            decode_offload_manager=None, metrics_collector=None, metrics_reporter=s.metrics_reporter,
            draft_worker=None, model_worker=None,
            logprob_result_processor=SchedulerLogprobResultProcessor(model_config=s.model_config),
            output_streamer=_Record("output_streamer"), beam_coordinator=s.beam_coordinator,
            abort_request=None)
        self.batch = None  # the batch schedule() chose, until update()
        self.requests: dict = {}  # rid -> Req, every live request
        self.pages: dict[str, list[int]] = {}  # rid -> the pages it held after the last step
        self.lengths: dict[str, int] = {}  # rid -> its tokens with pages after the last step it was scheduled in

    def add(self, message: dict) -> None:
        """What ``Scheduler.handle_generate_request`` does for a plain token-id request: build the
        ``Req``, ``init_req_max_new_tokens`` (clips ``max_new_tokens`` to ``max_req_len`` and the pool),
        ``validate_input_length``; then ``_add_request_to_queue``. A request either check refuses is
        reported by the next ``schedule`` as ``rejected`` and never queued."""
        from sglang.srt.managers.utils import validate_input_length

        req = self.parts.request(message)
        s = self.scheduler
        s.init_req_max_new_tokens(req)
        error = validate_input_length(req, s.max_req_input_len, False)
        if req.to_finish is not None or error:
            self.rejected.append([req.rid, error or str(getattr(req.to_finish, "message", req.to_finish))])
            return
        self.requests[req.rid] = req
        s._add_request_to_queue(req)

    rejected: list

    def abort(self, message: dict) -> None:
        """A waiting request leaves the queue (``Scheduler.abort_request``'s waiting-queue branch);
        the adapter refuses to abort an admitted one (module docstring)."""
        req = self.requests.pop(message["id"], None)
        if req is not None:
            self.scheduler.waiting_queue.remove(req)
            self.scheduler._release_aborted_request(req)

    def schedule(self, message: dict) -> dict:
        """``Scheduler.get_next_batch_to_run`` as the normal event loop calls it (``event_loop_normal``)."""
        s = self.scheduler
        if self.batch is not None:
            raise RuntimeError("schedule with a step in flight")
        s.retracted, s.engine_aborted = [], []
        rejected, self.rejected = self.rejected, []
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = self.batch = plan.batch_to_run
        if batch is None and s.running_batch.is_empty() and not s.waiting_queue and s.chunked_req is None:
            # event_loop_normal calls on_idle() when no batch runs; fully idle (is_fully_idle: nothing running,
            # waiting or chunked, no last batch on the loop's next spin) it resets the new-token ratio
            s.new_token_ratio_tracker.reset()
        for rid in s.retracted:
            self.pages[rid] = []
        scheduled = []
        if batch is not None and extend_with_cache(batch, self.parts) and s.chunked_req is not None:
            # SGLang inserts a middle chunk only in the next get_next_batch_to_run (stash_chunked_request), after
            # the step that computed it: not mapped yet (engines/sglang.py, docs/engines.md, The radix cache)
            return {"refused": "a chunked prefill with prefix caching (its middle chunks are inserted into the radix "
                               "tree a step late: not mapped yet)"}
        inserted: dict[tuple, int] = {}  # SGLang's publication: page-aligned prefix -> the page an earlier item inserts
        if batch is not None:
            extend = batch.forward_mode.is_extend()
            for i, req in enumerate(batch.reqs):
                if extend:
                    computed, count = batch.prefix_lens[i], batch.extend_lens[i]
                else:
                    computed, count = int(batch.seq_lens_cpu[i]) - 1, 1
                held = self.pages.get(req.rid, [])
                now = self.parts.pages(req, computed + count)
                hit = [] if req.rid in self.pages and held else now[: computed // self.parts.page_size]
                new = [p for p in now if p not in held and p not in hit]
                pairs = self.deduplications(req, now, computed + count, inserted) if extend_with_cache(batch, self.parts) else []
                scheduled.append([req.rid, computed, count, [p - 1 for p in new], [p - 1 for p in hit], pairs])
                self.pages[req.rid] = now
                self.lengths[req.rid] = computed + count
        return {"scheduled": scheduled, "preempted": list(s.retracted), "rejected": rejected,
                "engine_aborted": list(s.engine_aborted), "mode": None if batch is None else str(batch.forward_mode)}

    def deduplications(self, req, row: list[int], end: int, inserted: dict[tuple, int]) -> list[list[int]]:
        """The ``[own, cached]`` block pairs SGLang's checkpoint after this prefill chunk will make
        (``RadixCache.checkpoint`` -> ``_insert_cache``: ``free_segment`` of the row's pages the tree already holds,
        ``req_to_token_pool.write`` of the tree's pages into the row), predicted before it runs, as the spec's plan
        names them: for each full page of ``req``'s first ``end`` tokens, the tree's page (or the page an earlier
        item of the batch inserts, ``inserted``) where it is not the row's own. Records this item's pages in
        ``inserted`` for the later items."""
        size = self.parts.page_size
        tokens = list(req.full_untruncated_fill_ids[:end])
        cached = self.parts.cached_pages(tokens)
        pairs = []
        for index in range(end // size):
            prefix = tuple(tokens[: (index + 1) * size])
            target = cached[index] if index < len(cached) else inserted.get(prefix)
            if target is None:
                inserted[prefix] = row[index]
                continue
            if target != row[index]:
                pairs.append([row[index] - 1, target - 1])
        return pairs

    def update(self, message: dict) -> dict:
        """The model worker's sampled tokens (``GenerationBatchResult.next_token_ids``) through
        ``SchedulerBatchResultProcessor.process_batch_result_prefill`` / ``_decode``, as
        ``Scheduler.process_batch_result`` dispatches them; then ``last_batch`` as the event loop sets it."""
        import torch
        from sglang.srt.managers.utils import GenerationBatchResult

        s, batch, self.batch = self.scheduler, self.batch, None
        finished = []
        if batch is not None:
            sampled = message["sampled"]
            tokens = torch.tensor([self._token_of(req, sampled, batch.forward_mode.is_decode()) for req in batch.reqs],
                                  dtype=torch.int64)
            result = GenerationBatchResult(next_token_ids=tokens)
            if batch.forward_mode.is_decode():
                s.batch_result_processor.process_batch_result_decode(batch, result)
            else:
                s.batch_result_processor.process_batch_result_prefill(batch, result)
            for req in batch.reqs:
                if not req.finished() and req.rid in self.lengths:  # a checkpoint may have rewritten its row
                    self.pages[req.rid] = self.parts.pages(req, self.lengths[req.rid])
                if req.finished() and req.rid in self.requests:
                    finished.append([req.rid, req.finished_reason.to_json()["type"]])  # stop, length, abort
                    del self.requests[req.rid]
                    self.pages.pop(req.rid, None)
                    self.lengths.pop(req.rid, None)
        s.last_batch = batch
        return {"finished": finished}

    @staticmethod
    def _token_of(req, sampled: dict, decode: bool) -> int:
        """The token of ``req`` in ``next_token_ids``: the sampled one, or 0 for a row whose token SGLang
        drops (``process_batch_result_prefill`` / ``_decode``: a finished or retracted request, a middle chunk
        of a prefill, ``inflight_middle_chunks > 0``).

        Raises:
            RuntimeError: the spec sampled nothing for a row whose token SGLang appends (a protocol error:
                no token is invented)."""
        if req.rid in sampled:
            return int(sampled[req.rid])
        if req.finished() or req.is_retracted or (not decode and req.inflight_middle_chunks > 0):
            return 0
        raise RuntimeError(f"update: no sampled token for request {req.rid!r}, whose token SGLang appends")

    @staticmethod
    def probe(message: dict) -> dict:
        """``--probe`` over the pipe (``{"cases": [{"config", "requests"}, ...]}``: one result each, on fresh
        components of their own, not this engine's), so that the probe tests share the adapter's worker."""
        return {"cases": [probe(case["config"], case["requests"]) for case in message["cases"]]}

    def view(self, message: dict) -> dict:
        """SGLang's own bookkeeping: the allocator's free tokens, the waiting queue, the running batch
        (and the chunked request), each live request's pages and computed tokens."""
        s = self.scheduler
        running = [r.rid for r in s.running_batch.reqs if not r.finished()]
        if s.chunked_req is not None and s.chunked_req.rid not in running:
            running.append(s.chunked_req.rid)
        if s.last_batch is not None and s.last_batch.forward_mode.is_extend():
            running += [r.rid for r in s.last_batch.reqs if not r.finished() and r.rid not in running]
        computed = {rid: 0 for rid, _ in self.rejected}
        for rid, req in self.requests.items():
            computed[rid] = 0 if req in s.waiting_queue else len(req.origin_input_ids) + len(req.output_ids) - 1
        if s.chunked_req is not None:
            computed[s.chunked_req.rid] = s.chunked_req.extend_end
        return {
            "num_free_tokens": self.parts.allocator.available_size() + self.parts.tree_cache.evictable_size(),
            "waiting": [r.rid for r in s.waiting_queue] + [rid for rid, _ in self.rejected],
            "running": running,
            "block_tables": {rid: [p - 1 for p in pages] for rid, pages in self.pages.items() if pages},
            "num_computed_tokens": computed,
            "new_token_ratio": s.new_token_ratio_tracker.current,
        }


_STUB: _TorchvisionStub | None = None
"""The serving worker's torchvision hook (``__main__``), for the ``check`` line of each ``init`` reply."""


def extend_with_cache(batch, parts: Components) -> bool:
    """Whether ``batch`` is a prefill (extend) batch with the radix cache on: its chunks are inserted into the
    tree after the step (``checkpoint_kv_cache``)."""
    return batch.forward_mode.is_extend() and not parts.tree_cache.disable


def _build(message: dict):
    import sglang

    engine = Engine(message["config"], message["policy"], message.get("priority", False))
    engine.rejected = []
    return engine, {"sglang_version": sglang.__version__, "sglang_file": sglang.__file__,
                    "check": check_line(_STUB)}


def probe(config: dict, requests: list[dict]) -> dict:
    """``--probe``: one prefill pass through SGLang's own admission and allocation (module docstring)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    parts = Components(config)
    waiting = [parts.request(message) for message in requests]
    running = ScheduleBatch(reqs=[], batch_is_full=False)
    parts.policy.calc_priority(waiting, running)
    adder = PrefillAdder(parts.page_size, parts.tree_cache, parts.allocator, running, parts.new_token_ratio.current,
                         parts.max_prefill_tokens, parts.chunked_prefill_size, 0, 0,
                         max_running_requests=parts.max_running_requests)
    results = []
    for req in waiting:
        req.init_next_round_input(parts.tree_cache)
        result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        results.append(result.name)
        if result != AddReqResult.CONTINUE:
            break

    class _ModelConfig:  # the fields ScheduleBatch.init_new reads of the model config
        vocab_size = requests[0].get("vocab_size", 32000) if requests else 32000
        is_encoder_decoder = False
        hf_eos_token_id = None

    admitted = adder.can_run_list
    if admitted:
        batch = ScheduleBatch.init_new(admitted, parts.req_to_token_pool, parts.allocator, parts.tree_cache,
                                       _ModelConfig(), False, SpeculativeAlgorithm.NONE,
                                       chunked_req=adder.new_chunked_req)
        batch.prepare_for_extend()
    return {
        "results": results,
        "admitted": [[req.rid, req.prefix_len, req.extend_end, parts.pages(req)] for req in admitted],
        "chunked": adder.new_chunked_req.rid if adder.new_chunked_req is not None else None,
        "num_free_tokens": parts.allocator.available_size(),
        "new_token_ratio": [parts.new_token_ratio.init, parts.new_token_ratio.min, parts.new_token_ratio.decay],
    }


def check_line(stub: _TorchvisionStub) -> str:
    """Import the scheduling modules; the OK line of ``--check`` (module docstring), also sent in the serving
    worker's ``init`` reply (``check``) so that a test of the environment needs no second import of sglang."""
    import importlib

    for name in SCHEDULING_MODULES:
        importlib.import_module(name)
    import sglang
    import torch

    return (f"ENGINES SETUP: OK sglang {sglang.__version__}, torch {torch.__version__}, python "
            f"{sys.version.split()[0]}, {sys.prefix}; torchvision stubbed: {', '.join(sorted(set(stub.answered)))}")


def check() -> None:
    """``--check``: import the scheduling modules and print one OK line (module docstring)."""
    print(check_line(install_torchvision_stub()))


if __name__ == "__main__":
    if sys.argv[1:] == []:
        import importlib.util

        _STUB = install_torchvision_stub()
        _spec = importlib.util.spec_from_file_location("worker_pipe", os.path.join(_HERE, "worker_pipe.py"))
        _pipe = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_pipe)
        _pipe.serve(_build, ("add", "abort", "schedule", "update", "view", "probe"), ValueError)
    elif sys.argv[1:] == ["--check"]:
        check()
    elif len(sys.argv) == 3 and sys.argv[1] == "--probe":
        import json

        install_torchvision_stub()
        for case in json.loads(sys.argv[2]):  # a list of {"config", "requests"}: one line each
            sys.stdout.write(json.dumps(probe(case["config"], case["requests"])) + "\n")
    else:
        sys.exit(f"usage: {sys.argv[0]} [--check | --probe CASES_JSON]")
