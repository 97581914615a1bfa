"""Red team, round 5: norms in a transposed layout, embedding lookups seen through views, and the load repairs
("ai.onnx" domain, functions at another opset, duplicate names). Hostile-but-valid models (each loads in ONNX
Runtime unless a test says otherwise) built to make lnfuse change what a model computes, write a model that does
not load, crash, or accept a model ORT refuses.

Holes are ``xfail(strict=True)`` tests asserting the right behaviour; the passing tests cover cases no other test
file builds (a Transpose with its default perm, a multi-axis norm transposed after gamma, a permutation that fixes
the reduced axis and moves the others, a restore to the wrong axis in a transposed layout, a lookup whose positions
and target come from the shape of symbolic ids, both spellings of the default domain in the order ORT honours).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from normgraphs import EmbedBlock, LayoutGraph, session
from onnx import TensorProto

import lnfuse
from lnfuse.cli import main

FLOAT = TensorProto.FLOAT
RNG = np.random.default_rng(5)




def _feeds(shape_of_batch, batches=(1, 3)) -> list[dict[str, np.ndarray]]:
    """Random rows, rows of large magnitude with an offset, and constant rows, for each batch size."""
    feeds = []
    for b in batches:
        shape = shape_of_batch(b)
        for scale, offset in ((1.0, 0.0), (1000.0, 3.0), (0.0, 2.0)):
            feeds.append({"X": (RNG.standard_normal(shape) * scale + offset).astype(np.float32)})
    return feeds


def _same(original: onnx.ModelProto, fused: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> None:
    before, after = session(original), session(fused)
    for feed in feeds:
        for want, got in zip(before.run(None, feed), after.run(None, feed)):
            assert got.shape == want.shape, f"shape {got.shape}, the original gives {want.shape}"
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _reasons(result: lnfuse.FuseResult) -> list[tuple[str, str]]:
    return [(u.check, u.reason) for u in result.report.unfused]


def _cli(model: onnx.ModelProto, folder: Path, capsys, *args: str) -> tuple[int, str, Path]:
    path = folder / "model.onnx"
    onnx.save(model, path)
    out = folder / "out" / "fused.onnx"
    out.parent.mkdir()
    code = main([str(path), "-o", str(out), *args])
    return code, capsys.readouterr().err, out


# ---- norms in a transposed layout -------------------------------------------------------------------------------

N = 6


def _mean_read_in_two_layouts() -> onnx.ModelProto:
    """One-pass LayerNorm ``(T(x) - T(m)) * (T(E[x²]) - m² + eps)^-1/2`` with T = [0, 2, 1], m = mean(x, -1):
    the mean is read transposed in the numerator and as it is in ``m²``, both in the output's frame. The shapes
    broadcast ([B, 1, N] - [B, N, 1] is [B, N, N]) but the variance of element (b, i, j) mixes row j's E[x²] with row
    i's mean: not a norm. ``check_layouts`` records only the transposed read of the shared mean node (a read
    without views is not recorded), so both names 'mean' and 'vmean' are proved laid out like x."""
    g = LayoutGraph()
    axes = g.const([-1], np.int64)
    m = g.op("ReduceMean", "X", axes, keepdims=1)
    e2 = g.op("ReduceMean", g.op("Mul", "X", "X"), axes, keepdims=1)
    numerator = g.op("Sub", g.t("X", [0, 2, 1]), g.t(m, [0, 2, 1]))
    var_eps = g.op("Add", g.op("Sub", g.t(e2, [0, 2, 1]), g.op("Mul", m, m)), g.const(1e-5))
    y = g.op("Mul", numerator, g.op("Reciprocal", g.op("Sqrt", var_eps)))
    return g.model(y, ["B", N, N], ["B", N, N])


def test_a_mean_read_transposed_and_as_it_is_is_not_fused_without_verification():
    model = _mean_read_in_two_layouts()
    result = lnfuse.fuse(model, verify=False)
    assert "LayerNormalization" not in _ops(result.model), _ops(result.model)
    assert any(check == "layout" for check, _ in _reasons(result)), _reasons(result)


def test_a_mean_read_transposed_and_as_it_is_is_stopped_by_verification():
    """The same model with verification on: ORT's numbers disagree, so nothing is rewritten (the algebra's miss is
    caught only by the measurement)."""
    model = _mean_read_in_two_layouts()
    result = lnfuse.fuse(model)
    assert "LayerNormalization" not in _ops(result.model)
    _same(model, result.model, [f for f in _feeds(lambda b: (b, N, N)) if f["X"].std() > 0])


def test_a_transpose_with_its_default_perm_reverses_the_axes():
    """vmap's RMS norm written with Transposes that omit perm (the default reverses the axes): h in [C, B, C] is read
    as [C, B, C] reversed; the norm is over the last axis of the reversed layout, gamma laid out as [C]."""
    c = 4
    g = LayoutGraph()
    w = g.const(RNG.uniform(0.5, 1.5, (c, 1, 1)))
    numerator = g.t(g.op("Mul", w, "X"), None)
    inv = g.inv_rms(g.t(g.op("Mul", "X", "X"), None), [-1])
    model = g.model(g.op("Mul", inv, numerator), [c, "B", c], [c, "B", c])
    result = lnfuse.fuse(model, verify=False)
    assert _ops(result.model).count("SimplifiedLayerNormalization") == 1, (_ops(result.model), _reasons(result))
    _same(model, result.model, _feeds(lambda b: (c, b, c), batches=(1, 2, 5)))


@pytest.mark.parametrize("gamma_in", ["x_layout", "output_layout"])
def test_a_two_axis_layer_norm_transposed_after_gamma(gamma_in):
    """LayerNorm of x [B, A, C] over axes 1 and 2, then Transpose [0, 2, 1]: a LayerNorm of T(x) over its two
    trailing axes, gamma [1, A, C] applied before the Transpose (laid out anew as [C, A]) or [C, A] after it."""
    a, c = 3, 5
    g = LayoutGraph()
    mean = g.op("ReduceMean", "X", g.const([1, 2], np.int64), keepdims=1)
    d = g.op("Sub", "X", mean)
    normalized = g.op("Mul", d, g.inv_rms(g.op("Mul", d, d), [1, 2]))
    if gamma_in == "x_layout":
        y = g.t(g.op("Mul", normalized, g.const(RNG.uniform(0.5, 1.5, (1, a, c)))), [0, 2, 1])
    else:
        y = g.op("Mul", g.t(normalized, [0, 2, 1]), g.const(RNG.uniform(0.5, 1.5, (c, a))))
    model = g.model(y, ["B", c, a], ["B", a, c])
    result = lnfuse.fuse(model, verify=False)
    assert _ops(result.model).count("LayerNormalization") == 1, (_ops(result.model), _reasons(result))
    assert "Mul" not in _ops(result.model), "gamma is the fused op's scale"
    _same(model, result.model, _feeds(lambda b: (b, a, c)))


def test_a_permutation_that_fixes_the_reduced_axis_keeps_gamma_on_the_axis_it_moved():
    """T = [1, 0, 2] leaves the reduced axis where it is and swaps the others; gamma [C, 1, 1] varies along x's axis
    0, which T moves to axis 1 of the output: not the normalized axis, so gamma cannot be the fused op's scale."""
    c = 4
    g = LayoutGraph()
    w = g.const(RNG.uniform(0.5, 1.5, (c, 1, 1)))
    numerator = g.t(g.op("Mul", w, "X"), [1, 0, 2])
    inv = g.inv_rms(g.t(g.op("Mul", "X", "X"), [1, 0, 2]), [-1])
    model = g.model(g.op("Mul", inv, numerator), [c, c, c], [c, c, c])
    result = lnfuse.fuse(model, verify=False)
    fused_scales = [n for n in result.model.graph.node if "Normalization" in n.op_type]
    assert not fused_scales or "Mul" in _ops(result.model), _ops(result.model)
    assert any(check == "gamma" for check, _ in _reasons(result)), _reasons(result)
    _same(model, result.model, _feeds(lambda b: (c, c, c), batches=(1,)))


def test_a_keepdims0_statistic_restored_on_the_wrong_axis_of_a_transposed_layout_is_refused():
    """vmap's layout with the reduced statistic [B, S] reshaped to [B, 1, S] (S = C, so it broadcasts) instead of
    [B, S, 1]: row (b, s) would be scaled by the statistic of (b, c)."""
    c = 4
    g = LayoutGraph()
    w = g.const(RNG.uniform(0.5, 1.5, (c, 1, 1)))
    numerator = g.t(g.op("Mul", w, "X"), [1, 2, 0])
    var = g.op("ReduceMean", g.t(g.op("Mul", "X", "X"), [1, 2, 0]), g.const([-1], np.int64), keepdims=0)
    target = g.op("Concat", g.op("Shape", var, start=0, end=1), g.const([1, c], np.int64), axis=0)
    restored = g.op("Reshape", var, target)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", restored, g.const(1e-5))))
    model = g.model(g.op("Mul", inv, numerator), ["B", c, c], [c, "B", c])
    result = lnfuse.fuse(model, verify=False)
    assert not [o for o in _ops(result.model) if "Normalization" in o], _ops(result.model)
    assert any(check == "keepdims" for check, _ in _reasons(result)), _reasons(result)
    _same(model, result.model, _feeds(lambda b: (c, b, c)))


# ---- embedding lookups seen through views -------------------------------------------------------------------------

def test_a_flattened_lookup_with_symbolic_batch_and_sequence_and_range_positions():
    """MindSpore's flattened lookup with both dims symbolic: ids [batch, seq] looked up flat, reshaped back to
    Concat(Shape(ids), [H]); positions Range(0, Shape(ids)[1]) looked up and unsqueezed. Fused, and the same
    numbers for batch 1 and 3, sequence 1 and 5."""
    h, v, p = 8, 20, 16
    i64 = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    g = EmbedBlock(ids_shape=("batch", "seq"))
    flat = g.node("Reshape", ["ids", g.const("minus_one", i64([-1]))], "flat")
    rows = g.node("Gather", [g.table("word", v), flat], "word_rows")
    target = g.node("Concat", [g.node("Shape", ["ids"], "ids_shape"), g.const("hidden", i64([h]))], "back", axis=0)
    word = g.node("Reshape", [rows, target], "word_emb")
    seq = g.node("Gather", [g.node("Shape", ["ids"], "ids_shape2"), g.const("one", i64(1))], "seq_len")
    positions = g.node("Range", [g.const("zero", i64(0)), seq, g.const("step", i64(1))], "positions")
    pos = g.node("Unsqueeze", [g.node("Gather", [g.table("pos", p), positions], "pos_rows"),
                               g.const("axis0", i64([0]))], "pos_emb")
    model = g.norm(g.node("Add", [word, pos], "s"))
    result = lnfuse.fuse(model)
    assert "EmbedLayerNormalization" in _ops(result.model), (_ops(result.model), _reasons(result))
    rng = np.random.default_rng(0)
    feeds = [{"ids": rng.integers(0, v, size=(b, s)).astype(np.int64)} for b in (1, 3) for s in (1, 5)]
    before, after = session(model), session(result.model)
    for feed in feeds:
        np.testing.assert_allclose(after.run(None, feed)[0], before.run(None, feed)[0], atol=1e-4, rtol=1e-3)


# ---- load repairs: the default domain under two names, functions ----------------------------------------------------

def _softmax_model(imports: list[tuple[str, int]]) -> onnx.ModelProto:
    """Softmax(axis=1) of [2, 3, 4]: opset 11 normalizes over the flattened axes 1..2, opset 13 over axis 1."""
    graph = oh.make_graph([oh.make_node("Softmax", ["X"], ["Y"], name="softmax", axis=1)], "g",
                          [oh.make_tensor_value_info("X", FLOAT, [2, 3, 4])],
                          [oh.make_tensor_value_info("Y", FLOAT, [2, 3, 4])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid(d, v) for d, v in imports])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("imports", [
    [("", 11), ("ai.onnx", 18)],
    [("", 18), ("ai.onnx", 11)],
    [("ai.onnx", 18), ("", 11)],
    [("ai.onnx", 11), ("", 18)],
], ids=["default_11_alias_18", "default_18_alias_11", "alias_18_default_11", "alias_11_default_18"])
def test_the_default_domain_under_both_names_runs_at_the_version_ort_runs(tmp_path: Path, capsys, imports):
    model = _softmax_model(imports)
    feeds = [{"X": RNG.standard_normal((2, 3, 4)).astype(np.float32)}]
    session(model).run(None, feeds[0])
    code, err, out = _cli(model, tmp_path, capsys)
    assert code == 0, err
    _same(model, onnx.load(out), feeds)


def _function_model(function_imports, node_domain: str, model_imports) -> onnx.ModelProto:
    body = [oh.make_node("Softmax", ["X"], ["Y"], name="softmax", axis=1, domain=node_domain)]
    function = oh.make_function("local", "F", ["X"], ["Y"], body, [oh.make_opsetid(d, v) for d, v in function_imports])
    graph = oh.make_graph([oh.make_node("F", ["X"], ["Y"], domain="local", name="call")], "g",
                          [oh.make_tensor_value_info("X", FLOAT, [2, 3, 4])],
                          [oh.make_tensor_value_info("Y", FLOAT, [2, 3, 4])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid(d, v) for d, v in model_imports] +
                          [oh.make_opsetid("local", 1)], functions=[function])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("function_imports, node_domain", [
    ([("ai.onnx", 11)], ""), ([("ai.onnx", 11)], "ai.onnx"), ([("", 11)], "ai.onnx")],
    ids=["import_alias_node_default", "import_alias_node_alias", "import_default_node_alias"])
def test_the_ai_onnx_domain_inside_a_function_is_refused_as_ort_refuses_it(tmp_path: Path, capsys,
                                                                             function_imports, node_domain):
    model = _function_model(function_imports, node_domain, [("", 17)])
    with pytest.raises(Exception):
        session(model)
    code, err, out = _cli(model, tmp_path, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_node_named_like_an_inlined_function_node_is_refused_as_ort_refuses_it(tmp_path: Path, capsys):
    # ORT names the first copy of function F's node n '_inlfunc_F_n' when it inlines a call, and refuses a graph
    # whose own node already has that name
    function = oh.make_function("local", "F", ["X"], ["Y"], [oh.make_node("Relu", ["X"], ["Y"], name="n")],
                                [oh.make_opsetid("", 17)])
    graph = oh.make_graph([oh.make_node("F", ["X"], ["a"], domain="local", name="call"),
                           oh.make_node("Neg", ["a"], ["Y"], name="_inlfunc_F_n")], "g",
                          [oh.make_tensor_value_info("X", FLOAT, [2, 3, 4])],
                          [oh.make_tensor_value_info("Y", FLOAT, [2, 3, 4])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("local", 1)],
                          functions=[function])
    model.ir_version = 8
    with pytest.raises(Exception, match="same node name"):
        session(model)
    code, err, out = _cli(model, tmp_path, capsys)
    assert code == 2, err
    assert not out.exists()


@pytest.mark.parametrize("calls, graph_name, function_name", [
    (2, "_inlfunc_F_n_1", "n"),  # the second call's copy is not named so
    (1, "_inlfunc_F_", None),  # an unnamed node of the function has no name to clash with
    (1, "_inlfunc_F_call_n", "n"),  # the call's own name is not in the copy's name
])
def test_names_near_an_inlined_function_node_are_accepted_as_ort_accepts_them(tmp_path: Path, capsys, calls: int,
                                                                              graph_name: str, function_name):
    function = oh.make_function("local", "F", ["X"], ["Y"], [oh.make_node("Relu", ["X"], ["Y"], name=function_name)],
                                [oh.make_opsetid("", 17)])
    nodes = [oh.make_node("F", ["X" if i == 0 else f"a{i - 1}"], [f"a{i}"], domain="local", name=f"call{i or ''}")
             for i in range(calls)]
    nodes.append(oh.make_node("Neg", [f"a{calls - 1}"], ["Y"], name=graph_name))
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("X", FLOAT, [2, 3, 4])],
                          [oh.make_tensor_value_info("Y", FLOAT, [2, 3, 4])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("local", 1)],
                          functions=[function])
    model.ir_version = 8
    session(model)  # ORT loads it
    code, err, out = _cli(model, tmp_path, capsys)
    assert code == 0, err
    assert out.exists()


def _inlining_model(graph_nodes: list, functions: list) -> onnx.ModelProto:
    graph = oh.make_graph(graph_nodes, "g", [oh.make_tensor_value_info("X", FLOAT, [2, 3, 4])],
                          [oh.make_tensor_value_info("Y", FLOAT, [2, 3, 4])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("local", 1)],
                          functions=functions)
    model.ir_version = 10
    return model


def _function(name: str, nodes: list, overload: str = "") -> onnx.FunctionProto:
    function = oh.make_function("local", name, ["X"], ["Y"], nodes,
                                [oh.make_opsetid("", 17), oh.make_opsetid("local", 1)])
    function.overload = overload
    return function


def _call(name: str, x: str, y: str, node_name: str = "", overload: str = "") -> onnx.NodeProto:
    node = oh.make_node(name, [x], [y], domain="local", name=node_name)
    node.overload = overload
    return node


_G = _function("G", [oh.make_node("Relu", ["X"], ["Y"], name="k")])
_F_CALLS_G = _function("F", [_call("G", "X", "Y", "n")])
_OVERLOADS = [_function("F", [oh.make_node("Relu", ["X"], ["Y"], name="n")], "o1"),
              _function("F", [oh.make_node("Abs", ["X"], ["Y"], name="m")], "o2")]


@pytest.mark.parametrize("model, ort_loads", [
    # a function called by the function the graph calls is inlined into the graph too
    (_inlining_model([_call("F", "X", "a"), oh.make_node("Neg", ["a"], ["Y"], name="_inlfunc_G_k")],
                     [_F_CALLS_G, _G]), False),
    # the overload called is the one whose names count
    (_inlining_model([_call("F", "X", "a", overload="o1"), oh.make_node("Neg", ["a"], ["Y"], name="_inlfunc_F_n")],
                     _OVERLOADS), False),
    (_inlining_model([_call("F", "X", "a", overload="o1"), oh.make_node("Neg", ["a"], ["Y"], name="_inlfunc_F_m")],
                     _OVERLOADS), True),
    # the call node is replaced by the copy: its own name is free
    (_inlining_model([_call("F", "X", "a", "_inlfunc_F_n"), oh.make_node("Neg", ["a"], ["Y"])],
                     [_function("F", [oh.make_node("Relu", ["X"], ["Y"], name="n")])]), True),
    # a function body's own names do not meet the copies made in the graph
    (_inlining_model([_call("F", "X", "Y")],
                     [_function("F", [_call("G", "X", "z", "n"), oh.make_node("Identity", ["z"], ["Y"],
                                                                               name="_inlfunc_G_k")]), _G]), True),
], ids=["nested", "overload_called", "overload_not_called", "call_named_so", "in_a_function_body"])
def test_inlined_names_as_ort_gives_them(tmp_path: Path, capsys, model: onnx.ModelProto, ort_loads: bool):
    if ort_loads:
        session(model)
    else:
        with pytest.raises(Exception, match="same node name"):
            session(model)
    code, err, out = _cli(model, tmp_path, capsys)
    assert code == (0 if ort_loads else 2), err
    assert out.exists() == ort_loads


def test_a_cast_whose_dtype_is_the_callers_attribute_is_accepted(tmp_path: Path, capsys):
    """A function's Cast may take ``to`` from the calling node's attribute (``ref_attr_name``): its value is known
    only at each call, and it is no undefined data type. ONNX Runtime runs the model; so does lnfuse."""
    to = onnx.AttributeProto(name="to", ref_attr_name="to", type=onnx.AttributeProto.INT)
    cast = oh.make_node("Cast", ["X"], ["c"])
    cast.attribute.append(to)
    function = oh.make_function("local", "C", ["X"], ["Y"], [cast, oh.make_node("Cast", ["c"], ["Y"], to=FLOAT)],
                                [oh.make_opsetid("", 17)], attributes=["to"])
    graph = oh.make_graph([oh.make_node("C", ["X"], ["a"], domain="local", to=TensorProto.DOUBLE),
                           oh.make_node("Neg", ["a"], ["Y"])], "g",
                          [oh.make_tensor_value_info("X", FLOAT, [2, 3, 4])],
                          [oh.make_tensor_value_info("Y", FLOAT, [2, 3, 4])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("local", 1)],
                          functions=[function])
    model.ir_version = 8
    session(model)
    code, err, out = _cli(model, tmp_path, capsys)
    assert code == 0, err
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(session(onnx.load(out)).run(None, {"X": x})[0], -x)


# ---- load repairs: initializers of one name ---------------------------------------------------------------------------

def _mul_by_k(nodes: list, inits: list) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("X", FLOAT, [2, 3, 4])],
                          [oh.make_tensor_value_info("Y", FLOAT, [2, 3, 4])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_two_initializers_of_one_name_in_a_branch_are_refused_as_ort_refuses_them(tmp_path: Path, capsys):
    then = oh.make_graph([oh.make_node("Mul", ["X", "k"], ["t"], name="mul")], "then", [],
                         [oh.make_tensor_value_info("t", FLOAT, [2, 3, 4])],
                         [onh.from_array(np.array(v, np.float32), "k") for v in (1.0, 5.0)])
    other = oh.make_graph([oh.make_node("Identity", ["X"], ["e"], name="id")], "else", [],
                          [oh.make_tensor_value_info("e", FLOAT, [2, 3, 4])])
    model = _mul_by_k([oh.make_node("If", ["c"], ["Y"], then_branch=then, else_branch=other, name="if")],
                      [onh.from_array(np.array(True), "c")])
    with pytest.raises(Exception, match="not unique"):
        session(model)
    code, err, out = _cli(model, tmp_path, capsys)
    assert code == 2, err
    assert not out.exists()


def test_a_constant_node_named_like_an_initializer_is_read_as_ort_reads_it(tmp_path: Path, capsys):
    model = _mul_by_k([oh.make_node("Constant", [], ["k"], name="k_node",
                                    value=onh.from_array(np.array([9.0], np.float32))),
                       oh.make_node("Mul", ["X", "k"], ["Y"], name="mul")],
                      [onh.from_array(np.array([3.0], np.float32), "k")])
    feeds = [{"X": RNG.standard_normal((2, 3, 4)).astype(np.float32)}]
    np.testing.assert_allclose(session(model).run(None, feeds[0])[0], feeds[0]["X"] * 9.0, rtol=1e-6)
    code, err, out = _cli(model, tmp_path, capsys)
    assert code == 0, err
    _same(model, onnx.load(out), feeds)
