"""Every value lnfuse writes carries its dtype and shape in the saved model (symbolic where the input's was): the
outputs of fused nodes (Mean/InvStdDev, the Skip ops' sum, Embed's mask_index and embedding_sum included), the
Casts and Reshapes it inserts, and decomposed values. A later pass (decompose, ORT, onnx's inference) then sees a
fully typed graph; with --target onnx, onnx's inference in strict mode passes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from hypothesis import given, settings
from onnx import TensorProto

import lnfuse
from normgraphs import build
from test_properties import SETTINGS, specs

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"


def _untyped_new_values(written: onnx.ModelProto, original: onnx.ModelProto) -> list[str]:
    """Outputs of the nodes lnfuse wrote (not in the original) with no dtype, no shape, or a dim without a size
    or a name."""
    old = {n.name for n in original.graph.node}
    typed = {v.name: v.type.tensor_type for v in list(written.graph.value_info) + list(written.graph.output)}
    missing = []
    for node in written.graph.node:
        if node.name in old:
            continue
        for name in filter(None, node.output):
            tensor = typed.get(name)
            if tensor is None or not tensor.elem_type or not tensor.HasField("shape") or any(
                    not d.HasField("dim_value") and not d.dim_param for d in tensor.shape.dim):
                missing.append(f"{node.op_type}:{name}")
    return missing


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("name", sorted(p.name for p in SAMPLES.glob("*.onnx")))
def test_every_value_lnfuse_writes_is_typed(name, target, tmp_path: Path):
    result = lnfuse.fuse(SAMPLES / name, target=target)
    result.save(tmp_path / "out.onnx")
    written = onnx.load(tmp_path / "out.onnx")
    assert not _untyped_new_values(written, onnx.load(SAMPLES / name))
    if target == "onnx":
        onnx.checker.check_model(written, full_check=True)
        onnx.shape_inference.infer_shapes(written, strict_mode=True, check_type=True)


def test_decomposed_values_are_typed(tmp_path: Path):
    fused = lnfuse.fuse(SAMPLES / "llama_tiny_dynamo_op18.onnx")
    fused.save(tmp_path / "fused.onnx")
    plain = lnfuse.decompose(tmp_path / "fused.onnx").model
    assert not _untyped_new_values(plain, onnx.load(tmp_path / "fused.onnx"))


def test_the_skip_sum_keeps_the_symbolic_shape_of_the_residual(tmp_path: Path):
    # pre-norm: each Skip op's sum (output 3) is the next residual; it is declared [batch, sequence, hidden] with
    # the input's own dim names, so decompose and ORT know it without inferring contrib ops
    result = lnfuse.fuse(SAMPLES / "llama_tiny_dynamo_op18.onnx")
    result.save(tmp_path / "out.onnx")
    written = onnx.load(tmp_path / "out.onnx")
    inputs = {d.dim_param for v in written.graph.input for d in v.type.tensor_type.shape.dim if d.dim_param}
    typed = {v.name: v.type.tensor_type for v in written.graph.value_info}
    sums = [n.output[3] for n in written.graph.node
            if n.op_type == "SkipSimplifiedLayerNormalization" and len(n.output) > 3 and n.output[3]]
    assert sums
    for name in sums:
        dims = typed[name].shape.dim
        assert len(dims) == 3 and dims[-1].dim_value and {d.dim_param for d in dims[:2]} <= inputs, name


def test_exposed_statistics_and_embedding_outputs_are_typed(tmp_path: Path):
    # GPT-2's embedding sum is read by the first residual: EmbedLayerNormalization output 2; with
    # --quantize-embeddings the QEmbedLayerNormalization's mask_index (output 1) is written too
    for name, options in (("hf_gpt2_dynamo_op18.onnx", {}), ("bert_tiny_legacy_op14.onnx",
                                                             {"quantize_embeddings": "uint8"})):
        result = lnfuse.fuse(SAMPLES / name, **options)
        result.save(tmp_path / "out.onnx")
        written = onnx.load(tmp_path / "out.onnx")
        assert not _untyped_new_values(written, onnx.load(SAMPLES / name)), name
        embeds = [n for n in written.graph.node if n.op_type.endswith("EmbedLayerNormalization")]
        assert embeds and any(len([o for o in n.output if o]) > 1 for n in embeds), name


def test_mean_and_inv_std_dev_outputs_are_typed(tmp_path: Path):
    # a LayerNormalization whose mean and 1/sigma the graph also reads (training-style): outputs 1 and 2
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8])
    outs = [oh.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in (
        ("y", ["batch", 4, 8]), ("mean_out", ["batch", 4, 1]), ("inv_out", ["batch", 4, 1]))]
    nodes = [oh.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
             oh.make_node("Sub", ["x", "mean"], ["d"]),
             oh.make_node("Mul", ["d", "d"], ["sq"]),
             oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             oh.make_node("Add", ["var", "eps"], ["ve"]),
             oh.make_node("Sqrt", ["ve"], ["std"]),
             oh.make_node("Reciprocal", ["std"], ["inv"]),
             oh.make_node("Mul", ["d", "inv"], ["n"]),
             oh.make_node("Mul", ["n", "gamma"], ["y"]),
             oh.make_node("Identity", ["mean"], ["mean_out"]),
             oh.make_node("Identity", ["inv"], ["inv_out"])]
    inits = [onh.from_array(np.array(1e-5, np.float32), "eps"), onh.from_array(np.ones(8, np.float32), "gamma")]
    model = oh.make_model(oh.make_graph(nodes, "g", [x], outs, inits), opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    result = lnfuse.fuse(model, target="onnx")
    written = result.model
    [norm] = [n for n in written.graph.node if n.op_type == "LayerNormalization"]
    assert len([o for o in norm.output if o]) == 3
    assert not _untyped_new_values(written, model)
    onnx.shape_inference.infer_shapes(written, strict_mode=True, check_type=True)


@settings(SETTINGS, max_examples=min(SETTINGS.max_examples, 60))
@given(specs(mutations=False))
def test_generated_norms_are_written_typed(spec):
    model = build(spec)
    written = lnfuse.fuse(model).model
    assert not _untyped_new_values(written, model)
    decomposed = lnfuse.decompose(written).model
    assert not _untyped_new_values(decomposed, written)
