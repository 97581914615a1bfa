"""Per-model limits: the memory a model may take, how much it is expected to take, and what a worker's death
means."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

#: a worker's own memory with lnfuse, onnx_ir, ONNX Runtime and numpy imported and a small model fused
WORKER_BASE = 450 << 20


def estimate(path: Path, max_memory: int | None) -> int:
    """Memory a model is expected to need, from its size alone (the run never parses a model outside a worker):
    the worker, plus the model file twice (parsed structure, written copy), plus a tenth of the data files beside
    it named after it (external weights stay on disk; only the norms' weights are read), counted by the disk they
    take (a sparse file's holes hold nothing to read). Capped by --max-memory, which the worker cannot pass anyway."""
    try:
        size = path.stat().st_size
        data = sum(min(st.st_size, st.st_blocks * 512) for p in path.parent.glob(path.stem + "*")
                   if p != path and p.is_file() and p.suffix != ".onnx" and (st := p.stat()))
    except OSError:
        size = data = 0
    need = WORKER_BASE + 2 * size + data // 10
    return min(need, max_memory) if max_memory else need


def available_memory() -> int:
    """What the machine can give now (MemAvailable), or a guess where /proc is not there."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def cap_memory(max_memory: int | None) -> None:
    """In a worker: the memory it allocates may not pass ``max_memory`` (an allocation past it fails, in Python as a
    MemoryError, in ONNX Runtime as an error), so one model cannot take the machine's memory from the others.

    The limit is RLIMIT_DATA (heap and private writable mappings; Linux counts mmap'd allocations in it since 4.7),
    not RLIMIT_AS: lnfuse maps the model file and reads external weights through read-only file mappings, which
    take address space but no memory of their own (the page cache can drop them), and under RLIMIT_AS a 3 GB
    external-data model could not be opened under a 2 GB limit although it needs a few hundred MB."""
    if max_memory:
        kind = getattr(resource, "RLIMIT_DATA", resource.RLIMIT_AS)
        _, hard = resource.getrlimit(kind)
        limit = max_memory if hard == resource.RLIM_INFINITY else min(max_memory, hard)
        resource.setrlimit(kind, (limit, hard))


def death(exitcode: int | None, max_memory: int | None) -> tuple[str, str]:
    """Status and reason for a worker that died without answering (not killed by the watchdog)."""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else str(-exitcode)
        if max_memory and -exitcode in (signal.SIGABRT, signal.SIGSEGV, signal.SIGKILL, signal.SIGBUS):
            return "over memory", (f"its worker died ({name}) under --max-memory {size_text(max_memory)}: most "
                                   "likely out of memory")
        if -exitcode == signal.SIGKILL:
            return "worker died", "its worker was killed (SIGKILL; the kernel's OOM killer?); rerun to retry it"
        return "worker died", f"its worker died ({name}); rerun to retry it, and report the model if it recurs"
    return "worker died", f"its worker exited ({exitcode}) without an answer; rerun to retry it"


def size_text(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(size) < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"
