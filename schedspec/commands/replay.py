"""``schedspec replay CASE.json``: run a scenario, print its steps and a verdict per expectation."""

from __future__ import annotations

import sys

import click
from rich.table import Table
from rich.text import Text

from schedspec.cli_common import (
    EXIT_CHECK_FAILED,
    build_config,
    check_path,
    check_scheduler,
    fail,
    one_line,
    parse_sets,
    scheduler_option,
    set_option,
)
from schedspec.cli_common import console as make_console
from schedspec.reference.scenarios import (
    ScenarioError,
    bundled_scenarios,
    choose_scheduler,
    judged_on,
    load_scenario,
    replay,
)
from schedspec.reference.scheduler import UnknownScheduler, UnsupportedFeature
from schedspec.spec.config import ConfigError, SchedulerConfig


@click.command()
@click.argument("cases", nargs=-1, metavar="CASE.json...")
@scheduler_option
@set_option
@click.option("--all", "run_all", is_flag=True, help="Replay every bundled scenario.")
@click.option("--quiet", "-q", is_flag=True, help="Verdicts only, no step table.")
def command(cases: tuple[str, ...], scheduler_name: str | None, sets: tuple[str, ...], run_all: bool, quiet: bool) -> None:
    """Replay scenarios (format: schedspec/data/cases/README.md) and judge their expectations.

    Every file, field and option is validated before the first replay. With --scheduler, a scenario
    written for another scheduler is judged as the conformance suite judges it: on what every scheduler
    owes (invariants, outcomes, no token after an abort, ...), its latency bounds and the faults it
    records left out (listed as not judged). Exit 0 if every expectation
    holds, 1 if one fails, 2 on a bad file or option (naming the file and field), 3 if the scheduler
    lacks a feature the scenario needs (with --all, unsupported scenarios are reported and skipped).
    """
    console = make_console(soft_wrap=True)
    changes = parse_sets(sets)
    paths = list(cases) + ([str(p) for p in bundled_scenarios()] if run_all else [])
    if not paths:
        fail("no scenario given (pass CASE.json or --all)")
    if scheduler_name is not None:
        check_scheduler(scheduler_name, None)
    scenarios = []
    for path in paths:
        check_path("CASE.json", path)
        try:
            scenario = load_scenario(path)
        except ScenarioError as error:
            fail(str(error))
        name = choose_scheduler(scenario, scheduler_name)
        where = ("--scheduler" if scheduler_name is not None
                 else f"{path}: scheduler" if scenario.scheduler is not None
                 else f"{path}: config.policy" if scenario.policy is not None else "--scheduler")
        try:
            SchedulerConfig.from_dict(scenario.config)
        except ConfigError:
            check_scheduler(name, None, where)  # the scenario itself expects a config error
        else:
            config = build_config(scenario.config, changes)  # a --set that breaks the config: exit 2
            check_scheduler(name, config, where, unsupported_ok=True)
        scenarios.append(scenario)
    failed = unsupported = 0
    for scenario in scenarios:
        # a scenario written for another scheduler is judged for what applies to this one (as the
        # conformance suite judges it): its latency bounds and fault records are left out, and said so
        judged, left_out = judged_on(scenario, choose_scheduler(scenario, scheduler_name))
        try:
            result = replay(judged, scheduler_name, changes)
        except UnsupportedFeature as error:
            console.print(Text.assemble(("UNSUPPORTED", "yellow"), f" {one_line(scenario.name)}: {one_line(error)}"))
            unsupported += 1
            continue
        except UnknownScheduler as error:
            fail(str(error))
        # user text (names, ids, details naming ids) is printed escaped: a newline cannot split a line
        engine = result.run.engine if result.run is not None else None
        console.print(Text.assemble((one_line(scenario.name), "bold"), " on ", (one_line(result.scheduler), "cyan"),
                                    f" ({engine['name']} {engine['version']})" if engine else "",
                                    f": {one_line(scenario.about)}"))
        if left_out:
            console.print(f"  not judged on {result.scheduler} (written for {choose_scheduler(scenario)}): "
                          f"{', '.join(left_out)}")
        if result.run is not None and not quiet:
            table = Table("step", "scheduled (id:prefill+decode)", "preempted", "finished", "rejected", "free", "run", "wait")
            for record in result.run.records:
                table.add_row(
                    str(record.step),
                    " ".join(f"{one_line(s.request_id)}:{s.prefill_tokens}+{s.decode_tokens}" for s in record.scheduled),
                    " ".join(map(one_line, record.preempted)),
                    " ".join(f"{one_line(k)}({v})" for k, v in record.finished.items()),
                    " ".join(map(one_line, record.rejected)),
                    str(record.num_free_blocks), str(record.num_running), str(record.num_waiting),
                )
            console.print(table)
        for verdict in result.verdicts:
            mark = ("PASS", "green") if verdict.passed else ("FAIL", "red")
            console.print(Text.assemble("  ", mark, f" {one_line(verdict.name)}: {one_line(verdict.detail)}"))
        failed += not result.passed
    total = len(scenarios)
    console.print(f"{total - failed - unsupported} passed, {failed} failed, {unsupported} unsupported")
    if failed:
        sys.exit(EXIT_CHECK_FAILED)
    if unsupported and (not run_all or unsupported == total):
        sys.exit(3)
