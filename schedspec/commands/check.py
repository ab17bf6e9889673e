"""``schedspec check TRACE.jsonl``: judge an engine's step trace against the spec."""

from __future__ import annotations

import sys

import click

from schedspec.cli_common import EXIT_CHECK_FAILED, fail
from schedspec.spec.checker import check_trace
from schedspec.spec.properties import PROPERTIES
from schedspec.spec.trace import TraceFormatError, read_trace


@click.command()
@click.argument("trace", metavar="TRACE.jsonl")
@click.option("--property", "properties", multiple=True, metavar="NAME",
              help=f"Also check a trace property (repeatable): {', '.join(sorted(PROPERTIES))}.")
def command(trace: str, properties: tuple[str, ...]) -> None:
    """Check a StepRecord JSON Lines trace (header line with schema_version and config, then one record
    per step): every plan allowed, every invariant held, the records consistent with the spec.
    Exit 0 if clean, 1 naming the first violations, 2 on an unreadable trace."""
    for name in properties:
        if name not in PROPERTIES:
            fail(f"--property {name!r}: unknown; known: {', '.join(sorted(PROPERTIES))}")
    try:
        config, records = read_trace(trace)
        violations, steps = check_trace(config, records, properties)
    except TraceFormatError as error:
        fail(str(error))
    for violation in violations[:20]:
        click.echo(f"VIOLATION {violation}")
    click.echo(f"{steps} steps checked, {len(violations)} violations")
    if violations:
        sys.exit(EXIT_CHECK_FAILED)
