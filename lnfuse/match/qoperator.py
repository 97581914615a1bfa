"""QOperator ops read as the float ops they stand for, so that a norm computed by them is still found.

``quantize_static(..., quant_format=QuantFormat.QOperator)`` does not put QuantizeLinear/DequantizeLinear pairs
around a float op: it replaces the op by one that reads and writes 8-bit values, its scales and zero points as
extra inputs, e.g. ``QLinearAdd(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point)``. Of a
norm's ops, onnxruntime 1.32's QOperator registry quantizes Add and Mul (the epsilon, a 1/N scaling, a square as
``Mul(d, d)``, gamma and beta) and GlobalAveragePool; ReduceMean, Sub, Pow, Sqrt and Div stay float between a
DequantizeLinear and a QuantizeLinear. ``com.microsoft`` also defines QLinearReduceMean (ORT 1.32 has no CPU
kernel for it and its quantizer does not write it; another tool may).

Such an op computes its float op on the dequantized operands and rounds the result to 8 bits: between a norm's
input and its inverse root, that is a rounding a fused op would not do. The candidate finder reads it as its float op
(its operands at the positions below) and reports the norm with it as the reason it stays unfused.
"""

from __future__ import annotations

import onnx_ir as ir

from lnfuse.index.ops import is_op, onnx_op, ort_op

#: com.microsoft QOperator op -> (the ONNX op it computes on dequantized operands, the inputs holding those operands);
#: only the ops a norm's statistics can pass through (the QLinear MatMul, Conv, Softmax, Sigmoid... end the search as
#: their float ops do)
_CONTRIB = {
    "QLinearAdd": ("Add", (0, 3)),
    "QLinearMul": ("Mul", (0, 3)),
    "QLinearReduceMean": ("ReduceMean", (0,)),
    "QLinearGlobalAveragePool": ("GlobalAveragePool", (0,)),
    "QLinearWhere": ("Where", (0, 1, 4)),
}


def _entry(node: ir.Node | None) -> tuple[str, tuple[int, ...]] | None:
    name = ort_op(node)
    return _CONTRIB.get(name) if name is not None else None


def is_qoperator(node: ir.Node | None) -> bool:
    """Whether ``node`` is a QOperator op: a float op computed on 8-bit operands, its result rounded to 8 bits."""
    return _entry(node) is not None


def float_op(node: ir.Node | None) -> str | None:
    """The ONNX op ``node`` computes: its own for an ONNX op, the float op a QOperator op stands for; else None."""
    entry = _entry(node)
    return entry[0] if entry is not None else onnx_op(node)


def operands(node: ir.Node) -> list[ir.Value | None]:
    """The inputs of ``node`` in the float op's order: for a QOperator op, the quantized operands without their
    scales and zero points."""
    entry = _entry(node)
    if entry is None:
        return list(node.inputs)
    return [node.inputs[i] if i < len(node.inputs) else None for i in entry[1]]


def operand_index(node: ir.Node, index: int) -> int | None:
    """Which float operand input ``index`` of ``node`` is; None for a scale or zero point."""
    entry = _entry(node)
    if entry is None:
        return index
    return entry[1].index(index) if index in entry[1] else None


def rounds(node: ir.Node) -> bool:
    """Whether ``node`` rounds a float value to an integer grid: a quantizer, or a QOperator op (its output)."""
    return is_op(node, "QuantizeLinear", "DynamicQuantizeLinear") or is_qoperator(node)
