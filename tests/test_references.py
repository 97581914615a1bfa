"""Each rule's onnxscript reference function computes what the op it writes computes in ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto

from lnfuse.rules import layer_norm, rms_norm
from normgraphs import session


def _call(function, inputs: list[str], attrs: dict, opset: int) -> onnx.ModelProto:
    proto = function.to_function_proto()
    outputs = ["Y"] + [f"unused{i}" for i in range(1, len(proto.output))]
    node = oh.make_node(proto.name, inputs, outputs, domain=proto.domain, **attrs)
    graph = oh.make_graph([node], "ref", [oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
                          [oh.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = oh.make_model(graph, functions=[proto], opset_imports=[
        oh.make_opsetid("", opset), oh.make_opsetid(proto.domain, 1)])
    model.ir_version = 10
    return model


def _op(op_type: str, inputs: list[str], attrs: dict, opset: int) -> onnx.ModelProto:
    node = oh.make_node(op_type, inputs, ["Y"], **attrs)
    graph = oh.make_graph([node], "op", [oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
                          [oh.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("axis", [-1, -2])
def test_layer_norm_reference_matches_ort(axis):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    shape = x.shape[axis:]
    feeds = {"X": x, "S": rng.standard_normal(shape).astype(np.float32),
             "B": rng.standard_normal(shape).astype(np.float32)}
    attrs = {"axis": axis, "epsilon": 1e-3}
    want = session(_op("LayerNormalization", ["X", "S", "B"], attrs, 18)).run(None, feeds)[0]
    got = session(_call(layer_norm.reference(), ["X", "S", "B"], attrs, 18)).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op_type, opset", [("RMSNormalization", 23), ("SimplifiedLayerNormalization", 18)])
def test_rms_reference_matches_ort(op_type, opset):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    feeds = {"X": x, "S": rng.standard_normal(4).astype(np.float32)}
    attrs = {"axis": -1, "epsilon": 1e-3}
    want = session(_op(op_type, ["X", "S"], attrs, opset)).run(None, feeds)[0]
    got = session(_call(rms_norm.reference(), ["X", "S"], attrs, 18)).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
