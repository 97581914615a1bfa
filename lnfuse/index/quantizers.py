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
input (a Where's condition, an ArgMax's indices carry a difference on), except readers whose outputs depend only on
shapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from lnfuse.index.ops import ONNX_DOMAINS, is_op, known_op, onnx_op, op_key, ort_op, ort_schemas
from lnfuse.index.traversal import every_node, subgraphs

#: element types a quantizer writes: integers of 16 bits or fewer and the 8-bit floats
QUANTIZED = frozenset({ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.INT16, ir.DataType.UINT16,
                       ir.DataType.INT4, ir.DataType.UINT4, ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E4M3FNUZ,
                       ir.DataType.FLOAT8E5M2, ir.DataType.FLOAT8E5M2FNUZ, ir.DataType.FLOAT4E2M1})
#: ONNX Runtime contrib ops that quantize a float input inside the kernel and output floats
_QUANTIZE_INSIDE = frozenset({"DynamicQuantizeMatMul", "DynamicQuantizeLSTM"})
#: readers whose outputs depend on their input's shape, never on its values
_SHAPE_ONLY = frozenset({"Shape", "Size"})
#: ops that round a float to whole numbers: a quantizer written out in float ops (x / s, Round, Clip, * s)
_TO_WHOLE = frozenset({"Round", "Floor", "Ceil"})
#: MatMulNBits' accuracy level at which ONNX Runtime quantizes the activation to int8 blocks; its variants
#: (MatMulNBitsQLoRA, MatMulNBitsQkv, MatMulNBitsMlp, QMoE) take the attribute with the same policy
_INT8_ACCURACY = 4
#: GroupQueryAttention's attributes asking for a quantized KV cache ("NONE" by default)
_CACHE_QUANTIZATION = ("k_quant_type", "v_quant_type")
#: MatMulBlockQuantizedFp8Weight's optional activation scale: its input index
_FP8_A_SCALE = 3


def quantizes(node: ir.Node) -> bool:
    """Whether ``node`` rounds a float it reads to a quantized grid: QuantizeLinear and DynamicQuantizeLinear, any
    op that writes quantized integers from a float (a QLinear op's scales, a CastLike to int8, a Cast to any
    integer or bool), Round, Floor and Ceil, and the contrib ops that quantize their activation inside
    (DynamicQuantizeMatMul, any op at accuracy level 4).

    Where the graph does not say (an attribute the caller of a function picks, a type onnx's inference could not
    give: inside an attribute-parametric function, after a contrib op), the answer is yes whenever the node could
    quantize: a norm left unfused costs a little speed, a quantized value that moves breaks the promise."""
    if is_op(node, "QuantizeLinear", "DynamicQuantizeLinear") or \
            is_op(node, "QuantizeLinear", "DynamicQuantizeLinear", *_QUANTIZE_INSIDE, domain="com.microsoft"):
        return True
    if ort_op(node) is not None and (level := node.attributes.get("accuracy_level")) is not None and \
            (level.is_ref() or level.as_int() >= _INT8_ACCURACY):
        return True
    # a quantized KV cache: the new keys and values are quantized into it, and the attention reads them there
    if is_op(node, "GroupQueryAttention", domain="com.microsoft") and \
            any(_asks(node.attributes.get(name), "NONE") for name in _CACHE_QUANTIZATION):
        return True
    # given a_scale, the activation is rounded to float8 e4m3 before the product (W8A8)
    if is_op(node, "MatMulBlockQuantizedFp8Weight", domain="com.microsoft") and \
            len(node.inputs) > _FP8_A_SCALE and node.inputs[_FP8_A_SCALE] is not None:
        return True
    if known_op(node) is None:
        # an op of a domain lnfuse does not know (a call of a model-local function is walked into instead, by
        # ``QuantizerReach``): it may compute anything, so it quantizes when an output is, or may be, quantized
        return any(v.dtype is None or v.dtype in QUANTIZED for v in node.outputs)
    if onnx_op(node) in _TO_WHOLE:
        return True
    if is_op(node, "Cast") and (to := node.attributes.get("to")) is not None:
        if (source := _dtype(node.inputs[0] if node.inputs else None)) is not None and not source.is_floating_point():
            return False  # from integers (ArgMax's indices, a shape): nothing is rounded
        # the type it writes, even where not inferred: any integer (a truncation to a grid of step 1), a bool (a
        # threshold) or an 8-bit float
        if to.is_ref():
            return True
        target = ir.DataType(to.as_int())
        return target in QUANTIZED or not target.is_floating_point()
    if is_op(node, "CastLike") and len(node.inputs) > 1:
        like = _dtype(node.inputs[1])
        return like is None or like in QUANTIZED
    reads_float = any(v is not None and (v.dtype is None or v.dtype.is_floating_point()) for v in node.inputs)
    return reads_float and any(v.dtype in QUANTIZED if v.dtype is not None else _writes_quantized(node, i)
                               for i, v in enumerate(node.outputs))


def _asks(attribute: ir.Attr | None, off: str) -> bool:
    """Whether a string attribute is set to anything but ``off``, or left to the caller of a function."""
    return attribute is not None and (attribute.is_ref() or attribute.as_string() != off)


def _dtype(value: ir.Value | None) -> ir.DataType | None:
    """The element type of ``value``, or of the constant a Constant node writes into it (a function body's
    literals are typed only by their tensor), or None."""
    if value is None:
        return None
    if value.dtype is not None:
        return value.dtype
    producer = value.producer()
    if is_op(producer, "Constant") and (tensor := producer.attributes.get("value")) is not None \
            and not tensor.is_ref():
        return tensor.as_tensor().dtype
    return None


def _writes_quantized(node: ir.Node, index: int) -> bool:
    """Whether the op's schema allows output ``index`` no type but quantized ones (a QLinear op's output), for an
    output whose type is unknown."""
    allowed = _output_types(*op_key(node))
    return index < len(allowed) and allowed[index] is not None and allowed[index] <= _QUANTIZED_TYPE_STRS


_QUANTIZED_TYPE_STRS = frozenset(f"tensor({t.name.lower()})" for t in QUANTIZED)


@functools.cache
def _output_types(domain: str, name: str) -> tuple[frozenset[str] | None, ...]:
    """The type strings each output of op ``(domain, name)`` may have, from onnx's schemas or ONNX Runtime's (the
    contrib ops); empty for an op neither knows."""
    try:
        schema = onnx.defs.get_schema(name, domain=domain)
        outputs = [o.type_str for o in schema.outputs]
        constraints = {t.type_param_str: t.allowed_type_strs for t in schema.type_constraints}
    except onnx.defs.SchemaError:
        schema = ort_schemas().get((domain, name))
        if schema is None:
            return ()
        outputs = [o.typeStr for o in schema.outputs]
        constraints = {t.type_param_str: t.allowed_type_strs for t in schema.type_constraints}
    return tuple(frozenset(constraints.get(t, [t])) for t in outputs)


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
                self._none = self._none and not self._quantizes(node)
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
                    if self._quantizes(reader):
                        found.setdefault(reader, Reached(reader, hops))
                    elif onnx_op(reader) not in _SHAPE_ONLY:
                        following.extend(v for v in self._carried(reader, value) if v not in seen)
                following.extend(v for v in self._beyond(value) if v not in seen)
            seen.update(following)
            frontier, hops = following, hops + 1
        return list(found.values())

    def _quantizes(self, node: ir.Node) -> bool:
        """``quantizes``, but a call of a model-local function is not judged by its outputs: its body is walked."""
        if known_op(node) is None and _call_key(node) in self._functions:
            return False
        return quantizes(node)

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
