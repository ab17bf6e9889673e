"""The ``sglang-profile`` reference scheduler: a reproduction of the decisions of SGLang 0.5.23's
scheduler (``sglang==0.5.23``, ``sglang/srt/managers/scheduler.py`` ``Scheduler.get_next_batch_to_run``)
in the configuration the ``sglang`` adapter runs it in (``engines/sglang.py``): one CPU rank, the
chunk cache (radix cache disabled: no prefix caching), ``--schedule-policy fcfs``, no priority
scheduling (``sglang-profile-priority``: with it, rule 12), no mixed chunks, no overlap, no speculative decoding, the default environment
(``sglang/srt/environ.py``), ``page_size = block_size``, a pool of ``num_kv_blocks * block_size``
tokens, ``max_running_requests = max_num_seqs``, ``chunked_prefill_size = max_prefill_tokens =
max_num_batched_tokens`` (``chunked_prefill_size = -1`` with chunked prefill off).

Unlike ``vllm-v1`` this is not a pure ``plan(state, config)`` function: SGLang decides from state the
spec does not keep, so :class:`SglangProfile` keeps it beside its spec state, and changes that spec
state only by the spec's transitions (``spec.transitions``), so it refines the spec whenever its plans
are allowed (it is judged like every scheduler). The state of its own (SGLang's names):

- ``waiting``: SGLang's ``Scheduler.waiting_queue`` order (arrivals and retracted requests at the
  back; the spec puts a preempted request at the front of its own queue);
- ``running``: the order of ``running_batch.reqs`` (the retraction order breaks ties by it);
- ``chunked``: ``Scheduler.chunked_req``;
- ``batch_is_full``: ``running_batch.batch_is_full``, which survives from step to step;
- ``ratio``: ``NewTokenRatioTracker.current``;
- ``max_new_tokens``: each request's ``sampling_params.max_new_tokens`` after the arrival clipping.

The rules, each with its place in SGLang 0.5.23's source (``sglang/srt/...``):

1. **Arrival clipping** (``managers/scheduler.py`` ``Scheduler.init_req_max_new_tokens``):
   ``max_new_tokens = max(0, min(max_tokens, max_req_len - prompt_len - 1))``, ``max_req_len =
   min(max_model_len - 1, pool_tokens - 1)`` (``managers/tp_worker.py`` ``get_worker_info``), then
   ``min(that, pool_tokens - ceil_page(prompt_len) - page_size - 1)`` (``mem_cache/allocator/base.py``
   ``max_new_tokens_for_memory``). The profile uses the clipped value wherever SGLang reads
   ``max_new_tokens`` (rules 4, 5, 9, 10), but cannot end a request there: the spec ends it at its
   ``max_tokens`` (:func:`clipped_max_new_tokens`; the finding ``sglang-clips-max-tokens``).
2. **Prefill first, else decode; never mixed** (``Scheduler.get_next_batch_to_run``): a step is the
   prefill batch ``get_new_batch_prefill`` builds if it admits anything, else the decode of the whole
   running batch (``update_running_batch``); ``enable_mixed_chunk`` is off.
3. **When a prefill is tried** (``Scheduler._get_new_batch_prefill_raw``): not while ``batch_is_full``
   or with an empty waiting queue, unless a chunked request is pending; ``batch_is_full`` is cleared
   when the running batch is empty. Not when ``max_running_requests - len(running)`` is 0 (no chunked
   request): then ``batch_is_full`` is set. ``batch_is_full`` is also set when admission stops at the
   request-slot limit (rule 6) or with ``NO_TOKEN`` while something runs or was admitted, and cleared
   when a request leaves the running batch (``get_next_batch_to_run``'s ``filter_batch`` of finished
   requests, the filtered last prefill batch, a retraction in ``update_running_batch``). When the
   running batch is empty the last prefill batch becomes the running batch with the flag of a new
   ``ScheduleBatch`` (clear); otherwise ``merge_batch`` appends it (its requests after the running ones).
4. **The budget of a prefill pass** (``managers/schedule_policy.py`` ``PrefillAdder.__init__``,
   ``mem_cache/prefill_budget.py`` ``PrefillBudget``): ``rem_total_tokens = free tokens -
   total_offset``, ``total_offset`` starting at the sum over the running batch of
   ``min(max_new_tokens - outputs, CLIP_MAX_NEW_TOKENS) * new_token_ratio``
   (``_get_running_request_total_token_offset``; ``CLIP_MAX_NEW_TOKENS`` 4096); ``cur_rem_tokens =
   free tokens - current_offset`` (starting at 0); ``rem_input_tokens = max_prefill_tokens``,
   ``rem_chunk_tokens = chunked_prefill_size`` (``None`` without chunking). Each admitted chunk of
   ``n`` tokens reserves (``PrefillBudget.reserve``) ``ceil_page(n) + page_size`` in both offsets and
   its ``max_new_tokens`` (capped at 4096; 0 for a chunk that does not end the prompt) in
   ``total_offset`` alone, and takes ``ceil_page(n)`` from ``rem_input_tokens`` and
   ``rem_chunk_tokens`` (``_update_prefill_budget``). ``budget_state``: ``NO_TOKEN`` when
   ``rem_total_tokens <= 0`` or ``cur_rem_tokens <= 0``, else ``OTHER`` when ``rem_input_tokens <=
   0`` or ``rem_chunk_tokens <= 0``, else ``CONTINUE``.
5. **The chunked request first, one at a time** (``PrefillAdder.add_chunked_req``): its next chunk is
   ``min(pending, available_chunk_tokens)``, ``available_chunk_tokens = min(rem_chunk_tokens,
   int(rem_total_tokens))`` or, when that is not positive, ``rem_chunk_tokens`` (so the chunk may end
   inside a page, and a pool short of tokens still gets a whole chunk); the last chunk reserves the
   request's ``max_new_tokens``. Only one request is chunked at a time (``Scheduler.chunked_req``).
6. **Admission in queue order** (the ``for req in self.waiting_queue`` loop of
   ``_get_new_batch_prefill_raw``, FCFS: ``SchedulePolicy.calc_priority`` sorts nothing): stop when
   ``budget_state`` is ``OTHER``; stop (``batch_is_full``) when the admitted requests (the chunked one
   included) reach ``max_running_requests - len(running)`` (``get_num_allocatable_reqs``: free rows of
   ``ReqToTokenPool``); else ``add_one_req``, and stop at the first result that is not ``CONTINUE``.
7. **The admission estimate** (``PrefillAdder.add_one_req``, ``_select_prefill_admission``, a request
   with an end-of-sequence id and the radix cache off): with ``extend`` = prompt plus kept output
   tokens (nothing cached) and ``max_new = min(max(max_new_tokens - outputs, 0), 4096)``, the request
   needs ``extend + max_new + page_size < rem_total_tokens`` (strict; ``NO_TOKEN`` otherwise); without
   chunking every request but the first of the pass needs ``ceil_page(extend) < rem_input_tokens``
   (``OTHER``; the first may exceed ``max_prefill_tokens``); with chunking, when ``ceil_page(extend) >
   rem_chunk_tokens`` it is cut to ``rem_chunk_tokens`` rounded down to a page (``OTHER`` if that is 0)
   and becomes the chunked request. Admitted, it reserves (rule 4) ``min(max_new_tokens, 4096)``, the
   whole clipped output, not less the kept outputs. It returns ``budget_state`` after the reservation,
   so a request that is admitted and exhausts the estimate also ends the pass with ``NO_TOKEN``.
8. **Decode memory** (``managers/schedule_batch.py`` ``ScheduleBatch.check_decode_mem``,
   ``new_tokens_required_next_decode``, ``mem_cache/allocator/base.py`` ``check_decode_capacity``): a
   decode needs ``page_size`` free tokens for each running request whose committed tokens
   (``num_computed_tokens``) are a multiple of ``page_size``.
9. **Retraction** (``ScheduleBatch.retract_decode``, ``_get_decode_retraction_order``): when the
   decode does not fit, the running requests are sorted by ``(outputs, -prompt_len)`` descending
   (stable: ties keep running order) and retracted from the end: at least one, then while the rest
   do not fit, always keeping one; the kept requests stay in that sorted order (``filter_batch
   (keep_indices=...)``). Retracted requests free their pages and go to the **back** of the waiting
   queue in retraction order (``Scheduler._add_request_to_queue(req, is_retracted=True)``), keeping
   their output tokens (``Req.reset_for_retract``): re-admitted, they compute prompt plus outputs.
   If even the last one cannot decode SGLang aborts it (an engine fault: the profile raises
   :class:`SglangAbort`).
10. **The new-token ratio** (``managers/scheduler_components/new_token_ratio_tracker.py``
    ``NewTokenRatioTracker``, ``Scheduler.update_running_batch``): starts at ``init = 0.7``
    (``SGLANG_INIT_NEW_TOKEN_RATIO`` times ``schedule_conservativeness`` 1.0), decays by ``(init -
    min) / 600`` per decode step without retraction down to ``min = 0.7 * 0.14``; after a retraction
    it is ``min(1, (kept outputs + 20 * kept) / (kept max_new_tokens + 1))``
    (``estimate_new_token_ratio_after_retract``, ``SGLANG_RETRACT_DECODE_STEPS`` 20); a prefill step
    leaves it; an idle step with nothing running, waiting or chunked resets it to ``init``
    (``Scheduler.on_idle`` when ``is_fully_idle``).
11. **Blocks**: a prefill chunk gets the pages its tokens reach beyond those held
    (``ScheduleBatch.prepare_for_extend``), a decode one page when rule 8 says so
    (``prepare_for_decode``), both from the spec state's free queue in order (block ids are not
    SGLang's: ``schedspec diff`` compares counts unless ``--exact-blocks``).
12. **Priority** (``sglang-profile-priority`` only; ``--enable-priority-scheduling
    --schedule-low-priority-values-first --priority-scheduling-preemption-threshold 0``, the ``sglang-priority``
    adapter): each prefill pass clears ``batch_is_full`` and skips the request-slot early return
    (``_get_new_batch_prefill_raw``: ``enable_priority_preemption``), and the waiting queue is sorted by
    ``(priority, wait_queue_entry_time)`` (``SchedulePolicy._sort_by_priority_and_fcfs``; a lower value is
    more urgent, the spec's convention; every arrival, retraction and preemption stamps the time anew,
    ``Scheduler._add_request_to_queue``). When a request finds the slots taken (rule 6), or the flag set
    earlier in the pass, ``PrefillAdder.preempt_to_schedule`` walks the running requests from the least
    urgent (greatest ``priority``, then the latest to join the queue), each more than
    :data:`PREEMPTION_THRESHOLD` less urgent than it, summing their :meth:`SglangProfile._offset` (rule 4's
    reserved remaining output) until it covers ``len(full_untruncated_fill_ids) + min(max_new_tokens, 4096)
    - rem_total_tokens``; if it never does, nothing is preempted and the pass ends. ``full_untruncated_fill_ids``
    is the request's prompt and outputs as of its last ``Req.init_next_round_input`` (a pass that reached it)
    or ``prepare_for_decode``: empty for a request no pass has reached. The victims leave the running batch
    (its order kept), give their pages back and their offsets to the budget, and are re-queued at the back
    after the pass, admitted or not (``get_new_batch_prefill``), keeping their outputs like a retraction
    (rule 9), in the walk's order (SGLang's ``preempt_list`` is extended from a ``set``, so two victims
    of one step may be re-queued the other way round; that matters only between victims of equal priority,
    and no scenario measured showed it). Preempted requests' pages are freed but not counted toward the need: SGLang can take more
    requests than it needs, or none where one would do (the finding
    ``sglang-priority-preemption-takes-too-many``, :class:`ExcessPreemption`).
13. **A request SGLang runs with ``ignore_eos``** (no end-of-sequence id and no stop id:
    :func:`ignores_eos`; ``PrefillAdder.add_one_req`` sends it to ``add_one_req_ignore_eos`` while the radix
    cache is off): its remaining output is reserved at ratio 1, not the tracker's, wherever rule 4 counts a
    running request (``_get_running_request_total_token_offset``). It is admitted when ``ceil_page(extend) +
    page_size <= min(cur_rem_tokens, rem_total_tokens)`` (``PrefillBudget.can_allocate_prefill``) and a
    simulation of the requests' ends passes: ``req_states``, built at the pass's first such request from it,
    the running batch and the requests admitted so far (each ``(max_new_tokens * ratio - outputs, prompt +
    outputs)``, those with nothing left dropped), sorted by tokens left, and then extended by each later such
    request alone, inserted before the first state with at least as many tokens left, or before the last
    one; with ``cur_rem_tokens - paged input`` free, for the ``i``-th state of ``n`` the free tokens plus
    those the states before it free must exceed ``tokens left * (n - i) + IGNORE_EOS_RESERVE_TOKENS * (n -
    i)`` (``NO_TOKEN`` otherwise). No ``rem_input_tokens`` check; with chunking it is cut when its unrounded
    length exceeds ``rem_chunk_tokens``, to ``rem_chunk_tokens`` itself (not rounded to a page, unlike rule
    7). Admitted, it reserves as in rule 7.

**Within the spec, where SGLang is not** (docs/engines.md, *SGLang 0.5.23*, *The sglang-profile*):
the profile rejects at arrival only what the spec calls impossible (``spec.admission``), never what
SGLang's front end or ``validate_input_length`` refuse; it runs a request to its ``max_tokens`` (rule 1);
a decode batch of more than ``max_num_batched_tokens`` requests is cut to the budget (SGLang decodes
every running request: ``token-budget``), keeping the first ``max_num_batched_tokens`` of the running
order. Refused (:class:`~schedspec.reference.scheduler.UnsupportedFeature`, exit 3):
what the ``sglang`` adapter refuses (prefix caching, speculative decoding,
``long_prefill_token_threshold``, vLLM's per-step limits, LoRA and structured output). A request without an
end-of-sequence id is admitted by rule 13.

**SGLang's stalls are kept**: a request SGLang never admits (rules 1 and 7: a prompt of ``pool tokens -
page_size`` or more whose clipped ``max_new_tokens`` is 0, or a prompt longer than a chunk budget under a
page) waits here forever too, and the queue behind it
(docs/findings/sglang-unadmittable-request-blocks-queue.md). So the profile refines the spec step by step
but need not end every request: it is registered as an ``engine-profile``, which the suites every reference
scheduler runs leave out (``tests/test_sglang_profile.py`` runs it on the configs and shapes where SGLang
ends every request: :func:`comparable_config`, :func:`comparable_request`).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens
from schedspec.spec.request import Request, printable
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.transitions import abort_request, add_request, apply_plan
from schedspec.spec.workload import RequestSpec

from .scheduler import UnsupportedFeature

SGLANG_VERSION = "0.5.23"
CLIP_MAX_NEW_TOKENS = 4096
"""``managers/schedule_policy.py`` ``CLIP_MAX_NEW_TOKENS`` (``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`` unset)."""
INIT_NEW_TOKEN_RATIO = 0.7
"""``SGLANG_INIT_NEW_TOKEN_RATIO`` times ``schedule_conservativeness`` (1.0), capped at 1 (``environ.py``)."""
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14
"""``init * SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR`` (0.14)."""
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
"""``(init - min) / SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS`` (600), per decode step."""
RETRACT_DECODE_STEPS = 20
"""``SGLANG_RETRACT_DECODE_STEPS``: decode steps a kept request is assumed to take after a retraction."""

PREEMPTION_THRESHOLD = 0
"""``--priority-scheduling-preemption-threshold`` of ``sglang-profile-priority`` and the ``sglang-priority``
adapter (``engines/sglang_worker.py`` ``PREEMPTION_THRESHOLD``; SGLang's default is 10)."""

NO_TOKEN, OTHER, CONTINUE = "NO_TOKEN", "OTHER", "CONTINUE"
"""``PrefillAdder``'s ``AddReqResult`` values the profile meets."""


IGNORE_EOS_RESERVE_TOKENS = 1
"""``managers/schedule_policy.py`` ``IGNORE_EOS_RESERVE_TOKENS``: tokens kept per request by rule 13's check."""


def ignores_eos(request: Request) -> bool:
    """Whether the ``sglang`` adapter runs ``request`` with SGLang's ``ignore_eos`` (no end-of-sequence id and
    no stop id: ``engines/sglang_worker.py`` ``Components.request``), which takes rule 13's admission."""
    return request.eos_token_id is None and not request.stop_token_ids


class SglangAbort(Exception):
    """SGLang would abort a running request here (``retract_decode``: "Out of memory even after retracting
    all other requests"); the spec has no such transition."""


def pool_tokens(config: SchedulerConfig) -> int:
    """Tokens of SGLang's KV pool: ``num_kv_blocks * block_size`` (pages ``1..num_kv_blocks``)."""
    return config.num_kv_blocks * config.block_size


def max_req_len(config: SchedulerConfig) -> int:
    """SGLang's ``max_req_len``: ``min(max_model_len - 1, pool tokens - 1)`` (``managers/tp_worker.py``
    ``TpModelWorker.get_worker_info`` with ``context_len = max_model_len``)."""
    return min(config.max_model_len - 1, pool_tokens(config) - 1)


def max_req_input_len(config: SchedulerConfig) -> int:
    """SGLang's ``max_req_input_len`` (``max_req_len - 5``): a prompt this long or longer is refused at
    arrival (``managers/utils.py`` ``validate_input_length``)."""
    return max_req_len(config) - 5


def _ceil_page(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) * page_size


def clipped_max_new_tokens(prompt_len: int, max_tokens: int, config: SchedulerConfig) -> int:
    """SGLang's ``max_new_tokens`` for a request after the arrival clipping (rule 1, tokens):
    ``Scheduler.init_req_max_new_tokens`` and ``PagedTokenToKVPoolAllocator.max_new_tokens_for_memory``
    (``SGLANG_MAX_NEW_TOKENS_LIMIT`` unset). A request with ``max_tokens`` above it ends early in SGLang
    (docs/findings/sglang-clips-max-tokens.md)."""
    page = config.block_size
    clipped = max(0, min(max_tokens, max_req_len(config) - prompt_len - 1))
    return max(0, min(clipped, pool_tokens(config) - _ceil_page(prompt_len, page) - page - 1))


@attrs.define
class _Budget:
    """One prefill pass's ``PrefillAdder`` budget (rule 4), in tokens (floats: the ratio scales them)."""

    free: int
    page: int
    total_offset: float
    rem_input: int
    rem_chunk: int | None
    current_offset: float = 0.0
    req_states: list[tuple[float, int]] | None = None  # PrefillAdder.req_states (rule 13), built once per pass

    @property
    def rem_total(self) -> float:
        return self.free - self.total_offset

    def reserve(self, tokens: int, max_new: int) -> None:
        paged = _ceil_page(tokens, self.page)
        self.total_offset += paged + self.page + max_new
        self.current_offset += paged + self.page
        self.rem_input -= paged
        if self.rem_chunk is not None:
            self.rem_chunk -= paged

    def state(self) -> str:
        if not (self.rem_total > 0 and self.free - self.current_offset > 0):
            return NO_TOKEN
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0):
            return OTHER
        return CONTINUE


@attrs.frozen
class ExcessPreemption:
    """The finding ``sglang-priority-preemption-takes-too-many`` at one step (rule 12): SGLang's
    ``PrefillAdder.preempt_to_schedule`` preempted ``victims`` for ``request_id`` where its first ``enough``
    would have let ``PrefillAdder.add_one_req`` admit it (the pages they hold, which ``release_req`` frees, are
    not counted in what preemption frees)."""

    step: int
    request_id: str
    victims: tuple[str, ...]
    enough: int


@attrs.frozen
class _Decision:
    """What a planned step does to the profile's own state (applied by ``update``)."""

    plan: StepPlan
    prefill: tuple[str, ...]  # the extend batch, in order (the chunked request first); empty for a decode
    chunked: str | None  # Scheduler.chunked_req after the step
    running: tuple[str, ...]  # running_batch.reqs after the step's planning (retraction reorders it)
    waiting: tuple[str, ...]  # the waiting queue after the step's planning
    batch_is_full: bool
    ratio: float
    requeued: tuple[str, ...]  # re-queued at the back: preempt_to_schedule's, then retract_decode's (rule 12)
    fill_len: dict[str, int]  # len(Req.full_untruncated_fill_ids) after the step's planning (rule 12)


class SglangProfile:
    """SGLang 0.5.23's scheduler as a reference scheduler (module docstring); registry name
    ``sglang-profile``.

    Args:
        config: the limits (the ``sglang`` adapter's mapping, module docstring).
        name: its registry name.
        priority: SGLang's priority scheduling and preemption (rule 12; ``sglang-profile-priority``).

    Raises:
        UnsupportedFeature: a config the ``sglang`` adapter refuses (module docstring).
    """

    guarantees: frozenset[str] = frozenset()

    def __init__(self, config: SchedulerConfig, name: str = "sglang-profile", priority: bool = False) -> None:
        for refused, why in (
            (config.enable_prefix_caching, "prefix caching (SGLang's radix tree is not reproduced)"),
            (config.speculative, "speculative decoding"),
            (config.long_prefill_token_threshold > 0, "long_prefill_token_threshold > 0 (SGLang has no such limit)"),
            (config.limits_on, f"{', '.join(config.limits_on)}: vLLM's per-step limits, which SGLang does not apply"),
            (config.prefill_schedule_interval > 1, "prefill_schedule_interval > 1 (vLLM 0.33's prefill cadence)"),
        ):
            if refused:
                raise UnsupportedFeature(f"scheduler {name!r}: {why}")
        self.name = name
        self.config = config
        self.state = SchedulerState.initial(config)
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.chunked: str | None = None
        self.batch_is_full = False
        self.ratio = INIT_NEW_TOKEN_RATIO
        self.max_new_tokens: dict[str, int] = {}
        self.priority = priority
        self.entered: dict[str, int] = {}  # rid -> when it last joined the waiting queue (rule 12: an order)
        self.fill_len: dict[str, int] = {}  # rid -> len(Req.full_untruncated_fill_ids) (rule 12)
        self._clock = 0
        self.excess_preemptions: list[ExcessPreemption] = []  # the finding, each time it happened (rule 12)
        self._decision: _Decision | None = None

    # ------------------------------------------------------------------ arrivals and aborts
    def add_request(self, request: Request) -> None:
        """``handle_generate_request``: clip ``max_new_tokens`` (rule 1), join the back of the queue.

        Raises:
            UnsupportedFeature: a LoRA adapter or structured output."""
        if request.lora_int_id or request.grammar_ready_step is not None:
            raise UnsupportedFeature(f"scheduler {self.name!r}: request {printable(request.request_id)} has a LoRA "
                                     "adapter or structured output")
        self.state = add_request(self.state, request)
        self.max_new_tokens[request.request_id] = clipped_max_new_tokens(request.prompt_len, request.max_tokens,
                                                                         self.config)
        self._enqueue([request.request_id])
        self._decision = None

    def _enqueue(self, request_ids) -> None:
        """``Scheduler._add_request_to_queue``: to the back of the queue, stamped
        (``ReqTimeStats.set_wait_queue_entry_time``, which rule 12 orders by)."""
        for request_id in request_ids:
            self.waiting.append(request_id)
            self._clock += 1
            self.entered[request_id] = self._clock

    def abort_request(self, request_id: str) -> None:
        """The spec's abort; the request leaves SGLang's queues."""
        self.state = abort_request(self.state, request_id)
        if request_id not in self.state.requests:
            self._forget(request_id)
        self._decision = None

    def _forget(self, request_id: str) -> None:
        for queue in (self.waiting, self.running):
            if request_id in queue:
                queue.remove(request_id)
        if self.chunked == request_id:
            self.chunked = None
        for kept in (self.max_new_tokens, self.entered, self.fill_len):
            kept.pop(request_id, None)

    # ------------------------------------------------------------------------- planning
    def schedule(self) -> StepPlan:
        """``Scheduler.get_next_batch_to_run`` (rules 2 to 11); the same plan until ``update``.

        Raises:
            SglangAbort: SGLang would abort the last running request (rule 9)."""
        if self._decision is None:
            self._decision = self._plan()
        return self._decision.plan

    def _plan(self) -> _Decision:
        state, config = self.state, self.config
        page = config.block_size
        requests = state.requests
        rejected = tuple((r, reason) for r in state.waiting
                         if requests[r].admitted_step is None
                         and (reason := rejection_reason(requests[r].prompt_len, requests[r].max_tokens, config)))
        refused = {r for r, _ in rejected}
        waiting = [r for r in self.waiting if r not in refused]
        running = list(self.running)
        full = self.batch_is_full and bool(running)  # rule 3: an empty running batch clears the flag
        fill_len = dict(self.fill_len)
        if self.priority:  # rule 12: the flag is cleared to try preemption; the queue is sorted
            full = False
            waiting.sort(key=lambda r: (requests[r].priority, self.entered[r]))
        free = list(state.free_block_ids)
        preempted: list[str] = []

        def outputs(request_id: str) -> int:
            return requests[request_id].num_output_tokens

        def item(request_id: str, tokens: int) -> ScheduledRequest:
            request = requests[request_id]
            computed = request.num_computed_tokens
            count = blocks_for_tokens(computed + tokens, page) - len(request.block_ids)
            new = tuple(free[:count])
            del free[:count]
            return ScheduledRequest(request_id, computed, tokens, new)

        # rule 3: is a prefill tried?
        admitted: list[tuple[str, int]] = []
        chunked = self.chunked
        slots = config.max_num_seqs - len(running)
        if (full or not waiting) and chunked is None:
            pass
        elif slots <= 0 and chunked is None and not self.priority:
            full = True
        else:
            budget = _Budget(free=state.num_free_blocks * page, page=page,
                             total_offset=sum(self._offset(r) for r in running),
                             rem_input=config.max_num_batched_tokens,
                             rem_chunk=config.max_num_batched_tokens if config.enable_chunked_prefill else None)
            if chunked is not None:  # rule 5
                request = requests[chunked]
                pending = request.num_tokens - request.num_computed_tokens
                assert budget.rem_chunk is not None
                available = min(budget.rem_chunk, int(budget.rem_total))
                limit = available if available > 0 else budget.rem_chunk
                tokens = min(pending, limit)
                admitted.append((chunked, tokens))
                finishes = tokens >= pending
                budget.reserve(tokens, min(self.max_new_tokens[chunked], CLIP_MAX_NEW_TOKENS) if finishes else 0)
                if finishes:
                    chunked = None
            for request_id in waiting:  # rule 6
                if budget.state() == OTHER:
                    break
                if len(admitted) >= config.max_num_seqs - len(running):
                    full = True
                if full:  # rule 12: a more urgent request may preempt running ones
                    victims = self._preempt_to_schedule(requests[request_id], budget, running,
                                                        [r for r, _ in admitted], fill_len) if self.priority else []
                    if not victims:
                        break
                    preempted += victims
                    running = [r for r in running if r not in victims]
                    for victim in victims:
                        free.extend(requests[victim].block_ids)
                fill_len[request_id] = requests[request_id].num_tokens  # Req.init_next_round_input
                result, tokens, is_chunked = self._admit(requests[request_id], budget, running,
                                                         [r for r, _ in admitted])
                if tokens:
                    admitted.append((request_id, tokens))
                    if is_chunked:
                        chunked = request_id
                if result != CONTINUE:
                    if result == NO_TOKEN:
                        full = bool(admitted) or bool(running)
                    break

        ratio = self.ratio
        requeued = list(preempted)  # rule 12: preempt_list re-queued after the pass, admitted or not
        if admitted:  # rule 2: a prefill step
            names = {r for r, _ in admitted}
            waiting = [r for r in waiting if r not in names]
            scheduled = tuple(item(r, tokens) for r, tokens in admitted)
            prefill = tuple(r for r, _ in admitted)
        elif running:  # rule 2: decode the running batch (rules 8 to 10)
            prefill = ()

            def needed(ids: list[str]) -> int:
                return page * sum(1 for r in ids if requests[r].num_computed_tokens % page == 0)

            available = state.num_free_blocks * page
            if available >= needed(running):
                ratio = max(ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
            else:
                order = sorted(running, key=lambda r: (outputs(r), -requests[r].prompt_len), reverse=True)
                first = True
                while first or available < needed(order):
                    if len(order) == 1:
                        break
                    first = False
                    victim = order.pop()
                    preempted.append(victim)
                    available += len(requests[victim].block_ids) * page
                    free.extend(requests[victim].block_ids)
                if available < needed(order):
                    raise SglangAbort(f"step {state.step}: SGLang {SGLANG_VERSION} aborts {order[0]} (retract_decode: "
                                      "out of memory even after retracting all other requests)")
                running = order
                full = False
                kept_max_new = sum(self.max_new_tokens[r] for r in running)
                ratio = min(1.0, (sum(outputs(r) for r in running) + RETRACT_DECODE_STEPS * len(running))
                            / (kept_max_new + 1))
            decodes = running[:config.max_num_batched_tokens]  # the spec's token budget (module docstring)
            scheduled = tuple(item(r, 1) for r in decodes)
            for r in running:  # ScheduleBatch.prepare_for_decode: Req.refresh_fill_ids
                fill_len[r] = requests[r].num_tokens
        else:
            prefill, scheduled = (), ()
            if not waiting and chunked is None:  # rule 10: Scheduler.on_idle when fully idle
                ratio = INIT_NEW_TOKEN_RATIO
        plan = StepPlan(scheduled=scheduled, preempted=tuple(preempted), rejected=rejected)
        requeued += [r for r in preempted if r not in requeued]  # then retract_decode's, in its order
        return _Decision(plan, prefill, chunked, tuple(running), tuple(waiting), full, ratio, tuple(requeued),
                         fill_len)

    def _offset(self, request_id: str) -> float:
        """``PrefillAdder._get_running_request_total_token_offset`` (rule 4): a running request's remaining
        clipped output, capped at 4096, times the new-token ratio (tokens)."""
        request = self.state.requests[request_id]
        return (min(self.max_new_tokens[request_id] - request.num_output_tokens, CLIP_MAX_NEW_TOKENS)
                * self._ratio_of(request))

    def _ratio_of(self, request: Request) -> float:
        """The new-token ratio SGLang applies to ``request``'s remaining output: 1 for a request it runs with
        ``ignore_eos`` (rule 13: it always runs to its ``max_new_tokens``), else the tracker's."""
        return 1.0 if ignores_eos(request) else self.ratio

    def _admit(self, request: Request, budget: _Budget, running: list[str], admitted: list[str]
               ) -> tuple[str, int, bool]:
        """``PrefillAdder.add_one_req``: rule 13 for a request SGLang runs with ``ignore_eos``, else rule 7."""
        if ignores_eos(request):
            return self._add_one_req_ignore_eos(request, budget, running, admitted)
        return self._add_one_req(request, budget, bool(admitted))

    def _preempt_to_schedule(self, request: Request, budget: _Budget, running: list[str], admitted: list[str],
                             fill_len: Mapping[str, int]) -> list[str]:
        """``PrefillAdder.preempt_to_schedule`` (rule 12): the running requests preempted for ``request``, in
        the order taken, or none. Takes them from the least urgent (greatest ``priority``, then the last to
        join the queue), each more than ``PREEMPTION_THRESHOLD`` less urgent than ``request``, until the sum of
        their :meth:`_offset` covers ``len(full_untruncated_fill_ids) + min(max_new_tokens, 4096) -
        rem_total_tokens``; none if it never does. Taken, each leaves the budget's ``total_offset`` and gives
        its pages back (``ScheduleBatch.release_req``)."""
        requests = self.state.requests
        need = (fill_len.get(request.request_id, 0)
                + min(self.max_new_tokens[request.request_id], CLIP_MAX_NEW_TOKENS) - budget.rem_total)
        victims: list[str] = []
        for r in sorted(running, key=lambda r: (-requests[r].priority, -self.entered[r])):
            if requests[r].priority - request.priority <= PREEMPTION_THRESHOLD:
                break
            victims.append(r)
            need -= self._offset(r)
            if need <= 0:
                break
        if not victims or need > 0:
            return []
        for k, r in enumerate(victims, 1):
            budget.total_offset -= self._offset(r)
            budget.free += len(requests[r].block_ids) * budget.page
            trial = attrs.evolve(budget, req_states=None if budget.req_states is None else list(budget.req_states))
            if k < len(victims) and self._admit(request, trial, [r for r in running if r not in victims[:k]],
                                                admitted)[1]:
                found = ExcessPreemption(self.state.step, request.request_id, tuple(victims), k)
                if found not in self.excess_preemptions:  # a step planned again (an arrival) finds it again
                    self.excess_preemptions.append(found)
                break
        for r in victims[k:]:
            budget.total_offset -= self._offset(r)
            budget.free += len(requests[r].block_ids) * budget.page
        return victims

    def _add_one_req(self, request: Request, budget: _Budget, others: bool) -> tuple[str, int, bool]:
        """``PrefillAdder.add_one_req`` for a request with an end-of-sequence id (rule 7): ``(result, tokens
        admitted or 0, whether it is now the chunked request)``."""
        page = budget.page
        max_new_tokens = self.max_new_tokens[request.request_id]
        max_new = min(max(max_new_tokens - request.num_output_tokens, 0), CLIP_MAX_NEW_TOKENS)
        extend = request.num_tokens  # nothing cached: prompt plus the kept output tokens
        if not extend + max_new + page < budget.rem_total:
            return NO_TOKEN, 0, False
        paged = _ceil_page(extend, page)
        if budget.rem_chunk is None and others and paged >= budget.rem_input:
            return OTHER, 0, False
        reserved = min(max_new_tokens, CLIP_MAX_NEW_TOKENS)
        is_chunked = False
        if budget.rem_chunk is not None and paged > budget.rem_chunk:
            extend = budget.rem_chunk // page * page
            if extend <= 0:
                return OTHER, 0, False
            is_chunked, reserved = True, 0
        budget.reserve(extend, reserved)
        return budget.state(), extend, is_chunked

    def _add_one_req_ignore_eos(self, request: Request, budget: _Budget, running: list[str],
                                admitted: list[str]) -> tuple[str, int, bool]:
        """``PrefillAdder.add_one_req_ignore_eos`` (rule 13): ``(result, tokens admitted or 0, whether it is now
        the chunked request)``."""
        page, requests = budget.page, self.state.requests
        extend = request.num_tokens  # nothing cached: prompt plus the kept output tokens
        paged_input = _ceil_page(extend, page) + page
        if not paged_input <= min(budget.free - budget.current_offset, budget.rem_total):
            return NO_TOKEN, 0, False

        def state_of(request_id: str) -> tuple[float, int] | None:
            other = requests[request_id]
            left = self.max_new_tokens[request_id] * self._ratio_of(other) - other.num_output_tokens
            return (left, other.num_tokens) if left > 0 else None

        if budget.req_states is None:  # this request, the running batch, then the pass's admitted ones
            budget.req_states = sorted((found for r in (request.request_id, *running, *admitted)
                                        if (found := state_of(r)) is not None), key=lambda x: x[0])
        elif (found := state_of(request.request_id)) is not None:
            at = 0  # the first state with at least as many tokens left, else before the last one
            for at in range(len(budget.req_states)):
                if found[0] <= budget.req_states[at][0]:
                    break
            budget.req_states.insert(at, found)
        remaining, freed = budget.free - budget.current_offset - paged_input, 0
        for index, (left, occupied) in enumerate(budget.req_states):
            batch = len(budget.req_states) - index
            if remaining + freed - left * batch <= IGNORE_EOS_RESERVE_TOKENS * batch:
                return NO_TOKEN, 0, False
            freed += occupied
        if budget.rem_chunk is None or extend <= budget.rem_chunk:
            budget.reserve(extend, min(self.max_new_tokens[request.request_id], CLIP_MAX_NEW_TOKENS))
            return budget.state(), extend, False
        if budget.rem_chunk <= 0:
            return OTHER, 0, False
        tokens = budget.rem_chunk  # not rounded to a page, unlike rule 7
        budget.reserve(tokens, 0)
        return budget.state(), tokens, True

    # --------------------------------------------------------------------------- update
    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int]) -> tuple[str, ...]:
        """Apply the plan by the spec's transition and SGLang's bookkeeping after the step (the merge of
        the prefill batch at the next ``get_next_batch_to_run``, rule 3).

        Raises:
            ValueError: ``plan`` is not the plan ``schedule`` returned."""
        decision = self._decision
        if decision is None or plan != decision.plan:
            raise ValueError("update: the plan is not the one schedule() returned")
        result = apply_plan(self.state, plan, sampled_token_ids, self.config)
        self.state = result.state
        finished = set(result.finished)
        ended = set(self.max_new_tokens) - set(self.state.requests)
        self.waiting = [r for r in decision.waiting if r not in ended]
        self._enqueue(r for r in decision.requeued if r not in ended)
        self.fill_len = decision.fill_len
        self.chunked = decision.chunked
        self.ratio = decision.ratio
        running = [r for r in decision.running if r not in ended]
        full = decision.batch_is_full
        if decision.prefill:
            last = [r for r in decision.prefill if r != decision.chunked and r not in ended]
            if len(last) < len(decision.prefill):
                full = False  # the filtered last prefill batch shrank
            if last:
                if running:
                    running += last  # ScheduleBatch.merge_batch
                else:
                    running, full = last, False  # the last prefill batch becomes the running batch
        elif finished & set(decision.running):
            full = False  # running_batch.filter_batch() drops the finished requests
        self.running = running
        self.batch_is_full = full
        for request_id in ended:
            self._forget(request_id)
        self._decision = None
        return result.finished


def sglang_profile(config: SchedulerConfig) -> SglangProfile:
    """The registry's ``sglang-profile`` factory (module docstring)."""
    return SglangProfile(config)


def sglang_profile_priority(config: SchedulerConfig) -> SglangProfile:
    """The registry's ``sglang-profile-priority`` factory: rule 12 on (module docstring)."""
    return SglangProfile(config, "sglang-profile-priority", priority=True)


# ------------------------------------------------------------------ what SGLang and the spec agree on
def comparable_config(config: SchedulerConfig) -> SchedulerConfig | None:
    """``config`` moved onto where SGLang's limits and the spec's agree, for differential tests
    (``schedspec diff``), or ``None`` if it cannot be: ``max_num_batched_tokens >= max_num_seqs`` (SGLang
    decodes every running request in one step, with no token budget: the spec's ``token-budget`` would
    stop the run) and, with chunked prefill, ``>= block_size`` (a chunk is cut to whole pages: with
    ``chunked_prefill_size`` under a page SGLang never admits a prompt longer than it, rule 7), at least 8
    tokens of ``max_model_len`` and of pool (SGLang refuses every prompt when
    ``max_req_input_len`` is under 1), at least two pages (SGLang admits nothing into a one-page pool:
    :func:`admissible_alone`), and the features the adapter refuses off."""
    try:
        return config.with_changes(
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs,
                                       config.block_size if config.enable_chunked_prefill else 0),
            max_model_len=max(config.max_model_len, 8),
            num_kv_blocks=max(config.num_kv_blocks, 2, -(-8 // config.block_size)),
            enable_prefix_caching=False, long_prefill_token_threshold=0)
    except (ValueError, TypeError):
        return None


def comparable_request(spec: RequestSpec, config: SchedulerConfig, unclip: bool = False) -> RequestSpec:
    """A request moved onto what the ``sglang`` adapter takes into SGLang's queue unchanged
    (its tokenizer manager's checks and ``validate_input_length``, which the adapter applies:
    ``engines/sglang.py`` ``front_end_rejection``) and SGLang can admit into an empty pool (:func:`admissible_alone`): the
    prompt under ``max_req_input_len`` and under ``pool tokens - page_size``, ``prompt_len + max_tokens``
    at most ``max_model_len``, an abort only in its arrival step (the adapter refuses to abort an
    admitted request); with ``unclip`` also ``max_tokens`` at most the clipped ``max_new_tokens`` (rule 1;
    at least 1), so that SGLang runs the request to its end. Without it the clipping is left alone: the
    profile reproduces it and the run stops at the finding it is (docs/findings/sglang-clips-max-tokens.md)."""
    page = config.block_size
    prompt_len = max(1, min(spec.prompt_len, max_req_input_len(config) - 1, pool_tokens(config) - page - 1))
    max_tokens = max(1, min(spec.max_tokens, config.max_model_len - prompt_len))
    if unclip:
        max_tokens = max(1, min(max_tokens, clipped_max_new_tokens(prompt_len, max_tokens, config)))
    abort = None if spec.abort_at_step is None else spec.arrival_step
    return attrs.evolve(spec, prompt_len=prompt_len, max_tokens=max_tokens, abort_at_step=abort)


def admissible_alone(prompt_len: int, max_tokens: int, config: SchedulerConfig) -> bool:
    """Whether SGLang admits a fresh request of this shape into an empty pool (rule 7 with nothing
    running): ``prompt_len + min(clipped max_new_tokens, 4096) + page_size < pool tokens``. Clipping
    (rule 1) makes this hold whenever the clipped ``max_new_tokens`` is positive; when it is 0 (the
    page-rounded prompt and a page leave no token) it holds only if ``prompt_len + page_size < pool``,
    so a request with ``prompt_len >= pool - page_size`` that passes ``validate_input_length`` waits
    forever, and the requests behind it too (docs/findings/sglang-unadmittable-request-blocks-queue.md)."""
    clipped = min(clipped_max_new_tokens(prompt_len, max_tokens, config), CLIP_MAX_NEW_TOKENS)
    return prompt_len + clipped + config.block_size < pool_tokens(config)


def clipped_finishes(state: SchedulerState, config: SchedulerConfig) -> frozenset[str]:
    """The live requests of ``state`` (the spec's, after a step) that SGLang has ended at their clipped
    ``max_new_tokens`` (rule 1) while the spec runs them on: ``max(1, clipped) == outputs < max_tokens``
    (with ``max_new_tokens`` clipped to 0 SGLang still samples the prefill's token)."""
    return frozenset(
        request_id for request_id, request in state.requests.items()
        if request.num_output_tokens < request.max_tokens
        and request.num_output_tokens == max(1, clipped_max_new_tokens(request.prompt_len, request.max_tokens, config)))


def clipped_stops(state: SchedulerState, config: SchedulerConfig) -> frozenset[str]:
    """The requests the spec ended with ``stop`` at their first output, in ``state`` (after a step), whose
    ``max_new_tokens`` SGLang clipped to 0 at arrival (rule 1): SGLang ends such a request at the prefill's
    token with ``length`` even when that token is its end-of-sequence id, so only the reason differs, the
    finding ``sglang-clips-max-tokens`` again (seen through the adapter on 29 of the 1,000 scenarios of
    ``schedspec diff --scheduler sglang --against sglang-profile --seed 20261206``, every one a request clipped
    to 0 whose first output was its EOS; ``Req.update_finish_state`` tests the sampled token before the length
    for a request with ``max_new_tokens >= 1``, so the reason differs only at 0)."""
    return frozenset(
        request_id for request_id, request in state.finished.items()
        if request.finish_reason == "stop" and request.num_output_tokens == 1
        and clipped_max_new_tokens(request.prompt_len, request.max_tokens, config) == 0)
