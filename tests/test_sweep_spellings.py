"""Spellings found by the exporter sweep (tests/sweep/run_sweep.py): each fuses exactly, and its near-misses stay.

The graphs are written with onnx.helper in the form the exporter wrote them (the sweep's table in
docs/spellings.md says which exporter, model and opset).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest

import lnfuse
from normgraphs import op_types
from test_spellings import BETA, GAMMA, EPS, H, Graph, _fused_one


# ---- RMSNormalization(x - mean(x)) is LayerNormalization(x) ---------------------------------------------------
# torch 2.13's dynamo exporter at opset 23 writes CohereLayerNorm (and any hand-written LayerNorm without bias:
# mean-centred, then x * rsqrt(mean(d²) + eps)) as ReduceMean -> Sub -> RMSNormalization.

def _centred_rms(op: str = "RMSNormalization", opset: int = 23, axis: int = -1, mean_axes=(-1,), beta: bool = False,
                 centre_other: bool = False, read_inverse: bool = False, stash: int = 1) -> onnx.ModelProto:
    g = Graph(opset=opset)
    source = g.op("Neg", "X") if centre_other else "X"
    d = g.op("Sub", "X", g.mean(source, mean_axes))
    gamma = g.const(GAMMA if axis == -1 else np.ones([3, H], np.float32) * GAMMA)
    outputs = [f"rms_{len(g.nodes)}"] + ([f"inv_{len(g.nodes)}"] if read_inverse else [])
    g.nodes.append(oh.make_node(op, [d, gamma], outputs, name="rms", axis=axis, epsilon=EPS, stash_type=stash))
    y = outputs[0]
    if read_inverse:
        y = g.op("Add", y, g.mean(outputs[1]))
    if beta:
        y = g.op("Add", y, g.const(BETA))
    return g.model(y) if op == "RMSNormalization" else _unchecked(g, y)


def _unchecked(g: Graph, y: str) -> onnx.ModelProto:
    """ORT's SimplifiedLayerNormalization lives in the default domain, which the ONNX checker does not know."""
    graph = oh.make_graph(g.nodes, "g", [oh.make_tensor_value_info("X", onnx.TensorProto.FLOAT, g.shape)],
                          [oh.make_tensor_value_info(y, onnx.TensorProto.FLOAT, g.shape)], g.inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", g.opset)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("beta", [False, True])
def test_rms_of_centred_is_layer_norm(beta):
    _fused_one(_centred_rms(beta=beta), epsilon=EPS, axis=-1)


def test_simplified_layer_norm_of_centred_is_layer_norm():
    _fused_one(_centred_rms("SimplifiedLayerNormalization", opset=17), epsilon=EPS, axis=-1)


@pytest.mark.parametrize("case, check", [
    (dict(axis=-2, mean_axes=(-1,)), "axes"),  # the RMS op normalizes two axes, the mean one
    (dict(centre_other=True), None),  # x - mean(-x): not centred
    (dict(stash=10), "dtype"),  # statistics in float16: not what LayerNormalization computes
])
def test_rms_of_centred_near_misses(case, check):
    model = _centred_rms(**case)
    result = lnfuse.fuse(model)
    assert "LayerNormalization" not in op_types(result.model)
    if check is not None:
        assert check in {u.check for u in result.report.unfused}, result.report.unfused


def test_rms_of_centred_with_inverse_read_is_left():
    """SimplifiedLayerNormalization's second output (1/rms) is read: LayerNormalization's InvStdDev is the same
    number, but lnfuse does not rewire it (the RMS op's own output stays)."""
    result = lnfuse.fuse(_centred_rms("SimplifiedLayerNormalization", opset=17, read_inverse=True))
    assert "SimplifiedLayerNormalization" in op_types(result.model)
    assert "intermediate" in {u.check for u in result.report.unfused}, result.report.unfused
