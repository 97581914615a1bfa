"""Spellings that reach a norm's math only through algebra (issue 12): each fuses into one op with the right
attributes and the same numbers in ONNX Runtime; each near-miss next to it is refused with its reason.

Graphs are written here as ONNX nodes with the op order each exporter uses; the real exports (tf2onnx/Keras,
channels-first torch modules, onnxscript's code-form models) are checked at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx import TensorProto
from onnxscript import FLOAT, script
from onnxscript import opset18 as op

import lnfuse
from normgraphs import OpGraph, feeds_for, op_types, run

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
H, EPS = 8, 1e-5
RNG = np.random.default_rng(0)
GAMMA = RNG.uniform(0.5, 1.5, H).astype(np.float32)
BETA = RNG.uniform(-1, 1, H).astype(np.float32)


class Graph(OpGraph):
    """A tiny builder of float32 norms on ``X`` of ``shape``."""

    def __init__(self, shape=(2, 3, H), opset: int = 17):
        super().__init__()
        self.shape, self.opset = list(shape), opset

    def const(self, value, name: str | None = None) -> str:
        return self.tensor(np.asarray(value, dtype=np.float32), name)

    def mean(self, x: str, axes=(-1,)) -> str:
        return self.op("ReduceMean", x, axes=list(axes)) if self.opset < 18 else \
            self.op("ReduceMean", x, self.ints(axes))

    def ints(self, values) -> str:
        return self.tensor(np.asarray(values, dtype=np.int64), f"i{len(self.inits)}")

    def model(self, y: str) -> onnx.ModelProto:
        graph = oh.make_graph(self.nodes, "g", [oh.make_tensor_value_info("X", TensorProto.FLOAT, self.shape)],
                              [oh.make_tensor_value_info(y, TensorProto.FLOAT, self.shape)], self.inits)
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", self.opset)])
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model


def _fused_one(model: onnx.ModelProto, op: str = "LayerNormalization", **expected) -> onnx.NodeProto:
    result = lnfuse.fuse(model)
    nodes = [n for n in result.model.graph.node if n.op_type == op]
    assert len(nodes) == 1 and "ReduceMean" not in op_types(result.model), (op_types(result.model),
                                                                            result.report.unfused)
    attrs = {a.name: oh.get_attribute_value(a) for a in nodes[0].attribute}
    for name, value in expected.items():
        assert attrs[name] == pytest.approx(value, rel=1e-6, abs=0), (name, attrs)
    feeds = feeds_for(model)
    for want, got in zip(run(model, feeds), run(result.model, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)
    if not result.report.ort_only:
        onnx.checker.check_model(result.model, full_check=True)
    return nodes[0]


def _refused(model: onnx.ModelProto, check: str, words: str) -> None:
    result = lnfuse.fuse(model)
    assert not any("Normalization" in op for op in op_types(result.model)), op_types(result.model)
    reasons = [(u.check, u.reason) for u in result.report.unfused]
    assert any(c == check and words in r for c, r in reasons), reasons
    feeds = feeds_for(model)
    np.testing.assert_allclose(run(result.model, feeds)[0], run(model, feeds)[0], atol=1e-5, rtol=1e-5)


def _statistics(g: Graph, x: str = "X", mean_sq: str = "x_minus_mean", eps: float = EPS, axes=(-1,)):
    mean = g.mean(x, axes)
    d = g.op("Sub", x, mean) if mean_sq == "x_minus_mean" else g.op("Sub", mean, x)
    var = g.mean(g.op("Mul", d, d), axes)
    return mean, d, g.op("Add", var, g.const(eps))


# ---- products and quotients in any order and association ------------------------------------------------------

def _gamma_before_division(g: Graph) -> str:
    mean, d, var_eps = _statistics(g)
    return g.op("Add", g.op("Div", g.op("Mul", g.const(GAMMA), d), g.op("Sqrt", var_eps)), g.const(BETA))


def _d_times_gamma_over_std(g: Graph) -> str:
    mean, d, var_eps = _statistics(g)
    return g.op("Add", g.const(BETA), g.op("Mul", d, g.op("Div", g.const(GAMMA), g.op("Sqrt", var_eps))))


def _inv_gamma_d(g: Graph) -> str:
    mean, d, var_eps = _statistics(g)
    inv = g.op("Pow", var_eps, g.const(-0.5))
    return g.op("Add", g.op("Mul", g.op("Mul", inv, g.const(GAMMA)), d), g.const(BETA))


def _square_of_mean_minus_x(g: Graph) -> str:
    mean = g.mean("X")
    var = g.mean(g.op("Pow", g.op("Sub", mean, "X"), g.const(2.0)))
    d = g.op("Sub", "X", mean)
    n = g.op("Div", d, g.op("Sqrt", g.op("Add", g.const(EPS), var)))
    return g.op("Add", g.op("Mul", n, g.const(GAMMA)), g.const(BETA))


def _sum_over_n(g: Graph, n: float = H, times: bool = False) -> str:
    def mean(v):
        total = g.op("ReduceSum", v, g.ints([-1]))
        return g.op("Mul", total, g.const(1.0 / n)) if times else g.op("Div", total, g.const(float(n)))
    m = mean("X")
    d = g.op("Sub", "X", m)
    var_eps = g.op("Add", mean(g.op("Mul", d, d)), g.const(EPS))
    return g.op("Add", g.op("Mul", g.op("Div", d, g.op("Sqrt", var_eps)), g.const(GAMMA)), g.const(BETA))


def _keras_folded(g: Graph) -> str:
    """tf2onnx: means as GlobalAveragePool of the rank-3 activation, affine folded as x*k + (-mean*k + beta)."""
    mean = g.op("GlobalAveragePool", "X")
    d = g.op("Sub", "X", mean)
    var = g.op("GlobalAveragePool", g.op("Mul", d, d))
    k = g.op("Mul", g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const(EPS)))), g.const(GAMMA))
    return g.op("Add", g.op("Mul", "X", k), g.op("Add", g.op("Mul", g.op("Neg", mean), k), g.const(BETA)))


SPELLINGS = {
    "gamma_before_division": _gamma_before_division,
    "d_times_gamma_over_std": _d_times_gamma_over_std,
    "inv_gamma_d_in_any_order": _inv_gamma_d,
    "square_of_mean_minus_x": _square_of_mean_minus_x,
    "reducesum_over_n": _sum_over_n,
    "reducesum_times_one_over_n": lambda g: _sum_over_n(g, times=True),
    "tf2onnx_global_average_pool_folded_affine": _keras_folded,
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spelling_fuses_into_one_layer_norm(name):
    g = Graph()
    node = _fused_one(g.model(SPELLINGS[name](g)), axis=-1, epsilon=np.float32(EPS))
    assert len(node.input) == 3 and node.input[0] == "X"


def test_reducesum_divided_by_the_wrong_count_is_refused():
    g = Graph()
    _refused(g.model(_sum_over_n(g, n=H - 1)), "mean", "scaled by")


def test_centring_against_another_tensors_mean_is_refused():
    g = Graph()
    other = g.op("Mul", "X", g.const(2.0))
    mean, d, var_eps = _statistics(g)
    mean2 = g.mean(other)
    y = g.op("Add", g.op("Mul", "X", g.op("Reciprocal", g.op("Sqrt", var_eps))),
             g.op("Mul", g.op("Neg", mean2), g.op("Reciprocal", g.op("Sqrt", var_eps))))
    result = lnfuse.fuse(g.model(y))
    assert "LayerNormalization" not in op_types(result.model)


def test_square_of_a_sum_is_not_expanded_into_a_norm_of_its_terms():
    # (x - mean)**2 with the Sub read twice: the normal form keeps d**2, never x² - 2x·mean + mean²
    g = Graph()
    mean, d, var_eps = _statistics(g)
    y = g.op("Div", d, g.op("Sqrt", var_eps))
    node = _fused_one(g.model(y))
    assert len(node.input) == 2


# ---- epsilon ---------------------------------------------------------------------------------------------------

def test_epsilon_zero_is_exact_and_fuses():
    g = Graph()
    mean, d, var_eps = _statistics(g, eps=0.0)
    _fused_one(g.model(g.op("Div", d, g.op("Sqrt", var_eps))), epsilon=0.0)


def test_negative_epsilon_is_refused():
    g = Graph()
    mean, d, var_eps = _statistics(g, eps=-1e-5)
    _refused(g.model(g.op("Div", d, g.op("Sqrt", var_eps))), "epsilon", "epsilon >= 0")


# ---- constants written as CastLike (onnxscript) ------------------------------------------------------------------

def _onnxscript_rms() -> onnx.ModelProto:
    """RMSNorm as onnxscript writes Python literals: CastLike(Constant, x) for 2.0 and for epsilon."""
    @script()
    def rms(x: FLOAT[2, 3, 8], w: FLOAT[8]) -> FLOAT[2, 3, 8]:
        mean = op.ReduceMean(x ** 2.0, [-1], keepdims=1)
        return w * (x * op.Reciprocal(op.Sqrt(mean + 1e-05)))

    model = rms.to_model_proto()
    w = model.graph.input.pop(1)
    model.graph.initializer.append(onh.from_array(GAMMA, w.name))
    return model


def test_castlike_constants_count_as_constants():
    model = _onnxscript_rms()
    assert "CastLike" in op_types(model)
    result = lnfuse.fuse(model)
    assert op_types(result.model) == ["SimplifiedLayerNormalization"], result.report.unfused
    attrs = {a.name: oh.get_attribute_value(a) for a in result.model.graph.node[0].attribute}
    assert attrs["epsilon"] == pytest.approx(1e-5) and attrs["axis"] == -1
    feeds = {"x": RNG.standard_normal((2, 3, 8)).astype(np.float32)}
    np.testing.assert_allclose(run(result.model, feeds)[0], run(model, feeds)[0], atol=1e-5, rtol=1e-4)


# ---- channels-first norms -----------------------------------------------------------------------------------------

def _channels_first(g: Graph, gamma_shape=(H, 1, 1), rms: bool = False) -> str:
    """u = x.mean(1, keepdim=True); s = (x - u).pow(2).mean(1, keepdim=True); w[:, None, None] * (x - u) /
    sqrt(s + eps) + b[:, None, None] (Detectron2/ViTDet, SAM's LayerNorm2d, ConvNeXt)."""
    if rms:
        var_eps = g.op("Add", g.mean(g.op("Pow", "X", g.const(2.0)), (1,)), g.const(EPS))
        return g.op("Mul", g.const(GAMMA.reshape(gamma_shape)), g.op("Div", "X", g.op("Sqrt", var_eps)))
    mean = g.mean("X", (1,))
    d = g.op("Sub", "X", mean)
    var_eps = g.op("Add", g.mean(g.op("Pow", d, g.const(2.0)), (1,)), g.const(EPS))
    n = g.op("Div", d, g.op("Sqrt", var_eps))
    gamma = GAMMA.reshape(gamma_shape) if int(np.prod(gamma_shape)) == H else np.resize(GAMMA, gamma_shape)
    return g.op("Add", g.op("Mul", g.const(gamma), n), g.const(BETA.reshape(H, 1, 1)))


@pytest.mark.parametrize("rms", [False, True])
def test_channels_first_norm_is_transpose_norm_transpose(rms):
    g = Graph(shape=(2, H, 3, 5))
    fused_op = "SimplifiedLayerNormalization" if rms else "LayerNormalization"
    node = _fused_one(g.model(_channels_first(g, rms=rms)), fused_op, axis=-1, epsilon=np.float32(EPS))
    fused = lnfuse.fuse(g.model(_channels_first(Graph(shape=(2, H, 3, 5)), rms=rms))).model
    transposes = [n for n in fused.graph.node if n.op_type == "Transpose"]
    perms = [list(oh.get_attribute_value(n.attribute[0])) for n in transposes]
    assert perms == [[0, 2, 3, 1], [0, 3, 1, 2]]
    scale = next(t for t in fused.graph.initializer if t.name == node.input[1])
    assert list(scale.dims) == [H], "gamma becomes the [C] vector of the last axis"


def test_channels_first_gamma_varying_over_another_axis_is_left_outside():
    g = Graph(shape=(2, H, 3, 5))
    result = lnfuse.fuse(g.model(_channels_first(g, gamma_shape=(1, 3, 1))))
    node = next(n for n in result.model.graph.node if n.op_type == "LayerNormalization")
    assert "Mul" in op_types(result.model) and "Add" in op_types(result.model), "the affine stays outside"
    assert list(next(t for t in result.model.graph.initializer if t.name == node.input[1]).dims) == [H]
    feeds = feeds_for(result.model)
    model = g.model(_channels_first(Graph(shape=(2, H, 3, 5)), gamma_shape=(1, 3, 1)))
    np.testing.assert_allclose(run(result.model, feeds)[0], run(model, feeds)[0], atol=1e-4, rtol=1e-3)


def test_norm_over_the_batch_axis_is_refused():
    g = Graph(shape=(4, H))
    mean, d, var_eps = _statistics(g, axes=(0,))
    _refused(g.model(g.op("Div", d, g.op("Sqrt", var_eps))), "axes", "not the trailing")


# ---- real exports ------------------------------------------------------------------------------------------------

REAL = {  # file: (fused norm ops, Skip ops among them)
    "keras_encoder_tf2onnx_op13.onnx": (3, 2),
    "keras_encoder_tf2onnx_op17.onnx": (3, 2),
    "sam_neck_legacy_op14.onnx": (2, 0),
    "sam_neck_dynamo_op18.onnx": (2, 0),
    "convnext_tiny_legacy_op17.onnx": (5, 0),
    "hf_vitdet_dynamo_op18.onnx": (7, 4),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_export_fuses_every_norm(name):
    path = SAMPLES / name
    if not path.exists():
        pytest.skip(f"{name} is made by sample_models/make_exporter_samples.py (branch exports)")
    result = lnfuse.fuse(str(path), verify_model=True)
    ops = op_types(result.model)
    norms = [op for op in ops if op.endswith("Normalization")]
    assert (len(norms), sum(op.startswith("Skip") for op in norms)) == REAL[name], (ops, result.report.unfused)
    assert not any(u.rule in ("layer_norm", "rms_norm") for u in result.report.unfused), result.report.unfused


@pytest.mark.parametrize("name,norms", [("_smollm_1", 3), ("_whisper_encoder", 3)])
def test_onnxscript_code_form_fuses_every_norm(name, norms, tmp_path):
    sys.path.insert(0, str(SAMPLES))
    try:
        import make_exporter_samples
    except ImportError:
        pytest.skip("sample_models/make_exporter_samples.py is on branch exports")
    finally:
        sys.path.remove(str(SAMPLES))
    path = make_exporter_samples.onnxscript_model(name, tmp_path, seed=1, inline_bytes=1 << 20)
    result = lnfuse.fuse(str(path))
    assert sum(op.endswith("Normalization") for op in op_types(result.model)) == norms, result.report.unfused
    assert not any(u.check == "epsilon" for u in result.report.unfused)


def test_variance_without_square_root_is_refused():
    g = Graph()
    mean, d, var_eps = _statistics(g)
    _refused(g.model(g.op("Div", d, var_eps)), "exponent", "raised to -1")


def test_unbiased_variance_is_refused():
    g = Graph()
    mean = g.mean("X")
    d = g.op("Sub", "X", mean)
    var = g.op("Div", g.op("ReduceSum", g.op("Mul", d, d), g.ints([-1])), g.const(H - 1.0))
    _refused(g.model(g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(EPS))))), "variance", "scaled by")


@pytest.mark.parametrize("name,count", [("layer_norm_with_cast_2", 1), ("layer_norm_with_cast_3", 1),
                                        ("layer_norm_shared_input", 2)])
def test_ort_epsilon_zero_test_files_fuse(name, count):
    """ONNX Runtime's own fusion test files with epsilon 0, which its tests expect fused."""
    path = SAMPLES / "ort_fusion" / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{name}.onnx comes from ORT's generator scripts (sample_models/ort_fusion, branch lenient)")
    result = lnfuse.fuse(str(path))
    nodes = [n for n in result.model.graph.node if n.op_type == "LayerNormalization"]
    assert len(nodes) == count, result.report.unfused
    assert all(oh.get_attribute_value(a) == 0.0 for n in nodes for a in n.attribute if a.name == "epsilon")


def test_statistics_without_the_norm_around_them_are_reported():
    # x*k - mean(2x)*k: the variance of x is there, the formula is not: a candidate with its reason, not silence
    g = Graph()
    mean, d, var_eps = _statistics(g)
    k = g.op("Reciprocal", g.op("Sqrt", var_eps))
    other = g.mean(g.op("Mul", "X", g.const(2.0)))
    y = g.op("Sub", g.op("Mul", "X", k), g.op("Mul", other, k))
    _refused(g.model(y), "formula", "nothing computes")
