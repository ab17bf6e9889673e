"""vLLM V1's scheduler run standalone, no model, in vLLM's own environment: the worker half of the
``vllm`` adapter (:mod:`schedspec.engines.vllm` is the other half).

This file is run as a script by the Python of the vLLM environment (``.venv-vllm``, made by
``scripts/engines_setup.sh``); it imports only the standard library, ``vllm`` and the whole-engine
recorder's module (``recorder/schedspec_vllm_recorder.py``, which maps a ``SchedulerOutput`` for both;
it imports only those two itself), never ``schedspec``
(whose dependencies that environment does not pin). It speaks JSON Lines over stdin/stdout: one
command per line in, one reply per line out for the commands that reply. vLLM's own logging goes to
stderr. Every command but ``init`` names the scheduler it is for with ``handle`` (an integer the
client chose at ``init``), so one process serves many schedulers.

Commands (``op``):

- ``init`` ``{config, policy, async_scheduling}``: build the scheduler (with ``config.num_speculative_tokens``
  k > 0, an n-gram ``SpeculativeConfig`` of k tokens: no draft model); reply ``{"vllm_version",
  "vllm_file"}`` (the ``vllm`` package imported, which ``--path-ahead DIR`` can change: DIR is put first
  on ``sys.path``).
- ``add`` ``{id, prompt, max_tokens, priority, arrival_time, eos, stop_token_ids?, min_tokens?, lora_int_id?}``:
  no reply (``stop_token_ids`` and ``min_tokens`` go to its ``SamplingParams``; ``lora_int_id``,
  with ``config.max_loras`` > 0: a ``LoRARequest`` of that id, named ``lora-<id>``, whose path is never read;
  ``grammar_steps``: structured output, a JSON-schema ``StructuredOutputsParams``, so that vLLM holds the
  request in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` until its grammar is set: a :class:`ReadyGrammar`
  set just before the ``grammar_steps``-th ``schedule`` after this ``add``).
  Remote KV (after ``kv_connector``): ``kv_load_tokens`` (the prompt tokens the connector offers to load) and
  ``kv_send`` (its KV is sent when it finishes), handed to the connector.
- ``kv_connector``: rebuild the scheduler with the schedspec KV connector
  (``recorder/schedspec_vllm_connector.py`` ``ScheduledKVConnector``, ``KVTransferConfig`` with
  ``kv_load_failure_policy="recompute"``), before any ``add``; reply ``{}``.
- ``abort`` ``{id}``: ``Scheduler.finish_requests(id, RequestStatus.FINISHED_ABORTED)``; no reply.
- ``schedule``: ``Scheduler.schedule()``; reply ``{"scheduled": [[id, num_computed_tokens,
  num_scheduled_tokens, new_block_ids, num_hit_blocks, spec_token_ids], ...], "preempted": [id, ...],
  "num_requests": n}`` in vLLM's numbering, ``n`` the running and waiting requests the scheduler held
  when it began, ``spec_token_ids`` the item's ``SchedulerOutput.scheduled_spec_decode_tokens`` (placeholder
  ``-1`` drafts included; empty without speculative decoding); with the KV connector also ``"loads": [[id,
  tokens, block_ids], ...]``, the remote KV loads the step started (vLLM numbering).
- ``update`` ``{sampled, drafts}``: ``Scheduler.update_from_output`` of the oldest step in flight (with
  ``AsyncScheduler`` two steps may be in flight) with a ``ModelRunnerOutput`` holding the
  sampled token of every request that samples (an empty list for a request inside a prefill chunk; with
  speculative decoding a list, the accepted drafts then the sampled token); then, synchronous only, the
  ``drafts`` (request id -> draft ids) to ``Scheduler.update_draft_token_ids``, as ``EngineCore.post_step``
  hands them; reply ``{"finished": [[id, status], ...]}``. ``transfers`` ``{recving, invalid, sending}`` (KV
  connector, vLLM block numbering): the ``KVConnectorOutput`` of the step.
- ``close``: drop the scheduler; no reply.
- ``view``: reply the scheduler's own bookkeeping (free blocks of the block pool, waiting and running
  ids, block tables, ``num_computed_tokens``; the free queue in order, the blocks that carry a hash and
  the reference counts of held blocks), vLLM numbering; and the worker's: the ids whose stand-in grammar
  is still to be set (``grammar_due``). A request that ended while a transfer holds its
  blocks is left out (the spec's ``delayed_frees``); a landed load vLLM has not promoted yet is shown promoted,
  as the spec has it (a whole-sequence load with one token left; one failed from its first block holding
  nothing, its blocks counted free).

A command that fails sends ``{"error": traceback}`` as its reply; a failing command that does not
reply (``add``, ``abort``) makes the next reply an error instead.

How the scheduler is built (no GPU, no model weights, no hub):

- ``ModelConfig`` reads a ``config.json`` of a one-layer Llama written to a temporary directory, with
  ``skip_tokenizer_init=True``; ``HF_HUB_OFFLINE=1`` is set before vLLM is imported.
- ``KVCacheConfig`` has one ``KVCacheGroupSpec`` with a ``FullAttentionSpec`` (with ``config.kv_cache_groups``,
  one group per entry, ``FullAttentionSpec`` or ``SlidingWindowSpec``, one layer each; ``schedule`` then also
  replies ``groups`` (id -> the new block ids of groups 1..) and ``skipped`` (id -> the blocks its window freed))
  and ``num_kv_blocks + 1`` blocks: ``BlockPool`` (``vllm/v1/core/block_pool.py``) takes block 0 as its
  null block and never hands it out, so exactly ``num_kv_blocks`` are usable, ids ``1..num_kv_blocks``
  (the adapter maps vLLM block ``b`` to spec block ``b - 1``).
- ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``) or ``AsyncScheduler``
  (``vllm/v1/core/sched/async_scheduler.py``), with a ``StructuredOutputManager`` that is never used.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import deque

# This file sits beside the adapter ``vllm.py``; as a script its folder is sys.path[0], where
# ``import vllm`` would find the adapter instead of the engine.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
# ``--path-ahead DIR``: another vLLM's Python files (vLLM 0.33's, unpacked by scripts/engines_setup.sh)
# come first, ahead of the environment's own vllm package.
if len(sys.argv) == 3 and sys.argv[1] == "--path-ahead":
    sys.path.insert(0, os.path.abspath(sys.argv[2]))
    # and for the subprocesses vLLM starts (vllm/model_executor/models/registry.py _run_in_subprocess
    # inspects the model class in `python -m vllm.model_executor.models.registry`): without it they import
    # the environment's vLLM, whose _ModelInfo lacks the newer release's fields (0.33's supports_lora,
    # read when a LoRAConfig is given)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.abspath(sys.argv[2]), *filter(None, [os.environ.get("PYTHONPATH")])])
elif len(sys.argv) != 1:
    sys.exit(f"usage: {sys.argv[0]} [--path-ahead DIR]")
# The whole-engine recorder's folder (no ``vllm`` module in it): its ``scheduled_items`` maps a
# SchedulerOutput onto the spec for both.
sys.path.append(os.path.join(_HERE, "recorder"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 0,
}
"""The model vLLM's ``ModelConfig`` is told about. Nothing is loaded; the scheduler reads only its
length limits and whether it is a plain decoder (no multimodal, no mamba, no sliding window)."""


from schedspec_vllm_recorder import PreemptionOrder, scheduled_items  # noqa: E402  (after the path set-up above)


class ConfigRefused(Exception):
    """vLLM's config classes refuse the configuration (the message is vLLM's)."""


class ConfigError(ConfigRefused, ValueError):
    """A configuration the worker cannot give vLLM (the message says which field); answered as a refusal,
    as vLLM's own (:class:`ConfigRefused`)."""


class ReadyGrammar:
    """A compiled structured-output grammar as far as the scheduler sees it: it exists (so
    ``Scheduler._handle_blocked_waiting_request`` promotes the request to ``WAITING``) and accepts every token
    (``StructuredOutputManager.accept_tokens`` calls ``accept_tokens``; the other methods are the model
    runner's, which does not run here)."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


class Worker:
    """One vLLM scheduler and the bookkeeping to answer the commands (module docstring). ``base``: the
    scheduler class to build instead of vLLM's ``Scheduler``/``AsyncScheduler`` (a subclass of one, e.g.
    the recorder's; ``benchmarks/scheduler_overhead.py --recorder``)."""

    def __init__(self, config: dict, policy: str, async_scheduling: bool, vocab_size: int,
                 base: type | None = None, kv_connector: bool = False) -> None:
        self.arguments = (config, policy, async_scheduling, vocab_size, base)
        import torch
        from vllm.config import (
            CacheConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            SpeculativeConfig,
            VllmConfig,
        )
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        self.block_size = config["block_size"]
        self.num_kv_blocks = config["num_kv_blocks"]
        max_model_len = config["max_model_len"]
        self.model_dir = tempfile.TemporaryDirectory(prefix="schedspec-vllm-model-")
        model = dict(TINY_LLAMA, vocab_size=vocab_size, max_position_embeddings=max(max_model_len, 2048))
        with open(os.path.join(self.model_dir.name, "config.json"), "w") as handle:
            json.dump(model, handle)
        try:
            model_config = ModelConfig(
                model=self.model_dir.name,
                tokenizer=self.model_dir.name,
                skip_tokenizer_init=True,
                max_model_len=max_model_len,
                dtype="float32",
                seed=0,
            )
            cadence = {"prefill_schedule_interval": config["prefill_schedule_interval"]} \
                if config.get("prefill_schedule_interval", 1) > 1 else {}  # 0.33's local cadence (vllm.py refuses 0.32)
            scheduler_config = SchedulerConfig(
                **cadence,
                max_num_seqs=config["max_num_seqs"],
                max_num_batched_tokens=config["max_num_batched_tokens"],
                max_model_len=max_model_len,
                enable_chunked_prefill=config["enable_chunked_prefill"],
                long_prefill_token_threshold=config["long_prefill_token_threshold"],
                watermark=config.get("watermark", 0.0),
                max_num_active_seqs=config.get("max_num_active_seqs"),
                long_prefill_token_threshold_adaptive=config.get("long_prefill_token_threshold_adaptive", False),
                policy=policy,
                async_scheduling=async_scheduling,
                is_encoder_decoder=False,
            )
            self.enable_prefix_caching = bool(config.get("enable_prefix_caching", False))
            cache_config = CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching)
            cache_config.num_gpu_blocks = self.num_kv_blocks + 1
            self.num_speculative_tokens = int(config.get("num_speculative_tokens", 0))
            speculative_config = None
            if self.num_speculative_tokens:
                # The n-gram drafter needs no draft model (SpeculativeConfig.__post_init__ sets
                # model="ngram"); its num_lookahead_tokens and max_num_new_slots_for_drafting are 0.
                # The drafts themselves come from the adapter (update's "drafts"), not from n-gram lookup.
                speculative_config = SpeculativeConfig(
                    method="ngram", num_speculative_tokens=self.num_speculative_tokens,
                    prompt_lookup_min=1, prompt_lookup_max=1,
                    target_model_config=model_config, target_parallel_config=ParallelConfig(),
                )
            lora_config = None
            if config.get("max_loras", 0):
                from vllm.config import LoRAConfig

                lora_config = LoRAConfig(max_loras=config["max_loras"])
            vllm_config = VllmConfig(
                model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
                speculative_config=speculative_config, lora_config=lora_config,
                **({"kv_transfer_config": KVTransferConfig(
                    kv_connector="ScheduledKVConnector", kv_connector_module_path="schedspec_vllm_connector",
                    kv_role="kv_both", kv_load_failure_policy="recompute")} if kv_connector else {}),
            )
        except Exception as error:  # noqa: BLE001  (vLLM validates with pydantic and ValueError)
            raise ConfigRefused(f"{type(error).__name__}: {error}") from None
        if vllm_config.num_lookahead_tokens != int(config.get("num_lookahead_tokens", 0)):
            raise ConfigError(f"num_lookahead_tokens={config.get('num_lookahead_tokens', 0)}: the n-gram "
                              f"drafter has num_lookahead_tokens={vllm_config.num_lookahead_tokens}")
        # hybrid KV cache groups (config.kv_cache_groups): one group per entry, one layer each, all in the one
        # pool; without them the one full-attention group
        groups = config.get("kv_cache_groups") or [{"kind": "full_attention"}]
        self.num_groups = len(groups)
        specs = []
        for index, group in enumerate(groups):
            shape = {"block_size": self.block_size, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
            spec = (SlidingWindowSpec(**shape, sliding_window=group["sliding_window"])
                    if group["kind"] == "sliding_window" else FullAttentionSpec(**shape))
            specs.append(KVCacheGroupSpec([f"layers.{index}.self_attn"], spec))
        kv_cache_config = KVCacheConfig(num_blocks=self.num_kv_blocks + 1, kv_cache_tensors=[], kv_cache_groups=specs)
        # What EngineCore.__init__ (vllm/v1/engine/core.py) does with prefix caching on: seed NONE_HASH
        # and give every Request a block hasher, which fills Request.block_hashes for its full blocks
        # (prompt and, as they are appended, output tokens); without it no lookup ever hits.
        self.block_hasher = None
        if self.enable_prefix_caching:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

            hash_function = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_function)
            self.block_hasher = get_request_block_hasher(self.block_size, hash_function)
        scheduler_class = base or (AsyncScheduler if async_scheduling else Scheduler)
        if not issubclass(scheduler_class, PreemptionOrder):
            # the order of preemptions (the recorder's hook; its RecordingScheduler has it already)
            scheduler_class = type(f"PreemptionOrder{scheduler_class.__name__}", (PreemptionOrder, scheduler_class),
                                   {})
        self.scheduler = scheduler_class(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=self.block_size,
            log_stats=False,
        )
        self.scheduler.preempted_order = []
        self.async_scheduling = async_scheduling
        self.num_schedules = 0  # schedule() calls so far: the step vLLM plans next
        self.grammar_due: dict[str, tuple] = {}  # structured output: id -> (Request, schedule call it is ready at)
        # SchedulerOutputs planned and not yet updated, oldest first: at most one for the Scheduler, two
        # for the AsyncScheduler (step n+1 is planned before step n's output is processed).
        self.in_flight: deque = deque()

    # ------------------------------------------------------------------------------ commands
    def kv_connector(self, message: dict) -> dict:
        """Rebuild the scheduler with the schedspec KV connector (``recorder/schedspec_vllm_connector.py``),
        before any request was added; reply ``{}``."""
        if self.scheduler.requests:
            raise RuntimeError("kv_connector after requests were added")
        self.__init__(*self.arguments, kv_connector=True)
        return {}

    def add(self, message: dict) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        structured = None
        if message.get("grammar_steps") is not None:
            from vllm.sampling_params import StructuredOutputsParams

            structured = StructuredOutputsParams(json={"type": "object"})
        # stop_token_ids: check_stop stops on them too; min_tokens: check_stop tests it after them (the adapter
        # refuses a stop id sampled before it: StopBeforeMinTokens)
        params = SamplingParams(max_tokens=message["max_tokens"], ignore_eos=message["eos"] is None,
                                stop_token_ids=message.get("stop_token_ids") or None,
                                min_tokens=message.get("min_tokens", 0), structured_outputs=structured)
        if message["eos"] is not None:
            # What the input processor sets from the tokenizer's generation config
            # (vllm/v1/engine/input_processor.py); check_stop reads sampling_params.eos_token_id.
            params.update_from_generation_config({}, message["eos"])
        lora_request = None
        if message.get("lora_int_id"):
            from vllm.lora.request import LoRARequest

            lora_id = message["lora_int_id"]
            lora_request = LoRARequest(f"lora-{lora_id}", lora_id, f"/nonexistent/lora-{lora_id}")
        request = Request(
            request_id=message["id"],
            prompt_token_ids=list(message["prompt"]),
            sampling_params=params,
            pooling_params=None,
            arrival_time=message["arrival_time"],
            priority=message["priority"],
            block_hasher=self.block_hasher,
            lora_request=lora_request,
        )
        connector = self.scheduler.connector
        if message.get("kv_load_tokens"):  # remote KV: the connector offers this many prompt tokens
            connector.offers[message["id"]] = message["kv_load_tokens"]
        if message.get("kv_send"):
            connector.senders.add(message["id"])
        self.scheduler.add_request(request)
        if structured is not None:
            self.grammar_due[message["id"]] = (request, self.num_schedules + message["grammar_steps"])

    def abort(self, message: dict) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(message["id"], RequestStatus.FINISHED_ABORTED)
        self.grammar_due.pop(message["id"], None)  # an aborted request's grammar never lands

    def schedule(self, message: dict) -> dict:
        if len(self.in_flight) >= (2 if self.async_scheduling else 1):
            raise RuntimeError(f"schedule with {len(self.in_flight)} steps in flight")
        preempted = self.scheduler.preempted_order = []
        for request_id, (request, due) in list(self.grammar_due.items()):
            # what EngineCore does asynchronously: the compiled grammar lands in StructuredOutputRequest
            if due <= self.num_schedules:
                request.structured_output_request.grammar = ReadyGrammar()
                del self.grammar_due[request_id]
        self.num_schedules += 1
        num_running, num_waiting = self.scheduler.get_request_counts()  # what schedule() reads first
        tables = self._tables() if self.num_groups > 1 else {}
        connector = self.scheduler.connector
        if connector is not None:
            connector.loads = []
        output = self.scheduler.schedule()
        self.in_flight.append(output)
        scheduled = scheduled_items(output, self.block_size)  # the recorder's mapping, shared (drafts included)
        if set(preempted) != set(output.preempted_req_ids):
            raise RuntimeError(f"recorded preemptions {preempted} != {sorted(output.preempted_req_ids)}")
        reply = {"scheduled": scheduled, "preempted": list(preempted), "num_requests": num_running + num_waiting}
        if self.num_groups > 1:
            reply.update(self._group_blocks(output, tables))
        if connector is not None:  # the remote KV loads started: their blocks, vLLM numbering
            manager = self.scheduler.kv_cache_manager
            reply["loads"] = [[r, n, list(manager.get_block_ids(r)[0])] for r, n in connector.loads]
        return reply

    def _tables(self) -> dict[str, list[list[int]]]:
        """Every running request's block table per group (vLLM ids, the null block 0 included)."""
        coordinator = self.scheduler.kv_cache_manager.coordinator
        return {request.request_id: [[block.block_id for block in table] for table in coordinator.get_blocks(
            request.request_id)] for request in self.scheduler.running}

    def _group_blocks(self, output, before: dict[str, list[list[int]]]) -> dict:
        """Hybrid KV cache groups: ``{"groups": {id: [new ids of group 1, ...]}, "skipped": {id: [ids]}}`` for the
        scheduled requests: the new blocks of groups 1.. (``NewRequestData.block_ids[g]``,
        ``CachedRequestData.new_block_ids[i][g]``), and the blocks ``remove_skipped_blocks`` freed in
        ``allocate_slots`` (held before ``schedule``, the null block after), in the order they went to the front
        of the free queue (per group the highest index first, a later group's in front)."""
        new_ids: dict[str, list[list[int]]] = {}
        for new in output.scheduled_new_reqs:
            new_ids[new.req_id] = [list(ids) for ids in new.block_ids[1:]]
        cached = output.scheduled_cached_reqs
        for request_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            new_ids[request_id] = [list(group) for group in ids[1:]] if ids else [[] for _ in range(self.num_groups - 1)]
        after = self._tables()
        skipped: dict[str, list[int]] = {}
        for request_id in output.num_scheduled_tokens:
            old, now = before.get(request_id), after.get(request_id)
            if not old or not now:
                continue
            order: list[int] = []
            for table, current in zip(old, now, strict=True):
                freed = [table[i] for i in range(len(table) - 1, -1, -1)
                         if table[i] != 0 and i < len(current) and current[i] == 0]
                order = freed + order
            if order:
                skipped[request_id] = order
        return {"groups": {r: ids for r, ids in new_ids.items() if r in output.num_scheduled_tokens},
                "skipped": skipped}

    def update(self, message: dict) -> dict:
        from vllm.v1.outputs import ModelRunnerOutput

        if not self.in_flight:
            raise RuntimeError("update without schedule")
        output = self.in_flight.popleft()
        sampled = message["sampled"]
        request_ids = list(output.num_scheduled_tokens)
        # sampled: request id -> a token id, or (speculative decoding) the list of the accepted drafts
        # followed by the sampled token, as the model runner returns them (rejection sampler output).
        transfers = message.get("transfers")
        connector_output = None
        if transfers:  # the KV connector's report (vllm/v1/outputs.py KVConnectorOutput), vLLM block numbering
            from vllm.v1.outputs import KVConnectorOutput

            connector_output = KVConnectorOutput(finished_recving=set(transfers["recving"]) or None,
                                                 finished_sending=set(transfers["sending"]) or None,
                                                 invalid_block_ids=set(transfers["invalid"]))
        runner_output = ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={request_id: index for index, request_id in enumerate(request_ids)},
            sampled_token_ids=[_token_list(sampled[r]) if r in sampled else [] for r in request_ids],
            kv_connector_output=connector_output,
        )
        # (a request that ended while a transfer held its blocks stays in scheduler.requests until it is done)
        before = {r: q.status for r, q in self.scheduler.requests.items() if not q.is_finished()}
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        finished: dict[str, str] = {}
        for outputs in engine_outputs.values():
            for item in outputs.outputs:
                if item.finish_reason is not None:
                    finished[item.request_id] = str(item.finish_reason)
        # A request that ended in this step is gone from scheduler.requests (its blocks freed); its
        # EngineCoreOutput carries the finish reason. Cross-check both.
        gone = [r for r in before if r not in self.scheduler.requests and r not in finished]
        if gone:
            raise RuntimeError(f"requests left the scheduler without a finish output: {gone}")
        proposed = message.get("drafts") or {}
        if proposed and not self.async_scheduling:
            # What EngineCore.post_step does after update_from_output (vllm/v1/engine/core.py): the
            # drafter's proposals for the batch, handed to Scheduler.update_draft_token_ids. With async
            # scheduling the drafts stay in the worker (AsyncScheduler schedules placeholders).
            from vllm.v1.outputs import DraftTokenIds

            ids = [r for r in request_ids if r in proposed]
            self.scheduler.update_draft_token_ids(DraftTokenIds(ids, [list(proposed[r]) for r in ids]))
        return {"finished": sorted(finished.items())}

    def view(self, message: dict) -> dict:
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        waiting = [request.request_id for request in scheduler.waiting]
        waiting += [request.request_id for request in scheduler.kv_holding_waiting]
        tables = {}
        computed = {}
        freed_at_promotion = 0
        for request_id, request in scheduler.requests.items():
            if request.is_finished():
                continue  # ended, its blocks held for a transfer (the spec's delayed_frees)
            computed[request_id] = request.num_computed_tokens
            ids = manager.get_block_ids(request_id)
            if request_id in scheduler.finished_recving_kv_req_ids:
                # a landed load vLLM promotes in its next schedule (_update_waiting_for_remote_kv) and the spec at
                # once: shown promoted (a whole-sequence load leaves one token; a load failed from its first
                # block frees its blocks)
                if request.num_computed_tokens == request.num_tokens:
                    computed[request_id] = request.num_tokens - 1
                if request_id in scheduler.failed_recving_kv_req_ids and not request.num_computed_tokens:
                    freed_at_promotion += len(ids[0]) if ids else 0
                    continue
            if ids and ids[0]:
                tables[request_id] = list(ids[0])
        pool = manager.block_pool
        free_queue = [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]
        hashed = sorted(block.block_id for block in pool.blocks if block.block_hash is not None)
        return {
            "num_free_blocks": pool.get_num_free_blocks() + freed_at_promotion,
            "free_queue": free_queue,
            "cached_blocks": hashed,
            "ref_counts": {str(b.block_id): b.ref_cnt for b in pool.blocks if b.ref_cnt and not b.is_null},
            "waiting": waiting,
            "running": [request.request_id for request in scheduler.running],
            "block_tables": tables,
            "num_computed_tokens": computed,
            "grammar_due": sorted(self.grammar_due),  # structured output: the requests whose grammar is to land
        }


def _build(message: dict) -> tuple[Worker, dict]:
    worker = Worker(message["config"], message["policy"], message["async_scheduling"], message["vocab_size"])
    import vllm

    return worker, {"vllm_version": vllm.__version__, "vllm_file": vllm.__file__}


def _token_list(sampled) -> list[int]:
    """A request's sampled tokens as the model runner returns them: a list (accepted drafts, then the
    sampled token), or one token id."""
    return [int(t) for t in sampled] if isinstance(sampled, list) else [int(sampled)]


def main() -> None:
    """Serve commands from stdin until it closes (the loop is ``worker_pipe.serve``, beside this file,
    shared with the other engine workers; loaded by path since this folder is off ``sys.path``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("worker_pipe", os.path.join(_HERE, "worker_pipe.py"))
    pipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipe)
    pipe.serve(_build, ("add", "abort", "schedule", "update", "view", "kv_connector"), ConfigRefused)


if __name__ == "__main__":
    main()
