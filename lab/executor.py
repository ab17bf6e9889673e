"""One executor for the lab's runs: every job of a ``--sweep`` or a ``--capacity`` search runs through
:func:`execute`, in this process, in local worker processes, or as Ray tasks on an existing cluster.

A job is a typed, picklable run specification (:class:`schedspec.lab.sweep.SweepRun`,
:class:`schedspec.lab.capacity.CapacityRun`) with an ``index`` (its place in the plan) and a ``window``
(the requests it replays). Results come back in job order, never in completion order; each run depends
only on its job, so the results do not depend on the number of workers or on where they ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Protocol, TypeVar

import attrs


class Job(Protocol):
    """What :func:`execute` needs of a job (an attrs class)."""

    index: int
    window: Any


J = TypeVar("J", bound=Job)
R = TypeVar("R")


class RayUnavailable(Exception):
    """``--ray``: the cluster cannot be reached, or a task could not run on it (unusable input or
    environment: CLI exit 2; the message says which)."""


class RayNotInstalled(RayUnavailable):
    """``--ray``: the ``ray`` extra is not installed (a feature this installation lacks: CLI exit 3)."""


def execute(function: Callable[[J], R], jobs: Sequence[J], workers: int = 1,
            ray_address: str | None = None) -> list[R]:
    """``function(job)`` for every job, results in job order: with ``ray_address`` as Ray tasks
    (:func:`_execute_ray`), else ``workers`` processes at a time (1, or a single job: in this process).

    Raises:
        concurrent.futures.process.BrokenProcessPool: a worker process died (killed, out of memory).
        RayNotInstalled, RayUnavailable: with ``ray_address`` (:func:`_execute_ray`).
    """
    if ray_address is not None:
        return _execute_ray(function, jobs, ray_address)
    if workers <= 1 or len(jobs) <= 1:
        return [function(job) for job in jobs]
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        return list(pool.map(function, jobs))  # map keeps the job order


def _with_window(function: Callable[[J], R], job: J, window: Any) -> R:
    """``function`` on ``job`` with its window put back (a Ray object, shipped once per window)."""
    return function(attrs.evolve(job, window=window))


def _execute_ray(function: Callable[[J], R], jobs: Sequence[J], address: str) -> list[R]:
    """Every job as a Ray task (one CPU each, no retries) on the existing Ray cluster at ``address``
    (``ray.init(address=...)``: ``HOST:PORT`` of the head's GCS, ``ray://HOST:PORT`` for Ray Client, or
    ``auto``); results in job order, equal to the local ones whatever the cluster's size. Each distinct
    window is put in the object store once (``ray.put``), not once per task. The cluster's workers need
    schedspec installed (the same version). If this process is already connected to Ray (a test's local
    instance), that connection is used and left open.

    Raises:
        RayNotInstalled: ray is not installed.
        RayUnavailable: the cluster cannot be reached, or a task failed there.
    """
    try:
        import ray
    except ImportError as error:
        raise RayNotInstalled(f"needs the ray extra (pip install 'schedspec[ray]'): {error}") from None
    connected_here = False
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        except Exception as error:  # noqa: BLE001  (ray raises ConnectionError, ValueError, RuntimeError)
            raise RayUnavailable(f"cannot connect to the Ray cluster at {address!r}: "
                                 f"{type(error).__name__}: {error}") from None
        connected_here = True
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(_with_window)
        windows: dict[int, Any] = {}
        refs = []
        for job in jobs:
            if id(job.window) not in windows:
                windows[id(job.window)] = ray.put(job.window)
            refs.append(task.remote(function, attrs.evolve(job, window=None), windows[id(job.window)]))
        try:
            results = ray.get(refs)
        except ray.exceptions.RayError as error:  # a task could not run (e.g. schedspec missing there)
            raise RayUnavailable(f"a Ray task failed: {type(error).__name__}: "
                                 f"{str(error).strip().splitlines()[-1] if str(error).strip() else ''}") from None
    finally:
        if connected_here:
            ray.shutdown()
    return list(results)
