"""The documentation site's generated parts are up to date with the code, and the worked example
shows what its page says it shows. (The site itself is built by scripts/test.sh with
``mkdocs build --strict``, which fails on a broken link, anchor or API reference.)"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_docs_examples", ROOT / "scripts" / "gen_docs_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def step_example(generator) -> str:
    return generator.render_step_example()


def test_step_example_is_generated_from_a_lab_run(generator, step_example: str) -> None:
    assert generator.STEP_EXAMPLE.read_text(encoding="utf-8") == step_example, (
        "docs/generated/step-example.md is stale: run .venv/bin/python scripts/gen_docs_examples.py"
    )


def test_step_example_shows_a_mixed_step_a_chunked_prompt_and_a_preemption(step_example: str) -> None:
    # the generator writes each of these only when the run has it; a change of trace window or config
    # that loses one must be noticed (the page's prose promises all three)
    for what in ("**Prefill and decode in one step.**", "**A chunked long prompt.**", "**A preemption.**",
                 "admitted again in step", ": 0 violations;"):
        assert what in step_example, what


def test_api_spec_page_follows_the_reading_order(generator) -> None:
    order = generator.reading_order()
    assert order and order[0] == "schedspec.spec.config", order
    for module in order:
        importlib.import_module(module)  # a name mkdocstrings could not resolve fails here first
    assert generator.API_SPEC.read_text(encoding="utf-8") == generator.render_api_spec(), (
        "docs/api/spec.md is stale: run .venv/bin/python scripts/gen_docs_examples.py"
    )


def test_sphinx_roles_render_as_inline_code() -> None:
    spec = importlib.util.spec_from_file_location("griffe_sphinx_roles", ROOT / "scripts" / "griffe_sphinx_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "See :class:`~schedspec.spec.state.StepPlan`, :func:`apply_plan` and :mod:`schedspec.spec.rules`."
    assert module.plain_roles(text) == "See `StepPlan`, `apply_plan` and `schedspec.spec.rules`."
    assert module.plain_roles("``literal`` and :notarole:`x`") == "``literal`` and :notarole:`x`"


def test_what_breaks_each_check_is_generated_by_running_the_checker() -> None:
    spec = importlib.util.spec_from_file_location("gen_check_examples", ROOT / "scripts" / "gen_check_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = module.render()
    assert module.TARGET.read_text(encoding="utf-8") == page, (
        "docs/generated/what-breaks-each-check.md is stale: run .venv/bin/python scripts/gen_check_examples.py"
    )
    # every allowed-plan rule is broken by some fault of the catalogue, except the one no config of the
    # catalogue's traces can reach (chunked prefill off needs max_num_batched_tokens >= max_model_len)
    unreached = [line.split("`")[1] for line in page.splitlines() if "| rule | none" in line]
    assert unreached == ["whole-prefill-without-chunking"]
