"""Differential tests of the PyTorch backend under the reference schedulers.

1. **Batch invariance under scheduling.** Hypothesis generates workloads (mixed prompt and output
   lengths, arrivals over several steps, chunked prefill on and off with small token budgets and chunk
   caps, KV caches small enough to force preemption and recompute, prompts too large for the cache,
   aborts, EOS at chosen outputs) and runs them through :class:`~schedspec.reference.engine.Engine` with
   a reference policy and the real :class:`~schedspec.gpu_backend.Runner` (built-in tiny model, fp32,
   ``$SCHEDSPEC_DEVICE`` (default CPU), debug mode). Every finished request's greedy output must equal
   its output when run alone, and every non-empty step must be exactly one packed forward call (so
   running requests one by one cannot pass).

   fp32 logits change in the last bits with the batch shape (reduction order), so greedy decoding may
   legitimately flip where the two best tokens are within rounding noise. A mismatch is excused only
   where the solo run's top-2 logit margin (EOS masked, as when sampling) at the first differing output
   is below :data:`EPSILON`; excused cases are counted (Hypothesis ``event`` and ``note``, and printed
   per policy) and must stay rare. Any other mismatch fails and Hypothesis shrinks it to a minimal
   workload.

2. **Memory agrees with the spec.** After every step the backend's block ledger holds exactly the block
   table the spec state gives each request, and the KV cache itself holds written (finite) values in
   exactly the slots of positions ``[0, num_computed_tokens)`` of each request's ``block_ids`` (plus
   those of requests that finished in this step, released at the next one); every other slot is NaN
   (debug mode starts NaN and poisons freed blocks), so a later read of memory a request does not own
   yields NaN logits, which the backend reports. Negative tests show wrong plans and memory faults are
   caught.

Example counts follow ``HYPOTHESIS_PROFILE`` (``tests/conftest.py``): see :data:`EXAMPLES`.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import attrs
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import event as _event  # noqa: E402
from hypothesis import note as _note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.control import currently_in_test_context  # noqa: E402

from schedspec.gpu_backend import BlockTableError, Runner  # noqa: E402
from schedspec.gpu_backend.testing import device_for_tests, plan_step, run_step, state_with  # noqa: E402
from schedspec.reference.engine import Engine, ViolationFound  # noqa: E402
from schedspec.reference.scheduler import make_scheduler  # noqa: E402
from schedspec.spec.config import SchedulerConfig, blocks_for_tokens  # noqa: E402
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan  # noqa: E402
from schedspec.spec.transitions import apply_plan  # noqa: E402
from schedspec.spec.workload import EOS_TOKEN_ID, RequestSpec  # noqa: E402

EPSILON = 1e-4
"""A greedy mismatch is excused only where the solo run's top-2 logit margin is below this (fp32
logits of the tiny model are O(10); batch-shape rounding differences are ~1e-6)."""

MAX_EXCUSED_FRACTION = 0.02
"""Excused mismatches may affect at most this fraction of the compared requests (and at least one is
always tolerated)."""

MAX_MODEL_LEN = 48
MAX_PROMPT = 44
MAX_OUT = 12
"""Workload bounds: prompts of 1..44 tokens, 1..12 outputs, ``max_model_len`` 48 (so some requests end
at the model length before ``max_tokens``)."""

OTHER_POLICIES = ("priority", "shortest-prompt-first", "static")

_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
EXAMPLES = {
    "default": {"fcfs": 15, "other": 6},
    "ci": {"fcfs": 60, "other": 25},
    "nightly": {"fcfs": 1000, "other": 400},
}.get(_PROFILE, {"fcfs": 15, "other": 6})
"""Examples per policy for each profile: default ~40 s, ci ~3 min on a 2-core CPU machine."""

SOLO_CONFIG = SchedulerConfig(block_size=16, num_kv_blocks=4, max_num_batched_tokens=64, max_num_seqs=1,
                              max_model_len=MAX_MODEL_LEN)


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def event(text: str) -> None:
    """Hypothesis ``event`` inside a Hypothesis example; nothing in the fixed tests."""
    if currently_in_test_context():
        _event(text)


def note(text: str) -> None:
    """Hypothesis ``note`` inside a Hypothesis example (printed for a failing one); nothing elsewhere."""
    if currently_in_test_context():
        _note(text)


# --------------------------------------------------------------------------------------------------
# Solo runs: each (request id, prompt length) alone, prefilled in one step, greedy, EOS masked.
# --------------------------------------------------------------------------------------------------

_solo_runner: Runner | None = None
_solo_cache: dict[tuple[str, int], tuple[tuple[int, ...], tuple[float, ...]]] = {}


def top2_margin(logits: torch.Tensor) -> float:
    """Gap between the two best logits with EOS masked (what greedy sampling compares)."""
    row = logits.detach().float().clone()
    row[EOS_TOKEN_ID] = -math.inf
    best = torch.topk(row, 2).values
    return float(best[0] - best[1])


def solo(request_id: str, prompt_len: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The request alone: its greedy continuation (up to :data:`MAX_OUT` tokens or the model length)
    and the top-2 margin at each output. Prompt ids depend only on ``(request_id, prompt_len)``, and
    greedy output for fewer ``max_tokens`` is a prefix, so one run serves every workload."""
    global _solo_runner
    key = (request_id, prompt_len)
    if key not in _solo_cache:
        if _solo_runner is None:
            _solo_runner = Runner(SOLO_CONFIG, device=device_for_tests(), debug=True, record_logits="last")
        runner = _solo_runner
        runner.reset()
        state = state_with(SOLO_CONFIG, [RequestSpec(request_id, prompt_len, MAX_OUT)])
        tokens, margins = [], []
        while state.requests:
            state, sampled, _ = run_step(runner, state, SOLO_CONFIG, plan_step(state, SOLO_CONFIG))
            if request_id in sampled:
                tokens.append(sampled[request_id])
                margins.append(top2_margin(runner.last_logits[request_id]))
        assert state.finished[request_id].output_token_ids == tuple(tokens)
        _solo_cache[key] = (tuple(tokens), tuple(margins))
    return _solo_cache[key]


def expected_length(spec: RequestSpec) -> int:
    """Outputs of a finished request: ``max_tokens``, the model length, or the forced EOS."""
    n = min(spec.max_tokens, MAX_MODEL_LEN - spec.prompt_len)
    if spec.eos_at_output is not None and spec.eos_at_output <= n:
        n = spec.eos_at_output
    return n


# --------------------------------------------------------------------------------------------------
# The memory check: after every step, what the backend holds is what the spec says.
# --------------------------------------------------------------------------------------------------


def _mark(expected: torch.Tensor, table: tuple[int, ...], num_tokens: int, block_size: int) -> None:
    for position in range(num_tokens):
        expected[table[position // block_size], position % block_size] = True


def check_memory(runner: Runner, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> None:
    """Assert that the backend's memory agrees with the spec after ``plan`` ran on ``before``.

    - The ledger (the blocks the backend wrote for each request) equals ``after.requests[r].block_ids``
      for every live request, with ``num_computed_tokens`` positions written; requests that finished in
      this step still hold theirs (released and poisoned at the next step); nobody else holds any.
    - The KV cache (every layer, keys and values): a slot is finite exactly where it holds a position
      below ``num_computed_tokens`` of the request whose table names its block; every other slot is
      NaN. So no write landed outside owned memory, and freed memory was poisoned.
    """
    config = runner.config
    ledger = runner.ledger
    assert ledger is not None, "the memory check needs debug mode"
    expected = torch.zeros(config.num_kv_blocks, config.block_size, dtype=torch.bool)
    holders: dict[str, tuple[int, ...]] = {}
    for request_id, request in after.requests.items():
        table = ledger.tables.get(request_id, ())
        assert table == request.block_ids, (
            f"step {before.step}: spec says {request_id!r} owns blocks {list(request.block_ids)}, "
            f"the backend wrote {list(table)}")
        if request.block_ids:
            holders[request_id] = request.block_ids
            assert ledger.filled[request_id] == request.num_computed_tokens, (
                f"step {before.step}: {request_id!r}: backend wrote {ledger.filled[request_id]} positions, "
                f"spec says {request.num_computed_tokens} are computed")
            _mark(expected, request.block_ids, request.num_computed_tokens, config.block_size)
    items = {item.request_id: item for item in plan.scheduled}
    rejected = {request_id for request_id, _ in plan.rejected}
    for request_id in set(before.requests) - set(after.requests):  # rejected or finished in this step
        if request_id in rejected:
            assert not before.requests[request_id].block_ids and request_id not in ledger.tables
            continue
        item = items[request_id]
        table = before.requests[request_id].block_ids + item.new_block_ids
        assert ledger.tables.get(request_id, ()) == table
        if table:
            holders[request_id] = table
            _mark(expected, table, item.num_computed_tokens + item.num_tokens, config.block_size)
    assert dict(ledger.tables) == holders, f"step {before.step}: backend holds {ledger.tables}, spec {holders}"
    assert ledger.owner == {b: r for r, t in holders.items() for b in t}

    cache = runner.kv_cache
    stacked = torch.stack([*cache.key, *cache.value]).cpu()  # [2 * layers, blocks, block_size, heads, dim]
    nan = torch.isnan(stacked)
    all_nan = nan.all(dim=4).all(dim=3).all(dim=0)
    finite = (~nan).all(dim=4).all(dim=3).all(dim=0)
    torn = ~(all_nan | finite)
    assert not torn.any(), f"step {before.step}: slots partly written: {torn.nonzero().tolist()}"
    stray = finite & ~expected
    missing = expected & ~finite
    assert not stray.any(), (
        f"step {before.step}: KV slots (block, offset) hold data no live request owns: {stray.nonzero().tolist()}")
    assert not missing.any(), (
        f"step {before.step}: KV slots (block, offset) the spec says are computed hold NaN: "
        f"{missing.nonzero().tolist()}")


class CheckedRunner:
    """The token source of the differential runs: the real runner, the memory check after each step,
    and counts of what the steps looked like."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.busy_steps = 0
        self.max_batch = 0
        self.mixed_steps = 0

    def execute(self, plan: StepPlan, state: SchedulerState) -> tuple[dict[str, int], float]:
        sampled, seconds = self.runner.execute(plan, state)
        after = apply_plan(state, plan, sampled, self.runner.config).state
        check_memory(self.runner, state, plan, after)
        if plan.scheduled:
            self.busy_steps += 1
            self.max_batch = max(self.max_batch, len(plan.scheduled))
            sizes = {item.num_tokens > 1 for item in plan.scheduled}
            self.mixed_steps += sizes == {True, False}
        return sampled, seconds


# --------------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------------


@st.composite
def cases(draw, policy: str) -> tuple[SchedulerConfig, list[RequestSpec]]:
    """2 to 6 requests and a config for them: chunked prefill on or off, small token budgets and
    chunk caps, and a KV cache that holds little more than the largest request, half of them, all of
    them, or not even the largest one (so requests are preempted and recomputed, and some rejected).
    Every first choice (what Hypothesis tries first and shrinks towards) is a busy batch, not a
    degenerate one."""
    specs = []
    for index in range(draw(st.integers(2, 6))):
        prompt_len, max_tokens, arrival = (draw(st.integers(1, MAX_PROMPT)), draw(st.integers(1, MAX_OUT)),
                                           draw(st.integers(0, 3)))
        specs.append(RequestSpec(
            request_id=f"r{index}",
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            arrival_step=arrival,
            priority=draw(st.integers(0, 3)) if policy == "priority" else 0,
            abort_at_step=draw(st.integers(arrival, 20)) if draw(st.integers(0, 4)) == 4 else None,
            eos_at_output=draw(st.integers(1, MAX_OUT)) if draw(st.integers(0, 3)) == 3 else None,
        ))
    cache = draw(st.sampled_from(["tight", "half", "tight", "ample", "tiny"]))
    chunked = draw(st.sampled_from([True, False]))
    block_size = draw(st.sampled_from([4, 2, 8]))
    max_num_seqs = draw(st.sampled_from([4, 2, 3] if cache == "tight" else [4, 2, 3, 1]))
    if chunked:
        budget = max(max_num_seqs, draw(st.sampled_from([16, 8, 32, 5, 12])))
        threshold = draw(st.sampled_from([0, 6, 3]))
    else:
        budget, threshold = MAX_MODEL_LEN + draw(st.integers(0, 16)), 0
    need = [blocks_for_tokens(min(s.prompt_len + s.max_tokens, MAX_MODEL_LEN), block_size) for s in specs]
    if cache == "tight":  # the largest request and a block or two: decodes run out, preempt, recompute
        num_blocks = max(need) + draw(st.integers(0, 1))
    elif cache == "half":
        num_blocks = max(max(need), sum(need) // 2)
    elif cache == "ample":
        num_blocks = sum(need)
    else:  # not even the largest request at full length: it is rejected
        num_blocks = max(1, max(need) - draw(st.integers(1, 2)))
    config = SchedulerConfig(
        block_size=block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold,
    )
    return config, specs


def run_case(policy: str, config: SchedulerConfig, specs: list[RequestSpec], stats: Counter) -> None:
    """Run one workload batched, check it against the solo runs, and count what happened."""
    eos = {s.request_id: s.eos_at_output for s in specs if s.eos_at_output}
    runner = Runner(config, device=device_for_tests(), debug=True, eos_at_output=eos)
    source = CheckedRunner(runner)
    run = Engine(make_scheduler(policy, config), config, token_source=source).run(specs, mode="steps",
                                                                                   max_steps=5000)
    assert run.ok, [str(v) for v in run.violations[:5]]
    assert not run.state.requests, f"requests still live: {sorted(run.state.requests)}"
    busy = sum(1 for record in run.records if record.scheduled)
    assert runner.num_forward_calls == busy == source.busy_steps, (
        f"{runner.num_forward_calls} forward calls for {busy} non-empty steps: each step must be one packed call")

    stats["examples"] += 1
    stats["steps"] += run.num_steps
    stats["forward_calls"] += runner.num_forward_calls
    stats["mixed_prefill_decode_steps"] += source.mixed_steps
    preemptions = sum(r.num_preemptions for r in run.state.finished.values())
    stats["preemptions"] += preemptions
    event(f"chunked prefill {'on' if config.enable_chunked_prefill else 'off'}")
    event(f"KV cache of {config.num_kv_blocks} blocks of {config.block_size}")
    event(f"largest batch: {source.max_batch} requests")
    if preemptions:
        stats["workloads with preemption"] += 1
        event("preemption and recompute")
    if source.mixed_steps:
        event("prefill and decode in one step")

    for spec in specs:
        request = run.state.finished.get(spec.request_id)
        assert request is not None, f"{spec.request_id} never ended"
        outcome = request.status.outcome
        stats[f"outcome {outcome}"] += 1
        event(f"a request {outcome}")
        if outcome != "finished":
            continue
        batched = request.output_token_ids
        assert len(batched) == expected_length(spec), (spec, batched)
        reference, margins = solo(spec.request_id, spec.prompt_len)
        stats["requests compared"] += 1
        for index, token in enumerate(batched):
            if spec.eos_at_output == index + 1:
                assert token == EOS_TOKEN_ID
                break
            stats["tokens compared"] += 1
            if token == reference[index]:
                continue
            margin = margins[index]
            detail = (f"{spec.request_id} (prompt {spec.prompt_len}, {request.num_preemptions} preemptions) output "
                      f"{index + 1}: batched {token}, solo {reference[index]}, solo top-2 margin {margin:.3g}")
            assert margin < EPSILON, f"greedy output differs from the solo run: {detail}\nbatched {batched}\n" \
                                     f"solo    {reference[:len(batched)]}"
            stats["excused mismatches"] += 1
            event("excused mismatch (solo top-2 margin below epsilon)")
            note(f"excused: {detail}")
            break  # the contexts differ from here on


def _report(policy: str, stats: Counter) -> str:
    return (f"{policy}: {stats['examples']} workloads, {stats['steps']} steps, {stats['forward_calls']} forward calls, "
            f"{stats['mixed_prefill_decode_steps']} mixed prefill+decode steps, {stats['preemptions']} preemptions "
            f"(in {stats['workloads with preemption']} workloads); "
            f"{stats['requests compared']} finished requests / {stats['tokens compared']} tokens compared with solo "
            f"runs, {stats['excused mismatches']} excused mismatches (epsilon {EPSILON:g}); outcomes "
            + ", ".join(f"{k.split()[1]} {v}" for k, v in sorted(stats.items()) if k.startswith("outcome ")))


@pytest.mark.parametrize("policy", ["fcfs", *OTHER_POLICIES])
def test_batched_outputs_equal_solo_outputs_and_memory_agrees_with_the_spec(policy, record_property, capsys):
    stats: Counter = Counter()
    examples = EXAMPLES["fcfs" if policy == "fcfs" else "other"]

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases(policy))
    def check(case):
        config, specs = case
        note(f"config: {config}")
        run_case(policy, config, specs, stats)

    check()
    report = _report(policy, stats)
    record_property("differential", report)
    with capsys.disabled():
        print(f"\n[differential] {report}")
    compared = stats["requests compared"]
    assert stats["excused mismatches"] <= max(1, MAX_EXCUSED_FRACTION * compared), report


# --------------------------------------------------------------------------------------------------
# Fixed workloads: the property's corner cases, run every time
# --------------------------------------------------------------------------------------------------


def test_preemption_recompute_and_a_full_batch_give_the_solo_tokens():
    """A cache of 10 blocks of 4 for five requests: preemptions and recomputes, several requests per
    step, prefill chunks beside decodes."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=10, max_num_batched_tokens=16, max_num_seqs=4,
                             max_model_len=MAX_MODEL_LEN, long_prefill_token_threshold=6)
    specs = [RequestSpec(f"r{i}", p, 8, arrival_step=a) for i, (p, a) in enumerate([(9, 0), (14, 0), (5, 1),
                                                                                     (20, 2), (3, 3)])]
    stats: Counter = Counter()
    run_case("fcfs", config, specs, stats)
    assert stats["preemptions"] > 0 and stats["mixed_prefill_decode_steps"] > 0
    assert stats["requests compared"] == 5 and stats["excused mismatches"] == 0


# --------------------------------------------------------------------------------------------------
# Negative tests: wrong plans and memory faults are caught
# --------------------------------------------------------------------------------------------------

NEG_CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=32, max_num_seqs=4,
                             max_model_len=MAX_MODEL_LEN)


class StealBlock:
    """A buggy scheduler: fcfs, except that the first time a running request needs a new block it is
    handed a block another running request still owns (a double allocation)."""

    name = "steal-block"
    guarantees = frozenset()

    def __init__(self, config: SchedulerConfig) -> None:
        self.inner = make_scheduler("fcfs", config)
        self.fired = False

    @property
    def state(self) -> SchedulerState:
        return self.inner.state

    def add_request(self, request) -> None:
        self.inner.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.inner.abort_request(request_id)

    def schedule(self) -> StepPlan:
        plan = self.inner.schedule()
        if self.fired:
            return plan
        state = self.inner.state
        for index, item in enumerate(plan.scheduled):
            request = state.requests[item.request_id]
            others = [b for r in state.running if r != item.request_id for b in state.requests[r].block_ids]
            if item.new_block_ids and request.block_ids and others:
                self.fired = True
                bad = attrs.evolve(item, new_block_ids=(others[0], *item.new_block_ids[1:]))
                return attrs.evolve(plan, scheduled=plan.scheduled[:index] + (bad,) + plan.scheduled[index + 1:])
        return plan

    def update(self, plan, sampled):
        return self.inner.update(plan, sampled)


def _steal_workload() -> list[RequestSpec]:
    return [RequestSpec("a", 6, 8, arrival_step=0), RequestSpec("b", 6, 8, arrival_step=0)]


def test_a_double_allocation_from_the_scheduler_is_caught_by_the_backend():
    """With the spec checks off, the backend alone catches the stolen block before writing into it."""
    runner = Runner(NEG_CONFIG, device=device_for_tests(), debug=True)
    scheduler = StealBlock(NEG_CONFIG)
    engine = Engine(scheduler, NEG_CONFIG, token_source=CheckedRunner(runner), check=False, properties=())
    with pytest.raises(BlockTableError, match=r"new_block_ids writes into block \d+, which is owned by request"):
        engine.run(_steal_workload())
    assert scheduler.fired


def test_a_double_allocation_from_the_scheduler_is_also_a_spec_violation():
    runner = Runner(NEG_CONFIG, device=device_for_tests(), debug=True)
    engine = Engine(StealBlock(NEG_CONFIG), NEG_CONFIG, token_source=CheckedRunner(runner), properties=(),
                    stop_on_violation=True)
    with pytest.raises(ViolationFound):
        engine.run(_steal_workload())


def _after_preemption() -> tuple[Runner, SchedulerState, tuple[int, ...]]:
    """Two requests prefilled and decoded once, then "a" preempted: its blocks are freed (NaN)."""
    runner = Runner(NEG_CONFIG, device=device_for_tests(), debug=True)
    source = CheckedRunner(runner)
    state = state_with(NEG_CONFIG, [RequestSpec("a", 7, 8), RequestSpec("b", 7, 8)])
    for _ in range(2):
        plan = plan_step(state, NEG_CONFIG)
        sampled, _ = source.execute(plan, state)
        state = apply_plan(state, plan, sampled, NEG_CONFIG).state
    freed = state.requests["a"].block_ids
    plan = plan_step(state, NEG_CONFIG, only=["b"], preempt=["a"])
    sampled, _ = source.execute(plan, state)
    state = apply_plan(state, plan, sampled, NEG_CONFIG).state
    assert not state.requests["a"].block_ids and set(freed) <= set(state.free_block_ids)
    return runner, state, freed


def _pointing_at(state: SchedulerState, request_id: str, block: int) -> SchedulerState:
    requests = dict(state.requests)
    request = requests[request_id]
    requests[request_id] = attrs.evolve(request, block_ids=(block, *request.block_ids[1:]))
    return attrs.evolve(state, requests=requests)


def test_a_block_table_pointing_at_a_freed_block_is_caught():
    runner, state, freed = _after_preemption()
    for layer in range(runner.model_config.num_hidden_layers):
        assert runner.kv_cache.key[layer][list(freed)].isnan().all()
    bad = _pointing_at(state, "b", freed[0])
    request = bad.requests["b"]
    decode = StepPlan(scheduled=(ScheduledRequest("b", request.num_computed_tokens, 1),))
    with pytest.raises(BlockTableError, match=rf"block_ids lists block {freed[0]} owned by no request \(free\)"):
        runner.execute(decode, bad)
    # Without the ownership check, the read of the poisoned block still fails the step.
    runner.check_block_tables = False
    with pytest.raises(BlockTableError, match=r"NaN logits for request\(s\) \['b'\]"):
        runner.execute(decode, bad)


def test_resuming_a_preempted_request_without_recompute_is_caught():
    """A plan that resumes the preempted "a" as if its KV were still there (a decode at position 8 into
    fresh blocks) would read 8 positions nobody wrote: the ledger says so, and with that check off the
    NaN in those slots reaches the logits."""
    runner, state, _ = _after_preemption()
    request = state.requests["a"]
    assert request.num_computed_tokens == 0 and request.num_tokens == 9
    resume = StepPlan(scheduled=(ScheduledRequest("a", 8, 1, state.free_block_ids[:3]),))
    with pytest.raises(BlockTableError, match=r"num_computed_tokens=8 but only positions \[0, 0\) were written"):
        runner.execute(resume, state)
    runner.check_block_tables = False
    with pytest.raises(BlockTableError, match=r"NaN logits for request\(s\) \['a'\]"):
        runner.execute(resume, state)


def test_the_memory_check_catches_a_stray_write():
    runner, state, freed = _after_preemption()
    runner.kv_cache.value[1][freed[0], 0] = 0.0  # data in a block nobody owns
    request = state.requests["b"]
    plan = StepPlan(scheduled=(ScheduledRequest("b", request.num_computed_tokens, 1),))
    sampled, _ = runner.execute(plan, state)
    with pytest.raises(AssertionError, match=r"hold data no live request owns|partly written"):
        check_memory(runner, state, plan, apply_plan(state, plan, sampled, NEG_CONFIG).state)


def test_the_memory_check_catches_freed_blocks_left_unpoisoned():
    runner = Runner(NEG_CONFIG, device=device_for_tests(), debug=True)
    runner.kv_cache.fill_blocks = lambda block_ids, value=float("nan"): None  # a backend that forgets to poison
    source = CheckedRunner(runner)
    state = state_with(NEG_CONFIG, [RequestSpec("a", 7, 8), RequestSpec("b", 7, 8)])
    plan = plan_step(state, NEG_CONFIG)
    sampled, _ = source.execute(plan, state)
    state = apply_plan(state, plan, sampled, NEG_CONFIG).state
    plan = plan_step(state, NEG_CONFIG, only=["b"], preempt=["a"])
    with pytest.raises(AssertionError, match=r"hold data no live request owns"):
        source.execute(plan, state)


def test_the_memory_check_catches_a_ledger_that_disagrees_with_the_spec():
    runner, state, freed = _after_preemption()
    request = state.requests["b"]
    plan = StepPlan(scheduled=(ScheduledRequest("b", request.num_computed_tokens, 1),))
    sampled, _ = runner.execute(plan, state)
    after = apply_plan(state, plan, sampled, NEG_CONFIG).state
    runner.ledger.tables["b"] = (freed[0], *runner.ledger.tables["b"][1:])
    with pytest.raises(AssertionError, match=r"spec says 'b' owns blocks"):
        check_memory(runner, state, plan, after)
