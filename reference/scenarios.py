"""Scenarios: small JSON cases distilled from real scheduler faults, replayed with expectations.

Format: ``cases/README.md`` (shipped copies under ``schedspec/data/cases``). :func:`load_scenario`
validates a file and raises :class:`ScenarioError` naming the file and the field; :func:`replay`
runs it on a scheduler with every invariant checked at every step and judges each ``expect`` key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from schedspec.spec.config import ConfigError, SchedulerConfig
from schedspec.spec.properties import PROPERTIES
from schedspec.spec.rules import RULES
from schedspec.spec.workload import RequestSpec

from .engine import Engine, RunResult
from .fake_model import TokenSource
from .scheduler import UnsupportedFeature, make_scheduler

TokenSourceFactory = Callable[[SchedulerConfig, Sequence[RequestSpec]], TokenSource]
"""Builds the token source of one run from its config and workload (``replay(token_source_factory=...)``)."""


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names the file and the field."""


EXPECT_KEYS = {
    "config_error", "config_error_mentions", "outcome", "all_terminal_by_step", "first_token_by_step",
    "max_preemptions_per_request", "no_tokens_after_abort", "outputs_equal_solo", "free_blocks_at_end",
    "demonstrates",
}
REQUEST_KEYS = {"id", "arrival_step", "prompt_len", "max_tokens", "priority", "prefix", "abort_at_step", "eos_at_output"}
OUTCOMES = {"finished", "rejected", "aborted"}
DEFAULT_MAX_STEPS = 10_000


@attrs.frozen
class Scenario:
    """A parsed scenario. ``config`` is the raw dict (it may be meant to fail validation)."""

    name: str
    about: str
    config: dict[str, Any]
    policy: str | None
    requests: tuple[RequestSpec, ...]
    expect: dict[str, Any]
    scheduler: str | None
    path: str
    max_steps: int | None = None


def _int(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScenarioError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def parse_scenario(data: Any, path: str = "<scenario>") -> Scenario:
    """Validate a decoded scenario; raises :class:`ScenarioError` naming ``path`` and the field."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: the top level must be a JSON object")
    for key in ("name", "config", "requests"):
        if key not in data:
            raise ScenarioError(f"{path}: missing field {key!r}")
    config = data["config"]
    if not isinstance(config, dict):
        raise ScenarioError(f"{path}: field 'config' must be an object")
    config = dict(config)
    policy = config.pop("policy", None)
    if not isinstance(data["requests"], list):
        raise ScenarioError(f"{path}: field 'requests' must be a list")
    requests = []
    seen = set()
    for index, raw in enumerate(data["requests"]):
        where = f"{path}: requests[{index}]"
        if not isinstance(raw, dict):
            raise ScenarioError(f"{where}: must be an object")
        unknown = set(raw) - REQUEST_KEYS
        if unknown:
            raise ScenarioError(f"{where}: unknown field {sorted(unknown)[0]!r}")
        for key in ("id", "arrival_step", "prompt_len", "max_tokens"):
            if key not in raw:
                raise ScenarioError(f"{where}: missing field {key!r}")
        request_id = str(raw["id"])
        if request_id in seen:
            raise ScenarioError(f"{where}.id: duplicate id {request_id!r}")
        seen.add(request_id)
        prefix = raw.get("prefix")
        if prefix is not None and (not isinstance(prefix, dict) or "group" not in prefix or "len" not in prefix):
            raise ScenarioError(f"{where}.prefix: expected {{\"group\": name, \"len\": tokens}}")
        requests.append(RequestSpec(
            request_id=request_id,
            arrival_step=_int(raw["arrival_step"], f"{where}.arrival_step"),
            prompt_len=_int(raw["prompt_len"], f"{where}.prompt_len"),
            max_tokens=_int(raw["max_tokens"], f"{where}.max_tokens"),
            priority=_int(raw.get("priority", 0), f"{where}.priority", minimum=-(2**31)),
            prefix_group=str(prefix["group"]) if prefix else None,
            prefix_len=_int(prefix["len"], f"{where}.prefix.len") if prefix else 0,
            abort_at_step=_int(raw["abort_at_step"], f"{where}.abort_at_step") if "abort_at_step" in raw else None,
            eos_at_output=_int(raw["eos_at_output"], f"{where}.eos_at_output", 1) if "eos_at_output" in raw else None,
        ))
    expect = data.get("expect", {})
    if not isinstance(expect, dict):
        raise ScenarioError(f"{path}: field 'expect' must be an object")
    unknown = set(expect) - EXPECT_KEYS
    if unknown:
        raise ScenarioError(f"{path}: expect: unknown key {sorted(unknown)[0]!r}")
    for request_id, outcome in expect.get("outcome", {}).items():
        allowed = outcome if isinstance(outcome, list) else [outcome]
        if request_id not in seen:
            raise ScenarioError(f"{path}: expect.outcome: unknown request {request_id!r}")
        if not allowed or any(o not in OUTCOMES for o in allowed):
            raise ScenarioError(f"{path}: expect.outcome.{request_id}: {outcome!r} (allowed: {sorted(OUTCOMES)})")
    for request_id in expect.get("first_token_by_step", {}):
        if request_id not in seen:
            raise ScenarioError(f"{path}: expect.first_token_by_step: unknown request {request_id!r}")
    if "demonstrates" in expect:
        named = expect["demonstrates"]
        names = named if isinstance(named, list) else [named]
        known = set(PROPERTIES) | {r.name for r in RULES}
        if not names or any(not isinstance(n, str) or n not in known for n in names):
            raise ScenarioError(
                f"{path}: expect.demonstrates: {named!r} is not a property or rule name or a list of them "
                f"(properties: {sorted(PROPERTIES)}; rules: {sorted(r.name for r in RULES)})"
            )
    max_steps = _int(data["max_steps"], f"{path}: max_steps", 1) if "max_steps" in data else None
    return Scenario(
        name=str(data["name"]), about=str(data.get("about", "")), config=config, policy=policy,
        requests=tuple(requests), expect=expect, scheduler=data.get("scheduler"), path=path,
        max_steps=max_steps,
    )


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file. Raises :class:`ScenarioError` (file, line or field named)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ScenarioError(f"{path}: cannot read ({error.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ScenarioError(f"{path}:{error.lineno}: invalid JSON ({error.msg})") from None
    return parse_scenario(data, str(path))


def bundled_scenarios() -> list[Path]:
    """The scenario files shipped in the package (``schedspec/data/cases/*.json``), sorted by name."""
    folder = resources.files("schedspec") / "data" / "cases"
    return sorted(Path(str(p)) for p in folder.iterdir() if p.name.endswith(".json"))


@attrs.frozen
class Verdict:
    """One expectation's result."""

    name: str
    passed: bool
    detail: str


@attrs.frozen
class ReplayResult:
    """A replayed scenario: the scheduler used, each verdict, and the run (``None`` on a config error)."""

    scenario: Scenario
    scheduler: str
    verdicts: tuple[Verdict, ...]
    run: RunResult | None

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)


def choose_scheduler(scenario: Scenario, override: str | None = None) -> str:
    """``--scheduler`` if given, else the scenario's ``scheduler``, else its ``config.policy``, else fcfs."""
    return override or scenario.scheduler or scenario.policy or "fcfs"


def _run(scenario: Scenario, scheduler_name: str, config: SchedulerConfig, requests: Sequence[RequestSpec],
         watch: tuple[str, ...] = (), token_source_factory: TokenSourceFactory | None = None) -> RunResult:
    scheduler = make_scheduler(scheduler_name, config)
    properties = [p for p in sorted(scheduler.guarantees) if p not in watch]
    token_source = token_source_factory(config, requests) if token_source_factory is not None else None
    engine = Engine(scheduler, config, token_source=token_source, properties=properties, watch=watch)
    limit = scenario.expect.get("all_terminal_by_step")
    max_steps = DEFAULT_MAX_STEPS if limit is None else max(limit + 1, 1) * 4 + 100
    if scenario.max_steps is not None:
        max_steps = scenario.max_steps
    return engine.run(requests, mode="steps", max_steps=max_steps)


def replay(scenario: Scenario, scheduler_name: str | None = None,
           config_changes: dict[str, Any] | None = None,
           token_source_factory: TokenSourceFactory | None = None) -> ReplayResult:
    """Run a scenario and judge it.

    Every rule and invariant is checked at every step and every property the scheduler guarantees is
    monitored (one verdict, ``invariants``); then each ``expect`` key gets a verdict.

    ``token_source_factory(config, requests)`` builds the token source of each run (the scenario's and,
    for ``outputs_equal_solo``, every solo run, each with a fresh one); default: the engine's
    :class:`~schedspec.reference.fake_model.FakeModel` with the workload's ``eos_at_output``.

    Raises:
        UnsupportedFeature: the scheduler cannot run this config (CLI exit 3).
        UnknownScheduler: no such scheduler.
    """
    name = choose_scheduler(scenario, scheduler_name)
    raw = dict(scenario.config)
    raw.update(config_changes or {})
    expect = scenario.expect
    verdicts: list[Verdict] = []
    try:
        config = SchedulerConfig.from_dict(raw)
    except ConfigError as error:
        if expect.get("config_error"):
            message = str(error)
            missing = [w for w in expect.get("config_error_mentions", []) if w not in message]
            verdicts.append(Verdict("config_error", not missing,
                                    f"refused: {message}" + (f"; message lacks {missing}" if missing else "")))
            return ReplayResult(scenario, name, tuple(verdicts), None)
        verdicts.append(Verdict("config", False, f"config refused: {error}"))
        return ReplayResult(scenario, name, tuple(verdicts), None)
    if expect.get("config_error"):
        verdicts.append(Verdict("config_error", False, "config was accepted but must be refused"))
        return ReplayResult(scenario, name, tuple(verdicts), None)

    named = expect.get("demonstrates")
    demonstrates = tuple(named if isinstance(named, list) else [named] if named else [])
    watch = tuple(n for n in demonstrates if n in PROPERTIES)
    run = _run(scenario, name, config, scenario.requests, watch=watch, token_source_factory=token_source_factory)
    state = run.state
    violations = [v for v in run.violations if v.name not in demonstrates]
    verdicts.append(Verdict(
        "invariants", not violations,
        f"{run.num_steps_checked} steps checked, no violation" if not violations
        else "; ".join(str(v) for v in violations[:3]),
    ))
    for demonstrated in demonstrates:
        if demonstrated in PROPERTIES:
            seen = run.property_violations.get(demonstrated, [])
        else:
            seen = [v for v in run.violations if v.name == demonstrated]
        verdicts.append(Verdict(
            "demonstrates" if len(demonstrates) == 1 else f"demonstrates({demonstrated})", bool(seen),
            f"{demonstrated} fails as expected: {seen[0]}" if seen else f"{demonstrated} held on every step",
        ))

    def request(request_id: str):
        return state.finished.get(request_id) or state.requests.get(request_id)

    for request_id, wanted in expect.get("outcome", {}).items():
        allowed = wanted if isinstance(wanted, list) else [wanted]
        found = request(request_id)
        outcome = found.status.outcome if found else "never added"
        reason = f" ({found.finish_reason})" if found and found.finish_reason else ""
        verdicts.append(Verdict(f"outcome[{request_id}]", outcome in allowed, f"{outcome}{reason}, expected {' or '.join(allowed)}"))
    if "all_terminal_by_step" in expect:
        bound = expect["all_terminal_by_step"]
        last = max((r.step for r in run.records if r.finished or r.rejected or r.aborted), default=-1)
        live = sorted(state.requests)
        ok = not live and last <= bound
        verdicts.append(Verdict("all_terminal_by_step", ok,
                                f"live at the end: {live}" if live else f"last request ended in step {last}, bound {bound}"))
    for request_id, bound in expect.get("first_token_by_step", {}).items():
        found = request(request_id)
        step = found.first_token_step if found else None
        verdicts.append(Verdict(f"first_token_by_step[{request_id}]", step is not None and step <= bound,
                                f"first token in step {step}, bound {bound}"))
    if "max_preemptions_per_request" in expect:
        bound = expect["max_preemptions_per_request"]
        counts = {r: q.num_preemptions for r, q in list(state.finished.items()) + list(state.requests.items())}
        worst = max(counts.items(), key=lambda kv: kv[1], default=("-", 0))
        verdicts.append(Verdict("max_preemptions_per_request", worst[1] <= bound,
                                f"most preempted: {worst[0]} {worst[1]} times, bound {bound}"))
    if expect.get("no_tokens_after_abort"):
        bad = []
        for spec in scenario.requests:
            if spec.abort_at_step is None:
                continue
            late = [r.step for r in run.records if r.step >= spec.abort_at_step and spec.request_id in r.sampled_token_ids]
            if late:
                bad.append(f"{spec.request_id} sampled in step {late[0]}")
        verdicts.append(Verdict("no_tokens_after_abort", not bad, "; ".join(bad) or "no token after any abort"))
    if expect.get("outputs_equal_solo"):
        differ = []
        for spec in scenario.requests:
            found = request(spec.request_id)
            if found is None or found.status.outcome != "finished":
                continue
            solo_spec = attrs.evolve(spec, arrival_step=0, abort_at_step=None)
            solo = _run(scenario, name, config, [solo_spec],
                        token_source_factory=token_source_factory).state.finished.get(spec.request_id)
            if solo is None or solo.output_token_ids != found.output_token_ids:
                differ.append(spec.request_id)
        verdicts.append(Verdict("outputs_equal_solo", not differ,
                                f"outputs differ from solo runs: {differ}" if differ else "every finished output equals its solo run"))
    if "free_blocks_at_end" in expect:
        wanted = expect["free_blocks_at_end"]
        free = len(state.free_block_ids)
        verdicts.append(Verdict("free_blocks_at_end", free == wanted, f"{free} free blocks, expected {wanted}"))
    return ReplayResult(scenario, name, tuple(verdicts), run)


__all__ = [
    "Scenario", "ScenarioError", "ReplayResult", "TokenSourceFactory", "Verdict", "UnsupportedFeature",
    "load_scenario", "parse_scenario", "replay", "bundled_scenarios", "choose_scheduler",
]
