"""schedspec: an executable specification of iteration-level LLM inference schedulers.

The public API: the spec (:mod:`schedspec.spec`), the reference schedulers and engine loop
(:mod:`schedspec.reference`), the reusable Hypothesis state machine (:mod:`schedspec.testing`) and the
``schedspec`` command line (:mod:`schedspec.cli`). The most used names are re-exported here.
"""

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

__all__ = [
    "SCHEDULERS", "ConfigError", "Engine", "RequestSpec", "RunResult", "Scheduler", "SchedulerConfig",
    "SchedulerState", "StepPlan", "StepRecord", "make_scheduler", "violated_rules",
]
