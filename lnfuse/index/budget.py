"""One budget for every array computed from a model's constants.

A model file is a program: a few bytes of ``ConstantOfShape([2**28])``, ``Expand(eps, [2**15, 2**15])``,
``Range(0, 2**30, 1)`` or 28 ``Concat(x, x)`` describe gigabytes. lnfuse folds such values itself (``constants``)
and hands the graph to libraries that fold them too (onnx's data propagation, ONNX Runtime's symbolic shape
inference). Both are asked first how many elements a fold would make, from the inputs' shapes and the size inputs'
values, before anything is allocated; over ``MAX_ELEMENTS`` the value is treated as unknown and whoever needed it
refuses with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

#: the most elements of one array computed from constants (8 MiB of int64). What a norm needs is an epsilon, axes,
#: a shape or a gamma of the hidden size: thousands of elements. The libraries store folded values at up to ~150
#: bytes an element (onnx keeps each as a dim of a TensorShapeProto, ONNX Runtime's inference as Python ints), so
#: the same number also bounds the sum of everything they may fold in one model (``shapes``): about 150 MiB.
MAX_ELEMENTS = 1 << 20


class OverBudget(ValueError):
    """Computing a value would make an array larger than ``MAX_ELEMENTS``. A ValueError: callers that treat a
    value they cannot fold as unknown do so for this one too."""


def require(count: int, what: str) -> None:
    """Raise ``OverBudget`` naming ``what`` when ``count`` elements exceed the budget."""
    if count > MAX_ELEMENTS:
        raise OverBudget(f"{what} would make {count:,} elements, over lnfuse's budget of {MAX_ELEMENTS:,} for a value "
                         "computed from constants")


def elements(shape: Sequence[int]) -> int:
    """Elements of a shape, in Python ints: a product of huge dims must not wrap around as numpy's would."""
    return math.prod(int(d) for d in shape)


def broadcast(*shapes: Sequence[int]) -> tuple[int, ...]:
    """numpy's broadcast of shapes, computed on the dims alone (ValueError when they do not broadcast)."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(rank):
        dims = {int(s[axis - rank + len(s)]) for s in shapes if axis - rank + len(s) >= 0} - {1}
        if len(dims) > 1:
            raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


#: ops whose output has the elements of their first input, or fewer
_SAME_OR_FEWER = frozenset({"Cast", "CastLike", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Slice",
                            "Neg", "Abs", "Sqrt", "Reciprocal", "Floor", "Ceil", "Not", "Sign", "Relu",
                            "ReduceProd"})
#: elementwise ops with numpy broadcasting
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Mod", "Pow", "Max", "Min", "Equal", "Less", "Greater",
                           "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Where", "Sum", "Mean"})
#: ops whose output size is decided by the values of an input (or an attribute), not only by the inputs' sizes
SIZE_PRODUCING = frozenset({"ConstantOfShape", "Expand", "Range", "Tile", "Pad", "Resize", "Upsample", "OneHot",
                            "Concat", "Gather"})
#: every op ``output_elements`` can size
SIZED = _SAME_OR_FEWER | _BROADCASTING | SIZE_PRODUCING


def output_elements(op: str, attr: Callable[[str, object], object], args: Sequence[np.ndarray | None]) -> int:
    """How many elements ``op`` makes from ``args`` (arrays whose shapes count, and whose values count for the size
    inputs), before it is computed. ``attr(name, default)`` reads the node's attributes. ValueError (or KeyError)
    when the inputs make no sense for the op; KeyError for an op not in ``SIZED``."""
    if op in _SAME_OR_FEWER:
        return int(args[0].size)
    if op in _BROADCASTING:
        return elements(broadcast(*(a.shape for a in args if a is not None)))
    return _SIZERS[op](attr, args)


def _values(array: np.ndarray) -> list[int]:
    return [int(v) for v in np.asarray(array).reshape(-1)]


def _non_negative(dims: list[int], what: str) -> list[int]:
    if any(d < 0 for d in dims):
        raise ValueError(f"{what} {dims} has a negative size")
    return dims


def _range(attr, args) -> int:
    start, limit, delta = (np.asarray(a).reshape(-1)[0].item() for a in args[:3])
    if delta == 0:
        raise ValueError("Range with delta 0 never ends")
    return max(math.ceil((limit - start) / delta), 0)


def _expand(attr, args) -> int:
    return elements(broadcast(args[0].shape, _non_negative(_values(args[1]), "Expand shape")))


def _tile(attr, args) -> int:
    repeats = _non_negative(_values(args[1]), "Tile repeats")
    if len(repeats) != args[0].ndim:
        raise ValueError("Tile repeats do not match the input's rank")
    return elements(d * r for d, r in zip(args[0].shape, repeats))


def _pad(attr, args) -> int:
    pads = _values(args[1]) if len(args) > 1 and args[1] is not None else list(attr("pads", []) or [])
    shape, rank = args[0].shape, args[0].ndim
    if len(args) > 3 and args[3] is not None:  # opset 18: pads only on these axes
        axes = [a % max(rank, 1) for a in _values(args[3])]
    else:
        axes = list(range(rank))
    if len(pads) != 2 * len(axes):
        raise ValueError("Pad's pads do not match its axes")
    dims = list(shape)
    for i, axis in enumerate(axes):
        dims[axis] += pads[i] + pads[i + len(axes)]
    return elements(_non_negative(dims, "Pad output"))


def _resize(attr, args) -> int:
    sizes = args[3] if len(args) > 3 and args[3] is not None and args[3].size else None
    if sizes is not None:
        return elements(_non_negative(_values(sizes), "Resize sizes"))
    scales = args[2] if len(args) > 2 else args[1] if len(args) > 1 else None
    if scales is None:
        scales = np.asarray(attr("scales", []) or [], dtype=np.float64)
    factors = [float(s) for s in np.asarray(scales).reshape(-1)]
    if len(factors) != args[0].ndim or not all(math.isfinite(f) and f >= 0 for f in factors):
        raise ValueError("Resize scales do not match the input")
    return elements(math.floor(d * f) for d, f in zip(args[0].shape, factors))


def _one_hot(attr, args) -> int:
    return int(args[0].size) * max(_values(args[1])[0], 0)


def _concat(attr, args) -> int:
    return sum(int(a.size) for a in args if a is not None)


def _gather(attr, args) -> int:
    data, indices = args[0], args[1]
    axis = int(attr("axis", 0))
    if not -data.ndim <= axis < data.ndim:
        raise ValueError("Gather axis out of range")
    rows = data.shape[axis]
    return int(indices.size) * (int(data.size) // rows if rows else 0)


def _constant_of_shape(attr, args) -> int:
    return elements(_non_negative(_values(args[0]), "ConstantOfShape shape"))


_SIZERS = {"Range": _range, "Expand": _expand, "Tile": _tile, "Pad": _pad, "Resize": _resize, "Upsample": _resize,
           "OneHot": _one_hot, "Concat": _concat, "Gather": _gather, "ConstantOfShape": _constant_of_shape}


def stand_in(dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    """An array of the given shape that takes no memory (a zero-strided view of one element): lets
    ``output_elements`` size an op whose data input is too large, or not known, to hold."""
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(int(d) for d in shape))
