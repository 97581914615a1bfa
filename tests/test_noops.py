"""Residual and embedding sums behind no-ops (paddle2onnx's ``Add -> Identity -> Identity -> LayerNorm``, inference
Dropouts, Reshapes and Casts to what the value already is) fuse like sums read directly; ops that only look like
no-ops (a Reshape that changes the shape, a Cast that changes the dtype, a Dropout in training) are not read
through."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx_ir as ir
import pytest
from onnx import TensorProto

import lnfuse
from lnfuse.match.pattern import noop_source
from normgraphs import feeds_for, op_types, run

H = 8


class _Paddle:
    """A post-norm transformer sublayer the way paddle2onnx writes it: ``MatMul + bias`` then the residual Add,
    then whatever no-ops the exporter leaves, then the norm (decomposed at opset 13, native at 17). Nodes are
    named ``p2o.<Op>.<n>`` like paddle2onnx's."""

    def __init__(self, opset: int = 13, dtype=np.float32, batch="batch"):
        self.opset, self.dtype = opset, dtype
        self.elem = oh.np_dtype_to_tensor_dtype(np.dtype(dtype))
        self.nodes, self.inits, self.n = [], [], 0
        self.rng = np.random.default_rng(0)
        self.shape = [batch, 3, H]
        self.inputs = [oh.make_tensor_value_info("x", self.elem, self.shape)]
        self.outputs: list[tuple[str, int]] = []

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> str:
        self.n += 1
        outs = [f"p2o.{op_type}.{self.n}.tmp_{i}" for i in range(n_out)]
        self.nodes.append(oh.make_node(op_type, inputs, outs, name=f"p2o.{op_type}.{self.n}", **attrs))
        return outs[0]

    def const(self, array, hint: str) -> str:
        name = f"{hint}_{len(self.inits)}"
        self.inits.append(onh.from_array(np.asarray(array), name))
        return name

    def residual(self) -> str:
        w = self.const(self.rng.normal(scale=0.3, size=(H, H)).astype(self.dtype), "linear_0.w_0")
        b = self.const(self.rng.normal(size=H).astype(self.dtype), "linear_0.b_0")
        projected = self.op("Add", [self.op("MatMul", ["x", w]), b])
        return self.op("Add", [projected, "x"])

    def layer_norm(self, s: str, dtype=None, h: int = H) -> str:
        dtype = dtype or self.dtype
        gamma = self.const(self.rng.uniform(0.5, 1.5, h).astype(dtype), "layer_norm_0.w_0")
        beta = self.const(self.rng.normal(size=h).astype(dtype), "layer_norm_0.b_0")
        if self.opset >= 17:
            return self.op("LayerNormalization", [s, gamma, beta], axis=-1, epsilon=1e-5)
        mean = self.op("ReduceMean", [s], axes=[-1])
        d = self.op("Sub", [s, mean])
        var = self.op("ReduceMean", [self.op("Pow", [d, self.const(np.array(2, dtype), "two")])], axes=[-1])
        std = self.op("Sqrt", [self.op("Add", [var, self.const(np.array(1e-5, dtype), "eps")])])
        return self.op("Add", [self.op("Mul", [self.op("Div", [d, std]), gamma]), beta])

    def output(self, name: str, dtype: int | None = None) -> str:
        self.outputs.append((name, dtype or self.elem))
        return name

    def model(self) -> onnx.ModelProto:
        return _typed(self.nodes, self.inputs, self.outputs, self.inits, self.opset)


def _typed(nodes, inputs, outputs: list[tuple[str, int]], inits, opset: int) -> onnx.ModelProto:
    """The model with its outputs typed as exporters type them (shapes from onnx's inference)."""
    untyped = [oh.make_tensor_value_info(n, t, None) for n, t in outputs]
    model = oh.make_model(oh.make_graph(nodes, "paddle", inputs, untyped, inits),
                          opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    typed = onnx.shape_inference.infer_shapes(model).graph.output
    for out in typed:
        if not out.type.tensor_type.HasField("shape"):  # Reshape(s, Shape(s)) at opset 13: the exporter knows
            out.type.tensor_type.shape.CopyFrom(inputs[0].type.tensor_type.shape)
    model.graph.ClearField("output")
    model.graph.output.extend(typed)
    onnx.checker.check_model(model)
    return model


def _identity2(g: _Paddle, s: str) -> str:
    return g.op("Identity", [g.op("Identity", [s])])


def _reshape_const(g: _Paddle, s: str) -> str:
    return g.op("Reshape", [s, g.const(np.array([2, 3, H], np.int64), "shape")])


def _reshape_shape_of(g: _Paddle, s: str) -> str:
    return g.op("Reshape", [s, g.op("Shape", [s])])


def _cast_same(g: _Paddle, s: str) -> str:
    return g.op("Cast", [s], to=g.elem)


def _dropout_no_flag(g: _Paddle, s: str) -> str:
    # paddle2onnx at opset 13: ratio given, no training_mode, mask not written
    return g.op("Dropout", [s, g.const(np.array(0.1, np.float32), "ratio")])


def _dropout_false(g: _Paddle, s: str) -> str:
    return g.op("Dropout", [s, g.const(np.array(0.1, np.float32), "ratio"), g.const(np.array(False), "training")])


NOOPS = {"identity_identity": _identity2, "reshape_constant": _reshape_const, "reshape_shape_of": _reshape_shape_of,
         "cast_same_type": _cast_same, "dropout": _dropout_no_flag, "dropout_training_false": _dropout_false,
         "mixed": lambda g, s: _dropout_no_flag(g, _reshape_shape_of(g, _identity2(g, s)))}


def _fuse_and_compare(model: onnx.ModelProto, feeds: dict | None = None) -> lnfuse.FuseResult:
    result = lnfuse.fuse(model)
    feeds = feeds or feeds_for(model)
    for want, got in zip(run(model, feeds), run(result.model, feeds), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)
    return result


def _count(model: onnx.ModelProto, op_type: str) -> int:
    return op_types(model).count(op_type)


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("noop", sorted(NOOPS))
def test_residual_behind_noops_becomes_a_skip_norm(noop, opset):
    batch = 2 if noop == "reshape_constant" else "batch"  # a constant target equals a static shape only
    g = _Paddle(opset, batch=batch)
    g.output(g.layer_norm(NOOPS[noop](g, g.residual())))
    result = _fuse_and_compare(g.model())
    types = op_types(result.model)
    assert types.count("SkipLayerNormalization") == 1, (types, result.report.unfused)
    assert not {"Identity", "Dropout", "Cast", "Reshape", "ReduceMean"} & set(types), types
    assert types.count("Add") == 0, "the bias goes into the kernel, the residual Add is the kernel's sum"


def test_a_noop_read_elsewhere_reads_the_kernels_sum():
    """Pre-norm style: the next sublayer reads the Identity's output (the sum) too; it takes output 3, and the
    Cast whose result is a graph output gives it that output's name."""
    g = _Paddle(17)
    s = g.residual()
    first = g.op("Identity", [s])
    kept = g.op("Cast", [first], to=g.elem)
    g.output(g.layer_norm(g.op("Identity", [kept])))
    g.output(g.op("Mul", [first, g.const(np.array(2.0, np.float32), "two")]))
    g.output(kept)
    result = _fuse_and_compare(g.model())
    (skip,) = [n for n in result.model.graph.node if n.op_type == "SkipLayerNormalization"]
    assert len(skip.output) == 4 and skip.output[3], "the sum is read, so output 3 is written"
    assert not {"Identity", "Cast"} & set(op_types(result.model))
    assert [o.name for o in result.model.graph.output] == [o.name for o in g.model().graph.output]


def test_rms_residual_behind_identities():
    g = _Paddle(23)
    s = _identity2(g, g.residual())
    gamma = g.const(g.rng.uniform(0.5, 1.5, H).astype(np.float32), "rms_norm_0.w_0")
    g.output(g.op("RMSNormalization", [s, gamma], axis=-1, epsilon=1e-6))
    result = _fuse_and_compare(g.model())
    assert _count(result.model, "SkipSimplifiedLayerNormalization") == 1, op_types(result.model)


def test_noops_after_an_opt_style_flattening_reshape():
    """OPT flattens the sum to [B*S, H] before the norm: no-ops on either side of that Reshape are read through."""
    g = _Paddle(17, batch=2)
    s = g.op("Identity", [g.residual()])
    flat = g.op("Reshape", [s, g.const(np.array([-1, H], np.int64), "flat")])
    g.output(g.layer_norm(_dropout_no_flag(g, flat)))
    result = _fuse_and_compare(g.model())
    assert _count(result.model, "SkipLayerNormalization") == 1, op_types(result.model)
    assert not {"Identity", "Dropout"} & set(op_types(result.model))


# ---- not no-ops -----------------------------------------------------------------------------------------------------

def _not_fused_through(g: _Paddle, make, h: int = H) -> tuple[lnfuse.FuseResult, onnx.NodeProto]:
    """Build residual -> ``make`` -> norm; the op ``make`` wrote must not be read as a no-op, and the fused model
    computes what the model computes."""
    s = g.residual()
    between = make(g, s)
    node = g.nodes[-1]
    assert between == node.output[0]
    g.output(g.layer_norm(between, h=h))
    model = g.model()
    found = ir.from_proto(model).graph.node(node.name)
    assert noop_source(found) is None, f"{node.op_type} '{node.name}' taken for a no-op"
    return _fuse_and_compare(model), node


def test_a_reshape_that_changes_the_shape_is_not_a_noop():
    """[2, 3, 8] split into heads [2, 3, 2, 4], normalized over the 4: no kernel over the sum computes that."""
    g = _Paddle(17, batch=2)
    result, _ = _not_fused_through(
        g, lambda g, s: g.op("Reshape", [s, g.const(np.array([2, 3, 2, 4], np.int64), "split")]), h=4)
    assert _count(result.model, "SkipLayerNormalization") == 0, op_types(result.model)


def test_a_reshape_to_a_permuted_shape_is_not_a_noop():
    """[2, 3, H] to [3, 2, H] keeps the element count and the last axis: OPT's path moves it after the kernel,
    but it is no no-op."""
    g = _Paddle(17, batch=2)
    _, node = _not_fused_through(g, lambda g, s: g.op("Reshape", [s, g.const(np.array([3, 2, H], np.int64), "p")]))
    assert node.op_type == "Reshape"


def test_a_reshape_to_another_values_shape_is_not_a_noop():
    g = _Paddle(17, batch=2)
    g.inputs.append(oh.make_tensor_value_info("other", g.elem, [3, 2, H]))
    _not_fused_through(g, lambda g, s: g.op("Reshape", [s, g.op("Shape", ["other"])]))


def test_a_cast_that_changes_the_type_is_not_a_noop():
    """float32 sum -> Cast(float16) -> fp16 norm: a SkipLayerNormalization over the float32 addends would compute
    the norm in float32 and give a float32 result where the model gives float16."""
    g = _Paddle(17)

    def to_half(g, s):
        return g.op("Cast", [s], to=TensorProto.FLOAT16)
    s = g.residual()
    half = to_half(g, s)
    node = g.nodes[-1]
    g.output(g.layer_norm(half, dtype=np.float16), TensorProto.FLOAT16)
    model = g.model()
    assert noop_source(ir.from_proto(model).graph.node(node.name)) is None
    result = lnfuse.fuse(model)
    assert _count(result.model, "SkipLayerNormalization") == 0, op_types(result.model)
    assert _count(result.model, "Cast") == 1
    feeds = feeds_for(model)
    (want,), (got,) = run(model, feeds), run(result.model, feeds)
    assert got.dtype == want.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("why", ["training_true", "training_input", "mask_read"])
def test_a_dropout_that_may_drop_is_not_a_noop(why):
    g = _Paddle(17)
    if why == "training_input":
        g.inputs.append(oh.make_tensor_value_info("training", TensorProto.BOOL, []))
    s = g.residual()
    ratio = g.const(np.array(0.5, np.float32), "ratio")
    flag = {"training_true": g.const(np.array(True), "training"), "training_input": "training",
            "mask_read": g.const(np.array(False), "training")}[why]
    dropped = g.op("Dropout", [s, ratio, flag], n_out=2, seed=7)
    node = g.nodes[-1]
    g.output(g.layer_norm(dropped))
    if why == "mask_read":
        g.output(node.output[1], TensorProto.BOOL)
    model = g.model()
    assert noop_source(ir.from_proto(model).graph.node(node.name)) is None
    result = lnfuse.fuse(model)
    assert _count(result.model, "SkipLayerNormalization") == 0, op_types(result.model)
    assert _count(result.model, "Dropout") == 1
    feeds = feeds_for(model)
    if why == "training_input":
        feeds["training"] = np.array(False)
    if why != "training_true":  # dropping at random, the two runs draw different masks
        for want, got in zip(run(model, feeds), run(result.model, feeds), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


# ---- embeddings ---------------------------------------------------------------------------------------------------

def _embedding(noop: str | None, read_sum: bool = False) -> onnx.ModelProto:
    """paddle2onnx's ERNIE/BERT embeddings: word + position lookups, the sum, no-ops, LayerNorm (opset 17)."""
    rng = np.random.default_rng(0)
    inits = [onh.from_array(rng.normal(size=(30, H)).astype(np.float32), "word_embeddings"),
             onh.from_array(rng.normal(size=(16, H)).astype(np.float32), "pos_embeddings"),
             onh.from_array(rng.uniform(0.5, 1.5, H).astype(np.float32), "ln.w"),
             onh.from_array(rng.normal(size=H).astype(np.float32), "ln.b")]
    nodes = [oh.make_node("Gather", ["word_embeddings", "input_ids"], ["word"], name="p2o.Gather.0"),
             oh.make_node("Gather", ["pos_embeddings", "position_ids"], ["pos"], name="p2o.Gather.1"),
             oh.make_node("Add", ["word", "pos"], ["sum"], name="p2o.Add.2")]
    last = "sum"
    g = _Paddle(17)  # only for the no-op writers
    if noop is not None:
        g.nodes, g.inits = nodes, inits
        last = NOOPS[noop](g, last)
    nodes.append(oh.make_node("LayerNormalization", [last, "ln.w", "ln.b"], ["Y"], name="p2o.LayerNorm.9",
                              epsilon=1e-12))
    outputs = [("Y", TensorProto.FLOAT)]
    if read_sum:  # the next layer reads the value between the no-ops
        nodes.append(oh.make_node("Mul", [nodes[3].output[0], "ln.w"], ["Z"], name="p2o.Mul.10"))
        outputs.append(("Z", TensorProto.FLOAT))
    inputs = [oh.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              oh.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])]
    return _typed(nodes, inputs, outputs, inits, 17)


def _ids(batch: int = 2, seq: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"input_ids": rng.integers(0, 30, size=(batch, seq)).astype(np.int64),
            "position_ids": np.tile(np.arange(seq, dtype=np.int64), (batch, 1))}


@pytest.mark.parametrize("noop", ["identity_identity", "reshape_shape_of", "dropout", "dropout_training_false",
                                  "mixed"])
def test_embedding_sum_behind_noops_becomes_embed_layer_norm(noop):
    result = _fuse_and_compare(_embedding(noop), _ids())
    types = op_types(result.model)
    assert types.count("EmbedLayerNormalization") == 1, (types, result.report.unfused)
    assert not {"Identity", "Dropout", "Reshape", "Add", "LayerNormalization"} & set(types), types


def test_embedding_sum_read_between_noops_is_the_kernels_embedding_sum():
    model = _embedding("identity_identity", read_sum=True)
    result = _fuse_and_compare(model, _ids())
    (embed,) = [n for n in result.model.graph.node if n.op_type == "EmbedLayerNormalization"]
    assert len(embed.output) == 3 and embed.output[2], "the sum is read, so embedding_sum is written"
    assert "Identity" not in op_types(result.model)


def test_embedding_sum_behind_a_shape_changing_reshape_is_no_embedding_block():
    model = _embedding(None)
    graph = model.graph
    del graph.node[-1]
    graph.node.extend([
        oh.make_node("Reshape", ["sum", "flat"], ["sum_2d"], name="p2o.Reshape.3"),
        oh.make_node("LayerNormalization", ["sum_2d", "ln.w", "ln.b"], ["Y"], name="p2o.LayerNorm.9",
                     epsilon=1e-12)])
    graph.initializer.append(onh.from_array(np.array([-1, H], np.int64), "flat"))
    assert noop_source(ir.from_proto(model).graph.node("p2o.Reshape.3")) is None
    result = _fuse_and_compare(model, _ids())
    types = op_types(result.model)
    assert "EmbedLayerNormalization" not in types, "the kernel's output is 3-D, the norm's is 2-D"
