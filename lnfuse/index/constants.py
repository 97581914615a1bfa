"""Values known before the model runs: initializers, Constant nodes, and small computations on them.

Exporters rarely write epsilon or reduction axes as a plain initializer: the ONNX function bodies write
``Cast(Constant)`` for epsilon and ``Range(axis, Size(Shape(X)))`` for the axes, and onnxscript writes every literal
as ``CastLike(Constant, x)``. A value computed only from constants and from other values' types or shapes
(``CastLike``'s second input, ``Shape``, ``Size``) is fixed when the model is built, whatever those values hold.
Folding those few ops here lets a rule read the number it needs without running the model. Large initializers are
never read by ``is_static``. Every fold is sized first (``budget``): a value that would be larger than the budget is
not computed, and counts as unknown.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from lnfuse.index.budget import OverBudget, output_elements, require
from lnfuse.index.ops import is_op, onnx_op

_MAX_DEPTH = 8
_FOLDABLE = frozenset(
    {"Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Range", "Concat", "Gather", "Slice", "Add", "Sub",
     "Mul", "Div", "Neg", "ConstantOfShape", "Shape", "Size", "Flatten", "Expand", "Sqrt", "Reciprocal", "CastLike",
     # jnp.var's guard Where(N - ddof > 0, ...) and tf-keras's count ReduceProd(Gather(Shape(x), axes)) are fixed
     # once the dims they read are
     "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal", "Not", "And", "Or", "ReduceProd"}
)



def is_static(value: ir.Value, depth: int = 0, memo: dict | None = None) -> bool:
    """True when the value is fixed at build time. Reads no tensor data.

    ``memo`` keeps answers while the graph does not change (the engine keeps one per pass): without it, the walk up
    a value's producers runs again for every chain that meets the value. The answer depends on how deep the walk
    already is (it gives up past ``_MAX_DEPTH``) and holds up to some depth, failing beyond: per value, the memo
    keeps the deepest depth known to hold and the shallowest known to fail."""
    if memo is None:
        # one memo for this walk at least: without it, a value read twice by each of 8 levels is walked 2**8 times
        memo = {}
    holds, fails = memo.get(value, (-1, math.inf))
    if depth <= holds or depth >= fails:
        return depth <= holds
    answer = _is_static(value, depth, memo)
    holds, fails = memo.get(value, (-1, math.inf))
    memo[value] = (max(holds, depth), fails) if answer else (holds, min(fails, depth))
    return answer


def _is_static(value: ir.Value, depth: int, memo: dict | None) -> bool:
    if value is None or value.is_graph_input():
        return False
    node = value.producer()
    if node is None:
        return value.const_value is not None
    if onnx_op(node) is None or depth > _MAX_DEPTH or any(a.is_ref() for a in node.attributes.values()):
        return False  # a function attribute's value is known only at each call
    if is_op(node, "Constant"):
        return len(node.attributes) == 1 and not next(iter(node.attributes.values())).is_ref()
    if onnx_op(node) in ("Shape", "Size"):
        # Size(Shape(x)) is the rank: Shape's output has a static shape even when x's dims are symbolic
        dims = _read_dims(node)
        return dims is not None and all(isinstance(d, int) for d in dims)
    if onnx_op(node) not in _FOLDABLE:
        return False
    if _known_dims_of_shape(node, depth) is not None:
        return True
    if is_op(node, "CastLike"):
        # reads only the dtype of its second input
        like = node.inputs[1]
        return like is not None and like.type is not None and is_static(node.inputs[0], depth + 1, memo)
    return all(v is None or is_static(v, depth + 1, memo) for v in node.inputs)


def _known_dims_of_shape(node: ir.Node, depth: int = 0) -> np.ndarray | None:
    """``Gather(Shape(x), i)`` where the dims it picks are known: ``x.shape[-1]`` traced by the TorchScript exporter
    with a dynamic batch (a mean written ``x.sum(-1) / x.shape[-1]``) is a constant though Shape(x) is not."""
    if not is_op(node, "Gather") or _attr(node, "axis", 0) != 0 or len(node.inputs) != 2 or None in node.inputs:
        return None
    shape_node = node.inputs[0].producer()
    if shape_node is None or not is_op(shape_node, "Shape") or \
            not is_static(node.inputs[1], depth + 1):
        return None
    dims = _read_dims(shape_node)
    try:
        indices = np.asarray(_evaluate(node.inputs[1], {}))
    except (ValueError, TypeError, IndexError, KeyError, ArithmeticError):
        return None
    if dims is None or indices.dtype.kind not in "iu" or \
            not all(-len(dims) <= int(i) < len(dims) for i in indices.ravel()):
        return None
    picked = [dims[int(i)] for i in indices.ravel()]
    if not all(isinstance(d, int) for d in picked):
        return None
    return np.array(picked, dtype=np.int64).reshape(indices.shape)


def _read_dims(node: ir.Node) -> list | None:
    """The dims a Shape (its start:end slice) or Size node reads."""
    shape = node.inputs[0].shape if node.inputs and node.inputs[0] is not None else None
    if shape is None:
        return None
    dims = list(shape)
    if is_op(node, "Shape"):
        dims = dims[_attr(node, "start", 0):_attr(node, "end", None)]
    return dims


def static_value(value: ir.Value | None, memo: dict | None = None) -> np.ndarray | None:
    """The value's numbers if ``is_static`` holds, else None (``memo`` as for ``is_static``); None too when
    computing it would exceed the budget (``fold`` says so)."""
    try:
        return fold(value, memo)
    except OverBudget:
        return None


def fold(value: ir.Value | None, memo: dict | None = None) -> np.ndarray | None:
    """As ``static_value``, but raises ``OverBudget`` (with the node and the size) when the value, or one it is
    computed from, would be larger than the budget: a check can then say why it has no number."""
    if value is None or not is_static(value, 0, memo):
        return None
    try:
        return _evaluate(value, {})
    except OverBudget:
        raise
    except (ValueError, TypeError, IndexError, KeyError, ArithmeticError):
        return None


def _attr(node: ir.Node, name: str, default=None):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _evaluate(value: ir.Value, done: dict) -> np.ndarray:
    """The value's numbers; ``done`` holds the values already computed in this fold (a value read by both inputs
    of each of 8 nodes would otherwise be computed 2**8 times)."""
    if value not in done:
        done[value] = _compute(value, done)
    return done[value]


def _compute(value: ir.Value, done: dict) -> np.ndarray:
    node = value.producer()
    if node is None:
        return np.asarray(value.const_value.numpy())
    op = onnx_op(node)
    if op == "Constant":
        attr = node.attributes.get("value")  # the common spelling, read without onnx_ir's Protocol check
        tensor = attr.value if attr is not None and attr.type == ir.AttributeType.TENSOR else \
            ir.convenience.get_const_tensor(value)
        if tensor is None:
            raise ValueError("unsupported Constant")
        return np.asarray(tensor.numpy())
    if op == "Shape":
        return np.array([int(d) for d in _read_dims(node)], dtype=np.int64)
    if op == "CastLike":
        return _evaluate(node.inputs[0], done).astype(node.inputs[1].dtype.numpy())
    if op == "Size":
        # math.prod: numpy's product of declared dims wraps around past 2**63
        return np.array(math.prod(int(d) for d in node.inputs[0].shape), dtype=np.int64)
    known = _known_dims_of_shape(node)
    if known is not None:
        return known
    args = [None if v is None else _evaluate(v, done) for v in node.inputs]
    # sized before numpy allocates: the inputs are small, the output may be gigabytes
    require(output_elements(op, lambda name, default: _attr(node, name, default), args),
            f"{op} '{node.name}'")
    return FOLD[op](node, args)


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ONNX's integer Div truncates toward zero (C semantics); numpy's // floors."""
    q = a // b
    return np.where((q < 0) & (q * b != a), q + 1, q).astype(q.dtype)


def _axes(node: ir.Node, args: list) -> list[int]:
    axes = _attr(node, "axes")
    if axes is None and len(args) > 1 and args[1] is not None:
        axes = args[1].tolist()
    return list(axes) if axes is not None else []


def _unsqueeze(node, args):
    out = args[0]
    rank = out.ndim + len(_axes(node, args))
    for axis in sorted(a % rank for a in _axes(node, args)):
        out = np.expand_dims(out, axis)
    return out


def _squeeze(node, args):
    axes = _axes(node, args)
    return np.squeeze(args[0], axis=tuple(axes) if axes else None)


def _slice(node, args):
    data = args[0]
    starts = _attr(node, "starts") or args[1].tolist()
    ends = _attr(node, "ends") or args[2].tolist()
    axes = _attr(node, "axes") or (args[3].tolist() if len(args) > 3 and args[3] is not None else
                                   list(range(len(starts))))
    steps = args[4].tolist() if len(args) > 4 and args[4] is not None else [1] * len(starts)
    index = [slice(None)] * data.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        index[a] = slice(s, e, st)
    return data[tuple(index)]


def _cast(node, args):
    return args[0].astype(ir.DataType(_attr(node, "to")).numpy())


def _reshape(node, args):
    shape = [d if d != 0 else args[0].shape[i] for i, d in enumerate(args[1].tolist())]
    return args[0].reshape(shape)


def _constant_of_shape(node, args):
    fill = _attr(node, "value")
    fill_value = fill.numpy().reshape(-1)[0] if fill is not None else np.float32(0)
    return np.full(args[0].tolist(), fill_value, dtype=np.asarray(fill_value).dtype)


def _flatten(node, args):
    axis = _attr(node, "axis", 1) % max(args[0].ndim, 1) if args[0].ndim else 0
    outer = int(np.prod(args[0].shape[:axis]))
    return args[0].reshape(outer, -1)


def _reduce_prod(node, args):
    data = args[0]
    axes = _axes(node, args)
    if not axes:
        if _attr(node, "noop_with_empty_axes", 0):
            return data
        axes = list(range(data.ndim))
    result = np.prod(data, axis=tuple(a % max(data.ndim, 1) for a in axes), keepdims=bool(_attr(node, "keepdims", 1)))
    return np.asarray(result, dtype=data.dtype)


#: each foldable op computed from its inputs' values (``library_budget`` folds small protobuf constants with it too)
FOLD = {
    "Cast": _cast,
    "Identity": lambda n, a: a[0],
    "Reshape": _reshape,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Range": lambda n, a: np.arange(a[0], a[1], a[2]).astype(a[0].dtype),
    "Concat": lambda n, a: np.concatenate([x for x in a if x is not None], axis=_attr(n, "axis")),
    "Gather": lambda n, a: np.take(a[0], a[1], axis=_attr(n, "axis", 0)),
    "Slice": _slice,
    "Add": lambda n, a: a[0] + a[1],
    "Sub": lambda n, a: a[0] - a[1],
    "Mul": lambda n, a: a[0] * a[1],
    "Div": lambda n, a: _int_div(*a) if a[0].dtype.kind in "iu" else a[0] / a[1],
    "Neg": lambda n, a: -a[0],
    "Sqrt": lambda n, a: np.sqrt(a[0]),
    "Reciprocal": lambda n, a: 1 / a[0],
    "ConstantOfShape": _constant_of_shape,
    "Flatten": _flatten,
    "Expand": lambda n, a: a[0] * np.ones(a[1].tolist(), dtype=a[0].dtype),
    "Greater": lambda n, a: np.greater(a[0], a[1]),
    "Less": lambda n, a: np.less(a[0], a[1]),
    "GreaterOrEqual": lambda n, a: np.greater_equal(a[0], a[1]),
    "LessOrEqual": lambda n, a: np.less_equal(a[0], a[1]),
    "Equal": lambda n, a: np.equal(a[0], a[1]),
    "Not": lambda n, a: np.logical_not(a[0]),
    "And": lambda n, a: np.logical_and(a[0], a[1]),
    "Or": lambda n, a: np.logical_or(a[0], a[1]),
    "ReduceProd": _reduce_prod,
}
