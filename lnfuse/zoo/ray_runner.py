"""Past one machine: the same per-model job as Ray tasks, on a running cluster or a new local instance. Ray
schedules; lnfuse only submits, collects and writes the ledger.

Each task supervises its model exactly as a local run does (``local.run_local`` with one worker: a process
forked from a server that imported the optimizer once per Ray worker, under the same --max-memory and --timeout),
so a model that crashes or hangs ends its own child, never the Ray worker. Each task asks Ray for one CPU and the
memory expected of its model, so Ray places no more big models on a node than it has memory for. Inputs and
outputs must be on storage every node sees (the paths are the same on every node)."""

from __future__ import annotations

import os
from typing import Callable

from lnfuse.errors import UsageError
from lnfuse.zoo.job import INTERNAL, Job
from lnfuse.zoo.local import run_local


def run_ray(jobs: list[Job], address: str, cpus: int | None, timeout: float | None, max_memory: int | None,
            started: Callable[[Job], None], finished: Callable[[dict], None]) -> None:
    """Run every job as a Ray task; ``finished`` gets each row as it comes back, on the driver."""
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'lnfuse[ray]'") from None
    if address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    else:
        ray.init(num_cpus=cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    try:
        task = ray.remote(num_cpus=1, max_retries=3)(supervise)  # retried only when a node or worker is lost
        # a window of tasks in flight: the largest models go first, and "running" on the bar means something
        window = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
        waiting = sorted(jobs, key=lambda j: -j.estimate)
        flying: dict = {}
        while waiting or flying:
            while waiting and len(flying) < window:
                job = waiting.pop(0)
                flying[task.options(memory=max(job.estimate, 1)).remote(job, timeout, max_memory)] = job
                started(job)
            ready, _ = ray.wait(list(flying), num_returns=1)
            for ref in ready:
                job = flying.pop(ref)
                try:
                    row = ray.get(ref)
                except ray.exceptions.RayError as error:  # lost past Ray's retries: the model's row says so
                    text = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
                    row = job.row(status="worker died", exit=INTERNAL, reason=f"its Ray task failed ({text}); "
                                  "rerun to retry it")
                finished(row)
    finally:
        ray.shutdown()


def supervise(job: Job, timeout: float | None, max_memory: int | None) -> dict:
    """A Ray task: one model in a child process under its limits; its row."""
    rows: list[dict] = []
    run_local([job], 1, timeout, max_memory, lambda _: None, rows.append)
    return rows[0]
