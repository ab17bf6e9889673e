"""Diff ``schedspec lab``'s output at a git revision against the working tree's, on two dozen command lines
(a run, --compare, --sweep, --capacity, --json, --save / --steps-out / --requests-out / --plot, and bad
input), wall-time figures excepted: the check that a refactoring of the lab left its output unchanged.

    .venv/bin/python scripts/lab_output_diff.py [--against REV] [--only N]

The revision's tree is exported with ``git archive`` into a temporary folder and run with the same
interpreter, its packages put first on the import path (the editable install of the working tree left
out); each command line runs in an empty folder of its own, and its stdout, stderr, exit status and
every file it wrote (PNG files by their hash) are compared. Exit 0 when everything is equal, 1 when
something differs (the differences printed), 2 on bad input. Not a test of the suite: the expected
output is the old code's, which is the point of a refactoring check, not a statement of what is right.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMAND_LINES = [
    "--duration 10 --steps 5",
    "--duration 10 --steps all --json",
    "--duration 10 --steps none --compare fcfs,static,fcfs-no-chunking",
    "--duration 10 --compare fcfs,priority --json",
    "--duration 10 --steps none --sweep max_num_seqs=4,16 --jobs 1",
    "--duration 10 --sweep max_num_seqs=4,16 --sweep scheduler=fcfs,static --slo ttft=1s,itl=200ms --jobs 1",
    "--duration 10 --sweep max_num_seqs=4,16 --json --jobs 1",
    "--synthetic rate=2,cv=1,prompt=200,output=50,n=40,seed=1 --sweep max_num_seqs=4,16 --capacity "
    "--slo ttft=1s,itl=200ms --jobs 1",
    "--duration 20 --sweep max_num_seqs=8,32 --capacity --slo ttft=2s,itl=200ms --jobs 1 --json",
    "--duration 10 --steps none --save rec.json --steps-out steps.jsonl --requests-out req.csv",
    "--duration 10 --steps none --compare fcfs,static --save rec.json --steps-out s.jsonl --requests-out r.csv",
    "--duration 10 --steps none --sweep max_num_seqs=4,16 --save rec.json --jobs 1",
    "--duration 10 --steps every:50 --no-check --max-steps 120 --set max_num_seqs=2",
    "--synthetic rate=5,cv=2,prompt=300,output=40,duration=5,seed=3 --steps changed:10 --slo ttft=500ms,itl=100ms",
    "--duration 10 --capacity",
    "--duration 10 --sweep bogus=1,2",
    "--duration 10 --compare fcfs,nope",
    "--duration 10 --sweep max_num_seqs=4 --compare fcfs,static",
    "--duration 10 --steps bad",
    "--duration 10 --save /nonexistent/dir/x.json",
    "--duration 10 --sweep max_num_seqs=4,16 --ray auto --jobs 1",
    "--duration 10 --max-steps 50 --steps none --plot plots",
    "--duration 10 --sweep max_num_seqs=4,16 --capacity --jobs 1",
    "--duration 10 --json --compare fcfs,static --sweep max_num_seqs=2",
    "--duration 20 --set enable_prefix_caching=true --steps changed:5 --steps-out steps.jsonl",
    "--duration 20 --set enable_prefix_caching=true --compare fcfs,priority,vllm-v1 --json",
]
"""The command lines compared (each fast: a 10 to 20 s window of the packaged Azure conversation trace)."""

PACKAGES = {"schedspec": "schedspec", "spec": "schedspec/spec", "reference": "schedspec/reference",
            "lab": "schedspec/lab", "engines": "schedspec/engines", "gpu_backend": "schedspec/gpu_backend"}
"""Folder of the tree -> where it goes under the import root (pyproject's package-dir)."""

RUNNER = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, sys.argv.pop(1))
import runpy
sys.argv[0] = "schedspec"
runpy.run_module("schedspec", run_name="__main__", alter_sys=True)
"""
"""Runs ``schedspec`` from an import root given first, leaving out the working tree's editable install."""

WALL = [(re.compile(r"Wall time [0-9.]+ s"), "Wall time X s"),
        (re.compile(r'"wall_time_s": [0-9.e-]+'), '"wall_time_s": X')]


def import_root(tree: Path, into: Path) -> Path:
    """``tree``'s packages laid out as they are imported (``schedspec.spec`` from ``spec/``, ...)."""
    for folder, target in PACKAGES.items():
        shutil.copytree(tree / folder, into / target, ignore=shutil.ignore_patterns("__pycache__"))
    return into


def capture(root: Path, tree: Path, args: str, runner: Path) -> dict[str, str]:
    """``{"stdout", "stderr", "status", FILE: text or hash}`` of ``schedspec lab ARGS`` from ``root``;
    the tree's own folder in any path is written ``ROOT/``."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "COLUMNS": "120", "TERM": "dumb", "NO_COLOR": "1", "PYTHONHASHSEED": "0"}
        done = subprocess.run([sys.executable, str(runner), str(root), "lab", *args.split()], cwd=folder, env=env,
                              capture_output=True, text=True, check=False)
        out = {"stdout": done.stdout, "stderr": done.stderr, "status": str(done.returncode)}
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                data = path.read_bytes()
                out[str(path.relative_to(folder))] = (hashlib.sha256(data).hexdigest() if path.suffix == ".png"
                                                      else data.decode("utf-8", "replace"))
    for key, text in out.items():
        text = text.replace(str(root / "schedspec"), "ROOT")
        for pattern, replacement in WALL:
            text = pattern.sub(replacement, text)
        out[key] = text
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="main", metavar="REV", help="git revision to compare with (main)")
    parser.add_argument("--only", type=int, default=None, metavar="N", help="the first N command lines only")
    args = parser.parse_args()
    lines = COMMAND_LINES[:args.only] if args.only else COMMAND_LINES
    with tempfile.TemporaryDirectory(prefix="lab-output-diff-") as work:
        work_path = Path(work)
        old_tree = work_path / "old"
        old_tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.against], capture_output=True, check=False)
        if archive.returncode != 0:
            print(f"--against {args.against}: {archive.stderr.decode().strip()}", file=sys.stderr)
            return 2
        subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive.stdout, check=True)
        old_root = import_root(old_tree, work_path / "old-import")
        new_root = import_root(ROOT, work_path / "new-import")
        runner = work_path / "run.py"
        runner.write_text(RUNNER)
        different = 0
        for args_text in lines:
            old, new = capture(old_root, old_tree, args_text, runner), capture(new_root, ROOT, args_text, runner)
            if old == new:
                print(f"same      lab {args_text}")
                continue
            different += 1
            print(f"DIFFERENT lab {args_text}")
            for key in sorted(set(old) | set(new)):
                if old.get(key) != new.get(key):
                    diff = difflib.unified_diff((old.get(key) or "").splitlines(), (new.get(key) or "").splitlines(),
                                                f"{args.against}:{key}", f"working tree:{key}", lineterm="", n=1)
                    print("\n".join(list(diff)[:40]))
        print(f"{len(lines) - different} of {len(lines)} command lines give the same output "
              f"({args.against} against the working tree; wall times excepted)")
        return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
