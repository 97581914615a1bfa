"""Exports by other tools than torch's two exporters (sample_models/make_exporter_samples.py): tf2onnx/Keras, norms
written by hand over axis 1 of NCHW (SAM, ConvNeXt, ViTDet), Hugging Face Swin and ViTDet, and onnxscript's
code-form test models. lnfuse loads each, never makes it worse (the whole model agrees, the checker passes), and
fuses the norms it has."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import lnfuse
from lnfuse.verification.whole_model import compare_models, random_inputs

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
sys.path.insert(0, str(SAMPLES))
import make_exporter_samples  # noqa: E402  (the generator of the onnxscript models lives with the samples)

# file: (norms in the model, how many of them are residual norms (a Skip op), mean nodes that are not norms)
EXPECTED = {
    # tf2onnx: means as GlobalAveragePool, the affine folded as x·k + (Neg(mean)·k + beta)
    "keras_encoder_tf2onnx_op13.onnx": (3, 2, 0),
    "keras_encoder_tf2onnx_op17.onnx": (3, 2, 0),
    # channels-first norms become Transpose -> LayerNormalization -> Transpose
    "sam_neck_legacy_op14.onnx": (2, 0, 0),
    "sam_neck_legacy_op17.onnx": (2, 0, 0),
    "sam_neck_dynamo_op18.onnx": (2, 0, 0),
    # ConvNeXt's global average pooling x.mean([-2, -1]) is a mean that is not a norm: it stays
    "convnext_tiny_legacy_op14.onnx": (5, 0, 1),
    "convnext_tiny_legacy_op17.onnx": (5, 0, 1),
    "convnext_tiny_dynamo_op18.onnx": (5, 0, 1),
    "hf_swin_legacy_op17.onnx": (9, 5, 0),
    "hf_swin_dynamo_op18.onnx": (9, 5, 0),
    # 4 residual norms on [B, H, W, C] and 3 VitDetLayerNorm (channels-first) in the residual bottleneck block
    "hf_vitdet_legacy_op17.onnx": (7, 4, 0),
    "hf_vitdet_dynamo_op18.onnx": (7, 4, 0),
}
# onnxscript's models: (norms, residual norms at least, random weights up to this size inline, the rest sparse
# zeros; 0 = the model is too big for a whole-model check here)
ONNXSCRIPT = {
    "_smollm_1": (3, 2, 0),
    "_phi2lm": (2, 0, 0),
    "_phi4lm": (5, 4, 0),
    "_whisper_encoder": (3, 2, 1 << 30),
    # attention weights and below inline; of its residual sums only one has addends whose shapes inference proves
    # equal (the others carry different unknown dims, which could broadcast at run time)
    "_whisper_decoder": (4, 1, 1 << 20),
}
NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization", "SkipLayerNormalization",
            "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization")
MEANS = ("ReduceMean", "GlobalAveragePool")


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _feeds(model: onnx.ModelProto, batch: int, seed: int) -> dict[str, np.ndarray]:
    """Random inputs with a batch other than the export's (3)."""
    feeds = random_inputs(model, seed=seed)
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((batch, *value.shape[1:])).astype(value.dtype)
            for name, value in feeds.items()}


def _check_counts(name: str, fused: onnx.ModelProto, norms: int, residual: int, means_left: int, report) -> None:
    ops = _ops(fused)
    found = sum(ops.count(op) for op in NORM_OPS)
    assert found == norms, (name, {op: ops.count(op) for op in NORM_OPS}, report.unfused)
    skips = sum(ops.count(op) for op in NORM_OPS if op.startswith("Skip"))
    assert skips >= residual, f"{name}: {skips} Skip ops for {residual} residual norms"
    assert sum(ops.count(op) for op in MEANS) == means_left, "no mean left but the ones that are not norms"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_never_worse(name):
    """The whole model computes what it computed, for both targets, and --target onnx passes the full checker."""
    original = onnx.load(SAMPLES / name)
    for target in ("ort", "onnx"):
        result = lnfuse.fuse(SAMPLES / name, target=target)
        assert result.model.ir_version == original.ir_version
        for batch, seed in ((2, 1), (1, 2)):
            check = compare_models(original, result.model, _feeds(original, batch, seed))
            assert check["ok"], (target, check)
        if target == "onnx":
            onnx.checker.check_model(result.model, full_check=True)
        for unfused in result.report.unfused:
            assert unfused.reason, "every candidate left alone says why"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_norm_fuses(name):
    norms, residual, means_left = EXPECTED[name]
    result = lnfuse.fuse(SAMPLES / name)
    _check_counts(name, result.model, norms, residual, means_left, result.report)
    assert not result.report.unfused


def test_nothing_that_is_not_a_norm_is_fused():
    """ConvNeXt ends with a global average pooling, x.mean([-2, -1]), then a LayerNorm: the pooling stays."""
    for name in ("convnext_tiny_legacy_op14.onnx", "convnext_tiny_dynamo_op18.onnx"):
        fused = lnfuse.fuse(SAMPLES / name).model
        constants = {t.name: onnx.numpy_helper.to_array(t) for t in fused.graph.initializer}
        constants.update({n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in fused.graph.node
                          if n.op_type == "Constant" and n.attribute[0].name == "value"})
        spatial = []
        for node in fused.graph.node:
            if node.op_type != "ReduceMean":
                continue
            attr = [onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "axes"]
            axes = attr[0] if attr else constants[node.input[1]].tolist()
            spatial.append(sorted(a % 4 for a in axes) == [2, 3])
        assert spatial.count(True) == 1, f"{name}: the pooling mean stays ({spatial})"


@pytest.fixture(scope="module")
def onnxscript_models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("onnxscript")
    made = {}
    for name, (_norms, _residual, inline) in ONNXSCRIPT.items():
        # the whisper models get random inline weights so the whole model can be compared; the big ones keep
        # sparse zero weights that lnfuse never reads
        made[name] = make_exporter_samples.onnxscript_model(name, folder / name, seed=1,
                                                            inline_bytes=inline or 64 * 1024)
    return made


@pytest.mark.parametrize("name", sorted(ONNXSCRIPT))
def test_onnxscript_code_form_never_worse(name, onnxscript_models):
    inline = ONNXSCRIPT[name][2]
    path = onnxscript_models[name]
    original = onnx.load(path, load_external_data=False)
    assert "CastLike" in _ops(original), "the model is in onnxscript's code form"
    result = lnfuse.fuse(path)
    if inline:
        fused_path = path.with_name("fused.onnx")
        result.save(fused_path)  # beside the input: its external data is referenced, not copied
        full = onnx.load(path)
        check = compare_models(full, onnx.load(fused_path), random_inputs(full, seed=5))
        assert check["ok"], check
    for unfused in result.report.unfused:
        assert unfused.reason


@pytest.mark.parametrize("name", sorted(ONNXSCRIPT))
def test_onnxscript_code_form_fuses_every_norm(name, onnxscript_models):
    norms, residual, _whole = ONNXSCRIPT[name]
    result = lnfuse.fuse(onnxscript_models[name])
    _check_counts(name, result.model, norms, residual, 0, result.report)
