"""Graphs built to fool the matcher: each must come out computing exactly what it computed before (fused only
where that is provable), with verification on and off."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx import TensorProto

import lnfuse
from normgraphs import feeds_for, op_types, run

H = 4


def _model(nodes, inputs, outputs, inits=(), opset=17, functions=()) -> onnx.ModelProto:
    model = oh.make_model(oh.make_graph(nodes, "adv", inputs, outputs, list(inits)),
                          opset_imports=[oh.make_opsetid("", opset)] + [
                              oh.make_opsetid(f.domain, 1) for f in functions], functions=list(functions))
    model.ir_version = 8
    return model


def _io(name, shape):
    return oh.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _consts():
    return [onh.from_array(np.array(2.0, np.float32), "two"), onh.from_array(np.array(1e-5, np.float32), "eps")]


def _assert_unchanged_meaning(model: onnx.ModelProto, verify: bool) -> lnfuse.FuseResult:
    result = lnfuse.fuse(model, verify=verify)
    feeds = feeds_for(model)
    for want, got in zip(run(model, feeds), run(result.model, feeds)):
        assert want.shape == got.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)
    return result


@pytest.mark.parametrize("verify", [True, False])
def test_duplicated_sub_with_another_mean_is_not_a_duplicate(verify):
    nodes = [oh.make_node("ReduceMean", ["x"], ["m1"], axes=[-1]),
             oh.make_node("ReduceMean", ["x"], ["m2"], axes=[0]),
             oh.make_node("Sub", ["x", "m1"], ["d1"]),
             oh.make_node("Sub", ["x", "m2"], ["d2"]),
             oh.make_node("Pow", ["d2", "two"], ["sq"]),
             oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             oh.make_node("Add", ["var", "eps"], ["ve"]),
             oh.make_node("Sqrt", ["ve"], ["std"]),
             oh.make_node("Div", ["d1", "std"], ["y"])]
    result = _assert_unchanged_meaning(_model(nodes, [_io("x", [4, H])], [_io("y", [4, H])], _consts()), verify)
    assert "LayerNormalization" not in op_types(result.model)


@pytest.mark.parametrize("verify", [True, False])
def test_folded_form_needs_the_same_k_twice(verify):
    nodes = [oh.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
             oh.make_node("Sub", ["x", "mean"], ["d"]),
             oh.make_node("Mul", ["d", "d"], ["sq"]),
             oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             oh.make_node("Add", ["var", "eps"], ["ve"]),
             oh.make_node("Sqrt", ["ve"], ["std"]),
             oh.make_node("Reciprocal", ["std"], ["inv"]),
             oh.make_node("Mul", ["inv", "gamma"], ["k"]),
             oh.make_node("Mul", ["x", "k"], ["xk"]),
             oh.make_node("Mul", ["mean", "inv"], ["mk"]),  # gamma missing here
             oh.make_node("Sub", ["beta", "mk"], ["shift"]),
             oh.make_node("Add", ["xk", "shift"], ["y"])]
    inits = _consts() + [onh.from_array(np.full(H, 3.0, np.float32), "gamma"),
                         onh.from_array(np.ones(H, np.float32), "beta")]
    result = _assert_unchanged_meaning(_model(nodes, [_io("x", [4, H])], [_io("y", [4, H])], inits), verify)
    assert "LayerNormalization" not in op_types(result.model)


@pytest.mark.parametrize("verify", [True, False])
def test_gamma_computed_from_the_norms_own_mean(verify):
    nodes = [oh.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
             oh.make_node("Sub", ["x", "mean"], ["d"]),
             oh.make_node("Pow", ["d", "two"], ["sq"]),
             oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             oh.make_node("Add", ["var", "eps"], ["ve"]),
             oh.make_node("Sqrt", ["ve"], ["std"]),
             oh.make_node("Div", ["d", "std"], ["n"]),
             oh.make_node("Mul", ["n", "mean"], ["y"])]
    _assert_unchanged_meaning(_model(nodes, [_io("x", [4, H])], [_io("y", [4, H])], _consts()), verify)


@pytest.mark.parametrize("verify", [True, False])
def test_epsilon_that_would_broadcast_the_rank_is_refused(verify):
    nodes = [oh.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
             oh.make_node("Sub", ["x", "mean"], ["d"]),
             oh.make_node("Pow", ["d", "two"], ["sq"]),
             oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             oh.make_node("Add", ["var", "eps3"], ["ve"]),
             oh.make_node("Sqrt", ["ve"], ["std"]),
             oh.make_node("Div", ["d", "std"], ["y"])]
    inits = _consts() + [onh.from_array(np.full([3, 1, 1], 1e-5, np.float32), "eps3")]
    result = _assert_unchanged_meaning(_model(nodes, [_io("x", [4, H])], [_io("y", [3, 4, H])], inits), verify)
    assert "LayerNormalization" not in op_types(result.model)


def test_function_called_with_two_ranks_is_left_alone():
    body = [oh.make_node("ReduceMean", ["x"], ["mean"], axes=[1]),
            oh.make_node("Sub", ["x", "mean"], ["d"]),
            oh.make_node("Mul", ["d", "d"], ["sq"]),
            oh.make_node("ReduceMean", ["sq"], ["var"], axes=[1]),
            oh.make_node("Constant", [], ["eps"], value=onh.from_array(np.array(1e-5, np.float32))),
            oh.make_node("Add", ["var", "eps"], ["ve"]),
            oh.make_node("Sqrt", ["ve"], ["std"]),
            oh.make_node("Div", ["d", "std"], ["y"])]
    function = oh.make_function("local", "Norm", ["x"], ["y"], body, [oh.make_opsetid("", 17)])
    calls = [oh.make_node("Norm", ["a"], ["ya"], domain="local"), oh.make_node("Norm", ["b"], ["yb"], domain="local")]
    model = _model(calls, [_io("a", [2, H]), _io("b", [2, H, H])], [_io("ya", [2, H]), _io("yb", [2, H, H])],
                   functions=[function])
    for verify in (True, False):
        result = _assert_unchanged_meaning(model, verify)
        assert "LayerNormalization" not in [n.op_type for n in result.model.functions[0].node]


def test_integer_cast_of_the_normalized_value_is_kept():
    nodes = [oh.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
             oh.make_node("Sub", ["x", "mean"], ["d"]),
             oh.make_node("Pow", ["d", "two"], ["sq"]),
             oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             oh.make_node("Add", ["var", "eps"], ["ve"]),
             oh.make_node("Sqrt", ["ve"], ["std"]),
             oh.make_node("Div", ["d", "std"], ["n"]),
             oh.make_node("Cast", ["n"], ["ni"], to=TensorProto.INT32),
             oh.make_node("Cast", ["ni"], ["y"], to=TensorProto.FLOAT)]
    for verify in (True, False):
        result = _assert_unchanged_meaning(_model(nodes, [_io("x", [4, H])], [_io("y", [4, H])], _consts()), verify)
        assert op_types(result.model).count("Cast") == 2
