"""Embedding lookups whose ids nothing proves one shape, fed to EmbedLayerNormalization as the Add broadcasts them.

keras-hub's BERT exported by tf2onnx reads token ids and segment ids from two graph inputs whose dims tf2onnx names
apart, and slices its position table to the token ids' length: the embedding sum is the broadcast of
``word[ids_a]`` ([Ba, Sa, H]), ``segment[ids_b]`` ([Bb, Sb, H]) and ``Expand(table[0:n], T)`` ([n, H] spread to the
shape T). The kernel wants one [B, S] shape for its ids and positions, so each is expanded to ``common``, the
broadcast of ``shape(ids_a)``, ``shape(ids_b)``, ``[1, n]`` and ``T[:2]``, and the positions are given as ids,
``Expand([0..n-1], common)``. Where the original runs (every dim equal or 1), this is the same sum exactly: each
term is its own lookup repeated along the axes the Add repeats it. Where it does not, an Expand fails as the Add
would. Row 0, step 1 and whole rows of the Slice are proved by the rule; n is the Slice's own length, min(end, rows).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from lnfuse.index.ops import is_op
from lnfuse.match.pattern import Match
from lnfuse.match.rule import GraphContext, Refusal
from ._common import dtype_of, node_name

_INT64 = ir.DataType.INT64


def _typed(node: ir.Node, dtype: ir.DataType) -> ir.Value:
    node.outputs[0].type = ir.TensorType(dtype)
    return node.outputs[0]


def broadcast_inputs(ctx: GraphContext, m: Match, i: int, axis0: int, ids: list[ir.Value]) -> tuple[list, ir.Value]:
    """(each of ``ids`` expanded to the common shape, the position ids 0..n-1 expanded to it) for the sliced term
    ``i`` whose Slice lists axis 0 at ``axis0`` of its ends."""
    if ctx.opset < 13:
        raise Refusal("opset", f"expanding the ids to their broadcast needs Unsqueeze with axes as "
                      f"an input (opset 13), and the model has opset {ctx.opset}")
    node, table = m.node(f"slice{i}"), m.value(f"table{i}")
    views = [v for v in m.fact(f"views{i}", ()) if not is_op(v, "Identity")]
    if len(views) > 1 or (views and not is_op(views[0], "Expand")):
        raise Refusal("lookup", f"the rows of Slice '{node_name(node)}' reach the sum through "
                      f"{', '.join(v.op_type for v in views)}: only an Expand is followed when the ids are broadcast")

    def make(op: str, inputs: list, dtype: ir.DataType, **attrs) -> ir.Value:
        return _typed(ctx.node(op, inputs, attrs, hint="lnfuse_broadcast_ids"), dtype)

    def const(values) -> ir.Value:
        return ctx.constant(np.array(values, dtype=np.int64), "lnfuse_broadcast_ids")

    end = make("Cast", [make("Gather", [node.inputs[2], const([axis0])], dtype_of(node.inputs[2]))], _INT64,
               to=_INT64.value)
    rows = int(table.shape[0])
    # how many rows the Slice keeps from row 0, as Slice reads its end: a negative end counts from the last row
    counted = make("Max", [make("Add", [end, const([rows])], _INT64), const([0])], _INT64)
    n = make("Where", [make("Less", [end, const([0])], ir.DataType.BOOL), counted,
                       make("Min", [end, const([rows])], _INT64)], _INT64)
    shapes = [make("Shape", [v], _INT64) for v in ids] + [make("Concat", [const([1]), n], _INT64, axis=0)]
    if views:
        target = views[0].inputs[1]
        if target.shape is None or list(target.shape) != [3]:
            raise Refusal("lookup", f"Expand '{node_name(views[0])}' of the position rows is not to a 3-D shape")
        wide = make("Cast", [target], _INT64, to=_INT64.value)
        shapes.append(make("Slice", [wide, const([0]), const([2])], _INT64))
    # the broadcast of the shapes, folded: a 1 takes the other's dim. Not their Max: an empty batch (0) broadcast
    # with 1 is 0, where Max gave 1 and the kernel got ids of batch 0 and segment ids of batch 1 (red team, round
    # 9). Where the shapes do not broadcast, the dim kept is one of them and an Expand to it fails, as the Add does
    common = shapes[0]
    for shape in shapes[1:]:
        common = make("Where", [make("Equal", [common, const([1])], ir.DataType.BOOL), shape, common], _INT64)
    expanded = [make("Expand", [v, common], dtype_of(v)) for v in ids]
    positions = make("Range", [const(0), make("Squeeze", [n, const([0])], _INT64), const(1)], _INT64)
    row = make("Unsqueeze", [positions, const([0])], _INT64)
    return expanded, make("Expand", [row, common], _INT64)
