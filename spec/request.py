"""A request as the scheduler sees it: its prompt, its progress and its fate.

Mirrors vLLM ``vllm/v1/request.py`` (``Request``, ``RequestStatus``): ``num_computed_tokens`` counts
the tokens whose KV is in the cache; the tokens still to compute are
``len(prompt) + len(output) - num_computed_tokens`` (a running decode has exactly one).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs


def printable(text: object) -> str:
    """``text`` with every character that is not printable (a newline, a tab, an escape) written as its
    escape (``\\n``, ``\\x1b``): a request id shown in a message or a verdict line stays on its line and
    cannot drive the terminal. Printable text, the usual request ids among it, is returned unchanged."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


class RequestStatus(enum.Enum):
    """Where a request is. WAITING, RUNNING, PREEMPTED and WAITING_FOR_REMOTE_KVS are live; the rest are
    terminal."""

    WAITING = "waiting"
    """Added, not admitted yet (or re-queued; see PREEMPTED)."""
    RUNNING = "running"
    """Admitted: holds KV blocks and a ``max_num_seqs`` slot."""
    PREEMPTED = "preempted"
    """Was running, gave back all its blocks (recompute) and waits at the front of the queue."""
    FINISHED_STOPPED = "finished_stopped"
    """Sampled its end-of-sequence token."""
    FINISHED_LENGTH = "finished_length"
    """Reached ``max_tokens`` outputs or ``max_model_len`` total tokens."""
    FINISHED_ABORTED = "finished_aborted"
    """Aborted by the client."""
    REJECTED = "rejected"
    """Never admitted: it could never run to completion even alone (see ``admission``)."""
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    """Waiting in the queue while holding the blocks that a KV transfer (the KV connector) is filling with
    its prefix (vLLM ``RequestStatus.WAITING_FOR_REMOTE_KVS``, set in ``Scheduler.schedule`` when
    ``get_num_new_matched_tokens`` answers ``load_kv_async``). It may not be scheduled until the transfer
    lands (``StepRecord.finished_recving``); then it is WAITING again, holding its blocks, with the loaded
    tokens computed (:func:`schedspec.spec.transitions.land_transfers`). Declared last so that the order of the
    statuses before it is unchanged."""

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def is_waiting(self) -> bool:
        """In the waiting queue (fresh, preempted, or waiting for a remote KV transfer)."""
        return self in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_REMOTE_KVS)

    @property
    def outcome(self) -> str:
        """The scenario-level outcome: finished, aborted, rejected, or live."""
        if self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return "finished"
        if self is RequestStatus.FINISHED_ABORTED:
            return "aborted"
        if self is RequestStatus.REJECTED:
            return "rejected"
        return "live"


_TERMINAL = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.REJECTED,
    }
)


def _frozen_tokens(value: Sequence[int]) -> Sequence[int]:
    """Lists (mutable) become tuples; other sequences (tuples, lazy id sequences) are kept."""
    if isinstance(value, list) or not hasattr(value, "__getitem__"):
        return tuple(value)
    return value


@attrs.frozen(slots=False)
class Request:
    """One request. Immutable: every change makes a new value.

    Attributes:
        request_id: unique id.
        arrival_step: index of the step before which it was added.
        arrival_time: arrival in seconds (trace or simulated clock).
        prompt_token_ids: the prompt, ``len >= 0`` token ids (any ``Sequence[int]``, so a workload
            can supply ids lazily).
        max_tokens: most output tokens to sample (vLLM ``SamplingParams.max_tokens``).
        priority: lower is more urgent (vLLM's convention); used by priority policies only.
        eos_token_id: sampling this id stops the request; ``None`` never stops early.
        stop_token_ids: sampling any of these ids also stops it (vLLM ``SamplingParams.stop_token_ids``).
        min_tokens: no stop by EOS or stop id before this many outputs (vLLM ``SamplingParams.min_tokens``).
        status: see :class:`RequestStatus`.
        finish_reason: why a terminal request ended (``stop``, ``length``, ``max_model_len``,
            ``abort`` or the rejection reason); ``None`` while live.
        num_computed_tokens: tokens whose KV is in this request's blocks (tokens).
        output_token_ids: sampled tokens so far.
        block_ids: the block table: KV block ids in logical order; block ``i`` holds token positions
            ``[i * block_size, (i + 1) * block_size)``.
        num_preemptions: times it was preempted.
        admitted_step: step of its latest admission into the running set; ``None`` if never.
        first_token_step: step in which its first output token was sampled; ``None`` before.
        spec_token_ids: speculative decoding: the draft token ids the drafter proposed for it after its
            last step, to verify in its next decode (vLLM ``Request.spec_token_ids``, set by
            ``Scheduler.update_draft_token_ids``); at most ``num_speculative_tokens`` of them. Scheduling
            the request consumes them (``Scheduler.schedule`` sets ``request.spec_token_ids = []`` whether
            all, some or none were scheduled), and so does a preemption (``Scheduler._preempt_request``).
            Drafts are not part of the sequence: ``num_tokens`` does not count them.
        lora_int_id: the LoRA adapter it runs with (vLLM ``LoRARequest.lora_int_id``, ``Request.lora_request``);
            0 = the base model, no adapter. With ``SchedulerConfig.max_loras > 0`` a step's requests use
            at most that many distinct adapters (rule ``lora-limit``).
        grammar_ready_step: structured output: the first step at which its grammar is compiled, so that it
            may be admitted (:meth:`grammar_ready`); ``None`` without structured output. vLLM keeps such a
            request in ``RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` until
            ``StructuredOutputRequest.grammar`` is ready; its waiting loop skips it meanwhile (rule
            ``grammar-ready-before-admission``).
        group_block_ids: hybrid KV cache groups (``SchedulerConfig.kv_cache_groups``): the block tables of
            groups 1.. (group 0's is ``block_ids``), one tuple per group, in group order; empty without
            groups. A sliding-window group's table keeps its length and holds
            :data:`~schedspec.spec.kv_cache_groups.NULL_BLOCK` where a block fell out of the window and was
            freed (vLLM ``SingleTypeKVCacheManager.req_to_blocks`` with ``null_block``).
        num_external_computed_tokens: KV connector: the prompt tokens whose KV a remote KV transfer can load for
            it, the first ``num_external_computed_tokens`` of its prompt (vLLM
            ``KVConnectorBase_V1.get_num_new_matched_tokens`` answering ``(n, load_kv_async=True)`` at its
            first admission); 0 = nothing to load (the default: no connector). The connector offers them
            once: a plan may start the load (``StepPlan.loads``) only while ``kv_load_step`` is ``None``.
        kv_load_step: the step whose plan started its remote KV load (``StepPlan.loads``); ``None`` if none
            started. From then until the transfer lands it is WAITING_FOR_REMOTE_KVS.
        kv_send: KV connector: when it finishes (stop or length, not an abort) its blocks are sent to a remote
            engine and stay held until the send completes (``StepRecord.finished_sending``): vLLM
            ``KVConnectorBase_V1.request_finished`` answering ``delay_free_blocks=True`` (the prefill side of
            disaggregated prefill, ``kv_transfer_params`` ``do_remote_decode``).
    """

    request_id: str
    arrival_step: int
    prompt_token_ids: Sequence[int] = attrs.field(converter=_frozen_tokens)
    max_tokens: int
    arrival_time: float = 0.0
    priority: int = 0
    eos_token_id: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_computed_tokens: int = 0
    output_token_ids: tuple[int, ...] = ()
    block_ids: tuple[int, ...] = ()
    num_preemptions: int = 0
    admitted_step: int | None = None
    first_token_step: int | None = None
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    min_tokens: int = 0
    spec_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    lora_int_id: int = 0
    grammar_ready_step: int | None = None
    group_block_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=lambda v: tuple(map(tuple, v)))
    num_external_computed_tokens: int = 0
    kv_load_step: int | None = None
    kv_send: bool = False
    prompt_len: int = attrs.field(init=False, eq=False, repr=False)
    """Prompt length in tokens (``len(prompt_token_ids)``, kept because it is read every step)."""
    num_tokens: int = attrs.field(init=False, eq=False, repr=False)
    """Prompt plus output tokens so far: the sequence whose KV the request needs
    (``prompt_len + len(output_token_ids)``, kept because it is read many times every step)."""

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "prompt_len", len(self.prompt_token_ids))
        object.__setattr__(self, "num_tokens", self.prompt_len + len(self.output_token_ids))

    def grammar_ready(self, step: int) -> bool:
        """Whether it may be admitted in ``step`` as far as structured output goes: no grammar, or its grammar
        is ready (``grammar_ready_step <= step``). vLLM ``Scheduler._handle_blocked_waiting_request``."""
        return self.grammar_ready_step is None or self.grammar_ready_step <= step

    @property
    def holds_loaded_kv(self) -> bool:
        """Whether it is a waiting request that may hold blocks: its remote KV load started
        (``kv_load_step`` set) and it was never admitted since (vLLM ``Scheduler._holds_kv_blocks``: such a
        request sits in ``kv_holding_waiting``). Its table then has the blocks of its load, or none after a
        load that failed from its first block (invariant ``waiting-holds-only-loaded-kv``)."""
        return self.kv_load_step is not None and self.admitted_step is None and self.status.is_waiting

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to compute before it can sample: ``num_tokens - num_computed_tokens``."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Whether its next computation is a decode: exactly one token pending, past the prompt (the
        token it sampled last). This is the spec's one definition of a decode; everything else,
        including the last token of a prompt and a recompute after preemption, is a prefill (vLLM
        does not distinguish the two in ``Scheduler.schedule``; its ``SchedulerOutput`` and metrics
        count a request as decoding once its prompt is computed)."""
        return self.num_pending_tokens == 1 and self.num_computed_tokens >= self.prompt_len

    @property
    def is_prefill(self) -> bool:
        """``not is_decode``: more than one token pending (a prompt, or a recompute after preemption),
        or the prompt's last token."""
        return not self.is_decode
