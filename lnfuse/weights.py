"""Inline weights that stay in the input file: read only if a rule needs their values, copied back when saving.

A model file holds its weights inline unless they are external. lnfuse leaves the large ones out when it parses the
model (``wire.split_weights``) and gives each one an ``InlineWeight``: a tensor of known dtype and shape whose bytes
are read from the file on demand. Most are never read: fusing a norm needs gamma and beta, not the MatMul weights.
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

#: weights with at most this many elements are parsed with the model: shape inference may need their values
MAX_PARSED_ELEMENTS = 1024


@dataclass(frozen=True)
class FileWeights:
    """The weights left in a model file: where each one's TensorProto lies (to copy it) and where its raw bytes lie
    (to read them), and the file's identity when it was opened."""

    file: wire.FileIdentity
    tensors: dict[str, tuple[int, int]]
    data: dict[str, tuple[int, int]]


class InlineWeight(_core.TensorBase):
    """An inline weight of a model file, read from the file only when its values are asked for. The model file is
    opened directly (it is the file the user named, not a path from inside the model), and the bytes are the
    tensor's raw_data, decoded as onnx_ir decodes a TensorProto."""

    __slots__ = ("_dtype", "_shape", "_span", "_file", "_loaded")

    def __init__(self, like: ir.TensorProtocol, span: tuple[int, int], file: wire.FileIdentity):
        super().__init__(like.name, like.doc_string, dict(like.metadata_props) or None)
        self._dtype, self._shape = like.dtype, like.shape
        self._span, self._file = span, file
        self._loaded: ir.TensorProtocol | None = None

    @property
    def dtype(self) -> ir.DataType:
        return self._dtype

    @property
    def shape(self) -> ir.Shape:
        return self._shape

    def check_source(self) -> None:
        """Raise ``InputError`` if the file this weight is read from is no longer the file lnfuse read."""
        if not self._file.unchanged():
            raise InputError(f"{self._file.path}: the file changed after lnfuse read it, and lnfuse reads weights "
                             "from it as they are needed; run lnfuse again on the new file")

    def _tensor(self) -> ir.TensorProtocol:
        if self._loaded is None:
            self.check_source()
            offset, length = self._span
            with open(self._file.path, "rb") as file:
                file.seek(offset)
                data = file.read(length)
            proto = onnx.TensorProto(name=self.name or "", data_type=self._dtype.value,
                                     dims=self._shape.numpy(), raw_data=data)
            self._loaded = ir.serde.TensorProtoTensor(proto)
        return self._loaded

    def numpy(self) -> np.ndarray:
        return self._tensor().numpy()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def tobytes(self) -> bytes:
        """The stored bytes (packed for 4-bit types), as a TensorProto's raw_data holds them."""
        return self._tensor().tobytes()


@dataclass(frozen=True)
class SourceWeights:
    """The input file's weights as lnfuse left them, and the tensor object standing for each. A value still holding
    that same (immutable) object is saved by copying its TensorProto's bytes from the file."""

    weights: FileWeights
    tensors: dict[str, InlineWeight]

    @property
    def file(self) -> wire.FileIdentity:
        return self.weights.file

    def span_of(self, value: ir.Value) -> tuple[int, int] | None:
        tensor = self.tensors.get(value.name)
        return self.weights.tensors[value.name] if tensor is not None and value.const_value is tensor else None


def placeholders(lazy: list[wire.LazyInitializer], buf, file: wire.FileIdentity
                 ) -> tuple[list[onnx.TensorProto], FileWeights]:
    """For each weight left out of the parsed model: a TensorProto of its dtype and shape marked as external data
    pointing into the model file, so checks and shape inference see an initializer whose values are not loaded.
    Weights small enough that their values may decide a shape are parsed whole instead."""
    protos, tensors, data = [], {}, {}
    for weight in lazy:
        tensor = onnx.TensorProto.FromString(weight.header)
        if math.prod(tensor.dims) <= MAX_PARSED_ELEMENTS:
            start, length = weight.span
            protos.append(onnx.TensorProto.FromString(buf[start:start + length]))
            continue
        offset, length = weight.data
        expected = math.ceil(math.prod(tensor.dims) * ir.DataType(tensor.data_type).itemsize)
        if expected != length:
            raise ValueError(f"tensor '{tensor.name}' holds {length} bytes, its shape needs {expected}")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", file.path.name), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        protos.append(tensor)
        tensors[tensor.name], data[tensor.name] = weight.span, weight.data
    return protos, FileWeights(file, tensors, data)


def attach(model: ir.Model, weights: FileWeights) -> SourceWeights:
    """Replace the placeholders' tensors by ``InlineWeight``s (they are inline weights, not external data)."""
    tensors = {}
    for name, span in weights.data.items():
        value = model.graph.initializers[name]
        tensors[name] = value.const_value = InlineWeight(value.const_value, span, weights.file)
    return SourceWeights(weights, tensors)
