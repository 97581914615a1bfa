"""``--quantize-embeddings``: turn float EmbedLayerNormalization nodes into QEmbedLayerNormalization.

This is the one rewrite that changes numbers on purpose, so it runs only when asked, after fusion, and the report
says how far the quantized model is from the float one on random valid ids. Tables, gamma and beta are quantized
per tensor: uint8 asymmetric (zero point anywhere in 0..255) or int8 symmetric (zero point 0), dequantized by the
kernel as ``(q - zero_point) * scale``. A tensor a quantizer already quantized per tensor (the embedding rule hands
over a block whose tables ``quantize_dynamic`` or a QDQ recipe quantized) keeps its numbers: only the float ones are
quantized, and all are stored in one type, the kernel's constraint, by an exact re-encoding where needed. Nodes with position ids or an embedding_sum output are left as they are:
QEmbedLayerNormalization has neither (ONNX Runtime's own quantizer silently drops position_ids).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from lnfuse.index.constants import static_value
from lnfuse.save.provenance import mark_fused
from lnfuse.report import Fused, Report, Unfused
from lnfuse.match.rule import GraphContext
from lnfuse.verification.whole_model import compare_models, random_inputs
from lnfuse.index.ops import ORT_DOMAIN, is_op, op_key
from lnfuse.index.quantized_tensors import as_stored, per_tensor, reencoded, scalable

SCHEMES = ("uint8", "int8")


def quantize_embeddings(model: ir.Model, scheme: str, names: set[str], report: Report) -> int:
    """Rewrite every eligible EmbedLayerNormalization of the main graph; returns how many were rewritten."""
    graph = model.graph
    ctx = GraphContext(graph, model.opset_imports.get("", 1), "ort", "main", names)
    done = 0
    for node in [n for n in graph if is_op(n, "EmbedLayerNormalization", domain="com.microsoft")]:
        reason = _ineligible(node)
        if reason:
            report.unfused.append(Unfused("quantize_embeddings", "main", f"EmbedLayerNormalization '{node.name}'",
                                          "quantize", reason, [node.name]))
            continue
        inputs = list(node.inputs) + [None] * (9 - len(node.inputs))
        ids, seg_ids, word, pos, seg, gamma, beta, mask = inputs[:8]
        values = (word, pos, seg, gamma, beta)
        # a tensor a quantizer already quantized per tensor keeps its numbers, whatever the scheme
        kept = [_per_tensor(v) if v is not None else None for v in values]
        parts = _one_type(ctx, [k or (_quantize(ctx, v, scheme) if v is not None else None)
                                for k, v in zip(kept, values)], _stored_type(kept, scheme))
        qinputs = [ids, seg_ids] + [p[0] if p else None for p in parts] + [mask] + \
            [p[1] if p else None for p in parts] + [p[2] if p else None for p in parts]
        epsilon = node.attributes["epsilon"].value if "epsilon" in node.attributes else 1e-12
        fused = ctx.node("QEmbedLayerNormalization", qinputs, {"epsilon": epsilon}, domain="com.microsoft",
                         num_outputs=2, hint=node.name)
        for value in qinputs:
            if value is not None and value.const_value is not None and value.graph is None:
                graph.register_initializer(value)
        old_out = node.outputs[0]
        fused.outputs[0].type, fused.outputs[0].shape = old_out.type, old_out.shape
        # mask_index: one int32 per sequence (the kernel's contract), typed like every value lnfuse writes
        fused.outputs[1].type = ir.TensorType(ir.DataType.INT32)
        fused.outputs[1].shape = ir.Shape([ids.shape[0]]) if ids.shape is not None else None
        if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
            node.outputs[1].replace_all_uses_with(fused.outputs[1], replace_graph_outputs=True)
        graph.insert_after(node, [fused])
        name = old_out.name
        old_out.replace_all_uses_with(fused.outputs[0], replace_graph_outputs=True)
        # the tables the node read dequantized whole: unread now (the new node reads what they dequantized)
        unread = [v.producer() for v in inputs[2:7] if v is not None and v.producer() is not None]
        graph.remove(node, safe=True)
        for producer in dict.fromkeys(unread):
            if is_op(producer, "DequantizeLinear") and not any(o.uses() or o.is_graph_output()
                                                                for o in producer.outputs):
                graph.remove(producer, safe=True)
        fused.outputs[0].name = name
        record = Fused("quantize_embeddings", "QEmbedLayerNormalization", "main", [node.name],
                       {"epsilon": epsilon, "scheme": scheme}, None)
        report.fused.append(record)
        mark_fused([fused], [node], record)
        done += 1
    for name, value in list(graph.initializers.items()):
        if not value.uses() and not value.is_graph_input() and not value.is_graph_output():
            del graph.initializers[name]
    return done


def _ineligible(node: ir.Node) -> str:
    inputs = list(node.inputs) + [None] * (9 - len(node.inputs))
    if inputs[8] is not None:
        return "it uses position_ids, which QEmbedLayerNormalization does not take"
    if len(node.outputs) > 2 and node.outputs[2].name and (node.outputs[2].uses() or node.outputs[2].is_graph_output()):
        return "its embedding_sum output is read, which QEmbedLayerNormalization does not produce"
    if node.outputs[0].dtype != ir.DataType.FLOAT:
        return f"it computes in {node.outputs[0].dtype}; QEmbedLayerNormalization has a float32 kernel only"
    if any(v is not None and static_value(v) is None and _per_tensor(v) is None for v in inputs[2:7]):
        return "its tables, gamma or beta are not constants"
    # a NaN or infinite entry has no scale: the range would be NaN (uint8 crashed taking its zero point) and int8
    # would make every dequantized entry NaN, where the float model is NaN only where that row is read
    for value in inputs[2:7]:
        array = static_value(value) if value is not None and _per_tensor(value) is None else None
        if array is not None and not scalable(array):
            return f"'{value.name}' holds NaN or infinite values, which no per-tensor scale represents"
    return ""


def _per_tensor(value: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """(q, scale, zero_point) when ``value`` is a per-tensor dequantization of a stored int8/uint8 tensor (a table
    quantize_dynamic quantized), else None."""
    part = per_tensor(value)
    return (part.tensor, part.scale, part.zero_point) if part is not None and as_stored(part) else None


def _quantize(ctx: GraphContext, value: ir.Value, scheme: str) -> tuple[ir.Value, ir.Value, ir.Value]:
    data = static_value(value).astype(np.float32)
    if scheme == "int8":
        scale = float(np.abs(data).max()) / 127 or 1.0
        zero = 0
        q = np.clip(np.round(data / scale), -127, 127).astype(np.int8)
        zp = np.array(zero, dtype=np.int8)
    else:
        lo, hi = min(float(data.min()), 0.0), max(float(data.max()), 0.0)
        scale = (hi - lo) / 255 or 1.0
        zero = int(np.clip(round(-lo / scale), 0, 255))
        q = np.clip(np.round(data / scale) + zero, 0, 255).astype(np.uint8)
        zp = np.array(zero, dtype=np.uint8)
    return (ctx.constant(q, f"{value.name}_quant"), ctx.constant(np.array(scale, np.float32), f"{value.name}_scale"),
            ctx.constant(zp, f"{value.name}_zero_point"))


def _stored_type(kept: list, scheme: str) -> ir.DataType:
    """The one type the kernel takes its quantized tensors in: that of the tensors a quantizer wrote (the word
    table's first: the largest keeps its bytes), else the scheme's."""
    written = [k[0].dtype for k in kept if k is not None]
    return written[0] if written else (ir.DataType.INT8 if scheme == "int8" else ir.DataType.UINT8)


def _one_type(ctx: GraphContext, parts: list, wanted: ir.DataType) -> list:
    """Every part in the type ``wanted``: a part in the other type is re-encoded exactly (int8 q with zero point z
    is uint8 q + 128 with zero point z + 128, the same (q - z) * scale)."""
    out = []
    for part in parts:
        if part is None or part[0].dtype == wanted:
            out.append(part)
            continue
        q, scale, zero = part
        q_new, zero_new = (reencoded(static_value(v), wanted) for v in (q, zero))
        out.append((ctx.constant(q_new, f"{q.name}_{wanted.name.lower()}"), scale,
                    ctx.constant(zero_new, f"{zero.name}_{wanted.name.lower()}")))
    return out


def accuracy(float_model: onnx.ModelProto, quantized: onnx.ModelProto) -> dict:
    """Worst difference between the float and the quantized model on random ids valid for every table."""
    return compare_models(float_model, quantized, _valid_ids(float_model))


def _valid_ids(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    feeds = random_inputs(model, seed=7)
    rows = {t.name: t.dims[0] for t in model.graph.initializer if len(t.dims) == 2}
    producers = {o: n for n in model.graph.node for o in n.output}
    for output, node in producers.items():
        # a table dequantized per tensor has the rows of the quantized table it reads
        if is_op(node, "DequantizeLinear") and node.input[0] in rows:
            rows[output] = rows[node.input[0]]
    rng = np.random.default_rng(7)
    for node in model.graph.node:
        tables = {("", "Gather"): [(0, 1)], (ORT_DOMAIN, "EmbedLayerNormalization"): [(2, 0), (4, 1), (3, 8)]}.get(
            op_key(node), [])
        for table_index, ids_index in tables:
            if len(node.input) <= max(table_index, ids_index) or not node.input[ids_index]:
                continue
            ids = node.input[ids_index]
            while ids in producers and is_op(producers[ids], "Cast"):
                ids = producers[ids].input[0]
            bound = rows.get(node.input[table_index])
            if ids in feeds and bound and np.issubdtype(feeds[ids].dtype, np.integer):
                feeds[ids] = rng.integers(0, bound, size=feeds[ids].shape).astype(feeds[ids].dtype)
    return feeds
