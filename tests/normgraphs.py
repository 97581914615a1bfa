"""Normalization subgraphs in the spellings exporters write, and near-misses that compute something else.

``Spec`` holds every choice point (op spellings, operand order, Casts, axes forms, ranks, dtypes, symbolic dims);
``build`` turns a spec into a small model whose graph output is the norm. Tests pick specs by hand; the property
tests draw them at random.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
from onnx import TensorProto

DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
          "float64": TensorProto.DOUBLE}
MUTATIONS = ("eps_outside", "exponent3", "sub_swapped", "div_swapped", "axes_leading", "intermediate_read",
             "gamma_leading", "eps_runtime", "mean_axes_differ", "wrong_n", "other_mean", "eps_negative",
             "channel_gamma_wrong_axis")
#: how the numerator, the inverse and gamma are combined (``standard``: ``cast?(d * inv) * gamma + beta``)
ORDERS = ("standard", "gamma_first_div", "d_gamma_over_std", "inv_gamma_d", "folded")
#: how a mean is written: ReduceMean, ReduceSum(x) / N, ReduceSum(x) * (1/N), GlobalAveragePool (tf2onnx)
MEAN_FORMS = ("reducemean", "sum_div", "sum_mul", "gap")


@dataclass(frozen=True)
class Spec:
    kind: str = "layer"            # "layer" or "rms"
    opset: int = 17
    dtype: str = "float32"
    cast_stats: bool = False       # fp16/bf16: Cast to fp32 for the statistics, back before gamma
    rank: int = 3
    k: int = 1                     # number of normalized (trailing) axes
    positive_axes: bool = False
    keepdims0: bool = False        # ReduceMean(keepdims=0) + Unsqueeze
    square: str = "pow"            # pow | mul
    inverse: str = "div"           # div | recip | div1 | pow_neg_half | pow_neg1
    eps: float = 1e-5
    eps_node: bool = False         # Constant node instead of an initializer
    eps_first: bool = False        # Add(eps, var)
    gamma: str | None = "1d"       # None | 1d | 11h
    beta: str | None = "1d"        # None | 1d | 11h
    gamma_first: bool = False      # Mul(gamma, n)
    beta_first: bool = False       # Add(beta, scaled)
    dup_sub: bool = False          # two identical Subs (old PyTorch exports)
    symbolic: bool = False
    mutation: str | None = None
    hidden: int = 8
    order: str = "standard"        # one of ORDERS ("folded": tf2onnx's x*k + (-mean*k + beta), layer only)
    mean_form: str = "reducemean"  # one of MEAN_FORMS ("gap": k must be rank - 2)
    square_sign: bool = False      # the variance squares mean - x
    castlike: bool = False         # epsilon and the exponent written CastLike(constant, x) (onnxscript; opset >= 15)
    channels_first: bool = False   # normalize axis 1 (k = 1, rank >= 3), gamma/beta shaped [C, 1, ...]

    def with_(self, **changes) -> "Spec":
        return replace(self, **changes)


class _Builder:
    def __init__(self, spec: Spec):
        self.spec = spec
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def name(self, hint: str) -> str:
        self.n += 1
        return f"{hint}_{self.n}"

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(oh.make_node(op_type, list(inputs), [out], name=self.name(op_type), **attrs))
        return out

    def const(self, array: np.ndarray, hint: str, as_node: bool = False) -> str:
        name = self.name(hint)
        tensor = onh.from_array(np.asarray(array), name)
        if as_node:
            self.nodes.append(oh.make_node("Constant", [], [name], value=tensor, name=self.name("Constant")))
        else:
            self.inits.append(tensor)
        return name

    def scalar(self, value: float, dtype: str, hint: str, as_node: bool = False) -> str:
        if dtype == "bfloat16":
            tensor = oh.make_tensor(self.name(hint), TensorProto.BFLOAT16, [], [value])
            if as_node:
                self.nodes.append(oh.make_node("Constant", [], [tensor.name], value=tensor, name=self.name("C")))
            else:
                self.inits.append(tensor)
            return tensor.name
        return self.const(np.array(value, dtype=dtype), hint, as_node)

    def mean(self, x: str, axes: list[int], count: int = 1, wrong_n: bool = False) -> str:
        spec = self.spec
        if spec.mean_form == "gap":
            return self.op("GlobalAveragePool", x)
        keep = 0 if spec.keepdims0 else 1
        reduce = "ReduceMean" if spec.mean_form == "reducemean" else "ReduceSum"
        if spec.opset >= 18 or reduce == "ReduceSum":
            out = self.op(reduce, x, self.const(np.array(axes, np.int64), "axes"), keepdims=keep)
        else:
            out = self.op(reduce, x, axes=axes, keepdims=keep)
        if spec.keepdims0:
            if spec.opset >= 13:
                out = self.op("Unsqueeze", out, self.const(np.array(axes, np.int64), "unsq_axes"))
            else:
                out = self.op("Unsqueeze", out, axes=axes)
        n = count + 1 if wrong_n else count
        stats = "float32" if spec.cast_stats else spec.dtype
        if spec.mean_form == "sum_div":
            out = self.op("Div", out, self.scalar(float(n), stats, "count"))
        elif spec.mean_form == "sum_mul":
            out = self.op("Mul", self.scalar(1.0 / n, stats, "one_over_n"), out)
        return out

    def literal(self, value: float, dtype: str, hint: str, like: str, as_node: bool = False) -> str:
        """A scalar constant, or CastLike(float32 constant, like) as onnxscript writes literals."""
        if self.spec.castlike:
            return self.op("CastLike", self.scalar(value, "float32", hint, as_node), like)
        return self.scalar(value, dtype, hint, as_node)


def _param(spec: Spec, kind: str | None, rng: np.random.Generator, hint: str, b: _Builder, dtype: str,
           offset: float) -> str | None:
    if kind is None:
        return None
    h = [spec.hidden] * spec.k
    if spec.channels_first:
        ones = [1] * (spec.rank - 2)
        shape = {"1d": [spec.hidden] + ones, "11h": [1, spec.hidden] + ones, "leading": [3, 1] + ones,
                 "wrong_axis": [1] * (spec.rank - 1) + [5]}[kind]
    else:
        shape = {"1d": h, "11h": [1] * (spec.rank - spec.k) + h,
                 "leading": [3] + [1] * (spec.rank - spec.k - 1) + h}[kind]
    values = (offset + rng.uniform(0.5, 1.5, size=shape)).astype(np.float32)
    if dtype == "bfloat16":
        tensor = oh.make_tensor(b.name(hint), TensorProto.BFLOAT16, shape, values.reshape(-1).tolist())
        b.inits.append(tensor)
        return tensor.name
    return b.const(values.astype(dtype), hint)


def build(spec: Spec, seed: int = 0) -> onnx.ModelProto:
    """A model computing the norm described by ``spec`` on input ``X``; output ``Y``."""
    rng = np.random.default_rng(seed)
    b = _Builder(spec)
    mut = spec.mutation
    dims = ["batch", "seq", "extra"][: spec.rank - spec.k] if spec.symbolic else [3, 2, 4][: spec.rank - spec.k]
    if spec.channels_first:
        # [N, C, spatial...]: the last spatial dim is 5 so that a gamma over it cannot be mistaken for one over C
        x_shape = [dims[0], spec.hidden] + [2] * (spec.rank - 3) + [5]
        axes = [1] if spec.positive_axes else [1 - spec.rank]
    else:
        x_shape = list(dims) + [spec.hidden] * spec.k
        axes = list(range(spec.rank - spec.k, spec.rank)) if spec.positive_axes else list(range(-spec.k, 0))
    count = spec.hidden ** spec.k
    stats_dtype = "float32" if spec.cast_stats else spec.dtype
    x = "X"
    if spec.cast_stats:
        x = b.op("Cast", x, to=TensorProto.FLOAT)
    inputs = [oh.make_tensor_value_info("X", DTYPES[spec.dtype], x_shape)]

    mean = None
    if spec.kind == "layer":
        mean_axes = [0] if mut == "axes_leading" else axes
        mean = b.mean(x, mean_axes, count, wrong_n=mut == "wrong_n")
        d = b.op("Sub", mean, x) if mut == "sub_swapped" else b.op("Sub", x, mean)
        d2 = b.op("Sub", x, mean) if spec.dup_sub else d
        d_sq = b.op("Sub", mean, x) if spec.square_sign else d
    else:
        d = d2 = d_sq = x
    if spec.square == "pow":
        exponent = 3.0 if mut == "exponent3" else 2.0
        sq = b.op("Pow", d_sq, b.literal(exponent, stats_dtype, "two", d_sq))
    else:
        sq = b.op("Mul", d_sq, d2 if d_sq == d else d_sq)
    var_axes = [-1] if mut == "mean_axes_differ" and spec.k == 2 else (
        [0] if mut == "axes_leading" else axes)
    if mut == "mean_axes_differ" and spec.k == 1:
        var_axes = list(range(-2, 0))
    var = b.mean(sq, var_axes, count)
    if mut == "eps_runtime":
        eps = "EPS"
        inputs.append(oh.make_tensor_value_info("EPS", DTYPES[stats_dtype], []))
    else:
        eps = b.literal(-1e-3 if mut == "eps_negative" else spec.eps, stats_dtype, "eps", var, spec.eps_node)
    gamma_kind = "leading" if mut == "gamma_leading" else "wrong_axis" if mut == "channel_gamma_wrong_axis" \
        else spec.gamma
    gamma = _param(spec, gamma_kind, rng, "gamma", b, spec.dtype, 0.0)
    beta = _param(spec, spec.beta if spec.kind == "layer" else None, rng, "beta", b, spec.dtype, -1.0)
    if mut == "other_mean":
        # the numerator subtracts the mean of another tensor
        mean = b.mean(b.op("Mul", x, b.scalar(2.0, stats_dtype, "two_x")), axes, count)
        d2 = b.op("Sub", x, mean)
    if mut == "eps_outside":
        std = b.op("Add", b.op("Sqrt", var), eps)
        y = b.op("Div", d2, std)
        if spec.cast_stats:
            y = b.op("Cast", y, to=DTYPES[spec.dtype])
        order = "standard"
    else:
        var_eps = b.op("Add", eps, var) if spec.eps_first else b.op("Add", var, eps)
        inverse = spec.inverse
        needs_std = inverse != "pow_neg_half" or spec.order in ("gamma_first_div", "d_gamma_over_std")
        std = b.op("Sqrt", var_eps) if needs_std else None
        if inverse == "recip":
            inv = b.op("Reciprocal", std)
        elif inverse in ("div1", "div"):
            inv = b.op("Div", b.scalar(1.0, stats_dtype, "one"), std)
        elif inverse == "pow_neg1":
            inv = b.op("Pow", std, b.scalar(-1.0, stats_dtype, "m1"))
        else:
            inv = b.op("Pow", var_eps, b.scalar(-0.5, stats_dtype, "mhalf"))
        order = spec.order
        if (order == "standard" and inverse == "div") or (order in ("gamma_first_div", "d_gamma_over_std") and
                                                          gamma is not None):
            b.nodes.pop()  # 1/std is not written: the division by std is
        if order == "standard":
            if inverse == "div":
                y = b.op("Div", std, d2) if mut == "div_swapped" else b.op("Div", d2, std)
            else:
                y = b.op("Mul", d2, inv)
            if spec.cast_stats:
                y = b.op("Cast", y, to=DTYPES[spec.dtype])
        elif order == "folded" and mean is not None:
            k = b.op("Mul", inv, gamma) if gamma is not None else inv
            shift = b.op("Mul", b.op("Neg", mean), k)
            y = b.op("Add", b.op("Mul", x, k), b.op("Add", shift, beta) if beta is not None else shift)
        elif order == "gamma_first_div" and gamma is not None:
            y = b.op("Div", b.op("Mul", gamma, d2), std)
        elif order == "d_gamma_over_std" and gamma is not None:
            y = b.op("Mul", d2, b.op("Div", gamma, std))
        else:  # inv_gamma_d, or an order that needs gamma without one
            y = b.op("Mul", b.op("Mul", inv, gamma), d2) if gamma is not None else b.op("Mul", inv, d2)
    if order == "standard" and gamma is not None:
        y = b.op("Mul", gamma, y) if spec.gamma_first else b.op("Mul", y, gamma)
    if order != "folded" and beta is not None:
        y = b.op("Add", beta, y) if spec.beta_first else b.op("Add", y, beta)
    outputs = [oh.make_tensor_value_info(y, DTYPES[spec.dtype], x_shape)]
    if mut == "intermediate_read":
        stat_shape = [1 if i in [a % spec.rank for a in axes] else d for i, d in enumerate(x_shape)]
        outputs.append(oh.make_tensor_value_info(var, DTYPES[stats_dtype], stat_shape))
    nodes, inits = _used(b.nodes, b.inits, [o.name for o in outputs])
    graph = oh.make_graph(nodes, "norm", inputs, outputs, inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", spec.opset)])
    model.ir_version = 8 if spec.opset < 21 else 10
    onnx.checker.check_model(model)
    return model


def _used(nodes: list, inits: list, outputs: list[str]) -> tuple[list, list]:
    """Only what the outputs are computed from (a spelling may leave a value it built unread)."""
    needed, kept = set(outputs), []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
    return kept[::-1], [t for t in inits if t.name in needed]


# ---- embedding blocks ---------------------------------------------------------------------------------------------

class EmbedBlock:
    """A small embedding block builder: ids in (int64 [batch, seq] unless given), lookups and sums written by the
    test, ``norm`` adds the LayerNorm and makes the model."""

    def __init__(self, hidden: int = 8, ids_dtype: int = TensorProto.INT64, ids_shape: tuple = ("batch", "seq"),
                 opset: int = 17):
        self.hidden, self.ids_shape, self.opset = hidden, list(ids_shape), opset
        self.nodes, self.inits = [], []
        self.inputs = [oh.make_tensor_value_info("ids", ids_dtype, self.ids_shape)]
        self.rng = np.random.default_rng(0)

    def table(self, name: str, rows: int) -> str:
        self.inits.append(onh.from_array(self.rng.normal(size=(rows, self.hidden)).astype(np.float32), name))
        return name

    def node(self, op: str, inputs: list[str], out: str, **attrs) -> str:
        self.nodes.append(oh.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def const(self, name: str, array) -> str:
        self.inits.append(onh.from_array(np.asarray(array), name))
        return name

    def norm(self, s: str, outputs: tuple = ("Y",)) -> onnx.ModelProto:
        self.const("gamma", self.rng.uniform(0.5, 1.5, self.hidden).astype(np.float32))
        self.const("beta", self.rng.normal(size=self.hidden).astype(np.float32))
        self.node("LayerNormalization", [s, "gamma", "beta"], "Y", epsilon=1e-5)
        outs = [oh.make_tensor_value_info(o, TensorProto.FLOAT, self.ids_shape + [self.hidden]) for o in outputs]
        model = oh.make_model(oh.make_graph(self.nodes, "embed", self.inputs, outs, self.inits),
                              opset_imports=[oh.make_opsetid("", self.opset)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


# ---- running models -----------------------------------------------------------------------------------------------

def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def feeds_for(model: onnx.ModelProto, seed: int = 1) -> dict[str, np.ndarray]:
    """Random inputs with small-variance rows (wrong epsilons show there) and offset rows (wrong centring)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        t = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 3 for d in t.shape.dim]
        if t.elem_type == TensorProto.BFLOAT16:
            raise ValueError("feed bf16 models through a Cast wrapper")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        data = rng.standard_normal(shape)
        if shape:
            # tiny variance and large offset on different rows: together they are ill-conditioned for any kernel
            scale = np.ones([shape[0]] + [1] * (len(shape) - 1))
            offset = np.zeros_like(scale)
            scale.reshape(-1)[1::3] = 1e-3 if dtype == np.float16 else 1e-4
            offset.reshape(-1)[2::3] = 3.0
            data = data * scale + offset
        else:
            data = np.asarray(1e-5)
        feeds[value.name] = data.astype(dtype)
    return feeds


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return session(model).run(None, feeds)


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def tolerance(dtype: str) -> dict:
    return {"float32": dict(atol=1e-4, rtol=1e-3), "float64": dict(atol=1e-9, rtol=1e-7),
            "float16": dict(atol=1e-2, rtol=1e-2), "bfloat16": dict(atol=6e-2, rtol=3e-2)}[dtype]


def with_float_io(model: onnx.ModelProto) -> onnx.ModelProto:
    """Wrap a bf16 model so numpy can feed and read it: float32 in, Cast, the model, Cast, float32 out."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    casts = []
    for value in graph.input:
        if value.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            inner = value.name + "__bf16"
            for node in graph.node:
                node.input[:] = [inner if i == value.name else i for i in node.input]
            casts.append(oh.make_node("Cast", [value.name], [inner], to=TensorProto.BFLOAT16))
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    for value in graph.output:
        if value.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            inner = value.name + "__bf16"
            for node in graph.node:
                node.output[:] = [inner if o == value.name else o for o in node.output]
            graph.node.append(oh.make_node("Cast", [inner], [value.name], to=TensorProto.FLOAT))
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    nodes = casts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return model


class OpGraph:
    """A graph written op by op: ``g.op("Mul", a, b)`` returns the output name, ``g.tensor(array)`` an
    initializer's."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        out = f"{op_type.lower()}_{len(self.nodes)}"
        self.nodes.append(oh.make_node(op_type, list(inputs), [out], name=f"{op_type}_{len(self.nodes)}", **attrs))
        return out

    def tensor(self, array: np.ndarray, name: str | None = None) -> str:
        name = name or f"c{len(self.inits)}"
        self.inits.append(onh.from_array(array, name))
        return name


class LayoutGraph(OpGraph):
    """A norm written op by op, for layouts; the input is ``X`` (of ``shape``, or the ``in_shape`` given to
    ``model``)."""

    def __init__(self, shape: list | None = None):
        super().__init__()
        self.shape = shape

    def const(self, value, dtype=np.float32) -> str:
        return self.tensor(np.asarray(value, dtype=dtype))

    def t(self, x: str, perm: list[int] | None) -> str:
        """A Transpose; ``perm=None``: the default (reversing) one."""
        return self.op("Transpose", x) if perm is None else self.op("Transpose", x, perm=perm)

    def inv_rms(self, squares: str, axes: list[int], eps: float = 1e-5) -> str:
        """1/sqrt(mean(squares) + eps), the axes kept."""
        mean = self.op("ReduceMean", squares, self.const(axes, np.int64), keepdims=1)
        return self.op("Reciprocal", self.op("Sqrt", self.op("Add", mean, self.const(eps))))

    def model(self, y: str, out_shape: list, in_shape: list | None = None) -> onnx.ModelProto:
        x = oh.make_tensor_value_info("X", TensorProto.FLOAT, in_shape or self.shape)
        graph = oh.make_graph(self.nodes, "g", [x], [oh.make_tensor_value_info(y, TensorProto.FLOAT, out_shape)],
                              self.inits)
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model
