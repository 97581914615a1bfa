"""Writing a model atomically: the model, the one data file its weights may need, and the report appear together or
not at all. Every file lnfuse writes is named from what the user named (``-o fused.onnx`` gives ``fused.onnx`` and
``fused.onnx.data``): nothing the model names is ever a path written."""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import onnx
import onnx_ir as ir

from lnfuse.errors import OutputError
from lnfuse.index.ops import is_op
from lnfuse.index.traversal import every_graph, every_node
from lnfuse.load import trust, wire
from lnfuse.load.gate import GatedTensor
from lnfuse.load.io import INPUT_FILES
from lnfuse.load.weights import InlineWeight, SourceWeights
from lnfuse.save import data_file
from lnfuse.save.staging import Staging


def strip_inferred_value_info(model: ir.Model, declared: set[str], claims: Mapping[str, bytes]) -> None:
    """Drop the shapes lnfuse inferred for its own use, so the output declares what the input declared: the main
    graph's values as the input's value_info had them (``claims``; a claim inference contradicts is what ONNX
    Runtime loaded the input with, and the truth could make it refuse the output), the others as inferred."""
    # the nodes of the main graph and its bodies in one walk, and of each function (``every_graph``'s graphs)
    nodes = itertools.chain(every_node(model.graph), *(iter(f) for f in model.functions.values()))
    for value in (out for node in nodes for out in node.outputs):
        if value.is_graph_output():
            continue
        claim = claims.get(value.name) if value.graph is model.graph else None
        if claim is not None:
            declared_type = onnx.TypeProto.FromString(claim)
            value.type = ir.serde.deserialize_type_proto_for_type(declared_type)
            value.shape = ir.serde.deserialize_type_proto_for_shape(declared_type)
        elif value.name not in declared:
            value.type = None
            value.shape = None


#: how external weights are written: "keep" references the input's data files where the output can (it is written
#: into the model's own folder) and copies the ranges of them the model reads into ``<output>.data`` elsewhere;
#: "single" writes every weight into ``<output>.data``
EXTERNAL_LAYOUTS = ("keep", "single")


def save(model: ir.Model, path: str | os.PathLike, *, external_data: str | None, input_path: Path | None = None,
         in_place: bool = False, source: SourceWeights | None = None,
         report: tuple[str | os.PathLike, str] | None = None) -> list[Path]:
    """Write ``model`` to ``path`` (and ``report = (path, text)``) atomically: every file goes to a temporary
    folder beside its destination, and only when all are written is each renamed into place, the model last. A
    crash or Ctrl-C leaves no partial output, and no file the run reads (the input and its data) is ever written.
    Returns the files written: the model, ``<path>.data`` if its weights needed one, the report."""
    target = Path(path)
    if input_path is not None and not in_place and _same_file(target, input_path):
        raise OutputError(f"{target}: the output would overwrite the input; choose another path, or ask for in place "
                          "(--in-place, in_place=True)")
    if in_place and target.is_symlink() and input_path is not None and _same_file(target, input_path):
        # rewrite the file the link names, keep the link; any other link is replaced like any output
        target = Path(os.path.realpath(target))
    folder = target.parent if str(target.parent) else Path(".")
    report_path = Path(report[0]) if report is not None else None
    trust.check_folder(folder, target)
    trust.check_destination(target)
    if report_path is not None:
        trust.check_folder(report_path.parent if str(report_path.parent) else Path("."), report_path)
        trust.check_destination(report_path)
    weights = _Weights.of(model)
    if external_data == "keep":
        _hold_replaced(weights, target)
    # weights that go to ``<output>.data``: asked for, or too many to stay inline
    spill = external_data == "single" or _inline_bytes(weights) > _INLINE_LIMIT
    moved = weights.to_data_file(spill, os.path.realpath(folder))
    data = folder / (target.name + ".data") if moved else None
    written = [p for p in (target, data, report_path) if p is not None]
    reads = _check_overwrites(model, weights, written, data, input_path, in_place, source)
    try:
        with Staging(reads) as staging:
            tmp = staging.area(folder)
            _write(model, weights, moved, tmp / target.name, source)
            if report is not None:
                (staging.area(report_path.parent) / report_path.name).write_text(report[1])
            staging.commit(last=target)
    except OSError as error:
        raise OutputError(f"{target}: could not write ({error.strerror or error}); check the path and free space")\
            from None
    return written


#: inline weights past this go to ``<output>.data`` whatever the layout (a protobuf cannot exceed 2 GB)
_INLINE_LIMIT = onnx.checker.MAXIMUM_PROTOBUF * 0.9
#: with ``single``, inline initializers at least this large go to ``<output>.data`` (as ``onnx_ir.save`` does)
_SPILLED_BYTES = 256


@dataclass
class _Slot:
    """One place a weight sits: an initializer's value (of any graph but a function's) or the value of one of the
    main graph's Constant nodes (position, node)."""

    value: ir.Value | None = None
    position: int = -1
    node: ir.Node | None = None

    @property
    def tensor(self) -> ir.TensorProtocol | None:
        if self.value is not None:
            return self.value.const_value
        return self.node.attributes["value"].value

    @tensor.setter
    def tensor(self, tensor: ir.TensorProtocol) -> None:
        if self.value is not None:
            self.value.const_value = tensor
        else:
            doc = self.node.attributes["value"].doc_string
            self.node.attributes["value"] = ir.AttrTensor("value", tensor, doc_string=doc)


@dataclass
class _Weights:
    """Where a model keeps its tensors, found in one walk of its nodes (on a graph of a million nodes each walk
    costs): its graphs (the main one, If/Loop/Scan bodies, functions) and every slot a weight can sit in. The gate
    read everything external but the main graph's weights at load, so only those can still be external."""

    graphs: list[ir.Graph | ir.Function]
    slots: list[_Slot]

    @staticmethod
    def of(model: ir.Model) -> _Weights:
        graphs = list(every_graph(model))
        slots = [_Slot(value=v) for g in graphs if not isinstance(g, ir.Function) for v in g.initializers.values()]
        slots += [_Slot(position=i, node=node) for i, node in enumerate(model.graph) if _constant_value(node)]
        return _Weights(graphs, slots)

    @property
    def constants(self) -> list[_Slot]:
        return [slot for slot in self.slots if slot.node is not None]

    def external(self) -> list[tuple[_Slot, ir.ExternalTensor]]:
        return [(slot, t) for slot in self.slots if isinstance(t := slot.tensor, ir.ExternalTensor)]

    def to_data_file(self, spill: bool, folder: str) -> list[_Slot]:
        """The slots whose tensors go to ``<output>.data``: external weights that cannot be referenced where they
        lie (the output goes to another folder than the model's), or, with ``spill``, every external weight and
        every inline initializer of at least ``_SPILLED_BYTES``."""
        moved = []
        for slot in self.slots:
            tensor = slot.tensor
            if isinstance(tensor, ir.ExternalTensor):
                if not isinstance(tensor, GatedTensor):
                    raise RuntimeError(f"external tensor {tensor.name!r} was not admitted by a gate (a bug in lnfuse)")
                if spill or str(tensor.gate.folder) != folder:
                    moved.append(slot)
            elif spill and slot.value is not None and tensor is not None and tensor.nbytes >= _SPILLED_BYTES:
                moved.append(slot)
        return moved


def _check_overwrites(model: ir.Model, weights: _Weights, writes: list[Path], data: Path | None,
                      input_path: Path | None, in_place: bool, source: SourceWeights | None) -> set[tuple[int, int]]:
    """Before anything is written: no path the run writes (``writes``: the model first, ``data`` its data file) is
    a file it reads (see ``trust.check_no_overwrite``). Returns the (device, inode) of the files it reads."""
    read_paths = [input_path] if input_path is not None else []
    read_paths += [source.file.path] if source is not None else []
    read_paths += model.meta.get(INPUT_FILES, [])
    read_paths += [Path(t.base_dir) / t.location for _, t in weights.external()]
    reads = {ident: p for p in read_paths if (ident := trust.identity(p)) is not None}
    for path in writes[1:]:
        trust.check_destination(path)
    target = writes[0]
    allowed = set()
    if in_place and input_path is not None and trust.identity(target) == trust.identity(input_path):
        # the input model is replaced as asked, and so may be the data file its replacement writes; nothing else
        # (a report named like the input's data file would destroy the weights the new model reads)
        allowed = {trust.identity(p) for p in (target, data) if p is not None} - {None}
    trust.check_no_overwrite(reads, writes, allowed)
    return set(reads)


def _hold_replaced(weights: _Weights, target: Path) -> None:
    """Read into memory every external tensor whose bytes lie in the file this run replaces, so that it is written
    inline. A model may keep its external data in the model file itself (location = its own name): rewriting that
    file (``--in-place``) would leave references into a layout that is gone. Compared by device and inode: a link
    inside the folder to the model file is the file."""
    replaced = trust.identity(target)
    if replaced is None:
        return
    for slot, tensor in weights.external():
        if trust.identity(Path(tensor.base_dir) / tensor.location) == replaced:
            slot.tensor = _in_memory(tensor)


def _in_memory(tensor: ir.ExternalTensor) -> ir.Tensor:
    """The tensor's values copied out of its file (the file is about to be replaced), its name and doc kept."""
    values = tensor.numpy().copy()
    tensor.release()
    return ir.Tensor(values, dtype=tensor.dtype, name=tensor.name, doc_string=tensor.doc_string,
                     metadata_props=dict(tensor.metadata_props) or None)


def _write(model: ir.Model, weights: _Weights, moved: list[_Slot], tmp_model: Path,
           source: SourceWeights | None) -> None:
    for slot in weights.slots:
        if isinstance(slot.tensor, InlineWeight):
            slot.tensor.check_source()
    if not moved:
        _write_streamed(model, weights, tmp_model, source)
        return
    name = tmp_model.name + ".data"
    tensors = [slot.tensor for slot in moved]
    offsets = data_file.write(tmp_model.parent / name, [t for t in tensors if isinstance(t, GatedTensor)],
                              [t for t in tensors if not isinstance(t, GatedTensor)])
    # the model in memory keeps reading its own weights: the new references hold only while it is serialized
    for slot, tensor in zip(moved, tensors):
        slot.tensor = ir.ExternalTensor(name, offsets[id(tensor)], tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                        name=tensor.name, doc_string=tensor.doc_string,
                                        metadata_props=dict(tensor.metadata_props) or None,
                                        base_dir=tmp_model.parent)
    try:
        _write_streamed(model, weights, tmp_model, source)
    finally:
        for slot, tensor in zip(moved, tensors):
            slot.tensor = tensor


#: inline initializers and Constant values at least this large are written one by one after the rest of the model
_STREAMED_BYTES = 1 << 12


def _write_streamed(model: ir.Model, weights: _Weights, path: Path, source: SourceWeights | None) -> None:
    """Write the model without its large tensors, each one then added as a graph field of its own (see ``wire``):
    initializers at the end, each Constant node holding one in its place among the nodes. A tensor still held as
    read from the input file is copied from that file's bytes; others are serialized one at a time. Either way no
    second copy of all the weights is ever made."""
    graph = model.graph
    streamed = [v for v in graph.initializers.values() if _streamable(v)]
    constants = [(slot.position, slot.node, slot.node.attributes["value"]) for slot in weights.constants
                 if _large(slot.tensor)]
    # the dict behind graph.initializers, so the values keep their initializer state while left out
    registry = graph.initializers.data
    every = dict(registry)
    for value in streamed:
        del registry[value.name]
    for _, node, attribute in constants:  # a stand-in while the rest is serialized: constant_node_parts cuts it out
        node.attributes["value"] = ir.AttrTensor("value", ir.tensor([0.0]), doc_string=attribute.doc_string)
    try:
        head = ir.serde.serialize_model(model).SerializeToString()
    finally:
        registry.clear()
        registry.update(every)
        for _, node, attribute in constants:
            node.attributes["value"] = attribute
    pieces = wire.reframe(head, [i for i, _, _ in constants]) if constants else [head]
    tensors = {i: attribute.value for i, _, attribute in constants}
    with contextlib.ExitStack() as stack:
        original = None
        if source is not None and source.file.unchanged():
            original = stack.enter_context(open(source.file.path, "rb"))
        out = stack.enter_context(open(path, "xb", buffering=0))
        for piece in pieces:
            if isinstance(piece, bytes):
                data_file.write_all(out, piece)
                continue
            index, node = piece
            _write_tensor(out, tensors[index], None, original, source,
                          lambda length, node=node: wire.constant_node_parts(node, length))
        for value in streamed:
            _write_tensor(out, value.const_value, value.name, original, source,
                          lambda length: (wire.initializer_header(length), b""))


def _write_tensor(out, tensor: ir.TensorProtocol, name: str | None, original, source: SourceWeights | None,
                  frame) -> None:
    """One tensor as ``frame(its length)`` puts it: copied from the input file if it is still the weight read from
    there, else serialized alone (with ``name``, as onnx_ir's graph serializer names initializers)."""
    span = source.span_of(tensor, name) if original is not None else None
    if span is not None:
        before, after = frame(span[1])
        data_file.write_all(out, before)
        data_file.copy_range(original, out, *span)
        data_file.write_all(out, after)
        return
    if isinstance(tensor, ir.serde.TensorProtoTensor):
        proto = tensor.raw  # _streamable checked that an initializer's is named like its value
    else:
        proto = ir.serde.serialize_tensor(tensor)
        if name is not None:
            proto.name = name
    data = proto.SerializeToString()
    before, after = frame(len(data))
    data_file.write_all(out, before)
    data_file.write_all(out, data)
    data_file.write_all(out, after)


def _constant_value(node: ir.Node) -> ir.Attr | None:
    attribute = node.attributes.get("value") if is_op(node, "Constant") else None
    if attribute is None or attribute.type != ir.AttributeType.TENSOR:
        return None
    return attribute


def _large(tensor: ir.TensorProtocol) -> bool:
    return not isinstance(tensor, ir.ExternalTensor) and tensor.nbytes >= _STREAMED_BYTES


#: where onnx_ir keeps a value's quantization annotation (written with the graph, not with the tensor)
_QUANT_ANNOTATION = "quant_parameter_tensor_names"


def _streamable(value: ir.Value) -> bool:
    """Large inline tensors whose serialized form is exactly their stored proto (or a plain array)."""
    tensor = value.const_value
    if tensor is None or not _large(tensor):
        return False
    if tensor.metadata_props or value.metadata_props or value.doc_string or value.meta.get(_QUANT_ANNOTATION):
        return False
    return not isinstance(tensor, ir.serde.TensorProtoTensor) or tensor.raw.name == value.name


def _inline_bytes(weights: _Weights) -> int:
    """The size of the weights the saved proto would carry inline (a protobuf cannot exceed 2 GB)."""
    tensors = (slot.tensor for slot in weights.slots)
    return sum(t.nbytes for t in tensors if t is not None and not isinstance(t, ir.ExternalTensor))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and os.path.samefile(a, b)
    except OSError:
        return False
