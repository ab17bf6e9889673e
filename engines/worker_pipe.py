"""The worker half of the process pipe that every engine worker speaks (``vllm_worker.py``,
``sglang_worker.py``): JSON Lines over stdin/stdout, one command per line in, one reply per line out
for the commands that reply. Standard library only: it runs in the engines' own environments, which do
not pin schedspec's dependencies, and is imported by the worker scripts by file name (their folder is
``sys.path[0]`` when they run as scripts).

Protocol (the adapter side is ``schedspec.engines.vllm._WorkerProcess``):

- Every command but ``init`` names the scheduler it is for with ``handle`` (an integer the client chose
  at ``init``), so one process serves many schedulers.
- ``init`` builds one (the worker's ``build`` callable); its reply is what ``build`` returns beside the
  scheduler (the engine's version, where it was imported from).
- ``close`` drops one; no reply. The commands in ``no_reply`` (``add``, ``abort``) do not reply either.
- Any other command ``op`` in ``ops`` calls the scheduler's method of that name with the message.
- A command that fails sends ``{"error": traceback}`` as its reply; a failing command that does not
  reply makes the next reply **for the same handle** an error instead (another scheduler's command is
  never answered with it). ``refused`` (an exception type) raised by ``build`` (``init``) replies
  ``{"refused": message}``: the engine's own config refused the configuration; raised by any other
  command it is an error like any other failure (``refused`` may be as broad as ``ValueError``).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any


def serve(
    build: Callable[[dict], tuple[Any, dict]],
    ops: tuple[str, ...],
    refused: type[Exception],
    no_reply: tuple[str, ...] = ("add", "abort"),
) -> None:
    """Serve commands from stdin until it closes (module docstring). Anything the engine prints goes to
    stderr, never into the protocol."""
    out = sys.stdout
    sys.stdout = sys.stderr
    workers: dict[int, Any] = {}
    pending_errors: dict[Any, str] = {}
    """handle -> the first failure of a command of that handle that sends no reply, for its next reply."""
    silent = (*no_reply, "close")

    def reply(payload: dict) -> None:
        out.write(json.dumps(payload, separators=(",", ":")) + "\n")
        out.flush()

    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        op = message.get("op")
        replies = op not in silent
        handle = message.get("handle")
        if replies and handle in pending_errors:
            reply({"error": pending_errors.pop(handle)})
            continue
        try:
            if op == "init":
                workers[handle], result = build(message)
            elif op == "close":
                workers.pop(handle, None)
                result = None
            elif handle not in workers:
                raise RuntimeError(f"{op!r} for scheduler {handle!r}, which was never built")
            elif op in ops:
                result = getattr(workers[handle], op)(message)
            else:
                raise RuntimeError(f"unknown op {op!r}")
        except Exception as error:  # noqa: BLE001  (every failure goes back to the adapter as text)
            if replies:
                refusal = op == "init" and isinstance(error, refused)  # the engine's config refused, nothing else
                reply({"refused": str(error)} if refusal else {"error": traceback.format_exc()})
            elif handle not in pending_errors:
                pending_errors[handle] = f"{op} {message.get('id')!r} failed: {traceback.format_exc()}"
            continue
        if replies:
            reply(result or {})
