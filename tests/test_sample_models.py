"""Models exported by torch (legacy exporter at opset 14/17, dynamo at 18, fp16): every norm fuses and the whole
model still computes the same outputs."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

import lnfuse
from lnfuse.whole_model import compare_models, random_inputs

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
EXPECTED = {
    "bert_tiny_legacy_op14.onnx": ("LayerNormalization", 5),
    "bert_tiny_dynamo_op18.onnx": ("LayerNormalization", 5),
    "bert_tiny_fp16_legacy_op14.onnx": ("LayerNormalization", 5),
    "llama_tiny_legacy_op14.onnx": ("SimplifiedLayerNormalization", 5),
    "llama_tiny_dynamo_op18.onnx": ("SimplifiedLayerNormalization", 5),
    "llama_tiny_fp16_legacy_op17.onnx": ("SimplifiedLayerNormalization", 5),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_model_fuses_every_norm(name):
    path = SAMPLES / name
    original = onnx.load(path)
    result = lnfuse.fuse(path)
    fused = result.model
    op, count = EXPECTED[name]
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count(op) == count
    assert "ReduceMean" not in ops
    assert not result.report.unfused
    assert fused.ir_version == original.ir_version, "the IR version is kept"
    check = compare_models(original, fused, random_inputs(original, seed=3))
    assert check["ok"], check


def test_target_onnx_on_opset18_llama_needs_upgrade_for_rms():
    result = lnfuse.fuse(SAMPLES / "llama_tiny_dynamo_op18.onnx", target="onnx")
    assert not result.report.fused
    assert {u.check for u in result.report.unfused} == {"opset"}
    onnx.checker.check_model(result.model, full_check=True)


def test_fp16_model_keeps_its_dtype_at_the_norm_boundary():
    result = lnfuse.fuse(SAMPLES / "llama_tiny_fp16_legacy_op17.onnx")
    graph = result.model.graph
    inits = {t.name: t.data_type for t in graph.initializer}
    norms = [n for n in graph.node if n.op_type == "SimplifiedLayerNormalization"]
    assert norms and all(inits.get(n.input[1]) == onnx.TensorProto.FLOAT16 for n in norms)
    # the fp32 Casts around each norm's statistics were folded into stash_type
    assert [n.op_type for n in graph.node].count("Cast") <= 32 - 2 * len(norms)
