"""``schedspec compare BEFORE.json AFTER.json``: did a change help, under the same conditions?

Reads two run records (``schedspec lab --save``; :mod:`schedspec.lab.run_record`), each validated
against the run record JSON Schema, and prints first the conditions that differ, then every figure
side by side with the change and its sign.

A difference in conditions makes the figures incomparable unless it is the one under study:
``--allow-different FIELD`` (repeatable) names it, as a dotted path (``config.max_num_seqs``), a
group (``config``, ``window``) or a last part (``max_num_seqs``). Any other differing condition is
reported loudly and the command exits 1. The machine and Python version do not count when both
runs took their step times from the cost model (the simulated clock does not depend on them; they
still show), nor does the trace's path when its sha256 is the same.

Exit status: 0 comparable (no condition differs, or only allowed ones), 1 a condition other than the
allowed ones differs, 2 a record cannot be read or is not a valid run record (one line naming the
file and the field).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from schedspec.cli_common import EXIT_CHECK_FAILED, check_path, fail, one_line, table_width
from schedspec.cli_common import console as make_console
from schedspec.lab import run_record

LOWER_IS_BETTER_SUFFIXES = ("_s",)
LOWER_IS_BETTER = ("preemptions", "max_preemptions_per_request", "violations", "requests_rejected",
                   "requests_aborted", "requests_live")
HIGHER_IS_BETTER_SUFFIXES = ("_tokens_per_s", "requests_per_s")
HIGHER_IS_BETTER = ("goodput_percent", "goodput_met", "requests_finished", "prefix_hit_rate_percent", "prefix_hit_tokens")
NEUTRAL = ("span_s",)


def direction(figure: str) -> int:
    """+1 if a larger value of ``figure`` is better (throughput, goodput), -1 if smaller is (latency,
    preemptions, violations, wall time), 0 if neither (counts of steps and tokens, the span)."""
    if figure in NEUTRAL:
        return 0
    if figure in HIGHER_IS_BETTER or figure.endswith(HIGHER_IS_BETTER_SUFFIXES):
        return 1
    if figure in LOWER_IS_BETTER or figure.startswith("rejected_") or figure.endswith(LOWER_IS_BETTER_SUFFIXES):
        return -1
    return 0


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.6g}" if abs(value) < 1e6 else f"{value:,.0f}"
    text = json.dumps(value) if isinstance(value, list | dict) else str(value)
    return one_line(text if len(text) <= 80 else text[:77] + "...")


def figure_rows(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per figure of either record: ``figure``, ``before``, ``after``, ``change`` (after -
    before, ``None`` when either is missing), ``change_percent`` (relative to ``before``; ``None`` when
    it is 0 or missing) and ``verdict`` (``better``, ``worse`` or ``""``)."""
    a, b = before["figures"], after["figures"]
    rows = []
    for key in list(a) + [k for k in b if k not in a]:
        old, new = a.get(key), b.get(key)
        change = new - old if isinstance(old, int | float) and isinstance(new, int | float) else None
        percent = 100.0 * change / abs(old) if change is not None and old else None
        verdict = ""
        if change:
            sign = direction(key) * (1 if change > 0 else -1)
            verdict = "better" if sign > 0 else "worse" if sign < 0 else ""
        rows.append({"figure": key, "before": old, "after": new, "change": change, "change_percent": percent,
                     "verdict": verdict})
    return rows


def _plain(value: float) -> str:
    """A number as people read it: thousands separated, three significant digits below 1,000, never an
    exponent (``1,234``, ``137.7``, ``2.28``, ``0.0153``)."""
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.1f}"
    if size >= 1 or size == 0:
        return f"{value:.2f}".rstrip("0").rstrip(".") if size else "0"
    digits = 2 - math.floor(math.log10(size))
    return f"{value:.{digits}f}"


SECOND_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))


def figure_text(figure: str, value: Any, signed: bool = False) -> str:
    """A figure's value (or, ``signed``, a change of it) readable, with its unit (the run record's unit
    suffixes): seconds in s, ms, µs or ns (``2.28 µs``, not ``2.27837e-06``); ``_percent`` in percent
    (a change in percentage points, ``pp``); ``_per_s`` as a rate; a count as an integer with
    separators. ``None`` is ``-``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if not isinstance(value, int | float):
        return _value(value)
    sign = "+" if signed and value > 0 else ""
    if signed and value == 0:
        return "0"
    if figure.endswith("_percent"):
        return f"{sign}{value:,.1f}{' pp' if signed else '%'}"
    if figure.endswith("_per_s"):
        return f"{sign}{_plain(value)}/s"
    if figure.endswith("_s"):
        for scale, unit in SECOND_UNITS:
            if abs(value) >= scale or unit == "ns":
                return f"{sign}{_plain(value / scale)} {unit}" if value else "0 s"
    if isinstance(value, int):
        return f"{sign}{value:,}"
    return f"{sign}{_plain(value)}"


def _signed(value: float | int | None, percent: bool = False) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if percent:
        return f"{value:+,.1f}%"
    return f"{value:+,}" if isinstance(value, int) else f"{'+' if value > 0 else ''}{_plain(value)}"


@click.command()
@click.argument("before_path", metavar="BEFORE.json")
@click.argument("after_path", metavar="AFTER.json")
@click.option("--allow-different", "allowed", multiple=True, metavar="FIELD",
              help="A condition under study, allowed to differ (repeatable): a dotted path such as "
                   "config.max_num_seqs, a group such as config or window, or a last part such as max_num_seqs.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON only.")
def command(before_path: str, after_path: str, allowed: tuple[str, ...], as_json: bool) -> None:
    """Compare two run records (schedspec lab --save): first the conditions that differ, then every
    figure side by side with the change and its sign. Exit 0 when the conditions are the same (or
    differ only where --allow-different allows), 1 when another condition differs, 2 on a record that
    cannot be read or is not a valid run record."""
    check_path("BEFORE.json", before_path)
    check_path("AFTER.json", after_path)
    try:
        before = run_record.load_record(before_path)
        after = run_record.load_record(after_path)
    except run_record.RunRecordError as error:
        fail(str(error))
    paths = set(run_record.flatten(before["conditions"])) | set(run_record.flatten(after["conditions"]))
    for field in allowed:
        if not field.strip() or not any(run_record.field_matches(p, field.strip()) for p in paths):
            fail(f"--allow-different {field!r}: no such condition (e.g. config.max_num_seqs, window.time_scale, "
                 "scheduler, workload)")
    allowed = tuple(f.strip() for f in allowed)

    differences = []
    for path, old, new in run_record.differing_conditions(before, after):
        if any(run_record.field_matches(path, field) for field in allowed):
            status = "under study (--allow-different)"
        elif run_record.is_informational(path, before, after):
            status = "informational (cannot change simulated figures)"
        else:
            status = "DIFFERS"
        differences.append({"condition": path, "before": old, "after": new, "status": status})
    refused = [d["condition"] for d in differences if d["status"] == "DIFFERS"]
    rows = figure_rows(before, after)

    if as_json:
        click.echo(json.dumps({"before": before_path, "after": after_path, "comparable": not refused,
                               "differing_conditions": differences, "figures": rows}, indent=2, default=str))
        sys.exit(EXIT_CHECK_FAILED if refused else 0)

    console = make_console(width=table_width())  # the CLI's width rule (cli_common.MIN_TABLE_WIDTH)
    console.print(Text(f"before: {before['name']} ({before_path})\nafter:  {after['name']} ({after_path})"))
    if differences:
        table = Table(title="Conditions that differ", title_justify="left")
        for column in ("condition", "before", "after", "status"):
            table.add_column(column)
        for d in differences:
            table.add_row(d["condition"], _value(d["before"]), _value(d["after"]),
                          Text(d["status"], style="bold red" if d["status"] == "DIFFERS" else ""))
        console.print(table)
    else:
        console.print("Conditions: all the same (every field of both records' conditions is equal).")

    table = Table(title="Figures (units in the names: _s seconds, _percent 0-100 (a change in percentage points, pp), "
                        "_per_s per second; no suffix: a count)", title_justify="left")
    for column, justify in (("figure", "left"), ("before", "right"), ("after", "right"), ("change", "right"),
                            ("change %", "right"), ("", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        style = "green" if row["verdict"] == "better" else "red" if row["verdict"] == "worse" else ""
        table.add_row(row["figure"], figure_text(row["figure"], row["before"]),
                      figure_text(row["figure"], row["after"]), figure_text(row["figure"], row["change"], signed=True),
                      _signed(row["change_percent"], percent=True), Text(row["verdict"], style=style))
    console.print(table)
    if refused:
        console.print(Text.assemble(
            ("NOT COMPARABLE: ", "bold red"),
            f"{len(refused)} condition{'s' if len(refused) > 1 else ''} other than the one under study "
            f"{'differ' if len(refused) > 1 else 'differs'}: {', '.join(refused)}. A change in figures may come from them. If one is what you are "
            "studying, name it with --allow-different FIELD."))
        sys.exit(EXIT_CHECK_FAILED)
