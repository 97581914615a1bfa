"""Decompose: the exact inverse of fusion, for runtimes without the fused kernels.

Every fused op lnfuse writes is replaced by its rule's onnxscript reference function, inlined and lowered to the
model's opset (axes as attributes before opset 18, CastLike as Cast). Each replacement is verified in ORT like a
fusion, and ``fuse(decompose(m))`` gives back the same fused ops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import onnx.inliner
import onnx_ir as ir

from lnfuse.load import io
from lnfuse.save import write
from lnfuse.index.constants import static_value
from lnfuse.index.scopes import all_names, nodes_of, op_counts, scopes
from lnfuse.index.new_values import type_new_values
from lnfuse.rewrite import apply, cleanup
from lnfuse.match.pattern import attr_value
from lnfuse.save.provenance import mark_decomposed
from lnfuse.report import DECOMPOSE, Fused, Report, Unfused
from lnfuse.match.rule import GraphContext, Refusal, Replacement, new_nodes
from lnfuse.rules import embed_norm, layer_norm, rms_norm, skip_norm
from lnfuse.verification.region import verify
from lnfuse.index.ops import is_op


@dataclass(frozen=True)
class _Inverse:
    #: the rule's reference (compiled on first call)
    function: Callable[[], object]
    #: the function's input for each of the op's inputs (None: the op input has no counterpart)
    inputs: tuple[str, ...]
    #: zero-valued stand-ins for optional inputs the node leaves out
    optional: frozenset[str]
    #: op output index -> function output index (None: an output the reference does not compute)
    outputs: tuple[int | None, ...]


_INVERSES: dict[tuple[str, str], _Inverse] = {
    ("", "LayerNormalization"): _Inverse(layer_norm.reference, ("X", "Scale", "B"), frozenset({"B"}), (0, 1, 2)),
    ("", "RMSNormalization"): _Inverse(rms_norm.reference, ("X", "Scale"), frozenset(), (0,)),
    ("", "SimplifiedLayerNormalization"): _Inverse(rms_norm.reference, ("X", "Scale"), frozenset(), (0, 1)),
    ("com.microsoft", "SkipLayerNormalization"): _Inverse(
        skip_norm.reference, ("input", "skip", "gamma", "beta", "bias"), frozenset({"beta", "bias"}),
        (0, 1, 2, 3)),
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): _Inverse(
        skip_norm.reference_simplified, ("input", "skip", "gamma", "bias"), frozenset({"bias"}), (0, None, 1, 2)),
}


def decompose(model: str | onnx.ModelProto, *, verify_rewrites: bool = True):
    """Replace every fused norm op by primitive ONNX ops; returns a ``FuseResult`` whose report lists them."""
    from lnfuse.api import FuseResult

    start = time.perf_counter()
    loaded = io.load(model)
    report = Report(source=str(loaded.path or "<model>"), target="onnx", verified=verify_rewrites)
    report.ops_before = op_counts(loaded.model)
    names = all_names(loaded.model)
    before = nodes_of(loaded.model)
    for scope in scopes(loaded.model):
        ctx = GraphContext(scope.graph, scope.opset, "onnx", scope.path, names)
        done = []
        position: dict[ir.Node, float] = {node: i for i, node in enumerate(scope.graph)}
        for node in list(scope.graph):
            inverse = _INVERSES.get((node.domain if node.domain != "ai.onnx" else "", node.op_type))
            if inverse is None:
                continue
            try:
                done.append((node, _replacement(node, inverse, ctx, loaded.model)))
            except Refusal as refusal:
                report.unfused.append(Unfused(DECOMPOSE, scope.path, f"{node.op_type} '{node.name}'",
                                              refusal.check, refusal.detail, [node.name]))
        outcomes = verify([rep for _, rep in done], {**loaded.model.opset_imports, "": scope.opset},
                          loaded.model.ir_version, position) if verify_rewrites else [None] * len(done)
        kept = []
        for (node, rep), outcome in zip(done, outcomes):
            if outcome is not None and not outcome.ok:
                report.unfused.append(Unfused(DECOMPOSE, scope.path, f"{node.op_type} '{node.name}'", "verify",
                                              outcome.detail, [node.name]))
                continue
            apply(scope.graph, rep, position, ctx.fresh_name)
            kept.append(rep)
            report.fused.append(Fused(DECOMPOSE, node.op_type, scope.path, [node.name], rep.attributes,
                                      None if outcome is None else outcome.max_error))
        if kept:
            cleanup(scope.graph, [])
    if "com.microsoft" in loaded.model.opset_imports and not any(
            n.domain == "com.microsoft" for n in ir.traversal.RecursiveGraphIterator(loaded.model.graph)):
        del loaded.model.opset_imports["com.microsoft"]
    report.ops_after = op_counts(loaded.model)
    write.strip_inferred_value_info(loaded.model, loaded.declared_value_info | type_new_values(loaded.model, before),
                                    loaded.claims)
    mark_decomposed(loaded.model, report, verify_rewrites)
    report.seconds = time.perf_counter() - start
    return FuseResult(loaded.model, report, loaded.has_external_data, loaded.path, loaded.source)


_EMBED = ("com.microsoft", "EmbedLayerNormalization")
_EMBED_INVERSES = {
    True: _Inverse(embed_norm.reference, ("input_ids", "segment_ids", "word_embedding", "position_embedding",
                                          "segment_embedding", "gamma", "beta", "position_ids"),
                   frozenset(), (0, None, 1)),
    False: _Inverse(embed_norm.reference_no_segment, ("input_ids", "word_embedding", "position_embedding", "gamma",
                                                      "beta", "position_ids"), frozenset(), (0, None, 1)),
}
_INVERSES[_EMBED] = _EMBED_INVERSES[True]


def _embed_replacement(node: ir.Node, ctx: GraphContext, model: ir.Model) -> Replacement:
    """EmbedLayerNormalization: ids are int32 (Gather takes them as they are); absent position ids are 0..S-1."""
    inputs = list(node.inputs) + [None] * (9 - len(node.inputs))
    ids, segment_ids, word, position, segment, gamma, beta, mask, position_ids = inputs
    if mask is not None:
        raise Refusal("inputs", "a mask input only changes mask_index, which has no reference here")
    if position_ids is None:
        shape = ctx.node("Shape", [ids], hint="lnfuse_positions")
        length = ctx.node("Gather", [shape.outputs[0], ctx.constant(np.array(1, np.int64), "seq_axis")],
                          {"axis": 0}, hint="lnfuse_positions")
        zero, one = ctx.constant(np.array(0, np.int64), "zero"), ctx.constant(np.array(1, np.int64), "one")
        arange = ctx.node("Range", [zero, length.outputs[0], one], hint="lnfuse_positions")
        if ctx.opset < 13:  # axes an attribute, as Unsqueeze had them before opset 13
            rows = ctx.node("Unsqueeze", [arange.outputs[0]], {"axes": [0]}, hint="lnfuse_positions")
        else:
            rows = ctx.node("Unsqueeze", [arange.outputs[0], ctx.constant(np.array([0], np.int64), "row_axis")],
                            hint="lnfuse_positions")
        position_ids = rows.outputs[0]
        for n, dims in ((shape, [2]), (length, []), (arange, [ids.shape[1]]), (rows, [1, ids.shape[1]])):
            n.outputs[0].type, n.outputs[0].shape = ir.TensorType(ir.DataType.INT64), ir.Shape(dims)
    with_segment = segment is not None
    inverse = _EMBED_INVERSES[with_segment]
    values = [ids, segment_ids, word, position, segment, gamma, beta, position_ids] if with_segment else \
        [ids, word, position, gamma, beta, position_ids]
    attrs = {"epsilon": float(attr_value(node, "epsilon", 1e-12))}
    nodes, outputs = _inline(inverse.function(), dict(zip(inverse.inputs, values)), attrs, ctx, model)
    mapping = {}
    for index, old in enumerate(node.outputs):
        if old.name and (old.uses() or old.is_graph_output()):
            if inverse.outputs[index] is None:
                raise Refusal("outputs", "mask_index is read; it has no reference here")
            mapping[old] = outputs[inverse.outputs[index]]
            mapping[old].type, mapping[old].shape = old.type, old.shape
    helpers = [v.producer() for v in [position_ids] if v.producer() is not None and v.producer().graph is None]
    return Replacement(op_type=node.op_type, domain=node.domain, nodes=_new_first(helpers, nodes),
                       outputs=mapping, region=[node], attributes=attrs)


_FLOAT_TYPES = {t.value for t in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16)}


def _new_first(helpers: list[ir.Node], nodes: list[ir.Node]) -> list[ir.Node]:
    return new_nodes([h.outputs[0] for h in helpers]) + nodes


def _replacement(node: ir.Node, inverse: _Inverse, ctx: GraphContext, model: ir.Model) -> Replacement:
    if (node.domain, node.op_type) == _EMBED:
        return _embed_replacement(node, ctx, model)
    x = node.inputs[0]
    if x is None or x.shape is None or x.type is None:
        raise Refusal("shape", f"the type or rank of '{x.name if x else '?'}' is unknown")
    if node.domain == "com.microsoft" and len(node.inputs) > 1 and node.inputs[1] is not None:
        _share_last_two_dims(x, node.inputs[1])
    rank = len(x.shape)
    attrs = {"epsilon": float(attr_value(node, "epsilon", 1e-12 if node.domain == "com.microsoft" else 1e-5))}
    if node.domain != "com.microsoft":
        axis = int(attr_value(node, "axis", -1))
        attrs["axis"] = axis - rank if axis >= 0 else axis
        attrs["stash_type"] = int(attr_value(node, "stash_type", 1))
        if attrs["stash_type"] not in _FLOAT_TYPES:
            raise Refusal("stash_type", f"stash_type {attrs['stash_type']} is not a float type; the reference "
                          "cannot compute in it")
    if any(v is not None and v.dtype != x.dtype for v in node.inputs[1:]):
        raise Refusal("dtype", "inputs of different dtypes: the reference keeps one dtype")
    actual = {}
    for formal, value in zip(inverse.inputs, list(node.inputs) + [None] * len(inverse.inputs)):
        if value is None:
            if formal not in inverse.optional:
                raise Refusal("inputs", f"input '{formal}' is missing")
            hidden = x.shape[-1]
            if not isinstance(hidden, int):
                raise Refusal("shape", "the hidden size is unknown")
            value = ctx.constant(np.zeros([hidden], dtype=x.dtype.numpy()), f"lnfuse_zero_{formal}")
        actual[formal] = value
    nodes, outputs = _inline(inverse.function(), actual, attrs, ctx, model)
    mapping = {}
    for index, old in enumerate(node.outputs):
        if old.name and (old.uses() or old.is_graph_output()):
            if index >= len(inverse.outputs) or inverse.outputs[index] is None:
                raise Refusal("outputs", f"output {index} of {node.op_type} is read and has no reference")
            mapping[old] = outputs[inverse.outputs[index]]
            mapping[old].type, mapping[old].shape = old.type, old.shape
    return Replacement(op_type=node.op_type, domain=node.domain, nodes=nodes, outputs=mapping, region=[node],
                       attributes=attrs)


def _share_last_two_dims(x: ir.Value, skip: ir.Value) -> None:
    """The Skip kernels run only when input and skip agree in their last two dims, so where one of them knows a
    size the other writes symbolically (``floor(height/8)*floor(width/8) + 1`` against 17), that is the size:
    verification would otherwise draw independent sizes for the two and the kernel would refuse them."""
    if x.shape is None or skip.shape is None or min(len(x.shape), len(skip.shape)) < 2:
        return
    a, b = list(x.shape), list(skip.shape)
    for i in (-2, -1):
        if isinstance(b[i], int) and not isinstance(a[i], int):
            a[i] = b[i]
        elif isinstance(a[i], int) and not isinstance(b[i], int):
            b[i] = a[i]
    x.shape, skip.shape = ir.Shape(a), ir.Shape(b)


def _inline(function, actual: dict[str, ir.Value], attrs: dict, ctx: GraphContext,
            model: ir.Model) -> tuple[list[ir.Node], list[ir.Value]]:
    """The function's body for these inputs, inlined, lowered to the graph's opset, as new (unplaced) nodes."""
    proto = function.to_function_proto()
    call = onnx.helper.make_node(proto.name, list(actual), [f"out{i}" for i in range(len(proto.output))],
                                 domain=proto.domain, **attrs)
    inputs = [ir.serde.serialize_value(v, name=name) for name, v in actual.items()]
    graph = onnx.helper.make_graph([call], "inverse", inputs,
                                   [onnx.helper.make_value_info(f"out{i}", onnx.TypeProto())
                                    for i in range(len(proto.output))])
    # the inliner only inlines a function whose opset matches the model's: inline at the function's own opset
    # (every op the references use means the same from 18 to the newest opset), then lower for older models
    function_opset = next(o.version for o in proto.opset_import if o.domain == "")
    small = onnx.helper.make_model(graph, functions=[proto], opset_imports=[
        onnx.helper.make_opsetid("", function_opset), onnx.helper.make_opsetid(proto.domain, 1)])
    small.ir_version = 10
    inlined = onnx.shape_inference.infer_shapes(onnx.inliner.inline_local_functions(small))
    body = ir.serde.deserialize_model(inlined).graph
    _lower(body, ctx.opset)
    formal = {v.name: actual[v.name] for v in body.inputs}
    results = list(body.outputs)
    body.outputs.clear()
    nodes = list(body)
    body.remove(nodes, safe=False)
    for node in nodes:
        for i, value in enumerate(node.inputs):
            if value is not None and value.name in formal and value.producer() is None:
                node.replace_input_with(i, formal[value.name])
        node.name = ctx.fresh_name(f"lnfuse_decomposed/{node.op_type}")
        for out in node.outputs:
            out.name = ctx.fresh_name(f"lnfuse_decomposed/{out.name}")
    return nodes, [formal.get(v.name, v) if v.producer() is None else v for v in results]


def _lower(body: ir.Graph, opset: int) -> None:
    """Spell the body in the graph's opset: CastLike as Cast (<15 has no CastLike), axes as attributes (<18),
    and drop the additions of the zeros that stood in for absent optional inputs."""
    for node in list(body):
        if is_op(node, "Add"):
            _drop_zero_add(body, node)
            continue
        if is_op(node, "Constant") and "value" not in node.attributes:
            # value_float/value_ints: valid, but some tools (ORT's symbolic shape inference) read only ``value``
            tensor = ir.convenience.get_const_tensor(node.outputs[0])
            node.attributes.clear()
            node.attributes["value"] = ir.AttrTensor("value", tensor)
        if is_op(node, "Range") and all(static_value(v) is not None for v in node.inputs):
            # the references compute axes as Range(axis, 0, 1); onnx's inference reads axes only from a constant
            start, limit, delta = (static_value(v) for v in node.inputs)
            node.op_type = "Constant"
            node.resize_inputs(0)
            node.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.arange(start, limit, delta)))
            continue
        if is_op(node, "CastLike"):
            target = node.inputs[1].dtype
            node.resize_inputs(1)
            node.op_type = "Cast"
            node.attributes["to"] = ir.AttrInt64("to", target.value)
        elif is_op(node, "ReduceMean") and opset < 18 and len(node.inputs) > 1:
            axes = static_value(node.inputs[1])
            node.resize_inputs(1)
            node.attributes["axes"] = ir.AttrInt64s("axes", [int(a) for a in axes.reshape(-1)])
    for node in reversed(list(body)):
        if not any(o.uses() or o.is_graph_output() for o in node.outputs):
            body.remove(node, safe=True)


def _drop_zero_add(body: ir.Graph, node: ir.Node) -> None:
    out = node.outputs[0]
    for zero, other in ((node.inputs[1], node.inputs[0]), (node.inputs[0], node.inputs[1])):
        array = static_value(zero)
        if array is None or array.any() or other.shape is None or out.shape is None or \
                list(other.shape) != list(out.shape):
            continue
        for i, value in enumerate(body.outputs):
            if value is out:
                body.outputs[i] = other
        out.replace_all_uses_with(other)
        body.remove(node, safe=True)
        return
