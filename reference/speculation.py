"""Speculative decoding's model inputs for simulated runs: what a drafter proposes after each step and how
many drafts the model accepts, from a seeded acceptance model of the scenario.

Both are inputs to the spec (:class:`~schedspec.spec.state.SpeculativeOutput`), chosen by the model, as
sampled tokens are. In vLLM the drafter runs in the worker (n-gram lookup, EAGLE, MTP) and hands its
proposals to ``Scheduler.update_draft_token_ids`` after the step (``EngineCore.post_step``); the
rejection sampler decides the accepted prefix (``ModelRunnerOutput.sampled_token_ids``: the accepted
drafts, then one sampled token). Here, for runs without a real model:

- :class:`AcceptancePattern`, per request: how many drafts the drafter proposes after each of the
  request's steps that sample (``num_drafts``, cycled) and how many of the drafts it verifies the model
  accepts at each verification (``accepted``, cycled; ``None`` = all of them). The scenario format's
  ``acceptance`` field (``schedspec/data/cases/README.md``) is one of these.
- :class:`Speculation`: a run's patterns (a default for requests without one: every draft accepted, or a
  seeded per-draft acceptance rate), the draft ids and the per-request counters. :meth:`Speculation.accept`
  gives the accepted count of an item; :meth:`Speculation.propose` the drafts proposed after a step.

Draft ids are deterministic: the draft for output token ``j`` (1-based) of a request is the
end-of-sequence id when the scenario says the model emits it there (``eos_at_output == j``; so an
accepted draft can end the request: a stop inside the accepted drafts), else a pseudo-random id in
``[1, vocab_size)`` from the request id and ``j``. Acceptance never depends on the ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import attrs

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.persistent import evolve_request
from schedspec.spec.request import Request
from schedspec.spec.state import ScheduledRequest, SchedulerState, SpeculativeOutput, StepPlan
from schedspec.spec.transitions import stop_reason
from schedspec.spec.workload import DEFAULT_VOCAB_SIZE, EOS_TOKEN_ID

ACCEPT_ALL = "all"
ACCEPT_NONE = "none"


def _tuple_or_none(value):
    return None if value is None else tuple(value)


@attrs.frozen
class AcceptancePattern:
    """One request's speculative-decoding behaviour in a simulated run.

    Attributes:
        num_drafts: drafts proposed after each step in which the request samples and goes on, cycled
            (tokens; each capped at ``num_speculative_tokens``); ``None`` = always
            ``num_speculative_tokens``. A 0 means no proposal that time (vLLM's n-gram drafter finds
            no match).
        accepted: drafts accepted at each of the request's verifications (a step whose item carries
            d > 0 drafts), cycled, each capped at d; ``None`` = all d.

    Raises:
        ValueError: a count is negative or not an integer, or a list is empty.
    """

    num_drafts: tuple[int, ...] | None = attrs.field(default=None, converter=_tuple_or_none)
    accepted: tuple[int, ...] | None = attrs.field(default=None, converter=_tuple_or_none)

    def __attrs_post_init__(self) -> None:
        for name in ("num_drafts", "accepted"):
            values = getattr(self, name)
            if values is None:
                continue
            if not values:
                raise ValueError(f"{name}: an empty list (give at least one count, or leave it out)")
            for value in values:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{name}: {value!r} is not an integer >= 0")

    @classmethod
    def from_json(cls, value: object) -> AcceptancePattern:
        """A pattern from the scenario format: ``"all"``, ``"none"``, or ``{"num_drafts": [...],
        "accepted": [...]}`` (either key may be left out; a bare integer stands for a one-element list).

        Raises:
            ValueError: any other value (the message names the part that is wrong).
        """
        if value == ACCEPT_ALL:
            return cls()
        if value == ACCEPT_NONE:
            return cls(accepted=(0,))
        if not isinstance(value, dict):
            raise ValueError(f"{value!r}: expected \"all\", \"none\" or an object with num_drafts and/or accepted")
        unknown = set(value) - {"num_drafts", "accepted"}
        if unknown:
            raise ValueError(f"unknown key {sorted(unknown)[0]!r} (expected num_drafts, accepted)")

        def counts(name: str):
            raw = value.get(name)
            if raw is None:
                return None
            if isinstance(raw, int) and not isinstance(raw, bool):
                return (raw,)
            if not isinstance(raw, list):
                raise ValueError(f"{name}: {raw!r} is not a list of integers")
            return tuple(raw)

        return cls(num_drafts=counts("num_drafts"), accepted=counts("accepted"))

    def to_json(self) -> object:
        """The scenario-format value (:meth:`from_json` reads it back)."""
        if self.num_drafts is None and self.accepted is None:
            return ACCEPT_ALL
        if self.num_drafts is None and self.accepted == (0,):
            return ACCEPT_NONE
        data: dict[str, list[int]] = {}
        if self.num_drafts is not None:
            data["num_drafts"] = list(self.num_drafts)
        if self.accepted is not None:
            data["accepted"] = list(self.accepted)
        return data


ALL_ACCEPTED = AcceptancePattern()


def _unit(*parts: object) -> float:
    """A deterministic number in [0, 1) from ``parts`` (sha256: the same in every process)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class Speculation:
    """The drafter and the acceptance model of one simulated run (module docstring).

    Args:
        config: the run's config (``num_speculative_tokens`` k > 0).
        patterns: request id -> its :class:`AcceptancePattern`.
        eos_at_output: request id -> k: the model emits end-of-sequence as output token k (1-based).
        acceptance_rate: for requests without a pattern: each draft is accepted with this probability
            until the first rejection (seeded by ``seed``, the request id and the verification's index);
            ``None`` = every draft accepted.
        seed: seeds ``acceptance_rate``.
        vocab_size: draft ids lie in ``[1, vocab_size)`` (end-of-sequence only where ``eos_at_output`` says).

    Raises:
        ValueError: ``acceptance_rate`` outside [0, 1].
    """

    def __init__(self, config: SchedulerConfig, patterns: Mapping[str, AcceptancePattern] | None = None,
                 eos_at_output: Mapping[str, int] | None = None, acceptance_rate: float | None = None,
                 seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        if acceptance_rate is not None and not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate={acceptance_rate!r}: must be in [0, 1]")
        self.k = config.num_speculative_tokens
        self.patterns = dict(patterns or {})
        self.eos_at_output = dict(eos_at_output or {})
        self.acceptance_rate = acceptance_rate
        self.seed = seed
        self.vocab_size = vocab_size
        self.verifications: dict[str, int] = {}  # request id -> verifications so far
        self.proposals: dict[str, int] = {}  # request id -> proposals so far

    def accept(self, item: ScheduledRequest) -> int:
        """How many of the item's d drafts the model accepts (0 <= a <= d); advances the request's count of
        verifications. Placeholder drafts (``-1``, vLLM's padding) are never accepted."""
        d = len(item.spec_token_ids)
        if not d:
            return 0
        real = next((i for i, t in enumerate(item.spec_token_ids) if t < 0), d)
        index = self.verifications.get(item.request_id, 0)
        self.verifications[item.request_id] = index + 1
        pattern = self.patterns.get(item.request_id)
        if pattern is not None:
            accepted = real if pattern.accepted is None else pattern.accepted[index % len(pattern.accepted)]
        elif self.acceptance_rate is None:
            accepted = real
        else:
            accepted = 0
            while accepted < real and _unit(self.seed, item.request_id, index, accepted) < self.acceptance_rate:
                accepted += 1
        return min(accepted, real)

    def draft_id(self, request_id: str, output_index: int) -> int:
        """The draft proposed for output token ``output_index`` (1-based) of the request (module docstring)."""
        if self.eos_at_output.get(request_id) == output_index:
            return EOS_TOKEN_ID
        return 1 + int(_unit("draft", request_id, output_index) * (self.vocab_size - 1))

    def propose(self, request: Request) -> tuple[int, ...]:
        """The drafts proposed for ``request`` after a step in which it sampled and goes on (``request`` as
        it stands after the step); advances its count of proposals."""
        index = self.proposals.get(request.request_id, 0)
        self.proposals[request.request_id] = index + 1
        pattern = self.patterns.get(request.request_id)
        count = self.k
        if pattern is not None and pattern.num_drafts is not None:
            count = min(self.k, pattern.num_drafts[index % len(pattern.num_drafts)])
        first = len(request.output_token_ids) + 1
        return tuple(self.draft_id(request.request_id, first + i) for i in range(count))

    def output(self, plan: StepPlan, state: SchedulerState, sampled: Mapping[str, int],
               accepted: Mapping[str, int], config: SchedulerConfig) -> SpeculativeOutput:
        """The step's :class:`~schedspec.spec.state.SpeculativeOutput`: ``accepted`` (from :meth:`accept`,
        for the items that verified drafts) and the drafts proposed for every request that sampled in the
        step (``sampled``) and goes on after its accepted drafts and sampled token (the stop check of
        :func:`schedspec.spec.transitions.stop_reason` after each, as ``sample`` applies them). ``state``
        is the state before the step."""
        proposed: dict[str, tuple[int, ...]] = {}
        for item in plan.scheduled:
            token = sampled.get(item.request_id)
            if token is None:
                continue
            request = state.requests[item.request_id]
            outputs = request.output_token_ids
            stopped = False
            for next_token in item.spec_token_ids[:accepted.get(item.request_id, 0)] + (token,):
                outputs += (next_token,)
                if stop_reason(evolve_request(request, output_token_ids=outputs), config) is not None:
                    stopped = True
                    break
            if not stopped:
                drafts = self.propose(evolve_request(request, output_token_ids=outputs))
                if drafts:
                    proposed[item.request_id] = drafts
        return SpeculativeOutput(num_accepted_tokens={r: a for r, a in accepted.items() if a},
                                 draft_token_ids=proposed)
