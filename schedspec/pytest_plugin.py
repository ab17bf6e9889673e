"""The pytest plugin: run schedspec's conformance suite against any scheduler, in any project's CI.

Installed with schedspec (entry point ``pytest11``, name ``schedspec``), so every pytest run in an
environment where schedspec is installed has these options:

``--schedspec-scheduler NAME``
    The scheduler under test: a registered name (``fcfs``, ``static``, ``shortest-prompt-first``,
    ``priority``, ``vllm-v1``, ``vllm-v1-priority``, the engine adapters such as ``nanovllm``) or
    ``package.module:factory``, a callable taking a
    :class:`~schedspec.spec.config.SchedulerConfig` and returning an object with the ``Scheduler``
    protocol (:mod:`schedspec.reference.scheduler`), exactly as ``schedspec lab --scheduler``.
    Giving it adds the conformance suite (:mod:`schedspec.conformance`) to the session, next to
    whatever else pytest collects. The ini key ``schedspec_scheduler`` is the default.
``--schedspec-examples N``
    Hypothesis examples for the stateful test (default: the active Hypothesis profile's
    ``max_examples``, 100 unless a profile says otherwise). Ini key ``schedspec_examples``.
``--schedspec-steps N``
    Rules per example (default: the profile's ``stateful_step_count``, Hypothesis' 50).
``--schedspec-seed S``
    Seed the stateful test (Hypothesis' ``@seed``), so that a run is repeatable; without it the
    seed is random (or ``--hypothesis-seed``'s), as for any Hypothesis test.

Run only the suite (nothing of your own collected)::

    pytest --pyargs schedspec.conformance --schedspec-scheduler=mypkg.adapter:make_scheduler

or put it in your project's configuration and run ``pytest`` as usual (the suite is added)::

    [tool.pytest.ini_options]
    schedspec_scheduler = "mypkg.adapter:make_scheduler"
    schedspec_examples = "200"

A bad option value (an unknown scheduler, a factory that cannot be imported, a count below 1) is a
usage error (pytest exit status 4) naming the option, before anything is collected; so is naming the
suite (``--pyargs schedspec.conformance``) without a scheduler, where every test would be skipped and the
run would pass. The fixtures
``schedspec_scheduler_name`` and ``schedspec_settings`` are available to your own tests too (e.g. to
run :class:`schedspec.testing.SchedulerStateMachine` subclasses with the same settings).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

SUITE_MODULE = "schedspec.conformance"
"""The module holding the conformance suite's tests."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer (got {text!r})") from None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("schedspec", "schedspec conformance suite (schedspec.conformance)")
    group.addoption("--schedspec-scheduler", metavar="NAME", default=None,
                    help="run the schedspec conformance suite against this scheduler: a registered name "
                         "(fcfs, vllm-v1, nanovllm, ...) or package.module:factory")
    group.addoption("--schedspec-examples", metavar="N", type=_positive, default=None,
                    help="Hypothesis examples for the stateful conformance test (default: the active "
                         "Hypothesis profile's max_examples)")
    group.addoption("--schedspec-steps", metavar="N", type=_positive, default=None,
                    help="rules per stateful example (default: the profile's stateful_step_count)")
    group.addoption("--schedspec-seed", metavar="S", type=_seed, default=None,
                    help="seed for the stateful conformance test (repeatable runs)")
    parser.addini("schedspec_scheduler", "default for --schedspec-scheduler", default="")
    parser.addini("schedspec_examples", "default for --schedspec-examples", default="")


def scheduler_name(config: pytest.Config) -> str | None:
    """The scheduler chosen by ``--schedspec-scheduler`` or the ``schedspec_scheduler`` ini key."""
    return config.getoption("schedspec_scheduler") or config.getini("schedspec_scheduler") or None


def _examples(config: pytest.Config) -> int | None:
    given = config.getoption("schedspec_examples")
    if given is not None:
        return given
    text = config.getini("schedspec_examples")
    if not text:
        return None
    try:
        return _positive(str(text))
    except argparse.ArgumentTypeError as error:
        raise pytest.UsageError(f"ini key schedspec_examples: {error}") from None


def _check_scheduler(name: str) -> None:
    """Build ``name`` on a small valid config, so that a typo is a usage error, not 1 failed test."""
    from schedspec.reference.scheduler import UnknownScheduler, UnsupportedFeature, make_scheduler
    from schedspec.spec.config import SchedulerConfig

    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                             max_model_len=32)
    try:
        make_scheduler(name, config)
    except UnknownScheduler as error:
        raise pytest.UsageError(f"--schedspec-scheduler: {error}") from None
    except UnsupportedFeature:
        pass  # a scheduler may refuse this one config; each test then skips the configs it refuses


def _suite_path() -> Path:
    import importlib.util

    found = importlib.util.find_spec(SUITE_MODULE)
    assert found is not None and found.origin is not None
    return Path(found.origin)


def _suite_named(config: pytest.Config, suite: Path) -> bool:
    """Whether the command line names the suite (as a path, or a module with ``--pyargs``)."""
    named = {str(Path(a.split("::")[0]).resolve()) for a in config.args} | set(config.args)
    return SUITE_MODULE in named or str(suite) in named or any(a.startswith(SUITE_MODULE + "::") for a in config.args)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    name = scheduler_name(config)
    _examples(config)  # a bad ini value is a usage error now
    suite = _suite_path()
    if name is None:
        if _suite_named(config, suite):
            # every test would skip and the run pass: a CI with a misspelt option would stay green
            raise pytest.UsageError(
                f"{SUITE_MODULE}: no scheduler given: pass --schedspec-scheduler=NAME (or set the "
                "schedspec_scheduler ini key); without one every conformance test would be skipped")
        return
    _check_scheduler(name)
    if not _suite_named(config, suite):  # add the suite unless it was named on the command line
        config.args.append(str(suite))


@pytest.fixture(scope="session")
def schedspec_scheduler_name(pytestconfig: pytest.Config) -> str:
    """The scheduler under test (``--schedspec-scheduler``); skips the test when none was given."""
    name = scheduler_name(pytestconfig)
    if name is None:
        pytest.skip("no scheduler given: pass --schedspec-scheduler=NAME (or set the schedspec_scheduler ini key)")
    return name


@pytest.fixture(scope="session")
def schedspec_settings(pytestconfig: pytest.Config) -> Any:
    """Hypothesis settings for the stateful conformance test: the active profile, with
    ``--schedspec-examples`` and ``--schedspec-steps`` applied, no deadline (an engine's first step
    may compile or allocate) and the ``too_slow`` health check off (engine adapters are slow)."""
    from hypothesis import HealthCheck, settings

    changes: dict[str, Any] = {"deadline": None}
    examples = _examples(pytestconfig)
    if examples is not None:
        changes["max_examples"] = examples
    steps = pytestconfig.getoption("schedspec_steps")
    if steps is not None:
        changes["stateful_step_count"] = steps
    current = settings()
    changes["suppress_health_check"] = sorted({*current.suppress_health_check, HealthCheck.too_slow},
                                              key=lambda h: h.value)
    return settings(current, **changes)


@pytest.fixture(scope="session")
def schedspec_seed(pytestconfig: pytest.Config) -> int | None:
    """``--schedspec-seed``, or ``None`` (Hypothesis chooses)."""
    return pytestconfig.getoption("schedspec_seed")
