"""Issue 27, depth and signals: nothing a model or a folder decides sets how deep lnfuse recurses, and SIGTERM or
SIGHUP clean up as Ctrl-C does. Every case runs the real CLI on a real model or folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto
from onnx.external_data_helper import set_external_data

_CLI = [sys.executable, "-m", "lnfuse.cli"]


# ---------------------------------------------------------------------------------------------------------------
# SIGTERM and SIGHUP


def _big_model(folder: Path, name: str = "big") -> Path:
    """A model whose ``--external-data single`` output is a 2 GiB data file (read from a sparse input file): long
    enough to write that a signal lands in the middle of the save."""
    folder.mkdir(parents=True, exist_ok=True)
    big = onnx.TensorProto(name="big", data_type=TensorProto.FLOAT, dims=[1 << 29], raw_data=b"\0")
    set_external_data(big, f"{name}.data", 0, 1 << 31)
    big.ClearField("raw_data")
    big.data_location = TensorProto.EXTERNAL
    graph = oh.make_graph([oh.make_node("Size", ["big"], ["n"])], "g", [],
                          [oh.make_tensor_value_info("n", TensorProto.INT64, [])], [big])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    with open(folder / f"{name}.data", "wb") as data:
        data.truncate(1 << 31)
    path = folder / f"{name}.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _staging(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.endswith(".lnfuse-tmp")] if folder.exists() else []


def _signal_while_saving(args: list[str], out: Path, signum: int, group: bool = False) -> tuple[int, str]:
    """Start lnfuse, wait until its temporary folder appears under ``out`` (it is saving), send ``signum`` to it
    (or to its whole process group, as ``timeout`` and CI runners do) and return its exit code and stderr."""
    proc = subprocess.Popen(_CLI + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not _staging(out):
        time.sleep(0.005)
    assert proc.poll() is None, "the write finished before it could be stopped"
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_the_write_leaves_nothing(tmp_path: Path, signum: int):
    src = _big_model(tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    code, err = _signal_while_saving([str(src), "-o", str(out / "o.onnx"), "--external-data", "single", "-q"],
                                     out, signum)
    assert code == 128 + signum and f"interrupted ({signal.Signals(signum).name})" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(out.iterdir()) == [], "no output, no temporary folder, no partial data file"
    assert sorted(p.name for p in src.parent.iterdir()) == ["big.data", "big.onnx"]
    assert (src.parent / "big.data").stat().st_size == 1 << 31, "the input is untouched"


@pytest.mark.parametrize("signum,group", [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGHUP, True)])
def test_a_signal_to_a_many_model_run_leaves_no_temporary_file(tmp_path: Path, signum: int, group: bool):
    models = tmp_path / "models"
    for name in ("a", "b"):
        _big_model(models, name)
    out = tmp_path / "out"
    code, err = _signal_while_saving([str(models), "-o", str(out), "--jobs", "2", "--external-data", "single"],
                                     out, signum, group)
    assert code == 128 + signum, err
    assert "rerun the same command" in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert _staging(out) == [], "no temporary folder"
    assert not [p for p in out.iterdir() if p.name != "lnfuse-ledger.jsonl"], "no partial output or data file"
    assert all((models / f"{n}.data").stat().st_size == 1 << 31 for n in "ab"), "the inputs are untouched"
