"""schedspec: an executable specification of iteration-level LLM inference schedulers.

The public API: the spec (:mod:`schedspec.spec`), the reference schedulers and engine loop
(:mod:`schedspec.reference`), the reusable Hypothesis state machine (:mod:`schedspec.testing`) and the
``schedspec`` command line (:mod:`schedspec.cli`). The most used names are re-exported here.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "schedspec.reference.engine", "RunResult": "schedspec.reference.engine",
    "SCHEDULERS": "schedspec.reference.scheduler", "Scheduler": "schedspec.reference.scheduler",
    "make_scheduler": "schedspec.reference.scheduler",
    "ConfigError": "schedspec.spec", "RequestSpec": "schedspec.spec", "SchedulerConfig": "schedspec.spec",
    "SchedulerState": "schedspec.spec", "StepPlan": "schedspec.spec", "StepRecord": "schedspec.spec",
    "violated_rules": "schedspec.spec",
}
"""Each re-exported name -> its module, imported on first use (PEP 562), so that a command importing one
subpackage (``schedspec check`` needs only the spec) does not pay for the reference schedulers' import."""

if TYPE_CHECKING:  # pragma: no cover - for type checkers and editors
    from schedspec.reference.engine import Engine, RunResult
    from schedspec.reference.scheduler import SCHEDULERS, Scheduler, make_scheduler
    from schedspec.spec import (
        ConfigError,
        RequestSpec,
        SchedulerConfig,
        SchedulerState,
        StepPlan,
        StepRecord,
        violated_rules,
    )


def __getattr__(name: str) -> Any:
    """A re-exported name, imported from its module on first use.

    Raises:
        AttributeError: ``name`` is not one of :data:`__all__`."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'schedspec' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "SCHEDULERS", "ConfigError", "Engine", "RequestSpec", "RunResult", "Scheduler", "SchedulerConfig",
    "SchedulerState", "StepPlan", "StepRecord", "make_scheduler", "violated_rules",
]
