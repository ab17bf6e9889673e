"""Speculative decoding in the backend: greedy verification of ``1 + d`` tokens in one forward pass.

**The differential test.** With greedy sampling, the tokens a request gets with speculative decoding
equal the tokens it gets without it, whatever the drafts: all right, all wrong, right up to a point,
past the end of the request, an EOS among them. Each workload runs twice with the same driver
(:func:`drive`: the built-in tiny model, fp32, debug mode, every live request every step, blocks from
the free queue, preemption when the cache runs out and at random, chunked prefill, prefix hits): once
without drafts (the baseline, which also gives the true greedy continuation and its top-2 margins), then
with a drafter that proposes from that continuation with seeded errors. Every finished request's outputs
must be equal. As in ``tests/test_backend_differential.py``, a mismatch is excused only where the
baseline's top-2 margin at the first differing output is below :data:`EPSILON` (fp32 rounding differs
between a verification chunk and a one-token decode); excused cases are counted and must stay rare.

**Rejected positions are poisoned.** Debug mode writes NaN into the KV slots of every rejected draft
right after the step, and after every step :func:`check_memory` asserts that each live request's slots
are finite exactly below its ``num_computed_tokens``: so a step that reads a rejected position (a
scheduler that kept it computed, a cache that published it) gets NaN logits and the backend raises.
The negative tests at the end show such a fault caught, and a verifier that accepts wrong drafts
failing the differential check.

States are advanced by the spec's own transition (``apply_plan`` with the runner's accepted counts and
the drafter's proposals as its ``SpeculativeOutput``); the plans come from the naive planner of
:mod:`schedspec.gpu_backend.testing` (the reference schedulers' drafting is branch ``specdec-vllm``'s).
Sizes follow ``HYPOTHESIS_PROFILE`` (:data:`WORKLOADS`); ``default`` takes about
20 s on one CPU core.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter

import attrs
import pytest

torch = pytest.importorskip("torch")

from schedspec.gpu_backend import BlockTableError, Runner  # noqa: E402
from schedspec.gpu_backend import runner as runner_module  # noqa: E402
from schedspec.gpu_backend.errors import BackendError  # noqa: E402
from schedspec.gpu_backend.testing import device_for_tests, plan_step, speculative_output, state_with  # noqa: E402
from schedspec.reference.fake_model import greedy_verify  # noqa: E402
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens  # noqa: E402
from schedspec.spec.prefix_cache import CacheUpdate  # noqa: E402
from schedspec.spec.request import Request  # noqa: E402
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan  # noqa: E402
from schedspec.spec.transitions import add_request, apply_plan  # noqa: E402
from schedspec.spec.workload import DEFAULT_VOCAB_SIZE, EOS_TOKEN_ID, RequestSpec, token_ids  # noqa: E402

EPSILON = 1e-4
"""A mismatch is excused only where the baseline's top-2 logit margin (EOS masked) is below this."""

MAX_MODEL_LEN = 48
K = 4
"""``num_speculative_tokens`` of the drafter: each decode carries 0..K drafts."""

BASE = dict(block_size=4, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
            num_speculative_tokens=K)
CONFIGS = {
    # name: (scheduler config, prefill chunk cap, random preemption probability, prefix hits)
    "plain": (SchedulerConfig(num_kv_blocks=96, **BASE), None, 0.0, False),
    "chunked-prefill": (SchedulerConfig(num_kv_blocks=96, **BASE), 5, 0.0, False),
    "preemption": (SchedulerConfig(num_kv_blocks=16, **BASE), 7, 0.15, False),
    "prefix-caching": (SchedulerConfig(num_kv_blocks=40, enable_prefix_caching=True, **BASE), 6, 0.1, True),
}
"""16 blocks of 4 hold one request at ``max_model_len`` plus drafts, so ``drive`` can always make room by
preempting; 40 blocks with prefix caching keep evictable blocks around for hits."""

_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
WORKLOADS = {"default": 4, "ci": 6, "nightly": 200}.get(_PROFILE, 4)
"""Workloads per config and profile (seeded, so every run compares the same ones)."""


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def top2_margin(logits: torch.Tensor) -> float:
    """Gap between the two best logits with EOS masked (what greedy sampling compares)."""
    row = logits.detach().float().clone()
    row[EOS_TOKEN_ID] = -math.inf
    best = torch.topk(row, 2).values
    return float(best[0] - best[1])


def workload(rng: random.Random) -> tuple[list[RequestSpec], dict[str, int]]:
    """3..6 requests (prompts 1..30 tokens, 1..16 outputs, some sharing a 8-token prefix, a third with EOS
    at a chosen output) and their ``eos_at_output``."""
    specs, eos = [], {}
    for index in range(rng.randint(3, 6)):
        request_id = f"r{index}"
        prompt = rng.randint(1, 30)
        shared = prompt >= 9 and rng.random() < 0.5
        specs.append(RequestSpec(request_id, prompt, rng.randint(1, 16), prefix_group="p" if shared else None,
                                 prefix_len=8 if shared else 0))
        if rng.random() < 0.3:
            eos[request_id] = rng.randint(1, 12)
    return specs, eos


class Drafter:
    """Proposes up to :data:`K` drafts after each step for every request that sampled and still runs,
    from the true greedy continuation (``truth``), with seeded errors: each proposal is all right, all
    wrong, or right up to a random point; where the continuation has ended it proposes arbitrary ids.
    Trimmed so no draft lies at or past ``max_model_len``. Counts what it proposed in ``stats``."""

    def __init__(self, truth: dict[str, tuple[int, ...]], rng: random.Random, vocab: int, stats: Counter) -> None:
        self.truth, self.rng, self.vocab, self.stats = truth, rng, vocab, stats

    def wrong(self, token: int) -> int:
        return token % (self.vocab - 1) + 1  # != token, never EOS

    def propose(self, after: SchedulerState, sampled) -> dict[str, tuple[int, ...]]:
        drafts = {}
        for request_id in sampled:
            request = after.requests.get(request_id)
            if request is None:
                continue
            d = min(self.rng.randint(0, K), MAX_MODEL_LEN - 1 - request.num_computed_tokens)
            if d <= 0:
                continue
            done = request.num_output_tokens
            true = list(self.truth[request_id][done:done + d])
            true += [self.rng.randrange(1, self.vocab) for _ in range(d - len(true))]
            mode = self.rng.choice(("right", "wrong", "partial"))
            cut = {"right": d, "wrong": 0, "partial": self.rng.randint(1, d)}[mode]
            ids = true[:cut] + [self.wrong(t) for t in true[cut:cut + 1]] + true[cut + 1:]
            drafts[request_id] = tuple(ids[:d])
            self.stats[f"proposals {mode}"] += 1
            if EOS_TOKEN_ID in ids[:cut]:
                self.stats["proposals with EOS among the right drafts"] += 1
        return drafts


def _fits(plan: StepPlan, state: SchedulerState, config: SchedulerConfig) -> bool:
    for item in plan.scheduled:
        request = state.requests[item.request_id]
        have = len(request.block_ids) + len(item.cached_block_ids) + len(item.new_block_ids)
        if blocks_for_tokens(item.num_computed_tokens + item.num_tokens, config.block_size) > have:
            return False
    return True


def check_memory(runner: Runner, state: SchedulerState) -> None:
    """Every live request's KV slots (every layer, keys and values) are finite exactly at the positions
    below its ``num_computed_tokens``: rejected drafts' slots, and anything past them, are NaN."""
    size = runner.config.block_size
    finite = torch.isfinite(runner.kv_cache.key[0]).all(dim=-1).all(dim=-1).cpu()
    for tensor in (*runner.kv_cache.key, *runner.kv_cache.value):
        assert torch.equal(torch.isfinite(tensor).all(dim=-1).all(dim=-1).cpu(), finite)
    for request_id, request in state.requests.items():
        for index, block in enumerate(request.block_ids):
            for offset in range(size):
                position = index * size + offset
                assert bool(finite[block, offset]) == (position < request.num_computed_tokens), (
                    f"step {state.step}: request {request_id!r} position {position} (block {block}) is "
                    f"{'finite' if finite[block, offset] else 'NaN'}; num_computed_tokens="
                    f"{request.num_computed_tokens}")


def apply_speculative(state, plan, sampled, config, runner, drafter):
    """The spec's step with the runner's accepted drafts and, when there is a drafter, its proposals for the
    requests that sampled and still run (found by applying the step once without them)."""
    result = apply_plan(state, plan, sampled, config, speculative_output(runner))
    if drafter is None:
        return result
    drafts = drafter.propose(result.state, result.sampled)
    return apply_plan(state, plan, sampled, config, speculative_output(runner, drafts))


def drive(runner: Runner, config: SchedulerConfig, specs, chunk, preempt_probability: float, prefix_hits: bool,
          rng: random.Random, stats: Counter, drafter: Drafter | None = None, apply=apply_speculative,
          memory_check: bool = True):
    """Run the workload to the end; returns ``(outputs, margins)``: request id -> its output ids, and the
    top-2 margin at each output (baseline runs, ``record_logits="last"``)."""
    runner.reset()
    state = state_with(config, specs)
    margins: dict[str, list[float]] = {s.request_id: [] for s in specs}
    for _ in range(2_000):
        if not state.requests:
            break
        preempted = []
        if state.running and rng.random() < preempt_probability:
            preempted.append(rng.choice(state.running))
        only = [r for r in state.running if r not in preempted] + list(state.waiting)
        while True:
            plan = plan_step(state, config, chunk, only=only, preempt=preempted, prefix_hits=prefix_hits)
            if _fits(plan, state, config):
                break
            waiting = [r for r in only if r in state.waiting]
            if waiting:
                only.remove(waiting[-1])
            else:
                preempted.append(only.pop())
        step_drafts = {item.request_id: item.spec_token_ids for item in plan.scheduled if item.spec_token_ids}
        stats["preemptions"] += len(plan.preempted)
        stats["prefix hits"] += sum(1 for item in plan.scheduled if item.cached_block_ids)
        stats["chunked prefill items"] += sum(
            1 for item in plan.scheduled
            if item.num_computed_tokens + item.num_tokens < state.requests[item.request_id].num_tokens)
        before = runner.num_forward_calls
        sampled, _ = runner.execute(plan, state)
        assert runner.num_forward_calls == before + bool(plan.scheduled)
        for request_id, ids in step_drafts.items():
            accepted = runner.last_num_accepted_tokens[request_id]
            stats["verified items"] += 1
            stats["draft tokens"] += len(ids)
            stats["accepted draft tokens"] += accepted
            stats["items with " + ("all drafts accepted" if accepted == len(ids) else
                                   "no draft accepted" if accepted == 0 else "some drafts accepted")] += 1
        if runner.record_logits != "none":
            for request_id in sampled:
                margins[request_id].append(top2_margin(runner.last_logits[request_id]))
        after = apply(state, plan, sampled, config, runner, drafter).state
        for request_id in step_drafts:
            if request_id in after.finished and request_id not in state.finished:
                kept = after.finished[request_id].num_output_tokens - state.requests[request_id].num_output_tokens
                if kept < 1 + runner.last_num_accepted_tokens[request_id]:
                    stats["stops inside the kept tokens (rest dropped)"] += 1
        state = after
        if memory_check:
            check_memory(runner, state)
    else:
        raise AssertionError("requests still live after 2,000 steps")
    outputs = {r: request.output_token_ids for r, request in state.finished.items()}
    stats["requests ending on EOS"] += sum(1 for ids in outputs.values() if ids and ids[-1] == EOS_TOKEN_ID)
    return outputs, margins


def compare(name: str, seed: int, stats: Counter, mutate=None) -> None:
    """Baseline and speculative runs of workload ``seed`` under config ``name``; asserts equal outputs."""
    config, chunk, preempt_probability, prefix_hits = CONFIGS[name]
    rng = random.Random(f"{name}:{seed}")
    specs, eos = workload(rng)
    baseline_runner = Runner(config, device=device_for_tests(), debug=True, eos_at_output=eos, record_logits="last")
    truth, margins = drive(baseline_runner, config, specs, chunk, preempt_probability, prefix_hits,
                           random.Random(rng.random()), Counter())
    runner = Runner(config, device=device_for_tests(), debug=True, eos_at_output=eos)
    if mutate is not None:
        mutate(runner)
    drafter = Drafter(truth, random.Random(rng.random()), runner.vocab_size, stats)
    outputs, _ = drive(runner, config, specs, chunk, preempt_probability, prefix_hits,
                       random.Random(rng.random()), stats, drafter)
    assert set(outputs) == set(truth)
    for request_id, expected in truth.items():
        got = outputs[request_id]
        stats["requests compared"] += 1
        stats["tokens compared"] += len(expected)
        if got == expected:
            continue
        first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
        if first is not None and margins[request_id][first] < EPSILON:
            stats["excused mismatches"] += 1
            continue
        raise AssertionError(f"{name} workload {seed}: request {request_id!r}: with drafts {list(got)}, "
                             f"without {list(expected)} (first difference at output {first})")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_with_drafts_equal_the_tokens_without(name, record_property, capsys):
    stats: Counter = Counter()
    for seed in range(WORKLOADS):
        compare(name, seed, stats)
    with capsys.disabled():
        print(f"\n[speculative {name}] " + ", ".join(f"{key}: {value}" for key, value in sorted(stats.items())))
    for key, value in stats.items():
        record_property(key, value)
    assert stats["excused mismatches"] <= max(1, stats["requests compared"] // 50)
    # The campaign exercised what it claims to.
    assert stats["items with all drafts accepted"] and stats["items with no draft accepted"]
    assert stats["items with some drafts accepted"]
    assert stats["stops inside the kept tokens (rest dropped)"]  # EOS or a length limit among the accepted
    if name == "chunked-prefill":
        assert stats["chunked prefill items"]
    if name == "preemption":
        assert stats["preemptions"]
    if name == "prefix-caching":
        assert stats["prefix hits"]


# --------------------------------------------------------------------------------------------------
# Verification unit cases and bad input
# --------------------------------------------------------------------------------------------------


def test_greedy_verify_accepts_the_longest_equal_prefix_and_asks_no_target_past_the_first_rejection():
    asked = []

    def targets(values):
        return lambda i: asked.append(i) or values[i]

    assert greedy_verify((5, 6, 7), targets((5, 6, 7, 8))) == (3, 8)
    assert asked == [0, 1, 2, 3]
    asked.clear()
    assert greedy_verify((5, 6, 7), targets((4, 6, 7, 8))) == (0, 4)
    assert asked == [0]
    assert greedy_verify((5, 6, 7), targets((5, 9, 7, 8))) == (1, 9)
    assert greedy_verify((), targets((3,))) == (0, 3)


SMALL = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                        max_model_len=MAX_MODEL_LEN, num_speculative_tokens=K)


def _truth(config: SchedulerConfig, spec: RequestSpec) -> tuple[int, ...]:
    """The request's greedy outputs, alone, without drafts."""
    outputs, _ = drive(Runner(config, device=device_for_tests()), config, [spec], None, 0.0, False,
                       random.Random(0), Counter(), memory_check=False)
    return outputs[spec.request_id]


def _decoding(runner: Runner, drafts: tuple[int, ...], config: SchedulerConfig = SMALL) -> SchedulerState:
    """Request ``a`` (prompt 6) after its prefill, which sampled its first token; the drafter proposed
    ``drafts`` after it."""
    state = state_with(config, [RequestSpec("a", 6, 10)])
    plan = plan_step(state, config)
    sampled, _ = runner.execute(plan, state)
    return apply_plan(state, plan, sampled, config, speculative_output(runner, {"a": drafts})).state


def test_the_plan_items_drafts_are_verified():
    """``a``'s item verifies drafts ``[t1, t2, wrong]`` (``t`` the true continuation): 2 are accepted and the
    sampled token is ``t3``, the target's token at the rejected draft; the spec's step keeps ``t1 t2 t3``."""
    truth = _truth(SMALL, RequestSpec("a", 6, 10))
    runner = Runner(SMALL, device=device_for_tests(), debug=True)
    wrong = truth[3] % (runner.vocab_size - 1) + 1
    state = _decoding(runner, (truth[1], truth[2], wrong))
    plan = plan_step(state, SMALL)
    assert plan.scheduled[0].spec_token_ids == (truth[1], truth[2], wrong) and plan.scheduled[0].num_tokens == 4
    sampled, _ = runner.execute(plan, state)
    assert sampled == {"a": truth[3]} and runner.last_num_accepted_tokens == {"a": 2}
    after = apply_plan(state, plan, sampled, SMALL, speculative_output(runner)).state
    assert after.requests["a"].output_token_ids == truth[:4] and after.requests["a"].num_computed_tokens == 9
    check_memory(runner, after)


def test_drafts_on_a_prefill_chunk_are_refused():
    runner = Runner(SMALL, device=device_for_tests(), debug=True)
    state = state_with(SMALL, [RequestSpec("a", 6, 10)])
    plan = StepPlan(scheduled=(ScheduledRequest("a", 0, 3, (0,), spec_token_ids=(5, 6)),))
    with pytest.raises(BackendError, match="draft token"):
        runner.execute(plan, state)


def test_drafts_with_temperature_sampling_are_refused():
    runner = Runner(SMALL, device=device_for_tests(), debug=True, temperature=0.8)
    state = _decoding(runner, (5, 6))
    with pytest.raises(BackendError, match="greedy"):
        runner.execute(plan_step(state, SMALL), state)


# --------------------------------------------------------------------------------------------------
# Negative tests: each fault is caught
# --------------------------------------------------------------------------------------------------


def _publish_up_to_num_tokens(state, plan, sampled, config, runner, drafter):
    """A faulty transition: after verification the prefix cache publishes the blocks full up to
    ``min(num_computed_tokens + num_tokens, request.num_tokens)`` with ``num_tokens`` counted *after* the
    step (drafts included, capped at the tokens now known, whose ids are right) instead of the kept
    computed positions: a block whose last slot holds a rejected draft's KV gets a hash. vLLM 0.32 caches
    ``min(num_computed_tokens + num_new_tokens, request.num_tokens)`` at allocation, before the step's
    tokens exist (``KVCacheManager.allocate_slots``: "only finalized tokens are cached")."""
    result = apply_speculative(state, plan, sampled, config, runner, drafter)
    update = CacheUpdate(result.state.prefix_cache, result.state.free_block_ids)
    for item in plan.scheduled:
        request = result.state.requests.get(item.request_id)
        if item.spec_token_ids and request is not None:
            update.publish(request, request.block_ids, min(item.num_computed_tokens + item.num_tokens,
                                                           request.num_tokens), config.block_size)
    cache, free = update.freeze()
    return attrs.evolve(result, state=attrs.evolve(result.state, prefix_cache=cache, free_block_ids=free))


PREFIX = attrs.evolve(SMALL, enable_prefix_caching=True)


def _hit_after_a_rejection(apply, check_block_tables: bool) -> tuple[int, ...]:
    """``a`` (prompt 5) decodes once, then verifies 3 wrong drafts at positions 7..9: it keeps 1 token,
    has 8 tokens and 7 computed, slot 7 holding a rejected draft (poisoned). Then ``b``, whose prompt is
    ``a``'s 8 tokens plus one, is admitted alone with its longest prefix hit. Returns ``b``'s hit."""
    config = PREFIX
    wrong = _truth(config, RequestSpec("a", 5, 10))[2] % (DEFAULT_VOCAB_SIZE - 1) + 1
    runner = Runner(config, device=device_for_tests(), debug=True)
    runner.check_block_tables = check_block_tables
    state = state_with(config, [RequestSpec("a", 5, 10)])
    for drafts in ((), (wrong, wrong, wrong)):  # prefill (samples output 1), one decode (output 2)
        plan = plan_step(state, config, prefix_hits=True)
        sampled, _ = runner.execute(plan, state)
        state = apply_plan(state, plan, sampled, config, speculative_output(runner, {"a": drafts})).state
    plan = plan_step(state, config, prefix_hits=True)
    assert plan.scheduled[0].num_computed_tokens == 6 and plan.scheduled[0].num_tokens == 4
    sampled, _ = runner.execute(plan, state)
    assert runner.last_num_accepted_tokens == {"a": 0}
    state = apply(state, plan, sampled, config, runner, None).state
    a = state.requests["a"]
    assert (a.num_tokens, a.num_computed_tokens) == (8, 7)
    prompt = tuple(int(t) for t in token_ids(a, 0, 8)) + (7,)
    state = add_request(state, Request("b", state.step, prompt, max_tokens=3))
    plan = plan_step(state, config, only=["b"], prefix_hits=True)
    sampled, _ = runner.execute(plan, state)
    return plan.scheduled[0].cached_block_ids


@pytest.mark.parametrize("check_block_tables", [True, False], ids=["ledger", "nan-logits"])
def test_a_hit_on_a_block_published_with_a_rejected_draft_is_caught(check_block_tables):
    """The faulty cache publishes ``a``'s second block (positions 4..7, slot 7 a rejected draft); ``b`` hits
    it: the ledger reports that the block holds no valid KV, and with its table checks off the poisoned
    slot makes ``b``'s logits NaN."""
    match = "holds no valid KV" if check_block_tables else "NaN logits"
    with pytest.raises(BlockTableError, match=match):
        _hit_after_a_rejection(_publish_up_to_num_tokens, check_block_tables)


def test_the_spec_publishes_only_the_kept_positions():
    """The control: with the spec's own transition ``b`` hits one block and runs cleanly."""
    assert len(_hit_after_a_rejection(apply_speculative, True)) == 1


def test_rejected_slots_left_unpoisoned_fail_the_memory_check():
    config, chunk, _, _ = CONFIGS["plain"]
    runner = Runner(config, device=device_for_tests(), debug=True)
    runner.kv_cache.fill_slots = lambda slots, value=float("nan"): None
    specs = [RequestSpec("a", 6, 12)]
    rng = random.Random(5)
    truth, _ = drive(Runner(config, device=device_for_tests(), debug=True), config, specs, chunk, 0.0, False, rng,
                     Counter())
    drafter = Drafter(truth, rng, runner.vocab_size, Counter())
    drafter.propose = lambda after, sampled, inner=drafter.propose: {
        r: (1,) * len(d) for r, d in inner(after, sampled).items()}
    with pytest.raises(AssertionError, match="is finite; num_computed_tokens"):
        drive(runner, config, specs, chunk, 0.0, False, rng, Counter(), drafter)


def test_a_verifier_that_accepts_wrong_drafts_fails_the_differential_check(monkeypatch):
    monkeypatch.setattr(runner_module, "greedy_verify", lambda drafts, target_at: (len(drafts), target_at(len(drafts))))
    with pytest.raises(AssertionError, match="with drafts"):
        for seed in range(WORKLOADS):
            compare("plain", seed, Counter())


def test_a_verifier_that_rejects_every_draft_still_gives_the_greedy_tokens(monkeypatch):
    """Rejecting everything is slow but correct: only the target's tokens are kept."""
    monkeypatch.setattr(runner_module, "greedy_verify", lambda drafts, target_at: (0, target_at(0)))
    stats: Counter = Counter()
    compare("chunked-prefill", 0, stats)
    assert stats["accepted draft tokens"] == 0 and stats["requests compared"]
