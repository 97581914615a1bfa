"""The graphs other tools' own test suites fuse (sample_models/peer_cases, made by make_peer_cases.py; README.md
there names each test): lnfuse fuses at least what the peer's test expects, with --target ort and with --target onnx
where the opset has the op, writes what the checker passes (or, for ONNX Runtime's own ops, what ORT loads), and
ORT computes what the original computes."""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import lnfuse

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
FOLDER = SAMPLES / "peer_cases"

LN, SLN, RMS = "LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"
SKIP, SKIP_SLN, EMBED = "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization"
NORMS = (LN, SLN, RMS, SKIP, SKIP_SLN, EMBED)
_ORT_ONLY = {SLN, SKIP, SKIP_SLN, EMBED}

#: what each peer's test expects fused in its graph (--target ort); lnfuse must fuse at least as deep
EXPECTED = {
    # onnxscript rules/fusion/_layer_norm_test.py and _layer_norm_extended_test.py
    **{case: {LN: 1} for case in ("os_ln_recip", "os_ln_recip_bias", "os_ln_pow_recip", "os_ln_div",
                                  "os_ln_pow_div", "os_ln_div_bias", "os_ln_double")},
    "os_ln_fp16": {},  # onnxscript refuses float16 input; lnfuse fuses it (verified)
    # onnxscript ort_fusions/rms_normalization_unit_test.py (SimplifiedLayerNormalization) and
    # rules/fusion/_rms_normalization*_test.py (RMSNormalization, opset 23)
    **{case: {SLN: 1} for case in ("os_rms_scale_first", "os_rms_norm_first", "os_rms_cast_fp16",
                                   "os_rms_double")},
    "os_rms_int_input": {},  # onnxscript refuses an int input cast to float; lnfuse fuses after the Cast
    "os_rms_rank1_op23": {RMS: 1},
    # onnxscript ort_fusions/skip_normalization_unit_test.py
    **{case: {SKIP_SLN: 1, SLN: 0} for case in ("os_skip_sln_input_skip", "os_skip_sln_skip_input",
                                                "os_skip_sln_post_bias", "os_skip_sln_pre_bias")},
    **{case: {SKIP: 1, LN: 0} for case in ("os_skip_ln_input_skip", "os_skip_ln_post_bias")},
    "os_skip_sln_rank2": {},  # onnxscript wants rank 3; ORT's Skip kernels take [S, D] too
    "os_sln_no_add": {SLN: 1},
    # ORT python optimizer: test_attention_fusion (bert/gpt2 generators), test_optimizer, test_phi_vision
    **{case: {SKIP: 2, LN: 0} for case in ("ort_bert_attention_skip", "ort_bert_attention_skip_switched",
                                           "ort_gpt2_attention_skip", "ort_gpt2_attention_skip_switched",
                                           "ort_phi_vision_attention_layernorm")},
    "ort_gpt2_past_pt15_op11": {LN: 5},  # 2 layers: 2 * 2 + 1 (the test's 12 layers: 25)
    "ort_keras2onnx_bert_op11": {SKIP: 5},  # 2 layers: 2 * 2 + the embedding sum's norm (12 layers: 25)
    "ort_phi_vision_layernorm_fp16": {LN: 1},
    # ORT python optimizer: test_optimizer_huggingface_bert.py (transformers >= 5 expectations)
    "ort_hf_bert_1input_op16": {LN: 1, SKIP: 10},
    "ort_hf_distilbert_2inputs_op16": {LN: 1, SKIP: 10},
    "ort_hf_xlm_roberta_1input_op16": {LN: 1, SKIP: 4},
    # ORT C++ fusion test generators under testdata/transform/fusion not in sample_models/ort_fusion
    "ort_ln_without_scale_bias_op12": {LN: 1},
    "ort_ln_fp16_op10": {LN: 1},
    "ort_sln_fp16_pow_edge_op12": {},
    # ORT python optimizer: test_embedlayer_fusion.py (gpt2_model_generator.create_gpt2_embedlayer)
    **{f"ort_gpt2_embedlayer{v}": {EMBED: 1, SKIP: 1, "Gather": 0} for v in ("", "_output_sum", "_add_layernorm")},
    # ORT python optimizer: test_skip_layer_norm_fusion.py (the bias Add becomes the Skip op's bias; a Cast stays)
    **{f"ort_skip_fusion_{case}": {SKIP: 1, LN: 0, "Add": 0, "Cast": 0}
       for case in ("no_graph_output", "graph_output", "graph_output_bias1", "graph_output_bias2")},
    **{f"ort_skip_fusion_graph_output_cast_bias{i}": {SKIP: 1, LN: 0, "Add": 0, "Cast": 1} for i in (1, 2)},
}

#: where lnfuse refuses what the peer fuses (or what no one fuses), and the check that says why (docs/compare.md,
#: "Peers' test cases")
REFUSED = {
    # a float64 norm's epsilon cannot be written in the fused ops' float32 epsilon attribute: the peer's fusion
    # changes 1e-5 to 9.99999974737875e-06 (up to 1.2e-8 relative on the output, 10^7 float64 ulps)
    "os_ln_double": "epsilon",
    "os_rms_double": "epsilon",
    # ORT's edge case for its fuser (no peer fuses it): the epsilon is a graph input and the scale one number per row
    "ort_sln_fp16_pow_edge_op12": "epsilon",
}

CASES = sorted(p.stem for p in FOLDER.glob("*.onnx"))


def test_every_shipped_case_has_an_expectation():
    assert set(CASES) == set(EXPECTED)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for info in model.graph.input:
        tensor = info.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 3 for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        # integers are ids into the embedding tables (the smallest has 10 rows) as ORT's embed test draws them
        values = rng.integers(1, 7, shape) if np.issubdtype(dtype, np.integer) else rng.standard_normal(shape)
        feeds[info.name] = values.astype(dtype)
    return feeds


def _counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _assert_at_least(counts: Counter, expected: dict[str, int]) -> None:
    """As many norms fused as the peer fuses, each at least as deep (a Skip op also holds the norm the peer leaves
    as a separate LayerNormalization), no decomposed norm left, and no more of the other ops than the peer leaves."""
    assert counts["ReduceMean"] == 0
    for op, want in expected.items():
        if want == 0 or op not in NORMS:
            assert counts[op] <= want, op
    residual = (SKIP, SKIP_SLN, EMBED)
    assert sum(counts[op] for op in residual) >= sum(expected.get(op, 0) for op in residual)
    assert sum(counts[op] for op in NORMS) >= sum(v for op, v in expected.items() if op in NORMS)


def _assert_same_outputs(original: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    feeds = _feeds(original)
    for got, want in zip(_session(fused).run(None, feeds), _session(original).run(None, feeds)):
        tolerance = 2e-2 if want.dtype == np.float16 else 1e-4
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tolerance, atol=tolerance)


def _opset(model: onnx.ModelProto) -> int:
    return next(i.version for i in model.opset_import if i.domain in ("", "ai.onnx"))


@pytest.mark.parametrize("case", CASES)
def test_fuses_at_least_what_the_peer_expects(case: str):
    original = onnx.load(FOLDER / f"{case}.onnx")
    _session(original)  # the case is a model ONNX Runtime loads
    result = lnfuse.fuse(original)
    counts = _counts(result.model)
    if case in REFUSED:
        assert not any(counts[op] for op in NORMS)
        assert {u.check for u in result.report.unfused} == {REFUSED[case]}, result.report.unfused
    else:
        _assert_at_least(counts, EXPECTED[case])
        assert not result.report.unfused, result.report.unfused
    if not _ort_only_ops(result.model):
        onnx.checker.check_model(result.model, full_check=True)
    _assert_same_outputs(original, result.model)


def _ort_only_ops(model: onnx.ModelProto) -> set[str]:
    """ONNX Runtime's own ops: its contrib ops, and LayerNormalization below opset 17 (ORT has one there)."""
    ops = set(_counts(model))
    return (ops & _ORT_ONLY) | ({LN} & ops if _opset(model) < 17 else set())


def _onnx_target_cases() -> list[str]:
    """The cases whose opset has the fused ONNX op (below it, lnfuse only says so: one case checks that), less the
    ones whose input already holds ONNX Runtime's own ops."""
    cases = [c for c in CASES if _opset(onnx.load(FOLDER / f"{c}.onnx", load_external_data=False)) >= 17]
    return [c for c in cases if not c.startswith(("os_skip_sln", "os_sln"))] + ["ort_gpt2_past_pt15_op11"]


@pytest.mark.parametrize("case", _onnx_target_cases())
def test_target_onnx_where_the_opset_has_the_op(case: str):
    original = onnx.load(FOLDER / f"{case}.onnx")
    result = lnfuse.fuse(original, target="onnx")
    counts = _counts(result.model)
    assert not (_ORT_ONLY & set(counts)) - set(_counts(original)), "no ONNX Runtime op written"
    wanted = sum(v for op, v in EXPECTED[case].items() if op in NORMS)
    opset = _opset(original)
    has_rms = any(op in (SLN, SKIP_SLN) for op in EXPECTED[case]) or case.startswith("os_rms")
    if case in REFUSED or (has_rms and opset < 23) or opset < 17:
        assert all(u.check in ("opset", "epsilon") for u in result.report.unfused), result.report.unfused
    else:
        assert counts["ReduceMean"] == 0
        assert counts[LN] + counts[RMS] >= wanted
        onnx.checker.check_model(result.model, full_check=True)
    _assert_same_outputs(original, result.model)


def test_opset_upgrade_fuses_the_old_opset_cases_as_onnx_ops():
    """The opset-11/14 cases (ORT's tests) need --upgrade-opset for --target onnx: then every norm is a
    LayerNormalization and the model passes the full checker."""
    for case in ("ort_gpt2_past_pt15_op11", "ort_keras2onnx_bert_op11", "ort_phi_vision_layernorm_fp16",
                 "ort_ln_without_scale_bias_op12", "ort_ln_fp16_op10"):
        original = onnx.load(FOLDER / f"{case}.onnx")
        result = lnfuse.fuse(original, target="onnx", upgrade_opset=True)
        counts = _counts(result.model)
        assert counts["ReduceMean"] == 0 and counts[LN] == sum(EXPECTED[case].values()), (case, counts)
        onnx.checker.check_model(result.model, full_check=True)
        _assert_same_outputs(original, result.model)


def test_output_declared_without_a_shape_is_read_as_ort_reads_it():
    """make_tensor_value_info(name, type, None): ORT loads the model, onnx's checker wants the shape field. lnfuse
    declares the shape inference finds and fuses."""
    model = onnx.load(FOLDER / "os_ln_div_bias.onnx")
    model.graph.output[0].type.tensor_type.ClearField("shape")
    with pytest.raises(onnx.checker.ValidationError, match="shape"):
        onnx.checker.check_model(model)
    _session(model)
    result = lnfuse.fuse(model, target="onnx")
    assert _counts(result.model)[LN] == 1
    assert [d.dim_value for d in result.model.graph.output[0].type.tensor_type.shape.dim] == [2, 4, 8]
    onnx.checker.check_model(result.model, full_check=True)
    _assert_same_outputs(model, result.model)


def test_output_declared_without_a_type_is_read_as_ort_reads_it():
    """An output named with no type at all: ORT loads the model and infers it; onnx's checker wants the type.
    lnfuse declares the type inference finds and fuses."""
    model = onnx.load(FOLDER / "os_ln_div_bias.onnx")
    model.graph.output[0].ClearField("type")
    with pytest.raises(onnx.checker.ValidationError, match="type"):
        onnx.checker.check_model(model)
    _session(model)
    result = lnfuse.fuse(model, target="onnx")
    assert _counts(result.model)[LN] == 1
    output = result.model.graph.output[0].type.tensor_type
    assert output.elem_type == onnx.TensorProto.FLOAT and [d.dim_value for d in output.shape.dim] == [2, 4, 8]
    onnx.checker.check_model(result.model, full_check=True)
    _assert_same_outputs(model, result.model)


def _script(folder: Path, name: str):
    """A script that makes sample models, as a module (it lives beside its models, not in a package)."""
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def exporter_samples():
    return _script(SAMPLES, "make_exporter_samples")


def test_onnxscript_bart_encoder(exporter_samples, tmp_path):
    """onnxscript's skip_normalization_test (bart encoder): SkipLayerNormalization expected. lnfuse also writes the
    embedding block as EmbedLayerNormalization."""
    path = exporter_samples.onnxscript_model("_bart_encoder", tmp_path, seed=1)
    counts = _counts(lnfuse.fuse(str(path)).model)
    assert counts["ReduceMean"] == 0
    assert (counts[EMBED], counts[SKIP], counts[LN]) == (1, 4, 0), counts


def test_existing_skip_op_with_a_bias_over_lookups_stays():
    """A SkipLayerNormalization over the lookups that also adds a bias is not an EmbedLayerNormalization (the
    kernel adds no bias): it stays, with the reason."""
    model = onnx.load(FOLDER / "ort_gpt2_embedlayer.onnx")
    skip = next(n for n in model.graph.node if n.op_type == SKIP and n.input[0].startswith("add"))
    skip.input.append(next(t.name for t in model.graph.initializer if t.name.startswith("dense_bias")))
    result = lnfuse.fuse(model)
    counts = _counts(result.model)
    assert (counts[EMBED], counts[SKIP]) == (0, 2), counts
    assert [u.check for u in result.report.kept] == ["bias"] and not result.report.unfused, result.report.kept
    _assert_same_outputs(model, result.model)


@pytest.mark.parametrize("scale_dim,fused", [("H", True), ("K", False), (None, False)])
def test_run_time_scale_of_the_named_hidden_dim(scale_dim, fused):
    """A run-time scale declared [H] for an input [B, S, H] is of the normalized dims themselves (ORT's
    layer_norm_fp16 test model: X [M, N], Scale [N]); one of another named or an unnamed dim is not known to be."""
    mp = _script(FOLDER, "make_peer_cases")
    g = mp.Graph(0)
    x = g.input("x", mp.F32, ["B", "S", "H"])
    mean_square = g.op("ReduceMean", g.op("Mul", x, x), g.const([-1], np.int64), keepdims=1)
    n = g.op("Div", x, g.op("Sqrt", g.op("Add", mean_square, g.const(1e-6))))
    y = g.op("Mul", g.input("w", mp.F32, [scale_dim]), n)
    model = g.model([(y, mp.F32, ["B", "S", "H"])], 18)
    result = lnfuse.fuse(model)
    assert _counts(result.model)[SLN] == int(fused), result.report.unfused
    if fused:
        _assert_same_outputs(model, result.model)
