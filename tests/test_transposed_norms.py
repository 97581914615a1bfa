"""Norms computed in a transposed layout (jax2tf's vmap: ``T(w * h) * rsqrt(mean(T(h * h)) + eps)``), and the
near-misses whose permutations do not line up.

The normal form reads through Transposes (``algebra._viewed``); the rules compose the permutations and prove x is
normalized in one layout, with the reduced axes mapped through them (``rules/_norm.py``, ``check_layouts``). Every
fused case is compared with ONNX Runtime on the original; every near-miss must stay as it is, with the reason.
The real export is ``jax2tf/eqx_rmsnorm`` in tests/test_frameworks.py.
"""

from __future__ import annotations

import numpy as np
import onnx
from normgraphs import LayoutGraph, feeds_for, op_types, run, tolerance

import lnfuse
from lnfuse.match import algebra

C, S, EPS = 8, 4, 1e-5
RNG = np.random.default_rng(7)
STATISTICS = ("ReduceMean", "ReduceSum", "ReduceSumSquare")




def _fused(model: onnx.ModelProto, op: str, transposes: int) -> lnfuse.FuseResult:
    result = lnfuse.fuse(model)
    ops = op_types(result.model)
    assert ops.count(op) == 1, (ops, [(u.check, u.reason) for u in result.report.unfused])
    assert not [o for o in ops if o in STATISTICS], ops
    assert ops.count("Transpose") == transposes, ops
    feeds = feeds_for(model)
    np.testing.assert_allclose(run(result.model, feeds)[0], run(model, feeds)[0], **tolerance("float32"))
    return result


def _refused(model: onnx.ModelProto, check: str, words: str) -> None:
    result = lnfuse.fuse(model)
    ops = op_types(result.model)
    assert not [o for o in ops if "Normalization" in o], ops
    reasons = [(u.check, u.reason) for u in result.report.unfused]
    assert any(c == check and words in r for c, r in reasons), reasons
    feeds = feeds_for(model)
    np.testing.assert_allclose(run(result.model, feeds)[0], run(model, feeds)[0], rtol=0, atol=0)


# ---- accepted ----------------------------------------------------------------------------------------------------

def _vmapped_rms(w_shape: tuple, stat_perm=(1, 2, 0)) -> onnx.ModelProto:
    """jax2tf's Equinox RMSNorm: h in [C, B, S], the weight multiplied before vmap's Transpose to [B, S, C], the
    statistics of the transposed squares."""
    g = LayoutGraph([C, "B", S])
    w = g.const(RNG.uniform(0.5, 1.5, w_shape))
    numerator = g.t(g.op("Mul", w, "X"), [1, 2, 0])
    inv = g.inv_rms(g.t(g.op("Mul", "X", "X"), list(stat_perm)), [-1])
    return g.model(g.op("Mul", inv, numerator), ["B", S, C])


def test_rms_norm_in_vmaps_layout():
    """T(w * h) * rsqrt(mean(T(h²), -1) + eps): an RMS norm of T(h) over its last axis, w laid out as [C]; one
    Transpose of h goes in front of the fused op."""
    _fused(_vmapped_rms((C, 1, 1)), "SimplifiedLayerNormalization", transposes=1)


def test_transposes_that_compose_to_the_identity_leave_no_transpose():
    """T(t * rsqrt(mean(t², 1) + eps)) * gamma with t = T(x), T = [0, 2, 1] twice: the norm is over axis 1 of t,
    which is x's last axis, and x is read as it is."""
    g = LayoutGraph(["B", S, C])
    t = g.t("X", [0, 2, 1])
    normalized = g.op("Mul", t, g.inv_rms(g.op("Mul", t, t), [1]))
    y = g.op("Mul", g.t(normalized, [0, 2, 1]), g.const(RNG.uniform(0.5, 1.5, C)))
    _fused(g.model(y, ["B", S, C]), "SimplifiedLayerNormalization", transposes=0)


def test_layer_norm_over_a_leading_axis_then_transposed():
    """T(d * rsqrt(mean(d², 0) + eps)) * gamma + beta, d = h - mean(h, 0), h in [C, B, S]: a LayerNorm of T(h)."""
    g = LayoutGraph([C, "B", S])
    d = g.op("Sub", "X", g.op("ReduceMean", "X", g.const([0], np.int64), keepdims=1))
    normalized = g.t(g.op("Mul", d, g.inv_rms(g.op("Mul", d, d), [0])), [1, 2, 0])
    y = g.op("Add", g.op("Mul", normalized, g.const(RNG.uniform(0.5, 1.5, C))), g.const(RNG.uniform(-1, 1, C)))
    _fused(g.model(y, ["B", S, C]), "LayerNormalization", transposes=1)


def test_a_transposed_input_is_still_the_value_the_graph_names():
    """LayerNorm of Transpose(h) written on that value: the Transpose stays outside, as before."""
    g = LayoutGraph([C, "B", S])
    x = g.t("X", [1, 2, 0])
    d = g.op("Sub", x, g.op("ReduceMean", x, g.const([-1], np.int64), keepdims=1))
    y = g.op("Mul", d, g.inv_rms(g.op("Mul", d, d), [-1]))
    result = _fused(g.model(y, ["B", S, C]), "LayerNormalization", transposes=1)
    fused = next(n for n in result.model.graph.node if n.op_type == "LayerNormalization")
    assert fused.input[0] == x


# ---- refused -----------------------------------------------------------------------------------------------------

def test_statistics_of_other_rows_are_refused():
    """x * rsqrt(mean(T(x²), -1) + eps) with T = [0, 2, 1] and S = C: the shapes broadcast, but row (b, s) is scaled
    by the statistic of column s."""
    g = LayoutGraph(["B", C, C])
    inv = g.inv_rms(g.t(g.op("Mul", "X", "X"), [0, 2, 1]), [-1])
    _refused(g.model(g.op("Mul", "X", inv), ["B", C, C]), "layout", "not x's rows")


def test_gamma_on_the_wrong_axis_is_refused():
    """The weight varies along S in h's layout, so along axis 1 of the transposed layout, not the normalized one."""
    _refused(_vmapped_rms((1, 1, S)), "gamma", "varies over the leading axes")


def test_transposes_that_do_not_compose_to_the_identity_are_refused():
    """T1(T2(x)) * rsqrt(mean(x², -1) + eps), T1∘T2 a rotation of three equal axes: x read in two layouts."""
    g = LayoutGraph([C, C, C])
    numerator = g.t(g.t("X", [0, 2, 1]), [1, 0, 2])
    y = g.op("Mul", numerator, g.inv_rms(g.op("Mul", "X", "X"), [-1]))
    _refused(g.model(y, [C, C, C]), "layout", "not x's rows")


def test_stats_transposed_differently_from_x_are_refused():
    """vmap's layout with the squares permuted by [2, 0, 1] instead of [1, 2, 0] (C = S): another row's RMS."""
    g = LayoutGraph([C, C, C])
    w = g.const(RNG.uniform(0.5, 1.5, (C, 1, 1)))
    numerator = g.t(g.op("Mul", w, "X"), [1, 2, 0])
    inv = g.inv_rms(g.t(g.op("Mul", "X", "X"), [2, 0, 1]), [-1])
    _refused(g.model(g.op("Mul", inv, numerator), [C, C, C]), "layout", "not x's rows")


# ---- the normal form ---------------------------------------------------------------------------------------------

def test_view_axes_compose_permutations():
    import onnx_ir as ir

    g = LayoutGraph([C, "B", S])
    y = g.t(g.t("X", [1, 2, 0]), [2, 0, 1])
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(g.model(y, [C, "B", S])))
    nodes = list(model.graph)
    assert algebra.view_axes((nodes[1], nodes[0]), 3) == [0, 1, 2]
    assert algebra.view_axes((nodes[0],), 3) == [2, 0, 1]


def test_a_lower_rank_factor_is_not_read_through_a_transpose():
    """T(x * w) with w of rank 1 broadcast on the left: a permutation of w's one axis says nothing; the Transpose's
    result stays a leaf."""
    import onnx_ir as ir

    g = LayoutGraph(["B", S, C])
    y = g.t(g.op("Mul", "X", g.const(np.ones(C))), [0, 2, 1])
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(g.model(y, ["B", C, S])))
    out = list(model.graph)[-1].outputs[0]
    terms = algebra.expand(out).terms
    assert len(terms) == 1 and [f.value for f in terms[0].factors] == [out]
