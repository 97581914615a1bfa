"""Paths are resolved once: the input's folder, never the working directory, anchors external data, for every
command and every model lnfuse makes from the input along the way (the upgraded model, the whole-model checks)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import onnx
import pytest

import lnfuse
from lnfuse.verification.whole_model import compare_models, random_inputs

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
NAME = "llama_tiny_legacy_op14"


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """(model folder holding NAME.onnx with every tensor, epsilon included, in NAME.onnx.data; another folder)."""
    models, elsewhere = tmp_path / "models", tmp_path / "elsewhere"
    models.mkdir()
    elsewhere.mkdir()
    onnx.save(onnx.load(SAMPLES / f"{NAME}.onnx"), models / f"{NAME}.onnx", save_as_external_data=True,
              location=f"{NAME}.onnx.data", size_threshold=0)
    return models, elsewhere


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env)


def _ops(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(path, load_external_data=False).graph.node)


def _agrees(original: Path, written: Path) -> bool:
    model = onnx.load(original)
    return compare_models(model, onnx.load(written), random_inputs(model, seed=3))["ok"]


@pytest.mark.parametrize("options, fused", [
    ([], {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 4}),
    (["--target", "onnx", "--upgrade-opset"], {"RMSNormalization": 5}),
    (["--target", "onnx", "--upgrade-opset", "--verify", "model"], {"RMSNormalization": 5}),
])
def test_fuse_from_another_working_directory(layout, options, fused):
    models, elsewhere = layout
    proc = _cli(f"../models/{NAME}.onnx", "-o", "out.onnx", "-q", *options, cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    ops = _ops(elsewhere / "out.onnx")
    assert {op: ops[op] for op in fused} == fused
    assert _agrees(models / f"{NAME}.onnx", elsewhere / "out.onnx")


@pytest.mark.parametrize("command", ["explain", "check"])
def test_explain_and_check_from_another_working_directory(layout, command):
    _, elsewhere = layout
    proc = _cli(command, f"../models/{NAME}.onnx", "--target", "onnx", "--upgrade-opset", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert "upgraded from opset 14 to 23" in proc.stdout or "0 candidate(s) left unfused" in proc.stdout


def test_decompose_from_another_working_directory(layout):
    models, elsewhere = layout
    assert _cli(f"{NAME}.onnx", "-o", "fused.onnx", "-q", cwd=models).returncode == 0
    proc = _cli("decompose", "../models/fused.onnx", "-o", "plain.onnx", "-q", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert not _ops(elsewhere / "plain.onnx").keys() & {"SimplifiedLayerNormalization",
                                                          "SkipSimplifiedLayerNormalization"}
    assert _agrees(models / f"{NAME}.onnx", elsewhere / "plain.onnx")


def test_the_api_reads_weights_from_the_inputs_folder_after_a_change_of_directory(layout, monkeypatch):
    # the folder is resolved when the model is read: a later chdir (a script moving on) does not move the weights
    models, elsewhere = layout
    monkeypatch.chdir(models)
    result = lnfuse.fuse(f"{NAME}.onnx", target="onnx", upgrade_opset=True)
    monkeypatch.chdir(elsewhere)
    result.save("out.onnx")
    assert _agrees(models / f"{NAME}.onnx", elsewhere / "out.onnx")
