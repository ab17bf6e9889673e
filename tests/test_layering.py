"""The layering of the folders holds: spec imports nothing from reference, gpu_backend or engines;
reference does not import engines or gpu_backend; spec and gpu_backend import without z3."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "spec": ("schedspec.reference", "schedspec.gpu_backend", "schedspec.engines", "schedspec.cli",
             "schedspec.commands", "schedspec.testing", "schedspec.strategies", "schedspec.run_record",
             "schedspec.sweep"),
    "reference": ("schedspec.engines", "schedspec.gpu_backend", "schedspec.run_record", "schedspec.sweep",
                  "schedspec.cli", "schedspec.commands"),
}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_does_not_import_layers_above_it(folder):
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / folder).rglob("*.py")
        if "proofs" not in path.parts or folder != "reference"
        for name in _imports(path)
        if name.startswith(FORBIDDEN[folder])
    ]
    assert offenders == []


def test_the_layering_check_would_see_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from schedspec.reference.engine import Engine\n")
    assert "schedspec.reference.engine" in _imports(bad)


def test_spec_and_backend_import_without_z3():
    code = (
        "import sys; sys.modules['z3'] = None\n"
        "import schedspec.spec, schedspec.spec.checker, schedspec.gpu_backend\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr
