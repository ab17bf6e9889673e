"""Benchmark: scheduler overhead per step, ``schedule()`` plus the update, of schedspec's reference
``fcfs`` scheduler (and ``fcfs-fast``, the same plans on mutable tables) side by side with vLLM 0.32's own ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``:
``schedule`` and ``update_from_output``) on the same workload, in the same run.

The shape is the one vLLM's scheduler is usually timed on: N running requests decoding (prompts of 32
tokens, block size 16, nothing finishes during the timed steps), N = 256 and 1,024 by default. Each
side is warmed up (the prefill steps and a few decode steps), then ``--steps`` decode steps are timed
one call at a time with the thread's CPU clock (``--clock wall`` for ``time.perf_counter_ns``); the
median and mean per step are printed. Building
the sampled tokens (schedspec) or the ``ModelRunnerOutput`` (vLLM) is outside the timed calls.

vLLM runs in its own environment (``.venv-vllm``, made by ``scripts/engines_setup.sh``; or
``SCHEDSPEC_VLLM_PYTHON``): this file runs itself there with ``--vllm-side``, building the scheduler as
the ``vllm`` adapter's worker does (``engines/vllm_worker.py`` ``Worker``, no model, no GPU) and calling
vLLM directly, not through the adapter's pipe.

    .venv/bin/python benchmarks/scheduler_overhead.py [--sizes 256,1024] [--steps 50] [--only schedspec]
    .venv/bin/python benchmarks/scheduler_overhead.py --only vllm --recorder --sizes 256   # the recorder's cost

``--recorder`` adds vLLM's Scheduler with the whole-engine recorder
(``engines/recorder/schedspec_vllm_recorder.py``) beside the plain one, with the recorder's own time per
step on the engine thread (the time it spends outside vLLM's calls: copying the plan, the arrivals and
the sampled tokens for its writer thread). The vLLM rows also give the process's CPU time per timed step
(``time.process_time_ns`` over the timed loop, every thread: the recorder's writer thread, which builds
and writes the JSON lines, is counted there, its queue drained before the clock stops; the building of
each step's ``ModelRunnerOutput`` is in it on both rows).

The row ``fcfs checked`` is online checking: ``fcfs``'s plan and the engine loop's checked step (the
rules, the spec's ``apply_plan``, every invariant, by the incremental checker), in the ``update`` column.
Issue 26's target: at 256 running decodes, its total within vLLM's ``schedule()`` + ``update_from_output``
in the same run; the last line says met or not met.

Not part of the test suite. Prints the run conditions first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN = 32
BLOCK_SIZE = 16
MAX_TOKENS = 100_000
WARMUP_DECODE_STEPS = 5
CLOCK = time.thread_time_ns
"""The timer: CPU time of this thread (``--clock cpu``, the default: a shared, loaded machine deschedules
the process between calls, which wall time would count) or ``time.perf_counter_ns`` (``--clock wall``)."""


def config_fields(size: int, steps: int) -> dict:
    """The limits both schedulers get: every request runs at once, the prefill takes one step (or a
    few), and the KV cache holds every request at its longest length in the run."""
    longest = PROMPT_LEN + steps + WARMUP_DECODE_STEPS + 64
    return {
        "block_size": BLOCK_SIZE,
        # ceil(longest / BLOCK_SIZE), spec.config.blocks_for_tokens written out: this function also runs in
        # vLLM's interpreter (--vllm-side), where schedspec is not installed
        "num_kv_blocks": size * -(-longest // BLOCK_SIZE) + 16,
        "max_num_batched_tokens": max(8192, size),
        "max_num_seqs": size,
        "max_model_len": 4096,
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": 0,
    }


def summary(schedule_ns: list[int], update_ns: list[int]) -> dict:
    total = [a + b for a, b in zip(schedule_ns, update_ns, strict=True)]
    return {key: {"median_us": statistics.median(values) / 1e3, "mean_us": statistics.fmean(values) / 1e3}
            for key, values in (("schedule", schedule_ns), ("update", update_ns), ("total", total))}


CHECKED = "fcfs checked"
"""The online-checking row: ``fcfs``'s plan, then the checked step of the engine loop
(:class:`schedspec.spec.stepper.Stepper` with the incremental checker: the rules on the plan, the spec's
``apply_plan``, every invariant), the transition handed to the scheduler (``accept_transition``)."""
TARGET_SIZE = 256
"""Issue 26: the checked step at this many running decodes within vLLM's ``schedule()`` + update."""


def schedspec_side(size: int, steps: int, name: str = "fcfs") -> dict:
    from schedspec.reference.scheduler import make_scheduler
    from schedspec.spec.config import SchedulerConfig
    from schedspec.spec.request import Request
    from schedspec.spec.stepper import Stepper, step_checker

    fields = config_fields(size, steps)
    config = SchedulerConfig(**fields)
    checked = name == CHECKED
    scheduler = make_scheduler("fcfs" if checked else name, config)
    # from the scheduler's own state object, as the engine loop starts it, so that each transition is handed over
    stepper = Stepper(config, step_checker(config, incremental=True), state=scheduler.state) if checked else None
    for index in range(size):
        request = Request(f"r{index}", 0, [1 + (index + k) % 1000 for k in range(PROMPT_LEN)], MAX_TOKENS)
        if stepper is not None:
            scheduler.accept_transition(stepper.arrive(request))
        scheduler.add_request(request)

    def step(timed: bool) -> tuple[int, int, int]:
        started = CLOCK()
        plan = scheduler.schedule()
        planned = CLOCK()
        requests = scheduler.live if hasattr(scheduler, "live") else scheduler.state.requests  # fcfs-fast: its records
        sampled = {item.request_id: 7 for item in plan.scheduled
                   if item.num_computed_tokens + item.num_tokens >= requests[item.request_id].num_tokens}
        before_update = CLOCK()
        if stepper is not None:  # the checked step: rules, apply_plan, invariants; the scheduler takes the result
            outcome = stepper.step(plan, sampled)
            assert not outcome.rule_violations and not outcome.invariant_violations, outcome
            scheduler.accept_transition(outcome.transition)
        scheduler.update(plan, sampled)
        assert stepper is None or scheduler.state is stepper.state, "the transition was not handed over"
        done = CLOCK()
        decodes = sum(1 for item in plan.scheduled if item.num_tokens == 1)
        return planned - started, done - before_update, decodes

    while step(False)[2] < size:  # prefill steps, until every request decodes
        pass
    for _ in range(WARMUP_DECODE_STEPS):
        step(False)
    schedule_ns, update_ns = [], []
    for _ in range(steps):
        a, b, decodes = step(True)
        assert decodes == size, f"{decodes} decodes, expected {size}"
        schedule_ns.append(a)
        update_ns.append(b)
    return summary(schedule_ns, update_ns)


def vllm_side(size: int, steps: int, recorded: bool = False) -> dict:
    """Run in the vLLM environment (``--vllm-side``): vLLM's Scheduler built as the adapter's worker
    builds it, called directly. ``recorded``: the whole-engine recorder's subclass
    (``engines/recorder/schedspec_vllm_recorder.py`` ``RecordingScheduler``, writing its trace to a
    temporary file), whose own time per step (``recorder_seconds``) is reported as ``recorder``."""
    import importlib.util
    import tempfile

    spec = importlib.util.spec_from_file_location("vllm_worker", ROOT / "engines" / "vllm_worker.py")
    worker_module = importlib.util.module_from_spec(spec)
    # the worker reads its own command line (``--path-ahead DIR`` or nothing) when imported
    saved_argv, sys.argv = sys.argv, [str(ROOT / "engines" / "vllm_worker.py")]
    try:
        spec.loader.exec_module(worker_module)
    finally:
        sys.argv = saved_argv
    from vllm.v1.outputs import ModelRunnerOutput

    base = None
    folder = tempfile.TemporaryDirectory(prefix="schedspec-recorder-bench-")
    if recorded:
        import schedspec_vllm_recorder  # on sys.path: the worker module put its folder there

        os.environ[schedspec_vllm_recorder.TRACE_VARIABLE] = os.path.join(folder.name, f"trace-{size}.jsonl")
        base = schedspec_vllm_recorder.RecordingScheduler
    worker = worker_module.Worker(config_fields(size, steps), "fcfs", False, 32_000, base=base)
    scheduler = worker.scheduler
    recorder_ns: list[int] = []
    for index in range(size):
        worker.add({"id": f"r{index}", "prompt": [1 + (index + k) % 1000 for k in range(PROMPT_LEN)],
                    "max_tokens": MAX_TOKENS, "priority": 0, "arrival_time": float(index), "eos": None})

    def step() -> tuple[int, int, int]:
        started = CLOCK()
        output = scheduler.schedule()
        planned = CLOCK()
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for request_id in ids:
            request = scheduler.requests[request_id]
            done = request.num_computed_tokens >= request.num_tokens  # after schedule: advanced
            sampled.append([7] if done else [])
        runner_output = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=sampled)
        before_update = CLOCK()
        scheduler.update_from_output(output, runner_output)
        finished = CLOCK()
        decodes = sum(1 for n in output.num_scheduled_tokens.values() if n == 1)
        return planned - started, finished - before_update, decodes

    while step()[2] < size:
        pass
    for _ in range(WARMUP_DECODE_STEPS):
        step()
    schedule_ns, update_ns = [], []
    process_began = time.process_time_ns()
    for _ in range(steps):
        spent = getattr(scheduler, "recorder_seconds", 0.0)
        a, b, decodes = step()
        assert decodes == size, f"{decodes} decodes, expected {size}"
        schedule_ns.append(a)
        update_ns.append(b)
        recorder_ns.append(round((getattr(scheduler, "recorder_seconds", 0.0) - spent) * 1e9))
    if recorded:
        scheduler.recorder_flush()  # the writer thread's lines for the timed steps, inside the process clock
    process_ns = time.process_time_ns() - process_began
    import vllm

    result = {"vllm_version": vllm.__version__, **summary(schedule_ns, update_ns),
              "process_cpu_us_per_step": process_ns / steps / 1e3}
    if recorded:
        result["recorder"] = {"median_us": statistics.median(recorder_ns) / 1e3,
                              "mean_us": statistics.fmean(recorder_ns) / 1e3}
    scheduler.shutdown()
    folder.cleanup()
    return result


def vllm_python() -> Path:
    return Path(os.environ.get("SCHEDSPEC_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024", help="running decode requests, comma-separated")
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per size")
    parser.add_argument("--only", choices=["schedspec", "vllm"], default=None)
    parser.add_argument("--schedulers", default=f"fcfs,fcfs-fast,{CHECKED}",
                        help="schedspec schedulers to time, comma-separated (fcfs-fast: the same plans on mutable "
                             f"tables; {CHECKED!r}: fcfs's plan and the checked step, online checking)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="thread CPU time (default) or wall time per call")
    parser.add_argument("--recorder", action="store_true",
                        help="also time vLLM's Scheduler with the whole-engine recorder (schedspec_vllm_recorder), "
                             "and the recorder's own time per step")
    parser.add_argument("--vllm-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.vllm_side:
        print(json.dumps({str(size): vllm_side(size, args.steps, args.recorder) for size in sizes}))
        return
    print(f"conditions: {os.cpu_count()} cpus, {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}; running decode requests "
          f"with {PROMPT_LEN}-token prompts, block_size {BLOCK_SIZE}, {args.steps} timed steps after "
          f"{WARMUP_DECODE_STEPS} warm-up decode steps; clock: {args.clock} time; config per size: {config_fields(sizes[0], args.steps)} "
          f"(max_num_seqs = size)")
    results: dict[str, dict] = {}
    if args.only != "vllm":
        for name in args.schedulers.split(","):
            results[f"schedspec {name}"] = {str(size): schedspec_side(size, args.steps, name) for size in sizes}
    if args.only != "schedspec":
        python = vllm_python()
        if not python.exists():
            print(f"vLLM side skipped: {python} not found (bash scripts/engines_setup.sh)")
        else:
            for recorded in (False, True) if args.recorder else (False,):
                completed = subprocess.run([str(python), __file__, "--vllm-side", "--sizes", args.sizes,
                                            "--steps", str(args.steps), "--clock", args.clock]
                                           + (["--recorder"] if recorded else []),
                                           capture_output=True, text=True, check=False)
                if completed.returncode != 0:
                    print("vLLM side failed:\n" + completed.stderr[-3000:])
                    continue
                payload = json.loads(completed.stdout.strip().splitlines()[-1])
                version = next(iter(payload.values())).pop("vllm_version", "?")
                for value in payload.values():
                    value.pop("vllm_version", None)
                results[f"vLLM {version} Scheduler" + (" + recorder" if recorded else "")] = payload
    print(f"{'scheduler':<36} {'running':>8} {'schedule us':>16} {'update us':>16} {'total us':>16}"
          "   (median / mean per step)")
    for name, by_size in results.items():
        for size, figures in by_size.items():
            cells = [f"{figures[k]['median_us']:7.0f} /{figures[k]['mean_us']:7.0f}" for k in ("schedule", "update", "total")]
            mine = figures.get("recorder")
            extra = f"   of which the recorder's own {mine['median_us']:.0f} / {mine['mean_us']:.0f}" if mine else ""
            if "process_cpu_us_per_step" in figures:
                extra += f"   process CPU (all threads) {figures['process_cpu_us_per_step']:.0f} per step"
            print(f"{name:<36} {size:>8} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16}{extra}")
    vllm_row = next((by_size for name, by_size in results.items() if name.startswith("vLLM") and "recorder" not in name), None)
    mine = results.get(f"schedspec {CHECKED}", {}).get(str(TARGET_SIZE))
    if mine and vllm_row and str(TARGET_SIZE) in vllm_row:
        ratio = mine["total"]["median_us"] / vllm_row[str(TARGET_SIZE)]["total"]["median_us"]
        print(f"online checking at {TARGET_SIZE} running decodes: the checked step (plan + check) is {ratio:.2f}x vLLM's "
              f"schedule() + update_from_output (medians); target <= 1.00x: {'met' if ratio <= 1 else 'not met'}")
    else:
        print(f"online checking target (the checked step within vLLM's at {TARGET_SIZE} running decodes): not judged "
              f"(needs the {CHECKED!r} row and vLLM at size {TARGET_SIZE})")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
