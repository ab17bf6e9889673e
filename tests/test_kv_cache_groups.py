"""Hybrid KV cache groups (:mod:`schedspec.spec.kv_cache_groups`): the config, the rules and invariants per
group (each with a bad plan or state and its good twin), the admission rule over all groups, the trace format
(version 4), the reference schedulers that allocate per group, and the trace mutations of a sliding window.

The hand-made state: block size 2, a full-attention group and a sliding window of 4 tokens, 12 blocks. Request
``a`` has a prompt of 8 tokens, all computed, and one output (a decode at position 8): its full-attention table
is blocks 0..3 and its window table blocks 4..7. The token at position 8 attends positions 5..8, so the window's
first ``(8 - 4 + 1) // 2 = 2`` blocks (4 and 5) are past it and its allocation frees them; 9 tokens need 5
blocks per group, one new block in each.
"""

from __future__ import annotations

import io
import json
import random

import attrs
import pytest

from schedspec.reference.engine import Engine, UnsupportedFeature
from schedspec.reference.scheduler import make_scheduler
from schedspec.spec.admission import rejection_reason
from schedspec.spec.checker import check_trace
from schedspec.spec.config import ConfigError, KVCacheGroup, SchedulerConfig
from schedspec.spec.invariants import check_state
from schedspec.spec.kv_cache_groups import NULL_BLOCK, min_peak_blocks, num_skipped_blocks, release_order
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.rules import GROUP_RULES, violated_rules
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.trace import open_trace, record_schema_errors, write_trace
from schedspec.spec.transitions import apply_plan
from schedspec.spec.workload import RequestSpec
from schedspec.trace_mutations import (
    Trace,
    group_extra_block,
    group_hit_not_held,
    group_table_short,
    hybrid_trace,
    judge,
    window_frees_visible_block,
    window_keeps_skipped_block,
)

GROUPS = ({"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 4})
CONFIG = SchedulerConfig(block_size=2, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32,
                         kv_cache_groups=GROUPS)


def running_a(window_table: tuple[int, ...] = (4, 5, 6, 7)) -> Request:
    return Request("a", 0, tuple(range(10, 18)), max_tokens=4, status=RequestStatus.RUNNING, num_computed_tokens=8,
                   output_token_ids=(21,), block_ids=(0, 1, 2, 3), group_block_ids=(window_table,), admitted_step=0,
                   first_token_step=0)


def state_of(a: Request | None = None, free: tuple[int, ...] = (8, 9, 10, 11)) -> SchedulerState:
    a = a or running_a()
    return SchedulerState(step=1, running=("a",), requests={"a": a}, free_block_ids=free, num_requests_added=1)


GOOD = ScheduledRequest("a", 8, 1, (8,), group_new_block_ids=((9,),), skipped_block_ids=(5, 4))


def _case(bad: ScheduledRequest):
    return lambda: (state_of(), StepPlan(scheduled=(bad,)), StepPlan(scheduled=(GOOD,)), CONFIG)


GROUP_RULE_CASES = {
    # block 6 is at index 2: the token at position 8 still attends it (only indices 0 and 1 are past)
    "window-keeps-visible": _case(ScheduledRequest("a", 8, 1, (8,), group_new_block_ids=((9,),),
                                                   skipped_block_ids=(6, 5, 4))),
    # block 4 (index 0) is past the window but kept
    "window-frees-skipped": _case(ScheduledRequest("a", 8, 1, (8,), group_new_block_ids=((9,),), skipped_block_ids=(5,))),
    # the window group's table stays at 4 blocks: 8 slots for 9 tokens
    "group-table-covers": _case(ScheduledRequest("a", 8, 1, (8,), skipped_block_ids=(5, 4))),
    # 6 blocks in the window group for a sequence of 9 tokens (5 blocks)
    "group-no-excess-blocks": _case(ScheduledRequest("a", 8, 1, (8,), group_new_block_ids=((9, 10),),
                                                     skipped_block_ids=(5, 4))),
}
"""The rules of KV cache groups, as tests/test_rules.py's cases: (state, bad plan, good twin, config)."""


def case_window_sees_held():
    # after the window freed indices 0 and 1, index 2 (block 6) is still seen by the token at position 8
    good = state_of(running_a((NULL_BLOCK, NULL_BLOCK, 6, 7)), free=(4, 5, 8, 9, 10, 11))
    bad = state_of(running_a((NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 7)), free=(4, 5, 6, 8, 9, 10, 11))
    return bad, good, CONFIG, CONFIG


GROUP_STATE_CASES = {"window-sees-held": case_window_sees_held}
"""The state invariants of KV cache groups, as tests/test_invariants.py's cases: (bad, good, configs)."""


def test_the_good_plan_is_allowed_and_frees_the_window_blocks_to_the_front() -> None:
    assert violated_rules(state_of(), StepPlan(scheduled=(GOOD,)), CONFIG) == []
    after = apply_plan(state_of(), StepPlan(scheduled=(GOOD,)), {"a": 30}, CONFIG).state
    a = after.requests["a"]
    assert a.block_ids == (0, 1, 2, 3, 8)
    assert a.group_block_ids == ((NULL_BLOCK, NULL_BLOCK, 6, 7, 9),)
    assert after.free_block_ids == (5, 4, 10, 11)  # the window's frees at the front, highest index first
    assert check_state(after, CONFIG) == []


def test_a_window_block_freed_by_an_item_may_be_handed_out_by_it_but_not_before() -> None:
    reuse = ScheduledRequest("a", 8, 1, (8,), group_new_block_ids=((5,),), skipped_block_ids=(5, 4))
    assert violated_rules(state_of(), StepPlan(scheduled=(reuse,)), CONFIG) == []
    after = apply_plan(state_of(), StepPlan(scheduled=(reuse,)), {"a": 30}, CONFIG).state
    assert after.requests["a"].group_block_ids == ((NULL_BLOCK, NULL_BLOCK, 6, 7, 5),)
    assert check_state(after, CONFIG) == []
    # a block the window has not freed (6, still held) is not free
    taken = ScheduledRequest("a", 8, 1, (8,), group_new_block_ids=((6,),), skipped_block_ids=(5, 4))
    assert "blocks-from-free-pool" in {v.name for v in violated_rules(state_of(), StepPlan(scheduled=(taken,)), CONFIG)}


@pytest.mark.parametrize("name", sorted(GROUP_RULE_CASES))
def test_group_rule_cases_fail_on_the_bad_plan_only(name: str) -> None:
    state, bad, good, config = GROUP_RULE_CASES[name]()
    assert name in {v.name for v in violated_rules(state, bad, config)}
    assert violated_rules(state, good, config) == []


def test_the_group_rules_find_nothing_without_groups() -> None:
    single = CONFIG.with_changes(kv_cache_groups=())
    a = running_a()
    plain = state_of(Request("a", 0, a.prompt_token_ids, max_tokens=4, status=RequestStatus.RUNNING,
                             num_computed_tokens=8, output_token_ids=(21,), block_ids=(0, 1, 2, 3)),
                     free=tuple(range(4, 12)))
    found = violated_rules(plain, StepPlan(scheduled=(ScheduledRequest("a", 8, 1, (4,)),)), single)
    assert found == []
    assert set(GROUP_RULES) <= {r for r in GROUP_RULE_CASES}


def test_conservation_counts_every_group_of_the_one_pool() -> None:
    # block 7 is in the window table and in the free queue: both free and owned
    doubled = state_of(free=(7, 8, 9, 10, 11)[1:] + (7,))
    codes = {v.name for v in check_state(doubled, CONFIG)}
    assert "block-conservation" in codes
    # a window block neither held nor free (leaked): the pool no longer adds up
    leaked = state_of(running_a((NULL_BLOCK, NULL_BLOCK, 6, 7)), free=(5, 8, 9, 10, 11))
    assert "block-conservation" in {v.name for v in check_state(leaked, CONFIG)}
    # a window table that holds fewer slots than the computed tokens
    short = state_of(running_a((4, 5, 6)), free=(7, 8, 9, 10, 11))
    assert "table-covers-computed" in {v.name for v in check_state(short, CONFIG)}


def test_a_preempted_request_releases_every_group_last_group_in_front() -> None:
    a = running_a((NULL_BLOCK, NULL_BLOCK, 6, 7))
    assert release_order(a) == (7, 6, 3, 2, 1, 0)
    after = apply_plan(state_of(a, free=(4, 5, 8, 9, 10, 11)), StepPlan(preempted=("a",)), {}, CONFIG).state
    assert after.free_block_ids[:6] == (7, 6, 3, 2, 1, 0)
    assert after.requests["a"].group_block_ids == () and check_state(after, CONFIG) == []


# ---- the config


def test_groups_default_to_one_full_attention_group_left_out_of_the_dict() -> None:
    plain = SchedulerConfig(block_size=2, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32)
    assert plain.kv_cache_groups == () and "kv_cache_groups" not in plain.to_dict()
    assert CONFIG.to_dict()["kv_cache_groups"] == list(GROUPS)
    assert SchedulerConfig.from_dict(CONFIG.to_dict()) == CONFIG


@pytest.mark.parametrize("groups, field", [
    ([{"kind": "sliding_window", "sliding_window": 4}], "kv_cache_groups"),  # group 0 must be full attention
    ([{"kind": "full_attention"}, {"kind": "sliding_window"}], "kv_cache_groups[].sliding_window"),
    ([{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 0}], "kv_cache_groups[].sliding_window"),
    ([{"kind": "full_attention", "sliding_window": 4}], "kv_cache_groups[].sliding_window"),
    ([{"kind": "mamba"}], "kv_cache_groups[].kind"),
    ([{"kind": "full_attention", "block_size": 4}], "kv_cache_groups[]"),
    ("full_attention", "kv_cache_groups"),
])
def test_bad_groups_are_refused_naming_the_field(groups, field) -> None:
    with pytest.raises(ConfigError) as error:
        CONFIG.with_changes(kv_cache_groups=groups)
    assert error.value.field == field


@pytest.mark.parametrize("changes", [{"enable_prefix_caching": True}, {"num_speculative_tokens": 2}])
def test_groups_with_prefix_caching_or_speculative_decoding_are_valid_configs(changes) -> None:
    """Not a bad config (exit 2): prefix caching with groups is specified (tests/test_prefix_groups.py), and
    speculative decoding with groups is refused where it runs, as a feature the scheduler lacks (exit 3)."""
    assert CONFIG.with_changes(**changes).kv_cache_groups == CONFIG.kv_cache_groups


# ---- admission


def brute_force_peak(tokens: int, prompt_len: int, config: SchedulerConfig) -> int:
    """The peak of the one-token-a-step schedule, every step evaluated (the first one whole without chunked
    prefill), written out without the module's helpers."""
    size = config.block_size
    steps = [(c, c + 1) for c in range(tokens)]
    if not config.enable_chunked_prefill:
        steps = [(0, min(prompt_len, tokens))] + [(c, c + 1) for c in range(min(prompt_len, tokens), tokens)]
    peak = 0
    for start, end in steps:
        held = 0
        for group in config.kv_cache_groups:
            table = -(-end // size)
            gone = 0 if group.sliding_window is None else max(0, start - group.sliding_window + 1) // size
            held += table - min(gone, table)
        peak = max(peak, held)
    return peak


def test_the_peak_is_the_brute_force_peak() -> None:
    rng = random.Random(3)
    for _ in range(300):
        windows = [rng.randrange(1, 40) for _ in range(rng.randrange(0, 3))]
        config = SchedulerConfig(
            block_size=rng.choice([1, 2, 3, 4, 16]), num_kv_blocks=100, max_num_batched_tokens=128, max_num_seqs=4,
            max_model_len=128, enable_chunked_prefill=rng.random() < 0.7,
            kv_cache_groups=[{"kind": "full_attention"}] * rng.randrange(1, 3)
            + [{"kind": "sliding_window", "sliding_window": w} for w in windows])
        tokens = rng.randrange(1, 128)
        prompt_len = rng.randrange(1, tokens + 1)
        assert min_peak_blocks(tokens, prompt_len, config) == brute_force_peak(tokens, prompt_len, config), config


def test_admission_counts_every_group_and_only_the_window_of_a_window_group() -> None:
    # 18 tokens of KV (prompt 14, 5 outputs, the last not fed back): 9 full-attention blocks; the window holds at
    # most 3 (at position 16: 17 tokens, 9 blocks, the first (16 - 3) // 2 = 6 freed); 12 blocks are enough, and
    # would not be for two full-attention groups (18 blocks)
    assert rejection_reason(14, 5, CONFIG) is None
    assert min_peak_blocks(18, 14, CONFIG) == 12
    assert rejection_reason(14, 5, CONFIG.with_changes(kv_cache_groups=[{"kind": "full_attention"}] * 2)) is not None
    # 24 tokens: 12 full-attention blocks fit the pool alone, but not with the window's
    reason = rejection_reason(16, 9, CONFIG)
    assert reason is not None and reason.startswith("exceeds-kv-cache") and "2 KV cache groups" in reason
    assert rejection_reason(16, 9, CONFIG.with_changes(kv_cache_groups=())) is None


def test_skipped_blocks_follow_vllm_get_num_skipped_tokens() -> None:
    window = KVCacheGroup("sliding_window", 4)
    # vLLM's docstring example: sliding_window=4, num_computed_tokens=7 skips tokens 0..3 (4 tokens)
    assert num_skipped_blocks(window, 7, 1) == 4 and num_skipped_blocks(window, 7, 2) == 2
    assert num_skipped_blocks(window, 3, 1) == 0 and num_skipped_blocks(KVCacheGroup("full_attention"), 99, 1) == 0


# ---- the references, the trace and its mutations


def _workload(rng: random.Random) -> list[RequestSpec]:
    return [RequestSpec(f"r{i}", rng.randint(1, 40), rng.randint(1, 12), arrival_step=rng.randint(0, 6),
                        abort_at_step=9 if i == 3 else None) for i in range(8)]


@pytest.mark.parametrize("name", ["fcfs", "static", "shortest-prompt-first", "vllm-v1"])
def test_the_references_allocate_per_group_within_the_spec(name: str) -> None:
    rng = random.Random(name)
    windows = 0
    for _ in range(8):
        chunked = rng.random() < 0.8
        groups = [*GROUPS, *([{"kind": "sliding_window", "sliding_window": 5}] if rng.random() < 0.4 else [])]
        config = SchedulerConfig(block_size=2, num_kv_blocks=rng.randint(26, 60),
                                 max_num_batched_tokens=rng.choice([16, 48]) if chunked else 48, max_num_seqs=4,
                                 max_model_len=48, enable_chunked_prefill=chunked, kv_cache_groups=groups)
        if name == "vllm-v1":  # vLLM's start-up check sizes the pool for a max_model_len request (docs/engines.md)
            config = config.with_changes(num_kv_blocks=24 * len(groups))
        result = Engine(make_scheduler(name, config), config).run(_workload(rng))
        assert result.ok, [str(v) for v in result.violations[:3]]
        windows += sum(1 for r in result.records if r.blocks_skipped)
    assert windows  # the windows freed blocks


def test_schedulers_without_groups_are_refused() -> None:
    with pytest.raises(UnsupportedFeature, match="KV cache groups"):
        Engine(make_scheduler("priority", CONFIG), CONFIG).run([RequestSpec("r", 4, 2, arrival_step=0)])


@pytest.fixture(scope="module")
def trace() -> Trace:
    return hybrid_trace()[1]


def test_a_hybrid_trace_is_version_4_and_passes_the_check(trace: Trace, tmp_path) -> None:
    assert trace.header["schema_version"] == 4 and trace.header["config"]["kv_cache_groups"]
    assert any(r.get("blocks_skipped") for r in trace.records) and any(r["preempted"] for r in trace.records)
    assert any(code.startswith("exceeds-kv-cache") for r in trace.records for code in r["rejected"].values())
    # prefix caching on: hits across the groups, some past a window (a spec that published a group's blocks only
    # when the record named blocks for it failed here: the engine's plan and the record's differed)
    hits = [t for r in trace.records for tables in r.get("group_prefix_hit_blocks", {}).values() for t in tables]
    assert hits and any(NULL_BLOCK in t for t in hits)
    assert judge(trace.header, trace.records) == (None, None)
    path = tmp_path / "hybrid.jsonl"
    out = io.StringIO()
    from schedspec.spec.trace import StepRecord
    write_trace(out, trace.config, [StepRecord.from_dict(r) for r in trace.records], "fcfs")
    path.write_text(out.getvalue())
    opened = open_trace(path)
    assert opened.schema_version == 4
    assert check_trace(opened.config, opened.records()).ok


def test_version_3_cannot_carry_the_group_fields(trace: Trace) -> None:
    record = next(r for r in trace.records if r.get("blocks_skipped"))
    assert record_schema_errors(record, 4) is None
    assert "blocks_skipped" in (record_schema_errors(record, 3) or "")


def test_a_group_config_needs_version_4(trace: Trace, tmp_path) -> None:
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({**trace.header, "schema_version": 2}) + "\n")
    from schedspec.spec.trace import TraceFormatError
    with pytest.raises(TraceFormatError, match="kv_cache_groups"):
        open_trace(path)


@pytest.mark.parametrize("mutation, rule", [
    (group_hit_not_held, "prefix-hit-is-cached-chain"),
    (window_frees_visible_block, "window-keeps-visible"),
    (window_keeps_skipped_block, "window-frees-skipped"),
    (group_table_short, "group-table-covers"),
    (group_extra_block, "group-no-excess-blocks"),
])
def test_the_window_mutants_are_caught_at_their_step_by_their_rule(trace: Trace, mutation, rule) -> None:
    from schedspec.spec.trace import StepRecord
    steps = [i for i in range(len(trace.records)) if mutation(trace, i) is not None]
    assert steps
    for i in steps[:: max(len(steps) // 5, 1)]:
        header, records, observable = mutation(trace, i)
        report = check_trace(trace.config, [StepRecord.from_dict(r) for r in records])
        assert report.first_bad_step == observable == i
        assert rule in {v.name for v in report.violations}


def test_the_profile_releases_every_group_of_a_victim() -> None:
    """``schedspec diff --scheduler vllm --against vllm-v1`` (seed 0, example 26), shrunk: at step 8 r3's decode
    needs a block in each group and none is free; preempting r5 frees one block in each group, enough, so vLLM
    preempts only r5 (and r4's decode, whose window frees a block, goes on). A profile that released only a
    victim's group-0 blocks preempted r4 as well."""
    config = SchedulerConfig(block_size=8, num_kv_blocks=11, max_num_batched_tokens=10, max_num_seqs=3, max_model_len=56,
                             kv_cache_groups=[{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 8}])
    workload = [RequestSpec("r4", 25, 2, arrival_step=5), RequestSpec("r3", 1, 9, arrival_step=0),
                RequestSpec("r5", 1, 2, arrival_step=5)]
    result = Engine(make_scheduler("vllm-v1", config), config).run(workload, max_steps=9)
    step = result.records[8]
    assert step.preempted == ("r5",)
    assert [(s.request_id, s.num_tokens) for s in step.scheduled] == [("r3", 1), ("r4", 1)]
    assert step.blocks_skipped == {"r4": (5,)}


def test_the_watermark_counts_every_groups_blocks_and_the_windows_frees() -> None:
    """vLLM's watermark check is against the shared pool (``KVCacheManager.allocate_slots``: the coordinator's
    ``get_num_blocks_to_allocate`` sums every group's blocks, ``BlockPool.get_num_free_blocks`` after
    ``remove_skipped_blocks``). 16 blocks, watermark int(0.3 * 17) = 5, 8 free; ``a``'s decode takes one block
    per group and its window frees 2 (the pool stays at 8); admitting ``b`` with a 4-token prompt takes 2 blocks per
    group: 4 left < 5. Counting group 0 alone (main's rule) left 5: a false pass."""
    config = CONFIG.with_changes(num_kv_blocks=16, watermark=0.3)
    assert config.watermark_blocks == 5
    state = state_of(free=tuple(range(8, 16)))
    state = SchedulerState(step=1, running=("a",), requests={**state.requests, "b": Request("b", 1, (1, 2, 3, 4),
                                                                                          max_tokens=2)},
                           waiting=("b",), free_block_ids=state.free_block_ids, num_requests_added=2)

    def admit(prompt_blocks: tuple[int, ...], window_blocks: tuple[int, ...], tokens: int):
        b = ScheduledRequest("b", 0, tokens, prompt_blocks, group_new_block_ids=(window_blocks,))
        return [(v.name, v.request_id) for v in violated_rules(state, StepPlan(scheduled=(GOOD, b)), config)]

    assert admit((10, 11), (12, 13), 4) == [("watermark", "b")]
    assert admit((10,), (11,), 2) == []  # 1 block per group: 6 left


def test_a_windows_free_is_judged_by_the_reference_counts_in_plan_order() -> None:
    """``state.window_releases``, the one definition of what a window's free gives back to the pool (rules
    ``watermark`` and ``blocks-from-free-pool``, property ``work-conserving``), walks the counts in vLLM's order:
    preemptions, then per item its window's frees and then its hits (found in review: ``watermark`` and
    ``work-conserving`` read the counts before the step). (1) ``b``, first in the plan, hits block 5 that only
    ``a``'s window table holds; ``a``'s window then passes 5: 5 stays held (``b`` holds it), nothing is released
    (the counts before the step said released: a false pass of ``watermark``, one block too many). (2) ``p``,
    preempted, shares block 5 with ``a`` (count 2); ``a``'s window passes it: released (the counts before the step
    said held: a false alarm)."""
    from schedspec.spec.prefix_cache import PrefixCache
    from schedspec.spec.state import window_releases

    a = running_a()
    b = Request("b", 1, tuple(range(10, 18)), max_tokens=2)
    cache = PrefixCache(block_hashes={5: "h5"}, hash_to_blocks={"h5": (5,)},
                        ref_counts={b_id: 1 for b_id in (0, 1, 2, 3, 4, 5, 6, 7)})
    state = SchedulerState(step=1, running=("a",), requests={"a": a, "b": b}, waiting=("b",),
                           free_block_ids=(8, 9, 10, 11), num_requests_added=2, prefix_cache=cache)
    hit_first = StepPlan(scheduled=(ScheduledRequest("b", 0, 2, (9,), group_cached_block_ids=((5,),)),
                                    ScheduledRequest("a", 8, 1, (8,), skipped_block_ids=(5,))))
    assert window_releases(state, hit_first) == (frozenset(), frozenset())
    alone = StepPlan(scheduled=(ScheduledRequest("a", 8, 1, (8,), skipped_block_ids=(5,)),))
    assert window_releases(state, alone) == (frozenset({5}),)

    p = Request("p", 0, (1, 2), max_tokens=2, status=RequestStatus.RUNNING, num_computed_tokens=2,
                output_token_ids=(3,), block_ids=(10,), group_block_ids=((5,),), admitted_step=0, first_token_step=0)
    shared = attrs.evolve(cache, ref_counts={**cache.ref_counts, 5: 2, 10: 1})
    state = SchedulerState(step=1, running=("a", "p"), requests={"a": a, "p": p}, free_block_ids=(8, 9, 11),
                           num_requests_added=2, prefix_cache=shared)
    preempt = StepPlan(scheduled=(ScheduledRequest("a", 8, 1, (8,), skipped_block_ids=(5,)),), preempted=("p",))
    assert window_releases(state, preempt) == (frozenset({5}),)
    assert window_releases(state, attrs.evolve(preempt, preempted=())) == (frozenset(),)
