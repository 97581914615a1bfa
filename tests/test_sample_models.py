"""Models exported by torch (legacy exporter at opset 14/17, dynamo at 18, fp16): every norm fuses and the whole
model still computes the same outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import lnfuse
from lnfuse.verification.whole_model import compare_models, random_inputs

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
LAYER = ("LayerNormalization", "SkipLayerNormalization")
RMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
# (norm ops, norms in the model, residual norms among them, embedding blocks)
EXPECTED = {
    "bert_tiny_legacy_op14.onnx": (LAYER, 5, 4, 1),
    "bert_tiny_dynamo_op18.onnx": (LAYER, 5, 4, 1),
    "bert_tiny_fp16_legacy_op14.onnx": (LAYER, 5, 4, 1),
    "roberta_tiny_legacy_op14.onnx": (LAYER, 5, 4, 1),
    "roberta_tiny_dynamo_op18.onnx": (LAYER, 5, 4, 1),
    "gpt2_tiny_legacy_op14.onnx": (LAYER, 5, 4, 1),
    "bert_embeddings_qdq_op14.onnx": (LAYER, 1, 0, 0),  # uint8 tables, float gamma: see test_qembed_tables
    "llama_tiny_legacy_op14.onnx": (RMS, 5, 4, 0),
    "llama_tiny_dynamo_op18.onnx": (RMS, 5, 4, 0),
    "llama_tiny_fp16_legacy_op17.onnx": (RMS, 5, 4, 0),
    # Hugging Face transformers exports (make_hf_samples.py). Their exporters take the sequence length from the
    # looked-up embeddings, view the ids before the lookup, and BART scales the lookup by 1.0.
    "hf_gpt2_dynamo_op18.onnx": (LAYER, 5, 4, 1),
    "hf_distilbert_legacy_op14.onnx": (LAYER, 5, 4, 1),
    "hf_bart_legacy_op14.onnx": (LAYER, 12, 10, 2),
    "hf_opt_legacy_op14.onnx": (LAYER, 5, 4, 1),
    "hf_t5_encoder_dynamo_op18.onnx": (RMS, 5, 4, 0),
    # Gemma in fp16 applies its fp32 (1 + weight) before casting back: the Skip kernel takes gamma in the input's
    # dtype, so the residual Add stays outside (exactly what the model computes)
    "hf_gemma_fp16_legacy_op17.onnx": (RMS, 5, 0, 0),
}
EMBED = ("EmbedLayerNormalization", "QEmbedLayerNormalization")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_model_fuses_every_norm(name):
    path = SAMPLES / name
    original = onnx.load(path)
    result = lnfuse.fuse(path)
    fused = result.model
    (plain, skip), total, residual, embeds = EXPECTED[name]
    ops = [n.op_type for n in fused.graph.node]
    found_embeds = sum(ops.count(op) for op in EMBED)
    assert ops.count(plain) + ops.count(skip) + found_embeds == total
    assert ops.count(skip) >= residual, "every residual norm becomes a Skip op"
    assert found_embeds == embeds, "exactly one Embed op per embedding block"
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


def test_roberta_positions_are_passed_not_dropped():
    fused = lnfuse.fuse(SAMPLES / "roberta_tiny_legacy_op14.onnx").model
    embed = next(n for n in fused.graph.node if n.op_type == "EmbedLayerNormalization")
    assert len(embed.input) == 9 and embed.input[8], "cumsum(mask) + padding_idx positions go to position_ids"
    original = onnx.load(SAMPLES / "roberta_tiny_legacy_op14.onnx")
    feeds = random_inputs(original, seed=2)
    feeds["input_ids"] = np.array([[0, 5, 6, 7, 2, 1, 1], [0, 9, 8, 2, 1, 1, 1]], dtype=np.int64)  # padded
    feeds["attention_mask"] = (feeds["input_ids"] != 1).astype(np.int64)
    assert compare_models(original, fused, feeds)["ok"]


def test_api_takes_an_onnx_ir_model_and_leaves_it_alone():
    import onnx_ir as ir

    model = ir.load(SAMPLES / "llama_tiny_dynamo_op18.onnx")
    before = ir.serde.serialize_model(model).SerializeToString()
    result = lnfuse.fuse(model)
    assert "SkipSimplifiedLayerNormalization" in [n.op_type for n in result.model.graph.node]
    assert ir.serde.serialize_model(model).SerializeToString() == before


def test_inputs_with_their_own_dim_names_keep_the_add_that_may_broadcast():
    # torch's legacy exporter names every input's dims apart when dynamic_axes are lists. Then token_type_ids may
    # be [B, 1] while input_ids is [B, S]: the embedding Add broadcasts, which the Embed/Skip kernels cannot. The
    # residual Adds inside the layers are still fused.
    model = onnx.load(SAMPLES / "bert_tiny_legacy_op14.onnx")
    for value in model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            dim.dim_param = f"{value.name}_{dim.dim_param}"
    fused = lnfuse.fuse(model).model
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("SkipLayerNormalization") == 4 and "EmbedLayerNormalization" not in ops
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 50, (2, 6)), "attention_mask": np.ones((2, 6), np.int64),
             "token_type_ids": np.zeros((2, 1), np.int64)}
    assert compare_models(model, fused, feeds)["ok"]
