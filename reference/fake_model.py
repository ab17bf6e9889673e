"""The token-source interface and the default token source: a fake model over a fake paged KV cache.

A token source runs one step: ``execute(plan, state) -> (sampled_token_ids, step_seconds)``, where
``state`` is the state *before* the step and the result holds a token id for each request that
samples in it (:func:`schedspec.spec.state.samples_this_step`); with speculative decoding a third
element, the step's :class:`~schedspec.spec.state.SpeculativeOutput` (:func:`speculative_result`). The PyTorch backend
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
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.state import MAX_STATE_BLOCKS, NO_SPECULATION, SchedulerState, SpeculativeOutput, StepPlan
from schedspec.spec.workload import DEFAULT_VOCAB_SIZE, EOS_TOKEN_ID, token_ids

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


def speculative_result(result: tuple) -> tuple[dict[str, int], float, SpeculativeOutput]:
    """A token source's ``execute`` result as ``(sampled, seconds, speculative)``: a source with speculative
    decoding returns a third element, the step's :class:`~schedspec.spec.state.SpeculativeOutput` (drafts
    accepted, drafts proposed after the step); one without returns two (:data:`NO_SPECULATION`)."""
    if len(result) == 3:
        return result[0], result[1], result[2]
    return result[0], result[1], NO_SPECULATION




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
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cost_model=None,
        eos_at_output: Mapping[str, int] | None = None,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        speculation=None,
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
        self.speculation = speculation
        """Speculative decoding's drafter and acceptance model
        (:class:`~schedspec.reference.speculation.Speculation`), or ``None`` without it."""

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

    def execute(self, plan: StepPlan, state: SchedulerState) -> tuple[dict[str, int], float]:
        sampled: dict[str, int] = {}
        pending: list[tuple[str, tuple[int, ...], int]] = []
        decode_slots: list[int] = []
        decode_ids: list[int] = []
        size = self.config.block_size
        prefill_tokens = decode_tokens = attended = pairs = chunks = 0
        requests = state.requests
        eos_at_output = self.eos_at_output
        accepted: dict[str, int] = {}
        for item in plan.scheduled:
            request = requests[item.request_id]
            table = request.block_ids + item.cached_block_ids + item.new_block_ids if (
                item.new_block_ids or item.cached_block_ids) else request.block_ids
            start = item.num_computed_tokens
            stop = start + item.num_tokens
            attended += stop
            prompt_len = request.prompt_len
            num_tokens = request.num_tokens
            if item.spec_token_ids:
                # speculative decoding: the sequence's pending position(s), then the drafts after it; the
                # token is sampled after the accepted drafts, read back through the table like any other
                d = len(item.spec_token_ids)
                if start < num_tokens:
                    self.slots[self._slots(table, start, num_tokens)] = token_ids(request, start, num_tokens)
                self.slots[self._slots(table, stop - d, stop)] = np.asarray(item.spec_token_ids, dtype=np.int64)
                if request.is_decode:
                    decode_tokens += item.num_tokens
                else:
                    prefill_tokens += item.num_tokens
                    pairs += item.num_tokens * start + item.num_tokens * (item.num_tokens + 1) // 2
                    chunks += 1
                if stop - d == num_tokens:  # samples_this_step
                    a = self.speculation.accept(item) if self.speculation is not None else 0
                    accepted[item.request_id] = a
                    if eos_at_output and eos_at_output.get(item.request_id) == num_tokens - prompt_len + a + 1:
                        sampled[item.request_id] = EOS_TOKEN_ID
                    else:
                        pending.append((item.request_id, table, num_tokens + a))
                continue
            # request.is_decode, inlined: one token pending, past the prompt
            if num_tokens - request.num_computed_tokens == 1 and request.num_computed_tokens >= prompt_len:
                # one slot, the last sampled token (batched into one write below)
                decode_slots.append(table[start // size] * size + start % size)
                decode_ids.append(request.output_token_ids[start - prompt_len])
                decode_tokens += 1
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
        seconds = self._price(prefill_tokens, decode_tokens, attended, pairs, chunks)
        if self.speculation is None:
            return sampled, seconds
        return sampled, seconds, self.speculation.output(plan, state, sampled, accepted, self.config)


class CostOnlyModel:
    """A token source that keeps no KV at all: every sampled token is ``1`` (never EOS unless
    ``eos_at_output`` says so) and the step time comes from the cost model.

    The lab uses it with ``--no-check``: the fake KV of :class:`FakeModel` exists to make a wrong block
    table change the output, which only matters when something checks the output.
    """

    def __init__(self, config: SchedulerConfig, cost_model=None, eos_at_output: Mapping[str, int] | None = None) -> None:
        if cost_model is None:
            from schedspec.reference.cost_model import PROFILES

            cost_model = PROFILES["llama3-8b-a100-80gb"]
        self.cost_model = cost_model
        self._price = _pricer(cost_model)
        self.eos_at_output = dict(eos_at_output or {})

    def execute(self, plan: StepPlan, state: SchedulerState) -> tuple[dict[str, int], float]:
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
                decode_tokens += 1
            else:
                n = item.num_tokens
                prefill_tokens += n
                pairs += n * item.num_computed_tokens + n * (n + 1) // 2
                chunks += 1
            if stop == num_tokens:
                sampled[item.request_id] = EOS_TOKEN_ID if eos and eos.get(item.request_id) == outputs + 1 else 1
        return sampled, self._price(prefill_tokens, decode_tokens, attended, pairs, chunks)
