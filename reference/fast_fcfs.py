"""``fcfs-fast``: the ``fcfs`` policy with its own mutable state, for speed only.

:class:`FastFcfsScheduler` emits exactly the plans :func:`schedspec.reference.policies.fcfs` emits and
ends every step in exactly the state :func:`schedspec.spec.transitions.apply_plan` gives (its
:attr:`~FastFcfsScheduler.state`, built on demand), but keeps its state in mutable tables updated in
place: one record per live request (:class:`LiveRequest`: computed tokens, output count, block table,
status), the queues as lists and the free queue as a stack. The plain policy and the spec's transitions
stay the definition; this is an implementation tested equal to them step for step
(``tests/test_fast_fcfs.py``: Hypothesis workloads with arrivals, aborts, preemption, chunking, stops and
rejections, and every bundled scenario), and the engine loop checks its plans against the spec like any
scheduler's when checks are on.

Why: the plain ``fcfs`` scheduler builds a new immutable :class:`~schedspec.spec.request.Request` for
every scheduled request of every step (the spec's transitions are pure), and plans by re-deriving
everything from the state; over the one-hour Azure trace (46,000 steps, four million scheduled tokens)
that is most of a lab run. With checks off the lab (:class:`~schedspec.reference.engine.Engine`) drives
this scheduler without building spec states at all (:meth:`FastFcfsScheduler.live_view`,
:meth:`FastFcfsScheduler.step_views`).

Prefix caching is not implemented here: with ``enable_prefix_caching`` the factory
:func:`fcfs_fast` returns the plain ``fcfs`` scheduler.

Sources: as :func:`~schedspec.reference.policies.plan_step` (vLLM 0.32 ``Scheduler.schedule``) for the
plans and :mod:`schedspec.spec.transitions` for the updates.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens
from schedspec.spec.persistent import TerminalRequests, evolve_request
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.stop_rule import stop_reason_of
from schedspec.spec.transitions import PlanError

from . import policies
from .scheduler import ALL_PROPERTIES, ReferenceScheduler, UnsupportedFeature

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED


class RequestPhase:
    """A request as a step's statistics read it: whether its chunk is a decode, and its prompt length
    (tokens). Immutable; one per request and phase, shared between steps."""

    __slots__ = ("is_decode", "prompt_len")

    def __init__(self, is_decode: bool, prompt_len: int) -> None:
        self.is_decode = is_decode
        self.prompt_len = prompt_len

    @property
    def is_prefill(self) -> bool:
        return not self.is_decode


class LiveRequest:
    """A live request's mutable record (the fields of :class:`~schedspec.spec.request.Request` that a
    step changes). Reads like a ``Request`` for what token sources use (``prompt_len``,
    ``output_token_ids``, ``num_computed_tokens``, ``block_ids``, ``num_tokens``, ``is_decode``)."""

    __slots__ = ("request", "request_id", "prompt_len", "num_tokens", "num_computed_tokens", "output_token_ids",
                 "block_ids", "status", "num_preemptions", "admitted_step", "first_token_step", "cached",
                 "phases", "stop_ids", "end_tokens")

    def __init__(self, request: Request, max_model_len: int) -> None:
        self.request = request
        self.request_id = request.request_id
        self.prompt_len = request.prompt_len
        self.output_token_ids = list(request.output_token_ids)
        self.num_tokens = self.prompt_len + len(self.output_token_ids)
        self.num_computed_tokens = request.num_computed_tokens
        self.block_ids = list(request.block_ids)
        self.status = request.status
        self.num_preemptions = request.num_preemptions
        self.admitted_step = request.admitted_step
        self.first_token_step = request.first_token_step
        self.cached: Request | None = request
        """The equal immutable ``Request``, or ``None`` after a change (built again on demand)."""
        self.phases = (RequestPhase(False, self.prompt_len), RequestPhase(True, self.prompt_len))
        """Its phases as a step's statistics read them, prefill then decode (shared between steps)."""
        stop_ids = set(request.stop_token_ids)
        if request.eos_token_id is not None:
            stop_ids.add(request.eos_token_id)
        self.stop_ids = frozenset(stop_ids)
        """Sampled ids that stop it (its EOS and stop ids; after ``min_tokens`` outputs)."""
        self.end_tokens = min(max_model_len, self.prompt_len + request.max_tokens)
        """At this many tokens it ends by length (``max_model_len`` or ``max_tokens``)."""

    @property
    def is_decode(self) -> bool:
        """As :attr:`Request.is_decode`."""
        return self.num_tokens - self.num_computed_tokens == 1 and self.num_computed_tokens >= self.prompt_len

    @property
    def is_prefill(self) -> bool:
        return not self.is_decode

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def frozen(self, **changes: object) -> Request:
        """The immutable ``Request`` equal to this record (with ``changes``)."""
        if self.cached is not None and not changes:
            return self.cached
        fields = {"status": self.status, "num_computed_tokens": self.num_computed_tokens,
                  "output_token_ids": tuple(self.output_token_ids), "block_ids": tuple(self.block_ids),
                  "num_preemptions": self.num_preemptions, "admitted_step": self.admitted_step,
                  "first_token_step": self.first_token_step}
        fields.update(changes)
        request = evolve_request(self.request, **fields)
        if not changes:
            self.cached = request
        return request


# ScheduledRequest built without attrs' __init__ (its frozen __setattr__ costs a third of a decode step at
# 256 running requests): the same slots set directly; equal to ScheduledRequest(...) (tests/test_fast_fcfs.py).
_ScheduledRequest = ScheduledRequest
_new_item = object.__new__
_set_id = ScheduledRequest.__dict__["request_id"].__set__
_set_computed = ScheduledRequest.__dict__["num_computed_tokens"].__set__
_set_tokens = ScheduledRequest.__dict__["num_tokens"].__set__
_set_blocks = ScheduledRequest.__dict__["new_block_ids"].__set__
_set_cached = ScheduledRequest.__dict__["cached_block_ids"].__set__
_set_spec = ScheduledRequest.__dict__["spec_token_ids"].__set__
_set_groups = ScheduledRequest.__dict__["group_new_block_ids"].__set__  # KV cache groups: none here
_set_skipped = ScheduledRequest.__dict__["skipped_block_ids"].__set__
_set_group_hits = ScheduledRequest.__dict__["group_cached_block_ids"].__set__
_set_deduplicated = ScheduledRequest.__dict__["deduplicated_block_ids"].__set__  # SGLang's publication: none here


class _Sized:
    """A length without the items (a step view's free queue: copying it every step would cost more
    than the step)."""

    __slots__ = ("_length",)

    def __init__(self, length: int) -> None:
        self._length = length

    def __len__(self) -> int:
        return self._length


class LightState:
    """What a step view of :class:`FastFcfsScheduler` offers in place of a
    :class:`~schedspec.spec.state.SchedulerState`: ``step``, ``requests`` (request id -> a record that
    reads like a ``Request`` for the fields it names), ``running`` and ``waiting`` (ids) and
    ``free_block_ids`` (only its ``len`` is guaranteed). Not a step summary: it stands for the state
    in :class:`~schedspec.reference.engine.StepView`'s ``before`` and ``after`` in an unchecked
    ``fcfs-fast`` run, where building the spec state per step is what ``fcfs-fast`` saves."""

    __slots__ = ("step", "requests", "running", "waiting", "free_block_ids")

    def __init__(self, step: int, requests: Mapping, running, waiting, free_block_ids) -> None:
        self.step = step
        self.requests = requests
        self.running = running
        self.waiting = waiting
        self.free_block_ids = free_block_ids

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)


class FastFcfsScheduler:
    """The ``fcfs`` policy on mutable tables (module docstring). Implements the
    :class:`~schedspec.reference.scheduler.Scheduler` protocol; :attr:`state` is the spec state the
    plain ``fcfs`` scheduler would hold, built on demand (O(live requests + blocks))."""

    def __init__(self, config: SchedulerConfig, name: str = "fcfs-fast",
                 guarantees: frozenset[str] = ALL_PROPERTIES) -> None:
        if config.enable_prefix_caching:
            raise ValueError("FastFcfsScheduler: prefix caching is not implemented (use fcfs)")
        self.config = config
        self.name = name
        self.guarantees = guarantees
        self.step = 0
        self.num_requests_added = 0
        self.live: dict[str, LiveRequest] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.free: list[int] = list(range(config.num_kv_blocks - 1, -1, -1))
        """The free queue as a stack: its front is the end of the list (allocation pops, releases push)."""
        self.finished = TerminalRequests()
        self.impossible: dict[str, str] = {}
        """Waiting never-admitted requests that can never complete, in queue order, with the reason: the
        next plan rejects them (:func:`~schedspec.reference.policies.reject_impossible`)."""
        self._state: SchedulerState | None = None
        self._last: tuple[StepPlan, list[LiveRequest]] = (StepPlan(), [])
        """The last plan applied and the records that sampled in it (for :meth:`step_views`)."""

    # --- the protocol -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """As :func:`schedspec.spec.transitions.add_request` (same errors)."""
        request_id = request.request_id
        if request_id in self.live or request_id in self.finished:
            raise PlanError(f"request_id={request_id!r} was already added")
        if request.max_tokens < 0:
            raise PlanError(f"request_id={request_id!r}: max_tokens={request.max_tokens} < 0")
        if (request.status is not _WAITING or request.num_computed_tokens or request.output_token_ids
                or request.block_ids):
            raise PlanError(f"request_id={request_id!r} is not a fresh request (status={request.status.value})")
        if request.grammar_ready_step is not None:
            raise UnsupportedFeature(f"scheduler {self.name!r}: request {request_id!r} has structured output "
                                     "(grammar_compile_steps), which fcfs-fast does not implement; use fcfs")
        self.live[request_id] = LiveRequest(request, self.config.max_model_len)
        self.waiting.append(request_id)
        self.num_requests_added += 1
        if request.admitted_step is None:
            reason = rejection_reason(request.prompt_len, request.max_tokens, self.config)
            if reason is not None:
                self.impossible[request_id] = reason
        self._state = None

    def abort_request(self, request_id: str) -> None:
        """As :func:`schedspec.spec.transitions.abort_request`: its blocks go to the front of the free
        queue, last block first; unknown or ended ids change nothing."""
        record = self.live.pop(request_id, None)
        if record is None:
            return
        self.free.extend(record.block_ids)  # front of the queue, last block first
        if record.status is _RUNNING:
            self.running.remove(request_id)
        else:
            self.waiting.remove(request_id)
        self.impossible.pop(request_id, None)
        ended = record.frozen(status=RequestStatus.FINISHED_ABORTED, finish_reason="abort", block_ids=())
        self.finished = self.finished.with_added({request_id: ended})
        self._state = None

    def schedule(self) -> StepPlan:
        """The plan :func:`~schedspec.reference.policies.fcfs` returns for :attr:`state` (the same
        three phases as :func:`~schedspec.reference.policies.plan_step`, on the mutable tables)."""
        config = self.config
        block_size = config.block_size
        chunked = config.enable_chunked_prefill
        threshold = config.long_prefill_token_threshold
        live = self.live
        budget = config.max_num_batched_tokens
        free = self.free
        top = len(free)  # the pool: free[top - 1 - next] is the front's next block
        taken = 0
        released: list[int] = []  # blocks released by this plan's preemptions, taken after the free ones
        scheduled: list[ScheduledRequest] = []
        append = scheduled.append
        preempted: list[str] = []
        running = self.running

        records = [live[request_id] for request_id in running]
        decodes = [record for record in records if record.num_tokens - record.num_computed_tokens == 1]
        prefills = ([record for record in records if record.num_tokens - record.num_computed_tokens != 1]
                    if len(decodes) < len(records) else [])
        preempted_ids: set[str] = set()
        victims = running  # candidates, most recently admitted last (copied at the first preemption)
        for record in decodes + prefills if prefills else decodes:
            request_id = record.request_id
            if preempted and request_id in preempted_ids:
                continue
            if budget == 0:
                break
            computed = record.num_computed_tokens
            pending = record.num_tokens - computed
            if pending == 1:  # budget > 0 here: _chunk gives 1 token whatever the threshold and chunking
                num_tokens = 1
            else:
                if not chunked:
                    num_tokens = pending if pending <= budget else 0
                else:
                    if threshold and pending > threshold:
                        pending = threshold
                    num_tokens = pending if pending < budget else budget
                if num_tokens == 0:
                    continue
            end = computed + num_tokens
            needed = blocks_for_tokens(end, block_size) - len(record.block_ids)
            item = _new_item(_ScheduledRequest)
            _set_id(item, request_id)
            _set_computed(item, computed)
            _set_tokens(item, num_tokens)
            _set_cached(item, ())
            _set_spec(item, ())
            _set_groups(item, ())
            _set_skipped(item, ())
            _set_group_hits(item, ())
            _set_deduplicated(item, ())
            if needed > 0:
                if needed > top + len(released) - taken:
                    if victims is running:
                        victims = list(running)
                    gone = preempted_ids | {done.request_id for done in scheduled}
                    while needed > top + len(released) - taken:
                        while victims[-1] in gone:
                            victims.pop()
                        victim = victims.pop()
                        gone.add(victim)
                        preempted_ids.add(victim)
                        preempted.append(victim)
                        released.extend(reversed(live[victim].block_ids))
                        if victim == request_id:
                            break
                    if request_id in preempted_ids:
                        continue
                stop = taken + needed
                if stop <= top:
                    _set_blocks(item, tuple(free[top - stop:top - taken][::-1]))
                else:
                    _set_blocks(item, (tuple(free[:top - taken][::-1]) if taken < top else ()) + tuple(
                        released[max(taken - top, 0):stop - top]))
                taken = stop
            else:
                _set_blocks(item, ())
            append(item)
            budget -= num_tokens

        impossible = self.impossible
        if not preempted and self.waiting:
            num_running = len(running)
            max_num_seqs = config.max_num_seqs
            for request_id in self.waiting:
                if request_id in impossible:
                    continue
                if num_running >= max_num_seqs or budget == 0:
                    break
                record = live[request_id]
                computed = record.num_computed_tokens
                needed = blocks_for_tokens(record.num_tokens, block_size)
                pending = record.num_tokens - computed
                if not chunked:
                    num_tokens = pending if pending <= budget else 0
                else:
                    if threshold and pending > threshold:
                        pending = threshold
                    num_tokens = pending if pending < budget else budget
                if num_tokens == 0 or needed > top + len(released) - taken:
                    break
                stop = taken + needed
                if stop <= top:
                    new_blocks = tuple(free[top - stop:top - taken][::-1])
                else:
                    new_blocks = (tuple(free[:top - taken][::-1]) if taken < top else ()) + tuple(
                        released[max(taken - top, 0):stop - top])
                taken = stop
                scheduled.append(ScheduledRequest(request_id, computed, num_tokens, new_blocks))
                budget -= num_tokens
                num_running += 1
        return StepPlan(scheduled=tuple(scheduled), preempted=tuple(preempted), rejected=tuple(impossible.items()))

    def update(self, plan: StepPlan, sampled_token_ids: Mapping[str, int]) -> tuple[str, ...]:
        """As :func:`schedspec.spec.transitions.apply_plan` (preempt, reject, schedule, sample), in place.

        Raises:
            PlanError: a named request is not live, or a sampling request has no sampled token.
        """
        live = self.live
        step = self.step
        running = self.running
        waiting = self.waiting
        free = self.free
        config = self.config
        self._state = None
        released: list[int] = []  # front first, as StepInProgress.released
        for request_id in plan.preempted:
            record = self._live(request_id)
            released[:0] = reversed(record.block_ids)
            record.status = _PREEMPTED
            record.num_computed_tokens = 0
            record.block_ids = []
            record.num_preemptions += 1
            record.cached = None
            running.remove(request_id)
            waiting.insert(0, request_id)
        ended: dict[str, Request] = {}
        for request_id, reason in plan.rejected:
            record = self._live(request_id)
            del live[request_id]
            waiting.remove(request_id)
            self.impossible.pop(request_id, None)
            ended[request_id] = record.frozen(status=RequestStatus.REJECTED, finish_reason=reason)
        taken: list[int] = []
        admitted: list[str] = []
        samplers: list[LiveRequest] = []
        for item in plan.scheduled:
            request_id = item.request_id
            record = live.get(request_id)
            if record is None:
                raise PlanError(f"request_id={request_id!r} is not a live request at step {step}")
            if item.cached_block_ids:
                raise PlanError(f"request_id={request_id!r}: a prefix-cache hit without prefix caching")
            if item.num_computed_tokens + item.num_tokens == record.num_tokens:
                samplers.append(record)
            record.num_computed_tokens += item.num_tokens
            new_blocks = item.new_block_ids
            if new_blocks:
                record.block_ids.extend(new_blocks)
                taken.extend(new_blocks)
            record.cached = None
            if record.status is not _RUNNING:
                record.status = _RUNNING
                record.admitted_step = step
                admitted.append(request_id)
        if admitted:
            if len(admitted) <= 4 or admitted != waiting[:len(admitted)]:
                for request_id in admitted:
                    waiting.remove(request_id)
            else:
                del waiting[:len(admitted)]
            running.extend(admitted)
        # the free queue: released blocks in front of the old queue, less the taken ones
        if released or taken:
            count = len(taken)
            if not released and free[len(free) - count:][::-1] == taken:
                del free[len(free) - count:]
            else:
                queue = released + free[::-1]
                gone = set(taken)
                free[:] = [block_id for block_id in queue if block_id not in gone][::-1]
        finished: list[str] = []
        max_model_len = config.max_model_len
        for record in samplers:
            request_id = record.request_id
            try:
                token_id = sampled_token_ids[request_id]
            except KeyError:
                raise PlanError(f"no sampled token for request_id={request_id!r} at step {step}") from None
            outputs = record.output_token_ids
            outputs.append(token_id)
            num_tokens = record.num_tokens = record.num_tokens + 1
            if record.first_token_step is None:
                record.first_token_step = step
            if num_tokens < record.end_tokens and token_id not in record.stop_ids:
                continue  # none of the reasons below holds
            request = record.request
            reason = stop_reason_of(token_id, len(outputs), num_tokens, request.eos_token_id,  # the spec's rule
                                    request.stop_token_ids, request.min_tokens, request.max_tokens, max_model_len)
            if reason is None:
                continue
            status = RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
            del live[request_id]
            running.remove(request_id)
            free.extend(record.block_ids)  # front of the queue, last block first
            ended[request_id] = record.frozen(status=status, finish_reason=reason, block_ids=())
            finished.append(request_id)
        if ended:
            self.finished = self.finished.with_added(ended)
        self.step = step + 1
        self._last = (plan, samplers)
        return tuple(finished)

    def _live(self, request_id: str) -> LiveRequest:
        record = self.live.get(request_id)
        if record is None:
            raise PlanError(f"request_id={request_id!r} is not a live request at step {self.step}")
        return record

    # --- views --------------------------------------------------------------------------------------

    @property
    def state(self) -> SchedulerState:
        """The spec state (equal to the plain ``fcfs`` scheduler's after the same calls), built on demand
        and kept until the next change."""
        if self._state is None:
            self._state = SchedulerState(
                step=self.step,
                waiting=tuple(self.waiting),
                running=tuple(self.running),
                requests=MappingProxyType({request_id: record.frozen() for request_id, record in self.live.items()}),
                finished=self.finished,
                free_block_ids=tuple(reversed(self.free)),
                num_requests_added=self.num_requests_added,
            )
        return self._state

    @property
    def has_live_requests(self) -> bool:
        return bool(self.live)

    def is_live(self, request_id: str) -> bool:
        return request_id in self.live

    def live_view(self) -> LightState:
        """The current state for a token source (valid until the next change): ``requests`` maps live ids
        to their :class:`LiveRequest` records, which read like requests."""
        return LightState(self.step, self.live, self.running, self.waiting, _Sized(len(self.free)))

    def step_views(self) -> tuple[LightState, LightState]:
        """``(before, after)`` of the step just updated, for the lab's statistics: ``before.requests``
        maps each request the last plan scheduled to its :class:`RequestPhase` before the step;
        ``after`` has the queues and the free queue's length after it."""
        plan, samplers = self._last
        sampled = {record.request_id for record in samplers}
        phases: dict[str, RequestPhase] = {}
        for item in plan.scheduled:
            request_id = item.request_id
            record = self.live.get(request_id)
            if record is None:  # it ended in the step
                ended = self.finished[request_id]
                record = LiveRequest(ended, self.config.max_model_len)
            # Request.is_decode before the step: one token pending (the chunk is that token and it sampled),
            # past the prompt
            is_decode = (item.num_tokens == 1 and item.num_computed_tokens >= record.prompt_len
                         and request_id in sampled)
            phases[request_id] = record.phases[is_decode]
        before = LightState(self.step - 1, phases, (), (), _Sized(0))
        after = LightState(self.step, self.live, tuple(self.running), tuple(self.waiting), _Sized(len(self.free)))
        return before, after


def fcfs_fast(config: SchedulerConfig) -> FastFcfsScheduler | ReferenceScheduler:
    """The ``fcfs-fast`` scheduler: :class:`FastFcfsScheduler`, or the plain ``fcfs`` scheduler when
    prefix caching, speculative decoding or a per-step limit (``LIMIT_DEFAULTS``, e.g. ``max_loras``) is on
    (not implemented on the mutable tables)."""
    if config.enable_prefix_caching or config.speculative or config.limits_on:
        return ReferenceScheduler(config, policies.fcfs, "fcfs-fast", ALL_PROPERTIES)
    return FastFcfsScheduler(config)
