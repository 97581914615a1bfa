"""RMS normalization: y = x / sqrt(E[x²] + eps) * gamma, over the trailing axes (LLaMA, Qwen, T5, Gemma...).

Writes RMSNormalization-23 (opset >= 23), or ONNX Runtime's SimplifiedLayerNormalization (default domain,
ORT-only) with ``--target ort`` on older opsets and for bfloat16, which RMSNormalization-23 cannot run on CPU.
"""

from __future__ import annotations

import functools

import onnx_ir as ir

from lnfuse.match.pattern import Match, Var, maybe_cast
from lnfuse.match.rule import GraphContext, Refusal, Replacement, Rule
from ._common import (FLOATS, agreed_axes, channel_axis, check_epsilon_fits, check_exponent,
                      check_mean_scale, epsilon, mean_of_square, node_name, trailing_axes)
from ._shared_stats import leave_shared, left_to_siblings
from ._norm import (Boundary, Layout, absorb_type_reads, affine, channels_last, check_inverse,
                    check_layouts, check_scales, expose, finish, first_placement, inverse_sqrt, inverse_std_readers,
                    layout_params, scale_input, stash_type, transposed, var_plus_eps)


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


# y = x * (mean(x²) + eps) ** -1/2 * gamma, matched on the normal form (``lnfuse.match.algebra``)
X = maybe_cast(Var("x_in"), cast="cast_in", name="x")
VAR_EPS = var_plus_eps(mean_of_square(X, "sq", "var"))
PATTERN = affine([[(1, maybe_cast(X, cast="d_cast", name="d_num"), "scale_x")]], inverse_sqrt(VAR_EPS), beta=False)


class RmsNorm(Rule):
    name = "rms_norm"
    anchors = frozenset({"ReduceMean", "ReduceSum", "ReduceSumSquare", "GlobalAveragePool"})
    patterns = (PATTERN,)
    near_misses = ((VAR_EPS, "formula", "mean(x²) + eps is computed, but nothing computes x * (mean(x²) + eps) ** "
                    "-1/2 from it"),)

    def build(self, m: Match, ctx: GraphContext) -> Replacement:
        # the axes in the layout x is normalized in, which the graph may reach through Transposes
        layout = check_layouts(m, ctx, agreed_axes(m, ("var",)), {"var": None}, "var")
        axes = layout.axes
        channel = channel_axis(axes, m.node("var"))
        k = 1 if channel is not None else trailing_axes(axes, m.node("var"))
        check_mean_scale(float(m.fact("var_scale", 1.0)), m, "var", "the mean square", "variance")
        eps = epsilon(m)
        check_exponent(m, "sq", 2.0)
        check_inverse(m)
        scale = check_scales(m, ("scale_x",))
        return first_placement(m, lambda b: self._write(m, ctx, b, k, eps, scale, channel, layout))

    def _write(self, m: Match, ctx: GraphContext, b: Boundary, k: int, eps: float, scale: float,
               channel: int | None, layout: Layout) -> Replacement:
        op_type = _choose_op(ctx, b.dtype)
        check_epsilon_fits(eps, b.dtype)
        region = absorb_type_reads(list(b.region))
        # statistics another norm of x also reads stay for it: this norm's op computes its own
        region, shared = leave_shared(m, region, self.patterns, b.y)
        b = transposed(ctx, b, layout)
        gamma, _ = layout_params(m, ctx, b, k, scale, channel, layout.params)
        exposed_inv, absorbed = inverse_std_readers(m, region)
        if exposed_inv and layout.perm is not None:
            raise Refusal("intermediate", f"'{exposed_inv[0].name}' (1/rms) is read elsewhere in the layout the "
                          "graph computed it in, and the fused op computes it in x's")
        if exposed_inv and (op_type == "RMSNormalization" or channel is not None):
            raise Refusal("intermediate", f"'{exposed_inv[0].name}' (1/rms) is read elsewhere and "
                          f"{op_type} does not output it here")
        region += absorbed
        scale_in = scale_input(ctx, gamma, b.x, k, b.dtype, channel)
        attrs = {"axis": -k, "epsilon": eps, "stash_type": stash_type(b.dtype).value}
        if exposed_inv and stash_type(b.dtype) != ir.DataType.FLOAT:
            raise Refusal("dtype", f"the inverse RMS of {b.dtype} statistics cannot be exposed as float")

        def norm(source: ir.Value) -> ir.Node:
            fused = ctx.node(op_type, [source, scale_in], attrs, num_outputs=2 if exposed_inv else 1,
                             hint=node_name(m.node("var")))
            fused.outputs[0].type, fused.outputs[0].shape = b.y.type, source.shape
            return fused

        if channel is not None:
            outputs = {b.y: channels_last(ctx, b.x, b.y, channel, lambda t: norm(t).outputs[0])}
            done = finish(op_type, "", outputs, region, {"axis": channel, "epsilon": eps, "layout": "channels-first"})
        else:
            fused = norm(b.x)
            fused.outputs[0].shape = b.y.shape
            outputs = {b.y: fused.outputs[0]}
            for old in exposed_inv:
                fused.outputs[1].type = ir.TensorType(ir.DataType.FLOAT)
                outputs[old] = expose(ctx, fused.outputs[1], old, ir.DataType.FLOAT)
            done = finish(op_type, "", outputs, region, {"axis": -k, "epsilon": eps})
        return left_to_siblings(done, shared, b.x)


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
