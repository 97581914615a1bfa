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
from lnfuse.whole_model import compare_models, random_inputs
from normgraphs import Spec, build

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
FUSED = {"LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
         "SkipSimplifiedLayerNormalization"}


def _fused_ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node if n.op_type in FUSED)


@pytest.mark.parametrize("name", ["bert_tiny_legacy_op14.onnx", "bert_tiny_dynamo_op18.onnx",
                                  "llama_tiny_dynamo_op18.onnx", "llama_tiny_fp16_legacy_op17.onnx",
                                  "hf_gpt2_dynamo_op18.onnx", "hf_bart_legacy_op14.onnx",
                                  "hf_t5_encoder_dynamo_op18.onnx"])
def test_decompose_inverts_fuse(name, tmp_path: Path):
    fused_path, plain_path = tmp_path / "fused.onnx", tmp_path / "plain.onnx"
    fused = lnfuse.fuse(SAMPLES / name)
    fused.save(fused_path)
    plain = lnfuse.decompose(fused_path)
    assert not plain.report.unfused
    assert not _fused_ops(plain.model), "only primitive ops are left"
    assert all(o.domain != "com.microsoft" for o in plain.model.opset_import)
    onnx.checker.check_model(plain.model, full_check=True)
    original = onnx.load(SAMPLES / name)
    assert compare_models(original, plain.model, random_inputs(original, seed=5))["ok"]
    plain.save(plain_path)
    again = lnfuse.fuse(plain_path)
    assert _fused_ops(again.model) == _fused_ops(fused.model)


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
