"""Embedding lookups + sum + LayerNorm as one com.microsoft kernel (``--target ort`` only).

EmbedLayerNormalization computes ``LayerNorm(word[ids] + position[position_ids] + segment[segment_ids])``;
without ``position_ids`` the kernel uses 0..S-1. QEmbedLayerNormalization does the same from per-tensor quantized
tables, gamma and beta (``(q - zero_point) * scale``), and has no ``position_ids`` input. Tables a quantizer made
8-bit (``Gather(q) -> DequantizeLinear`` or ``DequantizeLinear(q) -> Gather``) go to QEmbedLayerNormalization as
they are, or the block is left to the norm rules: never to the float kernel through a DequantizeLinear of the whole
table, which ONNX Runtime does not fold at load (``_quantized_tables``).

Which lookup is which is decided by meaning, not by names: the word lookup is indexed by a [B, S] id tensor; the
position lookup is the one whose indices are provably 0..S-1 (a constant, a Slice of an arange buffer, a Range),
else one indexed by a (1, S) or (B, S) tensor, passed as ``position_ids`` (the kernel honours any values).
Embedding tables are never read: only their shapes and dtypes matter.

A lookup may reach the sum through views that leave its rows as they are, each proved from shapes and constants
(``_unviewed``): MindSpore looks up the flattened ids and reshapes back, ``Reshape(Gather(table, Reshape(ids, [-1])),
ids.shape + [hidden])``, which is ``Gather(table, ids)``; vmap (jax2onnx) adds unit axes and an Expand the Add would
do anyway (``Expand(Reshape(Gather(table, arange), [1, S, H]), [1, S, H])``). A view that moves rows (a Transpose of
non-unit axes, a Reshape to another shape than the lookup's own up to leading unit axes) is refused with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from lnfuse.index.constants import is_static, static_value
from lnfuse.match.pattern import Either, Match, Op, Pattern, Var, attr_value, noop_outputs, through_noops
from lnfuse.match.rule import ABSENT, GraphContext, Refusal, Replacement, Rule, new_nodes
from lnfuse.index.ops import is_op, onnx_op
from lnfuse.index.quantized_tensors import PerTensor, as_stored, per_tensor, reencoded, scalable
from ._broadcast_ids import broadcast_inputs
from ._common import dtype_of, kernel_epsilon, node_name, read_outside, same_dim

_INDEX_TYPES = (ir.DataType.INT32, ir.DataType.INT64)
_KERNEL_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


@functools.cache
def reference():
    """EmbedLayerNormalization with every input given: (output, embedding_sum).
    Compiled by onnxscript on first use: decompose and the tests need it, fusing does not."""
    from onnxscript import script
    from onnxscript import opset18 as op

    @script(default_opset=op)
    def embed_layer_normalization(input_ids, segment_ids, word_embedding, position_embedding, segment_embedding,
                                  gamma, beta, position_ids, epsilon: float = 1e-12):
        s = op.Add(op.Add(op.Gather(word_embedding, input_ids), op.Gather(position_embedding, position_ids)),
                   op.Gather(segment_embedding, segment_ids))
        axes = op.Constant(value_ints=[-1])
        mean = op.ReduceMean(s, axes)
        d = op.Sub(s, mean)
        var = op.ReduceMean(op.Mul(d, d), axes)
        eps = op.CastLike(op.Constant(value_float=epsilon), var)
        return op.Add(op.Mul(op.Div(d, op.Sqrt(op.Add(var, eps))), gamma), beta), s

    return embed_layer_normalization


@functools.cache
def reference_no_segment():
    """EmbedLayerNormalization without segment embeddings (GPT-2, DistilBERT): (output, embedding_sum).
    Compiled by onnxscript on first use: decompose and the tests need it, fusing does not."""
    from onnxscript import script
    from onnxscript import opset18 as op

    @script(default_opset=op)
    def embed_layer_normalization_no_segment(input_ids, word_embedding, position_embedding, gamma, beta,
                                             position_ids, epsilon: float = 1e-12):
        s = op.Add(op.Gather(word_embedding, input_ids), op.Gather(position_embedding, position_ids))
        axes = op.Constant(value_ints=[-1])
        mean = op.ReduceMean(s, axes)
        d = op.Sub(s, mean)
        var = op.ReduceMean(op.Mul(d, d), axes)
        eps = op.CastLike(op.Constant(value_float=epsilon), var)
        return op.Add(op.Mul(op.Div(d, op.Sqrt(op.Add(var, eps))), gamma), beta), s

    return embed_layer_normalization_no_segment


#: ops that only lay a lookup's rows out anew; which of them leave the rows as they are is proved by ``_unviewed``
_VIEW_OPS = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Expand", "Identity"})
#: how many views one lookup is seen through: exporters write one to three
_MAX_VIEWS = 6


class _Viewed(Pattern):
    """``inner`` at the value, or under a chain of view ops in front of it (farthest first). The chain's nodes join
    the match and are bound, innermost first, as the fact ``fact``: the matcher only finds them, the rule proves
    (``_unviewed``) that they leave the lookup's rows as they are, and refuses with the reason otherwise."""

    def __init__(self, inner: Pattern, fact: str):
        self.inner = inner
        self.fact = fact
        self.name = None

    def root_ops(self) -> frozenset[str] | None:
        inner = self.inner.root_ops()
        return None if inner is None else inner | _VIEW_OPS

    def _match(self, value, m):
        chain: list[ir.Node] = []  # outermost first
        under = value
        while len(chain) < _MAX_VIEWS and under is not None:
            node = under.producer()
            if node is None or onnx_op(node) not in _VIEW_OPS or \
                    node.outputs[0] is not under or not node.inputs or node.inputs[0] is None:
                break
            chain.append(node)
            under = node.inputs[0]
        for k in range(len(chain), -1, -1):  # the value under the k outermost views
            views = tuple(reversed(chain[:k]))
            bound = m.with_fact(self.fact, views)
            for node in views:
                bound = bound.add_node(node, None)
            yield from self.inner.match(chain[k - 1].inputs[0] if k else value, bound)


def _lookup(i: int) -> Pattern:
    # the ids as the Gather reads them (HF's view(input_ids) is already [B, S]); else, when the rule proves the rows
    # reach the sum in their shape, the ids before a Reshape: MindSpore looks up Reshape(ids, [-1]) and reshapes back
    ids = Either(Var(f"ids{i}"), Op("Reshape", Var(f"ids{i}"), Var(f"flat{i}"), name=f"reshaped_ids{i}"))
    gather = Op("Gather", Var(f"table{i}"), ids, name=f"gather{i}")
    # Keras' PositionEmbedding: table[:S] broadcast over the batch, no ids at all (``_sliced_positions`` proves it)
    sliced = Op("Slice", Var(f"table{i}"), name=f"slice{i}", extra_inputs=True)
    # quantize_dynamic's lookup: the rows of an int8/uint8 table, dequantized after the Gather
    return _Viewed(Either(Op("DequantizeLinear", gather, Var(f"scale{i}"), Var(f"zero{i}"), name=f"dq{i}"), gather,
                          sliced), f"views{i}")


def _stored_constant(value: ir.Value) -> bool:
    """An initializer or a Constant node: a term already folded, not a lookup of constant ids (whose table the rule
    would have to read)."""
    producer = value.producer()
    return is_static(value) and (producer is None or is_op(producer, "Constant"))


def _term(i: int) -> Either:
    # a static-shape export folds the position lookup of 0..S-1 into a constant [1, S, H] (or [S, H]) term, which
    # tf2onnx broadcasts over the batch as Keras' PositionEmbedding does
    return Either(_lookup(i), _Viewed(Var(f"folded{i}", _stored_constant), f"views{i}"))


_SUM = Either(
    Op("Add", Op("Add", _term(0), _term(1), name="add_inner"), _term(2), name="add"),
    Op("Add", _term(0), _term(1), name="add"),
)
_INNER = Op("Add", _term(0), _term(1), name="add_inner")


def _skip_norm(first, second) -> Op:
    """ONNX Runtime's SkipLayerNormalization already written over the lookups (ORT's GPT-2 embedding test graph):
    input + skip is the embedding sum; its own sum output (index 3) is the sum's value."""
    return Op("SkipLayerNormalization", first, second, Var("gamma"), name="norm", domain="com.microsoft",
              extra_inputs=True)


@dataclass
class _Lookup:
    gather: ir.Node | None  # None for a position term folded to a constant
    table: ir.Value
    ids: ir.Value
    kind: str  # "arange" (0..S-1), "row" ((1,S) ids), "full" ((B,S) ids), or "" (none of these)
    #: the int8/uint8 table, its scale and zero point, when the lookup reads a table quantized per tensor
    quantized: PerTensor | None = None
    #: the dequantization after the Gather (quantize_dynamic's order); None when it is in front of it (QDQ's)
    dq: ir.Node | None = None
    nodes: tuple[ir.Node, ...] = ()  # the lookup's own nodes: Reshape of the ids, Gather, dequantization, views


class EmbedNorm(Rule):
    name = "embed_norm"
    anchors = frozenset({"LayerNormalization", "SkipLayerNormalization"})
    refines = True
    targets = frozenset({"ort"})
    reports_fallback = True  # a refused block still becomes a Skip op: the user needs to know why it is not more
    # no-ops between the sum and the norm (paddle2onnx's Identity, an inference Dropout) are read through
    patterns = (Op("LayerNormalization", through_noops(_SUM), Var("gamma"), name="norm", extra_inputs=True),
                _skip_norm(_INNER, _term(2)), _skip_norm(_term(2), _INNER), _skip_norm(_term(0), _term(1)))

    def build(self, m: Match, ctx: GraphContext) -> Replacement:
        norm = m.node("norm")
        # s: the embedding sum, or (a Skip op's sum) its output; read: the sum's value if the graph has one
        s, read, (gamma, beta, epsilon) = _sum_and_norm(m, norm)
        if any(read_outside(v, m.nodes) for v in norm.outputs[1:3] if v.name):
            raise Refusal("outputs", f"the Mean/InvStdDev of '{node_name(norm)}' are read; the kernel has none")
        if s.shape is None or len(s.shape) != 3 or attr_value(norm, "axis", -1) not in (-1, 2):
            raise Refusal("shape", f"the embedding sum '{s.name}' must be 3-D and normalized over its last axis")
        if attr_value(norm, "stash_type", 1) != 1:
            raise Refusal("dtype", "the kernel computes the statistics in float32 (stash_type=1)")
        dtype, hidden = dtype_of(s), s.shape[-1]
        if dtype not in _KERNEL_DTYPES or not isinstance(hidden, int):
            raise Refusal("dtype", f"the kernel takes float32/float16 with a known hidden size, not {dtype} "
                          f"[..., {hidden}]")
        lookups = [_classify(m, i, ctx, s) for i in range(3) if m.node(f"gather{i}") is not None]
        sliced = [i for i in range(3) if m.node(f"slice{i}") is not None]
        if _unrelated_ids(lookups) and len(sliced) == 1:
            # keras-hub's BERT through tf2onnx: token and segment ids of unrelated dims, positions sliced
            lookups = _broadcast_lookups(ctx, m, sliced[0], lookups, s)
        else:
            _check_some_full(lookups, s)
            folded = [i for i in range(3) if m.value(f"folded{i}") is not None]
            if len(folded) > 1:
                raise Refusal("terms", "the embedding sum has more than one constant term")
            lookups += [_folded_positions(ctx, m, i, s) for i in folded]
            lookups += [_sliced_positions(m, i, s) for i in sliced]
        word, position, segment = _roles(lookups)
        for lookup in lookups:
            _check_table(lookup, hidden, dtype)
        # read before ``beta`` may become a made zero vector: whether gamma and beta come quantized too
        gamma_beta = _dequantized([gamma, beta])
        gamma = _vector(gamma, hidden, dtype, "gamma")
        beta = _vector(beta, hidden, dtype, "beta") if beta is not None else \
            ctx.constant(np.zeros(hidden, dtype=dtype.numpy()), "lnfuse_zero_beta")
        tables = [word, position] + ([segment] if segment else [])
        read_sums = [v for v in _sum_values(read, norm) if read_outside(v, m.nodes)]
        quantized, notes = _quantized_tables(ctx, tables, (gamma, beta, gamma_beta), read_sums, dtype) \
            if any(lk.quantized for lk in tables) else (None, [])
        if quantized is not None:
            fused = ctx.node("QEmbedLayerNormalization", _qembed_inputs(ctx, word, segment, quantized),
                             {"epsilon": epsilon}, domain="com.microsoft", num_outputs=2, hint=node_name(norm))
            op_type = "QEmbedLayerNormalization"
        else:
            inputs = [_int32(ctx, word.ids), _int32(ctx, segment.ids) if segment else None,
                      *(_float_table(ctx, lk) if lk else None for lk in (word, position, segment)), gamma, beta, None,
                      None if position.kind == "arange" else _int32(ctx, position.ids)]
            while inputs[-1] is None:
                inputs.pop()
            fused = ctx.node("EmbedLayerNormalization", inputs, {"epsilon": epsilon, "mask_index_type": 0},
                             domain="com.microsoft", num_outputs=3, hint=node_name(norm))
            op_type = "EmbedLayerNormalization"
        outputs = {norm.outputs[0]: fused.outputs[0]}
        # the sum's value, and the outputs of no-ops read through that hold it, wherever something else reads them
        if op_type == "EmbedLayerNormalization":
            fused.outputs[1].meta[ABSENT] = True
            if read_sums:
                outputs.update((v, fused.outputs[2]) for v in read_sums)
            else:
                fused.resize_outputs(1)
        elif read_sums:
            raise Refusal("outputs", "the embedding sum is read elsewhere and QEmbedLayerNormalization has no "
                          "embedding_sum output")
        for old, new in reversed(outputs.items()):  # the sum itself last: its type is the one kept
            new.type, new.shape = old.type, old.shape
        return Replacement(op_type=op_type, domain="com.microsoft", nodes=new_nodes([fused.outputs[0]]),
                           outputs=outputs,
                           region=_region(m, lookups), attributes={"epsilon": epsilon},
                           opset_imports={"com.microsoft": 1}, notes=notes)


def _sum_and_norm(m: Match, norm: ir.Node) -> tuple[ir.Value, ir.Value | None, tuple]:
    """The embedding sum (a value of its shape and type), the value holding it if any, and (gamma, beta, epsilon)
    of the norm: LayerNormalization(sum, gamma, beta), or SkipLayerNormalization(a, b, gamma, beta) with no bias
    (a bias would be one more term the kernel does not add), whose defaults are the contrib op's."""
    inputs = list(norm.inputs) + [None] * 5
    if is_op(norm, "LayerNormalization"):
        return m.value("add"), m.value("add"), (inputs[1], inputs[2], kernel_epsilon(norm, 1e-5))
    if inputs[4] is not None:
        raise Refusal("bias", f"'{node_name(norm)}' adds a bias to the embedding sum; the kernel adds none")
    total = norm.outputs[3] if len(norm.outputs) > 3 and norm.outputs[3].name else None
    return norm.outputs[0], total, (inputs[2], inputs[3], kernel_epsilon(norm, 1e-12))


def _sum_values(read: ir.Value | None, norm: ir.Node) -> list[ir.Value]:
    """The values holding the embedding sum: the sum, then the outputs of the no-ops between it and the norm."""
    if read is None:
        return []
    return [read] + (noop_outputs(norm.inputs[0], read) if is_op(norm, "LayerNormalization") else [])


def _region(m: Match, lookups: list[_Lookup]) -> list[ir.Node]:
    """The matched nodes, less any lookup node (its Gather, dequantization or views) that something else also
    reads, and what that node reads: two blocks sharing one word lookup keep it for that reader, and the kernel looks
    the rows up again itself."""
    keepable = {node for lookup in lookups for node in lookup.nodes}
    region = list(m.nodes)
    while True:
        kept = [n for n in region if n in keepable and any(read_outside(v, region) for v in n.outputs)]
        if not kept:
            return region
        region = [n for n in region if n not in kept]


def _classify(m: Match, i: int, ctx: GraphContext, total: ir.Value) -> _Lookup:
    gather = m.node(f"gather{i}")
    table, ids = m.value(f"table{i}"), m.value(f"ids{i}")
    dq = m.node(f"dq{i}")
    quantized = _quantized_table(dq if dq is not None else table.producer(), dq is not None)
    if quantized is not None and dq is not None:
        quantized.tensor = table  # dequantized after the Gather: the rows are the table's
    if attr_value(gather, "axis", 0) != 0:
        raise Refusal("gather", f"Gather '{node_name(gather)}' gathers along axis {attr_value(gather, 'axis')}")
    if dtype_of(ids) not in _INDEX_TYPES or ids.shape is None:
        raise Refusal("ids", f"the indices '{ids.name}' are not int32/int64 of known shape")
    nodes = _unviewed(m, i, ids, m.value(f"table{i}"), total)
    constant = static_value(ids)
    rows = table.shape[0] if table.shape is not None and len(table.shape) > 0 else None
    if constant is not None and isinstance(rows, int) and constant.size and \
            (constant.min() < 0 or constant.max() >= rows):
        raise Refusal("ids", f"the constant indices '{ids.name}' reach outside 0..{rows - 1}: ONNX Gather counts "
                      "negative ids from the end, the kernel refuses them")
    s = total.shape
    dims = list(ids.shape)
    kind = ""
    if len(dims) == 2 and same_dim(dims[0], s[0]) and same_dim(dims[1], s[1]):
        kind = "full"
    elif len(dims) == 2 and dims[0] == 1 and same_dim(dims[1], s[1]):
        kind = "row"
    if kind and _is_arange(ids, rows):
        kind = "arange"
    elif len(dims) == 1 and same_dim(dims[0], s[1]) and _is_arange(ids, rows):
        kind = "arange"
    elif len(dims) == 2 and dims[0] == 1 and _is_arange(ids, rows) and _sliced_to(ids, s[1]):
        # buffer[:, :S] with S read from another input's shape (transformers' dynamo exports): its length is
        # min(rows, S), which is S wherever the graph runs (else the Add cannot broadcast), so it is 0..S-1
        kind = "arange"
    wrapping = None if kind == "arange" else _wrapping_cast(ids, rows)
    if wrapping is not None:
        raise Refusal("ids", f"the indices '{ids.name}' come from Cast '{node_name(wrapping)}' to a signed type "
                      "too narrow for the table's rows: wrapped ids are negative, which Gather counts from the end "
                      "and the kernel refuses")
    return _Lookup(gather, table, ids, kind, quantized=quantized, dq=dq, nodes=nodes)


# ---- a lookup seen through views -----------------------------------------------------------------------------
# Dims are products (a known factor and named symbolic factors), so that a flattened [B*S] is compared exactly and a
# Reshape's -1 is solved by division. An unnamed unknown dim is no dim: nothing is proved about it.

_Dim = tuple[int, tuple[str, ...]]
_ONE: _Dim = (1, ())


def _unviewed(m: Match, i: int, ids: ir.Value, table: ir.Value, total: ir.Value) -> tuple[ir.Node, ...]:
    """Prove that lookup ``i`` adds ``Gather(table, ids)`` to the sum: the Reshape of its ids and the views it
    reaches the sum through, if any, keep its rows in their order (every Reshape does; a Transpose only when it
    moves unit axes alone) and give it the lookup's own shape up to leading unit axes, which the Add broadcasts
    alike; an Expand may repeat it only as the last view and only to the sum's own dims (the broadcast the Add does
    anyway). Returns the lookup's nodes; raises ``Refusal`` naming the view that moves or reshapes the rows."""
    gather, reshaped_ids = m.node(f"gather{i}"), m.node(f"reshaped_ids{i}")
    ids_dims, table_dims = _dims(ids), _dims(table)
    if ids_dims is None or table_dims is None or not table_dims:
        raise Refusal("lookup", f"the shapes of the ids '{ids.name}' and the table '{table.name}' of Gather "
                      f"'{node_name(gather)}' are not known dim by dim")
    rows = ids_dims + table_dims[1:]  # Gather(table, ids)
    dims = rows
    if reshaped_ids is not None:
        # Gather(table, Reshape(ids)) holds the rows of Gather(table, ids) in the same order, whatever the shape
        entries = _shape_vector(reshaped_ids.inputs[1])
        reshaped = None if entries is None else _reshaped(ids_dims, entries, attr_value(reshaped_ids, "allowzero", 0))
        if reshaped is None:
            raise Refusal("lookup", f"Reshape '{node_name(reshaped_ids)}' of the ids '{ids.name}' {_fmt(ids_dims)} in "
                          f"front of Gather '{node_name(gather)}': {_target(entries)}")
        dims = reshaped + table_dims[1:]
    views = _through_views(m, i, rows, dims, total, f"Gather '{node_name(gather)}'",
                           f"the lookup of the ids '{ids.name}'", "the lookup of those ids")
    dq = m.node(f"dq{i}")
    return tuple(n for n in (reshaped_ids, gather, dq) if n is not None) + views


def _through_views(m: Match, i: int, rows: list[_Dim], dims: list[_Dim], total: ir.Value, source: str,
                   what: str, short: str) -> tuple[ir.Node, ...]:
    """Prove that the views between term ``i``'s ``source`` and the sum keep its rows ``rows`` (laid out as ``dims``
    at ``source``) in order, up to leading unit axes and an Expand that only does the Add's broadcast; the views."""
    views: tuple[ir.Node, ...] = m.fact(f"views{i}", ())
    moves = [node for node in views if not is_op(node, "Identity")]  # an Identity moves nothing, wherever it is
    term = dims
    for k, node in enumerate(moves):
        term, grown = _view(node, dims)
        if grown:
            if k != len(moves) - 1:
                raise Refusal("lookup", f"Expand '{node_name(node)}' repeats the looked-up rows and "
                              f"{moves[k + 1].op_type} '{node_name(moves[k + 1])}' lays them out anew after it")
            _check_broadcast_of_sum(node, term, grown, total)
            break
        dims = term
    if len(term) > len(total.shape) or _leading_ones_off(dims) != _leading_ones_off(rows):
        last = f"{moves[-1].op_type} '{node_name(moves[-1])}'" if moves else source
        raise Refusal("lookup", f"{last} hands the sum the rows of {source} as {_fmt(dims)}, where {what} is "
                      f"{_fmt(rows)}: not {short}")
    return views


def _view(node: ir.Node, dims: list[_Dim]) -> tuple[list[_Dim], list[int]]:
    """The dims after one view op of a tensor of ``dims``, and the axes an Expand grows (repeats values along).
    Raises ``Refusal`` for a view that moves values or whose result is not proved."""
    op, name = node.op_type, node_name(node)
    if op == "Reshape":
        entries = _shape_vector(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        out = None if entries is None else _reshaped(dims, entries, attr_value(node, "allowzero", 0))
        if out is None:
            raise Refusal("lookup", f"Reshape '{name}' of the looked-up rows {_fmt(dims)}: {_target(entries)}")
        return out, []
    if op == "Flatten":
        axis = attr_value(node, "axis", 1)
        axis = axis + len(dims) if axis < 0 else axis
        return [_product(dims[:axis]), _product(dims[axis:])], []
    if op == "Transpose":
        perm = list(attr_value(node, "perm") or range(len(dims) - 1, -1, -1))
        if sorted(perm) != list(range(len(dims))):
            raise Refusal("lookup", f"Transpose '{name}' has perm {perm} for the rows {_fmt(dims)}")
        moved = [p for p in perm if dims[p] != _ONE]
        if moved != sorted(moved):
            raise Refusal("lookup", f"Transpose '{name}' (perm {list(perm)}) permutes the looked-up rows "
                          f"{_fmt(dims)}: only a transpose that moves unit axes alone keeps them in order")
        return [dims[p] for p in perm], []
    if op == "Expand":
        entries = _shape_vector(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        if entries is None or any(isinstance(e, int) and e < 1 for e in entries):
            raise Refusal("lookup", f"Expand '{name}' of the looked-up rows: its shape {entries} is not proved")
        return _expanded(name, dims, [(e, ()) if isinstance(e, int) else e for e in entries])
    axes = _view_axes(node)
    if op == "Unsqueeze" and axes is not None:
        rank = len(dims) + len(axes)
        positions = sorted({a % rank for a in axes if -rank <= a < rank})
        if len(positions) == len(axes):
            out = list(dims)
            for a in positions:
                out.insert(a, _ONE)
            return out, []
    if op == "Squeeze":
        axes = axes or None  # no axes, or an empty list: every unit axis
        if axes is None and all(d[1] == () for d in dims):
            axes = [a for a, d in enumerate(dims) if d == _ONE]  # every unit axis: only known when all dims are
        positions = {a % len(dims) for a in axes or () if -len(dims) <= a < len(dims)}
        if axes is not None and len(positions) == len(axes) and all(dims[a] == _ONE for a in positions):
            return [d for a, d in enumerate(dims) if a not in positions], []
    raise Refusal("lookup", f"{op} '{name}' of the looked-up rows {_fmt(dims)}: its axes are not proved")


def _expanded(name: str, dims: list[_Dim], target: list[_Dim]) -> tuple[list[_Dim], list[int]]:
    rank = max(len(dims), len(target))
    padded = [_ONE] * (rank - len(dims)) + dims
    target = [_ONE] * (rank - len(target)) + target
    out, grown = [], []
    for axis, (have, want) in enumerate(zip(padded, target)):
        if want == _ONE or want == have:
            out.append(have)
        elif have == _ONE:
            out.append(want)
            grown.append(axis)
        else:
            raise Refusal("lookup", f"Expand '{name}' to {_fmt(target)} does not provably broadcast the looked-up "
                          f"rows {_fmt(dims)}")
    return out, grown


def _check_broadcast_of_sum(node: ir.Node, out: list[_Dim], grown: list[int], total: ir.Value) -> None:
    """An Expand that repeats a term along unit axes to the sum's own dims adds what the Add's broadcast adds."""
    sum_dims = [_dim(d) for d in total.shape]
    offset = len(sum_dims) - len(out)
    if offset < 0 or any(out[a] != sum_dims[a + offset] for a in grown):
        raise Refusal("lookup", f"Expand '{node_name(node)}' repeats the looked-up rows to {_fmt(out)}, not to the "
                      f"embedding sum's own dims {_fmt(list(total.shape))}: it is more than the Add's broadcast")


def _view_axes(node: ir.Node) -> list[int] | None:
    axes = attr_value(node, "axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
        found = static_value(node.inputs[1])
        axes = None if found is None else [int(a) for a in found.reshape(-1)]
    return None if axes is None else list(axes)


def _dim(d) -> _Dim | None:
    if isinstance(d, int):
        return (d, ()) if d >= 0 else None
    name = getattr(d, "value", None)
    return (1, (name,)) if isinstance(name, str) and name else None


def _dims(value: ir.Value) -> list[_Dim] | None:
    if value.shape is None:
        return None
    dims = [_dim(d) for d in value.shape]
    return None if None in dims else dims


def _product(dims: list[_Dim]) -> _Dim:
    return math.prod(d[0] for d in dims), tuple(sorted(s for d in dims for s in d[1]))


def _quotient(whole: _Dim, part: _Dim) -> _Dim | None:
    """whole / part when part's factors are among whole's: the dim a Reshape's -1 stands for."""
    if part[0] == 0 or whole[0] % part[0]:
        return None
    left = Counter(whole[1])
    left.subtract(part[1])
    if any(n < 0 for n in left.values()):
        return None
    return whole[0] // part[0], tuple(sorted(left.elements()))


def _reshaped(dims: list[_Dim], entries: list, allowzero: int) -> list[_Dim] | None:
    """The dims Reshape gives ``dims`` for target ``entries`` (ints with ONNX's 0 and -1, or proven dims), or None
    when that is not proved (or the Reshape would fail)."""
    out: list[_Dim | None] = []
    free = None
    for k, entry in enumerate(entries):
        if isinstance(entry, tuple):
            out.append(entry)
        elif entry > 0:
            out.append((entry, ()))
        elif entry == 0 and not allowzero and k < len(dims):
            out.append(dims[k])  # 0 copies the input's dim
        elif entry == -1 and free is None:
            free = k
            out.append(None)
        else:
            return None
    if free is not None:
        out[free] = _quotient(_product(dims), _product([d for d in out if d is not None]))
        if out[free] is None:
            return None
    return out if _product(out) == _product(dims) else None


#: the longest shape vector read: a lookup's Reshape target has the rank of the sum (a longer one is no lookup's)
_MAX_SHAPE_ENTRIES = 8
#: how many ops a shape vector is followed through: tf2onnx's ends of tf.slice take ten from the Shape
_SHAPE_DEPTH = 12


def _target(entries: list | None) -> str:
    """Why a Reshape's target does not prove the lookup's shape, for a refusal."""
    if entries is None:
        return ("its target is neither a constant nor a Concat of Shape slices of known dims (at most "
                f"{_MAX_SHAPE_ENTRIES} entries)")
    return f"its target {_fmt(entries)} is not proved to give the rows the lookup's own shape"


def _shape_vector(value: ir.Value) -> list | None:
    """The entries of a shape input: a constant's ints (a Reshape's 0 and -1 keep their meaning), or the dims that
    ``Shape(x)[start:end]`` pieces of a Concat read, as proven dims; None when neither."""
    return _entries(value, 0, {})


def _entries(value: ir.Value, depth: int, seen: dict) -> list | None:
    # each value once (a Concat may read one piece many times, at every level), and never more entries than a
    # lookup's rank: the work is bounded by the graph, not by its fan-out
    if value not in seen:
        seen[value] = None  # a value met again on its own path is no shape vector
        found = _entries_of(value, depth, seen)
        seen[value] = found if found is None or len(found) <= _MAX_SHAPE_ENTRIES else None
    return seen[value]


def _entries_of(value: ir.Value, depth: int, seen: dict) -> list | None:
    array = static_value(value)
    if array is not None:
        return [int(v) for v in array.reshape(-1)] if array.ndim == 1 and array.dtype.kind in "iu" and \
            array.size <= _MAX_SHAPE_ENTRIES else None
    node = value.producer()
    if node is None or depth > _SHAPE_DEPTH or node.domain not in ("", "ai.onnx"):
        return None
    if is_op(node, "Identity") or (is_op(node, "Cast") and _holds_any_dim(value)):
        return _entries(node.inputs[0], depth + 1, seen)
    if is_op(node, "Shape"):
        dims = _dims(node.inputs[0])
        if dims is None:
            return None
        rank = len(dims)
        start, end = attr_value(node, "start", 0), attr_value(node, "end", rank)
        return dims[max(start + rank if start < 0 else start, 0):min(end + rank if end < 0 else end, rank)]
    if is_op(node, "Concat") and attr_value(node, "axis") in (0, -1) and len(node.inputs) <= _MAX_SHAPE_ENTRIES:
        parts = []
        for v in node.inputs:
            part = _entries(v, depth + 1, seen)
            if part is None or len(parts) + len(part) > _MAX_SHAPE_ENTRIES:
                return None
            parts += part
        return parts
    if is_op(node, "Slice"):
        return _sliced_entries(node, depth, seen)
    if onnx_op(node) in ("Add", "Mul", "Equal") and len(node.inputs) == 2:
        # tf2onnx's tf.slice: ends = begin + size + (size == -1) * INT_MAX, all of it at run time
        pair = [_entries(v, depth + 1, seen) for v in node.inputs]
        return None if None in pair else _elementwise(onnx_op(node), *pair)
    return None


def _sliced_entries(node: ir.Node, depth: int, seen: dict) -> list | None:
    """``vector[start:end]`` of a shape vector (tf2onnx's strided_slice of a Shape), constant bounds, step 1."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    whole = _entries(inputs[0], depth + 1, seen)
    bounds = [None if v is None else static_value(v) for v in inputs[1:5]]
    if whole is None or any(b is None and v is not None for b, v in zip(bounds, inputs[1:5])) or \
            bounds[0] is None or bounds[1] is None or bounds[0].size != 1 or bounds[1].size != 1 or \
            (bounds[2] is not None and int(bounds[2].reshape(-1)[0]) not in (0, -1)) or \
            (bounds[3] is not None and int(bounds[3].reshape(-1)[0]) != 1):
        return None
    return whole[int(bounds[0].reshape(-1)[0]):int(bounds[1].reshape(-1)[0])]


def _known(entry) -> int | None:
    """The number an entry is, if it is one (a dim of no symbolic factor)."""
    if isinstance(entry, tuple):
        return entry[0] if not entry[1] else None
    return int(entry)


def _elementwise(op: str, a: list, b: list) -> list | None:
    """Add, Mul or Equal of two shape vectors, broadcast as ONNX does; None where a result is not proved. A symbolic
    dim is a size, never negative: it differs from a negative number; times 0 it is 0, plus 0 itself."""
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        return None
    n = max(len(a), len(b))
    a, b = (a * n if len(a) == 1 else a), (b * n if len(b) == 1 else b)
    out = []
    for x, y in zip(a, b):
        kx, ky = _known(x), _known(y)
        if kx is not None and ky is not None:
            value = kx + ky if op == "Add" else kx * ky if op == "Mul" else int(kx == ky)
            if not -2**31 <= value < 2**31:
                return None  # int32 arithmetic would wrap where Python's does not
            out.append(value)
        elif op == "Add" and 0 in (kx, ky):
            out.append(y if kx == 0 else x)
        elif op == "Mul" and 0 in (kx, ky):
            out.append(0)
        elif op == "Mul" and 1 in (kx, ky):
            out.append(y if kx == 1 else x)
        elif op == "Equal" and ((kx is not None and kx < 0) or (ky is not None and ky < 0)):
            out.append(0)
        else:
            return None
    return out


def _leading_ones_off(dims: list[_Dim]) -> list[_Dim]:
    k = 0
    while k < len(dims) and dims[k] == _ONE:
        k += 1
    return dims[k:]


def _fmt(dims: list) -> str:
    def one(d):
        if not isinstance(d, tuple):
            return str(d)
        factors = ([str(d[0])] if d[0] != 1 or not d[1] else []) + list(d[1])
        return "*".join(factors)
    return "[" + ", ".join(one(d) for d in dims) + "]"


def _folded_positions(ctx: GraphContext, m: Match, i: int, s: ir.Value) -> _Lookup:
    """A constant term P of shape [S, H], [1, S, H] or [B, S, H] with B equal rows, added to a sum of the sum's own
    (fixed) shape, is the lookup of rows 0..S-1 of the table P[..., :, :] (the kernel's default positions). The
    shape must be the sum's own: a constant that broadcasts the ids' batch or sequence would not be a lookup. It may
    reach the sum through views that keep its rows (``_through_views``): tf2onnx folds Keras' table[:S] of a static
    S and broadcasts it over the batch."""
    value = m.value(f"folded{i}")
    array = value.const_value.numpy() if value.const_value is not None else static_value(value)
    dims = list(s.shape)
    if array is None or array.ndim not in (2, 3) or list(array.shape[-2:]) != dims[1:] or \
            (array.ndim == 3 and array.shape[0] not in (1, dims[0])):
        raise Refusal("terms", f"the constant term '{value.name}' of the embedding sum is not a position term of "
                      f"the sum's shape {dims}")
    rows = array.reshape(-1, *array.shape[-2:])
    if not np.array_equal(rows, np.broadcast_to(rows[:1], rows.shape)):
        raise Refusal("terms", f"the constant term '{value.name}' differs between batch rows; it is not a lookup")
    own = [(int(d), ()) for d in array.shape]
    views = _through_views(m, i, own, own, s, f"the constant '{value.name}'", f"the constant '{value.name}'",
                           "that constant")
    table = ctx.constant(np.ascontiguousarray(rows[0]), f"{value.name}_as_positions")
    return _Lookup(None, table, table, "arange", nodes=views)


def _broadcast_lookups(ctx: GraphContext, m: Match, i: int, lookups: list[_Lookup], s: ir.Value) -> list[_Lookup]:
    """The two lookups and the sliced positions, each expanded to the broadcast the Add does
    (``rules/_broadcast_ids.py``): the word and segment ids as [B, S] ids, the positions as position ids."""
    position = _sliced_positions(m, i, s, free=True)
    node = m.node(f"slice{i}")
    axes = static_value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    axes = [0, 1] if axes is None else [int(a) % 2 for a in axes.reshape(-1)]
    expanded, positions = broadcast_inputs(ctx, m, i, axes.index(0), [lk.ids for lk in lookups])
    out = [dataclasses.replace(lk, ids=ids, kind="full") for lk, ids in zip(lookups, expanded)]
    return out + [dataclasses.replace(position, ids=positions, kind="row")]


def _sliced_positions(m: Match, i: int, s: ir.Value, free: bool = False) -> _Lookup:
    """Keras' PositionEmbedding, ``broadcast_to(slice(table, (0, 0), (S, H)), shape(x))``: the rows 0..S-1 of the
    table, which is the lookup of positions 0..S-1 (the kernel's default), when the Slice provably starts at row 0,
    steps by 1 and ends at the sum's sequence length S (read from a run-time shape), keeps whole rows, and the table
    has more than one row (one row would broadcast to every position). Anything else is refused with what it saw.
    ``free``: the end is not compared with S, nor the views followed (the rows are expanded explicitly)."""
    node, table = m.node(f"slice{i}"), m.value(f"table{i}")
    table_dims = _dims(table)
    if table_dims is None or len(table_dims) != 2 or table_dims[0][1] or table_dims[0][0] < 2:
        raise Refusal("positions", f"Slice '{node_name(node)}' reads '{table.name}' of shape "
                      f"{_fmt(table_dims) if table_dims else 'unknown'}: a position table is a known [rows, H] "
                      "with more than one row")
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts, axes, steps = (None if v is None else static_value(v) for v in (inputs[1], inputs[3], inputs[4]))
    if starts is None or (inputs[3] is not None and axes is None) or (inputs[4] is not None and steps is None):
        raise Refusal("positions", f"the starts, axes or steps of Slice '{node_name(node)}' of the table "
                      f"'{table.name}' are not constants")
    starts = [int(v) for v in starts.reshape(-1)]
    axes = list(range(len(starts))) if axes is None else [int(a) % 2 if -2 <= a < 2 else int(a)
                                                          for a in axes.reshape(-1)]
    steps = [1] * len(starts) if steps is None else [int(v) for v in steps.reshape(-1)]
    ends = None if inputs[2] is None else _shape_vector(inputs[2])
    if any(a not in (0, 1) for a in axes) or len(set(axes)) != len(axes) or len(steps) != len(starts) or \
            len(axes) != len(starts):
        raise Refusal("positions", f"Slice '{node_name(node)}' slices axes {axes} of the 2-D table '{table.name}'")
    seq, hidden = _dim(s.shape[1]), table_dims[1]
    ends = ends if ends is not None and len(ends) == len(starts) else None
    found = {axis: (start, step, None if ends is None else _as_dim(ends[k]))
             for k, (axis, start, step) in enumerate(zip(axes, starts, steps))}
    if 0 not in found or (found[0][2] != seq and 1 in found and found[1][2] == seq and seq is not None):
        raise Refusal("positions", f"Slice '{node_name(node)}' cuts the sequence out of axis 1 of the table "
                      f"'{table.name}' {_fmt(table_dims)}: the kernel's positions are its rows (axis 0)")
    start, step, end = found[0]
    if start != 0 or step != 1:
        raise Refusal("positions", f"Slice '{node_name(node)}' takes the rows from {start} in steps of {step} of "
                      f"'{table.name}': positions 0..S-1 start at row 0 and step by 1")
    if ends is None:
        raise Refusal("positions", f"the ends of Slice '{node_name(node)}' of the table '{table.name}': "
                      f"{_target(ends)}")
    if not free and (seq is None or end != seq):
        raise Refusal("positions", f"Slice '{node_name(node)}' ends at row {_fmt([end])[1:-1]} of '{table.name}', "
                      f"not provably at the sequence length {s.shape[1]} of the embedding sum")
    if 1 in found:
        start, step, end = found[1]
        whole = end == hidden or (not end[1] and not hidden[1] and end[0] >= hidden[0])
        if start != 0 or step != 1 or not whole:
            raise Refusal("positions", f"Slice '{node_name(node)}' takes columns {start}:{_fmt([end])[1:-1]}:{step} "
                          f"of the table '{table.name}' {_fmt(table_dims)}, not whole rows")
    views = m.fact(f"views{i}", ()) if free else \
        _through_views(m, i, [seq, hidden], [seq, hidden], s, f"Slice '{node_name(node)}'",
                       f"rows 0..S-1 of '{table.name}'", "the positions 0..S-1")
    return _Lookup(None, table, table, "arange", nodes=(node,) + views)


def _as_dim(entry) -> _Dim:
    return entry if isinstance(entry, tuple) else (int(entry), ())


def _quantized_table(dq: ir.Node | None, after: bool) -> PerTensor | None:
    """The table a lookup reads as (q, scale, zero point) when ``dq`` dequantizes it: after the Gather
    (``after``, quantize_dynamic's order) or in front of it (QDQ's). Both are the lookup of the same int8/uint8
    table when the scale and zero point are one number each: a per-tensor dequantization commutes with the lookup.
    Refused when the dequantization is not per tensor; None when there is none (a float table)."""
    if dq is None or not is_op(dq, "DequantizeLinear"):
        return None
    where = "after a lookup" if after else "of an embedding table"
    found = _dequantized([dq.outputs[0]])
    if found is None or attr_value(dq, "block_size", 0):
        q = dq.inputs[0]
        raise Refusal("quantized", f"DequantizeLinear '{node_name(dq)}' {where} is not per tensor int8/uint8 "
                      f"({dtype_of(q)} {_shape_text(dq.inputs[1])} scale): only one scale and zero point per table "
                      "commute with the lookup and fit QEmbedLayerNormalization")
    return found[0]


def _shape_text(value: ir.Value | None) -> str:
    return "no" if value is None else "unknown" if value.shape is None else _fmt(list(value.shape))


def _float_table(ctx: GraphContext, lookup: _Lookup) -> ir.Value:
    """The float table the float kernel reads. A quantized table is only read so when --quantize-embeddings will
    turn the node into QEmbedLayerNormalization (``_quantized_tables``): dequantized whole, as the kernel's input,
    it would stay a DequantizeLinear ONNX Runtime does not fold, run at every inference."""
    if lookup.dq is None:
        return lookup.table  # a float table, or the graph's own DequantizeLinear in front of the Gather
    q = lookup.quantized
    node = ctx.node("DequantizeLinear", [q.tensor, q.scale, q.zero_point], {}, hint=f"{q.tensor.name}_dequantized")
    node.outputs[0].type = ir.TensorType(dtype_of(q.scale))
    node.outputs[0].shape = q.tensor.shape
    return node.outputs[0]


def _sliced_to(ids: ir.Value, seq) -> bool:
    """``ids`` is a Slice whose end is the sequence length ``seq``, read from the shape of a tensor."""
    node = ids.producer()
    while node is not None and onnx_op(node) in ("Cast", "Identity"):
        node = node.inputs[0].producer()
    if node is None or not is_op(node, "Slice") or len(node.inputs) < 3:
        return False
    return _is_dim_of(node.inputs[2], seq)


def _is_dim_of(value: ir.Value, dim, depth: int = 0) -> bool:
    """``value`` holds one number, provably the size ``dim``: Shape(t)[i:i+1], Gather(Shape(t), i), possibly
    Cast, Unsqueezed or Reshaped, of a tensor t whose axis i is ``dim``."""
    node = value.producer()
    if node is None or depth > 4:
        return False
    if onnx_op(node) in ("Identity", "Unsqueeze", "Reshape", "Squeeze") or \
            (is_op(node, "Cast") and _holds_any_dim(value)):
        return _is_dim_of(node.inputs[0], dim, depth + 1)
    if is_op(node, "Gather") and node.inputs[0].producer() is not None:
        shape_node, index = node.inputs[0].producer(), static_value(node.inputs[1])
        if not is_op(shape_node, "Shape") or index is None or index.size != 1 or len(shape_node.attributes):
            return False
        return _axis_is(shape_node.inputs[0], int(index.reshape(-1)[0]), dim)
    if is_op(node, "Shape"):
        source = node.inputs[0]
        if source.shape is None:
            return False
        rank = len(source.shape)
        start, end = attr_value(node, "start", 0), attr_value(node, "end", rank)
        start, end = start + rank if start < 0 else start, min(end + rank if end < 0 else end, rank)
        return end - start == 1 and _axis_is(source, start, dim)
    return False


def _axis_is(value: ir.Value, axis: int, dim) -> bool:
    shape = value.shape
    return shape is not None and -len(shape) <= axis < len(shape) and same_dim(shape[axis], dim)


#: the largest n such that a type holds every integer 0..n exactly
_EXACT_UP_TO = {ir.DataType.INT8: 2**7 - 1, ir.DataType.UINT8: 2**8 - 1, ir.DataType.INT16: 2**15 - 1,
                ir.DataType.UINT16: 2**16 - 1, ir.DataType.INT32: 2**31 - 1, ir.DataType.UINT32: 2**32 - 1,
                ir.DataType.INT64: 2**63 - 1, ir.DataType.UINT64: 2**64 - 1, ir.DataType.BFLOAT16: 2**8,
                ir.DataType.FLOAT16: 2**11, ir.DataType.FLOAT: 2**24, ir.DataType.DOUBLE: 2**53}


def _holds_any_dim(value: ir.Value) -> bool:
    """Whether ``value``'s type holds every size a tensor has (int32 and wider): a dim Cast to uint8 or bool is
    that dim only at the small sizes verification tries (uint8(257) is 1, a one-row Slice the Add broadcasts)."""
    return _EXACT_UP_TO.get(dtype_of(value), 0) >= 2**31 - 1


def _counts_exactly(value: ir.Value, rows) -> bool:
    """Whether ``value``'s type holds every position a lookup in a table of ``rows`` rows can read (0..rows-1; with
    the rows unknown, every int32 id the kernel takes): a Range or Cast in a narrower type wraps or rounds them."""
    top = _EXACT_UP_TO.get(dtype_of(value))
    return top is not None and top >= (rows - 1 if isinstance(rows, int) else 2**31 - 1)


def _wrapping_cast(ids: ir.Value, rows, depth: int = 0) -> ir.Node | None:
    """A Cast on the way to ``ids`` into a signed type that does not hold every row index (int8 ids of a table of
    300 rows), through the ops that carry ids unchanged."""
    node = ids.producer()
    if node is None or depth > 6 or node.domain not in ("", "ai.onnx"):
        return None
    if is_op(node, "Cast") and dtype_of(ids) in _SIGNED and not _counts_exactly(ids, rows):
        return node
    if onnx_op(node) in ("Cast", "Unsqueeze", "Expand", "Identity", "Reshape", "Squeeze"):
        return _wrapping_cast(node.inputs[0], rows, depth + 1)
    return None


_SIGNED = frozenset({ir.DataType.INT8, ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64})


def _is_arange(ids: ir.Value, rows, depth: int = 0) -> bool:
    """True when every row of ``ids`` is 0, 1, ..., n-1 (the caller checks that n is the sequence length), for
    every n up to the table's ``rows``."""
    array = static_value(ids)
    if array is not None:
        if array.size == 0:
            return False  # no position at all: not the positions of a sequence
        rows = array.reshape(-1, array.shape[-1]) if array.ndim else array.reshape(1, 1)
        return bool(np.all(rows == np.arange(rows.shape[-1])))
    node = ids.producer()
    if node is None or depth > 6:
        return False
    if onnx_op(node) in ("Cast", "Unsqueeze", "Expand", "Identity"):
        # position ids broadcast over the batch, or widened: still 0..n-1 along the last axis, unless the last
        # axis itself is broadcast (a constant 0 expanded to [B, S] is not 0..S-1)
        source = node.inputs[0]
        if is_op(node, "Expand") and (source.shape is None or ids.shape is None or len(source.shape) == 0
                                         or not same_dim(source.shape[-1], ids.shape[-1])):
            return False
        axes = attr_value(node, "axes")
        if is_op(node, "Unsqueeze") and axes is None and len(node.inputs) > 1:
            found = static_value(node.inputs[1])
            axes = None if found is None else found.reshape(-1).tolist()
        if is_op(node, "Unsqueeze") and (axes is None or any(a in (-1, len(ids.shape) - 1) for a in axes)):
            return False
        if is_op(node, "Cast") and not _counts_exactly(ids, rows):
            return False
        return _is_arange(node.inputs[0], rows, depth + 1)
    if is_op(node, "Range"):
        start, delta = static_value(node.inputs[0]), static_value(node.inputs[2])
        return start is not None and delta is not None and start.item() == 0 and delta.item() == 1 and \
            _counts_exactly(ids, rows)
    if is_op(node, "Slice"):
        return _is_arange_slice(node, rows, depth)
    return False


def _is_arange_slice(node: ir.Node, rows, depth: int) -> bool:
    """``buffer[..., 0:n]`` of an arange buffer (HF's registered position_ids) is 0..n-1."""
    data = node.inputs[0]
    starts = static_value(node.inputs[1]) if len(node.inputs) > 1 else None
    axes = static_value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    steps = static_value(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    if starts is None or data.shape is None:
        return False
    rank = len(data.shape)
    axes_list = [int(a) % rank for a in axes.reshape(-1)] if axes is not None else list(range(starts.size))
    if axes_list != [rank - 1] or starts.reshape(-1)[0] != 0:
        return False
    if steps is not None and steps.reshape(-1)[0] != 1:
        return False
    return _is_arange(data, rows, depth + 1)


def _unrelated_ids(lookups: list[_Lookup]) -> bool:
    """Two lookups of 2-D ids, neither proven the sum's [batch, sequence]: ids whose dims nothing relates."""
    return len(lookups) == 2 and not any(lk.kind == "full" for lk in lookups) and \
        all(lk.ids.shape is not None and len(lk.ids.shape) == 2 for lk in lookups)


def _check_some_full(lookups: list[_Lookup], s: ir.Value) -> None:
    """Some lookup's ids must be the sum's [batch, sequence]; when several lookups read 2-D ids and none is proven
    so, the sum is a broadcast of ids whose shapes nothing relates (tf2onnx names each graph input's dims apart: a
    BERT's token and segment ids), and the kernel takes input and segment ids of one shape."""
    two_d = [lk for lk in lookups if lk.ids.shape is not None and len(lk.ids.shape) == 2]
    if len(two_d) < 2 or any(lk.kind == "full" for lk in lookups):
        return
    names = " and ".join(f"'{lk.ids.name}'" for lk in two_d)
    raise Refusal("ids", f"the embedding sum's dims {_fmt(list(s.shape))} are a broadcast of the lookups of {names} "
                  "that shape inference assumed, not proved (their ids come from inputs whose dims nothing in the "
                  "graph relates): no ids are proven its [batch, sequence], and the kernel takes input and segment "
                  "ids of one shape")


def _roles(lookups: list[_Lookup]) -> tuple[_Lookup, _Lookup, _Lookup | None]:
    """word (indexed by [B, S] ids), position (0..S-1 first, else (1, S) or (B, S) ids), segment (the rest)."""
    remaining = list(lookups)
    word = next((lk for lk in remaining if lk.kind == "full"), None)
    if word is None:
        raise Refusal("ids", "no lookup is indexed by a [batch, sequence] id tensor")
    remaining.remove(word)
    position = next((lk for kind in ("arange", "row", "full") for lk in remaining if lk.kind == kind), None)
    if position is None:
        raise Refusal("ids", "the second lookup's indices are neither 0..S-1 nor shaped (1, S) or (B, S)")
    remaining.remove(position)
    segment = remaining[0] if remaining else None
    if segment is not None and segment.kind not in ("full", "arange") or (
            segment is not None and segment.kind == "arange" and list(segment.ids.shape) != list(word.ids.shape)):
        raise Refusal("ids", f"segment ids '{segment.ids.name}' must have the shape of the input ids")
    return word, position, segment


def _check_table(lookup: _Lookup, hidden: int, dtype: ir.DataType) -> None:
    # a quantized table: the shape of the int8/uint8 table, the type it is dequantized to
    table = lookup.quantized.tensor if lookup.quantized else lookup.table
    shape, found = table.shape, dtype_of(lookup.quantized.scale if lookup.quantized else table)
    if shape is None or len(shape) != 2 or shape[1] != hidden or found != dtype:
        raise Refusal("table", f"table '{table.name}' is {found}"
                      f"{'unknown' if shape is None else _fmt(list(shape))}; the kernel needs {dtype}[rows, {hidden}]")


def _vector(value: ir.Value, hidden: int, dtype: ir.DataType, what: str) -> ir.Value:
    if value.shape is None or list(value.shape) != [hidden] or dtype_of(value) != dtype:
        raise Refusal(what, f"{what} '{value.name}' must be {dtype}[{hidden}]")
    return value


def _int32(ctx: GraphContext, ids: ir.Value) -> ir.Value:
    """The kernel takes int32 ids. Valid ids index a table, so they fit; a Cast is inserted for int64, except for
    int32 ids the graph widened itself (jax2onnx's ``Cast(ids, int64)``): int32 -> int64 -> int32 gives them back."""
    if dtype_of(ids) == ir.DataType.INT32:
        return ids
    widened = ids.producer()
    if widened is not None and is_op(widened, "Cast") and \
            widened.inputs[0] is not None and dtype_of(widened.inputs[0]) == ir.DataType.INT32:
        return widened.inputs[0]
    cast = ctx.node("Cast", [ids], {"to": ir.DataType.INT32.value}, hint="lnfuse_ids")
    cast.outputs[0].type = ir.TensorType(ir.DataType.INT32)
    cast.outputs[0].shape = ids.shape
    return cast.outputs[0]


def _dequantized(values: list[ir.Value | None]) -> list[PerTensor] | None:
    """Each value as a per-tensor DequantizeLinear (``quantized_tensors.per_tensor``), or None if any is not (then
    the float kernel reads the dequantized tensors, which is exact)."""
    found = [per_tensor(v) for v in values]
    return None if any(f is None for f in found) else found


def _qembed_inputs(ctx: GraphContext, word: _Lookup, segment: _Lookup | None, q: list[PerTensor]) -> list:
    """The kernel's inputs: ids, segment ids, the five quantized tensors, no mask, their scales and zero points
    (all of one type, ``_one_type``)."""
    word_q, pos_q = q[0], q[1]
    seg_q = q[2] if segment is not None else None
    parts = _one_type(ctx, [word_q, pos_q, seg_q, q[-2], q[-1]])
    return ([_int32(ctx, word.ids), _int32(ctx, segment.ids) if segment else None]
            + [p.tensor if p else None for p in parts] + [None]
            + [p.scale if p else None for p in parts] + [p.zero_point if p else None for p in parts])


def _one_type(ctx: GraphContext, parts: list[PerTensor | None]) -> list[PerTensor | None]:
    """The kernel takes every quantized tensor and zero point in one type (uint8 or int8). The word table's type is
    kept (the largest tensor keeps its bytes); another part is re-encoded exactly: int8 q with zero point z is
    uint8 q + 128 with zero point z + 128, the same (q - z) * scale. An absent zero point is DequantizeLinear's 0."""
    wanted = dtype_of(parts[0].tensor)
    out: list[PerTensor | None] = []
    for part in parts:
        if part is None:
            out.append(None)
            continue
        zero = part.zero_point if part.zero_point is not None else ctx.constant(
            np.zeros((), dtype_of(part.tensor).numpy()), f"{part.tensor.name}_zero_point")
        if dtype_of(part.tensor) == wanted:
            out.append(PerTensor(part.tensor, part.scale, zero))
            continue
        arrays = [static_value(part.tensor), static_value(zero)]
        if any(a is None for a in arrays):
            raise Refusal("quantized", f"'{part.tensor.name}' is {dtype_of(part.tensor)} where the word table is "
                          f"{wanted}: QEmbedLayerNormalization takes one type, and a tensor computed at run time "
                          "cannot be re-encoded")
        tensor, zero = (ctx.constant(reencoded(a, wanted), f"{v.name}_{wanted.name.lower()}")
                        for a, v in zip(arrays, (part.tensor, zero)))
        out.append(PerTensor(tensor, part.scale, zero))
    return out


def _quantized_tables(ctx: GraphContext, tables: list[_Lookup], norm: tuple, read_sums: list[ir.Value],
                      dtype: ir.DataType) -> tuple[list[PerTensor] | None, list[str]]:
    """What a block over int8/uint8 tables becomes: QEmbedLayerNormalization over the tables as they are when
    gamma and beta are quantized per tensor too (exact but for the kernel's rounding), the quantized parts in the
    kernel's order. The float EmbedLayerNormalization would read each table through a DequantizeLinear of the whole
    table, which ONNX Runtime does not fold at load (it keeps DequantizeLinear out of constant folding): every run
    would dequantize every table. So it is written only as the hand-over to --quantize-embeddings, which turns it
    into QEmbedLayerNormalization (quantizing gamma and beta) after the pass; else the block is refused with why.
    ``norm``: gamma, beta, and both as quantized parts if they are."""
    position = tables[1]
    gamma, beta, gamma_beta = norm
    why = "EmbedLayerNormalization would read each table through a DequantizeLinear of the whole table, which " \
        "ONNX Runtime does not fold at load: every run would dequantize the tables"
    if dtype != ir.DataType.FLOAT:
        raise Refusal("quantized", f"the tables are quantized and the block computes in {dtype}: "
                      f"QEmbedLayerNormalization has a float32 kernel only, and {why}")
    if position.kind != "arange":
        raise Refusal("quantized", f"the tables are quantized and the positions '{position.ids.name}' are not "
                      f"provably 0..S-1: QEmbedLayerNormalization takes no position_ids, and {why}")
    if read_sums:
        raise Refusal("outputs", f"the tables are quantized and the embedding sum is read elsewhere: "
                      f"QEmbedLayerNormalization has no embedding_sum output, and {why}")
    float_parts = [f"table '{lk.table.name}' is float" for lk in tables if lk.quantized is None]
    if gamma_beta is None:
        float_parts.append("gamma and beta are float")
    if not float_parts:
        return [lk.quantized for lk in tables] + gamma_beta, []
    # that pass rewrites the main graph, keeps stored quantized tensors and quantizes constant float ones: a block
    # it would leave as it is would keep the whole-table dequantization
    stored = [lk.quantized for lk in tables if lk.quantized]
    floats = [lk.table for lk in tables if lk.quantized is None] + ([] if gamma_beta else [gamma, beta])
    if ctx.quantize_embeddings and ctx.path == "main" and \
            all(as_stored(q) for q in stored) and \
            all(is_static(v) and scalable(static_value(v)) for v in floats):
        return None, ["written over the dequantized tables for --quantize-embeddings, which turns it into "
                      "QEmbedLayerNormalization over the tables as they are"]
    raise Refusal("quantized", f"the tables are quantized and {' and '.join(float_parts)}: "
                  "QEmbedLayerNormalization takes them quantized, which changes the numbers, and "
                  f"{why}; --quantize-embeddings writes QEmbedLayerNormalization over the tables as they are and "
                  "reports the measured difference")


RULE = EmbedNorm()
