"""Embedding lookups + sum + LayerNorm become one EmbedLayerNormalization (or QEmbedLayerNormalization from QDQ
tables) where the kernel computes the same, whatever form the position ids take."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx import TensorProto

import lnfuse
from normgraphs import EmbedBlock, op_types, session

H, V, P, T = 8, 20, 16, 2


class _G(EmbedBlock):
    """A small embedding block builder: ids [batch, seq] int64 in, norm out."""

    def arange_slice_positions(self):
        """HF BERT: a registered [1, P] arange buffer sliced to the sequence length."""
        self.const("pos_buffer", np.arange(P, dtype=np.int64).reshape(1, P))
        shape = self.node("Shape", ["ids"], "ids_shape")
        seq = self.node("Gather", [shape, self.const("one", np.array([1], np.int64))], "seq_len", axis=0)
        return self.node("Slice", ["pos_buffer", self.const("zero", np.array([0], np.int64)), seq,
                                   self.const("axis1", np.array([1], np.int64))], "pos_ids")

    def range_positions(self):
        """GPT-2: torch.arange(S) from the ids' shape, unsqueezed to [1, S]."""
        shape = self.node("Shape", ["ids"], "ids_shape")
        seq = self.node("Gather", [shape, self.const("one_s", np.array(1, np.int64))], "seq_len", axis=0)
        arange = self.node("Range", [self.const("zero_s", np.array(0, np.int64)), seq,
                                     self.const("step", np.array(1, np.int64))], "arange")
        return self.node("Unsqueeze", [arange, self.const("axis0", np.array([0], np.int64))], "pos_ids")

    def roberta_positions(self):
        """RoBERTa: cumsum(ids != pad) * mask + pad."""
        pad = self.const("pad", np.array(1, np.int64))
        mask = self.node("Cast", [self.node("Not", [self.node("Equal", ["ids", pad], "is_pad")], "keep")],
                         "mask", to=TensorProto.INT64)
        cumsum = self.node("CumSum", [mask, self.const("ax", np.array(1, np.int64))], "cumsum")
        return self.node("Add", [self.node("Mul", [cumsum, mask], "masked"), pad], "pos_ids")


def _embed(model: onnx.ModelProto, expect: str = "EmbedLayerNormalization") -> tuple[onnx.NodeProto, onnx.ModelProto]:
    result = lnfuse.fuse(model)
    fused = result.model
    nodes = [n for n in fused.graph.node if n.op_type == expect]
    assert len(nodes) == 1, (op_types(fused), result.report.unfused)
    rng = np.random.default_rng(1)
    names = [i.name for i in model.graph.input]
    for batch, seq in ((2, 5), (1, 9)):
        feeds = {n: (rng.integers(0, T, size=(batch, seq)) if n == "tt" else
                     rng.integers(2, 12, size=(batch, seq))).astype(np.int64) for n in names}
        want = session(model).run(None, feeds)
        got = session(fused).run(None, feeds)
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-3)
    return nodes[0], fused


def _bert(positions: str = "slice", vocab: int = V) -> onnx.ModelProto:
    g = _G()
    g.inputs.append(oh.make_tensor_value_info("tt", TensorProto.INT64, ["batch", "seq"]))
    word = g.node("Gather", [g.table("word", vocab), "ids"], "word_emb")
    pos_ids = g.arange_slice_positions() if positions == "slice" else g.roberta_positions()
    pos = g.node("Gather", [g.table("pos", P + 2), pos_ids], "pos_emb")
    seg = g.node("Gather", [g.table("seg", T), "tt"], "seg_emb")
    return g.norm(g.node("Add", [g.node("Add", [word, pos], "wp"), seg], "s"))


def test_bert_embeddings_with_arange_positions():
    node, fused = _embed(_bert())
    inputs = list(node.input) + [""] * (9 - len(node.input))
    assert inputs[2:5] == ["word", "pos", "seg"] and inputs[7:] == ["", ""], "0..S-1 positions are implicit"
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["epsilon"] == pytest.approx(1e-5) and attrs["mask_index_type"] == 0
    assert "Gather" not in op_types(fused) and "Slice" not in op_types(fused)


def test_roberta_positions_are_passed_as_position_ids():
    node, fused = _embed(_bert(positions="roberta"))
    assert len(node.input) == 9 and node.input[8], "non-trivial positions go to the position_ids input"
    assert "CumSum" in op_types(fused), "the nodes computing them are kept"


def test_gpt2_style_without_segment():
    g = _G()
    word = g.node("Gather", [g.table("word", V), "ids"], "word_emb")
    pos = g.node("Gather", [g.table("pos", P), g.range_positions()], "pos_emb")
    node, _ = _embed(g.norm(g.node("Add", [pos, word], "s")))
    assert node.input[1] == "" and node.input[2] == "word" and node.input[3] == "pos"
    assert len(node.input) <= 8


def test_explicit_position_ids_input():
    g = _G()
    g.inputs.append(oh.make_tensor_value_info("pids", TensorProto.INT64, ["batch", "seq"]))
    word = g.node("Gather", [g.table("word", V), "ids"], "word_emb")
    pos = g.node("Gather", [g.table("pos", P), "pids"], "pos_emb")
    node, _ = _embed(g.norm(g.node("Add", [word, pos], "s")))
    assert node.input[8].startswith("lnfuse_ids"), "int64 position ids are cast to int32"


def test_constant_negative_position_ids_are_not_given_to_the_kernel():
    # ONNX Gather counts negative ids from the end of the table; the kernel refuses them at run time
    g = _G()
    g.inputs[0] = oh.make_tensor_value_info("ids", TensorProto.INT64, [2, 4])
    word = g.node("Gather", [g.table("word", V), "ids"], "word_emb")
    pos = g.node("Gather", [g.table("pos", P), g.const("pids", np.arange(-4, 0, dtype=np.int64).reshape(1, 4))],
                 "pos_emb")
    model = g.norm(g.node("Add", [word, pos], "s"))
    model.graph.output[0].type.tensor_type.shape.CopyFrom(onnx.TensorShapeProto(dim=[
        onnx.TensorShapeProto.Dimension(dim_value=d) for d in (2, 4, H)]))
    result = lnfuse.fuse(model)
    assert "EmbedLayerNormalization" not in op_types(result.model)
    assert any("outside 0..15" in note for note in result.report.notes)
    feeds = {"ids": np.arange(8, dtype=np.int64).reshape(2, 4)}
    np.testing.assert_allclose(session(result.model).run(None, feeds)[0], session(model).run(None, feeds)[0],
                               atol=1e-4, rtol=1e-3)


def test_embedding_sum_read_elsewhere_is_output_2():
    g = _G()
    g.inputs.append(oh.make_tensor_value_info("tt", TensorProto.INT64, ["batch", "seq"]))
    word = g.node("Gather", [g.table("word", V), "ids"], "word_emb")
    pos = g.node("Gather", [g.table("pos", P), g.arange_slice_positions()], "pos_emb")
    seg = g.node("Gather", [g.table("seg", T), "tt"], "seg_emb")
    s = g.node("Add", [g.node("Add", [word, pos], "wp"), seg], "s")
    node, _ = _embed(g.norm(s, outputs=("Y", "s")))
    assert len(node.output) == 3 and node.output[1] == "" and node.output[2] == "s"


def test_partial_sum_read_elsewhere_is_not_embedded():
    g = _G()
    g.inputs.append(oh.make_tensor_value_info("tt", TensorProto.INT64, ["batch", "seq"]))
    word = g.node("Gather", [g.table("word", V), "ids"], "word_emb")
    pos = g.node("Gather", [g.table("pos", P), g.arange_slice_positions()], "pos_emb")
    seg = g.node("Gather", [g.table("seg", T), "tt"], "seg_emb")
    s = g.node("Add", [g.node("Add", [word, pos], "wp"), seg], "s")
    model = g.norm(s, outputs=("Y", "wp"))
    result = lnfuse.fuse(model)
    assert "EmbedLayerNormalization" not in op_types(result.model)
    # the kernel cannot output word + position alone: the last Add and the norm become a Skip op instead
    assert "SkipLayerNormalization" in op_types(result.model)
    assert any("embed_norm left" in note and "'wp'" in note for note in result.report.notes), \
        "the report says why the block is a Skip op and not an Embed op"
    feeds = {"ids": np.array([[3, 4, 5]]), "tt": np.array([[0, 1, 0]])}
    for want, got in zip(session(model).run(None, feeds), session(result.model).run(None, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_target_onnx_keeps_the_lookups():
    result = lnfuse.fuse(_bert(), target="onnx")
    assert "EmbedLayerNormalization" not in op_types(result.model)
    assert "LayerNormalization" in op_types(result.model)


def _qdq_bert(positions: str = "slice", vocab: int = V) -> onnx.ModelProto:
    """The embedding block with uint8 per-tensor tables, gamma and beta behind DequantizeLinear."""
    model = _bert(positions, vocab)
    graph = model.graph
    new_inits, dq_nodes = [], []
    for init in list(graph.initializer):
        if init.name not in ("word", "pos", "seg", "gamma", "beta"):
            new_inits.append(init)
            continue
        data = onh.to_array(init)
        lo, hi = float(min(data.min(), 0)), float(max(data.max(), 0))
        scale = (hi - lo) / 255 or 1.0
        zero = int(round(-lo / scale))
        q = np.clip(np.round(data / scale) + zero, 0, 255).astype(np.uint8)
        new_inits += [onh.from_array(q, init.name + "_q"), onh.from_array(np.array(scale, np.float32),
                                                                          init.name + "_scale"),
                      onh.from_array(np.array(zero, np.uint8), init.name + "_zp")]
        dq_nodes.append(oh.make_node("DequantizeLinear", [init.name + "_q", init.name + "_scale",
                                                          init.name + "_zp"], [init.name]))
    del graph.initializer[:]
    graph.initializer.extend(new_inits)
    nodes = dq_nodes + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    return model


def test_qdq_embeddings_become_qembed():
    node, fused = _embed(_qdq_bert(), expect="QEmbedLayerNormalization")
    assert [node.input[i] for i in (2, 3, 4, 5, 6)] == ["word_q", "pos_q", "seg_q", "gamma_q", "beta_q"]
    assert len(node.output) == 2 and node.output[1], "mask_index_out is a required output"
    assert "DequantizeLinear" not in op_types(fused)


def test_qdq_with_explicit_positions_never_drops_positions_nor_dequantizes_whole_tables():
    """QEmbedLayerNormalization takes no position_ids, and the float kernel would dequantize every table at every
    run (ONNX Runtime does not fold DequantizeLinear): the block stays what the norm rules make, with the reason."""
    model = _qdq_bert(positions="roberta")
    result = lnfuse.fuse(model)
    ops = op_types(result.model)
    assert "EmbedLayerNormalization" not in ops and "QEmbedLayerNormalization" not in ops
    assert "SkipLayerNormalization" in ops or "LayerNormalization" in ops
    explained = result.report.explain()
    assert "not provably 0..S-1" in explained and "does not fold" in explained, explained
    feeds = {"ids": np.array([[2, 3, 4]]), "tt": np.array([[0, 1, 1]])}
    np.testing.assert_allclose(session(result.model).run(None, feeds)[0], session(model).run(None, feeds)[0],
                               atol=1e-5)


def test_verification_stops_a_rule_that_would_drop_position_ids(monkeypatch):
    """If the rule wrongly took RoBERTa's positions for 0..S-1, QEmbedLayerNormalization would drop them: the
    verification in ORT (random quantized tables, as the 9,000-row table is too large to read) must refuse it."""
    from lnfuse.rules import embed_norm
    real = embed_norm._is_arange
    monkeypatch.setattr(embed_norm, "_is_arange", lambda ids, depth=0: ids.name == "pos_ids" or real(ids, depth))
    result = lnfuse.fuse(_qdq_bert(positions="roberta", vocab=9000), only=["embed_norm"])
    assert "QEmbedLayerNormalization" not in op_types(result.model)
    refused = [u for u in result.report.kept if u.rule == "embed_norm"]
    assert refused and all(u.check == "verify" for u in refused), result.report.kept


@pytest.mark.parametrize("positions", ["slice", "roberta"])
def test_verification_stops_a_wrong_epsilon_on_a_large_vocabulary(monkeypatch, positions):
    """The random tables of a 9,000-row vocabulary keep the small-variance rows where a wrong epsilon shows."""
    from lnfuse.rules import embed_norm
    monkeypatch.setattr(embed_norm, "kernel_epsilon", lambda node, default: 1e-3)
    result = lnfuse.fuse(_bert(positions=positions, vocab=9000), only=["embed_norm"])
    assert not result.report.fused and [u.check for u in result.report.kept] == ["verify"]


@pytest.mark.parametrize("scheme", ["uint8", "int8"])
def test_quantize_embeddings_on_request(scheme):
    model = _bert()
    result = lnfuse.fuse(model, quantize_embeddings=scheme)
    nodes = [n for n in result.model.graph.node if n.op_type == "QEmbedLayerNormalization"]
    assert len(nodes) == 1 and "EmbedLayerNormalization" not in op_types(result.model)
    dtypes = {t.name: t.data_type for t in result.model.graph.initializer}
    want = TensorProto.UINT8 if scheme == "uint8" else TensorProto.INT8
    assert all(dtypes[nodes[0].input[i]] == want for i in (2, 3, 4, 5, 6))
    note = next(n for n in result.report.notes if "quantized 1 embedding" in n)
    worst = float(note.rsplit(" ", 1)[-1])
    assert 0 < worst < 0.2, note
    feeds = {"ids": np.array([[2, 3, 4]]), "tt": np.array([[0, 1, 1]])}
    np.testing.assert_allclose(session(result.model).run(None, feeds)[0], session(model).run(None, feeds)[0],
                               atol=0.2)


def test_quantize_never_drops_position_ids():
    result = lnfuse.fuse(_bert(positions="roberta"), quantize_embeddings="uint8")
    assert "QEmbedLayerNormalization" not in op_types(result.model)
    assert any(u.rule == "quantize_embeddings" and "position_ids" in u.reason for u in result.report.unfused)


def test_quantize_leaves_a_float16_block_as_it_is():
    # QEmbedLayerNormalization has a float32 kernel only: an fp16 model keeps its EmbedLayerNormalization
    from pathlib import Path
    sample = Path(__file__).resolve().parent.parent / "sample_models" / "bert_tiny_fp16_legacy_op14.onnx"
    result = lnfuse.fuse(sample, quantize_embeddings="int8")
    assert "EmbedLayerNormalization" in op_types(result.model)
    assert "QEmbedLayerNormalization" not in op_types(result.model)
    assert any(u.rule == "quantize_embeddings" and "float32" in u.reason for u in result.report.unfused)
    session(result.model)  # ORT loads it


def _sliced_to_mask_axis(axis: int) -> onnx.ModelProto:
    """transformers' dynamo form (DeBERTa-v2): position_ids[:, :S] with S read from the attention mask's shape,
    and token types as zeros expanded to the mask's shape."""
    g = _G()
    g.inputs.append(oh.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "seq"]))
    g.const("pos_buffer", np.arange(P, dtype=np.int64).reshape(1, P))
    end = g.node("Shape", ["mask"], "mask_len", start=axis, end=axis + 1)
    pos_ids = g.node("Slice", ["pos_buffer", g.const("zero", np.array([0], np.int64)), end,
                               g.const("axis1", np.array([1], np.int64))], "pos_ids")
    batch = g.node("Shape", ["mask"], "mask_batch", start=0, end=1)
    seq = g.node("Shape", ["mask"], "mask_seq", start=1, end=2)
    zeros = g.node("Expand", [g.const("zero_s", np.array(0, np.int64)),
                              g.node("Concat", [batch, seq], "mask_shape", axis=0)], "token_types")
    word = g.node("Gather", [g.table("word", V), "ids"], "word_emb")
    pos = g.node("Gather", [g.table("pos", P), pos_ids], "pos_emb")
    seg = g.node("Gather", [g.table("seg", T), zeros], "seg_emb")
    return g.norm(g.node("Add", [g.node("Add", [word, pos], "wp"), seg], "s"))


def test_positions_sliced_to_the_sequence_length_of_another_input():
    node, fused = _embed(_sliced_to_mask_axis(1))
    inputs = list(node.input) + [""] * (9 - len(node.input))
    assert inputs[2:5] == ["word", "pos", "seg"] and inputs[8] == "", "proved 0..S-1: the kernel's own positions"


def test_positions_sliced_to_the_batch_size_are_not_taken_for_0_to_s():
    result = lnfuse.fuse(_sliced_to_mask_axis(0))
    ops = op_types(result.model)
    assert "EmbedLayerNormalization" not in ops, "min(P, batch) positions are not 0..S-1"


def test_deberta_v2_from_the_dynamo_exporter():
    """transformers' DeBERTa-v2 (sample_models/make_deberta_sample.py): its embedding block fuses exactly."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "sample_models" / "deberta_v2_tiny_dynamo_op18.onnx"
    result = lnfuse.fuse(path, verify_model=True)
    embeds = [n for n in result.model.graph.node if n.op_type == "EmbedLayerNormalization"]
    assert len(embeds) == 1 and len(embeds[0].input) <= 8, "positions are the kernel's own 0..S-1"
    assert result.report.model_check["summary"].startswith("agree"), result.report.model_check


def _folded(term: np.ndarray) -> onnx.ModelProto:
    """A static-shape export with constant folding: the position lookup of 0..S-1 is a stored [.., S, H] term."""
    g = _G()
    g.inputs[0] = oh.make_tensor_value_info("ids", TensorProto.INT64, [2, 4])
    word = g.node("Gather", [g.table("word", V), "ids"], "word_emb")
    model = g.norm(g.node("Add", [word, g.const("pos_term", term.astype(np.float32))], "s"))
    model.graph.output[0].type.tensor_type.shape.CopyFrom(onnx.TensorShapeProto(dim=[
        onnx.TensorShapeProto.Dimension(dim_value=d) for d in (2, 4, H)]))
    return model


def test_a_folded_position_term_is_the_position_table():
    term = np.random.default_rng(4).normal(size=(1, 4, H))
    result = lnfuse.fuse(_folded(term), verify_model=True)
    embed = [n for n in result.model.graph.node if n.op_type == "EmbedLayerNormalization"]
    assert len(embed) == 1 and len(embed[0].input) <= 8, op_types(result.model)
    assert result.report.model_check["summary"].startswith("agree")


def test_a_constant_term_that_differs_between_batch_rows_is_not_a_lookup():
    term = np.random.default_rng(4).normal(size=(2, 4, H))
    result = lnfuse.fuse(_folded(term), verify_model=True)
    assert "EmbedLayerNormalization" not in op_types(result.model)
    assert any("differs between batch rows" in note for note in result.report.notes), result.report.notes
    assert result.report.model_check["summary"].startswith("agree")
