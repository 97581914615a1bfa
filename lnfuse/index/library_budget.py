"""The budget (``budget.MAX_ELEMENTS``) applied to the libraries that infer shapes for lnfuse.

onnx's data-propagating inference and ONNX Runtime's symbolic inference fold values computed from constants
(``ConstantOfShape``, ``Range``, ``Concat``, arithmetic) to know the shapes they decide, with no bound: a 1 KB model
made them take gigabytes. Neither can be told a limit, so they are shown less: before inference, the graph is
walked in order, sizing what each node would make from values known at build time, exactly as ``constants`` sizes
its own folds. A node that would make more than the budget, or push the sum of everything computed past it, has its
known inputs renamed to fresh graph inputs of the same type and shape in the copy given to the libraries: they see
run-time data there, so they infer the node's shape symbolically and allocate nothing. The names are put back in
the result. Shapes that depend on such a node are then symbolic, which is all that is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from lnfuse.index.budget import MAX_ELEMENTS, SIZE_PRODUCING, SIZED, elements, output_elements, stand_in
from lnfuse.index.constants import FOLD
from lnfuse.index.ops import is_op, onnx_op

#: values held with their numbers (shapes, axes, epsilon) up to this many elements; larger known values are only
#: sized. A size input is never that large in a model worth fusing.
_SMALL = 4096
#: folds ``constants`` does not do, which shape arithmetic uses (``Where(Equal(shape, -1), 1, shape)``)
_EXTRA = {
    "Equal": lambda n, a: np.equal(a[0], a[1]),
    "Less": lambda n, a: np.less(a[0], a[1]),
    "Greater": lambda n, a: np.greater(a[0], a[1]),
    "Not": lambda n, a: np.logical_not(a[0]),
    "Where": lambda n, a: np.where(a[0], a[1], a[2]),
    "Max": lambda n, a: np.maximum.reduce(np.broadcast_arrays(*a)),
    "Min": lambda n, a: np.minimum.reduce(np.broadcast_arrays(*a)),
    "Abs": lambda n, a: np.abs(a[0]),
    "Tile": lambda n, a: _tile(a[0], a[1].tolist()),
}


def _tile(array: np.ndarray, repeats: list[int]) -> np.ndarray:
    """np.tile, but an empty result is made empty: numpy repeats axis by axis, and an input with a 0 dim tiled by
    2^40 made a 4 TiB intermediate for a result of no elements."""
    if array.size == 0 or 0 in repeats:
        return np.zeros([d * r for d, r in zip(array.shape, repeats)], array.dtype)
    return np.tile(array, repeats)


class _Attribute:
    def __init__(self, proto: onnx.AttributeProto):
        value = onnx.helper.get_attribute_value(proto)
        self.value = ir.TensorProtoTensor(value) if isinstance(value, onnx.TensorProto) else value


class _Node:
    """What the fold functions read of a node: its attributes, by name, each with a ``value``."""

    def __init__(self, proto: onnx.NodeProto):
        self.name = proto.name
        self.attributes = {a.name: _Attribute(a) for a in proto.attribute}


def _attr_reader(node: _Node):
    def read(name: str, default=None):
        attr = node.attributes.get(name)
        return default if attr is None else attr.value
    return read


@dataclass
class Hidden:
    """The fresh input names given to a graph's node inputs, each with the name it stands for."""

    renamed: dict[str, str] = field(default_factory=dict)


@dataclass
class _Walk:
    types: dict[str, onnx.TypeProto]
    known: dict[str, np.ndarray] = field(default_factory=dict)
    exact: set[str] = field(default_factory=set)  # names whose array holds the real numbers, not a stand-in
    total: int = 0
    shapes: dict[str, onnx.TypeProto] | None = None  # onnx's inference without data propagation, made on demand
    #: for a whole-model run, the most all nodes together may make beyond the data they read (None: the budget
    #: for everything the libraries fold, summed over the graph)
    per_node: int | None = None


def hide_oversized(proto: onnx.ModelProto) -> Hidden:
    """Rename in ``proto``'s main graph the known inputs of every node that would fold past the budget (see the
    module); ``restore`` puts them back."""
    hidden = Hidden()
    walk, over = _walk(proto)
    for index in over:
        _hide(proto, index, proto.graph.node[index], walk, hidden)
    return hidden


def first_oversized(proto: onnx.ModelProto, per_node: int) -> str | None:
    """The node of the main graph at which what the graph computes from build-time values, beyond the data it
    reads, passes ``per_node`` elements in all, described for a message; None when it never does. ``proto`` is
    not changed."""
    _, over = _walk(proto, per_node)
    if not over:
        return None
    node = proto.graph.node[over[0]]
    return f"{node.op_type} '{node.name}'"


def _walk(proto: onnx.ModelProto, per_node: int | None = None) -> tuple[_Walk, list[int]]:
    """What the main graph computes from build-time values, and the nodes (by index) that pass the budget."""
    graph = proto.graph
    walk, over = _Walk({v.name: v.type for v in graph.input}, per_node=per_node), []
    for tensor in graph.initializer:
        _source(walk, tensor.name, tensor)
    known = walk.known
    for index, node in enumerate(graph.node):
        op = onnx_op(node)
        if op not in _SOURCES and (op not in SIZED or not all(name in known or not name for name in node.input)):
            continue  # computed from run-time data (most nodes): nothing the libraries fold
        if op is not None and not _visit(walk, node, proto):
            over.append(index)
    return walk, over


def restore(proto: onnx.ModelProto, hidden: Hidden) -> None:
    """Undo ``hide_oversized`` on ``proto`` or on a model inference made from it. By name: ONNX Runtime's
    inference may hand back the nodes in another order."""
    if not hidden.renamed:
        return
    graph = proto.graph
    for node in graph.node:
        for slot, name in enumerate(node.input):
            if name in hidden.renamed:
                node.input[slot] = hidden.renamed[name]
    for field_name in ("input", "value_info"):
        infos = getattr(graph, field_name)
        kept = [v for v in infos if v.name not in hidden.renamed]
        if len(kept) != len(infos):
            del infos[:]
            infos.extend(kept)


def _source(walk: _Walk, name: str, tensor: onnx.TensorProto) -> None:
    """A constant the model holds: its bytes are in the file, so it costs nothing against the budget."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.data_type == onnx.TensorProto.STRING:
        return
    count = elements(tensor.dims)
    if count <= _SMALL:
        try:
            walk.known[name] = onnx.numpy_helper.to_array(tensor)
            walk.exact.add(name)
            return
        except (ValueError, TypeError):
            return
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    except (KeyError, ValueError):
        return
    walk.known[name] = stand_in(dtype, tensor.dims)


#: Constant's attributes that hold numbers, with the dtype each gives
_CONSTANT_ATTRS = {"value_int": np.int64, "value_ints": np.int64, "value_float": np.float32,
                   "value_floats": np.float32}


def _constant(node: onnx.NodeProto) -> onnx.TensorProto | None:
    for attr in node.attribute:
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            return attr.t
        if attr.name in _CONSTANT_ATTRS:
            value = onnx.helper.get_attribute_value(attr)
            return onnx.numpy_helper.from_array(np.asarray(value, dtype=_CONSTANT_ATTRS[attr.name]))
    return None


#: ops ``_visit`` reads whatever their inputs: they make build-time values from none
_SOURCES = frozenset({"Constant", "Shape", "Size"})


def _visit(walk: _Walk, node: onnx.NodeProto, proto: onnx.ModelProto) -> bool:
    """Record what ``node`` makes that the libraries could fold; False when it must be hidden from them."""
    op = onnx_op(node)
    if op == "Constant":
        value = _constant(node)
        if value is not None and node.output:
            _source(walk, node.output[0], value)
        return True
    if op in ("Shape", "Size"):
        _shape_of(walk, node, proto)
        return True
    inputs = [name for name in node.input if name]
    if op not in SIZED or not inputs or not all(name in walk.known for name in inputs) or len(node.output) != 1:
        return True  # computed from run-time data, or not an op the libraries fold
    args = [walk.known[name] if name else None for name in node.input]
    count = _count(op, node, args, all(name in walk.exact for name in inputs))
    if walk.per_node is not None:
        # a whole model is about to run: what cannot be told (a Range to a length computed by an op not folded
        # here, as Whisper's decoder has) runs as it would in the user's application
        if count is None:
            return True
        # only what a node makes beyond the data it reads counts: a Cast or a Concat of the weights the file
        # holds is as large as the file, while a few bytes of ConstantOfShape or Expand are not
        held = sum(elements(walk.known[name].shape) for name in set(inputs))
        walk.total += max(0, count - held)
        if walk.total > walk.per_node:
            return False
    elif count is None or count > MAX_ELEMENTS - walk.total:
        return False
    else:
        walk.total += count
    _fold(walk, node, args, count, all(name in walk.exact for name in inputs))
    return True


def _count(op: str, node: onnx.NodeProto, args: list, exact: bool) -> int | None:
    """Elements ``node`` makes, or None when it cannot be told: a size input known to the libraries but not held
    here (too large, or computed by an op not folded here) might say anything."""
    if op in SIZE_PRODUCING and op not in ("Concat", "Gather") and not exact:
        return None
    try:
        return output_elements(op, _attr_reader(_Node(node)), args)
    except (ValueError, TypeError, KeyError, IndexError, ArithmeticError):
        return None


def _fold(walk: _Walk, node: onnx.NodeProto, args: list, count: int, exact: bool) -> None:
    out = node.output[0]
    fold = FOLD.get(onnx_op(node)) or _EXTRA.get(onnx_op(node))
    if exact and count <= _SMALL and fold is not None:
        try:
            walk.known[out] = np.asarray(fold(_Node(node), args))
            walk.exact.add(out)
            return
        except (ValueError, TypeError, KeyError, IndexError, ArithmeticError):
            pass
    # known to the libraries, too large (or too odd) to hold here: sized as a flat vector, which is how they fold
    walk.known[out] = stand_in(args[0].dtype, [count])


def _shape_of(walk: _Walk, node: onnx.NodeProto, proto: onnx.ModelProto) -> None:
    """Shape and Size of a value whose dims are all numbers give numbers the libraries fold; symbolic dims give
    them symbols, which allocate nothing."""
    name = node.input[0] if node.input else ""
    dims = _dims(walk, name, proto)
    if dims is None or not node.output:
        return
    if is_op(node, "Size"):
        walk.known[node.output[0]] = np.array(elements(dims) if elements(dims) < 2**63 else -1, dtype=np.int64)
    else:
        reader = _attr_reader(_Node(node))
        walk.known[node.output[0]] = np.array(dims[reader("start", 0):reader("end", None)], dtype=np.int64)
    walk.exact.add(node.output[0])


def _dims(walk: _Walk, name: str, proto: onnx.ModelProto) -> list[int] | None:
    if name in walk.known:
        return list(walk.known[name].shape) if name in walk.exact else None
    type_proto = walk.types.get(name) or _inferred(walk, proto).get(name)
    if type_proto is None or not type_proto.tensor_type.HasField("shape"):
        return None
    dims = type_proto.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    values = [d.dim_value for d in dims]
    return values if all(v < 2**63 for v in values) else None


def _symbolic_if_large(type_proto: onnx.TypeProto, name: str) -> None:
    """A data input too large to hold gets symbolic dims: Concat(x, x) of a hidden x would otherwise still have a
    static length, and onnx's data propagation holds every element of a static 1-D value. A size input (small)
    keeps its dims, so that the node's rank stays known."""
    shape = type_proto.tensor_type.shape
    if elements(d.dim_value or 1 for d in shape.dim) <= _SMALL:
        return
    for axis, dim in enumerate(shape.dim):
        dim.Clear()
        dim.dim_param = f"{name}_d{axis}"


def _inferred(walk: _Walk, proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """The types onnx's inference gives without data propagation (shapes only, from the constants as they are:
    nothing is folded), made the first time a walk needs one."""
    if walk.shapes is None:
        try:
            inferred = onnx.shape_inference.infer_shapes(proto)
            walk.shapes = {v.name: v.type for v in inferred.graph.value_info}
        except Exception:  # noqa: BLE001 - onnx raises several types; the walk then knows fewer shapes
            walk.shapes = {}
    return walk.shapes


def _hide(proto: onnx.ModelProto, index: int, node: onnx.NodeProto, walk: _Walk, hidden: Hidden) -> None:
    """Rename the node's known inputs to fresh graph inputs of the same type (and shape, when inference is told
    one): the libraries see run-time data there."""
    for slot, name in enumerate(node.input):
        if not name or name not in walk.known:
            continue
        fresh = f"lnfuse_budget_{index}_{slot}"
        info = onnx.ValueInfoProto(name=fresh)
        type_proto = walk.types.get(name) or _inferred(walk, proto).get(name)
        if type_proto is not None and type_proto.tensor_type.elem_type:
            info.type.CopyFrom(type_proto)
            _symbolic_if_large(info.type, fresh)
        else:  # the dtype inference would give it; the shape left unknown
            info.type.tensor_type.elem_type = onnx.helper.np_dtype_to_tensor_dtype(walk.known[name].dtype)
        proto.graph.input.append(info)
        node.input[slot] = fresh
        hidden.renamed[fresh] = name
