"""Exporter quirks that hide a norm from its neighbours, removed before matching. Each removal is exact.

- ``Cast(to=T)`` of a tensor that already is T: readers of the Cast read its input (torch's legacy exporter keeps
  ``.to(float32)`` on float32 tensors, so a norm and the residual reading the "same" tensor see two values).
- ``DequantizeLinear(QuantizeLinear(v, s, z), s, z)`` where v is already on that grid (it was dequantized with the
  same scale and zero point, then only moved by Gather/Reshape/...): requantizing gives back v bit for bit. ORT's
  QDQ quantizer writes these pairs after embedding lookups.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from lnfuse.constants import static_value

# ops that only move or select elements: their outputs hold values of their (first) input
_MOVES = frozenset({"Gather", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Identity", "Expand",
                    "Flatten"})


def canonicalize(graph: ir.Graph | ir.Function) -> list[str]:
    """Remove no-op Casts and identity requantizations; returns what was removed, for the report."""
    host = graph.graph if isinstance(graph, ir.Function) else graph
    removed = []
    casts = sum(_bypass(host, node) for node in list(host) if _is_noop_cast(node))
    if casts:
        removed.append(f"{casts} Cast(s) to the dtype their input already has")
    pairs = sum(_bypass(host, node, node.inputs[0].producer().inputs[0])
                for node in list(host) if _is_identity_requantization(node))
    if pairs:
        removed.append(f"{pairs} QuantizeLinear/DequantizeLinear pair(s) that give back their input exactly")
    return removed


def _bypass(host: ir.Graph, node: ir.Node, source: ir.Value | None = None) -> bool:
    out = node.outputs[0]
    if out.is_graph_output():
        return False
    out.replace_all_uses_with(source if source is not None else node.inputs[0])
    host.remove(node, safe=True)
    return True


def _is_noop_cast(node: ir.Node) -> bool:
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
        return False
    to = node.attributes.get("to")
    source = node.inputs[0]
    return to is not None and source.type is not None and source.dtype == ir.DataType(to.value)


def _is_identity_requantization(node: ir.Node) -> bool:
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return False
    quantize = node.inputs[0].producer() if node.inputs[0] is not None else None
    if quantize is None or quantize.op_type != "QuantizeLinear" or quantize.outputs[0].uses().__len__() != 1:
        return False
    grid = _grid(node)
    if grid is None or _grid(quantize) != grid:
        return False
    value = quantize.inputs[0]
    while (producer := value.producer()) is not None and producer.op_type in _MOVES:
        value = producer.inputs[0]
    source = value.producer()
    return source is not None and source.op_type == "DequantizeLinear" and _grid(source) == grid


def _grid(node: ir.Node) -> tuple | None:
    """(scale, zero point, zero-point dtype) of a per-tensor (De)QuantizeLinear, or None."""
    if len(node.inputs) < 3 or node.inputs[2] is None:
        return None
    scale, zero = static_value(node.inputs[1]), static_value(node.inputs[2])
    if scale is None or zero is None or scale.size != 1 or zero.size != 1:
        return None
    return float(np.asarray(scale).reshape(-1)[0]), int(np.asarray(zero).reshape(-1)[0]), str(zero.dtype)
