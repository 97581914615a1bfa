"""Just enough of protobuf's wire format to copy a model's weights from its file without decoding them.

A saved model is ``ModelProto`` bytes; each inline weight is one ``TensorProto`` inside the graph field. lnfuse
rewrites a few dozen small nodes and keeps every weight as it was, so the weights it keeps can be written by copying
their bytes from the input file (from the page cache) instead of serializing them again from memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: field numbers in onnx.proto
MODEL_GRAPH = 7
GRAPH_INITIALIZER = 5
TENSOR_RAW_DATA = 9
#: TensorProto fields that make a tensor other than plain raw bytes: segment, the typed data fields, external data
_NOT_PLAIN = frozenset({3, 4, 5, 6, 7, 10, 11, 13, 14})

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


def field_header(number: int, length: int) -> bytes:
    """Tag and length of a length-delimited field."""
    return _varint_bytes(number << 3 | _LENGTH_DELIMITED) + _varint_bytes(length)


def initializer_header(tensor_length: int) -> bytes:
    """What precedes a serialized TensorProto so that, appended to a ModelProto, it adds one graph initializer
    (protobuf merges repeated occurrences of a message field)."""
    inner = field_header(GRAPH_INITIALIZER, tensor_length)
    return field_header(MODEL_GRAPH, len(inner) + tensor_length) + inner


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


#: a 64-bit varint takes at most 10 bytes; a longer run of continuation bytes is not protobuf (unbounded, the
#: loop would build an ever larger integer: quadratic in the run's length)
_MAX_VARINT_BYTES = 10


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    for pos in range(pos, pos + _MAX_VARINT_BYTES):
        byte = buf[pos]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos + 1
        shift += 7
    raise ValueError(f"a varint longer than {_MAX_VARINT_BYTES} bytes at byte {pos + 1 - _MAX_VARINT_BYTES}")


def _fields(buf, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Each field of the message in ``buf[start:end]``: (number, wire type, where its tag starts, where its payload
    starts, where it ends). Payloads are skipped, not decoded."""
    pos = start
    while pos < end:
        field_start = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        payload = pos
        if wire == _LENGTH_DELIMITED:
            length, payload = _varint(buf, pos)
            pos = payload + length
        elif wire == _VARINT:
            _, pos = _varint(buf, pos)
        elif wire == _FIXED64:
            pos += 8
        elif wire == _FIXED32:
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} at byte {field_start}")
        yield number, wire, field_start, payload, pos
    if pos != end:
        raise ValueError("a field runs past the end of its message")


@dataclass(frozen=True)
class LazyInitializer:
    """An inline weight left out of the parsed model: its TensorProto without the data, where that TensorProto
    lies in the file (to copy it when saving), and where its raw bytes lie (to read them if a rule needs them)."""

    header: bytes
    span: tuple[int, int]
    data: tuple[int, int]


def split_weights(buf, min_bytes: int) -> tuple[bytes, list[LazyInitializer]]:
    """The model's bytes without its large raw-data initializers, and those initializers.

    Only tensors stored plainly qualify (raw_data, no external location, no segment); everything else stays in the
    bytes as it was, so parsing them gives the model minus the listed weights.
    """
    model, lazy = bytearray(), []
    for number, wire, field_start, payload, end in _fields(buf, 0, len(buf)):
        if number != MODEL_GRAPH or wire != _LENGTH_DELIMITED:
            model += buf[field_start:end]
            continue
        graph = bytearray()
        for inner, inner_wire, g_start, g_payload, g_end in _fields(buf, payload, end):
            is_tensor = inner == GRAPH_INITIALIZER and inner_wire == _LENGTH_DELIMITED
            weight = _plain_weight(buf, g_payload, g_end, min_bytes) if is_tensor else None
            if weight is None:
                graph += buf[g_start:g_end]
            else:
                header, data = weight
                lazy.append(LazyInitializer(header, (g_payload, g_end - g_payload), data))
        model += field_header(MODEL_GRAPH, len(graph)) + graph
    return bytes(model), lazy


def _plain_weight(buf, start: int, end: int, min_bytes: int) -> tuple[bytes, tuple[int, int]] | None:
    header, data = bytearray(), None
    for number, wire, f_start, payload, f_end in _fields(buf, start, end):
        if number == TENSOR_RAW_DATA and wire == _LENGTH_DELIMITED:
            data = (payload, f_end - payload)
        elif number in _NOT_PLAIN:
            return None
        else:
            header += buf[f_start:f_end]
    if data is None or data[1] < min_bytes:
        return None
    return bytes(header), data


@dataclass(frozen=True)
class FileIdentity:
    """A file as it was when it was read: its bytes are reused only while this still matches."""

    path: Path
    identity: tuple[int, int, int, int, int]

    @staticmethod
    def of_open(path: Path, fd: int) -> FileIdentity:
        """The identity of the file open as ``fd`` (taken before reading it, so a later rewrite shows)."""
        return FileIdentity(path, _identity(os.fstat(fd)))

    def unchanged(self) -> bool:
        try:
            return _identity(os.stat(self.path)) == self.identity
        except OSError:
            return False


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
