"""Norms that a QDQ quantizer has already rounded inside: candidates, reported with the reason they stay unfused.

ONNX Runtime's ``quantize_static`` (QDQ format) writes QuantizeLinear -> DequantizeLinear pairs on the
intermediates of a norm (the variance, variance + epsilon, the normalized value, ...). Each pair rounds its value to
an 8-bit grid, and a fused op would not: fusing would change what the model computes, so no rule matches through
them. Such a norm is still a norm to the user, who should learn why it stays, and what to do (fuse, then quantize).

A candidate is a reduction of a square (``ReduceMean(Pow(d, 2))`` or ``ReduceMean(Mul(d, d))``, the variance or
mean square of every LayerNorm and RMS norm spelling) whose result reaches a square root or a division within a few
nodes, with a QuantizeLinear on the way.
"""

from __future__ import annotations

import onnx_ir as ir

from lnfuse.report import Report, Unfused
from lnfuse.index.ops import is_op, onnx_op
from lnfuse.match.qoperator import float_op, is_qoperator

#: ops a QDQ quantizer or an exporter puts between the steps of a norm, which this search looks through
_PASS = frozenset({"QuantizeLinear", "DequantizeLinear", "Cast"})
#: how far (in nodes) from the reduction the inverse square root is looked for
_REACH = 8


def quantized_norms(model: ir.Model, report: Report) -> list[Unfused]:
    """The norm candidates of ``model`` left unfused because quantization rounds inside them, other than those a
    rule already reported."""
    reported = {name for entry in [*report.fused, *report.unfused] for name in entry.nodes}
    found = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if not is_op(node, "ReduceMean") or node.name in reported or not _reduces_a_square(node):
            continue
        rounding = _rounding_before_the_root(node)
        if rounding:
            graph = node.graph.name if node.graph is not None and node.graph is not model.graph else "main"
            found.append(Unfused("quantized", graph or "main", f"ReduceMean '{node.name}'", "quantized",
                                 rounding_reason(rounding), [node.name, *(n.name for n in rounding)]))
    return found


def rounding_reason(rounding: list[ir.Node]) -> str:
    """Why a norm with these rounding nodes inside stays unfused, and what to do. A QOperator op is named first
    (QLinearAdd of the variance and epsilon): the step computed in 8 bits, where its QuantizeLinear only feeds it."""
    named = sorted(rounding, key=lambda n: not is_qoperator(n))
    first = named[0]
    if is_qoperator(first):
        what = (f"{first.op_type} '{first.name}' (a QOperator {float_op(first)}, computed on 8-bit values) and "
                f"{len(named) - 1} more rounding step(s) round")
    else:
        what = f"{first.op_type} '{first.name}' (and {len(named) - 1} more) rounds"
    return (f"{what} the norm's intermediates to 8 bits; a fused op would not round them, so fusing would change "
            "what the model computes: fuse the float model first, then quantize (docs/quantized.md)")


def _through(value: ir.Value | None) -> ir.Node | None:
    """The producer of ``value``, looking through quantization pairs and Casts."""
    node = value.producer() if value is not None else None
    while node is not None and onnx_op(node) in _PASS:
        node = node.inputs[0].producer()
    return node


def _reduces_a_square(reduce: ir.Node) -> bool:
    square = _through(reduce.inputs[0])
    if square is None or len(square.inputs) < 2:
        return False
    if is_op(square, "Mul"):
        return _through(square.inputs[0]) is _through(square.inputs[1]) is not None or \
            square.inputs[0] is square.inputs[1]
    return is_op(square, "Pow")


def _rounding_before_the_root(reduce: ir.Node) -> list[ir.Node]:
    """The QuantizeLinear nodes between the reduction and the square root or division it feeds, if one is reached."""
    frontier, seen, rounding = [reduce], {reduce}, []
    for _ in range(_REACH):
        following = []
        for node in frontier:
            for value in node.outputs:
                for user, _ in value.uses():
                    if user in seen:
                        continue
                    seen.add(user)
                    if onnx_op(user) in ("Sqrt", "Reciprocal", "Div"):
                        return rounding
                    if is_op(user, "QuantizeLinear"):
                        rounding.append(user)
                    if onnx_op(user) in _PASS or is_op(user, "Add"):
                        following.append(user)
        frontier = following
    return []
