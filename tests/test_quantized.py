"""Models quantized first, by ONNX Runtime's own quantizer (sample_models/make_quantized.py): quantize_dynamic's
int8 embedding lookups fuse exactly; quantize_static's QDQ norms stay, each reported with the reason."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
from onnx import TensorProto

import lnfuse
from normgraphs import session

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
DYNAMIC = SAMPLES / "bert_tiny_dynamic_int8_op14.onnx"
QDQ = SAMPLES / "bert_tiny_qdq_op14.onnx"


def _counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _feeds(batch: int = 2, seq: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"input_ids": rng.integers(0, 100, (batch, seq)), "token_type_ids": rng.integers(0, 2, (batch, seq)),
            "attention_mask": np.ones((batch, seq), np.int64)}


def test_norms_feeding_dynamic_quantizers_stay_by_default():
    """quantize_dynamic quantizes each MatMul's activation at run time: every norm but the last feeds one."""
    original = onnx.load(DYNAMIC)
    result = lnfuse.fuse(DYNAMIC)
    counts = _counts(result.model)
    assert counts["EmbedLayerNormalization"] + counts["SkipLayerNormalization"] == 1, counts
    left = [u for u in result.report.unfused + result.report.kept if u.check == "requantization"]
    assert len(left) == 4 and all("reaches DynamicQuantizeLinear '" in u.reason for u in left), left
    dynamic_inputs = {n.input[0] for n in original.graph.node if n.op_type == "DynamicQuantizeLinear"}
    probe = onnx.load(DYNAMIC)
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in sorted(dynamic_inputs))
    fused = result.model
    fused.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in sorted(dynamic_inputs))
    for seed in range(8):
        feeds = {k: np.random.default_rng(seed).permutation(v.ravel()).reshape(v.shape) for k, v in _feeds().items()}
        for before, after in zip(session(probe).run(None, feeds)[1:], session(fused).run(None, feeds)[1:]):
            np.testing.assert_array_equal(before, after)


def test_dynamic_int8_lookups_are_never_dequantized_whole():
    """quantize_dynamic's gamma and beta are float: QEmbedLayerNormalization would change the numbers, and the float
    EmbedLayerNormalization would dequantize every table at every run (ONNX Runtime does not fold DequantizeLinear).
    The block stays what the norm rules make, exact, and the report names the option that quantizes it."""
    result = lnfuse.fuse(DYNAMIC, verify_model=True, inputs=_feeds(), allow_requantization=True)
    fused = result.model
    counts = _counts(fused)
    assert counts["SkipLayerNormalization"] == 5 and counts["ReduceMean"] == 0
    assert counts["EmbedLayerNormalization"] == 0 and counts["QEmbedLayerNormalization"] == 0
    assert result.report.model_check["summary"].startswith("agree"), result.report.model_check
    tables = {t.name for t in fused.graph.initializer if len(t.dims) == 2 and t.data_type == TensorProto.UINT8}
    assert len(tables) >= 3 and not any(n.op_type == "DequantizeLinear" and n.input[0] in tables
                                        for n in fused.graph.node), "no DequantizeLinear reads a whole table"
    explained = result.report.explain()
    assert "gamma and beta are float" in explained and "--quantize-embeddings" in explained, explained


def test_quantize_embeddings_keeps_the_quantized_tables_and_measures_the_rest():
    original = onnx.load(DYNAMIC)
    quantized_tables = {t.name for t in original.graph.initializer if t.data_type == TensorProto.UINT8}
    result = lnfuse.fuse(DYNAMIC, quantize_embeddings="uint8", allow_requantization=True)
    qembed = next(n for n in result.model.graph.node if n.op_type == "QEmbedLayerNormalization")
    assert set(qembed.input[2:5]) <= quantized_tables, "the tables quantize_dynamic wrote are kept as they are"
    note = next(n for n in result.report.notes if "quantized 1 embedding block" in n)
    difference = float(note.rsplit(" ", 1)[-1])
    assert 0 < difference < 0.05, note  # gamma and beta are quantized now: a small, measured difference
    feeds = _feeds()
    np.testing.assert_allclose(session(result.model).run(None, feeds)[0], session(original).run(None, feeds)[0],
                               atol=0.05)


def test_qdq_norms_are_candidates_with_the_reason_they_stay():
    original = onnx.load(QDQ)
    result = lnfuse.fuse(QDQ)
    counts = _counts(result.model)
    assert counts["LayerNormalization"] + counts["SkipLayerNormalization"] == 0, "fusing would remove rounding"
    left = [u for u in result.report.unfused if u.check == "quantized"]
    assert len(left) == 5, [u.anchor for u in result.report.unfused]  # the embedding norm and 2 per layer
    assert all("QuantizeLinear" in u.reason and "fuse the float model first" in u.reason for u in left)
    assert "no normalization-like candidates" not in result.report.explain()
    feeds = _feeds()
    np.testing.assert_array_equal(session(result.model).run(None, feeds)[0], session(original).run(None, feeds)[0])


def test_a_per_axis_dequantization_after_a_lookup_is_not_commuted():
    """Only one scale for the whole table commutes with the lookup; a scale per hidden unit is refused by name."""
    rng = np.random.default_rng(0)
    h = 8
    inits = [onh.from_array(rng.integers(0, 255, (20, h)).astype(np.uint8), "word_q"),
             onh.from_array(rng.uniform(0.01, 0.02, h).astype(np.float32), "word_scale"),
             onh.from_array(np.full(h, 128, np.uint8), "word_zero"),
             onh.from_array(rng.normal(size=(16, h)).astype(np.float32), "pos"),
             onh.from_array(np.arange(16, dtype=np.int64).reshape(1, 16)[:, :4], "pos_ids"),
             onh.from_array(rng.uniform(0.5, 1.5, h).astype(np.float32), "gamma"),
             onh.from_array(rng.normal(size=h).astype(np.float32), "beta")]
    nodes = [oh.make_node("Gather", ["word_q", "ids"], ["word_rows_q"], name="word"),
             oh.make_node("DequantizeLinear", ["word_rows_q", "word_scale", "word_zero"], ["word_rows"], axis=2,
                          name="word_dq"),
             oh.make_node("Gather", ["pos", "pos_ids"], ["pos_rows"], name="position"),
             oh.make_node("Add", ["word_rows", "pos_rows"], ["s"], name="sum"),
             oh.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], epsilon=1e-5, name="norm")]
    graph = oh.make_graph(nodes, "per_axis", [oh.make_tensor_value_info("ids", TensorProto.INT64, [2, 4])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, h])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 9
    result = lnfuse.fuse(model)
    assert _counts(result.model)["EmbedLayerNormalization"] == 0
    assert any("not per tensor" in u.reason for u in result.report.unfused) or \
        any("not per tensor" in n for n in result.report.notes), (result.report.unfused, result.report.notes)
