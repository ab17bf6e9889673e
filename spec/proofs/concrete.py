"""Concrete Python spec values as encoding numerals, and back: how the encoding is tested against the
code (``tests/test_proofs_encoding.py``, ``tests/test_proofs_policy.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import z3

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import RequestStatus
from schedspec.spec.state import SchedulerState, StepPlan

from .encoding import EMPTY, PREEMPTED, RUNNING, STATUS_NAMES, WAITING, Ctx, Plan, Slot, State, SymConfig, py

_STATUS = {RequestStatus.WAITING: WAITING, RequestStatus.PREEMPTED: PREEMPTED, RequestStatus.RUNNING: RUNNING}


def concrete_ctx(config: SchedulerConfig) -> Ctx:
    return Ctx(SymConfig.concrete(config), "fixed")


def encode_state(state: SchedulerState, slot_ids: Sequence[str | None]) -> State:
    """The state with request ``slot_ids[i]`` in slot ``i`` (``None``: empty). Positions are the indices
    in ``state.waiting`` / ``state.running``; ``seq`` is the arrival step (the order of addition is
    not stored in a state)."""
    V = z3.IntVal
    waiting = {r: k for k, r in enumerate(state.waiting)}
    running = {r: k for k, r in enumerate(state.running)}
    slots = []
    for request_id in slot_ids:
        request = state.requests.get(request_id) if request_id is not None else None
        if request is None:
            slots.append(Slot(V(EMPTY), V(0), V(0), V(0), V(0), V(0), V(0), z3.BoolVal(False), V(0), V(0), V(0), V(0)))
            continue
        pos = running[request_id] if request_id in running else waiting[request_id]
        slots.append(Slot(
            st=V(_STATUS[request.status]), p=V(request.prompt_len), o=V(request.num_output_tokens),
            mt=V(request.max_tokens), nc=V(request.num_computed_tokens), b=V(len(request.block_ids)), pos=V(pos),
            adm=z3.BoolVal(request.admitted_step is not None), npre=V(request.num_preemptions),
            arr=V(request.arrival_step), prio=V(request.priority), seq=V(request.arrival_step),
        ))
    return State(slots, V(len(state.free_block_ids)), V(0), V(len(state.waiting) - 1), V(len(state.running) - 1),
                 V(state.step), V(state.num_requests_added))


def slot_assignment(state: SchedulerState, plan: StepPlan | None, n: int, order: Sequence[int] | None = None
                    ) -> list[str | None]:
    """Slots for every live request, then for ids the plan names that are not live; ``order`` permutes
    the slots. Raises ``ValueError`` if ``n`` slots are too few."""
    ids: list[str] = list(state.running) + list(state.waiting)
    if plan is not None:
        named = [i.request_id for i in plan.scheduled] + list(plan.preempted) + [r for r, _ in plan.rejected]
        ids += [r for r in dict.fromkeys(named) if r not in state.requests]
    if len(ids) > n:
        raise ValueError(f"{len(ids)} requests need more than {n} slots")
    slots: list[str | None] = list(ids) + [None] * (n - len(ids))
    if order is not None:
        slots = [slots[k] for k in order]
    return slots


def encode_plan(plan: StepPlan, slot_ids: Sequence[str | None]) -> Plan:
    """The plan per slot. Each id must appear at most once in the plan (a slot holds one entry)."""
    V = z3.IntVal
    index = {r: i for i, r in enumerate(slot_ids) if r is not None}
    n = len(slot_ids)
    out = Plan(sched=[z3.BoolVal(False)] * n, start=[V(0)] * n, ntok=[V(0)] * n, nb=[V(0)] * n, bpos=[V(0)] * n,
               pre=[z3.BoolVal(False)] * n, ppos=[V(0)] * n, rej=[z3.BoolVal(False)] * n)
    for k, item in enumerate(plan.scheduled):
        i = index[item.request_id]
        out.sched[i] = z3.BoolVal(True)
        out.start[i] = V(item.num_computed_tokens)
        out.ntok[i] = V(item.num_tokens)
        out.nb[i] = V(len(item.new_block_ids))
        out.bpos[i] = V(k)
    for k, request_id in enumerate(plan.preempted):
        out.pre[index[request_id]] = z3.BoolVal(True)
        out.ppos[index[request_id]] = V(k)
    for request_id, _ in plan.rejected:
        out.rej[index[request_id]] = z3.BoolVal(True)
    return out


def evaluate(term: Any) -> Any:
    """A ground term as a Python value."""
    return py(z3.simplify(term))


def decode_state(s: State, slot_ids: Sequence[str | None]) -> dict[str, Any]:
    """What the encoding says about a ground state: each live request's fields, the queue orders (by
    position) and the free block count."""
    requests = {}
    waiting, running = [], []
    for request_id, sl in zip(slot_ids, s.slots, strict=True):
        st = evaluate(sl.st)
        if st == EMPTY:
            continue
        requests[request_id] = {
            "status": STATUS_NAMES[st], "prompt_len": evaluate(sl.p), "outputs": evaluate(sl.o),
            "max_tokens": evaluate(sl.mt), "computed": evaluate(sl.nc), "blocks": evaluate(sl.b),
            "admitted": evaluate(sl.adm), "preemptions": evaluate(sl.npre),
        }
        (running if st == RUNNING else waiting).append((evaluate(sl.pos), request_id))
    return {
        "requests": requests,
        "waiting": [r for _, r in sorted(waiting)],
        "running": [r for _, r in sorted(running)],
        "free": evaluate(s.free),
    }


def describe_state(state: SchedulerState) -> dict[str, Any]:
    """The same view of a Python state, for comparison with :func:`decode_state`."""
    requests = {}
    for request_id, r in state.requests.items():
        requests[request_id] = {
            "status": STATUS_NAMES[_STATUS[r.status]], "prompt_len": r.prompt_len, "outputs": r.num_output_tokens,
            "max_tokens": r.max_tokens, "computed": r.num_computed_tokens, "blocks": len(r.block_ids),
            "admitted": r.admitted_step is not None, "preemptions": r.num_preemptions,
        }
    return {"requests": requests, "waiting": list(state.waiting), "running": list(state.running),
            "free": len(state.free_block_ids)}


def describe_plan(plan: StepPlan) -> dict[str, Any]:
    """A plan with block ids replaced by counts (the encoding counts blocks)."""
    return {
        "scheduled": [(i.request_id, i.num_computed_tokens, i.num_tokens, len(i.new_block_ids)) for i in plan.scheduled],
        "preempted": list(plan.preempted),
        "rejected": sorted(r for r, _ in plan.rejected),
    }


def decode_plan(values: Mapping[str, Any], slot_ids: Sequence[str | None]) -> dict[str, Any]:
    """A plan read from per-slot Python values (``values[field][i]``), in :func:`describe_plan` form."""
    n = len(slot_ids)
    scheduled = sorted((values["bpos"][i], slot_ids[i], values["start"][i], values["ntok"][i], values["nb"][i])
                       for i in range(n) if values["sched"][i])
    preempted = sorted((values["ppos"][i], slot_ids[i]) for i in range(n) if values["pre"][i])
    rejected = sorted(str(slot_ids[i]) for i in range(n) if values["rej"][i])
    return {
        "scheduled": [(r, start, ntok, nb) for _, r, start, ntok, nb in scheduled],
        "preempted": [r for _, r in preempted],
        "rejected": rejected,
    }


# --- block ids (:mod:`.blocks`) --------------------------------------------------------------------------


def encode_ownership(state: SchedulerState, slot_ids: Sequence[str | None], num_kv_blocks: int) -> list[Any]:
    """``owner[k]`` for each block ``k`` in ``[0, num_kv_blocks)``: the slot of the live request that owns
    it, or :data:`.blocks.FREE`. Raises ``ValueError`` naming the block if the state has no such function
    (a block owned twice, free and owned, out of range, or neither free nor owned): exactly when the
    Python invariant ``block-conservation`` is broken on the live requests."""
    from .blocks import FREE

    index = {r: i for i, r in enumerate(slot_ids) if r is not None}
    owner: dict[int, Any] = {}
    for block_id in state.free_block_ids:
        if block_id in owner:
            raise ValueError(f"block {block_id} is twice in the free queue")
        owner[block_id] = FREE
    for request_id, request in state.requests.items():
        for block_id in request.block_ids:
            if block_id in owner:
                raise ValueError(f"block {block_id} owned by {request_id} is also free or owned")
            owner[block_id] = index[request_id]
    for block_id in owner:
        if not 0 <= block_id < num_kv_blocks:
            raise ValueError(f"block {block_id} out of range")
    missing = [k for k in range(num_kv_blocks) if k not in owner]
    if missing:
        raise ValueError(f"block {missing[0]} is neither free nor owned")
    return [z3.IntVal(owner[k]) for k in range(num_kv_blocks)]


def encode_handout(plan: StepPlan, slot_ids: Sequence[str | None], num_kv_blocks: int) -> Any:
    """The plan's new block ids per slot (:class:`.blocks.Handout`): copies of each block in range, and
    the ids out of range."""
    from .blocks import Handout

    index = {r: i for i, r in enumerate(slot_ids) if r is not None}
    n = len(slot_ids)
    hand = [[0] * num_kv_blocks for _ in range(n)]
    stray = [0] * n
    for item in plan.scheduled:
        i = index[item.request_id]
        for block_id in item.new_block_ids:
            if 0 <= block_id < num_kv_blocks:
                hand[i][block_id] += 1
            else:
                stray[i] += 1
    return Handout([[z3.IntVal(x) for x in row] for row in hand], [z3.IntVal(x) for x in stray])


def ownership_of(state: SchedulerState, slot_ids: Sequence[str | None], num_kv_blocks: int) -> list[int]:
    """:func:`encode_ownership` as Python ints (a state after a step, for comparison with the encoding)."""
    return [py(v) for v in encode_ownership(state, slot_ids, num_kv_blocks)]
