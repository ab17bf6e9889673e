"""The token-source interface and the default token source: a fake model over a fake paged KV cache.

A token source runs one step: ``execute(plan, state) -> (sampled_token_ids, step_seconds)``, where
``state`` is the state *before* the step and the result holds a token id for each request that
samples in it (:func:`schedspec.spec.state.samples_this_step`). The PyTorch backend
(``schedspec.gpu_backend.Runner``) implements the same interface with a real model.

:class:`FakeModel` keeps one token id per KV slot (``num_kv_blocks * block_size`` slots). Each step it
writes every scheduled token's id into the slot its block table gives, then derives each sampled token
from ids it reads back **through the block table**: a wrong table, a lost or shared block, or a bad
recompute changes the output, so ``outputs_equal_solo`` catches them. A prefix-cache hit's blocks
(``cached_block_ids``) are read, never written: their slots still hold what the request that computed
them wrote, so a hit on the wrong block changes the output too. Its step time comes from a
:class:`~schedspec.reference.cost_model.CostModel`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request
from schedspec.spec.state import (
    MAX_STATE_BLOCKS,
    SchedulerState,
    SpeculativeOutput,
    StepPlan,
)
from schedspec.spec.workload import DEFAULT_VOCAB_SIZE, EOS_TOKEN_ID, _mix, _seed, token_ids

FULL_READ_LIMIT = 16
"""Sequences up to this many tokens are read back whole when they sample; longer ones are read at their
last :data:`SAMPLED_READS` positions and at as many pseudo-random earlier ones chosen from the length
(so the cost stays O(1) per request while any table entry can be probed)."""
SAMPLED_READS = 2


@runtime_checkable
class TokenSource(Protocol):
    """Runs one planned step. ``state`` is the state before the step.

    Returns:
        ``(sampled_token_ids, step_seconds)``: request id -> sampled token id for every request that
        samples this step, and the step's duration in seconds.
    """

    def execute(self, plan: StepPlan, state: SchedulerState) -> tuple[dict[str, int], float]: ...


SpeculativeResult = tuple[dict[str, int], float, SpeculativeOutput]
"""What a token source's ``execute_speculative(plan, state)`` returns with speculative decoding on:
``(sampled_token_ids, step_seconds, speculative)``, ``speculative`` the drafts it accepted per request
that verified drafts and the drafts proposed for each request that sampled
(:class:`~schedspec.spec.state.SpeculativeOutput`). The engine loop calls it instead of ``execute`` when
``num_speculative_tokens > 0``; a token source without it cannot run speculative decoding."""


ACCEPTANCE_PATTERNS = ("all", "none", "rate:P", "upto:N")
"""The per-request acceptance patterns of :class:`AcceptanceModel`: the drafter right at every position, at
none, at each with probability P (0 <= P <= 1), or at every position up to output N and none after. A stop
inside the accepted drafts comes from the workload (``eos_at_output`` within a run of right drafts, or
``max_tokens``)."""


class AcceptanceModel:
    """The seeded acceptance model of speculative decoding: which drafts the drafter gets right.

    :class:`FakeModel` drafts and verifies greedily (:meth:`FakeModel.execute_speculative`): a draft is the
    token the model would sample at its position when this model says the drafter is right there, and
    another token when it says it is wrong; verification accepts drafts while they equal the model's
    tokens. By default the drafter is right with probability ``rate`` at each output position; per request,
    a pattern of :data:`ACCEPTANCE_PATTERNS`. A draw depends only on (seed, request id, output position),
    never on the batch or on how many drafts were scheduled, so with a correct KV cache a request's
    tokens are the same with speculative decoding as without, however it is batched.

    Args:
        rate: probability that the drafter is right at a position (0..1), for requests without a pattern.
        seed: the seed of every draw.
        patterns: request id -> pattern (``"all"``, ``"none"``, ``"rate:0.5"``, ``"upto:12"``).

    Raises:
        ValueError: a rate outside [0, 1] or a pattern not of :data:`ACCEPTANCE_PATTERNS`, naming it.
    """

    def __init__(self, rate: float = 0.7, seed: int = 0, patterns: Mapping[str, str] | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"acceptance rate={rate!r}: must be between 0 and 1")
        self.rate = rate
        self.seed = seed
        self.patterns = {request_id: self._parse(request_id, p) for request_id, p in (patterns or {}).items()}

    @staticmethod
    def _parse(request_id: str, pattern: str) -> tuple[str, float]:
        kind, _, value = pattern.partition(":")
        try:
            if kind in ("all", "none") and not value:
                return kind, 0.0
            if kind == "rate" and 0.0 <= float(value) <= 1.0:
                return kind, float(value)
            if kind == "upto" and int(value) >= 0:
                return kind, float(int(value))
        except ValueError:
            pass
        raise ValueError(f"acceptance pattern {pattern!r} of request {request_id!r}: expected one of "
                         f"{', '.join(ACCEPTANCE_PATTERNS)}")

    def to_dict(self) -> dict[str, Any]:
        """``{"rate", "seed"}`` and, when set, ``patterns`` (request id -> pattern text): what a run record's
        ``conditions.acceptance`` holds."""
        data: dict[str, Any] = {"rate": self.rate, "seed": self.seed}
        if self.patterns:
            data["patterns"] = {request_id: kind if kind in ("all", "none") else
                                f"{kind}:{int(value) if kind == 'upto' else value:g}"
                                for request_id, (kind, value) in self.patterns.items()}
        return data

    def right(self, request_id: str, output: int) -> bool:
        """Whether the drafter's draft for output number ``output`` (1-based) of the request is right."""
        kind, value = self.patterns.get(request_id, ("rate", self.rate))
        if kind == "all":
            return True
        if kind == "none":
            return False
        if kind == "upto":
            return output <= value
        return _mix(_seed(f"{self.seed}:{request_id}"), output) / 2**64 < value


MAX_SIMULATED_KV_BLOCKS = MAX_STATE_BLOCKS
"""Most KV blocks a simulated run may have (:data:`schedspec.spec.state.MAX_STATE_BLOCKS`)."""

MAX_SIMULATED_KV_TOKENS = 100_000_000
"""Most KV slots (``num_kv_blocks * block_size``) :class:`FakeModel` may keep: 8 bytes each, 800 MB."""


def simulation_size_problem(config: SchedulerConfig) -> str | None:
    """Why ``config`` is too large to simulate on this machine (naming the field), or ``None``.

    A valid config can describe a KV cache far larger than any GPU's; the simulation keeps one entry
    per block and the fake model one per slot, so such a config would exhaust memory instead of
    running. Callers refuse it as unusable input before the run.
    """
    if config.num_kv_blocks > MAX_SIMULATED_KV_BLOCKS:
        return (f"num_kv_blocks={config.num_kv_blocks:,}: more than {MAX_SIMULATED_KV_BLOCKS:,} blocks, "
                f"too large to simulate")
    if config.kv_capacity_tokens > MAX_SIMULATED_KV_TOKENS:
        return (f"num_kv_blocks={config.num_kv_blocks:,} * block_size={config.block_size:,} = "
                f"{config.kv_capacity_tokens:,} KV slots: more than {MAX_SIMULATED_KV_TOKENS:,}, too large to simulate")
    return None


def greedy_verify(draft_token_ids: Sequence[int], target_at: Callable[[int], int]) -> tuple[int, int]:
    """Greedy verification of ``d`` drafts, the one definition the fake models and the PyTorch backend's
    runner share: ``target_at(i)`` is the model's greedy token at the ``i``-th verified position (``i`` in
    ``0..d``: after the pending token and ``i`` drafts), asked lazily, only up to the first draft it
    rejects. Returns ``(a, token)``: ``a`` (0..d) drafts are accepted, the longest prefix of the drafts
    equal to the targets, and the request samples ``token = target_at(a)`` (the bonus token after ``d``
    accepted drafts, else the correction of the first rejected one).

    Source: vLLM 0.32 ``vllm/v1/sample/rejection_sampler.py`` ``rejection_greedy_sample_kernel``.
    """
    accepted = 0
    while True:
        token = target_at(accepted)
        if accepted < len(draft_token_ids) and draft_token_ids[accepted] == token:
            accepted += 1
            continue
        return accepted, token


def _pricer(cost_model):
    """``(prefill, decode, attended, pairs, chunks) -> seconds`` for ``cost_model``: its ``step_seconds`` with
    the prefill attention pairs and chunks only when it charges for them (``e`` or ``f`` non-zero), so a
    duck-typed cost model with the three-count ``step_seconds(prefill, decode, attended)`` still works."""
    if getattr(cost_model, "e", 0.0) or getattr(cost_model, "f", 0.0):
        return cost_model.step_seconds
    step_seconds = cost_model.step_seconds
    return lambda prefill, decode, attended, pairs, chunks: step_seconds(prefill, decode, attended)


@functools.lru_cache(maxsize=65536)
def _read_positions(length: int) -> tuple[int, ...]:
    """:meth:`FakeModel.read_positions`, remembered (a run asks for the same lengths again and again)."""
    return tuple(FakeModel.read_positions(length))


class FakeModel:
    """The default token source (module docstring).

    Args:
        config: the scheduler config (sizes the slot array: ``num_kv_blocks * block_size``).
        cost_model: gives each step's duration; default: the ``llama3-8b-a100-80gb`` profile.
        eos_at_output: request id -> k: emit :data:`EOS_TOKEN_ID` as output token k (1-based).
        vocab_size: sampled ids lie in ``[1, vocab_size)`` (EOS only where ``eos_at_output`` says).
        acceptance: speculative decoding's acceptance model (:meth:`execute_speculative`); default an
            :class:`AcceptanceModel` with its defaults.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cost_model=None,
        eos_at_output: Mapping[str, int] | None = None,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        acceptance: AcceptanceModel | None = None,
    ) -> None:
        if cost_model is None:
            from schedspec.reference.cost_model import PROFILES

            cost_model = PROFILES["llama3-8b-a100-80gb"]
        self.config = config
        self.cost_model = cost_model
        self._price = _pricer(cost_model)
        self.eos_at_output = dict(eos_at_output or {})
        self.vocab_size = vocab_size
        self.slots = np.full(config.num_kv_blocks * config.block_size, -1, dtype=np.int64)
        self.acceptance = acceptance or AcceptanceModel()

    def _slots(self, table: tuple[int, ...], start: int, stop: int) -> np.ndarray:
        size = self.config.block_size
        positions = np.arange(start, stop)
        return np.asarray(table, dtype=np.int64)[positions // size] * size + positions % size

    @staticmethod
    def read_positions(length: int) -> list[int]:
        """Positions read back to sample after a sequence of ``length`` tokens (deterministic)."""
        if length <= FULL_READ_LIMIT:
            return list(range(length))
        earlier = length - SAMPLED_READS
        x = length
        probes = []
        for _ in range(SAMPLED_READS):
            x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
            probes.append((x >> 33) % earlier)
        return probes + list(range(earlier, length))

    def _sample_all(self, pending: list[tuple[str, tuple[int, ...], int]]) -> dict[str, int]:
        """Sample for every ``(request_id, block table, length)`` with one gather from the slot array."""
        size = self.config.block_size
        slot_ids: list[int] = []
        bounds: list[int] = []
        for _, table, length in pending:
            slot_ids.extend([table[p // size] * size + p % size for p in _read_positions(length)])
            bounds.append(len(slot_ids))
        values = self.slots.take(slot_ids).tolist() if slot_ids else []
        sampled = {}
        start = 0
        for (request_id, _, length), stop in zip(pending, bounds, strict=True):
            digest = hash((length, *values[start:stop])) & 0xFFFFFFFFFFFFFFFF
            sampled[request_id] = 1 + digest % (self.vocab_size - 1)
            start = stop
        return sampled

    def _token_at(self, values: list[int], length: int) -> int:
        """The token sampled after a sequence of ``length`` tokens whose :meth:`read_positions` hold
        ``values`` (the one definition of :meth:`_sample_all`'s token)."""
        return 1 + (hash((length, *values)) & 0xFFFFFFFFFFFFFFFF) % (self.vocab_size - 1)

    def _read(self, table: tuple[int, ...], length: int) -> list[int]:
        size = self.config.block_size
        return self.slots.take([table[p // size] * size + p % size for p in _read_positions(length)]).tolist()

    def execute_speculative(self, plan: StepPlan, state: SchedulerState) -> SpeculativeResult:
        """:meth:`execute` with speculative decoding (:data:`SpeculativeResult`), verified greedily over the
        fake KV cache: a decode's drafts are written into the slots after its pending token; the model's
        token at each of those positions is read back **through the block table** (the EOS at the output
        ``eos_at_output`` names); drafts are accepted while they equal it, and the token sampled is the
        model's at the first mismatch (or after the last draft). Then, for each request that sampled, the
        drafts of its next step: ``min(k, max_model_len - num_tokens)`` (vLLM's n-gram drafter trims so:
        ``ngram_proposer.py``, ``k = min(k, max_model_len - total_token)``), each the model's token at its
        position computed from the request's tokens (not the cache) where the :class:`AcceptanceModel`
        says the drafter is right, another token where it is wrong. A wrong block table, a rejected
        position kept as computed or an accepted one lost makes the model's tokens differ from the
        drafter's and from a solo run's."""
        sampled, seconds = self.execute(plan, state)
        requests = state.requests
        accepted: dict[str, int] = {}
        kept: dict[str, tuple[int, ...]] = {}  # the accepted drafts of each request that verified some
        eos_at_output = self.eos_at_output
        for item in plan.scheduled:
            drafts = item.spec_token_ids
            if not drafts or item.request_id not in sampled:
                continue
            request = requests[item.request_id]
            table = request.block_ids + item.new_block_ids
            eos_at = eos_at_output.get(item.request_id)

            def target_at(a: int, request: Request = request, table: tuple[int, ...] = table,
                          eos_at: int | None = eos_at) -> int:
                if eos_at == request.num_output_tokens + 1 + a:
                    return EOS_TOKEN_ID
                length = request.num_tokens + a
                return self._token_at(self._read(table, length), length)

            a, sampled[item.request_id] = greedy_verify(drafts, target_at)
            accepted[item.request_id] = a
            kept[item.request_id] = drafts[:a]
        proposals = {}
        for request_id, token in sampled.items():
            request = requests[request_id]
            extra = (*kept.get(request_id, ()), token)
            drafts = self._drafts(request, extra)
            if drafts:
                proposals[request_id] = drafts
        return sampled, seconds, SpeculativeOutput(accepted, proposals)

    def _drafts(self, request: Request, extra: tuple[int, ...]) -> tuple[int, ...]:
        """The drafts proposed for ``request`` (as before the step) after it appends ``extra`` (its accepted
        drafts and the token sampled): :meth:`execute_speculative`."""
        length = request.num_tokens + len(extra)
        count = min(self.config.num_speculative_tokens, self.config.max_model_len - length)
        if count <= 0:
            return ()
        outputs = request.num_output_tokens + len(extra)
        known = request.num_tokens
        sequence = list(extra)

        def value(position: int) -> int:
            if position < known:
                return int(token_ids(request, position, position + 1)[0])
            return sequence[position - known]

        eos = self.eos_at_output.get(request.request_id)
        drafts = []
        for index in range(count):
            output = outputs + 1 + index
            position = length + index
            token = EOS_TOKEN_ID if eos == output else self._token_at(
                [value(p) for p in _read_positions(position)], position)
            if not self.acceptance.right(request.request_id, output):
                token = 1 + token % (self.vocab_size - 1)  # another id (a wrong draft)
            drafts.append(token)
            sequence.append(token)
        return tuple(drafts)

    def execute(self, plan: StepPlan, state: SchedulerState) -> tuple[dict[str, int], float]:
        """Run the step (module docstring). A decode's drafts are written after its pending token and its
        token is sampled as if it had none (:meth:`execute_speculative` verifies them)."""
        sampled: dict[str, int] = {}
        pending: list[tuple[str, tuple[int, ...], int]] = []
        decode_slots: list[int] = []
        decode_ids: list[int] = []
        size = self.config.block_size
        prefill_tokens = decode_tokens = attended = pairs = chunks = 0
        requests = state.requests
        eos_at_output = self.eos_at_output
        for item in plan.scheduled:
            request = requests[item.request_id]
            table = request.block_ids + item.cached_block_ids + item.new_block_ids if (
                item.new_block_ids or item.cached_block_ids) else request.block_ids
            start = item.num_computed_tokens
            stop = start + item.num_tokens
            attended += stop
            prompt_len = request.prompt_len
            num_tokens = request.num_tokens
            # request.is_decode, inlined: one token pending, past the prompt
            drafts = item.spec_token_ids
            if num_tokens - request.num_computed_tokens == 1 and request.num_computed_tokens >= prompt_len:
                # one slot, the last sampled token (batched into one write below), then the drafts
                decode_slots.append(table[start // size] * size + start % size)
                decode_ids.append(request.output_token_ids[start - prompt_len])
                decode_tokens += 1
                if drafts:
                    for offset, draft in enumerate(drafts, 1):
                        decode_slots.append(table[(start + offset) // size] * size + (start + offset) % size)
                        decode_ids.append(draft)
                    decode_tokens += len(drafts)
                    stop -= len(drafts)  # the sequence ends here; the drafts are past it
            else:
                self.slots[self._slots(table, start, stop)] = token_ids(request, start, stop)
                n = item.num_tokens
                prefill_tokens += n
                pairs += n * start + n * (n + 1) // 2
                chunks += 1
            if stop == num_tokens:  # samples_this_step
                if eos_at_output and eos_at_output.get(item.request_id) == num_tokens - prompt_len + 1:
                    sampled[item.request_id] = EOS_TOKEN_ID
                else:
                    pending.append((item.request_id, table, stop))
        if decode_slots:
            self.slots[decode_slots] = decode_ids
        sampled.update(self._sample_all(pending))
        return sampled, self._price(prefill_tokens, decode_tokens, attended, pairs, chunks)


class CostOnlyModel:
    """A token source that keeps no KV at all: every sampled token is ``1`` (never EOS unless
    ``eos_at_output`` says so) and the step time comes from the cost model.

    The lab uses it with ``--no-check``: the fake KV of :class:`FakeModel` exists to make a wrong block
    table change the output, which only matters when something checks the output.
    """

    def __init__(self, config: SchedulerConfig, cost_model=None, eos_at_output: Mapping[str, int] | None = None,
                 acceptance: AcceptanceModel | None = None) -> None:
        if cost_model is None:
            from schedspec.reference.cost_model import PROFILES

            cost_model = PROFILES["llama3-8b-a100-80gb"]
        self.config = config
        self.cost_model = cost_model
        self._price = _pricer(cost_model)
        self.eos_at_output = dict(eos_at_output or {})
        self.acceptance = acceptance or AcceptanceModel()
        """Speculative decoding's acceptance model (:meth:`execute_speculative`)."""

    def execute_speculative(self, plan: StepPlan, state: SchedulerState) -> SpeculativeResult:
        """:meth:`execute` with speculative decoding (:data:`SpeculativeResult`), without KV: the model's
        token at every output is ``1`` (``EOS_TOKEN_ID`` where ``eos_at_output`` says), a draft is that
        token where the :class:`AcceptanceModel` says the drafter is right and ``2`` where it is wrong, and
        verification accepts drafts while they equal the model's tokens; so a request accepts exactly what
        :class:`FakeModel` accepts for the same acceptance model. Drafts proposed after the step:
        ``min(k, max_model_len - num_tokens)`` for each request that sampled, as :class:`FakeModel`."""
        sampled, seconds = self.execute(plan, state)
        requests = state.requests
        accepted: dict[str, int] = {}
        proposals: dict[str, tuple[int, ...]] = {}
        config = self.config
        for item in plan.scheduled:
            request_id = item.request_id
            if request_id not in sampled:
                continue
            request = requests[request_id]
            outputs = request.num_output_tokens
            drafts = item.spec_token_ids
            a = 0
            if drafts:
                a, sampled[request_id] = greedy_verify(
                    drafts, lambda i, request_id=request_id, outputs=outputs: self._model_token(request_id,
                                                                                              outputs + 1 + i))
                accepted[request_id] = a
            done = outputs + a + 1  # outputs after the step
            count = min(config.num_speculative_tokens, config.max_model_len - (request.num_tokens + a + 1))
            if count > 0:
                proposals[request_id] = tuple(
                    self._model_token(request_id, done + i) if self.acceptance.right(request_id, done + i) else 2
                    for i in range(1, count + 1))
        return sampled, seconds, SpeculativeOutput(accepted, proposals)

    def _model_token(self, request_id: str, output: int) -> int:
        """The model's token at output number ``output`` (1-based) of the request: ``EOS_TOKEN_ID`` where
        ``eos_at_output`` says, else ``1``."""
        eos = self.eos_at_output
        return EOS_TOKEN_ID if eos and eos.get(request_id) == output else 1

    def execute(self, plan: StepPlan, state: SchedulerState) -> tuple[dict[str, int], float]:
        """Run the step: its cost, and token ``1`` for each request that samples (a decode's drafts are
        decode tokens; its token is sampled as if it had none: :meth:`execute_speculative` verifies them)."""
        sampled: dict[str, int] = {}
        prefill_tokens = decode_tokens = attended = pairs = chunks = 0
        eos = self.eos_at_output
        requests = state.requests
        for item in plan.scheduled:
            request = requests[item.request_id]
            stop = item.num_computed_tokens + item.num_tokens
            attended += stop
            num_tokens, computed, prompt_len = request.num_tokens, request.num_computed_tokens, request.prompt_len
            outputs = num_tokens - prompt_len
            if num_tokens - computed == 1 and computed >= prompt_len:  # request.is_decode, inlined
                decode_tokens += item.num_tokens  # 1, plus the drafts it verifies
                stop -= len(item.spec_token_ids)  # the sequence ends here; the drafts are past it
            else:
                n = item.num_tokens
                prefill_tokens += n
                pairs += n * item.num_computed_tokens + n * (n + 1) // 2
                chunks += 1
            if stop == num_tokens:
                sampled[item.request_id] = EOS_TOKEN_ID if eos and eos.get(item.request_id) == outputs + 1 else 1
        return sampled, self._price(prefill_tokens, decode_tokens, attended, pairs, chunks)
