"""`schedspec lab` as a new user sees it: every packaged trace by name with its source and license,
the long-context profile, the admission count before the run, derived config fields after --set, and
empty latency groups said in words."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from schedspec.cli import cli
from schedspec.lab import trace_formats


def lab(*args: str):
    return CliRunner().invoke(cli, ["lab", *args], catch_exceptions=False)


@pytest.mark.parametrize(("name", "title", "license_text"), [
    ("azure-conv", "Azure LLM inference 2023, conversation service", "CC BY 4.0"),
    ("azure-code", "Azure LLM inference 2023, code service", "CC BY 4.0"),
    ("mooncake", "Mooncake (Kimi) FAST'25 conversation trace", "Apache License 2.0"),
])
def test_every_packaged_trace_by_name_shows_source_license_and_summary(name, title, license_text):
    result = lab("--trace", name, "--max-requests", "20", "--steps", "none", "--no-check")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("│", " ").split())  # the table's wrapping undone
    assert title in text and license_text in text and "Source:" in text
    assert re.search(r"[\d,]+ requests over [\d,.]+ s", text), text
    assert name in trace_formats.PACKAGED_TRACES


def test_admission_count_is_printed_before_the_run_and_matches_the_rejections():
    args = ("--trace", "mooncake", "--max-requests", "40", "--no-check")
    result = lab(*args, "--steps", "none")
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    match = re.match(r"Admission: (\d+) of 40 requests .* longer than max_model_len 8,192", first)
    assert match, first
    figures = json.loads(lab(*args, "--json").stdout)["figures"]
    assert int(match.group(1)) == figures["rejected_prompt_exceeds_max_model_len"] > 0
    assert "--profile llama3.1-8b" in " ".join(result.output.split())


def test_long_context_profile_admits_the_mooncake_window():
    result = lab("--trace", "mooncake", "--max-requests", "40", "--no-check", "--json",
                 "--profile", "llama3.1-8b-h100-80gb")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["figures"]["requests_rejected"] == 0
    assert record["figures"]["requests_finished"] == 40
    assert record["conditions"]["config"]["max_model_len"] == 131_072


def test_derived_fields_are_derived_again_after_set():
    result = lab("--max-requests", "10", "--no-check", "--steps", "none", "--set", "block_size=32")
    assert result.exit_code == 0, result.output
    # floor(58,101,405,184 B / (32 tokens * 128 KiB)) = 14,090 blocks (tests/test_cost_model.py).
    assert re.search(r"num_kv_blocks\s+│ 14,090 ", result.output), result.output
    assert "block_size = 32 (set)" in result.output
    off = lab("--max-requests", "10", "--no-check", "--json", "--set", "enable_chunked_prefill=false")
    assert json.loads(off.stdout)["conditions"]["config"]["max_num_batched_tokens"] == 8192


def test_an_empty_latency_group_says_why():
    result = lab("--max-requests", "20", "--max-steps", "2", "--steps", "none", "--no-check")
    assert result.exit_code == 0, result.output
    assert "Per-request latency (finished requests): none. No request finished" in " ".join(result.output.split())
    assert "│ ttft │" not in result.output and "│     ttft │" not in result.output


def test_kv_usage_is_a_percent_in_the_summary_as_in_the_step_table():
    result = lab("--max-requests", "30", "--no-check", "--steps", "3")
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "kv_usage_mean" in line]
    assert len(rows) == 1 and rows[0].rstrip(" │").endswith("%"), rows
