"""Quantized tensors as a DequantizeLinear reads them, for QEmbedLayerNormalization (the embedding rule and
``--quantize-embeddings`` both ask): which are per tensor, which can be taken as they are stored, and the exact
re-encoding between int8 and uint8 that the op's one-type contract needs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from lnfuse.index.constants import static_value
from lnfuse.index.ops import is_op

#: the element types QEmbedLayerNormalization reads
QUANTIZED = (ir.DataType.INT8, ir.DataType.UINT8)


@dataclass
class PerTensor:
    """DequantizeLinear(tensor, scale, zero_point) with one scale and one zero point for the whole tensor."""

    tensor: ir.Value
    scale: ir.Value
    zero_point: ir.Value | None  # None: DequantizeLinear's default, 0 in the tensor's type


def per_tensor(value: ir.Value | None) -> PerTensor | None:
    """``value`` as a per-tensor dequantization of an int8/uint8 tensor (a one-element scale and zero point, no
    blocks), else None. Only then does it commute with a lookup, and only then does QEmbedLayerNormalization take it."""
    node = value.producer() if value is not None else None
    if not is_op(node, "DequantizeLinear") or len(node.inputs) < 2:
        return None
    blocks = node.attributes.get("block_size")
    if blocks is not None and (blocks.is_ref() or blocks.as_int()):
        return None
    tensor, scale, zero = (list(node.inputs) + [None])[:3]
    if tensor is None or scale is None or tensor.dtype not in QUANTIZED or \
            (zero is not None and zero.dtype != tensor.dtype):
        return None
    if any(v.shape is None or (len(v.shape) != 0 and list(v.shape) != [1]) for v in (scale, zero) if v is not None):
        return None
    return PerTensor(tensor, scale, zero)


def as_stored(part: PerTensor) -> bool:
    """Whether the tensor can be taken as it is stored, its scale and zero point read: an initializer or a Constant,
    with a zero point (what ``--quantize-embeddings`` keeps byte for byte)."""
    producer = part.tensor.producer()
    stored = part.tensor.const_value is not None or is_op(producer, "Constant")
    return stored and part.zero_point is not None and \
        all(static_value(v) is not None and static_value(v).size == 1 for v in (part.scale, part.zero_point))


def reencoded(array: np.ndarray, wanted: ir.DataType) -> np.ndarray:
    """``array`` (a quantized tensor or its zero point) in the other 8-bit type, exactly: int8 q with zero point z is
    uint8 q + 128 with zero point z + 128, the same (q - z) * scale."""
    shift = 128 if wanted == ir.DataType.UINT8 else -128
    return (array.astype(np.int16) + shift).astype(wanted.numpy())


def scalable(array: np.ndarray) -> bool:
    """Whether one per-tensor scale can quantize ``array`` (what ``--quantize-embeddings`` does to a float tensor):
    every entry finite. A NaN or infinity makes the range, hence the scale, NaN or infinite."""
    return array.dtype.kind != "f" or bool(np.isfinite(array).all())
