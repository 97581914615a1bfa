"""The exit-code contract of docs/cli.md, as a table: each model, with the same options, ends with the same code
alone and in a folder run (and on Ray, where Ray is installed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from normgraphs import Spec, build

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"


def _lnfuse(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=cwd)


def _model(kind: str, folder: Path) -> Path:
    path = folder / f"{kind}.onnx"
    if kind == "fused":
        shutil.copyfile(SAMPLES / "bert_tiny_legacy_op14.onnx", path)
    elif kind == "quantized":  # the sample the issue found exiting 0 alone and 1 in a folder
        shutil.copyfile(SAMPLES / "bert_tiny_qdq_op14.onnx", path)
    elif kind == "left":  # a statistic lnfuse must leave (x**3 is no norm)
        onnx.save(build(Spec(mutation="exponent3")), path)
    elif kind == "bad":
        path.write_bytes(b"not onnx")
    return path


#: (model, options, exit code alone and in a folder)
TABLE = [("fused", [], 0), ("quantized", [], 0), ("left", [], 0), ("bad", [], 2),
         ("fused", ["--target", "onnx"], 0), ("quantized", ["--no-verify"], 0)]


@pytest.mark.parametrize("kind,options,code", TABLE, ids=[f"{k}{''.join(o)}" for k, o, _ in TABLE])
def test_the_same_code_alone_and_in_a_folder(tmp_path: Path, kind: str, options: list[str], code: int):
    models = tmp_path / "models"
    models.mkdir()
    model = _model(kind, models)
    alone = _lnfuse(model, "-o", tmp_path / "alone.onnx", "-q", *options)
    folder = _lnfuse(models, "-o", tmp_path / "out", "--jobs", "1", "--json", *options)
    assert alone.returncode == code, alone.stderr
    assert folder.returncode == code, folder.stderr
    assert [row["exit"] for row in json.loads(folder.stdout)["models"]] == [code]


def test_check_is_the_gate_for_what_is_left(tmp_path: Path):
    model = _model("left", tmp_path)
    assert _lnfuse("check", model).returncode == 1
    assert _lnfuse("check", _model("fused", tmp_path)).returncode == 0
    assert _lnfuse("check", _model("bad", tmp_path)).returncode == 2


def test_usage_problems_are_exit_2_with_a_hint(tmp_path: Path):
    for args in (["-o", "out"], ["m.onnx"], ["m.onnx", "-o", "o.onnx", "--timeout", "5"], ["--jobs", "0", "-o", "o"]):
        proc = _lnfuse(*args, cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert "error:" in proc.stderr.strip().splitlines()[-1], (args, proc.stderr)


def test_ray_with_an_address_where_no_cluster_runs_is_a_usage_error(tmp_path: Path):
    """``--ray auto`` with no cluster used to end as exit 3 "internal error ... please report it"."""
    ray = pytest.importorskip("ray")
    if getattr(ray, "init", None) is None:
        pytest.skip("ray is not installed")
    models = tmp_path / "models"
    models.mkdir()
    _model("fused", models)
    proc = _lnfuse(models, "-o", tmp_path / "out", "--ray", "auto")
    assert proc.returncode == 2 and "no Ray cluster answers there" in proc.stderr, proc.stderr
