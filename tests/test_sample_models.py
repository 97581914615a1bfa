"""Models exported by torch (legacy exporter at opset 14/17, dynamo at 18, fp16): every norm fuses and the whole
model still computes the same outputs."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

import lnfuse
from lnfuse.whole_model import compare_models, random_inputs

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
LAYER = ("LayerNormalization", "SkipLayerNormalization")
RMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
# (norm ops, norms in the model, residual norms among them)
EXPECTED = {
    "bert_tiny_legacy_op14.onnx": (LAYER, 5, 4),
    "bert_tiny_dynamo_op18.onnx": (LAYER, 5, 4),
    "bert_tiny_fp16_legacy_op14.onnx": (LAYER, 5, 4),
    "llama_tiny_legacy_op14.onnx": (RMS, 5, 4),
    "llama_tiny_dynamo_op18.onnx": (RMS, 5, 4),
    "llama_tiny_fp16_legacy_op17.onnx": (RMS, 5, 4),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_model_fuses_every_norm(name):
    path = SAMPLES / name
    original = onnx.load(path)
    result = lnfuse.fuse(path)
    fused = result.model
    (plain, skip), total, residual = EXPECTED[name]
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count(plain) + ops.count(skip) + ops.count("EmbedLayerNormalization") == total
    assert ops.count(skip) >= residual, "every residual norm becomes a Skip op"
    if plain == "LayerNormalization":
        assert ops.count("EmbedLayerNormalization") == 1, "one Embed op per embedding block"
    assert "ReduceMean" not in ops
    assert not result.report.unfused
    assert fused.ir_version == original.ir_version, "the IR version is kept"
    check = compare_models(original, fused, random_inputs(original, seed=3))
    assert check["ok"], check


@pytest.mark.parametrize("name", ["llama_tiny_legacy_op14.onnx", "llama_tiny_dynamo_op18.onnx"])
def test_pre_norm_residual_sum_is_read_from_output_3(name):
    fused = lnfuse.fuse(SAMPLES / name).model
    skips = [n for n in fused.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    readers = {i for n in fused.graph.node for i in n.input}
    with_sum = [n for n in skips if len(n.output) == 4 and n.output[3] in readers]
    assert len(with_sum) >= 3, "the next residual Add reads the sum the Skip op outputs"
    assert all(n.output[1] == "" and n.output[2] == "" for n in with_sum)
    assert fused.opset_import[-1].domain == "com.microsoft" or any(
        o.domain == "com.microsoft" for o in fused.opset_import)


def test_target_onnx_never_writes_contrib_ops():
    result = lnfuse.fuse(SAMPLES / "bert_tiny_dynamo_op18.onnx", target="onnx")
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("LayerNormalization") == 5 and "SkipLayerNormalization" not in ops
    onnx.checker.check_model(result.model, full_check=True)


def test_target_onnx_on_opset18_llama_needs_upgrade_for_rms():
    result = lnfuse.fuse(SAMPLES / "llama_tiny_dynamo_op18.onnx", target="onnx")
    assert not result.report.fused
    assert {u.check for u in result.report.unfused} == {"opset"}
    onnx.checker.check_model(result.model, full_check=True)


def test_fp16_model_keeps_its_dtype_at_the_norm_boundary():
    result = lnfuse.fuse(SAMPLES / "llama_tiny_fp16_legacy_op17.onnx")
    graph = result.model.graph
    inits = {t.name: t.data_type for t in graph.initializer}
    norms = [n for n in graph.node if n.op_type in RMS]
    assert norms and all(inits.get(n.input[2 if n.op_type.startswith("Skip") else 1]) == onnx.TensorProto.FLOAT16
                         for n in norms)
    # the fp32 Casts around each norm's statistics were folded into stash_type
    assert [n.op_type for n in graph.node].count("Cast") <= 32 - 2 * len(norms)
