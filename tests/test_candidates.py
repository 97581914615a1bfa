"""explain and check find norm-like statistics themselves (lnfuse/match/candidates.py), whatever the rules match.

The graphs are written as JAX/Flax (jax2onnx, jax2tf + tf2onnx) and Keras's BatchNormalization path write them
(issue 20). Today no rule fuses those spellings; others are teaching the rules to. So the tests on them hold what
must stay true either way: each norm is a candidate, either fused or left with the reason of the rule of its kind
(layer_norm for a centred norm, never the RMS formula), and check's exit code says whether one is left. The exit
code itself is asserted on graphs that no rule may ever fuse (they compute something else).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx_ir as ir
import pytest
from onnx import TensorProto

import lnfuse
from lnfuse.match import candidates
from normgraphs import Spec, build, run

H = 8
EPS = 1e-6


class _Graph:
    """A graph as an exporter writes it: named nodes, initializers for constants."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        name = f"{op_type}_{len(self.nodes)}"
        self.nodes.append(oh.make_node(op_type, list(inputs), [f"{name}_out"], name=name, **attrs))
        return f"{name}_out"

    def const(self, array, hint: str) -> str:
        name = f"{hint}_{len(self.inits)}"
        self.inits.append(onh.from_array(np.asarray(array), name))
        return name

    def model(self, y: str, x_shape: list, y_shape: list | None = None, opset: int = 17) -> onnx.ModelProto:
        graph = oh.make_graph(self.nodes, "g", [oh.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
                              [oh.make_tensor_value_info(y, TensorProto.FLOAT, y_shape or x_shape)], self.inits)
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model


def _gamma_beta(g: _Graph, shape: list[int]) -> tuple[str, str]:
    return (g.const(np.linspace(0.5, 1.5, H, dtype=np.float32).reshape(shape), "gamma"),
            g.const(np.linspace(-1.0, 1.0, H, dtype=np.float32).reshape(shape), "beta"))


def flax_one_pass(clamp: str = "max", floor: float = 0.0) -> onnx.ModelProto:
    """Flax's LayerNorm through jax2onnx: var = max(0, E[x²] − E[x]²), rsqrt as Reciprocal(Sqrt), the scale folded
    into the inverse. ``floor`` ≠ 0 clamps at another value: that is no longer a norm's variance."""
    g = _Graph()
    mean = g.op("ReduceMean", "X", axes=[-1])
    mean_square = g.op("ReduceMean", g.op("Mul", "X", "X"), axes=[-1])
    var = g.op("Sub", mean_square, g.op("Mul", mean, mean))
    zero = g.const(np.float32(floor), "floor")
    var = {"max": lambda: g.op("Max", zero, var), "max_after": lambda: g.op("Max", var, zero),
           "relu": lambda: g.op("Relu", var), "clip": lambda: g.op("Clip", var, zero)}[clamp]()
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const(np.float32(EPS), "eps"))))
    gamma, beta = _gamma_beta(g, [H])
    y = g.op("Add", g.op("Mul", g.op("Sub", "X", mean), g.op("Mul", inv, gamma)), beta)
    return g.model(y, ["batch", "seq", H])


def jax2tf_channels_first() -> onnx.ModelProto:
    """jax2tf → tf2onnx over axis 1 of [N, C, T]: ReduceSum(keepdims=0) × 1/N, re-broadcast by a Reshape to a run-time
    shape (Concat of Slices of Shape(x), Cast) and an Expand, rsqrt as Reciprocal(Sqrt)."""
    g = _Graph()
    shape = g.op("Shape", "X")
    kept = g.op("Cast", g.op("Concat", g.op("Slice", shape, g.const(np.array([0]), "s0"), g.const(np.array([1]), "e0")),
                             g.const(np.array([1]), "one"),
                             g.op("Slice", shape, g.const(np.array([2]), "s2"), g.const(np.array([3]), "e2")),
                             axis=0), to=TensorProto.INT64)

    def mean(value: str) -> str:
        total = g.op("ReduceSum", value, g.const(np.array([1]), "axes"), keepdims=0)
        scaled = g.op("Mul", total, g.const(np.float32(1 / H), "one_over_n"))
        return g.op("Expand", g.op("Reshape", scaled, kept), shape)

    d = g.op("Sub", "X", mean("X"))
    var = mean(g.op("Mul", d, d))
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const(np.float32(EPS), "eps"))))
    gamma, beta = _gamma_beta(g, [H, 1])
    y = g.op("Add", g.op("Mul", g.op("Mul", d, inv), gamma), beta)
    return g.model(y, ["batch", H, "time"])


def jnp_var() -> onnx.ModelProto:
    """A hand-written norm over jnp.var: ReduceSumSquare(x − mean) / (N − ddof), guarded by Where(N > ddof, ·, nan)."""
    g = _Graph()
    mean = g.op("ReduceMean", "X", axes=[-1])
    d = g.op("Sub", "X", mean)
    n, ddof = g.const(np.float32(H), "n"), g.const(np.float32(0), "ddof")
    var = g.op("Where", g.op("Greater", n, ddof),
               g.op("Div", g.op("ReduceSumSquare", d, axes=[-1]), g.op("Sub", n, ddof)),
               g.const(np.float32(np.nan), "nan"))
    gamma, beta = _gamma_beta(g, [H])
    y = g.op("Add", g.op("Mul", g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(np.float32(EPS), "eps")))),
                         gamma), beta)
    return g.model(y, ["batch", "seq", H])


def keras_batch_norm(rows: int = 6) -> onnx.ModelProto:
    """Keras's fused LayerNormalization through tf2onnx: Reshape to [1, rows, H, 1], ReduceMean(axes 0, 2, 3),
    ReduceSumSquare(x − mean) / ReduceProd(Shape), BatchNormalization(scale 1, bias 0, mean, var), Reshape back,
    then γ and β."""
    g = _Graph()
    xr = g.op("Reshape", "X", g.const(np.array([1, rows, H, 1]), "to4d"))
    mean = g.op("ReduceMean", xr, axes=[0, 2, 3], keepdims=0)
    d = g.op("Sub", xr, g.op("Reshape", mean, g.const(np.array([1, rows, 1, 1]), "kept")))
    count = g.op("Cast", g.op("ReduceProd", g.op("Gather", g.op("Shape", xr), g.const(np.array([0, 2, 3]), "idx")),
                              keepdims=0), to=TensorProto.FLOAT)
    var = g.op("Div", g.op("ReduceSumSquare", d, axes=[0, 2, 3], keepdims=0), count)
    normed = g.op("BatchNormalization", xr, g.const(np.ones(rows, np.float32), "scale"),
                  g.const(np.zeros(rows, np.float32), "bias"), mean, var, epsilon=EPS)
    gamma, beta = _gamma_beta(g, [H])
    y = g.op("Add", g.op("Mul", g.op("Reshape", normed, g.const(np.array([2, rows // 2, H]), "back")), gamma), beta)
    return g.model(y, [2, rows // 2, H])


def no_norm() -> onnx.ModelProto:
    """A classifier head: mean pooling, a second moment that is returned (not divided by), MatMul, Softmax."""
    g = _Graph()
    pooled = g.op("ReduceMean", "X", axes=[1], keepdims=0)
    energy = g.op("Sqrt", g.op("ReduceMean", g.op("Mul", pooled, pooled), axes=[-1]))
    logits = g.op("MatMul", pooled, g.const(np.ones((H, 3), np.float32), "w"))
    y = g.op("Mul", g.op("Softmax", logits, axis=-1), energy)
    return g.model(y, ["batch", "seq", H], ["batch", 3])


JAX_STYLE = {"flax_max": lambda: flax_one_pass("max"), "flax_max_after": lambda: flax_one_pass("max_after"),
             "flax_relu": lambda: flax_one_pass("relu"), "flax_clip": lambda: flax_one_pass("clip"),
             "jax2tf_channels_first": jax2tf_channels_first, "jnp_var": jnp_var, "keras_batch_norm": keras_batch_norm}
CHANNEL_AXIS = {"jax2tf_channels_first": 1}


def _layer_norm_reference(x: np.ndarray, axis: int) -> np.ndarray:
    mean = x.mean(axis=axis, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axis, keepdims=True)
    shape = [1] * x.ndim
    shape[axis] = H
    gamma = np.linspace(0.5, 1.5, H, dtype=np.float32).reshape(shape)
    beta = np.linspace(-1.0, 1.0, H, dtype=np.float32).reshape(shape)
    return (x - mean) / np.sqrt(var + EPS) * gamma + beta


@pytest.mark.parametrize("name", sorted(JAX_STYLE))
def test_the_exporter_graphs_are_layer_norms(name: str):
    """What the candidates tests stand on: each graph computes a LayerNorm (in ORT, against numpy)."""
    x = np.random.default_rng(0).standard_normal((2, H, 3) if name in CHANNEL_AXIS else (2, 3, H))
    x = x.astype(np.float32) * 3 + 1
    [y] = run(JAX_STYLE[name](), {"X": x})
    np.testing.assert_allclose(y, _layer_norm_reference(x, CHANNEL_AXIS.get(name, -1)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(JAX_STYLE))
def test_every_exporter_norm_is_a_candidate_with_its_kinds_reason(name: str):
    report = lnfuse.fuse(JAX_STYLE[name]()).report
    [found] = report.candidates
    assert found.kind == "centred" and found.graph == "main"
    if found.fused:
        assert found.rule == "layer_norm" and not report.unfused
        return
    # left: explained by layer_norm (a centred norm is no RMS near-miss), with what was seen or what failed
    assert (found.rule, bool(found.check), bool(found.reason)) == ("layer_norm", True, True)
    [left] = report.unfused
    assert (left.rule, left.check, left.reason) == (found.rule, found.check, found.reason)
    assert "rms_norm" not in left.rule and "mean(x²) + eps is computed" not in left.reason
    if found.check == "spelling":  # no rule started on it: the report names what it saw
        assert found.reason.endswith((": no rule matches this spelling",
                                      ": no layer_norm pattern matches this spelling"))
        assert found.reason.startswith("centred statistics over ")


def test_the_spelling_is_named_where_no_rule_started():
    # what was seen, in the order the statistics are computed: the one-pass variance, its clamp, the inverse root
    stats = candidates.find(ir.serde.deserialize_model(flax_one_pass("max")).graph)
    [flax] = stats
    assert flax.kind == "centred" and flax.inverse.op_type == "Reciprocal"
    assert flax.describe() == ("centred statistics over axis -1 (mean ReduceMean(x); variance one-pass "
                               "E[x²] − E[x]², E[x²] = ReduceMean(Mul(x, x)) → Sub → Max → Add → Sqrt → Reciprocal)")
    [channels] = candidates.find(ir.serde.deserialize_model(jax2tf_channels_first()).graph)
    assert "over axis 1" in channels.describe()
    assert "mean ReduceSum(x, keepdims=0) → Mul → Reshape(run-time shape) → Expand(run-time shape);" \
        in channels.describe()
    [keras] = candidates.find(ir.serde.deserialize_model(keras_batch_norm()).graph)
    assert keras.inverse.op_type == "BatchNormalization" and [n.op_type for n in keras.reductions()] == \
        ["ReduceMean", "ReduceSumSquare"]
    [var] = candidates.find(ir.serde.deserialize_model(jnp_var()).graph)
    assert "variance ReduceSumSquare(x − mean) → Div → Where → Add → Sqrt → Div" in var.describe()


def test_an_ordinary_layer_norm_fuses_and_leaves_no_candidate(tmp_path: Path):
    path = tmp_path / "ln.onnx"
    onnx.save(build(Spec()), path)
    report = lnfuse.fuse(path).report
    [found] = report.candidates
    assert (found.kind, found.fused, found.rule, found.op_type) == ("centred", True, "layer_norm",
                                                                    "LayerNormalization")
    assert not report.unfused
    explained = _cli("explain", str(path))
    assert "1 norm-like statistic(s) found: 1 fused, 0 left" in explained.stdout
    assert _cli("check", str(path)).returncode == 0


def test_an_rms_norm_is_uncentred_and_fuses():
    report = lnfuse.fuse(build(Spec(kind="rms"))).report
    [found] = report.candidates
    assert (found.kind, found.fused, found.rule) == ("uncentred", True, "rms_norm")


def test_a_near_miss_gets_its_own_rules_reason():
    # the mean over axis 0: a centred norm over the wrong axes, refused by layer_norm for its axes
    report = lnfuse.fuse(build(Spec(mutation="axes_leading"))).report
    [found] = report.candidates
    assert (found.fused, found.kind, found.rule, found.check) == (False, "centred", "layer_norm", "axes")
    [left] = report.unfused
    assert (left.rule, left.check, left.reason) == ("layer_norm", "axes", found.reason)


def test_a_model_without_norms_has_no_candidates(tmp_path: Path):
    path = tmp_path / "head.onnx"
    onnx.save(no_norm(), path)
    report = lnfuse.fuse(path).report
    assert report.candidates == [] and report.unfused == []
    explained = _cli("explain", str(path))
    assert explained.returncode == 0 and "no normalization-like candidates" in explained.stdout
    assert _cli("check", str(path)).returncode == 0


def test_the_search_is_linear_in_the_graph():
    # 5,000 second moments that never reach a root, each read by 20 nodes, and one value read by 20,000 nodes: every
    # walk is bounded
    x = ir.Value(name="X", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, H]))
    nodes = []
    for _ in range(5_000):
        square = ir.node("Mul", [x, x])
        mean_square = ir.node("ReduceMean", [square.outputs[0]], {"axes": [-1]})
        nodes += [square, mean_square, *(ir.node("Sqrt", [mean_square.outputs[0]]) for _ in range(20))]
    wide = ir.node("ReduceMean", [nodes[0].outputs[0]], {"axes": [-1]})
    nodes += [wide, *(ir.node("Add", [wide.outputs[0], x]) for _ in range(20_000))]
    graph = ir.Graph([x], [nodes[-1].outputs[0]], nodes=nodes, opset_imports={"": 17})
    start = time.perf_counter()
    assert candidates.find(graph) == []
    assert time.perf_counter() - start < 5.0  # about 0.3 s; a walk that is not bounded would take minutes


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *args], capture_output=True, text=True)


def test_check_fails_on_an_unfused_jax_style_norm(tmp_path: Path):
    # Flax's spelling, clamped at 0.1 instead of 0: the clamp acts, so no rule may ever fuse it
    path = tmp_path / "flax.onnx"
    onnx.save(flax_one_pass("max", floor=0.1), path)
    checked = _cli("check", str(path))
    assert checked.returncode == 1, checked.stdout + checked.stderr
    [line] = [line for line in checked.stdout.splitlines() if line.startswith("unfused:")]
    assert "ReduceMean 'ReduceMean_0', ReduceMean 'ReduceMean_2' [layer_norm/" in line
    assert "lnfuse check: 1 candidate(s) left unfused, 0 fusable" in checked.stdout

    data = json.loads(_cli("explain", str(path), "--json").stdout)
    [entry] = data["candidates"]
    assert entry["kind"] == "centred" and not entry["fused"] and entry["rule"] == "layer_norm"
    assert {"fused", "unfused", "notes", "fused_counts", "worst_error"} <= set(data)  # the fields scripts read


@pytest.mark.parametrize("name", sorted(JAX_STYLE))
def test_check_exits_1_exactly_when_a_candidate_is_left(name: str, tmp_path: Path):
    path = tmp_path / f"{name}.onnx"
    onnx.save(JAX_STYLE[name](), path)
    checked = _cli("check", str(path), "--json")
    left = [c for c in json.loads(checked.stdout)["candidates"] if not c["fused"]]
    assert checked.returncode == (1 if left else 0)


def test_check_only_rms_norm_names_the_skipped_centred_candidates(tmp_path: Path):
    path = tmp_path / "flax.onnx"
    onnx.save(flax_one_pass("max", floor=0.1), path)
    checked = _cli("check", str(path), "--only", "rms_norm")
    assert checked.returncode == 1
    [line] = [line for line in checked.stdout.splitlines() if line.startswith("unfused:")]
    assert "[layer_norm/skipped]" in line and "layer_norm did not run (--only/--skip)" in line
    assert "lnfuse check: 1 candidate(s) of rules that did not run (layer_norm) count as left unfused" \
        in checked.stdout

    # an ordinary LayerNorm under --only rms_norm: whatever rms_norm makes of it, check does not pass silently
    ordinary = tmp_path / "ln.onnx"
    onnx.save(build(Spec(inverse="recip")), ordinary)
    only_rms = _cli("check", str(ordinary), "--only", "rms_norm", "--json")
    [entry] = json.loads(only_rms.stdout)["candidates"]
    assert only_rms.returncode == (0 if entry["fused"] else 1)
    assert entry["fused"] or entry["check"] == "skipped"


def test_a_quantized_norm_is_a_candidate_explained_by_its_rounding():
    path = Path(__file__).resolve().parent.parent / "sample_models" / "bert_tiny_qdq_op14.onnx"
    report = lnfuse.fuse(path).report
    left = [c for c in report.candidates if not c.fused]
    assert left and all(c.check == "quantized" and "QuantizeLinear" in c.reason for c in left)
    assert len(report.unfused) == len(left)
