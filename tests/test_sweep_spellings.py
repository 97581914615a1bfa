"""Spellings found by the exporter sweep (tests/sweep/run_sweep.py): each fuses exactly, and its near-misses stay.

The graphs are written with onnx.helper in the form the exporter wrote them, and three real exports are read from
sample_models/sweep/ (docs/sweep.md says which exporter, model and opset showed each form).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest

import lnfuse
from normgraphs import op_types
from test_spellings import BETA, GAMMA, EPS, H, Graph, _fused_one

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models" / "sweep"


# ---- RMSNormalization(x - mean(x)) is LayerNormalization(x) ---------------------------------------------------
# torch 2.13's dynamo exporter at opset 23 writes CohereLayerNorm (and any hand-written LayerNorm without bias:
# mean-centred, then x * rsqrt(mean(d²) + eps)) as ReduceMean -> Sub -> RMSNormalization.

def _centred_rms(op: str = "RMSNormalization", opset: int = 23, axis: int = -1, mean_axes=(-1,), beta: bool = False,
                 centre_other: bool = False, read_inverse: bool = False, stash: int = 1,
                 swapped: bool = False) -> onnx.ModelProto:
    g = Graph(opset=opset)
    source = g.op("Neg", "X") if centre_other else "X"
    mean = g.mean(source, mean_axes)
    d = g.op("Sub", mean, "X") if swapped else g.op("Sub", "X", mean)
    gamma = g.const(GAMMA if axis == -1 else np.ones([3, H], np.float32) * GAMMA)
    outputs = [f"rms_{len(g.nodes)}"] + ([f"inv_{len(g.nodes)}"] if read_inverse else [])
    g.nodes.append(oh.make_node(op, [d, gamma], outputs, name="rms", axis=axis, epsilon=EPS, stash_type=stash))
    y = outputs[0]
    if read_inverse:
        y = g.op("Add", y, g.mean(outputs[1]))
    if beta:
        y = g.op("Add", y, g.const(BETA))
    return g.model(y) if op == "RMSNormalization" else _unchecked(g, y)


def _checks(result: lnfuse.FuseResult) -> set[str]:
    """The checks that refused, on the form reported and on the other forms tried."""
    return {u.check for u in result.report.unfused} | {o.check for u in result.report.unfused for o in u.others}


def _unchecked(g: Graph, y: str, extra_inputs=()) -> onnx.ModelProto:
    """ORT's SimplifiedLayerNormalization lives in the default domain, which the ONNX checker does not know."""
    graph = oh.make_graph(g.nodes, "g", [oh.make_tensor_value_info("X", onnx.TensorProto.FLOAT, g.shape),
                                         *extra_inputs],
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
    (dict(swapped=True), "operands"),  # mean - x: the LayerNorm negated (epsilon was blamed)
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


# ---- torch.var / var_mean through the dynamo exporter -----------------------------------------------------------
# torch 2.13's dynamo exporter writes var(unbiased=False) and var_mean(correction=0) with their own mean (axes [2]
# where the code's mean says [-1], or ReduceSum / N), ReduceMean(keepdims=0), then a Reshape to the kept shape and
# an Expand to that same shape, with targets computed from Shape(var).

@pytest.mark.parametrize("name", ["user_ln_var_unbiased_false_dynamo_op18", "user_ln_var_mean_dynamo_op18",
                                  "user_ln_hand_fp32_dynamo_op23"])
def test_sweep_exports_fuse(name):
    """The real exports (``python tests/sweep/run_sweep.py --samples sample_models/sweep``): one LayerNorm each,
    nothing of the norm left, the whole model unchanged."""
    model = onnx.load(str(SAMPLES / f"{name}.onnx"))
    result = lnfuse.fuse(model, verify_model=True)
    ops = op_types(result.model)
    assert ops.count("LayerNormalization") == 1, (ops, result.report.unfused)
    assert not {"ReduceMean", "ReduceSum", "Expand", "Reshape", "RMSNormalization"} & set(ops), ops
    assert result.report.model_check["ok"], result.report.model_check


def test_mean_twins_with_equal_axes_spelled_apart_fuse():
    """The numerator's mean reduces axes [-1], the variance's [2] (the same axis of a rank-3 x)."""
    g = Graph(opset=18)
    d_num = g.op("Sub", "X", g.mean("X", (-1,)))
    d_var = g.op("Sub", "X", g.mean("X", (2,)))
    var = g.mean(g.op("Mul", d_var, d_var), (-1,))
    y = g.op("Div", d_num, g.op("Sqrt", g.op("Add", var, g.const(EPS))))
    _fused_one(g.model(g.op("Add", g.op("Mul", y, g.const(GAMMA)), g.const(BETA))), epsilon=EPS, axis=-1)


def test_var_reshaped_by_a_runtime_shape_is_left():
    """ReduceMean(keepdims=0) then a Reshape whose target is a graph input: nothing proves it restores the axes."""
    g = Graph(opset=18)
    mean = g.mean("X")
    d = g.op("Sub", "X", mean)
    flat_var = g.op("ReduceMean", g.op("Mul", d, d), g.ints([-1]), keepdims=0)
    var = g.op("Reshape", flat_var, "target")
    y = g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(EPS))))
    model = _unchecked(g, y, [oh.make_tensor_value_info("target", onnx.TensorProto.INT64, [3])])
    result = lnfuse.fuse(model)
    assert "LayerNormalization" not in op_types(result.model)
    assert "keepdims" in _checks(result), result.report.unfused


# ---- the inverse RMS computed without the reduced axes, unsqueezed after ----------------------------------------
# x * rsqrt(x.pow(2).mean(-1) + eps).unsqueeze(-1): both torch exporters keep the Unsqueeze after the Rsqrt.

def _rms_unsqueezed_late(shape=(2, 3, H), restore=-1, eps_shape=()) -> onnx.ModelProto:
    g = Graph(shape=shape, opset=18)
    mean_sq = g.op("ReduceMean", g.op("Mul", "X", "X"), g.ints([-1]), keepdims=0)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean_sq, g.const(np.full(eps_shape, EPS)))))
    y = g.op("Mul", g.op("Mul", "X", g.op("Unsqueeze", inv, g.ints([restore]))), g.const(GAMMA[:shape[-1]]))
    if len(eps_shape) == len(shape):
        y = g.op("Squeeze", y, g.ints([0]))  # the rank epsilon added, taken off again
    return g.model(y)


def test_rms_unsqueezed_after_the_root_fuses():
    _fused_one(_rms_unsqueezed_late(), op="SimplifiedLayerNormalization", epsilon=EPS, axis=-1)


@pytest.mark.parametrize("case, check", [
    (dict(shape=(4, 4, 4), restore=-2), "keepdims"),  # [4, 1, 4]: broadcasts, but along the wrong axis
    (dict(eps_shape=(1, 1, 1)), "shape"),  # epsilon raises the rank of the reduced [2, 3] to [1, 2, 3]
])
def test_rms_unsqueezed_after_near_misses(case, check):
    model = _rms_unsqueezed_late(**case)
    result = lnfuse.fuse(model)
    assert "SimplifiedLayerNormalization" not in op_types(result.model)
    assert check in _checks(result), result.report.unfused


# ---- a mean divided by x.shape[-1] ------------------------------------------------------------------------------
# The TorchScript exporter traces x.sum(-1) / x.shape[-1] with a dynamic batch as ReduceSum / Cast(Gather(Shape(x),
# 2)): Shape(x) is not a constant, but the dim it picks is.

def _sum_over_traced_count(index: int) -> onnx.ModelProto:
    g = Graph(shape=("batch", 3, H))
    n = g.op("Cast", g.op("Gather", g.op("Shape", "X"), g.ints(index)), to=onnx.TensorProto.FLOAT)
    d = g.op("Sub", "X", g.op("Div", g.op("ReduceSum", "X", g.ints([-1])), n))
    var = g.op("Div", g.op("ReduceSum", g.op("Mul", d, d), g.ints([-1])), n)
    y = g.op("Mul", d, g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const(EPS)))))
    return g.model(g.op("Add", g.op("Mul", y, g.const(GAMMA)), g.const(BETA)))


def test_mean_over_a_traced_known_dim_fuses():
    _fused_one(_sum_over_traced_count(2), epsilon=EPS, axis=-1)


def test_mean_over_a_traced_unknown_dim_is_left():
    """Divided by the batch size (a symbolic dim): not a constant, so not the mean over the last axis."""
    result = lnfuse.fuse(_sum_over_traced_count(0))
    assert "LayerNormalization" not in op_types(result.model)
