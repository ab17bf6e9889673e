#!/usr/bin/env bash
# Device check of the PyTorch backend (schedspec.gpu_backend) on a lent CUDA machine.
#
# Assumes: Python 3.12 with its own CUDA torch, numpy, attrs, pytest and hypothesis (tests/conftest.py
# imports it); safetensors and transformers are optional (their tests skip). Downloads nothing, needs
# no z3.
# Runs tests/test_gpu_backend_*.py with SCHEDSPEC_DEVICE=cuda and prints one summary line.
# Usage, from anywhere: bash scripts/device_check.sh [cuda|cpu]   (PYTHON=... picks the interpreter;
# "cpu" is a rehearsal of the same steps on a machine without a GPU).
# Exit status: 0 all passed, 1 a test failed, 2 the machine is not usable (no CUDA, missing module).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEVICE="${1:-cuda}"
export DEVICE
started=$(date +%s)

"$PY" - <<'EOF' || exit 2
import importlib.util, sys
missing = [m for m in ("torch", "numpy", "attrs", "pytest", "hypothesis") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"DEVICE CHECK: UNUSABLE: missing modules {missing}")
import os, torch
if os.environ["DEVICE"] == "cuda" and not torch.cuda.is_available():
    sys.exit(f"DEVICE CHECK: UNUSABLE: torch {torch.__version__} sees no CUDA device")
optional = [m for m in ("safetensors", "transformers") if importlib.util.find_spec(m) is None]
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, {gpu}; "
      f"optional modules missing (tests skip): {optional or 'none'}", flush=True)
EOF

# Make `schedspec` importable: an offline editable install, else a shadow package tree of symlinks
# (pyproject maps schedspec.spec -> spec/, schedspec.gpu_backend -> gpu_backend/, ...).
if ! "$PY" -c "import schedspec.gpu_backend.testing, schedspec.spec.state" 2>/dev/null; then
    if ! "$PY" -m pip install --no-deps --no-build-isolation --no-index -q -e . >/dev/null 2>&1 \
        || ! "$PY" -c "import schedspec.gpu_backend.testing, schedspec.spec.state" 2>/dev/null; then
        shadow=$(mktemp -d)
        mkdir "$shadow/schedspec"
        for entry in schedspec/*; do ln -s "$PWD/$entry" "$shadow/schedspec/"; done
        for package in spec reference gpu_backend engines lab; do
            [ -d "$package" ] && ln -s "$PWD/$package" "$shadow/schedspec/$package"
        done
        export PYTHONPATH="$shadow${PYTHONPATH:+:$PYTHONPATH}"
        echo "schedspec from a shadow tree at $shadow (editable install not possible offline)"
    fi
fi

export SCHEDSPEC_DEVICE="$DEVICE"
log=$(mktemp)
timeout 270 "$PY" -m pytest tests/test_gpu_backend_*.py -q 2>&1 | tee "$log" | tail -n 40
status=${PIPESTATUS[0]}
summary=$(grep -E "(passed|failed|error|skipped)" "$log" | tail -n 1)
elapsed=$(( $(date +%s) - started ))
if [ "$status" -eq 0 ]; then
    echo "DEVICE CHECK: PASS on $DEVICE: ${summary:-no summary} (${elapsed}s total)"
    exit 0
fi
[ "$status" -eq 124 ] && summary="timed out after 270s; $summary"
echo "DEVICE CHECK: FAIL on $DEVICE (pytest exit $status): ${summary:-no summary} (${elapsed}s total)"
exit 1
