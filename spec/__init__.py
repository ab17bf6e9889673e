"""The executable specification of an iteration-level LLM scheduler.

Read it in this order; each module is short and cites where its rules come from:

1. :mod:`~schedspec.spec.config`: the limits (``block_size``, ``num_kv_blocks``,
   ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``, chunked prefill, ...).
2. :mod:`~schedspec.spec.request`: a request, its status and its progress.
3. :mod:`~schedspec.spec.admission`: which requests are rejected at arrival.
4. :mod:`~schedspec.spec.state`: the scheduler state and a step's plan.
5. :mod:`~schedspec.spec.rules`: which plans are **allowed** (local rules).
6. :mod:`~schedspec.spec.transitions`: how arrivals, aborts and an allowed step change the state.
7. :mod:`~schedspec.spec.invariants`: what must hold of every state and step.
8. :mod:`~schedspec.spec.properties`: claims about whole runs (progress, no starvation, ...).
9. :mod:`~schedspec.spec.trace` and :mod:`~schedspec.spec.checker`: the step-trace format any engine
   can write (a JSON Schema, ``trace-schema.json``), and the checker that replays it on the spec and
   judges every field.
10. :mod:`~schedspec.spec.incremental`: the same checks at a cost proportional to each step's change.

This package imports nothing from ``schedspec.reference``, ``schedspec.gpu_backend`` or
``schedspec.engines``.
"""

from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import ConfigError, SchedulerConfig, blocks_for_tokens
from schedspec.spec.invariants import INVARIANT_NAMES, check_state, check_step
from schedspec.spec.properties import PROPERTIES
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import RULE_NAMES, Violation, violated_rules
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan, samples_this_step
from schedspec.spec.trace import StepRecord, read_trace, write_trace
from schedspec.spec.transitions import PlanError, abort_request, add_request, apply_plan
from schedspec.spec.workload import EOS_TOKEN_ID, RequestSpec

__all__ = [
    "EOS_TOKEN_ID", "INVARIANT_NAMES", "PROPERTIES", "RULE_NAMES", "ConfigError", "PlanError", "Request",
    "RequestSpec", "RequestStatus", "ScheduledRequest", "SchedulerConfig", "SchedulerState", "StepPlan",
    "StepRecord", "Violation", "abort_request", "add_request", "apply_plan", "blocks_for_tokens", "check_state",
    "check_step", "read_trace", "rejection_reason", "samples_this_step", "violated_rules", "write_trace",
]
