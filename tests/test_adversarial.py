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


def _layer_norm(x="x", y="y", axes=None, eps="eps", divide=None):
    """(x - mean) / sqrt(var + eps) over the last axis, axes as an input name (opset 18) or the attribute."""
    def mean(i, o):
        return oh.make_node("ReduceMean", [i, axes], [o]) if axes else oh.make_node("ReduceMean", [i], [o], axes=[-1])
    return [mean(x, "mean"), oh.make_node("Sub", [x, "mean"], ["d"]), oh.make_node("Pow", ["d", "two"], ["sq"]),
            mean("sq", "var"), oh.make_node("Add", ["var", eps], ["ve"]), oh.make_node("Sqrt", ["ve"], ["std"]),
            oh.make_node("Div", ["d", "std"], [y])]


@pytest.mark.parametrize("verify", [True, False])
def test_axes_from_integer_division_truncate_like_onnx(verify):
    # Div(-1, 2) is 0 in ONNX (toward zero), -1 in numpy (floor): the mean is over axis 0, not a norm
    nodes = [oh.make_node("Constant", [], ["m1"], value=onh.from_array(np.array([-1], np.int64))),
             oh.make_node("Constant", [], ["c2"], value=onh.from_array(np.array([2], np.int64))),
             oh.make_node("Div", ["m1", "c2"], ["axes"])] + _layer_norm(axes="axes")
    result = _assert_unchanged_meaning(_model(nodes, [_io("x", [3, H])], [_io("y", [3, H])], _consts(), opset=18),
                                       verify)
    assert "LayerNormalization" not in op_types(result.model)


@pytest.mark.parametrize("verify", [True, False])
def test_axes_from_a_function_attribute_are_not_guessed(verify):
    # the region cut out to verify would run without the call's attribute: only a check can refuse this
    def mean(i, o):
        node = oh.make_node("ReduceMean", [i], [o])
        ref = onnx.AttributeProto(name="axes", ref_attr_name="ax", type=onnx.AttributeProto.INTS)
        node.attribute.append(ref)
        return node
    body = [mean("x", "mean"), oh.make_node("Sub", ["x", "mean"], ["d"]), oh.make_node("Mul", ["d", "d"], ["sq"]),
            mean("sq", "var"), oh.make_node("Constant", [], ["eps"], value_float=1e-5),
            oh.make_node("Add", ["var", "eps"], ["ve"]), oh.make_node("Sqrt", ["ve"], ["std"]),
            oh.make_node("Div", ["d", "std"], ["y"])]
    function = oh.make_function("local", "Norm", ["x"], ["y"], body, [oh.make_opsetid("", 17)], attributes=["ax"])
    function.value_info.extend([_io(n, [3, H]) for n in ("x", "d", "sq", "y")] +
                               [_io(n, [3, 1]) for n in ("mean", "var", "ve", "std")])
    model = _model([oh.make_node("Norm", ["a"], ["ya"], domain="local", ax=[-1])], [_io("a", [3, H])],
                   [_io("ya", [3, H])], functions=[function])
    model.ir_version = 10
    result = _assert_unchanged_meaning(model, verify)
    assert {n.op_type for n in result.model.functions[0].node} >= {"ReduceMean"}
    assert any(u.check == "attribute" for u in result.report.unfused)


@pytest.mark.parametrize("verify", [True, False])
def test_float64_epsilon_that_float32_rounds_to_zero_is_refused(verify):
    nodes = [oh.make_node("Cast", ["x"], ["xd"], to=TensorProto.DOUBLE)] + _layer_norm("xd", "yd") + \
        [oh.make_node("Cast", ["yd"], ["y"], to=TensorProto.FLOAT)]
    inits = [onh.from_array(np.array(2.0), "two"), onh.from_array(np.array(1e-300), "eps")]
    model = _model(nodes, [_io("x", [3, H])], [_io("y", [3, H])], inits)
    result = lnfuse.fuse(model, verify=verify)
    assert "LayerNormalization" not in op_types(result.model)
    constant_rows = {"x": np.ones((3, H), np.float32)}  # zero variance: 0/sqrt(0 + eps) must stay 0, not NaN
    np.testing.assert_array_equal(run(result.model, constant_rows)[0], run(model, constant_rows)[0])


@pytest.mark.parametrize("verify", [True, False])
def test_broadcasting_ones_over_sigma_are_not_its_inverse(verify):
    nodes = _layer_norm() + [oh.make_node("Div", ["ones", "std"], ["inv"])]
    inits = _consts() + [onh.from_array(np.ones((2, 3, 1), np.float32), "ones")]
    model = _model(nodes, [_io("x", [3, H])], [_io("y", [3, H]), _io("inv", [2, 3, 1])], inits)
    _assert_unchanged_meaning(model, verify)


@pytest.mark.parametrize("verify", [True, False])
def test_norm_over_an_empty_axis_is_left_alone(verify):
    model = _model(_layer_norm(), [_io("x", [3, 0])], [_io("y", [3, 0])], _consts())
    result = _assert_unchanged_meaning(model, verify)
    assert "LayerNormalization" not in op_types(result.model)


@pytest.mark.parametrize("verify", [True, False])
def test_graph_output_inside_a_reshape_chain_is_kept(verify):
    shapes = [onh.from_array(np.array([12], np.int64), "s12"), onh.from_array(np.array([3, 4], np.int64), "s34")]
    nodes = _layer_norm(y="n") + [oh.make_node("Reshape", ["n", "s12"], ["flat"]),
                                  oh.make_node("Reshape", ["flat", "s34"], ["y"])]
    model = _model(nodes, [_io("x", [3, H])], [_io("y", [3, H]), _io("flat", [12])], _consts() + shapes)
    result = _assert_unchanged_meaning(model, verify)
    assert "LayerNormalization" in op_types(result.model)


def test_sparse_constants_are_read_as_their_dense_values():
    eps = oh.make_sparse_tensor(oh.make_tensor("v", TensorProto.FLOAT, [1], [1e-5]),
                                oh.make_tensor("i", TensorProto.INT64, [1], [0]), [1])
    nodes = [oh.make_node("Constant", [], ["eps_sparse"], sparse_value=eps)] + _layer_norm(eps="eps_sparse")
    model = _model(nodes, [_io("x", [3, H])], [_io("y", [3, H])], _consts())
    onnx.checker.check_model(model, full_check=True)
    result = _assert_unchanged_meaning(model, True)
    assert "LayerNormalization" in op_types(result.model)


def test_ort_only_ops_inside_functions_and_branches_can_be_read_back():
    # the default target writes ORT's SimplifiedLayerNormalization at opset 17; decompose and a second fuse must
    # accept lnfuse's own output
    rms = [oh.make_node("Mul", ["x", "x"], ["sq"]), oh.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1]),
           oh.make_node("Constant", [], ["eps"], value_float=1e-6), oh.make_node("Add", ["ms", "eps"], ["me"]),
           oh.make_node("Sqrt", ["me"], ["rms"]), oh.make_node("Div", ["x", "rms"], ["y"])]
    function = oh.make_function("local", "Rms", ["x"], ["y"], rms, [oh.make_opsetid("", 17)])
    model = _model([oh.make_node("Rms", ["a"], ["ya"], domain="local")], [_io("a", [3, H])], [_io("ya", [3, H])],
                   functions=[function])
    fused = lnfuse.fuse(model).model
    assert "SimplifiedLayerNormalization" in [n.op_type for n in fused.functions[0].node]
    assert lnfuse.fuse(fused).report.fused == []
    plain = lnfuse.decompose(fused).model
    feeds = feeds_for(model)
    np.testing.assert_allclose(run(plain, feeds)[0], run(model, feeds)[0], atol=1e-4, rtol=1e-3)
