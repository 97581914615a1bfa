"""Just enough of protobuf's wire format to copy a model's weights from its file without decoding them.

A saved model is ``ModelProto`` bytes; each inline weight is one ``TensorProto`` inside the graph field. lnfuse
rewrites a few dozen small nodes and keeps every weight as it was, so the weights it keeps can be written by copying
their bytes from the input file (from the page cache) instead of serializing them again from memory.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: field numbers in onnx.proto
MODEL_GRAPH = 7
GRAPH_INITIALIZER = 5
TENSOR_NAME = 8

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


def _varint(buf: mmap.mmap, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: mmap.mmap, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(field number, offset, length) of each length-delimited field in ``buf[start:end]``; others are skipped."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == _LENGTH_DELIMITED:
            length, pos = _varint(buf, pos)
            yield number, pos, length
            pos += length
        elif wire == _VARINT:
            _, pos = _varint(buf, pos)
        elif wire == _FIXED64:
            pos += 8
        elif wire == _FIXED32:
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} at byte {pos}")
    if pos != end:
        raise ValueError("a field runs past the end of its message")


@dataclass(frozen=True)
class InitializerSpans:
    """Where each main-graph initializer's serialized TensorProto lies in a model file, and the file's identity
    when it was indexed (the bytes are copied only if the file is still the same)."""

    path: Path
    identity: tuple[int, int, int, int]
    spans: dict[str, tuple[int, int]]

    @staticmethod
    def index(path: Path, buf: mmap.mmap) -> InitializerSpans:
        spans = {}
        for number, offset, length in _fields(buf, 0, len(buf)):
            if number != MODEL_GRAPH:
                continue
            for inner, t_offset, t_length in _fields(buf, offset, offset + length):
                if inner != GRAPH_INITIALIZER:
                    continue
                for field, n_offset, n_length in _fields(buf, t_offset, t_offset + t_length):
                    if field == TENSOR_NAME:
                        spans[bytes(buf[n_offset:n_offset + n_length]).decode()] = (t_offset, t_length)
        return InitializerSpans(path, _identity(path), spans)

    def still_valid(self) -> bool:
        try:
            return _identity(self.path) == self.identity
        except OSError:
            return False


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
