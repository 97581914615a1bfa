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


def test_the_olive_helper_without_olive_says_what_to_install():
    pytest.importorskip("onnx")  # always there; Olive is not part of .[test]
    try:
        import olive  # noqa: F401
        pytest.skip("Olive is installed here")
    except ImportError:
        pass
    proc = subprocess.run([sys.executable, "-m", "lnfuse.integrations.olive"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "pip install olive-ai" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_jobs_with_one_model_is_still_one_models_run(tmp_path: Path):
    """``--jobs 2`` with one model writes ``-o fused.onnx`` as a file, not a folder; ``-o`` naming a folder for one
    model is refused with the file name to give."""
    (tmp_path / "m.onnx").write_bytes(SAMPLE.read_bytes())
    proc = _lnfuse("m.onnx", "-o", "fused.onnx", "--jobs", "2", "-q", cwd=tmp_path)
    assert proc.returncode == 0 and (tmp_path / "fused.onnx").is_file(), proc.stderr
    proc = _lnfuse("m.onnx", "-o", "out/", cwd=tmp_path)
    assert proc.returncode == 2 and "out/m.onnx" in proc.stderr and not (tmp_path / "out").exists(), proc.stderr


def test_a_folder_fused_into_itself_says_why_nothing_runs(tmp_path: Path):
    (tmp_path / "m.onnx").write_bytes(SAMPLE.read_bytes())
    proc = _lnfuse(".", "-o", ".", cwd=tmp_path)
    assert proc.returncode == 2 and "--in-place" in proc.stderr and "no .onnx file" not in proc.stderr


def test_upper_case_models_and_dangling_links_are_not_skipped_silently(tmp_path: Path):
    zoo = tmp_path / "zoo"
    (zoo / "x.onnx").mkdir(parents=True)  # a folder named like a model is a folder
    (zoo / "A.ONNX").write_bytes(SAMPLE.read_bytes())
    (zoo / "x.onnx" / "b.onnx").write_bytes(SAMPLE.read_bytes())
    (zoo / "dead.onnx").symlink_to("nowhere.onnx")
    proc = _lnfuse(zoo, "-o", tmp_path / "out", "--jobs", "1", "--json")
    import json
    rows = {row["model"]: row["status"] for row in json.loads(proc.stdout)["models"]}
    assert rows == {"A.ONNX": "fused", "x.onnx/b.onnx": "fused", "dead.onnx": "bad input"}, rows


def test_subcommands_describe_themselves():
    texts = {command: _lnfuse(command, "--help").stdout for command in ("explain", "decompose", "check")}
    assert "exit 1" in texts["check"] and "primitive ONNX ops" in texts["decompose"] and "candidate" in texts["explain"]
    assert len(set(texts.values())) == 3


def test_a_resumed_run_with_nothing_left_says_so(tmp_path: Path):
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "m.onnx").write_bytes(SAMPLE.read_bytes())
    assert _lnfuse("zoo", "-o", "out", "--jobs", "1", cwd=tmp_path).returncode == 0
    again = _lnfuse("zoo", "-o", "out", "--jobs", "1", cwd=tmp_path)
    assert "nothing left to run" in again.stderr and "running the rest" not in again.stderr, again.stderr


def test_target_onnx_never_writes_a_model_the_checker_refuses(tmp_path: Path):
    """Inputs that already hold ONNX Runtime's ops (its LayerNormalization at opset 11, com.microsoft ops): every
    output of a --target onnx --upgrade-opset run passes the full checker, or the model's row says refused."""
    import json
    import shutil

    import onnx

    samples = SAMPLE.parents[2] / "ort_fusion"
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    for name in ("embed_layer_norm_format3.onnx", "layer_norm_fusion_scale_bias.onnx", "layer_norm_shared_input.onnx"):
        shutil.copyfile(samples / name, zoo / name)
    proc = _lnfuse(zoo, "-o", tmp_path / "out", "--target", "onnx", "--upgrade-opset", "--jobs", "1", "--json")
    rows = json.loads(proc.stdout)["models"]
    assert any(row["status"] == "bad input" and "only ONNX Runtime runs" in row["reason"] for row in rows), rows
    for row in rows:
        if row["exit"] == 0:
            onnx.checker.check_model(onnx.load(row["output"]), full_check=True)
    single = _lnfuse(zoo / "embed_layer_norm_format3.onnx", "-o", tmp_path / "one.onnx", "--target", "onnx")
    assert single.returncode == 2 and len(single.stderr.strip().splitlines()) == 1, single.stderr
    assert "decompose" in single.stderr and not (tmp_path / "one.onnx").exists()


@pytest.mark.parametrize("content", [b"not a zip", b"\x93NUMPY"])
def test_inputs_that_are_not_an_npz_are_a_usage_error(tmp_path: Path, content: bytes):
    (tmp_path / "m.onnx").write_bytes(SAMPLE.read_bytes())
    (tmp_path / "in.npz").write_bytes(content)
    proc = _lnfuse("m.onnx", "-o", "o.onnx", "--verify", "model", "--inputs", "in.npz", cwd=tmp_path)
    assert proc.returncode == 2 and "numpy.savez" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_path_too_long_for_the_system_is_a_usage_error(tmp_path: Path):
    proc = _lnfuse("x" * 5000 + ".onnx", "y.onnx", "-o", "out", cwd=tmp_path)
    assert proc.returncode == 2 and "give a shorter path" in proc.stderr, proc.stderr


def test_fusing_a_fused_model_keeps_what_the_first_run_fused(tmp_path: Path):
    import onnx

    (tmp_path / "m.onnx").write_bytes(SAMPLE.read_bytes())
    assert _lnfuse("m.onnx", "-o", "once.onnx", "-q", cwd=tmp_path).returncode == 0
    assert _lnfuse("once.onnx", "-o", "twice.onnx", "-q", cwd=tmp_path).returncode == 0
    props = {p.key: p.value for p in onnx.load(tmp_path / "twice.onnx").metadata_props}
    assert props["lnfuse.fused"] == '{"LayerNormalization": 1}', props


def test_upgrade_opset_without_target_onnx_is_not_ignored(tmp_path: Path):
    (tmp_path / "m.onnx").write_bytes(SAMPLE.read_bytes())
    proc = _lnfuse("m.onnx", "-o", "o.onnx", "--upgrade-opset", cwd=tmp_path)
    assert proc.returncode == 2 and "--target onnx" in proc.stderr.splitlines()[-1], proc.stderr


def test_inputs_of_the_wrong_shape_are_named_as_dims(tmp_path: Path):
    """``--inputs`` of another shape: the message shows dims as ``float32[?,8,32]``, not a Python list."""
    import numpy as np
    import onnx

    (tmp_path / "m.onnx").write_bytes(SAMPLE.read_bytes())
    name = onnx.load(tmp_path / "m.onnx").graph.input[0].name
    np.savez(tmp_path / "in.npz", **{name: np.zeros((2, 3), np.float32)})
    proc = _lnfuse("m.onnx", "-o", "o.onnx", "--verify", "model", "--inputs", "in.npz", cwd=tmp_path)
    assert proc.returncode == 2 and "float32[2,3]" in proc.stderr and "'?'" not in proc.stderr, proc.stderr


def test_a_long_reason_is_cut_at_a_word():
    from lnfuse.zoo.job import _shortened

    text = "the addends of 'h' have shapes " + "[batch,8,32] and " * 40
    cut = _shortened(text)
    assert len(cut) <= 300 and cut.endswith("…") and text.startswith(cut[:-1].rstrip())
    assert cut[:-1].split()[-1] in text.split(), "no word cut in half"
