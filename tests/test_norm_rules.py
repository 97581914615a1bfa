"""Each spelling of LayerNormalization / RMS normalization fuses into one op that computes the same numbers; each
near-miss that computes something else is left alone with the reason in the report."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest

import lnfuse
from normgraphs import Spec, build, feeds_for, op_types, run, tolerance, with_float_io

FUSED = ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization")

LAYER_VARIANTS = {
    "baseline": Spec(),
    "opset14_axes_attribute": Spec(opset=14),
    "opset18_axes_input": Spec(opset=18),
    "positive_axes": Spec(positive_axes=True),
    "two_trailing_axes": Spec(rank=4, k=2, hidden=4),
    "rank2": Spec(rank=2),
    "square_as_mul": Spec(square="mul"),
    "reciprocal": Spec(inverse="recip"),
    "one_over_sqrt": Spec(inverse="div1"),
    "pow_minus_half": Spec(inverse="pow_neg_half"),
    "pow_minus_one": Spec(inverse="pow_neg1"),
    "eps_first": Spec(eps_first=True),
    "eps_constant_node": Spec(eps_node=True, eps=1e-12),
    "gamma_first_beta_first": Spec(gamma_first=True, beta_first=True),
    "no_beta": Spec(beta=None),
    "no_affine": Spec(gamma=None, beta=None),
    "gamma_beta_1_1_h": Spec(gamma="11h", beta="11h"),
    "keepdims0_unsqueeze": Spec(keepdims0=True),
    "keepdims0_unsqueeze_opset18": Spec(keepdims0=True, opset=18),
    "duplicated_sub": Spec(dup_sub=True, square="mul"),
    "symbolic_dims": Spec(symbolic=True),
    "fp16": Spec(dtype="float16"),
    "fp16_fp32_statistics": Spec(dtype="float16", cast_stats=True),
    "float64": Spec(dtype="float64", eps=2.0 ** -17),
    "large_eps": Spec(eps=0.1),
    # seen through algebra (issue 12)
    "eps_zero": Spec(eps=0.0),
    "gamma_before_division": Spec(order="gamma_first_div"),
    "d_times_gamma_over_std": Spec(order="d_gamma_over_std"),
    "inv_gamma_d": Spec(order="inv_gamma_d", inverse="recip"),
    "tf2onnx_folded_affine": Spec(order="folded", inverse="pow_neg_half"),
    "tf2onnx_folded_no_beta": Spec(order="folded", beta=None),
    "square_of_mean_minus_x": Spec(square_sign=True),
    "mean_as_sum_over_n": Spec(mean_form="sum_div", opset=18),
    "mean_as_sum_times_one_over_n": Spec(mean_form="sum_mul", keepdims0=True),
    "global_average_pool_means": Spec(mean_form="gap", order="folded"),
    "castlike_constants": Spec(castlike=True, opset=18),
}

RMS_VARIANTS = {
    "rms_opset23": Spec(kind="rms", opset=23),
    "rms_opset17": Spec(kind="rms"),
    "rms_reciprocal": Spec(kind="rms", inverse="recip", opset=23),
    "rms_one_over_sqrt": Spec(kind="rms", inverse="div1"),
    "rms_pow_minus_half": Spec(kind="rms", inverse="pow_neg_half", opset=23),
    "rms_square_as_mul": Spec(kind="rms", square="mul"),
    "rms_gamma_first": Spec(kind="rms", gamma_first=True, opset=23),
    "rms_no_gamma": Spec(kind="rms", gamma=None, opset=23),
    "rms_fp16_fp32_statistics": Spec(kind="rms", dtype="float16", cast_stats=True, opset=23),
    "rms_two_axes": Spec(kind="rms", rank=4, k=2, hidden=4, opset=23),
    "rms_keepdims0": Spec(kind="rms", keepdims0=True),
    "rms_inv_gamma_x": Spec(kind="rms", order="inv_gamma_d", opset=23),
    "rms_gamma_before_division": Spec(kind="rms", order="gamma_first_div"),
    "rms_sum_over_n": Spec(kind="rms", mean_form="sum_div", opset=23),
    "rms_castlike_constants": Spec(kind="rms", castlike=True, opset=23),
}


def _check_fused(spec: Spec, target: str = "ort") -> tuple[onnx.ModelProto, onnx.NodeProto, lnfuse.FuseResult]:
    model = build(spec)
    result = lnfuse.fuse(model, target=target)
    fused = result.model
    ops = op_types(fused)
    assert "ReduceMean" not in ops, (ops, result.report.unfused)
    nodes = [n for n in fused.graph.node if n.op_type in FUSED]
    assert len(nodes) == 1, ops
    node = nodes[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["axis"] == -spec.k
    stats = "float32" if spec.cast_stats else spec.dtype
    eps_as_written = float(np.array(spec.eps, dtype=ml_dtypes.bfloat16 if stats == "bfloat16" else stats))
    assert attrs["epsilon"] == pytest.approx(eps_as_written, rel=1e-6)
    assert node.input[0] == "X", "the fused op reads the model's input in its own dtype (Casts folded)"
    if spec.dtype == "bfloat16":
        model, fused = with_float_io(model), with_float_io(fused)
    feeds = feeds_for(model)
    for want, got in zip(run(model, feeds), run(fused, feeds)):
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **tolerance(spec.dtype))
    if not result.report.ort_only:
        onnx.checker.check_model(result.model, full_check=True)
    return fused, node, result


@pytest.mark.parametrize("name", sorted(LAYER_VARIANTS))
def test_layer_norm_variant_fuses(name):
    spec = LAYER_VARIANTS[name]
    _, node, result = _check_fused(spec)
    assert node.op_type == "LayerNormalization"
    assert len(node.input) == (3 if spec.beta else 2)
    assert result.report.ort_only == (spec.opset < 17)
    assert [f.op_type for f in result.report.fused] == ["LayerNormalization"]
    assert result.report.fused[0].max_error is not None


@pytest.mark.parametrize("name", sorted(RMS_VARIANTS))
def test_rms_norm_variant_fuses(name):
    spec = RMS_VARIANTS[name]
    _, node, _ = _check_fused(spec)
    assert node.op_type == ("RMSNormalization" if spec.opset >= 23 else "SimplifiedLayerNormalization")
    assert node.domain == ""


def test_fp16_statistics_map_to_stash_type_and_keep_model_dtype():
    fused, node, _ = _check_fused(Spec(dtype="float16", cast_stats=True))
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["stash_type"] == 1
    assert "Cast" not in op_types(fused)
    assert fused.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16


def test_bf16_rms_at_opset23_ort_folds_casts_onnx_keeps_them_outside():
    # without gamma: ORT's CPU provider has no bfloat16 Mul, so the original could not run with one
    spec = Spec(kind="rms", dtype="bfloat16", cast_stats=True, opset=23, gamma=None)
    _, node, _ = _check_fused(spec)
    assert node.op_type == "SimplifiedLayerNormalization"
    # RMSNormalization-23 cannot run bfloat16 on CPU: the standard target normalizes the fp32 statistics instead
    result = lnfuse.fuse(build(spec), target="onnx")
    ops = op_types(result.model)
    assert ops == ["Cast", "RMSNormalization", "Cast"]
    onnx.checker.check_model(result.model, full_check=True)


def test_gamma_and_beta_are_reshaped_to_the_normalized_shape():
    fused, node, _ = _check_fused(Spec(gamma="11h", beta="11h"))
    inits = {t.name: t for t in fused.graph.initializer}
    assert list(inits[node.input[1]].dims) == [8]
    assert list(inits[node.input[2]].dims) == [8]


def test_target_onnx_on_old_opset_refuses_with_upgrade_hint():
    result = lnfuse.fuse(build(Spec(opset=14)), target="onnx")
    assert not result.report.fused
    assert [u.check for u in result.report.unfused] == ["opset"]
    assert any("--upgrade-opset" in note for note in result.report.notes)
    onnx.checker.check_model(result.model, full_check=True)


def test_upgrade_opset_converts_then_fuses_standard_ops():
    model = build(Spec(opset=14))
    result = lnfuse.fuse(model, target="onnx", upgrade_opset=True)
    fused = result.model
    assert fused.opset_import[0].version == 17
    assert op_types(fused) == ["LayerNormalization"]
    onnx.checker.check_model(fused, full_check=True)
    feeds = feeds_for(model)
    np.testing.assert_allclose(run(fused, feeds)[0], run(model, feeds)[0], atol=1e-4, rtol=1e-3)


def test_rms_upgrade_to_opset23():
    model = build(Spec(kind="rms", opset=18))
    result = lnfuse.fuse(model, target="onnx", upgrade_opset=True)
    assert "RMSNormalization" in op_types(result.model)
    assert result.model.opset_import[0].version == 23


REFUSALS = {
    "eps_outside": ("epsilon", "outside the square root"),
    "exponent3": ("exponent", "raises to 3"),
    "div_swapped": ("operands", "swapped"),
    "axes_leading": ("axes", "not the trailing"),
    "mean_axes_differ": ("axes", "reduces"),
    "intermediate_read": ("intermediate", "graph output"),
    "eps_runtime": ("epsilon", "not a constant"),
    "eps_negative": ("epsilon", "epsilon >= 0"),
}


@pytest.mark.parametrize("mutation", sorted(REFUSALS))
def test_near_miss_is_not_fused_and_is_explained(mutation):
    model = build(Spec(mutation=mutation))
    result = lnfuse.fuse(model)
    assert "LayerNormalization" not in op_types(result.model)
    check, words = REFUSALS[mutation]
    reasons = [(u.check, u.reason) for u in result.report.unfused]
    assert any(c == check and words in r for c, r in reasons), reasons
    feeds = feeds_for(model)
    for want, got in zip(run(model, feeds), run(result.model, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_sub_swapped_is_never_a_layer_norm():
    model = build(Spec(mutation="sub_swapped"))
    result = lnfuse.fuse(model)
    assert "LayerNormalization" not in op_types(result.model)
    feeds = feeds_for(model)
    np.testing.assert_allclose(run(result.model, feeds)[0], run(model, feeds)[0], atol=1e-4, rtol=1e-3)


def test_gamma_varying_over_leading_axis_stays_outside_the_fused_op():
    model = build(Spec(mutation="gamma_leading", beta=None))
    result = lnfuse.fuse(model)
    fused = result.model
    node = next(n for n in fused.graph.node if n.op_type == "LayerNormalization")
    assert "gamma" not in node.input[1], "the leading-axis gamma must not become the op's scale"
    assert "Mul" in op_types(fused)
    assert any("leading" in note for f in result.report.fused for note in f.notes)
    feeds = feeds_for(model)
    np.testing.assert_allclose(run(fused, feeds)[0], run(model, feeds)[0], atol=1e-4, rtol=1e-3)


def test_no_verify_skips_ort_but_still_fuses():
    result = lnfuse.fuse(build(Spec()), verify=False)
    assert op_types(result.model) == ["LayerNormalization"]
    assert result.report.fused[0].max_error is None


def test_fusing_twice_changes_nothing():
    once = lnfuse.fuse(build(Spec(opset=18))).model
    twice = lnfuse.fuse(once)
    assert not twice.report.fused
    assert op_types(twice.model) == op_types(once)


def test_only_and_skip_select_rules():
    spec = Spec(kind="rms", opset=23)
    assert not lnfuse.fuse(build(spec), only=["layer_norm"]).report.fused
    assert not lnfuse.fuse(build(spec), skip=["rms_norm"]).report.fused
    with pytest.raises(lnfuse.UsageError, match="unknown rule"):
        lnfuse.fuse(build(spec), only=["nope"])


def test_float64_epsilon_that_float32_cannot_hold_is_refused():
    result = lnfuse.fuse(build(Spec(dtype="float64", eps=1e-5)))
    assert not result.report.fused
    assert any(u.check == "epsilon" and "float32" in u.reason for u in result.report.unfused)
