"""The PyTorch backend's n-gram drafter (issue 23): the rule on hand-worked sequences (longest n-gram,
earliest occurrence, the bounds), the runner proposing it over the request's sequence as the spec appends
it, and ``--backend torch`` with ``num_speculative_tokens > 0`` (which exited 3 while the runner had no
drafter): every check passes and greedy outputs equal those without speculation.

The rule agrees with vLLM 0.32's own ``_find_longest_matched_ngram_and_propose_tokens`` on 20,000 random
sequences (a one-off comparison in vLLM's environment, given in the branch's report; it is not run here,
which would need that environment). Cost: about 25 s of CPU (the tiny model on a CPU)."""

from __future__ import annotations

import pytest

from schedspec.gpu_backend.ngram import DEFAULT_LOOKUP, ngram_drafts


@pytest.mark.parametrize("tokens, k, max_model_len, lookup, want", [
    # the 3-gram suffix "1 2 3" occurs at 0: what follows it
    ((1, 2, 3, 9, 1, 2, 3), 2, 100, (1, 3), (9, 1)),
    # the longest n wins over an earlier, shorter match: "1 2" (then 8) before "2" (then 9)
    ((2, 9, 1, 2, 8, 1, 2), 1, 100, (1, 2), (8,)),
    # among occurrences of the same length, the earliest: "5" at 0 (then 7), not at 2 (then 8)
    ((5, 7, 5, 8, 5), 1, 100, (1, 1), (7,)),
    # an overlapping occurrence: "4" at 0, then at most up to the end of the sequence
    ((4, 4), 3, 100, (1, 1), (4,)),
    # max_model_len leaves room for one draft
    ((1, 2, 3, 9, 1, 2, 3), 3, 8, (1, 3), (9,)),
    # the sequence already at max_model_len: none
    ((1, 2, 3, 9, 1, 2, 3), 3, 7, (1, 3), ()),
    # no n-gram of length >= prompt_lookup_min recurs
    ((1, 2, 3, 9, 1, 2, 3), 3, 100, (4, 5), ()),
    ((1, 2, 3, 4), 3, 100, (1, 3), ()),
    # shorter than prompt_lookup_min
    ((1,), 3, 100, (2, 2), ()),
    # k = 0
    ((1, 1, 1), 0, 100, (1, 1), ()),
    # vLLM's default lookup (5, 5): a 5-gram that recurs
    ((1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5), 3, 100, DEFAULT_LOOKUP, (6, 7, 1)),
])
def test_the_ngram_rule(tokens, k, max_model_len, lookup, want):
    assert ngram_drafts(tokens, k, max_model_len, lookup) == want


@pytest.mark.parametrize("lookup", [(0, 2), (3, 2)])
def test_a_bad_lookup_is_refused(lookup):
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        ngram_drafts((1, 2, 3), 2, 100, lookup)


torch = pytest.importorskip("torch")

from schedspec.gpu_backend import Runner  # noqa: E402
from schedspec.gpu_backend.errors import BackendError  # noqa: E402
from schedspec.gpu_backend.testing import device_for_tests  # noqa: E402
from schedspec.reference.engine import Engine  # noqa: E402
from schedspec.reference.scheduler import SCHEDULERS  # noqa: E402
from schedspec.spec.config import SchedulerConfig  # noqa: E402
from schedspec.spec.transitions import apply_plan  # noqa: E402
from schedspec.spec.workload import RequestSpec, token_ids  # noqa: E402

LOOKUP = (1, 3)  # shorter n-grams than vLLM's default, so the random tiny model's sequences get drafts


class _Watched:
    """The runner as the engine loop's token source, checking after each step that every proposal is the
    n-gram rule over the request's sequence as the spec appends it (the state after the step)."""

    def __init__(self, runner, config):
        self.runner, self.config, self.proposals = runner, config, 0

    def execute(self, plan, state):
        return self.runner.execute(plan, state)

    def execute_speculative(self, plan, state):
        sampled, seconds, speculative = self.runner.execute_speculative(plan, state)
        after = apply_plan(state, plan, sampled, self.config, speculative).state
        for request_id in sampled:
            request = after.requests.get(request_id)
            if request is None:
                continue  # it stopped in the step: its drafts are ignored
            want = ngram_drafts(token_ids(request, 0, request.num_tokens), self.config.num_speculative_tokens,
                                self.config.max_model_len, LOOKUP)
            assert request.spec_token_ids == want, (request_id, request.spec_token_ids, want)
            self.proposals += bool(want)
        return sampled, seconds, speculative


def test_the_torch_runner_drafts_by_ngram_and_speculation_keeps_the_greedy_tokens():
    device = device_for_tests()
    base = SchedulerConfig(block_size=16, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                           max_model_len=256)
    spec = base.with_changes(num_speculative_tokens=3)
    workload = [RequestSpec(f"r{i}", 10 + 5 * i, 60, arrival_step=i) for i in range(4)]
    outputs = {}
    for cfg in (base, spec):
        runner = Runner(cfg, device=device, debug=True, ngram_lookup=LOOKUP)
        source = _Watched(runner, cfg) if cfg.speculative else runner
        result = Engine(SCHEDULERS["fcfs"](cfg), cfg, token_source=source).run(workload)
        assert result.ok, result.violations[:3]
        outputs[cfg.speculative] = {r.request_id: r.output_token_ids for r in result.state.finished.values()}
        if cfg.speculative:
            verified = sum(len(item.spec_token_ids) for record in result.records for item in record.scheduled)
            assert source.proposals > 0 and verified > 0
    assert outputs[True] == outputs[False] and len(outputs[True]) == 4


def test_a_bad_ngram_lookup_is_a_backend_error():
    with pytest.raises(BackendError, match="ngram_lookup"):
        Runner(SchedulerConfig(16, 8, 64, 2, 128, num_speculative_tokens=2), device="cpu", ngram_lookup=(2, 1))


def test_lab_backend_torch_runs_speculative_decoding():
    """``schedspec lab --backend torch --set num_speculative_tokens=3``: it exited 3 while the runner had no
    drafter; now every step is checked (0 violations) and the run record carries k."""
    import json

    from click.testing import CliRunner

    from schedspec.cli import cli

    result = CliRunner().invoke(cli, ["lab", "--backend", "torch", "--device", device_for_tests().split(":")[0],
                                      "--max-requests", "6", "--length-scale", "16",
                                      "--set", "num_speculative_tokens=3", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["conditions"]["config"]["num_speculative_tokens"] == 3
    assert record["figures"]["violations"] == 0 and record["figures"]["steps_checked"] == record["figures"]["num_steps"]
