"""What one step of the ``sglang`` adapter costs (engines/sglang.py): SGLang 0.5.23's own
``get_next_batch_to_run`` and result processing in the worker, the pipe round trips and the engine view,
without the spec's checks.

Drives the adapter directly for ``--steps`` steps with ``--running`` requests decoding (prompt 16,
outputs long enough to outlast the run, a pool that holds them all), feeding token 1 to every request
that samples. Prints, per step: the wall time seen by the caller, the caller's thread CPU time, and
the worker's CPU time (read from ``/proc/<pid>/stat``, Linux only), median and mean, beside the cost of
starting the worker (importing sglang). Run conditions go beside every figure (the machine's load).

    .venv/bin/python benchmarks/sglang_step_cost.py [--running 32] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from schedspec.engines.sglang import SglangScheduler
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.workload import RequestSpec


def _worker_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=32, help="requests decoding at once")
    parser.add_argument("--steps", type=int, default=200, help="steps timed")
    args = parser.parse_args()
    block_size, outputs = 16, args.steps + 50
    blocks = args.running * (-(-(16 + outputs) // block_size) + 2) + 8
    config = SchedulerConfig(block_size, blocks, max(512, args.running), args.running, 4096)
    started = time.perf_counter()
    adapter = SglangScheduler(config)
    print(f"worker start and init: {time.perf_counter() - started:.1f} s wall (load {os.getloadavg()[0]:.1f})")
    requests = {}
    for index in range(args.running):
        request = RequestSpec(f"r{index}", 16, outputs, 0).to_request(0)
        requests[request.request_id] = request
        adapter.add_request(request)
    pid = adapter.worker.process.pid
    walls, cpus, workers = [], [], []
    for step in range(args.steps + 5):
        wall, cpu, worker = time.perf_counter(), time.thread_time(), _worker_cpu(pid)
        plan = adapter.schedule()
        sampled = {item.request_id: 1 for item in plan.scheduled}
        adapter.update(plan, sampled)
        adapter.engine_view()
        if step >= 5 and all(i.num_tokens == 1 for i in plan.scheduled):  # decode steps only
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
            workers.append(_worker_cpu(pid) - worker)
    load = os.getloadavg()[0]
    for name, values in (("wall", walls), ("caller CPU", cpus)):
        print(f"{name:>10}: median {statistics.median(values) * 1e3:7.2f} ms, mean {statistics.mean(values) * 1e3:7.2f} ms "
              f"per decode step of {args.running} requests ({len(values)} steps, load {load:.1f})")
    # /proc counts CPU in clock ticks (10 ms): only the total over the steps is meaningful
    print(f"worker CPU: mean {sum(workers) / len(workers) * 1e3:7.2f} ms per decode step (total over {len(workers)} "
          f"steps, clock-tick resolution)")


if __name__ == "__main__":
    main()
