"""Norms quantized in QOperator format are candidates, one per norm, left with the QOperator op that rounds inside.

``quantize_static(..., quant_format=QuantFormat.QOperator)`` turns a norm's epsilon Add into QLinearAdd (and gamma's
Mul, beta's Add, LLaMA's ``x * 1/σ`` into QLinear ops), so ``variance + eps`` is QuantizeLinear -> QLinearAdd ->
DequantizeLinear before the Sqrt. Issue 28: explain and check found 0 candidates on such a model (or the RMS
formula's reason on a LayerNorm). The samples are ORT's quantizer's output on float samples lnfuse fuses
(sample_models/make_qoperator.py); what the user relies on: check's count and exit code, explain's count, and a
reason that names the op and says what to do.

The number of norms present is counted independently of the candidate finder: lnfuse's rules fuse the float model
each sample was quantized from, and each norm they fuse is one norm present in the quantized model (the quantizer
keeps the float node names, so the norms are matched one to one by their reductions).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest
from onnx import TensorProto

import onnx_ir as ir
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

import lnfuse
from lnfuse.match import candidates
from lnfuse.match.quantized_norms import rounding_reason

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
QOPERATOR = SAMPLES / "qoperator"
#: each QOperator sample with every op type quantized (the quantizer's default) -> the float sample it came from
QUANTIZED_EVERYWHERE = {
    "bert_qop_per_tensor.onnx": "bert_tiny_legacy_op14.onnx",
    "bert_qop_per_channel.onnx": "bert_tiny_legacy_op14.onnx",
    "gpt2_qop_per_tensor.onnx": "gpt2_tiny_legacy_op14.onnx",
    "llama_qop_per_tensor.onnx": "llama_tiny_legacy_op14.onnx",
    "llama_qop_per_channel.onnx": "llama_tiny_legacy_op14.onnx",
    "vit_qop_per_tensor.onnx": "wm_vit_legacy_op14.onnx",
}
NORM_RULES = ("layer_norm", "rms_norm")
#: the reason's opening: the QOperator op, by type and name
NAMED = re.compile(r"^(QLinear\w+) '([^']+)' \(a QOperator (\w+), computed on 8-bit values\)")


def _lnfuse(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@functools.cache
def _norms_in_float_model(float_file: str) -> dict[frozenset[str], frozenset[str]]:
    """The norms of a float sample, as lnfuse's rules fuse them: each one's ReduceMean names -> all its nodes."""
    model = onnx.load(SAMPLES / float_file)
    reductions = {n.name for n in model.graph.node if n.op_type == "ReduceMean" and n.domain == ""}
    report = lnfuse.fuse(SAMPLES / float_file).report
    norms = {frozenset(reductions.intersection(f.nodes)): frozenset(f.nodes) for f in report.fused
             if f.rule in NORM_RULES}
    assert norms and all(norms) and len(norms) == sum(f.rule in NORM_RULES for f in report.fused), \
        "the float sample's norms fuse, each from reductions of its own"
    return norms


def _check(sample: Path) -> tuple[int, dict]:
    done = _lnfuse("check", sample, "--json")
    return done.returncode, json.loads(done.stdout)


def _reduce_means(report_nodes: list[str], model: onnx.ModelProto) -> frozenset[str]:
    means = {n.name for n in model.graph.node if n.op_type == "ReduceMean" and n.domain == ""}
    return frozenset(means.intersection(report_nodes))


@pytest.mark.parametrize("sample", sorted(QUANTIZED_EVERYWHERE))
def test_check_counts_each_qoperator_norm_once_with_the_op_that_rounds(sample: str):
    norms = _norms_in_float_model(QUANTIZED_EVERYWHERE[sample])
    model = onnx.load(QOPERATOR / sample)
    qlinear = {n.name: n.op_type for n in model.graph.node if n.domain == "com.microsoft"}
    code, report = _check(QOPERATOR / sample)
    assert code == 1, "a norm left unfused fails the gate"
    assert len(report["candidates"]) == len(report["unfused"]) == len(norms)
    assert {_reduce_means(c["nodes"], model) for c in report["candidates"]} == set(norms), "one candidate per norm"
    for candidate in report["candidates"]:
        assert not candidate["fused"] and candidate["check"] == "quantized", candidate
        named = NAMED.match(candidate["reason"])
        assert named, candidate["reason"]
        op, name, float_op = named.groups()
        assert qlinear.get(name) == op and float_op in ("Add", "Mul"), "the reason names a QLinear node of the model"
        # the quantizer names a QLinear node after the float node it replaced: the op named is this norm's own step
        assert name.removesuffix("_quant") in norms[_reduce_means(candidate["nodes"], model)], name
        assert "fuse the float model first, then quantize" in candidate["reason"]


@pytest.mark.parametrize("sample", ["bert_qop_per_tensor.onnx", "llama_qop_per_tensor.onnx"])
def test_explain_counts_the_same_norms(sample: str):
    norms = _norms_in_float_model(QUANTIZED_EVERYWHERE[sample])
    explain = _lnfuse("explain", QOPERATOR / sample)
    assert explain.returncode == 0, explain.stderr
    left = [line for line in explain.stdout.splitlines() if line.startswith("LEFT")]
    assert len(left) == len(norms) and all("[quantized/quantized] QLinearAdd '" in line for line in left), left
    assert f"{len(norms)} norm-like statistic(s) found: 0 fused, {len(norms)} left" in explain.stdout


def test_a_rounded_inverse_root_is_inside_the_norm():
    """Only Mul quantized: the epsilon Add stays float, and 1/σ is rounded for the QLinearMul that scales x by it."""
    norms = _norms_in_float_model("llama_tiny_legacy_op14.onnx")
    model = onnx.load(QOPERATOR / "llama_qop_mul_only.onnx")
    code, report = _check(QOPERATOR / "llama_qop_mul_only.onnx")
    assert code == 1 and len(report["candidates"]) == len(norms)
    for candidate in report["candidates"]:
        named = NAMED.match(candidate["reason"])
        assert candidate["check"] == "quantized" and named.group(1) == "QLinearMul", candidate["reason"]
        assert named.group(2).removesuffix("_quant") in norms[_reduce_means(candidate["nodes"], model)]


def test_a_quantized_norm_output_is_not_a_rounding_inside_it():
    """Only MatMul quantized: each norm is float, and its output is quantized for the QLinearMatMul after it, as a
    fused norm's would be. Every norm is still a candidate; none is called quantized inside."""
    norms = _norms_in_float_model("bert_tiny_legacy_op14.onnx")
    _, report = _check(QOPERATOR / "bert_qop_matmul_only.onnx")
    assert len(report["candidates"]) == len(norms)
    assert not [c for c in report["candidates"] if c["check"] == "quantized"], report["candidates"]


def test_norms_fused_before_quantizing_pass_the_gate():
    """lnfuse first (five LayerNormalization), then QOperator: the norms are single ops, nothing is left."""
    model = onnx.load(QOPERATOR / "gpt2_fused_then_qop.onnx")
    assert sum(n.op_type == "LayerNormalization" for n in model.graph.node) == 5
    code, report = _check(QOPERATOR / "gpt2_fused_then_qop.onnx")
    assert code == 0 and report["candidates"] == [] and report["unfused"] == []


# ---- a statistic computed by QLinear ops ---------------------------------------------------------------------------

H = 6


def _channel_norm(tmp_path: Path) -> tuple[Path, Path]:
    """A hand-written norm over the spatial axes of [N, C, H, W] (an InstanceNorm without affine): GlobalAveragePool
    for both means, the square as Mul(d, d); and ORT's quantizer's QOperator output for it, which computes the square
    by QLinearMul, the variance by QLinearGlobalAveragePool and variance + eps by QLinearAdd."""
    nodes = [oh.make_node("GlobalAveragePool", ["X"], ["mean"], name="mean"),
             oh.make_node("Sub", ["X", "mean"], ["d"], name="centre"),
             oh.make_node("Mul", ["d", "d"], ["sq"], name="square"),
             oh.make_node("GlobalAveragePool", ["sq"], ["var"], name="variance"),
             oh.make_node("Add", ["var", "eps"], ["var_eps"], name="add_eps"),
             oh.make_node("Sqrt", ["var_eps"], ["std"], name="root"),
             oh.make_node("Div", ["d", "std"], ["Y"], name="normalize")]
    shape = ["batch", 4, H, H]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("X", TensorProto.FLOAT, shape)],
                          [oh.make_tensor_value_info("Y", TensorProto.FLOAT, shape)],
                          [onh.from_array(np.float32(1e-5), "eps")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    float_path, quantized_path = tmp_path / "channel_norm.onnx", tmp_path / "channel_norm_qop.onnx"
    onnx.save(model, float_path)

    class Calibration(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.batches = iter([{"X": rng.standard_normal((2, 4, H, H)).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(float_path, quantized_path, Calibration(), quant_format=QuantFormat.QOperator)
    onnx.checker.check_model(onnx.load(quantized_path), full_check=True)
    return float_path, quantized_path


def test_a_variance_a_qlinear_op_computes_is_found(tmp_path: Path):
    float_path, quantized_path = _channel_norm(tmp_path)
    assert [f.op_type for f in lnfuse.fuse(float_path).report.fused] == ["LayerNormalization"], "one norm present"
    quantized = onnx.load(quantized_path)
    by_name = {n.name: n.op_type for n in quantized.graph.node if n.domain == "com.microsoft"}
    assert sorted(by_name.values()) == ["QLinearAdd", "QLinearGlobalAveragePool", "QLinearMul"], by_name
    x = np.random.default_rng(1).standard_normal((2, 4, H, H)).astype(np.float32)
    rounded = ort.InferenceSession(quantized_path, providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    exact = (x - x.mean((2, 3), keepdims=True)) / np.sqrt(x.var((2, 3), keepdims=True) + 1e-5)
    assert 1e-3 < np.abs(rounded - exact).max() < 1.0, "ORT computes the norm, rounded inside"
    code, report = _check(quantized_path)
    assert code == 1 and len(report["candidates"]) == 1, report
    candidate = report["candidates"][0]
    assert candidate["kind"] == "centred" and candidate["check"] == "quantized"
    variance = next(name for name, op in by_name.items() if op == "QLinearGlobalAveragePool")
    assert variance in candidate["nodes"] and "over axes [2, 3] of rank 4" in candidate["statistics"], candidate
    named = NAMED.match(candidate["reason"])
    assert named and by_name[named.group(2)] == named.group(1), candidate["reason"]


def test_a_qlinear_reduce_mean_is_a_reduction():
    """com.microsoft's QLinearReduceMean (ORT 1.32 defines it, has no CPU kernel for it, and its quantizer does not
    write it; another tool may): a mean of squares it computes is a candidate, with it as the rounding step."""
    inits = [onh.from_array(np.float32(1e-5), "eps"), onh.from_array(np.float32(2.0), "two")]
    for value, scale in (("sq", 0.05), ("var", 0.02)):
        inits += [onh.from_array(np.float32(scale), f"{value}_s"), onh.from_array(np.uint8(128), f"{value}_z")]
    nodes = [oh.make_node("Pow", ["X", "two"], ["sq"], name="square"),
             oh.make_node("QuantizeLinear", ["sq", "sq_s", "sq_z"], ["sq_q"], name="sq_Q"),
             oh.make_node("QLinearReduceMean", ["sq_q", "sq_s", "sq_z", "var_s", "var_z"], ["var_q"], axes=[-1],
                          keepdims=1, domain="com.microsoft", name="mean_square"),
             oh.make_node("DequantizeLinear", ["var_q", "var_s", "var_z"], ["var"], name="var_DQ"),
             oh.make_node("Add", ["var", "eps"], ["var_eps"], name="add_eps"),
             oh.make_node("Sqrt", ["var_eps"], ["rms"], name="root"),
             oh.make_node("Div", ["X", "rms"], ["Y"], name="normalize")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4, 8])],
                          [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4, 8])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    found = candidates.find(ir.from_proto(model).graph)
    assert [(s.kind, s.square.name) for s in found] == [("uncentred", "mean_square")]
    assert rounding_reason(found[0].quantizers).startswith("QLinearReduceMean 'mean_square' (a QOperator ReduceMean")
