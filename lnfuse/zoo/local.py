"""One machine: long-lived worker processes, one model at a time each, under a watchdog.

The workers are forked from a server process that imported the optimizer once (multiprocessing's forkserver), so a
worker costs no imports, and one that is replaced costs a fork. Each worker caps its own memory (``--max-memory``,
see ``limits.cap_memory``); the parent kills a worker whose model passes ``--timeout`` and starts another. A worker
that dies loses only the model it held: every other result has already been handed back. Models go largest first,
and a model starts only when the memory expected of it fits beside the running ones."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import signal
import time
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from typing import Callable, Iterator

from lnfuse import interrupts
from lnfuse import terminal
from lnfuse.zoo.job import BAD, INTERNAL, Job, identify, run
from lnfuse.zoo.ledger import LIMITED
from lnfuse.zoo.limits import available_memory, cap_memory, death

#: a worker whose memory has grown past this share of --max-memory retires after its model, so that what
#: one model left behind (fragmentation, caches) cannot make the next one fail
_RETIRE = 0.7
#: seconds a worker asked to stop (SIGTERM) has to clean up before it is killed
_GRACE = 5.0


class _Worker:
    def __init__(self, context: multiprocessing.context.BaseContext, max_memory: int | None):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, max_memory), daemon=True)
        self.process.start()
        child.close()

    def terminate(self) -> None:
        """Ask the worker to stop: SIGTERM ends its model as Ctrl-C would (its temporary files removed)."""
        with contextlib.suppress(OSError):
            self.process.terminate()

    def stop(self, grace: float = _GRACE) -> None:
        """The worker ended: asked first (a worker in the middle of saving removes its temporary folder), then
        killed if it has not ended within ``grace`` seconds (stuck in a library's C code)."""
        if self.process.is_alive():
            self.terminate()
            self.process.join(grace)
        self.process.kill()
        self.process.join()
        self.conn.close()


def serve(conn: Connection, max_memory: int | None) -> None:
    """A worker's life: fuse the models it is sent, one at a time, and send back each row (or, for a model whose
    worker was stopped, the identity of its files)."""
    # Ctrl-C and a closed terminal are the parent's to handle: it stops the workers with SIGTERM, which (like a
    # SIGTERM sent to the whole process group by ``timeout`` or CI) ends the model here as Ctrl-C would
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it (worker_context); a worker must not
    _die_with_parent()
    cap_memory(max_memory)
    # what the server imported is there for the worker's life: the cycle collector need not walk it at every full
    # collection (nor touch its pages, which stay shared with the server)
    gc.freeze()
    # the suppression outermost: a SIGTERM that lands while the handler is being put back is still suppressed,
    # and one after that ends the process by default, with no traceback. The handler goes before the library
    # messages' own clean-up: a SIGTERM raised inside a callback that clean-up sets off (logging's weakref to the
    # handler it removes) cannot be suppressed, and Python prints it as a traceback
    with contextlib.suppress(KeyboardInterrupt), \
            terminal.library_messages(), \
            interrupts.as_keyboard_interrupt((signal.SIGTERM,)):  # a library's warning may quote a model's names
        _serve(conn, max_memory)


def _serve(conn: Connection, max_memory: int | None) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        kind, job = message
        try:
            if kind == "identify":
                row = identify(job)
            else:
                row = run(job, lambda content: conn.send(("hashed", content)))
            retire = row.get("status") == "over memory" or (max_memory and _data_size() > _RETIRE * max_memory)
            conn.send(("row", row, bool(retire)))
        except OSError:  # the run is gone (interrupted, killed): nobody to answer
            return
        if retire:
            return


def worker_context() -> multiprocessing.context.BaseContext:
    """Workers forked from a server that imported the optimizer once (spawned where there is no forkserver)."""
    context = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                          else "spawn")
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload(["lnfuse.api", "lnfuse.zoo.job"])
        # started with SIGTERM/SIGHUP ignored (which it keeps): a signal to the whole process group must not end
        # the server, whose end kills every worker at once (``_die_with_parent``), in the middle of its save
        with interrupts.ignored():
            forkserver.ensure_running()
    return context


class Slot:
    """One model at a time in a long-lived worker process, under the watchdog. The worker is started once and kept
    for the next model; one that dies, is stopped or retires is replaced by the next. A model whose worker was
    stopped while it fused (``timeout``, ``over memory``) has its files' identity taken by the next worker before
    its row is final, so that a rerun under the same limits can tell whether the model changed."""

    def __init__(self, context: multiprocessing.context.BaseContext, timeout: float | None,
                 max_memory: int | None):
        self.context, self.timeout, self.max_memory = context, timeout, max_memory
        self.worker: _Worker | None = None
        self.job: Job | None = None
        self.held: dict | None = None  # the row of a stopped model, waiting for its identity
        self.started = 0.0
        self.content: dict = {}  # the model's identity as far as known, sent before it is fused

    def warm(self) -> None:
        """Start the worker now rather than with the first model."""
        if self.worker is None:
            self.worker = _Worker(self.context, self.max_memory)

    def start(self, job: Job) -> None:
        self.job, self.held, self.content = job, None, {}
        self._send(("run", job))

    def deadline(self) -> float | None:
        return None if self.timeout is None or self.job is None else self.started + self.timeout

    def waitables(self) -> list:
        return [self.worker.conn, self.worker.process.sentinel] if self.worker is not None else []

    def poll(self) -> dict | None:
        """The model's row once it is final; None while it runs within its time."""
        row, keep = self._collect()
        if row is None:
            return None
        if not keep:
            self._retire()
        if self.held is not None:  # the stopped model's identity (or nothing, if that failed too)
            row, self.held = {**self.held, **row}, None
        elif row["status"] in LIMITED and row.get("data_files") is None and not keep:
            self.held = row
            self._send(("identify", self.job))
            return None
        self.job = None
        return row

    def run(self, job: Job) -> dict:
        """``start``, then wait for the row (one model at a time, as a Ray actor runs them)."""
        self.start(job)
        while (row := self.poll()) is None:
            deadline = self.deadline()
            wait(self.waitables(), timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        return row

    def close(self) -> None:
        if self.worker is not None and self.job is None:
            try:
                self.worker.conn.send(None)
            except OSError:
                pass
        self._retire()

    def _send(self, message: tuple) -> None:
        """To the worker, or to a new one if it died while idle."""
        self.started = time.monotonic()
        self.warm()
        try:
            self.worker.conn.send(message)
        except OSError:
            self._retire()
            self.warm()
            self.worker.conn.send(message)

    def _retire(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

    def _collect(self) -> tuple[dict | None, bool]:
        """The worker's answer if it has one (and whether the worker can take another model), or a row saying why
        the model ended without one; (None, True) while it is still working within its time. A worker that fails
        while it takes a stopped model's identity answers nothing ({}): the model keeps the row it had."""
        job, worker = self.job, self.worker
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message[0] == "row":
                    return message[1], not message[2]
                self.content = message[1]
        except (EOFError, OSError):
            pass  # it died: said below
        if worker.process.is_alive():
            if self.timeout is None or time.monotonic() - self.started < self.timeout:
                return None, True
            if self.held is not None:
                return {}, False
            return job.row(status="timeout", exit=BAD, seconds=round(self.timeout, 3), **self.content,
                           reason=f"still running after --timeout {self.timeout:g} s; stopped"), False
        worker.process.join()
        if self.held is not None:
            return {}, False
        status, reason = death(worker.process.exitcode, self.max_memory)
        return job.row(status=status, exit=BAD if status == "over memory" else INTERNAL, reason=reason,
                       seconds=round(time.monotonic() - self.started, 3), **self.content), False


def run_local(jobs: list[Job], workers: int, timeout: float | None, max_memory: int | None,
              started: Callable[[Job], None], finished: Callable[[dict], None]) -> None:
    """Run every job; ``finished`` gets each row as it comes (in the parent, in finishing order)."""
    context = worker_context()
    pending = sorted(jobs, key=lambda j: -j.estimate)  # largest first: the long ones do not end the run alone
    budget = int(available_memory() * 0.9)
    idle: list[Slot] = []
    busy: list[Slot] = []
    def fill() -> list[Job]:
        begun = []
        with _interrupts_deferred():  # a Ctrl-C here would leave a worker the cleanup below does not know
            while pending and len(busy) < workers:
                job = _admit(pending, budget - sum(s.job.estimate for s in busy), not busy)
                if job is None:
                    break
                slot = idle.pop() if idle else Slot(context, timeout, max_memory)
                slot.start(job)
                busy.append(slot)
                begun.append(job)
        return begun

    try:
        begun = fill()
        while busy:
            for job in begun:
                started(job)
            _wait(busy)
            done, begun = [], []
            try:
                for slot in list(busy):
                    if (row := slot.poll()) is not None:
                        busy.remove(slot)
                        idle.append(slot)
                        done.append(row)
                begun = fill()  # the workers go on while the rows are written
            finally:  # a Ctrl-C meanwhile still keeps what finished
                for row in done:
                    finished(row)
    finally:
        for slot in busy:  # all asked at once, so that their grace runs side by side
            if slot.worker is not None:
                slot.worker.terminate()
        for slot in idle + busy:
            slot.close()


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ctrl-C (SIGINT), SIGTERM and SIGHUP held back while workers are started and handed jobs; delivered, as
    KeyboardInterrupt, when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *interrupts.TERMINATING})
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


def _wait(busy: list[Slot]) -> None:
    """Until a worker answers or dies, or the first deadline passes."""
    deadlines = [d for s in busy if (d := s.deadline()) is not None]
    wait([w for s in busy for w in s.waitables()],
         timeout=max(0.0, min(deadlines) - time.monotonic()) if deadlines else None)


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
