"""One definition of a step's time, and `schedspec calibrate`: the step shape the lab charges is the one
the trace records and the PyTorch backend's runner reports; the grid's plans are legal; the fit recovers
known coefficients and never goes negative; the profile file round-trips through `lab --profile`; bad
input exits 2 with one line.

Cost: one `calibrate --quick` (tiny model, CPU, about 3-6 s), a 6-request torch lab run, two small
cost-model lab runs: about 15 s in all on a 2-core machine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from schedspec.cli import cli
from schedspec.lab import calibrate as cal
from schedspec.lab.run import run_lab
from schedspec.lab.synthetic import synthetic
from schedspec.reference import cost_model as costs
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.rules import violated_rules

# A small KV cache so requests are preempted and recomputed (recompute chunks are prefill).
SMALL = SchedulerConfig(block_size=4, num_kv_blocks=14, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=48)


def _workload(n=10, seed=1):
    return synthetic(rate=50.0, prompt="uniform:4:30", output="uniform:2:12", num_requests=n, seed=seed)


@pytest.mark.parametrize("check", [True, False], ids=["FakeModel", "CostOnlyModel"])
def test_the_lab_charges_the_cost_of_the_recorded_batch(check):
    """Every step's duration equals the profile's price of the batch as the trace records it, so a step
    trace (e.g. of a torch run) can be priced with the same definition."""
    records = []
    cost = costs.CostModel("t", a=1e-3, b=1e-4, c=3e-4, d=1e-6, e=1e-8, f=2e-4)
    result = run_lab(_workload(), "fcfs", SMALL, cost_model=cost, check=check, on_step=records.append)
    assert result.run.ok and records
    assert sum(len(r.preempted) for r in records) > 0, "the case must preempt, to cover recompute"
    for record in records:
        assert record.duration == pytest.approx(cost.batch_seconds(record.scheduled), rel=1e-12)


def test_step_shape_classifies_as_the_trace_records():
    from schedspec.reference.engine import Engine
    from schedspec.reference.fake_model import FakeModel
    from schedspec.reference.scheduler import make_scheduler

    cost = costs.CostModel("t", a=0.0, b=1.0, c=1000.0, d=0.0)  # prefill and decode tokens told apart
    seen = []

    class Spy(FakeModel):
        def execute(self, plan, state):
            seen.append(costs.step_shape(plan, state))
            return super().execute(plan, state)

    engine = Engine(make_scheduler("fcfs", SMALL), SMALL, token_source=Spy(SMALL, cost_model=cost),
                    record_steps=True)
    run = engine.run(_workload(seed=2), mode="time")
    records = [r for r in run.records if r.scheduled]
    assert len(records) == len(seen)
    for record, shape in zip(records, seen, strict=True):
        assert shape.prefill_tokens == sum(i.prefill_tokens for i in record.scheduled)
        assert shape.decode_tokens == sum(i.decode_tokens for i in record.scheduled)
        assert shape.kv_tokens_attended == sum(i.num_computed_tokens + i.num_tokens for i in record.scheduled)


def test_the_runner_reports_the_shape_the_lab_charges():
    pytest.importorskip("torch", reason="the torch extra is not installed")
    from schedspec.gpu_backend import Runner

    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=6,
                             max_model_len=64)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-core machine shared with other tests: one thread is faster, not slower
    try:
        _run_under_the_lab(Runner(config, device="cpu"), config)
    finally:
        torch.set_num_threads(threads)


def _run_under_the_lab(runner, config):
    assert runner.warm_up() > 0
    shapes, records = [], []
    original = runner.execute

    def execute(plan, state):
        out = original(plan, state)
        shapes.append((runner.last_step_shape, costs.step_shape(plan, state), out[1]))
        return out

    runner.execute = execute
    run_lab(_workload(6, seed=3), "fcfs", config, token_source=runner, on_step=records.append)
    steps = [r for r in records if r.scheduled]
    assert len(steps) == len(shapes) > 3
    for record, (reported, expected, seconds) in zip(steps, shapes, strict=True):
        assert reported == expected
        assert record.duration == seconds > 0  # the lab's clock advances by what the runner measured


def test_grid_plans_are_legal_and_have_the_designed_shape():
    grid = cal.design_grid(256, 8, 256)
    assert {p.region for p in grid} == set(cal.REGIONS)
    config = SchedulerConfig(block_size=16, num_kv_blocks=400, max_num_batched_tokens=4096, max_num_seqs=64,
                             max_model_len=1024)
    for point in grid:
        state, plan = cal.point_state(point, config)
        assert violated_rules(state, plan, config) == [], point.label
        shape = costs.step_shape(plan, state)
        assert shape.decode_tokens == point.decodes
        assert shape.prefill_tokens == sum(n for _, n in point.chunks)
        assert shape.kv_tokens_attended == point.kv_tokens
    with pytest.raises(ValueError, match="needs"):
        cal.point_state(cal.GridPoint("decode", decodes=64, context=1000), config)


def _fake_measurements(coefficients, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    config = SchedulerConfig(block_size=16, num_kv_blocks=1000, max_num_batched_tokens=4096, max_num_seqs=64,
                             max_model_len=1024)
    for point in cal.design_grid(512, 16, 512):
        shape = costs.step_shape(*reversed(cal.point_state(point, config)))
        t = costs.CostModel("truth", *coefficients[:4], e=coefficients[4] if len(coefficients) > 4 else 0.0) \
            .shape_seconds(shape)
        out.append(cal.Measurement(point, shape, t * (1 + noise * rng.standard_normal()), 0.0))
    return out


def test_fit_recovers_known_coefficients_and_stays_non_negative():
    truth = (2e-3, 5e-5, 0.0, 3e-8)
    fitted = cal.fit(_fake_measurements(truth))
    assert [fitted[k] for k in cal.FEATURES] == pytest.approx((*truth, 0.0), rel=1e-6, abs=1e-12)
    errors = cal.region_errors(fitted, _fake_measurements(truth))
    assert errors["all"]["max_abs_percent"] < 1e-6
    # Noise that would drive the decode coefficient negative in plain least squares: clamped at 0.
    noisy = _fake_measurements(truth, noise=0.05, seed=4)
    fitted = cal.fit(noisy)
    assert all(v >= 0 for v in fitted.values())
    matrix = np.array([[1, m.shape.prefill_tokens, m.shape.decode_tokens, m.shape.kv_tokens_attended] for m in noisy],
                      float) / np.array([m.seconds for m in noisy])[:, None]
    fitted.pop("e_s_per_prefill_attention_pair")
    plain, *_ = np.linalg.lstsq(matrix, np.ones(len(noisy)), rcond=None)
    x = np.array([fitted[k] for k in cal.FEATURES[:4]])
    cost = np.sum((matrix @ x - 1) ** 2)
    assert cost >= np.sum((matrix @ plain - 1) ** 2) - 1e-12  # constrained optimum is no better than free
    # ... and no feasible point nearby is better (a local check of optimality).
    rng = np.random.default_rng(0)
    for _ in range(200):
        y = np.maximum(x * (1 + 0.05 * rng.standard_normal(4)) + 1e-9 * rng.standard_normal(4), 0)
        assert np.sum((matrix @ y - 1) ** 2) >= cost - 1e-12


def test_auto_form_takes_the_attention_term_only_when_the_residuals_call_for_it():
    quadratic = _fake_measurements((2e-3, 5e-5, 1e-4, 3e-8, 2e-8))
    form, fitted, rms = cal.choose_form(quadratic)
    assert form == "attention" and rms["attention"] < 1e-6 < rms["linear"]
    assert fitted["e_s_per_prefill_attention_pair"] == pytest.approx(2e-8, rel=1e-6)
    form, fitted, _ = cal.choose_form(_fake_measurements((2e-3, 5e-5, 1e-4, 3e-8), noise=0.02, seed=1))
    assert form == "linear" and fitted["e_s_per_prefill_attention_pair"] == 0.0


def test_nnls_against_a_brute_force_grid():
    rng = np.random.default_rng(7)
    matrix = rng.random((12, 2))
    target = matrix @ np.array([1.0, -0.5]) + 0.01 * rng.standard_normal(12)
    x = cal.nonnegative_least_squares(matrix, target)
    grid = np.linspace(0, 2, 401)
    a, b = np.meshgrid(grid, grid, indexing="ij")
    residual = matrix[:, 0, None, None] * a + matrix[:, 1, None, None] * b - target[:, None, None]
    cost = np.sum(residual ** 2, axis=0)
    i, j = np.unravel_index(np.argmin(cost), cost.shape)
    assert x[1] == 0.0 and x[0] == pytest.approx(grid[i], abs=0.01) and grid[j] == 0.0


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_calibrate_quick_writes_a_profile_the_lab_loads(tmp_path, request):
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    # `calibrate --threads 1` sets torch's threads for the whole process; restored after the test so
    # that the tests run after it in the same process (xdist worker) see the threads they saw before.
    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    out = tmp_path / "tiny.json"
    result = invoke("calibrate", "--quick", "--device", "cpu", "--threads", "1", "--out", str(out))
    assert result.exit_code == 0, result.output
    for text in ("Fit error per region", "prefill", "decode", "mixed", "torch threads", "torch 2."):
        assert text in result.output
    document = json.loads(out.read_text())
    assert document["kind"] == costs.PROFILE_KIND["measured"]
    assert document["conditions"]["torch_threads"] == 1 and document["conditions"]["dtype"] == "float32"
    assert all(v >= 0 for v in document["coefficients"].values())
    assert document["fit_error_percent"]["all"]["points"] == len(document["points"]) >= 10
    profile = costs.load_profile(out)
    assert profile.measured and profile.a == document["coefficients"]["a_s_per_step"]
    lab = invoke("lab", "--profile", str(out), "--max-requests", "5", "--length-scale", "8", "--json")
    assert lab.exit_code == 0, lab.output
    record = json.loads(lab.stdout)
    assert record["conditions"]["cost_profile"]["kind"] == costs.PROFILE_KIND["measured"]
    assert record["conditions"]["cost_profile"]["a_s_per_step"] == profile.a
    # The packaged profiles say they are derived on paper.
    packaged = invoke("lab", "--max-requests", "3", "--steps", "none")
    assert "derived, not measured" in packaged.output


@pytest.mark.parametrize(("args", "expected"), [
    (["calibrate", "--model", "/nonexistent/dir"], "--model"),
    (["calibrate", "--quick", "--max-context", "4"], "--max-context"),
    (["calibrate", "--out", "/nonexistent/dir/p.json"], "--out"),
    (["calibrate", "--device", "cpu", "--max-context", "200000"], "max_position"),
])
def test_calibrate_bad_input_exits_2_with_one_line(args, expected):
    pytest.importorskip("torch", reason="the torch extra is not installed")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.output


@pytest.mark.parametrize(("content", "expected"), [
    ("{", "bad.json:1: not JSON"),
    ('{"record": "other"}', "field record"),
    ('{"record": "schedspec-cost-profile", "schema_version": 1, "name": "x", "coefficients": '
     '{"a_s_per_step": -1, "b_s_per_prefill_token": 0, "c_s_per_decode_token": 0, "d_s_per_kv_token": 0}}',
     "coefficients.a_s_per_step"),
    ('{"record": "schedspec-cost-profile", "schema_version": 1, "name": "x", "coefficients": '
     '{"a_s_per_step": 1, "b_s_per_prefill_token": 0, "c_s_per_decode_token": 0, "d_s_per_kv_token": 0}, '
     '"scheduler_config": {"max_num_seqs": 0}}', "scheduler_config.max_num_seqs"),
])
def test_lab_refuses_a_bad_profile_file(tmp_path, content, expected):
    path = tmp_path / "bad.json"
    path.write_text(content)
    result = CliRunner().invoke(cli, ["lab", "--profile", str(path), "--max-requests", "2"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--profile" in lines[0] and expected in lines[0], result.output


def test_thread_clock_needs_one_torch_thread_on_a_cpu():
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    from schedspec.gpu_backend import BackendError, Runner

    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=4,
                             max_model_len=64)
    with pytest.raises(BackendError, match="clock"):
        Runner(config, device="cpu", clock="cycles")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(BackendError, match="set_num_threads"):
            Runner(config, device="cpu", clock="thread")
        torch.set_num_threads(1)
        runner = Runner(config, device="cpu", clock="thread")
        assert "CPU clock" in runner.describe()
    finally:
        torch.set_num_threads(threads)


def test_lawson_hanson_equals_the_exhaustive_nnls():
    rng = np.random.default_rng(11)
    for _ in range(30):
        matrix = rng.random((15, 4))
        target = matrix @ rng.normal(size=4) + 0.05 * rng.standard_normal(15)
        assert cal.lawson_hanson(matrix, target) == pytest.approx(cal.nonnegative_least_squares(matrix, target),
                                                                 abs=1e-9)


def test_piecewise_form_recovers_a_concave_batch_curve():
    """Real small-batch GEMMs are concave in the batch (4 decodes cost far less than 4 of 1): the
    piecewise form fits that exactly, the linear form cannot, and auto picks the piecewise one."""
    truth = costs.CostModel("truth", 0, 0, 0, d=2e-7, f=1e-3,
                            token_knots=((1, 0.010), (4, 0.016), (16, 0.020), (64, 0.030), (256, 0.08), (576, 0.17)))
    config = SchedulerConfig(block_size=16, num_kv_blocks=3000, max_num_batched_tokens=4096, max_num_seqs=64,
                             max_model_len=1024)
    measurements = []
    for point in cal.design_grid(512, 64, 512):
        shape = costs.step_shape(*reversed(cal.point_state(point, config)))
        measurements.append(cal.Measurement(point, shape, truth.shape_seconds(shape), 0.0))
    form, fitted, rms = cal.choose_form(measurements)
    assert form == "piecewise" and rms["piecewise"] < 1e-6 < 0.05 < rms["linear"]
    model = cal.cost_model_of(fitted)
    for tokens in (1, 3, 16, 100, 576, 2000):
        shape = costs.StepShape(tokens, 0, tokens, 1, tokens * (tokens + 1) // 2)
        assert model.shape_seconds(shape) == pytest.approx(truth.shape_seconds(shape), rel=1e-6)


def test_a_piecewise_profile_file_round_trips(tmp_path):
    measurements = _fake_measurements((2e-3, 5e-5, 1e-4, 3e-8))
    coefficients = cal.fit(measurements, "piecewise")
    document = cal.profile_document("pw", coefficients, measurements, {"model": "m", "device": "cpu",
                                    "torch_threads": 1, "torch_version": "x"}, {"repeats": 1, "warmup": 0}, {},
                                    "piecewise", {"piecewise": 0.0})
    path = tmp_path / "pw.json"
    path.write_text(cal.dumps(document))
    loaded = costs.load_profile(path)
    assert loaded.token_knots == tuple((t, v) for t, v in coefficients["token_knots"]) and loaded.token_knots
    shape = measurements[5].shape
    assert loaded.shape_seconds(shape) == pytest.approx(cal.cost_model_of(coefficients).shape_seconds(shape))
    document["token_knots"] = [[4, 0.1], [1, 0.2]]
    path.write_text(cal.dumps(document))
    with pytest.raises(costs.CostModelError, match="token_knots"):
        costs.load_profile(path)


def test_the_calibration_page_is_rendered_from_its_measurements():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gen_calibration_doc", root / "scripts" / "gen_calibration_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (root / "docs" / "calibration.md").read_text() == module.render(), (
        "docs/calibration.md is stale: run .venv/bin/python scripts/gen_calibration_doc.py --render-only")
    for profile in (root / "docs" / "calibration").glob("*-profile.json"):
        assert costs.load_profile(profile).measured
