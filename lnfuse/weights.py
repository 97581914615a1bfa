"""Inline weights that stay in the input file: read only if a rule needs their values, copied back when saving.

A model file holds its weights inline unless they are external. lnfuse leaves them out when it parses the model
(``wire.split_weights``) and gives each one an ``InlineWeight``: a tensor of known dtype and shape whose bytes are
read from the file on demand. Most are never read: fusing a norm needs gamma and beta, not the MatMul weights.
Saving then copies each weight's bytes from the input file, so they are neither decoded nor held in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir import _core

from lnfuse import wire
from lnfuse.errors import InputError


class InlineWeight(_core.TensorBase):
    """An inline weight of a model file, read (memory-mapped) from the file only when its values are asked for.
    It is not an ``ExternalTensor``, so a model serialized from onnx_ir holds it inline, as the input did."""

    __slots__ = ("_data", "_file")

    def __init__(self, data: ir.ExternalTensor, file: wire.FileIdentity):
        super().__init__(data.name, data.doc_string, dict(data.metadata_props) or None)
        self._data = data
        self._file = file

    @property
    def dtype(self) -> ir.DataType:
        return self._data.dtype

    @property
    def shape(self) -> ir.Shape:
        return self._data.shape

    def check_source(self) -> None:
        """Raise ``InputError`` if the file this weight is read from is no longer the file lnfuse read."""
        if not self._file.unchanged():
            raise InputError(f"{self._file.path}: the file changed after lnfuse read it, and lnfuse reads weights "
                             "from it as they are needed; run lnfuse again on the new file")

    def numpy(self) -> np.ndarray:
        self.check_source()
        return self._data.numpy()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def tobytes(self) -> bytes:
        return self.numpy().tobytes()


@dataclass(frozen=True)
class SourceWeights:
    """The input file's inline weights as lnfuse left them: where each one's TensorProto lies in the file, and the
    tensor object standing for it. A value still holding that same (immutable) object is saved by copying."""

    file: wire.FileIdentity
    spans: dict[str, tuple[int, int]]
    tensors: dict[str, InlineWeight]

    def span_of(self, value: ir.Value) -> tuple[int, int] | None:
        tensor = self.tensors.get(value.name)
        return self.spans[value.name] if tensor is not None and value.const_value is tensor else None


def placeholders(lazy: list[wire.LazyInitializer], path: Path) -> tuple[list[onnx.TensorProto], dict]:
    """For each weight left out of the parsed model: a TensorProto that points at its raw bytes inside the model
    file itself (as external data would), so checks and shape inference see a normal external initializer.
    Also returns name -> the TensorProto's span in the file."""
    protos, spans = [], {}
    for weight in lazy:
        tensor = onnx.TensorProto.FromString(weight.header)
        offset, length = weight.data
        expected = math.prod(tensor.dims) * ir.DataType(tensor.data_type).itemsize
        if math.ceil(expected) != length:
            raise ValueError(f"tensor '{tensor.name}' holds {length} bytes, its shape needs {math.ceil(expected)}")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", path.name), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        protos.append(tensor)
        spans[tensor.name] = weight.span
    return protos, spans


def attach(model: ir.Model, spans: dict[str, tuple[int, int]], file: wire.FileIdentity) -> SourceWeights:
    """Replace the placeholders' external tensors by ``InlineWeight``s (they are inline weights, not external)."""
    tensors = {}
    for name in spans:
        value = model.graph.initializers[name]
        tensors[name] = value.const_value = InlineWeight(value.const_value, file)
    return SourceWeights(file, spans, tensors)
