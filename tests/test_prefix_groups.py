"""Prefix caching with hybrid KV cache groups (:mod:`schedspec.spec.kv_cache_groups`, issue 27): the hit every
group holds, as vLLM's coordinator finds it; the rules and invariants that judge it, each with a plan or state
that breaks it; the references that follow it; the combinations still refused (exit 3).

The hand-made run: block size 2, a full-attention group and a sliding window of 4 tokens, prefix caching on, 16
blocks. Step 0 computes request ``a``'s 8-token prompt (group 0 blocks 0..3, the window's 4..7), which publishes
them. At step 1 request ``b`` (the same 8 tokens and 2 more) is admitted: at most ``(10 - 1) // 2 = 4`` blocks
may hit; group 0 holds all 4; the window, at 8 computed tokens, needs only blocks 2 and 3 (``(8 - 4 + 1) // 2 = 2``
are past it), so its hit table is ``(NULL, NULL, 6, 7)``.
"""

from __future__ import annotations

import json
import random

import attrs
import pytest
from click.testing import CliRunner

from schedspec.cli import cli as main
from schedspec.reference.engine import Engine, UnsupportedFeature
from schedspec.reference.scheduler import make_scheduler
from schedspec.reference.vllm_v1 import startup_blocks
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.fast_check import fast_check
from schedspec.spec.invariants import check_state
from schedspec.spec.kv_cache_groups import NULL_BLOCK, group_cache_key, longest_group_hit
from schedspec.spec.prefix_cache import ROOT_HASH, PrefixCache, request_block_hash
from schedspec.spec.request import Request
from schedspec.spec.rules import violated_rules
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.trace import open_trace, write_trace
from schedspec.spec.transitions import add_request, apply_plan
from schedspec.spec.workload import RequestSpec

GROUPS = ({"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 4})
CONFIG = SchedulerConfig(block_size=2, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32,
                         kv_cache_groups=GROUPS, enable_prefix_caching=True)
PROMPT = tuple(range(10, 18))


def after_a() -> SchedulerState:
    """The state after step 0 (``a`` computed its prompt and sampled token 21), with ``b`` arrived."""
    state = SchedulerState.initial(CONFIG)
    state = add_request(state, Request("a", 0, PROMPT, max_tokens=4))
    plan = StepPlan(scheduled=(ScheduledRequest("a", 0, 8, (0, 1, 2, 3), group_new_block_ids=((4, 5, 6, 7),)),))
    assert violated_rules(state, plan, CONFIG) == []
    state = apply_plan(state, plan, {"a": 21}, CONFIG).state
    return add_request(state, Request("b", 1, PROMPT + (30, 31), max_tokens=2))


def admit_b(hit0=(0, 1, 2, 3), hit1=(NULL_BLOCK, NULL_BLOCK, 6, 7), num_tokens=2) -> StepPlan:
    """Step 1: ``a`` decodes (its window frees blocks 4 and 5 first, cached: to the back of the queue) and ``b``
    is admitted with a hit."""
    computed = len(hit0) * CONFIG.block_size
    needed = -(-(computed + num_tokens) // CONFIG.block_size) - len(hit0)
    return StepPlan(scheduled=(
        ScheduledRequest("a", 8, 1, (8,), group_new_block_ids=((9,),), skipped_block_ids=(5, 4)),
        ScheduledRequest("b", computed, num_tokens, tuple(range(10, 10 + needed)), hit0,
                         group_new_block_ids=(tuple(range(12, 12 + needed)),), group_cached_block_ids=(hit1,)),
    ))


def rules_broken(state: SchedulerState, plan: StepPlan) -> set[str]:
    return {v.name for v in violated_rules(state, plan, CONFIG)}


# ---- the hit as vLLM's coordinator computes it


def test_the_good_hit_is_allowed_and_shares_the_blocks() -> None:
    state = after_a()
    assert longest_group_hit(state.prefix_cache, state.requests["b"], CONFIG) == ((0, 1, 2, 3), (-1, -1, 6, 7))
    plan = admit_b()
    assert rules_broken(state, plan) == set()
    after = apply_plan(state, plan, {"a": 22, "b": 40}, CONFIG).state
    assert check_state(after, CONFIG) == []
    assert after.requests["b"].group_block_ids == ((NULL_BLOCK, NULL_BLOCK, 6, 7, 12),)
    assert after.prefix_cache.ref_counts[6] == 2 and after.prefix_cache.ref_counts[0] == 2
    # the window's frees were cached: they stay cached, at the back of the free queue, under group 1's keys
    assert after.free_block_ids[-2:] == (5, 4)
    key = group_cache_key(request_block_hash(after.requests["a"], 0, ROOT_HASH, 2), 1)
    assert after.prefix_cache.block_hashes[4] == key and key.endswith("@1")


@pytest.mark.parametrize("hit0, hit1, rule", [
    # the window's block 3 not held (block 5 caches block 1 of the prompt): no hit of 4 blocks
    ((0, 1, 2, 3), (NULL_BLOCK, NULL_BLOCK, 6, 5), "prefix-hit-is-cached-chain"),
    # group 1 naming group 0's block of the same tokens (another group's key)
    ((0, 1, 2, 3), (NULL_BLOCK, NULL_BLOCK, 2, 7), "prefix-hit-is-cached-chain"),
    # a block the window no longer needs named instead of the null block
    ((0, 1, 2, 3), (4, NULL_BLOCK, 6, 7), "prefix-hit-is-cached-chain"),
    # the tables of two lengths
    ((0, 1, 2, 3), (NULL_BLOCK, 6, 7), "prefix-hit-is-cached-chain"),
    # shorter than the longest hit every group holds
    ((0, 1, 2), (NULL_BLOCK, 5, 6), "prefix-hit-longest"),
    # group 0's hit alone, the window's left empty
    ((0, 1, 2, 3), (), "prefix-hit-is-cached-chain"),
])
def test_a_hit_not_every_group_holds_is_refused(hit0, hit1, rule) -> None:
    plan = admit_b(hit0, hit1) if hit1 else attrs.evolve(admit_b(), scheduled=(
        admit_b().scheduled[0], attrs.evolve(admit_b().scheduled[1], group_cached_block_ids=())))
    assert rule in rules_broken(after_a(), plan)


def test_a_hit_longer_than_the_window_holds_is_refused() -> None:
    """The window's blocks 2 and 3 evicted (handed out to ``a``'s decode): group 0 still holds 4 blocks, but the
    longest length every group holds is 1 block (the window needs only block 0 at 2 tokens; at 4, 6 and 8 it
    needs blocks 0..1, 1..2, 2..3)."""
    state = after_a()
    cache = state.prefix_cache
    keys = {b: k for b, k in cache.block_hashes.items() if b not in (6, 7)}
    listed = {k: tuple(b for b in blocks if b not in (6, 7)) for k, blocks in cache.hash_to_blocks.items()}
    evicted = PrefixCache(keys, {k: v for k, v in listed.items() if v}, cache.ref_counts)
    assert longest_group_hit(evicted, state.requests["b"], CONFIG) == ((0, 1), (4, 5))
    assert longest_group_hit(evicted, state.requests["b"], CONFIG.with_changes(kv_cache_groups=GROUPS[:1]))[0] \
        == (0, 1, 2, 3)


def test_a_window_free_of_a_shared_block_frees_nothing() -> None:
    """After step 1, ``b`` shares blocks 6 and 7 of the window; at step 2 ``a``'s window passes block 6
    (``(9 - 4 + 1) // 2 = 3``): the free drops its count to 1, so handing it out breaks ``blocks-from-free-pool``,
    and the state keeps it held (out of the free queue)."""
    state = apply_plan(after_a(), admit_b(), {"a": 22, "b": 40}, CONFIG).state
    free = state.free_block_ids
    good = StepPlan(scheduled=(ScheduledRequest("a", 9, 1, (), skipped_block_ids=(6,)),))
    assert rules_broken(state, good) == set()
    after = apply_plan(state, good, {"a": 23}, CONFIG).state
    assert 6 not in after.free_block_ids and after.prefix_cache.ref_counts[6] == 1 and check_state(after, CONFIG) == []
    assert len(after.free_block_ids) == len(free)
    bad = StepPlan(scheduled=(ScheduledRequest("a", 9, 1, (6,), group_new_block_ids=((),), skipped_block_ids=(6,)),))
    assert "blocks-from-free-pool" in rules_broken(state, bad)


def test_a_reference_count_that_misses_a_group_table_is_caught() -> None:
    """``prefix-ref-counts`` counts every group's table: a cache that forgets ``b``'s reference to window block 6
    is a breach (the invariant of the issue: nothing freed that a window still sees, cached blocks included)."""
    state = apply_plan(after_a(), admit_b(), {"a": 22, "b": 40}, CONFIG).state
    counts = dict(state.prefix_cache.ref_counts)
    counts[6] = 1
    broken = attrs.evolve(state, prefix_cache=attrs.evolve(state.prefix_cache, ref_counts=counts))
    assert "prefix-ref-counts" in {v.name for v in check_state(broken, CONFIG)}


def test_a_window_block_published_under_group_0s_key_is_caught() -> None:
    state = apply_plan(after_a(), admit_b(), {"a": 22, "b": 40}, CONFIG).state
    hashes = dict(state.prefix_cache.block_hashes)
    hashes[6] = hashes[2]  # group 0's key for the same tokens
    by_hash = {k: tuple(b for b in v if b != 6) for k, v in state.prefix_cache.hash_to_blocks.items()}
    by_hash[hashes[2]] = by_hash[hashes[2]] + (6,)
    broken = attrs.evolve(state, prefix_cache=PrefixCache(hashes, {k: v for k, v in by_hash.items() if v},
                                                          state.prefix_cache.ref_counts))
    assert "prefix-published-computed" in {v.name for v in check_state(broken, CONFIG)}


def _vllm_hit(present: list[list[bool]], windows: list[int | None], block_size: int,
              max_cache_hit_length: int) -> tuple[int, list[list[bool]]]:
    """vLLM 0.32 ``HybridKVCacheCoordinator.find_longest_cache_hit`` transcribed, on a cache given per group and
    block index as cached or not: groups of one spec searched together, full attention first (its run from the
    start, then trimmed), each sliding window searched from the right for ``cdiv(w - 1, block_size)`` contiguous
    cached blocks within the current length, repeated until no spec shortens it (one pass for one full-attention
    spec and one other); then ``add_local_computed_blocks``'s nulls. Returns the hit length in blocks and, per
    group, which table entries are real blocks (not null)."""
    specs: list[tuple[int | None, list[int]]] = []
    for g, window in enumerate(windows):
        for spec in specs:
            if spec[0] == window:
                spec[1].append(g)
                break
        else:
            specs.append((window, [g]))
    specs.sort(key=lambda spec: spec[0] is not None)
    simple = len(specs) == 2 and specs[0][0] is None
    hit_length = max_cache_hit_length
    full_length: int | None = None
    while True:
        current = hit_length
        for window, ids in specs:
            if window is None and full_length is not None:
                current = min(current, full_length)
                continue
            limit = current // block_size
            if window is None:
                n = 0
                while n < limit and all(present[g][n] for g in ids):
                    n += 1
                full_length = n * block_size
                current = full_length
                continue
            need = -(-(window - 1) // block_size)
            run, found = 0, None
            for i in range(limit - 1, -1, -1):
                if all(present[g][i] for g in ids):
                    run += 1
                    if run >= need:
                        found = i + run
                        break
                else:
                    run = 0
            current = (found if found is not None else run) * block_size
        if current >= hit_length:
            break
        hit_length = current
        if simple:
            break
    blocks = hit_length // block_size
    tables = []
    for window in windows:
        skipped = 0 if window is None else max(0, blocks * block_size - window + 1) // block_size
        tables.append([i >= skipped for i in range(blocks)])
    return blocks, tables


def test_the_hit_is_vllms_fixed_point_on_random_caches() -> None:
    """:func:`longest_group_hit` against the transcription of vLLM's coordinator (:func:`_vllm_hit`), over random
    group layouts (windows repeated, so that groups of one spec are searched together) and random caches."""
    rng = random.Random(27)
    checked = hits = 0
    for _ in range(400):
        size = rng.choice([1, 2, 3])
        windows: list[int | None] = [None] + [rng.choice([2, 3, 4, 5, 7, 9]) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.3:
            windows.insert(rng.randint(1, len(windows)), None)  # a second full-attention group
        config = SchedulerConfig(block_size=size, num_kv_blocks=400, max_num_batched_tokens=64, max_num_seqs=2,
                                 max_model_len=128, enable_prefix_caching=True,
                                 kv_cache_groups=[{"kind": "full_attention"} if w is None else
                                                  {"kind": "sliding_window", "sliding_window": w} for w in windows])
        prompt = tuple(rng.randint(1, 50) for _ in range(rng.randint(1, 30)))
        request = Request("r", 0, prompt, max_tokens=1)
        blocks = (len(prompt) - 1) // size
        density = rng.random()
        present = [[rng.random() < density for _ in range(blocks)] for _ in windows]
        keys: dict[int, str] = {}
        parent, next_id = ROOT_HASH, 0
        for index in range(blocks):
            parent = request_block_hash(request, index, parent, size)
            for g in range(len(windows)):
                if present[g][index]:
                    keys[next_id] = group_cache_key(parent, g)
                    next_id += 1
        cache = PrefixCache(keys, {k: (b,) for b, k in keys.items()}, {})
        expected_blocks, expected_real = _vllm_hit(present, windows, size, len(prompt) - 1)
        tables = longest_group_hit(cache, request, config)
        assert [len(t) for t in tables] == [expected_blocks] * len(windows)
        assert [[b != NULL_BLOCK for b in t] for t in tables] == expected_real
        checked += 1
        hits += expected_blocks > 0
    assert checked == 400 and hits > 50


# ---- the references


@pytest.mark.parametrize("name", ["fcfs", "vllm-v1"])
def test_the_references_hit_across_groups_within_the_spec(name: str) -> None:
    rng = random.Random(name)
    hits = nulls = 0
    for _ in range(6):
        windows = [rng.choice([3, 4, 8]) for _ in range(rng.randint(1, 2))]
        config = SchedulerConfig(block_size=2, num_kv_blocks=rng.randint(20, 40), max_num_batched_tokens=rng.choice([4, 16]),
                                 max_num_seqs=3, max_model_len=32, enable_prefix_caching=True,
                                 kv_cache_groups=[{"kind": "full_attention"}] + [
                                     {"kind": "sliding_window", "sliding_window": w} for w in windows])
        config = config.with_changes(num_kv_blocks=max(config.num_kv_blocks, startup_blocks(config)))
        workload = [RequestSpec(f"r{i}", rng.randint(2, 20), rng.randint(1, 6), arrival_step=rng.randint(0, 8),
                                prefix_group=rng.choice("ab"), prefix_len=rng.randint(0, 16)) for i in range(7)]
        result = Engine(make_scheduler(name, config), config).run(workload)
        assert result.ok, [str(v) for v in result.violations[:3]]
        tables = [t for r in result.records for group in r.group_prefix_hit_blocks.values() for t in group]
        hits += len(tables)
        nulls += sum(NULL_BLOCK in t for t in tables)
    assert hits and nulls  # hits across groups happened, some past a window


# ---- what is still refused: a feature the scheduler lacks, exit 3


SPECULATIVE = CONFIG.with_changes(enable_prefix_caching=False, num_speculative_tokens=2)


def test_groups_with_speculative_decoding_are_a_missing_feature_not_a_bad_config() -> None:
    with pytest.raises(UnsupportedFeature, match="speculative decoding"):
        Engine(make_scheduler("fcfs", SPECULATIVE), SPECULATIVE).run([RequestSpec("r", 4, 2, arrival_step=0)])


def test_remote_kv_with_groups_is_a_missing_feature() -> None:
    config = CONFIG.with_changes(enable_prefix_caching=False)
    with pytest.raises(UnsupportedFeature, match="remote KV"):
        Engine(make_scheduler("fcfs", config), config).run(
            [RequestSpec("r", 8, 2, arrival_step=0, num_external_computed_tokens=4)])


def test_check_exits_3_on_a_trace_of_groups_with_speculative_decoding(tmp_path) -> None:
    path = tmp_path / "spec.jsonl"
    with path.open("w") as out:
        write_trace(out, SPECULATIVE, [], "fcfs")
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exit_code == 3, result.output
    assert "speculative decoding" in result.output and "Traceback" not in result.output


def test_diff_exits_3_on_groups_with_speculative_decoding() -> None:
    result = CliRunner().invoke(main, ["diff", "--scheduler", "fcfs", "--against", "vllm-v1", "--examples", "2",
                                       "--set", "num_speculative_tokens=2",
                                       "--set", "kv_cache_groups=" + json.dumps(list(GROUPS))])
    assert result.exit_code == 3, result.output


# ---- traces


def test_a_trace_carries_the_group_hits_and_the_fast_path_falls_back(tmp_path) -> None:
    """The records carry ``group_prefix_hit_blocks`` (version 4), ``check``'s plain path passes the trace, the
    fast path (which does not model groups) declines it, and a hit entry changed to another block fails it."""
    config = CONFIG.with_changes(num_kv_blocks=40)
    workload = [RequestSpec(f"r{i}", 12, 3, arrival_step=i, prefix_group="p", prefix_len=10) for i in range(4)]
    result = Engine(make_scheduler("fcfs", config), config).run(workload)
    assert result.ok
    path = tmp_path / "hits.jsonl"
    with path.open("w") as out:
        write_trace(out, config, result.records, "fcfs")
    lines = path.read_text().splitlines()
    assert any("group_prefix_hit_blocks" in line for line in lines)
    opened = open_trace(path)
    assert fast_check(opened, ("progress",), False, False) is None
    assert CliRunner().invoke(main, ["check", str(path)]).exit_code == 0
    # a mutant: the window's last hit entry named as the null block
    records = [json.loads(line) for line in lines[1:]]
    index = next(i for i, r in enumerate(records) if r.get("group_prefix_hit_blocks"))
    request_id, tables = next(iter(records[index]["group_prefix_hit_blocks"].items()))
    tables[0][-1] = -1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0]] + [json.dumps(r) for r in records]) + "\n")
    checked = CliRunner().invoke(main, ["check", "--json", str(bad)])
    assert checked.exit_code == 1, checked.output
    assert json.loads(checked.output)["first_bad_step"] == records[index]["step"]


def test_check_exits_3_on_a_trace_of_groups_with_a_remote_kv_load(tmp_path) -> None:
    """A groups trace whose arrival offers a remote KV load: refused as not specified (exit 3), not judged."""
    config = CONFIG.with_changes(enable_prefix_caching=False)
    result = Engine(make_scheduler("fcfs", config), config).run([RequestSpec("r", 4, 2, arrival_step=0)])
    path = tmp_path / "load.jsonl"
    with path.open("w") as out:
        write_trace(out, config, result.records, "fcfs")
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    record["arrivals"][0]["num_external_computed_tokens"] = 2
    path.write_text("\n".join([lines[0], json.dumps(record), *lines[2:]]) + "\n")
    checked = CliRunner().invoke(main, ["check", str(path)])
    assert checked.exit_code == 3, checked.output
    assert "remote KV" in checked.output


def test_work_conserving_counts_a_hit_on_blocks_a_window_freed_in_the_step() -> None:
    """``schedspec diff --scheduler vllm --against vllm-v1 --seed 1 --set block_size=2`` (groups of 8 and 5, prefix
    caching), example 30: at step 12 r6's window frees 11 blocks and r3's hit takes 4 of them back; the property
    counted those 4 free and called the head r7 admissible (a false alarm of ``work-conserving``)."""
    config = SchedulerConfig(block_size=2, num_kv_blocks=30, max_num_batched_tokens=20, max_num_seqs=7,
                             max_model_len=20, enable_chunked_prefill=False, enable_prefix_caching=True,
                             kv_cache_groups=[{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 8},
                                              {"kind": "sliding_window", "sliding_window": 5}])
    workload = [RequestSpec("r3", 7, 11, arrival_step=7, priority=2, prefix_group="b", prefix_len=4),
                RequestSpec("r4", 10, 10, arrival_step=3, abort_at_step=7),
                RequestSpec("r0", 10, 19, arrival_step=3, priority=2, eos_at_output=4, prefix_group="b", prefix_len=4),
                RequestSpec("r6", 17, 12, arrival_step=5, eos_at_output=4, prefix_group="b", prefix_len=14),
                RequestSpec("r2", 16, 16, arrival_step=4, eos_at_output=3),
                RequestSpec("r7", 3, 2, arrival_step=7),
                RequestSpec("r5", 7, 17, arrival_step=7, prefix_group="b", prefix_len=5),
                RequestSpec("r1", 19, 18, arrival_step=3, priority=2)]
    result = Engine(make_scheduler("vllm-v1", config), config).run(workload)
    assert result.ok, [str(v) for v in result.violations[:3]]
    step = result.records[12]
    reused = {b for tables in step.group_prefix_hit_blocks.values() for t in tables for b in t} \
        & {b for blocks in step.blocks_skipped.values() for b in blocks}
    assert reused  # the case above: a hit on blocks a window freed in the same step
