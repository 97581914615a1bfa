"""The framework exporters' spellings (issue 20), hand-built, each next to a near-miss that is not the same function
and must stay as it is: a clamp at 0 of a one-pass variance, keepdims=0 statistics re-broadcast to a run-time
shape, jnp.var's ``Where(N - ddof > 0, ...)``, Equinox's constant-row guard and float64 variance, MindSpore's
``ReduceSumSquare / N``, Paddle's twin centring behind Identities, and Flax's zero mean through jax2tf.

Each fused case is checked three ways: the fused op is there (and no statistic is left), its attributes, and ONNX
Runtime's numbers on the fused model against the original's, in float32 and float16 where the spelling is
dtype-independent. The real exports are in tests/test_frameworks.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
from onnx import TensorProto

import lnfuse
from lnfuse.match import algebra
from lnfuse.index.constants import static_value
from lnfuse.index.shapes import infer_shapes
from normgraphs import OpGraph, run

H, EPS = 8, 1e-5
RNG = np.random.default_rng(20)
GAMMA = RNG.uniform(0.5, 1.5, H)
BETA = RNG.uniform(-1, 1, H)
DTYPES = {"float32": (TensorProto.FLOAT, np.float32), "float16": (TensorProto.FLOAT16, np.float16)}
STATISTICS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "Max", "Where")


class Graph(OpGraph):
    """A norm written op by op (``OpGraph``); ``X`` is ``[B, 4, H]`` with a symbolic batch."""

    def __init__(self, dtype: str = "float32", shape: tuple = ("B", 4, H), opset: int = 18):
        super().__init__()
        self.elem, self.np = DTYPES[dtype]
        self.shape, self.opset = list(shape), opset

    def const(self, value, dtype=None) -> str:
        return self.tensor(np.asarray(value, dtype=dtype or self.np))

    def ints(self, values) -> str:
        return self.const(values, np.int64)

    def reduce(self, op_type: str, x: str, axes=(-1,), keepdims: int = 1) -> str:
        return self.op(op_type, x, self.ints(list(axes)), keepdims=keepdims)

    def rebroadcast(self, stat: str, x: str, axis: int = 2) -> str:
        """jax2tf's and jnp's restore of a keepdims=0 statistic: ``Reshape(s, Concat(Shape(x)[:axis], 1, ...))``
        then ``Expand`` to that same run-time shape."""
        shape = self.op("Shape", x)
        pieces = [self.op("Slice", shape, self.ints([0]), self.ints([axis]), self.ints([0])), self.ints([1])]
        if axis < len(self.shape) - 1:
            pieces.append(self.op("Slice", shape, self.ints([axis + 1]), self.ints([len(self.shape)]),
                                  self.ints([0])))
        target = self.op("Concat", *pieces, axis=0)
        return self.op("Expand", self.op("Reshape", stat, target), target)

    def affine(self, normalized: str) -> str:
        return self.op("Add", self.op("Mul", normalized, self.const(GAMMA)), self.const(BETA))

    def model(self, y: str, shape: list | None = None, elem: int | None = None) -> onnx.ModelProto:
        graph = oh.make_graph(self.nodes, "g", [oh.make_tensor_value_info("X", self.elem, self.shape)],
                              [oh.make_tensor_value_info(y, elem or self.elem,
                                                         self.shape if shape is None else shape)], self.inits)
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", self.opset)])
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    dtype = DTYPES["float16" if model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
                   else "float32"][1]
    rng = np.random.default_rng(1)
    shape = [d.dim_value or 3 for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = rng.normal(0, 1, shape) + rng.normal(0, 3, shape[:-1] + [1])  # offsets: a wrong centring shows
    x[0, 0] = 2.5  # a constant row: where Equinox's guard acts
    return {"X": x.astype(dtype)}


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _fused(model: onnx.ModelProto, op: str = "LayerNormalization", **attrs) -> lnfuse.FuseResult:
    result = lnfuse.fuse(model)
    ops = _ops(result.model)
    assert ops.count(op) == 1, (ops, [(u.check, u.reason) for u in result.report.unfused])
    assert not [o for o in ops if o in STATISTICS], ops
    node = next(n for n in result.model.graph.node if n.op_type == op)
    got = {a.name: oh.get_attribute_value(a) for a in node.attribute}
    for name, value in attrs.items():
        assert got[name] == pytest.approx(value, rel=1e-6), (name, got)
    feeds = _feeds(model)
    fp16 = model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    np.testing.assert_allclose(run(result.model, feeds)[0].astype(np.float64),
                               run(model, feeds)[0].astype(np.float64),
                               atol=2e-2 if fp16 else 1e-4, rtol=2e-2 if fp16 else 1e-3)
    return result


def _left(model: onnx.ModelProto, check: str | None = None, words: str = "") -> lnfuse.FuseResult:
    """No LayerNormalization in the output, the numbers are the original's, and (given) a refusal says why. (What
    such a graph does compute exactly may still fuse as that: an RMS norm of its own ``x - m``, say.)"""
    result = lnfuse.fuse(model)
    assert "LayerNormalization" not in _ops(result.model), _ops(result.model)
    feeds = _feeds(model)
    np.testing.assert_allclose(run(result.model, feeds)[0], run(model, feeds)[0], atol=1e-6, rtol=1e-6)
    if check is not None:
        reasons = [(u.check, u.reason) for u in result.report.unfused]
        assert any(c == check and words in r for c, r in reasons), reasons
    return result


# ---- a clamp at 0 of a one-pass variance (Flax) ---------------------------------------------------------------

def _one_pass(g: Graph, clamp: str, moment=None, mean_of_square=None) -> str:
    """Flax's LayerNorm: var = clamp(E[x²] - E[x]²), ``(x - m) / sqrt(var + eps) * gamma + beta``."""
    x = "X"
    m = g.reduce("ReduceMean", x)
    second = mean_of_square or g.reduce("ReduceMean", g.op("Mul", x, x))
    variance = g.op("Sub", second, moment or g.op("Mul", m, m))
    zero = g.const(0.0)
    clamped = {"max_after": lambda: g.op("Max", variance, zero), "max_before": lambda: g.op("Max", zero, variance),
               "relu": lambda: g.op("Relu", variance), "clip": lambda: g.op("Clip", variance, zero),
               "none": lambda: variance}[clamp]()
    inv = g.op("Sqrt", g.op("Add", clamped, g.const(1e-6)))
    return g.affine(g.op("Div", g.op("Sub", x, m), inv))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clamp", ["max_after", "max_before", "relu", "clip"])
def test_clamp_of_one_pass_variance_is_the_variance(clamp, dtype):
    g = Graph(dtype)
    _fused(g.model(_one_pass(g, clamp)), epsilon=float(g.np(1e-6)), axis=-1)


def test_clamp_of_a_quantity_not_provably_nonnegative_stays():
    # E[x²] - 2·E[x]² can be negative (x = [1, 1]: 1 - 2 = -1): the clamp changes the value there
    g = Graph()
    m = g.reduce("ReduceMean", "X")
    y = _one_pass(g, "max_after", moment=g.op("Mul", g.op("Mul", m, m), g.const(2.0)))
    _left(g.model(y))


def test_clamp_of_moments_over_other_axes_stays():
    # E[x²] over the last axis minus E[x]² over the middle one is no variance (and need not be >= 0)
    g = Graph(shape=("B", H, H))
    m_other = g.reduce("ReduceMean", "X", axes=(-2,))
    second = g.reduce("ReduceMean", g.op("Mul", "X", "X"))
    y = _one_pass(g, "max_after", mean_of_square=second, moment=g.op("Mul", m_other, m_other))
    _left(g.model(y))


def test_clamp_at_another_bound_stays():
    g = Graph()
    m = g.reduce("ReduceMean", "X")
    variance = g.op("Sub", g.reduce("ReduceMean", g.op("Mul", "X", "X")), g.op("Mul", m, m))
    clamped = g.op("Max", variance, g.const(0.5))  # max(var, 0.5) is another function where var < 0.5
    y = g.affine(g.op("Div", g.op("Sub", "X", m), g.op("Sqrt", g.op("Add", clamped, g.const(1e-6)))))
    _left(g.model(y))


def test_nonnegative_is_a_proof_on_the_normal_form():
    """The lemma itself: E[x²] - E[x]² is >= 0, E[x²] - 2E[x]² and E[x]² - E[x²] are not known to be."""
    g = Graph()
    m = g.reduce("ReduceMean", "X")
    sq = g.reduce("ReduceMean", g.op("Mul", "X", "X"))
    outs = {"variance": g.op("Sub", sq, g.op("Mul", m, m)), "negated": g.op("Sub", g.op("Mul", m, m), sq),
            "twice": g.op("Sub", sq, g.op("Mul", g.const(2.0), g.op("Mul", m, m))), "square_mean": sq}
    model = ir.from_proto(infer_shapes(g.model(outs["variance"], ["B", 4, 1]))[0])
    values = {v.name: v for n in model.graph for v in n.outputs}
    proved = {k: algebra.nonnegative(list(algebra.expand(values[v]).terms)) for k, v in outs.items()}
    assert proved == {"variance": True, "negated": False, "twice": False, "square_mean": True}


# ---- keepdims=0 statistics re-broadcast to a run-time shape (jax2tf, jnp) -----------------------------------

def _jax2tf(g: Graph, axis: int = 2, count: float | None = None, clamp: bool = True) -> str:
    """``m = ReduceSum(x, keepdims=0) * 1/N``, the variance clamped on the keepdims=0 values, each re-broadcast by
    Reshape + Expand to a run-time shape; rsqrt as Reciprocal(Sqrt); gamma folded into it."""
    n = count if count is not None else g.shape[axis]
    x = "X"
    inv_n = g.const(1.0 / n)
    m = g.op("Mul", g.reduce("ReduceSum", x, axes=(axis,), keepdims=0), inv_n)
    second = g.op("Mul", g.reduce("ReduceSum", g.op("Mul", x, x), axes=(axis,), keepdims=0), inv_n)
    variance = g.op("Sub", second, g.op("Mul", m, m))
    if clamp:
        variance = g.op("Max", g.const(0.0), variance)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", g.rebroadcast(variance, x, axis), g.const(1e-6))))
    shape = [1, 1, 1]
    shape[axis] = H
    scale = g.op("Mul", inv, g.const(GAMMA.reshape(shape)))
    centred = g.op("Sub", x, g.rebroadcast(m, x, axis))
    return g.op("Add", g.op("Mul", centred, scale), g.const(BETA.reshape(shape)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax2tf_rebroadcast_statistics_are_kept_statistics(dtype):
    g = Graph(dtype)
    _fused(g.model(_jax2tf(g)), epsilon=float(g.np(1e-6)), axis=-1)


def test_jax2tf_channels_first_is_transposed_around_the_norm():
    g = Graph(shape=("B", H, 4))
    result = _fused(g.model(_jax2tf(g, axis=1)))
    assert _ops(result.model).count("Transpose") == 2


def test_jax2tf_mean_divided_by_another_count_stays():
    g = Graph()
    _left(g.model(_jax2tf(g, count=H + 1, clamp=False)))


def test_reshape_that_is_not_the_rebroadcast_stays():
    # the keepdims=0 mean [B, S] reshaped to [B, 1, S] (not [B, S, 1]): with S = H it broadcasts, along the wrong axis
    g = Graph(shape=(2, H, H))
    m = g.op("Mul", g.reduce("ReduceSum", "X", keepdims=0), g.const(1.0 / H))
    wrong = g.op("Reshape", m, g.ints([2, 1, H]))
    d = g.op("Sub", "X", wrong)
    var = g.reduce("ReduceMean", g.op("Mul", d, d))
    _left(g.model(g.affine(g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(EPS)))))))


# ---- jnp.var's Where(N - ddof > 0, var, NaN), MindSpore's ReduceSumSquare / N --------------------------------

def _jnp(g: Graph, ddof: float, sum_square: bool = True) -> str:
    x = "X"
    n = g.const(float(H))
    m = g.op("Div", g.rebroadcast(g.reduce("ReduceSum", x, keepdims=0), x), n)
    d = g.op("Sub", x, m)
    dof = g.op("Sub", n, g.op("Cast", g.const(ddof, np.int32), to=g.elem))
    squares = g.reduce("ReduceSumSquare", d, keepdims=0) if sum_square else \
        g.reduce("ReduceSum", g.op("Mul", d, d), keepdims=0)
    var = g.op("Div", g.rebroadcast(squares, x), dof)
    nan = g.op("Expand", g.const(np.nan), g.op("Shape", var))
    guarded = g.op("Where", g.op("Greater", dof, g.const(0.0)), var, nan)
    return g.affine(g.op("Div", d, g.op("Sqrt", g.op("Add", guarded, g.const(EPS)))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sum_square", [True, False])
def test_jnp_var_behind_its_guard_is_the_variance(sum_square, dtype):
    g = Graph(dtype)
    _fused(g.model(_jnp(g, 0, sum_square)), epsilon=float(g.np(EPS)))


def test_jnp_var_with_ddof_1_stays():
    # the unbiased variance divides by N - 1: not LayerNorm's
    g = Graph()
    _left(g.model(_jnp(g, 1)), "variance", "needs 0.125")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mindspore_sum_square_over_n_is_the_variance(dtype):
    g = Graph(dtype, opset=11)
    x = "X"
    m = g.op("ReduceMean", x, axes=[-1])
    d = g.op("Sub", x, m)
    var = g.op("Div", g.op("ReduceSumSquare", d, axes=[-1], keepdims=1), g.const(float(H)))
    _fused(g.model(g.affine(g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(EPS)))))), epsilon=float(g.np(EPS)))


def test_sum_square_over_n_minus_1_stays():
    g = Graph(opset=11)
    m = g.op("ReduceMean", "X", axes=[-1])
    d = g.op("Sub", "X", m)
    var = g.op("Div", g.op("ReduceSumSquare", d, axes=[-1], keepdims=1), g.const(float(H - 1)))
    _left(g.model(g.affine(g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(EPS)))))), "variance")


# ---- Equinox: the constant-row guard and the float64 variance ------------------------------------------------

def _equinox(g: Graph, finite: bool = True, extrema_axes=(-1,), wide=TensorProto.DOUBLE) -> str:
    x = "X"
    m = g.reduce("ReduceMean", x)
    d = g.op("Sub", x, m)
    constant = g.op("Equal", g.reduce("ReduceMin", x, extrema_axes), g.reduce("ReduceMax", x, extrema_axes))
    if finite:
        constant = g.op("And", constant, g.op("Equal", g.op("Sub", m, m), g.const(0.0)))
    guarded = g.op("Where", constant, g.const(0.0), d)
    square = g.op("Cast", g.op("Mul", guarded, guarded), to=wide)
    var = g.op("Cast", g.reduce("ReduceMean", square), to=g.elem)
    return g.affine(g.op("Div", guarded, g.op("Sqrt", g.op("Add", var, g.const(EPS)))))


@pytest.mark.parametrize("dtype", DTYPES)
def test_equinox_guard_and_float64_variance(dtype):
    g = Graph(dtype)
    _fused(g.model(_equinox(g)), epsilon=float(g.np(EPS)))


def test_equinox_guard_without_the_finite_mean_stays():
    # min == max alone also holds on a row of equal infinities, where x - mean(x) is NaN and the guard gives 0
    g = Graph()
    _left(g.model(_equinox(g, finite=False)))


def test_equinox_guard_over_other_axes_stays():
    # a row constant along the middle axis says nothing about x - mean over the last one
    g = Graph(shape=("B", H, H))
    _left(g.model(_equinox(g, extrema_axes=(-2,))))


def test_statistic_averaged_in_a_narrower_float_stays():
    # float32 squares rounded to float16, averaged there and cast back: a float16 variance, not a float32 norm's
    g = Graph()
    _left(g.model(_equinox(g, wide=TensorProto.FLOAT16)), "dtype", "not a wider computation")


# ---- Paddle's twin centring, Flax's zero mean ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_paddle_twin_centring_behind_identities(dtype):
    g = Graph(dtype, shape=("B", H, 4), opset=11)
    x = "X"
    m = g.op("Identity", g.op("ReduceMean", x, axes=[1]))
    d1 = g.op("Identity", g.op("Sub", x, m))
    var = g.op("Identity", g.op("ReduceMean", g.op("Pow", d1, g.const(2.0)), axes=[1]))
    d2 = g.op("Identity", g.op("Sub", x, m))
    scaled = g.op("Mul", g.op("Identity", var), g.const([1.0]))
    normed = g.op("Div", d2, g.op("Sqrt", g.op("Identity", g.op("Add", scaled, g.const(EPS)))))
    y = g.op("Add", g.op("Mul", g.const(GAMMA.reshape(H, 1)), normed), g.const(BETA.reshape(H, 1)))
    _fused(g.model(y), epsilon=float(g.np(EPS)))


def _zero_mean_rms(g: Graph, fill: float) -> str:
    x = "X"
    zeros = g.rebroadcast(g.op("Expand", g.const([[fill]]), g.op("Slice", g.op("Shape", x), g.ints([0]),
                                                                   g.ints([2]), g.ints([0]))), x)
    ms = g.op("Mul", g.reduce("ReduceSum", g.op("Mul", x, x), keepdims=0), g.const(1.0 / H))
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", g.rebroadcast(ms, x), g.const(1e-6))))
    return g.op("Mul", g.op("Sub", x, zeros), g.op("Mul", inv, g.const(GAMMA.reshape(1, 1, H))))


@pytest.mark.parametrize("dtype", DTYPES)
def test_flax_rms_minus_expanded_zeros(dtype):
    g = Graph(dtype, opset=17)
    _fused(g.model(_zero_mean_rms(g, 0.0)), op="SimplifiedLayerNormalization", epsilon=float(g.np(1e-6)))


def test_rms_minus_expanded_nonzero_stays():
    g = Graph(opset=17)
    _left(g.model(_zero_mean_rms(g, 0.5)))


# ---- the constants the proofs read ----------------------------------------------------------------------------

def test_folded_counts_and_conditions():
    """``ReduceProd(Gather(Shape(x), axes))`` of known dims and ``N - ddof > 0`` are constants."""
    g = Graph(shape=("B", 4, H))
    count = g.op("ReduceProd", g.op("Gather", g.op("Shape", "X"), g.ints([1, 2])), keepdims=0)
    positive = g.op("Greater", g.op("Cast", count, to=TensorProto.FLOAT), g.const(0.0, np.float32))
    model = ir.from_proto(infer_shapes(g.model(positive, [], TensorProto.BOOL))[0])
    values = {v.name: v for n in model.graph for v in n.outputs}
    assert static_value(values[count]).tolist() == 4 * H
    assert static_value(values[positive]).tolist() is True
    assert algebra.uniform(values[positive]) == 1.0


# ---- tf-keras's fused path: BatchNormalization over x seen as [1, rows, H, 1] ----------------------------------

def _keras_bn(g: Graph, scale: float = 1.0, bias: float = 0.0, var_axes=(0, 2, 3), count=None,
              view=(1, -1, H, 1), mean_of_squares: bool = False, channels=None) -> str:
    """tf2onnx's spelling of tf-keras's fused LayerNormalization: the per-row statistics of the view, its
    BatchNormalization with Expanded ones and zeros, the Reshape back to Shape(x), then gamma and beta."""
    x = "X"
    shape = g.op("Shape", x)
    rows = g.op("ReduceProd", g.op("Slice", shape, g.ints([0]), g.ints([len(g.shape) - 1]), g.ints([0])), keepdims=1) \
        if channels is None else g.ints([channels])
    r = g.op("Reshape", x, g.ints(list(view)))
    m = g.op("ReduceMean", r, axes=[0, 2, 3], keepdims=1)
    d = g.op("Sub", r, m)
    if mean_of_squares:
        var = g.op("ReduceMean", g.op("Mul", d, d), axes=list(var_axes), keepdims=0)
    else:
        n = g.op("Cast", g.op("ReduceProd", g.op("Gather", g.op("Shape", r), g.ints(list(var_axes))), keepdims=0),
                 to=g.elem) if count is None else g.const(float(count))
        var = g.op("Div", g.op("ReduceSumSquare", d, axes=list(var_axes), keepdims=0), n)
    ones, zeros = g.op("Expand", g.const(scale), rows), g.op("Expand", g.const(bias), rows)
    y = g.op("BatchNormalization", r, ones, zeros, g.op("Squeeze", m, g.ints([0, 2, 3])), var, epsilon=1e-3)
    return g.affine(g.op("Reshape", y, shape))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mean_of_squares", [False, True])
def test_tf_keras_batch_norm_path_is_layer_norm(mean_of_squares, dtype):
    g = Graph(dtype, opset=17)
    _fused(g.model(_keras_bn(g, mean_of_squares=mean_of_squares)), epsilon=float(np.float32(1e-3)), axis=-1)


def test_tf_keras_batch_norm_with_static_rows():
    g = Graph(shape=(2, 4, H), opset=17)
    _fused(g.model(_keras_bn(g, view=(1, 8, H, 1))), epsilon=float(np.float32(1e-3)))


def test_tf_keras_batch_norm_scale_not_one_stays():
    g = Graph(opset=17)
    _left(g.model(_keras_bn(g, scale=2.0)), "scale", "not all 1s")


def test_tf_keras_batch_norm_bias_not_zero_stays():
    g = Graph(opset=17)
    _left(g.model(_keras_bn(g, bias=0.5)), "bias", "not all 0s")


def test_tf_keras_batch_norm_variance_over_other_axes_stays():
    # rows == H, so the per-column variance (axes 0, 1, 3: one value per column) has BatchNormalization's shape
    g = Graph(shape=(2, 4, H), opset=17)
    _left(g.model(_keras_bn(g, var_axes=(0, 1, 3))), "axes", "not a statistic of each row")


def test_tf_keras_batch_norm_unbiased_variance_stays():
    g = Graph(opset=17)
    _left(g.model(_keras_bn(g, count=H - 1)), "variance", f"needs {1 / H:.6g}")


def test_tf_keras_batch_norm_view_of_other_rows_stays():
    # [1, 16, H/2, 1]: BatchNormalization's channels are half rows, not the rows of x
    g = Graph(shape=(2, 4, H), opset=17)
    _left(g.model(_keras_bn(g, view=(1, 16, H // 2, 1), channels=16)), "axes", "not as")

