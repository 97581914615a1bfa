"""Timing a tool as a whole process, the way a user runs it: interpreter start, imports, work, exit.

Shared by ``speed.py`` (its whole-process column) and ``scale.py``.
"""

from __future__ import annotations

import os
import resource
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ChildRun:
    seconds: float
    peak_mb: float
    error: str | None = None

    def __str__(self) -> str:
        return self.error or f"{self.seconds:.2f} s, {self.peak_mb:.0f} MB"


def run_child(argv: list[str], timeout: float = 900) -> ChildRun:
    """Wall time from start to exit and peak RSS (``wait4``: the child's own) of one command."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        seconds = time.perf_counter() - start
        proc.returncode = code = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        peak = usage.ru_maxrss / 1024
        if code == 0:
            return ChildRun(seconds, peak)
        if seconds >= timeout:
            return ChildRun(seconds, peak, f"timeout after {timeout:.0f} s")
        err.seek(0)
        last = (err.read().decode(errors="replace").strip().splitlines() or [""])[-1]
        return ChildRun(seconds, peak, f"exit {code}: {last[:120]}")


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall clock, CPU seconds used by the whole machine, CPU seconds used by this process and its children), or
    None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # everything but idle and iowait
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"),
            own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime)


def competition_note(start: tuple[float, float, float] | None) -> str:
    """Timings are only as good as the machine was quiet: how much CPU other processes took during the run."""
    end = cpu_snapshot()
    if start is None or end is None:
        return "note: could not read /proc/stat to check for competing processes"
    wall, others = end[0] - start[0], (end[1] - start[1]) - (end[2] - start[2])
    share = max(0.0, others) / (wall * (os.cpu_count() or 1))
    verdict = "quiet" if share < 0.05 else "BUSY: other processes competed; compare the ratios, not the seconds"
    return f"other processes used {max(0.0, others):.0f} CPU-s of {os.cpu_count()} cores x {wall:.0f} s " \
           f"({share:.0%}): {verdict}"
