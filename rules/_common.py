"""Pattern pieces and named checks shared by the normalization families.

Each check either returns what it proved (axes, epsilon, a parameter in the fused op's layout) or raises ``Refusal``
with the values it saw, so the report can say exactly why a candidate was left alone.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import onnx_ir as ir

from lnfuse.index.budget import OverBudget
from lnfuse.index.constants import fold, is_static, static_value
from lnfuse.match.pattern import Either, Match, Op, Pattern, Terms, attr_value, maybe_cast, mono, through_casts
from lnfuse.match.rule import GraphContext, Refusal
from lnfuse.index.ops import is_op, onnx_op

#: reductions that sum without dividing by the count (ReduceSumSquare sums the squares)
SUMS = ("ReduceSum", "ReduceSumSquare")
FLOATS = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE)
_WIDTH = {ir.DataType.FLOAT16: 16, ir.DataType.BFLOAT16: 16, ir.DataType.FLOAT: 32, ir.DataType.DOUBLE: 64}


# ---- pattern pieces ---------------------------------------------------------------------------------------------

def mean_over(x: Pattern, name: str) -> Pattern:
    """The mean of x over some axes, kept: ReduceMean with keepdims=1, ReduceMean with keepdims=0 followed by an
    Unsqueeze that restores the axes (``reduced_axes`` proves it), GlobalAveragePool (tf2onnx), which is the mean
    over every axis after the second, or a ReduceSum (its count is divided out in the normal form: ``reduced_count``
    says by how much).

    torch's dynamo exporter restores the axes of ``torch.var``/``var_mean`` its own way: a Reshape to the kept shape
    and an Expand to that same shape (``broadcast_in_dim``); ``reduced_axes`` proves both change no element.

    The reduction may read x through Casts (``through_casts``): fp16 tools average ``Cast32(x16)`` and subtract the
    mean from x16 itself."""
    return _kept(Op(("ReduceMean", "ReduceSum"), through_casts(x), name=name, extra_inputs=True), x, name)


def mean_of_square(d: Pattern, square_name: str, name: str) -> Pattern:
    """The mean of d², as ``mean_over`` reads it (``Pow(d, 2)``, ``d * d``, a widening Cast of d first), or as
    ``ReduceSumSquare(d)``, which is ``ReduceSum(d * d)`` by definition (MindSpore's variance
    ``ReduceSumSquare(x - mean) / N``, jnp.var's ``ReduceSumSquare(x - mean)``): the exponent 2 is then the op's, and
    the count is divided out as for a ReduceSum."""
    squared = square(d, square_name)
    sum_square = Op("ReduceSumSquare", squared[0], name=name, extra_inputs=True)
    # Equinox averages the squares in float64 and rounds the mean back: Cast(ReduceMean(Cast(d², double)), float)
    # (a Cast the rule proves keeps the norm's precision: ``rules/_norm.py``, ``check_casts``)
    wide = maybe_cast(Terms(mono(1, squared)), f"{name}_wide")
    statistic = Either(mean_over(wide, name), _kept(sum_square, None, name))
    return Either(Op("Cast", statistic, name=f"{name}_narrow"), statistic)


def _kept(reduce: Pattern, x: Pattern | None, name: str) -> Pattern:
    """``reduce`` with its axes kept: by keepdims=1, an Unsqueeze or Reshape restoring them, an Expand to the same
    shape after either, or (for a mean of ``x``) GlobalAveragePool."""
    restored = Op(("Unsqueeze", "Reshape"), reduce, name=f"{name}_unsqueeze", extra_inputs=True)
    expanded = Op("Expand", Either(reduce, restored), name=f"{name}_expand", extra_inputs=True)
    forms = [reduce, restored, expanded] + ([Op("GlobalAveragePool", x, name=name)] if x is not None else [])
    return Either(*forms)


def square(d: Pattern, name: str) -> tuple[Pattern, str]:
    """d ** e, any spelling (``Pow(d, 2)``, ``Mul(d, d)``, ``d`` cast first); e is the fact ``{name}_exponent``,
    which ``check_exponent`` proves is 2."""
    return (maybe_cast(d, f"{name}_cast"), f"{name}_exponent")


def _check_unsqueezed(node: ir.Node, unsqueeze: ir.Node, axes: list[int], rank: int | None) -> None:
    restored = attr_value(unsqueeze, "axes")
    if restored is None:
        found = static_value(unsqueeze.inputs[1]) if len(unsqueeze.inputs) > 1 else None
        if found is None:
            raise Refusal("keepdims", f"the axes of Unsqueeze '{unsqueeze.name}' are computed at run time")
        restored = found.reshape(-1).tolist()
    out_rank = rank if rank is not None else len(axes) + (rank_of(node.outputs[0]) or 0)
    restored = sorted(int(a) - out_rank if int(a) >= 0 else int(a) for a in restored)
    if restored != axes:
        raise Refusal("keepdims", f"ReduceMean '{node.name}' reduces axes {axes} but Unsqueeze "
                      f"'{unsqueeze.name}' restores {restored}")


def _kept_shape(x: ir.Value, axes: list[int]) -> list | None:
    """x's shape with the reduced axes as 1: the shape of the mean with keepdims=1."""
    if x.shape is None:
        return None
    rank = len(x.shape)
    return [1 if i - rank in axes else d for i, d in enumerate(x.shape)]


def _check_same_shape(value: ir.Value, want, what: str, node: ir.Node) -> None:
    """``value`` has exactly the shape ``want`` (known dims equal, symbolic dims the same symbol): a Reshape to the
    kept shape only puts back the reduced axes, an Expand to its input's shape copies nothing."""
    got = None if value.shape is None else list(value.shape)
    want = None if want is None else list(want)
    if got is None or want is None or len(got) != len(want) or \
            any(not same_dim(a, b) for a, b in zip(got, want)):
        raise Refusal("keepdims", f"{what} after ReduceMean '{node.name}' gives shape {got}, where restoring the "
                      f"reduced axes needs {want}")


def same_dim(a, b) -> bool:
    """Two dims known to be equal: the same size, or one named symbolic dim (an unnamed unknown dim equals
    nothing)."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a is not None and b is not None and a.value is not None and a.value == b.value


def kept_dims(m: Match, name: str) -> ir.Value:
    """The keepdims=1 form of a ``mean_over`` match."""
    return m.value(f"{name}_expand") or m.value(f"{name}_unsqueeze") or m.value(name)


# ---- checks -----------------------------------------------------------------------------------------------------

def rank_of(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def reduced_count(m: Match, name: str) -> int:
    """How many elements a ``mean_over`` match sums without dividing: 1 for a mean, the product of the reduced dims
    for a ReduceSum (which must then be known)."""
    node = m.node(name)
    if onnx_op(node) not in SUMS:
        return 1
    shape = node.inputs[0].shape
    dims = [] if shape is None else [list(shape)[a] for a in reduced_axes(m, name)]
    if shape is None or not all(isinstance(d, int) for d in dims):
        raise Refusal("shape", f"ReduceSum '{node.name}' sums dims {dims or '?'} of unknown size: the count it must "
                      "be divided by to be a mean is unknown")
    return int(np.prod(dims))


def check_mean_scale(scale: float, m: Match, name: str, what: str, check: str = "mean") -> None:
    """``scale * reduction`` must be the mean: 1 for ReduceMean, 1/N for a ReduceSum of N elements."""
    count = reduced_count(m, name)
    if abs(scale * count - 1) > 1e-6:
        node = m.node(name)
        raise Refusal(check, f"{node.op_type} '{node.name}' of {count} element(s) is scaled by {scale:.6g}: "
                      f"{what} needs {1 / count:.6g}")


def reduced_axes(m: Match, name: str) -> tuple[int, ...]:
    """The axes a ``mean_over`` match reduces, as negative numbers, proven to be kept (keepdims or Unsqueeze)."""
    node = m.node(name)
    x = node.inputs[0]
    rank = rank_of(x)
    if is_op(node, "GlobalAveragePool"):
        if rank is None or rank < 3:
            raise Refusal("axes", f"GlobalAveragePool '{node.name}' needs an input of known rank >= 3")
        return tuple(range(2 - rank, 0))
    axes = attr_value(node, "axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
        found = static_value(node.inputs[1])
        if found is None:
            raise Refusal("axes", f"the axes of ReduceMean '{node.name}' are computed at run time")
        axes = found.reshape(-1).tolist()
    if not axes:
        if attr_value(node, "noop_with_empty_axes", 0):
            raise Refusal("axes", f"ReduceMean '{node.name}' has empty axes with noop_with_empty_axes=1 (no reduction)")
        if rank is None:
            raise Refusal("axes", f"ReduceMean '{node.name}' reduces all axes of a tensor of unknown rank")
        axes = list(range(rank))
    axes = [int(a) for a in axes]
    if any(a >= 0 for a in axes):
        if rank is None:
            raise Refusal("axes", f"ReduceMean '{node.name}' has axes {axes} but the rank of its input is unknown")
        axes = [a - rank if a >= 0 else a for a in axes]
    axes = sorted(set(axes))
    keepdims = attr_value(node, "keepdims", 1)
    unsqueeze = m.node(f"{name}_unsqueeze")
    # the unit-dim restores among the views seen above the statistic (Transposes above them: ``check_layouts``)
    restores = [split_views(chain)[1] for chain in m.views(node.outputs[0])]
    restores = [chain for chain in restores if chain]
    if restores:
        # re-broadcast with the ops around it (``algebra._viewed``): each Reshape only inserts unit dims, so the
        # outermost one's shape says where the statistic's rows are
        if keepdims or unsqueeze is not None:
            raise Refusal("keepdims", f"Reshape '{restores[0][0].name}' adds axes to {node.op_type} "
                          f"'{node.name}', which kept them")
        for chain in restores:
            _check_same_shape(chain[0].outputs[0], _kept_shape(x, axes), f"Reshape '{chain[0].name}'", node)
    elif unsqueeze is None and not keepdims:
        raise Refusal("keepdims", f"ReduceMean '{node.name}' drops the reduced axes (keepdims=0)")
    if unsqueeze is not None:
        if keepdims:
            raise Refusal("keepdims", f"{unsqueeze.op_type} '{unsqueeze.name}' adds axes to a ReduceMean that kept "
                          "them")
        if is_op(unsqueeze, "Reshape"):
            _check_same_shape(unsqueeze.outputs[0], _kept_shape(x, axes), f"Reshape '{unsqueeze.name}'", node)
        else:
            _check_unsqueezed(node, unsqueeze, axes, rank)
    expand = m.node(f"{name}_expand")
    if expand is not None:
        # Expand only broadcasts: to its input's own shape it is the identity
        _check_same_shape(expand.outputs[0], expand.inputs[0].shape, f"Expand '{expand.name}'", node)
    return tuple(axes)


def split_views(chain: tuple[ir.Node, ...]) -> tuple[tuple[ir.Node, ...], tuple[ir.Node, ...]]:
    """(Transposes, unit-dim restores): the restores must be the innermost views (a statistic's dropped axes put back,
    then the whole moved)."""
    transposes = tuple(n for n in chain if is_op(n, "Transpose"))
    restores = chain[len(transposes):]
    if any(is_op(n, "Transpose") for n in restores):
        raise Refusal("layout", f"Reshape '{node_name(restores[0])}' inserts unit dims above Transpose: a statistic's "
                      "axes are restored only before it is moved")
    return transposes, restores


def agreed_axes(m: Match, names: Iterable[str]) -> tuple[int, ...]:
    """The axes every reduction of the norm reduces (refused when they disagree). A restore the normal form saw
    (a Reshape inserting unit dims) must sit above one of these statistics: on any other value it changes its rank."""
    names = tuple(names)
    statistics = {m.node(n).outputs[0] for n in names if m.node(n) is not None}
    for _, value, chain in m.viewed():
        restores = split_views(chain)[1]
        if restores and value not in statistics and not _with_statistic(m, value, statistics):
            raise Refusal("keepdims", f"Reshape '{restores[0].name}' inserts unit dims into '{value.name}', which "
                          "is not a statistic of the norm")
    first, axes = None, None
    for name in names:
        if m.node(name) is None:
            continue
        found = reduced_axes(m, name)
        if axes is not None and found != axes:
            raise Refusal("axes", f"ReduceMean '{m.node(first).name}' reduces {list(axes)} but "
                          f"'{m.node(name).name}' reduces {list(found)}")
        first, axes = first or name, found
    return axes


def _with_statistic(m: Match, value: ir.Value, statistics: set[ir.Value]) -> bool:
    """``value`` is var + eps (or its eps) of the same shape as the variance: restoring it restores the variance
    (which the normal form then sees restored too) and adds eps, one number, on the same rows."""
    var_eps = m.value("var_eps")
    if var_eps is None or value not in (var_eps, m.value("eps")):
        return False
    return any(s.shape is not None and var_eps.shape is not None and len(s.shape) == len(var_eps.shape) and
               all(same_dim(a, b) for a, b in zip(s.shape, var_eps.shape)) for s in statistics)


def trailing_axes(axes: tuple[int, ...], node: ir.Node) -> int:
    """Number of normalized axes, after proving they are the last ones."""
    k = len(axes)
    if list(axes) != list(range(-k, 0)):
        raise Refusal("axes", f"ReduceMean '{node.name}' reduces axes {list(axes)}, not the trailing ones")
    shape = node.inputs[0].shape
    if shape is not None and len(shape) >= k and any(d == 0 for d in list(shape)[len(shape) - k:]):
        # the mean of nothing: the graph gives an empty tensor, the fused kernels refuse to run
        raise Refusal("shape", f"ReduceMean '{node.name}' normalizes over an empty axis {dims_text(shape)}")
    return k


def channel_axis(axes: tuple[int, ...], node: ir.Node) -> int | None:
    """The one axis a channels-first norm normalizes (axis 1 of NCHW, or any single axis after the batch axis that
    is not the last), as a non-negative index; None when the axes are the trailing ones."""
    rank = rank_of(node.inputs[0])
    if rank is not None and any(not -rank <= a < rank for a in axes):
        # ONNX Runtime refuses such a model; an untrusted one still gets a refusal, not a crash
        raise Refusal("axes", f"ReduceMean '{node.name}' reduces axes {list(axes)}, outside its input's rank {rank}")
    if len(axes) == 1 and axes[0] != -1 and rank is not None and axes[0] + rank >= 1:
        dim = list(node.inputs[0].shape)[axes[0]]
        if dim == 0:
            raise Refusal("shape", f"ReduceMean '{node.name}' normalizes over an empty axis")
        return axes[0] + rank
    if axes and axes[-1] != -1:
        raise Refusal("axes", f"ReduceMean '{node.name}' reduces axes {list(axes)}, not the trailing ones (nor one "
                      "channel axis after the batch axis)")
    return None


def scalar(m: Match, name: str, what: str) -> float:
    """A constant that must hold one number and must not broadcast the result to another shape: epsilon, an
    exponent, a numerator."""
    value = m.value(name)
    try:
        array = fold(value)
    except OverBudget as over:
        raise Refusal("budget", f"{what} '{value.name}' is not computed: {over}") from None
    if array is None:
        producer = value.producer()
        source = f"node '{producer.name}' ({producer.op_type})" if producer is not None else "a graph input"
        raise Refusal(what, f"{what} '{value.name}' is not a constant (computed by {source})")
    flat = np.asarray(array).reshape(-1)
    if flat.dtype.kind not in "fiu":
        raise Refusal(what, f"{what} '{value.name}' is {flat.dtype}, not a number")
    if flat.size != 1:
        raise Refusal(what, f"{what} '{value.name}' holds {flat.size} values {flat[:4].tolist()}, not one number")
    x = m.value("x")
    rank = rank_of(x) if x is not None else None
    if np.ndim(array) > (rank if rank is not None else 1):
        raise Refusal(what, f"{what} '{value.name}' has shape {list(np.shape(array))}, which raises the rank")
    return float(flat[0])


def check_exponent(m: Match, name: str, expected: float, what: str = "exponent") -> None:
    exponent = m.fact(f"{name}_exponent")
    if exponent is not None and exponent != expected:
        raise Refusal(what, f"the square of the norm raises to {float(exponent):g}, not {expected:g}")


def epsilon(m: Match, name: str = "eps") -> float:
    """Epsilon as the norm adds it: the constant times its coefficient in the normal form. Zero is exact (the fused
    op then computes what the graph computes, NaN for constant rows included); a negative one is refused."""
    eps = scalar(m, name, "epsilon") * float(m.fact(f"{name}_scale", 1.0))
    if eps < 0 or not np.isfinite(eps):
        raise Refusal("epsilon", f"epsilon is {eps:g}; the fused op needs a finite epsilon >= 0")
    if eps > 0 and not 0 < np.float32(eps) < np.inf:
        raise Refusal("epsilon", f"epsilon {eps:g} becomes {np.float32(eps):g} in the fused op's float32 attribute")
    return eps


def check_epsilon_fits(eps: float, dtype: ir.DataType) -> None:
    """The ops' epsilon attribute is a float32: for a float64 norm, rounding it would change the result beyond
    double precision (fp16/fp32 norms never see the difference)."""
    if dtype == ir.DataType.DOUBLE and float(np.float32(eps)) != eps:
        raise Refusal("epsilon", f"epsilon {eps!r} of a float64 norm cannot be written exactly in the fused op's "
                      "float32 epsilon attribute")


def readers_outside(value: ir.Value, region: Iterable[ir.Node]) -> list[ir.Node]:
    inside = set(region)
    return [user for user, _ in value.uses() if user not in inside]


def read_outside(value: ir.Value, region: Iterable[ir.Node]) -> bool:
    """Whether anything but the region sees the value: another node, or the graph's outputs."""
    return value.is_graph_output() or bool(readers_outside(value, region))


def node_name(node: ir.Node | None) -> str:
    return "?" if node is None else (node.name or node.op_type)


# ---- dtypes and parameters --------------------------------------------------------------------------------------

def dtype_of(value: ir.Value) -> ir.DataType | None:
    return value.dtype if value.type is not None else None


def cast_target(node: ir.Node) -> ir.DataType:
    return ir.DataType(attr_value(node, "to"))


def is_widening(src: ir.DataType | None, dst: ir.DataType) -> bool:
    """A float-to-float Cast that every value survives exactly (fp16/bf16 -> fp32 -> fp64)."""
    if src not in _WIDTH or dst not in _WIDTH:
        return False
    if src == dst:
        return True
    return _WIDTH[src] < _WIDTH[dst] and not (src == ir.DataType.FLOAT16 and dst == ir.DataType.BFLOAT16)


def peel_widening_casts(value: ir.Value) -> ir.Value:
    """The value a chain of exact Casts started from: ``Cast(gamma_fp16 -> fp32)`` is gamma_fp16 seen as fp32."""
    while (node := value.producer()) is not None and is_op(node, "Cast") and \
            is_widening(dtype_of(node.inputs[0]), cast_target(node)):
        value = node.inputs[0]
    return value


def param_as(ctx: GraphContext, value: ir.Value, x: ir.Value, k: int, dtype: ir.DataType, what: str) -> ir.Value:
    """gamma or beta in the fused op's layout: shape x.shape[-k:] (or [H] for k=1) and the op's dtype.

    The math allows any operand that broadcasts onto the normalized axes without touching the leading ones; the
    fused op wants exactly the normalized shape. Constants are reshaped/broadcast and cast (only when exact);
    run-time tensors are accepted when their shape already is the normalized shape, up to leading 1s.
    """
    source = peel_widening_casts(value)
    x_rank = rank_of(x)
    shape = source.shape
    if shape is None:
        raise Refusal(what, f"the shape of {what} '{value.name}' is unknown")
    dims = list(shape)
    if x_rank is not None and len(dims) > x_rank:
        raise Refusal(what, f"{what} '{value.name}' has shape {dims_text(dims)}, which raises the rank of the input "
                      f"(rank {x_rank})")
    lead, tail = dims[:-k] if len(dims) > k else [], dims[-k:] if k else []
    if any(d != 1 for d in lead):
        # a constant is a near-miss worth reporting; a run-time tensor of full shape is just the next op's operand
        raise Refusal(what if is_static(source) else "operand", f"{what} '{value.name}' has shape {dims_text(dims)}: it "
                      f"varies over the leading axes, not only the {k} normalized one(s); left outside the fused op")
    x_tail = list(x.shape)[-k:] if x.shape is not None else [None] * k
    target = []
    for have, want in zip([1] * (k - len(tail)) + tail, x_tail):
        if isinstance(want, int):
            target.append(want)
        elif have != 1 and isinstance(have, int):
            target.append(have)
        elif same_dim(have, want):
            target.append(want)  # a run-time operand of the input's own (named) normalized dims: [N] for [M, N]
        else:
            raise Refusal(what, f"the normalized dims of the input {dims_text(x_tail)} are not known, so {what} "
                          f"'{value.name}' {dims_text(dims)} cannot be laid out for the fused op")
    for have, want in zip([1] * (k - len(tail)) + tail, target):
        if have != want and have != 1:
            raise Refusal(what, f"{what} '{value.name}' has shape {dims_text(dims)}, which does not broadcast onto the "
                          f"normalized dims {target}")
    if all(isinstance(d, int) for d in target):
        check_laid_out(target, what)
    array = static_value(source)
    if array is not None:
        converted = _exact_astype(np.broadcast_to(array.reshape(tail if tail else []), target), dtype)
        if converted is None:
            # the numbers of a constant, and the dtype the op computes in: no shape decides it
            raise Refusal("dtype", f"{what} '{value.name}' ({dtype_of(source)}) is not exactly representable "
                          f"in {dtype}", decided=True)
        if source is value and value.producer() is None and list(array.shape) == target and \
                dtype_of(source) == dtype:
            return value
        return ctx.constant(converted, f"{value.name}_{dtype.name.lower()}")
    if dtype_of(source) != dtype:
        raise Refusal("dtype", f"{what} '{value.name}' is {dtype_of(source)} at run time and the fused op "
                      f"needs {dtype}")
    if tail != target:
        raise Refusal(what, f"{what} '{value.name}' has shape {dims_text(dims)} at run time; the fused op needs {target}")
    if dims == target:
        return source
    if not all(isinstance(d, int) for d in target):
        raise Refusal(what, f"{what} '{value.name}' has shape {dims_text(dims)} at run time: a Reshape to the normalized "
                      f"dims {dims_text(target)} needs their sizes, which are known only at run time")
    reshape = ctx.node("Reshape", [source, ctx.constant(np.array(target, dtype=np.int64), f"{what}_shape")],
                       hint=what)
    reshape.outputs[0].type = ir.TensorType(dtype)
    reshape.outputs[0].shape = ir.Shape(target)
    return reshape.outputs[0]


#: the most elements a constant the fused op needs in full (a broadcast gamma, a unit scale) may have: a norm that
#: wide cannot be verified within lnfuse.verification.region.BUDGET anyway, and a 300-byte model must not grow a
#: gigabyte weight
MAX_LAID_OUT = 1 << 25


def check_laid_out(dims: list[int], what: str) -> None:
    if int(np.prod(dims, dtype=object)) > MAX_LAID_OUT:
        raise Refusal("size", f"the fused op would need {what} of shape {dims} written out in full, over "
                      f"{MAX_LAID_OUT:,} elements; too large to verify, left as it is")


def channel_param(ctx: GraphContext, value: ir.Value, x: ir.Value, axis: int, dtype: ir.DataType,
                  what: str) -> ir.Value:
    """gamma or beta of a channels-first norm (``w[:, None, None]``) as the [C] vector the fused op takes after the
    channel axis is moved last: it must vary along the channel axis only."""
    source = peel_widening_casts(value)
    rank, array = rank_of(x), static_value(source)
    channels = list(x.shape)[axis] if x.shape is not None else None
    if array is None or not isinstance(channels, int):
        raise Refusal(what, f"{what} '{value.name}' of a channels-first norm must be a constant over a channel axis "
                      "of known size")
    if array.ndim > rank:
        raise Refusal(what, f"{what} '{value.name}' has shape {dims_text(array.shape)}, which raises the rank")
    dims = [1] * (rank - array.ndim) + list(array.shape)
    if any(d != 1 for i, d in enumerate(dims) if i != axis) or dims[axis] not in (1, channels):
        raise Refusal(what, f"{what} '{value.name}' has shape {dims_text(array.shape)}: it does not vary along the "
                      f"channel axis {axis} only")
    check_laid_out([channels], what)
    converted = _exact_astype(np.broadcast_to(array.reshape(-1), (channels,)), dtype)
    if converted is None:
        raise Refusal("dtype", f"{what} '{value.name}' is not exactly representable in {dtype}", decided=True)
    return ctx.constant(converted, f"{value.name}_channels")


def _exact_astype(array: np.ndarray, dtype: ir.DataType) -> np.ndarray | None:
    converted = np.asarray(array).astype(dtype.numpy())
    back = converted.astype(np.float64)
    original = np.asarray(array).astype(np.float64)
    return converted if np.array_equal(back, original, equal_nan=True) else None


def dims_text(dims) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def kernel_epsilon(norm: ir.Node, default: float) -> float:
    """A norm node's epsilon for ONNX Runtime's fused kernels, which refuse to load one that is negative (ONNX's
    LayerNormalization accepts any): such a norm stays as it is."""
    epsilon = float(attr_value(norm, "epsilon", default))
    if not math.isfinite(epsilon) or epsilon < 0:
        raise Refusal("epsilon", f"epsilon {epsilon:g} of '{norm.name}' is not a finite number >= 0, which ONNX "
                      "Runtime's fused kernels require")
    return epsilon
