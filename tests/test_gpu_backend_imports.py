"""Import hygiene: torch stays inside gpu_backend (importing the package itself does not load it), and
nothing gpu_backend imports loads z3."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import schedspec.gpu_backend

PACKAGE = Path(schedspec.gpu_backend.__file__).parent

BLOCK_HEAVY = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "safetensors", "transformers", "z3"}:
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, Block())
import importlib
for module in MODULES:
    importlib.import_module(module)
import schedspec.gpu_backend as gb
from schedspec.gpu_backend import BackendError, BlockTableError, ModelConfig, tiny_model_config
assert issubclass(BackendError, ValueError) and issubclass(BlockTableError, BackendError)
assert tiny_model_config().num_hidden_layers == 4
try:
    gb.Runner
except ImportError as exc:
    assert "blocked: torch" in str(exc), exc
else:
    raise AssertionError("Runner imported without torch")
assert "torch" not in sys.modules
print("ok")
"""


def _spec_modules_used() -> list[str]:
    """The project modules outside gpu_backend that gpu_backend imports."""
    found = set()
    for source in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("schedspec."):
                if not node.module.startswith("schedspec.gpu_backend"):
                    found.add(node.module)
    return sorted(found)


def test_package_imports_without_torch_and_its_project_imports_need_no_z3():
    modules = _spec_modules_used()
    assert "schedspec.spec.state" in modules
    code = f"MODULES = {modules!r}\n" + BLOCK_HEAVY
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_gpu_backend_source_never_mentions_z3():
    for source in PACKAGE.glob("*.py"):
        assert "z3" not in source.read_text(), source
