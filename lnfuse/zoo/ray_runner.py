"""Past one machine: the same per-model job on a pool of long-lived Ray actors, on a running cluster or a new local
instance. Ray places the actors; lnfuse only feeds them, collects the rows and writes the ledger.

Why actors: a Ray task that fused a model itself would pay lnfuse's imports (onnx_ir, ONNX Runtime, numpy: about
0.5 s) wherever Ray started a fresh worker, and a task that supervises a child process per model (to survive a
crash or a hang) pays a fresh child's warm-up for every model. An actor is a process that stays: each one holds a
``local.Slot`` (a worker process forked from a server that imported the optimizer once, kept from model to model
under the same --timeout and --max-memory as a local run), so a model that crashes or hangs ends its worker,
never the actor, and the actor's next model starts warm.

Memory: Ray reserves an actor's resources for its life, not per call. Models are fed largest first, so an actor
created with the memory estimate of its first model has enough for every later one; an idle actor whose
reservation is more than twice the next model's estimate is replaced by one sized for it (so a node is not held
by the reservation of a model long finished), which costs a new actor's imports a few times in a run, not once a
model. When no model is left to start, idle actors end and free their reservations.

An actor that dies (its node lost, killed by Ray's memory monitor) fails no model by itself: its model goes to
another actor, three times at most, then its row says ``worker died``; a new actor takes the dead one's place.
Inputs and outputs must be on storage every node sees (the paths are the same on every node)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from lnfuse.errors import UsageError, first_line
from lnfuse.zoo.job import INTERNAL, Job
from lnfuse.zoo.local import Slot, worker_context

#: an actor lost this many times under one model (a node lost, Ray's memory monitor) ends that model's tries
_TRIES = 4
#: an idle actor reserving more than this many times the next model's estimate is replaced by a smaller one
_OVERSIZE = 2


class Runner:
    """A Ray actor's state: one ``Slot``, started when the actor is (so the imports overlap the other actors')."""

    def __init__(self, timeout: float | None, max_memory: int | None) -> None:
        self.slot = Slot(worker_context(), timeout, max_memory)
        self.slot.warm()

    def run(self, job: Job) -> dict:
        return self.slot.run(job)


@dataclass
class _Actor:
    handle: Any
    memory: int  # the memory it reserved, in bytes


def run_ray(jobs: list[Job], address: str, cpus: int | None, timeout: float | None, max_memory: int | None,
            started: Callable[[Job], None], finished: Callable[[dict], None]) -> None:
    """Run every job on a pool of Ray actors, one per CPU of the cluster; ``finished`` gets each row as it comes
    back, on the driver."""
    try:
        import ray
    except ImportError:
        ray = None
    if getattr(ray, "init", None) is None:  # a folder named ray (Ray's own /tmp/ray) on the path is no Ray
        raise UsageError("--ray needs Ray: pip install 'ray>=2.9' (or, from a clone of lnfuse, pip install -e "
                         "'.[ray]')")
    if address:
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except Exception as error:  # noqa: BLE001 - Ray says "no cluster" in several exception types
            raise UsageError(f"--ray {address}: no Ray cluster answers there ({first_line(error)}); start one "
                             "(ray start --head) or give --ray without an address for a local one") from None
    else:
        ray.init(num_cpus=cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    try:
        _Pool(ray, int(ray.cluster_resources().get("CPU", 1)), timeout, max_memory).run(jobs, started, finished)
    finally:
        ray.shutdown()


class _Pool:
    def __init__(self, ray, size: int, timeout: float | None, max_memory: int | None) -> None:
        self.ray, self.size = ray, max(1, size)
        # num_cpus=1: one model at a time on one core, as a local worker; no restarts: the pool replaces it
        self.actor_class = ray.remote(num_cpus=1, max_restarts=0)(Runner)
        self.args = (timeout, max_memory)
        self.idle: list[_Actor] = []
        self.flying: dict = {}  # call -> (actor, job)
        self.tries: Counter[str] = Counter()
        # no reservation above the largest node's memory: such a model would wait for a node forever; capped, it
        # runs alone on the largest one (and fails there as `over memory` if it needs more)
        self.largest = max((int(n["Resources"].get("memory", 0)) for n in ray.nodes() if n.get("Alive")), default=0)

    def run(self, jobs: list[Job], started: Callable[[Job], None], finished: Callable[[dict], None]) -> None:
        waiting = sorted(jobs, key=lambda j: -j.estimate)
        try:
            while waiting or self.flying:
                while waiting and len(self.flying) < self.size:
                    job = waiting.pop(0)
                    actor = self._actor_for(job)
                    self.flying[actor.handle.run.remote(job)] = (actor, job)
                    if not self.tries[job.source]:
                        started(job)
                if not waiting:  # nothing left to start: idle actors give their reservations back
                    self._end(self.idle)
                    self.idle = []
                ready, _ = self.ray.wait(list(self.flying), num_returns=1)
                for ref in ready:
                    row = self._collect(ref, waiting)
                    if row is not None:
                        finished(row)
        finally:
            self._end(self.idle + [actor for actor, _ in self.flying.values()])

    def _actor_for(self, job: Job) -> _Actor:
        """An idle actor whose reservation fits ``job`` (at least its estimate, at most twice it), or a new one
        reserving its estimate in place of an idle one that does not fit."""
        need = max(min(job.estimate, self.largest or job.estimate), 1)
        for i, actor in enumerate(self.idle):
            if need <= actor.memory <= _OVERSIZE * need:
                return self.idle.pop(i)
        if self.idle:
            self._end([self.idle.pop(0)])
        return _Actor(self.actor_class.options(memory=need).remote(*self.args), need)

    def _collect(self, ref, waiting: list[Job]) -> dict | None:
        """The row a call returned, or None when its actor was lost and the model goes back to the front of the
        queue (largest first still: it was the largest left when it started)."""
        actor, job = self.flying.pop(ref)
        try:
            row = self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as error:
            # the call itself raised (the actor lives): a fault of the job, not of the cluster; no retry
            self.idle.append(actor)
            text = (str(error).strip().splitlines() or [type(error).__name__])[-1][:200]
            return job.row(status="internal error", exit=INTERNAL, reason=f"{text}; please report it with the model")
        except self.ray.exceptions.RayError as error:
            self._end([actor])
            self.tries[job.source] += 1
            if self.tries[job.source] < _TRIES:
                waiting.insert(0, job)
                return None
            text = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            return job.row(status="worker died", exit=INTERNAL, reason=f"its Ray actor was lost {_TRIES} times "
                           f"({text}); rerun to retry it")
        self.idle.append(actor)
        return row

    def _end(self, actors: list[_Actor]) -> None:
        for actor in actors:
            self.ray.kill(actor.handle)
