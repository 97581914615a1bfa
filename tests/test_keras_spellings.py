"""Keras 3's spellings (issue 28), on keras-hub backbones exported by Keras' own ``model.export(format="onnx")``
(sample_models/frameworks/keras_hub, made by make_keras_hub.py; each npz holds Keras' own output):

- keras-hub's PositionEmbedding slices its table, ``broadcast_to(table[0:S], shape(x))``, with no position ids: that
  is the lookup of positions 0..S-1, so the embeddings become EmbedLayerNormalization (no position_ids input);
- BERT's token and segment ids are separate inputs whose dims nothing relates: the kernel gets them, and the
  positions, expanded to the broadcast the model's Add does;
- a Slice that starts elsewhere, steps by 2 or cuts the positions out of another axis is not, and says why;
- GPT-NeoX's parallel residual normalizes one input twice and the exporter computes the statistics once for both:
  each norm is fused with its own gamma/beta and no statistic is left; a statistic also read by something that is
  not one of those norms is still refused (the fused op cannot expose it).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import lnfuse

FOLDER = Path(__file__).resolve().parent.parent / "sample_models" / "frameworks" / "keras_hub"
# Keras' float32 vs ONNX Runtime's, different reduction orders
RTOL = ATOL = 1e-4
STATISTICS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "GlobalAveragePool")
# exports whose embeddings read their positions from a sliced table (folded to a constant by torch's exporter) with
# ids of one shape, per backend (tf_bert's are not: its own tests below)
SLICED = sorted(p.stem for p in FOLDER.glob("*.onnx") if p.stem.split("_", 1)[1] in ("gpt2", "token_and_position")
                or p.stem in ("jax_bert", "torch_bert"))
# those with a dynamic sequence
DYNAMIC = [name for name in SLICED if name.startswith("tf_")]
# tf2onnx's, where the norms share statistics (torch writes LayerNormalization itself)
PARALLEL = ["tf_gpt_neox"]


def _data(name: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    with np.load(FOLDER / f"{name}.npz") as npz:
        names = [str(n) for n in npz["input_names"]]
        return {n: npz[f"input_{i}"] for i, n in enumerate(names)}, npz["expected"]


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # what the file says, nothing more
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@functools.cache
def _fused(name: str, target: str = "ort") -> lnfuse.FuseResult:
    # tf2onnx writes opset 15: standard LayerNormalization needs the upgrade to 17
    return lnfuse.fuse(FOLDER / f"{name}.onnx", target=target, upgrade_opset=target == "onnx")


def _nodes(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type]


def test_every_backend_has_its_exports():
    assert {f"{backend}_{name}" for backend in ("tf", "jax", "torch") for name in ("token_and_position",)} | \
        {"tf_gpt2", "torch_gpt2", "jax_bert", "torch_bert"} <= set(SLICED)
    assert all((FOLDER / f"{name}.onnx").is_file() for name in PARALLEL)


@pytest.mark.parametrize("name", SLICED)
def test_sliced_position_table_becomes_embed_layer_norm(name):
    """The embeddings are one EmbedLayerNormalization reading no position ids (0..S-1), and the fused model computes
    what Keras computed."""
    result = _fused(name)
    embeds = _nodes(result.model, "EmbedLayerNormalization")
    assert len(embeds) == 1, [(u.rule, u.check, u.reason) for u in result.report.kept + result.report.unfused]
    position_ids = embeds[0].input[8] if len(embeds[0].input) > 8 else ""
    assert position_ids == "", "positions 0..S-1 are the kernel's default: no position_ids input"
    assert not _nodes(result.model, "Slice") or all("position" not in n.name for n in _nodes(result.model, "Slice"))
    feeds, expected = _data(name)
    np.testing.assert_allclose(_run(result.model, feeds), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", DYNAMIC)
def test_sliced_positions_at_other_lengths(name):
    """0..S-1 holds at every sequence length the table serves, not only at the sample's 8."""
    result = _fused(name)
    original = onnx.load(str(FOLDER / f"{name}.onnx"))
    feeds, _ = _data(name)
    for length in (1, 5, 16):
        resized = {k: np.resize(v, (v.shape[0], length)) for k, v in feeds.items()}
        np.testing.assert_allclose(_run(result.model, resized), _run(original, resized), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("how, reason", [
    ("offset", "takes the rows from 1 in steps of 1"),
    ("step2", "takes the rows from 0 in steps of 2"),
    ("axis1", "cuts the sequence out of axis 1 of the table"),
])
def test_other_slices_are_not_positions(how, reason):
    """table[1:S+1], table[0:2S:2] and a [H, max] table cut along axis 1 are not positions 0..S-1: no
    EmbedLayerNormalization, the reason is reported, and the numbers stay Keras'."""
    name = f"tf_position_{how}"
    result = _fused(name)
    assert not _nodes(result.model, "EmbedLayerNormalization")
    said = [f"{u.check}: {u.reason}" for u in result.report.kept] + result.report.notes
    assert any("embed_norm" in s or s.startswith("positions") for s in said) and \
        any(reason in s for s in said), said
    feeds, expected = _data(name)
    np.testing.assert_allclose(_run(result.model, feeds), expected, rtol=RTOL, atol=ATOL)


def test_constant_slice_of_dynamic_sequence_is_not_positions():
    """table[0:8] folded to a constant and broadcast to a dynamic S: at S = 1 Keras broadcasts 8 rows, which is no
    lookup of positions 0..0; no EmbedLayerNormalization, and the numbers stay Keras'."""
    result = _fused("tf_position_fixed_end")
    assert not _nodes(result.model, "EmbedLayerNormalization")
    feeds, expected = _data("tf_position_fixed_end")
    np.testing.assert_allclose(_run(result.model, feeds), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", PARALLEL)
def test_shared_statistics_fuse_every_norm(name):
    """GPT-NeoX (2 layers, parallel residual): 5 norms over 3 inputs, the statistics computed once per input. Every
    norm is fused with its own gamma/beta and no statistic is left."""
    result = _fused(name)
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("LayerNormalization") + ops.count("SkipLayerNormalization") == 5, \
        [(u.rule, u.check, u.reason) for u in result.report.unfused]
    assert not [op for op in ops if op in STATISTICS]
    assert not [n.name for n in result.model.graph.node if "layer_norm" in n.name and n.op_type in ("Neg", "Sqrt")]
    # explain and check account for every statistic, the shared ones as fused by the norms that read them
    assert len(result.report.candidates) == 3 and all(c.fused for c in result.report.candidates), \
        result.report.candidates
    feeds, expected = _data(name)
    np.testing.assert_allclose(_run(result.model, feeds), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", PARALLEL)
def test_shared_statistics_for_onnx_target(name):
    """The same with standard ops only (the model upgraded to opset 17): five LayerNormalization-17, checker-clean."""
    result = _fused(name, "onnx")
    assert [n.op_type for n in result.model.graph.node].count("LayerNormalization") == 5
    onnx.checker.check_model(result.model, full_check=True)
    assert not [n for n in result.model.graph.node if n.op_type in STATISTICS]
    feeds, expected = _data(name)
    np.testing.assert_allclose(_run(result.model, feeds), expected, rtol=RTOL, atol=ATOL)


def test_statistic_read_by_something_else_is_refused():
    """The same export with the shared -mean of the first layer's input also read by a graph output (something that
    is not one of the norms): those two norms are refused with the reason, the others still fuse, and the numbers
    stay the model's."""
    model = onnx.load(str(FOLDER / "tf_gpt_neox.onnx"))
    neg = next(n for n in model.graph.node if n.op_type == "Neg" and "transformer_layer_0" in n.name)
    model.graph.node.append(onnx.helper.make_node("Identity", [neg.output[0]], ["mean_negated"], name="reads_mean"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("mean_negated", onnx.TensorProto.FLOAT, None))
    result = lnfuse.fuse(model)
    refused = [u for u in result.report.unfused if u.check == "intermediate"]
    assert refused and all("cannot expose it" in u.reason for u in refused), result.report.explain()
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("LayerNormalization") + ops.count("SkipLayerNormalization") == 3
    assert "Neg" in ops
    feeds, _ = _data("tf_gpt_neox")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ort.InferenceSession(result.model.SerializeToString(), options,
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("tokens, segments", [
    ((2, 8), (2, 8)), ((2, 8), (2, 1)), ((2, 8), (1, 8)), ((1, 8), (2, 8)), ((2, 1), (2, 8)), ((1, 1), (2, 8)),
    ((3, 5), (3, 5)), ((2, 16), (2, 16)), ((2, 8), (3, 8)),
])
def test_bert_ids_of_unrelated_dims_are_broadcast_as_the_model_does(tokens, segments):
    """keras-hub's BERT through tf2onnx: token and segment ids are two inputs whose dims nothing relates, and the
    model broadcasts them (and the sliced positions, as long as the token ids). The embeddings become one
    EmbedLayerNormalization whose ids and position ids are expanded to that broadcast: the same numbers wherever the
    model runs, and a failure wherever it fails ([2, 8] token ids with [3, 8] segment ids)."""
    result = _fused("tf_bert")
    embeds = _nodes(result.model, "EmbedLayerNormalization")
    assert len(embeds) == 1 and len(embeds[0].input) > 8 and embeds[0].input[8], "position ids given explicitly"
    original = onnx.load(str(FOLDER / "tf_bert.onnx"))
    rng = np.random.default_rng(28)
    feeds = {"token_ids": rng.integers(0, 100, tokens).astype(np.int32),
             "segment_ids": rng.integers(0, 2, segments).astype(np.int32),
             "padding_mask": np.ones(tokens, np.int32)}
    try:
        want = _run(original, feeds)
    except Exception:  # the model itself cannot add these embeddings
        with pytest.raises(Exception):
            _run(result.model, feeds)
        return
    np.testing.assert_allclose(_run(result.model, feeds), want, rtol=RTOL, atol=ATOL)


def test_bert_matches_keras():
    feeds, expected = _data("tf_bert")
    np.testing.assert_allclose(_run(_fused("tf_bert").model, feeds), expected, rtol=RTOL, atol=ATOL)


def test_rms_norms_sharing_their_statistic_fuse_each_with_its_own_scale():
    """Two RMS norms of one x reading one 1/rms (an exporter's common-subexpression pass), each with its own scale."""
    import onnx.helper as oh
    import onnx.numpy_helper as onh

    rng = np.random.default_rng(0)
    h = 16
    nodes = [oh.make_node("Mul", ["x", "x"], ["sq"]), oh.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1]),
             oh.make_node("Add", ["ms", "eps"], ["mse"]), oh.make_node("Sqrt", ["mse"], ["rms"]),
             oh.make_node("Reciprocal", ["rms"], ["inv"]), oh.make_node("Mul", ["x", "inv"], ["n"]),
             oh.make_node("Mul", ["n", "g1"], ["y1"]), oh.make_node("Mul", ["x", "inv"], ["n2"]),
             oh.make_node("Mul", ["n2", "g2"], ["y2"])]
    inits = [onh.from_array(np.float32(1e-6), "eps"), onh.from_array(rng.normal(size=h).astype(np.float32), "g1"),
             onh.from_array(rng.normal(size=h).astype(np.float32), "g2")]
    graph = oh.make_graph(nodes, "shared_rms", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, h])],
                          [oh.make_tensor_value_info(y, onnx.TensorProto.FLOAT, [2, 3, h]) for y in ("y1", "y2")],
                          inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    result = lnfuse.fuse(model)
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("SimplifiedLayerNormalization") == 2 and "ReduceMean" not in ops, result.report.explain()
    feeds = {"x": rng.normal(size=(2, 3, h)).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
