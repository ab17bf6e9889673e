#!/usr/bin/env bash
# The test command (README quick start): create the environment, install pinned dependencies,
# lint, build the documentation site (mkdocs.yml, strict: a broken link or reference fails), and run
# the whole suite. The engines' environments are made too (scripts/engines_setup.sh), in the background from
# the start, beside .venv's install: .venv-vllm and .vllm033 (log: build/vllm-setup.log) waited for before
# the suite; .venv-sglang (log: build/sglang-setup.log) while the suite runs too: the SGLang adapter
# waits for it (engines/sglang.py, wait_for_install), so only the SGLang tests wait, and only if they
# come before the install ends. A failed vLLM install stops the command before the suite with its
# `ENGINES SETUP: FAIL` line; a failed SGLang install fails the command with its one `ENGINES SETUP: FAIL` line after the suite. Local opt-outs:
# SCHEDSPEC_SKIP_ENGINES=1 skips every engine (then deselect tests/test_engine_vllm.py; the SGLang tests
# skip, saying why); SCHEDSPEC_SKIP_SGLANG=1 skips SGLang alone (its tests skip, saying why).
# HYPOTHESIS_PROFILE selects the Hypothesis profile (default: fast; CI sets "ci").
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_SETUP_PID=""
SGLANG_SETUP_LOG=build/sglang-setup.log
if [[ "${SCHEDSPEC_SKIP_ENGINES:-}" != "1" && "${SCHEDSPEC_SKIP_SGLANG:-}" != "1" ]]; then
  mkdir -p build
  echo "install: building .venv-sglang in the background (reused when unchanged; log $SGLANG_SETUP_LOG)"
  bash scripts/engines_setup.sh --only sglang >"$SGLANG_SETUP_LOG" 2>&1 &
  SGLANG_SETUP_PID=$!
  export SCHEDSPEC_SGLANG=1  # the SGLang tests run: a missing environment fails them, never skips them
fi
# .venv-vllm and .vllm033 (`--only vllm`) in the background too: they are made with python3 (or python3.11),
# not .venv, so they install beside .venv's pip installs; waited for before the suite (below), where a failed
# install stops the command with its `ENGINES SETUP: FAIL` line.
VLLM_SETUP_LOG=build/vllm-setup.log
mkdir -p build
echo "install: building .venv-vllm and .vllm033 in the background (reused when unchanged; log $VLLM_SETUP_LOG)"
bash scripts/engines_setup.sh --only vllm >"$VLLM_SETUP_LOG" 2>&1 &
VLLM_SETUP_PID=$!
# The two pip installs are skipped when .venv was made by this script from the same pins: the stamp
# .venv/.schedspec-install holds the pyproject.toml and engines/requirements-nanovllm.txt it installed
# (written only after both installs succeeded; the import checks below run every time, and the package
# itself is an editable install, so code changes need no reinstall). A fresh clone always installs.
pins() { cat pyproject.toml engines/requirements-nanovllm.txt; python3 --version; }
if [[ -x .venv/bin/python && -f .venv/.schedspec-install ]] && cmp -s .venv/.schedspec-install <(pins); then
  echo "install: reused .venv (pins unchanged since its install)"
else
  rm -f .venv/.schedspec-install
  python3 -m venv .venv
  pip_quiet() {
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
      | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
  }
  pip_quiet -e '.[dev,torch,hf,docs,ray]'
  # nano-vLLM (engine adapter schedspec.engines.nanovllm): exact pins, --no-deps so that its declared
  # triton/torch requirements are not resolved (see engines/requirements-nanovllm.txt).
  pip_quiet --no-deps -r engines/requirements-nanovllm.txt
  pins >.venv/.schedspec-install
fi
.venv/bin/python -c "import schedspec, torch, transformers, xxhash" # fail early if the install is incomplete
.venv/bin/python -c "from schedspec.engines.nanovllm import load_engine; load_engine()"
.venv/bin/ruff check .
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet   # the site goes to site/ (git-ignored)
# .venv-vllm and .vllm033 for the `vllm` adapters: the suite needs them, so wait for their set-up here.
if ! wait "$VLLM_SETUP_PID"; then
  cat "$VLLM_SETUP_LOG" >&2
  grep -q "^ENGINES SETUP: FAIL" "$VLLM_SETUP_LOG" \
    || echo "ENGINES SETUP: FAIL: the vLLM install (.venv-vllm, .vllm033) failed; see $VLLM_SETUP_LOG" >&2
  exit 1
fi
grep "^ENGINES SETUP" "$VLLM_SETUP_LOG" || true
# The suite on both cores (pytest-xdist, 2 workers; every test is independent of order and process).
# --dist worksteal: each worker starts on one contiguous half of the collection (so a module's
# fixtures, e.g. a torch runner or the vLLM worker process, are mostly built once per worker), and a
# worker that runs dry takes half of the other's queue. The durations are very uneven (the stateful
# machines and Z3 searches take minutes, most tests milliseconds), which `load`'s fixed chunks
# balance worse; no test needs to share a worker with another, so `loadgroup` has nothing to group.
# Arguments are passed to pytest, so `-n 0` (later on the line) runs everything in this process.
status=0
.venv/bin/python -m pytest -q -n 2 --dist worksteal "$@" || status=$?
if [[ -n "$SGLANG_SETUP_PID" ]] && ! wait "$SGLANG_SETUP_PID"; then
  grep "^ENGINES SETUP: FAIL" "$SGLANG_SETUP_LOG" >&2 \
    || echo "ENGINES SETUP: FAIL: the SGLang install (.venv-sglang) failed; see $SGLANG_SETUP_LOG" >&2
  exit 1
fi
[[ -z "$SGLANG_SETUP_PID" ]] || grep "^ENGINES SETUP" "$SGLANG_SETUP_LOG" || true
exit "$status"
