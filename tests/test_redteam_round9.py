"""Red team, round 9: Keras' sliced position tables, statistics shared between norms, quantized embedding tables.

Each model below runs in ONNX Runtime at the sizes fed; lnfuse under its default options must write a model that
computes the same there (or runs wherever the original runs).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

import lnfuse

H, VOCAB = 8, 20


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def _same(model: onnx.ModelProto, fused: onnx.ModelProto, feeds: dict) -> None:
    expected = _run(model, feeds)
    for want, got in zip(expected, _run(fused, feeds)):
        assert want.shape == got.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _embedding(end_nodes: list, rows: int, ids_shape=("B", "S")) -> onnx.ModelProto:
    """LayerNorm(word[ids] + pos[0:end]), Keras' PositionEmbedding with ``end`` computed by ``end_nodes`` from
    ``shape`` = Shape(ids)."""
    rng = np.random.default_rng(0)
    nodes = [oh.make_node("Gather", ["word", "ids"], ["we"]),
             oh.make_node("Shape", ["ids"], ["shape"]),
             *end_nodes,
             oh.make_node("Slice", ["pos", "zero", "end", "zero"], ["pe"]),
             oh.make_node("Add", ["we", "pe"], ["sum"]),
             oh.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    inits = [numpy_helper.from_array(a, n) for n, a in [
        ("word", rng.standard_normal((VOCAB, H)).astype(np.float32)),
        ("pos", rng.standard_normal((rows, H)).astype(np.float32)),
        ("zero", np.array([0])), ("one", np.array([1])), ("two", np.array([2])),
        ("gamma", (rng.standard_normal(H) + 1).astype(np.float32)),
        ("beta", rng.standard_normal(H).astype(np.float32))]]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("ids", TensorProto.INT64, list(ids_shape))],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", H])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _ids(seq: int) -> dict:
    return {"ids": np.random.default_rng(1).integers(0, VOCAB, (1, seq))}


@pytest.mark.parametrize("narrow", [TensorProto.UINT8, TensorProto.INT8, TensorProto.INT16])
def test_slice_end_through_a_narrowing_cast_is_not_the_sequence_length(narrow):
    """end = Cast(Cast(S, uint8), int64) is S only below 256: at S = 257 the Slice keeps row 0 alone, which the Add
    broadcasts to every position, while EmbedLayerNormalization adds positions 0..256. The verification sizes
    (2 to 7) never wrap."""
    wrap = {TensorProto.UINT8: 257, TensorProto.INT8: 257, TensorProto.INT16: 65537}[narrow]
    model = _embedding([oh.make_node("Slice", ["shape", "one", "two"], ["s"]),
                        oh.make_node("Cast", ["s"], ["narrow"], to=narrow),
                        oh.make_node("Cast", ["narrow"], ["end"], to=TensorProto.INT64)], rows=wrap + 10)
    fused = lnfuse.fuse(model).model
    for seq in (3, wrap):
        _same(model, fused, _ids(seq))


def test_slice_end_through_a_cast_to_bool_runs_where_the_original_runs():
    """end = Cast(Cast(S, bool), int64) is 1: the one position row is broadcast. The embedding rule's verification
    refuses its rewrite; the Skip op written instead must still run (ORT's symbolic inference carries S through the
    Cast to bool, so the position term was taken for [S, H])."""
    model = _embedding([oh.make_node("Slice", ["shape", "one", "two"], ["s"]),
                        oh.make_node("Cast", ["s"], ["flag"], to=TensorProto.BOOL),
                        oh.make_node("Cast", ["flag"], ["end"], to=TensorProto.INT64)], rows=16)
    fused = lnfuse.fuse(model).model
    _same(model, fused, _ids(3))


@pytest.mark.parametrize("tokens, segments", [((0, 8), (1, 8)), ((1, 8), (0, 8)), ((0, 1), (1, 8))])
def test_bert_ids_broadcast_with_an_empty_batch(tokens, segments):
    """keras-hub's BERT through tf2onnx broadcasts token ids of batch 0 with segment ids of batch 1 to batch 0 (the
    Add broadcasts 1 to 0), and runs. The ids were expanded to the elementwise Max of their shapes, batch 1, which is
    not their broadcast: the kernel then had ids of batch 0 and segment ids of batch 1."""
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "sample_models" / "frameworks" / "keras_hub" / "tf_bert.onnx"
    model = onnx.load(str(path))
    fused = lnfuse.fuse(model).model
    assert any(n.op_type == "EmbedLayerNormalization" for n in fused.graph.node)
    rng = np.random.default_rng(9)
    feeds = {"token_ids": rng.integers(0, 100, tokens).astype(np.int32),
             "segment_ids": rng.integers(0, 2, segments).astype(np.int32),
             "padding_mask": np.ones(tokens, np.int32)}
    _same(model, fused, feeds)


@pytest.mark.parametrize("scheme", ["uint8", "int8"])
@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_quantize_embeddings_of_a_table_holding_nan_or_inf(scheme, bad):
    """A word table with one NaN (or -inf) entry: --quantize-embeddings took its range for the scale, and crashed
    (uint8: the zero point of a NaN range) or made every entry NaN (int8), where the model is NaN only where that row
    is read. The block is left to the float kernel instead."""
    model = _embedding([oh.make_node("Slice", ["shape", "one", "two"], ["end"])], rows=16)
    word = next(t for t in model.graph.initializer if t.name == "word")
    table = numpy_helper.to_array(word).copy()
    table[3, 2] = bad
    word.CopyFrom(numpy_helper.from_array(table, "word"))
    result = lnfuse.fuse(model, quantize_embeddings=scheme)
    feeds = {"ids": np.array([[1, 2, 4]])}  # row 3 unread: the model's output is finite
    assert np.isfinite(_run(result.model, feeds)[0]).all()
    _same(model, result.model, feeds)


def _norms_sharing_statistics(count: int) -> onnx.ModelProto:
    """``count`` LayerNorms of one input written out, sharing the mean, the variance and the standard deviation
    (an exporter's common subexpressions), each with its own gamma and beta: a model of a few tens of KB."""
    rng = np.random.default_rng(0)
    nodes = [oh.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]), oh.make_node("Sub", ["x", "mean"], ["d"]),
             oh.make_node("Mul", ["d", "d"], ["sq"]), oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             oh.make_node("Add", ["var", "eps"], ["ve"]), oh.make_node("Sqrt", ["ve"], ["sd"])]
    inits, outputs = [numpy_helper.from_array(np.float32(1e-5), "eps")], []
    for i in range(count):
        nodes += [oh.make_node("Div", ["d", "sd"], [f"n{i}"]), oh.make_node("Mul", [f"n{i}", f"g{i}"], [f"m{i}"]),
                  oh.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"])]
        inits += [numpy_helper.from_array(rng.standard_normal(H).astype(np.float32), f"g{i}"),
                  numpy_helper.from_array(rng.standard_normal(H).astype(np.float32), f"b{i}")]
        outputs.append(oh.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["B", "S", H]))
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", H])], outputs,
                          inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_many_norms_sharing_statistics_fuse_in_time_linear_in_their_number():
    """Each norm proved every other norm's readers of the shared statistics its siblings, anew: quadratic in the
    number of norms (120 norms 6.5 s, 240 norms 25 s, 300 about 40 s for a 60 KB model). The proofs hold for the
    pass: 300 norms take a few seconds."""
    import time
    model = _norms_sharing_statistics(300)
    start = time.perf_counter()
    result = lnfuse.fuse(model)
    took = time.perf_counter() - start
    assert [n.op_type for n in result.model.graph.node] == ["LayerNormalization"] * 300
    assert took < 20, f"{took:.1f} s"
    _same(model, result.model, {"x": np.random.default_rng(2).standard_normal((2, 3, H)).astype(np.float32)})


def test_quantize_embeddings_never_leaves_a_whole_table_dequantized_for_a_nan_gamma():
    """quantize_dynamic's BERT (int8 tables) with a NaN in the float gamma, under --quantize-embeddings: the
    embedding rule handed the block over (EmbedLayerNormalization reading each table through a DequantizeLinear of
    the whole table) to a pass that cannot quantize gamma; the block must be left to the norm rules instead."""
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "sample_models" / "bert_tiny_dynamic_int8_op14.onnx"
    model = onnx.load(str(path))
    gamma = next(t for t in model.graph.initializer if t.name == "model.embeddings.LayerNorm.weight")
    values = numpy_helper.to_array(gamma).copy()
    values[1] = np.nan
    gamma.CopyFrom(numpy_helper.from_array(values, gamma.name))
    result = lnfuse.fuse(model, quantize_embeddings="uint8", allow_requantization=True)
    ops = [n.op_type for n in result.model.graph.node]
    assert "EmbedLayerNormalization" not in ops and "QEmbedLayerNormalization" not in ops
    rng = np.random.default_rng(3)
    feeds = {i.name: rng.integers(0, 2 if i.name == "token_type_ids" else 100, (2, 5)) for i in model.graph.input}
    feeds.update({n: np.ones((2, 5), np.int64) for n in feeds if n == "attention_mask"})
    _same(model, result.model, feeds)


def test_position_slice_ending_at_int32_min_does_not_crash():
    """keras-hub's BERT with the position Slice's ends [INT32_MIN, INT32_MAX]: ONNX Runtime's symbolic inference
    gives the rows it keeps (none) the dim -1, carried to the residual sum [B, -1, 32]; verification drew inputs of
    that shape and numpy raised (exit 3 from the CLI)."""
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "sample_models" / "frameworks" / "keras_hub" / "tf_bert.onnx"
    model = onnx.load(str(path))
    node = next(n for n in model.graph.node if n.name == "functional_1/position_embedding_1/Slice")
    model.graph.initializer.append(numpy_helper.from_array(np.array([-2**31, 2**31 - 1], np.int32), "red_end"))
    node.input[2] = "red_end"
    result = lnfuse.fuse(model)
    rng = np.random.default_rng(4)
    feeds = {"token_ids": rng.integers(0, 100, (2, 0)).astype(np.int32),
             "segment_ids": rng.integers(0, 2, (2, 0)).astype(np.int32), "padding_mask": np.ones((2, 0), np.int32)}
    try:
        _run(model, feeds)
    except Exception:  # noqa: BLE001 - the model itself fails here: only the crash is under test
        return
    _same(model, result.model, feeds)


def test_where_on_an_equal_of_the_sequence_length_is_not_the_sequence_length():
    """end = Where(S == 100, 1, S): ORT's symbolic inference took S == 100 for False (Python's == on sympy
    expressions) and typed the position rows [S, H]; at S = 100 they are [1, H], which the Add broadcasts. The
    Skip op written over that Add failed there ("last two dimensions of skip needs to be same as input"), and
    verification, feeding the rows in the inferred shape at small sizes, could not see it."""
    model = _embedding([oh.make_node("Slice", ["shape", "one", "two"], ["s"]),
                        oh.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array([100]))),
                        oh.make_node("Equal", ["s", "k"], ["eq"]),
                        oh.make_node("Where", ["eq", "one", "s"], ["end"])], rows=200)
    fused = lnfuse.fuse(model).model
    for seq in (3, 100):
        _same(model, fused, _ids(seq))


@pytest.mark.xfail(strict=True, reason="not fixed: ORT's inference assumes graph input dims positive; keeping Max and "
                   "Min only where decided loses the shapes of HF's dynamic-int8 embeddings (test_qembed_tables)")
def test_max_of_the_sequence_length_and_one_is_not_the_sequence_length_of_an_empty_sequence():
    """end = Max(S, 1): ORT's symbolic inference takes a graph input's dims for positive and made it S; for an empty
    sequence it is 1, the Add broadcasts [1, H] over [B, 0, H], and the Skip op written over it refused."""
    model = _embedding([oh.make_node("Slice", ["shape", "one", "two"], ["s"]),
                        oh.make_node("Max", ["s", "one"], ["end"])], rows=20)
    fused = lnfuse.fuse(model).model
    for seq in (0, 3):
        _same(model, fused, {"ids": np.zeros((2, seq), np.int64)})
