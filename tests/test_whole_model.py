"""Whole-model inputs are built from the model, as a user would: --verify model and --upgrade-opset run real
image, audio and KV-cache exports (sample_models/make_whole_model_samples.py), and say what to pass with --inputs
when no input lnfuse builds makes the model run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest
from onnx import TensorProto

import lnfuse
from lnfuse.verification.whole_model import model_inputs

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
WHOLE_MODEL_SAMPLES = ["wm_vit_legacy_op14.onnx", "wm_convnext_legacy_op14.onnx", "wm_wav2vec2_legacy_op14.onnx",
                       "wm_llama_past_legacy_op14.onnx"]


@pytest.mark.parametrize("name", WHOLE_MODEL_SAMPLES)
def test_verify_model_runs_real_exports(name: str):
    result = lnfuse.fuse(SAMPLES / name, verify_model=True)
    assert result.report.model_check["ok"], result.report.model_check
    assert result.report.fused


@pytest.mark.parametrize("name", WHOLE_MODEL_SAMPLES)
def test_upgrade_opset_runs_real_exports(name: str):
    result = lnfuse.fuse(SAMPLES / name, target="onnx", upgrade_opset=True)
    assert any(note.startswith("upgraded from opset 14") for note in result.report.notes), result.report.notes
    assert result.model.opset_import[0].version >= 17
    onnx.checker.check_model(result.model, full_check=True)


def test_inputs_follow_the_graph():
    """Channels are the Conv's, image sizes the position table's, the mask is past + sequence long, ids index
    their table."""
    vit, _ = model_inputs(onnx.load(SAMPLES / "wm_vit_legacy_op14.onnx"))
    assert vit["pixel_values"].shape[1:] == (3, 32, 32)
    llama, _ = model_inputs(onnx.load(SAMPLES / "wm_llama_past_legacy_op14.onnx"))
    past, sequence = llama["past_key_values.0.key"].shape[2], llama["input_ids"].shape[1]
    assert llama["attention_mask"].shape[1] == past + sequence
    assert llama["position_ids"].shape == llama["input_ids"].shape
    assert 0 <= llama["input_ids"].min() and llama["input_ids"].max() < 100
    assert len(np.unique(llama["input_ids"])) > 2
    audio, _ = model_inputs(onnx.load(SAMPLES / "wm_wav2vec2_legacy_op14.onnx"))
    assert audio["input_values"].shape[1] >= 400


def _unrunnable(tmp_path: Path) -> Path:
    """A layer norm (opset 14: --target onnx needs 17) after a MatMul by a [37, 8] weight: 'n' must be 37, which
    nothing lnfuse reads says (and 1 does not broadcast there)."""
    rng = np.random.default_rng(0)
    nodes = [oh.make_node("MatMul", ["x", "weight"], ["t"]), oh.make_node("ReduceMean", ["t"], ["m"], axes=[-1]),
             oh.make_node("Sub", ["t", "m"], ["d"]), oh.make_node("Mul", ["d", "d"], ["sq"]),
             oh.make_node("ReduceMean", ["sq"], ["v"], axes=[-1]), oh.make_node("Add", ["v", "eps"], ["ve"]),
             oh.make_node("Sqrt", ["ve"], ["s"]), oh.make_node("Div", ["d", "s"], ["y"])]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
                          [onh.from_array(rng.standard_normal((37, 8)).astype(np.float32), "weight"),
                           onh.from_array(np.array(1e-5, np.float32), "eps")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 14)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    path = tmp_path / "unrunnable.onnx"
    onnx.save(model, path)
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *args], capture_output=True, text=True, timeout=300)


def test_no_runnable_inputs_names_the_option_and_the_inputs(tmp_path: Path):
    source = _unrunnable(tmp_path)
    run = _cli(str(source), "-o", str(tmp_path / "out.onnx"), "--verify", "model")
    assert run.returncode == 2
    message = run.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in run.stderr
    assert "--verify model" in message and "--upgrade-opset" not in message
    assert "--inputs FILE.npz" in message and "x float32[batch, n]" in message
    assert not (tmp_path / "out.onnx").exists()


def test_upgrade_opset_keeps_the_opset_when_no_input_runs(tmp_path: Path):
    """--upgrade-opset never fails where plain fuse succeeds: it keeps the model's opset and says why."""
    source, out = _unrunnable(tmp_path), tmp_path / "out.onnx"
    run = _cli(str(source), "-o", str(out), "--target", "onnx", "--upgrade-opset")
    assert run.returncode == 0, run.stderr
    assert "kept opset 14" in run.stdout and "--upgrade-opset needs" in run.stdout and "--inputs" in run.stdout
    assert onnx.load(out).opset_import[0].version == 14


def test_given_inputs_make_it_run(tmp_path: Path):
    source = _unrunnable(tmp_path)
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, x=np.random.default_rng(1).standard_normal((2, 37)).astype(np.float32))
    run = _cli(str(source), "-o", str(tmp_path / "out.onnx"), "--target", "onnx", "--upgrade-opset",
               "--verify", "model", "--inputs", str(inputs))
    assert run.returncode == 0, run.stderr
    assert "upgraded from opset 14 to 17" in run.stdout and "whole-model check: agree" in run.stdout


def test_upgrade_opset_with_external_data_from_another_folder(tmp_path: Path):
    model = onnx.load(SAMPLES / "wm_vit_legacy_op14.onnx")
    (tmp_path / "model").mkdir()
    (tmp_path / "elsewhere").mkdir()
    onnx.save_model(model, tmp_path / "model" / "vit.onnx", save_as_external_data=True, location="vit.onnx.data",
                    size_threshold=1024)
    run = subprocess.run([sys.executable, "-m", "lnfuse.cli", "../model/vit.onnx", "-o", "../model/out.onnx",
                          "--upgrade-opset", "--target", "onnx"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path / "elsewhere")
    assert run.returncode == 0, run.stderr
    assert "upgraded from opset 14 to 17" in run.stdout
    out = tmp_path / "model" / "out.onnx"
    onnx.checker.check_model(str(out), full_check=True)
    feeds, want = model_inputs(onnx.load(SAMPLES / "wm_vit_legacy_op14.onnx"))
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want["last_hidden_state"], atol=1e-4)


def test_related_dims_named_apart_are_found_by_tries():
    """A decoder step as older exporters name it: the mask is 'past_sequence_length + 1' long, so the ids'
    'sequence_length' must be 1; and a total length named apart from the ids it must equal."""
    nodes = [oh.make_node("Gather", ["table", "input_ids"], ["e"]),
             oh.make_node("Concat", ["past", "e"], ["kv"], axis=1),
             oh.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
             oh.make_node("Unsqueeze", ["mf", "axis2"], ["m3"]),
             oh.make_node("Add", ["kv", "m3"], ["y"]),
             oh.make_node("Cast", ["total_mask"], ["tf"], to=TensorProto.FLOAT),
             oh.make_node("Cast", ["input_ids"], ["idf"], to=TensorProto.FLOAT),
             oh.make_node("Add", ["tf", "idf"], ["z"])]
    graph = oh.make_graph(
        nodes, "step",
        [oh.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
         oh.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "past_sequence_length + 1"]),
         oh.make_tensor_value_info("past", TensorProto.FLOAT, ["batch_size", "past_sequence_length", 4]),
         oh.make_tensor_value_info("total_mask", TensorProto.INT64, ["batch_size", "total_length"])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", "past_sequence_length + 1", 4]),
         oh.make_tensor_value_info("z", TensorProto.FLOAT, ["batch_size", "sequence_length"])],
        [onh.from_array(np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32), "table"),
         onh.from_array(np.array([2], np.int64), "axis2")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 14)])
    model.ir_version = 8
    feeds, outputs = model_inputs(model)
    assert feeds["input_ids"].shape[1] == 1 and feeds["total_mask"].shape[1] == 1
    assert feeds["attention_mask"].shape[1] == feeds["past"].shape[1] + 1
    assert feeds["input_ids"].max() < 10 and outputs["y"].shape[1] == feeds["past"].shape[1] + 1


def test_whole_model_check_writes_nothing_beside_the_input(tmp_path: Path):
    """ORT reads the external data from the input's folder; no temporary model is put there (the folder may be
    read-only, and a file appearing in it, even briefly, changes its modification time)."""
    folder, out = tmp_path / "model", tmp_path / "out"
    folder.mkdir()
    out.mkdir()
    onnx.save_model(onnx.load(SAMPLES / "wm_vit_legacy_op14.onnx"), folder / "vit.onnx", save_as_external_data=True,
                    location="vit.onnx.data", size_threshold=1024)
    before = (sorted(p.name for p in folder.iterdir()), folder.stat().st_mtime_ns)
    result = lnfuse.fuse(folder / "vit.onnx", verify_model=True)
    assert result.report.model_check["ok"], result.report.model_check
    result.save(out / "fused.onnx")
    assert (sorted(p.name for p in folder.iterdir()), folder.stat().st_mtime_ns) == before
