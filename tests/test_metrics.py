"""Latency and efficiency metrics, goodput (schedspec.lab.metrics), on hand-built runs whose
expected values are worked out by hand in the comments."""

from __future__ import annotations

import csv

import attrs
import pytest

from schedspec.lab.metrics import (
    CSV_COLUMNS,
    EFFICIENCY_KEYS,
    MetricsError,
    RequestTimeline,
    Slo,
    efficiency_summary,
    goodput,
    latency_summary,
    long_prompt_threshold,
    parse_slo,
    stats,
    timelines_to_csv,
)
from schedspec.spec.trace import ScheduledTokens, StepRecord
from schedspec.spec.workload import RequestSpec


def example() -> list[RequestTimeline]:
    return [
        # A: arrives 0, first scheduled 0.5, tokens at 1.0, 1.2, 1.5, 2.0, finishes at 2.0.
        RequestTimeline("A", 100, 0.0, 0.5, [1.0, 1.2, 1.5, 2.0], 2.0, "finished", "length"),
        # B: long prompt, arrives 1.0 during a long prefill, scheduled at once, one token at 1.5.
        RequestTimeline("B", 1000, 1.0, 1.0, [1.5], 1.5, "finished", "stop", arrived_during_long_prefill=True),
        # C: rejected at 0.2.
        RequestTimeline("C", 50, 0.2, None, [], 0.2, "rejected", None),
        # D: aborted after two tokens.
        RequestTimeline("D", 200, 0.3, 0.3, [0.8, 1.8], 1.9, "aborted", None, num_preemptions=1),
    ]


def test_timeline_definitions():
    a, b, c, d = example()
    assert a.ttft == 1.0 and a.queueing_delay == 0.5 and a.e2e == 2.0
    assert a.itls == pytest.approx([0.2, 0.3, 0.5])
    assert a.tpot == pytest.approx(1.0 / 3)  # (2.0 - 1.0) / (4 - 1)
    assert a.max_itl == pytest.approx(0.5)
    assert (b.ttft, b.itls, b.tpot, b.max_itl, b.queueing_delay) == (0.5, [], None, None, 0.0)
    assert (c.ttft, c.queueing_delay, c.num_output_tokens) == (None, None, 0)
    assert d.ttft == pytest.approx(0.5) and d.tpot == pytest.approx(1.0)
    live = RequestTimeline("E", 1, 0.0)
    assert (live.outcome, live.e2e, live.token_times) == ("live", None, [])


def test_latency_summary_hand_values():
    summary = latency_summary(example())
    assert summary["requests"] == {"finished": 2, "aborted": 1, "rejected": 1, "live": 0, "total": 4}
    everything = summary["all"]
    # TTFT over finished A (1.0) and B (0.5): linear percentiles between them.
    assert everything["ttft"] == pytest.approx(
        {"count": 2, "mean": 0.75, "p50": 0.75, "p95": 0.975, "p99": 0.995, "max": 1.0})
    # ITL pooled over finished requests: A's 0.2, 0.3, 0.5 (B has none; D is not finished).
    # p95: rank 0.95 * 2 = 1.9 -> 0.3 + 0.9 * (0.5 - 0.3) = 0.48; p99: rank 1.98 -> 0.3 + 0.98 * 0.2.
    assert everything["itl"] == pytest.approx(
        {"count": 3, "mean": 1.0 / 3, "p50": 0.3, "p95": 0.48, "p99": 0.496, "max": 0.5})
    assert everything["tpot"]["count"] == 1 and everything["tpot"]["mean"] == pytest.approx(1.0 / 3)
    assert everything["e2e"]["mean"] == pytest.approx(1.25) and everything["e2e"]["max"] == 2.0
    assert everything["queueing"] == pytest.approx(
        {"count": 2, "mean": 0.25, "p50": 0.25, "p95": 0.475, "p99": 0.495, "max": 0.5})
    # The decile is over admitted prompts (C, rejected, is left out): 100, 200, 1000: p90 rank
    # 0.9 * 2 = 1.8 -> 200 + 0.8 * 800 = 840; only B is long.
    assert summary["long_prompt_len"] == 840
    assert summary["long_prompts"]["ttft"]["count"] == 1 and summary["long_prompts"]["ttft"]["max"] == 0.5
    assert summary["arrived_during_long_prefill"]["e2e"]["mean"] == pytest.approx(0.5)
    assert latency_summary(example(), long_prompt_len=150)["long_prompts"]["ttft"]["count"] == 1


def test_rejected_prompts_do_not_set_the_long_prompt_decile():
    # Ten rejected prompts far over max_model_len would put the p90 above every admitted prompt (and
    # leave the long-prompt group empty) if they counted.
    rejected = [RequestTimeline(f"R{i}", 200_000, 0.1, None, [], 0.1, "rejected", None) for i in range(10)]
    summary = latency_summary(example() + rejected)
    assert summary["long_prompt_len"] == 840
    assert summary["long_prompts"]["ttft"]["count"] == 1


def test_stats_empty_and_threshold():
    assert stats([]) == {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    assert long_prompt_threshold([]) == 0
    assert long_prompt_threshold(range(1, 11)) == 10  # p90 of 1..10 = 9.1 -> 10


def percent(timelines, *args, **kwargs):
    return goodput(timelines, *args, **kwargs)["percent"]


def test_goodput_hand_values():
    timelines = example()
    # Denominator: A, B, D (C was rejected). A: TTFT 1.0 ok, max ITL 0.5 > 0.4 fails; B meets; D aborted.
    result = goodput(timelines, ttft_slo=1.0, itl_slo=0.4)
    assert result == {"percent": pytest.approx(100 / 3), "met": 1, "admitted": 3, "ttft_slo": 1.0,
                      "itl_slo": 0.4, "tpot_slo": None, "e2e_slo": None}
    assert percent(timelines, 1.0, 0.5) == pytest.approx(200 / 3)
    assert percent(timelines, ttft_slo=0.9, itl_slo=0.5) == pytest.approx(100 / 3)
    assert percent(timelines, ttft_slo=0.4) == 0.0
    assert percent(timelines, e2e_slo=1.0) == pytest.approx(100 / 3)
    assert percent(timelines, tpot_slo=0.3) == pytest.approx(100 / 3)  # A's TPOT 1/3 fails; B has none
    assert goodput([timelines[2]], ttft_slo=1.0) == {
        "percent": None, "met": 0, "admitted": 0, "ttft_slo": 1.0, "itl_slo": None, "tpot_slo": None,
        "e2e_slo": None}
    with pytest.raises(MetricsError, match="at least one SLO"):
        goodput(timelines)
    with pytest.raises(MetricsError, match="itl"):
        goodput(timelines, itl_slo=0)


def test_parse_slo():
    assert parse_slo("ttft=2,itl=100ms") == Slo(ttft=2.0, itl=0.1)
    assert parse_slo(" TTFT = 1.5s , tpot=25ms,e2e=1e1") == Slo(ttft=1.5, tpot=0.025, e2e=10.0)
    slo = parse_slo("ttft=1s,itl=400ms")
    assert percent(example(), *slo) == pytest.approx(100 / 3)


@pytest.mark.parametrize(
    ("text", "field"),
    [("", "empty"), ("ttft", "key=value"), ("latency=2", "latency"), ("ttft=fast", "ttft"),
     ("ttft=0ms", "ttft"), ("itl=5min", "itl"), ("ttft=1,ttft=2", "twice"), ("itl=-1", "itl")],
)
def test_parse_slo_errors(text, field):
    with pytest.raises(MetricsError, match=field):
        parse_slo(text)


def records() -> list[StepRecord]:
    x, y = RequestSpec("X", 4, 3, arrival_time=0.0), RequestSpec("Y", 2, 2, arrival_time=0.0)
    return [
        StepRecord(0, 0.0, 0.1, arrivals=[x, y],
                   scheduled=[ScheduledTokens("X", 0, 4, 0), ScheduledTokens("Y", 0, 2, 0)],
                   sampled_token_ids={"X": 5, "Y": 6}, num_free_blocks=6, num_running=2),
        StepRecord(1, 0.1, 0.1, scheduled=[ScheduledTokens("Y", 2, 0, 1)], preempted=["X"],
                   sampled_token_ids={"Y": 7}, finished={"Y": "length"}, num_free_blocks=10, num_running=0,
                   num_waiting=1),
        StepRecord(2, 0.5, 0.2, scheduled=[ScheduledTokens("X", 0, 5, 0)], sampled_token_ids={"X": 8},
                   num_free_blocks=8, num_running=1),
        StepRecord(3, 0.7, 0.1, scheduled=[ScheduledTokens("X", 5, 0, 1)], sampled_token_ids={"X": 9},
                   finished={"X": "length"}, num_free_blocks=10, num_running=0),
    ]


HAND_EFFICIENCY = {
    "num_steps": 4,
    "num_empty_steps": 0,
    # tokens per step 6, 1, 5, 1: mean 3.25, median 3, p99 rank 2.97 -> 5 + 0.97 * 1.
    "tokens_per_step_mean": 3.25,
    "tokens_per_step_p50": 3.0,
    "tokens_per_step_p99": 5.97,
    "prefill_tokens": 11,
    "decode_tokens": 2,
    "running_mean": 0.75,
    "running_max": 2,
    "preemptions": 1,
    "max_preemptions_per_request": 1,
    # used fractions 0.4, 0, 0.2, 0 weighted by 0.1, 0.1, 0.2, 0.1: (0.04 + 0.04) / 0.5 = 0.16.
    "kv_usage_mean": 0.16,
    "kv_usage_max": 0.4,
    "span_s": 0.8,
    # 5 sampled tokens; finished tokens X 4+3, Y 2+2 = 11; computed 13; 2 requests; over 0.8 s.
    "output_tokens_per_s": 6.25,
    "total_tokens_per_s": 13.75,
    "computed_tokens_per_s": 16.25,
    "requests_per_s": 2.5,
}


def test_efficiency_summary_hand_values():
    summary = efficiency_summary(records(), num_kv_blocks=10)
    assert tuple(summary) == EFFICIENCY_KEYS
    assert summary == pytest.approx(HAND_EFFICIENCY)


@attrs.frozen
class CountsOnlyStep:
    """Like the lab's LabStep: counts, no ids."""

    start_time: float
    duration: float
    prefill_tokens: int
    decode_tokens: int
    num_running: int
    num_free_blocks: int
    num_preempted: int
    num_finished: int


def test_efficiency_summary_from_counts_only_steps():
    steps = [CountsOnlyStep(r.start_time, r.duration, r.prefill_tokens, r.decode_tokens, r.num_running,
                            r.num_free_blocks, len(r.preempted), len(r.finished)) for r in records()]
    summary = efficiency_summary(steps, num_kv_blocks=10)
    unknown = {"output_tokens_per_s", "total_tokens_per_s", "max_preemptions_per_request"}
    assert all(summary[key] is None for key in unknown)
    assert {k: v for k, v in summary.items() if k not in unknown} == pytest.approx(
        {k: v for k, v in HAND_EFFICIENCY.items() if k not in unknown})
    timelines = [
        RequestTimeline("X", 4, 0.0, 0.0, [0.1, 0.7, 0.8], 0.8, "finished", "length", num_preemptions=1),
        RequestTimeline("Y", 2, 0.0, 0.0, [0.1, 0.2], 0.2, "finished", "length"),
    ]
    assert efficiency_summary(steps, 10, timelines) == pytest.approx(HAND_EFFICIENCY)


def test_efficiency_summary_empty_and_errors():
    empty = efficiency_summary([], num_kv_blocks=4)
    assert empty["num_steps"] == 0 and empty["kv_usage_mean"] is None and empty["output_tokens_per_s"] is None
    with pytest.raises(MetricsError, match="num_kv_blocks"):
        efficiency_summary(records(), num_kv_blocks=0)


def test_timelines_to_csv(tmp_path):
    path = tmp_path / "timelines.csv"
    assert timelines_to_csv(example(), path) == 4
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == CSV_COLUMNS
    a, c = rows[0], rows[2]
    assert (a["request_id"], a["num_output_tokens"], float(a["ttft"]), float(a["max_itl"])) == ("A", "4", 1.0, 0.5)
    assert (c["outcome"], c["ttft"], c["first_scheduled_time"]) == ("rejected", "", "")
    with pytest.raises(MetricsError, match="cannot write"):
        timelines_to_csv(example(), tmp_path / "missing" / "x.csv")


def test_prefix_hit_counter_hand_records():
    """Hit rate in tokens over first admissions; a re-admission after a preemption counted apart."""
    from schedspec.lab.metrics import PREFIX_HIT_KEYS, PrefixHitCounter, prefix_hit_summary

    def item(request_id: str, computed: int, prefill: int, decode: int = 0) -> ScheduledTokens:
        return ScheduledTokens(request_id, computed, prefill, decode)

    records = [
        # A (100 tokens) and B (60) arrive; A admitted with no hit; R (8) rejected
        StepRecord(0, 0.0, 0.1, arrivals=(RequestSpec("A", 100, 5), RequestSpec("B", 60, 5), RequestSpec("R", 8, 0)),
                   scheduled=(item("A", 0, 100),), sampled_token_ids={"A": 3}, rejected={"R": "no-output: x"}),
        # B admitted with a 48-token hit (computes 12); A decodes
        StepRecord(1, 0.1, 0.1, scheduled=(item("A", 100, 0, 1), item("B", 48, 12)), prefix_hit_tokens={"B": 48},
                   sampled_token_ids={"A": 4, "B": 5}),
        # B preempted (1 output so far); C arrives, aborted before it is admitted
        StepRecord(2, 0.2, 0.1, arrivals=(RequestSpec("C", 30, 2),), scheduled=(item("A", 101, 0, 1),),
                   preempted=("B",), sampled_token_ids={"A": 6}),
        # B re-admitted: its query is 60 + 1 tokens, 48 hit; not in the rate
        StepRecord(3, 0.3, 0.1, aborts=("C",), scheduled=(item("B", 48, 13),), prefix_hit_tokens={"B": 48},
                   sampled_token_ids={"B": 7}),
    ]
    summary = prefix_hit_summary(records, True, 16)
    assert tuple(summary) == PREFIX_HIT_KEYS
    assert summary == {
        "enable_prefix_caching": True, "block_size": 16,
        "prefix_hit_rate": 48 / 160, "prefix_hit_tokens": 48, "prefix_query_tokens": 160, "prefix_admissions": 2,
        "prefix_hit_tokens_after_preemption": 48, "prefix_query_tokens_after_preemption": 61,
        "prefix_readmissions": 1,
    }
    assert PrefixHitCounter().summary(False, 16)["prefix_hit_rate"] is None  # no admissions: no rate
