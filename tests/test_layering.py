"""The layering of the folders holds: spec imports nothing from reference, gpu_backend, engines or the lab;
reference does not import engines, gpu_backend or the lab; engines and gpu_backend do not import the lab;
the lab imports nothing of the CLI or of schedspec.testing; spec and gpu_backend import without z3.
The engine loop, the trace checker and the Hypothesis machine take their checked step from the one
stepper in spec (spec/stepper.py), not from the transitions, rules and invariants directly.

Relative imports (``from .x import y``, ``from .. import z``) are resolved against the folder's import
name (pyproject's package-dir), so they are checked too. Cost: well under a second (AST parsing only),
plus one interpreter start for the z3 check.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = ("schedspec.cli", "schedspec.commands")  # "schedspec.cli" also covers schedspec.cli_common
FORBIDDEN = {
    "spec": ("schedspec.reference", "schedspec.gpu_backend", "schedspec.engines", "schedspec.lab", *CLI,
             "schedspec.testing", "schedspec.strategies"),
    "reference": ("schedspec.engines", "schedspec.gpu_backend", "schedspec.lab", *CLI),
    "engines": ("schedspec.lab", *CLI),
    "gpu_backend": ("schedspec.lab", *CLI),
    "lab": (*CLI, "schedspec.testing"),
}


def _imports(path: Path, package: str | None = None) -> list[str]:
    """Every module ``path`` imports, at any depth of the file (lazy imports inside functions too).
    A relative import is resolved against ``package`` (the file's own package, e.g.
    ``schedspec.reference``) and left out when ``package`` is not given."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0 and package is not None:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - (node.level - 1)])
            if node.module:
                names.append(f"{base}.{node.module}")
            else:  # from .. import lab
                names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def _offenders(root: Path, folder: str) -> list[str]:
    """``"FILE imports NAME"`` for every import under ``root / folder`` that ``FORBIDDEN[folder]`` forbids."""
    offenders = []
    for path in sorted((root / folder).rglob("*.py")):
        if "proofs" in path.parts and folder == "reference":
            continue
        package = ".".join(("schedspec", folder, *path.relative_to(root / folder).parent.parts))
        offenders.extend(f"{path.relative_to(root)} imports {name}"
                         for name in _imports(path, package) if name.startswith(FORBIDDEN[folder]))
    return offenders


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_does_not_import_layers_above_it(folder):
    assert (ROOT / folder).is_dir()
    assert _offenders(ROOT, folder) == []


def test_the_layering_check_would_see_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from schedspec.reference.engine import Engine\n")
    assert "schedspec.reference.engine" in _imports(bad)


def test_the_layering_check_sees_the_lab_rows_broken(tmp_path):
    """A deliberate break of each new row: reference, engines and gpu_backend importing the lab (absolute,
    relative and lazily inside a function), and the lab importing the CLI."""
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "engine.py").write_text(
        "from ..lab import metrics\n"
        "def run():\n"
        "    from schedspec.lab.run import run_lab\n")
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "vllm.py").write_text("import schedspec.lab.trace_formats\n")
    (tmp_path / "gpu_backend").mkdir()
    (tmp_path / "gpu_backend" / "runner.py").write_text("from schedspec.lab import calibrate\n")
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "capacity.py").write_text(
        "def command():\n"
        "    from schedspec.cli_common import fail\n"
        "    from schedspec.testing import machine_for\n")
    assert _offenders(tmp_path, "reference") == ["reference/engine.py imports schedspec.lab",
                                                 "reference/engine.py imports schedspec.lab.run"]
    assert _offenders(tmp_path, "engines") == ["engines/vllm.py imports schedspec.lab.trace_formats"]
    assert _offenders(tmp_path, "gpu_backend") == ["gpu_backend/runner.py imports schedspec.lab"]
    assert _offenders(tmp_path, "lab") == ["lab/capacity.py imports schedspec.cli_common",
                                           "lab/capacity.py imports schedspec.testing"]


STEPPER = "schedspec.spec.stepper"
STEPPER_USERS = ("reference/engine.py", "spec/checker.py", "schedspec/testing.py")
"""The three places that run a checked step: the engine loop, the trace checker, the Hypothesis machine."""
STEP_PARTS = {
    "schedspec.spec.transitions": {"add_request", "abort_request", "apply_plan"},
    "schedspec.spec.rules": {"violated_rules"},
    "schedspec.spec.invariants": {"check_step"},
    "schedspec.spec.incremental": {"IncrementalChecker"},
}
"""What the stepper composes: a user that imports one of these steps on its own (a second copy of the step)."""


def _step_offenders(root: Path, relative: str) -> list[str]:
    """``"FILE ..."`` for a stepper user that does not import the stepper or imports a part of the step."""
    path = root / relative
    found = [] if STEPPER in _imports(path) else [f"{relative} does not use {STEPPER}"]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in STEP_PARTS:
            found.extend(f"{relative} imports {node.module}.{alias.name}"
                         for alias in node.names if alias.name in STEP_PARTS[node.module])
    return found


@pytest.mark.parametrize("relative", STEPPER_USERS)
def test_the_engine_checker_and_machine_step_through_the_one_stepper(relative):
    assert _step_offenders(ROOT, relative) == []


def test_the_stepper_check_would_see_a_second_copy_of_the_step(tmp_path):
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "checker.py").write_text(
        "from schedspec.spec.stepper import Stepper\n"
        "from schedspec.spec.transitions import PlanError, apply_plan\n"
        "def f():\n"
        "    from schedspec.spec.rules import Violation, violated_rules\n")
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "engine.py").write_text("from schedspec.spec.invariants import check_step\n")
    assert _step_offenders(tmp_path, "spec/checker.py") == [
        "spec/checker.py imports schedspec.spec.transitions.apply_plan",
        "spec/checker.py imports schedspec.spec.rules.violated_rules"]
    assert _step_offenders(tmp_path, "reference/engine.py") == [
        "reference/engine.py does not use schedspec.spec.stepper",
        "reference/engine.py imports schedspec.spec.invariants.check_step"]


def test_spec_and_backend_import_without_z3():
    code = (
        "import sys; sys.modules['z3'] = None\n"
        "import schedspec.spec, schedspec.spec.checker, schedspec.spec.stepper, schedspec.gpu_backend\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr
