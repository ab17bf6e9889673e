"""``schedspec prove``: check the spec's theorems and a policy's with Z3; counterexamples become scenarios.

Every theorem is listed with its statement, its result (proved / counterexample with the scenario /
unknown), the size it was checked at (N slots, ``block_size`` fixed, symbolic or uninterpreted, depth
K for bounded model checking) and its time. Exit 1 if a theorem does not come out as expected (a claim
not proved, unknown included, or an expected counterexample not found and confirmed by replay); 2 on
bad options; 3 for a scheduler without a proof encoding. See ``docs/proofs.md``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import attrs
import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from schedspec.cli_common import (
    EXIT_CHECK_FAILED,
    EXIT_UNSUPPORTED,
    Count,
    Number,
    atomic_output,
    check_outputs,
    check_scheduler,
    fail,
    one_line,
    parse_sets,
    scheduler_option,
    set_option,
    table_width,
)
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.proofs.core import (
    COUNTEREXAMPLE,
    DEFAULT_BMC_BLOCK_SIZE,
    DEFAULT_BMC_SLOTS,
    DEFAULT_DEPTH,
    DEFAULT_ID_BLOCKS,
    DEFAULT_POLICY_SLOTS,
    DEFAULT_SLOTS,
    DEFAULT_TIMEOUT_S,
    PROVED,
    Options,
    Result,
    Theorem,
)

MAX_SIZE = 64
"""Largest --slots, --depth, --policy-slots, --bmc-slots accepted (the default run uses N=16, K=6; the
solver's work grows exponentially, so a larger model is a typo, not a proof anyone waits for)."""

DEFAULT_SCHEDULER = "fcfs"
ENCODED = ("fcfs", "static", "shortest-prompt-first", "priority")
"""Schedulers with a proof encoding (``schedspec.reference.proofs.policy.POLICIES``)."""

_INT_FIELDS = {"num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"}


def _options(sets: tuple[str, ...], slots: int, depth: int, policy_slots: int, bmc_slots: int,
             timeout: float, bmc_block_size: int = 2, id_blocks: int = DEFAULT_ID_BLOCKS) -> Options:
    changes = parse_sets(sets)
    known = {f.name for f in attrs.fields(SchedulerConfig)}
    fixed: dict[str, Any] = {}
    block, block_size = "fixed", 16
    for key, val in changes.items():
        if key not in known:
            fail(f"--set {one_line(key)}: not a SchedulerConfig field (known: {', '.join(sorted(known))})")
        if key == "block_size":
            if val in ("symbolic", "uninterpreted"):
                block = val
            elif isinstance(val, int) and not isinstance(val, bool) and val >= 1:
                block_size = val
            else:
                fail(f"--set block_size={val!r}: expected a positive integer, 'symbolic' or 'uninterpreted'")
        elif key in _INT_FIELDS:
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                fail(f"--set {key}={val!r}: must be an integer >= 1")
            if key == "num_kv_blocks" and val > MAX_SIZE:
                fail(f"--set num_kv_blocks={val}: at most {MAX_SIZE} in prove (the block-id and prefix-cache "
                     "theorems have one variable per block, and cover goals and counterexamples are replayed on "
                     "the reference); leave it unset and the count theorems hold for every num_kv_blocks")
            fixed[key] = val
        elif key == "long_prefill_token_threshold":
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                fail(f"--set {key}={val!r}: must be an integer >= 0 (0 = off)")
            fixed[key] = val
        elif key == "enable_chunked_prefill":
            if not isinstance(val, bool):
                fail(f"--set {key}={val!r}: must be true or false")
            fixed[key] = val
        elif key == "enable_prefix_caching":
            if not isinstance(val, bool):
                fail(f"--set {key}={val!r}: must be true or false")
            if val:
                fixed[key] = True
        elif key == "preemption_mode":
            if val != "recompute":
                fail(f"--set preemption_mode={val!r}: must be 'recompute' (the only mode the spec defines)")
    if min(slots, depth, policy_slots, bmc_slots) < 1:
        fail("--slots, --depth, --policy-slots and --bmc-slots must be >= 1")
    if timeout <= 0:
        fail("--timeout must be > 0")
    return Options(slots=slots, block=block, block_size_value=block_size, depth=depth, fixed=fixed,
                   timeout_s=timeout, bmc_slots=bmc_slots, policy_slots=policy_slots, bmc_block_size=bmc_block_size,
                   id_blocks=id_blocks)


def _check_config_space(opts: Options) -> None:
    """Exit 2 if the fixed fields leave no valid config (every theorem would hold vacuously)."""
    import z3

    from schedspec.spec.proofs.encoding import SymConfig

    cfg = SymConfig.symbolic(fixed=opts.config_fixed())
    solver = z3.Solver()
    solver.add(cfg.valid())
    if solver.check() == z3.unsat:
        fail(f"--set {opts.fixed}: no valid SchedulerConfig has these values (config validation refuses them)")


def theorems_for(scheduler: str, prefix_caching: bool = False) -> list[Theorem]:
    """The theorems a run proves: with prefix caching on, the prefix-cache theorems
    (``schedspec.spec.proofs.prefix``; the count encoding and the policy encodings model caching off)."""
    if prefix_caching:
        from schedspec.spec.proofs.prefix import prefix_theorems

        return prefix_theorems()
    from schedspec.reference.proofs.theorems import policy_theorems
    from schedspec.spec.proofs.theorems import spec_theorems

    return spec_theorems() + policy_theorems(scheduler)


def _bundled(scenario: dict[str, Any]) -> str | None:
    """The bundled scenario file this counterexample is, if one is (same name and same content)."""
    from importlib import resources

    path = resources.files("schedspec") / "data" / "cases" / f"{scenario['name']}.json"
    if not path.is_file():
        return None
    try:
        same = json.loads(path.read_text(encoding="utf-8")) == json.loads(json.dumps(scenario))
    except (OSError, ValueError):
        return None
    return str(path) if same else None


def _save_scenario(scenario: dict[str, Any], folder: str) -> str:
    """Write ``FOLDER/<name>.json`` whole or not at all (a temporary file renamed over it: a symlink there is
    replaced, not written through); exit 2 if that path is a folder."""
    from schedspec.reference.proofs.scenarios import render

    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / f"{scenario['name']}.json"
    if path.is_dir():
        fail(f"--save-cases {one_line(folder)}: {one_line(path.name)} there is a folder, cannot write the scenario")
    with atomic_output(path, encoding="utf-8") as handle:
        handle.write(render(scenario))
    return str(path)


def _size(result: Result) -> str:
    return f"N={result.slots}" + (f", K={result.depth}" if result.depth is not None else "")


def _coverage(result: Result) -> str:
    """The vacuity checks (premises and cases satisfiable) or cover goals (reached at depth d), short."""
    if not result.vacuity:
        return "-"
    bad = result.vacuous
    cover = [c for c in result.vacuity if c.depth is not None]
    text = f"{len(result.vacuity) - len(bad)}/{len(result.vacuity)} " + ("reached" if cover else "satisfiable")
    if cover:
        text += " (" + ", ".join(f"{c.case} @{c.depth}" for c in cover if c.reached) + ")"
    if bad:
        text += "; [red]" + ", ".join(f"{c.case}: {c.status}" for c in bad) + "[/]"
    return text


def _verdict(result: Result) -> str:
    if result.status == PROVED and result.expected == PROVED and result.vacuous:
        text = "[red]proved, but vacuously[/] (see vacuity / cover)"
    elif result.status == PROVED:
        text = "[green]proved[/]" if result.ok else "[red]proved[/] (a counterexample was expected)"
    elif result.status == COUNTEREXAMPLE:
        colour = "green" if result.ok else "red"
        text = f"[{colour}]counterexample[/]"
        if result.scenario is not None:
            text += f" {result.scenario['name']}"
            if result.replayed is not None:
                text += " (replay confirms)" if result.replayed else " (replay does NOT confirm)"
    else:
        text = "[red]unknown[/]"
    return text


@click.command()
@scheduler_option
@set_option
@click.option("--slots", "-N", "slots", type=Count(minimum=1, maximum=MAX_SIZE), default=DEFAULT_SLOTS, show_default=True,
              help="Request slots N of the symbolic state.")
@click.option("--depth", "-K", "depth", type=Count(minimum=1, maximum=MAX_SIZE), default=DEFAULT_DEPTH, show_default=True,
              help="Depth K of bounded model checking (progress holds for every max_model_len <= K).")
@click.option("--policy-slots", type=Count(minimum=1, maximum=MAX_SIZE), default=DEFAULT_POLICY_SLOTS, show_default=True,
              help="Slots for the one-step policy theorems (capped at --slots).")
@click.option("--bmc-slots", type=Count(minimum=1, maximum=MAX_SIZE), default=DEFAULT_BMC_SLOTS, show_default=True,
              help="Slots for bounded model checking (capped at --slots).")
@click.option("--bmc-block-size", type=Count(minimum=1, maximum=1024), default=DEFAULT_BMC_BLOCK_SIZE,
              show_default=True, help="Block size of bounded model checking and its cover goals (small: preemptions reachable).")
@click.option("--id-blocks", type=Count(minimum=1, maximum=MAX_SIZE), default=DEFAULT_ID_BLOCKS, show_default=True,
              help="num_kv_blocks M of the block-id theorems (spec/blocks/*: one variable per block; N = --policy-slots; "
                   "--set num_kv_blocks=M overrides it).")
@click.option("--timeout", type=Number(minimum=0, strict=True, maximum=86_400.0), default=DEFAULT_TIMEOUT_S, show_default=True,
              help="Seconds per solver query; a query that runs out answers unknown.")
@click.option("--only", "only", multiple=True, metavar="TEXT", help="Run only theorems whose name contains TEXT.")
@click.option("--list", "list_only", is_flag=True, help="List the theorems and their statements; prove nothing.")
@click.option("--save-cases", default=None, metavar="DIR",
              help="Write each counterexample scenario to DIR/<name>.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def command(scheduler_name: str | None, sets: tuple[str, ...], slots: int, depth: int, policy_slots: int,
            bmc_slots: int, bmc_block_size: int, id_blocks: int, timeout: float, only: tuple[str, ...], list_only: bool, save_cases: str | None, as_json: bool) -> None:
    """Prove the spec's invariants and a scheduler's trace properties with Z3.

    --set block_size=16 (default), =symbolic (ceil division is nonlinear; may answer unknown) or
    =uninterpreted (proves for every block size; counterexamples are re-checked with block_size=16);
    --set FIELD=VALUE fixes another config field. Default run: spec at N=16, one-step policy theorems
    at N=4, bounded model checking (progress, bounded-preemptions) at N=4, K=6 with block_size 2
    (--bmc-block-size) and its cover goals, block ids at
    N=4 with num_kv_blocks=6 (--id-blocks). With --set enable_prefix_caching=true only the
    prefix-cache theorems run (spec/prefix/*, at --policy-slots slots and --id-blocks blocks).
    """
    check_outputs([], [], folders=[("--save-cases", save_cases)])
    for text in only:
        if not text.strip():
            fail("--only: empty text (it would match every theorem; leave --only out to run them all)")
    scheduler = DEFAULT_SCHEDULER if scheduler_name is None else scheduler_name
    if scheduler not in ENCODED:
        check_scheduler(scheduler, None)  # exit 2 if it is no scheduler at all
        fail(f"--scheduler {one_line(scheduler)!r} has no proof encoding (encoded: {', '.join(ENCODED)}); "
             "its plans are checked at run time by replay and check instead", EXIT_UNSUPPORTED)
    opts = _options(sets, slots, depth, policy_slots, bmc_slots, timeout, bmc_block_size, id_blocks)
    caching = bool(opts.fixed.get("enable_prefix_caching"))
    if caching and opts.block != "fixed":
        fail(f"--set block_size={opts.block} with --set enable_prefix_caching=true: the prefix-cache encoding "
             "needs a fixed block size (a hit of k blocks is k * block_size tokens: linear only then)")

    def matching(theorems: list[Theorem]) -> list[Theorem]:
        return [t for t in theorems if not only or any(o in t.name for o in only)]

    chosen = matching(theorems_for(scheduler, caching))
    if list_only:
        # without the flag, also the theorems --set enable_prefix_caching=true runs instead
        listed = [("", chosen)] + ([] if caching else [
            ("with --set enable_prefix_caching=true (instead of the above):", matching(theorems_for(scheduler, True)))])
        if not any(theorems for _, theorems in listed):
            fail(f"--only {', '.join(one_line(o) for o in only)}: no theorem matches")
        if as_json:
            click.echo(json.dumps([{"name": t.name, "expected": t.expected, "statement": t.statement,
                                    "prefix_caching": bool(heading) or caching, "bounded": t.bmc}
                                   for heading, theorems in listed for t in theorems], indent=2))
            return
        for heading, theorems in listed:
            if heading and theorems:
                click.echo(heading)
            for theorem in theorems:
                click.echo(f"{theorem.name}  [{'expect ' + theorem.expected}]  {theorem.statement}")
        return
    if not chosen:
        fail(f"--only {', '.join(one_line(o) for o in only)}: no theorem matches")
    _check_config_space(opts)
    console = Console(width=table_width())  # the CLI's width rule (cli_common.MIN_TABLE_WIDTH)
    progress = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    results: list[Result] = []
    for theorem in chosen:
        with progress.status(f"{theorem.name} ..."):
            result = theorem.run(opts)
        if result.scenario is not None:
            result.scenario_file = _bundled(result.scenario)
            if save_cases:
                result.scenario_file = _save_scenario(result.scenario, save_cases)
        results.append(result)
        mark = "[green]ok[/]" if result.ok else "[red]not as expected[/]"
        progress.print(f"{mark} {result.name}: {result.status} ({result.seconds:.1f} s)", highlight=False)
    failed = [r for r in results if not r.ok]
    if as_json:
        click.echo(json.dumps({
            "scheduler": scheduler, "slots": opts.slots, "block_size": opts.block_label, "depth": opts.depth,
            "fixed": opts.fixed, "ok": not failed, "results": [r.to_dict() for r in results],
        }, indent=2))
    else:
        _print(console, scheduler, opts, results)
    if failed:
        sys.exit(EXIT_CHECK_FAILED)


def _print(console: Console, scheduler: str, opts: Options, results: list[Result]) -> None:
    table = Table(title=f"schedspec prove --scheduler {scheduler} (block_size {opts.block_label}"
                        + (f", fixed {opts.fixed}" if opts.fixed else "") + ")", show_lines=False)
    table.add_column("theorem: statement", ratio=1)
    table.add_column("result", max_width=44)
    table.add_column("size", no_wrap=True)
    table.add_column("block_size", no_wrap=True)
    table.add_column("vacuity / cover", max_width=40)
    table.add_column("time", justify="right", no_wrap=True)
    for r in results:
        table.add_row(f"[bold]{r.name}[/]\n[dim]{r.statement}[/]", _verdict(r), _size(r), r.block,
                      _coverage(r), f"{r.seconds:.1f} s")
    console.print(table)
    shown: set[str] = set()
    for r in results:
        lines = "; ".join(str(c) for c in r.vacuity)
        if lines and lines not in shown:
            shown.add(lines)
            console.print(f"[bold]{r.name}[/] (and the theorems with the same premises): ", end="")
            console.print(lines, markup=False, highlight=False)
    for r in results:
        if r.scenario is not None:
            where = r.scenario_file or "not saved (use --save-cases DIR)"
            console.print(f"[bold]{r.name}[/]: counterexample scenario {escape(r.scenario['name'])} "
                          f"({escape(where)}); {escape(r.detail)}", highlight=False)
        if not r.ok and r.vacuous and r.status == PROVED:
            console.print(f"[red]{r.name}[/]: proved, but vacuously: "
                          + "; ".join(str(c) for c in r.vacuous), highlight=False)
        elif not r.ok:
            console.print(f"[red]{r.name}[/]: {r.status}; {escape(r.detail)}", highlight=False)
            if r.witness is not None and (r.scenario is None or "steps" in r.witness):
                console.print(witness_table(r.witness))
    failed = sum(not r.ok for r in results)
    console.print(f"{len(results) - failed} as expected, {failed} not"
                  + ("" if not failed else " (exit 1)"))


def _plan_cell(row: dict[str, Any]) -> str:
    if row.get("plan_sched"):
        return f"schedule {row['plan_ntok']} tokens from {row['plan_start']}, +{row['plan_nb']} blocks"
    if row.get("plan_pre"):
        return f"preempt (#{row['plan_ppos']})"
    if row.get("plan_rej"):
        return "reject"
    return "-" if "plan_sched" in row else ""


def _yes_no(value: Any) -> str:
    return {True: "yes", False: "no"}.get(value, "")


def witness_table(witness: dict[str, Any]) -> Table:
    """A counterexample state (and plan) as one row per live request: what a person reads first; a
    counterexample run of bounded model checking (``witness["steps"]``) as one row per step and live
    request.

    ``witness`` is ``solve.state_values``'s dict (its ``config``, scalars and live ``slots``), or
    ``bmc.run_witness``'s (with ``steps``)."""
    cfg = witness.get("config", {})
    title = "counterexample (minimized): " + ", ".join(f"{k}={v}" for k, v in cfg.items())
    if "steps" in witness:
        extra = [k for k in ("preemptions", "bound") if any(k in row for row in witness.get("slots", []))]
        if extra:
            title += "; per slot at the start: " + ", ".join(
                f"slot {row['slot']} " + " ".join(f"{k} {row[k]}" for k in extra) for row in witness["slots"])
        table = Table(title=title, title_justify="left")
        for column in ("step", "free blocks", "slot", "status", "prompt", "outputs", "max_tokens", "computed",
                       "blocks", "plan", "ends"):
            table.add_column(column)
        for step in witness["steps"]:
            for row in step["slots"]:
                table.add_row(str(step["step"]), str(step["free"]), str(row["slot"]), str(row["st"]), str(row["p"]),
                              str(row["o"]), str(row["mt"]), str(row["nc"]), str(row["b"]), _plan_cell(row),
                              _yes_no(row.get("ends")))
        return table
    title += f"; free blocks {witness.get('free')}"
    extra_fields = {k: witness[k] for k in ("owner",) if k in witness}
    if extra_fields:
        title += "; " + ", ".join(f"{k} {v}" for k, v in extra_fields.items())
    table = Table(title=title, title_justify="left")
    for column in ("slot", "status", "prompt", "outputs", "max_tokens", "computed", "blocks", "queue pos",
                   "admitted", "plan", "EOS"):
        table.add_column(column)
    for row in witness.get("slots", []):
        table.add_row(str(row["slot"]), str(row["st"]), str(row["p"]), str(row["o"]), str(row["mt"]), str(row["nc"]),
                      str(row["b"]), str(row["pos"]), "yes" if row["adm"] else "no", _plan_cell(row),
                      _yes_no(row.get("eos")))
    return table
