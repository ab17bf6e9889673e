"""The executable specification of an iteration-level LLM scheduler.

Read it in this order; each module is short and cites where its rules come from:

1. :mod:`~schedspec.spec.config`: the limits (``block_size``, ``num_kv_blocks``,
   ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``, chunked prefill, ...).
2. :mod:`~schedspec.spec.request`: a request, its status and its progress (what a decode is).
3. :mod:`~schedspec.spec.admission`: which requests are rejected at arrival.
4. :mod:`~schedspec.spec.state`: the scheduler state and a step's plan (and, for an asynchronous engine, the
   step in flight when the next plan is made: ``InFlightStep``).
5. :mod:`~schedspec.spec.transitions`: the actions (arrive, abort; preempt, reject, schedule,
   sample) and the step as their composition.
6. :mod:`~schedspec.spec.rules`: each action's guard, the rules that say which plans are **allowed**.
7. :mod:`~schedspec.spec.invariants`: what must hold of every state and step.
8. :mod:`~schedspec.spec.properties`: claims about whole runs (progress, no starvation, ...).
9. :mod:`~schedspec.spec.prefix_cache`: prefix caching (chained block hashes, reference counts,
   evictable blocks, hits at admission), which the actions use when ``enable_prefix_caching`` is on.
10. :mod:`~schedspec.spec.trace` and :mod:`~schedspec.spec.checker`: the step-trace format any engine
    can write (a JSON Schema, ``trace-schema.json``), and the checker that replays it on the spec and
    judges every field.

Where a name differs from vLLM's, ``docs/vllm-names.md`` says so and why.

Not on the reading path (each tested equal to the plain definitions above):
:mod:`~schedspec.spec.persistent` (containers shared between states, for speed),
:mod:`~schedspec.spec.incremental` (the checks at a cost proportional to each step's change),
:mod:`~schedspec.spec.workload` (deterministic prompt ids for the requests a trace or scenario
describes) and :mod:`~schedspec.spec.proofs` (the Z3 encoding of the rules and invariants).

This package imports nothing from ``schedspec.reference``, ``schedspec.gpu_backend`` or
``schedspec.engines``.
"""

from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import ConfigError, SchedulerConfig, blocks_for_tokens
from schedspec.spec.invariants import INVARIANT_NAMES, check_state, check_step
from schedspec.spec.properties import PROPERTIES
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import RULE_NAMES, Violation, violated_rules
from schedspec.spec.state import (
    NO_SPECULATION,
    InFlightStep,
    ScheduledRequest,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
    landed_plan,
    samples_this_step,
)
from schedspec.spec.trace import StepRecord, read_trace, write_trace
from schedspec.spec.transitions import PlanError, abort_request, add_request, apply_plan
from schedspec.spec.workload import EOS_TOKEN_ID, RequestSpec

__all__ = [
    "EOS_TOKEN_ID", "INVARIANT_NAMES", "InFlightStep", "NO_SPECULATION", "PROPERTIES", "RULE_NAMES", "ConfigError", "PlanError", "Request",
    "RequestSpec", "RequestStatus", "ScheduledRequest", "SchedulerConfig", "SchedulerState", "SpeculativeOutput", "StepPlan",
    "StepRecord", "Violation", "abort_request", "add_request", "apply_plan", "blocks_for_tokens", "check_state",
    "check_step", "landed_plan", "read_trace", "rejection_reason", "samples_this_step", "violated_rules", "write_trace",
]
