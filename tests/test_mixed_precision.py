"""fp16 norms whose statistics the fp16 converters keep in float32 (``op_block_list=[ReduceMean, Pow, Sqrt,
Reciprocal]``, a ``node_block_list`` of the statistics nodes, onnxconverter-common) fuse as the norm with its
statistics in float32 (``stash_type=1``); a Cast that rounds the statistics below the norm's own precision, or out of
the floats, keeps the norm as it is, and explain says which Cast.

The models are real converter output (``sample_models/make_mixed_precision.py``); the near-misses below are the
converter's Cast form with one Cast changed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto

import lnfuse
from lnfuse.verification.whole_model import random_inputs

FOLDER = Path(__file__).resolve().parent.parent / "sample_models" / "mixed_precision"
#: norms in each converted model (as in its float source, tests/test_sample_models.py)
NORMS = {
    "bert_tiny_legacy_op14_ort_ops_keepio.onnx": 5,
    "bert_tiny_dynamo_op18_ort_ops.onnx": 5,
    "bert_tiny_dynamo_op18_ort_nodes.onnx": 5,
    "gpt2_tiny_legacy_op14_occ_ops_keepio.onnx": 5,
    "convnext_tiny_legacy_op14_occ_ops.onnx": 5,
    "llama_tiny_legacy_op14_ort_ops.onnx": 5,
    "llama_tiny_dynamo_op18_ort_ops_keepio.onnx": 5,
    "llama_tiny_legacy_op14_ort_nodes_keepio.onnx": 5,
    "llama_tiny_dynamo_op18_occ_ops_keepio.onnx": 5,
    "sam_neck_legacy_op14_ort_ops.onnx": 2,
}
NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization", "SkipLayerNormalization",
            "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization")
#: the tolerance of a float16 model's outputs (lnfuse's verification of a float16 rewrite uses the same)
FP16 = dict(atol=1e-2, rtol=1e-2)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _agree(original: onnx.ModelProto, fused: onnx.ModelProto, seeds=(0, 1, 2)) -> None:
    for seed in seeds:
        feeds = random_inputs(original, seed=seed)
        for want, got in zip(_run(original, feeds), _run(fused, feeds)):
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **FP16)


@pytest.mark.parametrize("name", sorted(NORMS))
def test_every_converted_norm_fuses_and_computes_what_the_model_did(name):
    original = onnx.load(FOLDER / name)
    result = lnfuse.fuse(FOLDER / name)
    ops = [n.op_type for n in result.model.graph.node]
    # the norms found by what they compute, independently of the rules: every one fused
    assert [c.fused for c in result.report.candidates] == [True] * NORMS[name] and not result.report.unfused
    assert sum(ops.count(op) for op in NORM_OPS) == NORMS[name]
    assert "Sqrt" not in ops, "each norm's statistics went with it (ConvNeXt's pooling head is a ReduceMean of its own)"
    _agree(original, result.model)


@pytest.mark.parametrize("name", sorted(NORMS))
def test_standard_ops_keep_float16_with_float32_statistics(name):
    """``--target onnx --upgrade-opset``: LayerNormalization-17 or RMSNormalization-23 reading the float16 tensor
    itself with ``stash_type=1``, which the full checker accepts and ONNX Runtime runs."""
    original = onnx.load(FOLDER / name)
    result = lnfuse.fuse(FOLDER / name, target="onnx", upgrade_opset=True)
    model = result.model
    onnx.checker.check_model(model, full_check=True)
    norms = [n for n in model.graph.node if n.op_type in ("LayerNormalization", "RMSNormalization")]
    assert len(norms) == NORMS[name] and [c.fused for c in result.report.candidates] == [True] * NORMS[name]
    typed = onnx.shape_inference.infer_shapes(model).graph
    dtypes = {v.name: v.type.tensor_type.elem_type for v in list(typed.value_info) + list(typed.input)}
    dtypes.update({t.name: t.data_type for t in typed.initializer})
    for norm in norms:
        assert {a.name: a.i for a in norm.attribute if a.name == "stash_type"}.get("stash_type", 1) == 1
        assert dtypes[norm.input[0]] == dtypes[norm.input[1]] == TensorProto.FLOAT16, "no Cast around the norm"
    _agree(original, model)


@pytest.mark.parametrize("name", ["user_ln_var_unbiased_false_dynamo_op18_fp16", "user_ln_var_mean_dynamo_op18_fp16"])
def test_torch_var_in_float16_through_dynamo_fuses(name):
    """torch's dynamo exporter computes ``torch.var`` / ``var_mean`` of a float16 tensor in float32 and rounds the
    mean and the variance back to float16 (``tests/sweep/run_sweep.py --samples sample_models/sweep``): the same
    form as the converters', one LayerNormalization with ``stash_type=1``."""
    original = onnx.load(FOLDER.parent / "sweep" / f"{name}.onnx")
    result = lnfuse.fuse(original)
    (norm,) = [n for n in result.model.graph.node if n.op_type == "LayerNormalization"]
    assert {a.name: a.i for a in norm.attribute}.get("stash_type", 1) == 1
    assert [c.fused for c in result.report.candidates] == [True]
    _agree(original, result.model)


def test_statistics_in_bfloat16_are_not_a_wider_computation():
    """ONNX Runtime's converter with ``use_bfloat16_as_blocked_nodes_dtype=True`` rounds an fp16 norm's
    statistics to bfloat16, three mantissa bits fewer than float16: another function, left as it is."""
    result = lnfuse.fuse(FOLDER / "bert_tiny_dynamo_op18_ort_bf16_stats.onnx")
    assert [c.fused for c in result.report.candidates] == [False] * 5 and len(result.report.unfused) == 5
    for left in result.report.unfused:
        assert left.check == "dtype"
        assert "to BFLOAT16 inside the norm, below the precision of its FLOAT16 input" in left.reason


# ---- near-misses: the converter's Cast form with one Cast changed ----------------------------------------------

H = 8


def _converter_norm(x_type: int, stats: int, variance_via: int | None = None) -> onnx.ModelProto:
    """LayerNorm of x in the form fp16 converters write: each statistics op reads ``Cast(·, stats)`` and its result is
    cast back to x's type. ``variance_via``: the variance goes through a Cast to this type and back first."""
    nodes, n = [], iter(range(1000))

    def op(op_type: str, *inputs: str, **attrs) -> str:
        out = f"v{next(n)}"
        nodes.append(oh.make_node(op_type, list(inputs), [out], name=f"{op_type}_{out}", **attrs))
        return out

    def blocked(op_type: str, *inputs: str, **attrs) -> str:
        return op("Cast", op(op_type, *[op("Cast", i, to=stats) for i in inputs], **attrs), to=x_type)

    np_type = onnx.helper.tensor_dtype_to_np_dtype(x_type)
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array(np.array(2, np_type), "two"),
             onnx.numpy_helper.from_array(np.array(1e-3, np_type), "eps"),
             onnx.numpy_helper.from_array(rng.uniform(0.5, 1.5, H).astype(np_type), "gamma"),
             onnx.numpy_helper.from_array(rng.normal(0, 0.1, H).astype(np_type), "beta")]
    mean = blocked("ReduceMean", "x", axes=[-1])
    d = op("Sub", "x", mean)
    var = blocked("ReduceMean", blocked("Pow", d, "two"), axes=[-1])
    if variance_via is not None:
        var = op("Cast", op("Cast", var, to=variance_via), to=x_type)
    std = blocked("Sqrt", op("Add", var, "eps"))
    y = op("Add", op("Mul", op("Div", d, std), "gamma"), "beta")
    graph = oh.make_graph(nodes, "norm", [oh.make_tensor_value_info("x", x_type, ["B", 4, H])],
                          [oh.make_tensor_value_info(y, x_type, ["B", 4, H])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    return model


def test_float16_norm_with_float32_statistics_fuses():
    model = _converter_norm(TensorProto.FLOAT16, TensorProto.FLOAT)
    result = lnfuse.fuse(model)
    (norm,) = [n for n in result.model.graph.node if n.op_type == "LayerNormalization"]
    assert [n.op_type for n in result.model.graph.node] == ["LayerNormalization"], "every Cast went with the norm"
    assert {a.name: a.i for a in norm.attribute}["stash_type"] == 1
    onnx.checker.check_model(result.model, full_check=True)
    _agree(model, result.model)


@pytest.mark.parametrize("x_type, stats, via, reason", [
    # a float32 model whose statistics are rounded to float16 between the ops: a float16 norm's numbers
    (TensorProto.FLOAT, TensorProto.FLOAT16, None,
     "rounds FLOAT to FLOAT16 inside the norm, below the precision of its FLOAT input"),
    # the variance truncated to an integer
    (TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.INT32, "turns FLOAT16 into INT32 inside the norm"),
    # statistics in float32 that come back through bfloat16, not float16
    (TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.BFLOAT16,
     "rounds FLOAT16 to BFLOAT16 inside the norm, below the precision of its FLOAT16 input"),
])
def test_cast_that_rounds_the_statistics_below_the_norm_is_not_fused(x_type, stats, via, reason):
    result = lnfuse.fuse(_converter_norm(x_type, stats, via))
    assert not result.report.fused
    (left,) = result.report.unfused
    assert left.check == "dtype" and reason in left.reason, left.reason
