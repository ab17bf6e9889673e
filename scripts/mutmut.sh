#!/usr/bin/env bash
# Mutation score of the spec and the checker with mutmut 3 (issue 9). Not run in CI: slow on 2 cores.
#
#   scripts/mutmut.sh                 # all five modules
#   scripts/mutmut.sh rules checker   # only the mutants of spec/rules.py and spec/checker.py
#   MUTMUT_CHILDREN=2 scripts/mutmut.sh rules       # parallel workers (default 1)
#   MUTMUT_RESUME=1 scripts/mutmut.sh rules         # keep build/mutmut and its results from a previous run
#   scripts/mutmut.sh 'schedspec.spec.checker.x__compare_after__mutmut_*'   # mutant names or patterns
#   MUTMUT_STAGE=/tmp/mm scripts/mutmut.sh checker  # another staging folder (default build/mutmut)
#
# Mutated: spec/{rules,transitions,invariants,checker,incremental}.py. Tests: the fast selection below
# (about 45 s in all on one core; mutmut runs, for each mutant, only the tests that called its function).
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
STAGE="${MUTMUT_STAGE:-$ROOT/build/mutmut}"
CHILDREN="${MUTMUT_CHILDREN:-1}"
MODULES=("$@")
[ ${#MODULES[@]} -eq 0 ] && MODULES=(rules transitions invariants checker incremental)
TESTS=(tests/test_rules.py tests/test_invariants.py tests/test_transitions.py tests/test_state.py
       tests/test_incremental.py tests/test_checker.py tests/test_checker_report.py)

"$PY" -c "import mutmut" 2>/dev/null || { echo "mutmut is not installed: pip install -e '.[dev]'" >&2; exit 2; }

if [ "${MUTMUT_RESUME:-0}" != 1 ] || [ ! -d "$STAGE" ]; then
  rm -rf "$STAGE"
  mkdir -p "$STAGE/schedspec"
  cp -r "$ROOT"/schedspec/. "$STAGE/schedspec/"
  for pair in spec:spec reference:reference engines:engines gpu_backend:gpu_backend lab:lab; do
    cp -r "$ROOT/${pair%%:*}" "$STAGE/schedspec/${pair##*:}"
  done
  cp -r "$ROOT/tests" "$STAGE/tests"
  # mutmut 3 skips decorated functions: the rules and invariants are registered with decorators.
  "$PY" "$ROOT/scripts/mutmut_undecorate.py" "$STAGE"/schedspec/spec/{rules,transitions,invariants,checker,incremental}.py
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
only_mutate = ["schedspec/spec/rules.py", "schedspec/spec/transitions.py", "schedspec/spec/invariants.py",
               "schedspec/spec/checker.py", "schedspec/spec/incremental.py"]
also_copy = [${ALSO%, }]
pytest_add_cli_args = ["-p", "no:cacheprovider"]
pytest_add_cli_args_test_selection = [${SEL%, }]
EOF
fi

cd "$STAGE"
PATTERNS=()
SUMMARY=()
for m in "${MODULES[@]}"; do
  case "$m" in
    *.*) PATTERNS+=("$m"); m="${m#schedspec.spec.}"; m="${m%%.*}" ;;
    *) PATTERNS+=("schedspec.spec.$m.*") ;;
  esac
  case " ${SUMMARY[*]:-} " in *" $m "*) ;; *) SUMMARY+=("$m") ;; esac
done
start=$(date +%s)
# mutants/ must exist before Python starts: a PYTHONPATH entry that does not exist yet is cached as
# "no finder" and the tests would silently import the unmutated package through the editable install.
mkdir -p mutants
export HYPOTHESIS_PROFILE=mutmut PYTHONPATH="$STAGE/mutants" SCHEDSPEC_TESTS_IN_PROCESS=1
"$PY" -m mutmut run --max-children "$CHILDREN" "${PATTERNS[@]}"
echo "mutmut took $(( $(date +%s) - start )) s with $CHILDREN worker(s) on $(nproc) core(s)"
"$PY" - "${SUMMARY[@]}" <<'EOF'
import collections
import subprocess
import sys

out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                     capture_output=True, text=True).stdout
counts = collections.defaultdict(collections.Counter)
for line in out.splitlines():
    name, _, status = line.strip().rpartition(": ")
    if not name.startswith("schedspec.spec."):
        continue
    module = name.split(".")[2]
    if module in sys.argv[1:]:
        counts[module][status] += 1
print(f"{'file':<22}{'mutants':>8}{'killed':>8}{'survived':>9}{'timeout':>8}{'other':>7}{'score':>8}")
total = collections.Counter()
for module in sys.argv[1:]:
    c = counts[module]
    total.update(c)
    n = sum(c.values())
    other = n - c["killed"] - c["survived"] - c["timeout"]
    score = 100 * (c["killed"] + c["timeout"]) / n if n else 0.0
    print(f"spec/{module + '.py':<17}{n:>8}{c['killed']:>8}{c['survived']:>9}{c['timeout']:>8}{other:>7}{score:>7.1f}%")
n = sum(total.values())
score = 100 * (total["killed"] + total["timeout"]) / n if n else 0.0
print(f"{'all':<22}{n:>8}{total['killed']:>8}{total['survived']:>9}{total['timeout']:>8}"
      f"{n - total['killed'] - total['survived'] - total['timeout']:>7}{score:>7.1f}%")
EOF
