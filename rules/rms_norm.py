"""RMS normalization: y = x / sqrt(E[x²] + eps) * gamma, over the trailing axes (LLaMA, Qwen, T5, Gemma...).

Writes RMSNormalization-23 (opset >= 23), or ONNX Runtime's SimplifiedLayerNormalization (default domain,
ORT-only) with ``--target ort`` on older opsets and for bfloat16, which RMSNormalization-23 cannot run on CPU.
"""

from __future__ import annotations

import functools

import onnx_ir as ir

from lnfuse.pattern import Match, Op, Var, maybe_cast
from lnfuse.rule import GraphContext, Refusal, Replacement, Rule
from ._common import FLOATS, check_epsilon_fits, check_exponent, epsilon, mean_over, node_name, reduced_axes, square, trailing_axes
from ._norm import (Boundary, affine, first_placement, check_inner_casts, check_inverse_sqrt, expose, finish, stash_type,
                         inverse_std_readers, normalize, ones_scale, params)


@functools.cache
def reference():
    """RMSNormalization-23 / SimplifiedLayerNormalization with the statistics in ``stash_type``, for a negative ``axis``:
    (Y, inverse RMS).
    Compiled by onnxscript on first use: decompose and the tests need it, fusing does not."""
    from onnxscript import script
    from onnxscript import opset18 as op

    @script(default_opset=op)
    def rms_normalization(X, Scale, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1):
        axes = op.Range(op.Constant(value_int=axis), op.Constant(value_int=0), op.Constant(value_int=1))
        xf = op.Cast(X, to=stash_type)
        mean_square = op.ReduceMean(op.Mul(xf, xf), axes)
        eps = op.CastLike(op.Constant(value_float=epsilon), mean_square)
        rms = op.Sqrt(op.Add(mean_square, eps))
        return op.Mul(op.CastLike(op.Div(xf, rms), X), Scale), op.Reciprocal(rms)

    return rms_normalization


X = maybe_cast(Var("x_in"), cast="cast_in", name="x")
VAR_EPS = Op("Add", mean_over(square(X, "sq"), "var"), Var("eps"), name="add_eps")
PATTERN = affine(normalize(maybe_cast(X, cast="d_cast", name="d_num"), VAR_EPS))


class RmsNorm(Rule):
    name = "rms_norm"
    anchors = frozenset({"ReduceMean", "GlobalAveragePool"})
    patterns = (PATTERN,)

    def build(self, m: Match, ctx: GraphContext) -> Replacement:
        k = trailing_axes(reduced_axes(m, "var"), m.node("var"))
        eps = epsilon(m)
        check_exponent(m, "sq", 2.0, "exponent")
        check_inverse_sqrt(m)
        check_inner_casts(m, ("sq_cast", "d_cast"))
        if m.node("add_beta") is not None:
            raise Refusal("bias", "RMS normalization has no bias input; the Add stays outside")
        return first_placement(m, lambda b: self._write(m, ctx, b, k, eps))

    def _write(self, m: Match, ctx: GraphContext, b: Boundary, k: int, eps: float) -> Replacement:
        op_type = _choose_op(ctx, b.dtype)
        check_epsilon_fits(eps, b.dtype)
        region = list(b.region)
        gamma, _ = params(m, ctx, b, k)
        exposed_inv, absorbed = inverse_std_readers(m, region)
        if exposed_inv and op_type == "RMSNormalization":
            raise Refusal("intermediate", f"'{exposed_inv[0].name}' (1/rms) is read elsewhere and "
                          "RMSNormalization does not output it")
        region += absorbed
        scale = gamma if gamma is not None else ones_scale(ctx, b.x, k, b.dtype)
        attrs = {"axis": -k, "epsilon": eps, "stash_type": stash_type(b.dtype).value}
        if exposed_inv and stash_type(b.dtype) != ir.DataType.FLOAT:
            raise Refusal("dtype", f"the inverse RMS of {b.dtype} statistics cannot be exposed as float")
        fused = ctx.node(op_type, [b.x, scale], attrs, num_outputs=2 if exposed_inv else 1,
                         hint=node_name(m.node("var")))
        fused.outputs[0].type, fused.outputs[0].shape = b.y.type, b.y.shape
        outputs = {b.y: fused.outputs[0]}
        for old in exposed_inv:
            fused.outputs[1].type = ir.TensorType(ir.DataType.FLOAT)
            outputs[old] = expose(ctx, fused.outputs[1], old, ir.DataType.FLOAT)
        return finish(op_type, "", outputs, region, {"axis": -k, "epsilon": eps})


def _choose_op(ctx: GraphContext, dtype: ir.DataType) -> str:
    if dtype not in FLOATS:
        raise Refusal("dtype", f"RMS normalization does not take {dtype}")
    if ctx.opset >= 23 and dtype != ir.DataType.BFLOAT16:
        return "RMSNormalization"
    if ctx.target == "ort":
        return "SimplifiedLayerNormalization"
    if ctx.opset >= 23:
        raise Refusal("dtype", "RMSNormalization-23 has no bfloat16 kernel in ONNX Runtime's CPU provider; "
                      "use --target ort for SimplifiedLayerNormalization")
    raise Refusal("opset", f"RMSNormalization needs opset 23 and the model has opset {ctx.opset}: use "
                  f"--upgrade-opset, or --target ort for ONNX Runtime's SimplifiedLayerNormalization")


RULE = RmsNorm()
