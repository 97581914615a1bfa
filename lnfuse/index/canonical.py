"""Exporter quirks that hide a norm from its neighbours, removed before matching. Each removal is exact.

- ``Cast(to=T)`` of a tensor that already is T: readers of the Cast read its input (torch's legacy exporter keeps
  ``.to(float32)`` on float32 tensors, so a norm and the residual reading the "same" tensor see two values).
- ``Mul(x, 1)`` with a one-element 1 that does not raise x's rank: x·1 is x, bit for bit (BART and others scale the
  word embedding by ``embed_scale``, which is 1.0 unless the config asks for sqrt(d_model)).
- ``Shape`` of a table lookup ``Gather(table, ids)``: the ids' shape followed by the table's trailing dims. Exporters
  take the sequence length from the looked-up embeddings (``inputs_embeds.shape[1]``), which ties the position ids
  to the lookup they are added to; reading the ids' shape instead unties them.
- ``CastLike(v, like)`` where like's dtype is known: ``Cast(v, to=that dtype)``, which it is by definition.
  onnxscript writes every literal this way (``CastLike(Constant, x)``); the Cast no longer reads x, so a gamma or
  epsilon written so is a constant that depends on nothing the norm computes.
- ``DequantizeLinear(QuantizeLinear(v, s, z), s, z)`` where v is already on that grid (it was dequantized with the
  same scale and zero point, then only moved by Gather/Reshape/...): requantizing gives back v bit for bit. ORT's
  QDQ quantizer writes these pairs after embedding lookups.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_ir as ir

from lnfuse.index.constants import static_value
from lnfuse.index.ops import is_op, onnx_op

# ops that only move or select elements: their outputs hold values of their (first) input
_MOVES = frozenset({"Gather", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Identity", "Expand",
                    "Flatten"})


def canonicalize(graph: ir.Graph | ir.Function, fresh_name: Callable[[str], str]) -> list[str]:
    """Remove no-op Casts, multiplications by 1, shapes of lookups and identity requantizations; returns what was
    removed, for the report. ``fresh_name`` names new values uniquely across the whole model (subgraphs see the
    names of the graphs around them)."""
    host = graph.graph if isinstance(graph, ir.Function) else graph
    removed = []
    # the nodes each step looks at, in graph order, listed in one pass (on a graph of a million nodes each pass
    # costs): no step adds or removes nodes of a later step's op, but the CastLike step adds Casts
    of_op: dict[str, list[ir.Node]] = {op: [] for op in _STEP_OPS}
    for node in host:
        if onnx_op(node) in of_op:
            of_op[onnx_op(node)].append(node)
    likes = sum(_cast_like_to_cast(host, node, fresh_name) for node in of_op["CastLike"] if _is_known_cast_like(node))
    if likes:
        removed.append(f"{likes} CastLike(s) of a known dtype (now Cast)")
    casts = sum(_bypass(host, node) for node in (list(host) if likes else of_op["Cast"]) if _is_noop_cast(node))
    if casts:
        removed.append(f"{casts} Cast(s) to the dtype their input already has")
    ones, read = 0, {}
    for node in of_op["Mul"]:
        source = _times_one(node, read)
        ones += source is not None and _bypass(host, node, source)
    if ones:
        removed.append(f"{ones} Mul(s) by 1")
    shapes = sum(_shape_from_ids(host, node, fresh_name) for node in of_op["Shape"])
    if shapes:
        removed.append(f"{shapes} Shape(s) of embedding lookups (now read from the ids)")
    pairs = sum(_bypass(host, node, node.inputs[0].producer().inputs[0])
                for node in of_op["DequantizeLinear"] if _is_identity_requantization(node))
    if pairs:
        removed.append(f"{pairs} QuantizeLinear/DequantizeLinear pair(s) that give back their input exactly")
    return removed


#: the ops ``canonicalize`` rewrites, in the order of its steps
_STEP_OPS = ("CastLike", "Cast", "Mul", "Shape", "DequantizeLinear")


def _bypass(host: ir.Graph, node: ir.Node, source: ir.Value | None = None) -> bool:
    out = node.outputs[0]
    if out.is_graph_output():
        return False
    out.replace_all_uses_with(source if source is not None else node.inputs[0])
    host.remove(node, safe=True)
    return True


def _is_known_cast_like(node: ir.Node) -> bool:
    if not is_op(node, "CastLike") or len(node.inputs) != 2 or None in node.inputs:
        return False
    return node.inputs[1].type is not None and node.inputs[1].dtype is not None and \
        all(not a.is_ref() for a in node.attributes.values())


def _cast_like_to_cast(host: ir.Graph, node: ir.Node, fresh_name: Callable[[str], str]) -> bool:
    attrs = {"to": node.inputs[1].dtype}
    if "saturate" in node.attributes:
        attrs["saturate"] = node.attributes["saturate"].value
    cast = ir.node("Cast", [node.inputs[0]], attrs, name=fresh_name(f"{node.name or 'CastLike'}/Cast"))
    old, new = node.outputs[0], cast.outputs[0]
    new.name = fresh_name(f"{old.name}_cast")
    new.type, new.shape = old.type, old.shape
    host.insert_before(node, [cast])
    if old.is_graph_output():
        new.name, old.name = old.name, f"{old.name}__replaced"
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    host.remove(node, safe=True)
    return True


def _is_noop_cast(node: ir.Node) -> bool:
    if not is_op(node, "Cast") or node.inputs[0] is None:
        return False
    to = node.attributes.get("to")
    source = node.inputs[0]
    return to is not None and not to.is_ref() and source.type is not None and source.dtype == ir.DataType(to.value)


def _times_one(node: ir.Node, read: dict[ir.Value, np.ndarray | None]) -> ir.Value | None:
    """x when ``node`` is Mul(x, 1) or Mul(1, x) and the product has x's shape and dtype. ``read``: the constants
    already read (a chain of a million Muls by one constant reads it once)."""
    if not is_op(node, "Mul") or len(node.inputs) != 2 or None in node.inputs:
        return None
    for x, one in (node.inputs, reversed(node.inputs)):
        # only a one-element constant is read: a large weight is never loaded just to see it is not 1
        single = one.shape is not None and one.shape.is_static() and all(int(d) == 1 for d in one.shape)
        if single and one not in read:
            read[one] = static_value(one)
        array = read.get(one) if single else None
        if array is not None and array.reshape(-1)[0] == 1 and x.shape is not None \
                and array.ndim <= len(x.shape) and x.type is not None and x.dtype == one.dtype:
            return x
    return None



def _shape_from_ids(host: ir.Graph, shape: ir.Node, fresh_name: Callable[[str], str]) -> bool:
    found = _lookup_shape(shape.inputs[0]) if shape.inputs and shape.inputs[0] is not None else None
    if found is None:
        return False
    ids, trailing = found
    start, end = (shape.attributes.get(k) for k in ("start", "end"))
    if not trailing:
        new = [ir.node("Shape", [ids], {a.name: a.value for a in (start, end) if a is not None})]
    else:
        def constant(values):
            return ir.node("Constant", [], {"value": ir.tensor(np.array(values, dtype=np.int64))})
        pieces = [ir.node("Shape", [ids]), constant(trailing)]
        new = pieces + [ir.node("Concat", [pieces[0].outputs[0], pieces[1].outputs[0]], {"axis": 0})]
        if start is not None or end is not None:
            bounds = [constant([start.value if start is not None else 0]),
                      constant([end.value if end is not None else np.iinfo(np.int64).max])]
            new += bounds + [ir.node("Slice", [new[-1].outputs[0], bounds[0].outputs[0], bounds[1].outputs[0]])]
    for node in new:
        node.name = fresh_name(f"{shape.name or 'Shape'}/from_ids")
        node.outputs[0].name = fresh_name(f"{shape.name or 'Shape'}/from_ids_out")
    host.insert_before(shape, new)
    old, result = shape.outputs[0], new[-1].outputs[0]
    result.type, result.shape = old.type, old.shape
    if old.is_graph_output():
        result.name, old.name = old.name, f"{old.name}__replaced"
    old.replace_all_uses_with(result, replace_graph_outputs=True)
    host.remove(shape, safe=True)
    return True


#: Gathers of one index along a trailing axis a lookup's shape is followed through: each drops an axis, and a table
#: has a few (BART reads one); a longer chain is left as it is, not walked (its length is the model's to choose)
_MAX_TRAILING_GATHERS = 8


def _lookup_shape(value: ir.Value) -> tuple[ir.Value, list[int]] | None:
    """(ids, trailing dims) when ``value`` is ``Gather(table, ids)`` along axis 0 of a stored table, possibly followed
    by Gathers of one constant index along a trailing axis (BART reads ``inputs_embeds[:, :, -1]``): its shape is
    ids.shape + trailing."""
    trailing_gathers: list[ir.Node] = []  # outermost first
    node = value.producer()
    while True:
        if node is None or not is_op(node, "Gather") or None in node.inputs:
            return None
        if _gather_axis(node) == 0:
            break
        if len(trailing_gathers) == _MAX_TRAILING_GATHERS:
            return None
        trailing_gathers.append(node)
        node = node.inputs[0].producer()
    table = _stored_shape(node.inputs[0])
    if table is None or not table:
        return None
    ids, trailing = node.inputs[1], table[1:]
    for gather in reversed(trailing_gathers):
        if ids.shape is None:
            return None
        axis, index = _gather_axis(gather), gather.inputs[1]
        rank, ids_rank = len(ids.shape) + len(trailing), len(ids.shape)
        picked = static_value(index) if index.shape is not None and len(index.shape) == 0 else None
        if picked is None or not -rank <= axis < rank or axis % rank < ids_rank:
            return None
        k = axis % rank - ids_rank
        if not -trailing[k] <= int(picked) < trailing[k]:
            return None
        trailing = trailing[:k] + trailing[k + 1:]
    return ids, trailing


def _gather_axis(node: ir.Node) -> int:
    return node.attributes["axis"].value if "axis" in node.attributes else 0


def _stored_shape(table: ir.Value) -> list[int] | None:
    """The shape of a stored tensor (not an overridable graph input), through a dequantization or a Cast."""
    while table.const_value is None:
        node = table.producer()
        if node is None or onnx_op(node) not in ("DequantizeLinear", "Cast", "Identity"):
            return None
        table = node.inputs[0]
    if table.is_graph_input():
        return None
    return list(table.const_value.shape)


def _is_identity_requantization(node: ir.Node) -> bool:
    if not is_op(node, "DequantizeLinear"):
        return False
    quantize = node.inputs[0].producer() if node.inputs[0] is not None else None
    if quantize is None or not is_op(quantize, "QuantizeLinear") or quantize.outputs[0].uses().__len__() != 1:
        return False
    grid = _grid(node)
    if grid is None or _grid(quantize) != grid:
        return False
    value = quantize.inputs[0]
    while (producer := value.producer()) is not None and onnx_op(producer) in _MOVES:
        value = producer.inputs[0]
    source = value.producer()
    if source is None or not is_op(source, "DequantizeLinear") or _grid(source) != grid:
        return False
    # the pair gives back its input only in the input's own float type: a pair that dequantizes into another
    # (a float16 value requantized, then dequantized with a float32 scale) changes the readers' dtype and rounding
    given, made = quantize.inputs[0].dtype, node.outputs[0].dtype
    return given is not None and given == made


def _grid(node: ir.Node) -> tuple | None:
    """(scale, its dtype, zero point, zero-point dtype) of a per-tensor (De)QuantizeLinear, or None."""
    if len(node.inputs) < 3 or node.inputs[2] is None:
        return None
    scale, zero = static_value(node.inputs[1]), static_value(node.inputs[2])
    if scale is None or zero is None or scale.size != 1 or zero.size != 1:
        return None
    return (float(np.asarray(scale).reshape(-1)[0]), str(scale.dtype), int(np.asarray(zero).reshape(-1)[0]),
            str(zero.dtype))
