"""Write docs/choosing-a-configuration.md and its plots (docs/images/choosing/) from lab sweeps on the
packaged real traces, so that every number and figure on the page comes from a run, with its
conditions, and none is typed.

Each experiment is one ``schedspec lab --sweep ... --json --plot DIR`` command (run in-process through
the CLI, so the page shows the exact command a reader can run). The page is not rebuilt by the docs
build (the sweeps take minutes); regenerate it after a change to the lab, the policies or the cost
model::

    .venv/bin/python scripts/gen_config_guide.py            # about 5 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import time
from pathlib import Path

from click.testing import CliRunner

from schedspec.cli import cli
from schedspec.lab.metrics import parse_slo
from schedspec.lab.sweep import choose_best, value_text

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "choosing-a-configuration.md"
IMAGES = ROOT / "docs" / "images" / "choosing"

SLO = "ttft=2s,itl=200ms"
AZURE = ("--trace", "azure-conv", "--duration", "120")
"""The first two minutes of the Azure conversation trace at its recorded rate (456 requests, about
3.8 requests/s) on one A100 (the default profile)."""
MOONCAKE = ("--trace", "mooncake", "--duration", "120", "--time-scale", "4", "--profile", "llama3.1-8b-h100-80gb")
"""The first two minutes of the Mooncake trace (long prompts: half exceed 8,192 tokens) with arrivals
at a quarter of the recorded rate (one GPU's share of a service that ran on many), on the
128k-context profile on one H100."""

EXPERIMENTS = [
    {
        "key": "budget",
        "title": "The token budget: `max_num_batched_tokens`",
        "args": (*AZURE, "--sweep", "max_num_batched_tokens=256,512,1024,2048,4096,8192"),
        "intro": (
            "`max_num_batched_tokens` caps the tokens one step computes, prompts and decodes together. "
            "With chunked prefill on, a long prompt is cut into chunks of at most the remaining budget. "
            "A larger budget finishes prompts in fewer steps (lower TTFT), but every decoding request "
            "waits for the whole step, so a step carrying a large prefill chunk stretches the gap between "
            "two tokens of every other request (higher ITL tail)."
        ),
    },
    {
        "key": "seqs",
        "title": "The batch size: `max_num_seqs`",
        "args": (*AZURE, "--sweep", "max_num_seqs=8,16,32,64,128,256"),
        "intro": (
            "`max_num_seqs` caps the requests running at once. Too small, and arrivals queue while the "
            "device is underused: TTFT grows with the queue and throughput drops. Larger, and more "
            "decodes share each step: each step is a little longer (the KV reads grow), so ITL rises "
            "slowly, while throughput rises until the load is served."
        ),
    },
    {
        "key": "chunking",
        "title": "Chunked prefill on or off",
        "args": (*AZURE, "--sweep", "enable_chunked_prefill=true,false"),
        "intro": (
            "Without chunked prefill a prompt is computed in one step, and vLLM raises "
            "`max_num_batched_tokens` to `max_model_len` so that any admitted prompt fits (the lab "
            "derives it the same way and says so in its \"Config derivation\" lines). Every decode then "
            "waits for whole prompts: the ITL tail is the cost of the longest prompt in the window."
        ),
    },
    {
        "key": "mooncake",
        "title": "Long prompts: the Mooncake trace with a 128k context",
        "args": (*MOONCAKE, "--sweep", "max_num_batched_tokens=2048,8192,32768"),
        "intro": (
            "On the Mooncake conversation trace, prompts run to 126k tokens. With the 8k-context "
            "profiles the lab says before the run how many requests exceed `max_model_len` (and are "
            "rejected); the `llama3.1-8b-*` profiles (`max_model_len` 131,072) admit them. Long prompts "
            "make the budget's trade sharper: each step of a large chunk holds every decode."
        ),
    },
]


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1e3:,.0f}" if value * 1e3 >= 100 else f"{value * 1e3:.1f}"


def run(experiment: dict) -> tuple[str, list[dict], float]:
    folder = IMAGES / experiment["key"]
    if folder.exists():
        shutil.rmtree(folder)
    args = ["lab", *experiment["args"], "--slo", SLO, "--no-check", "--json", "--plot", str(folder.relative_to(ROOT))]
    started = time.perf_counter()
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    elapsed = time.perf_counter() - started
    if result.exit_code != 0:
        raise SystemExit(f"{' '.join(args)}: exit {result.exit_code}\n{result.output[-2000:]}")
    command = "schedspec " + " ".join(shlex.quote(a) for a in args)
    return command, json.loads(result.stdout), elapsed


def table(records: list[dict]) -> list[str]:
    fields = list(records[0]["conditions"]["sweep_point"])
    head = [*fields, "output tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "TPOT p50 ms", "goodput %",
            "preemptions", "KV mean %", "meets SLO"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    slo = records[0]["conditions"]["slo"]
    for record in records:
        f = record["figures"]
        meets = (not f["violations"] and f["ttft_p99_s"] is not None and f["ttft_p99_s"] <= slo["ttft_s"]
                 and f["itl_p99_s"] is not None and f["itl_p99_s"] <= slo["itl_s"])
        point = record["conditions"]["sweep_point"]
        lines.append("| " + " | ".join([
            *(str(point[k]).lower() if isinstance(point[k], bool) else f"{point[k]}" for k in fields),
            f"{f['output_tokens_per_s']:,.0f}", f"{_ms(f['ttft_p50_s'])} / {_ms(f['ttft_p99_s'])}",
            f"{_ms(f['itl_p50_s'])} / {_ms(f['itl_p99_s'])}", _ms(f["tpot_p50_s"]),
            "–" if f["goodput_percent"] is None else f"{f['goodput_percent']:.1f}", f"{f['preemptions']:,}",
            f"{f['kv_usage_mean_percent']:.1f}", "yes" if meets else "no",
        ]) + " |")
    return lines


def conditions(records: list[dict], elapsed: float) -> str:
    c = records[0]["conditions"]
    config = {k: v for k, v in c["config"].items() if k not in c["sweep_point"]}
    window = c["window"]
    arrivals = c["arrivals"]
    cost = c["cost_profile"]
    return (
        f"Conditions: trace {c['workload']['description'].splitlines()[0]}; window: the first "
        f"{window['duration_s']:g} s, time scale {window['time_scale']:g} ({arrivals['num_requests']:,} requests, "
        f"{arrivals['rate_req_per_s']:.1f} requests/s); scheduler `{c['scheduler']}`; step times from the cost "
        f"model `{cost['name']}` ({cost['hardware']}, {cost['model']}); the other config fields: "
        + ", ".join(f"`{k}={v}`" for k, v in config.items())
        + f"; SLO p99 TTFT <= {c['slo']['ttft_s']:g} s and p99 ITL <= {c['slo']['itl_s'] * 1e3:g} ms; spec checks off "
        f"for speed (the figures do not depend on the checks); {len(records)} runs in {elapsed:.0f} s "
        f"wall on {os.cpu_count()} cores; schedspec {c['schedspec_version']}."
    )


def verdict(records: list[dict]) -> str:
    """The lab's own verdict on the sweep (``schedspec.lab.sweep.choose_best``, as the CLI prints it)."""
    best, reason = choose_best(records, parse_slo(SLO))
    if best is None:
        return f"**The lab's verdict:** none: {reason}."
    point = ", ".join(f"`{k}={value_text(v)}`" for k, v in records[best]["conditions"]["sweep_point"].items())
    return f"**The lab's verdict:** {point}: {reason}."


def main() -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    lines = [
        "<!-- Generated by scripts/gen_config_guide.py from lab sweeps; do not edit by hand. -->",
        "",
        "# Choosing a configuration",
        "",
        "An iteration-level scheduler has three limits that decide most of what users feel: "
        "`max_num_batched_tokens` (the tokens one step may compute), `max_num_seqs` (the requests that may "
        "run at once) and chunked prefill (whether a prompt may be split across steps). They trade the "
        "time to the first token (TTFT) against the time between tokens (ITL): a larger step serves more "
        "work per forward pass, and every request in it waits for the whole pass.",
        "",
        "This page shows the trade on the packaged real traces with `schedspec lab --sweep`. Every table "
        "and plot below was produced by the command printed above it (run by "
        "`scripts/gen_config_guide.py`); the figures are simulated (the cost model of "
        "[Workloads and metrics](workloads-and-metrics.md)), so they compare configurations under the "
        "same conditions rather than predict a real GPU to the millisecond. Each row is one configuration; "
        "*meets SLO* means its p99 TTFT and p99 ITL are within the target; the plots mark the "
        "configurations that meet it, the Pareto front (no other point has both lower p99 latency and "
        "higher throughput) and the SLO line.",
        "",
        "How to read the columns: output tok/s is output tokens per simulated second; TTFT is arrival to "
        "first token; ITL is every gap between two tokens of one request (pooled); TPOT is a request's "
        "mean gap; goodput is the share of admitted requests that met both SLOs; KV mean is the "
        "time-weighted KV cache use.",
        "",
    ]
    for experiment in EXPERIMENTS:
        command, records, elapsed = run(experiment)
        key = experiment["key"]
        lines += [f"## {experiment['title']}", "", experiment["intro"], "", "```bash", command, "```", "",
                  conditions(records, elapsed), "", *table(records), "", verdict(records), "",
                  f"![Throughput against p99 ITL](images/choosing/{key}/sweep-itl-p99.png)",
                  f"![Throughput against p99 TTFT](images/choosing/{key}/sweep-ttft-p99.png)", ""]
        print(f"{key}: {len(records)} runs in {elapsed:.0f} s")
    lines += [
        "## What to take away",
        "",
        "- Start from vLLM's defaults (the lab's profiles derive them) and sweep the field you mean to "
        "change, on a window of your own traffic, with your SLO: `--sweep FIELD=... --slo ttft=..,itl=..`. "
        "The lab names the best configuration that meets the SLO and why (the verdicts above are its words).",
        "- The step budget is the ITL lever: a step that carries a prefill chunk of the whole budget lasts "
        "about `a + b * max_num_batched_tokens` (the cost model's per-step and per-token costs), and every "
        "decoding request waits for it; the p99 ITL column follows it. The TTFT columns show what a smaller "
        "budget costs.",
        "- `max_num_seqs` limits only when the load needs more concurrency; set too low, requests queue "
        "and TTFT grows with the queue.",
        "- Without chunked prefill the ITL tail is set by the longest prompt in the window.",
        "- Compare runs only under the same conditions: `--save` each run and `schedspec compare "
        "BEFORE.json AFTER.json`, which refuses runs whose conditions differ in more than the field under "
        "study.",
        "",
        f"Generated on {platform.machine()} with Python {platform.python_version()}.",
        "",
    ]
    PAGE.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
