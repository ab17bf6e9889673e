"""SGLang 0.5.23's scheduling layer run standalone, no model, in SGLang's own environment: the worker
half of the ``sglang`` adapter (:mod:`schedspec.engines.sglang` is the other half).

This file is run as a script by the Python of the SGLang environment (``.venv-sglang``, made by
``scripts/engines_setup.sh`` from ``engines/requirements-sglang.txt``); it imports only the standard
library, ``torch``, ``transformers`` and ``sglang``, never ``schedspec``. It speaks the JSON Lines
protocol of ``worker_pipe.py`` (beside this file, shared with ``vllm_worker.py``).

``--check`` (used by ``scripts/engines_setup.sh``): import the scheduling modules, print one line
``ENGINES SETUP: OK sglang ...`` naming the ``torchvision`` modules the stub answered, and exit.

``--probe CASES_JSON`` (used by ``tests/test_engine_sglang.py``; a list of ``{"config", "requests"}``,
one output line each): build SGLang's scheduling components
for a schedspec config (:class:`Components`), admit the given requests through SGLang's own
``SchedulePolicy.calc_priority``, ``PrefillAdder.add_one_req``, ``ScheduleBatch.init_new`` and
``prepare_for_extend`` (which allocates the pages), and print one JSON line: what was admitted, the
chunked request, the pages each row holds and the allocator's free tokens. The adapter's step loop
(``Scheduler.get_next_batch_to_run`` driven over the pipe) is not written yet: docs/engines.md, *SGLang*.

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
    - ``SchedulePolicy(policy, ...)`` and ``NewTokenRatioTracker.from_config()``.
    """

    def __init__(self, config: dict, policy: str = "fcfs") -> None:
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
        self.policy = SchedulePolicy(policy, self.tree_cache, False, policy == "priority", False)
        self.new_token_ratio = NewTokenRatioTracker.from_config()

    def request(self, message: dict):
        """An SGLang ``Req`` for a spec request: its token ids, ``max_new_tokens = max_tokens``,
        ``ignore_eos`` when it has no end-of-sequence id."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        eos = message.get("eos")
        params = SamplingParams(max_new_tokens=message["max_tokens"], ignore_eos=eos is None)
        params.normalize(None)
        return Req(message["id"], "", array("q", message["prompt"]), params,
                   eos_token_ids=None if eos is None else {eos}, vocab_size=message.get("vocab_size", 32000),
                   priority=message.get("priority"))

    def pages(self, req) -> list[int]:
        """The pages of ``req``'s row of the request-to-token pool, in order (its allocated tokens)."""
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        slots = row[: req.extend_end].tolist()
        return list(dict.fromkeys(slot // self.page_size for slot in slots))


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


def check() -> None:
    """``--check``: import the scheduling modules and print one OK line (module docstring)."""
    import importlib

    stub = install_torchvision_stub()
    for name in SCHEDULING_MODULES:
        importlib.import_module(name)
    import sglang
    import torch

    print(f"ENGINES SETUP: OK sglang {sglang.__version__}, torch {torch.__version__}, python "
          f"{sys.version.split()[0]}, {sys.prefix}; torchvision stubbed: {', '.join(sorted(set(stub.answered)))}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        check()
    elif len(sys.argv) == 3 and sys.argv[1] == "--probe":
        import json

        install_torchvision_stub()
        for case in json.loads(sys.argv[2]):  # a list of {"config", "requests"}: one line each
            sys.stdout.write(json.dumps(probe(case["config"], case["requests"])) + "\n")
    else:
        sys.exit(f"usage: {sys.argv[0]} [--check | --probe CASES_JSON]")
