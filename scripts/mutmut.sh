#!/usr/bin/env bash
# Mutation score of the spec and the checker with mutmut 3 (issue 9). Not run in CI: slow on 2 cores.
#
#   scripts/mutmut.sh                 # all seven modules, one after the other, each with its own tests
#   scripts/mutmut.sh rules checker   # only the mutants of spec/rules.py and spec/checker.py
#   MUTMUT_CHILDREN=2 scripts/mutmut.sh rules       # parallel workers (default 1)
#   MUTMUT_RESUME=1 scripts/mutmut.sh rules         # keep build/mutmut and its results from a previous run
#   scripts/mutmut.sh 'schedspec.spec.checker.x__compare_after__mutmut_*'   # mutant names or patterns
#   MUTMUT_STAGE=/tmp/mm scripts/mutmut.sh checker  # another staging folder (default build/mutmut-MODULE)
#   MUTMUT_TESTS="tests/test_rules.py" scripts/mutmut.sh rules   # another test selection
#
# Mutated: spec/{rules,transitions,invariants,checker,incremental,prefix_cache,properties}.py. Each module
# named runs in its own staging folder with its own focused test selection (tests_for below; mutmut runs,
# for each mutant, only the tests of that selection that called its function), so a module's run does not
# pay for the others' tests. A pattern of mutant names runs in the stage of its module.
#
# Why a staging tree (1): mutmut 3 does not mutate decorated functions, and the spec's rules and
# invariants are registered by decorators; scripts/mutmut_undecorate.py rewrites `@d def f` as
# `def f; f = d(f)` in the staged copy (same object, same registration order), so their bodies are mutated.
# Why a staging tree (2): the project maps folders to packages with setuptools package-dir (spec/ is
# schedspec.spec), while mutmut 3 names a mutant after its file path (spec/rules.py -> spec.rules) and
# only activates it when that name equals the function's __module__ (schedspec.spec.rules). So this
# script assembles the installed layout under build/mutmut/ (schedspec/, schedspec/spec/, schedspec/reference/,
# ... plus tests/ and pyproject.toml) and runs mutmut there; mutmut copies it into build/mutmut/mutants/,
# puts that folder first on sys.path (ahead of the editable install's finder), and PYTHONPATH points the
# tests' `python -m schedspec` subprocesses at the mutated copy too. The working tree is never modified.
#
# Prints mutmut's summary and the per-file killed/survived/timeout counts; survivors are listed with
# `cd build/mutmut && ../../.venv/bin/mutmut results` and shown with `mutmut show <name>`.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
CHILDREN="${MUTMUT_CHILDREN:-1}"
ALL=(rules transitions invariants checker incremental prefix_cache properties)
[ $# -eq 0 ] && set -- "${ALL[@]}"

"$PY" -c "import mutmut" 2>/dev/null || { echo "mutmut is not installed: pip install -e '.[dev]'" >&2; exit 2; }

# The focused test selection of each module: the test files that exercise it directly (timed per file on
# an idle core with `pytest --durations`; the slow end-to-end files are left out, docs/testing.md says which;
# checker: the in-flight state machine test, 23 s, is deselected: test_in_flight's hand-made cases cover the paths).
# The slow stateful suites with prefix caching (6 to 12 s each on a loaded core; a surviving mutant runs every
# test that called it, so each survivor paid about two minutes): left out of the first pass of prefix_cache, rules
# and transitions, whose survivors are then rerun by name with MUTMUT_FULL=1 (the whole selection). The three
# vllm-v1 and static cases of the same suite stay in the first pass.
SLOW_PREFIX=()
if [ "${MUTMUT_FULL:-0}" != 1 ]; then
  for t in 'test_policy_refines_spec_with_prefix_caching[vllm-v1-priority]' \
           'test_policy_refines_spec_with_prefix_caching[vllm-v1-priority@0.33]' \
           'test_policy_refines_spec_with_prefix_caching[priority]' \
           'test_policy_refines_spec_with_prefix_caching[shortest-prompt-first]' \
           'test_policy_refines_spec_with_prefix_caching[fcfs]' \
           'test_policy_refines_spec_with_prefix_caching[fcfs-fast]' \
           test_stateful_machine_reaches_hits_after_preemption; do
    SLOW_PREFIX+=(--deselect "tests/test_prefix_cache.py::$t")
  done
fi

tests_for() {
  local spec=(tests/test_rules.py tests/test_invariants.py tests/test_transitions.py tests/test_state.py)
  local checker=(tests/test_incremental.py tests/test_checker.py tests/test_checker_report.py)
  case "$1" in
    # rules: also the test files of its rule families (SGLang's publication, the limits, remote KV loads, KV cache
    # groups and their prefix hits, speculative decoding, a step in flight less its state machine): 60 s together
    rules) echo "${spec[@]}" "${checker[@]}" tests/test_prefix_cache.py tests/test_spec_mutants.py tests/test_mutants_rules.py \
                tests/test_prefix_dedup.py tests/test_limits.py tests/test_remote_kv.py tests/test_kv_cache_groups.py \
                tests/test_prefix_groups.py tests/test_speculative.py tests/test_in_flight.py \
                --deselect tests/test_in_flight.py::test_the_machine_drives_an_in_flight_scheduler "${SLOW_PREFIX[@]}" ;;
    transitions) echo "${spec[@]}" "${checker[@]}" tests/test_prefix_cache.py tests/test_spec_mutants.py \
                      tests/test_speculative.py tests/test_in_flight.py tests/test_remote_kv.py tests/test_kv_cache_groups.py \
                      tests/test_prefix_groups.py tests/test_prefix_dedup.py tests/test_mutants_transitions.py \
                      --deselect tests/test_in_flight.py::test_the_machine_drives_an_in_flight_scheduler "${SLOW_PREFIX[@]}" ;;
    invariants) echo "${spec[@]}" "${checker[@]}" tests/test_spec_mutants.py tests/test_mutants_invariants.py ;;
    checker) echo "${checker[@]}" tests/test_checker_memory.py tests/test_invariants.py tests/test_state.py \
                  tests/test_spec_mutants.py tests/test_speculative.py tests/test_in_flight.py tests/test_mutants_checker.py \
                  --deselect tests/test_in_flight.py::test_the_machine_drives_an_in_flight_scheduler ;;
    incremental) echo tests/test_incremental.py tests/test_mutants_incremental.py tests/test_checker_memory.py tests/test_invariants.py \
                      tests/test_spec_mutants.py tests/test_in_flight.py \
                      --deselect tests/test_in_flight.py::test_the_machine_drives_an_in_flight_scheduler ;;
    # prefix_cache: the policies call CacheUpdate in every end-to-end test, so a survivor ran all of
    # test_checker.py's engine traces (minutes on a loaded core): the first pass has the direct tests only, without
    # test_checker.py, every case of the prefix-caching stateful suite and the CLI round trip (41 s of its 52 s: a
    # survivor paid them all, minutes at load 10); MUTMUT_FULL=1 adds them back
    prefix_cache) echo tests/test_prefix_cache.py tests/test_rules.py tests/test_invariants.py tests/test_incremental.py \
                       tests/test_spec_mutants.py tests/test_prefix_groups.py tests/test_prefix_dedup.py \
                       tests/test_mutants_prefix_cache.py "${SLOW_PREFIX[@]}" \
                       "$([ "${MUTMUT_FULL:-0}" = 1 ] && echo tests/test_checker.py || echo \
                          --deselect tests/test_prefix_cache.py::test_policy_refines_spec_with_prefix_caching \
                          --deselect tests/test_prefix_cache.py::test_caching_trace_round_trips_through_schedspec_check)" ;;
    properties) echo tests/test_priority_inversion.py tests/test_proofs_counterexamples.py tests/test_checker.py tests/test_transitions.py \
                     tests/test_spec_mutants.py tests/test_mutants_properties.py ;;
    *) echo "unknown module $1 (one of: ${ALL[*]})" >&2; exit 2 ;;
  esac
}

run_module() {  # run_module MODULE [PATTERN...]: mutmut on one module's mutants in its own stage
local MODULE=$1; shift
local STAGE="${MUTMUT_STAGE:-$ROOT/build/mutmut-$MODULE}"
local TESTS
read -r -a TESTS <<< "${MUTMUT_TESTS:-$(tests_for "$MODULE")}"

if [ "${MUTMUT_RESUME:-0}" != 1 ] || [ ! -d "$STAGE" ]; then
  rm -rf "$STAGE"
  mkdir -p "$STAGE/schedspec"
  cp -r "$ROOT"/schedspec/. "$STAGE/schedspec/"
  for pair in spec:spec reference:reference engines:engines gpu_backend:gpu_backend lab:lab; do
    cp -r "$ROOT/${pair%%:*}" "$STAGE/schedspec/${pair##*:}"
  done
  cp -r "$ROOT/tests" "$STAGE/tests"
  # mutmut 3 skips decorated functions: the rules and invariants are registered with decorators.
  "$PY" "$ROOT/scripts/mutmut_undecorate.py" "$STAGE/schedspec/spec/$MODULE.py"
  find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
  rm -rf "$STAGE/tests/.hypothesis"
  # tests/test_checker.py compares the bundled engine traces with ROOT.parent/shared, ROOT being mutants/.
  if [ -d "$ROOT/../shared" ]; then ln -s "$(cd "$ROOT/../shared" && pwd)" "$STAGE/shared"; fi
  # Everything of the package except schedspec/spec (which mutmut copies itself) goes via also_copy.
  ALSO=$(cd "$STAGE" && for p in schedspec/*; do [ "$p" != schedspec/spec ] && printf '"%s", ' "$p"; done)
  SEL=$(printf '"%s", ' "${TESTS[@]}")
  cp "$ROOT/pyproject.toml" "$STAGE/pyproject.toml"
  cat >> "$STAGE/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = ["schedspec/spec"]
only_mutate = ["schedspec/spec/$MODULE.py"]
also_copy = [${ALSO%, }]
pytest_add_cli_args = ["-p", "no:cacheprovider"]
pytest_add_cli_args_test_selection = [${SEL%, }]
EOF
fi

# The commit the mutants come from (with "+changes" when spec/ or tests/ differ from it in the working tree).
local COMMIT
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD)"
git -C "$ROOT" diff --quiet HEAD -- spec tests || COMMIT="$COMMIT+changes"
cd "$STAGE"
local PATTERNS=("$@")
[ ${#PATTERNS[@]} -eq 0 ] && PATTERNS=("schedspec.spec.$MODULE.*")
local start=$(date +%s)
# mutants/ must exist before Python starts: a PYTHONPATH entry that does not exist yet is cached as
# "no finder" and the tests would silently import the unmutated package through the editable install.
mkdir -p mutants
HYPOTHESIS_PROFILE=mutmut PYTHONPATH="$STAGE/mutants" SCHEDSPEC_TESTS_IN_PROCESS=1 \
  "$PY" -m mutmut run --max-children "$CHILDREN" "${PATTERNS[@]}"
local took=$(( $(date +%s) - start ))
echo "mutmut on spec/$MODULE.py took $took s with $CHILDREN worker(s) on $(nproc) core(s), load average $(cut -d' ' -f1 /proc/loadavg)"
# Every mutant's status, for the table in docs/testing.md (scripts/gen_mutmut_table.py reads these files): a
# whole module's run in MODULE.txt; a run of some of its mutants (names or patterns: the survivors again,
# after new tests) in MODULE.rerun-DATE.txt, whose statuses replace those of the mutants it ran.
mkdir -p "$ROOT/scripts/mutmut-results"
local out="$ROOT/scripts/mutmut-results/$MODULE.txt"
[ $# -gt 0 ] && out="$ROOT/scripts/mutmut-results/$MODULE.rerun-$(date -u +%Y%m%dT%H%M%S).txt"
{ echo "# spec/$MODULE.py: tests ${TESTS[*]}; $took s; $CHILDREN worker(s); $(date -u +%FT%TZ); commit $COMMIT"
  "$PY" -m mutmut results --all true; } > "$out"
"$PY" "$ROOT/scripts/gen_mutmut_table.py" --summary "$ROOT/scripts/mutmut-results/$MODULE.txt"
}

# Arguments: module names, or mutant names/patterns (run in the stage of their module).
declare -A WANTED=()
ORDER=()
for m in "$@"; do
  case "$m" in
    *.*) module="${m#schedspec.spec.}"; module="${module%%.*}" ;;
    *) module="$m"; m="" ;;
  esac
  tests_for "$module" > /dev/null
  [ -z "${WANTED[$module]+x}" ] && ORDER+=("$module") && WANTED[$module]=""
  [ -n "$m" ] && WANTED[$module]+="$m "
done
for module in "${ORDER[@]}"; do
  read -r -a patterns <<< "${WANTED[$module]}"
  ( run_module "$module" "${patterns[@]}" )
done
