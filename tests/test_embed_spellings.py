"""Embedding lookups the way MindSpore and jax2onnx (vmapped Equinox) write them are EmbedLayerNormalization when
the rule proves they are lookups: a Reshape of the ids and a Reshape back that restores ids.shape + [hidden], unit
axes added or moved, an Expand the Add would do anyway. Near-misses (a Reshape to another shape, a Transpose that
permutes the rows, rows spread over the wrong axis, a target given at run time) are refused with the reason, and
whatever is fused or left, the model computes what it computed (ONNX Runtime, graph optimizations off)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import lnfuse
from normgraphs import EmbedBlock, op_types, session

H, V, P, S = 8, 20, 16, 8
RUNTIME_SHAPE = [2, S, H]  # fed to a graph input named "shape"


def _check_numbers(model: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    """Original and fused agree on valid ids, for two batch sizes where the batch is symbolic."""
    rng = np.random.default_rng(3)
    for batch in (2, 3):
        feeds = {}
        for value in model.graph.input:
            t = value.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else batch for d in t.shape.dim]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
            feeds[value.name] = (np.array(RUNTIME_SHAPE, dtype) if value.name == "shape" else
                                 rng.integers(0, V, size=dims).astype(dtype))
        for want, got in zip(session(model).run(None, feeds), session(fused).run(None, feeds)):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def _fuse(model: onnx.ModelProto) -> lnfuse.FuseResult:
    result = lnfuse.fuse(model)
    _check_numbers(model, result.model)
    return result


def _embed(model: onnx.ModelProto) -> tuple[onnx.NodeProto, onnx.ModelProto]:
    result = _fuse(model)
    nodes = [n for n in result.model.graph.node if n.op_type == "EmbedLayerNormalization"]
    assert len(nodes) == 1, (op_types(result.model), result.report.notes, result.report.unfused)
    return nodes[0], result.model


def _refused(model: onnx.ModelProto, because: str) -> lnfuse.FuseResult:
    """Not an EmbedLayerNormalization, and the report says why (a note when a Skip op was written instead)."""
    result = _fuse(model)
    assert "EmbedLayerNormalization" not in op_types(result.model)
    said = list(result.report.notes) + [u.reason for u in result.report.kept if u.rule == "embed_norm"]
    assert any(because in text for text in said), said
    return result


def _i64(values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _positions(g: EmbedBlock, ids_dtype=np.int32) -> str:
    """The position lookup of a constant 0..S-1 as MindSpore stores it: [S, H] rows."""
    return g.node("Gather", [g.table("pos", P), g.const("pos_ids", np.arange(S, dtype=ids_dtype))], "pos_rows")


def _mindspore(ids_shape=(2, S)) -> onnx.ModelProto:
    """MindSpore's nn.Embedding: Reshape(ids, [-1]) -> Gather -> Reshape back; the position lookup reshaped to
    [1, S, H]."""
    g = EmbedBlock(ids_dtype=TensorProto.INT32, ids_shape=ids_shape)
    flat = g.node("Reshape", ["ids", g.const("minus_one", _i64([-1]))], "flat_ids")
    rows = g.node("Gather", [g.table("word", V), flat], "word_rows")
    word = g.node("Reshape", [rows, g.const("word_shape", _i64(list(ids_shape) + [H]))], "word_emb")
    pos = g.node("Reshape", [_positions(g), g.const("pos_shape", _i64([1, S, H]))], "pos_emb")
    return g.norm(g.node("Add", [word, pos], "s"))


def _reshaped_to(ids_shape, transpose: bool = False) -> onnx.ModelProto:
    g = EmbedBlock(ids_dtype=TensorProto.INT32, ids_shape=ids_shape)
    ids = g.node("Transpose", ["ids"], "ids_t", perm=[1, 0]) if transpose else "ids"
    flat = g.node("Reshape", [ids, g.const("minus_one", _i64([-1]))], "flat_ids") if len(ids_shape) > 1 else ids
    rows = g.node("Gather", [g.table("word", V), flat], "word_rows")
    word = g.node("Reshape", [rows, g.const("word_shape", _i64([2, S, H]))], "word_emb")
    pos = g.node("Reshape", [_positions(g), g.const("pos_shape", _i64([1, S, H]))], "pos_emb")
    g.ids_shape = [2, S]
    return g.norm(g.node("Add", [word, pos], "s"))


# ---- accepted ---------------------------------------------------------------------------------------------------

def test_mindspore_lookup_of_flattened_ids_reshaped_back():
    node, fused = _embed(_mindspore())
    inputs = list(node.input) + [""] * (9 - len(node.input))
    assert inputs[0] == "ids", "int32 ids go to the kernel as they are"
    assert inputs[2:4] == ["word", "pos"] and inputs[8] == "", "constant 0..S-1 are the kernel's own positions"
    assert not {"Gather", "Reshape", "Cast"} & set(op_types(fused))


@pytest.mark.parametrize("back", ["minus_one", "shape_of_ids", "zero_copies"])
def test_flattened_lookup_with_a_symbolic_batch(back):
    """Reshape back to [-1, S, H] (the -1 solved as batch*S*H / (S*H)), to Concat(Shape(ids), [H]), or to
    [0, 0, H] of a Reshape to [B, S, H // 2, 2] in between."""
    g = EmbedBlock(ids_shape=("batch", S))
    flat = g.node("Reshape", ["ids", g.const("minus_one", _i64([-1]))], "flat_ids")
    rows = g.node("Gather", [g.table("word", V), flat], "word_rows")
    if back == "minus_one":
        word = g.node("Reshape", [rows, g.const("back", _i64([-1, S, H]))], "word_emb")
    elif back == "shape_of_ids":
        target = g.node("Concat", [g.node("Shape", ["ids"], "ids_shape"), g.const("hidden", _i64([H]))], "back",
                        axis=0)
        word = g.node("Reshape", [rows, target], "word_emb")
    else:
        split = g.node("Reshape", [rows, g.const("split", _i64([-1, S, H // 2, 2]))], "split_rows")
        word = g.node("Reshape", [split, g.const("back", _i64([0, 0, H]))], "word_emb")
    pos = g.node("Reshape", [_positions(g, np.int64), g.const("pos_shape", _i64([1, S, H]))], "pos_emb")
    node, fused = _embed(g.norm(g.node("Add", [pos, word], "s")))
    assert node.input[0] != "ids" and "Cast" in op_types(fused), "int64 ids are cast to int32"
    assert "Gather" not in op_types(fused)


def _vmapped(position_views) -> onnx.ModelProto:
    """jax2onnx's vmapped Equinox lookups: the word lookup reads Cast(ids, int64), the position lookup reads
    Cast(Range(0, S, 1), int64) and reaches the sum through what ``position_views`` writes."""
    g = EmbedBlock(ids_dtype=TensorProto.INT32, ids_shape=("B", S), opset=18)
    word = g.node("Gather", [g.table("word", V), g.node("Cast", ["ids"], "ids_i64", to=TensorProto.INT64)],
                  "word_emb")
    arange = g.node("Range", [g.const("start", np.array(0, np.int32)), g.const("stop", np.array(S, np.int32)),
                              g.const("step", np.array(1, np.int32))], "arange")
    rows = g.node("Gather", [g.table("pos", P), g.node("Cast", [arange], "arange_i64", to=TensorProto.INT64)],
                  "pos_rows")
    return g.norm(g.node("Add", [word, position_views(g, rows)], "s"))


def _broadcast_in_dim(g: EmbedBlock, rows: str) -> str:
    """What jax2onnx writes for vmap's broadcast of a batch-invariant term: Reshape to [1, S, H], then Expand to
    [1, S, H], each shape a Concat of one-element constants."""
    def shape(name):
        return g.node("Concat", [g.const(f"{name}_{k}", _i64([d])) for k, d in enumerate((1, S, H))], name, axis=0)
    return g.node("Expand", [g.node("Reshape", [rows, shape("reshape_shape")], "pos_1sh"), shape("expand_shape")],
                  "pos_emb")


def _unit_axis_moved(g: EmbedBlock, rows: str) -> str:
    """vmap with the batch axis added in the middle and moved to the front: [S, 1, H] -> [1, S, H]."""
    middle = g.node("Unsqueeze", [rows, g.const("axis1", _i64([1]))], "pos_s1h")
    return g.node("Transpose", [middle], "pos_emb", perm=[1, 0, 2])


def _expanded_to_the_sum(g: EmbedBlock, rows: str) -> str:
    """The batch-invariant term repeated over the batch, to Concat(Shape(ids), [H]): what the Add broadcasts."""
    lifted = g.node("Reshape", [rows, g.const("pos_shape", _i64([1, S, H]))], "pos_1sh")
    target = g.node("Concat", [g.node("Shape", ["ids"], "ids_shape"), g.const("hidden", _i64([H]))], "sum_shape",
                    axis=0)
    return g.node("Expand", [lifted, target], "pos_emb")


def _expanded_then_identity(g: EmbedBlock, rows: str) -> str:
    """An Identity after the repeating Expand moves nothing (Paddle writes Identities after nearly every op)."""
    return g.node("Identity", [_expanded_to_the_sum(g, rows)], "pos_identity")


@pytest.mark.parametrize("views", [_broadcast_in_dim, _unit_axis_moved, _expanded_to_the_sum, _expanded_then_identity],
                         ids=["broadcast_in_dim", "unit_axis_moved", "expanded_to_the_sum", "expanded_then_identity"])
def test_vmapped_position_lookup(views):
    node, fused = _embed(_vmapped(views))
    inputs = list(node.input) + [""] * (9 - len(node.input))
    assert inputs[0] == "ids", "int32 ids widened to int64 by the graph are read as they were"
    assert inputs[3] == "pos" and inputs[8] == "", "Range(0, S, 1) is the kernel's own positions"
    assert not {"Gather", "Cast", "Expand", "Transpose"} & set(op_types(fused))


def test_the_lookup_of_transposed_ids_reads_the_transposed_ids():
    # [S, 2] ids transposed to [2, S], flattened, looked up and reshaped to [2, S, H]: the lookup of Transpose(ids)
    node, fused = _embed(_reshaped_to(ids_shape=(S, 2), transpose=True))
    assert node.input[0] == "ids_t" and "Transpose" in op_types(fused)


def test_a_lookup_view_read_elsewhere_is_kept_for_its_reader():
    model = _mindspore()
    model.graph.output.append(onnx.helper.make_tensor_value_info("word_emb", TensorProto.FLOAT, [2, S, H]))
    node, fused = _embed(model)
    assert node.input[0] == "ids"
    assert {"Gather", "Reshape"} <= set(op_types(fused)), "the word lookup and its views stay for the output"


# ---- refused ----------------------------------------------------------------------------------------------------

def test_a_reshape_back_to_another_shape_is_not_the_lookup():
    # [4, 4] ids looked up flat and reshaped to [2, 8, H]: the rows of a [4, 4] id tensor, not of [2, 8] ids
    _refused(_reshaped_to(ids_shape=(4, 4)), "not the lookup of those ids")


def test_a_transpose_after_the_lookup_that_permutes_rows_is_refused():
    # [2, S] ids looked up flat, reshaped to [S, 2, H] and transposed to [2, S, H]: row (b, s) holds the vector of
    # the id at flat position 2*s + b, not of ids[b, s]
    g = EmbedBlock(ids_dtype=TensorProto.INT32, ids_shape=(2, S))
    flat = g.node("Reshape", ["ids", g.const("minus_one", _i64([-1]))], "flat_ids")
    rows = g.node("Gather", [g.table("word", V), flat], "word_rows")
    swapped = g.node("Reshape", [rows, g.const("swapped", _i64([S, 2, H]))], "word_s2h")
    word = g.node("Transpose", [swapped], "word_emb", perm=[1, 0, 2])
    pos = g.node("Reshape", [_positions(g), g.const("pos_shape", _i64([1, S, H]))], "pos_emb")
    _refused(g.norm(g.node("Add", [word, pos], "s")), "permutes the looked-up rows")


def test_one_dimensional_ids_reshaped_after_the_lookup_are_refused():
    # the kernel takes [batch, sequence] ids: [16] ids would need a Reshape lnfuse does not write
    _refused(_reshaped_to(ids_shape=(2 * S,)), "not the lookup of those ids")


def test_a_permuting_vmap_is_refused():
    # S == H: the transposed [1, H, S] rows add to [B, S, H] as well, each position's vector spread over positions
    def permuted(g, rows):
        lifted = g.node("Reshape", [rows, g.const("pos_shape", _i64([1, S, H]))], "pos_1sh")
        return g.node("Transpose", [lifted], "pos_emb", perm=[0, 2, 1])
    _refused(_vmapped(permuted), "permutes the looked-up rows")


def test_position_rows_spread_over_the_batch_are_refused():
    # [S, 1, H] added to [S, S, H]: the batch row b gets position b's vector, not one per position
    def spread(g, rows):
        return g.node("Unsqueeze", [rows, g.const("axis1", _i64([1]))], "pos_emb")
    g = EmbedBlock(ids_dtype=TensorProto.INT32, ids_shape=(S, S), opset=18)
    word = g.node("Gather", [g.table("word", V), "ids"], "word_emb")
    rows = g.node("Gather", [g.table("pos", P), g.const("pos_ids", np.arange(S, dtype=np.int32))], "pos_rows")
    _refused(g.norm(g.node("Add", [word, spread(g, rows)], "s")), "not the lookup of those ids")


def test_a_reshape_back_to_a_shape_given_at_run_time_is_refused():
    g = EmbedBlock(ids_dtype=TensorProto.INT32, ids_shape=(2, S))
    g.inputs.append(onnx.helper.make_tensor_value_info("shape", TensorProto.INT64, [3]))
    flat = g.node("Reshape", ["ids", g.const("minus_one", _i64([-1]))], "flat_ids")
    word = g.node("Reshape", [g.node("Gather", [g.table("word", V), flat], "word_rows"), "shape"], "word_emb")
    pos = g.node("Reshape", [_positions(g), g.const("pos_shape", _i64([1, S, H]))], "pos_emb")
    _refused(g.norm(g.node("Add", [word, pos], "s")), "is neither a constant nor a Concat of Shape slices")
