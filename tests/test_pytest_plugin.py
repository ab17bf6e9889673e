"""The pytest plugin (``schedspec.pytest_plugin``, entry point ``pytest11``) and its conformance suite
(``schedspec.conformance``), run as an engine project would run them: in a fresh pytest session
(pytester) whose only configuration is the plugin's options.

The suite must pass every reference policy and fail a toy scheduler that breaks one rule, naming it.
Example counts are kept small (the suite's own stateful check of every policy is tests/test_stateful.py).
"""

from __future__ import annotations

import importlib.metadata

import pytest

from schedspec.reference.kv_connector import uses_kv_connector
from schedspec.reference.scenarios import bundled_scenarios, load_scenario
from schedspec.reference.scheduler import CADENCE_PLANS, KV_CONNECTOR_PLANS, REGISTRY, SCHEDULERS

pytest_plugins = ["pytester"]

SUITE = ("--pyargs", "schedspec.conformance", "-p", "no:cacheprovider")
QUICK = ("--schedspec-examples=8", "--schedspec-steps=20", "--schedspec-seed=0")

NEEDS_PREFIX_CACHING = sorted(p.stem for p in bundled_scenarios() if load_scenario(p).config.get("enable_prefix_caching"))

TOY = '''
"""A scheduler an engine author might write: fcfs that forgets max_num_seqs."""
import attrs

from schedspec.reference import policies
from schedspec.reference.scheduler import ALL_PROPERTIES, ReferenceScheduler


def fcfs_ignoring_max_num_seqs(config):
    def plan(state, config):
        # admits as if max_num_seqs were as large as the token budget allows
        return policies.fcfs(state, attrs.evolve(config, max_num_seqs=config.max_num_batched_tokens))

    return ReferenceScheduler(config, plan, "fcfs-ignoring-max-num-seqs", ALL_PROPERTIES)
'''


GRAMMAR_SCENARIOS = [p for p in bundled_scenarios()
                     if any(r.grammar_compile_steps is not None for r in load_scenario(p).requests)]
"""The bundled scenarios with structured output (which fcfs-fast refuses)."""

CADENCE_SCENARIOS = [p for p in bundled_scenarios()
                     if load_scenario(p).config.get("prefill_schedule_interval", 1) > 1]
"""The bundled scenarios with vLLM 0.33's prefill cadence (which the schedulers outside
``CADENCE_PLANS`` refuse; fcfs-fast runs fcfs with it)."""


REMOTE_KV_SCENARIOS = [p for p in bundled_scenarios()
                       if uses_kv_connector(load_scenario(p).requests)]
"""The bundled scenarios with remote KV loads or sends (which the schedulers outside ``KV_CONNECTOR_PLANS``,
fcfs-fast among them, refuse)."""


NO_SHRINK_PROFILE = """
from hypothesis import Phase, settings

settings.register_profile("no-shrink", phases=(Phase.explicit, Phase.generate), database=None)
"""


def test_plugin_is_registered_as_a_pytest11_entry_point() -> None:
    found = {e.name: e.value for e in importlib.metadata.entry_points(group="pytest11")}
    assert found.get("schedspec") == "schedspec.pytest_plugin", (
        "the schedspec pytest11 entry point is missing: re-run pip install -e . (scripts/test.sh does)"
    )


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_suite_passes_every_reference_policy(pytester: pytest.Pytester, name: str) -> None:
    result = pytester.runpytest(*SUITE, f"--schedspec-scheduler={name}", *QUICK, "-rs")
    outcomes = result.parseoutcomes()
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert outcomes.get("failed", 0) == 0
    # one stateful test and one test per scenario, the prefix-caching scenarios included, none skipped
    assert NEEDS_PREFIX_CACHING
    # fcfs-fast refuses structured output (a request with grammar_compile_steps): those scenarios skip
    refused = len(GRAMMAR_SCENARIOS) if name == "fcfs-fast" else 0
    assert GRAMMAR_SCENARIOS and CADENCE_SCENARIOS
    # the schedulers that do not follow the prefill cadence refuse its scenarios
    if name != "fcfs-fast" and REGISTRY[name].plan not in CADENCE_PLANS:
        refused += len(CADENCE_SCENARIOS)
    # and those outside KV_CONNECTOR_PLANS (fcfs-fast too) the remote KV scenarios
    assert REMOTE_KV_SCENARIOS
    if name == "fcfs-fast" or REGISTRY[name].plan not in KV_CONNECTOR_PLANS:
        refused += len(REMOTE_KV_SCENARIOS)
    assert outcomes["passed"] == 1 + len(bundled_scenarios()) - refused
    assert outcomes.get("skipped", 0) == refused


def test_suite_fails_a_scheduler_that_ignores_max_num_seqs(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(toy_engine=TOY)
    # Shrinking the failure takes ~40 s; the project's own Hypothesis profile turns it off (in a
    # subprocess, so that loading the profile leaves this session's settings alone).
    pytester.makeconftest(NO_SHRINK_PROFILE)
    result = pytester.runpytest_subprocess(
        *SUITE, "--schedspec-scheduler=toy_engine:fcfs_ignoring_max_num_seqs", "--schedspec-examples=20",
        "--schedspec-steps=20", "--schedspec-seed=0", "--hypothesis-profile=no-shrink")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    text = result.stdout.str()
    # the stateful test fails on the broken rule, named, before anything runs
    result.stdout.fnmatch_lines(["FAILED *test_state_machine*"])
    assert "refinement check (spec rules)" in text and "sequence-cap" in text and "max_num_seqs=" in text
    # and so does the scenario distilled from the same fault in nano-vLLM
    result.stdout.fnmatch_lines(["FAILED *test_scenario*nanovllm-max-num-seqs-caps-batch-not-running-set*"])


def test_giving_the_option_adds_the_suite_next_to_the_projects_own_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_own="def test_own():\n    assert True\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--schedspec-scheduler=fcfs", *QUICK, "-v")
    result.stdout.fnmatch_lines(["*test_own.py::test_own PASSED*", "*::test_state_machine PASSED*"])
    assert result.ret == 0


def test_ini_key_chooses_the_scheduler(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nschedspec_scheduler = static\nschedspec_examples = 5\n")
    result = pytester.runpytest(*SUITE, "--schedspec-steps=10", "-k", "state_machine", "-v")
    result.stdout.fnmatch_lines(["*test_state_machine PASSED*"])
    assert result.ret == 0


def test_without_a_scheduler_the_suite_is_a_usage_error_and_own_tests_skip(pytester: pytest.Pytester) -> None:
    """Naming the suite without a scheduler would skip every test and pass (issue 28): a usage error. A
    project's own test that uses the fixture skips, saying why."""
    result = pytester.runpytest(*SUITE, "-k", "state_machine")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*no scheduler given: pass --schedspec-scheduler=NAME*"])
    pytester.makepyfile(test_own="def test_own(schedspec_scheduler_name):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    result.stdout.fnmatch_lines(["*no scheduler given: pass --schedspec-scheduler=NAME*"])
    assert result.parseoutcomes().get("skipped") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--schedspec-scheduler=no-such-scheduler",), "*--schedspec-scheduler: *'no-such-scheduler': unknown; known: *"),
        (("--schedspec-scheduler=no_such_module:factory",), "*--schedspec-scheduler: *cannot load*"),
        (("--schedspec-scheduler=fcfs", "--schedspec-examples=0"), "*--schedspec-examples: must be at least 1 (got 0)*"),
        (("--schedspec-scheduler=fcfs", "--schedspec-seed=x"), "*--schedspec-seed: must be an integer (got 'x')*"),
    ],
    ids=["unknown-name", "unimportable-factory", "zero-examples", "seed-not-a-number"],
)
def test_a_bad_option_is_a_usage_error_naming_it(pytester: pytest.Pytester, args: tuple[str, ...], message: str) -> None:
    result = pytester.runpytest(*SUITE, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
