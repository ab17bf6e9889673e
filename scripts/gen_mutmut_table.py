"""The mutation-score table of docs/testing.md, from the results scripts/mutmut.sh saves.

scripts/mutmut.sh writes, per module, ``scripts/mutmut-results/MODULE.txt`` (committed, so that the table can be regenerated): a header line (tests, seconds,
workers, date) and mutmut's ``results --all true`` (``name: status`` per mutant); a rerun of some mutants
(the survivors, after new tests) ``MODULE.rerun-DATE.txt``, whose statuses replace theirs. This script counts them
per file and writes the table, and every surviving mutant with its reason from
``scripts/mutmut_reasons.toml`` (``"mutant name" = "why it survives"``; a survivor without one is listed as
"not explained"), between the ``<!-- mutmut-table -->`` and ``<!-- /mutmut-table -->`` lines of
docs/testing.md.

    python scripts/gen_mutmut_table.py                  # rewrite the table in docs/testing.md
    python scripts/gen_mutmut_table.py --summary FILE   # print one module's counts (scripts/mutmut.sh)
    python scripts/gen_mutmut_table.py --check          # exit 1 if docs/testing.md is not what it would write

Score: (killed + timeout) / mutants, mutmut's convention (a mutant that makes the tests hang is caught);
mutants not run (``not checked``, ``no tests``, ...) count against the score.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "scripts" / "mutmut-results"
REASONS = ROOT / "scripts" / "mutmut_reasons.toml"
DOC = ROOT / "docs" / "testing.md"
MODULES = ("rules", "transitions", "invariants", "checker", "incremental", "prefix_cache", "properties")
BEGIN, END = "<!-- mutmut-table -->", "<!-- /mutmut-table -->"


def read(path: Path) -> tuple[str, dict[str, str]]:
    """(header line, mutant name -> status) of one results file."""
    lines = path.read_text().splitlines()
    header = lines[0].lstrip("# ") if lines and lines[0].startswith("#") else ""
    statuses = {}
    for line in lines:
        name, _, status = line.strip().rpartition(": ")
        if name.startswith("schedspec.spec."):
            statuses[name] = status
    return header, statuses


def merged(module: str) -> tuple[list[str], dict[str, str]] | None:
    """(header lines, mutant name -> status) of a module: its whole run (``MODULE.txt``), then each rerun of
    some of its mutants (``MODULE.rerun-DATE.txt``, in date order), whose statuses replace those of the
    mutants it ran (a rerun lists the others as ``not checked``). ``None`` if the module was never run."""
    base = RESULTS / f"{module}.txt"
    if not base.exists():
        return None
    header, statuses = read(base)
    headers = [header]
    for rerun in sorted(RESULTS.glob(f"{module}.rerun-*.txt")):
        header, again = read(rerun)
        ran = {name: status for name, status in again.items() if status != "not checked" and name in statuses}
        statuses.update(ran)
        headers.append(f"rerun of {len(ran)}: {header.split(': ', 1)[-1]}")
    return headers, statuses


def counts(statuses: dict[str, str]) -> tuple[collections.Counter, float]:
    c = collections.Counter(statuses.values())
    n = len(statuses)
    return c, (100 * (c["killed"] + c["timeout"]) / n if n else 0.0)


def summary_line(module: str, statuses: dict[str, str]) -> str:
    c, score = counts(statuses)
    other = len(statuses) - c["killed"] - c["timeout"] - c["survived"]
    return (f"spec/{module}.py: {len(statuses)} mutants, {c['killed']} killed, {c['timeout']} timeout, "
            f"{c['survived']} survived, {other} not run ({dict((k, v) for k, v in c.items() if k not in ('killed', 'timeout', 'survived'))}); "
            f"score {score:.1f} %")


def table() -> str:
    reasons = tomllib.loads(REASONS.read_text()) if REASONS.exists() else {}
    rows = ["| file | mutants | killed | timeout | survived | not run | score | run (tests; seconds; workers; date) |",
            "|---|---|---|---|---|---|---|---|"]
    survivors: list[str] = []
    for module in MODULES:
        found = merged(module)
        if found is None:
            rows.append(f"| spec/{module}.py | not run (no results file) | | | | | | |")
            continue
        headers, statuses = found
        header = "; then ".join(headers)
        c, score = counts(statuses)
        other = len(statuses) - c["killed"] - c["timeout"] - c["survived"]
        rows.append(f"| spec/{module}.py | {len(statuses)} | {c['killed']} | {c['timeout']} | {c['survived']} | {other} "
                    f"| **{score:.1f} %** | {header.split(': ', 1)[-1]} |")
        left = sorted((name for name, status in statuses.items() if status != "killed" and status != "timeout"),
                      key=lambda name: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)])
        if left:
            survivors.append(f"\n**spec/{module}.py** ({len(left)}):\n")
            for name in left:
                why = reasons.get(name, "not explained")
                short = name.removeprefix(f"schedspec.spec.{module}.")
                survivors.append(f"- `{short}` ({statuses[name]}): {why}")
    return "\n".join([BEGIN, *rows, "", "Mutants not killed and why (`mutmut show NAME` in the module's stage prints "
                      "the diff; the reasons are in scripts/mutmut_reasons.toml):", *survivors, END])


def render(doc: str) -> str:
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:start] + table() + doc[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", type=Path)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.summary:
        module = args.summary.name.split(".")[0]
        found = merged(module)
        print(summary_line(module, found[1] if found else read(args.summary)[1]))
        return 0
    doc = DOC.read_text()
    new = render(doc)
    if args.check:
        return 0 if new == doc else 1
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
