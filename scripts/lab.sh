#!/usr/bin/env bash
# The main job (README quick start): install schedspec and run the lab on the default real trace
# window (Azure LLM inference trace 2023, conversation). Extra arguments go to `schedspec lab`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e . 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
exec .venv/bin/schedspec lab "$@"
