"""Request descriptors: what arrives, when, and with which deterministic token ids.

A :class:`RequestSpec` is the full description of an arriving request (the ``arrivals`` of a
:class:`~schedspec.spec.trace.StepRecord`). Its prompt ids are derived, not stored, so a trace of
tens of millions of prompt tokens costs no memory: positions inside a shared ``prefix`` carry ids
common to the whole group, every other position ids unique to the request (scenario format,
``cases/README.md``). :data:`EOS_TOKEN_ID` appears in no prompt.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import attrs
import numpy as np

from schedspec.spec.request import Request

EOS_TOKEN_ID = 0
"""The end-of-sequence id every workload uses; prompt ids are never 0."""

DEFAULT_VOCAB_SIZE = 4096
"""Token ids lie in ``[1, vocab_size)``; 4096 matches the built-in tiny model of the backend."""


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _mix(seed: int, position: int) -> int:
    # splitmix64 finaliser: a fast, well-spread deterministic function of (seed, position).
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _mix_array(seeds: np.ndarray, positions: np.ndarray, vocab_size: int) -> np.ndarray:
    """:func:`_mix` on uint64 arrays, mapped to ids in ``[1, vocab_size)`` (int64)."""
    with np.errstate(over="ignore"):
        z = seeds + np.uint64(0x9E3779B97F4A7C15) * (positions + np.uint64(1))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (np.uint64(1) + z % np.uint64(vocab_size - 1)).astype(np.int64)


class _DerivedPrompt(Sequence[int]):
    """A prompt of ``length`` ids computed from a few parameters (its ``_key``): equal keys, equal ids.

    Position ``p`` has id ``1 + mix(seed, offset) % (vocab_size - 1)``, where a subclass says which
    ``(seed, offset)`` a position uses (:meth:`_seed_at`, and :meth:`_seeds_at` for arrays); positions
    that belong to no shared part use the request's own seed and their position.
    """

    __slots__ = ("_length", "_own_seed", "_vocab")

    def __init__(self, request_id: str, length: int, vocab_size: int) -> None:
        self._length = length
        self._own_seed = _seed("request:" + request_id)
        self._vocab = vocab_size

    def _seed_at(self, index: int) -> tuple[int, int]:
        raise NotImplementedError

    def _seeds_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _key(self) -> tuple:
        raise NotImplementedError

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step == 1:
                return tuple(int(i) for i in self.array(start, max(start, stop)))
            return tuple(self[i] for i in range(start, stop, step))
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(index)
        seed, offset = self._seed_at(index)
        return 1 + _mix(seed, offset) % (self._vocab - 1)

    def array(self, start: int, stop: int) -> np.ndarray:
        """Ids of positions ``[start, stop)`` as an int64 array of shape ``[stop - start]``, computed
        vectorised (same values as indexing)."""
        seeds, offsets = self._seeds_at(np.arange(start, stop, dtype=np.uint64))
        return _mix_array(seeds, offsets, self._vocab)

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self._key() == other._key()  # type: ignore[attr-defined]
        if isinstance(other, Sequence):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())


class SyntheticPrompt(_DerivedPrompt):
    """A read-only prompt whose ids are computed on access.

    Position ``p < prefix_len`` has id ``f(prefix_group, p)``; others ``f(request_id, p)``; each id in
    ``[1, vocab_size)``.
    """

    __slots__ = ("_prefix_len", "_prefix_seed")

    def __init__(self, request_id: str, length: int, prefix_group: str | None = None,
                 prefix_len: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        super().__init__(request_id, length, vocab_size)
        self._prefix_len = min(prefix_len, length) if prefix_group is not None else 0
        self._prefix_seed = _seed("prefix:" + (prefix_group or ""))

    def _seed_at(self, index: int) -> tuple[int, int]:
        return (self._prefix_seed if index < self._prefix_len else self._own_seed), index

    def _seeds_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seeds = np.where(positions < self._prefix_len, np.uint64(self._prefix_seed), np.uint64(self._own_seed))
        return seeds, positions

    def _key(self) -> tuple:
        return self._length, self._prefix_len, self._prefix_seed, self._own_seed, self._vocab

    def __repr__(self) -> str:
        return f"SyntheticPrompt(len={self._length}, prefix_len={self._prefix_len})"


class BlockHashPrompt(_DerivedPrompt):
    """A read-only prompt made of hashed blocks, as the Mooncake traces describe prompts: block ``k``
    (positions ``[k * block_tokens, (k + 1) * block_tokens)``) has ids ``f(block_hash_ids[k], offset)``,
    ``offset`` the position inside the block; positions past the last hashed block have ids
    ``f(request_id, position)``. Equal hash ids therefore give equal token ids (a shared prefix in the
    trace is a shared prefix of ids, which a prefix cache can hit), different ones different ids (up
    to collisions of ids in ``[1, vocab_size)``); a last block shorter than ``block_tokens`` shares
    the ids it has with any other use of its hash id.

    It lives in the spec, beside :class:`SyntheticPrompt`, because the trace checker rebuilds every
    request from its arrival record (``block_hash_ids``, ``hash_block_tokens``) and imports nothing
    outside the spec; :mod:`schedspec.lab.trace_formats` builds it from a Mooncake trace's
    ``hash_ids`` (512 tokens per block).

    Args:
        request_id: the request (seeds positions past the hashed blocks).
        length: prompt tokens.
        block_hash_ids: one id per block, in order.
        block_tokens: tokens per hashed block (>= 1).
        vocab_size: ids lie in ``[1, vocab_size)``.

    Raises:
        ValueError: ``block_tokens < 1``.
    """

    __slots__ = ("_block_tokens", "_block_seeds", "_hash_ids")

    def __init__(self, request_id: str, length: int, block_hash_ids: Sequence[int], block_tokens: int,
                 vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens}: must be >= 1")
        super().__init__(request_id, length, vocab_size)
        self._block_tokens = block_tokens
        self._hash_ids = tuple(block_hash_ids)
        self._block_seeds = np.array([_seed(f"block:{h}") for h in self._hash_ids], dtype=np.uint64)

    def _seed_at(self, index: int) -> tuple[int, int]:
        block = index // self._block_tokens
        if block < len(self._block_seeds):
            return int(self._block_seeds[block]), index % self._block_tokens
        return self._own_seed, index

    def _seeds_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        blocks = positions // np.uint64(self._block_tokens)
        hashed = blocks < np.uint64(len(self._block_seeds))
        seeds = np.full(positions.shape, np.uint64(self._own_seed), dtype=np.uint64)
        if hashed.any():
            seeds[hashed] = self._block_seeds[blocks[hashed].astype(np.int64)]
        return seeds, np.where(hashed, positions % np.uint64(self._block_tokens), positions)

    def _key(self) -> tuple:
        return self._length, self._block_tokens, self._hash_ids, self._own_seed, self._vocab

    def __repr__(self) -> str:
        return f"BlockHashPrompt(len={self._length}, blocks={len(self._hash_ids)}x{self._block_tokens})"


@attrs.frozen
class RequestSpec:
    """One arriving request, fully described.

    Attributes:
        request_id: unique id.
        prompt_len: prompt tokens.
        max_tokens: most output tokens.
        arrival_step: step before which it is added (scenarios); ``None`` when arrival is by time.
        arrival_time: arrival in seconds on the engine's clock: a trace's time (time-driven runs); in a
            step-driven run the engine loop replaces it with the start of the arrival step on its
            simulated clock (:class:`ArrivalClock`), so a scenario need not give it.
        priority: lower is more urgent (vLLM).
        prefix_group: requests of one group share their first ``prefix_len`` prompt ids.
        prefix_len: tokens of shared prefix.
        abort_at_step: the client aborts it before this step is planned (after the arrivals of that
            step); not before ``arrival_step`` (``ValueError``: the abort would be dropped).
        eos_at_output: the model emits end-of-sequence as output token k (1-based).
        abort_at_time: the client aborts it at this time in seconds (time-driven runs); not before
            ``arrival_time`` (``ValueError``).
        eos_token_id: its end-of-sequence id (:data:`EOS_TOKEN_ID` for every workload of this project);
            ``None``: no EOS stops it (vLLM ``ignore_eos``).
        stop_token_ids: other ids that stop it when sampled.
        min_tokens: outputs before EOS or a stop id may stop it.
        block_hash_ids: the prompt as hashed blocks (a Mooncake trace's ``hash_ids``): when set, the
            prompt ids are a :class:`BlockHashPrompt` and ``prefix_group``/``prefix_len`` do not shape
            them; ``None``: a :class:`SyntheticPrompt`.
        hash_block_tokens: tokens per block of ``block_hash_ids`` (512 for Mooncake); set with it.
        lora_int_id: its LoRA adapter (:attr:`Request.lora_int_id`; 0 = none, left out of :meth:`to_dict`).
        grammar_compile_steps: structured output: steps its grammar takes to compile, counted from its
            arrival step (0: ready at once; :attr:`Request.grammar_ready_step` is ``arrival_step +
            grammar_compile_steps``); ``None``: no structured output.
        num_external_computed_tokens: KV connector: the prompt tokens a remote KV transfer can load for it
            (:attr:`Request.num_external_computed_tokens`; 0 = none, left out of :meth:`to_dict`).
        kv_load_steps: the workload's schedule for its load: it lands with the KV connector's report of the
            step ``kv_load_steps`` steps after the step that started it (0: that very step's report);
            ``None``: 1. A scenario event, like ``abort_at_step``, counted from when the load starts; at least 1
            (``ValueError``), so that a plan never depends on the report of its own step.
        kv_load_invalid_block: the index, among its load's blocks, of the first block the load fails to fill
            (reported in ``invalid_block_ids`` when it lands: vLLM ``_handle_invalid_blocks``); ``None``: the
            load succeeds. Given without a load (``num_external_computed_tokens`` 0), like ``kv_load_steps``, it is
            refused (``ValueError``); past the load's blocks it never fails it (a scenario refuses that:
            ``reference/scenarios.py``).
        kv_send: KV connector: its blocks are sent when it finishes (:attr:`Request.kv_send`; left out of
            :meth:`to_dict` when false).
        kv_send_steps: the workload's schedule for its send: it completes with the report of the step
            ``kv_send_steps`` steps after the step it finished in; ``None``: 1; at least 1, and only with
            ``kv_send`` (``ValueError``).
    """

    request_id: str
    prompt_len: int
    max_tokens: int
    arrival_step: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    prefix_group: str | None = None
    prefix_len: int = 0
    abort_at_step: int | None = None
    eos_at_output: int | None = None
    abort_at_time: float | None = None
    eos_token_id: int | None = EOS_TOKEN_ID
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    min_tokens: int = 0
    block_hash_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple))
    hash_block_tokens: int | None = None
    lora_int_id: int = 0
    grammar_compile_steps: int | None = None
    num_external_computed_tokens: int = 0
    kv_load_steps: int | None = None
    kv_load_invalid_block: int | None = None
    kv_send: bool = False
    kv_send_steps: int | None = None

    def __attrs_post_init__(self) -> None:
        # An abort due before the arrival would be met while the request does not exist yet, and dropped
        # silently (abort_request ignores unknown ids): such a request is refused.
        if self.abort_at_step is not None and self.arrival_step is not None and self.abort_at_step < self.arrival_step:
            raise ValueError(f"request_id={self.request_id!r}: abort_at_step={self.abort_at_step} is before "
                             f"arrival_step={self.arrival_step}")
        for name in ("kv_load_steps", "kv_send_steps"):  # a transfer lands with a later step's report
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"request_id={self.request_id!r}: {name}={value} < 1")
        # A transfer's schedule without the transfer would be dropped silently: such a request is refused.
        if self.num_external_computed_tokens == 0:
            for name in ("kv_load_steps", "kv_load_invalid_block"):
                if getattr(self, name) is not None:
                    raise ValueError(f"request_id={self.request_id!r}: {name}={getattr(self, name)} without a remote "
                                     "KV load (num_external_computed_tokens is 0)")
        if self.kv_send_steps is not None and not self.kv_send:
            raise ValueError(f"request_id={self.request_id!r}: kv_send_steps={self.kv_send_steps} without kv_send")
        if not 0 <= self.num_external_computed_tokens <= self.prompt_len:
            raise ValueError(f"request_id={self.request_id!r}: num_external_computed_tokens="
                             f"{self.num_external_computed_tokens} outside [0, prompt_len={self.prompt_len}]")
        if self.abort_at_time is not None and self.abort_at_time < self.arrival_time:
            raise ValueError(f"request_id={self.request_id!r}: abort_at_time={self.abort_at_time:g} s is before "
                             f"arrival_time={self.arrival_time:g} s")

    def prompt_token_ids(self, vocab_size: int = DEFAULT_VOCAB_SIZE) -> SyntheticPrompt | BlockHashPrompt:
        """The deterministic prompt ids: a :class:`BlockHashPrompt` when ``block_hash_ids`` is set
        (``hash_block_tokens`` per block, 512 if unset), else a :class:`SyntheticPrompt`."""
        if self.block_hash_ids is not None:
            return BlockHashPrompt(self.request_id, self.prompt_len, self.block_hash_ids,
                                   self.hash_block_tokens or 512, vocab_size)
        return SyntheticPrompt(self.request_id, self.prompt_len, self.prefix_group, self.prefix_len, vocab_size)

    def to_request(self, arrival_step: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Request:
        """The fresh :class:`Request` the scheduler receives when this arrives at ``arrival_step``, with
        this descriptor's ``arrival_time`` (an engine loop stamps it first: :class:`ArrivalClock`)."""
        return Request(
            request_id=self.request_id,
            arrival_step=arrival_step,
            arrival_time=self.arrival_time,
            prompt_token_ids=self.prompt_token_ids(vocab_size),
            max_tokens=self.max_tokens,
            priority=self.priority,
            eos_token_id=self.eos_token_id,
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            lora_int_id=self.lora_int_id,
            grammar_ready_step=None if self.grammar_compile_steps is None else arrival_step + self.grammar_compile_steps,
            num_external_computed_tokens=self.num_external_computed_tokens,
            kv_send=self.kv_send,
        )

    STOP_FIELDS = ("eos_token_id", "stop_token_ids", "min_tokens")
    """The stop conditions, written explicitly in every trace arrival (``eos_token_id`` even when null)."""

    def to_dict(self) -> dict:
        """JSON-ready fields: optional ones left out when unset (``lora_int_id`` and
        ``num_external_computed_tokens`` when 0, ``kv_send`` when false), the stop conditions
        always present."""
        data = attrs.asdict(self)
        for name in ("lora_int_id", "num_external_computed_tokens", "kv_send"):  # 0 / false: left out
            if not data[name]:
                del data[name]
        data["stop_token_ids"] = list(self.stop_token_ids)
        if self.block_hash_ids is not None:
            data["block_hash_ids"] = list(self.block_hash_ids)
        return {k: v for k, v in data.items() if v is not None or k in self.STOP_FIELDS}

    @classmethod
    def from_dict(cls, data: dict) -> RequestSpec:
        return cls(**data)


class ArrivalClock:
    """Stamps each arrival with its ``arrival_time`` on the engine's clock, as a serving engine does.

    vLLM's engine stamps a request with ``time.time()`` when it receives it
    (``vllm/v1/engine/input_processor.py`` ``InputProcessor.process_inputs``), so no two requests share
    an arrival time and the one received first is the older. Its priority queue orders by
    ``(priority, arrival_time, request_id)`` (``vllm/v1/request.py`` ``Request.__lt__``, used by
    ``vllm/v1/core/sched/request_queue.py`` ``PriorityRequestQueue``) and picks a priority victim by
    ``(priority, arrival_time)`` (``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule``), so with
    real arrival times those orders follow arrival, never the id. The reference engine loop, the
    Hypothesis machine and ``schedspec diff`` stamp every arrival here, so the vLLM adapters and the
    ``vllm-v1`` profiles see the clock a whole engine would.

    :meth:`stamp` returns ``now`` (seconds: the start of the arrival step on the simulated clock, or
    the trace's arrival time), unless that is not later than the previous stamp (several arrivals
    before the same step, equal trace times, steps that took 0 s): then the next float after the
    previous stamp (``math.nextafter``). So stamps strictly increase in the **order of addition**, which
    alone decides ties (the order of a step's arrivals is the workload's, sorted by arrival and stable),
    and a stamp exceeds ``now`` by at most as many units in the last place as requests arrived with it
    (within :data:`schedspec.spec.checker.TIME_TOLERANCE`).
    """

    def __init__(self) -> None:
        self.last = -math.inf
        """The latest stamp given (seconds; ``-inf`` before the first)."""

    def stamp(self, now: float) -> float:
        """The arrival time of a request added when the clock reads ``now`` seconds (class docstring)."""
        self.last = now if now > self.last else math.nextafter(self.last, math.inf)
        return self.last

    def stamped(self, spec: RequestSpec, now: float) -> RequestSpec:
        """``spec`` with ``arrival_time`` set to :meth:`stamp` of ``now`` (the same object if unchanged)."""
        time = self.stamp(now)
        return spec if time == spec.arrival_time else attrs.evolve(spec, arrival_time=time)


def token_ids(request: Request, start: int, stop: int) -> np.ndarray:
    """Ids of positions ``[start, stop)`` of the request's prompt plus output, as an int64 array of
    shape ``[stop - start]`` (vectorised for prompts that offer ``array(start, stop)``, such as
    :class:`SyntheticPrompt`). Used by the model backends to build a step's input ids."""
    prompt = request.prompt_token_ids
    prompt_len = request.prompt_len
    parts = []
    if start < prompt_len:
        end = min(stop, prompt_len)
        array = getattr(prompt, "array", None)
        parts.append(array(start, end) if array is not None else np.asarray(prompt[start:end], dtype=np.int64))
    if stop > prompt_len:
        first = max(start, prompt_len) - prompt_len
        parts.append(np.asarray(request.output_token_ids[first:stop - prompt_len], dtype=np.int64))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def token_id_at(request: Request, position: int) -> int:
    """The token id at ``position`` of the request's prompt plus output."""
    if position < request.prompt_len:
        return request.prompt_token_ids[position]
    return request.output_token_ids[position - request.prompt_len]
