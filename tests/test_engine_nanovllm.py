"""The nano-vLLM adapter (``schedspec.engines.nanovllm``) against the spec.

- how it imports and what it refuses;
- its plan conversion on a run worked out by hand from nano-vLLM's ``Scheduler.schedule``;
- every bundled scenario it can express, replayed through the engine loop (every plan checked against
  the spec) with the engine's own view (``engine_view``) compared with the spec's state after every
  arrival and every step, and the confirmed findings (docs/findings/nanovllm-*.md) reproduced;
- the Hypothesis stateful machine of :mod:`schedspec.testing` against the adapter, plus the engine
  view after every step: once unfiltered (it must find the decode-preemption fault by itself), and
  once with examples that reach that known fault discarded, so that it searches for other faults.

The engine is required, not optional: scripts/test.sh installs it (engines/requirements-nanovllm.txt).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping

import attrs
import pytest
from hypothesis import HealthCheck, Phase, event, reject, settings
from hypothesis.stateful import run_state_machine_as_test

from schedspec.engines.nanovllm import NanoVllmScheduler
from schedspec.reference.engine import Engine, ViolationFound
from schedspec.reference.kv_connector import uses_kv_connector
from schedspec.reference.scenarios import bundled_scenarios, load_scenario, replay
from schedspec.reference.scheduler import EngineFault, EngineView, UnsupportedFeature, make_scheduler
from schedspec.spec.admission import rejection_reason
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.request import Request
from schedspec.spec.state import ScheduledRequest, SchedulerState, StepPlan
from schedspec.spec.transitions import abort_request, add_request, apply_plan
from schedspec.spec.workload import RequestSpec
from schedspec.strategies import scheduler_configs
from schedspec.testing import SchedulerStateMachine, SpecViolation


def _config(**changes) -> SchedulerConfig:
    base = dict(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=16,
                enable_chunked_prefill=False)
    base.update(changes)
    return SchedulerConfig(**base)


def view_mismatches(view: EngineView, state: SchedulerState) -> list[str]:
    """Fields where the engine's view differs from the spec state's. Queues are compared as multisets
    (sorted lists), so a request the engine holds twice is a difference."""
    spec = EngineView.of_state(state)
    found = []
    for field in ("num_free_blocks", "block_tables", "num_computed_tokens"):
        if getattr(view, field) != getattr(spec, field):
            found.append(f"{field}: engine {getattr(view, field)} spec {getattr(spec, field)}")
    for field in ("waiting", "running"):
        if sorted(getattr(view, field)) != sorted(getattr(spec, field)):
            found.append(f"{field}: engine {getattr(view, field)} spec {getattr(spec, field)}")
    return found


class ViewChecked:
    """Wraps the adapter for the engine loop: keeps its own spec state (by the spec's transitions) and
    records, after every arrival, abort and step, where ``engine_view()`` differs from it. (The engine
    loop will do this itself; until then this is how the tests compare.)"""

    def __init__(self, inner: NanoVllmScheduler, config: SchedulerConfig) -> None:
        self.inner, self.config = inner, config
        self.name, self.guarantees, self.state = inner.name, inner.guarantees, None
        self.shadow = SchedulerState.initial(config)
        self.mismatches: list[tuple[int, list[str]]] = []  # (step just done, differences)

    def _compare(self) -> None:
        found = view_mismatches(self.inner.engine_view(), self.shadow)
        if found:
            self.mismatches.append((self.shadow.step - 1, found))

    def add_request(self, request: Request) -> None:
        self.inner.add_request(request)
        self.shadow = add_request(self.shadow, request)
        self._compare()

    def abort_request(self, request_id: str) -> None:
        self.inner.abort_request(request_id)
        self.shadow = abort_request(self.shadow, request_id)
        self._compare()

    def schedule(self) -> StepPlan:
        return self.inner.schedule()

    def update(self, plan: StepPlan, sampled: Mapping[str, int]) -> tuple[str, ...]:
        finished = self.inner.update(plan, sampled)
        self.shadow = apply_plan(self.shadow, plan, sampled, self.config).state
        self._compare()
        return finished


# ------------------------------------------------------------------------------ import, config
def test_engine_modules_import_without_the_package_init():
    code = (
        "import sys\n"
        "import schedspec.reference.scheduler as s\n"
        "assert 'schedspec.engines.nanovllm' not in sys.modules, 'registry imported the adapter eagerly'\n"
        "from schedspec.spec.config import SchedulerConfig\n"
        "a = s.make_scheduler('nanovllm', SchedulerConfig(4, 8, 16, 4, 16, enable_chunked_prefill=False))\n"
        "print(type(a).__name__, 'nanovllm.llm' in sys.modules, 'nanovllm.engine.model_runner' in sys.modules,\n"
        "      hasattr(sys.modules['nanovllm'], 'LLM'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["NanoVllmScheduler", "False", "False", "False"], result.stderr



def test_a_missing_or_other_engine_version_is_unsupported(monkeypatch):
    import importlib.metadata

    from schedspec.engines import nanovllm

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "20250101")
    with pytest.raises(UnsupportedFeature, match="20260210, found 20250101"):
        nanovllm.load_engine()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(UnsupportedFeature, match="requirements-nanovllm.txt"):
        make_scheduler("nanovllm", _config())

@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"enable_prefix_caching": True}, "prefix caching"),
        ({"block_size": 1}, "block_size"),
        ({"enable_chunked_prefill": True, "max_num_batched_tokens": 8}, "chunked prefill"),
        ({"enable_chunked_prefill": True, "long_prefill_token_threshold": 4}, "long_prefill_token_threshold"),
    ],
)
def test_configs_it_cannot_run_are_refused(changes, needle):
    with pytest.raises(UnsupportedFeature, match=needle):
        make_scheduler("nanovllm", _config(**changes))


def test_chunked_prefill_config_is_accepted_when_every_prompt_fits_one_step():
    adapter = make_scheduler("nanovllm", _config(enable_chunked_prefill=True, long_prefill_token_threshold=16))
    assert isinstance(adapter, NanoVllmScheduler)


def test_block_size_is_per_instance_and_the_engine_class_is_untouched():
    from schedspec.engines.nanovllm import load_engine

    small, large = NanoVllmScheduler(_config(block_size=2)), NanoVllmScheduler(_config(block_size=8))
    for adapter in (small, large):
        adapter.add_request(RequestSpec(f"r{adapter.config.block_size}", 9, 2).to_request(0))
    plans = [small.schedule(), large.schedule()]
    assert [len(p.scheduled[0].new_block_ids) for p in plans] == [5, 2]  # ceil(9 / 2), ceil(9 / 8)
    assert load_engine().Sequence.block_size == 256


# ------------------------------------------------------------------------------ conversion
def test_plans_of_a_simple_run_worked_out_by_hand():
    """A (prompt 5, 3 outputs) and B (prompt 3, 2 outputs), block_size 4, 8 blocks. nano-vLLM prefills
    both in step 0 (A takes blocks 0, 1; B takes 2: free blocks are handed out from the front), decodes
    both in step 1 (no new block: A's 6th and B's 4th token still fit), B ends with its 2nd output;
    step 2 decodes A alone, which ends with its 3rd."""
    config = _config()
    adapter = NanoVllmScheduler(config)
    state = SchedulerState.initial(config)
    for spec in (RequestSpec("A", 5, 3), RequestSpec("B", 3, 2)):
        adapter.add_request(spec.to_request(0))
        state = add_request(state, spec.to_request(0))
    expected = [
        (StepPlan((ScheduledRequest("A", 0, 5, (0, 1)), ScheduledRequest("B", 0, 3, (2,)))), ()),
        (StepPlan((ScheduledRequest("A", 5, 1), ScheduledRequest("B", 3, 1))), ("B",)),
        (StepPlan((ScheduledRequest("A", 6, 1),)), ("A",)),
    ]
    for step, (plan_wanted, finished_wanted) in enumerate(expected):
        plan = adapter.schedule()
        assert plan == plan_wanted, f"step {step}"
        assert adapter.schedule() is plan  # schedule() again before update(): same plan, engine untouched
        sampled = {item.request_id: 7 for item in plan.scheduled}
        assert adapter.update(plan, sampled) == finished_wanted
        state = apply_plan(state, plan, sampled, config).state
        assert view_mismatches(adapter.engine_view(), state) == []
    assert adapter.engine_view().num_free_blocks == 8


def test_front_end_rejects_and_caps_at_max_model_len():
    """A prompt longer than max_model_len is rejected in the next plan without reaching the engine; a
    request asking for more outputs than max_model_len leaves ends where the spec ends it."""
    config = _config(max_model_len=8, max_num_batched_tokens=8)
    adapter = ViewChecked(NanoVllmScheduler(config), config)
    run = Engine(adapter, config).run([RequestSpec("long", 9, 1, arrival_step=0),
                                       RequestSpec("grows", 6, 50, arrival_step=0)])
    assert run.ok, [str(v) for v in run.violations]
    assert run.records[0].rejected.keys() == {"long"}
    grows = run.state.finished["grows"]
    assert (grows.finish_reason, len(grows.output_token_ids)) == ("max_model_len", 2)
    assert adapter.mismatches == []



def test_prefix_groups_share_no_block_in_the_engine():
    """Two requests with an 8-token shared prefix (two full blocks): nano-vLLM's always-on prefix cache
    would reuse those blocks if it saw the workload's ids (shown with the engine directly); the adapter's
    own ids keep every request's blocks its own, as the spec without prefix caching says."""
    config = _config()
    adapter = ViewChecked(NanoVllmScheduler(config), config)
    specs = [RequestSpec(r, 10, 2, arrival_step=step, prefix_group="g", prefix_len=8) for r, step in (("A", 0), ("B", 1))]
    run = Engine(adapter, config).run(specs)
    assert run.ok and adapter.mismatches == []
    admitted = [item for record in run.records for item in record.scheduled if item.prefill_tokens]
    assert [(i.request_id, i.num_computed_tokens, i.prefill_tokens) for i in admitted] == [("A", 0, 10), ("B", 0, 10)]

    raw = NanoVllmScheduler(config)  # the same prompts given to the engine unchanged
    first, second = (raw._sequence_class(list(spec.to_request(0).prompt_token_ids)) for spec in specs)
    raw.engine.add(first)
    raw.engine.schedule()
    raw.engine.add(second)
    raw.engine.schedule()
    assert second.num_cached_tokens == 8

def test_abort_of_a_request_the_engine_holds_is_unsupported():
    adapter = NanoVllmScheduler(_config())
    adapter.add_request(RequestSpec("A", 4, 2).to_request(0))
    adapter.add_request(RequestSpec("empty", 0, 2).to_request(0))  # rejected at the front end
    adapter.abort_request("empty")  # not in the engine: fine
    adapter.abort_request("never-added")
    with pytest.raises(UnsupportedFeature, match="abort"):
        adapter.abort_request("A")


def test_a_view_mismatch_is_seen_by_the_comparison():
    """The comparison used throughout can fail: a spec state one block short differs."""
    adapter = NanoVllmScheduler(_config())
    adapter.add_request(RequestSpec("A", 4, 2).to_request(0))
    state = add_request(SchedulerState.initial(_config()), RequestSpec("A", 4, 2).to_request(0))
    assert view_mismatches(adapter.engine_view(), state) == []
    assert view_mismatches(adapter.engine_view(), attrs.evolve(state, free_block_ids=state.free_block_ids[1:]))



def test_a_broken_conversion_is_caught_by_the_engine_loop():
    """Deliberate break: an adapter that forgets to report the blocks the engine allocated is caught by
    the spec's rules (the checks this file relies on can fail)."""

    class Forgetful(NanoVllmScheduler):
        def schedule(self):
            plan = super().schedule()
            return attrs.evolve(plan, scheduled=tuple(attrs.evolve(i, new_block_ids=()) for i in plan.scheduled))

    config = _config()
    with pytest.raises(ViolationFound) as caught:
        Engine(Forgetful(config), config, stop_on_violation=True).run([RequestSpec("A", 5, 3, arrival_step=0)])
    assert "block-table-covers" in {v.name for v in caught.value.violations}

# ------------------------------------------------------------------------------ scenarios
PREEMPTION_CRASH = ("may_append", "IndexError")
NEVER_FITS_CRASH = ("assert scheduled_seqs", "AssertionError")
# The plan breaks the rule; the state after it breaks the invariant that the rule protects.
SEQUENCE_CAP = ["running-within-max-num-seqs", "sequence-cap"]
KNOWN = {
    # Confirmed findings (docs/findings/): the crash (with the view mismatch one step before it), or the
    # only rule the run breaks.
    "nanovllm-decode-preemption-leaves-victim-running": PREEMPTION_CRASH,
    "kv-pressure-no-thrash": PREEMPTION_CRASH,
    "preempt-then-prefix-hit": PREEMPTION_CRASH,
    "nanovllm-never-fits-blocks-queue-then-crashes": NEVER_FITS_CRASH,
    "prompt-larger-than-kv-cache": NEVER_FITS_CRASH,
    "nanovllm-max-num-seqs-caps-batch-not-running-set": SEQUENCE_CAP,
    "eos-frees-slot-early": SEQUENCE_CAP,
    "slot-freed-is-reused": SEQUENCE_CAP,
    "priority-preempts-at-seq-cap": SEQUENCE_CAP,
    "priority-preemption-must-admit": SEQUENCE_CAP,
    # vLLM's findings' cases: nano-vLLM has the never-fits fault too.
    "counterexample-vllm-impossible-request-blocks-queue": NEVER_FITS_CRASH,
    "counterexample-vllm-outgrown-request-blocks-queue": NEVER_FITS_CRASH,
    "counterexample-vllm-priority-no-preempt-at-seq-cap": SEQUENCE_CAP,
    # the priority-inversion cases fill max_num_seqs too
    "counterexample-fcfs-priority-inversion": SEQUENCE_CAP,
    "counterexample-priority-inversion-second-urgent": SEQUENCE_CAP,
    "counterexample-sglang-priority-preemption-refused": SEQUENCE_CAP,  # SGLang's finding's case: 2 slots filled
}
SCENARIOS = bundled_scenarios()


def _nano_config(scenario) -> SchedulerConfig:
    """The scenario's config as nano-vLLM can run it: chunked prefill off with a budget of at least
    max_model_len (a whole prompt per step, which is what nano-vLLM does anyway) and prefix caching off
    (the adapter's prompt ids share no block). Scenarios meant for nanovllm are run unchanged."""
    raw = dict(scenario.config)
    if scenario.scheduler != "nanovllm":
        raw.update(enable_chunked_prefill=False, enable_prefix_caching=False,
                   max_num_batched_tokens=max(raw["max_num_batched_tokens"], raw["max_model_len"]))
    return SchedulerConfig.from_dict(raw)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_bundled_scenario_through_the_engine_loop(path):
    scenario = load_scenario(path)
    if scenario.expect.get("config_error"):
        pytest.skip("a config-error scenario: no run (the config is refused before any scheduler exists)")
    config = _nano_config(scenario)
    if config.num_speculative_tokens:
        with pytest.raises(UnsupportedFeature, match="no speculative decoding"):
            NanoVllmScheduler(config)
        pytest.skip("a speculative-decoding scenario: nano-vLLM has none, and its adapter refuses it (exit 3)")
    if config.limits_on:
        with pytest.raises(UnsupportedFeature, match="no such limit"):
            NanoVllmScheduler(config)
        pytest.skip(f"a scenario of a per-step limit ({config.limits_on[0]}) nano-vLLM lacks: its adapter refuses it")
    if any(r.grammar_compile_steps is not None for r in scenario.requests):
        with pytest.raises(UnsupportedFeature, match="no grammar wait"):
            Engine(NanoVllmScheduler(config), config).run(scenario.requests, max_steps=10)
        pytest.skip("a structured-output scenario: nano-vLLM has no grammar wait, and its adapter refuses it")
    if uses_kv_connector(scenario.requests):
        with pytest.raises(UnsupportedFeature, match="remote KV"):
            Engine(NanoVllmScheduler(config), config).run(scenario.requests, max_steps=10)
        pytest.skip("a remote KV scenario: nano-vLLM has no KV connector, and the engine loop refuses it")
    adapter = ViewChecked(NanoVllmScheduler(config), config)
    known = KNOWN.get(scenario.name)
    try:
        run = Engine(adapter, config).run(scenario.requests, max_steps=5_000)
    except UnsupportedFeature as error:
        assert any(s.abort_at_step is not None for s in scenario.requests), error
        pytest.skip(f"has an abort, which nano-vLLM lacks: {error}")
    except EngineFault as fault:
        assert isinstance(known, tuple), f"unexpected engine crash: {fault}"
        assert all(word in str(fault) for word in known), str(fault)
        if known is PREEMPTION_CRASH:  # the victim was left in the engine's running list the step before
            assert adapter.mismatches and adapter.mismatches[0][0] == fault.step - 1, adapter.mismatches
            assert adapter.mismatches[0][1][0].startswith("running"), adapter.mismatches
        return
    assert not isinstance(known, tuple), f"{scenario.name}: the known crash did not happen"
    broken = sorted({v.name for v in run.violations})
    assert broken == (known or []), [str(v) for v in run.violations[:5]]
    assert adapter.mismatches == []
    assert not run.state.requests, "requests left live"


@pytest.mark.parametrize("path", [p for p in SCENARIOS if p.stem.startswith("nanovllm-")],
                         ids=lambda p: p.stem)
def test_finding_case_replays_the_engine_behaviour_and_fails_for_the_reference(path):
    """Each finding's case passes on nanovllm (the fault reproduces) and its finding verdict fails on
    fcfs, which does not have the fault: the expectation can fail."""
    scenario = load_scenario(path)
    assert replay(scenario).passed
    verdicts = {v.name: v for v in replay(scenario, "fcfs").verdicts}
    assert not verdicts["finding"].passed


# ------------------------------------------------------------------------------ stateful
def _machine_configs():
    """Chunked prefill off (nano-vLLM has none); block_size >= 2; max_num_seqs raised to at least
    num_kv_blocks, so the running set (each running sequence holds a block) can never exceed it and the
    known max_num_seqs difference (docs/findings) cannot mask other faults."""

    def fit(config: SchedulerConfig) -> SchedulerConfig:
        seqs = max(config.max_num_seqs, config.num_kv_blocks)
        return config.with_changes(block_size=max(2, config.block_size), max_num_seqs=seqs,
                                   max_num_batched_tokens=max(config.max_num_batched_tokens, seqs))

    return scheduler_configs(chunked_prefill=False, max_kv_blocks=12, max_model_len=32).map(fit)


class NanoVllmMachine(SchedulerStateMachine):
    """The stateful machine against the adapter, with the engine view compared after every arrival and
    step. Requests the engine can never fit (a known finding) are shrunk until they fit alone; requests
    the front end rejects (empty, max_tokens 0, longer than max_model_len) are kept. The abort rule is
    dropped (nano-vLLM has no abort)."""

    skip_known_preemption_fault = False

    @classmethod
    def build_scheduler(cls, config):
        return NanoVllmScheduler(config)

    @classmethod
    def configs(cls):
        return _machine_configs()

    abort = None  # type: ignore[assignment]  # no abort rule

    def add_request(self, prompt_len, max_tokens, eos_at_output=None, priority=0):
        config = self.config
        reason = rejection_reason(prompt_len, max_tokens, config)
        if reason is not None and "KV blocks" in reason:
            capacity = config.kv_capacity_tokens
            prompt_len = min(prompt_len, capacity)
            max_tokens = max(1, min(max_tokens, capacity + 1 - prompt_len))
        request_id = super().add_request(prompt_len, max_tokens, eos_at_output, priority)
        self._compare_view()
        return request_id

    def advance(self):
        engine = self.scheduler.engine
        try:
            plan = super().advance()
        except EngineFault:
            if self.skip_known_preemption_fault and self._victim_left_running:
                reject()
            raise
        left = {self.scheduler._request_ids.get(id(seq)) for seq in engine.running} & set(plan.preempted)
        if left:
            self._victim_left_running = True
            event("decode preemption left the victim in the running list")
            if self.skip_known_preemption_fault:
                reject()  # the known fault: this example can only end in it; look elsewhere
        self._compare_view()
        return plan

    _victim_left_running = False

    def _compare_view(self):
        found = view_mismatches(self.scheduler.engine_view(), self.shadow)
        if found:
            self._fail("state-mismatch", f"after step {self.shadow.step - 1}: " + "; ".join(found))


class AvoidKnownFault(NanoVllmMachine):
    skip_known_preemption_fault = True


QUICK = settings(max_examples=60, stateful_step_count=25, deadline=None, derandomize=True, database=None,
                 phases=(Phase.explicit, Phase.generate, Phase.shrink),
                 suppress_health_check=list(HealthCheck))


def test_stateful_machine_finds_the_decode_preemption_fault():
    """Unfiltered, the machine finds the known fault by itself: the engine's running list keeps the
    preempted request (state-mismatch), or the engine crashes on it."""
    with pytest.raises((SpecViolation, EngineFault)) as caught:  # no shrinking: the first failure will do
        run_state_machine_as_test(NanoVllmMachine, settings=settings(QUICK, phases=(Phase.explicit, Phase.generate)))
    text = str(caught.value)
    assert ("state-mismatch" in text and "running" in text) or all(w in text for w in PREEMPTION_CRASH), text


def test_stateful_machine_elsewhere_finds_nothing():
    """With the examples that reach the known fault discarded, every plan is allowed, every invariant
    holds, the engine's view equals the spec's after every step, and nothing is lost."""
    run_state_machine_as_test(AvoidKnownFault, settings=settings(QUICK, max_examples=150))



# ------------------------------------------------------------------------------ command line
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "schedspec", *args], capture_output=True, text=True, timeout=600)


def test_cli_reports_an_engine_crash_in_the_lab_as_a_failed_check():
    """The real Azure window (first 40 requests) with a 400-block cache: nano-vLLM preempts in decode,
    leaves the victim running, and would crash a step later; the lab reports it (exit 1), no traceback."""
    result = _cli("lab", "--scheduler", "nanovllm", "--set", "enable_chunked_prefill=false",
                  "--set", "max_num_batched_tokens=8192", "--set", "num_kv_blocks=400",
                  "--max-requests", "40", "--steps", "none")
    assert result.returncode == 1, result.stdout + result.stderr
    # The engine loop compares the engine's own view with the spec after every step, so the run stops
    # one step before the crash, where the preempted victim is left in nano-vLLM's running list.
    assert "state-mismatch" in result.stdout and "in the engine's running queue" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_cli_exit_codes_for_nanovllm():
    case = next(p for p in SCENARIOS if p.stem == "nanovllm-decode-preemption-leaves-victim-running")
    assert _cli("replay", "-q", str(case)).returncode == 0  # the finding reproduces
    unsupported = _cli("lab", "--scheduler", "nanovllm", "--max-requests", "5", "--steps", "none")
    assert unsupported.returncode == 3 and "chunked prefill" in unsupported.stderr
    assert "Traceback" not in unsupported.stdout + unsupported.stderr
