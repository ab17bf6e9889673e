"""Tests that kill the mutants mutmut found surviving in spec/checker.py (issue 28, docs/testing.md
"Mutation score"): each asserts the checker's verdict on a trace (which mismatch, at which step, for which
request, with which numbers) or what it reads from a record, on records edited by hand here. Each test names
the mutants it was written for (``scripts/mutmut.sh`` names, ``x_FUNCTION__mutmut_N``)."""

from __future__ import annotations

import attrs
import pytest

from schedspec.spec.checker import check_trace, plan_from_record, transfers_of
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.state import NO_TRANSFERS, KVLoad, KVTransferOutput, ScheduledRequest, StepPlan
from schedspec.spec.trace import StepRecord


def record(**fields) -> StepRecord:
    return StepRecord(step=0, start_time=0.0, duration=0.01, **fields)


def test_the_connectors_report_is_read_from_each_of_its_three_fields() -> None:
    """``transfers_of``: a record without a KV connector's report is ``NO_TRANSFERS``; each of
    ``finished_recving``, ``invalid_block_ids`` and ``finished_sending`` alone is read into the report the
    step applies. Kills the mutants of ``x_transfers_of`` (``or`` made ``and``: a report of one field was
    dropped; a field passed as another or as ``None``)."""
    assert transfers_of(record()) is NO_TRANSFERS
    for fields in ({"finished_recving": ("r",)}, {"invalid_block_ids": (3,)}, {"finished_sending": ("s",)}):
        assert transfers_of(record(**fields)) == KVTransferOutput(**fields), fields
    both = {"finished_recving": ("r", "q"), "invalid_block_ids": (3, 4), "finished_sending": ("s",)}
    assert transfers_of(record(**both)) == KVTransferOutput(**both)


def test_the_plan_of_a_record_carries_its_loads_and_every_groups_blocks() -> None:
    """``plan_from_record``: a scheduled request's item carries the record's new blocks, hit blocks, new blocks
    of groups 1.., window frees, groups' hit blocks and de-duplicated pairs; each remote KV load of
    ``kv_loads`` takes its blocks from ``blocks_allocated``. Kills the mutants of ``x_plan_from_record`` that
    drop or swap one of them."""
    step = record(scheduled=[{"request_id": "a", "num_computed_tokens": 0, "prefill_tokens": 4, "decode_tokens": 0}],
                  blocks_allocated={"a": [0], "r": [1, 2]}, prefix_hit_blocks={"a": [8]}, kv_loads={"r": 8},
                  group_blocks_allocated={"a": [[5]]}, blocks_skipped={"a": [7]}, group_prefix_hit_blocks={"a": [[9]]},
                  blocks_deduplicated={"a": [[3, 4]]})
    assert plan_from_record(step) == StepPlan(
        scheduled=(ScheduledRequest("a", 0, 4, new_block_ids=(0,), cached_block_ids=(8,),
                                    group_new_block_ids=((5,),), skipped_block_ids=(7,), group_cached_block_ids=((9,),),
                                    deduplicated_block_ids=((3, 4),)),),
        loads=(KVLoad("r", 8, (1, 2)),))


def test_a_transfer_still_holding_blocks_when_the_trace_ends_is_named_with_its_kind_and_blocks() -> None:
    """``unfinished-request`` for each ended request whose transfer never reported done: ``a`` (7 tokens: 2
    blocks of 4) finished at step 0 and sends its KV for 5 steps; ``b`` started loading 4 tokens (1 block) at
    step 1 and was aborted at step 3 while loading. Cut after step 3, the trace names both, each with its
    transfer, blocks, last step and the field that never reported it; the whole trace passes. Kills the
    mutants of ``x__unfinished``'s ``delayed_frees`` loop (the kind, the count, the step, the field)."""
    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import make_scheduler
    from schedspec.spec.workload import RequestSpec

    config = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=16)
    workload = [RequestSpec("a", 7, 1, arrival_step=0, kv_send=True, kv_send_steps=5),
                RequestSpec("b", 6, 2, arrival_step=1, num_external_computed_tokens=4, kv_load_steps=5, abort_at_step=3)]
    records = Engine(make_scheduler("fcfs", config), config).run(workload, max_steps=40).records
    assert records[1].kv_loads == {"b": 4} and records[3].aborted == ("b",)
    assert check_trace(config, records).ok
    tail = ("every transfer must complete; a log window cut from a running engine is checked with --allow-unfinished")
    assert [(v.name, v.step, v.request_id, v.detail) for v in check_trace(config, records[:4]).violations] == [
        ("unfinished-request", 3, "a", "ended, but its remote KV send still holds 2 blocks when the trace ends after "
                                       f"step 3 (never reported in finished_sending): {tail}"),
        ("unfinished-request", 3, "b", "ended, but its remote KV load still holds 1 blocks when the trace ends after "
                                       f"step 3 (never reported in finished_recving): {tail}"),
    ]


@pytest.fixture(scope="module")
def remote():
    """The KV connector's trace (``trace_mutations.remote_kv_trace``) as records, and its config."""
    from schedspec.trace_mutations import remote_kv_trace

    _, trace = remote_kv_trace()
    return trace.config, [StepRecord.from_dict(r) for r in trace.records]


@pytest.fixture(scope="module")
def hybrid():
    """The trace with hybrid KV cache groups and prefix caching (``trace_mutations.hybrid_trace``)."""
    from schedspec.trace_mutations import hybrid_trace

    _, trace = hybrid_trace()
    return trace.config, [StepRecord.from_dict(r) for r in trace.records]


def mismatches(config: SchedulerConfig, records: list[StepRecord], step: int, **fields) -> list:
    """The ``trace-mismatch`` violations of the trace with ``fields`` set in record ``step``."""
    edited = list(records)
    edited[step] = attrs.evolve(records[step], **fields)
    return [(v.step, v.request_id, v.detail) for v in check_trace(config, edited).violations
            if v.name == "trace-mismatch"]


def test_blocks_allocated_go_to_the_batch_or_to_the_loads_the_step_starts(remote) -> None:
    """The connector's trace passes (a load's blocks are in ``blocks_allocated`` though it is not in the
    batch); blocks allocated to an id neither in the batch nor loading, at the step of a load, are a mismatch
    naming it and its blocks. Kills the mutants of ``x__compare_record``'s ``blocks_allocated`` test (the
    loads not excused, or every id excused)."""
    config, records = remote
    assert check_trace(config, records).ok
    step = next(i for i, r in enumerate(records) if r.kv_loads)
    allocated = {**records[step].blocks_allocated, "ghost": (47,)}
    assert mismatches(config, records, step, blocks_allocated=allocated) == [
        (step, "ghost", "blocks_allocated [47] to a request that is not in the step's batch nor loads")]


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("group_blocks_allocated", ((1,), (2,)), "[[1], [2]]"),
    ("blocks_skipped", (3,), "[3]"),
    ("group_prefix_hit_blocks", ((4,), ()), "[[4], []]"),
])
def test_the_groups_blocks_go_only_to_the_batch(hybrid, field: str, value: tuple, shown: str) -> None:
    """With KV cache groups (the trace passes: ``test_deduplicated_blocks_go_only_to_the_batch``), a group field
    (version 4) giving blocks to an id not in the step's batch is a mismatch naming the field, the id and the
    blocks; the same field with only empty tables is no mismatch. Kills the mutants of ``x__compare_record``'s group fields loop (a field left out, ``any`` dropped,
    the detail)."""
    config, records = hybrid
    step = next(i for i, r in enumerate(records) if r.scheduled)
    assert mismatches(config, records, step, **{field: {**getattr(records[step], field), "ghost": value}}) == [
        (step, "ghost", f"{field} {shown} for a request that is not in the step's batch")]
    empty = tuple(() for _ in value) if value and isinstance(value[0], tuple) else ()
    assert mismatches(config, records, step, **{field: {**getattr(records[step], field), "ghost": empty}}) == []


def test_window_frees_need_groups_configured(remote) -> None:
    """Without ``kv_cache_groups``, ``blocks_skipped`` for a scheduled request is a mismatch naming the field and
    the request (the other group fields make a plan the spec refuses first: ``the spec cannot apply``). Kills the
    mutants of ``x__compare_record``'s ``no kv_cache_groups configured`` test."""
    config, records = remote
    request_id = records[0].scheduled[0].request_id
    assert mismatches(config, records, 0, blocks_skipped={request_id: (47,)}) == [
        (0, request_id, "blocks_skipped with no kv_cache_groups configured")]
    assert mismatches(config, records, 0, blocks_skipped={request_id: ()}) == []


def test_deduplicated_blocks_go_only_to_the_batch(hybrid) -> None:
    """The trace with KV cache groups passes; ``blocks_deduplicated`` pairs for an id not in the step's batch are a mismatch naming the id and the
    pairs; an empty list is none. Kills the mutants of ``x__compare_record``'s ``blocks_deduplicated``
    loop."""
    config, records = hybrid
    assert check_trace(config, records).ok
    step = next(i for i, r in enumerate(records) if r.scheduled)
    assert mismatches(config, records, step, blocks_deduplicated={"ghost": ((5, 6),)}) == [
        (step, "ghost", "blocks_deduplicated [[5, 6]] for a request that is not in the step's batch")]
    assert mismatches(config, records, step, blocks_deduplicated={"ghost": ()}) == []


def test_a_load_the_record_gives_no_blocks_is_judged_as_taking_none(remote) -> None:
    """A record that starts a remote KV load but lists no ``blocks_allocated`` for it: the plan's load takes no
    blocks (``()``), so ``load-blocks-exact`` names the request and the blocks it should take (3 tokens: 1
    block of 4), at that step; no crash. Kills ``x_plan_from_record__mutmut_63, _65`` (the load's blocks
    ``None``: a TypeError instead of the verdict)."""
    config, records = remote
    step = next(i for i, r in enumerate(records) if r.kv_loads)
    request_id, tokens = next(iter(records[step].kv_loads.items()))
    assert plan_from_record(record(kv_loads={"r": 8})).loads == (KVLoad("r", 8, ()),)
    edited = list(records)
    edited[step] = attrs.evolve(records[step], blocks_allocated={
        r: b for r, b in records[step].blocks_allocated.items() if r != request_id})
    report = check_trace(config, edited)
    blocks = -(-tokens // config.block_size)
    assert report.first_bad_step == step
    assert ("load-blocks-exact", request_id, f"load of {tokens} tokens takes 0 blocks, not {blocks}") in [
        (v.name, v.request_id, v.detail) for v in report.violations]
