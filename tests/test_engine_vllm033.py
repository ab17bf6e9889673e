"""The ``vllm@0.33`` adapters: vLLM 0.33.0's own scheduler (the pinned wheel's Python files in
``.vllm033``, run by ``.venv-vllm``'s Python, :mod:`schedspec.engines.vllm` *Versions*) checked against
the spec with every check on, as ``tests/test_engine_vllm.py`` checks 0.32:

- the bundled scenarios vLLM agrees with replayed on ``vllm@0.33`` (every expectation), and through the
  wrapper that compares vLLM's own view with the spec's state after every arrival, abort and step;
- the findings' cases replayed on 0.33: each must still show vLLM's behaviour (docs/findings say
  which versions have each fault);
- the one decision 0.33 changed in the spec's scope, on the real engines: a priority request that
  preempts itself lets the running loop go on (0.32 ``break``\\s), hand-worked, and the ``vllm-v1``
  profiles of each version plan the same steps as their engine;
- the Hypothesis state machine on both policies and async scheduling; ``schedspec diff`` of each
  adapter against its profile;
- which version ran: the worker's reported version is checked (a deliberate break: 0.32's files under
  the 0.33 name are refused) and shown in the run conditions (run record, lab and replay output).

Like the 0.32 tests, never skipped for a missing engine: ``scripts/engines_setup.sh`` (run by
``scripts/test.sh``) builds ``.vllm033``; without it these fail saying how to build it.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from test_engine_vllm import (  # the 0.32 tests' helpers, shared (tests/ is on sys.path under pytest)
    AGREEING,
    CASES,
    FINDINGS,
    VllmAsyncMachine,
    VllmMachine,
    _replay_checked,
)

from schedspec.engines.vllm import EngineUnavailable, VllmAsyncScheduler, VllmScheduler
from schedspec.reference.engine import Engine
from schedspec.reference.scenarios import load_scenario, replay
from schedspec.reference.scheduler import UnsupportedFeature, make_scheduler
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.workload import RequestSpec

CONFIG = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32)


def test_the_names_choose_the_version() -> None:
    """``@0.33`` runs 0.33.0 (as the worker reports it), the plain names stay 0.32.0."""
    for name, version in [("vllm@0.33", "0.33.0"), ("vllm-priority@0.33", "0.33.0"), ("vllm-async@0.33", "0.33.0"),
                          ("vllm-priority-async@0.33", "0.33.0"), ("vllm", "0.32.0"), ("vllm-priority@0.32", "0.32.0")]:
        scheduler = make_scheduler(name, CONFIG)
        assert scheduler.engine == {"name": "vllm", "version": version}, name
        assert scheduler.name == name.removesuffix("@0.32")
        scheduler.close()


@pytest.mark.parametrize("stem", AGREEING)
def test_scenario_replays_on_vllm_033(stem: str) -> None:
    result = replay(load_scenario(CASES[stem]), "vllm@0.33")
    failed = [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]
    assert not failed, failed
    assert result.run.engine == {"name": "vllm", "version": "0.33.0"}


@pytest.mark.parametrize("stem", AGREEING + ["priority-preempts-at-seq-cap"])
def test_engine_view_equals_spec_state_after_every_step_033(stem: str) -> None:
    name = "vllm-priority@0.33" if stem.startswith("priority") else "vllm@0.33"
    scheduler, result = _replay_checked(CASES[stem], name)
    assert result.ok, [str(v) for v in result.violations[:5]]
    assert scheduler.mismatches == []
    assert scheduler.compared >= result.num_steps


@pytest.mark.parametrize("stem", FINDINGS)
def test_finding_still_reproduces_on_033(stem: str) -> None:
    """The finding's case (its ``expect`` is vLLM 0.32's behaviour, a finding included) passes on the
    same adapter at 0.33: the fault is still there."""
    scenario = load_scenario(CASES[stem])
    result = replay(scenario, f"{scenario.scheduler}@0.33")
    failed = [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]
    assert not failed, failed


# ------------------------------------------------- the decision that changed: continue, not break
SELF_PREEMPTION = SchedulerConfig(block_size=4, num_kv_blocks=3, max_num_batched_tokens=16, max_num_seqs=4,
                                  max_model_len=32)
SELF_PREEMPTION_REQUESTS = [RequestSpec("A", 3, 8, arrival_step=0, priority=3),
                            RequestSpec("B", 8, 4, arrival_step=1, priority=0)]
"""Worked by hand (``Scheduler.schedule``): step 0 admits A (3 tokens, 1 block); step 1 decodes A (4
tokens, still 1 block) and admits B (8 tokens, 2 blocks: the cache is full). Step 2: A (first in
``self.running``) needs a 2nd block for its 5th token, none is free, the least urgent running request
is A itself: A preempts itself. 0.32 ``break``\\s (B gets no token); 0.33 ``continue``\\s: B needs a 3rd
block for its 9th token and takes the one A freed."""


def _steps(name: str):
    config = SELF_PREEMPTION
    result = Engine(make_scheduler(name, config), config, properties=()).run(SELF_PREEMPTION_REQUESTS, max_steps=100)
    assert result.ok, [str(v) for v in result.violations[:3]]
    assert set(result.state.finished) == {"A", "B"}
    return [([(s.request_id, s.num_computed_tokens, s.num_tokens) for s in r.scheduled], list(r.preempted))
            for r in result.records]


def test_a_self_preempting_priority_request_no_longer_ends_the_running_phase() -> None:
    before, after = _steps("vllm-priority@0.32"), _steps("vllm-priority@0.33")
    assert before[:3] == after[:2] + [([], ["A"])]
    assert before[:2] == [([("A", 0, 3)], []), ([("A", 3, 1), ("B", 0, 8)], [])]
    assert before[2] == ([], ["A"])  # 0.32: nothing scheduled in step 2
    assert after[2] == ([("B", 8, 1)], ["A"])  # 0.33: B decodes in step 2 on A's freed block


def test_each_profile_plans_its_versions_steps() -> None:
    """``vllm-v1-priority`` follows 0.32, ``vllm-v1-priority@0.33`` 0.33, on the hand-worked case."""
    assert _steps("vllm-v1-priority") == _steps("vllm-priority@0.32")
    assert _steps("vllm-v1-priority@0.33") == _steps("vllm-priority@0.33")


# ------------------------------------------------------------------------------- the machine
class Vllm033Machine(VllmMachine):
    """:class:`VllmMachine` (engine view compared after every rule) on vLLM 0.33."""

    @classmethod
    def build_scheduler(cls, config):
        return VllmScheduler(config, cls.policy, "0.33")


class Vllm033PriorityMachine(Vllm033Machine):
    policy = "priority"


class Vllm033AsyncMachine(VllmAsyncMachine):
    @classmethod
    def build_scheduler(cls, config):
        return VllmAsyncScheduler(config, cls.policy, "0.33")


MACHINE_EXAMPLES = int(os.environ.get("SCHEDSPEC_VLLM_EXAMPLES", "30"))
"""Examples per machine (half the 0.32 file's default: the 0.32 machines cover the shared mapping)."""


@pytest.mark.parametrize("machine", [Vllm033Machine, Vllm033PriorityMachine, Vllm033AsyncMachine],
                         ids=["fcfs", "priority", "fcfs-async"])
def test_state_machine_033(machine) -> None:
    run_state_machine_as_test(machine, settings=settings(max_examples=MACHINE_EXAMPLES, stateful_step_count=30))


@pytest.mark.parametrize("policy", ["vllm", "vllm-priority"])
def test_diff_vllm_033_against_its_profile_has_no_unexplained_divergence(policy: str) -> None:
    from click.testing import CliRunner

    from schedspec.cli import cli

    against = "vllm-v1@0.33" if policy == "vllm" else "vllm-v1-priority@0.33"
    result = CliRunner().invoke(cli, ["diff", "--scheduler", f"{policy}@0.33", "--against", against,
                                      "--examples", "150", "--seed", "20261202"], catch_exceptions=False)
    assert result.exit_code == 0, result.output[-3000:]
    assert "150 examples" in result.output and "0 divergent (unexplained)" in result.output
    assert "0 findings" in result.output


# ------------------------------------------------------------------- which version ran
def test_a_worker_with_the_wrong_version_is_refused(monkeypatch) -> None:
    """A deliberate break: 0.32's own files put ahead under the 0.33 name; the worker imports 0.32.0
    and the adapter refuses to run it as 0.33."""
    from schedspec.engines import vllm as adapter

    python = adapter.vllm_python()
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setenv("SCHEDSPEC_VLLM033_PATH", site)
    with pytest.raises(EngineUnavailable, match=r"imported vllm 0\.32\.0 .*expected 0\.33\.0"):
        make_scheduler("vllm@0.33", CONFIG)


def test_missing_033_files_say_how_to_build_them(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SCHEDSPEC_VLLM033_PATH", str(tmp_path / "absent"))
    with pytest.raises(EngineUnavailable, match="engines_setup.sh"):
        make_scheduler("vllm-priority@0.33", CONFIG)


def test_the_version_is_in_the_run_conditions() -> None:
    """``schedspec lab --json`` records ``conditions.engine`` (``null`` for a reference scheduler) and
    prints it among the run conditions; ``schedspec replay`` names it after the scheduler."""
    from click.testing import CliRunner

    from schedspec.cli import cli

    runner = CliRunner()
    result = runner.invoke(cli, ["lab", "--compare", "fcfs,vllm@0.33", "--max-requests", "20", "--json"],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    engines = {r["conditions"]["scheduler"]: r["conditions"]["engine"] for r in json.loads(result.stdout)}
    assert engines == {"fcfs": None, "vllm@0.33": {"name": "vllm", "version": "0.33.0"}}
    shown = runner.invoke(cli, ["lab", "--scheduler", "vllm@0.33", "--max-requests", "5"], catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert any("engine" in line and "vllm 0.33.0" in line for line in shown.output.splitlines()), shown.output
    # in-process: the replay reuses the 0.33 worker the lab runs above started (a subprocess started its own)
    replayed = runner.invoke(cli, ["replay", "-q", "--scheduler", "vllm-priority@0.33",
                                   str(CASES["kv-pressure-no-thrash"])], catch_exceptions=False)
    assert replayed.exit_code == 0, replayed.output
    assert "on vllm-priority@0.33 (vllm 0.33.0)" in replayed.stdout


def test_the_prefill_cadence_holds_on_033_and_is_refused_by_032() -> None:
    """vLLM 0.33's local prefill cadence (``prefill_schedule_interval``), on the real scheduler: the bundled
    scenario (B held through steps 1 and 2, admitted at step 3) meets every expectation and vLLM's view equals
    the spec's state after every step; 0.32 obeys the option only under a data-parallel engine core, so
    its adapter refuses it before starting vLLM (exit 3)."""
    stem = "limit-prefill-cadence-holds-prefills"
    scheduler, result = _replay_checked(CASES[stem], "vllm@0.33")  # one vLLM start: view and spec compared
    assert result.ok, [str(v) for v in result.violations[:3]]
    assert scheduler.mismatches == [] and scheduler.compared >= result.num_steps
    admitted = {s.request_id: r.step for r in reversed(result.records) for s in r.scheduled}
    assert admitted == {"A": 0, "B": 3}  # a cadence-blind scheduler admits B at step 1
    config = SchedulerConfig.from_dict(load_scenario(CASES[stem]).config)
    for name in ("vllm", "vllm-priority@0.32", "vllm-async@0.33"):
        with pytest.raises(UnsupportedFeature, match="prefill_schedule_interval=3"):
            make_scheduler(name, config)
