"""Norms inside subgraphs and functions, norms whose statistics are read elsewhere, and the Keras folded form."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
from onnx import TensorProto

import lnfuse
from normgraphs import Spec, build, feeds_for, op_types, run


def _all_op_types(model: onnx.ModelProto) -> list[str]:
    ops = []

    def walk(graph):
        for node in graph.node:
            ops.append(node.op_type)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)

    walk(model.graph)
    for f in model.functions:
        ops.extend(n.op_type for n in f.node)
    return ops


def _same_outputs(a: onnx.ModelProto, b: onnx.ModelProto, feeds: dict) -> None:
    for want, got in zip(run(a, feeds), run(b, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_norm_inside_if_branches_is_fused():
    inner = build(Spec(opset=17)).graph
    then_graph = oh.make_graph(list(inner.node), "then", [], [oh.make_tensor_value_info(inner.output[0].name,
                               TensorProto.FLOAT, [3, 2, 8])], list(inner.initializer))
    else_graph = oh.make_graph([oh.make_node("Identity", ["X"], ["x_copy"])], "else", [],
                               [oh.make_tensor_value_info("x_copy", TensorProto.FLOAT, [3, 2, 8])])
    node = oh.make_node("If", ["cond"], ["Y"], then_branch=then_graph, else_branch=else_graph)
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("cond", TensorProto.BOOL, []),
                                        inner.input[0]], [oh.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 2, 8])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    result = lnfuse.fuse(model)
    ops = _all_op_types(result.model)
    assert "LayerNormalization" in ops and "ReduceMean" not in ops
    assert result.report.fused[0].graph.startswith("main/")
    onnx.checker.check_model(result.model, full_check=True)
    feeds = feeds_for(build(Spec()))
    for cond in (True, False):
        _same_outputs(model, result.model, {"cond": np.array(cond), **feeds})


def test_norm_inside_model_local_function_is_fused():
    inner = build(Spec(opset=18, eps_node=True)).graph
    consts = [oh.make_node("Constant", [], [t.name], value=t) for t in inner.initializer]
    function = oh.make_function("local", "Norm", ["X"], [inner.output[0].name], consts + list(inner.node),
                                [oh.make_opsetid("", 18)])
    call = oh.make_node("Norm", ["X"], ["Y"], domain="local")
    graph = oh.make_graph([call], "g", [inner.input[0]], [oh.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 2, 8])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("local", 1)],
                          functions=[function])
    model.ir_version = 8
    result = lnfuse.fuse(model)
    body = [n.op_type for n in result.model.functions[0].node]
    assert "LayerNormalization" in body and "ReduceMean" not in body, body
    onnx.checker.check_model(result.model, full_check=True)
    _same_outputs(model, result.model, feeds_for(build(Spec())))


def _training_style(read: str) -> onnx.ModelProto:
    """A norm whose mean (or 1/std) is also a graph output, as training graphs keep them for the backward pass."""
    x = oh.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3, 8])
    nodes = [
        oh.make_node("ReduceMean", ["X"], ["mean"], axes=[-1]),
        oh.make_node("Sub", ["X", "mean"], ["d"]),
        oh.make_node("Mul", ["d", "d"], ["sq"]),
        oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
        oh.make_node("Add", ["var", "eps"], ["ve"]),
        oh.make_node("Sqrt", ["ve"], ["std"]),
        oh.make_node("Reciprocal", ["std"], ["inv"]),
        oh.make_node("Mul", ["d", "inv"], ["n"]),
        oh.make_node("Mul", ["n", "gamma"], ["Y"]),
    ]
    rng = np.random.default_rng(0)
    inits = [onh.from_array(np.array(1e-5, np.float32), "eps"),
             onh.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "gamma")]
    outputs = [oh.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3, 8]),
               oh.make_tensor_value_info(read, TensorProto.FLOAT, [2, 3, 1])]
    model = oh.make_model(oh.make_graph(nodes, "train", [x], outputs, inits),
                          opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_mean_and_inv_std_read_elsewhere_become_layer_norm_outputs():
    for read, index in (("mean", 1), ("inv", 2)):
        model = _training_style(read)
        result = lnfuse.fuse(model)
        assert op_types(result.model) == ["LayerNormalization"], result.report.unfused
        node = result.model.graph.node[0]
        assert node.output[index] == read, "the graph output keeps its name"
        onnx.checker.check_model(result.model, full_check=True)
        _same_outputs(model, result.model, feeds_for(model))


def test_intermediate_that_cannot_be_exposed_blocks_fusion():
    model = _training_style("mean")
    model.graph.output[1].name = "d"
    model.graph.output[1].type.tensor_type.shape.dim[2].dim_value = 8
    result = lnfuse.fuse(model)
    assert "LayerNormalization" not in op_types(result.model)
    assert any(u.check == "intermediate" and "'d'" in u.reason for u in result.report.unfused)


def _keras_folded(with_beta: bool) -> onnx.ModelProto:
    """tf2onnx's form of Keras LayerNormalization: y = x*k + (beta - mean*k), k = gamma / sqrt(var + eps)."""
    nodes = [
        oh.make_node("ReduceMean", ["X"], ["mean"], axes=[-1]),
        oh.make_node("Sub", ["X", "mean"], ["d"]),
        oh.make_node("Mul", ["d", "d"], ["sq"]),
        oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
        oh.make_node("Add", ["var", "eps"], ["ve"]),
        oh.make_node("Sqrt", ["ve"], ["std"]),
        oh.make_node("Reciprocal", ["std"], ["inv"]),
        oh.make_node("Mul", ["inv", "gamma"], ["k"]),
        oh.make_node("Mul", ["X", "k"], ["xk"]),
        oh.make_node("Mul", ["mean", "k"], ["mk"]),
    ]
    nodes += [oh.make_node("Sub", ["beta", "mk"], ["shift"]), oh.make_node("Add", ["xk", "shift"], ["Y"])] \
        if with_beta else [oh.make_node("Sub", ["xk", "mk"], ["Y"])]
    rng = np.random.default_rng(1)
    inits = [onh.from_array(np.array(1e-3, np.float32), "eps"),
             onh.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "gamma"),
             onh.from_array(rng.normal(size=8).astype(np.float32), "beta")]
    graph = oh.make_graph(nodes, "keras", [oh.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 8])],
                          [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 8])],
                          inits if with_beta else inits[:2])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_keras_folded_affine_is_a_layer_norm():
    for with_beta in (True, False):
        model = _keras_folded(with_beta)
        result = lnfuse.fuse(model)
        assert op_types(result.model) == ["LayerNormalization"], result.report.unfused
        assert len(result.model.graph.node[0].input) == (3 if with_beta else 2)
        onnx.checker.check_model(result.model, full_check=True)
        _same_outputs(model, result.model, feeds_for(model))


def test_unsqueeze_restoring_other_axes_is_refused():
    model = build(Spec(keepdims0=True, opset=17))
    for node in model.graph.node:
        if node.op_type == "Unsqueeze":
            axes = next(i for i in model.graph.initializer if i.name == node.input[1])
            axes.CopyFrom(onh.from_array(np.array([0], np.int64), axes.name))
            break
    result = lnfuse.fuse(model)
    assert "LayerNormalization" not in op_types(result.model)
    assert any(u.check == "keepdims" for u in result.report.unfused)


def test_tf2onnx_global_average_pool_mean():
    """tf2onnx writes a mean over the trailing axes as GlobalAveragePool (every axis after the second)."""
    nodes = [
        oh.make_node("GlobalAveragePool", ["X"], ["mean"]),
        oh.make_node("Sub", ["X", "mean"], ["d"]),
        oh.make_node("Mul", ["d", "d"], ["sq"]),
        oh.make_node("GlobalAveragePool", ["sq"], ["var"]),
        oh.make_node("Add", ["var", "eps"], ["ve"]),
        oh.make_node("Sqrt", ["ve"], ["std"]),
        oh.make_node("Reciprocal", ["std"], ["inv"]),
        oh.make_node("Mul", ["inv", "gamma"], ["k"]),
        oh.make_node("Mul", ["X", "k"], ["xk"]),
        oh.make_node("Mul", ["mean", "k"], ["mk"]),
        oh.make_node("Sub", ["beta", "mk"], ["shift"]),
        oh.make_node("Add", ["xk", "shift"], ["Y"]),
    ]
    rng = np.random.default_rng(2)
    inits = [onh.from_array(np.array(1e-3, np.float32), "eps"),
             onh.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "gamma"),
             onh.from_array(rng.normal(size=8).astype(np.float32), "beta")]
    graph = oh.make_graph(nodes, "keras", [oh.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3, 8])],
                          [oh.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3, 8])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    result = lnfuse.fuse(model)
    assert op_types(result.model) == ["LayerNormalization"], result.report.unfused
    _same_outputs(model, result.model, feeds_for(model))


def test_a_build_let_go_leaves_no_reader_behind():
    """A node a rule made for a rewrite that is then refused reads its inputs from the moment it exists; let go, it
    must read nothing, or the clean-up would keep the values it read alive and later checks would see a reader."""
    import onnx_ir as ir

    from lnfuse.match.rule import GraphContext

    x = ir.Value(name="x")
    graph = ir.Graph([x], [], nodes=[])
    ctx = GraphContext(graph, 17, "ort", "main", set())
    ctx.node("Transpose", [x], {"perm": [1, 0]})
    assert len(list(x.uses())) == 1
    ctx.settle(keep=False)
    assert list(x.uses()) == []
    kept = ctx.node("Neg", [x])
    ctx.settle(keep=True)
    assert [use.node for use in x.uses()] == [kept]
