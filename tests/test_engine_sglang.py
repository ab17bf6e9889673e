"""SGLang 0.5.23's scheduling layer (``.venv-sglang``, built by ``scripts/engines_setup.sh``) run on the
CPU with no model by ``engines/sglang_worker.py``: its environment, the first pass of its own admission and
allocation against states worked out by hand from the source (``sglang/srt/managers/schedule_policy.py``
``PrefillAdder``, ``sglang/srt/mem_cache/prefill_budget.py`` ``PrefillBudget``,
``sglang/srt/managers/scheduler_components/new_token_ratio_tracker.py``), the Hypothesis machine on the
step-by-step ``sglang`` adapter, and ``schedspec lab --scheduler sglang`` on the default window.

``scripts/test.sh`` builds the environment (2.4 GB) in the background and sets ``SCHEDSPEC_SGLANG=1``: these
tests then run (the adapter waits for an install still in progress) and a missing environment fails them.
Run by hand without the environment and without ``SCHEDSPEC_SGLANG=1`` (or with ``SCHEDSPEC_SKIP_SGLANG=1``,
the local opt-out), they skip, saying so.

Cost: everything here goes through the one SGLang worker of the test process (``engines/vllm.py``
``_worker``; the probe cases and the import check too, over its ``probe`` command and ``init`` reply), whose
start, 25-50 s on the shared 2-core machine, is mostly importing sglang; the lab run dominates the rest
(docs/engines.md, SGLang 0.5.23, *CI's time*).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = Path(os.environ.get("SCHEDSPEC_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))

pytestmark = pytest.mark.skipif(
    os.environ.get("SCHEDSPEC_SKIP_SGLANG") == "1" or (os.environ.get("SCHEDSPEC_SGLANG") != "1" and not PYTHON.exists()),
    reason="the SGLang environment (.venv-sglang, 2.4 GB) is not built (SCHEDSPEC_SKIP_SGLANG=1, or pytest run without "
           "scripts/test.sh): bash scripts/engines_setup.sh --only sglang")

# 16 pages of 4 tokens: SGLang's allocator holds 64 tokens, pages 1..16 (page 0 is padding).
POOL = {"block_size": 4, "num_kv_blocks": 16, "max_num_seqs": 4, "max_model_len": 128,
        "enable_prefix_caching": False}
CASES = [
    # A: chunked prefill, budget 8, no end-of-sequence id, radix cache off
    # (PrefillAdder.add_one_req_ignore_eos): the 10-token prompt is cut to the chunk budget (8 tokens),
    # becomes the chunked request, and the spent chunk budget stops the pass (OTHER) before r1 is tried.
    {"config": dict(POOL, max_num_batched_tokens=8, enable_chunked_prefill=True),
     "requests": [{"id": "r0", "prompt": list(range(1, 11)), "max_tokens": 5, "eos": None},
                  {"id": "r1", "prompt": list(range(11, 18)), "max_tokens": 3, "eos": None}]},
    # B: no chunking, an end-of-sequence id (PrefillAdder.add_one_req -> PrefillBudget.check_prefill):
    # admission needs prompt + max_tokens + one page < free tokens, strictly: 40 + 20 + 4 = 64 is not
    # < 64, so nothing is admitted, although 60 tokens (15 pages) fit the pool.
    {"config": dict(POOL, max_num_batched_tokens=64, enable_chunked_prefill=False),
     "requests": [{"id": "big", "prompt": list(range(1, 41)), "max_tokens": 20, "eos": 0}]},
    # C: one output token fewer: 63 < 64, admitted; its 40 prompt tokens take pages 1..10.
    {"config": dict(POOL, max_num_batched_tokens=64, enable_chunked_prefill=False),
     "requests": [{"id": "fits", "prompt": list(range(1, 41)), "max_tokens": 19, "eos": 0}]},
    # D: no end-of-sequence id and the radix cache off: PrefillAdder.add_one_req_ignore_eos, which needs
    # free - (ceil_page(prompt) + page) - max_tokens > IGNORE_EOS_RESERVE_TOKENS (1):
    # 64 - 44 - 19 = 1 is not > 1 (refused), 64 - 44 - 18 = 2 is (E, admitted).
    {"config": dict(POOL, max_num_batched_tokens=64, enable_chunked_prefill=False),
     "requests": [{"id": "d", "prompt": list(range(1, 41)), "max_tokens": 19, "eos": None}]},
    {"config": dict(POOL, max_num_batched_tokens=64, enable_chunked_prefill=False),
     "requests": [{"id": "e", "prompt": list(range(1, 41)), "max_tokens": 18, "eos": None}]},
]


def _worker_scheduler():
    """An ``sglang`` adapter on the process's shared worker (started here if no test started it yet)."""
    from schedspec.engines.sglang import SglangScheduler
    from schedspec.spec.config import SchedulerConfig

    return SglangScheduler(SchedulerConfig(**POOL, max_num_batched_tokens=64))


@pytest.fixture(scope="module")
def probed() -> list[dict]:
    scheduler = _worker_scheduler()
    try:
        return scheduler._call({"op": "probe", "cases": CASES})["cases"]
    finally:
        scheduler.close()


def test_the_environment_imports_the_scheduling_modules() -> None:
    """The worker's ``init`` reply carries ``--check``'s line (scripts/engines_setup.sh checks a fresh install
    with ``--check`` itself): the scheduling modules import, with the pinned sglang and torch."""
    scheduler = _worker_scheduler()
    try:
        line = scheduler._call({"op": "init", "config": scheduler.config.to_dict(), "policy": "fcfs"})["check"]
    finally:
        scheduler.close()
    assert line.startswith("ENGINES SETUP: OK sglang 0.5.23, torch 2.13.0+cpu")
    # the stub answered exactly the modules the docstring of install_torchvision_stub names
    assert line.endswith("torchvision stubbed: torchvision, torchvision.transforms, torchvision.transforms.functional")


def test_chunked_prefill_cuts_at_a_page_and_allocates_the_first_free_pages(probed) -> None:
    case = probed[0]
    assert case["results"] == ["OTHER"]
    assert case["admitted"] == [["r0", 0, 8, [1, 2]]]  # pages 1, 2 = spec blocks 0, 1
    assert case["chunked"] == "r0"
    assert case["num_free_tokens"] == 64 - 8


def test_admission_reserves_the_whole_output_and_a_page(probed) -> None:
    refused, admitted = probed[1], probed[2]
    assert refused["results"] == ["NO_TOKEN"] and refused["admitted"] == []
    assert refused["num_free_tokens"] == 64
    assert admitted["admitted"] == [["fits", 0, 40, list(range(1, 11))]]
    assert admitted["num_free_tokens"] == 64 - 40


def test_admission_without_an_end_of_sequence_id_keeps_one_token_spare(probed) -> None:
    refused, admitted = probed[3], probed[4]
    assert refused["results"] == ["NO_TOKEN"] and refused["admitted"] == []
    assert admitted["admitted"] == [["e", 0, 40, list(range(1, 11))]]


def test_new_token_ratio_defaults(probed) -> None:
    # SGLANG_INIT_NEW_TOKEN_RATIO 0.7 x schedule_conservativeness 1.0; min = 0.7 x 0.14;
    # decay = (init - min) / SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS (600)
    init, minimum, decay = probed[0]["new_token_ratio"]
    assert init == pytest.approx(0.7) and minimum == pytest.approx(0.098)
    assert decay == pytest.approx((0.7 - 0.098) / 600)


# ------------------------------------------------------------------------ the step-by-step adapter
import attrs  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from schedspec.reference.scheduler import EngineView, view_differences  # noqa: E402
from schedspec.spec.admission import rejection_reason  # noqa: E402
from schedspec.testing import SchedulerStateMachine, SpecViolation  # noqa: E402


def _sglang_limits(config) -> tuple[int, int]:
    """SGLang's own limits for a schedspec config, as the worker derives them (engines/sglang.py):
    ``max_req_input_len`` (a prompt this long or longer is refused) and the tokens an empty pool holds."""
    pool = config.num_kv_blocks * config.block_size
    max_req_len = min(config.max_model_len - 1, pool - 1)
    return max_req_len - 5, pool


class SglangMachine(SchedulerStateMachine):
    """The state machine of :mod:`schedspec.testing` on the ``sglang`` adapter, SGLang's own view
    compared with the spec state after every rule.

    Configs are moved onto what the adapter runs (no prefix caching, no speculative decoding, no
    ``long_prefill_token_threshold``: exit 3 otherwise) and where SGLang's budgets and the spec's agree:
    ``max_num_batched_tokens >= max_num_seqs`` (an SGLang decode batch is not budgeted), with chunked
    prefill at least ``block_size`` (a chunk under a page never admits a longer prompt: the finding
    ``sglang-unadmittable-request-blocks-queue``) and, without chunked prefill, at least ``max_model_len`` (SGLang admits the first prompt of a pass past
    ``max_prefill_tokens``). Request shapes are moved onto those SGLang accepts unchanged: a prompt
    below ``max_req_input_len`` and a ``max_tokens`` that ``init_req_max_new_tokens`` does not clip
    (the finding ``sglang-clips-max-tokens``, tested below). Aborts of admitted requests (refused,
    exit 3) become aborts of waiting ones."""

    scheduler_name = "sglang"

    @classmethod
    def configs(cls):
        def agree(config):
            # SGLang refuses every prompt of a pool or context under 7 tokens (max_req_input_len <= 0)
            model_len = max(config.max_model_len, 8)
            # with chunking, at least a page: SGLang cuts a chunk to whole pages, so under a page it never
            # admits a prompt longer than the chunk (docs/findings/sglang-unadmittable-request-blocks-queue.md)
            budget = max(config.max_num_batched_tokens, config.max_num_seqs,
                         config.block_size if config.enable_chunked_prefill else model_len)
            return attrs.evolve(config, max_model_len=model_len, max_num_batched_tokens=budget,
                                num_kv_blocks=max(config.num_kv_blocks, -(-8 // config.block_size)),
                                enable_prefix_caching=False, long_prefill_token_threshold=0,
                                num_speculative_tokens=0, num_lookahead_tokens=0)
        return super().configs().map(agree)

    def add_request(self, prompt_len, max_tokens, eos_at_output=None, priority=0, prefix_group=None, prefix_len=0):
        config = self.config
        max_input, pool = _sglang_limits(config)
        if 0 < prompt_len and max_tokens >= 1:
            prompt_len = min(prompt_len, max_input - 1)
            paged = -(-prompt_len // config.block_size) * config.block_size
            limit = min(pool - paged - config.block_size - 1, max_input + 5 - prompt_len - 1,
                        config.max_model_len - prompt_len)  # the front end refuses a longer total
            max_tokens = max(1, min(max_tokens, limit))
            if limit < 1 or rejection_reason(prompt_len, max_tokens, config) is not None:
                prompt_len, max_tokens = 0, 1  # both refuse an empty prompt at arrival
        elif max_tokens < 1:
            prompt_len = 0  # SGLang admits max_tokens=0 (a prefill, then a length finish); the spec rejects it
        return super().add_request(prompt_len, max_tokens, eos_at_output, priority,
                                   prefix_group=prefix_group, prefix_len=0)

    def abort(self, which, index):
        super().abort("waiting" if which == "running" else which, index)

    def _check_scheduler_state(self) -> None:
        super()._check_scheduler_state()
        found = view_differences(EngineView.of_state(self.shadow), self.scheduler.engine_view())
        if found:
            self._fail("engine view", f"at step {self.shadow.step}: " + "; ".join(str(f) for f in found))


CI = os.environ.get("HYPOTHESIS_PROFILE") == "ci"
MACHINE_EXAMPLES = int(os.environ.get("SCHEDSPEC_SGLANG_EXAMPLES", "25" if CI else "6"))
"""Examples of the machine: 25 of up to 30 rules under the ``ci`` profile (derandomized, as the profile), 6 of 20
otherwise (each is a few hundred worker round trips, a few seconds of CPU in all; the worker starts once)."""
MACHINE_RULES = 30 if CI else 20


def test_state_machine() -> None:
    run_state_machine_as_test(SglangMachine, settings=settings(max_examples=MACHINE_EXAMPLES,
                                                               stateful_step_count=MACHINE_RULES, deadline=None))


def test_state_machine_catches_a_broken_adapter(monkeypatch) -> None:
    """A deliberate break: report one block too many as free; the machine's view check fails."""
    from schedspec.engines.sglang import SglangScheduler

    original = SglangScheduler.engine_view
    monkeypatch.setattr(SglangScheduler, "engine_view",
                        lambda self: attrs.evolve(original(self), num_free_blocks=original(self).num_free_blocks + 1))
    with pytest.raises(SpecViolation, match="engine view"):
        run_state_machine_as_test(SglangMachine, settings=settings(max_examples=5, stateful_step_count=5,
                                                                   derandomize=True, database=None, deadline=None))


def test_clipped_max_tokens_is_a_refinement_finding() -> None:
    """docs/findings/sglang-clips-max-tokens.md: replay exits 1 with the refinement at step 18 (in this process:
    the shared worker)."""
    from click.testing import CliRunner

    from schedspec.cli import cli

    case = ROOT / "schedspec" / "data" / "cases" / "counterexample-sglang-clips-max-tokens.json"
    done = CliRunner().invoke(cli, ["replay", "--scheduler", "sglang", str(case)], catch_exceptions=False)
    assert "PASS finding: refinement reproduced: step 18" in done.output, done.output[-3000:]


def test_lab_on_the_default_window_checks_every_step() -> None:
    """Issue 25: ``schedspec lab --scheduler sglang`` on the default window (the Azure 2023 conversation trace,
    first 120 s, 456 requests): every step checked against the spec with SGLang's own view compared, no
    violation, every request finished. About 5,600 steps: 60-70 s of CPU, the largest SGLang test."""
    from click.testing import CliRunner

    from schedspec.cli import cli

    done = CliRunner().invoke(cli, ["lab", "--scheduler", "sglang", "--json"], catch_exceptions=False)
    assert done.exit_code == 0, done.output[-3000:]
    figures = json.loads(done.stdout)["figures"]
    assert figures["violations"] == 0
    assert figures["steps_checked"] == figures["num_steps"] > 5000
    assert figures["requests_total"] == figures["requests_finished"] == 456


def test_refused_features_exit_3() -> None:
    from schedspec.reference.scheduler import UnsupportedFeature, make_scheduler
    from schedspec.spec.config import SchedulerConfig

    with pytest.raises(UnsupportedFeature, match="prefix caching"):
        make_scheduler("sglang", SchedulerConfig(4, 16, 64, 4, 128, enable_prefix_caching=True))
