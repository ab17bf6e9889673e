#!/usr/bin/env bash
# The main job (README quick start): install schedspec and run the lab on the default real trace
# window (Azure LLM inference trace 2023, conversation). Extra arguments go to `schedspec lab`.
#
# The install runs once: on a fresh machine (no .venv) it creates .venv and installs schedspec
# (editable, so later code changes need no reinstall); after that it is repeated only when
# pyproject.toml (the pinned dependencies) changed since, or the environment is broken.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.schedspec-lab-install
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ ! -x .venv/bin/schedspec || "$(cat "$stamp" 2>/dev/null)" != "$want" ]] \
   || ! .venv/bin/python -c "import schedspec.cli" 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e . 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  .venv/bin/python -c "import schedspec.cli"  # fail here if the install is incomplete
  echo "$want" > "$stamp"
fi
exec .venv/bin/schedspec lab "$@"
