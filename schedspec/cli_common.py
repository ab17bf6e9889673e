"""Conventions shared by every ``schedspec`` command.

- ``--scheduler NAME``: a registered scheduler (``schedspec.reference.scheduler.SCHEDULERS``) or
  ``module:factory``.
- ``--set key=value`` (repeatable): change a :class:`~schedspec.spec.config.SchedulerConfig` field.
  Values are parsed as JSON scalars where possible (``16``, ``true``), else kept as strings.
- Exit status: 0 all checks passed; 1 a check failed (expectation, invariant, divergence, theorem
  not proved), naming it and the step; 2 unusable input (file, line and field named, no traceback);
  3 the chosen scheduler cannot express the scenario (a feature it lacks).
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click

from schedspec.spec.config import ConfigError, SchedulerConfig

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNSUPPORTED = 3


def fail(message: str, status: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print ``schedspec: error: message`` to stderr and exit with ``status``."""
    click.echo(f"schedspec: error: {message}", err=True)
    sys.exit(status)


def parse_value(text: str) -> Any:
    """A ``--set`` value: a JSON scalar (int, float, true/false, null) or else the string itself."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, int | float | bool | str) or value is None else text


def parse_sets(items: tuple[str, ...]) -> dict[str, Any]:
    """``("block_size=16", ...)`` -> ``{"block_size": 16, ...}``; exits 2 on a malformed item."""
    changes: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            fail(f"--set {item!r}: expected key=value")
        changes[key.strip()] = parse_value(value.strip())
    return changes


def build_config(base: dict[str, Any], changes: dict[str, Any], where: str = "--set") -> SchedulerConfig:
    """``SchedulerConfig`` from ``base`` with ``changes`` applied; exits 2 naming the field on error."""
    data = dict(base)
    data.update(changes)
    try:
        return SchedulerConfig.from_dict(data)
    except ConfigError as error:
        fail(f"{where}: {error}")
    except TypeError as error:
        fail(f"{where}: {error}")


scheduler_option = click.option(
    "--scheduler", "scheduler_name", default=None, metavar="NAME",
    help="Scheduler: fcfs, static, shortest-prompt-first, priority, vllm-v1, vllm-v1-priority, or module:factory.",
)
set_option = click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE",
    help="Change a SchedulerConfig field (repeatable), e.g. --set max_num_seqs=8.",
)
