"""What lnfuse writes is exactly the model it holds, however the bytes are laid out on disk."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest
from onnx import TensorProto

import lnfuse

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"


@pytest.mark.parametrize("name,target", [("llama_tiny_dynamo_op18.onnx", "ort"),
                                         ("roberta_tiny_dynamo_op18.onnx", "onnx")])
def test_saved_file_is_the_fused_model(tmp_path: Path, name: str, target: str):
    result = lnfuse.fuse(SAMPLES / name, target=target)
    out = tmp_path / "fused.onnx"
    result.save(out)
    written, held = onnx.load(str(out)), result.model
    large = [t for t in held.graph.initializer if len(t.raw_data) >= 1 << 12]
    assert large, "the sample has weights large enough to be written one by one"
    assert {t.name: t.SerializeToString() for t in written.graph.initializer} == \
        {t.name: t.SerializeToString() for t in held.graph.initializer}
    assert [n.SerializeToString() for n in written.graph.node] == [n.SerializeToString() for n in held.graph.node]
    assert written.graph.input == held.graph.input and written.graph.output == held.graph.output
    assert written.opset_import == held.opset_import and written.ir_version == held.ir_version
    if result.report.ort_only:
        ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    else:
        onnx.checker.check_model(str(out), full_check=True)


def test_weights_stay_in_the_input_file_until_saved(tmp_path: Path):
    """Weights no rule needs are copied from the input file when saving; if that file changed in between, saving
    stops with a clear error instead of writing other weights."""
    model = tmp_path / "model.onnx"
    model.write_bytes((SAMPLES / "bert_tiny_legacy_op14.onnx").read_bytes())
    result = lnfuse.fuse(model)
    held = {t.name: t.SerializeToString() for t in result.model.graph.initializer}
    first = tmp_path / "first.onnx"
    result.save(first)
    assert {t.name: t.SerializeToString() for t in onnx.load(str(first)).graph.initializer} == held
    model.write_bytes(b"\0" * model.stat().st_size)  # same size, other bytes: the input was rewritten
    with pytest.raises(lnfuse.InputError, match="changed after lnfuse read it"):
        result.save(tmp_path / "second.onnx")
    assert not (tmp_path / "second.onnx").exists()


def test_in_place_rewrite_reads_the_weights_before_replacing_the_file(tmp_path: Path):
    model = tmp_path / "model.onnx"
    model.write_bytes((SAMPLES / "gpt2_tiny_legacy_op14.onnx").read_bytes())
    result = lnfuse.fuse(model)
    held = {t.name: t.SerializeToString() for t in result.model.graph.initializer}
    result.save(model, in_place=True)
    assert {t.name: t.SerializeToString() for t in onnx.load(str(model)).graph.initializer} == held
    ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])


def _layer_norm_file(path: Path, hidden: int = 2048, gamma: bool = True, extra=None, opset: int = 17) -> Path:
    """x -> decomposed LayerNorm over [2, 3, hidden] (gamma/beta of 8 KiB: kept in the file until needed)."""
    rng = np.random.default_rng(0)
    inits = [onh.from_array(np.array(1e-5, np.float32), "eps"), onh.from_array(np.array(2.0, np.float32), "two"),
             onh.from_array(rng.standard_normal(hidden).astype(np.float32), "beta")]
    inits.append(onh.from_array(np.array([-1], np.int64), "axes"))

    def reduce_mean(source: str, out: str) -> onnx.NodeProto:
        if opset >= 18:
            return oh.make_node("ReduceMean", [source, "axes"], [out])
        return oh.make_node("ReduceMean", [source], [out], axes=[-1])

    nodes = [reduce_mean("x", "m"), oh.make_node("Sub", ["x", "m"], ["d"]),
             oh.make_node("Pow", ["d", "two"], ["p"]), reduce_mean("p", "v"),
             oh.make_node("Add", ["v", "eps"], ["ve"]), oh.make_node("Sqrt", ["ve"], ["s"]),
             oh.make_node("Div", ["d", "s"], ["n"])]
    if gamma:
        inits.append(onh.from_array(rng.uniform(0.5, 1.5, hidden).astype(np.float32), "gamma"))
        nodes.append(oh.make_node("Mul", ["n", "gamma"], ["g"]))
    nodes.append(oh.make_node("Add", ["g" if gamma else "n", "beta"], ["y"]))
    outputs = [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, hidden])]
    if extra is not None:
        extra(nodes, inits, outputs)
    graph = oh.make_graph(nodes, "ln", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, hidden])], outputs,
                          inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.save(model, path)
    return path


def _same_outputs(original: Path, fused: Path) -> None:
    first = ort.InferenceSession(str(original), providers=["CPUExecutionProvider"])
    feeds = {i.name: np.random.default_rng(1).standard_normal(i.shape).astype(np.float32) for i in first.get_inputs()}
    second = ort.InferenceSession(str(fused), providers=["CPUExecutionProvider"])
    for want, got in zip(first.run(None, feeds), second.run(None, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_large_constants_made_by_a_rule_keep_their_names(tmp_path: Path):
    model = _layer_norm_file(tmp_path / "m.onnx", hidden=1024, gamma=False)
    result = lnfuse.fuse(model)
    result.save(tmp_path / "o.onnx")
    saved = onnx.load(str(tmp_path / "o.onnx"))
    assert all(t.name for t in saved.graph.initializer)
    _same_outputs(model, tmp_path / "o.onnx")


def test_packed_4_bit_weights_round_trip(tmp_path: Path):
    """An int4 weight nothing fuses is kept exactly, in the model held in memory and in the file written."""
    values = np.random.default_rng(0).integers(-8, 8, size=(64, 256)).astype(np.int8)
    nibbles = (values.reshape(-1) & 0xF).astype(np.uint8)
    packed = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()

    def int4_output(nodes, inits, outputs):
        inits += [oh.make_tensor("w4", TensorProto.INT4, [64, 256], packed, raw=True),
                  onh.from_array(np.array(0.5, np.float32), "scale")]
        nodes.append(oh.make_node("DequantizeLinear", ["w4", "scale"], ["w"]))
        outputs.append(oh.make_tensor_value_info("w", TensorProto.FLOAT, [64, 256]))

    model = _layer_norm_file(tmp_path / "m.onnx", hidden=256, extra=int4_output, opset=21)
    result = lnfuse.fuse(model, verify_model=True)
    assert result.report.model_check["ok"], result.report.model_check
    held = next(t for t in result.model.graph.initializer if t.name == "w4")
    assert held.raw_data == packed
    result.save(tmp_path / "o.onnx")
    assert next(t for t in onnx.load(str(tmp_path / "o.onnx")).graph.initializer if t.name == "w4").raw_data == packed
    _same_outputs(model, tmp_path / "o.onnx")


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_models_behind_links_are_read_like_any_file(tmp_path: Path, link: str):
    """Hugging Face's cache links snapshots to blobs: the model file is read directly, whatever points at it."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snapshot").mkdir()
    blob = _layer_norm_file(tmp_path / "blobs" / "abc")
    model = tmp_path / "snapshot" / "model.onnx"
    if link == "symlink":
        model.symlink_to(Path("..") / "blobs" / "abc")
    else:
        os.link(blob, model)
    result = lnfuse.fuse(model)
    assert result.report.fused_counts() == {"LayerNormalization": 1}, result.report.unfused
    result.save(tmp_path / "o.onnx")
    _same_outputs(blob, tmp_path / "o.onnx")


def test_a_rewrite_of_the_input_while_it_is_read_is_caught(tmp_path: Path, monkeypatch):
    import lnfuse.load.io as lio
    model = _layer_norm_file(tmp_path / "m.onnx")
    infer = lio.infer_shapes_deferred  # what fuse's load runs (ORT's symbolic inference is left for later)

    def rewritten_meanwhile(proto, **options):
        other = onnx.load(str(model))
        for tensor in other.graph.initializer:
            if tensor.name == "beta":
                tensor.raw_data = np.full(2048, 7.0, np.float32).tobytes()
        onnx.save(other, model)  # same layout and size, other weights
        return infer(proto, **options)

    monkeypatch.setattr(lio, "infer_shapes_deferred", rewritten_meanwhile)
    with pytest.raises(lnfuse.InputError, match="changed after lnfuse read it"):
        lnfuse.fuse(model, verify=False).save(tmp_path / "o.onnx")
    assert not (tmp_path / "o.onnx").exists()


def test_weights_are_copied_where_the_kernel_cannot_copy_files(tmp_path: Path, monkeypatch):
    def unsupported(*args, **kwargs):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    result = lnfuse.fuse(SAMPLES / "gpt2_tiny_legacy_op14.onnx")
    held = {t.name: t.SerializeToString() for t in result.model.graph.initializer}
    result.save(tmp_path / "o.onnx")
    assert {t.name: t.SerializeToString() for t in onnx.load(str(tmp_path / "o.onnx")).graph.initializer} == held
