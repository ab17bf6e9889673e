"""Bounded model checking (``reference/proofs/bmc.py``): each check is shown able to fail by a deliberate
break: a policy encoding whose victims are the oldest candidates (bounded-preemptions finds a run over the
bound), a reference that disagrees with the encoding's cover run (the replay does not reproduce it), an
encoding that does not return released blocks (the slot-order layout's lemma is refuted), and runs too short
to preempt a request twice (a cover goal is not reached). That fcfs's run properties hold at the same size
(N = 3, K = 4) with every cover goal reached and reproduced by the reference is checked once, through the
command line, by ``tests/test_proofs_prove.py::test_every_fcfs_theorem_holds_at_three_slots`` (it was checked
here a second time); static's bounded-preemptions is checked here.

Cost: about a minute on the 2-core machine (N = 3, K = 4; the victims break at K = 2).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

z3 = pytest.importorskip("z3")

from test_proofs_exhaustive import released_not_returned  # noqa: E402

from schedspec.reference.proofs import bmc  # noqa: E402
from schedspec.reference.proofs import policy as policy_encoding  # noqa: E402
from schedspec.spec.proofs.core import Options  # noqa: E402

SMALL = Options(slots=3, bmc_slots=3, depth=4, timeout_s=120)


def _victims_oldest_first(monkeypatch) -> None:
    """The slot-order step's victims: the candidates right after the requester first (the oldest), instead
    of the most recently admitted (a source mutant, as mutmut makes them)."""
    source = inspect.getsource(policy_encoding._plan_step_slot_order)
    younger = "for u in range(v + 1, n)])"
    assert younger in source, "the mutant no longer applies: update it"
    namespace = dict(vars(policy_encoding))
    exec(source.replace(younger, "for u in range(i, v)])"), namespace)  # noqa: S102
    monkeypatch.setattr(policy_encoding, "_plan_step_slot_order", namespace["_plan_step_slot_order"])


def test_static_keeps_bounded_preemptions():
    result = bmc.bounded_preemptions("static").run(SMALL)
    assert result.status == "proved" and result.ok, (result.detail, result.vacuity)


def _no_cover_goals(monkeypatch) -> None:
    """For a deliberate break whose test asserts on the query's verdict only: the cover goals (a quarter of
    such a run) are not searched. They are checked where they are the point: on the theorems that hold
    (``tests/test_proofs_prove.py::test_every_fcfs_theorem_holds_at_three_slots``) and in one step
    (``test_bounded_preemptions_covers_unreachable_in_one_step``)."""
    monkeypatch.setattr(bmc, "cover_goals", lambda *args, **kwargs: [])


def test_victims_oldest_first_break_bounded_preemptions(monkeypatch):
    """Runs of K = 2 steps, not 4: the oldest request preempted once already breaks its bound P(1) = 0, so the
    query, the from-Init search and the replay that does not confirm it are all reached in 2 steps (3.8 s of
    CPU instead of 14.2 s at K = 4 on the 2-core machine); the theorem at K = 4 is checked where it holds
    (``tests/test_proofs_prove.py``)."""
    _victims_oldest_first(monkeypatch)
    _no_cover_goals(monkeypatch)
    result = bmc.bounded_preemptions("fcfs").run(dataclasses.replace(SMALL, depth=2))
    assert result.status == "counterexample", result.detail
    # the minimized run, step by step, with each slot's count and bound
    assert result.witness is not None and "preemptions" in result.witness["slots"][0]
    assert result.witness["steps"] and all("slots" in step for step in result.witness["steps"])
    # a run from Init on which the (mutated) encoding breaks the bound becomes a scenario; the reference
    # (not mutated) does not reproduce it, and says so
    assert result.scenario is not None and result.scenario["expect"] == {"demonstrates": "bounded-preemptions"}
    assert result.replayed is False and "did not confirm" in result.detail


def test_a_cover_run_the_reference_does_not_reproduce_is_unconfirmed(monkeypatch):
    """The cover replay is a real check: a preemption run the encoding finds is reproduced by the
    reference, and not by a reference that sees 100 more KV blocks (deliberate break: it never runs out,
    so it never preempts); an unconfirmed cover makes the theorem not as expected."""
    import attrs

    from schedspec.reference import scheduler as registry
    from schedspec.reference.proofs.properties import run_from_init
    from schedspec.spec.proofs.core import UNCONFIRMED, Coverage, Result
    from schedspec.spec.proofs.theorems import setup

    opts = bmc.bmc_options(SMALL)
    ctx = setup(opts)
    r = run_from_init(ctx, "fcfs", 2, 4, eos=True, aborts=True, layout="slot-order")
    solver = z3.Solver()
    solver.add(ctx.cfg.valid(), *ctx.facts, z3.Or([bmc.PROGRESS_COVERS["preemption"](ctx, r, t) for t in range(4)]))
    assert solver.check() == z3.sat
    model = solver.model()
    step = next(t for t in range(4) if z3.is_true(model.eval(r.steps[t].step.any_preempted, model_completion=True)))
    assert bmc.replay_cover(model, ctx, r, "fcfs", "preemption", step)
    original = registry.SCHEDULERS["fcfs"]
    monkeypatch.setitem(registry.REGISTRY, "fcfs", attrs.evolve(
        registry.REGISTRY["fcfs"],
        factory=lambda config: original(attrs.evolve(config, num_kv_blocks=config.num_kv_blocks + 100))))
    assert not bmc.replay_cover(model, ctx, r, "fcfs", "preemption", step)
    result = Result("x", "", "proved", "proved", 2, "fixed 2", 4, vacuity=[Coverage("preemption", UNCONFIRMED, step)])
    assert not result.ok


def test_a_layout_lemma_refuted_fails_the_run(monkeypatch):
    """An encoding that does not return a victim's blocks to the pool breaks the slot-order step's lemma
    that the pool never goes negative; the run reports the lemma, not a proof."""
    monkeypatch.setattr(bmc, "plan_step", released_not_returned(policy_encoding.plan_step))
    _no_cover_goals(monkeypatch)
    result = bmc.bounded_preemptions("fcfs").run(SMALL)
    assert result.status == "counterexample" and "lemma pool-nonnegative" in result.detail, result.detail


def test_bounded_preemptions_covers_unreachable_in_one_step():
    """Deliberate break: in runs of one step no request is preempted twice, so the bound is never
    exercised beyond a single preemption; the bounded check would say little and must fail."""
    result = bmc.bounded_preemptions("fcfs").run(dataclasses.replace(SMALL, depth=1))
    assert not result.ok
    covers = {c.case: c.status for c in result.vacuity}
    assert covers["a request preempted twice after the last arrival"] == "unsat"


def test_preemption_bounds_follow_the_monitor():
    """The capped bound of the encoding is the monitor's ``P`` (capped), on concrete requests."""
    from schedspec.spec.admission import max_blocks_needed
    from schedspec.spec.config import SchedulerConfig
    from schedspec.spec.proofs.concrete import concrete_ctx, encode_state, evaluate
    from schedspec.spec.state import SchedulerState
    from schedspec.spec.transitions import add_request
    from schedspec.spec.workload import RequestSpec

    config = SchedulerConfig(block_size=2, num_kv_blocks=8, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=8)
    state = SchedulerState.initial(config)
    shapes = [(3, 2), (1, 1), (5, 3), (2, 4)]
    for k, (prompt, max_tokens) in enumerate(shapes):
        state = add_request(state, RequestSpec(f"r{k}", prompt, max_tokens, arrival_step=0).to_request(0))
    ids = [f"r{k}" for k in range(len(shapes))]
    ctx = concrete_ctx(config)
    for cap in (3, 50):
        bounds = bmc.preemption_bounds(ctx, encode_state(state, ids), cap)
        solver = z3.Solver()
        solver.add(ctx.facts)
        assert solver.check() == z3.sat
        got = [evaluate(solver.model().eval(b, model_completion=True)) for b in bounds]
        total, expected = 0, []
        for prompt, max_tokens in shapes:
            expected.append(min(total, cap))
            total += (total + 1) * max_blocks_needed(prompt, max_tokens, config)
        assert got == expected, (cap, got, expected)
