"""The ``sglang`` adapter's contract beside SGLang's scheduling (``tests/test_engine_sglang.py``): the stop
conditions reach SGLang's ``SamplingParams``, SGLang's finish reasons are compared with the spec's, the
worker invents no token for a row the spec did not sample, and a version mismatch drops the worker's
scheduler. They need the SGLang environment and skip without it, saying so (as ``test_engine_sglang.py``).
"""

from __future__ import annotations

import attrs
import pytest

from schedspec.reference.engine import Engine
from schedspec.reference.scheduler import UnsupportedFeature, make_scheduler
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.workload import RequestSpec
from tests.test_engine_sglang import pytestmark  # noqa: F401  (the same skip: no SGLang environment)

CONFIG = SchedulerConfig(num_kv_blocks=32, block_size=4, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64)
PLAIN = RequestSpec("r0", prompt_len=6, max_tokens=8, arrival_step=0, arrival_time=0.0)
OTHER = RequestSpec("r1", prompt_len=5, max_tokens=6, arrival_step=0, arrival_time=0.0)


def _outputs_of(spec: RequestSpec) -> tuple[int, ...]:
    """The tokens the engine loop's token source samples for ``spec`` run alone to max_tokens (on fcfs)."""
    result = Engine(make_scheduler("fcfs", CONFIG), CONFIG, properties=()).run([spec], max_steps=100)
    return result.state.finished[spec.request_id].output_token_ids


def test_stop_token_ids_and_min_tokens_reach_sglang() -> None:
    """r0 stops on its third output, a stop id (no end-of-sequence id: SGLang checks stop ids only without
    ignore_eos); r1 has min_tokens 2 and a stop id at its fourth output. SGLang ends both where the spec does,
    with its reason (dropping stop_token_ids, SGLang ran r0 to max_tokens: a false finding)."""
    specs = [attrs.evolve(PLAIN, stop_token_ids=(_outputs_of(PLAIN)[2],), eos_token_id=None),
             attrs.evolve(OTHER, stop_token_ids=(_outputs_of(OTHER)[3],), min_tokens=2)]
    result = Engine(make_scheduler("sglang", CONFIG), CONFIG, properties=()).run(specs, max_steps=100)
    assert [str(v) for v in result.violations] == []
    ended = result.state.finished
    assert (ended["r0"].finish_reason, len(ended["r0"].output_token_ids)) == ("stop", 3)
    assert (ended["r1"].finish_reason, len(ended["r1"].output_token_ids)) == ("stop", 4)


def test_a_stop_id_sampled_before_min_tokens_is_refused_not_a_finding() -> None:
    """SGLang stops on an EOS whatever min_new_tokens says (its sampler never samples one earlier); the spec
    does not: exit 3 naming min_tokens. min_tokens > max_tokens, which SGLang refuses, is refused too."""
    early = attrs.evolve(OTHER, min_tokens=3, eos_at_output=2)
    with pytest.raises(UnsupportedFeature, match="min_tokens=3: the token source sampled stop id .* as output 2"):
        Engine(make_scheduler("sglang", CONFIG), CONFIG, properties=()).run([early], max_steps=100)
    with pytest.raises(UnsupportedFeature, match="min_tokens=3 > max_tokens=2"):
        Engine(make_scheduler("sglang", CONFIG), CONFIG, properties=()).run(
            [attrs.evolve(OTHER, max_tokens=2, min_tokens=3)], max_steps=100)


def test_a_wrong_finish_reason_from_sglang_is_a_refinement_mismatch(monkeypatch) -> None:
    """SGLang's finish types are compared with the spec's reasons (finish_reason_mismatches): the honest
    adapter passes a run where one request stops on EOS and one on max_tokens; reporting the stop as
    ``length`` fails at the step of the stop, naming the request."""
    from schedspec.engines.sglang import SglangScheduler

    specs = [attrs.evolve(PLAIN, eos_at_output=3), OTHER]
    honest = Engine(make_scheduler("sglang", CONFIG), CONFIG, properties=()).run(specs, max_steps=100)
    assert not honest.violations and honest.state.finished["r0"].finish_reason == "stop"
    assert honest.state.finished["r1"].finish_reason == "length"
    original = SglangScheduler.update

    def relabels_stops(self, plan, sampled):
        finished = original(self, plan, sampled)
        self.finish_reasons = {r: "length" if why == "stop" else why for r, why in self.finish_reasons.items()}
        return finished

    monkeypatch.setattr(SglangScheduler, "update", relabels_stops)
    faulty = Engine(make_scheduler("sglang", CONFIG), CONFIG, properties=()).run(specs, max_steps=100)
    assert [v.name for v in faulty.violations] == ["refinement"]
    assert "request r0 with reason length" in str(faulty.violations[0])


def test_the_worker_invents_no_token_for_a_request_the_spec_did_not_sample() -> None:
    """A prefill that reaches the end of its prompt samples; an update without its token is a protocol error
    (the worker fed token 0 and SGLang appended it as an output)."""
    from schedspec.engines.vllm import EngineError

    scheduler = make_scheduler("sglang", CONFIG)
    scheduler.add_request(PLAIN.to_request(0))
    plan = scheduler.schedule()
    assert [(i.request_id, i.num_tokens) for i in plan.scheduled] == [("r0", 6)]
    with pytest.raises(EngineError, match="no sampled token for request 'r0'"):
        scheduler.update(plan, {})


def test_a_version_mismatch_drops_the_scheduler_it_built(monkeypatch) -> None:
    from schedspec.engines import sglang as sglang_adapter
    from schedspec.engines.vllm import EngineError, EngineUnavailable, _worker

    monkeypatch.setattr(sglang_adapter, "SGLANG_VERSION", "0.0.0")
    worker = _worker(sglang_adapter.sglang_python(), None, sglang_adapter.WORKER, "SGLang",
                     sglang_adapter.PYTHON_VARIABLE)
    handle = worker.next_handle
    with pytest.raises(EngineUnavailable, match="expected 0.0.0"):
        sglang_adapter.SglangScheduler(CONFIG)
    with pytest.raises(EngineError, match="never built"):
        worker.call({"op": "view", "handle": handle})


RADIX = SchedulerConfig(block_size=4, num_kv_blocks=32, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128,
                        enable_prefix_caching=True, prefix_cache_publication="sglang-radix")
SHARED = [RequestSpec("A", 20, 6, arrival_step=0, prefix_group="g", prefix_len=16),
          RequestSpec("B", 20, 6, arrival_step=0, prefix_group="g", prefix_len=16),
          RequestSpec("C", 20, 6, arrival_step=3, prefix_group="g", prefix_len=16)]


def test_the_radix_cache_deduplicates_and_hits_under_every_check() -> None:
    """SGLang's RadixCache under prefix_cache_publication="sglang-radix" (docs/engines.md, The radix cache): A and
    B prefill one new 16-token prefix together, and SGLang's checkpoint frees B's 4 copies for A's pages (the
    plan names the de-duplication); C, admitted later, hits the 16 tokens. Every rule, invariant and view
    comparison holds (the view counts the tree's evictable pages as free)."""
    result = Engine(make_scheduler("sglang", RADIX), RADIX, properties=()).run(SHARED, mode="steps", max_steps=60)
    assert [str(v) for v in result.violations] == []
    first = result.records[0]
    assert len(first.blocks_deduplicated.get("B", ())) == 4
    assert any(r.prefix_hit_tokens.get("C") == 16 for r in result.records)
    assert sorted(result.state.finished) == ["A", "B", "C"]


def test_a_de_duplication_left_out_of_the_plan_is_a_state_mismatch(monkeypatch) -> None:
    """The deliberate break: an adapter that does not name SGLang's de-duplication in its plan. SGLang frees B's
    copies anyway, so its free count exceeds the spec's after step 0."""
    from schedspec.engines.sglang import SglangScheduler

    honest = SglangScheduler.schedule

    def silent(self):
        plan = honest(self)
        self.plan = attrs.evolve(plan, scheduled=tuple(attrs.evolve(i, deduplicated_block_ids=()) for i in plan.scheduled))
        return self.plan

    monkeypatch.setattr(SglangScheduler, "schedule", silent)
    result = Engine(make_scheduler("sglang", RADIX), RADIX, properties=()).run(SHARED, mode="steps", max_steps=60)
    assert any(v.name == "state-mismatch" and v.step == 0 and "num_free_blocks" in str(v) for v in result.violations)


def test_a_chunked_prefill_with_the_radix_cache_is_refused() -> None:
    """SGLang inserts a chunked request's middle chunk into the tree only in the next get_next_batch_to_run
    (stash_chunked_request): not mapped yet, a feature the adapter lacks (exit 3), not a finding."""
    config = attrs.evolve(RADIX, max_num_batched_tokens=8)
    with pytest.raises(UnsupportedFeature, match="chunked prefill with prefix caching"):
        Engine(make_scheduler("sglang", config), config, properties=()).run(SHARED[:1], mode="steps", max_steps=60)


def test_prefix_caching_with_vllm_publication_is_refused() -> None:
    with pytest.raises(UnsupportedFeature, match="prefix_cache_publication='vllm'"):
        make_scheduler("sglang", attrs.evolve(RADIX, prefix_cache_publication="vllm"))
