"""A rewrite whose output reaches a QuantizeLinear is refused by default, from the graph alone: a float rounding
difference there moves quantized values by whole steps for some inputs, whether or not the verification inputs
show it (tests/test_requantization_graph.py has the paths). ``allow_requantization`` keeps it, and the region is then
compared after the quantizer too, with the counts in the report as evidence.

The model is a static-QDQ int8 encoder made by ONNX Runtime's own quantizer from a float model with native
LayerNormalization and residual Adds, quantizing the MatMuls (as for a speech or text encoder): each norm's output
is quantized for the next MatMul."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx import TensorProto

import lnfuse
from lnfuse.cli import main
from normgraphs import session

H, LAYERS, SEQ = 32, 2, 16


def _float_encoder() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for layer in range(LAYERS):
        p = f"encoder.layers.{layer}"
        inits += [onh.from_array(rng.normal(scale=0.2, size=(H, H)).astype(np.float32), f"{p}.fc.weight"),
                  onh.from_array(rng.normal(size=H).astype(np.float32), f"{p}.fc.bias"),
                  onh.from_array(rng.uniform(0.5, 1.5, H).astype(np.float32), f"{p}.norm.weight"),
                  onh.from_array(rng.normal(size=H).astype(np.float32), f"{p}.norm.bias")]
        nodes += [oh.make_node("MatMul", [x, f"{p}.fc.weight"], [f"{p}/mm"], name=f"/{p}/fc/MatMul"),
                  oh.make_node("Add", [f"{p}/mm", f"{p}.fc.bias"], [f"{p}/fc"], name=f"/{p}/fc/Add"),
                  oh.make_node("Add", [f"{p}/fc", x], [f"{p}/residual"], name=f"/{p}/Add"),
                  oh.make_node("LayerNormalization", [f"{p}/residual", f"{p}.norm.weight", f"{p}.norm.bias"],
                               [f"{p}/norm"], name=f"/{p}/norm/LayerNormalization", epsilon=1e-5)]
        x = f"{p}/norm"
    inits.append(onh.from_array(rng.normal(scale=0.2, size=(H, 4)).astype(np.float32), "head.weight"))
    nodes.append(oh.make_node("MatMul", [x, "head.weight"], ["logits"], name="/head/MatMul"))
    graph = oh.make_graph(nodes, "encoder", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ, H])],
                          [oh.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", SEQ, 4])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 9
    return model


@pytest.fixture(scope="module")
def qdq_path(tmp_path_factory) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    folder = tmp_path_factory.mktemp("qdq")
    float_path, qdq = folder / "encoder.onnx", folder / "encoder.qdq.onnx"
    onnx.save(_float_encoder(), float_path)
    rng = np.random.default_rng(1)

    class Calibration(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": rng.normal(size=(2, SEQ, H)).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(float_path), str(qdq), Calibration(), quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=["MatMul"], activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    model = onnx.load(qdq)
    producers = {o: n for n in model.graph.node for o in n.output}
    readers = {i: n for n in model.graph.node for i in n.input}
    for norm in (n for n in model.graph.node if n.op_type == "LayerNormalization"):
        assert producers[norm.input[0]].op_type == "Add", "the residual Add feeds the norm directly"
        assert readers[norm.output[0]].op_type == "QuantizeLinear", "the norm's output is quantized"
    return qdq


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(2).normal(size=(3, SEQ, H)).astype(np.float32)}


def test_residuals_feeding_a_quantizer_are_refused_by_default(qdq_path):
    result = lnfuse.fuse(qdq_path, verify_model=True, inputs=_feeds())
    counts = Counter(n.op_type for n in result.model.graph.node)
    assert counts["SkipLayerNormalization"] == 0 and counts["LayerNormalization"] == LAYERS
    refused = [u for u in result.report.kept if u.rule == "skip_norm"]
    assert len(refused) == LAYERS, result.report.kept
    for u in refused:
        assert u.check == "requantization"
        assert "reaches QuantizeLinear '" in u.reason and "_QuantizeLinear' directly" in u.reason, u.reason
        assert "--allow-requantization" in u.reason
    assert result.report.model_check["summary"].startswith("agree"), result.report.model_check
    original = onnx.load(qdq_path)
    np.testing.assert_array_equal(session(result.model).run(None, _feeds())[0],
                                  session(original).run(None, _feeds())[0])


def test_allow_requantization_fuses_and_reports_the_quantized_values(qdq_path):
    result = lnfuse.fuse(qdq_path, verify_model=True, inputs=_feeds(), allow_requantization=True)
    counts = Counter(n.op_type for n in result.model.graph.node)
    assert counts["SkipLayerNormalization"] == LAYERS and counts["LayerNormalization"] == 0
    for fused in result.report.fused:
        (note,) = [n for n in fused.notes if "reaches QuantizeLinear" in n]
        moved, total = note.split(": ", 1)[1].split(" quantized values")[0].split(" of ")
        assert total == str(2 * SEQ * H) and 0 <= int(moved) <= int(total), note
        float_error = float(note.rsplit("differ by up to ", 1)[1])
        assert 0 < float_error == pytest.approx(fused.max_error, rel=1e-3), (note, fused.max_error)
    assert result.report.model_check["summary"].startswith("agree"), result.report.model_check


def test_the_command_line_option(qdq_path, tmp_path):
    out = tmp_path / "fused.onnx"
    assert main([str(qdq_path), "-o", str(out), "--verify", "model", "-q"]) == 0
    assert "SkipLayerNormalization" not in {n.op_type for n in onnx.load(out).graph.node}
    assert main([str(qdq_path), "-o", str(out), "--verify", "model", "--allow-requantization", "-q"]) == 0
    assert "SkipLayerNormalization" in {n.op_type for n in onnx.load(out).graph.node}
