"""``docs/generated/proofs-timings.md`` is the rendering of the recorded ``schedspec prove --json`` runs
(``scripts/gen_proofs_timings.py``), not typed by hand, and names only theorems that exist."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_proofs_timings", ROOT / "scripts" / "gen_proofs_timings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_timings_page_renders_the_recorded_runs(generator):
    data = json.loads(generator.RUNS_FILE.read_text(encoding="utf-8"))
    assert generator.PAGE.read_text(encoding="utf-8") == generator.render(data), (
        "docs/generated/proofs-timings.md is stale: run .venv/bin/python scripts/gen_proofs_timings.py")
    assert [run["command"] for run in data["runs"]] == [
        "schedspec prove " + " ".join(args) for _, args in generator.RUNS], "RUNS changed: rerun with --run"


def test_the_recorded_runs_name_existing_theorems(generator):
    pytest.importorskip("z3")
    from schedspec.commands.prove import ENCODED, theorems_for

    known = {t.name for scheduler in ENCODED for t in theorems_for(scheduler)}
    data = json.loads(generator.RUNS_FILE.read_text(encoding="utf-8"))
    named = {r["name"] for run in data["runs"] for r in run["results"]}
    assert named <= known, sorted(named - known)


def test_a_changed_result_changes_the_page(generator):
    """Deliberate break: the page follows the data (a result flipped to unknown shows as not expected)."""
    data = json.loads(generator.RUNS_FILE.read_text(encoding="utf-8"))
    data["runs"][0]["results"][0].update(status="unknown", ok=False, detail="timeout")
    assert "**unknown** (not as expected: timeout)" in generator.render(data)
