"""Benchmark: ``schedspec check FILE`` end to end, as a user runs it, on lab traces, beside a peer.

    .venv/bin/python benchmarks/check_speed.py [--only NAME,...] [--no-peer] [--repeat N] [--folder DIR]

Each trace is made once by ``schedspec lab --steps none --steps-out FILE ...`` (the command is printed;
kept in ``--folder``, default ``build/check-speed``, and reused while the lab's output for the same
arguments is there), then judged by ``schedspec check FILE`` in a subprocess: CPU seconds (user +
system, of the child process) and wall seconds, steps per CPU second and per wall second, beside the
issue's target (issue 26: 20,000 steps/s on one core). The same subprocess judging an empty trace
(the header only) gives the start-up cost, printed beside the figures.

Each file is judged three ways, side by side: ``schedspec check FILE`` as a user runs it (the fast path,
``spec/fast_check.py``, certifies a legal trace; the plain path judges what it cannot certify), the
**plain path** alone (``schedspec check --no-fast-path FILE``: the spec's persistent state, the incremental
checker, a ``StepRecord`` per line), and the **peer** (unless ``--no-peer``): the plain path with the previous
reading path, ``jsonschema``'s ``best_match(iter_errors(...))`` on every line (the compiled ``jsonschema-rs``
screen of ``schedspec.spec.trace`` turned off, so every line goes to the definition;
``SCHEDSPEC_NO_FAST_PATH=1``). All must give the same verdict; the benchmark fails (exit 1) where they
differ.

Traces (``--only``): ``azure-120`` (the lab's default window: the Azure 2023 conversation trace, first
120 s), ``azure-600`` (its first 600 s), ``mooncake-120`` (Mooncake conversation trace, first 120 s,
profile ``llama3.1-8b-a100-80gb``), ``mooncake-120-prefix`` (the same with ``--set
enable_prefix_caching=true``: the incremental checker's shared-block ledger).

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

TARGET_STEPS_PER_S = 20_000
"""Issue 26: ``schedspec check`` at least this many steps per second on one core."""

MOONCAKE = ("--trace", "mooncake", "--profile", "llama3.1-8b-a100-80gb")
TRACES: dict[str, tuple[str, ...]] = {
    "azure-120": (),
    "azure-600": ("--duration", "600"),
    "mooncake-120": MOONCAKE,
    "mooncake-120-prefix": (*MOONCAKE, "--set", "enable_prefix_caching=true"),
}
"""Name -> the ``schedspec lab`` arguments that make the trace (besides ``--steps none --steps-out``)."""

ROOT = Path(__file__).resolve().parents[1]
SCHEDSPEC = [str(Path(sys.executable).parent / "schedspec")]
"""The console script beside this interpreter (the project's ``.venv``), as a user runs it."""


def _peer_main(path: str) -> None:
    """``schedspec check PATH`` with the previous reading path (main before issue 26): every line through
    ``jsonschema``, and the repeated-key check as a Python loop over every object's pairs."""
    from schedspec.spec import trace

    def no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
        data: dict[str, object] = {}
        for key, value in pairs:
            if key in data:
                raise trace.StrictJsonError(f"key {key!r} appears twice in one object")
            data[key] = value
        return data

    class NoScreen:
        """Accepts nothing, so :func:`schedspec.spec.trace._schema_error` asks ``jsonschema`` every time."""

        def is_valid(self, data: object) -> bool:
            return False

    trace._fast_validator = lambda part, version: NoScreen()
    trace._no_duplicate_keys = no_duplicate_keys
    os.environ["SCHEDSPEC_NO_FAST_PATH"] = "1"  # the plain path, as before the fast path existed
    from schedspec.cli import main

    sys.argv = ["schedspec", "check", path]
    main()


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed (the fast path reads with json)"


def _timed(command: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """(CPU seconds of the child, wall seconds, the finished process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall, done


def _verdict(done: subprocess.CompletedProcess) -> tuple[int, int, str]:
    """(exit code, steps checked, the summary line) of a ``schedspec check`` run."""
    lines = done.stdout.strip().splitlines()
    last = lines[-1] if lines else done.stderr.strip()
    found = re.match(r"([\d,]+) steps? checked", last)  # plural() writes 5,620 with a thousands separator
    return done.returncode, int(found.group(1).replace(",", "")) if found else -1, last


def _make_trace(name: str, folder: Path) -> Path:
    path = folder / f"{name}.jsonl"
    arguments = folder / f"{name}.args"
    wanted = " ".join(TRACES[name])
    if path.exists() and arguments.exists() and arguments.read_text() == wanted:
        print(f"  {name}: reusing {path} (made by schedspec lab --steps none {wanted})")
        return path
    command = [*SCHEDSPEC, "lab", "--steps", "none", *TRACES[name], "--steps-out", str(path)]
    print(f"  {name}: {' '.join(command[len(SCHEDSPEC) - 1:])}", flush=True)
    path.unlink(missing_ok=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"check_speed: the lab run for {name} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    arguments.write_text(wanted)
    return path


def _rate(steps: int, seconds: float) -> str:
    return f"{steps / seconds:>9,.0f}" if seconds > 0 else "      inf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(TRACES), help=f"traces, comma-separated: {', '.join(TRACES)}")
    parser.add_argument("--no-peer", action="store_true", help="skip the peer (jsonschema on every line)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each; the least CPU is reported")
    parser.add_argument("--folder", default=str(ROOT / "build" / "check-speed"))
    parser.add_argument("--peer-run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_run is not None:
        _peer_main(args.peer_run)
        return
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in TRACES]
    if unknown:
        sys.exit(f"check_speed: --only {','.join(unknown)}: unknown; known: {', '.join(TRACES)}")
    if not Path(SCHEDSPEC[0]).exists():
        sys.exit(f"check_speed: {SCHEDSPEC[0]}: no such file; run with the project's .venv/bin/python")
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "?"
    print(f"conditions: python {platform.python_version()}; {os.cpu_count()} cpus "
          f"({platform.processor() or platform.machine()}); load average {os.getloadavg()[0]:.1f} at start; "
          f"jsonschema {metadata.version('jsonschema')}, jsonschema-rs {metadata.version('jsonschema-rs')}, "
          f"orjson {_version('orjson')}; "
          f"commit {commit}; CPU = user + system seconds of the `schedspec check` process, one core "
          f"(it runs single-threaded); least of {args.repeat} run(s); target {TARGET_STEPS_PER_S:,} steps/s")
    print("traces:")
    paths = {name: _make_trace(name, folder) for name in names}

    header_only = folder / "header-only.jsonl"
    with paths[names[0]].open("rb") as handle:
        header_only.write_bytes(handle.readline())
    startup, _, _ = _timed([*SCHEDSPEC, "check", str(header_only), "--allow-unfinished"])
    print(f"start-up: `schedspec check` on a header-only trace (0 steps): {startup:.2f} s CPU "
          "(included in every figure below)")

    header = (f"{'trace':<20} {'runner':<28} {'steps':>7} {'CPU s':>7} {'wall s':>7} {'steps/CPU s':>11} "
              f"{'steps/wall s':>12}  {'target':>8}  verdict")
    print(header)
    print("-" * len(header))
    mismatch = False
    for name in names:
        path = paths[name]
        runners = [("schedspec check (fast path)", [*SCHEDSPEC, "check", str(path)]),
                   ("plain: --no-fast-path", [*SCHEDSPEC, "check", "--no-fast-path", str(path)])]
        if not args.no_peer:
            runners.append(("peer: jsonschema every line", [sys.executable, __file__, "--peer-run", str(path)]))
        verdicts = []
        for label, command in runners:
            best = None
            for _ in range(max(1, args.repeat)):
                cpu, wall, done = _timed(command)
                if best is None or cpu < best[0]:
                    best = (cpu, wall, done)
            cpu, wall, done = best
            code, steps, summary = _verdict(done)
            verdicts.append((code, steps, summary))
            met = "met" if steps > 0 and steps / cpu >= TARGET_STEPS_PER_S else "not met"
            print(f"{name:<20} {label:<28} {steps:>7,} {cpu:>7.2f} {wall:>7.2f} {_rate(steps, cpu):>11} "
                  f"{_rate(steps, wall):>12}  {met:>8}  exit {code}: {summary}", flush=True)
        if len({v for v in verdicts}) > 1:
            mismatch = True
            print(f"{name}: the verdicts differ")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if mismatch:
        sys.exit(1)


if __name__ == "__main__":
    main()
