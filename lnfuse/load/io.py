"""Reading models without loading their weights, and writing them atomically.

A model is read with its external data left on disk (onnx_ir's tensors read it lazily, only when a rule needs a
value), validated, and shape-inferred. Inferred shapes help the checks but are not part of the user's model, so the
names of the value_info entries the input had are remembered and the others are dropped before saving.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError, Message

from lnfuse.load import trust, wellformed, wire
from lnfuse.load.gate import WEIGHT_ELEMENTS, Gate, weight_value
from lnfuse.load.weights import FileWeights, SourceWeights, attach, split
from lnfuse.errors import InputError, first_line
from lnfuse.load.repair import declare_output_shapes, repair
from lnfuse.index.demand import PendingShapes, infer_shapes_deferred
from lnfuse.index.shapes import TypesDisagree, infer_function_types, infer_shapes, type_error
from lnfuse.index.traversal import every_graph, every_proto_node
from lnfuse.index.ops import onnx_op, ort_schemas


@dataclass
class Loaded:
    model: ir.Model
    path: Path | None
    declared_value_info: set[str] = field(default_factory=set)
    has_external_data: bool = False
    shape_inference_error: str | None = None
    source: SourceWeights | None = None
    gate: Gate | None = None
    #: ORT's symbolic shape inference, when onnx's left dims unknown and it was deferred (``load(defer_symbolic)``)
    pending_shapes: PendingShapes | None = None
    #: the main graph's value_info as the input declared it (serialized types, by name): written back as it was,
    #: even where inference contradicts it, since ONNX Runtime loaded the input with that claim
    claims: dict[str, bytes] = field(default_factory=dict)


def read_proto(path: str | os.PathLike) -> tuple[onnx.ModelProto, FileWeights | None]:
    """The model without its data: external data stays external, and large inline weights become placeholders that
    point into the model file (where they lie is returned with it). Or ``InputError`` saying what is wrong with the
    file."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file; check the path")
    if p.is_dir():
        raise InputError(f"{p}: is a directory, not an ONNX file")
    if p.stat().st_size == 0:
        raise InputError(f"{p}: the file is empty; re-export the model")
    try:
        proto, weights = _parse(p)
    except (DecodeError, RuntimeError, ValueError, OSError) as error:
        if _MAX_DEPTH_SAID in str(error):
            raise _too_deep(str(p)) from None
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise InputError(f"{p}: not a readable ONNX model (truncated or not ONNX: {first}); re-export it") from None
    if not proto.HasField("graph") or proto.ir_version == 0:
        raise InputError(f"{p}: not an ONNX model (no graph or IR version); re-export it")
    return proto, weights


#: what protobuf says of a message nested past its limit (100 messages deep)
_MAX_DEPTH_SAID = "MaxDepth"
#: If/Loop/Scan bodies nested in one another that a model file can hold: protobuf reads no message nested more than
#: 100 deep (nor does ONNX Runtime's reader), each body is three messages (node, attribute, graph) below its graph,
#: and a value's type takes five more. A model built in memory deeper than that could never be read back
MAX_NESTED_BODIES = 30


def _too_deep(where: str) -> InputError:
    return InputError(f"{where}: If/Loop/Scan bodies (or types) nested deeper than a model file can hold (protobuf "
                      f"reads 100 messages deep, some {MAX_NESTED_BODIES} levels of bodies); ONNX Runtime cannot load it "
                      "either, flatten the nesting")


def _copied(source: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a caller's proto, read back as a file would be (so nested no deeper than protobuf reads)."""
    try:
        return onnx.ModelProto.FromString(source.SerializeToString())
    except DecodeError as error:
        if _MAX_DEPTH_SAID in str(error):
            raise _too_deep("model") from None
        raise InputError(f"model: not a valid ONNX model ({first_line(error)})") from None


def _serialized(source: ir.Model) -> onnx.ModelProto:
    """The proto of a caller's onnx_ir model. Its bodies' nesting is measured first, with a stack: onnx_ir's
    serializer recurses once per level."""
    stack = [(graph, 1) for graph in [source.graph, *source.functions.values()]]
    while stack:
        graph, depth = stack.pop()
        for node in graph:
            for attribute in node.attributes.values():
                if attribute.type == ir.AttributeType.GRAPH:
                    bodies = [attribute.value]
                elif attribute.type == ir.AttributeType.GRAPHS:
                    bodies = list(attribute.value)
                else:
                    continue
                if depth > MAX_NESTED_BODIES:
                    raise _too_deep("model")
                stack += [(body, depth + 1) for body in bodies]
    try:
        return ir.serde.serialize_model(source)
    except RecursionError:  # types nested past any limit (a sequence of a sequence of ...), by a library's walk
        raise _too_deep("model") from None


#: onnx.load's text formats, chosen by file extension like onnx does
_TEXT_SUFFIXES = (".json", ".onnxtxt", ".textproto", ".prototxt", ".pbtxt")


def _parse(path: Path) -> tuple[onnx.ModelProto, FileWeights | None]:
    """Parse the model's structure from the page cache, leaving its large inline weights in the file."""
    if path.suffix.lower() in _TEXT_SUFFIXES:
        return onnx.load(str(path), load_external_data=False), None
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        identity = wire.FileIdentity.of_open(path, file.fileno())
        try:
            structure, weights = split(mapped, identity)
            proto = onnx.ModelProto.FromString(structure)
        except (ValueError, TypeError, IndexError, DecodeError):
            # not splittable (truncated, or not what it claims, e.g. a weight of no data type): let protobuf say
            # what is wrong, or read it whole (and let the checks name the flaw)
            return onnx.ModelProto.FromString(memoryview(mapped)), None
    return proto, weights if weights.tensors else None


def validate(proto: onnx.ModelProto, where: str, gate: Gate
             ) -> tuple[onnx.ModelProto, dict[int, onnx.TensorProto], bool]:
    """Versions, external files, then onnx's checker on the model's skeleton (the weights' bytes are not what
    makes a graph valid, and checking them would cost a full copy). Returns the skeleton, the Constant nodes of
    ``proto`` holding weights (``_large_constants``), which it holds as inputs, and whether its types were checked
    here: only for a model with ONNX Runtime's own default-domain ops, which onnx's inference would stop at; the
    others' are checked by the shape inference that follows (``check_types``), which then runs once, not twice."""
    repair(proto, where)  # what ONNX Runtime repairs itself (node order, domains, -1 dims), or its refusal
    max_opset = onnx.defs.onnx_opset_version()
    for imp in proto.opset_import:
        if imp.version < 1:
            raise InputError(f"{where}: opset {imp.version} of domain '{imp.domain or 'ai.onnx'}' is not a version "
                             "(they start at 1); ONNX Runtime refuses it too; re-export the model")
        if imp.domain in ("", "ai.onnx") and imp.version > max_opset:
            raise InputError(f"{where}: opset {imp.version} is newer than this onnx supports ({max_opset}); "
                             "upgrade onnx or re-export at a lower opset")
    constants = _large_constants(proto.graph)  # after repair, which may have put the nodes in another order
    checked = _skeleton(proto, gate, constants)
    declare_output_shapes(proto, checked)  # outputs typed without a shape: ORT reads them as unknown rank
    ort_only = _ort_only_ops(checked)
    # ONNX Runtime's default-domain ops (a model fused with --target ort): everything else is checked
    without = _without_ort_only_ops(checked, ort_only) if ort_only else checked
    # serialized once for the checker and the type check (on a graph of a million nodes, each copy costs)
    checked_bytes = checked.SerializeToString()
    without_bytes = without.SerializeToString() if ort_only else checked_bytes
    try:
        onnx.checker.check_model(checked_bytes)
    except (onnx.checker.ValidationError, onnx.onnx_cpp2py_export.checker.ValidationError) as error:
        if not ort_only:
            raise InputError(f"{where}: fails the ONNX checker ({first_line(error)}); fix or re-export the model")\
                from None
        try:
            onnx.checker.check_model(without_bytes)
        except (onnx.checker.ValidationError, onnx.onnx_cpp2py_export.checker.ValidationError) as again:
            raise InputError(f"{where}: fails the ONNX checker ({first_line(again)}); fix or re-export the model")\
                from None
    del checked_bytes
    if ort_only:
        _check_types(without_bytes, where)
    return checked, constants, bool(ort_only)


def _check_types(checked: bytes, where: str) -> None:
    """onnx's basic checker does not look at types; ONNX Runtime refuses a node whose inputs bind one type
    parameter to two types, and what lnfuse would write from it fails the full checker. Only type errors are
    refused: a declared shape that disagrees with the inferred one is a claim ORT ignores (see ``shapes``).
    ``checked`` (a serialized model) holds no op only ONNX Runtime defines (onnx's inference would stop there).
    Only the verdict is used: the inferred model onnx returns is not parsed."""
    try:
        onnx.onnx_cpp2py_export.shape_inference.infer_shapes(checked, True, True, False)  # check_type, strict_mode
    except Exception as error:  # noqa: BLE001 - onnx also raises ValueError (an undefined elem type): no verdict
        if (detail := type_error(error)) is not None:
            raise _types_refused(where, detail) from None


def _types_refused(where: str, detail: str) -> InputError:
    return InputError(f"{where}: its types do not line up ({detail}); ONNX Runtime refuses to load it too; fix or "
                      "re-export the model")


_ORT_DOMAIN = "lnfuse.ort_default_domain"


def _ort_only_ops(proto: onnx.ModelProto) -> set[str]:
    """Default-domain ops of the model that ONNX does not define at the model's opset but ONNX Runtime does."""
    opset = next((i.version for i in proto.opset_import if i.domain in ("", "ai.onnx")), 1)
    missing = set()
    for op in {n.op_type for n in every_proto_node(proto) if n.domain in ("", "ai.onnx")}:
        try:
            onnx.defs.get_schema(op, opset, "")
        except onnx.defs.SchemaError:
            missing.add(op)
    if not missing:
        return missing  # listing ORT's schemas costs 0.1 s: only when there is something to look up
    ort = {name for domain, name in ort_schemas() if domain == ""}
    return missing if missing <= ort else set()


def _without_ort_only_ops(proto: onnx.ModelProto, ops: set[str]) -> onnx.ModelProto:
    """A copy whose ``ops`` (from ``_ort_only_ops``) are in a domain of their own, which onnx does not check."""
    copy = onnx.ModelProto.FromString(proto.SerializeToString())
    for node in every_proto_node(copy):
        if onnx_op(node) in ops:
            node.domain = _ORT_DOMAIN
    for imports in [copy.opset_import, *(f.opset_import for f in copy.functions)]:
        imports.append(onnx.helper.make_opsetid(_ORT_DOMAIN, 1))
    return copy


def _large_constants(graph: onnx.GraphProto) -> dict[int, onnx.TensorProto]:
    """The Constant nodes holding weights (onnxscript's code form writes weights so), by position; the skeleton sees
    them as graph inputs."""
    return {i: tensor for i, node in enumerate(graph.node)
            if (tensor := weight_value(node)) is not None
            and math.prod(tensor.dims) > WEIGHT_ELEMENTS}


def _skeleton(proto: onnx.ModelProto, gate: Gate, constants: dict[int, onnx.TensorProto]) -> onnx.ModelProto:
    """The model without its weights: each large initializer, and each Constant node holding a large tensor
    (``constants``), becomes a typed graph input. Shape inference and the structural checks run on this in
    milliseconds instead of copying and serializing gigabytes (ORT's symbolic inference would decode every
    Constant)."""
    skeleton = onnx.ModelProto(ir_version=proto.ir_version)
    skeleton.opset_import.extend(proto.opset_import)
    skeleton.functions.extend(proto.functions)
    graph = proto.graph
    kept = []
    inputs = {v.name for v in graph.input}
    weights = []
    for tensor in graph.initializer:
        if int(np.prod(tensor.dims)) > WEIGHT_ELEMENTS:
            if tensor.name not in inputs:
                weights.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        elif tensor.data_location == onnx.TensorProto.EXTERNAL:
            # a small constant (a Reshape target, epsilon) stored outside: shape inference needs its value
            kept.append(gate.inline(tensor))
        else:
            kept.append(tensor)
    skeleton.graph.CopyFrom(onnx.GraphProto(name=graph.name, doc_string=graph.doc_string))
    if constants:
        for i, node in enumerate(graph.node):
            if i in constants:
                tensor = constants[i]
                weights.append(onnx.helper.make_tensor_value_info(node.output[0], tensor.data_type, list(tensor.dims)))
            else:
                skeleton.graph.node.append(node)
    else:
        skeleton.graph.node.extend(graph.node)
    skeleton.graph.input.extend(list(graph.input) + weights)
    skeleton.graph.output.extend(graph.output)
    skeleton.graph.value_info.extend(graph.value_info)
    skeleton.graph.initializer.extend(kept)
    return skeleton


def _one_base_dir(model: ir.Model) -> Path | None:
    """The folder an ``ir.Model``'s external tensors are read from (the trust boundary needs one model folder):
    every external tensor's, initializers and attribute tensors alike, in every graph and function."""
    folders = {Path(tensor.base_dir) for tensor in _ir_tensors(model) if isinstance(tensor, ir.ExternalTensor)}
    if len(folders) > 1:
        raise InputError(f"model: external tensors are read from {len(folders)} folders "
                         f"({', '.join(sorted(map(repr, map(str, folders))))}); save the model to one folder first")
    return next(iter(folders), None)


def _ir_tensors(model: ir.Model):
    """The tensors of an ``ir.Model``: initializers, and the values of tensor attributes of every node (functions'
    attribute defaults included)."""
    attributes = []
    for graph in every_graph(model):
        if not isinstance(graph, ir.Function):
            yield from (v.const_value for v in graph.initializers.values())
        else:
            attributes.extend(graph.attributes.values())
        for node in graph:
            attributes.extend(node.attributes.values())
    for attribute in attributes:
        if isinstance(attribute, ir.Attr) and not attribute.is_ref():
            if attribute.type == ir.AttributeType.TENSOR:
                yield attribute.value
            elif attribute.type == ir.AttributeType.TENSORS:
                yield from attribute.value


def _value_info_names(graph: onnx.GraphProto, names: set[str]) -> set[str]:
    names.update(v.name for v in graph.value_info)
    for node in graph.node:
        if not node.attribute:
            continue
        for attr in node.attribute:
            for sub in list(attr.g and [attr.g] or []) + list(attr.graphs):
                _value_info_names(sub, names)
    return names


def load(source: str | os.PathLike | onnx.ModelProto | ir.Model, base_dir: Path | None = None,
         defer_symbolic: bool = False) -> Loaded:
    """Read, validate and shape-infer a model; external weights stay on disk, read through the model folder's gate
    only. ``base_dir``: the folder a ModelProto's external data lies in (by default the working directory, where
    onnx_ir would read it). ``defer_symbolic``: run only onnx's inference now, and leave ONNX Runtime's symbolic
    inference (seconds on some models) to ``Loaded.pending_shapes``, for the caller to resolve where candidates
    need it (``demand``)."""
    lazy: FileWeights | None = None
    if isinstance(source, (ir.Model, onnx.ModelProto)):
        path, where = None, "model"
        if isinstance(source, ir.Model):
            # serializing makes the copy lnfuse works on (the caller's model is never modified); external tensors
            # keep pointing at their files
            proto = _serialized(source)
            base_dir = _one_base_dir(source)
        else:
            proto = _copied(source)  # the caller's proto stays as it is
        # resolved now: a script that changes directory later still reads from the same folder
        gate = Gate(base_dir or Path.cwd(), where)
    else:
        path = Path(source)
        (proto, lazy), where = read_proto(path), str(path)
        gate = Gate(path.parent, where)
    # from here on, the only external references are the main graph's weights, each admitted by the gate
    gate.admit_all(proto, lnfuse_made=lazy.holds if lazy else None)
    wellformed.check(proto, where)
    _densify_sparse(proto, where)
    skeleton, constants, types_checked = validate(proto, where, gate)
    declared = _value_info_names(proto.graph, set())
    # a claim is about the value of that name the input computes: one naming no value (value_info a tool left
    # behind when it removed the node) says nothing, and must not type a value lnfuse names later
    produced = {name for node in proto.graph.node for name in node.output}
    claims = {v.name: v.type.SerializeToString() for v in proto.graph.value_info if v.name in produced}
    pending = None
    try:
        if defer_symbolic:
            inferred, error, pending = infer_shapes_deferred(skeleton, check_types=not types_checked)
        else:
            inferred, error = infer_shapes(skeleton, check_types=not types_checked)
    except TypesDisagree as disagree:
        raise _types_refused(where, str(disagree)) from None
    del skeleton  # each copy of the graph is let go as soon as it is not needed: a big graph's peak is its copies
    # inferred types are set on the IR values directly (_set_types): the value_info is not deserialized
    types = list(inferred.graph.value_info)
    inferred.graph.ClearField("value_info")
    inferred_names = {v.name for v in types} if constants else set()
    for i, tensor in constants.items():
        node = proto.graph.node[i]
        if node.output[0] not in inferred_names:
            types.append(onnx.helper.make_tensor_value_info(node.output[0], tensor.data_type, list(tensor.dims)))
    proto = _with_inferred_graph(proto, inferred, list(constants))
    del constants
    del inferred
    model = ir.serde.deserialize_model(proto)
    _set_types(model.graph, types)
    infer_function_types(model)
    source_weights = attach(model, lazy) if lazy else None
    has_external = gate.attach(model)
    # absolute: a script may change directory between reading and saving
    model.meta[INPUT_FILES] = [Path(os.path.abspath(f)) for f in ([path] if path is not None else []) + gate.files()]
    model.meta[DATA_LOCATIONS] = gate.admitted()
    return Loaded(model, path, declared, has_external, error, source_weights, gate, pending, claims)


#: what the inferred skeleton holds of the full model: its nodes (with the subgraphs' value_info), its outputs, and
#: its value_info (taken out before, for _set_types)
_INFERRED_GRAPH_FIELDS = ("node", "output", "value_info")


def _with_inferred_graph(proto: onnx.ModelProto, inferred: onnx.ModelProto, constants: list[int]
                         ) -> onnx.ModelProto:
    """The inferred skeleton made the full model again: its nodes and outputs as inferred, every other field as
    ``proto`` has it, and the Constant nodes the skeleton held as inputs back in their places. The inferred nodes
    are reused, not copied: on a graph of a million nodes a copy costs hundreds of megabytes."""
    for message, source, keep in ((inferred, proto, ("graph",)), (inferred.graph, proto.graph, _INFERRED_GRAPH_FIELDS)):
        for descriptor, _ in message.ListFields():
            if descriptor.name not in keep:
                message.ClearField(descriptor.name)
        for descriptor, value in source.ListFields():
            if descriptor.name not in keep:
                _copy_field(message, descriptor.name, value)
    if constants:
        inferred_nodes = iter(inferred.graph.node)
        held = set(constants)
        nodes = [proto.graph.node[i] if i in held else next(inferred_nodes) for i in range(len(proto.graph.node))]
        graph = onnx.GraphProto()
        graph.node.extend(nodes)  # a copy: code-form models, whose weights are Constants, have few nodes
        inferred.graph.ClearField("node")
        inferred.graph.node.extend(graph.node)
    return inferred


def _copy_field(message, name: str, value) -> None:
    if isinstance(value, Message):
        getattr(message, name).CopyFrom(value)
    elif isinstance(value, (str, bytes, int, float)):
        setattr(message, name, value)
    else:
        getattr(message, name).extend(value)


def _set_types(graph: ir.Graph, infos: list[onnx.ValueInfoProto]) -> None:
    """Types and shapes of the main graph's values from ``infos``, as onnx_ir sets them when it reads value_info,
    but each distinct type read once (a graph of a million values has a handful): onnx_ir's shapes read from
    value_info are frozen, so one is shared by every value of that shape; each value gets its own type object."""
    values = {value.name: value for node in graph for value in node.outputs if not value.is_graph_output()}
    values.update((name, value) for name, value in graph.initializers.items() if not value.is_graph_input())
    read: dict[bytes, tuple[ir.Shape | None, ir.TypeProtocol | None]] = {}
    for info in infos:
        value = values.get(info.name)
        if value is None:
            continue
        key = info.type.SerializeToString()
        if key not in read:
            read[key] = (ir.serde.deserialize_type_proto_for_shape(info.type),
                         ir.serde.deserialize_type_proto_for_type(info.type))
        shape, kind = read[key]
        if info.doc_string or info.metadata_props or type(kind) is not ir.TensorType or kind.denotation:
            ir.serde.deserialize_value_info_proto(info, value)
            continue
        value.shape, value.type = shape, ir.TensorType(kind.dtype)


#: where a loaded model keeps the files it was read from (saving must never write over one of them)
INPUT_FILES = "lnfuse.input_files"
#: and its data files as it names them, with their stat keys when they were admitted (``Gate.admitted``)
DATA_LOCATIONS = "lnfuse.data_locations"


#: a sparse tensor is stored dense in memory and in the output: refused past this size, checked before allocating
#: (a 320-byte sparse initializer can declare a 37 GiB dense shape), for all of a model's sparse tensors together.
#: 64 MiB is far above any sparse constant a normalization touches; making one dense takes about three times its
#: size at the peak (the array, its TensorProto, the serialized model).
MAX_DENSE_SPARSE_BYTES = 64 << 20


def _densify_sparse(proto: onnx.ModelProto, where: str) -> None:
    """Sparse constants and initializers as dense tensors of the same values (onnx_ir reads only dense ones). The
    budget holds for all of them together, checked before the first is made dense: six sparse tensors of a few
    bytes, each just under it, took 3 GB."""
    constants = [attr for node in every_proto_node(proto) if node.op_type == "Constant"
                 for attr in node.attribute if attr.name == "sparse_value"]
    total = 0
    for sparse in [attr.sparse_tensor for attr in constants] + list(proto.graph.sparse_initializer):
        said = f"{where}: sparse tensor {sparse.values.name!r}"
        total += trust.element_count(sparse.dims, said) * _itemsize(sparse.values.data_type, said)
        if total > MAX_DENSE_SPARSE_BYTES:
            raise InputError(f"{said}: the sparse tensors' dense shapes need {total:.0f} bytes in all, more than "
                             f"lnfuse allows ({MAX_DENSE_SPARSE_BYTES >> 20} MiB); store them dense or smaller")
    for attr in constants:
        attr.CopyFrom(onnx.helper.make_attribute("value", _dense(attr.sparse_tensor, where)))
    proto.graph.initializer.extend(_dense(sparse, where) for sparse in proto.graph.sparse_initializer)
    proto.graph.ClearField("sparse_initializer")


def _itemsize(data_type: int, said: str) -> float:
    if data_type == onnx.TensorProto.STRING:  # each element at least an object's reference (its text comes on top)
        return np.dtype(object).itemsize
    try:
        return ir.DataType(data_type).itemsize
    except ValueError:
        raise InputError(f"{said}: unknown data type {data_type}; re-export the model") from None


def _dense(sparse: onnx.SparseTensorProto, where: str) -> onnx.TensorProto:
    said = f"{where}: sparse tensor {sparse.values.name!r}"
    dims = [int(d) for d in sparse.dims]
    elements = trust.element_count(dims, said)
    try:
        values = onnx.numpy_helper.to_array(sparse.values)
        indices = onnx.numpy_helper.to_array(sparse.indices).astype(np.int64)
    except (ValueError, TypeError, KeyError) as error:
        raise InputError(f"{said}: cannot be read ({first_line(error)}); re-export the model") from None
    linear = indices.ndim == 1
    if values.ndim != 1 or not (linear or indices.shape == (len(values), len(dims))) or len(indices) != len(values):
        raise InputError(f"{said}: {len(values)} values and indices of shape {list(indices.shape)} do not match its "
                         f"{len(dims)} dimensions; re-export the model")
    bounds = np.array([elements] if linear else dims, dtype=np.int64)
    if indices.size and ((indices < 0).any() or (indices >= bounds).any()):
        raise InputError(f"{said}: an index lies outside its shape {dims}; re-export the model")
    # the elements not listed are zero, and for text the empty string (what ONNX Runtime makes of them too)
    flat = np.full(elements, b"", dtype=object) if values.dtype == object else np.zeros(elements, dtype=values.dtype)
    flat[indices if linear else np.ravel_multi_index(tuple(indices.T), dims)] = values
    return onnx.numpy_helper.from_array(flat.reshape(dims), sparse.values.name)
