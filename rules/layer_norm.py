"""LayerNormalization: y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta, over the trailing axes.

Writes LayerNormalization-17 (opset >= 17), or ONNX Runtime's own LayerNormalization (registered in the default
domain, ORT-only) on older opsets with ``--target ort``.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from lnfuse.constants import static_value
from lnfuse.pattern import Either, Match, Op, Var, maybe_cast
from lnfuse.rule import GraphContext, Refusal, Replacement, Rule
from ._common import (FLOATS, check_epsilon_fits, check_exponent, epsilon, kept_dims, mean_over, node_name, param_as, read_outside,
                           rank_of, readers_outside, reduced_axes, square, trailing_axes)
from ._norm import (Boundary, affine, first_placement, check_inner_casts, check_inverse_sqrt, expose, finish, stash_type,
                         inverse_std, inverse_std_readers, normalize, ones_scale, params)


@functools.cache
def reference():
    """LayerNormalization-17 with the statistics in ``stash_type`` (1: float32), for a negative ``axis``:
    (Y, Mean, InvStdDev).
    Compiled by onnxscript on first use: decompose and the tests need it, fusing does not."""
    from onnxscript import script
    from onnxscript import opset18 as op

    @script(default_opset=op)
    def layer_normalization(X, Scale, B, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1):
        axes = op.Range(op.Constant(value_int=axis), op.Constant(value_int=0), op.Constant(value_int=1))
        xf = op.Cast(X, to=stash_type)
        mean = op.ReduceMean(xf, axes)
        d = op.Sub(xf, mean)
        var = op.ReduceMean(op.Mul(d, d), axes)
        eps = op.CastLike(op.Constant(value_float=epsilon), var)
        std = op.Sqrt(op.Add(var, eps))
        normalized = op.Div(d, std)
        return op.Add(op.Mul(op.CastLike(normalized, X), Scale), B), mean, op.Reciprocal(std)

    return layer_normalization


# ---- the math, as patterns --------------------------------------------------------------------------------------
X = maybe_cast(Var("x_in"), cast="cast_in", name="x")
MEAN = mean_over(X, "mean")
D = Op("Sub", X, MEAN, name="d")
D_NUM = maybe_cast(D, cast="d_cast", name="d_num")
VARIANCE = Either(
    mean_over(square(D, "sq"), "var"),
    # E[x²] - E[x]²: the ONNX function body of LayerNormalization
    Op("Sub", mean_over(square(X, "xsq"), "var"), square(MEAN, "msq"), name="var_sub"),
)
VAR_EPS = Op("Add", VARIANCE, Var("eps"), name="add_eps")
NORMALIZED = normalize(D_NUM, VAR_EPS)
STANDARD = affine(NORMALIZED)
# the ONNX function body works on Flatten(X, axis) and reshapes back: Reshape(norm2d, Shape(X))
UNFLATTENED = Op("Reshape", STANDARD, Var("x_shape"), name="unflatten")
# tf2onnx/Keras folds the affine: x*k + (beta - mean*k) with k = gamma / sqrt(var + eps)
_INV = inverse_std(VAR_EPS)
# both products must use the same k (named, so the second use must be the very value the first one matched)
_K = Either(Op("Mul", _INV, Var("gamma"), name="mul_gamma"), _INV, name="k")
FOLDED = maybe_cast(Either(
    Op("Add", Op("Mul", X, _K, name="x_k"), Op("Sub", Var("beta"), Op("Mul", MEAN, _K, name="mean_k"),
                                              name="shift"), name="add_beta"),
    Op("Sub", Op("Mul", X, _K, name="x_k"), Op("Mul", MEAN, _K, name="mean_k"), name="shift"),
), cast="cast_out", name="y")


class LayerNorm(Rule):
    name = "layer_norm"
    anchors = frozenset({"ReduceMean", "GlobalAveragePool"})
    patterns = (UNFLATTENED, STANDARD, FOLDED)
    near_misses = (
        (Op("Div", Op("Sub", Var("x"), mean_over(Var("x"), "mean")),
            Op("Add", Op("Sqrt", mean_over(Var("sq"), "var")), Var("eps"))), "epsilon",
         "epsilon is added outside the square root: (x - mean) / (sqrt(var) + eps)"),
        (Op("Sub", mean_over(Var("x"), "mean"), Var("x")), "operands",
         "Sub computes mean - x (operands swapped)"),
        (Op("Div", Op("Sqrt", Op("Add", mean_over(Var("sq"), "var"), Var("eps"))),
            Op("Sub", Var("x"), mean_over(Var("x"), "mean"))), "operands",
         "Div computes sqrt(var + eps) / (x - mean) (operands swapped)"),
    )

    def build(self, m: Match, ctx: GraphContext) -> Replacement:
        k = trailing_axes(reduced_axes(m, "mean"), m.node("mean"), [(reduced_axes(m, "var"), m.node("var"))])
        eps = epsilon(m)
        for name in ("sq", "xsq", "msq"):
            check_exponent(m, name, 2.0, "exponent")
        check_inverse_sqrt(m)
        check_inner_casts(m, ("sq_cast", "xsq_cast", "msq_cast", "d_cast"))
        return first_placement(m, lambda b: self._write(m, ctx, b, k, eps))

    def _write(self, m: Match, ctx: GraphContext, b: Boundary, k: int, eps: float) -> Replacement:
        op_type = _choose_op(ctx, b.dtype)
        check_epsilon_fits(eps, b.dtype)
        region = list(b.region)
        x, y = b.x, b.y
        if m.node("unflatten") is not None:
            x, y, k, gamma, beta = _unflatten(m, ctx, b)
        else:
            gamma, beta = params(m, ctx, b, k)
        mean = kept_dims(m, "mean")
        exposed_mean = [mean] if read_outside(mean, region) else []
        exposed_inv, absorbed = inverse_std_readers(m, region)
        region += absorbed
        flattened = m.node("unflatten") is not None
        if flattened:
            _only_reshaped(exposed_mean + exposed_inv, region)
        n_out = 3 if exposed_inv else 2 if exposed_mean else 1
        scale = gamma if gamma is not None else ones_scale(ctx, x, k, b.dtype)
        stash = stash_type(b.dtype)
        if n_out > 1 and stash != ir.DataType.FLOAT:
            raise Refusal("dtype", "LayerNormalization's Mean/InvStdDev are float or bfloat16, and these statistics "
                          f"are {b.dtype}")
        attrs = {"axis": -k, "epsilon": eps, "stash_type": stash.value}
        fused = ctx.node(op_type, [x, scale] + ([beta] if beta is not None else []), attrs, num_outputs=n_out,
                         hint=node_name(m.node("mean")))
        fused.outputs[0].type, fused.outputs[0].shape = y.type, y.shape
        outputs = {y: fused.outputs[0]}
        for i in range(1, n_out):
            fused.outputs[i].type = ir.TensorType(stash)
            if x.shape is not None:
                fused.outputs[i].shape = ir.Shape(list(x.shape)[:-k] + [1] * k)
        for index, olds in ((1, exposed_mean), (2, exposed_inv)):
            for old in olds:
                stat = _as_2d(ctx, fused.outputs[index]) if flattened else fused.outputs[index]
                outputs[old] = expose(ctx, stat, old, stash)
        return finish(op_type, "", outputs, region, {"axis": -k, "epsilon": eps})


def _choose_op(ctx: GraphContext, dtype: ir.DataType) -> str:
    if dtype not in FLOATS:
        raise Refusal("dtype", f"LayerNormalization does not take {dtype}")
    if ctx.opset >= 17 or ctx.target == "ort":
        return "LayerNormalization"  # below opset 17: ONNX Runtime's own, in the default domain
    raise Refusal("opset", f"LayerNormalization needs opset 17 and the model has opset {ctx.opset}: use "
                  f"--upgrade-opset, or --target ort for ONNX Runtime's own LayerNormalization")


def _unflatten(m: Match, ctx: GraphContext, b: Boundary):
    """Prove ``Reshape(norm(Flatten(X, a)), Shape(X))`` is a norm of X over its axes a.., and lay out gamma/beta."""
    flatten, shape = b.x.producer(), m.value("x_shape").producer()
    if b.y is not m.value("y") or flatten is None or flatten.op_type != "Flatten":
        raise Refusal("shape", "the Reshape after the norm does not undo a Flatten before it")
    x_nd = flatten.inputs[0]
    if shape is None or shape.op_type != "Shape" or shape.inputs[0] is not x_nd or shape.attributes:
        raise Refusal("shape", f"Reshape '{node_name(m.node('unflatten'))}' does not restore the shape of "
                      f"'{x_nd.name}'")
    rank = rank_of(x_nd)
    if rank is None:
        raise Refusal("shape", f"the rank of '{x_nd.name}' is unknown")
    axis = flatten.attributes["axis"].value if "axis" in flatten.attributes else 1
    k = rank - (axis % rank if rank else 0) if axis != rank else 0
    if k < 1:
        raise Refusal("axes", f"Flatten '{flatten.name}' leaves no axis to normalize")
    b2 = Boundary(x_nd, m.value("unflatten"), b.dtype, b.region)
    gamma = m.value("gamma") if m.node("mul_gamma") is not None else None
    beta = m.value("beta") if m.node("add_beta") is not None else None
    return (x_nd, b2.y, k, _flat_param(ctx, gamma, x_nd, k, b.dtype, "gamma"),
            _flat_param(ctx, beta, x_nd, k, b.dtype, "beta"))


def _flat_param(ctx: GraphContext, value: ir.Value | None, x_nd: ir.Value, k: int, dtype: ir.DataType,
                what: str) -> ir.Value | None:
    """gamma/beta seen as [1, N] in the flattened norm: Flatten(W, 0) is W itself; a constant is reshaped."""
    if value is None:
        return None
    producer = value.producer()
    if producer is not None and producer.op_type == "Flatten" and \
            (producer.attributes["axis"].value if "axis" in producer.attributes else 1) == 0:
        return param_as(ctx, producer.inputs[0], x_nd, k, dtype, what)
    array = static_value(value)
    dims = list(x_nd.shape)[-k:]
    if array is None or not all(isinstance(d, int) for d in dims) or array.size not in (1, int(np.prod(dims))):
        raise Refusal(what, f"{what} '{value.name}' of the flattened norm cannot be laid out as {dims}")
    laid_out = ctx.constant(np.broadcast_to(array.reshape(-1), (int(np.prod(dims)),)).reshape(dims), what)
    return param_as(ctx, laid_out, x_nd, k, dtype, what)


def _as_2d(ctx: GraphContext, stat: ir.Value) -> ir.Value:
    """The statistic in the [M, 1] layout the flattened norm computed it in."""
    reshape = ctx.node("Reshape", [stat, ctx.constant(np.array([-1, 1], dtype=np.int64), "stat_2d_shape")],
                       hint="lnfuse_stat")
    reshape.outputs[0].type = stat.type
    return reshape.outputs[0]


def _only_reshaped(values: list[ir.Value], region: list[ir.Node]) -> None:
    # the flattened statistic has shape [M, 1]; the fused op's has X's leading dims: only a Reshape cannot tell
    for value in values:
        for reader in readers_outside(value, region):
            if reader.op_type != "Reshape" or reader.inputs[0] is not value:
                raise Refusal("intermediate", f"'{value.name}' is read by {reader.op_type} '{reader.name}' in its "
                              f"flattened shape")


RULE = LayerNorm()
