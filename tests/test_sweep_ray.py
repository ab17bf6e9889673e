"""``schedspec lab --sweep ... --ray ADDRESS``: the sweep's runs as Ray tasks give the same run
records as local runs. The test starts its own local Ray instance (one CPU) and shuts it down."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile

import pytest
from click.testing import CliRunner

from schedspec.cli import cli

SWEEP = ("lab", "--max-requests", "25", "--sweep", "max_num_seqs=2,8", "--sweep", "max_num_batched_tokens=512,2048",
         "--json")


def figures_without_wall_time(output: str) -> list[dict]:
    records = json.loads(output)
    for record in records:
        record["figures"].pop("wall_time_s")
    return records


def test_ray_sweep_equals_local_runs():
    ray = pytest.importorskip("ray", reason="ray is not installed (the ray extra; scripts/test.sh installs it)")
    local = CliRunner().invoke(cli, [*SWEEP, "--jobs", "1"], catch_exceptions=False)
    assert local.exit_code == 0, local.output
    # A short temporary folder of its own: Ray's socket paths must fit in 107 bytes (AF_UNIX).
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=1, include_dashboard=False, _temp_dir=temp, log_to_driver=False, logging_level="ERROR")
    try:
        address = ray.get_runtime_context().gcs_address
        remote = CliRunner().invoke(cli, [*SWEEP, "--ray", address], catch_exceptions=False)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    assert remote.exit_code == 0, remote.output
    expected = figures_without_wall_time(local.stdout)
    assert len(expected) == 4 and expected[0]["figures"]["requests_finished"] > 0
    assert figures_without_wall_time(remote.stdout) == expected


def test_ray_without_the_extra_exits_3_with_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    result = CliRunner().invoke(cli, [*SWEEP, "--ray", "127.0.0.1:6379"])
    assert result.exit_code == 3, result.output
    assert "--ray 127.0.0.1:6379: needs the ray extra" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("args", "needle"), [
    (("lab", "--max-requests", "5", "--ray", "auto"), "--ray: only with --sweep"),
    ((*SWEEP, "--ray", "auto", "--jobs", "2"), "--ray and --jobs"),
])
def test_ray_option_misuse_exits_2(args, needle):
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 2 and needle in result.output, result.output
