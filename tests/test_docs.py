"""Generated documentation is up to date with the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_spec_doc", ROOT / "scripts" / "gen_spec_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spec_reference_is_generated_from_the_registries():
    assert (ROOT / "docs" / "spec-reference.md").read_text() == _generator().render(), (
        "docs/spec-reference.md is stale: run .venv/bin/python scripts/gen_spec_doc.py"
    )


def test_published_trace_schema_is_the_one_the_checker_uses():
    assert (ROOT / "docs" / "trace-schema.json").read_text() == _generator().render_schema(), (
        "docs/trace-schema.json is stale: run .venv/bin/python scripts/gen_spec_doc.py"
    )


def test_mutation_table_is_the_one_the_saved_results_give():
    """docs/testing.md's mutation-score table is what scripts/gen_mutmut_table.py writes from the committed
    results in scripts/mutmut-results/ and the reasons in scripts/mutmut_reasons.toml (regenerate it after a
    run or a new reason)."""
    spec = importlib.util.spec_from_file_location("gen_mutmut_table", ROOT / "scripts" / "gen_mutmut_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = (ROOT / "docs" / "testing.md").read_text()
    assert module.render(doc) == doc, "run: python scripts/gen_mutmut_table.py"
