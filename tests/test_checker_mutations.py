"""The checkers are sound on real traces: every semantic mutant of the catalogue
(``schedspec.trace_mutations``) is rejected by both the full and the incremental checker at the step
where it first becomes observable, the unmutated traces pass, and the mutants that change nothing
observable pass. A derandomized sample: one applicable step per operator and trace, preferring the
first 200 steps (``benchmarks/checker_mutations.py`` runs the whole catalogue)."""

from __future__ import annotations

import random

import pytest

from schedspec.trace_mutations import MUTATIONS, applicable_steps, judge, mutate_and_judge, standard_traces

SEED = 20261201


@pytest.fixture(scope="module")
def traces():
    return standard_traces(scale=1)


def test_unmutated_traces_pass(traces):
    for label, trace in traces:
        assert judge(trace.header, trace.records) == (None, None), label


def test_the_catalogue_is_large_and_applies(traces):
    semantic = [m for m in MUTATIONS if m.semantic]
    assert len(semantic) >= 20
    never = [m.name for m in MUTATIONS if not any(applicable_steps(t, m) for _, t in traces)]
    assert never == [], f"operators that apply to no trace: {never}"
    assert any(r["preempted"] for _, t in traces for r in t.records), "one trace must preempt (KV pressure)"


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_every_mutant_is_judged_at_its_step(traces, mutation):
    rng = random.Random(f"{SEED}:{mutation.name}")
    judged = 0
    for label, trace in traces:
        steps = applicable_steps(trace, mutation)
        early = [s for s in steps if s < 200] or steps
        if not early:
            continue
        outcome = mutate_and_judge(trace, label, mutation, rng.choice(early))
        judged += 1
        assert outcome.correct, outcome
    assert judged, "applies to no trace"
