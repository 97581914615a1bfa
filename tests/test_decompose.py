"""Decompose is the exact inverse of fusion: primitive ops only, same numbers, and fusing again gives back the
same fused ops."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx import TensorProto

import lnfuse
from lnfuse.verification.whole_model import compare_models, random_inputs
from normgraphs import Spec, build

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
FUSED = {"LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
         "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization"}


def _fused_ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node if n.op_type in FUSED)


def _round_trip(source: Path | onnx.ModelProto, folder: Path, target: str = "ort") -> None:
    """fuse -> save -> decompose -> save -> fuse, through files as a user would: the decomposed model has only
    primitive ops and computes what the original computes; fusing it again gives back the same fused ops, which
    compute what the original computes too."""
    original = source if isinstance(source, onnx.ModelProto) else onnx.load(source)
    fused_path, plain_path = folder / "fused.onnx", folder / "plain.onnx"
    fused = lnfuse.fuse(source, target=target)
    fused.save(fused_path)
    plain = lnfuse.decompose(fused_path)
    assert not plain.report.unfused, [(u.anchor, u.check, u.reason) for u in plain.report.unfused]
    assert not _fused_ops(plain.model), "only primitive ops are left"
    assert all(o.domain != "com.microsoft" for o in plain.model.opset_import)
    onnx.checker.check_model(plain.model, full_check=True)
    feeds = random_inputs(original, seed=5)
    assert compare_models(original, plain.model, feeds)["ok"]
    plain.save(plain_path)
    again = lnfuse.fuse(plain_path, target=target)
    assert _fused_ops(again.model) == _fused_ops(fused.model), [(u.check, u.reason) for u in again.report.unfused]
    assert compare_models(original, again.model, feeds)["ok"]


@pytest.mark.parametrize("name", sorted(p.name for p in SAMPLES.glob("*.onnx")))
def test_decompose_inverts_fuse_on_every_sample_model(name, tmp_path: Path):
    _round_trip(SAMPLES / name, tmp_path)


@pytest.mark.parametrize("name", ["bert_tiny_dynamo_op18.onnx", "hf_gpt2_dynamo_op18.onnx",
                                  "roberta_tiny_dynamo_op18.onnx"])
def test_decompose_inverts_fuse_for_standard_ops(name, tmp_path: Path):
    _round_trip(SAMPLES / name, tmp_path, target="onnx")


def test_decompose_inverts_fuse_on_onnxscripts_bart_encoder(tmp_path: Path):
    # its input_ids has an unnamed sequence dim and its position ids are computed from Shape(input_ids): the
    # region decompose verifies must feed ids and positions of one sequence length, as fuse's verification does
    from onnxscript.rewriter.models import _bart_encoder

    model = _bart_encoder.make_model_with_random_weights()
    assert _fused_ops(lnfuse.fuse(model).model) == {"EmbedLayerNormalization": 1, "SkipLayerNormalization": 4}
    _round_trip(model, tmp_path)


def test_decomposed_axes_are_constants_that_shape_inference_reads(tmp_path: Path):
    # the references compute axes as Range(axis, 0, 1); written as is, onnx's inference cannot read them and every
    # value after the decomposed norm loses its shape (the next fusion then cannot verify)
    spec = Spec(opset=18)
    plain = lnfuse.decompose(build(spec)).model
    assert "Range" not in {n.op_type for n in plain.graph.node}
    inferred = onnx.shape_inference.infer_shapes(plain, strict_mode=True)
    shapes = {v.name: v.type.tensor_type for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for node in plain.graph.node:
        for name in node.output:
            assert shapes[name].HasField("shape") and len(shapes[name].shape.dim) == len(
                [d for d in shapes[name].shape.dim if d.HasField("dim_value") or d.dim_param]), name


@pytest.mark.parametrize("spec", [Spec(opset=17), Spec(opset=18, beta=None), Spec(kind="rms", opset=23)])
def test_decompose_standard_ops_round_trip(spec):
    fused = lnfuse.fuse(build(spec)).model
    plain = lnfuse.decompose(fused).model
    onnx.checker.check_model(plain, full_check=True)
    assert _fused_ops(lnfuse.fuse(plain).model) == _fused_ops(fused)


def test_layer_norm_with_an_unusable_stash_type_is_left_as_it_is():
    # stash_type=0 passes the checker and ORT runs it; the reference has no dtype to compute in
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])
    node = oh.make_node("LayerNormalization", ["x", "gamma"], ["y"], stash_type=0)
    model = oh.make_model(oh.make_graph([node], "g", [x], [y], [onh.from_array(np.ones(4, np.float32), "gamma")]),
                          opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    result = lnfuse.decompose(model)
    assert [n.op_type for n in result.model.graph.node] == ["LayerNormalization"]
    assert [u.check for u in result.report.unfused] == ["stash_type"]


def test_decompose_inverts_fuse_on_the_onnx_backend_cases():
    # the 57 expanded LayerNormalization/RMSNormalization cases of the compare table, for both targets
    from test_backend_cases import CASES

    for case in CASES:
        for target in ("ort", "onnx"):
            fused = lnfuse.fuse(case.model, target=target).model
            plain = lnfuse.decompose(fused)
            assert not plain.report.unfused and not _fused_ops(plain.model), (case.name, target)
            assert _fused_ops(lnfuse.fuse(plain.model, target=target).model) == _fused_ops(fused), (case.name, target)


_OPSET_11 = sorted(str(p.relative_to(SAMPLES)) for p in SAMPLES.glob("*/**/*.onnx")
                   if "embed" in p.name and onnx.load(p, load_external_data=False).opset_import[0].version < 13
                   and all(o.version < 13 for o in onnx.load(p, load_external_data=False).opset_import
                           if o.domain in ("", "ai.onnx")))


@pytest.mark.parametrize("name", _OPSET_11)
def test_decompose_below_opset_13_writes_its_own_opsets_ops(name, tmp_path: Path):
    """Positions 0..S-1 for EmbedLayerNormalization are made with the Unsqueeze of the model's opset (axes an
    attribute before 13): ONNX Runtime takes the decomposed model, and no fused op is left (ORT's samples keep
    their other contrib ops)."""
    import onnxruntime as ort

    lnfuse.fuse(SAMPLES / name).save(tmp_path / "fused.onnx")
    plain = lnfuse.decompose(tmp_path / "fused.onnx")  # each replacement verified in ONNX Runtime
    assert not plain.report.unfused, [(u.anchor, u.check, u.reason) for u in plain.report.unfused]
    assert not _fused_ops(plain.model), "only primitive ops are left"
    plain.save(tmp_path / "plain.onnx")
    ort.InferenceSession(str(tmp_path / "plain.onnx"), providers=["CPUExecutionProvider"])
