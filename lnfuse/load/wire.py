"""Just enough of protobuf's wire format to leave a model's weights in its file and to copy them back undecoded.

A saved model is ``ModelProto`` bytes; each inline weight is one ``TensorProto`` inside it: an initializer of the
graph, or the ``value`` of a ``Constant`` node (onnxscript's code form writes every weight so). lnfuse rewrites a few
dozen small nodes and keeps every weight as it was, so it parses the model with each large weight replaced by a
small placeholder, and writes each kept weight back by copying its bytes from the input file (from the page cache)
instead of serializing it again from memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: field numbers in onnx.proto
MODEL_GRAPH = 7
GRAPH_NODE = 1
GRAPH_INITIALIZER = 5
NODE_OP_TYPE = 4
NODE_ATTRIBUTE = 5
NODE_DOMAIN = 7
ATTRIBUTE_NAME = 1
ATTRIBUTE_TENSOR = 5
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
class PlainTensor:
    """A TensorProto of the file holding its values as raw bytes: its other fields (dtype, dims, name...), where the
    whole TensorProto lies (to copy it when saving) and where its raw bytes lie (to read them if a rule needs them)."""

    header: bytes
    span: tuple[int, int]
    data: tuple[int, int]


#: what replaces a large tensor in the parsed bytes: a serialized TensorProto, or None to keep the tensor
Placeholder = Callable[[PlainTensor], "bytes | None"]


def split_weights(buf, min_bytes: int, placeholder: Placeholder) -> bytes:
    """The model's bytes with each large plain tensor of the main graph (an initializer, or the value of a Constant
    node) replaced by ``placeholder(tensor)``.

    Plain: raw_data of at least ``min_bytes``, no external location, no segment. Everything else is kept byte for
    byte. Fields smaller than ``min_bytes`` cannot hold such a tensor and are skipped unread, so the cost is one
    step per field of the graph, and one copy of the bytes that stay.
    """
    model, run = bytearray(), 0
    for number, wire, field_start, payload, end in _fields(buf, 0, len(buf)):
        if number == MODEL_GRAPH and wire == _LENGTH_DELIMITED:
            graph = _graph(buf, payload, end, min_bytes, placeholder)
            if graph is not None:
                model += buf[run:field_start]
                model += field_header(MODEL_GRAPH, len(graph)) + graph
                run = end
    model += buf[run:len(buf)]
    return bytes(model)


def _graph(buf, start: int, end: int, min_bytes: int, placeholder: Placeholder) -> bytearray | None:
    graph, run = bytearray(), start
    for number, wire, field_start, payload, field_end in _fields(buf, start, end):
        if wire != _LENGTH_DELIMITED or field_end - payload < min_bytes:
            continue
        if number == GRAPH_INITIALIZER:
            tensor = _plain_tensor(buf, payload, field_end, min_bytes)
            new = placeholder(tensor) if tensor is not None else None
            replaced = None if new is None else field_header(GRAPH_INITIALIZER, len(new)) + new
        elif number == GRAPH_NODE:
            replaced = _constant_node(buf, payload, field_end, min_bytes, placeholder)
        else:
            continue
        if replaced is not None:
            graph += buf[run:field_start]
            graph += replaced
            run = field_end
    if run == start:
        return None
    graph += buf[run:end]
    return graph


def _constant_node(buf, start: int, end: int, min_bytes: int, placeholder: Placeholder) -> bytes | None:
    """The node field with the placeholder in its ``value`` tensor, if the node is a Constant holding a large plain
    tensor. Repeated scalar fields count as protobuf counts them: the last one wins."""
    op_type = domain = value = None
    for number, wire, field_start, payload, field_end in _fields(buf, start, end):
        if wire != _LENGTH_DELIMITED:
            continue
        if number == NODE_OP_TYPE:
            op_type = bytes(buf[payload:field_end])
        elif number == NODE_DOMAIN:
            domain = bytes(buf[payload:field_end])
        elif number == NODE_ATTRIBUTE and field_end - payload >= min_bytes:
            tensor = _value_tensor(buf, payload, field_end)
            value = (field_start, payload, field_end, *tensor) if tensor is not None else value
    if op_type != b"Constant" or domain not in (None, b"", b"ai.onnx") or value is None:
        return None
    attr_start, attr_payload, attr_end, t_start, t_payload, t_end = value
    tensor = _plain_tensor(buf, t_payload, t_end, min_bytes)
    new = placeholder(tensor) if tensor is not None else None
    if new is None:
        return None
    attribute = buf[attr_payload:t_start] + field_header(ATTRIBUTE_TENSOR, len(new)) + new + buf[t_end:attr_end]
    node = buf[start:attr_start] + field_header(NODE_ATTRIBUTE, len(attribute)) + attribute + buf[attr_end:end]
    return field_header(GRAPH_NODE, len(node)) + node


def _value_tensor(buf, start: int, end: int) -> tuple[int, int, int] | None:
    """Where the tensor of an attribute named ``value`` lies (tag, payload, end), if it has exactly one."""
    name, tensors = None, []
    for number, wire, field_start, payload, field_end in _fields(buf, start, end):
        if wire == _LENGTH_DELIMITED and number == ATTRIBUTE_NAME:
            name = bytes(buf[payload:field_end])
        elif wire == _LENGTH_DELIMITED and number == ATTRIBUTE_TENSOR:
            tensors.append((field_start, payload, field_end))
    # a message field given twice is merged by protobuf: not one tensor's bytes any more
    return tensors[0] if name == b"value" and len(tensors) == 1 else None


def _plain_tensor(buf, start: int, end: int, min_bytes: int) -> PlainTensor | None:
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
    return PlainTensor(bytes(header), (start, end - start), data)


def reframe(model: bytes, nodes: list[int]) -> list[bytes | tuple[int, bytes]]:
    """A serialized model cut around the nodes of its main graph at the (sorted) positions ``nodes``: bytes to
    write as they are and, in the place of each of those nodes, (its position, its bytes). Writing each such node
    as a graph of its own (``constant_node_parts``) gives the same model: protobuf merges the occurrences of the
    graph field, and the nodes keep their order."""
    graphs = [f for f in _fields(model, 0, len(model)) if f[0] == MODEL_GRAPH and f[1] == _LENGTH_DELIMITED]
    if len(graphs) != 1:
        raise ValueError("the model has no graph, or more than one graph field")
    _, _, field_start, payload, end = graphs[0]
    pieces: list[bytes | tuple[int, bytes]] = [model[:field_start] + model[end:]]
    wanted = iter(nodes)
    index, run, target = -1, payload, next(wanted, None)
    for number, _, g_start, g_payload, g_end in _fields(model, payload, end):
        if number != GRAPH_NODE:
            continue
        index += 1
        if index == target:
            pieces += [_graph_field(model[run:g_start]), (index, model[g_payload:g_end])]
            run, target = g_end, next(wanted, None)
    if target is not None:
        raise ValueError(f"the graph has no node {target}")
    pieces.append(_graph_field(model[run:end]))
    return [p for p in pieces if p]


def _graph_field(graph_fields: bytes) -> bytes:
    return field_header(MODEL_GRAPH, len(graph_fields)) + graph_fields if graph_fields else b""


def constant_node_parts(node: bytes, tensor_length: int) -> tuple[bytes, bytes]:
    """A serialized Constant node with its ``value`` tensor cut out, re-framed for a tensor of ``tensor_length``
    bytes, with the graph field around it: ``before + tensor + after`` adds that node to a model's graph."""
    for number, wire, attr_start, attr_payload, attr_end in _fields(node, 0, len(node)):
        found = _value_tensor(node, attr_payload, attr_end) if (number, wire) == (NODE_ATTRIBUTE,
                                                                                    _LENGTH_DELIMITED) else None
        if found is None:
            continue
        t_start, _, t_end = found
        inner = field_header(ATTRIBUTE_TENSOR, tensor_length)
        attribute_length = (t_start - attr_payload) + len(inner) + tensor_length + (attr_end - t_end)
        head = node[:attr_start] + field_header(NODE_ATTRIBUTE, attribute_length) + node[attr_payload:t_start] + inner
        tail = node[t_end:]
        node_length = len(head) + tensor_length + len(tail)
        node_field = field_header(GRAPH_NODE, node_length)
        return field_header(MODEL_GRAPH, len(node_field) + node_length) + node_field + head, tail
    raise ValueError("the node has no value tensor")


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
