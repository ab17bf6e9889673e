"""Scenarios: small JSON cases distilled from real scheduler faults, replayed with expectations.

Format: ``cases/README.md`` (shipped copies under ``schedspec/data/cases``). :func:`load_scenario`
validates a file and raises :class:`ScenarioError` naming the file and the field; :func:`replay`
runs it on a scheduler with every invariant checked at every step and judges each ``expect`` key.
A scenario gives arrival steps only; the engine loop stamps each arrival's ``arrival_time`` with the
start of its step on the simulated clock (:class:`~schedspec.spec.workload.ArrivalClock`), as an
engine stamps requests on receipt.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from schedspec.spec.config import ConfigError, SchedulerConfig, blocks_for_tokens
from schedspec.spec.properties import PROPERTIES
from schedspec.spec.rules import RULES
from schedspec.spec.trace import StrictJsonError, strict_json_loads
from schedspec.spec.workload import RequestSpec

from .engine import Engine, RunResult
from .fake_model import AcceptanceModel, FakeModel, TokenSource, simulation_size_problem
from .scheduler import EngineFault, UnsupportedFeature, make_scheduler

TokenSourceFactory = Callable[[SchedulerConfig, Sequence[RequestSpec]], TokenSource]
"""Builds the token source of one run from its config and workload (``replay(token_source_factory=...)``)."""


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names the file and the field."""


EXPECT_KEYS = {
    "config_error", "config_error_mentions", "outcome", "all_terminal_by_step", "first_token_by_step",
    "max_preemptions_per_request", "no_tokens_after_abort", "outputs_equal_solo", "free_blocks_at_end",
    "demonstrates", "finding",
}
FINDING_KEYS = {"name", "step", "mentions", "also"}
ENGINE_CRASH = "engine-crash"
"""The ``finding.name`` of an engine crash (:class:`~schedspec.reference.scheduler.EngineFault`)."""
REQUEST_KEYS = {"id", "arrival_step", "prompt_len", "max_tokens", "priority", "prefix", "abort_at_step", "eos_at_output",
                "acceptance", "lora_int_id", "grammar_compile_steps", "num_external_computed_tokens", "kv_load_steps",
                "kv_load_invalid_block", "kv_send", "kv_send_steps"}
OUTCOMES = {"finished", "rejected", "aborted"}
TOP_KEYS = {"name", "about", "config", "requests", "expect", "scheduler", "max_steps"}
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
    acceptance: Mapping[str, str] = attrs.field(factory=dict)
    """Speculative decoding: request id -> its acceptance pattern (the request's ``acceptance`` field, one of
    :data:`~schedspec.reference.fake_model.ACCEPTANCE_PATTERNS`: ``"all"``, ``"none"``, ``"rate:P"``,
    ``"upto:N"``); the others follow the :class:`~schedspec.reference.fake_model.AcceptanceModel` default."""


MAX_STEP = 10_000
"""Largest step number a scenario may name (``arrival_step``, ``abort_at_step``, ``*_by_step``):
scenarios are small cases, replayed step by step (a replay stops after 10,000 steps, or four
times ``all_terminal_by_step``)."""

MAX_COUNT = 2**31 - 1
"""Largest token or block count a scenario may carry (int32)."""

MAX_REQUESTS = 1_000_000
"""Most requests a scenario may list (``benchmarks/size.py`` replays 100,000 in well under a minute; a
replay keeps every request's state, about 1 KB each)."""

MAX_SCENARIO_BYTES = 256 * 1024 * 1024
"""Largest scenario file read (256 MiB; a million requests take about 80 MB of JSON)."""


def _int(value: Any, where: str, minimum: int = 0, maximum: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ScenarioError(f"{where}: expected an integer in [{minimum:,}, {maximum:,}], got {_show(value)}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ScenarioError(f"{where}: expected true or false, got {_show(value)}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ScenarioError(f"{where}: expected a non-empty string, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_scenario(data: Any, path: str = "<scenario>") -> Scenario:
    """Validate a decoded scenario; raises :class:`ScenarioError` naming ``path`` and the field.

    Every field is checked for type and range (counts in ``[0, 2**31-1]``, steps in
    ``[0, MAX_STEP]``, flags ``true``/``false``, at most :data:`MAX_REQUESTS` requests, no abort before
    its arrival), and ``config`` is validated as a
    :class:`SchedulerConfig` unless ``expect.config_error`` says it must be refused, so a wrong
    config is unusable input (naming ``config.FIELD``), never a failed check.
    """
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: the top level must be a JSON object")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise ScenarioError(f"{path}: unknown field {sorted(unknown)[0]!r} (known: {', '.join(sorted(TOP_KEYS))})")
    for key in ("name", "config", "requests"):
        if key not in data:
            raise ScenarioError(f"{path}: missing field {key!r}")
    name = _str(data["name"], f"{path}: name")
    about = data.get("about", "")
    if not isinstance(about, str):
        raise ScenarioError(f"{path}: about: expected a string, got {_show(about)}")
    scheduler = data.get("scheduler")
    if scheduler is not None:
        _str(scheduler, f"{path}: scheduler")
    config = data["config"]
    if not isinstance(config, dict):
        raise ScenarioError(f"{path}: field 'config' must be an object")
    config = dict(config)
    policy = config.pop("policy", None)
    if policy is not None:
        _str(policy, f"{path}: config.policy")
    if not isinstance(data["requests"], list):
        raise ScenarioError(f"{path}: field 'requests' must be a list")
    if len(data["requests"]) > MAX_REQUESTS:
        raise ScenarioError(f"{path}: requests: {len(data['requests']):,} requests, more than the {MAX_REQUESTS:,} "
                            "a scenario may list")
    requests = []
    seen = set()
    acceptance: dict[str, str] = {}
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
        request_id = _str(raw["id"], f"{where}.id")
        if request_id in seen:
            raise ScenarioError(f"{where}.id: duplicate id {request_id!r}")
        seen.add(request_id)
        prefix = raw.get("prefix")
        if prefix is not None and (not isinstance(prefix, dict) or set(prefix) != {"group", "len"}):
            raise ScenarioError(f"{where}.prefix: expected {{\"group\": name, \"len\": tokens}}")
        prompt_len = _int(raw["prompt_len"], f"{where}.prompt_len")
        arrival = _int(raw["arrival_step"], f"{where}.arrival_step", maximum=MAX_STEP)
        if "abort_at_step" in raw:
            abort = _int(raw["abort_at_step"], f"{where}.abort_at_step", maximum=MAX_STEP)
            if abort < arrival:  # the engine would meet the abort before the request exists, and drop it
                raise ScenarioError(f"{where}.abort_at_step: {abort} is before arrival_step {arrival} "
                                    "(a request can be aborted only once it has arrived)")
        if "acceptance" in raw:
            pattern = _str(raw["acceptance"], f"{where}.acceptance")
            try:
                AcceptanceModel(patterns={request_id: pattern})
            except ValueError as error:
                raise ScenarioError(f"{where}.acceptance: {error}") from None
            acceptance[request_id] = pattern
        try:
            spec = RequestSpec(
            request_id=request_id,
            arrival_step=arrival,
            prompt_len=prompt_len,
            max_tokens=_int(raw["max_tokens"], f"{where}.max_tokens"),
            priority=_int(raw.get("priority", 0), f"{where}.priority", minimum=-(2**31)),
            prefix_group=_str(prefix["group"], f"{where}.prefix.group") if prefix else None,
            prefix_len=_int(prefix["len"], f"{where}.prefix.len", maximum=prompt_len) if prefix else 0,
            abort_at_step=abort if "abort_at_step" in raw else None,
            eos_at_output=_int(raw["eos_at_output"], f"{where}.eos_at_output", 1) if "eos_at_output" in raw else None,
            lora_int_id=_int(raw.get("lora_int_id", 0), f"{where}.lora_int_id"),
            grammar_compile_steps=(_int(raw["grammar_compile_steps"], f"{where}.grammar_compile_steps", maximum=MAX_STEP)
                                   if "grammar_compile_steps" in raw else None),
            num_external_computed_tokens=_int(raw.get("num_external_computed_tokens", 0),
                                              f"{where}.num_external_computed_tokens", maximum=prompt_len),
            kv_load_steps=(_int(raw["kv_load_steps"], f"{where}.kv_load_steps", 1, maximum=MAX_STEP)
                           if "kv_load_steps" in raw else None),
            kv_load_invalid_block=(_int(raw["kv_load_invalid_block"], f"{where}.kv_load_invalid_block")
                                   if "kv_load_invalid_block" in raw else None),
            kv_send=_bool(raw.get("kv_send", False), f"{where}.kv_send"),
            kv_send_steps=(_int(raw["kv_send_steps"], f"{where}.kv_send_steps", 1, maximum=MAX_STEP)
                           if "kv_send_steps" in raw else None),
            )
        except ValueError as error:  # RequestSpec's own checks (a transfer's schedule without the transfer, ...)
            raise ScenarioError(f"{where}: {error}") from None
        requests.append(spec)
    expect = data.get("expect", {})
    if not isinstance(expect, dict):
        raise ScenarioError(f"{path}: field 'expect' must be an object")
    unknown = set(expect) - EXPECT_KEYS
    if unknown:
        raise ScenarioError(f"{path}: expect: unknown key {sorted(unknown)[0]!r}")
    _check_expect(expect, seen, path)
    if not expect.get("config_error"):
        try:
            checked = SchedulerConfig.from_dict(config)
        except ConfigError as error:
            raise ScenarioError(f"{path}: config.{error.field}: {error.reason} (got {_show(error.value)})") from None
        except (TypeError, ValueError, OverflowError) as error:
            raise ScenarioError(f"{path}: config: {error}") from None
        problem = simulation_size_problem(checked)
        if problem is not None:
            raise ScenarioError(f"{path}: config.{problem}")
        for index, spec in enumerate(requests):
            # a failure past the load's blocks never happens: the field would be dropped silently
            load_blocks = blocks_for_tokens(spec.num_external_computed_tokens, checked.block_size)
            if spec.kv_load_invalid_block is not None and spec.kv_load_invalid_block >= load_blocks:
                raise ScenarioError(f"{path}: requests[{index}].kv_load_invalid_block: {spec.kv_load_invalid_block} is "
                                    f"past the load's last block (index {load_blocks - 1}: num_external_computed_tokens "
                                    f"{spec.num_external_computed_tokens} at block_size {checked.block_size}), so the "
                                    "load would never fail")
    max_steps = _int(data["max_steps"], f"{path}: max_steps", 1, maximum=10 * MAX_STEP) if "max_steps" in data else None
    return Scenario(
        name=name, about=about, config=config, policy=policy,
        requests=tuple(requests), expect=expect, scheduler=scheduler, path=path, max_steps=max_steps,
        acceptance=acceptance,
    )


def _check_expect(expect: dict[str, Any], ids: set[str], path: str) -> None:
    where = f"{path}: expect"
    for key in ("config_error", "no_tokens_after_abort", "outputs_equal_solo"):
        if key in expect:
            _bool(expect[key], f"{where}.{key}")
    mentions = expect.get("config_error_mentions", [])
    if not isinstance(mentions, list) or not all(isinstance(m, str) for m in mentions):
        raise ScenarioError(f"{where}.config_error_mentions: expected a list of strings, got {_show(mentions)}")
    outcome = expect.get("outcome", {})
    if not isinstance(outcome, dict):
        raise ScenarioError(f"{where}.outcome: expected an object of request id -> outcome, got {_show(outcome)}")
    for request_id, wanted in outcome.items():
        allowed = wanted if isinstance(wanted, list) else [wanted]
        if request_id not in ids:
            raise ScenarioError(f"{where}.outcome: unknown request {request_id!r}")
        if not allowed or any(not isinstance(o, str) or o not in OUTCOMES for o in allowed):
            raise ScenarioError(f"{where}.outcome.{request_id}: {_show(wanted)} (allowed: {', '.join(sorted(OUTCOMES))})")
    if "all_terminal_by_step" in expect:
        _int(expect["all_terminal_by_step"], f"{where}.all_terminal_by_step", maximum=MAX_STEP)
    first = expect.get("first_token_by_step", {})
    if not isinstance(first, dict):
        raise ScenarioError(f"{where}.first_token_by_step: expected an object of request id -> step, got {_show(first)}")
    for request_id, bound in first.items():
        if request_id not in ids:
            raise ScenarioError(f"{where}.first_token_by_step: unknown request {request_id!r}")
        _int(bound, f"{where}.first_token_by_step.{request_id}", maximum=MAX_STEP)
    if "max_preemptions_per_request" in expect:
        _int(expect["max_preemptions_per_request"], f"{where}.max_preemptions_per_request")
    if "free_blocks_at_end" in expect:
        _int(expect["free_blocks_at_end"], f"{where}.free_blocks_at_end")
    if "demonstrates" in expect:
        named = expect["demonstrates"]
        names = named if isinstance(named, list) else [named]
        known = set(PROPERTIES) | {r.name for r in RULES}
        if not names or any(not isinstance(n, str) or n not in known for n in names):
            raise ScenarioError(
                f"{where}.demonstrates: {_show(named)} is not a property or rule name or a list of them "
                f"(properties: {', '.join(sorted(PROPERTIES))}; rules: {', '.join(sorted(r.name for r in RULES))})"
            )
    finding = expect.get("finding")
    if finding is not None:
        if not isinstance(finding, dict) or not isinstance(finding.get("name"), str) or set(finding) - FINDING_KEYS:
            raise ScenarioError(
                f"{where}.finding: expected {{\"name\": violation name or {ENGINE_CRASH!r}, "
                "optional \"step\", optional \"mentions\": [words], optional \"also\": [violation names]}"
            )
        also = finding.get("also", [])
        if not isinstance(also, list) or not all(isinstance(w, str) for w in also):
            raise ScenarioError(f"{where}.finding.also: expected a list of violation names")
        if "step" in finding:
            _int(finding["step"], f"{where}.finding.step", maximum=MAX_STEP)
        words = finding.get("mentions", [])
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ScenarioError(f"{where}.finding.mentions: expected a list of strings")


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file. Raises :class:`ScenarioError` (file, line or field named):
    unreadable file, a file over :data:`MAX_SCENARIO_BYTES`, bytes that are not UTF-8, invalid JSON (also ``NaN``, ``Infinity`` and a key
    given twice in one object), or any field :func:`parse_scenario` refuses."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir() and not stat.S_ISREG(path.stat().st_mode):
            raise ScenarioError(f"{path}: not a regular file (a device or pipe cannot be read as a scenario)")
        if path.is_file() and path.stat().st_size > MAX_SCENARIO_BYTES:
            raise ScenarioError(f"{path}: {path.stat().st_size:,} bytes, larger than the {MAX_SCENARIO_BYTES:,} "
                                "a scenario file may have")
        raw = path.read_bytes()
    except OSError as error:
        raise ScenarioError(f"{path}: cannot read ({error.strerror})") from None
    except ScenarioError:
        raise
    except ValueError as error:  # a NUL character in the path
        raise ScenarioError(f"{path}: cannot open ({error})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise ScenarioError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[error.start]:02x})") from None
    try:
        data = strict_json_loads(text)
    except StrictJsonError as error:
        where = f"{path}:{error.lineno}" if error.lineno is not None else f"{path}"
        raise ScenarioError(f"{where}: invalid JSON ({error})") from None
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


ALWAYS_JUDGED = frozenset({"config_error", "config_error_mentions", "outcome", "no_tokens_after_abort",
                           "outputs_equal_solo", "free_blocks_at_end"})
"""``expect`` keys every scheduler is judged on (the implicit ``invariants`` verdict always is): what any
correct scheduler owes on the scenario's workload."""
OWN_SCHEDULER_ONLY = frozenset({"first_token_by_step", "all_terminal_by_step", "max_preemptions_per_request"})
"""``expect`` keys judged only on the scenario's own scheduler (:func:`choose_scheduler` without an override):
latency and preemption bounds, which differ between correct policies (static batching holds a slot that
continuous batching reuses)."""
FAULT_RECORDS = frozenset({"demonstrates", "finding"})
"""``expect`` keys that record how the scenario's own scheduler fails: judged on it by ``schedspec replay``
(they pass while the fault is there), on no other scheduler, and never by the conformance suite (the
scheduler under test must not fail)."""


def judged_on(scenario: Scenario, scheduler_name: str, *,
              fault_records: bool = True) -> tuple[Scenario, tuple[str, ...]]:
    """The scenario as it is judged on ``scheduler_name``, and the ``expect`` keys left out (sorted).

    On its own scheduler (:func:`choose_scheduler` with no override): :data:`ALWAYS_JUDGED`,
    :data:`OWN_SCHEDULER_ONLY` and, with ``fault_records``, :data:`FAULT_RECORDS`; on any other, only
    :data:`ALWAYS_JUDGED`. The ``invariants`` verdict is always judged. ``schedspec replay --scheduler``
    (``fault_records=True``) and the conformance suite (:mod:`schedspec.conformance`, ``False``) both
    judge this way, so that a scenario written for another scheduler never fails the one under test for
    what that one does not promise.
    """
    own = scheduler_name == choose_scheduler(scenario)
    keep = ALWAYS_JUDGED | (OWN_SCHEDULER_ONLY if own else frozenset()) | (
        FAULT_RECORDS if own and fault_records else frozenset())
    kept = {k: v for k, v in scenario.expect.items() if k in keep}
    left_out = tuple(sorted(set(scenario.expect) - set(kept)))
    return (attrs.evolve(scenario, expect=kept) if left_out else scenario), left_out


def _run(scenario: Scenario, scheduler_name: str, config: SchedulerConfig, requests: Sequence[RequestSpec],
         watch: tuple[str, ...] = (), token_source_factory: TokenSourceFactory | None = None) -> RunResult:
    scheduler = make_scheduler(scheduler_name, config)
    properties = [p for p in sorted(scheduler.guarantees) if p not in watch]
    token_source = token_source_factory(config, requests) if token_source_factory is not None else None
    if token_source is None and config.speculative and scenario.acceptance:
        # the default token source, with the scenario's per-request acceptance patterns
        token_source = FakeModel(config, eos_at_output={s.request_id: s.eos_at_output for s in requests
                                                        if s.eos_at_output},
                                 acceptance=AcceptanceModel(patterns=scenario.acceptance))
    engine = Engine(scheduler, config, token_source=token_source, properties=properties, watch=watch, incremental=True)
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
    finding = expect.get("finding")
    try:
        run = _run(scenario, name, config, scenario.requests, watch=watch, token_source_factory=token_source_factory)
    except EngineFault as fault:
        verdicts.append(_finding_verdict(finding, [(ENGINE_CRASH, fault.step, str(fault))])
                        if finding else Verdict("engine", False, f"the engine crashed: {fault}"))
        return ReplayResult(scenario, name, tuple(verdicts), None)
    state = run.state
    if finding:
        verdicts.append(_finding_verdict(finding, [(v.name, v.step, str(v)) for v in run.violations]))
    expected = {*demonstrates, *([finding["name"], *finding.get("also", [])] if finding else [])}
    violations = [v for v in run.violations if v.name not in expected]
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


def _finding_verdict(finding: dict[str, Any], seen: list[tuple[str, int | None, str]]) -> Verdict:
    """``expect.finding``: a known engine fault must show, as it was observed: a violation (or the engine
    crash, ``engine-crash``) of that name, at ``step`` if given, whose text contains every word of
    ``mentions``. It passes while the engine still has the fault and fails once the engine is fixed."""
    name, step, words = finding["name"], finding.get("step"), finding.get("mentions", [])
    for seen_name, seen_step, text in seen:
        if seen_name == name and (step is None or seen_step == step) and all(w in text for w in words):
            return Verdict("finding", True, f"{name} reproduced: {text}")
    where = f" at step {step}" if step is not None else ""
    others = "; ".join(text for _, _, text in seen[:2]) or "none"
    return Verdict("finding", False, f"{name}{where} mentioning {words} not seen (seen: {others})")


__all__ = [
    "Scenario", "ScenarioError", "ReplayResult", "TokenSourceFactory", "Verdict", "UnsupportedFeature",
    "load_scenario", "parse_scenario", "replay", "bundled_scenarios", "choose_scheduler", "judged_on",
    "ALWAYS_JUDGED", "OWN_SCHEDULER_ONLY", "FAULT_RECORDS",
]
