"""Trace mutation operators: faults an engine can make, written into a correct step trace.

Each :class:`Mutation` takes a correct trace (the header and the records, as JSON objects) and a step
``i`` and returns a mutated copy together with the step at which the fault first becomes observable,
or ``None`` where it does not apply at ``i``. Each models a class of bug reported against public
serving engines (double allocation, a block freed twice or never, a leak on finish, abort or
preemption, budget or ``max_num_seqs`` exceeded, a chunk that skips or repeats tokens, a token after
finish or abort, a missing token, output past ``max_tokens``, a wrong finish reason, wrong counters,
time going backwards, ...). A checker is sound on a trace when it rejects every **semantic** mutant at
exactly that step and accepts the unmutated trace. Mutants marked not semantic change nothing the spec
constrains; a checker must accept them (each says why).

Used by ``tests/test_checker_mutations.py`` (a derandomized sample in CI) and
``benchmarks/checker_mutations.py`` (the whole catalogue on five real trace windows).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from schedspec.spec.checker import check_trace, plan_from_record, speculative_of, transfers_of
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.kv_cache_groups import NULL_BLOCK, num_skipped_blocks
from schedspec.spec.request import RequestStatus
from schedspec.spec.rules import RULES
from schedspec.spec.state import (
    SchedulerState,
    cadence_after,
    carries_prefill,
    prefill_held,
)
from schedspec.spec.trace import StepRecord, header_line, record_schema_errors
from schedspec.spec.transitions import abort_request, add_request, apply_plan

Record = dict[str, Any]


@attrs.define
class Trace:
    """A trace as JSON objects, with the spec's states before and after each step (from replaying it).

    Attributes:
        header: the header line.
        records: one dict per step.
        config: the header's config.
        before: ``before[i]``: the spec's state before step ``i`` is planned (arrivals and aborts applied).
        after: ``after[i]``: the state after step ``i``.
    """

    header: dict[str, Any]
    records: list[Record]
    config: SchedulerConfig
    before: list[SchedulerState]
    after: list[SchedulerState]

    @classmethod
    def of(cls, header: dict[str, Any], records: Sequence[StepRecord]) -> Trace:
        """Replay correct records on the spec (they must be legal) and keep every state."""
        config = SchedulerConfig.from_dict(header["config"])
        state = SchedulerState.initial(config, asynchronous=bool(header.get("async_scheduling", False)))
        before, after = [], []
        for record in records:
            for spec in record.arrivals:
                state = add_request(state, spec.to_request(record.step))
            for request_id in record.aborts:
                state = abort_request(state, request_id)
            before.append(state)
            state = apply_plan(state, plan_from_record(record), record.sampled_token_ids, config,
                               speculative_of(record), transfers_of(record)).state
            after.append(state)
        return cls(header, [r.to_dict() for r in records], config, before, after)


Mutant = tuple[dict[str, Any], list[Record], int]
"""(header, records, the first step at which the fault is observable)."""


@attrs.frozen
class Mutation:
    """A mutation operator.

    Attributes:
        name: kebab-case name.
        models: the engine bug class it models.
        apply: ``(trace, i) -> Mutant | None``.
        semantic: False for a mutant that changes nothing the spec constrains (a checker must accept it).
        why_not_semantic: for those, the reason.
        applies: a cheap ``(trace, i) -> bool`` for operators whose ``apply`` copies many records; by
            default ``apply(trace, i) is not None``.
    """

    name: str
    models: str
    apply: Callable[[Trace, int], Mutant | None]
    semantic: bool = True
    why_not_semantic: str = ""
    applies: Callable[[Trace, int], bool] | None = None


def _edit(trace: Trace, i: int) -> tuple[list[Record], Record]:
    """A copy of the records whose record ``i`` may be edited in place."""
    records = list(trace.records)
    records[i] = copy.deepcopy(records[i])
    return records, records[i]


def _edit_from(trace: Trace, i: int) -> list[Record]:
    """A copy of the records in which records ``i`` and later may be edited in place."""
    return trace.records[:i] + [copy.deepcopy(r) for r in trace.records[i:]]


def _scheduled(record: Record, predicate: Callable[[dict], bool]) -> dict | None:
    return next((item for item in record["scheduled"] if predicate(item)), None)


def _finishing(trace: Trace, i: int, reason: str | None = None) -> str | None:
    finished = trace.records[i]["finished"]
    return next((r for r, why in sorted(finished.items()) if reason is None or why == reason), None)


# --- blocks -----------------------------------------------------------------------------------------


def double_allocation(trace: Trace, i: int) -> Mutant | None:
    record = trace.records[i]
    before = trace.before[i]
    preempted = set(record["preempted"])
    finishing = set(record["finished"])
    for taker, blocks in sorted(record["blocks_allocated"].items()):
        if not blocks:
            continue
        for owner_id in before.running:
            owner = before.requests[owner_id]
            if owner_id != taker and owner.block_ids and owner_id not in preempted and owner_id not in finishing:
                records, r = _edit(trace, i)
                r["blocks_allocated"][taker][0] = owner.block_ids[0]
                return trace.header, records, i
    return None


def allocation_out_of_range(trace: Trace, i: int) -> Mutant | None:
    for taker, blocks in sorted(trace.records[i]["blocks_allocated"].items()):
        if blocks:
            records, r = _edit(trace, i)
            r["blocks_allocated"][taker][0] = trace.config.num_kv_blocks + 7
            return trace.header, records, i
    return None


def allocation_outside_batch(trace: Trace, i: int) -> Mutant | None:
    record = trace.records[i]
    before = trace.before[i]
    scheduled = {item["request_id"] for item in record["scheduled"]}
    loading = record.get("kv_loads", {})  # a remote KV load's blocks are its own allocation
    idle = [r for r in before.running + before.waiting
            if r not in scheduled and r not in record["rejected"] and r not in loading]
    taken = {b for blocks in record["blocks_allocated"].values() for b in blocks}
    spare = [b for b in before.free_block_ids if b not in taken]
    if not idle or not spare:
        return None
    records, r = _edit(trace, i)
    r["blocks_allocated"][idle[0]] = [spare[-1]]
    return trace.header, records, i


def free_twice(trace: Trace, i: int) -> Mutant | None:
    for request_id, blocks in sorted(trace.records[i]["blocks_freed"].items()):
        if blocks:
            records, r = _edit(trace, i)
            r["blocks_freed"][request_id].append(blocks[0])
            return trace.header, records, i
    return None


def free_foreign_block(trace: Trace, i: int) -> Mutant | None:
    before = trace.before[i]
    for request_id, blocks in sorted(trace.records[i]["blocks_freed"].items()):
        foreign = [b for b in before.free_block_ids if b not in blocks]
        if blocks and foreign:
            records, r = _edit(trace, i)
            r["blocks_freed"][request_id][-1] = foreign[0]
            return trace.header, records, i
    return None


def _drop_freed(trace: Trace, i: int, request_id: str, whole: bool, counters: bool) -> Mutant | None:
    blocks = trace.records[i]["blocks_freed"].get(request_id)
    if not blocks:
        return None
    records = _edit_from(trace, i) if counters else _edit(trace, i)[0]
    r = records[i]
    lost = len(blocks) if whole else 1
    if whole:
        del r["blocks_freed"][request_id]
    else:
        r["blocks_freed"][request_id] = blocks[:-1]
    if counters:  # the engine's free count agrees with its leak from here on
        for later in records[i:]:
            later["num_free_blocks"] = max(0, later["num_free_blocks"] - lost)
    return trace.header, records, i


def leak_on_finish_ids_only(trace: Trace, i: int) -> Mutant | None:
    request_id = _finishing(trace, i)
    return None if request_id is None else _drop_freed(trace, i, request_id, whole=False, counters=False)


def leak_on_finish(trace: Trace, i: int) -> Mutant | None:
    request_id = _finishing(trace, i)
    return None if request_id is None else _drop_freed(trace, i, request_id, whole=False, counters=True)


def leak_on_preempt(trace: Trace, i: int) -> Mutant | None:
    preempted = trace.records[i]["preempted"]
    return None if not preempted else _drop_freed(trace, i, preempted[0], whole=True, counters=False)


def preempted_holds_blocks(trace: Trace, i: int) -> Mutant | None:
    preempted = trace.records[i]["preempted"]
    return None if not preempted else _drop_freed(trace, i, preempted[0], whole=True, counters=True)


def leak_on_abort(trace: Trace, i: int) -> Mutant | None:
    aborted = trace.records[i]["aborted"]
    return None if not aborted else _drop_freed(trace, i, aborted[0], whole=True, counters=True)


def _spare_blocks(trace: Trace, i: int) -> list[int]:
    """Blocks free before step ``i`` that the step hands to nobody."""
    taken = {b for blocks in trace.records[i]["blocks_allocated"].values() for b in blocks}
    return [b for b in trace.before[i].free_block_ids if b not in taken]


def too_few_blocks(trace: Trace, i: int) -> Mutant | None:
    """A request's new blocks of step ``i`` less the last one, while its chunk needs it: the block
    table no longer covers the tokens it computes."""
    record = trace.records[i]
    before = trace.before[i]
    for item in record["scheduled"]:
        request_id = item["request_id"]
        new = record["blocks_allocated"].get(request_id)
        request = before.requests.get(request_id)
        if not new or request is None:
            continue
        end = item["num_computed_tokens"] + item["prefill_tokens"] + item["decode_tokens"]
        if (len(request.block_ids) + len(new) - 1) * trace.config.block_size < end:
            records, r = _edit(trace, i)
            r["blocks_allocated"][request_id] = new[:-1]
            return trace.header, records, i
    return None


def extra_block(trace: Trace, i: int) -> Mutant | None:
    """One more block for a request whose chunk reaches the end of its sequence: more blocks than its
    sequence needs (an allocator that rounds up)."""
    record = trace.records[i]
    before = trace.before[i]
    spare = _spare_blocks(trace, i)
    for item in record["scheduled"]:
        request = before.requests.get(item["request_id"])
        end = item["num_computed_tokens"] + item["prefill_tokens"] + item["decode_tokens"]
        if request is None or not spare or end != request.num_tokens:
            continue
        records, r = _edit(trace, i)
        r["blocks_allocated"].setdefault(item["request_id"], []).append(spare[-1])
        return trace.header, records, i
    return None


# --- hybrid KV cache groups (trace version 4) ------------------------------------------------------------


def window_frees_visible_block(trace: Trace, i: int) -> Mutant | None:
    """A block a sliding window still sees freed with those it has passed (an off-by-one at the window's
    edge, or a window measured in blocks): added to the item's ``blocks_skipped``."""
    config = trace.config
    record = trace.records[i]
    before = trace.before[i]
    for item in record["scheduled"]:
        request = before.requests.get(item["request_id"])
        if request is None or not request.group_block_ids:
            continue
        for group, table in zip(config.kv_cache_groups[1:], request.group_block_ids, strict=False):
            skipped = num_skipped_blocks(group, item["num_computed_tokens"], config.block_size)
            visible = [b for b in table[skipped:] if b != NULL_BLOCK]
            if group.sliding_window is not None and visible:
                records, r = _edit(trace, i)
                r.setdefault("blocks_skipped", {}).setdefault(item["request_id"], []).append(visible[0])
                return trace.header, records, i
    return None


def window_keeps_skipped_block(trace: Trace, i: int) -> Mutant | None:
    """A block the window has passed kept in the table, not freed, while the engine's free count still
    counts it free: dropped from the item's ``blocks_skipped``."""
    for request_id, skipped in sorted(trace.records[i].get("blocks_skipped", {}).items()):
        if skipped:
            records, r = _edit(trace, i)
            r["blocks_skipped"][request_id] = skipped[:-1]
            if not r["blocks_skipped"][request_id]:
                del r["blocks_skipped"][request_id]
            if not r["blocks_skipped"]:
                del r["blocks_skipped"]
            return trace.header, records, i
    return None


def group_table_short(trace: Trace, i: int) -> Mutant | None:
    """A group past group 0 not given the step's last new block (an allocator that extends group 0's table
    only): its table no longer covers the tokens the step computes."""
    for request_id, groups in sorted(trace.records[i].get("group_blocks_allocated", {}).items()):
        for index, new in enumerate(groups):
            if new:
                records, r = _edit(trace, i)
                r["group_blocks_allocated"][request_id][index] = new[:-1]
                return trace.header, records, i
    return None


def group_extra_block(trace: Trace, i: int) -> Mutant | None:
    """One more block in group 1 for a request whose chunk reaches the end of its sequence (a group allocator
    that rounds up): more blocks than its sequence needs in that group."""
    record = trace.records[i]
    before = trace.before[i]
    groups = record.get("group_blocks_allocated", {})
    taken = {b for blocks in record["blocks_allocated"].values() for b in blocks}
    taken |= {b for tables in groups.values() for blocks in tables for b in blocks}
    spare = [b for b in before.free_block_ids if b not in taken]
    for item in record["scheduled"]:
        request = before.requests.get(item["request_id"])
        end = item["num_computed_tokens"] + item["prefill_tokens"] + item["decode_tokens"]
        new = groups.get(item["request_id"])
        if request is None or not spare or end != request.num_tokens or not new or not new[0]:
            continue
        records, r = _edit(trace, i)
        r["group_blocks_allocated"][item["request_id"]][0].append(spare[-1])
        return trace.header, records, i
    return None


def group_hit_not_held(trace: Trace, i: int) -> Mutant | None:
    """A prefix-cache hit whose sliding-window group does not hold the prefix: the last entry of the window's hit
    table (which its window needs at the hit length) reported null, as a coordinator that took group 0's hit
    alone would leave it (a hit only where every group holds the prefix: ``prefix-hit-is-cached-chain``)."""
    for request_id, tables in sorted(trace.records[i].get("group_prefix_hit_blocks", {}).items()):
        group = next((g for g, table in enumerate(tables) if table and table[-1] != NULL_BLOCK), None)
        if group is None:
            continue
        records, r = _edit(trace, i)
        r["group_prefix_hit_blocks"][request_id][group][-1] = NULL_BLOCK
        return trace.header, records, i
    return None


# --- the batch ----------------------------------------------------------------------------------------


def preempted_and_scheduled(trace: Trace, i: int) -> Mutant | None:
    record = trace.records[i]
    if not record["preempted"]:
        return None
    victim = trace.before[i].requests[record["preempted"][0]]
    records, r = _edit(trace, i)
    r["scheduled"].append({"request_id": victim.request_id, "num_computed_tokens": victim.num_computed_tokens,
                           "prefill_tokens": 0 if not victim.is_prefill else 1,
                           "decode_tokens": 1 if not victim.is_prefill else 0})
    return trace.header, records, i


def zero_token_chunk(trace: Trace, i: int) -> Mutant | None:
    """A request in the batch with no tokens to compute (vLLM never schedules one: a request with
    ``num_new_tokens == 0`` is skipped): the first scheduled request's tokens set to 0."""
    record = trace.records[i]
    if not record["scheduled"]:
        return None
    records, r = _edit(trace, i)
    r["scheduled"][0]["prefill_tokens"] = r["scheduled"][0]["decode_tokens"] = 0
    return trace.header, records, i


def chunk_over_threshold(trace: Trace, i: int) -> Mutant | None:
    """The header's ``long_prefill_token_threshold`` set just below the largest prefill chunk of step
    ``i``, the first step with a chunk that large: an engine that ignores the threshold."""
    def largest(k: int) -> int:
        return max((s["prefill_tokens"] for s in trace.records[k]["scheduled"]), default=0)

    if not trace.config.enable_chunked_prefill:
        return None
    peak = largest(i)
    if peak < 2 or any(largest(k) >= peak for k in range(i)):
        return None
    header = copy.deepcopy(trace.header)
    header["config"]["long_prefill_token_threshold"] = peak - 1
    return header, list(trace.records), i


def admits_impossible(trace: Trace, i: int) -> Mutant | None:
    """A request the spec rejects at its arrival (it can never complete alone) admitted instead, with
    one prompt token and one block: an engine without the admission check."""
    record = trace.records[i]
    spare = _spare_blocks(trace, i)
    if not record["rejected"] or not spare:
        return None
    request_id = sorted(record["rejected"])[0]
    records, r = _edit(trace, i)
    del r["rejected"][request_id]
    r["scheduled"].append({"request_id": request_id, "num_computed_tokens": 0, "prefill_tokens": 1,
                           "decode_tokens": 0})
    r["blocks_allocated"][request_id] = [spare[-1]]
    return trace.header, records, i


def budget_exceeded(trace: Trace, i: int) -> Mutant | None:
    record = trace.records[i]
    before = trace.before[i]
    total = sum(s["prefill_tokens"] + s["decode_tokens"] for s in record["scheduled"])
    extra = trace.config.max_num_batched_tokens - total + 1
    for item in record["scheduled"]:
        request = before.requests.get(item["request_id"])
        tokens = item["prefill_tokens"] + item["decode_tokens"]
        if request is not None and item["prefill_tokens"] and request.num_pending_tokens >= tokens + extra:
            records, r = _edit(trace, i)
            target = next(s for s in r["scheduled"] if s["request_id"] == item["request_id"])
            target["prefill_tokens"] += extra
            return trace.header, records, i
    return None


def max_num_seqs_exceeded(trace: Trace, i: int) -> Mutant | None:
    """The header's ``max_num_seqs`` lowered below what the engine ran at step ``i`` (the first step at
    which it ran that many): an engine that ignores its cap."""
    return _cap_exceeded(trace, i, "max_num_seqs")


def max_num_active_seqs_exceeded(trace: Trace, i: int) -> Mutant | None:
    """The header's ``max_num_active_seqs`` set below what the engine ran at step ``i`` (the first step at
    which it ran that many, by admission): an engine whose admission ignores it."""
    return _cap_exceeded(trace, i, "max_num_active_seqs")


def _cap_exceeded(trace: Trace, i: int, field: str) -> Mutant | None:
    """The header's ``field`` (a cap on the running set) set one below the running count at step ``i``, the
    first step that reaches that count (``None`` where it does not apply)."""
    def running_in(k: int) -> int:
        before = trace.before[k]
        record = trace.records[k]
        preempted = sum(1 for r in set(record["preempted"]) if r in before.running)
        admitted = sum(1 for s in record["scheduled"] if s["request_id"] not in before.running)
        return len(before.running) - preempted + admitted

    peak = running_in(i)
    if peak < 2 or any(running_in(k) >= peak for k in range(i)):
        return None
    header = copy.deepcopy(trace.header)
    header["config"][field] = peak - 1
    try:
        SchedulerConfig.from_dict(header["config"])
    except Exception:  # noqa: BLE001 - a cap the config cannot take: not applicable
        return None
    return header, list(trace.records), i


def lora_limit_exceeded(trace: Trace, i: int) -> Mutant | None:
    """At the first step ``i`` that schedules two or more requests: the header says ``max_loras = 1``, every
    arrival runs with LoRA adapter 1 but the last request scheduled in step ``i``, which runs with adapter
    2: an engine that ignores ``max_loras`` (no earlier step schedules two requests, so none breaks it)."""
    if len(trace.records[i]["scheduled"]) < 2 or any(len(r["scheduled"]) >= 2 for r in trace.records[:i]):
        return None
    other = trace.records[i]["scheduled"][-1]["request_id"]
    header = copy.deepcopy(trace.header)
    header["config"]["max_loras"] = 1
    records = [copy.deepcopy(r) if r["arrivals"] else r for r in trace.records]
    for record in records:
        for arrival in record["arrivals"]:
            arrival["lora_int_id"] = 2 if arrival["request_id"] == other else 1
    return header, records, i


def _first_admission(trace: Trace, i: int) -> dict | None:
    """An item of step ``i`` that admits a request for the first time (never admitted before), or ``None``."""
    before = trace.before[i]
    return _scheduled(trace.records[i], lambda s: s["request_id"] not in before.running
                      and s["request_id"] in before.requests and before.requests[s["request_id"]].admitted_step is None)


def grammar_wait_ignored(trace: Trace, i: int) -> Mutant | None:
    """A request first admitted in step ``i`` is given structured output whose grammar is ready only in step
    ``i + 1`` (``grammar_compile_steps`` in its arrival): an engine that admits a request before its grammar
    is compiled (vLLM ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``)."""
    item = _first_admission(trace, i)
    if item is None:
        return None
    before = trace.before[i]
    request_id = item["request_id"]
    arrival_step = before.requests[request_id].arrival_step
    records = _edit_from(trace, arrival_step)
    arrival = next(a for a in records[arrival_step]["arrivals"] if a["request_id"] == request_id)
    arrival["grammar_compile_steps"] = i + 1 - arrival_step
    return trace.header, records, i


def _with_watermark_blocks(config: SchedulerConfig, blocks: int) -> SchedulerConfig | None:
    """``config`` with a ``watermark`` that keeps exactly ``blocks`` blocks (``None``: no such fraction)."""
    if not 0 < blocks <= config.num_kv_blocks:
        return None
    changed = config.with_changes(watermark=(blocks + 0.5) / (config.num_kv_blocks + 1))
    return changed if changed.watermark_blocks == blocks else None


def _breaks_watermark(trace: Trace, k: int, config: SchedulerConfig) -> bool:
    """Whether step ``k``'s plan breaks the spec's rule ``watermark`` under ``config``."""
    check = next(r.check for r in RULES if r.name == "watermark")
    return any(True for _ in check(trace.before[k], plan_from_record(StepRecord.from_dict(trace.records[k])), config))


def watermark_ignored(trace: Trace, i: int) -> Mutant | None:
    """The header gets the smallest ``watermark`` that step ``i``'s admissions break while no earlier step's
    do: an engine that admits a waiting request into the blocks its watermark keeps free."""
    config = trace.config
    before = trace.before[i]
    admitted = [s for s in trace.records[i]["scheduled"] if s["request_id"] not in before.running]
    preempted = set(trace.records[i]["preempted"])
    if config.watermark or not admitted or (len(admitted) < 2 and all(r in preempted for r in before.running)):
        return None  # no admission while another request runs
    low, high = 1, config.num_kv_blocks  # the fewest blocks kept free that step i breaks (monotone in blocks)
    top = _with_watermark_blocks(config, high)
    if top is None or not _breaks_watermark(trace, i, top):
        return None
    while low < high:
        middle = (low + high) // 2
        candidate = _with_watermark_blocks(config, middle)
        if candidate is not None and _breaks_watermark(trace, i, candidate):
            high = middle
        else:
            low = middle + 1
    changed = _with_watermark_blocks(config, low)
    if changed is None or any(_breaks_watermark(trace, k, changed) for k in range(i)):
        return None
    header = copy.deepcopy(trace.header)
    header["config"]["watermark"] = changed.watermark
    return header, list(trace.records), i


CADENCE_INTERVALS = range(2, 9)
"""The ``prefill_schedule_interval`` values :func:`prefill_cadence_ignored` tries."""


def _first_held_prefill(trace: Trace, config: SchedulerConfig) -> int | None:
    """The first step whose plan breaks the rule ``prefill-cadence`` under ``config`` (``None``: none does):
    the cadence's history (``prefill_cadence``, the one part of the states the interval changes) is carried
    along the trace's states, as :func:`~schedspec.spec.transitions.apply_plan` would."""
    cadence = None
    for k, record in enumerate(trace.records):
        before = attrs.evolve(trace.before[k], prefill_cadence=cadence)
        if before.in_flight is not None:
            return None  # the cadence with a step in flight is not specified
        plan = plan_from_record(StepRecord.from_dict(record))
        if prefill_held(before, config) and any(
                item.request_id in before.requests and carries_prefill(before, item) for item in plan.scheduled):
            return k
        cadence = cadence_after(before, plan, trace.after[k].waiting, config)
    return None


_HELD_FIRSTS: dict[int, tuple[Trace, dict[int, int]]] = {}
"""The last trace asked about (by id, with the trace kept so the id stays its own): first held prefill step ->
smallest interval. One entry: the catalogue asks about one trace's steps in a row."""


def _held_firsts(trace: Trace) -> dict[int, int]:
    """``{step: interval}``: for each step that is the first to carry a prefill the cadence holds under some
    interval of :data:`CADENCE_INTERVALS`, the smallest such interval (computed once per trace)."""
    cached = _HELD_FIRSTS.get(id(trace))
    if cached is not None and cached[0] is trace:
        return cached[1]
    firsts: dict[int, int] = {}
    if trace.config.prefill_schedule_interval == 1:
        for interval in CADENCE_INTERVALS:
            first = _first_held_prefill(trace, trace.config.with_changes(prefill_schedule_interval=interval))
            if first is not None:
                firsts.setdefault(first, interval)
    _HELD_FIRSTS.clear()
    _HELD_FIRSTS[id(trace)] = (trace, firsts)
    return firsts


def prefill_cadence_ignored(trace: Trace, i: int) -> Mutant | None:
    """The header gets the smallest ``prefill_schedule_interval`` (of :data:`CADENCE_INTERVALS`) under which
    step ``i`` is the first held step that carries a prefill: an engine that prefills while vLLM 0.33's
    cadence holds the step."""
    interval = _held_firsts(trace).get(i)
    if interval is None:
        return None
    header = copy.deepcopy(trace.header)
    header["config"]["prefill_schedule_interval"] = interval
    return header, list(trace.records), i


def chunk_skips_token(trace: Trace, i: int) -> Mutant | None:
    item = _scheduled(trace.records[i], lambda s: s["prefill_tokens"] > 1)
    if item is None:
        return None
    records, r = _edit(trace, i)
    target = next(s for s in r["scheduled"] if s["request_id"] == item["request_id"])
    target["num_computed_tokens"] += 1
    target["prefill_tokens"] -= 1
    return trace.header, records, i


def chunk_repeats_token(trace: Trace, i: int) -> Mutant | None:
    item = _scheduled(trace.records[i], lambda s: s["num_computed_tokens"] > 0)
    if item is None:
        return None
    records, r = _edit(trace, i)
    target = next(s for s in r["scheduled"] if s["request_id"] == item["request_id"])
    target["num_computed_tokens"] -= 1
    return trace.header, records, i


def decode_two_tokens(trace: Trace, i: int) -> Mutant | None:
    item = _scheduled(trace.records[i], lambda s: s["decode_tokens"] == 1)
    if item is None:
        return None
    records, r = _edit(trace, i)
    next(s for s in r["scheduled"] if s["request_id"] == item["request_id"])["decode_tokens"] = 2
    return trace.header, records, i


def prefill_reported_as_decode(trace: Trace, i: int) -> Mutant | None:
    item = _scheduled(trace.records[i], lambda s: s["prefill_tokens"] >= 1 and s["decode_tokens"] == 0)
    if item is None:
        return None
    records, r = _edit(trace, i)
    target = next(s for s in r["scheduled"] if s["request_id"] == item["request_id"])
    target["prefill_tokens"] -= 1
    target["decode_tokens"] += 1
    return trace.header, records, i


def decode_reported_as_prefill(trace: Trace, i: int) -> Mutant | None:
    item = _scheduled(trace.records[i], lambda s: s["decode_tokens"] == 1)
    if item is None:
        return None
    records, r = _edit(trace, i)
    target = next(s for s in r["scheduled"] if s["request_id"] == item["request_id"])
    target["prefill_tokens"], target["decode_tokens"] = 1, 0
    return trace.header, records, i


# --- tokens and endings -------------------------------------------------------------------------------


def token_after_finish(trace: Trace, i: int) -> Mutant | None:
    if i == 0:
        return None
    request_id = _finishing(trace, i - 1)
    if request_id is None:
        return None
    records, r = _edit(trace, i)
    r["sampled_token_ids"][request_id] = 7
    return trace.header, records, i


def token_after_abort(trace: Trace, i: int) -> Mutant | None:
    aborted = trace.records[i]["aborted"]
    if not aborted:
        return None
    records, r = _edit(trace, i)
    r["sampled_token_ids"][aborted[0]] = 7
    return trace.header, records, i


def missing_token(trace: Trace, i: int) -> Mutant | None:
    sampled = trace.records[i]["sampled_token_ids"]
    if not sampled:
        return None
    records, r = _edit(trace, i)
    del r["sampled_token_ids"][sorted(sampled)[0]]
    return trace.header, records, i


def token_mid_prefill(trace: Trace, i: int) -> Mutant | None:
    record = trace.records[i]
    for item in record["scheduled"]:
        if item["request_id"] not in record["sampled_token_ids"]:
            records, r = _edit(trace, i)
            r["sampled_token_ids"][item["request_id"]] = 7
            return trace.header, records, i
    return None


def output_past_max_tokens(trace: Trace, i: int) -> Mutant | None:
    """A request that reaches ``max_tokens`` is not ended: the engine keeps it (and its blocks)."""
    request_id = _finishing(trace, i, "length")
    if request_id is None:
        return None
    records, r = _edit(trace, i)
    del r["finished"][request_id]
    held = len(r["blocks_freed"].pop(request_id, []))
    r["num_running"] += 1
    r["num_free_blocks"] = max(0, r["num_free_blocks"] - held)
    return trace.header, records, i


def wrong_finish_reason(trace: Trace, i: int) -> Mutant | None:
    request_id = _finishing(trace, i)
    if request_id is None:
        return None
    records, r = _edit(trace, i)
    r["finished"][request_id] = "stop" if r["finished"][request_id] != "stop" else "length"
    return trace.header, records, i


def finish_not_due(trace: Trace, i: int) -> Mutant | None:
    """A request is reported finished although it has outputs left and sampled no stop token."""
    record = trace.records[i]
    for request_id in sorted(record["sampled_token_ids"]):
        if request_id not in record["finished"]:
            records, r = _edit(trace, i)
            r["finished"][request_id] = "length"
            return trace.header, records, i
    return None


# --- queue bookkeeping, counters, time -----------------------------------------------------------------


def _counter(name: str) -> Callable[[Trace, int], Mutant | None]:
    def mutate(trace: Trace, i: int) -> Mutant | None:
        records, r = _edit(trace, i)
        r[name] += 1
        return trace.header, records, i

    mutate.__name__ = f"wrong_{name}"
    return mutate


def time_backwards(trace: Trace, i: int) -> Mutant | None:
    if i == 0:
        return None
    records, r = _edit(trace, i)
    r["start_time"] = trace.records[i - 1]["start_time"] - 1.0
    return trace.header, records, i


def negative_duration(trace: Trace, i: int) -> Mutant | None:
    records, r = _edit(trace, i)
    r["duration"] = -max(r["duration"], 0.001)
    return trace.header, records, i


def step_skipped(trace: Trace, i: int) -> Mutant | None:
    records = _edit_from(trace, i)
    for later in records[i:]:
        later["step"] += 1
    return trace.header, records, i


def wrong_rejection_reason(trace: Trace, i: int) -> Mutant | None:
    rejected = trace.records[i]["rejected"]
    if not rejected:
        return None
    records, r = _edit(trace, i)
    r["rejected"][sorted(rejected)[0]] = "bogus"
    return trace.header, records, i


def rejects_possible_request(trace: Trace, i: int) -> Mutant | None:
    record = trace.records[i]
    before = trace.before[i]
    scheduled = {s["request_id"] for s in record["scheduled"]}
    for request_id in before.waiting:
        request = before.requests[request_id]
        if request.admitted_step is None and request_id not in scheduled and request_id not in record["rejected"]:
            records, r = _edit(trace, i)
            r["rejected"][request_id] = "exceeds-kv-cache: made up"
            return trace.header, records, i
    return None


def prefix_hit_without_caching(trace: Trace, i: int) -> Mutant | None:
    record = trace.records[i]
    if trace.config.enable_prefix_caching or not record["scheduled"]:
        return None
    free = trace.before[i].free_block_ids
    if not free:
        return None
    records, r = _edit(trace, i)
    request_id = record["scheduled"][0]["request_id"]
    r["prefix_hit_tokens"][request_id] = trace.config.block_size
    r.setdefault("prefix_hit_blocks", {})[request_id] = [free[-1]]
    return trace.header, records, i


# --- prefix caching (traces with enable_prefix_caching) -------------------------------------------


def _hit(trace: Trace, i: int) -> tuple[str, list[int]] | None:
    """The first request (by id) with a prefix-cache hit in record ``i``."""
    hits = trace.records[i].get("prefix_hit_blocks", {})
    for request_id in sorted(hits):
        if hits[request_id]:
            return request_id, list(hits[request_id])
    return None


def _set_hit(r: Record, request_id: str, blocks: list[int], shift: int, block_size: int) -> None:
    """Record ``blocks`` as the hit of ``request_id`` with the chunk start moved by ``shift`` blocks (the chunk
    shrinks by as many tokens, so it still ends where it did)."""
    r.setdefault("prefix_hit_blocks", {})[request_id] = blocks
    r["prefix_hit_tokens"][request_id] = len(blocks) * block_size
    item = _scheduled(r, lambda s: s["request_id"] == request_id)
    assert item is not None
    item["num_computed_tokens"] += shift * block_size
    item["prefill_tokens"] -= shift * block_size


def hit_longer_than_cached(trace: Trace, i: int) -> Mutant | None:
    """The request's first new block is claimed as one more cached block (a hit past the cached chain)."""
    found = _hit(trace, i)
    size = trace.config.block_size
    if found is None:
        return None
    request_id, blocks = found
    new = trace.records[i]["blocks_allocated"].get(request_id, [])
    item = _scheduled(trace.records[i], lambda s: s["request_id"] == request_id)
    if not new or item is None or item["prefill_tokens"] <= size:
        return None
    records, r = _edit(trace, i)
    r["blocks_allocated"][request_id] = new[1:]
    if not r["blocks_allocated"][request_id]:
        del r["blocks_allocated"][request_id]
    _set_hit(r, request_id, blocks + [new[0]], 1, size)
    return trace.header, records, i


def hit_shorter_than_cached(trace: Trace, i: int) -> Mutant | None:
    """The last cached block of a hit is not reused: the engine recomputes tokens it had cached."""
    found = _hit(trace, i)
    if found is None:
        return None
    request_id, blocks = found
    records, r = _edit(trace, i)
    r["blocks_allocated"][request_id] = [blocks[-1]] + list(r["blocks_allocated"].get(request_id, []))
    _set_hit(r, request_id, blocks[:-1], -1, trace.config.block_size)
    if not blocks[:-1]:
        del r["prefix_hit_blocks"][request_id]
    return trace.header, records, i


def _replace_last_hit(trace: Trace, i: int, candidates: list[int]) -> Mutant | None:
    found = _hit(trace, i)
    if found is None:
        return None
    request_id, blocks = found
    cache = trace.before[i].prefix_cache
    used = {b for bs in trace.records[i]["blocks_allocated"].values() for b in bs}
    used |= {b for bs in trace.records[i].get("prefix_hit_blocks", {}).values() for b in bs}
    wanted = cache.block_hashes.get(blocks[-1]) if cache is not None else None
    for block_id in candidates:
        if block_id not in used and (cache is None or cache.block_hashes.get(block_id) != wanted):
            records, r = _edit(trace, i)
            r["prefix_hit_blocks"][request_id] = blocks[:-1] + [block_id]
            return trace.header, records, i
    return None


def hit_on_uncached_block(trace: Trace, i: int) -> Mutant | None:
    """A hit's last block replaced by a free block that caches nothing (a stale or wrong hash table)."""
    cache = trace.before[i].prefix_cache
    if cache is None:
        return None
    return _replace_last_hit(trace, i, [b for b in trace.before[i].free_block_ids if b not in cache.block_hashes])


def hit_on_evicted_block(trace: Trace, i: int) -> Mutant | None:
    """A hit's last block replaced by a block evicted in an earlier step (its hash was dropped then)."""
    evicted = [b for record in trace.records[:i] for b in record.get("blocks_evicted", [])]
    return _replace_last_hit(trace, i, list(dict.fromkeys(reversed(evicted))))


def deduplicated_under_vllm(trace: Trace, i: int) -> Mutant | None:
    """A block a prefill chunk of step ``i`` completes (and vLLM publishes) replaced in its request's table by a
    block cached before the step, the request's copy freed: SGLang's de-duplication at publication
    (``RadixCache._insert_cache``) in an engine whose header claims vLLM's publication, whose block tables only
    grow (``BlockHashToBlockMap`` keeps duplicates)."""
    cache = trace.before[i].prefix_cache
    if cache is None or not cache.block_hashes or trace.config.prefix_cache_publication != "vllm":
        return None
    record = trace.records[i]
    handed = {b for bs in record["blocks_allocated"].values() for b in bs}
    cached = next((b for b in sorted(cache.block_hashes) if b not in handed), None)
    if cached is None:
        return None
    size = trace.config.block_size
    for item in record["scheduled"]:
        request = trace.before[i].requests.get(item["request_id"])
        if request is None:
            continue
        table = request.block_ids + tuple(record.get("prefix_hit_blocks", {}).get(item["request_id"], ())) + tuple(
            record["blocks_allocated"].get(item["request_id"], ()))
        full = min((item["num_computed_tokens"] + item["prefill_tokens"] + item["decode_tokens"]) // size, len(table))
        own = next((b for b in table[:full] if b not in cache.block_hashes and b != cached), None)
        if own is None:
            continue
        records, r = _edit(trace, i)
        r["blocks_deduplicated"] = {item["request_id"]: [[own, cached]]}
        r["blocks_freed"][item["request_id"]] = list(r["blocks_freed"].get(item["request_id"], [])) + [own]
        return trace.header, records, i
    return None


def cached_block_handed_out_while_referenced(trace: Trace, i: int) -> Mutant | None:
    """A new block replaced by a cached block another running request still references."""
    cache = trace.before[i].prefix_cache
    record = trace.records[i]
    if cache is None:
        return None
    leaving = set(record["preempted"])
    held = {b for r in trace.before[i].running if r not in leaving for b in trace.before[i].requests[r].block_ids
            if b in cache.block_hashes}
    for taker, blocks in sorted(record["blocks_allocated"].items()):
        mine = set(trace.before[i].requests[taker].block_ids) if taker in trace.before[i].requests else set()
        for block_id in sorted(held - mine):
            if blocks:
                records, r = _edit(trace, i)
                r["blocks_allocated"][taker][0] = block_id
                return trace.header, records, i
    return None


def eviction_unreported(trace: Trace, i: int) -> Mutant | None:
    """A cached block handed out without its eviction in ``blocks_evicted``."""
    if not trace.records[i].get("blocks_evicted"):
        return None
    records, r = _edit(trace, i)
    del r["blocks_evicted"]
    return trace.header, records, i


def aborted_without_abort(trace: Trace, i: int) -> Mutant | None:
    record = trace.records[i]
    live = [r for r in trace.before[i].running if r not in record["aborts"]]
    if not live:
        return None
    records, r = _edit(trace, i)
    r["aborted"].append(live[0])
    return trace.header, records, i


def duplicate_arrival(trace: Trace, i: int) -> Mutant | None:
    if i == 0 or not trace.records[i]["arrivals"] and not any(trace.records[k]["arrivals"] for k in range(i)):
        return None
    earlier = next((trace.records[k]["arrivals"][0] for k in range(i) if trace.records[k]["arrivals"]), None)
    if earlier is None:
        return None
    records, r = _edit(trace, i)
    r["arrivals"].append(copy.deepcopy(earlier))
    return trace.header, records, i


REUSED_AFTER = 20
"""Steps after a request ended before :func:`reused_id_after_end` reuses its id: the trace checker has long
forgotten the ended request and kept only its id (``Stepper.forget_ended``, after the step it ended). The
standard traces' last arrivals come about 30 steps after their first ends; ``tests/test_checker_memory.py``
reuses an id about 400 steps later."""


def reused_id_after_end(trace: Trace, i: int) -> Mutant | None:
    """A fresh arrival at step ``i`` under the id of a request that ended at least :data:`REUSED_AFTER`
    steps before (an engine that recycles request ids)."""
    if not trace.records[i]["arrivals"]:
        return None
    ended = next((request_id for k in range(i - REUSED_AFTER + 1) for request_id in
                  sorted({*trace.records[k]["finished"], *trace.records[k]["aborted"], *trace.records[k]["rejected"]})),
                 None)
    if ended is None:
        return None
    records, r = _edit(trace, i)
    r["arrivals"][0]["request_id"] = ended
    return trace.header, records, i


# --- mutants that change nothing observable ------------------------------------------------------------


def reorder_blocks_freed(trace: Trace, i: int) -> Mutant | None:
    for request_id, blocks in sorted(trace.records[i]["blocks_freed"].items()):
        if len(blocks) > 1:
            records, r = _edit(trace, i)
            r["blocks_freed"][request_id] = list(reversed(blocks))
            return trace.header, records, i
    return None


def idle_gap(trace: Trace, i: int) -> Mutant | None:
    records = _edit_from(trace, i)
    for later in records[i:]:
        later["start_time"] += 0.5
    return trace.header, records, i


def abort_unknown_id(trace: Trace, i: int) -> Mutant | None:
    records, r = _edit(trace, i)
    r["aborts"].append("never-added-request")
    return trace.header, records, i


# --- speculative decoding (trace version 3) -----------------------------------------------------------


def _item(record: Record, request_id: str) -> dict:
    return next(s for s in record["scheduled"] if s["request_id"] == request_id)


def _verifying(trace: Trace, i: int) -> list[dict]:
    return [s for s in trace.records[i]["scheduled"] if s.get("spec_token_ids")]


def drafts_over_budget(trace: Trace, i: int) -> Mutant | None:
    """A decode verifies every draft proposed for it although the budget had room for fewer (drafts not
    counted in the token budget): a step whose batch is full, with a decode whose drafts were trimmed."""
    record = trace.records[i]
    before = trace.before[i]
    total = sum(s["prefill_tokens"] + s["decode_tokens"] for s in record["scheduled"])
    for item in record["scheduled"]:
        request = before.requests.get(item["request_id"])
        if request is None or not request.spec_token_ids or item["prefill_tokens"]:
            continue
        extra = len(request.spec_token_ids) - len(item.get("spec_token_ids", ()))
        if extra > 0 and total + extra > trace.config.max_num_batched_tokens:
            end = item["num_computed_tokens"] + item["decode_tokens"] + extra
            if end + 1 > trace.config.max_model_len:
                continue  # would break drafts-within-max-model-len first; another step will do
            records, r = _edit(trace, i)
            target = _item(r, item["request_id"])
            target["spec_token_ids"] = list(request.spec_token_ids)
            target["decode_tokens"] += extra
            needed = -(-end // trace.config.block_size) - len(request.block_ids) - len(
                r["blocks_allocated"].get(item["request_id"], []))
            if needed > 0:
                spare = _spare_blocks(trace, i)
                if len(spare) < needed:
                    continue
                r["blocks_allocated"].setdefault(item["request_id"], []).extend(spare[:needed])
            return trace.header, records, i
    return None


def drafts_on_prefill(trace: Trace, i: int) -> Mutant | None:
    """A prefill chunk (or a recompute) logged as verifying a draft: drafts handed to a request that is
    not a running decode."""
    item = _scheduled(trace.records[i], lambda s: s["prefill_tokens"] >= 1 and not s.get("spec_token_ids"))
    if item is None:
        return None
    records, r = _edit(trace, i)
    _item(r, item["request_id"])["spec_token_ids"] = [1]
    return trace.header, records, i


def draft_not_proposed(trace: Trace, i: int) -> Mutant | None:
    """A decode verifies a draft id other than the one proposed for it (drafts mixed up between requests)."""
    verifying = _verifying(trace, i)
    if not verifying:
        return None
    records, r = _edit(trace, i)
    drafts = _item(r, verifying[0]["request_id"])["spec_token_ids"]
    drafts[-1] = drafts[-1] % 4095 + 1
    return trace.header, records, i


def drafts_past_max_model_len(trace: Trace, i: int) -> Mutant | None:
    """A decode verifies one draft more than ``max_model_len`` can accept with the token after it (vLLM
    trims them in ``Scheduler.schedule``)."""
    record = trace.records[i]
    before = trace.before[i]
    limit = trace.config.max_model_len
    for item in record["scheduled"]:
        request = before.requests.get(item["request_id"])
        if request is None or not request.is_decode or item["prefill_tokens"]:
            continue
        drafts = list(item.get("spec_token_ids", ()))
        end = item["num_computed_tokens"] + item["decode_tokens"]
        if end + 1 == limit and len(request.spec_token_ids) > len(drafts):
            records, r = _edit(trace, i)
            target = _item(r, item["request_id"])
            target["spec_token_ids"] = list(request.spec_token_ids[:len(drafts) + 1])
            target["decode_tokens"] += 1
            return trace.header, records, i
    return None


def lookahead_not_allocated(trace: Trace, i: int) -> Mutant | None:
    """The last new block of a request dropped where only ``num_lookahead_tokens`` needed it (the drafter's
    KV slots past the chunk not allocated)."""
    if not trace.config.num_lookahead_tokens:
        return None
    record = trace.records[i]
    before = trace.before[i]
    size = trace.config.block_size
    for item in record["scheduled"]:
        request_id = item["request_id"]
        new = record["blocks_allocated"].get(request_id)
        request = before.requests.get(request_id)
        if not new or request is None:
            continue
        end = item["num_computed_tokens"] + item["prefill_tokens"] + item["decode_tokens"]
        held = len(request.block_ids) + len(record.get("prefix_hit_blocks", {}).get(request_id, ())) + len(new)
        if (held - 1) * size >= end:
            records, r = _edit(trace, i)
            r["blocks_allocated"][request_id] = new[:-1]
            return trace.header, records, i
    return None


def _rejecting(trace: Trace, i: int) -> str | None:
    """A request that verified drafts in step ``i``, rejected some and goes on."""
    record = trace.records[i]
    for item in _verifying(trace, i):
        request_id = item["request_id"]
        accepted = record.get("num_accepted_tokens", {}).get(request_id)
        if accepted is not None and accepted < len(item["spec_token_ids"]) and request_id not in record["finished"]:
            return request_id
    return None


def rejected_drafts_kept_computed(trace: Trace, i: int) -> Mutant | None:
    """Rejected drafts kept as computed: the request's next chunk starts past the accepted tokens (vLLM
    takes them back in ``update_from_output``: ``num_computed_tokens -= num_rejected``). Applied at the
    step ``i`` where the drafts are rejected; observable at the request's next step."""
    request_id = _rejecting(trace, i)
    if request_id is None:
        return None
    rejected = len(_item(trace.records[i], request_id)["spec_token_ids"]) - trace.records[i]["num_accepted_tokens"][
        request_id]
    for j in range(i + 1, len(trace.records)):
        if request_id in trace.records[j]["preempted"] or request_id in trace.records[j]["aborts"]:
            return None
        later = next((s for s in trace.records[j]["scheduled"] if s["request_id"] == request_id), None)
        if later is not None:
            records, r = _edit(trace, j)
            _item(r, request_id)["num_computed_tokens"] += rejected
            return trace.header, records, j
    return None


def rejected_draft_blocks_freed(trace: Trace, i: int) -> Mutant | None:
    """The blocks holding only rejected draft positions freed after the step (vLLM keeps them in the block
    table: a rejection frees nothing)."""
    request_id = _rejecting(trace, i)
    if request_id is None:
        return None
    after = trace.after[i].requests[request_id]
    size = trace.config.block_size
    needed = -(-(after.num_computed_tokens + 1) // size)
    if len(after.block_ids) <= needed:
        return None
    records, r = _edit(trace, i)
    r["blocks_freed"].setdefault(request_id, []).append(after.block_ids[-1])
    r["num_free_blocks"] += 1
    return trace.header, records, i


def accepted_past_drafts(trace: Trace, i: int) -> Mutant | None:
    """More drafts reported accepted than the decode verified (a bonus token counted as a draft)."""
    record = trace.records[i]
    for item in _verifying(trace, i):
        if item["request_id"] in record.get("num_accepted_tokens", {}):
            records, r = _edit(trace, i)
            r["num_accepted_tokens"][item["request_id"]] = len(item["spec_token_ids"]) + 1
            return trace.header, records, i
    return None


def stop_inside_drafts_ignored(trace: Trace, i: int) -> Mutant | None:
    """A request whose stop (EOS, stop id, max_tokens, max_model_len) falls inside its accepted drafts goes
    on: reported neither finished nor freed, counters as if it ran on."""
    record = trace.records[i]
    for item in _verifying(trace, i):
        request_id = item["request_id"]
        accepted = record.get("num_accepted_tokens", {}).get(request_id)
        if request_id in record["finished"] and accepted:
            records, r = _edit(trace, i)
            del r["finished"][request_id]
            freed = r["blocks_freed"].pop(request_id, [])
            r["num_free_blocks"] -= len(freed)
            r["num_running"] += 1
            return trace.header, records, i
    return None


def drafts_kept_after_preemption(trace: Trace, i: int) -> Mutant | None:
    """A preempted request's drafts verified again by its recompute (vLLM drops them in
    ``_preempt_request``): the resumed request's first chunk carries the drafts it held."""
    for request_id in trace.records[i]["preempted"]:
        held = trace.before[i].requests[request_id].spec_token_ids
        if not held:
            continue
        for j in range(i + 1, len(trace.records)):
            later = next((s for s in trace.records[j]["scheduled"] if s["request_id"] == request_id), None)
            if later is not None:
                records, r = _edit(trace, j)
                _item(r, request_id)["spec_token_ids"] = list(held)
                return trace.header, records, j
            if request_id in trace.records[j]["aborts"]:
                return None
    return None


# --- a step in flight (asynchronous scheduling: traces whose header says async_scheduling) -------------


def _wasted_decode(record: Record, request_id: str, computed: int) -> None:
    """Add a wasted decode of ``request_id`` at position ``computed`` to ``record``, reported as wasted."""
    record["scheduled"].append({"request_id": request_id, "num_computed_tokens": computed, "prefill_tokens": 0,
                                "decode_tokens": 1})
    record.setdefault("wasted_tokens", {})[request_id] = 1


def schedule_past_foreseen_length(trace: Trace, i: int) -> Mutant | None:
    """A plan made over placeholders schedules a request the in-flight step brings to its length."""
    in_flight = trace.before[i].in_flight
    if in_flight is None or i == 0:
        return None
    ended = next((r for r, why in sorted(trace.records[i - 1]["finished"].items()) if why in ("length", "max_model_len")
                  and not any(item["request_id"] == r for item in trace.records[i]["scheduled"])), None)
    if ended is None:
        return None
    records, r = _edit(trace, i)
    _wasted_decode(r, ended, in_flight.ended[ended].num_computed_tokens)
    return trace.header, records, i


def hand_out_block_freed_in_flight(trace: Trace, i: int) -> Mutant | None:
    """A plan hands out a block that a request which ended while the step before was in flight still held
    when the plan was made (the engine freed it to the pool the plan was drawn from too early)."""
    in_flight = trace.before[i].in_flight
    if in_flight is None or not in_flight.freed_blocks:
        return None
    record = trace.records[i]
    preempted = set(record["preempted"])
    allocated = {b for blocks in record["blocks_allocated"].values() for b in blocks}
    held = sorted(b for r, blocks in in_flight.freed_blocks.items() if r not in preempted for b in blocks
                  if b not in allocated and b in trace.before[i].free_block_ids)
    taker = next((r for r, blocks in sorted(record["blocks_allocated"].items()) if blocks and r in trace.before[i].requests),
                 None)
    if not held or taker is None:
        return None
    records, r = _edit(trace, i)
    r["blocks_allocated"][taker][0] = held[0]
    return trace.header, records, i


def admit_arrival_before_planned(trace: Trace, i: int) -> Mutant | None:
    """A plan made while the step before was in flight admits a request that arrived after it was made: the
    arrival of a request first admitted at step ``i`` (after step 0) is moved from its step to step ``i``."""
    if trace.before[i].in_flight is None or i == 0:
        return None
    admitted = next((item["request_id"] for item in trace.records[i]["scheduled"]
                     if item["request_id"] in trace.before[i].requests
                     and trace.before[i].requests[item["request_id"]].admitted_step is None), None)
    if admitted is None:
        return None
    arrived_at = trace.before[i].requests[admitted].arrival_step
    if arrived_at >= i:
        return None
    records = _edit_from(trace, arrived_at)
    spec = next(a for a in records[arrived_at]["arrivals"] if a["request_id"] == admitted)
    records[arrived_at]["arrivals"].remove(spec)
    if spec.get("arrival_step") is not None:
        spec["arrival_step"] = i
    records[i]["arrivals"].append(spec)
    for k in range(arrived_at, i):
        records[k]["num_waiting"] -= 1
    return trace.header, records, i


def wasted_item_misplaced(trace: Trace, i: int) -> Mutant | None:
    """Wasted work that is not what the planner could plan: a wasted chunk starting one token early."""
    wasted = trace.records[i].get("wasted_tokens") or {}
    request_id = next(iter(sorted(wasted)), None)
    if request_id is None:
        return None
    records, r = _edit(trace, i)
    item = _scheduled(r, lambda x: x["request_id"] == request_id)
    if item is None or item["num_computed_tokens"] == 0:
        return None
    item["num_computed_tokens"] -= 1
    return trace.header, records, i


def hide_wasted_tokens(trace: Trace, i: int) -> Mutant | None:
    """A log that does not say which of a step's work was wasted (``wasted_tokens`` left out)."""
    if not trace.records[i].get("wasted_tokens"):
        return None
    records, r = _edit(trace, i)
    del r["wasted_tokens"]
    return trace.header, records, i


def scheduled_before_transfer_landed(trace: Trace, i: int) -> Mutant | None:
    """A request whose remote KV load is in flight in step ``i`` (WAITING_FOR_REMOTE_KVS) is also scheduled in
    it: one more prompt token after the loaded ones, computed over blocks the transfer has not written (an
    engine that promotes a request before ``finished_recving``)."""
    before = trace.before[i]
    scheduled = {s["request_id"] for s in trace.records[i]["scheduled"]}
    request = next((before.requests[r] for r in before.waiting if r not in scheduled
                    and before.requests[r].status is RequestStatus.WAITING_FOR_REMOTE_KVS
                    and before.requests[r].num_computed_tokens + 1 < before.requests[r].num_tokens), None)
    if request is None:
        return None
    records, r = _edit(trace, i)
    r["scheduled"].append({"request_id": request.request_id, "num_computed_tokens": request.num_computed_tokens,
                           "prefill_tokens": 1, "decode_tokens": 0})
    return trace.header, records, i


def load_extra_block(trace: Trace, i: int) -> Mutant | None:
    """A remote KV load started in step ``i`` takes one block more than its tokens need (an allocator that
    rounds the external tokens up, or allocates the first chunk beside the load)."""
    record = trace.records[i]
    loads = record.get("kv_loads", {})
    taken = {b for blocks in record["blocks_allocated"].values() for b in blocks}
    spare = [b for b in trace.before[i].free_block_ids if b not in taken]
    if not loads or not spare:
        return None
    request_id = next(iter(loads))
    records, r = _edit(trace, i)
    r["blocks_allocated"][request_id] = list(r["blocks_allocated"].get(request_id, [])) + [spare[-1]]
    r["num_free_blocks"] -= 1
    return trace.header, records, i


def load_not_as_offered(trace: Trace, i: int) -> Mutant | None:
    """A remote KV load started in step ``i`` is recorded for one token fewer than the connector offered (a
    scheduler that trims the external tokens its own way), its blocks unchanged."""
    record = trace.records[i]
    loads = {r: n for r, n in record.get("kv_loads", {}).items() if n > 1}
    if not loads:
        return None
    request_id = next(iter(loads))
    records, r = _edit(trace, i)
    r["kv_loads"][request_id] -= 1
    return trace.header, records, i


def failed_load_kept_computed(trace: Trace, i: int) -> Mutant | None:
    """Step ``i`` first schedules a request whose remote KV load failed (``invalid_block_ids``): its chunk starts
    after the whole load, as if the invalid blocks held KV, and computes that many tokens fewer (an engine that
    ignores ``invalid_block_ids``: vLLM's recompute policy, ``_handle_invalid_blocks``, recomputes from the first
    invalid block)."""
    before = trace.before[i]
    for item in trace.records[i]["scheduled"]:
        request = before.requests.get(item["request_id"])
        if request is None or not request.holds_loaded_kv or not request.block_ids:
            continue
        lost = min(request.num_external_computed_tokens, request.num_tokens - 1) - request.num_computed_tokens
        if lost <= 0 or item["prefill_tokens"] <= lost:
            continue
        records, r = _edit(trace, i)
        changed = _scheduled(r, lambda s, rid=request.request_id: s["request_id"] == rid)
        changed["num_computed_tokens"] += lost
        changed["prefill_tokens"] -= lost
        return trace.header, records, i
    return None


def freed_at_abort_while_loading(trace: Trace, i: int) -> Mutant | None:
    """A request aborted before step ``i`` while its remote KV load was in flight is reported to free its blocks
    at the abort, though the transfer still writes them and frees them when it lands: the same blocks freed twice
    (vLLM ``Scheduler.finish_requests`` delays the free: ``delay_free_blocks``)."""
    record = trace.records[i]
    held = {r: trace.before[i].delayed_frees[r] for r in record["aborted"] if r in trace.before[i].delayed_frees}
    if not held:
        return None
    request_id, delayed = next(iter(held.items()))
    records, r = _edit(trace, i)
    r["blocks_freed"][request_id] = list(delayed.block_ids)
    r["num_free_blocks"] += len(delayed.block_ids)
    return trace.header, records, i


def send_freed_at_finish(trace: Trace, i: int) -> Mutant | None:
    """A ``kv_send`` request that finishes in step ``i`` is reported to free its blocks at once, though its KV
    send still reads them until ``finished_sending`` (vLLM ``request_finished`` returning
    ``delay_free_blocks=True``)."""
    after = trace.after[i]
    request_id = next((r for r in trace.records[i]["finished"] if r in after.delayed_frees), None)
    if request_id is None:
        return None
    blocks = after.delayed_frees[request_id].block_ids
    records, r = _edit(trace, i)
    r["blocks_freed"][request_id] = list(blocks)
    r["num_free_blocks"] += len(blocks)
    return trace.header, records, i


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("double-allocation", "a block handed to a request while another request still holds it", double_allocation),
    Mutation("window-frees-visible-block", "a sliding-window group frees a block its window still sees (off by one "
             "at the window's edge)", window_frees_visible_block),
    Mutation("window-keeps-skipped-block", "a sliding-window group keeps a block its window has passed, counted free",
             window_keeps_skipped_block),
    Mutation("group-table-short", "a KV cache group past group 0 not extended for the step's tokens", group_table_short),
    Mutation("group-extra-block", "a KV cache group past group 0 given more blocks than the sequence needs",
             group_extra_block),
    Mutation("group-hit-not-held", "a prefix-cache hit a sliding-window group does not hold (its needed entry "
             "null): group 0's hit taken for every group", group_hit_not_held),
    Mutation("allocation-out-of-range", "a block id past the pool (off-by-one in the block pool)", allocation_out_of_range),
    Mutation("allocation-outside-batch", "blocks allocated to a request that is not in the step's batch",
             allocation_outside_batch),
    Mutation("too-few-blocks", "a chunk computed into a block table too short for it (one block missing)",
             too_few_blocks),
    Mutation("extra-block", "a block more than the sequence needs (an allocator that rounds up)", extra_block),
    Mutation("free-twice", "a block freed twice (double free into the free queue)", free_twice),
    Mutation("free-foreign-block", "a request frees a block it never owned", free_foreign_block),
    Mutation("leak-on-finish-ids-only", "a finished request's last block is never freed; counters look right",
             leak_on_finish_ids_only),
    Mutation("leak-on-finish", "a finished request's last block is never freed (free count shrinks)", leak_on_finish),
    Mutation("leak-on-preempt", "a preempted request's blocks are not reported freed", leak_on_preempt),
    Mutation("preempted-holds-blocks", "a preempted request keeps its blocks", preempted_holds_blocks),
    Mutation("leak-on-abort", "an aborted request's blocks are never freed", leak_on_abort),
    Mutation("preempted-and-scheduled", "a preempted request is still run in the same step", preempted_and_scheduled),
    Mutation("zero-token-chunk", "a request in the batch with no tokens to compute", zero_token_chunk),
    Mutation("chunk-over-threshold", "a prefill chunk above long_prefill_token_threshold", chunk_over_threshold),
    Mutation("admits-impossible", "a request that can never complete alone admitted instead of rejected",
             admits_impossible),
    Mutation("budget-exceeded", "a step computes more than max_num_batched_tokens", budget_exceeded),
    Mutation("max-num-seqs-exceeded", "more running sequences than max_num_seqs", max_num_seqs_exceeded),
    Mutation("lora-limit-exceeded", "more distinct LoRA adapters in a step than max_loras", lora_limit_exceeded),
    Mutation("grammar-wait-ignored", "a structured-output request admitted before its grammar is ready",
             grammar_wait_ignored, applies=lambda t, i: _first_admission(t, i) is not None),
    Mutation("watermark-ignored", "a request admitted into the blocks the watermark keeps free", watermark_ignored),
    Mutation("prefill-cadence-ignored", "a prefill on a step vLLM 0.33's prefill cadence holds",
             prefill_cadence_ignored, applies=lambda t, i: i in _held_firsts(t)),
    Mutation("max-num-active-seqs-exceeded", "admission past max_num_active_seqs", max_num_active_seqs_exceeded),
    Mutation("chunk-skips-token", "a prefill chunk starts past the computed tokens (a token never computed)",
             chunk_skips_token),
    Mutation("chunk-repeats-token", "a chunk starts before the computed tokens (a token computed twice)",
             chunk_repeats_token),
    Mutation("decode-two-tokens", "a decode computes two tokens", decode_two_tokens),
    Mutation("prefill-reported-as-decode", "a prefill token logged as a decode token", prefill_reported_as_decode),
    Mutation("decode-reported-as-prefill", "a decode token logged as a prefill token", decode_reported_as_prefill),
    Mutation("token-after-finish", "a token sampled for a request that finished a step earlier", token_after_finish),
    Mutation("token-after-abort", "a token sampled for a request aborted before the step", token_after_abort),
    Mutation("missing-token", "a request that completes its sequence gets no token", missing_token),
    Mutation("token-mid-prefill", "a token sampled from a partial prefill chunk (or an unscheduled request)",
             token_mid_prefill),
    Mutation("output-past-max-tokens", "a request not stopped at max_tokens", output_past_max_tokens),
    Mutation("wrong-finish-reason", "stop reported as length or length as stop", wrong_finish_reason),
    Mutation("finish-not-due", "a request ended before its stop condition", finish_not_due),
    Mutation("wrong-free-count", "the free block count off by one", _counter("num_free_blocks")),
    Mutation("wrong-running-count", "the running count off by one", _counter("num_running")),
    Mutation("wrong-waiting-count", "the waiting count off by one (a request lost from the queue)",
             _counter("num_waiting")),
    Mutation("time-backwards", "a step starts before the previous one", time_backwards),
    Mutation("negative-duration", "a step lasts a negative time", negative_duration),
    Mutation("step-skipped", "a step number skipped (a lost log line)", step_skipped, applies=lambda t, i: True),
    Mutation("wrong-rejection-reason", "a rejection whose reason names no limit the request breaks",
             wrong_rejection_reason),
    Mutation("rejects-possible-request", "a request that fits is rejected", rejects_possible_request),
    Mutation("prefix-hit-without-caching", "prefix cache hits reported with prefix caching off",
             prefix_hit_without_caching),
    Mutation("hit-longer-than-cached", "a prefix-cache hit that claims a block past the cached chain",
             hit_longer_than_cached),
    Mutation("hit-shorter-than-cached", "a cached prefix recomputed instead of reused (a missed hit)",
             hit_shorter_than_cached),
    Mutation("hit-on-uncached-block", "a prefix-cache hit on a block that caches nothing", hit_on_uncached_block),
    Mutation("hit-on-evicted-block", "a prefix-cache hit on a block evicted in an earlier step", hit_on_evicted_block),
    Mutation("cached-block-handed-out-while-referenced",
             "a cached block handed out as a new block while a running request references it",
             cached_block_handed_out_while_referenced),
    Mutation("deduplicated-under-vllm", "a block table rewritten at publication (SGLang's de-duplication) by an "
             "engine that claims vLLM's append-only publication", deduplicated_under_vllm),
    Mutation("eviction-unreported", "a cached block handed out without reporting its eviction", eviction_unreported),
    Mutation("drafts-over-budget", "a decode's drafts not counted in the token budget", drafts_over_budget),
    Mutation("drafts-on-prefill", "drafts verified by a prefill chunk", drafts_on_prefill),
    Mutation("draft-not-proposed", "a draft id verified that was not proposed for the request", draft_not_proposed),
    Mutation("drafts-past-max-model-len", "drafts scheduled past what max_model_len can accept",
             drafts_past_max_model_len),
    Mutation("lookahead-not-allocated", "no KV slots allocated for num_lookahead_tokens", lookahead_not_allocated),
    Mutation("rejected-drafts-kept-computed", "rejected drafts kept as computed tokens",
             rejected_drafts_kept_computed),
    Mutation("rejected-draft-blocks-freed", "the blocks of rejected draft positions freed", rejected_draft_blocks_freed),
    Mutation("accepted-past-drafts", "more drafts accepted than verified", accepted_past_drafts),
    Mutation("stop-inside-drafts-ignored", "a stop inside the accepted drafts does not end the request",
             stop_inside_drafts_ignored),
    Mutation("drafts-kept-after-preemption", "a preempted request's drafts verified by its recompute",
             drafts_kept_after_preemption),
    Mutation("aborted-without-abort", "a request ended as aborted that the client did not abort", aborted_without_abort),
    Mutation("duplicate-arrival", "a request id added twice", duplicate_arrival),
    Mutation("reused-id-after-end", f"a fresh request under the id of one that ended {REUSED_AFTER}+ steps before",
             reused_id_after_end),
    Mutation("reorder-blocks-freed", "blocks released in another order", reorder_blocks_freed, semantic=False,
             why_not_semantic="the spec constrains which blocks are released, not the order an engine lists them"),
    Mutation("idle-gap", "the engine idles between two steps", idle_gap, semantic=False, applies=lambda t, i: True,
             why_not_semantic="steps may start later than the previous one ended (an idle engine)"),
    Mutation("abort-unknown-id", "an abort of an id never added", abort_unknown_id, semantic=False,
             why_not_semantic="aborting an unknown id changes nothing (vLLM Scheduler.finish_requests skips it)"),
    Mutation("schedule-past-foreseen-length", "an asynchronous plan schedules a request its placeholders bring to "
             "max_tokens (vLLM's async guard missing)", schedule_past_foreseen_length),
    Mutation("hand-out-block-freed-in-flight", "an asynchronous plan hands out a block a request held until the "
             "step in flight ended it", hand_out_block_freed_in_flight),
    Mutation("admit-arrival-before-planned", "an asynchronous plan admits a request that arrived after it was made",
             admit_arrival_before_planned),
    Mutation("wasted-item-misplaced", "wasted work for an ended request that starts where its computation did not",
             wasted_item_misplaced),
    Mutation("hide-wasted-tokens", "a step's wasted work not reported (wasted_tokens left out)", hide_wasted_tokens),
    Mutation("scheduled-before-transfer-landed", "a request scheduled while its remote KV load is in flight",
             scheduled_before_transfer_landed),
    Mutation("load-extra-block", "a remote KV load takes a block more than its tokens need", load_extra_block),
    Mutation("load-not-as-offered", "a remote KV load of other tokens than the connector offered", load_not_as_offered),
    Mutation("failed-load-kept-computed", "the blocks of a failed remote KV load kept as computed",
             failed_load_kept_computed),
    Mutation("freed-at-abort-while-loading", "a request aborted while loading frees its blocks at once and again "
             "when the load lands", freed_at_abort_while_loading),
    Mutation("send-freed-at-finish", "a request whose KV is being sent frees its blocks at its finish",
             send_freed_at_finish),
)
"""The catalogue, by name order of concern: blocks, batch, tokens and endings, bookkeeping, time."""


@attrs.frozen
class Outcome:
    """One mutant judged by both checkers.

    Attributes:
        mutation: the operator's name.
        trace: the trace's label.
        step: the step it was applied at.
        expected: the first step at which the fault is observable (``None`` for a non-semantic mutant).
        full: the first illegal step the full checker reported (``None``: accepted).
        incremental: the same for the incremental checker.
    """

    mutation: str
    trace: str
    step: int
    expected: int | None
    full: int | None
    incremental: int | None

    @property
    def correct(self) -> bool:
        """Both checkers rejected a semantic mutant at the expected step, or accepted a non-semantic one."""
        return self.full == self.expected and self.incremental == self.expected


def judge(header: dict[str, Any], records: list[Record]) -> tuple[int | None, int | None]:
    """The first illegal step by the full and by the incremental checker (``None``: the trace is legal).

    Raises:
        ValueError: a record breaks the trace schema (a mutation operator must produce valid records).
    """
    for number, record in enumerate(records):
        problem = record_schema_errors(record)  # the newest version's schema (a superset of the older ones)
        if problem:
            raise ValueError(f"record {number}: {problem}")
    config = SchedulerConfig.from_dict(header["config"])
    parsed = [StepRecord.from_dict(r) for r in records]
    asynchronous = bool(header.get("async_scheduling", False))
    full = check_trace(config, parsed, async_scheduling=asynchronous).first_bad_step
    incremental = check_trace(config, parsed, incremental=True, async_scheduling=asynchronous).first_bad_step
    return full, incremental


def mutate_and_judge(trace: Trace, label: str, mutation: Mutation, step: int) -> Outcome | None:
    """Apply ``mutation`` at ``step`` and judge it; ``None`` where it does not apply."""
    mutant = mutation.apply(trace, step)
    if mutant is None:
        return None
    header, records, observable = mutant
    full, incremental = judge(header, records)
    return Outcome(mutation.name, label, step, observable if mutation.semantic else None, full, incremental)


def applicable_steps(trace: Trace, mutation: Mutation) -> list[int]:
    """The steps at which ``mutation`` applies."""
    if mutation.applies is not None:
        return [i for i in range(len(trace.records)) if mutation.applies(trace, i)]
    return [i for i in range(len(trace.records)) if mutation.apply(trace, i) is not None]


def lab_trace(label: str, trace_file: str, config: SchedulerConfig, max_requests: int, time_scale: float,
              scheduler: str = "fcfs", faults: bool = True) -> tuple[str, Trace]:
    """A correct trace from a lab run on a window of a packaged real trace (``trace_file`` names one of
    ``schedspec/data/traces``), with, when ``faults``, every seventh request aborted shortly after it
    arrives and one request made impossible (a prompt over ``max_model_len``), so that the abort and
    rejection operators apply.

    Raises:
        schedspec.reference.engine.ViolationFound: the reference scheduler broke the spec (a bug).
    """
    import io

    from schedspec.lab.run import run_lab
    from schedspec.lab.trace_formats import load_trace, packaged_trace_path
    from schedspec.lab.windows import select_window

    workload = select_window(load_trace(packaged_trace_path(trace_file)), max_requests=max_requests,
                             time_scale=time_scale)
    if faults:
        workload = [
            attrs.evolve(spec, abort_at_time=spec.arrival_time + 0.4) if k % 7 == 3 else
            attrs.evolve(spec, prompt_len=config.max_model_len + 1) if k == 5 else spec
            for k, spec in enumerate(workload)
        ]
    out = io.StringIO()
    run_lab(workload, scheduler, config, steps_out=out)
    records = [StepRecord.from_json(line) for line in out.getvalue().splitlines()]
    return label, Trace.of(json.loads(header_line(config, scheduler)), records)


def prefix_cache_trace(scale: int = 1) -> tuple[str, Trace]:
    """A correct trace with prefix caching on: ``24 * scale`` requests in 4 prefix groups (shared prefixes
    of 12 to 40 tokens, prompts of up to 72 tokens, block size 4) arriving over a short time into a KV cache
    of 60 blocks, so that the run has hits, evictions, shared blocks and preemptions (fcfs)."""
    import io
    import random

    from schedspec.lab.run import run_lab
    from schedspec.spec.workload import RequestSpec

    rng = random.Random(7)
    config = SchedulerConfig(block_size=4, num_kv_blocks=60, max_num_batched_tokens=48, max_num_seqs=6,
                             max_model_len=128, enable_prefix_caching=True)
    prefixes = {f"g{k}": rng.randrange(12, 41) for k in range(4)}
    workload = []
    for k in range(24 * scale):
        group = rng.choice(sorted(prefixes))
        prompt = prefixes[group] + rng.randrange(1, 33)
        workload.append(RequestSpec(f"p{k:03d}", prompt, rng.randrange(2, 24), arrival_time=0.02 * k,
                                    prefix_group=group, prefix_len=prefixes[group],
                                    abort_at_time=0.02 * k + 0.05 if k % 9 == 4 else None))
    out = io.StringIO()
    run_lab(workload, "fcfs", config, steps_out=out)
    records = [StepRecord.from_json(line) for line in out.getvalue().splitlines()]
    return "prefix-cache", Trace.of(json.loads(header_line(config, "fcfs")), records)


def speculative_trace(scale: int = 1, lookahead: bool = False) -> tuple[str, Trace]:
    """A correct trace with speculative decoding (trace version 3): ``30 * scale`` requests (prompts of up to
    60 tokens, up to 40 outputs, max_model_len 64 so that some end at it, some with an EOS at an output
    that the drafter's drafts can reach, every eleventh aborted) run by fcfs with 3 drafts a decode
    (:class:`~schedspec.reference.fake_model.FakeModel` verifying, acceptance rate 0.7) in a KV cache of 40
    blocks of 4 (preemptions); without ``lookahead`` prefix caching is on (shared prefixes), with it
    ``num_lookahead_tokens = 3`` (EAGLE's)."""
    import random

    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS
    from schedspec.spec.workload import RequestSpec

    rng = random.Random(23 + lookahead)
    config = SchedulerConfig(block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=6,
                             max_model_len=64, enable_prefix_caching=not lookahead, num_speculative_tokens=3,
                             num_lookahead_tokens=3 if lookahead else 0)
    workload = []
    for k in range(30 * scale):
        prompt = rng.randrange(1, 61)
        group = {} if lookahead or k % 3 else {"prefix_group": "g", "prefix_len": min(prompt, 12)}
        arrival = rng.randrange(0, 30)
        workload.append(RequestSpec(f"s{k:03d}", prompt, rng.randrange(1, 41), arrival_step=arrival,
                                    eos_at_output=rng.randrange(2, 12) if k % 4 == 1 else None,
                                    abort_at_step=arrival + rng.randrange(3, 30) if k % 11 == 7 else None, **group))
    result = Engine(SCHEDULERS["fcfs"](config), config, stop_on_violation=True).run(workload)
    label = "speculative-lookahead" if lookahead else "speculative-prefix-cache"
    return label, Trace.of(json.loads(header_line(config, "fcfs")), result.records)


LONG_TRACE_CONFIG = {"block_size": 4, "num_kv_blocks": 8, "max_num_batched_tokens": 16, "max_num_seqs": 2,
                     "max_model_len": 32, "enable_chunked_prefill": True, "long_prefill_token_threshold": 0,
                     "enable_prefix_caching": False, "preemption_mode": "recompute"}


def long_trace(steps: int) -> Iterator[Record]:
    """The records of a correct fcfs trace of ``steps`` steps, made as they are needed (any length, little
    memory): request ``r{k}`` arrives at step ``2k`` (prompt 3 tokens, ``max_tokens`` 2), is prefilled in
    that step and decoded and finished (``length``) in the next, holding block 0. Its header's config is
    :data:`LONG_TRACE_CONFIG`. For the size benchmark (``benchmarks/size.py``) and the tests that a check
    of a long trace forgets ended requests yet still refuses a reused id."""
    empty = {"arrivals": [], "aborts": [], "blocks_allocated": {}, "blocks_freed": {}, "prefix_hit_tokens": {},
             "preempted": [], "finished": {}, "aborted": [], "rejected": {}}
    for step in range(steps):
        request_id = f"r{step // 2}"
        record = {"step": step, "start_time": step * 0.01, "duration": 0.01, **empty}
        if step % 2 == 0:
            record.update(
                arrivals=[{"request_id": request_id, "prompt_len": 3, "max_tokens": 2, "arrival_step": step,
                           "arrival_time": 0.0, "priority": 0, "prefix_len": 0, "eos_token_id": 0,
                           "stop_token_ids": [], "min_tokens": 0}],
                scheduled=[{"request_id": request_id, "num_computed_tokens": 0, "prefill_tokens": 3, "decode_tokens": 0}],
                blocks_allocated={request_id: [0]}, sampled_token_ids={request_id: 700}, num_free_blocks=7,
                num_running=1, num_waiting=0)
        else:
            record.update(
                scheduled=[{"request_id": request_id, "num_computed_tokens": 3, "prefill_tokens": 0, "decode_tokens": 1}],
                blocks_freed={request_id: [0]}, finished={request_id: "length"}, sampled_token_ids={request_id: 958},
                num_free_blocks=8, num_running=0, num_waiting=0)
        yield record


def in_flight_trace(scale: int = 1) -> tuple[str, Trace]:
    """A correct trace of an asynchronous engine (header ``async_scheduling``): ``40 * scale`` requests
    (prompts of up to 40 tokens, up to 20 outputs, every third with an EOS among its first outputs, every
    seventh aborted, one impossible) run by fcfs planned while a step is in flight
    (:class:`~schedspec.reference.in_flight.InFlightScheduler`) in a KV cache of 40 blocks of 4, so that
    plans compute for requests that ended meanwhile (``wasted_tokens``) and preempt."""
    import random

    from schedspec.reference.engine import Engine
    from schedspec.reference.in_flight import fcfs_async
    from schedspec.spec.workload import RequestSpec

    rng = random.Random(5)
    config = SchedulerConfig(block_size=4, num_kv_blocks=40, max_num_batched_tokens=32, max_num_seqs=6,
                             max_model_len=64)
    workload = []
    for k in range(40 * scale):
        arrival = rng.randrange(0, 40 * scale)
        workload.append(RequestSpec(f"q{k:03d}", rng.randrange(1, 40), rng.randrange(1, 20), arrival_step=arrival,
                                    eos_at_output=rng.randrange(1, 10) if k % 3 == 1 else None,
                                    abort_at_step=arrival + rng.randrange(1, 20) if k % 7 == 2 else None))
    workload.append(RequestSpec("impossible", config.max_model_len + 6, 3, arrival_step=5))
    result = Engine(fcfs_async(config), config, stop_on_violation=True).run(workload)
    return "in-flight", Trace.of(json.loads(header_line(config, "fcfs-async", async_scheduling=True)), result.records)


def hybrid_trace(scale: int = 1) -> tuple[str, Trace]:
    """A correct trace with hybrid KV cache groups (trace version 4): a full-attention group and sliding-window
    groups of 8 and 5 tokens (block size 2) sharing a pool of 38 blocks, ``30 * scale`` requests of up to 40
    prompt tokens and 16 outputs (max_model_len 64), every seventh aborted, every third sharing a prefix (prefix
    caching on: hits across the groups, some past a window), and one request whose full-attention blocks alone
    would fit but whose groups together never can (rejected ``exceeds-kv-cache``); fcfs, with window frees and
    preemptions."""
    import random

    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS
    from schedspec.spec.workload import RequestSpec

    rng = random.Random(31)
    config = SchedulerConfig(block_size=2, num_kv_blocks=38, max_num_batched_tokens=24, max_num_seqs=6,
                             max_model_len=64, enable_prefix_caching=True,
                             kv_cache_groups=[{"kind": "full_attention"},
                                              {"kind": "sliding_window", "sliding_window": 8},
                                              {"kind": "sliding_window", "sliding_window": 5}])
    workload = []
    for k in range(30 * scale):
        arrival = rng.randrange(0, 30 * scale)
        prompt_len = rng.randrange(1, 41)
        shared = k % 3 == 0  # every third shares a prefix (prefix caching: hits across the groups)
        workload.append(RequestSpec(f"h{k:03d}", prompt_len, rng.randrange(1, 17), arrival_step=arrival,
                                    eos_at_output=rng.randrange(2, 10) if k % 5 == 1 else None,
                                    abort_at_step=arrival + rng.randrange(2, 20) if k % 7 == 3 else None,
                                    prefix_group="p" if shared else None, prefix_len=prompt_len if shared else 0))
    workload.append(RequestSpec("impossible", 60, 4, arrival_step=4))
    result = Engine(SCHEDULERS["fcfs"](config), config, stop_on_violation=True).run(workload)
    return "hybrid-kv-cache-groups", Trace.of(json.loads(header_line(config, "fcfs")), result.records)


def remote_kv_trace(scale: int = 1) -> tuple[str, Trace]:
    """A correct trace with a KV connector: ``40 * scale`` requests (prompts of up to 40 tokens, up to 12 outputs),
    half of them loading part of their prompt remotely (landing 1 to 4 steps after the load starts, one in three
    of those failing from one of its first blocks), every fifth sending its KV when it finishes, every seventh
    aborted (some while loading), run by fcfs in a KV cache of 48 blocks of 4 (so that loads wait for blocks and
    running requests are preempted) with the engine loop's KV connector
    (:class:`~schedspec.reference.kv_connector.ScheduledConnector`)."""
    import random

    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import SCHEDULERS
    from schedspec.spec.workload import RequestSpec

    rng = random.Random(11)
    config = SchedulerConfig(block_size=4, num_kv_blocks=48, max_num_batched_tokens=32, max_num_seqs=6,
                             max_model_len=64)
    workload = []
    for k in range(40 * scale):
        prompt = rng.randrange(2, 41)
        arrival = rng.randrange(0, 30 * scale)
        load = {}
        if k % 2 == 0:
            load = {"num_external_computed_tokens": rng.randrange(1, prompt + 1), "kv_load_steps": rng.randrange(1, 5),
                    "kv_load_invalid_block": rng.randrange(0, 3) if k % 6 == 0 else None}
        workload.append(RequestSpec(f"k{k:03d}", prompt, rng.randrange(1, 13), arrival_step=arrival,
                                    kv_send=k % 5 == 1, kv_send_steps=rng.randrange(1, 4) if k % 5 == 1 else None,
                                    abort_at_step=arrival + rng.randrange(0, 4) if k % 7 == 2 else None, **load))
    result = Engine(SCHEDULERS["fcfs"](config), config, stop_on_violation=True).run(workload)
    return "remote-kv", Trace.of(json.loads(header_line(config, "fcfs")), result.records)


def standard_traces(scale: int = 1) -> list[tuple[str, Trace]]:
    """The traces the catalogue is measured on (five real windows, one with prefix caching, two with
    speculative decoding, :func:`speculative_trace`, one of an asynchronous engine, :func:`in_flight_trace`, one
    with hybrid KV cache groups, :func:`hybrid_trace`, and one with remote KV loads and sends,
    :func:`remote_kv_trace`): the Azure conversation and code traces and
    Mooncake's conversation trace under a roomy KV cache (fcfs), the Azure conversation trace under KV
    pressure (fcfs, with preemptions), the Azure code trace under static batching, and
    :func:`prefix_cache_trace` (synthetic shared prefixes, prefix caching on). ``scale``
    multiplies the requests per window (1: CI's sample)."""
    roomy = SchedulerConfig(block_size=16, num_kv_blocks=2048, max_num_batched_tokens=512, max_num_seqs=16,
                            max_model_len=8192)
    tight = SchedulerConfig(block_size=16, num_kv_blocks=250, max_num_batched_tokens=512, max_num_seqs=8,
                            max_model_len=2048)
    long_roomy = SchedulerConfig(block_size=64, num_kv_blocks=4096, max_num_batched_tokens=8192, max_num_seqs=8,
                                 max_model_len=65536)
    return [
        lab_trace("azure-conv", "AzureLLMInferenceTrace_conv.csv", roomy, 12 * scale, 0.05),
        lab_trace("azure-code", "AzureLLMInferenceTrace_code.csv", roomy, 12 * scale, 0.05),
        lab_trace("mooncake-conv", "mooncake_conversation_trace.jsonl", long_roomy, 6 * scale, 0.05),
        lab_trace("azure-conv-kv-pressure", "AzureLLMInferenceTrace_conv.csv", tight, 24 * scale, 0.001),
        lab_trace("azure-code-static", "AzureLLMInferenceTrace_code.csv", tight, 16 * scale, 0.01, scheduler="static"),
        prefix_cache_trace(scale),
        speculative_trace(scale),
        speculative_trace(scale, lookahead=True),
        in_flight_trace(scale),
        hybrid_trace(scale),
        remote_kv_trace(scale),
    ]
