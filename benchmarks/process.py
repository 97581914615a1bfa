"""Timing a tool as a whole process, the way a user runs it: interpreter start, imports, work, exit.

Shared by ``speed.py`` (its whole-process column) and ``scale.py``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_ORT_CPP = ("import sys, onnxruntime as ort; ort.set_default_logger_severity(3); o = ort.SessionOptions(); "
            "o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED; "
            "o.optimized_model_filepath = sys.argv[2]; "
            "ort.InferenceSession(sys.argv[1], o, providers=['CPUExecutionProvider'])")
_ORT_TRANSFORMERS = ("import sys; from onnxruntime.transformers.optimizer import optimize_model; "
                     "optimize_model(sys.argv[1], model_type='bert', num_heads=0, hidden_size=0, opt_level=0)"
                     ".save_model_to_file(sys.argv[2])")
_ONNXSCRIPT = ("import sys, onnx; from onnxscript.rewriter import rewrite; "
               "from onnxscript.rewriter.rules.fusion._layer_norm import layer_normalization_rules as a; "
               "from onnxscript.rewriter.rules.fusion._rms_normalization import rms_normalization_rules as b; "
               "onnx.save(rewrite(onnx.load(sys.argv[1]), [*a, *b]), sys.argv[2])")

#: each tool as a command line: the same work as the in-process tools of speed.py, plus the interpreter's start
#: and the tool's imports
SNIPPETS = {
    "floor": "import sys, onnx; onnx.save(onnx.load(sys.argv[1]), sys.argv[2])",
    "onnx": "import sys, onnx; m = onnx.load(sys.argv[1]); onnx.checker.check_model(m); onnx.save(m, sys.argv[2])",
    "onnx_ir": "import sys, onnx_ir as ir; ir.save(ir.load(sys.argv[1]), sys.argv[2])",
    "ort-cpp": _ORT_CPP,
    "ort-transformers": _ORT_TRANSFORMERS,
    "onnxscript": _ONNXSCRIPT,
}


def compile_lnfuse() -> str:
    """Byte-compile lnfuse's modules, as pip does when it installs a package, so that lnfuse starts as installed:
    the other tools' packages were compiled at install. An editable install run where PYTHONDONTWRITEBYTECODE is
    set (this VM sets it) would otherwise compile lnfuse's forty modules from source at every start (about 0.06 s
    of CPU). Returns the line the benchmarks print about it."""
    done = subprocess.run([sys.executable, "-c", "import compileall, pathlib, lnfuse, lnfuse.rules; "
                           "ok = all(compileall.compile_dir(pathlib.Path(m.__file__).parent, quiet=1) "
                           "for m in (lnfuse, lnfuse.rules)); print(pathlib.Path(lnfuse.__file__).parent, ok)"],
                          capture_output=True, text=True)
    return f"lnfuse's bytecode compiled before the process runs, as pip does at install ({done.stdout.strip()})"


def command(tool: str, model: Path, out: Path) -> list[str]:
    """The command that runs ``tool`` on ``model`` and writes ``out``: lnfuse's own CLI, or a one-line script."""
    if tool in ("lnfuse", "lnfuse-noverify"):
        return [sys.executable, "-m", "lnfuse.cli", "-q", str(model), "-o", str(out),
                *(["--no-verify"] if tool == "lnfuse-noverify" else [])]
    return [sys.executable, "-c", SNIPPETS[tool], str(model), str(out)]


@dataclass(frozen=True)
class ChildRun:
    seconds: float
    peak_mb: float
    error: str | None = None

    def __str__(self) -> str:
        return self.error or f"{self.seconds:.2f} s, {self.peak_mb:.0f} MB"


def run_child(argv: list[str], timeout: float = 900) -> ChildRun:
    """Wall time from start to exit and peak RSS of one command.

    The command is started by a small launcher (this file run as a script), not by the caller: Linux counts the
    peak RSS of the process a child was forked from into the child's, and the caller may hold gigabytes."""
    done = subprocess.run([sys.executable, __file__, str(timeout), *argv], stdout=subprocess.PIPE, check=True)
    seconds, peak, error = json.loads(done.stdout)
    return ChildRun(seconds, peak, error)


def _measure(argv: list[str], timeout: float) -> tuple[float, float, str | None]:
    """(seconds, peak RSS in MB from wait4, error or None) of one command, started from this process."""
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
            return seconds, peak, None
        if seconds >= timeout:
            return seconds, peak, f"timeout after {timeout:.0f} s"
        err.seek(0)
        last = (err.read().decode(errors="replace").strip().splitlines() or [""])[-1]
        return seconds, peak, f"exit {code}: {last[:120]}"


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


if __name__ == "__main__":
    print(json.dumps(_measure(sys.argv[2:], float(sys.argv[1]))))
