"""Exporter quirks removed before matching: each removal is exact, and only what is provably a no-op goes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx import TensorProto

import lnfuse
from lnfuse.verification.whole_model import compare_models


def _model(nodes, inputs, outputs, inits=(), opset=18):
    graph = oh.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _ids_input():
    return oh.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])


def _feeds(batch=2, seq=5):
    return {"ids": np.random.default_rng(0).integers(0, 10, size=(batch, seq)).astype(np.int64)}


def _readers(model, name):
    return [n for n in model.graph.node if name in n.input]


@pytest.mark.parametrize("start,end", [(None, None), (1, 2), (-1, None), (0, 2)])
def test_shape_of_a_lookup_is_read_from_the_ids(start, end):
    table = onh.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table")
    attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    nodes = [oh.make_node("Gather", ["table", "ids"], ["emb"]),
             oh.make_node("Shape", ["emb"], ["shape"], **attrs),
             oh.make_node("Cast", ["shape"], ["dims"], to=TensorProto.FLOAT),
             oh.make_node("ReduceSum", ["emb"], ["total"], keepdims=0)]
    model = _model(nodes, [_ids_input()], [oh.make_tensor_value_info("dims", TensorProto.FLOAT, ["n"]),
                                          oh.make_tensor_value_info("total", TensorProto.FLOAT, [])], [table])
    fused = lnfuse.fuse(model).model
    assert [n.op_type for n in _readers(fused, "emb")] == ["ReduceSum"], "no Shape reads the lookup any more"
    assert compare_models(model, fused, _feeds())["ok"]
    onnx.checker.check_model(fused, full_check=True)


def test_shape_after_picking_the_last_feature_of_a_lookup():
    # BART: input_shape = inputs_embeds[:, :, -1].shape
    table = onh.from_array(np.ones((10, 4), dtype=np.float32), "table")
    last = onh.from_array(np.array(-1, dtype=np.int64), "last")
    nodes = [oh.make_node("Gather", ["table", "ids"], ["emb"]),
             oh.make_node("Gather", ["emb", "last"], ["picked"], axis=2),
             oh.make_node("Shape", ["picked"], ["shape"])]
    model = _model(nodes, [_ids_input()], [oh.make_tensor_value_info("shape", TensorProto.INT64, ["n"])],
                   [table, last])
    fused = lnfuse.fuse(model).model
    assert [n.op_type for n in fused.graph.node] == ["Shape"] and list(fused.graph.node[0].input) == ["ids"]
    assert compare_models(model, fused, _feeds())["ok"]


def test_lookup_in_an_overridable_table_keeps_its_shape():
    # a graph input with an initializer can be fed with another width: its shape is not known before it runs
    table = onh.from_array(np.ones((10, 4), dtype=np.float32), "table")
    nodes = [oh.make_node("Gather", ["table", "ids"], ["emb"]), oh.make_node("Shape", ["emb"], ["shape"])]
    model = _model(nodes, [_ids_input(), oh.make_tensor_value_info("table", TensorProto.FLOAT, [10, 4])],
                   [oh.make_tensor_value_info("shape", TensorProto.INT64, ["n"])], [table])
    fused = lnfuse.fuse(model).model
    assert [n.op_type for n in _readers(fused, "emb")] == ["Shape"]


@pytest.mark.parametrize("one,removed", [
    (np.array(1.0, dtype=np.float32), True),
    (np.array([1.0], dtype=np.float32), True),
    (np.ones((1, 1, 1), dtype=np.float32), False),   # raises x's rank from 2 to 3
    (np.ones(2, dtype=np.float32), False),           # not one element
    (np.array(1.0000001, dtype=np.float32), False),
])
def test_multiplication_by_one(one, removed):
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])
    nodes = [oh.make_node("Mul", ["x", "one"], ["y"]), oh.make_node("Neg", ["y"], ["out"])]
    model = _model(nodes, [x], [oh.make_tensor_value_info("out", TensorProto.FLOAT, ["a", "b"])],
                   [onh.from_array(one, "one")])
    fused = lnfuse.fuse(model).model
    assert ("Mul" not in [n.op_type for n in fused.graph.node]) == removed
    assert compare_models(model, fused, {"x": np.random.default_rng(1).standard_normal((3, 2), dtype=np.float32)})[
        "ok"]


def test_rewritten_shapes_in_branches_get_names_unique_in_the_model():
    # subgraphs see the names of the graph around them: a name reused there makes the model invalid
    table = onh.from_array(np.ones((10, 4), dtype=np.float32), "table")

    def branch(tag):
        return oh.make_graph([oh.make_node("Gather", ["table", "ids"], [f"emb_{tag}"]),
                              oh.make_node("Shape", [f"emb_{tag}"], [f"shape_{tag}"])], tag, [],
                             [oh.make_tensor_value_info(f"shape_{tag}", TensorProto.INT64, ["n"])])
    nodes = [oh.make_node("Gather", ["table", "ids"], ["emb"]), oh.make_node("Shape", ["emb"], ["shape"]),
             oh.make_node("If", ["cond"], ["picked"], then_branch=branch("a"), else_branch=branch("b"))]
    model = _model(nodes, [_ids_input(), oh.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                   [oh.make_tensor_value_info("picked", TensorProto.INT64, ["n"]),
                    oh.make_tensor_value_info("shape", TensorProto.INT64, ["n"])], [table])
    fused = lnfuse.fuse(model).model
    onnx.checker.check_model(fused, full_check=True)
    feeds = {**_feeds(), "cond": np.array(True)}
    assert compare_models(model, fused, feeds)["ok"]


@pytest.mark.parametrize("dim", ["s0 % (s1 - s1)", "1000000*1000000", "batch*sequence"])
def test_dims_written_as_expressions_never_break_verification(dim):
    # ORT's symbolic inference writes dims like batch*sequence; a name that only looks like arithmetic gets a
    # size of its own
    x = [oh.make_tensor_value_info(n, TensorProto.FLOAT, [dim, 8]) for n in ("a", "b")]
    nodes = [oh.make_node("Add", ["a", "b"], ["s"]),
             oh.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], epsilon=1e-5)]
    inits = [onh.from_array(np.linspace(0.5, 2, 8).astype(np.float32), "gamma"),
             onh.from_array(np.linspace(-1, 1, 8).astype(np.float32), "beta")]
    model = _model(nodes, x, [oh.make_tensor_value_info("y", TensorProto.FLOAT, [dim, 8])], inits, opset=17)
    result = lnfuse.fuse(model)
    assert [f.op_type for f in result.report.fused] == ["SkipLayerNormalization"]


def test_castlike_of_a_known_dtype_becomes_a_cast_that_no_longer_reads_the_tensor():
    # onnxscript's literal: CastLike(1.5, x) * x; the Cast computes the same bits and does not read x
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 3])
    nodes = [oh.make_node("Constant", [], ["c"], value=onh.from_array(np.array(1.5, np.float32))),
             oh.make_node("CastLike", ["c", "x"], ["c_like"]),
             oh.make_node("Mul", ["c_like", "x"], ["y"])]
    model = _model(nodes, [x], [oh.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 3])])
    result = lnfuse.fuse(model)
    ops = [n.op_type for n in result.model.graph.node]
    assert "CastLike" not in ops and "Cast" in ops
    cast = next(n for n in result.model.graph.node if n.op_type == "Cast")
    assert list(cast.input) == ["c"] and oh.get_attribute_value(cast.attribute[0]) == TensorProto.FLOAT16
    assert any("CastLike" in note for note in result.report.notes)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float16)}
    comparison = compare_models(model, result.model, feeds)
    assert comparison["ok"] and max(comparison["outputs"].values()) == 0
