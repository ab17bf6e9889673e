"""The parts of the ``sglang`` adapter (``engines/sglang.py``) that run without SGLang's environment:
the front end's checks it applies itself, and how a missing or wrong environment is reported (exit 3 when
not installed, exit 2 when ``SCHEDSPEC_SGLANG_PYTHON`` names nothing). The adapter's runs are in
tests/test_engine_sglang.py, which skips without ``.venv-sglang``."""

from __future__ import annotations

import pytest

from schedspec.engines import sglang
from schedspec.reference.scheduler import EngineEnvironmentError, UnsupportedFeature
from schedspec.spec.admission import rejection_code
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.workload import RequestSpec

CONFIG = SchedulerConfig(4, 16, 64, 4, 32)  # 64 tokens of KV, max_model_len 32


def _reason(prompt_len: int, max_tokens: int) -> str | None:
    return sglang.front_end_rejection(RequestSpec("r", prompt_len, max_tokens, 0).to_request(0), CONFIG)


def test_the_front_end_refuses_what_sglang_refuses_with_the_spec_code() -> None:
    assert rejection_code(_reason(0, 4)) == "empty-prompt"
    assert rejection_code(_reason(32, 1)) == "prompt-exceeds-max-model-len"  # >= context length
    assert _reason(31, 1) is None and _reason(16, 16) is None  # 16 + 16 = 32 is the limit, allowed
    # past the context length in all: SGLang refuses; the spec would admit it and end it at max_model_len,
    # so the reason's code names the limit the spec knows (a documented difference, judged by the rule)
    assert rejection_code(_reason(16, 17)) == "prompt-exceeds-max-model-len"


def test_no_environment_is_a_missing_feature_and_a_wrong_variable_unusable_input(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(sglang.PYTHON_VARIABLE, raising=False)
    monkeypatch.setattr(sglang, "DEFAULT_PYTHON", tmp_path / "none" / "python")
    with pytest.raises(UnsupportedFeature, match="bash scripts/engines_setup.sh --only sglang"):
        sglang.SglangScheduler(CONFIG)
    monkeypatch.setenv(sglang.PYTHON_VARIABLE, str(tmp_path / "no-python"))
    with pytest.raises(EngineEnvironmentError, match="SCHEDSPEC_SGLANG_PYTHON=.*no such file"):
        sglang.SglangScheduler(CONFIG)


@pytest.mark.parametrize("changes, refused", [
    ({"enable_prefix_caching": True}, "prefix caching"),
    ({"num_speculative_tokens": 2}, "speculative decoding"),
    ({"long_prefill_token_threshold": 8}, "long_prefill_token_threshold=8"),
    ({"max_loras": 1}, "max_loras: vLLM's per-step limits"),
    ({"watermark": 0.1}, "watermark: vLLM's per-step limits"),
    ({"max_num_active_seqs": 1}, "max_num_active_seqs: vLLM's per-step limits"),
    ({"long_prefill_token_threshold_adaptive": True}, "long_prefill_token_threshold_adaptive: vLLM's"),
    ({"prefill_schedule_interval": 2}, "prefill_schedule_interval: vLLM's per-step limits"),
])
def test_features_sglang_lacks_are_refused_before_the_worker_starts(changes, refused, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(sglang, "DEFAULT_PYTHON", tmp_path / "none" / "python")  # never reached
    import attrs

    with pytest.raises(UnsupportedFeature, match=refused):
        sglang.SglangScheduler(attrs.evolve(CONFIG, **changes))


def test_cli_replay_of_a_prefix_caching_scenario_exits_3() -> None:
    """``schedspec replay --scheduler sglang`` on a scenario with prefix caching: a feature the adapter
    lacks (exit 3), refused before any worker starts."""
    import subprocess
    import sys

    from schedspec.reference.scenarios import bundled_scenarios

    case = next(p for p in bundled_scenarios() if p.stem == "preempt-then-prefix-hit")
    done = subprocess.run([sys.executable, "-m", "schedspec", "replay", "--scheduler", "sglang", str(case)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 3, done.stdout[-1000:] + done.stderr[-1000:]
    assert "prefix caching" in done.stdout + done.stderr


def test_the_adapter_waits_for_an_install_in_progress_and_reports_a_failed_one(tmp_path) -> None:
    """``wait_for_install``: scripts/test.sh builds .venv-sglang in the background and the adapter waits while
    ``.schedspec-installing`` names a running set-up; a set-up that ended without removing it (a failed
    install: its process gone, or ended and not yet reaped, as test.sh's own background job is until its
    ``wait``) is reported, not waited for."""
    import subprocess
    import sys

    marker = tmp_path / ".schedspec-installing"
    sglang.wait_for_install(tmp_path)  # no install in progress: returns at once
    # a running "install" that removes the marker when done, as setup_sglang does after its stamp
    done = subprocess.Popen([sys.executable, "-c", f"import time, os; time.sleep(1); os.remove({str(marker)!r})"])
    marker.write_text(f"{done.pid}\n")
    sglang.wait_for_install(tmp_path)
    assert not marker.exists() and done.wait(timeout=60) == 0
    # still running past the limit
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    marker.write_text(f"{running.pid}\n")
    try:
        with pytest.raises(UnsupportedFeature, match="still being installed by process"):
            sglang.wait_for_install(tmp_path, timeout_s=0.2)
    finally:
        running.kill()
    # ended (a zombie until reaped, then gone) with the marker left behind: a failed install
    for _ in ("zombie", "reaped"):
        with pytest.raises(UnsupportedFeature, match="ended without completing.*build/sglang-setup.log"):
            sglang.wait_for_install(tmp_path, timeout_s=30)  # a zombie taken for a live install: "still being ..."
        running.wait(timeout=60)
