"""Types for the values lnfuse writes. Rules type what they can from the values they replace; the rest is inferred
here, so that the saved model declares every value lnfuse wrote and a later pass (decompose, ORT, onnx's inference)
sees a fully typed graph. Shared by fusion (``engine``), the API and decompose."""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import onnx
import onnx_ir as ir

from lnfuse.index.constants import static_value
from lnfuse.index.shapes import infer_shapes
from lnfuse.index.traversal import every_node


def type_new_values(model: ir.Model, before: Mapping[ir.Node, None] | set[ir.Node]) -> set[str]:
    """Give every value lnfuse wrote (the outputs of nodes not in ``before``) its dtype and shape, and return their
    names: the saved model declares them, so that a later pass (decompose, ORT, onnx's inference) sees a fully
    typed graph. Rules type what they can from the values they replace; the rest is inferred here, node by node
    with onnx's inference for standard ops, and with ONNX Runtime's symbolic inference for its contrib ops."""
    names: set[str] = set()
    for graph in [model.graph, *model.functions.values()]:
        opsets = {**model.opset_imports, **(graph.opset_imports if isinstance(graph, ir.Function) else {})}
        new = [n for n in every_node(graph) if n not in before]
        untyped = []
        for node in new:
            if any(_untyped(v) for v in node.outputs) and not _infer_node(node, opsets, model.ir_version):
                untyped.append(node)
        if untyped:
            _infer_contrib(untyped, opsets, model.ir_version)
        for value in (v for n in new for v in n.outputs):
            if value.shape is not None:
                value.shape = _plausible(value.shape)
        names.update(v.name for n in new for v in n.outputs if v.name and not _untyped(v))
    return names


def retype_new_values(model: ir.Model, before: Mapping[ir.Node, None] | set[ir.Node],
                      keep: set[ir.Value] = frozenset()) -> None:
    """Infer again, node by node in graph order, the shapes of the values lnfuse wrote (outputs of nodes not in
    ``before``), after the values they are computed from got new shapes: a norm fused on onnx's shapes carries
    them, and a later rule compares it with values the symbolic inference has since renamed. ``keep``: values
    already given the new shape of the value they replaced (``PendingShapes.resolve``'s aliases), as rules type
    a fused output. Where inference now says nothing, the shape it had stays (its dims are named apart from the new
    ones: ``demand._rename_unknown_dims``)."""
    for graph in [model.graph, *model.functions.values()]:
        opsets = {**model.opset_imports, **(graph.opset_imports if isinstance(graph, ir.Function) else {})}
        new = [n for n in every_node(graph) if n not in before]
        had = {v: v.shape for n in new for v in n.outputs}
        untyped = []
        for node in new:
            for value in node.outputs:
                if value not in keep:
                    value.shape = None
            if not _infer_node(node, opsets, model.ir_version):
                untyped.append(node)
        if untyped:
            _infer_contrib(untyped, opsets, model.ir_version)
        for value, shape in had.items():
            # as type_new_values writes them: a size no run can have stays unknown
            value.shape = shape if value.shape is None else _plausible(value.shape)


#: no real tensor has this many elements; a larger static shape comes from a declared dim nothing checks
_MAX_PLAUSIBLE_ELEMENTS = 1 << 40


def _plausible(shape: ir.Shape) -> ir.Shape:
    """The shape with sizes no run can have left unknown: 0 or a product past ``_MAX_PLAUSIBLE_ELEMENTS``, inferred
    from a declared input dim (``[batch, 0]``, ``[batch, 2**62]``). Written on lnfuse's values, ONNX Runtime's
    load-time inference would take them as fact and refuse the model (a Reshape's -1, a product overflow)."""
    dims = [None if d == 0 else d for d in shape]
    if math.prod(d for d in dims if isinstance(d, int)) > _MAX_PLAUSIBLE_ELEMENTS:
        dims = [d if not isinstance(d, int) or i == len(dims) - 1 else None for i, d in enumerate(dims)]
    return shape if dims == list(shape) else ir.Shape(dims)


def _untyped(value: ir.Value) -> bool:
    return bool(value.name) and (value.type is None or value.shape is None)


def _infer_node(node: ir.Node, opsets: dict[str, int], ir_version: int) -> bool:
    """Type the node's outputs with onnx's own inference for its op; False where onnx has no schema for it."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except onnx.defs.SchemaError:
        return False
    known = [v for v in node.inputs if v is not None and v.type is not None]
    types = {v.name: ir.serde.serialize_value(v).type for v in known}
    data = {}
    for v in known:  # small constants (axes, Reshape targets) decide output shapes
        if v.shape is not None and v.shape.is_static() and math.prod(v.shape.numpy()) <= 64 \
                and (array := static_value(v)) is not None:
            data[v.name] = onnx.numpy_helper.from_array(np.asarray(array), v.name)
    try:
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, ir.serde.serialize_node(node), types, data,
            opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()], ir_version=ir_version)
    except Exception:  # noqa: BLE001 - onnx raises several types; the value stays untyped and the test says so
        return True
    for value in node.outputs:
        _set_type(value, inferred.get(value.name))
    return True


def _infer_contrib(nodes: list[ir.Node], opsets: dict[str, int], ir_version: int) -> None:
    """ONNX Runtime's symbolic inference on a small graph of just these nodes, their inputs as typed inputs."""
    produced = {v for n in nodes for v in n.outputs}
    inputs = {v.name: v for n in nodes for v in n.inputs if v is not None and v not in produced}
    if any(v.type is None or v.shape is None for v in inputs.values()):
        return
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes], "lnfuse_types",
        [ir.serde.serialize_value(v) for v in inputs.values()],
        [onnx.helper.make_value_info(v.name, onnx.TypeProto()) for v in produced if v.name])
    probe = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    probe.ir_version = ir_version
    inferred, _ = infer_shapes(probe)
    found = {v.name: v.type for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for value in produced:
        if _untyped(value):
            _set_type(value, found.get(value.name))


def _set_type(value: ir.Value, type_proto: onnx.TypeProto | None) -> None:
    if type_proto is None or not type_proto.tensor_type.elem_type:
        return
    if value.type is None:
        value.type = ir.serde.deserialize_type_proto_for_type(type_proto)
    if value.shape is None and type_proto.tensor_type.HasField("shape"):
        value.shape = ir.serde.deserialize_type_proto_for_shape(type_proto)
