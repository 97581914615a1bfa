"""Norm-like statistics, found without any rule's patterns: what ``explain`` and ``check`` must account for.

The rules match the spellings they know; a norm written some other way would leave no trace in the report if the
report only listed what a rule's pattern started on. So the candidates are found here, by what a norm computes:
a second moment of some x (a mean or sum of x², of (x − mean)², ReduceSumSquare, ReduceL2; or the one-pass
E[x²] − E[x]²) whose value reaches an inverse square root (a root, then a division, a reciprocal or a negative
power; Pow −0.5; BatchNormalization's variance input). Each candidate is centred (x − mean appears: a LayerNorm's
kind) or uncentred (an RMS norm's kind), which says whose refusal explains it.

A quantized model's norms are candidates too: a QuantizeLinear/DequantizeLinear round trip is a view, and a
QOperator op (QLinearAdd of the variance and epsilon, QLinearMul of d and d...) is read as the float op it computes
(``lnfuse.match.qoperator``). The rounding steps met inside the norm are recorded: no rule fuses through them.

The search is a bounded walk from each reduction: a few producer steps back to see what is reduced, a few reader
steps forward to the inverse root. Every walk visits at most a fixed number of nodes, so the whole search is linear
in the graph's size, and a graph without reductions costs one pass over its nodes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx_ir as ir

from lnfuse.index.constants import static_value
from lnfuse.index.ops import is_op, onnx_op, op_name
from lnfuse.match.qoperator import float_op, operand_index, operands, rounds

#: which rule's reasons explain a candidate of each kind (a centred norm is not an RMS near-miss)
RULE_OF_KIND = {"centred": "layer_norm", "uncentred": "rms_norm"}

_FIRST_MOMENT = frozenset({"ReduceMean", "ReduceSum", "GlobalAveragePool"})
#: reductions that square what they reduce
_SQUARING = frozenset({"ReduceSumSquare", "ReduceL2"})
#: ops that hand a value on without changing what it means here (type, layout, broadcast, a quantization round trip)
_VIEWS = frozenset({"Cast", "CastLike", "Identity", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Flatten",
                    "Transpose", "Dropout", "QuantizeLinear", "DequantizeLinear"})
#: elementwise ops a variance passes through on its way to the root (epsilon, 1/N, a clamp, a guard, the root)
_CARRY = _VIEWS | {"Add", "Sub", "Mul", "Div", "Max", "Min", "Relu", "Clip", "Abs", "Neg", "Where", "Sqrt", "Pow"}
_CLAMPS = frozenset({"Max", "Relu", "Clip"})
#: how far the walks go: a norm's statistics reach their root in a handful of nodes
_BACK_STEPS = 8
_FORWARD_NODES = 48


@dataclass
class Statistics:
    """One norm-like candidate: its reductions (``means``, then ``square``, the second moment), the nodes from the
    second moment to ``inverse`` (where the inverse root or division was reached), and the spelling seen."""

    kind: str
    square: ir.Node
    means: list[ir.Node]
    inverse: ir.Node
    nodes: list[ir.Node]
    #: the ops from the reductions to the inverse root, as phrases (for the report)
    spelling: list[str] = field(default_factory=list)
    #: the steps inside the norm that round to an integer grid (quantizers, QOperator ops), where a fused op would not
    quantizers: list[ir.Node] = field(default_factory=list)

    @property
    def rule(self) -> str:
        return RULE_OF_KIND[self.kind]

    def reductions(self) -> list[ir.Node]:
        return [*self.means, self.square]

    def describe(self) -> str:
        """What was seen, in words: the kind, the axes, and how each statistic was spelled."""
        return f"{self.kind} statistics {_over(self.square)} ({'; '.join(self.spelling)})"


def find(graph: ir.Graph | ir.Function) -> list[Statistics]:
    """Every norm-like candidate of ``graph`` (not of its subgraphs: each is a scope of its own), in graph order."""
    found = []
    for node in graph:
        if float_op(node) in _FIRST_MOMENT or float_op(node) in _SQUARING:
            if (stats := _candidate(node)) is not None:
                found.append(stats)
    return found


def _candidate(reduce: ir.Node) -> Statistics | None:
    squared = _squared(reduce)
    if squared is None:
        return None
    base, spell_square, squaring = squared
    centring = _centring(base)
    means = [centring[0]] if centring else []
    spelling = [f"mean {_chain(*centring)}"] if centring else []
    walk = _walk(reduce)
    if walk is None:
        return None
    inverse, path, one_pass = walk
    square_phrase = spell_square("x − mean" if centring else "x")
    if one_pass is not None and not centring:
        means.append(one_pass[0])
        spelling.append(f"mean {_chain(*one_pass)}")
        square_phrase = f"one-pass E[x²] − E[x]², E[x²] = {square_phrase}"
    spelling.append(f"{'variance' if means else 'mean square'} {square_phrase}"
                    + (f" → {' → '.join(_label_op(n) for n in path)}" if path else ""))
    for mean in _numerator_means(inverse, path):
        if mean not in means:
            means.append(mean)
    kind = "centred" if means else "uncentred"
    nodes = list(dict.fromkeys([*means, reduce, *path]))
    # every step between the norm's input and the inverse root: a rounding at any of them is inside the norm
    inside = [*means, *squaring, reduce, *path]
    if centring:
        inside += [*centring[1], *_views(base)]
    if one_pass is not None and not centring:
        inside += one_pass[1]
    quantizers = [n for n in dict.fromkeys(inside) if rounds(n)] + _rounded_inverse(inverse)
    return Statistics(kind, reduce, means, inverse, nodes, spelling, quantizers)


# ---- looking back: what is reduced -------------------------------------------------------------------------------

def _producer(value: ir.Value | None) -> ir.Node | None:
    """The producer of ``value`` past views (Cast, Identity, a quantization round trip...)."""
    node = value.producer() if value is not None else None
    for _ in range(_BACK_STEPS):
        if node is None or onnx_op(node) not in _VIEWS or not node.inputs:
            return node
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return node


def _views(value: ir.Value | None) -> list[ir.Node]:
    """The views ``_producer`` looks through from ``value``, nearest first."""
    passed = []
    node = value.producer() if value is not None else None
    while node is not None and len(passed) < _BACK_STEPS and onnx_op(node) in _VIEWS and node.inputs:
        passed.append(node)
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return passed


def _same(a: ir.Value | None, b: ir.Value | None) -> bool:
    """The same tensor, up to views (a Sub that reads x through a Cast the square also reads through)."""
    return a is b or (a is not None and b is not None and (p := _producer(a)) is not None and p is _producer(b))


def _squared(reduce: ir.Node) -> tuple[ir.Value, Callable[[str], str], list[ir.Node]] | None:
    """What ``reduce`` reduces the square of, how to spell that given the words for it, and the nodes from the
    square to the reduction; None when it is not a second moment."""
    reduced = operands(reduce)[0] if reduce.inputs else None
    if reduced is None:
        return None
    if float_op(reduce) in _SQUARING:
        return reduced, lambda d: _call(reduce, d), []
    square = _producer(reduced)
    if square is None:
        return None
    factors = operands(square)
    if len(factors) < 2:
        return None
    steps = [square, *_views(reduced)]
    if float_op(square) == "Pow" and _constant(factors[1]) == 2.0:
        return factors[0], lambda d: _call(reduce, f"Pow({d}, 2)"), steps
    if float_op(square) == "Mul" and _same(factors[0], factors[1]):
        return factors[0], lambda d: _call(reduce, f"{op_name(square)}({d}, {d})"), steps
    return None


def _centring(base: ir.Value) -> tuple[ir.Node, list[ir.Node]] | None:
    """The mean ``base`` is centred by (x − mean, or mean − x), with the nodes from the mean to the Sub."""
    sub = _producer(base)
    if sub is None or not is_op(sub, "Sub") or len(sub.inputs) != 2:
        return None
    for operand in (sub.inputs[1], sub.inputs[0]):
        found = _mean_behind(operand, _BACK_STEPS)
        if found is not None:
            return found
    return None


def _mean_behind(value: ir.Value | None, budget: int) -> tuple[ir.Node, list[ir.Node]] | None:
    """The first-moment reduction ``value`` is, up to views and scalings (a sum × 1/N or / N, N a constant or
    computed at run time, guarded by a Where), with the nodes between, nearest the reduction first."""
    node = value.producer() if value is not None else None
    if node is None or budget <= 0:
        return None
    op = float_op(node)
    if op in _FIRST_MOMENT:
        return node, []
    if op in _VIEWS or op == "Div":
        scaled = node.inputs[:1]
    elif op == "Mul":
        factors = operands(node)
        scaled = [v for v in factors if v is not None and static_value(v) is None] or factors
    elif op == "Where":
        scaled = operands(node)[1:]
    else:
        return None
    for operand in scaled:
        found = _mean_behind(operand, budget - 1)
        if found is not None:
            return found[0], [*found[1], node]
    return None


def _square_of_mean(value: ir.Value | None) -> tuple[ir.Node, list[ir.Node]] | None:
    """E[x]² of the one-pass variance: Mul(m, m) or Pow(m, 2), m a mean."""
    node = _producer(value)
    factors = operands(node) if node is not None else []
    if len(factors) < 2:
        return None
    if (float_op(node) == "Mul" and _same(factors[0], factors[1])) or \
            (float_op(node) == "Pow" and _constant(factors[1]) == 2.0):
        return _mean_behind(factors[0], _BACK_STEPS)
    return None


def _numerator_means(inverse: ir.Node, path: list[ir.Node]) -> list[ir.Node]:
    """The means that centre what the inverse root scales (x − mean in (x − mean) / std), and the mean
    BatchNormalization is handed: a variance with a mean of its own still normalizes x − that mean."""
    if is_op(inverse, "BatchNormalization"):
        found = _mean_behind(inverse.inputs[3], _BACK_STEPS) if len(inverse.inputs) > 3 else None
        return [found[0]] if found else []
    scaled: list[ir.Value | None] = []
    if is_op(inverse, "Div"):
        scaled.append(inverse.inputs[0])
    else:
        for reader, index in itertools.islice(_readers(inverse), 8):
            factors, index = operands(reader), operand_index(reader, index)
            if float_op(reader) in ("Mul", "Div") and len(factors) == 2 and index is not None:
                scaled.append(factors[1 - index])
    means = []
    for value in scaled:
        node = _producer(value)
        if node is not None and float_op(node) == "Mul":  # gamma · (x − mean)
            candidates = [_producer(v) for v in operands(node)]
        else:
            candidates = [node]
        for sub in candidates:
            if sub is not None and is_op(sub, "Sub") and (found := _centring(sub.outputs[0])) is not None:
                means.append(found[0])
    return means


def _readers(inverse: ir.Node) -> list[tuple[ir.Node, int]]:
    """The readers of ``inverse``'s output, and through a quantizer after it, the QOperator op reading its result
    (1/σ rounded, then multiplied by QLinearMul)."""
    found = []
    for reader, index in itertools.islice((use for out in inverse.outputs for use in out.uses()), 8):
        if is_op(reader, "QuantizeLinear") and reader.outputs:
            found += itertools.islice(reader.outputs[0].uses(), 8)
        else:
            found.append((reader, index))
    return found


def _rounded_inverse(inverse: ir.Node) -> list[ir.Node]:
    """The quantizers that round 1/σ itself (the inverse root before anything multiplies it), and the QOperator ops
    that read them. A quantizer after (x − mean) / σ is not one: it rounds the norm's output, as it would round a
    fused op's."""
    if not (is_op(inverse, "Reciprocal") or (is_op(inverse, "Pow") and len(inverse.inputs) > 1)
            or (is_op(inverse, "Div") and _constant(inverse.inputs[0]) is not None)):
        return []
    found = []
    for reader, _ in itertools.islice((use for out in inverse.outputs for use in out.uses()), 8):
        if is_op(reader, "QuantizeLinear"):
            found.append(reader)
            found += [user for user, _ in itertools.islice(reader.outputs[0].uses(), 8) if rounds(user)]
    return list(dict.fromkeys(found))


# ---- looking forward: does it reach an inverse root --------------------------------------------------------------

def _walk(reduce: ir.Node) -> tuple[ir.Node, list[ir.Node], tuple[ir.Node, list[ir.Node]] | None] | None:
    """Breadth first from the second moment through ``_CARRY`` ops to the first inverse root or division by a
    root: (that node, the path to it, the mean of a one-pass variance met on the way). None if none is reached
    within ``_FORWARD_NODES`` nodes."""
    rooted = is_op(reduce, "ReduceL2")
    # (value, a root taken on the way, the path of nodes to it)
    frontier: list[tuple[ir.Value, bool, tuple[ir.Node, ...]]] = [(reduce.outputs[0], rooted, ())]
    seen: set[tuple[ir.Node, bool]] = set()
    one_pass = None
    while frontier:
        following = []
        for value, root, path in frontier:
            for reader, at in value.uses():
                # a QOperator op is read as its float op (QLinearAdd of variance and epsilon: an Add that rounds)
                index = operand_index(reader, at)
                if (reader, root) in seen or float_op(reader) is None or index is None:
                    continue
                seen.add((reader, root))
                if len(seen) > _FORWARD_NODES:  # a value read by thousands of nodes is no norm's statistic
                    return None
                op = float_op(reader)
                if _reaches_inverse(reader, index, root):
                    return reader, [*path, reader], one_pass
                if op == "Sub" and index == 0 and one_pass is None:
                    one_pass = _square_of_mean(operands(reader)[1])
                if op not in _CARRY or reader.outputs[0] is None:
                    continue
                takes_root = op == "Sqrt" or (op == "Pow" and _constant(reader.inputs[1]) == 0.5)
                following.append((reader.outputs[0], root or takes_root, (*path, reader)))
        frontier = following
    return None


def _reaches_inverse(node: ir.Node, index: int, rooted: bool) -> bool:
    op = onnx_op(node)
    if op == "BatchNormalization":
        return index == 4  # its variance: BatchNormalization computes (x − mean) / sqrt(var + eps)
    if op == "Pow":
        exponent = _constant(node.inputs[1]) if index == 0 else None
        return exponent is not None and (exponent == -0.5 or (rooted and exponent < 0))
    return rooted and ((op == "Div" and index == 1) or op == "Reciprocal")


# ---- words --------------------------------------------------------------------------------------------------------

def _constant(value: ir.Value | None) -> float | None:
    array = static_value(value) if value is not None else None
    if array is None or array.size != 1:
        return None
    return float(np.asarray(array, dtype=np.float64).reshape(-1)[0])


def _label_op(node: ir.Node) -> str:
    """The op as the report names it in a spelling: a reduction with its keepdims=0, a Reshape to a shape known
    only at run time, a Pow's exponent."""
    op = op_name(node)
    if op.startswith("Reduce") and _keeps_no_dims(node):
        return f"{op}(keepdims=0)"
    if op in ("Reshape", "Expand") and len(node.inputs) > 1 and static_value(node.inputs[1]) is None:
        return f"{op}(run-time shape)"
    if op == "Pow" and (exponent := _constant(node.inputs[1])) is not None:
        return f"Pow({exponent:g})"
    return op


def _keeps_no_dims(node: ir.Node) -> bool:
    keep = node.attributes.get("keepdims")
    return keep is not None and not keep.is_ref() and keep.value == 0


def _call(reduce: ir.Node, operand: str) -> str:
    return f"{reduce.op_type}({operand}{', keepdims=0' if _keeps_no_dims(reduce) else ''})"


def _chain(reduce: ir.Node, path: list[ir.Node]) -> str:
    return " → ".join([_call(reduce, "x"), *(_label_op(n) for n in path)])


def _over(reduce: ir.Node) -> str:
    """'over axis 1 of rank 3', 'over axes [-1]', 'over axes computed at run time'."""
    x = reduce.inputs[0] if reduce.inputs else None
    rank = len(x.shape) if x is not None and x.shape is not None else None
    if float_op(reduce) == "GlobalAveragePool":
        last = reduce.attributes.get("channels_last")  # QLinearGlobalAveragePool's NHWC layout
        channels_last = last is not None and not last.is_ref() and last.value == 1
        axes = (list(range(1, rank - 1)) if channels_last else list(range(2, rank))) if rank is not None else None
        if axes is None:
            return f"over every axis {'but the first and last' if channels_last else 'after the second'}"
    else:
        attr = reduce.attributes.get("axes")
        if attr is not None and not attr.is_ref():
            axes = list(attr.value)
        elif len(reduce.inputs) > 1 and reduce.inputs[1] is not None:
            found = static_value(reduce.inputs[1])
            if found is None:
                return "over axes computed at run time"
            axes = [int(a) for a in np.asarray(found).reshape(-1)]
        else:
            return "over every axis"
    if rank is not None:
        axes = sorted(a % rank if rank else a for a in axes)
    words = f"axis {axes[0]}" if len(axes) == 1 else f"axes {axes}"
    return f"over {words}" + (f" of rank {rank}" if rank is not None else "")
