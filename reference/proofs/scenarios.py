"""Counterexamples as scenarios: a Z3 model of a run from the initial state becomes a scenario in the
bundled format (``cases/README.md``) with ``"scheduler"`` and ``"expect": {"demonstrates": PROPERTY}``,
and the executable reference replays it to confirm that the property's monitor reports."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import z3

from schedspec.spec.proofs.encoding import Ctx
from schedspec.spec.proofs.solve import value


def _request_name(k: int) -> str:
    letters = string.ascii_uppercase
    return letters[k] if k < len(letters) else f"R{k}"


def scenario_from_run(model: z3.ModelRef, ctx: Ctx, run: Any, policy: str, prop: str, name: str, about: str
                      ) -> dict[str, Any]:
    """The scenario of the run in ``model``: its config and the requests that arrived within the run."""
    config = ctx.cfg.evaluate(model)
    config = {
        "block_size": config["block_size"], "num_kv_blocks": config["num_kv_blocks"],
        "max_num_batched_tokens": config["max_num_batched_tokens"], "max_num_seqs": config["max_num_seqs"],
        "max_model_len": config["max_model_len"], "enable_chunked_prefill": config["enable_chunked_prefill"],
        "long_prefill_token_threshold": config["long_prefill_token_threshold"], "enable_prefix_caching": False,
        "preemption_mode": "recompute", "policy": policy,
    }
    depth = len(run.steps)
    arrived = []
    for i, arrival in enumerate(run.arrival):
        step = value(model, arrival)
        if step < depth:
            arrived.append((step, i))
    requests = []
    for k, (step, i) in enumerate(sorted(arrived)):
        requests.append({"id": _request_name(k), "arrival_step": step, "prompt_len": value(model, run.prompt[i]),
                         "max_tokens": value(model, run.max_tokens[i])})
    return {
        "name": name,
        "about": about,
        "scheduler": policy,
        "config": config,
        "requests": requests,
        "expect": {"demonstrates": prop},
    }


def confirm(scenario: dict[str, Any], prop: str) -> tuple[bool, str]:
    """Replay the scenario on its scheduler; confirmed when every invariant holds and ``prop``'s monitor
    reports. Returns ``(confirmed, one line)``."""
    from schedspec.reference.scenarios import parse_scenario, replay

    result = replay(parse_scenario(scenario, scenario["name"]))
    verdicts = {v.name: v for v in result.verdicts}
    shown = verdicts.get("demonstrates")
    invariants = verdicts.get("invariants")
    ok = bool(shown and shown.passed and invariants and invariants.passed)
    if ok:
        return True, f"replayed on {result.scheduler}: {shown.detail}"
    problems = [f"{v.name}: {v.detail}" for v in result.verdicts if not v.passed]
    return False, f"replay on {result.scheduler} did not confirm it: {'; '.join(problems)}"


def write_scenario(scenario: dict[str, Any], folder: str | Path) -> Path:
    """Write ``<folder>/<name>.json`` in the bundled files' layout (one request per line)."""
    path = Path(folder) / f"{scenario['name']}.json"
    path.write_text(render(scenario), encoding="utf-8")
    return path


def render(scenario: dict[str, Any]) -> str:
    head = {k: scenario[k] for k in ("name", "about", "scheduler")}
    lines = ["{"]
    for key, val in head.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(val)},")
    lines.append(f'  "config": {json.dumps(scenario["config"])},')
    lines.append('  "requests": [')
    reqs = [f"    {json.dumps(r)}" for r in scenario["requests"]]
    lines.append(",\n".join(reqs))
    lines.append("  ],")
    lines.append(f'  "expect": {json.dumps(scenario["expect"])}')
    lines.append("}")
    return "\n".join(lines) + "\n"
