"""``schedspec diff``: agreement with itself, a divergence found, shrunk and written as a replayable case,
findings, exact block comparison, and the exit codes 0/1/2/3.

Cost: about 10 s on one core (a few hundred small generated scenarios in all).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from schedspec.cli import cli
from schedspec.commands.diff import compare, run_diff
from schedspec.reference import vllm_v1
from schedspec.reference.scenarios import load_scenario, replay
from schedspec.reference.scheduler import (
    REGISTRY,
    SCHEDULERS,
    ReferenceScheduler,
    RegisteredScheduler,
    UnsupportedFeature,
)
from schedspec.spec.state import StepPlan


def invoke(*args: str):
    return CliRunner().invoke(cli, ["diff", *args], catch_exceptions=False)


def test_vllm_v1_against_itself_has_no_divergence() -> None:
    result = invoke("--scheduler", "vllm-v1", "--against", "vllm-v1", "--examples", "60", "--seed", "3")
    assert result.exit_code == 0, result.output
    assert "60 examples" in result.output
    assert "0 divergent (unexplained), 0 documented differences, 0 findings" in result.output


def test_fcfs_against_vllm_v1_diverges_and_writes_a_replayable_case(tmp_path: Path) -> None:
    """fcfs reserves blocks for the whole prompt at admission and schedules decodes first; vllm-v1
    allocates for the first chunk and keeps list order: they must diverge on some scenario."""
    out = tmp_path / "cases"
    result = invoke("--scheduler", "fcfs", "--against", "vllm-v1", "--examples", "40", "--seed", "1",
                    "--out", str(out))
    assert result.exit_code == 1, result.output
    assert "DIVERGENCE" in result.output
    written = sorted(out.glob("*.json"))
    assert written
    for path in written:
        scenario = load_scenario(path)  # the cases format
        from schedspec.spec.config import SchedulerConfig

        config = SchedulerConfig.from_dict(scenario.config)
        again = compare(config, list(scenario.requests), "fcfs", "vllm-v1")
        assert again.divergence is not None
        assert f"at step {again.divergence.step}:" in json.loads(path.read_text())["about"]
        assert len(scenario.requests) <= 8
        for name in ("fcfs", "vllm-v1"):  # its expectations hold on both: a divergence is not a fault
            assert replay(scenario, name).passed

    before = {p: p.read_bytes() for p in written}
    again = invoke("--scheduler", "fcfs", "--against", "vllm-v1", "--examples", "40", "--seed", "1",
                   "--out", str(out))
    assert again.exit_code == 1
    assert {p: p.read_bytes() for p in written} == before  # nothing overwritten
    assert len(list(out.glob("*.json"))) == 2 * len(written)


def test_shrinking_keeps_the_divergence_and_makes_it_small(tmp_path: Path) -> None:
    report = run_diff("fcfs", "vllm-v1", 40, 1, {}, tmp_path, echo=lambda line: None)
    assert report.divergent >= 1 and report.cases
    sizes = [len(load_scenario(p).requests) for p in report.cases]
    assert min(sizes) == 1  # a fcfs/vllm-v1 difference needs one long prompt only


def _register_factory(monkeypatch, name: str, factory) -> None:
    monkeypatch.setitem(REGISTRY, name, RegisteredScheduler(name, "reference", factory=factory))


def _register(monkeypatch, name: str, plan, guarantees=frozenset()) -> None:
    _register_factory(monkeypatch, name, lambda config: ReferenceScheduler(config, plan, name, guarantees))


def test_a_scheduler_that_breaks_the_spec_is_a_finding(monkeypatch) -> None:
    def no_new_blocks(state, config) -> StepPlan:
        plan = vllm_v1.vllm_v1(state, config)
        return attrs.evolve(plan, scheduled=tuple(attrs.evolve(i, new_block_ids=()) for i in plan.scheduled))

    _register(monkeypatch, "broken", no_new_blocks)
    result = invoke("--scheduler", "broken", "--against", "vllm-v1", "--examples", "10", "--seed", "0")
    assert result.exit_code == 1
    assert "FINDING broken block-table-covers" in result.output


def test_block_ids_are_compared_only_with_exact_blocks(monkeypatch) -> None:
    """A scheduler equal to vllm-v1 but for the block ids it picks (the back of the free queue): the
    same block counts, other ids."""

    def from_the_back(state, config) -> StepPlan:
        return vllm_v1.vllm_v1(attrs.evolve(state, free_block_ids=state.free_block_ids[::-1]), config)

    _register(monkeypatch, "backwards", from_the_back)
    counts = invoke("--scheduler", "backwards", "--against", "vllm-v1", "--examples", "20", "--seed", "0")
    assert counts.exit_code == 0, counts.output
    exact = invoke("--scheduler", "backwards", "--against", "vllm-v1", "--examples", "20", "--seed", "0",
                   "--exact-blocks")
    assert exact.exit_code == 1 and "DIVERGENCE" in exact.output


def test_a_scheduler_that_cannot_express_the_scenarios_exits_3(monkeypatch) -> None:
    def refuse(config):
        raise UnsupportedFeature("refuses every config")

    _register_factory(monkeypatch, "refuses", refuse)
    result = invoke("--scheduler", "refuses", "--against", "vllm-v1", "--examples", "5")
    assert result.exit_code == 3
    assert "5 unsupported" in result.output


def test_a_reserved_scheduler_not_implemented_exits_3(monkeypatch) -> None:
    monkeypatch.setitem(REGISTRY, "future-engine",
                        RegisteredScheduler("future-engine", "reserved", reason="not written yet"))
    result = CliRunner().invoke(cli, ["diff", "--scheduler", "future-engine", "--against", "vllm-v1"])
    assert result.exit_code == 3
    assert "not written yet" in result.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--scheduler", "nope", "--against", "vllm-v1"], "unknown"),
        (["--scheduler", "fcfs", "--against", "vllm-v1", "--set", "no_such_field=1"], "no_such_field"),
        (["--scheduler", "fcfs", "--against", "vllm-v1", "--set", "block_size=0"], "block_size"),
        (["--scheduler", "fcfs", "--against", "vllm-v1", "--examples", "0"], "--examples"),
    ],
)
def test_bad_input_exits_2(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(cli, ["diff", *args])
    assert result.exit_code == 2
    assert needle in result.output
    assert "Traceback" not in result.output


def test_set_fixes_a_field_in_every_scenario(monkeypatch) -> None:
    seen = []
    original = SCHEDULERS["vllm-v1"]

    def recording(config):
        seen.append(config)
        return original(config)

    _register_factory(monkeypatch, "vllm-v1", recording)
    result = invoke("--scheduler", "vllm-v1", "--against", "vllm-v1", "--examples", "10",
                    "--set", "enable_chunked_prefill=false")
    assert result.exit_code == 0, result.output
    assert seen and all(not c.enable_chunked_prefill for c in seen)


class _LiftsThresholdWhenAlone:
    """An engine adapter (no spec ``state``) that behaves like vLLM: vllm-v1, except that
    ``long_prefill_token_threshold`` is not applied while only one request is live."""

    def __init__(self, config, expose_state: bool) -> None:
        self.config = config
        self.inner = ReferenceScheduler(config, vllm_v1.vllm_v1, "inner", frozenset())
        self.name = "like-vllm"
        self.guarantees = frozenset()
        if expose_state:  # a spec state of its own: a reference scheduler, not an engine adapter
            self.state = self.inner.state
        self.expose_state = expose_state

    def add_request(self, request) -> None:
        self.inner.add_request(request)
        self._sync()

    def abort_request(self, request_id) -> None:
        self.inner.abort_request(request_id)
        self._sync()

    def schedule(self) -> StepPlan:
        state = self.inner.state
        if len(state.requests) == 1:
            return vllm_v1.vllm_v1(state, self.config.with_changes(long_prefill_token_threshold=0))
        return vllm_v1.vllm_v1(state, self.config)

    def update(self, plan, sampled):
        finished = self.inner.update(plan, sampled)
        self._sync()
        return finished

    def _sync(self) -> None:
        if self.expose_state:
            self.state = self.inner.state


@pytest.mark.parametrize("expose_state", [False, True], ids=["engine", "reference"])
def test_documented_vllm_behaviour_is_not_a_failure_only_for_an_engine(monkeypatch, expose_state: bool) -> None:
    """vLLM lifts the long-prefill threshold for a lone request (its documented behaviour; the spec rule
    long-prefill-threshold forbids it): from an engine adapter that is a documented difference (exit 0);
    from a reference scheduler, a finding (exit 1)."""
    _register_factory(monkeypatch, "like-vllm", lambda config: _LiftsThresholdWhenAlone(config, expose_state))
    result = invoke("--scheduler", "like-vllm", "--against", "vllm-v1", "--examples", "20", "--seed", "0",
                    "--set", "long_prefill_token_threshold=1", "--set", "enable_chunked_prefill=true")
    if expose_state:
        assert result.exit_code == 1 and "FINDING like-vllm long-prefill-threshold" in result.output
    else:
        assert result.exit_code == 0, result.output
        assert "documented difference: like-vllm long-prefill-threshold" in result.output
        assert " 0 documented differences" not in result.output


@functools.cache
def _drawn_scenarios(count: int = 200) -> list:
    """``count`` scenarios of ``schedspec diff``'s strategy, seeded (issue 24's generator checks)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    from schedspec.commands.diff import scenarios

    drawn = []

    @hypothesis_seed(24)
    @settings(max_examples=count, database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(scenarios({}))
    def collect(scenario) -> None:
        drawn.append(scenario[1])

    collect()
    return drawn


def test_generated_ids_are_independent_of_arrival_and_workload_order() -> None:
    """Issue 24: the ids are a random permutation, so an order that falls back to the id where it should
    follow the arrival shows up: often a request that arrives later (or, in one step, is added later)
    has the smaller id. Ids in workload order (``r0``, ``r1`` ...), as before, fail both counts."""
    later_smaller = added_later_smaller = 0
    for requests in _drawn_scenarios():
        ids = [r.request_id for r in requests]
        assert sorted(ids) == sorted(f"r{k}" for k in range(len(requests)))  # still r0 .. r{n-1}
        for k, first in enumerate(requests):
            for second in requests[k + 1:]:
                if second.request_id < first.request_id:
                    if second.arrival_step == first.arrival_step:
                        added_later_smaller += 1
                    later = second if second.arrival_step > first.arrival_step else first
                    earlier = first if later is second else second
                    later_smaller += later.request_id < earlier.request_id
    assert later_smaller > 100 and added_later_smaller > 10, (later_smaller, added_later_smaller)


def test_generated_priorities_are_often_equal() -> None:
    """Two requests of one scenario share a priority in well over a quarter of the pairs (what 0..3
    drawn uniformly gives): where they do, vLLM's priority order falls back to the arrival time."""
    pairs = equal = 0
    for requests in _drawn_scenarios():
        for k, first in enumerate(requests):
            for second in requests[k + 1:]:
                pairs += 1
                equal += first.priority == second.priority
    assert pairs > 500 and equal / pairs > 0.35, (equal, pairs)


def test_remote_kv_scenarios_exercise_loads_failures_and_sends_and_vllm_v1_agrees_with_itself() -> None:
    """``--remote-kv``: the generated workloads load, fail loads and send (with prefix caching off), and the
    profile compared with itself over them finds nothing (every step of both checked against the spec)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    from schedspec.commands.diff import scenarios

    drawn: list = []

    @hypothesis_seed(5)
    @settings(max_examples=80, database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(scenarios({}, remote_kv=True))
    def collect(scenario) -> None:
        drawn.append(scenario)

    collect()
    requests = [r for config, rs, _ in drawn if not config.enable_prefix_caching for r in rs]
    assert sum(1 for r in requests if r.num_external_computed_tokens) > 30
    assert sum(1 for r in requests if r.kv_load_invalid_block is not None) > 5
    assert sum(1 for r in requests if r.kv_send) > 10
    assert not any(r.num_external_computed_tokens or r.kv_send for config, rs, _ in drawn
                   if config.enable_prefix_caching for r in rs)
    result = invoke("--scheduler", "vllm-v1", "--against", "vllm-v1", "--examples", "40", "--seed", "4",
                    "--remote-kv")
    assert result.exit_code == 0, result.output
    assert "0 divergent (unexplained), 0 documented differences, 0 findings, 0 unsupported" in result.output


def _step(step: int, scheduled: dict[str, tuple[int, int]], num_running: int, **fields):
    """A StepRecord for the recognizer tests: ``scheduled`` maps id -> (num_computed_tokens, tokens), all decode
    tokens (a prefill count does not matter to the recognizer)."""
    from schedspec.spec.trace import ScheduledTokens, StepRecord

    items = tuple(ScheduledTokens(r, c, 0, n) for r, (c, n) in scheduled.items())
    return StepRecord(step=step, start_time=0.0, duration=0.0, scheduled=items, num_running=num_running, **fields)


def _failed_load_run(invalid_block: int = 10, full: bool = True, scheduled_c: bool = False):
    """An engine's run in which request ``c``'s remote load (blocks 10, 11) lands after step 1, failed from
    ``invalid_block``; ``a`` and ``b`` run, taking both sequence slots when ``full`` (``max_num_seqs=2``); at step 3
    the engine preempts ``b``."""
    from schedspec.spec.config import SchedulerConfig

    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=2,
                             max_model_len=64)
    running = 2 if full else 1
    ab = {"a": (8, 1), "b": (8, 1)} if full else {"a": (8, 1)}
    records = [
        _step(0, {"a": (0, 8), "b": (0, 8)} if full else {"a": (0, 8)}, running, kv_loads={"c": 8},
              blocks_allocated={"c": (10, 11)}),
        _step(1, ab, running, finished_recving=("c",), invalid_block_ids=(invalid_block,)),
        _step(2, {**ab, **({"c": (0, 8)} if scheduled_c else {})}, running),
        _step(3, {"a": (9, 1)}, 1, preempted=("b",)),
    ]
    return config, records


def test_the_failed_load_recognizer_matches_only_a_failed_load_held_by_vllm() -> None:
    """``failed_load_held`` (docs/engines.md, remote KV): the engine preempts where the profile does not while a
    load that failed from its first block waits, unreached by vLLM's waiting loop since the report. Any other
    divergence, or the same one with the blocks already freed in vLLM, is not matched."""
    from schedspec.commands.diff import FAILED_LOAD_HELD, ComparedStep, failed_load_held

    config, records = _failed_load_run()
    engine = ComparedStep.of(records[3], exact_blocks=False)
    profile = ComparedStep({"a": (9, 1, 0), "b": (9, 1, 0)}, frozenset(), frozenset(), frozenset())
    assert failed_load_held(config, records, 3, engine, profile) == FAILED_LOAD_HELD
    # the profile preempting more than the engine, or the same: not this difference
    assert failed_load_held(config, records, 3, profile, engine) is None
    assert failed_load_held(config, records, 3, engine, engine) is None
    # the engine scheduled something the profile did not
    other = ComparedStep({"b": (9, 1, 0)}, frozenset(), frozenset(), frozenset())
    assert failed_load_held(config, records, 3, engine, other) is None
    # a load that failed from its second block keeps its blocks in the spec too
    config, records = _failed_load_run(invalid_block=11)
    assert failed_load_held(config, records, 3, engine, profile) is None
    # a free sequence slot at step 2: vLLM's waiting loop reached c and freed its blocks
    config, records = _failed_load_run(full=False)
    assert failed_load_held(config, records, 3, engine, profile) is None
    # c was admitted at step 2 (its blocks freed first)
    config, records = _failed_load_run(scheduled_c=True)
    assert failed_load_held(config, records, 3, engine, profile) is None
    # no failed load at all: a plain preemption divergence
    config, records = _failed_load_run()
    records = [attrs.evolve(r, finished_recving=(), invalid_block_ids=()) for r in records]
    assert failed_load_held(config, records, 3, engine, profile) is None


def test_the_failed_load_recognizer_matches_an_admission_stopped_at_a_holder_ahead() -> None:
    """The other form of the failed-load difference (``diff --remote-kv --seed 2`` example 178): vLLM's waiting
    loop stops at a landed load ahead of the failed one in ``kv_holding_waiting`` (the failed load's blocks still
    held, the whole sequence does not fit), the profile admits it. Not matched when the first request only the
    profile admits holds nothing, or loaded after the failed one, or when the engine scheduled an item differently."""
    from schedspec.commands.diff import FAILED_LOAD_HELD, ComparedStep, failed_load_held

    config, records = _failed_load_run()
    # d's load (blocks 12..15) started at step 0 before c's and landed after step 0; a and b end after step 2
    records[0] = attrs.evolve(records[0], kv_loads={"d": 8, "c": 8},
                              blocks_allocated={"d": (12, 13, 14, 15), "c": (10, 11)}, finished_recving=("d",))
    records[2] = attrs.evolve(records[2], num_running=0)
    records[3] = _step(3, {}, 0)
    engine = ComparedStep.of(records[3], exact_blocks=False)
    profile = ComparedStep({"d": (8, 8, 2)}, frozenset(), frozenset(), frozenset())
    assert failed_load_held(config, records, 3, engine, profile) == FAILED_LOAD_HELD
    # the profile admitted c itself, or a request that holds nothing: not this difference
    fresh = ComparedStep({"e": (0, 8, 2)}, frozenset(), frozenset(), frozenset())
    assert failed_load_held(config, records, 3, engine, fresh) is None
    # d's load started after c's: c is ahead of it, vLLM's loop reached c first
    late = [attrs.evolve(records[0], kv_loads={"c": 8, "d": 8})] + records[1:]
    assert failed_load_held(config, late, 3, engine, profile) is None
    # the engine scheduled a common item differently
    records[3] = _step(3, {"d": (8, 4)}, 1)
    other = ComparedStep({"d": (8, 8, 2), "e": (0, 8, 2)}, frozenset(), frozenset(), frozenset())
    assert failed_load_held(config, records, 3, ComparedStep.of(records[3], exact_blocks=False), other) is None


def test_a_profile_excuses_only_the_engine_it_reproduces():
    """A profile's documented differences apply between it and an adapter of its own engine only: vLLM is never
    excused by the SGLang profile's findings, nor SGLang by the vllm-v1 profile's divergences."""
    from schedspec.commands.diff import PROFILES, pair_profile

    assert pair_profile("vllm", "vllm-v1") is PROFILES["vllm-v1"]
    assert pair_profile("vllm-v1@0.33", "vllm@0.33") is PROFILES["vllm-v1@0.33"]
    assert pair_profile("sglang", "sglang-profile") is PROFILES["sglang-profile"]
    assert pair_profile("sglang", "vllm-v1") is None
    assert pair_profile("vllm", "sglang-profile") is None
    assert pair_profile("nanovllm", "vllm-v1") is None
    assert pair_profile("fcfs", "vllm-v1") is None
