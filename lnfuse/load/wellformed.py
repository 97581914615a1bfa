"""What onnx's checker does not check but every later step assumes: text is UTF-8, data types are ones ONNX defines,
a tensor's data is as long as its shape says, and the graph computes something.

A hostile or corrupt file breaks these in ways protobuf accepts (it hands back invalid UTF-8 as bytes, keeps any
integer as a data type). Checked once at load, on the model without its weights' bytes, so that each such file is
refused with one line naming what and where instead of failing deep inside a rule.
"""

from __future__ import annotations

import math

import onnx
import onnx_ir as ir
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from lnfuse.errors import InputError
from lnfuse.index.traversal import proto_bodies

#: attributes of ONNX ops whose value is a data type (Cast's ``to``, the random ops' ``dtype``, QuantizeLinear's
#: ``output_dtype``)
_DTYPE_ATTRIBUTES = frozenset({"to", "dtype", "output_dtype"})

#: typed data fields that hold two numbers per element (real and imaginary parts)
_COMPLEX = frozenset({onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128})


def check(proto: onnx.ModelProto, where: str) -> None:
    """``InputError`` for the first flaw found; nothing when the model is well formed."""
    if not proto.graph.output:
        raise InputError(f"{where}: the graph has no outputs, so it computes nothing (ONNX Runtime refuses it); "
                         "re-export the model with its outputs")
    _walk(proto, "model", where, text_checked=_all_text_is_utf8(proto))
    _claims_match_initializers(proto.graph, where)
    _node_names_unique(proto, where)
    _inlined_size_bounded(proto, where)


#: nodes the model's function calls may expand to: ONNX Runtime (and onnx's shape inference, once per call site)
#: inlines every call, so a few functions that each call the next twice describe 2^n nodes in a kilobyte. Real
#: exports with functions expand to tens of thousands
MAX_INLINED_NODES = 1_000_000


def _inlined_size_bounded(proto: onnx.ModelProto, where: str) -> None:
    """Refuse a model whose function calls expand past ``MAX_INLINED_NODES`` nodes, counted once per function (a
    memo, walked with a stack: no recursion on the call depth a model decides). A call cycle counts no further
    (the checker refuses recursion)."""
    functions = {_function_id(f): f for f in proto.functions}
    if not functions:
        return
    size: dict[tuple, int] = {}

    def nodes_of(nodes) -> list[onnx.NodeProto]:
        return list(nodes) + [n for body in proto_bodies(nodes) for n in body.node]

    def total(nodes) -> int:
        return min(sum(size.get(_function_id(n), 0) if _function_id(n) in functions else 1
                       for n in nodes_of(nodes)), MAX_INLINED_NODES + 1)

    stack, entered = [(key, False) for key in functions], set()
    while stack:
        key, done = stack.pop()
        if done:
            size[key] = total(functions[key].node)
            continue
        if key in entered:
            continue
        entered.add(key)
        stack.append((key, True))
        stack.extend((callee, False) for n in nodes_of(functions[key].node)
                     if (callee := _function_id(n)) in functions and callee not in entered)
    expanded = total(proto.graph.node)
    if expanded > MAX_INLINED_NODES:
        raise InputError(f"{where}: its model-local functions call one another into more than "
                         f"{MAX_INLINED_NODES:,} nodes once inlined (as ONNX Runtime and onnx's shape inference "
                         "inline every call); call each function once, or inline them where the model was made")


def _node_names_unique(proto: onnx.ModelProto, where: str) -> None:
    """ONNX Runtime refuses a graph (or function body) in which two nodes share a name; unnamed nodes are fine."""
    lists = [proto.graph.node, *(f.node for f in proto.functions)]
    lists += [body.node for body in proto_bodies([n for nodes in lists for n in nodes])]
    for nodes in lists:
        seen: set[str] = set()
        for node in nodes:
            if node.name in seen:
                raise InputError(f"{where}: two nodes are named '{node.name}' in one graph; ONNX Runtime refuses "
                                 "that too; give each node its own name (or none) where the model was made")
            if node.name:
                seen.add(node.name)
    _no_inlined_name_taken(proto, where)


def _no_inlined_name_taken(proto: onnx.ModelProto, where: str) -> None:
    """ONNX Runtime inlines each call of a model-local function into the graph that makes it (and the calls inside
    the function, in turn), naming the first copy of function F's node n ``_inlfunc_F_n``, and refuses the graph
    when one of its own nodes already has that name. The call nodes themselves are replaced, so their names are
    free."""
    functions = {_function_id(f): f for f in proto.functions}
    if not functions:
        return

    def calls(nodes) -> list[onnx.FunctionProto]:
        return [functions[_function_id(n)] for n in nodes if _function_id(n) in functions]

    for nodes in [proto.graph.node, *(body.node for body in proto_bodies(proto.graph.node))]:
        todo, inlined = calls(nodes), set()
        names: set[str] = set()
        while todo:
            function = todo.pop()
            if _function_id(function) in inlined:
                continue
            inlined.add(_function_id(function))
            names.update(f"_inlfunc_{function.name}_{n.name}" for n in function.node
                         if n.name and _function_id(n) not in functions)
            todo.extend(calls(function.node))
        for node in nodes:
            if node.name in names and _function_id(node) not in functions:
                raise InputError(f"{where}: node '{node.name}' has the name ONNX Runtime gives a node of a function "
                                 "it inlines there, and ONNX Runtime refuses the model for it; rename the node where "
                                 "the model was made")


def _function_id(message) -> tuple[str, str, str]:
    """A call node's (domain, op, overload), or a function's (domain, name, overload): equal when the node calls it."""
    name = message.op_type if isinstance(message, onnx.NodeProto) else message.name
    return message.domain, name, getattr(message, "overload", "")


def _all_text_is_utf8(proto: onnx.ModelProto) -> bool:
    """Whether every string field of the model is UTF-8, checked by protobuf in C: a proto3 copy of onnx's schema
    refuses to parse text that is not (onnx.proto is proto2, which keeps it as bytes). False does not say where:
    the walk then reads each field and names it."""
    schema = descriptor_pb2.FileDescriptorProto()
    onnx.ModelProto.DESCRIPTOR.file.CopyToProto(schema)
    package = "lnfuse_utf8_check"
    schema.name, schema.package, schema.syntax = f"{package}.proto", package, "proto3"
    schema.ClearField("options")
    messages = list(schema.message_type)
    while messages:
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in message.field:
            field.ClearField("default_value")  # proto3 has none
            if field.type_name.startswith(".onnx."):
                field.type_name = f".{package}.{field.type_name[len('.onnx.'):]}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(schema)
    strict = message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.ModelProto"))
    try:
        strict.FromString(proto.SerializeToString())
    except DecodeError:
        return False
    return True


def _claims_match_initializers(graph: onnx.GraphProto, where: str) -> None:
    """A graph input naming an initializer declares the shape the initializer holds (ONNX Runtime checks an input
    against its initializer; rules read the declared shape and must not meet another one). A value_info naming one
    ORT ignores, and so does lnfuse (``repair``)."""
    held = {t.name: list(t.dims) for t in graph.initializer}
    held.update({s.values.name: list(s.dims) for s in graph.sparse_initializer})
    for info in graph.input:
        dims = held.get(info.name)
        tensor_type = info.type.tensor_type
        if dims is None or not info.type.HasField("tensor_type") or not tensor_type.HasField("shape"):
            continue
        declared = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if len(declared) != len(dims) or any(d is not None and d != h for d, h in zip(declared, dims)):
            raise InputError(f"{where}: initializer {info.name!r} holds shape {dims} but the graph declares "
                             f"{['?' if d is None else d for d in declared]}; re-export the model")


def _walk(message, path: str, where: str, text_checked: bool) -> None:
    """Check every field of ``message`` and of the messages in it. ``text_checked``: every string is known to be
    UTF-8, so a node without attributes, which holds nothing else to check (names, op type, domain, text), is
    skipped: on a graph of a million nodes, reading each one's fields would take seconds."""
    if isinstance(message, onnx.TensorProto):
        _check_tensor(message, path, where)
        return
    if isinstance(message, onnx.NodeProto) and message.domain in ("", "ai.onnx"):
        for attr in message.attribute:
            # an attribute that refers to the calling node's (``ref_attr_name``) has its value only at each call
            if attr.name in _DTYPE_ATTRIBUTES and attr.type == onnx.AttributeProto.INT and not attr.ref_attr_name:
                _data_type(attr.i, f"{path} ({message.op_type}) attribute {attr.name!r}", where, allow_undefined=False)
    skip_plain_nodes = text_checked and isinstance(message, (onnx.GraphProto, onnx.FunctionProto))
    for field, value in message.ListFields():
        items = value if _repeated(field) else (value,)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            plain = skip_plain_nodes and field.name == "node"
            for index, item in enumerate(items):
                if plain and not item.attribute:
                    continue
                _walk(item, f"{path}.{field.name}" + (f"[{index}]" if len(items) > 1 else ""), where, text_checked)
        elif field.type == FieldDescriptor.TYPE_STRING and not text_checked:
            _text(items, f"{path}.{field.name}", where)
        elif field.name == "elem_type":
            _data_type(value, f"{path}.elem_type", where, allow_undefined=True)


def _repeated(field: FieldDescriptor) -> bool:
    # protobuf 5.29 added is_repeated and 7 removed label
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == FieldDescriptor.LABEL_REPEATED


def _text(items, path: str, where: str) -> None:
    # protobuf returns a string field that is not valid UTF-8 as bytes instead of str
    for item in items:
        if isinstance(item, bytes):
            raise InputError(f"{where}: {path} is not UTF-8 text ({item[:40]!r}); the file is corrupt, re-export it")


def _data_type(value: int, path: str, where: str, allow_undefined: bool) -> None:
    try:
        known = ir.DataType(value)
    except ValueError:
        known = None
    if known is None or (known == ir.DataType.UNDEFINED and not allow_undefined):
        raise InputError(f"{where}: {path} is data type {value}, which ONNX does not define; re-export the model")


def _check_tensor(tensor: onnx.TensorProto, path: str, where: str) -> None:
    _text([tensor.name, tensor.doc_string, *(e.key for e in tensor.external_data),
           *(e.value for e in tensor.external_data)], f"{path}.name", where)
    said = f"{where}: tensor {tensor.name!r} ({path})"
    _data_type(tensor.data_type, f"tensor {tensor.name!r} ({path})", where, allow_undefined=False)
    if any(d < 0 for d in tensor.dims):
        raise InputError(f"{said}: negative dimension in {list(tensor.dims)}; re-export the model")
    if tensor.HasField("segment"):
        raise InputError(f"{said}: a segment of a larger tensor, which ONNX Runtime does not read; re-export it")
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return  # checked against its file by lnfuse.load.trust
    elements = math.prod(tensor.dims)
    if tensor.HasField("raw_data"):
        if tensor.data_type == onnx.TensorProto.STRING:
            raise InputError(f"{said}: a STRING tensor with raw bytes, which ONNX does not allow; re-export it")
        expected = math.ceil(elements * ir.DataType(tensor.data_type).itemsize)
        held, unit = len(tensor.raw_data), "bytes"
    else:
        field = onnx.helper.tensor_dtype_to_field(tensor.data_type)
        held, unit = len(getattr(tensor, field)), f"values in {field}"
        expected = elements * (2 if tensor.data_type in _COMPLEX else 1)
        if tensor.data_type != onnx.TensorProto.STRING and ir.DataType(tensor.data_type).itemsize == 0.5:
            expected = math.ceil(elements / 2)  # two 4-bit elements a value
    if held != expected:
        raise InputError(f"{said}: holds {held} {unit}, its shape {list(tensor.dims)} needs {expected}; the file "
                         "is corrupt, re-export the model")
