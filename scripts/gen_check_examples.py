"""Write ``docs/generated/what-breaks-each-check.md``: for every rule, invariant and trace mismatch the
checker knows, a real fault that breaks it, found by running the checker, not written by hand.

Each fault is a mutation operator of :mod:`schedspec.trace_mutations` (a class of engine bug) applied at
its first applicable step to one of the catalogue's correct real-trace windows (the smallest ones,
``standard_traces(scale=1)``); the page shows, per check, the operators whose mutant it rejects, and the
checker's own message for the first of them. Checks that no operator reaches are listed too: their
failing cases are the unit tests named in the page. ``tests/test_docs_site.py`` fails when the page is
stale::

    .venv/bin/python scripts/gen_check_examples.py
"""

from __future__ import annotations

from pathlib import Path

from schedspec.spec.checker import DEFAULT_PROPERTIES, check_trace
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import STATE_INVARIANTS, STEP_INVARIANTS
from schedspec.spec.proofs.encoding import STATE_INVARIANT_ORDER
from schedspec.spec.rules import RULES
from schedspec.spec.trace import StepRecord
from schedspec.trace_mutations import MUTATIONS, applicable_steps, standard_traces

ROOT = Path(__file__).resolve().parents[1]
SPECULATIVE_ONLY = ("drafts-on-running-decodes",)
"""Invariants proved only with drafts (``spec/speculative/step/...``): without drafts they hold trivially."""
TARGET = ROOT / "docs" / "generated" / "what-breaks-each-check.md"


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def findings() -> dict[str, list[tuple[str, str, str, int, str]]]:
    """check name -> ``[(kind, operator, trace label, step, message)]`` for every semantic operator,
    applied at its first applicable step of the first trace it applies to."""
    traces = standard_traces(scale=1)
    found: dict[str, list[tuple[str, str, str, int, str]]] = {}
    for mutation in MUTATIONS:
        if not mutation.semantic:
            continue
        for label, trace in traces:
            steps = applicable_steps(trace, mutation)
            if not steps:
                continue
            header, records, _ = mutation.apply(trace, steps[0])
            config = SchedulerConfig.from_dict(header["config"])
            report = check_trace(config, [StepRecord.from_dict(r) for r in records],
                                 async_scheduling=bool(header.get("async_scheduling", False)))
            seen: set[str] = set()
            for violation in report.violations:
                if violation.name not in seen:
                    seen.add(violation.name)
                    found.setdefault(violation.name, []).append(
                        (violation.kind, mutation.name, label, steps[0], str(violation)))
            break
    return found


def render() -> str:
    """The page's Markdown."""
    found = findings()
    checks = ([("rule", r.name) for r in RULES] + [("invariant", i.name) for i in STATE_INVARIANTS + STEP_INVARIANTS]
              + [("property", name) for name in DEFAULT_PROPERTIES])
    known = {name for _, name in checks}
    lines = [
        "| check | kind | faults that break it (mutation operators) | the checker's message for the first |",
        "|---|---|---|---|",
    ]
    for kind, name in checks + sorted({(v[0][0], n) for n, v in found.items() if n not in known}):
        hits = found.get(name, [])
        if hits:
            operators = ", ".join(f"`{op}`" for _, op, _, _, _ in hits)
            _, _, label, step, message = hits[0]
            lines.append(f"| `{name}` | {kind} | {operators} | {_cell(message)} (`{hits[0][1]}` on {label}, step {step}) |")
        elif kind == "invariant" and name in STATE_INVARIANT_ORDER:
            # drafts-on-running-decodes holds trivially without drafts: its theorem is the one with them
            theorem = f"spec/speculative/step/{name}" if name in SPECULATIVE_ONLY else f"spec/step/{name}"
            lines.append(f"| `{name}` | {kind} | none: no trace reaches it | the rules imply it (`schedspec prove`, "
                         f"theorem `{theorem}`), so a faulty trace breaks a rule first; its failing cases are "
                         "in `tests/test_invariants.py` |")
        else:
            lines.append(f"| `{name}` | {kind} | none of the catalogue's operators | its failing cases are in its unit "
                         "tests (`tests/test_rules.py`, `tests/test_invariants.py`, `tests/test_checker.py`) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET}")
