"""LayerNormalization: y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta, over the trailing axes.

Writes LayerNormalization-17 (opset >= 17), or ONNX Runtime's own LayerNormalization (registered in the default
domain, ORT-only) on older opsets with ``--target ort``.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from lnfuse.index.constants import static_value
from lnfuse.match.pattern import Either, Match, Op, Terms, Var, attr_value, maybe_cast, mono
from lnfuse.match.rule import GraphContext, Refusal, Replacement, Rule
from lnfuse.index.ops import is_op, onnx_op
from ._common import (FLOATS, SUMS, agreed_axes, channel_axis, check_epsilon_fits, check_exponent, dtype_of,
                      check_mean_scale, epsilon, kept_dims, mean_of_square, mean_over,
                      node_name, param_as, rank_of, read_outside, readers_outside, reduced_axes, square, trailing_axes)
from ._shared_stats import leave_shared, left_to_siblings
from ._norm import (Boundary, Layout, absorb_type_reads, affine, channels_last, check_inverse,
                    check_layouts, check_scales, expose, finish, first_placement, inverse_sqrt, inverse_std_readers,
                    layout_params, scale_input, stash_type, transposed, var_plus_eps)


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
# y = (x - mean) * (var + eps) ** -1/2 * gamma + beta, matched on the normal form (``lnfuse.match.algebra``): any order,
# association and sign of the products and sums below reaches the same monomials.
X = maybe_cast(Var("x_in"), cast="cast_in", name="x")
MEAN = mean_over(X, "mean")
# The variance may centre by a mean of its own: torch's dynamo exporter writes ``torch.var`` and ``var_mean`` with
# their own ReduceMean (axes [2] where the code's mean has [-1]), or ReduceSum / N. ``check_centring`` proves both
# are the mean of x over the same axes, so they are the same number.
VMEAN = mean_over(X, "vmean")
# x - mean computed once (it is read by the square too); under the square its sign does not matter
D = Terms(mono(1, X, scale="d_x"), mono(-1, MEAN, scale="d_mean"))
D_SQUARED = Terms(mono(1, X, scale="dsq_x"), mono(-1, VMEAN, scale="dsq_mean"), either_sign=True)
VAR_EPS = Either(
    var_plus_eps(mean_of_square(D_SQUARED, "sq", "var")),
    # E[x²] - E[x]²: the ONNX function body of LayerNormalization
    var_plus_eps(mean_of_square(X, "xsq", "var"),
                 mono(-1, square(VMEAN, "msq"), scale="msq_scale")),
)
INVERSE = inverse_sqrt(VAR_EPS)
NUMERATORS = [[(1, maybe_cast(D, cast="d_cast", name="d_num"), "scale_x")],
              # tf2onnx/Keras distributes: x*k + (-mean*k + beta), k = gamma / sqrt(var + eps)
              [(1, X, "scale_x"), (-1, MEAN, "scale_mean")]]
STANDARD = affine(NUMERATORS, INVERSE)
# the ONNX function body works on Flatten(X, axis) and reshapes back: Reshape(norm2d, Shape(X))
UNFLATTENED = Op("Reshape", STANDARD, Var("x_shape"), name="unflatten")
# An RMS norm of x - mean(x) is the LayerNorm of x: torch's dynamo exporter at opset 23 writes a hand-written
# LayerNorm without bias (Cohere, OLMo-style code) as ReduceMean -> Sub -> RMSNormalization
RMS_OF_CENTRED = Op(("RMSNormalization", "SimplifiedLayerNormalization"), D, Var("gamma"), name="rms")
CENTRED_RMS = maybe_cast(Either(Terms(mono(1, RMS_OF_CENTRED), mono(1, Var("beta"))), RMS_OF_CENTRED),
                         cast="cast_out", name="y")
# tf-keras's fused LayerNormalization (tf2onnx): x seen as [1, rows, H, 1], per-row statistics over axes 0, 2, 3,
# BatchNormalization(view, ones, zeros, mean, var) (its channel axis 1 is x's rows), Reshape back, then gamma, beta.
# BatchNormalization's epsilon is an attribute, not a term of the normal form: ``_build_batch_norm`` proves the rest.
BN_VIEW = Op("Reshape", Var("x"), Var("bn_view_shape"), name="bn_view")
BN_MEAN_STAT = Op("ReduceMean", BN_VIEW, name="mean", extra_inputs=True)
BN_VMEAN = mean_over(BN_VIEW, "vmean")
BN_VAR_STAT = mean_of_square(Terms(mono(1, BN_VIEW, scale="dsq_x"), mono(-1, BN_VMEAN, scale="dsq_mean"),
                                   either_sign=True), "sq", "var")
BN = Op("BatchNormalization", BN_VIEW, Var("bn_scale"), Var("bn_bias"),
        Either(Op("Squeeze", BN_MEAN_STAT, name="bn_mean_squeeze", extra_inputs=True), BN_MEAN_STAT),
        Terms(mono(1, Either(Op("Squeeze", BN_VAR_STAT, name="bn_var_squeeze", extra_inputs=True), BN_VAR_STAT),
                   scale="var_scale")),
        name="bn")
BN_BACK = Op("Reshape", BN, Var("bn_back_shape"), name="bn_back")
BATCH_NORM = Either(Terms(mono(1, BN_BACK, Var("gamma"), scale="scale_out"), mono(1, Var("beta"))),
                    Terms(mono(1, BN_BACK, Var("gamma"), scale="scale_out")),
                    Terms(mono(1, BN_BACK, scale="scale_out"), mono(1, Var("beta"))),
                    BN_BACK, name="y")


class LayerNorm(Rule):
    name = "layer_norm"
    anchors = frozenset({"ReduceMean", "ReduceSum", "ReduceSumSquare", "GlobalAveragePool"})
    patterns = (UNFLATTENED, STANDARD, CENTRED_RMS, BATCH_NORM)
    near_misses = (
        (Op("Div", Op("Sub", Var("x"), mean_over(Var("x"), "mean")),
            Op("Add", Op("Sqrt", mean_over(Var("sq"), "var")), Var("eps"))), "epsilon",
         "epsilon is added outside the square root: (x - mean) / (sqrt(var) + eps)"),
        (Op("Div", Op("Sub", mean_over(Var("x"), "mean"), Var("x")), Var("std")), "operands",
         "Sub computes mean - x (operands swapped)"),
        (Op("Div", Op("Sqrt", Op("Add", mean_over(Var("sq"), "var"), Var("eps"))),
            Op("Sub", Var("x"), mean_over(Var("x"), "mean"))), "operands",
         "Div computes sqrt(var + eps) / (x - mean) (operands swapped)"),
        # the statistics without the formula around them (another tensor's mean, another power...)
        (VAR_EPS, "formula", "var + eps of a centred value is computed, but nothing computes (x - mean) * "
         "(var + eps) ** -1/2 from it"),
    )

    def build(self, m: Match, ctx: GraphContext) -> Replacement:
        if m.node("bn") is not None:
            return _build_batch_norm(m, ctx)
        # the axes in the layout x is normalized in, which the graph may reach through Transposes: the variance's
        # own mean is read inside the squares (two-pass) or beside them (E[x²] - E[x]²)
        frames = {"mean": None, "var": None, "vmean": "var" if m.fact("msq_scale") is None else None}
        layout = check_layouts(m, ctx, agreed_axes(m, ("mean", "vmean", "var")), frames, "mean")
        if (layout.perm is not None or layout.params) and (m.node("unflatten") or m.node("rms")):
            raise Refusal("layout", "a flattened or RMS-of-centred norm read through Transposes")
        axes = layout.axes
        channel = channel_axis(axes, m.node("mean"))
        k = 1 if channel is not None else trailing_axes(axes, m.node("mean"))
        check_centring(m)
        eps = epsilon(m) if m.node("rms") is None else check_centred_rms(m, k, channel)
        for name in ("sq", "xsq", "msq"):
            check_exponent(m, name, 2.0)
        check_inverse(m)
        scale = check_scales(m, ("scale_x",)) * float(m.fact("d_x", 1.0))
        if scale < 0:
            raise Refusal("operands", "the normalized value is negated: Sub computes mean - x (operands swapped)")
        return first_placement(m, lambda b: self._write(m, ctx, b, k, eps, scale, channel, layout))

    def _write(self, m: Match, ctx: GraphContext, b: Boundary, k: int, eps: float, scale: float,
               channel: int | None, layout: Layout) -> Replacement:
        op_type = _choose_op(ctx, b.dtype)
        check_epsilon_fits(eps, b.dtype)
        region = absorb_type_reads(list(b.region))
        # statistics another norm of x also reads stay for it: this norm's op computes its own
        region, shared = leave_shared(m, region, self.patterns, b.y)
        b = transposed(ctx, b, layout)
        x, y = b.x, b.y
        if m.node("unflatten") is not None:
            if abs(scale - 1) > 1e-6:
                raise Refusal("gamma", f"the flattened norm is scaled by {scale:g}")
            if k != 1:  # the axes after Flatten's are the 2-D norm's last axis, not all of it
                raise Refusal("axes", f"the flattened norm reduces {k} axes of the 2-D Flatten output, not its last")
            x, y, k, gamma, beta = _unflatten(m, ctx, b)
        else:
            gamma, beta = layout_params(m, ctx, b, k, scale, channel, layout.params)
        mean = kept_dims(m, "mean")
        exposed_mean = [mean] if mean.producer() in region and read_outside(mean, region) else []
        flattened = m.node("unflatten") is not None
        if exposed_mean and not flattened and rank_of(mean) != rank_of(x):
            # a keepdims=0 mean re-broadcast by the ops around it: the fused op's Mean has the kept shape (a
            # flattened norm's [M, 1] statistics are laid out again below)
            raise Refusal("intermediate", f"the mean '{mean.name}' is read elsewhere without its reduced axes, "
                          "and the fused op's Mean keeps them")
        exposed_inv, absorbed = inverse_std_readers(m, region)
        region += absorbed
        if layout.perm is not None and (exposed_mean or exposed_inv):
            raise Refusal("intermediate", "the statistics are read elsewhere in the layout the graph computed them "
                          "in, and the fused op computes them in x's")
        if flattened:
            _only_reshaped(exposed_mean + exposed_inv, region)
        n_out = 3 if exposed_inv else 2 if exposed_mean else 1
        if channel is not None and n_out > 1:
            raise Refusal("intermediate", "the statistics of a channels-first norm are read elsewhere, and the fused "
                          "op computes them in the transposed layout")
        scale_in = scale_input(ctx, gamma, x, k, b.dtype, channel)
        stash = stash_type(b.dtype)
        if n_out > 1 and stash != ir.DataType.FLOAT:
            raise Refusal("dtype", "LayerNormalization's Mean/InvStdDev are float or bfloat16, and these statistics "
                          f"are {b.dtype}")
        attrs = {"axis": -k, "epsilon": eps, "stash_type": stash.value}
        hint = node_name(m.node("mean"))

        def norm(source: ir.Value) -> ir.Node:
            fused = ctx.node(op_type, [source, scale_in] + ([beta] if beta is not None else []), attrs,
                             num_outputs=n_out, hint=hint)
            fused.outputs[0].type, fused.outputs[0].shape = y.type, source.shape
            return fused

        if channel is not None:
            outputs = {y: channels_last(ctx, x, y, channel, lambda t: norm(t).outputs[0])}
            return finish(op_type, "", outputs, region, {"axis": channel, "epsilon": eps, "layout": "channels-first"})
        fused = norm(x)
        fused.outputs[0].shape = y.shape
        outputs = {y: fused.outputs[0]}
        for i in range(1, n_out):
            fused.outputs[i].type = ir.TensorType(stash)
            if x.shape is not None:
                fused.outputs[i].shape = ir.Shape(list(x.shape)[:-k] + [1] * k)
        for index, olds in ((1, exposed_mean), (2, exposed_inv)):
            for old in olds:
                stat = _as_2d(ctx, fused.outputs[index]) if flattened else fused.outputs[index]
                outputs[old] = expose(ctx, stat, old, stash)
        return left_to_siblings(finish(op_type, "", outputs, region, {"axis": -k, "epsilon": eps}), shared, x)


def check_centring(m: Match) -> None:
    """x - mean must subtract the mean itself: a ReduceSum divided by the count of what it sums, and the same
    coefficient on x and on the mean (``x - 0.9 * mean`` is not centred)."""
    for x_fact, mean_fact, mean, what in (("d_x", "d_mean", "mean", "the centred value"),
                                          ("dsq_x", "dsq_mean", "vmean", "the squared deviation"),
                                          ("scale_x", "scale_mean", "mean", "the normalized value")):
        if m.fact(mean_fact) is None:
            continue
        x_scale = float(m.fact(x_fact))
        if x_fact == "dsq_x" and abs(abs(x_scale) - 1) > 1e-6:
            raise Refusal("mean", f"{what} scales x by {x_scale:g}")
        check_mean_scale(float(m.fact(mean_fact)) / x_scale, m, mean, f"{what} (x - mean)")
    if m.node("var") is not None:
        check_mean_scale(float(m.fact("var_scale", 1.0)), m, "var", "the variance", "variance")
    if m.fact("msq_scale") is not None:
        check_mean_scale(float(m.fact("msq_scale")) ** 0.5, m, "vmean", "the squared mean")


def check_centred_rms(m: Match, k: int, channel: int | None) -> float:
    """RMSNorm(x - mean(x)) is LayerNorm(x) when the RMS op normalizes the axes the mean reduces, computes its
    statistics as LayerNormalization would (float32, or double for double) and only its output is read; its
    epsilon."""
    rms = m.node("rms")
    rank = rank_of(rms.inputs[0])
    axis = attr_value(rms, "axis", -1)
    if channel is not None:
        raise Refusal("axes", "the mean reduces one channel axis")
    if rank is None or axis % rank != rank - k:
        raise Refusal("axes", f"{rms.op_type} '{node_name(rms)}' normalizes from axis {axis}, and the mean it "
                      f"centres by reduces the last {k} of {rank} axes")
    dtype = dtype_of(rms.inputs[0])
    stash = attr_value(rms, "stash_type", 1)
    if dtype is None or stash != stash_type(dtype).value:
        raise Refusal("dtype", f"{rms.op_type} '{node_name(rms)}' computes its statistics in type {stash}, "
                      f"where LayerNormalization of {dtype} would use {stash_type(dtype) if dtype else '?'}")
    if any(out.uses() or out.is_graph_output() for out in rms.outputs[1:]):
        raise Refusal("intermediate", f"the inverse RMS of {rms.op_type} '{node_name(rms)}' is read elsewhere")
    scale = float(m.fact("d_x", 1.0))
    if abs(abs(scale) - 1) > 1e-6:
        # RMS(c * d) = sign(c) * d / sqrt(mean(d²) + eps / c²): the factor moves into epsilon, not into gamma (a
        # sign alone, mean - x, is the operand swap ``build`` refuses)
        raise Refusal("epsilon", f"{rms.op_type} '{node_name(rms)}' normalizes (x - mean) * {scale:g}: its epsilon "
                      f"acts as epsilon / {scale * scale:g} on x - mean")
    eps = float(attr_value(rms, "epsilon", 1e-5))
    if eps < 0 or not np.isfinite(eps):
        raise Refusal("epsilon", f"epsilon is {eps:g}; the fused op needs a finite epsilon >= 0")
    return eps


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
    if b.y is not m.value("y") or flatten is None or not is_op(flatten, "Flatten"):
        raise Refusal("shape", "the Reshape after the norm does not undo a Flatten before it")
    x_nd = flatten.inputs[0]
    if shape is None or not is_op(shape, "Shape") or shape.inputs[0] is not x_nd or shape.attributes:
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
    gamma, beta = m.value("gamma"), m.value("beta")
    return (x_nd, b2.y, k, _flat_param(ctx, gamma, x_nd, k, b.dtype, "gamma"),
            _flat_param(ctx, beta, x_nd, k, b.dtype, "beta"))


def _flat_param(ctx: GraphContext, value: ir.Value | None, x_nd: ir.Value, k: int, dtype: ir.DataType,
                what: str) -> ir.Value | None:
    """gamma/beta seen as [1, N] in the flattened norm: Flatten(W, 0) is W itself; a constant is reshaped."""
    if value is None:
        return None
    producer = value.producer()
    if producer is not None and is_op(producer, "Flatten") and \
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
            if not is_op(reader, "Reshape") or reader.inputs[0] is not value:
                raise Refusal("intermediate", f"'{value.name}' is read by {reader.op_type} '{reader.name}' in its "
                              f"flattened shape")


RULE = LayerNorm()


# ---- tf-keras's fused path: BatchNormalization over x seen as [1, rows, H, 1] ---------------------------------

_BN_AXES = [0, 2, 3]


def _build_batch_norm(m: Match, ctx: GraphContext) -> Replacement:
    """``Reshape(BatchNormalization(Reshape(x, [1, rows, H, 1]), 1, 0, mean, var), Shape(x))`` is LayerNorm of x over
    its last axis with BatchNormalization's epsilon, when the statistics are the mean and population variance of each
    row (axes 0, 2, 3 of the view), BN's scale is all ones and its bias all zeros, and BN runs in inference mode."""
    bn, view, back = m.node("bn"), m.node("bn_view"), m.node("bn_back")
    x = m.value("x")
    eps = _check_bn_node(bn, ctx.opset)
    h = _check_bn_view(m, x, view)
    for name, want, what in (("bn_scale", 1, "scale"), ("bn_bias", 0, "bias")):
        _check_bn_constant(m.value(name), want, what, bn)
    _check_bn_mean(m)
    _check_bn_variance(m, h)
    _check_restores_shape(back, x)
    check_exponent(m, "sq", 2.0)
    scale = check_scales(m, ())
    return first_placement(m, lambda b: _write_batch_norm(m, ctx, b, eps, scale))


def _write_batch_norm(m: Match, ctx: GraphContext, b: Boundary, eps: float, scale: float) -> Replacement:
    op_type = _choose_op(ctx, b.dtype)
    check_epsilon_fits(eps, b.dtype)
    region = list(b.region)
    # the Expands of BN's unit scale and zero bias go with it: a region input, verification would feed them random
    # numbers (and nothing else needs them)
    for name in ("bn_scale", "bn_bias"):
        node = m.value(name).producer()
        if node is not None and is_op(node, "Expand") and node not in region and \
                not m.value(name).is_graph_output() and all(user in region for user, _ in m.value(name).uses()):
            region.append(node)
    region = absorb_type_reads(region)
    gamma, beta = layout_params(m, ctx, b, 1, scale, None)
    scale_in = scale_input(ctx, gamma, b.x, 1, b.dtype)
    attrs = {"axis": -1, "epsilon": eps, "stash_type": stash_type(b.dtype).value}
    fused = ctx.node(op_type, [b.x, scale_in] + ([beta] if beta is not None else []), attrs,
                     hint=node_name(m.node("bn")))
    fused.outputs[0].type, fused.outputs[0].shape = b.y.type, b.y.shape
    return finish(op_type, "", {b.y: fused.outputs[0]}, region,
                  {"axis": -1, "epsilon": eps, "form": "tf-keras BatchNormalization"})


def _check_bn_node(bn: ir.Node, opset: int) -> float:
    """Inference mode, one output read, per-channel ("spatial") statistics: BatchNormalization's epsilon. (Before
    opset 7, ``is_test`` defaults to 0: training.)"""
    if attr_value(bn, "training_mode", 0) != 0:
        raise Refusal("training", f"BatchNormalization '{node_name(bn)}' runs in training mode: it computes its own "
                      "batch statistics")
    if attr_value(bn, "is_test", 1 if opset >= 7 else 0) != 1 or attr_value(bn, "spatial", 1) != 1:
        raise Refusal("training", f"BatchNormalization '{node_name(bn)}' is not the per-channel inference form "
                      "(is_test=0 or spatial=0)")
    if len(bn.inputs) != 5:
        raise Refusal("operands", f"BatchNormalization '{node_name(bn)}' has {len(bn.inputs)} inputs, not 5")
    if any(out.uses() or out.is_graph_output() for out in bn.outputs[1:]):
        raise Refusal("intermediate", f"BatchNormalization '{node_name(bn)}' has running statistics read elsewhere")
    eps = float(attr_value(bn, "epsilon", 1e-5))
    if eps < 0 or not np.isfinite(eps):
        raise Refusal("epsilon", f"epsilon is {eps:g}; the fused op needs a finite epsilon >= 0")
    return eps


def _dims(value: ir.Value) -> list | None:
    return None if value.shape is None else list(value.shape)


def _check_bn_view(m: Match, x: ir.Value, view: ir.Node) -> int:
    """The view is x as [1, rows, H, 1]: BatchNormalization's channels (axis 1) are x's rows, H is x's last axis.
    H: the number each row's statistics are taken over."""
    target = static_value(m.value("bn_view_shape"))
    dims = _dims(x)
    if target is None or target.ndim != 1 or target.size != 4:
        raise Refusal("shape", f"Reshape '{node_name(view)}' does not view x as [1, rows, H, 1] (its target is not a "
                      "constant of 4 dims)")
    target = [int(d) for d in target]
    if not dims or not isinstance(dims[-1], int) or dims[-1] <= 0:
        raise Refusal("shape", f"the last dim of '{x.name}' is unknown, so the rows of the [1, rows, H, 1] view "
                      "cannot be proven to be its rows")
    h = dims[-1]
    leading = dims[:-1]
    rows = int(np.prod(leading)) if all(isinstance(d, int) for d in leading) else None
    if target[0] != 1 or target[2] != h or target[3] != 1 or not (target[1] == -1 or (rows is not None and
                                                                                    target[1] == rows)):
        raise Refusal("axes", f"Reshape '{node_name(view)}' views '{x.name}' {dims} as {target}, not as "
                      f"[1, rows, {h}, 1]: BatchNormalization's channels are not the rows of x")
    return h


def _check_bn_constant(value: ir.Value, want: float, what: str, bn: ir.Node) -> None:
    """BatchNormalization's scale (bias) is all ones (zeros): a constant, or an Expand of one."""
    source = value
    producer = value.producer()
    if static_value(value) is None and producer is not None and is_op(producer, "Expand") and \
            producer.domain in ("", "ai.onnx"):
        source = producer.inputs[0]
    array = static_value(source)
    if array is None:
        raise Refusal(what, f"the {what} of BatchNormalization '{node_name(bn)}' ('{value.name}') is not a constant")
    if array.size == 0 or not np.all(array == want):
        raise Refusal(what, f"the {what} of BatchNormalization '{node_name(bn)}' is {array.reshape(-1)[:4].tolist()}, "
                      f"not all {want}s: the norm is scaled or shifted per row")


def _axes_of(node: ir.Node, rank: int = 4) -> list[int] | None:
    axes = attr_value(node, "axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
        found = static_value(node.inputs[1])
        axes = None if found is None else found.reshape(-1).tolist()
    return None if axes is None else sorted({int(a) % rank for a in axes})


def _check_reduction(node: ir.Node, squeeze: ir.Node | None, what: str) -> None:
    """A per-row statistic of the view: reduced over axes 0, 2, 3, and handed to BatchNormalization as [rows]
    (keepdims=0, or keepdims=1 and a Squeeze of the same axes)."""
    axes = _axes_of(node)
    if axes != _BN_AXES:
        raise Refusal("axes", f"{node.op_type} '{node_name(node)}' ({what}) reduces axes {axes} of the "
                      f"[1, rows, H, 1] view, not {_BN_AXES}: not a statistic of each row")
    keepdims = attr_value(node, "keepdims", 1)
    if squeeze is None and keepdims:
        raise Refusal("keepdims", f"{node.op_type} '{node_name(node)}' ({what}) keeps its axes and nothing squeezes "
                      "them")
    if squeeze is not None and (not keepdims or _axes_of(squeeze) != _BN_AXES):
        raise Refusal("keepdims", f"Squeeze '{node_name(squeeze)}' does not remove exactly the axes {what} reduced")


def _check_bn_mean(m: Match) -> None:
    """BatchNormalization's mean is the mean of each row, and the variance centres by it."""
    _check_reduction(m.node("mean"), m.node("bn_mean_squeeze"), "the mean")
    vmean = m.node("vmean")
    axes = reduced_axes(m, "vmean")
    if sorted(a % 4 for a in axes) != _BN_AXES:
        raise Refusal("axes", f"{vmean.op_type} '{node_name(vmean)}' centres the variance by a mean over axes "
                      f"{list(axes)} of the view, not {_BN_AXES}")
    x_scale = float(m.fact("dsq_x", 1.0))
    if abs(abs(x_scale) - 1) > 1e-6:
        raise Refusal("mean", f"the squared deviation scales x by {x_scale:g}")
    check_mean_scale(float(m.fact("dsq_mean", 1.0)) / x_scale, m, "vmean", "the squared deviation (x - mean)")


def _check_bn_variance(m: Match, h: int) -> None:
    """The variance is the population variance of each row: the sum of squared deviations over axes 0, 2, 3 of the
    view divided by H (or their mean)."""
    var = m.node("var")
    for name in ("var_unsqueeze", "var_expand"):
        if m.node(name) is not None:
            raise Refusal("keepdims", f"the variance is re-broadcast by '{node_name(m.node(name))}', where "
                          "BatchNormalization takes one value per row")
    _check_reduction(var, m.node("bn_var_squeeze"), "the variance")
    count = h if onnx_op(var) in SUMS else 1
    scale = float(m.fact("var_scale", 1.0))
    if abs(scale * count - 1) > 1e-6:
        raise Refusal("variance", f"{var.op_type} '{node_name(var)}' of {count} element(s) is scaled by {scale:.6g}: "
                      f"the variance needs {1 / count:.6g}")


def _shape_source(value: ir.Value) -> ir.Value | None:
    """The tensor whose whole shape ``value`` is: Shape(t), seen through integer Casts (tf2onnx's int64 -> int32
    -> int64 round trip)."""
    for _ in range(4):
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if is_op(node, "Shape"):
            if attr_value(node, "start", 0) != 0 or attr_value(node, "end") is not None:
                return None
            return node.inputs[0]
        if not is_op(node, "Cast") or attr_value(node, "to") not in (ir.DataType.INT32.value, ir.DataType.INT64.value):
            return None
        value = node.inputs[0]
    return None


def _check_restores_shape(back: ir.Node, x: ir.Value) -> None:
    """The Reshape after BatchNormalization gives back x's shape: to Shape(x), or to x's static shape."""
    target = back.inputs[1]
    if _shape_source(target) is x:
        return
    wanted, dims = static_value(target), _dims(x)
    if wanted is not None and dims is not None and all(isinstance(d, int) for d in dims) and \
            wanted.reshape(-1).tolist() == dims:
        return
    raise Refusal("shape", f"Reshape '{node_name(back)}' does not restore the shape of '{x.name}'")
