"""One machine: long-lived worker processes, one model at a time each, under a watchdog.

The workers are forked from a server process that imported the optimizer once (multiprocessing's forkserver), so a
worker costs no imports, and one that is replaced costs a fork. Each worker caps its own memory (``--max-memory``,
see ``limits.cap_memory``); the parent kills a worker whose model passes ``--timeout`` and starts another. A worker
that dies loses only the model it held: every other result has already been handed back. Models go largest first,
and a model starts only when the memory expected of it fits beside the running ones."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import time
from multiprocessing.connection import Connection, wait
from typing import Callable, Iterator

from lnfuse.zoo.job import BAD, INTERNAL, Job, run
from lnfuse.zoo.limits import available_memory, cap_memory, death

#: a worker whose memory has grown past this share of --max-memory retires after its model, so that what
#: one model left behind (fragmentation, caches) cannot make the next one fail
_RETIRE = 0.7


class _Worker:
    def __init__(self, context: multiprocessing.context.BaseContext, max_memory: int | None):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, max_memory), daemon=True)
        self.process.start()
        child.close()
        self.job: Job | None = None
        self.started = 0.0
        self.content: dict = {}  # the model's hash and size, sent before it is fused

    def stop(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


def serve(conn: Connection, max_memory: int | None) -> None:
    """A worker's life: fuse the models it is sent, one at a time, and send back each row."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the workers
    _die_with_parent()
    cap_memory(max_memory)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            row = run(job, lambda content: conn.send(("hashed", content)))
            retire = row["status"] == "over memory" or (max_memory and _data_size() > _RETIRE * max_memory)
            conn.send(("row", row, bool(retire)))
        except OSError:  # the run is gone (interrupted, killed): nobody to answer
            return
        if retire:
            return


def run_local(jobs: list[Job], workers: int, timeout: float | None, max_memory: int | None,
              started: Callable[[Job], None], finished: Callable[[dict], None]) -> None:
    """Run every job; ``finished`` gets each row as it comes (in the parent, in finishing order)."""
    context = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                          else "spawn")
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload(["lnfuse.api", "lnfuse.zoo.job"])
    pending = sorted(jobs, key=lambda j: -j.estimate)  # largest first: the long ones do not end the run alone
    budget = int(available_memory() * 0.9)
    idle: list[_Worker] = []
    busy: list[_Worker] = []
    try:
        while pending or busy:
            with _interrupts_deferred():  # a Ctrl-C here would leave a worker the cleanup below does not know
                while pending and len(busy) < workers:
                    job = _admit(pending, budget - sum(w.job.estimate for w in busy), not busy)
                    if job is None:
                        break
                    busy.append(_dispatch(idle.pop() if idle else _Worker(context, max_memory), job, context,
                                          max_memory))
                    started(job)
            _wait(busy, timeout)
            for worker in list(busy):
                row, keep = _collect(worker, timeout, max_memory)
                if row is None:
                    continue
                busy.remove(worker)
                worker.job = None
                if keep:
                    idle.append(worker)
                else:
                    worker.stop()
                finished(row)
    finally:
        for worker in idle + busy:
            if worker.job is None:
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
            worker.stop()


def _dispatch(worker: _Worker, job: Job, context: multiprocessing.context.BaseContext,
              max_memory: int | None) -> _Worker:
    """Hand ``job`` to ``worker``, or to a new worker if that one died while idle."""
    worker.job, worker.started, worker.content = job, time.monotonic(), {}
    try:
        worker.conn.send(job)
        return worker
    except OSError:
        worker.stop()
        return _dispatch(_Worker(context, max_memory), job, context, max_memory)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ctrl-C (SIGINT) held back while workers are started and handed jobs; delivered, as KeyboardInterrupt, when
    the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _admit(pending: list[Job], free: int, alone: bool) -> Job | None:
    """The largest model that fits in the memory left; the largest of all when nothing else runs."""
    for i, job in enumerate(pending):
        if job.estimate <= free or alone:
            return pending.pop(i)
    return None


def _wait(busy: list[_Worker], timeout: float | None) -> None:
    """Until a worker answers or dies, or the first deadline passes."""
    waits = [w.conn for w in busy] + [w.process.sentinel for w in busy]
    deadline = None
    if timeout is not None and busy:
        deadline = max(0.0, min(w.started for w in busy) + timeout - time.monotonic())
    wait(waits, timeout=deadline)


def _collect(worker: _Worker, timeout: float | None, max_memory: int | None) -> tuple[dict | None, bool]:
    """The worker's row if it has finished (and whether it can take another model), or a row saying why its model
    ended without one; (None, True) while it is still working within its time."""
    job = worker.job
    try:
        while worker.conn.poll():
            message = worker.conn.recv()
            if message[0] == "row":
                return message[1], not message[2]
            worker.content = message[1]
    except (EOFError, OSError):
        pass  # it died: said below
    if worker.process.is_alive():
        if timeout is None or time.monotonic() - worker.started < timeout:
            return None, True
        worker.stop()
        return job.row(status="timeout", exit=BAD, seconds=round(timeout, 3), **worker.content,
                       reason=f"still running after --timeout {timeout:g} s; stopped"), False
    worker.process.join()
    status, reason = death(worker.process.exitcode, max_memory)
    return job.row(status=status, exit=BAD if status == "over memory" else INTERNAL, reason=reason,
                   seconds=round(time.monotonic() - worker.started, 3), **worker.content), False


def _data_size() -> int:
    """What RLIMIT_DATA counts so far (VmData), or 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _die_with_parent() -> None:
    """Linux: the worker is killed when the process that forked it ends (the forkserver, which ends with the run),
    so that a run killed with SIGKILL leaves no worker fusing on."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
