"""Which quantizers a value reaches: the graph property behind "a quantized value never moves unless asked".

A fused op computes what its region computes, but rounds differently (differences of an ulp or so). In front of a
quantizer, such a difference moves a quantized value by a whole step wherever the float value lies within an ulp
of a rounding boundary: rare enough that a few verification inputs show nothing, common enough that a real input
stream does. So whether a rewrite may change a quantized value is decided here from the graph alone: a value
reaches a quantizer when some path of readers leads from it to a node that quantizes what it reads, whatever the
ops on the way and however far, through subgraphs (outer-scope reads, and a body's outputs to its node's outputs)
and model-local functions (a call's inputs into the body, the body's outputs to every call). A path ends at the
first quantizer: what that quantizer writes is already a quantized value that moved.

The walk is conservative where the graph alone cannot tell: every output of a reader counts as depending on every
input (a Where's condition, an ArgMax's indices, a Cast to int32 all carry a difference on), except readers whose
outputs depend only on shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from lnfuse.index.ops import ONNX_DOMAINS, is_op, known_op, onnx_op
from lnfuse.index.traversal import every_node, subgraphs

#: element types a quantizer writes: integers of 16 bits or fewer and the 8-bit floats
QUANTIZED = frozenset({ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.INT16, ir.DataType.UINT16,
                       ir.DataType.INT4, ir.DataType.UINT4, ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E4M3FNUZ,
                       ir.DataType.FLOAT8E5M2, ir.DataType.FLOAT8E5M2FNUZ, ir.DataType.FLOAT4E2M1})
#: ONNX Runtime contrib ops that quantize a float input inside the kernel and output floats
_QUANTIZE_INSIDE = frozenset({"DynamicQuantizeMatMul", "DynamicQuantizeLSTM"})
#: readers whose outputs depend on their input's shape, never on its values
_SHAPE_ONLY = frozenset({"Shape", "Size"})
#: MatMulNBits' accuracy level at which ONNX Runtime quantizes the activation to int8 blocks
_INT8_ACCURACY = 4


def quantizes(node: ir.Node) -> bool:
    """Whether ``node`` rounds a float it reads to a quantized grid: QuantizeLinear and DynamicQuantizeLinear, any
    op that writes quantized integers from a float (a QLinear op's scales, a Cast to int8), and the contrib ops that
    quantize their activation inside (DynamicQuantizeMatMul, MatMulNBits at accuracy level 4)."""
    if is_op(node, "QuantizeLinear", "DynamicQuantizeLinear") or \
            is_op(node, "QuantizeLinear", "DynamicQuantizeLinear", *_QUANTIZE_INSIDE, domain="com.microsoft"):
        return True
    if is_op(node, "MatMulNBits", domain="com.microsoft"):
        level = node.attributes.get("accuracy_level")
        return level is not None and not level.is_ref() and level.as_int() >= _INT8_ACCURACY
    if known_op(node) is None:
        return False  # a model-local function: the walk goes into its body instead
    if is_op(node, "Cast") and (to := node.attributes.get("to")) is not None and not to.is_ref():
        return ir.DataType(to.as_int()) in QUANTIZED  # the output's type, even where inference left it unknown
    reads_float = any(v is not None and v.dtype is not None and v.dtype.is_floating_point() for v in node.inputs)
    return reads_float and any(v.dtype in QUANTIZED for v in node.outputs)


@dataclass(frozen=True)
class Reached:
    """The first quantizer on a path from a changed value, and how many readers the path crossed before it."""

    quantizer: ir.Node
    hops: int


class QuantizerReach:
    """The model's structure the walk needs beyond each value's readers: which node owns each subgraph, and each
    model-local function's body and call sites. Built once per model; rewrites replace nodes inside graphs, never
    subgraphs or calls, so it stays right while the model is rewritten."""

    def __init__(self, model: ir.Model):
        self._owner: dict[int, ir.Node] = {}
        self._functions = dict(model.functions)
        self._calls: dict[ir.OperatorIdentifier, list[ir.Node]] = {}
        self._body_of: dict[int, ir.OperatorIdentifier] = {}
        for key, function in self._functions.items():
            self._body_of[id(function.graph)] = key
        #: a model with no quantizer anywhere (a float model) needs no walk
        self._none = True
        for graph in [model.graph, *self._functions.values()]:
            for node in every_node(graph):
                self._none = self._none and not quantizes(node)
                for sub in subgraphs(node):
                    self._owner[id(sub)] = node
                if (key := _call_key(node)) in self._functions:
                    self._calls.setdefault(key, []).append(node)

    def first_quantizers(self, values: list[ir.Value]) -> list[Reached]:
        """Each quantizer the ``values`` reach first, nearest first (breadth-first: the shortest path to each)."""
        if self._none:
            return []
        seen: set[ir.Value] = set(values)
        frontier, found, hops = list(values), {}, 0
        while frontier:
            following = []
            for value in frontier:
                for reader in self._readers(value):
                    if quantizes(reader):
                        found.setdefault(reader, Reached(reader, hops))
                    elif onnx_op(reader) not in _SHAPE_ONLY:
                        following.extend(v for v in self._carried(reader, value) if v not in seen)
                following.extend(v for v in self._beyond(value) if v not in seen)
            seen.update(following)
            frontier, hops = following, hops + 1
        return list(found.values())

    def _readers(self, value: ir.Value) -> list[ir.Node]:
        return [node for node, _ in value.uses()]

    def _carried(self, reader: ir.Node, value: ir.Value) -> list[ir.Value]:
        """Where a difference in ``value`` goes once ``reader`` reads it: the reader's outputs; for a Loop or Scan
        given it as a state or sequence, every input of its bodies; for a call of a model-local function, the
        body's inputs it binds."""
        out = [v for v in reader.outputs if v is not None]
        out += [v for sub in subgraphs(reader) for v in sub.inputs]
        key = _call_key(reader)
        if key in self._functions:
            body = self._functions[key]
            out += [body.inputs[i] for i, v in enumerate(reader.inputs) if v is value and i < len(body.inputs)]
        return out

    def _beyond(self, value: ir.Value) -> list[ir.Value]:
        """Where a graph output leads: a subgraph's to its node's outputs (and, for a loop body, back into its
        inputs on the next iteration); a function body's to the matching output of every call."""
        if not value.is_graph_output():
            return []
        graph = value.graph
        owner = self._owner.get(id(graph))
        if owner is not None:
            loops_back = list(graph.inputs) if is_op(owner, "Loop", "Scan") else []
            return [v for v in owner.outputs if v is not None] + loops_back
        key = self._body_of.get(id(graph))
        if key is None:
            return []
        index = list(graph.outputs).index(value)
        return [call.outputs[index] for call in self._calls.get(key, ()) if index < len(call.outputs)]


def _call_key(node: ir.Node) -> ir.OperatorIdentifier | None:
    """The function a node calls, were the model to define one under that key. A node of an ONNX domain runs
    ONNX's op whatever functions the model holds (``lnfuse.index.ops``)."""
    if node.domain in ONNX_DOMAINS:
        return None
    return (node.domain, node.op_type, node.overload)
