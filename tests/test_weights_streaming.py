"""Large weights stay in the input file: never decoded, copied back byte for byte, whether they are initializers or
the ``value`` of Constant nodes (onnxscript's code form writes every weight so)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest
from onnx import TensorProto

import lnfuse
from lnfuse.load import wire
from lnfuse.load.weights import InlineWeight

HIDDEN, FFN = 64, 256


def _code_form_model(path: Path, opset: int = 17) -> Path:
    """x -> decomposed LayerNorm -> MatMul(W1) -> Relu -> MatMul(W2), every operand a Constant node right before
    its first reader. W1 and W2 (64 KiB each) are weights; the norm's constants are small."""
    rng = np.random.default_rng(0)
    nodes = []

    def constant(name: str, value: np.ndarray) -> str:
        nodes.append(oh.make_node("Constant", [], [name], value=onh.from_array(value, name)))
        return name

    def op(op_type: str, inputs: list[str], **attrs) -> str:
        out = f"{op_type.lower()}{len(nodes)}"
        nodes.append(oh.make_node(op_type, inputs, [out], **attrs))
        return out

    mean = op("ReduceMean", ["x"], axes=[-1])
    d = op("Sub", ["x", mean])
    var = op("ReduceMean", [op("Pow", [d, constant("two", np.array(2.0, np.float32))])], axes=[-1])
    std = op("Sqrt", [op("Add", [var, constant("eps", np.array(1e-5, np.float32))])])
    normed = op("Div", [d, std])
    gamma = constant("gamma", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    beta = constant("beta", rng.normal(0, 0.1, HIDDEN).astype(np.float32))
    y = op("Add", [op("Mul", [normed, gamma]), beta])
    w1 = constant("w1", rng.standard_normal((HIDDEN, FFN)).astype(np.float32))
    h = op("Relu", [op("MatMul", [y, w1])])
    w2 = constant("w2", rng.standard_normal((FFN, HIDDEN)).astype(np.float32))
    nodes[-1].doc_string, nodes[-1].attribute[0].doc_string = "second layer", "kept with the node"
    nodes.append(oh.make_node("MatMul", [h, w2], ["out"]))
    graph = oh.make_graph(nodes, "code_form", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["b", HIDDEN])],
                          [oh.make_tensor_value_info("out", TensorProto.FLOAT, ["b", HIDDEN])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def _constant_tensors(model: onnx.ModelProto) -> dict[str, bytes]:
    return {n.output[0]: n.attribute[0].t.SerializeToString() for n in model.graph.node if n.op_type == "Constant"}


def test_large_constants_are_not_decoded_and_are_copied_byte_for_byte(tmp_path: Path):
    model = _code_form_model(tmp_path / "m.onnx")
    result = lnfuse.fuse(model)
    assert result.report.fused_counts() == {"LayerNormalization": 1}, result.report.unfused
    held = {n.outputs[0].name: n.attributes["value"].value for n in result.ir_model.graph if n.op_type == "Constant"}
    assert {name for name, t in held.items() if isinstance(t, InlineWeight)} == {"w1", "w2"}
    assert not any(held[name].loaded for name in ("w1", "w2")), "a weight was read from the file"
    out = tmp_path / "o.onnx"
    result.save(out)
    assert not any(held[name].loaded for name in ("w1", "w2")), "saving read a weight instead of copying it"
    before, after = _constant_tensors(onnx.load(str(model))), _constant_tensors(onnx.load(str(out)))
    assert after["w1"] == before["w1"] and after["w2"] == before["w2"]
    nodes_before, nodes_after = (
        {n.output[0]: n.SerializeToString() for n in onnx.load(str(p)).graph.node if n.op_type == "Constant"}
        for p in (model, out))
    assert nodes_after["w1"] == nodes_before["w1"] and nodes_after["w2"] == nodes_before["w2"]
    onnx.checker.check_model(str(out), full_check=True)
    x = {"x": np.random.default_rng(1).standard_normal((3, HIDDEN)).astype(np.float32)}
    want, got = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, x)[0] for p in (model, out))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_constants_keep_their_place_among_the_nodes(tmp_path: Path):
    """Each large Constant is written as a graph field of its own: the node order (a topological order) stays."""
    model = _code_form_model(tmp_path / "m.onnx")
    result = lnfuse.fuse(model, target="onnx")
    out = tmp_path / "o.onnx"
    result.save(out)
    written = onnx.load(str(out))
    assert [n.SerializeToString() for n in written.graph.node] == \
        [n.SerializeToString() for n in result.model.graph.node]


def test_a_large_constant_reads_its_values_from_the_file_on_demand(tmp_path: Path):
    model = _code_form_model(tmp_path / "m.onnx")
    result = lnfuse.fuse(model)
    w1 = next(n for n in result.ir_model.graph if n.outputs[0].name == "w1").attributes["value"].value
    stored = onnx.load(str(model))
    want = onh.to_array(next(n for n in stored.graph.node if n.output[0] == "w1").attribute[0].t)
    np.testing.assert_array_equal(w1.numpy(), want)
    assert w1.loaded


def test_a_changed_input_is_caught_before_a_constant_is_copied(tmp_path: Path):
    model = _code_form_model(tmp_path / "m.onnx")
    result = lnfuse.fuse(model)
    model.write_bytes(b"\0" * model.stat().st_size)
    with pytest.raises(lnfuse.InputError, match="changed after lnfuse read it"):
        result.save(tmp_path / "o.onnx")


def test_split_leaves_plain_tensors_in_the_file_and_keeps_everything_else():
    """Initializers and Constant values with raw bytes are replaced; typed-data tensors, small ones, and
    Constants of other domains stay byte for byte."""
    big = onh.from_array(np.arange(2048, dtype=np.float32), "big")
    typed = oh.make_tensor("typed", TensorProto.FLOAT, [2048], np.ones(2048, np.float32).tolist())
    nodes = [oh.make_node("Constant", [], ["c"], value=onh.from_array(np.ones(4096, np.float32), "c")),
             oh.make_node("Constant", [], ["other"], domain="custom",
                          value=onh.from_array(np.ones(4096, np.float32), "o")),
             oh.make_node("Constant", [], ["small"], value=onh.from_array(np.ones(4, np.float32), "s"))]
    graph = oh.make_graph(nodes, "g", [], [oh.make_tensor_value_info("c", TensorProto.FLOAT, [4096])], [big, typed])
    data = oh.make_model(graph).SerializeToString()
    seen: list[wire.PlainTensor] = []

    def placeholder(tensor: wire.PlainTensor) -> bytes:
        seen.append(tensor)
        return onnx.TensorProto(name="placeholder").SerializeToString()

    parsed = onnx.ModelProto.FromString(wire.split_weights(data, 1024, placeholder))
    assert sorted(onnx.TensorProto.FromString(t.header).name for t in seen) == ["big", "c"]
    for tensor in seen:  # spans point at the TensorProto and at its raw bytes
        start, length = tensor.span
        proto = onnx.TensorProto.FromString(data[start:start + length])
        offset, size = tensor.data
        assert proto.raw_data == data[offset:offset + size]
    assert [t.name for t in parsed.graph.initializer] == ["placeholder", "typed"]
    assert [n.attribute[0].t.name for n in parsed.graph.node] == ["placeholder", "o", "s"]
    original = oh.make_model(graph)
    assert parsed.graph.initializer[1] == original.graph.initializer[1]
    assert parsed.graph.node[1:] == original.graph.node[1:]


def test_a_constant_node_can_be_reframed_around_its_tensor():
    tensor = onh.from_array(np.arange(16, dtype=np.float32), "t")
    node = oh.make_node("Constant", [], ["c"], name="n", value=onnx.TensorProto(name="stand-in"))
    data = tensor.SerializeToString()
    before, after = wire.constant_node_parts(node.SerializeToString(), len(data))
    graph_only = onnx.ModelProto.FromString(before + data + after)
    assert graph_only.graph.node[0].attribute[0].t == tensor and graph_only.graph.node[0].name == "n"


@pytest.mark.parametrize("size", [1 << 20, 50 << 20])
def test_garbage_is_refused_at_once(size: int):
    """0xff bytes: every byte continues a varint; a varint is at most 10 bytes, so the first field fails."""
    start = time.perf_counter()
    with pytest.raises(ValueError):
        wire.split_weights(b"\xff" * size, 1024, lambda tensor: None)
    assert time.perf_counter() - start < 0.5
