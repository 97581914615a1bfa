"""Inline weights that stay in the input file: read only if a rule needs their values, copied back when saving.

A model file holds its weights inline unless they are external: as initializers, or as the ``value`` of Constant
nodes. lnfuse parses the model with each large one replaced by a placeholder (``wire.split_weights``) and gives each
one an ``InlineWeight``: a tensor of known dtype and shape whose bytes are read from the file on demand. Most are
never read: fusing a norm needs gamma and beta, not the MatMul weights. Saving then copies each weight's bytes from
the input file, so they are neither decoded nor held in memory.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from lnfuse.load import wire
from lnfuse.errors import InputError
from lnfuse.index.ops import is_op

#: weights with at most this many elements are parsed with the model: shape inference may need their values
MAX_PARSED_ELEMENTS = 1024


#: inline weights of at least this many bytes stay in the file until a rule needs their values
LAZY_BYTES = 1 << 12


@dataclass(frozen=True)
class FileWeights:
    """The weights left in a model file, by the offset of their raw bytes (which their placeholders point at), and
    the file's identity when it was opened."""

    file: wire.FileIdentity
    tensors: dict[int, wire.PlainTensor]

    def holds(self, tensor: onnx.TensorProto) -> bool:
        """Whether ``tensor`` is the placeholder of one of these weights: it names the model file at one of their
        offsets, with that weight's length, type and shape (a tensor of the model's own that names its file so is
        external data like any other, admitted by the gate)."""
        info = {entry.key: entry.value for entry in tensor.external_data}
        offset = info.get("offset", "")
        if info.get("location") != self.file.path.name or not offset.isdigit() or int(offset) not in self.tensors:
            return False
        stored = self.tensors[int(offset)]
        header = onnx.TensorProto.FromString(stored.header)
        return (info.get("length") == str(stored.data[1]) and header.data_type == tensor.data_type
                and list(header.dims) == list(tensor.dims))


class InlineWeight(ir.LazyTensor):
    """An inline weight of a model file, read from the file only when its values are asked for (then kept). The
    model file is opened directly (it is the file the user named, not a path from inside the model), and the bytes
    are the tensor's raw_data, decoded as onnx_ir decodes a TensorProto. onnx_ir's public ``LazyTensor`` does the
    deferring (its ``TensorBase`` is private)."""

    __slots__ = ("stored", "file")

    def __init__(self, like: ir.TensorProtocol, stored: wire.PlainTensor, file: wire.FileIdentity):
        # the reader holds the weight's facts, not the weight: no reference cycle keeps a dropped weight alive
        # while the API pauses the cycle collector
        read = functools.partial(_read, stored, file, like.name, like.dtype, like.shape)
        super().__init__(read, like.dtype, like.shape, cache=True, name=like.name, doc_string=like.doc_string,
                         metadata_props=dict(like.metadata_props) or None)
        self.stored, self.file = stored, file

    @property
    def loaded(self) -> bool:
        """Whether the values were read from the file (a rule needed them)."""
        return self._tensor is not None

    def check_source(self) -> None:
        """Raise ``InputError`` if the file this weight is read from is no longer the file lnfuse read."""
        _check_source(self.file)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)


def _check_source(file: wire.FileIdentity) -> None:
    if not file.unchanged():
        raise InputError(f"{file.path}: the file changed after lnfuse read it, and lnfuse reads weights "
                         "from it as they are needed; run lnfuse again on the new file")


def _read(stored: wire.PlainTensor, file: wire.FileIdentity, name: str | None, dtype: ir.DataType,
          shape: ir.Shape) -> ir.TensorProtocol:
    """An inline weight's values, read from its file (which must still be the file lnfuse read)."""
    _check_source(file)
    offset, length = stored.data
    with open(file.path, "rb") as opened:
        opened.seek(offset)
        data = opened.read(length)
    proto = onnx.TensorProto(name=name or "", data_type=dtype.value, dims=shape.numpy(), raw_data=data)
    return ir.serde.TensorProtoTensor(proto)


@dataclass(frozen=True)
class SourceWeights:
    """The input file whose weights lnfuse left in it. A tensor that is still the (immutable) ``InlineWeight`` read
    from it is saved by copying its TensorProto's bytes from the file."""

    file: wire.FileIdentity

    def span_of(self, tensor: ir.TensorProtocol | None, name: str | None = None) -> tuple[int, int] | None:
        """Where ``tensor``'s TensorProto lies in the file, if it can be copied from there: it is one of the file's
        weights and (for an initializer, whose TensorProto carries the value's name) still has the name ``name``."""
        if not isinstance(tensor, InlineWeight) or tensor.file != self.file:
            return None
        return tensor.stored.span if name is None or tensor.name == name else None


def split(buf, file: wire.FileIdentity) -> tuple[bytes, FileWeights]:
    """The model's bytes with each large weight replaced by a placeholder: a TensorProto of its dtype and shape
    marked as external data pointing into the model file, so checks and shape inference see a tensor whose values
    are not loaded. Weights small enough that their values may decide a shape are kept whole."""
    tensors: dict[int, wire.PlainTensor] = {}

    def placeholder(stored: wire.PlainTensor) -> bytes | None:
        tensor = onnx.TensorProto.FromString(stored.header)
        if math.prod(tensor.dims) <= MAX_PARSED_ELEMENTS:
            return None
        offset, length = stored.data
        expected = math.ceil(math.prod(tensor.dims) * ir.DataType(tensor.data_type).itemsize)
        if expected != length:
            raise ValueError(f"tensor '{tensor.name}' holds {length} bytes, its shape needs {expected}")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", file.path.name), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        tensors[offset] = stored
        return tensor.SerializeToString()

    return wire.split_weights(buf, LAZY_BYTES, placeholder), FileWeights(file, tensors)


def attach(model: ir.Model, weights: FileWeights) -> SourceWeights:
    """Replace the placeholders' tensors (external tensors pointing into the model file) by ``InlineWeight``s: they
    are inline weights, not external data."""
    def inline(tensor: ir.TensorProtocol) -> InlineWeight | None:
        if not isinstance(tensor, ir.ExternalTensor) or tensor.location != weights.file.path.name:
            return None
        stored = weights.tensors.get(tensor.offset)
        return InlineWeight(tensor, stored, weights.file) if stored is not None else None

    for value in model.graph.initializers.values():
        value.const_value = inline(value.const_value) or value.const_value
    for node in model.graph:
        attribute = node.attributes.get("value") if is_op(node, "Constant") else None
        if attribute is not None and attribute.type == ir.AttributeType.TENSOR:
            tensor = inline(attribute.value)
            if tensor is not None:
                node.attributes["value"] = ir.AttrTensor("value", tensor, doc_string=attribute.doc_string)
    return SourceWeights(weights.file)
