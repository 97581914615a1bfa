"""Measured proof: run each matched region and its replacement in ONNX Runtime on the same inputs.

Regions are cut out as tiny models and batched: one session runs every original region of a pass, one runs every
replacement. Graph optimizations are off, so ORT does not fuse the original for us. Inputs are random with some
rows of very small variance (a wrong epsilon only shows there) and some with a large offset (a wrong centring only
shows there); symbolic dims get concrete sizes, the same size for the same name.
"""

from __future__ import annotations

import ast
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from lnfuse.index.constants import is_static, static_value
from lnfuse.load.gate import Gate, ort_initializers
from lnfuse.match.pattern import attr_value
from lnfuse.match.rule import Replacement
from lnfuse.index.ops import is_op, known_op, onnx_op

#: (atol, rtol) by the dtype of the compared output
TOLERANCE = {
    ir.DataType.DOUBLE: (1e-9, 1e-7),
    ir.DataType.FLOAT: (1e-4, 1e-3),
    ir.DataType.FLOAT16: (1e-2, 1e-2),
    ir.DataType.BFLOAT16: (6e-2, 3e-2),
}
_SMALL_SCALE = {ir.DataType.DOUBLE: 1e-4, ir.DataType.FLOAT: 1e-4, ir.DataType.FLOAT16: 3e-3,
                ir.DataType.BFLOAT16: 3e-2}
_SIZES = (2, 3, 5, 4, 6, 7)
#: when the original region cannot run at the sizes drawn (a 2-row position table read at sequence length 3), its
#: free symbolic dims, in order, cycle through each of these instead; neighbours always differ, so a batch dim taken
#: for a sequence dim still shows
_FALLBACK = ((1, 2), (2, 1))
#: regions per ORT session: one session for many regions saves the per-session cost, but ORT's session setup grows
#: faster than linearly with the graph, so very large batches are split
_BATCH = 48
_LARGE = 1 << 16
#: lookup ids are drawn from the first rows of a table; only those rows get random values, so verifying a
#: 30,000-row embedding costs a few kilobytes instead of a full random table per region
_TABLE_ROWS = 64
#: ops that carry lookup ids through unchanged in value
ID_MOVES = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand"})
#: nodes a region may borrow from its graph to compute what both of its sides read
_MAX_PRELUDE = 48
_INTEGERS = (ir.DataType.INT64, ir.DataType.INT32)
_HALF = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_MAX_DIM = 4096
#: the most the inputs of one ORT verification run may take: a region (or a batch of regions) needing more is
#: verified on fewer rows, or not at all
BUDGET = 256 << 20


#: ops a fused output may pass through, element by element, on its way to a QuantizeLinear that is then compared
#: too: each maps an element to an element, so a rounding difference reaches the quantizer where it stood
ELEMENTWISE = frozenset({"Identity", "Cast", "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "LeakyRelu", "Clip",
                         "Sigmoid", "HardSigmoid", "Tanh", "Erf", "Exp", "Sqrt", "Pow", "Max", "Min", "Elu", "Selu",
                         "Softplus", "Gelu", "Where"})
#: how many elementwise ops the walk to a quantizer crosses: exporters put at most an activation or a scale between
#: a norm and the QuantizeLinear of the next MatMul
_QUANT_WALK = 4


@dataclass
class Requantized:
    """What one QuantizeLinear after a fused region gave on the verification inputs, original against fused."""

    quantizer: str
    output: str
    moved: int
    total: int
    steps: int
    float_error: float

    def describe(self) -> str:
        return (f"'{self.output}' reaches QuantizeLinear '{self.quantizer}': {self.moved} of {self.total} quantized "
                f"values moved (by up to {self.steps} step(s)) on the verification inputs; the float values it "
                f"quantizes differ by up to {self.float_error:.3g}")


@dataclass
class Outcome:
    ok: bool
    max_error: float
    detail: str
    #: the quantizers after the region, compared too; a float difference there may move quantized values
    requantized: list[Requantized] = field(default_factory=list)


class Unverifiable(Exception):
    """The region cannot be run on its own (unknown shapes or dtypes)."""


def verify(replacements: Sequence[Replacement], opsets: dict[str, int], ir_version: int,
           position: Mapping[ir.Node, float], seed: int = 0) -> list[Outcome]:
    """One outcome per replacement, in order. Batches them; on a batch failure, checks them one by one.
    ``position`` orders the nodes of the graph the replacements are in.

    A region whose output reaches a QuantizeLinear (through a few elementwise ops with constant operands) is also
    compared after the quantizer, and the outcome says how many quantized values moved: evidence for the report,
    never a clearance (the engine refuses such a rewrite from the graph alone unless requantization is allowed)."""
    if not replacements:
        return []
    prepared, outcomes = [], [None] * len(replacements)
    for i, rep in enumerate(replacements):
        try:
            prepared.append((i, _Region(rep, f"c{i}__", seed + i, position)))
        except Unverifiable as error:
            outcomes[i] = Outcome(False, float("nan"), f"cannot verify: {error}")
    for batch in _batches(prepared):
        try:
            for (i, _), outcome in zip(batch, _run([r for _, r in batch], opsets, ir_version)):
                outcomes[i] = outcome
        except _Failed as failure:  # each region alone, to tell which failed (a batch of one has failed alone)
            for i, region in batch:
                outcomes[i] = _after(region, failure, opsets, ir_version) if len(batch) == 1 else \
                    _alone(region, opsets, ir_version)
    return outcomes


def _alone(region: "_Region", opsets: dict[str, int], ir_version: int) -> Outcome:
    """One region's outcome, run by itself."""
    try:
        return _run([region], opsets, ir_version)[0]
    except _Failed as failure:
        return _after(region, failure, opsets, ir_version)


def _after(region: "_Region", error: _Failed, opsets: dict[str, int], ir_version: int) -> Outcome:
    """The outcome of a region whose run by itself failed with ``error``. When its original side cannot run at the
    sizes drawn, those sizes are outside what the model accepts (a 2-row position table read at sequence length
    3): it is then measured at every small size pattern in ``_FALLBACK`` where the original runs, and must agree at
    each; a replacement that fails where the original runs is refused."""
    if error.fused or not region.free:
        return _not_run(error)
    measured = []
    for palette in _FALLBACK:
        try:
            region.resize(palette)
            measured.append(_run([region], opsets, ir_version)[0])
        except Unverifiable as unverifiable:
            return Outcome(False, float("nan"), f"cannot verify: {unverifiable}")
        except _Failed as failure:
            if failure.fused:
                return _not_run(failure)
    if not measured:
        return _not_run(error)
    failed = [o for o in measured if not o.ok]
    return Outcome(not failed, max(o.max_error for o in measured), failed[0].detail if failed else "",
                   [q for o in measured for q in o.requantized])


def _not_run(failure: Exception) -> Outcome:
    return Outcome(False, float("nan"), f"ORT could not run it: {failure}")


class _Failed(Exception):
    """ORT could not build or run one side of a verification run; the message is ORT's last line."""

    def __init__(self, fused: bool, error: Exception):
        super().__init__(_first_line(error))
        self.fused = fused


def _batches(prepared: list[tuple[int, "_Region"]]) -> Iterator[list[tuple[int, "_Region"]]]:
    """Consecutive regions, at most ``_BATCH`` of them and ``BUDGET`` bytes of inputs per run."""
    batch, size = [], 0
    for item in prepared:
        if batch and (len(batch) == _BATCH or size + item[1].size > BUDGET):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item[1].size
    if batch:
        yield batch


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return (text.splitlines() or [type(error).__name__])[-1][:300]


class _Region:
    """One replacement cut out of its graph: the old nodes and the new nodes, reading the same inputs."""

    def __init__(self, rep: Replacement, prefix: str, seed: int, position: Mapping[ir.Node, float]):
        self.prefix = prefix
        self.rep = rep
        new_reads = _reads(rep.nodes, {v for n in rep.nodes for v in n.outputs})
        produced_old = {v for n in rep.region for v in n.outputs}
        old_reads = _reads(rep.region, produced_old)
        ids = {n.inputs[1] for n in rep.region if is_op(n, "Gather")}
        self.shapes_of: dict[ir.Value, ir.Node] = {}
        prelude, context = _shared_context(old_reads, new_reads, produced_old, ids, self.shapes_of)
        order = lambda n: position.get(n, len(position))  # noqa: E731
        old_nodes = sorted(prelude + context + list(rep.region), key=order)
        self.new_nodes = sorted(prelude, key=order) + list(rep.nodes)
        reads = _reads(old_nodes, {v for n in old_nodes for v in n.outputs}) + \
            _reads(self.new_nodes, {v for n in self.new_nodes for v in n.outputs})
        # lookup tables are never read to verify: the region computes the same for any table contents
        tables = _tables(old_nodes)
        self.inputs, self.constants, seen = [], [], set()
        for value in reads:
            if value in seen:
                continue
            seen.add(value)
            if is_static(value) and not _large(value) and value not in tables:
                self.constants.append(value)
            else:
                self.inputs.append(value)
        self.pairs = list(rep.outputs.items())
        #: (pair index, walked nodes, QuantizeLinear) for each quantizer a fused output reaches
        self.quantizers = [(i, walk, q) for i, (old, _) in enumerate(self.pairs) for walk, q in _quantizers(old)]
        for _, walk, q in self.quantizers:
            for value in (v for n in walk + [q] for v in n.inputs if v is not None and is_static(v)):
                if value not in seen:
                    seen.add(value)
                    self.constants.append(value)
        self.old_nodes = old_nodes
        self.tables = tables
        # integer inputs used as Gather indices get valid indices for their table
        self.bounds = _id_bounds(old_nodes)
        self.dtypes = {v: self._dtype(v) for v in self.inputs}
        self.size, self.seed = 0, seed
        #: sizes given to symbolic dims before any is drawn (see ``resize``), and the names drawn
        self.preset: dict[str, int] = {}
        self.free: list[str] = []
        self.feeds = self._feeds(np.random.default_rng(seed))

    def resize(self, palette: Sequence[int]) -> None:
        """New feeds with the free symbolic dims (plain names, not expressions of others), in order, cycling
        through the sizes of ``palette``."""
        self.preset = {name: palette[i % len(palette)] for i, name in enumerate(self.free)}
        self.feeds = self._feeds(np.random.default_rng(self.seed))

    def _dtype(self, value: ir.Value) -> ir.DataType:
        """A region input's dtype; an input typed by nothing (a loop body's carried value when inference could
        not follow the loop) takes the dtype of the fused op's scale, which the op requires it to share."""
        dtype = value.dtype
        if dtype is None:
            scale = _scale(self.rep)
            dtype = scale.dtype if scale is not None else None
        # UNDEFINED (0) is what a tensor of no element type declares: no input of that type can be made
        if dtype is None or dtype == ir.DataType.UNDEFINED:
            raise Unverifiable(f"the dtype of '{value.name}' is unknown")
        return dtype

    def _feeds(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Random inputs of concrete shapes within ``BUDGET``: first the shapes the graph gives (symbolic dims
        small); over the budget, the norm's rows shrunk to a few (the fused op is row-wise and the checks proved
        the region computes the same norm on every row); still over it, the region is not verified."""
        shapes = self._plan({})
        if _bytes(shapes, self.dtypes) > BUDGET:
            shapes = self._plan(_row_shrink(self.rep))
            if _bytes(shapes, self.dtypes) > BUDGET:
                value = max(shapes, key=lambda v: _bytes({v: shapes[v]}, self.dtypes))
                raise Unverifiable(
                    f"its inputs would take {_bytes(shapes, self.dtypes) / 2**20:,.0f} MiB ('{value.name}' is "
                    f"{shapes[value]}), over the {BUDGET >> 20} MiB verification budget even with the norm's rows "
                    "cut to a few (the normalized axes cannot be cut)")
        self.size = _bytes(shapes, self.dtypes)
        feeds = {}
        for value, shape in shapes.items():
            dtype = self.dtypes[value]
            if value in self.shapes_of:
                feeds[self.prefix + value.name] = np.array(shape, dtype=np.int64)
            elif value in self.tables and shape:
                feeds[self.prefix + value.name] = _random_table(rng, dtype, shape, self.tables[value])
            else:
                feeds[self.prefix + value.name] = _random(rng, dtype, shape, self.bounds.get(value))
        return feeds

    def _plan(self, shrink: Mapping[int, int]) -> dict[ir.Value, list[int]]:
        """The concrete shape of every input (for a ``shapes_of`` input: the shape it holds), the same size for
        the same symbolic dim, static dims mapped through ``shrink``."""
        dims, unnamed = dict(self.preset), itertools.count()
        shapes = {}
        for value in self.inputs:
            if value in self.shapes_of:
                # the shape of a value the region computes: the concrete sizes the other inputs were given
                node = self.shapes_of[value]
                start, end = attr_value(node, "start", 0), attr_value(node, "end", None)
                shapes[value] = _concrete(self._shape(node.inputs[0]), dims, shrink, unnamed)[start:end]
            else:
                shape = _concrete(self._shape(value), dims, shrink, unnamed)
                if value in self.tables and shape and shrink:
                    # ids point at the first rows only: a table needs no more rows than they and constant ids pick
                    shape[0] = min(shape[0], max([_TABLE_ROWS, *(r + 1 for r in self.tables[value])]))
                shapes[value] = shape
        self.free = [name for name in dims if name.startswith("?") or name.isidentifier()]
        return shapes

    def _shape(self, value: ir.Value) -> ir.Shape:
        if value.shape is not None:
            return _named_input_dims(value)
        guess = _guessed_shape(self.rep)
        if guess is None:
            raise Unverifiable(f"the shape of '{value.name}' is unknown, and the fused op does not imply one")
        return guess

    def graph(self, fused: bool) -> tuple[list, list, list, list]:
        nodes = self.new_nodes if fused else self.old_nodes
        pairs = [(new if fused else old) for old, new in self.pairs]
        node_protos, inputs, outputs, inits = [], [], [], []
        for value in self.inputs:
            name, dtype = self.prefix + value.name, self.dtypes[value]
            if dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
                # numpy has no bfloat16 for ORT's feed: feed fp32 and cast inside the model
                inputs.append(onnx.helper.make_tensor_value_info(name + "__f32", onnx.TensorProto.FLOAT, None))
                node_protos.append(onnx.helper.make_node("Cast", [name + "__f32"], [name], to=dtype.value))
            else:
                inputs.append(onnx.helper.make_tensor_value_info(name, dtype.value, None))
        for value in self.constants:
            array = static_value(value)
            if array is None:
                raise Unverifiable(f"constant '{value.name}' cannot be read")
            inits.append(onnx.numpy_helper.from_array(array, self.prefix + value.name))
        for index, node in enumerate(nodes):
            proto = ir.serde.serialize_node(node)
            proto.name = f"{self.prefix}n{index}"
            proto.input[:] = [self.prefix + n if n else "" for n in proto.input]
            proto.output[:] = [self.prefix + n if n else "" for n in proto.output]
            node_protos.append(proto)
        for i, value in enumerate(pairs):
            name = f"{self.prefix}out{i}"
            node_protos.append(onnx.helper.make_node("Cast", [self.prefix + value.name], [name],
                                                     to=onnx.TensorProto.DOUBLE))
            outputs.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.DOUBLE, None))
        # the walk to each quantizer, copied per quantizer and reading this side's output: the float values the
        # quantizer reads and what it makes of them are compared
        renamed = {old.name: (new if fused else old).name for old, new in self.pairs}
        for k, (_, walk, q) in enumerate(self.quantizers):
            tag = f"{self.prefix}q{k}__"
            own = {v.name for n in walk + [q] for v in n.outputs}

            def local(name: str) -> str:
                return "" if not name else tag + name if name in own else self.prefix + renamed.get(name, name)
            for index, node in enumerate(walk + [q]):
                proto = ir.serde.serialize_node(node)
                proto.name = f"{tag}n{index}"
                proto.input[:] = [local(n) for n in proto.input]
                proto.output[:] = [local(n) for n in proto.output]
                node_protos.append(proto)
            for suffix, value in (("float", q.inputs[0]), ("quantized", q.outputs[0])):
                name = f"{tag}{suffix}"
                node_protos.append(onnx.helper.make_node("Cast", [local(value.name)], [name],
                                                         to=onnx.TensorProto.DOUBLE))
                outputs.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.DOUBLE, None))
        return node_protos, inputs, outputs, inits

    def feed_dict(self) -> dict[str, np.ndarray]:
        out = {}
        for value in self.inputs:
            name = self.prefix + value.name
            key = name + "__f32" if self.dtypes[value] in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) else name
            out[key] = self.feeds[name]
        return out


def _shared_context(old_reads: list[ir.Value], new_reads: list[ir.Value], produced_old: set[ir.Value],
                    ids: set[ir.Value], shapes_of: dict[ir.Value, ir.Node]) -> tuple[list[ir.Node], list[ir.Node]]:
    """(prelude for both sides, extra nodes for the old side) so that both sides compute from the same inputs.

    The old side may read values computed outside the region from the new side's inputs (Flatten(X), Shape(X)):
    those are recomputed on the old side. Values that random data would make meaningless are computed through a
    prelude both sides run: positions from Shape(input_ids) while the lookup reads view(input_ids), and the shape
    arithmetic a Reshape's target is made of. Lookup ids (``ids``) stay random valid indices."""
    context: list[ir.Node] = []
    missing = [v for v in old_reads if v not in new_reads and not _derive(v, set(new_reads) | produced_old, context)]
    shapes = [v for v in dict.fromkeys(old_reads + new_reads)
              if v not in ids and v.producer() is not None and v.dtype in _INTEGERS and not is_static(v)]
    if not missing and not shapes:
        return [], context
    prelude: list[ir.Node] = []
    # every value only the old side reads, not only the missing ones: those ``context`` derived from the new side's
    # reads (Cast(ids) when the kernel reads the ids themselves) must not become random inputs of the old side
    old_only = [v for v in dict.fromkeys(old_reads) if v not in new_reads]
    if all(_derive(v, set(), prelude, from_inputs=True, avoid=produced_old) for v in old_only + shapes + new_reads) \
            and len(prelude) <= _MAX_PRELUDE:
        return prelude, []
    # the activations come from far up: keep them as inputs, and compute only the shape arithmetic from them
    prelude, sources = [], (set(old_reads) | set(new_reads)) - set(missing) - set(shapes)
    for value in shapes:
        attempt: list[ir.Node] = []
        if _derive(value, sources, attempt, from_inputs=True, avoid=produced_old, shapes_of=shapes_of):
            prelude += [n for n in attempt if n not in prelude]
    prelude = prelude if len(prelude) <= _MAX_PRELUDE else []
    return prelude, [n for n in context if n not in prelude]


def _concrete(shape: ir.Shape, sizes: dict[str, int], shrink: Mapping[int, int], unnamed: Iterator[int]) -> list[int]:
    """Sizes for ``shape``; each unnamed dim is a name of its own, numbered by ``unnamed`` (the same numbers when a
    region is planned again, so that a preset reaches them)."""
    if any(isinstance(d, int) and d < 0 for d in shape):
        # no tensor has it: a shape inference that computed one (ORT's for a Slice ending at INT32_MIN) is wrong there
        raise Unverifiable(f"a shape {list(shape)} with a negative dim was inferred")
    return [shrink.get(d, d) if isinstance(d, int) else
            dim_size(str(d) if d is not None and d.value is not None else f"?{next(unnamed)}", sizes) for d in shape]


def _bytes(shapes: Mapping[ir.Value, list[int]], dtypes: Mapping[ir.Value, ir.DataType]) -> int:
    """What the feeds take (half floats are fed as float32). Python ints: a [2**31, 2**31] shape does not wrap."""
    return sum(math.prod(shape) * (4 if dtypes[v] in _HALF else max(dtypes[v].itemsize, 1))
               for v, shape in shapes.items())


#: the fused ops that normalize row by row, with how to find the normalized axis: ``axis`` attribute (default
#: -1) or always the last; their first input holds the rows (EmbedLayerNormalization: every dim of its ids)
_ROW_WISE = {"LayerNormalization": "axis", "SimplifiedLayerNormalization": "axis", "RMSNormalization": "axis",
             "SkipLayerNormalization": -1, "SkipSimplifiedLayerNormalization": -1,
             "EmbedLayerNormalization": None, "QEmbedLayerNormalization": None}


def _fused_node(rep: Replacement) -> ir.Node | None:
    return next((n for n in rep.nodes if is_op(n, rep.op_type, domain=rep.domain)), None)


def _row_shrink(rep: Replacement) -> dict[int, int]:
    """Static sizes of the fused op's rows, each mapped to a small size: verifying a row-wise op on a few rows
    proves it on any number. A row size equal to a normalized size is kept (the two cannot be told apart)."""
    node = _fused_node(rep)
    if node is None or known_op(node) not in _ROW_WISE or node.inputs[0] is None or not node.inputs[0].shape:
        return {}
    shape, how = list(node.inputs[0].shape), _ROW_WISE[known_op(node)]
    axis = attr_value(node, "axis", -1) if how == "axis" else how
    rows, normalized = (shape, []) if axis is None else (shape[:axis % len(shape)], shape[axis % len(shape):])
    taken = {d for d in normalized if isinstance(d, int)}
    small = (n for n in itertools.count(2) if n not in taken)
    return {d: next(small) for d in dict.fromkeys(rows) if isinstance(d, int) and d > 2 and d not in taken}


def _scale(rep: Replacement) -> ir.Value | None:
    """The fused op's scale (gamma): its first floating-point constant input after the data."""
    node = _fused_node(rep)
    return next((v for v in (node.inputs[1:] if node is not None else ())
                 if v is not None and is_static(v) and v.dtype is not None and v.dtype.is_floating_point()
                 and v.shape is not None), None)


def _guessed_shape(rep: Replacement) -> ir.Shape | None:
    """A shape for a norm input whose shape inference could not tell (a loop body's carried value): a few rows,
    then the scale's shape, with as many leading dims as a non-negative ``axis`` implies. Any consistent shape
    serves: the checks proved the region row-wise, and a wrong guess makes ORT fail, which refuses the rewrite."""
    node, scale = _fused_node(rep), _scale(rep)
    if node is None or scale is None or known_op(node) not in _ROW_WISE or _ROW_WISE[known_op(node)] is None:
        return None
    axis = attr_value(node, "axis", -1) if _ROW_WISE[known_op(node)] == "axis" else -1
    leading = axis if axis >= 0 else 2
    return ir.Shape([2, 3, 4, 5][:leading] + list(scale.shape))


def _named_input_dims(value: ir.Value) -> ir.Shape:
    """A graph input's unnamed dims, called what ORT's symbolic inference calls them in the values computed from
    the input (``input_ids_d1``), so that the input and those values get the same sizes."""
    if not value.is_graph_input():
        return value.shape
    return ir.Shape([d if isinstance(d, int) or d.value is not None else f"{value.name}_d{i}"
                     for i, d in enumerate(value.shape)])


def dim_size(name: str, sizes: dict[str, int]) -> int:
    """A concrete size for a symbolic dim, the same for the same name. A dim that ORT's symbolic inference wrote as
    an expression of others (``batch*sequence`` after a flattening Reshape) gets the value of that expression."""
    if name not in sizes:
        try:
            found = _dim_expression(ast.parse(name, mode="eval").body, sizes)
        except (SyntaxError, ValueError, ArithmeticError, RecursionError):
            found = None
        # an expression too large for a test input is not worth allocating: the region then gets a size of its own
        sizes[name] = found if found is not None and 0 < found <= _MAX_DIM else _SIZES[len(sizes) % len(_SIZES)]
    return sizes[name]


_DIM_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
            ast.Mod: operator.mod}


def _dim_expression(tree: ast.expr, sizes: dict[str, int]) -> int | None:
    """The value of a dim expression, or None for a plain name (which gets a size of its own)."""
    if isinstance(tree, ast.Name):
        return None
    if isinstance(tree, ast.Constant) and isinstance(tree.value, int):
        return tree.value
    if isinstance(tree, ast.BinOp) and type(tree.op) in _DIM_OPS:
        return _DIM_OPS[type(tree.op)](_operand(tree.left, sizes), _operand(tree.right, sizes))
    if isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id in ("Min", "Max"):
        return (min if tree.func.id == "Min" else max)(_operand(a, sizes) for a in tree.args)
    raise ValueError("not a dim expression")


def _operand(tree: ast.expr, sizes: dict[str, int]) -> int:
    if isinstance(tree, ast.Name):
        return dim_size(tree.id, sizes)
    value = _dim_expression(tree, sizes)
    if value is None:
        raise ValueError("not a dim expression")
    return value


def _derive(value: ir.Value, known: set, context: list[ir.Node], depth: int = 0, from_inputs: bool = False,
            avoid: set = frozenset(), shapes_of: dict | None = None) -> bool:
    """Add to ``context`` the nodes computing ``value`` from ``known`` values and constants (and graph inputs, with
    ``from_inputs``), if few enough, reading nothing in ``avoid``. A Shape reads only its input's shape: that input
    becomes a region input, fed random data of its (symbolic) shape."""
    if value in known or is_static(value):
        return True
    node = value.producer()
    if node is None:
        return from_inputs
    if depth > 8 or node.graph is None or node.attributes.get("body") is not None or value in avoid:
        return False
    if node in context:
        return True
    if is_op(node, "Shape") and node.inputs[0] in avoid and shapes_of is not None \
            and node.inputs[0].shape is not None:
        shapes_of[value] = node  # fed as the concrete shape of the region's value
        return True
    if is_op(node, "Shape") and node.inputs[0] not in avoid or all(
            v is None or _derive(v, known, context, depth + 1, from_inputs, avoid, shapes_of) for v in node.inputs):
        context.append(node)
        return True
    return False


def _id_bounds(nodes: Sequence[ir.Node]) -> dict[ir.Value, int]:
    """Integer values used as lookup indices, with how many table rows they may index; also the values they are
    reshaped or cast from inside the region (``view(input_ids)``), which then get the valid ids."""
    bounds: dict[ir.Value, int] = {}
    inside = set(nodes)
    for node in nodes:
        table = node.inputs[0] if is_op(node, "Gather") else None
        if table is None or table.shape is None or not isinstance(table.shape[0], int) \
                or attr_value(node, "axis", 0) != 0:
            continue
        ids, bound = node.inputs[1], min(table.shape[0], _TABLE_ROWS)
        while True:
            bounds[ids] = min(bound, bounds.get(ids, bound))
            source = ids.producer()
            if source is None or source not in inside or onnx_op(source) not in ID_MOVES:
                break
            ids = source.inputs[0]
    return bounds


def _quantizers(value: ir.Value) -> list[tuple[list[ir.Node], ir.Node]]:
    """Each QuantizeLinear that reads ``value``, directly or through up to ``_QUANT_WALK`` elementwise ops whose
    other operands are constants (so the walk can be run on its own), with the ops walked; a quantizer whose scale
    and zero point are not constants is not one the region can be compared through."""
    found, frontier = [], [(value, [])]
    for _ in range(_QUANT_WALK + 1):
        following = []
        for current, walk in frontier:
            for reader, index in current.uses():
                others = [v for i, v in enumerate(reader.inputs) if i != index and v is not None]
                constant_operands = all(is_static(v) and not _large(v) for v in others)
                if reader.domain not in ("", "ai.onnx") or not constant_operands or len(reader.outputs) != 1:
                    continue
                if is_op(reader, "QuantizeLinear") and index == 0:
                    found.append((walk, reader))
                elif onnx_op(reader) in ELEMENTWISE:
                    following.append((reader.outputs[0], walk + [reader]))
        frontier = following
    return found


def _reads(nodes: Sequence[ir.Node], produced: set) -> list[ir.Value]:
    return [v for n in nodes for v in n.inputs if v is not None and v not in produced]


def _large(value: ir.Value) -> bool:
    """Initializers too big to read just to verify (embedding tables): the region is run on random values of the
    same shape instead; what a norm computes does not depend on the table's contents."""
    if value.producer() is not None or value.shape is None or not value.shape.is_static():
        return False
    return int(np.prod([int(d) for d in value.shape])) > _LARGE


def _random(rng: np.random.Generator, dtype: ir.DataType, shape: list[int], bound: int | None = None) -> np.ndarray:
    if dtype.is_floating_point():
        # drawn in place in the fed dtype: no float64 copies of a large input
        data = np.asarray(rng.standard_normal(shape, dtype=np.float64 if dtype == ir.DataType.DOUBLE else np.float32))
        if shape and shape[0] > 1:
            data[1::3] *= _SMALL_SCALE.get(dtype, 1e-3)
            data[2::3] += 3.0
        return data
    if dtype == ir.DataType.BOOL:
        return rng.integers(0, 2, size=shape).astype(bool)
    if bound:
        return rng.integers(0, bound, size=shape).astype(dtype.numpy())
    return np.zeros(shape, dtype=dtype.numpy())


def _tables(nodes: Sequence[ir.Node]) -> dict[ir.Value, set[int]]:
    """The lookup tables the region reads (a Gather's data, or the quantized tensor a DequantizeLinear turns into
    one), each with the rows that constant ids pick (fed ids are drawn below ``_TABLE_ROWS``)."""
    tables: dict[ir.Value, set[int]] = {}
    for node in nodes:
        if not is_op(node, "Gather"):
            continue
        rows = tables.setdefault(node.inputs[0], set())
        ids = static_value(node.inputs[1]) if is_static(node.inputs[1]) else None
        if ids is not None and ids.size <= _LARGE and attr_value(node, "axis", 0) == 0:
            rows.update(int(i) for i in ids.reshape(-1))
    for node in nodes:
        if is_op(node, "DequantizeLinear") and node.outputs[0] in tables:
            tables.setdefault(node.inputs[0], set()).update(tables[node.outputs[0]])
    return tables


def _random_table(rng: np.random.Generator, dtype: ir.DataType, shape: list[int], picked: set[int]) -> np.ndarray:
    """Random rows where ids can point (the first ``_TABLE_ROWS``, and the rows constant ids pick), zeros elsewhere
    (np.zeros does not touch memory until it is read). Float rows follow ``_random``'s pattern of small-variance
    and offset rows; quantized tables get random integers over their whole range."""
    rows = sorted(set(range(min(shape[0], _TABLE_ROWS))) | {r % shape[0] for r in picked if -shape[0] <= r < shape[0]})
    if dtype.is_floating_point():
        table = np.zeros(shape, dtype=np.float64 if dtype == ir.DataType.DOUBLE else np.float32)
        table[rows] = _random(rng, dtype, [len(rows)] + shape[1:])
    else:
        table = np.zeros(shape, dtype=dtype.numpy())
        info = np.iinfo(table.dtype)
        table[rows] = rng.integers(info.min, info.max, size=[len(rows)] + shape[1:], endpoint=True)
    return table


def _run(regions: list[_Region], opsets: dict[str, int], ir_version: int) -> list[Outcome]:
    results = {}
    feeds = {}
    for region in regions:
        feeds.update(region.feed_dict())
    for fused in (False, True):
        try:
            results[fused] = session(_model(regions, fused, opsets, ir_version), threads=1).run(None, feeds)
        except Exception as error:  # noqa: BLE001 - ORT raises several types; the message is what matters
            raise _Failed(fused, error) from error
    outcomes, index = [], 0
    for region in regions:
        worst, ok, detail = 0.0, True, ""
        for old, _ in region.pairs:
            expected, actual = results[False][index], results[True][index]
            index += 1
            atol, rtol = TOLERANCE.get(old.dtype, (1e-4, 1e-3))
            err, passed = compare(expected, actual, atol, rtol)
            worst = max(worst, err)
            if not passed:
                ok = False
                detail = f"output '{old.name}' differs by {err:.3g} (tolerance {atol:g} + {rtol:g}*|x|)"
        requantized = []
        for pair, _, q in region.quantizers:
            (before, after), (q_before, q_after) = [(results[False][index + j], results[True][index + j])
                                                    for j in (0, 1)]
            index += 2
            float_error = float(np.max(np.abs(before - after), initial=0.0)) if before.shape == after.shape \
                else float("inf")
            steps = np.abs(q_before - q_after) if q_before.shape == q_after.shape else np.full(1, np.inf)
            requantized.append(Requantized(q.name or "<unnamed QuantizeLinear>", region.pairs[pair][0].name,
                                           int(np.count_nonzero(steps)), int(q_before.size),
                                           int(np.nanmax(steps, initial=0)) if np.isfinite(steps).all() else -1,
                                           float_error))
        outcomes.append(Outcome(ok, worst, detail, requantized))
    return outcomes


def _model(regions: list[_Region], fused: bool, opsets: dict[str, int], ir_version: int) -> onnx.ModelProto:
    """One side of every region, side by side in one model."""
    nodes, inputs, outputs, inits = [], [], [], []
    for region in regions:
        n, i, o, t = region.graph(fused)
        nodes += n
        inputs += i
        outputs += o
        inits += t
    model = onnx.helper.make_model(onnx.helper.make_graph(nodes, "lnfuse_verify", inputs, outputs, inits),
                                   opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = ir_version
    return model


def compare(expected: np.ndarray, actual: np.ndarray, atol: float, rtol: float) -> tuple[float, float]:
    """(max abs error, passed). NaN and inf must match exactly."""
    if expected.shape != actual.shape:
        return float("inf"), False
    expected = expected.astype(np.float64)
    actual = actual.astype(np.float64)
    same_special = (np.isnan(expected) & np.isnan(actual)) | (np.isinf(expected) & (expected == actual))
    finite = ~same_special
    if not finite.any():
        return 0.0, True
    diff = np.abs(expected[finite] - actual[finite])
    err = float(np.nanmax(diff)) if diff.size else 0.0
    if np.isnan(diff).any():
        return float("nan"), False
    return err, bool(np.all(diff <= atol + rtol * np.abs(expected[finite])))


def session(model: onnx.ModelProto, optimize: bool = False, threads: int = 0,
            gate: Gate | None = None) -> ort.InferenceSession:
    """An ORT CPU session; graph optimizations off unless asked (so ORT's own fusions do not hide differences).
    ``threads=0`` lets ORT choose. The model's external weights are read through ``gate`` and given to ORT in
    memory: ORT never resolves a data location itself (against the working directory, or anywhere)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.log_severity_level = 4
    options.intra_op_num_threads = threads
    model, names, arrays = ort_initializers(model, gate)
    if names:
        options.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays])
    created = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    created.lnfuse_weights = arrays  # ORT reads the arrays' memory for the session's life
    return created
