"""Embedding tables ONNX Runtime's quantizer already made 8-bit (sample_models/make_quantized_tables.py and
make_quantized.py): QEmbedLayerNormalization over the tables as they are, never an EmbedLayerNormalization reading
a DequantizeLinear of a whole table (ONNX Runtime does not fold it: every run would dequantize every table)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx import TensorProto
from onnxruntime.quantization.quant_utils import quantize_data

import lnfuse
from normgraphs import session

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
DYNAMIC = SAMPLES / "bert_tiny_dynamic_int8_op14.onnx"  # Gather(uint8 table) -> DequantizeLinear, with segments
DISTILBERT = SAMPLES / "hf_distilbert_dynamic_int8_op14.onnx"  # the same without segments
QDQ_INT8 = SAMPLES / "bert_tiny_qdq_gather_int8_op14.onnx"  # DequantizeLinear(int8 table) -> Gather
QDQ_MATMUL = SAMPLES / "bert_tiny_qdq_gather_matmul_op14.onnx"  # the norm's output reaches a QuantizeLinear
ROBERTA = SAMPLES / "roberta_tiny_dynamic_int8_op14.onnx"  # positions computed from the ids


def _feeds(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    batch, seq = (1, 8) if seed % 2 else (3, 5)
    feeds = {}
    for value in model.graph.input:
        if value.name == "attention_mask":
            feeds[value.name] = np.ones((batch, seq), np.int64)
        else:
            feeds[value.name] = rng.integers(0, 2 if value.name == "token_type_ids" else 100, (batch, seq))
    return feeds


def _tables(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer
            if len(t.dims) == 2 and t.data_type in (TensorProto.INT8, TensorProto.UINT8)}


def _whole_table_dequantized(model: onnx.ModelProto, tables) -> list[str]:
    """DequantizeLinear nodes of a whole table read by anything but the lookup the quantizer wrote."""
    lookups = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    return [n.name for n in model.graph.node
            if n.op_type == "DequantizeLinear" and n.input[0] in tables and n.output[0] not in lookups]


def _agree(fused: onnx.ModelProto, original: onnx.ModelProto, atol: float) -> None:
    for seed in (1, 2, 3):
        feeds = _feeds(original, seed)
        np.testing.assert_allclose(session(fused).run(None, feeds)[0], session(original).run(None, feeds)[0],
                                   atol=atol, rtol=0)


def _qembed(model: onnx.ModelProto) -> onnx.NodeProto:
    found = [n for n in model.graph.node if n.op_type == "QEmbedLayerNormalization"]
    assert len(found) == 1, [n.op_type for n in model.graph.node]
    return found[0]


@pytest.mark.parametrize("path", [DYNAMIC, QDQ_INT8], ids=["gather_then_dq", "dq_then_gather"])
def test_float_gamma_and_beta_leave_the_block_exact_and_name_the_option(path):
    """(The block's output feeds the first layer's quantizers: allowed here, so the embedding rule is what decides.)"""
    original = onnx.load(path)
    result = lnfuse.fuse(path, allow_requantization=True)
    ops = [n.op_type for n in result.model.graph.node]
    assert "EmbedLayerNormalization" not in ops and "QEmbedLayerNormalization" not in ops
    assert "ReduceMean" not in ops, "the norm rules still fuse the block"
    assert not _whole_table_dequantized(result.model, _tables(original))
    explained = result.report.explain()
    assert "gamma and beta are float" in explained and "--quantize-embeddings" in explained, explained
    _agree(result.model, original, atol=1e-5)


@pytest.mark.parametrize("scheme", ["uint8", "int8"])
@pytest.mark.parametrize("path", [DYNAMIC, DISTILBERT, QDQ_INT8], ids=["dynamic", "no_segment", "qdq_int8"])
def test_quantize_embeddings_takes_the_tables_as_they_are(path, scheme, tmp_path):
    original = onnx.load(path)
    tables = _tables(original)
    result = lnfuse.fuse(path, quantize_embeddings=scheme, allow_requantization=True)
    node = _qembed(result.model)
    inits = {t.name: t for t in result.model.graph.initializer}
    table_inputs = [name for name in node.input[2:5] if name]
    assert len(table_inputs) == (2 if path == DISTILBERT else 3)
    for name in table_inputs:
        assert name in tables and inits[name].SerializeToString() == tables[name].SerializeToString(), \
            f"'{name}' is the quantizer's table, byte for byte"
    quantized = [inits[name].data_type for name in node.input[2:7] if name] + \
        [inits[name].data_type for name in node.input[13:18] if name]
    assert set(quantized) == {tables[table_inputs[0]].data_type}, "one type, the tables' own"
    assert not _whole_table_dequantized(result.model, tables)
    assert not any(n.op_type == "EmbedLayerNormalization" for n in result.model.graph.node)
    note = next(n for n in result.report.notes if "quantized 1 embedding block" in n)
    worst = float(note.rsplit(" ", 1)[-1])
    assert 0 < worst < 0.1, note  # gamma and beta are quantized now: measured, and small
    written = result.save(tmp_path / "fused.onnx")[0]
    onnx.checker.check_model(onnx.load(written), full_check=True)
    _agree(result.model, original, atol=0.1)


def _gamma_beta_quantized(path: Path) -> onnx.ModelProto:
    """The QDQ model with the embedding norm's gamma and beta also behind DequantizeLinear, quantized per tensor by
    ONNX Runtime's own quant_utils (uint8, asymmetric), where the tables are int8: the kernel's one type is reached
    by re-encoding gamma and beta."""
    model = onnx.load(path)
    graph = model.graph
    for name in ("embedding_norm.weight", "embedding_norm.bias"):
        init = next(t for t in graph.initializer if t.name == name)
        data = onh.to_array(init)
        zero, scale, q = quantize_data(data, TensorProto.UINT8, symmetric=False)
        graph.initializer.remove(init)
        graph.initializer.extend([onh.from_array(np.asarray(q, np.uint8).reshape(data.shape), f"{name}_q"),
                                  onh.from_array(np.asarray(scale, np.float32).reshape(()), f"{name}_scale"),
                                  onh.from_array(np.asarray(zero, np.uint8).reshape(()), f"{name}_zp")])
        graph.node.insert(0, oh.make_node("DequantizeLinear", [f"{name}_q", f"{name}_scale", f"{name}_zp"], [name],
                                          name=f"{name}_dq"))
    onnx.checker.check_model(model, full_check=True)
    return model


def test_tables_gamma_and_beta_quantized_become_qembed_exactly(tmp_path):
    model = _gamma_beta_quantized(QDQ_INT8)
    tables = _tables(model)
    result = lnfuse.fuse(model)
    node = _qembed(result.model)
    inits = {t.name: t for t in result.model.graph.initializer}
    assert all(inits[name].SerializeToString() == tables[name].SerializeToString() for name in node.input[2:5])
    assert {inits[name].data_type for name in node.input[2:7]} == {TensorProto.INT8}, "gamma, beta re-encoded"
    assert not _whole_table_dequantized(result.model, tables)
    assert [f.max_error for f in result.report.fused if f.op_type == "QEmbedLayerNormalization"][0] < 1e-5
    onnx.checker.check_model(onnx.load(result.save(tmp_path / "fused.onnx")[0]), full_check=True)
    _agree(result.model, model, atol=1e-5)  # exact but for the kernel's rounding


def test_qembed_in_front_of_a_quantizer_is_not_written_silently():
    """The fused output reaches a QuantizeLinear: under the default requantization rule the block is not written
    as QEmbedLayerNormalization, and the report says why; with allow_requantization it is, over the tables as they
    are."""
    model = _gamma_beta_quantized(QDQ_MATMUL)
    result = lnfuse.fuse(model)
    assert not [f for f in result.report.fused if f.op_type == "QEmbedLayerNormalization"]
    assert "QEmbedLayerNormalization" not in [n.op_type for n in result.model.graph.node]
    explained = result.report.explain()
    assert "QuantizeLinear" in explained and "--allow-requantization" in explained, explained
    allowed = lnfuse.fuse(model, allow_requantization=True)
    node = _qembed(allowed.model)
    assert set(node.input[2:5]) <= set(_tables(model))
    _agree(allowed.model, model, atol=0.1)


def test_positions_not_0_to_s_are_refused_with_the_reason():
    original = onnx.load(ROBERTA)
    result = lnfuse.fuse(ROBERTA, quantize_embeddings="uint8", allow_requantization=True)
    ops = [n.op_type for n in result.model.graph.node]
    assert "QEmbedLayerNormalization" not in ops and "EmbedLayerNormalization" not in ops
    assert not _whole_table_dequantized(result.model, _tables(original))
    explained = result.report.explain()
    assert "not provably 0..S-1" in explained and "takes no position_ids" in explained, explained
    _agree(result.model, original, atol=1e-5)


def test_a_per_axis_table_is_refused_with_the_reason():
    """A scale per hidden unit in front of the lookup: no one scale per table for QEmbedLayerNormalization."""
    model = onnx.load(QDQ_INT8)
    graph = model.graph
    dq = next(n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "word.weight_quantized")
    for i, name in ((1, "word.weight_scale_per_axis"), (2, "word.weight_zero_point_per_axis")):
        value = onh.to_array(next(t for t in graph.initializer if t.name == dq.input[i]))
        graph.initializer.append(onh.from_array(np.full(32, value, value.dtype) * (1 if i == 2 else np.linspace(
            0.5, 1.5, 32, dtype=np.float32)), name))
        dq.input[i] = name
    dq.attribute.append(oh.make_attribute("axis", 1))
    # the quantizer's Q/DQ pair after the lookup rounds to the per-tensor scale: gone with it, the rows go on as read
    rows = next(n for n in graph.node if n.op_type == "Gather" and n.input[0] == dq.output[0]).output[0]
    pair = [n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] == rows]
    pair += [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] == pair[0].output[0]]
    for node in graph.node:
        node.input[:] = [rows if name == pair[1].output[0] else name for name in node.input]
    for node in pair:
        graph.node.remove(node)
    onnx.checker.check_model(model, full_check=True)
    result = lnfuse.fuse(model, quantize_embeddings="uint8")
    assert "QEmbedLayerNormalization" not in [n.op_type for n in result.model.graph.node]
    explained = result.report.explain()
    assert "not per tensor" in explained, explained
    _agree(result.model, model, atol=1e-5)
