"""The worker half of the engines' process pipe (``engines/worker_pipe.py``), driven over a real pipe by a
worker script that serves toy schedulers: errors of commands that send no reply go to the next reply of
the same scheduler only, and ``refused`` is answered only by commands that reply."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import schedspec.engines

WORKER = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("worker_pipe", sys.argv[1])
    pipe = importlib.util.module_from_spec(spec); spec.loader.exec_module(pipe)

    class Refused(Exception):
        pass

    class Toy:
        def __init__(self):
            self.added = []
        def add(self, message):
            if message["id"] == "bad":
                raise ValueError("cannot add bad")
            if message["id"] == "refuse":
                raise Refused("refused in add")
            self.added.append(message["id"])
        def schedule(self, message):
            if message.get("refuse"):
                raise Refused("refused in schedule")
            return {"added": self.added}

    def build(message):
        if message.get("refuse"):
            raise Refused("config refused")
        return Toy(), {"built": message["handle"]}

    pipe.serve(build, ("add", "schedule"), Refused, no_reply=("add",))
""")


def _talk(tmp_path: Path, messages: list[dict]) -> list[dict]:
    script = tmp_path / "toy_worker.py"
    script.write_text(WORKER)
    pipe = Path(schedspec.engines.__file__).parent / "worker_pipe.py"
    done = subprocess.run([sys.executable, str(script), str(pipe)], input="".join(json.dumps(m) + "\n" for m in messages),
                          capture_output=True, text=True, timeout=60, check=True)
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_a_silent_failure_is_reported_to_its_own_scheduler_only(tmp_path):
    replies = _talk(tmp_path, [
        {"op": "init", "handle": 1}, {"op": "init", "handle": 2},
        {"op": "add", "handle": 1, "id": "bad"},          # fails, sends no reply
        {"op": "add", "handle": 2, "id": "r2"},
        {"op": "schedule", "handle": 2},                  # scheduler 2 is not answered with 1's error
        {"op": "schedule", "handle": 1},                  # scheduler 1 is
        {"op": "schedule", "handle": 1},                  # once
    ])
    assert replies[:2] == [{"built": 1}, {"built": 2}]
    assert replies[2] == {"added": ["r2"]}
    assert "error" in replies[3] and "add 'bad' failed" in replies[3]["error"] and "cannot add bad" in replies[3]["error"]
    assert replies[4] == {"added": []}
    assert len(replies) == 5


def test_refused_is_a_reply_only_for_commands_that_reply(tmp_path):
    replies = _talk(tmp_path, [
        {"op": "init", "handle": 1, "refuse": True},      # replies {"refused": ...}
        {"op": "init", "handle": 2},
        {"op": "add", "handle": 2, "id": "refuse"},       # refused inside a silent command: no reply now
        {"op": "schedule", "handle": 2},                  # the pending error instead
        {"op": "schedule", "handle": 2, "refuse": True},  # refused outside init: an error, not a refusal
    ])
    assert replies[0] == {"refused": "config refused"}
    assert replies[1] == {"built": 2}
    assert "error" in replies[2] and "refused in add" in replies[2]["error"]
    assert "error" in replies[3] and "refused in schedule" in replies[3]["error"]
    assert len(replies) == 4
