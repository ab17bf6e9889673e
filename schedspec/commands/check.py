"""``schedspec check TRACE.jsonl``: judge an engine's step trace against the spec."""

from __future__ import annotations

import json
import os
import sys

import click

from schedspec.cli_common import EXIT_CHECK_FAILED, EXIT_UNSUPPORTED, fail, one_line, plural
from schedspec.spec.checker import DEFAULT_PROPERTIES, CheckReport, check_trace
from schedspec.spec.fast_check import fast_check
from schedspec.spec.kv_cache_groups import unspecified_with_groups
from schedspec.spec.properties import PROPERTIES
from schedspec.spec.request import RequestStatus
from schedspec.spec.state import SchedulerState
from schedspec.spec.trace import TraceFormatError, open_trace


def _state_lines(state: SchedulerState) -> list[str]:
    lines = [f"  free blocks {state.num_free_blocks}; running {len(state.running)}; waiting {len(state.waiting)}"]
    for queue, ids in (("running", state.running), ("waiting", state.waiting)):
        for request_id in ids[:12]:
            r = state.requests[request_id]
            loading = " (waiting for remote KV)" if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS else ""
            lines.append(f"  {queue} {request_id!r}{loading}: prompt {r.prompt_len}, outputs {r.num_output_tokens}/"
                         f"{r.max_tokens}, computed {r.num_computed_tokens}, blocks {list(r.block_ids)}")
        if len(ids) > 12:
            lines.append(f"  ... {len(ids) - 12} more {queue}")
    if state.delayed_frees:
        lines.append(f"  held for transfers of ended requests: "
                     f"{json.dumps({r: list(d.block_ids) for r, d in list(state.delayed_frees.items())[:12]})}")
    return lines


def _print_report(report: CheckReport, limit: int) -> None:
    if report.first_bad_step is not None:
        click.echo(f"FIRST ILLEGAL STEP {report.first_bad_step} "
                   f"(valid prefix: {report.valid_prefix} steps, 0..{report.valid_prefix - 1})")
        if report.state_before is not None:
            click.echo("state before the step (spec):")
            for line in _state_lines(report.state_before):
                click.echo(line)
        if report.record is not None:
            click.echo("the step as recorded:")
            for item in report.record.scheduled:
                blocks = list(report.record.blocks_allocated.get(item.request_id, ()))
                click.echo(f"  scheduled {item.request_id!r}: from {item.num_computed_tokens}, prefill "
                           f"{item.prefill_tokens}, decode {item.decode_tokens}, new blocks {blocks}")
            for name in ("preempted", "rejected", "kv_loads", "finished", "blocks_freed", "sampled_token_ids",
                         "finished_recving", "invalid_block_ids", "finished_sending"):
                value = getattr(report.record, name)
                if value:
                    click.echo(f"  {name}: {json.dumps(value if not isinstance(value, tuple) else list(value))}")
    for violation in report.violations[:limit]:
        # The code only where it says more than the name (a named case: name:case, Violation.code).
        code = f" [code {one_line(violation.code)}]" if violation.code != violation.name else ""
        click.echo(f"VIOLATION {one_line(violation)}{code}")
    if len(report.violations) > limit:
        click.echo(f"... {plural(len(report.violations) - limit, 'more violation')} (--max-violations)")


@click.command()
@click.argument("trace", metavar="TRACE.jsonl")
@click.option("--property", "properties", multiple=True, metavar="NAME",
              help=f"Also check a trace property (repeatable): {', '.join(sorted(PROPERTIES))}. "
                   f"Always checked: {', '.join(DEFAULT_PROPERTIES)}.")
@click.option("--keep-going", is_flag=True,
              help="Continue past the first illegal step (later violations may be its consequences).")
@click.option("--full", is_flag=True,
              help="Check invariants with the full definition (check_step) instead of the incremental checker "
                   "(the same verdicts, tested; the incremental one is faster on long traces).")
@click.option("--no-fast-path", is_flag=True,
              help="Judge every step with the plain spec path only (by default a fast screen certifies a legal "
                   "trace and any step it cannot certify is judged by the plain path from the start: the same "
                   "output; spec/fast_check.py). The environment variable SCHEDSPEC_NO_FAST_PATH=1 does the same.")
@click.option("--allow-unfinished", is_flag=True,
              help="The trace is a window cut from a running engine's log: requests still live at its end are "
                   "not reported (by default each is an unfinished-request violation).")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as one JSON object.")
@click.option("--max-violations", default=20, show_default=True, type=click.IntRange(min=1),
              help="Violations printed (all are counted).")
def command(trace: str, properties: tuple[str, ...], keep_going: bool, full: bool, no_fast_path: bool,
            allow_unfinished: bool, as_json: bool, max_violations: int) -> None:
    """Judge a StepRecord JSON Lines trace (schema: docs/trace-schema.json) against the spec: replay it,
    check every plan against the rules, every state against the invariants and every field of every
    record against what the spec says happened; stop at the first illegal step and show it; at the end
    every request must have ended (finished, aborted or rejected), unless --allow-unfinished. Exit 0 if
    legal, 1 naming the first illegal step, 2 on an unreadable or malformed trace (file, line and
    field named). Prefix-caching traces are judged too (hits, evictions, reference counts). Each
    violation carries its stable code (the name, or name:case): in --json as "code", in the text after
    the message where it names a case; test the code, not the wording."""
    for name in properties:
        if name not in PROPERTIES:
            fail(f"--property {name!r}: unknown; known: {', '.join(sorted(PROPERTIES))}")
    try:
        opened = open_trace(trace)
        if opened.async_scheduling and opened.config.prefill_schedule_interval > 1:
            # spec/state.py prefill_held: the cadence of a plan made over placeholders is not specified, so
            # such a trace would pass whatever the engine's cadence did
            fail(f"{trace}: header: async_scheduling with prefill_schedule_interval="
                 f"{opened.config.prefill_schedule_interval}: the spec does not specify vLLM's prefill cadence "
                 "for plans made while a step is in flight", status=EXIT_UNSUPPORTED)
        connector = bool(opened.config.kv_cache_groups) and any(  # a groups trace is short: read it once more
            record.kv_loads or any(a.num_external_computed_tokens or a.kv_send for a in record.arrivals)
            for record in opened.records())
        unspecified = unspecified_with_groups(opened.config, opened.async_scheduling, connector)
        if unspecified is not None:  # spec/kv_cache_groups.py: a combination with groups the spec does not specify
            fail(f"{trace}: header: {unspecified}", status=EXIT_UNSUPPORTED)
        names = DEFAULT_PROPERTIES + properties
        report = None
        if not (full or no_fast_path or os.environ.get("SCHEDSPEC_NO_FAST_PATH", "") not in ("", "0")):
            report = fast_check(opened, names, keep_going, allow_unfinished)
        if report is None:  # not certified by the fast path: the plain path judges the whole trace
            report = check_trace(opened.config, opened.records(), names, keep_going,
                                 incremental=not full, allow_unfinished=allow_unfinished,
                                 async_scheduling=opened.async_scheduling)
    except TraceFormatError as error:
        fail(str(error))
    if as_json:
        click.echo(json.dumps({
            "trace": trace,
            "ok": report.ok,
            "steps_checked": report.steps_checked,
            "first_bad_step": report.first_bad_step,
            "valid_prefix": report.valid_prefix,
            "properties": list(report.properties),
            "notes": opened.notes,
            "violations": [
                {"kind": v.kind, "name": v.name, "code": v.code, "step": v.step, "request_id": v.request_id,
                 "detail": v.detail}
                for v in report.violations
            ],
        }))
    else:
        for note in opened.notes:
            click.echo(f"note: {note}")
        _print_report(report, max_violations)
        click.echo(f"{plural(report.steps_checked, 'step')} checked, {plural(len(report.violations), 'violation')} "
                   f"(properties: {', '.join(report.properties)})")
    if report.violations:
        sys.exit(EXIT_CHECK_FAILED)
