"""The lnfuse program ends without the interpreter's teardown (``cli.run``): what it prints still arrives through a
pipe with the right exit code, and a profiler watching it still gets to write its results."""

from __future__ import annotations

import pstats
import subprocess
import sys
from pathlib import Path

import onnx

from normgraphs import Spec, build


def _model(tmp_path: Path, spec: Spec = Spec(opset=17)) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save(build(spec), path)
    return path


def test_report_and_exit_code_arrive_through_a_pipe(tmp_path: Path):
    model = _model(tmp_path)
    fused = subprocess.run([sys.executable, "-m", "lnfuse.cli", str(model), "-o", str(tmp_path / "out.onnx")],
                           capture_output=True, text=True, timeout=300)
    assert fused.returncode == 0, fused.stderr
    assert fused.stdout.rstrip().endswith(f"wrote {tmp_path / 'out.onnx'}")
    near_miss = _model(tmp_path, Spec(mutation="eps_outside"))
    gate = subprocess.run([sys.executable, "-m", "lnfuse.cli", "check", str(near_miss)], capture_output=True,
                          text=True, timeout=300)
    assert gate.returncode == 1 and "left unfused, 0 fusable" in gate.stdout, gate.stdout


def test_a_profiled_run_still_writes_its_profile(tmp_path: Path):
    model, stats = _model(tmp_path), tmp_path / "run.prof"
    done = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(stats), "-m", "lnfuse.cli", str(model), "-o",
                           str(tmp_path / "out.onnx"), "-q"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert any("fuse_model" in name for _, _, name in pstats.Stats(str(stats)).stats)
