"""What a new user trips on, each kept as a test: ``--from-list`` alone is an input, a rule name given to the API as
one string is a rule name, and the API's save error speaks the API's words."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import lnfuse
from lnfuse.errors import OutputError

SAMPLE = Path(__file__).resolve().parent.parent / "sample_models" / "frameworks" / "spox" / "layernorm.onnx"


def _lnfuse(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_from_list_alone_is_an_input(tmp_path: Path):
    (tmp_path / "a.onnx").write_bytes(SAMPLE.read_bytes())
    (tmp_path / "list.txt").write_text("# one model\na.onnx\n")
    proc = _lnfuse("--from-list", "list.txt", "-o", "out", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "a.onnx").is_file()


def test_no_input_at_all_is_a_usage_error(tmp_path: Path):
    proc = _lnfuse("-o", "out", cwd=tmp_path)
    assert proc.returncode == 2 and "model (or --from-list FILE)" in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize("only", ["layer_norm", "layer_norm,rms_norm", ["layer_norm"]])
def test_only_takes_one_name_as_a_string(only):
    assert lnfuse.fuse(str(SAMPLE), only=only).report.fused_counts() == {"LayerNormalization": 1}


def test_an_unknown_rule_name_is_named_whole():
    with pytest.raises(Exception, match="unknown rule 'layer'"):
        lnfuse.fuse(str(SAMPLE), only="layer")


def test_the_api_save_error_names_the_api_argument(tmp_path: Path):
    model = tmp_path / "m.onnx"
    model.write_bytes(SAMPLE.read_bytes())
    result = lnfuse.fuse(str(model))
    with pytest.raises(OutputError, match="in_place=True"):
        result.save(model)
    result.save(model, in_place=True)
