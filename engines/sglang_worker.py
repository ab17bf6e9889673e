"""SGLang 0.5.23's scheduling layer run standalone, no model, in SGLang's own environment: the worker
half of the ``sglang`` adapter (:mod:`schedspec.engines.sglang` is the other half).

This file is run as a script by the Python of the SGLang environment (``.venv-sglang``, made by
``scripts/engines_setup.sh`` from ``engines/requirements-sglang.txt``); it imports only the standard
library, ``torch``, ``transformers`` and ``sglang``, never ``schedspec``. It speaks the JSON Lines
protocol of ``worker_pipe.py`` (beside this file, shared with ``vllm_worker.py``).

``--check`` (used by ``scripts/engines_setup.sh``): import the scheduling modules, print one line
``ENGINES SETUP: OK sglang ...`` naming the ``torchvision`` modules the stub answered, and exit.

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
    elif len(sys.argv) != 1:
        sys.exit(f"usage: {sys.argv[0]} [--check]")
