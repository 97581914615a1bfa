"""``lnfuse check`` counts the norms left unfused, not what a second rule declined: a LayerNormalization that could
not take in a residual or the embeddings is a fused norm, kept as it is (``explain`` says KEPT), and a CI gate
passes on it, lnfuse's own outputs included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FRAMEWORKS = Path(__file__).resolve().parent.parent / "sample_models" / "frameworks"
#: a norm after a bias Add (no residual): the Skip rule declines it, the norm itself is fused
BIAS_THEN_NORM = ["onnxscript/layernorm.onnx", "paddle/layernorm_op17.onnx", "spox/layernorm.onnx"]


def _lnfuse(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("sample", BIAS_THEN_NORM)
def test_check_passes_where_explain_calls_every_norm_fused(sample: str, tmp_path: Path):
    source = FRAMEWORKS / sample
    check = _lnfuse("check", source)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "0 candidate(s) left unfused" in check.stdout
    fused = tmp_path / "fused.onnx"
    assert _lnfuse(source, "-o", fused, "-q").returncode == 0
    again = _lnfuse("check", fused, "--json")
    assert again.returncode == 0, again.stdout
    report = json.loads(again.stdout)
    assert report["unfused"] == [] and report["kept"], "the declined Skip fold is kept, not left"
    explain = _lnfuse("explain", fused)
    assert "KEPT" in explain.stdout and "LEFT" not in explain.stdout, explain.stdout


def test_shapes_in_reasons_read_as_dims_not_python_reprs():
    explain = _lnfuse("explain", FRAMEWORKS / "onnxscript" / "layernorm.onnx", "-v")
    assert "SymbolicDim" not in explain.stdout and "[batch,8,32]" in explain.stdout, explain.stdout
