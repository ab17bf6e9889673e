"""Trace loaders, window selection and synthetic workloads (schedspec.lab.trace_formats, windows, synthetic)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from schedspec.lab import trace_formats as formats
from schedspec.lab.synthetic import parse_synthetic, synthetic
from schedspec.lab.trace_formats import (
    default_trace_path,
    detect_format,
    load_azure_csv,
    load_mooncake_jsonl,
    load_trace,
    trace_info,
)
from schedspec.lab.windows import select_window
from schedspec.lab.workload_checks import WorkloadError
from schedspec.spec.workload import RequestSpec, token_ids

HEADER = b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
TRACES = Path(formats.__file__).resolve().parent.parent / "schedspec" / "data" / "traces"


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def azure(tmp_path: Path, *rows: str, name: str = "AzureLLMInferenceTrace_conv.csv") -> Path:
    # CRLF line ends and no newline after the last row, as upstream.
    return write(tmp_path, name, HEADER + "\r\n".join(rows).encode())


def mooncake(tmp_path: Path, *objects: dict | str, name: str = "mooncake_test.jsonl") -> Path:
    lines = [o if isinstance(o, str) else json.dumps(o) for o in objects]
    return write(tmp_path, name, ("\n".join(lines) + "\n").encode())


# ---------------------------------------------------------------------------------------------- azure


def test_azure_crlf_without_final_newline(tmp_path):
    path = azure(tmp_path, "2023-11-16 18:15:46.6805900,374,44", "2023-11-16 18:15:50.9951690,396,109")
    requests = load_azure_csv(path)
    assert [r.request_id for r in requests] == ["conv-000000", "conv-000001"]
    assert [(r.prompt_len, r.max_tokens) for r in requests] == [(374, 44), (396, 109)]
    assert requests[0].arrival_time == 0.0
    # 50.9951690 - 46.6805900 = 4.3145790 s
    assert requests[1].arrival_time == pytest.approx(4.314579, abs=1e-9)
    assert all(r.arrival_step is None for r in requests)


def test_azure_seven_fractional_digits_are_exact(tmp_path):
    # The 7th digit is 100 ns; strptime's %f would reject these or drop it.
    path = azure(tmp_path, "2023-11-16 18:00:00.0000000,1,1", "2023-11-16 18:00:00.0000001,1,1",
                 "2023-11-16 18:00:01.9999999,1,1")
    times = [r.arrival_time for r in load_azure_csv(path)]
    assert times[1] == pytest.approx(1e-7, abs=1e-12)
    assert times[2] == pytest.approx(1.9999999, abs=1e-12)


def test_azure_crosses_midnight_and_sorts(tmp_path):
    path = azure(tmp_path, "2023-11-17 00:00:01.5000000,5,6", "2023-11-16 23:59:59.0000000,3,4")
    requests = load_azure_csv(path)
    assert [r.request_id for r in requests] == ["conv-000001", "conv-000000"]
    assert [r.arrival_time for r in requests] == [0.0, pytest.approx(2.5)]


def test_azure_id_prefix_and_lf_and_blank_lines(tmp_path):
    path = write(tmp_path, "x.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-01-01 00:00:00.0,2,3\n\n")
    assert [r.request_id for r in load_azure_csv(path, id_prefix="t")] == ["t-000000"]


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ("2023-11-16 18:15:46.6805900,-5,44", "ContextTokens"),
        ("2023-11-16 18:15:46.6805900,12.5,44", "ContextTokens"),
        ("2023-11-16 18:15:46.6805900,12,abc", "GeneratedTokens"),
        ("2023-11-16 18:15:46.6805900,12,100000000000000000000", "GeneratedTokens"),  # 10^20
        ("2023-11-16 18:15:46.6805900,12,", "GeneratedTokens"),
        ("2023-11-16T18:15,12,4", "TIMESTAMP"),
        ("2023-02-30 18:15:46.1,12,4", "TIMESTAMP"),
        ("2023-11-16 25:15:46.1,12,4", "TIMESTAMP"),
        ("2023-11-16 18:15:46.6805900,12", "expected 3 fields"),
    ],
)
def test_azure_bad_rows_name_file_line_and_field(tmp_path, row, field):
    path = azure(tmp_path, "2023-11-16 18:15:46.6805900,374,44", row)
    with pytest.raises(WorkloadError) as error:
        load_azure_csv(path)
    message = str(error.value)
    assert f"{path}:3:" in message and field in message
    assert "\n" not in message


def test_azure_bad_header_and_empty(tmp_path):
    with pytest.raises(WorkloadError, match="missing column 'GeneratedTokens'"):
        load_azure_csv(write(tmp_path, "a.csv", b"TIMESTAMP,ContextTokens\r\n2023-01-01 00:00:00,1"))
    with pytest.raises(WorkloadError, match="no requests"):
        load_azure_csv(write(tmp_path, "b.csv", HEADER))
    with pytest.raises(WorkloadError, match="empty file"):
        load_azure_csv(write(tmp_path, "c.csv", b""))


def test_missing_file(tmp_path):
    for loader in (load_azure_csv, load_mooncake_jsonl, load_trace, detect_format):
        with pytest.raises(WorkloadError, match="no such file") as error:
            loader(tmp_path / "nope.csv")
        assert "nope.csv" in str(error.value)


# ------------------------------------------------------------------------------------------- mooncake


def test_mooncake_timestamps_are_milliseconds(tmp_path):
    path = mooncake(
        tmp_path,
        {"timestamp": 3000, "input_length": 10, "output_length": 2, "hash_ids": [7]},
        {"timestamp": 1500, "input_length": 20, "output_length": 3, "hash_ids": [8]},
        {"timestamp": 1500, "input_length": 30, "output_length": 4, "hash_ids": [9]},
    )
    requests = load_mooncake_jsonl(path)
    assert [r.arrival_time for r in requests] == [0.0, 0.0, 1.5]
    # ties keep file order
    assert [r.request_id for r in requests] == ["mooncake-000001", "mooncake-000002", "mooncake-000000"]
    assert [(r.prompt_len, r.max_tokens) for r in requests] == [(20, 3), (30, 4), (10, 2)]


def test_mooncake_prefix_groups_hand_example(tmp_path):
    # A = blocks 1,2,3 (3 full blocks); B = 1,2,3 full + a partial 4th; C = 1 then 9 (2 full blocks).
    # Trie of full blocks: 1 (3 requests) -> 2 (2) -> 3 (2); 1 -> 9 (1). The heavy path 1-2-3 holds A, B;
    # C is alone on path 1-9 and gets no group (its shared first block is lost, never overstated).
    path = mooncake(
        tmp_path,
        {"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 10, "input_length": 2000, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 20, "input_length": 1024, "output_length": 1, "hash_ids": [1, 9]},
    )
    a, b, c = load_mooncake_jsonl(path, id_prefix="x")
    assert a.prefix_group == b.prefix_group is not None
    assert (a.prefix_len, b.prefix_len) == (1536, 1536)
    assert (c.prefix_group, c.prefix_len) == (None, 0)
    assert a.prompt_token_ids()[:1536] == b.prompt_token_ids()[:1536]
    # the prompt ids follow hash_ids, not the groups: C shares A's first block, and only that one
    assert a.prompt_token_ids()[:512] == c.prompt_token_ids()[:512]
    assert a.prompt_token_ids()[512:1024] != c.prompt_token_ids()[512:1024]
    assert b.prompt_token_ids()[1536:1600] != tuple(range(64))  # own ids beyond the prefix


def test_mooncake_prompts_share_exactly_the_common_hash_id_prefix(tmp_path):
    path = mooncake(
        tmp_path,
        {"timestamp": 0, "input_length": 1300, "output_length": 1, "hash_ids": [7, 8, 9]},
        {"timestamp": 5, "input_length": 1700, "output_length": 1, "hash_ids": [7, 8, 5, 6]},
        {"timestamp": 6, "input_length": 300, "output_length": 1},
    )
    a, b, c = load_mooncake_jsonl(path, id_prefix="m")
    assert (a.block_hash_ids, a.hash_block_tokens) == ((7, 8, 9), 512) and c.block_hash_ids is None
    pa, pb = a.prompt_token_ids(), b.prompt_token_ids()
    assert isinstance(pa, formats.MooncakePrompt) and len(pa) == 1300 and len(pb) == 1700
    ids_a, ids_b = pa.array(0, 1300), pb.array(0, 1300)
    same = ids_a == ids_b
    assert same[:1024].all()  # hash ids 7, 8: 1,024 tokens in common
    assert same[1024:].mean() < 0.01  # 9 vs 5: different ids (up to chance collisions in the vocabulary)
    # indexing, slices and array agree; ids never 0 (EOS) and below the vocabulary
    assert [pa[i] for i in (0, 511, 512, 1299, -1)] == [int(ids_a[i]) for i in (0, 511, 512, 1299, -1)]
    assert pa[1000:1010] == tuple(int(x) for x in ids_a[1000:1010]) and pa[::500] == (pa[0], pa[500], pa[1000])
    assert ids_a.min() >= 1 and ids_a.max() < 4096
    # a request without hash_ids has ids of its own
    assert (c.prompt_token_ids().array(0, 300) == ids_a[:300]).mean() < 0.01
    # the trace format carries it: an arrival record rebuilds the same prompt, and validates
    from schedspec.spec.trace import record_schema_errors

    arrival = json.loads(json.dumps(a.to_dict()))
    assert arrival["block_hash_ids"] == [7, 8, 9] and arrival["hash_block_tokens"] == 512
    assert RequestSpec.from_dict(arrival).prompt_token_ids() == pa
    assert (token_ids(RequestSpec.from_dict(arrival).to_request(0), 0, 1300) == ids_a).all()
    record = {"step": 0, "start_time": 0.0, "duration": 0.0, "arrivals": [arrival], "aborts": [], "scheduled": [],
              "blocks_allocated": {}, "blocks_freed": {}, "prefix_hit_tokens": {}, "preempted": [], "finished": {},
              "aborted": [], "rejected": {}, "sampled_token_ids": {}, "num_free_blocks": 0, "num_running": 0,
              "num_waiting": 1}
    assert record_schema_errors(record) is None
    assert "block_hash_ids" not in RequestSpec("plain", 4, 1).to_dict()
    record["arrivals"][0]["hash_block_tokens"] = 0
    assert "hash_block_tokens" in (record_schema_errors(record) or "")


def test_mooncake_shared_prompt_tokens_counts_chained_blocks(tmp_path):
    path = mooncake(
        tmp_path,
        {"timestamp": 0, "input_length": 1300, "output_length": 1, "hash_ids": [7, 8, 9]},
        {"timestamp": 5, "input_length": 1700, "output_length": 1, "hash_ids": [7, 8, 5, 6]},
        {"timestamp": 9, "input_length": 600, "output_length": 1, "hash_ids": [5, 8]},
    )
    requests = load_mooncake_jsonl(path, id_prefix="m")
    # 16-token blocks: b hits a's first 1,024 tokens; c's block "5" is at another position (another parent)
    assert formats.mooncake_shared_prompt_tokens(requests, 16) == (1024, 3600)
    assert formats.mooncake_shared_prompt_tokens(requests, 512) == (1024, 3600)


def test_mooncake_packaged_prefix_groups_never_overstate_sharing():
    path = TRACES / "mooncake_conversation_trace.jsonl"
    hashes = {}
    with path.open() as handle:
        for index, line in enumerate(handle):
            hashes[f"mooncake-{index:06d}"] = json.loads(line)["hash_ids"]
    groups: dict[str, list[RequestSpec]] = {}
    for request in load_mooncake_jsonl(path):
        assert request.prefix_len % 512 == 0 and request.prefix_len <= request.prompt_len
        if request.prefix_group is not None:
            groups.setdefault(request.prefix_group, []).append(request)
    assert groups and all(len(members) >= 2 for members in groups.values())
    for members in groups.values():
        longest = max(members, key=lambda r: r.prefix_len)
        for member in members:
            blocks = member.prefix_len // 512
            assert hashes[member.request_id][:blocks] == hashes[longest.request_id][:blocks]
    # Blocks each request shares, in its synthetic ids, with earlier members of its group: the figure
    # the docs quote (of 105,592 full-block prefix hits an infinite cache would see).
    kept, longest_so_far = 0, {}
    for request in load_mooncake_jsonl(path):
        if request.prefix_group is not None:
            blocks = request.prefix_len // 512
            kept += min(blocks, longest_so_far.get(request.prefix_group, 0))
            longest_so_far[request.prefix_group] = max(blocks, longest_so_far.get(request.prefix_group, 0))
    assert kept == 90_906


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"timestamp": 0, "input_length": 10}', "output_length"),
        ('{"timestamp": 0, "input_length": 12.5, "output_length": 1}', "input_length"),
        ('{"timestamp": 0, "input_length": -3, "output_length": 1}', "input_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": true}', "output_length"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1}', "timestamp"),
        ('{"timestamp": 1e999, "input_length": 10, "output_length": 1}', "timestamp"),
        ('{"timestamp": NaN, "input_length": 10, "output_length": 1}', "timestamp"),
        ('{"timestamp": 1' + "0" * 400 + ', "input_length": 10, "output_length": 1}', "timestamp"),
        ('{"timestamp": 0, "input_length": 100000000000000000000, "output_length": 1}', "input_length"),
        ('{"timestamp": "0", "input_length": 10, "output_length": 1}', "timestamp"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 10', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_mooncake_bad_lines_name_file_line_and_field(tmp_path, line, field):
    path = mooncake(tmp_path, {"timestamp": 0, "input_length": 10, "output_length": 1}, line)
    with pytest.raises(WorkloadError) as error:
        load_mooncake_jsonl(path)
    # a number out of range is refused by the strict JSON reader itself (spec.trace.strict_json_loads), which
    # names the line and what is out of range; the other bad lines name their field
    assert f"{path}:2:" in str(error.value) and (field in str(error.value) or "out of range" in str(error.value))


# ------------------------------------------------------------------------------- format and packaging


def test_detect_format_and_load_trace(tmp_path):
    csv_path = azure(tmp_path, "2023-11-16 18:15:46.6805900,374,44", name="trace.txt")
    jsonl_path = mooncake(tmp_path, {"timestamp": 0, "input_length": 1, "output_length": 1}, name="t.data")
    assert detect_format(csv_path) == "azure" and detect_format(jsonl_path) == "mooncake"
    assert load_trace(csv_path)[0].prompt_len == 374
    assert load_trace(jsonl_path, format="mooncake")[0].prompt_len == 1
    with pytest.raises(WorkloadError, match="format='parquet'"):
        load_trace(csv_path, format="parquet")
    with pytest.raises(WorkloadError, match="cannot detect"):
        detect_format(write(tmp_path, "junk.txt", b"hello,world\n"))
    with pytest.raises(WorkloadError, match="empty file"):
        detect_format(write(tmp_path, "empty.txt", b"\n\n"))


def test_packaged_traces_are_unmodified_copies_with_licenses():
    import hashlib

    assert default_trace_path().name == "AzureLLMInferenceTrace_conv.csv" and default_trace_path().is_file()
    for digest, (name, _, _) in formats._KNOWN_TRACES.items():
        assert hashlib.sha256((TRACES / name).read_bytes()).hexdigest() == digest
    assert (TRACES / "LICENSES" / "CC-BY-4.0_AzurePublicDataset_LICENSE.txt").is_file()
    assert (TRACES / "LICENSES" / "Apache-2.0_Mooncake_LICENSE-APACHE.txt").is_file()
    attribution = (TRACES / "ATTRIBUTION.md").read_text()
    assert formats.AZURE_ATTRIBUTION.split(",")[0] in attribution and "Mooncake FAST'25" in attribution


# Totals from schedspec/data/traces/README.md (computed there independently of this loader).
@pytest.mark.parametrize(
    ("name", "rows", "inputs", "outputs", "last_arrival"),
    [
        ("AzureLLMInferenceTrace_conv.csv", 19_366, 22_361_870, 4_088_665, 3501.7),
        ("AzureLLMInferenceTrace_code.csv", 8_819, 18_059_974, 245_896, 3435.9),
        ("mooncake_conversation_trace.jsonl", 12_031, 144_793_823, 4_122_048, 3537.0),
    ],
)
def test_packaged_trace_totals_match_readme(name, rows, inputs, outputs, last_arrival):
    requests = load_trace(TRACES / name)
    assert len(requests) == rows
    assert sum(r.prompt_len for r in requests) == inputs
    assert sum(r.max_tokens for r in requests) == outputs
    assert requests[0].arrival_time == 0.0
    assert requests[-1].arrival_time == pytest.approx(last_arrival, abs=0.05)
    times = [r.arrival_time for r in requests]
    assert times == sorted(times)
    assert len({r.request_id for r in requests}) == rows


def test_full_conv_trace_loads_whole():
    # Whole file read: every row becomes a request. (Load speed is a benchmark's question,
    # benchmarks/lab_full_trace.py, not a timed unit test.)
    requests = load_trace(default_trace_path())
    assert len(requests) == 19_366
    assert all(later.arrival_time >= earlier.arrival_time for earlier, later in zip(requests, requests[1:], strict=False))


def test_trace_info_attribution(tmp_path):
    info = trace_info(default_trace_path())
    assert "19,366 requests" in info.description and "CC BY 4.0" in info.attribution
    assert info.attribution in str(info) and info.format == "azure"
    own = trace_info(azure(tmp_path, "2023-11-16 18:15:46.6805900,374,44", name="mine.csv"))
    assert own.attribution == "" and own.num_requests == 1
    changed = trace_info(azure(tmp_path, "2023-11-16 18:15:46.6805900,374,44"))
    assert "Modified copy" in changed.attribution


# ------------------------------------------------------------------------------------------- windows


def specs(*times: float) -> list[RequestSpec]:
    return [RequestSpec(f"r{i}", 10, 5, arrival_time=t) for i, t in enumerate(times)]


def test_select_window_rebases_and_scales():
    requests = specs(0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
    window = select_window(requests, start=1.0, duration=3.0)
    assert [r.request_id for r in window] == ["r1", "r2", "r3"]  # [1, 4): 4.0 excluded
    assert [r.arrival_time for r in window] == [0.0, 1.0, 2.0]
    fast = select_window(requests, start=1.0, duration=3.0, time_scale=0.5)
    assert [r.arrival_time for r in fast] == [0.0, 0.5, 1.0]
    assert [r.request_id for r in select_window(requests, max_requests=2)] == ["r0", "r1"]
    slow = select_window(specs(10.0, 11.0, 13.0), time_scale=2.0)
    assert [r.arrival_time for r in slow] == [0.0, 2.0, 6.0]


def test_select_window_moves_abort_times():
    request = RequestSpec("a", 10, 5, arrival_time=10.0, abort_at_time=12.0)
    (moved,) = select_window([request], time_scale=0.5)
    assert (moved.arrival_time, moved.abort_at_time) == (0.0, 1.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"duration": 0}, "duration"),
        ({"duration": -1.0}, "duration"),
        ({"max_requests": 0}, "max_requests"),
        ({"max_requests": 1.5}, "max_requests"),
        ({"time_scale": 0}, "time_scale"),
        ({"time_scale": float("nan")}, "time_scale"),
        ({"start": float("inf")}, "start"),
        ({"start": 100.0}, "no requests"),
        ({"start": 0.5, "duration": 0.25}, "no requests"),
    ],
)
def test_select_window_errors(kwargs, field):
    with pytest.raises(WorkloadError, match=field):
        select_window(specs(0.0, 1.0), **kwargs)


def test_select_window_empty_workload():
    with pytest.raises(WorkloadError, match="no requests"):
        select_window([])


# ----------------------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_synthetic_rate_and_cv(cv):
    requests = synthetic(rate=4.0, cv=cv, prompt=100, output=10, num_requests=20_000, seed=7)
    gaps = np.diff([r.arrival_time for r in requests])
    assert requests[0].arrival_time == 0.0 and len(requests) == 20_000
    # Statistical tolerances: the standard error of the mean gap is cv/sqrt(n) (~2 % at cv=3) and
    # that of the sample CV a few percent even for cv=3 (gamma kurtosis); bounds are > 3 sigma.
    assert 1.0 / gaps.mean() == pytest.approx(4.0, rel=0.08)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.12)


def test_synthetic_constant_gaps_duration_and_determinism():
    steady = synthetic(rate=2.0, cv=0.0, prompt=5, output=5, num_requests=4)
    assert [r.arrival_time for r in steady] == [0.0, 0.5, 1.0, 1.5]
    timed = synthetic(rate=50.0, prompt=5, output=5, duration=100.0, seed=3)
    assert all(r.arrival_time < 100.0 for r in timed)
    assert len(timed) == pytest.approx(5000, rel=0.05)
    assert synthetic(3.0, prompt=5, output=5, num_requests=50, seed=1) == \
        synthetic(3.0, prompt=5, output=5, num_requests=50, seed=1)
    assert synthetic(3.0, prompt=5, output=5, num_requests=50, seed=1) != \
        synthetic(3.0, prompt=5, output=5, num_requests=50, seed=2)


def test_synthetic_length_distributions():
    requests = synthetic(1.0, prompt="uniform:10:20", output="geom:40", num_requests=20_000, seed=0)
    prompts = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.max_tokens for r in requests])
    assert prompts.min() == 10 and prompts.max() == 20
    assert outputs.min() >= 1 and outputs.mean() == pytest.approx(40, rel=0.05)
    normal = synthetic(1.0, prompt="normal:5:10", output=7, num_requests=2000, seed=0)
    assert min(r.prompt_len for r in normal) == 1 and {r.max_tokens for r in normal} == {7}


def test_parse_synthetic():
    spec = parse_synthetic("rate=5, cv=2,prompt=uniform:100:200,output=geom:50,n=1000,seed=4")
    assert (spec.rate, spec.cv, spec.num_requests, spec.seed) == (5.0, 2.0, 1000, 4)
    assert str(spec.prompt) == "uniform:100:200" and str(spec.output) == "geom:50"
    requests = spec.generate()
    assert len(requests) == 1000 and requests[0].request_id == "syn-000000"
    assert requests == synthetic(5, 2, "uniform:100:200", "geom:50", num_requests=1000, seed=4)
    timed = parse_synthetic("synthetic:rate=1,prompt=8,output=8,duration=30")
    assert (timed.cv, timed.duration, timed.seed) == (1.0, 30.0, 0)
    assert parse_synthetic(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("rate=5,prompt=8,output=8,n=10,color=red", "color"),
        ("prompt=8,output=8,n=10", "rate"),
        ("rate=5,output=8,n=10", "prompt"),
        ("rate=abc,prompt=8,output=8,n=10", "rate"),
        ("rate=0,prompt=8,output=8,n=10", "rate"),
        ("rate=5,cv=-1,prompt=8,output=8,n=10", "cv"),
        ("rate=5,prompt=8,output=8", "n"),
        ("rate=5,prompt=8,output=8,n=10,duration=5", "duration"),
        ("rate=5,prompt=8,output=8,n=1.5", "n"),
        ("rate=5,prompt=8,output=8,n=0", "n"),
        ("rate=5,prompt=8,output=8,duration=0", "duration"),
        ("rate=5,prompt=uniform:5:2,output=8,n=10", "prompt"),
        ("rate=5,prompt=8,output=zipf:2,n=10", "output"),
        ("rate=5,prompt=0,output=8,n=10", "prompt"),
        ("rate=5,prompt=8,output=8,n=10,seed=-1", "seed"),
        ("rate=5,rate=6,prompt=8,output=8,n=10", "rate"),
        ("rate=5,prompt,output=8,n=10", "prompt"),
    ],
)
def test_parse_synthetic_errors_name_the_key(text, field):
    with pytest.raises(WorkloadError, match=field):
        parse_synthetic(text)


def test_synthetic_errors():
    with pytest.raises(WorkloadError, match="rate"):
        synthetic(-1, prompt=1, output=1, num_requests=1)
    with pytest.raises(WorkloadError, match="exactly one"):
        synthetic(1, prompt=1, output=1)
    with pytest.raises(WorkloadError, match="seed"):
        synthetic(1, prompt=1, output=1, num_requests=1, seed=-2)
