"""The command line as a user meets it: summary, report, explain, and one clear line for bad input."""

from __future__ import annotations

import hashlib
import os
import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from normgraphs import Spec, build

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"


def lnfuse(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save(build(Spec(opset=17)), path)
    return path


def test_fuse_prints_summary_writes_output_and_report(model_path: Path, tmp_path: Path):
    before = _digest(model_path)
    out, report = tmp_path / "fused.onnx", tmp_path / "report.json"
    proc = lnfuse(str(model_path), "-o", str(out), "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    assert "LayerNormalization" in proc.stdout and "worst verified error" in proc.stdout
    assert "all nodes" in proc.stdout and "before" in proc.stdout and " s)" in proc.stdout
    assert _digest(model_path) == before, "the input is never modified"
    fused = onnx.load(out)
    onnx.checker.check_model(fused, full_check=True)
    assert [n.op_type for n in fused.graph.node] == ["LayerNormalization"]
    data = json.loads(report.read_text())
    assert data["fused_counts"] == {"LayerNormalization": 1}
    assert data["ops_before"]["ReduceMean"] == 2 and "ReduceMean" not in data["ops_after"]
    assert not list(tmp_path.glob(".*lnfuse-tmp")), "no temporary files left behind"


def test_quiet_and_json(model_path: Path, tmp_path: Path):
    quiet = lnfuse(str(model_path), "-o", str(tmp_path / "a.onnx"), "-q")
    assert quiet.returncode == 0 and quiet.stdout == ""
    as_json = lnfuse(str(model_path), "-o", str(tmp_path / "b.onnx"), "--json")
    assert json.loads(as_json.stdout)["fused"][0]["op_type"] == "LayerNormalization"


def test_progress_bar_on_a_terminal_only(model_path: Path, tmp_path: Path):
    import pty
    terminal, stderr = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "lnfuse.cli", str(model_path), "-o", str(tmp_path / "a.onnx")],
                              stdout=subprocess.PIPE, stderr=stderr, timeout=300)
        os.set_blocking(terminal, False)
        drawn = os.read(terminal, 1 << 16).decode()
    finally:
        os.close(stderr)
        os.close(terminal)
    assert proc.returncode == 0 and "] 100%" not in drawn and "%  main: layer_norm" in drawn and "[" in drawn
    piped = lnfuse(str(model_path), "-o", str(tmp_path / "b.onnx"))
    assert piped.returncode == 0 and piped.stderr == "", "no bar when stderr is not a terminal"


def test_explain_lists_fused_and_refused_candidates(tmp_path: Path):
    path = tmp_path / "m.onnx"
    onnx.save(build(Spec(mutation="exponent3")), path)
    proc = lnfuse("explain", str(path))
    assert proc.returncode == 0
    assert "LEFT" in proc.stdout and "raises to 3" in proc.stdout


def test_explain_writes_its_report_alone_or_with_the_annotated_copy(tmp_path: Path):
    path, report = tmp_path / "m.onnx", tmp_path / "explain.json"
    onnx.save(build(Spec(mutation="exponent3")), path)
    before = _digest(path)
    proc = lnfuse("explain", str(path), "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    assert "LEFT" in proc.stdout and f"wrote {report}" in proc.stdout
    as_json = lnfuse("explain", str(path), "--json")
    timeless = lambda data: {k: v for k, v in data.items() if k != "seconds"}  # noqa: E731
    assert timeless(json.loads(report.read_text())) == timeless(json.loads(as_json.stdout))
    assert json.loads(report.read_text())["unfused"][0]["check"] == "exponent"
    annotated, together = tmp_path / "a.onnx", tmp_path / "together.json"
    both = lnfuse("explain", str(path), "--annotate", str(annotated), "--report", str(together))
    assert both.returncode == 0, both.stderr
    assert timeless(json.loads(together.read_text())) == timeless(json.loads(report.read_text()))
    assert annotated.exists()
    refused = lnfuse("explain", str(path), "--report", str(path))
    assert refused.returncode == 2 and "would destroy the input" in refused.stderr
    assert _digest(path) == before
    assert not list(tmp_path.glob(".*lnfuse-tmp")), "no temporary files left behind"


def test_target_onnx_and_upgrade(tmp_path: Path):
    path, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(build(Spec(opset=14)), path)
    plain = lnfuse(str(path), "-o", str(out), "--target", "onnx")
    assert plain.returncode == 0 and "--upgrade-opset" in plain.stdout
    upgraded = lnfuse(str(path), "-o", str(out), "--target", "onnx", "--upgrade-opset")
    assert upgraded.returncode == 0, upgraded.stderr
    model = onnx.load(out)
    assert model.opset_import[0].version == 17
    onnx.checker.check_model(model, full_check=True)


def test_verify_model_reports_whole_model_difference(tmp_path: Path):
    out = tmp_path / "o.onnx"
    proc = lnfuse(str(SAMPLES / "bert_tiny_legacy_op14.onnx"), "-o", str(out), "--verify", "model")
    assert proc.returncode == 0, proc.stderr
    assert "whole-model check: agree" in proc.stdout


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    text = tmp_path / "text.onnx"
    text.write_text("this is not a model\n" * 10)
    good = build(Spec()).SerializeToString()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(good[: len(good) // 2])
    newer = build(Spec())
    newer.ir_version = 99
    too_new = tmp_path / "ir99.onnx"
    too_new.write_bytes(newer.SerializeToString())
    invalid = build(Spec())
    invalid.graph.node[0].input[0] = "no_such_value"
    broken = tmp_path / "invalid.onnx"
    broken.write_bytes(invalid.SerializeToString())
    return {
        "missing": (tmp_path / "nope.onnx", "no such file"),
        "empty": (empty, "empty"),
        "not_onnx": (text, "not a readable ONNX model"),
        "truncated": (truncated, "not a readable ONNX model"),
        "ir_too_new": (too_new, "IR version 99"),
        "invalid_graph": (broken, "fails the ONNX checker"),
    }


@pytest.mark.parametrize("case", ["missing", "empty", "not_onnx", "truncated", "ir_too_new", "invalid_graph"])
def test_bad_input_gets_one_line_and_exit_2(tmp_path: Path, case: str):
    path, words = _bad_inputs(tmp_path)[case]
    before = _digest(path) if path.exists() else None
    out = tmp_path / "out.onnx"
    proc = lnfuse(str(path), "-o", str(out))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists()
    if before is not None:
        assert _digest(path) == before


def test_missing_external_data_file(tmp_path: Path):
    model = build(Spec(hidden=64))
    onnx.save(model, tmp_path / "ext.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.data", size_threshold=0)
    (tmp_path / "ext.data").unlink()
    proc = lnfuse(str(tmp_path / "ext.onnx"), "-o", str(tmp_path / "out.onnx"))
    assert proc.returncode == 2 and "ext.data" in proc.stderr and "missing" in proc.stderr


def test_output_over_input_is_refused_without_in_place(model_path: Path):
    before = _digest(model_path)
    proc = lnfuse(str(model_path), "-o", str(model_path))
    assert proc.returncode == 2 and "--in-place" in proc.stderr
    assert _digest(model_path) == before
    assert lnfuse(str(model_path), "-o", str(model_path), "--in-place").returncode == 0
    assert [n.op_type for n in onnx.load(model_path).graph.node] == ["LayerNormalization"]


def test_unwritable_output_folder(model_path: Path, tmp_path: Path):
    proc = lnfuse(str(model_path), "-o", str(tmp_path / "no" / "such" / "dir" / "o.onnx"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_unknown_rule_is_a_usage_error(model_path: Path, tmp_path: Path):
    proc = lnfuse(str(model_path), "-o", str(tmp_path / "o.onnx"), "--only", "bogus")
    assert proc.returncode == 2 and "unknown rule 'bogus'" in proc.stderr


def _external_model(folder: Path, hidden: int = 256) -> Path:
    model = build(Spec(hidden=hidden))
    path = folder / "ext.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data",
              size_threshold=0)
    return path


def _external_locations(path: Path) -> set[str]:
    proto = onnx.load(path, load_external_data=False)
    return {e.value for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
            for e in t.external_data if e.key == "location"}


def test_external_data_kept_beside_the_model_and_copied_elsewhere(tmp_path: Path):
    """keep: an output in the model's folder references its data file; elsewhere the weights go to
    ``<output>.data``, named from the output, never from the model."""
    src = _external_model(tmp_path)
    before = _digest(tmp_path / "ext.data")
    proc = lnfuse(str(src), "-o", str(tmp_path / "beside.onnx"))
    assert proc.returncode == 0, proc.stderr
    assert _external_locations(tmp_path / "beside.onnx") <= {"ext.data"}
    out_dir = tmp_path / "elsewhere"
    out_dir.mkdir()
    proc = lnfuse(str(src), "-o", str(out_dir / "out.onnx"))
    assert proc.returncode == 0, proc.stderr
    assert _external_locations(out_dir / "out.onnx") <= {"out.onnx.data"}
    assert sorted(p.name for p in out_dir.iterdir()) == ["out.onnx", "out.onnx.data"]
    assert _digest(tmp_path / "ext.data") == before
    proto = onnx.load(out_dir / "out.onnx", load_external_data=False)
    assert proto.ir_version == build(Spec()).ir_version


def test_external_data_in_a_single_new_file(tmp_path: Path):
    src = _external_model(tmp_path)
    out = tmp_path / "out.onnx"
    proc = lnfuse(str(src), "-o", str(out), "--external-data", "single")
    assert proc.returncode == 0, proc.stderr
    assert _external_locations(out) == {"out.onnx.data"}
    fused = onnx.load(out)
    assert [n.op_type for n in fused.graph.node] == ["LayerNormalization"]


def test_nothing_but_the_output_is_written(tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    proc = lnfuse(str(SAMPLES / "llama_tiny_legacy_op14.onnx"), "-o", "out.onnx", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in work.iterdir()) == ["out.onnx"]


@pytest.mark.parametrize("command", ["", "explain", "decompose", "check"])
def test_help_is_plain_text(command: str):
    proc = lnfuse(*([command] if command else []), "--help")
    assert proc.returncode == 0 and "usage: lnfuse" in proc.stdout
    assert "`" not in proc.stdout, "no reStructuredText/Markdown markup in what a terminal shows"


def test_decompose_command(tmp_path: Path):
    fused, plain = tmp_path / "f.onnx", tmp_path / "p.onnx"
    assert lnfuse(str(SAMPLES / "bert_tiny_dynamo_op18.onnx"), "-o", str(fused), "-q").returncode == 0
    proc = lnfuse("decompose", str(fused), "-o", str(plain))
    assert proc.returncode == 0, proc.stderr
    ops = {n.op_type for n in onnx.load(plain).graph.node}
    assert "ReduceMean" in ops and not ops & {"LayerNormalization", "SkipLayerNormalization"}
    # the summary says what was decomposed, not what was fused
    table = proc.stdout[proc.stdout.index("decomposed op"):].splitlines()
    assert table[1].split()[:2] == ["EmbedLayerNormalization", "1"]
    assert table[2].split()[:2] == ["SkipLayerNormalization", "4"]
    assert "fused: nothing" not in proc.stdout
    again = lnfuse("decompose", str(plain), "-o", str(tmp_path / "again.onnx"))
    assert again.returncode == 0 and "decomposed: nothing" in again.stdout and "fused" not in again.stdout


def _split_external(model: onnx.ModelProto, folder: Path, weights: set[str]) -> Path:
    """Save with the named initializers in weights.data and every other initializer in params.data."""
    from onnx.external_data_helper import set_external_data

    files = {"weights.data": bytearray(), "params.data": bytearray()}
    for tensor in model.graph.initializer:
        location = "weights.data" if tensor.name in weights else "params.data"
        raw = onnx.numpy_helper.to_array(tensor).tobytes()
        offset = len(files[location])
        files[location] += raw
        for field in ("float_data", "int64_data", "int32_data", "double_data"):
            tensor.ClearField(field)
        tensor.raw_data = raw
        set_external_data(tensor, location, offset, len(raw))
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
    for name, data in files.items():
        (folder / name).write_bytes(bytes(data))
    path = folder / "split.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_weights_no_rule_needs_are_never_read(tmp_path: Path):
    """A MatMul weight lives in weights.data: fusing the norm after it must not read that file (its access time
    stays put; ext4 with relatime updates it on a read once it is older than the modification time)."""
    import numpy as np

    norm = build(Spec(hidden=64, opset=17))
    graph = norm.graph
    w = onnx.numpy_helper.from_array(np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32), "W")
    graph.initializer.append(w)
    matmul = onnx.helper.make_node("MatMul", ["X_in", "W"], ["X"])
    graph.node.insert(0, matmul)
    graph.input[0].name = "X_in"
    path = _split_external(norm, tmp_path, {"W"})
    weights = tmp_path / "weights.data"
    stat = weights.stat()
    os.utime(weights, (stat.st_mtime - 1000, stat.st_mtime))
    atime = weights.stat().st_atime
    out = tmp_path / "fused.onnx"
    proc = lnfuse(str(path), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert weights.stat().st_atime == atime, "the MatMul weights were read"
    assert "LayerNormalization" in {n.op_type for n in onnx.load(out, load_external_data=False).graph.node}
    onnx.checker.check_model(str(out))
    # the measurement itself works: writing a single new data file has to read the weights
    proc = lnfuse(str(path), "-o", str(tmp_path / "copy.onnx"), "--external-data", "single")
    assert proc.returncode == 0 and weights.stat().st_atime != atime


def test_opset_newer_than_supported(tmp_path: Path):
    model = build(Spec())
    model.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    path = tmp_path / "new.onnx"
    path.write_bytes(model.SerializeToString())
    proc = lnfuse(str(path), "-o", str(tmp_path / "o.onnx"))
    assert proc.returncode == 2 and "opset" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flaw, words", [("duplicate", "fails the ONNX checker"), ("cycle", "form a cycle")])
def test_duplicate_names_and_cycles_are_refused(tmp_path: Path, flaw: str, words: str):
    model = build(Spec())
    nodes = model.graph.node
    if flaw == "duplicate":
        nodes[2].output[0] = nodes[1].output[0]  # two nodes write the same value
    else:
        nodes[0].input[0] = nodes[3].output[0]  # the first node reads a later one: a cycle
    path = tmp_path / f"{flaw}.onnx"
    path.write_bytes(model.SerializeToString())
    proc = lnfuse(str(path), "-o", str(tmp_path / "o.onnx"))
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o.onnx").exists()


def test_output_on_a_filesystem_that_refuses_writes(model_path: Path):
    # /sys refuses new files even for root, so this runs the real failure path of the write
    proc = lnfuse(str(model_path), "-o", "/sys/lnfuse-test-output.onnx")
    assert proc.returncode == 2 and "lnfuse: error:" in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_during_the_write_leaves_nothing(tmp_path: Path):
    """SIGINT while a 256 MiB data file is being written (real bytes: holes are copied in no time): exit 130, no
    output, no temporary files."""
    import signal
    import time

    from onnx.external_data_helper import set_external_data

    model = build(Spec(hidden=64))
    big = onnx.TensorProto(name="big", data_type=onnx.TensorProto.FLOAT, dims=[1 << 26], raw_data=b"\0")
    set_external_data(big, "big.data", 0, 1 << 28)
    big.ClearField("raw_data")
    big.data_location = onnx.TensorProto.EXTERNAL
    model.graph.initializer.append(big)
    model.graph.node.append(onnx.helper.make_node("Size", ["big"], ["n"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("n", onnx.TensorProto.INT64, []))
    with open(tmp_path / "big.data", "wb") as f:
        for _ in range(16):
            f.write(b"\x01" * (1 << 24))
    src = tmp_path / "big.onnx"
    src.write_bytes(model.SerializeToString())
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "lnfuse.cli", str(src), "-o", str(out_dir / "o.onnx"),
                             "--external-data", "single", "-q"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not list(out_dir.glob(".*lnfuse-tmp")):
        time.sleep(0.005)
    assert proc.poll() is None, "the write finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err, err
    assert list(out_dir.iterdir()) == [], "no output and no temporary files"
    assert (tmp_path / "big.data").stat().st_size == 1 << 28, "the input data is untouched"


def test_check_command_gates_ci(tmp_path: Path):
    fusable = SAMPLES / "llama_tiny_dynamo_op18.onnx"
    assert lnfuse("check", str(fusable)).returncode == 0
    refused = lnfuse("check", str(fusable), "--target", "onnx")
    assert refused.returncode == 1 and "needs opset 23" in refused.stdout
    path = tmp_path / "near.onnx"
    onnx.save(build(Spec(mutation="eps_outside")), path)
    assert lnfuse("check", str(path)).returncode == 1


def test_whole_model_check_on_a_model_ort_cannot_run(tmp_path: Path):
    # every tensor in external data, the Unsqueeze axes too: ONNX Runtime cannot load the original, so --verify
    # model cannot run; fusing still works
    model = onnx.load(SAMPLES / "hf_gpt2_dynamo_op18.onnx")
    path = tmp_path / "all_external.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="all.data", size_threshold=0)
    (tmp_path / "out").mkdir()
    proc = lnfuse(str(path), "-o", str(tmp_path / "out" / "o.onnx"), "--verify", "model")
    assert proc.returncode == 2 and "cannot run the original model" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not list((tmp_path / "out").iterdir())
    proc = lnfuse(str(path), "-o", str(tmp_path / "out" / "o.onnx"))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.data", "all_external.onnx", "out"]


@pytest.mark.parametrize("command", [["fuse", "--json"], ["check"], ["explain"]])
def test_a_reader_that_leaves_changes_neither_the_work_nor_the_exit_code(model_path: Path, tmp_path: Path,
                                                                         command: list[str]):
    """``lnfuse ... | head``: stdout's reader may close the pipe before lnfuse prints; the model is still written,
    and the exit code is the command's own, not an internal error claiming nothing was written."""
    out = tmp_path / "o.onnx"
    args = [command[0], str(model_path)] + (["-o", str(out)] if command[0] == "fuse" else []) + command[1:]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before lnfuse writes a byte
    proc = subprocess.run([sys.executable, "-m", "lnfuse.cli", *args], stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=300)
    os.close(write)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    if command[0] == "fuse":
        onnx.checker.check_model(onnx.load(out), full_check=True)
