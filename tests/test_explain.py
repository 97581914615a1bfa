"""explain names the deciding refusal: for each candidate, the check that failed on the form that got furthest,
not the first form tried; the others are in the report and under -v / --json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
from onnx import TensorProto

import lnfuse

H = 8


def _residual_norm(z_shape: list, gamma_from_sum: bool = False) -> onnx.ModelProto:
    """LayerNormalization(x + y + z). The residual rule first tries the forms with a 1-D bias (x + y + bias): none
    of x, y, z is one, so each is refused for its bias. The form without bias, (x + y) + z, is the real candidate,
    and its own check decides."""
    def info(name, shape):
        return oh.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    nodes = [oh.make_node("Add", ["x", "y"], ["xy"], name="inner"),
             oh.make_node("Add", ["xy", "z"], ["s"], name="outer")]
    inits = [onh.from_array(np.zeros(H, np.float32), "beta")]
    if gamma_from_sum:  # a scale computed from the sum itself: the fused op would feed itself
        nodes.append(oh.make_node("ReduceMean", ["s"], ["gamma"], name="gamma_from_sum", axes=[0, 1], keepdims=0))
    else:
        inits.append(onh.from_array(np.ones(H, np.float32), "gamma"))
    nodes.append(oh.make_node("LayerNormalization", ["s", "gamma", "beta"], ["out"], name="norm", epsilon=1e-5))
    graph = oh.make_graph(nodes, "g", [info("x", ["batch", "seq", H]), info("y", ["batch", "seq", H]),
                                       info("z", z_shape)], [info("out", ["batch", "seq", H])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _only_refusal(model: onnx.ModelProto) -> lnfuse.report.Unfused:
    report = lnfuse.fuse(model).report
    assert not report.fused
    [refused] = [u for u in report.kept if u.anchor == "LayerNormalization 'norm'"]
    return refused


def test_the_form_that_read_furthest_decides_not_the_first_pattern():
    # a [1, 1, H] addend: the bias forms fail early (the bias is not 1-D); the residual form gets to its shapes
    refused = _only_refusal(_residual_norm([1, 1, H]))
    assert (refused.rule, refused.check) == ("skip_norm", "shape")
    assert "the addends of 's'" in refused.reason
    assert {o.check for o in refused.others} == {"bias", "shape"}
    assert all(o.matched == 3 for o in refused.others if o.check == "bias")
    assert len(refused.nodes) == 2  # the deciding form's own nodes: the Add and the norm


def test_a_form_refused_after_the_rules_checks_decides_over_larger_forms():
    # every shape fits; the residual form passes the rule's checks and is refused by the engine for a cycle (the
    # scale is computed from the sum): that is what blocks the fusion, not the 3-node bias forms
    refused = _only_refusal(_residual_norm(["batch", "seq", H], gamma_from_sum=True))
    assert (refused.check, refused.reason) == ("cycle", "'s' is computed inside the norm and also feeds the fused op")
    assert sorted(o.check for o in refused.others) == ["bias", "bias", "bias"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *args], capture_output=True, text=True)


def test_explain_prints_the_deciding_reason_and_lists_the_others_under_v(tmp_path: Path):
    path = tmp_path / "m.onnx"
    onnx.save(_residual_norm([1, 1, H]), path)
    plain = _cli("explain", str(path))
    assert plain.returncode == 0, plain.stderr
    [kept] = [line for line in plain.stdout.splitlines() if line.startswith("KEPT")]  # a fused norm, kept as it is
    assert "[skip_norm/shape] the addends of 's'" in kept and "LEFT" not in plain.stdout
    assert "other check(s) failed on other forms tried; -v lists them" in plain.stdout
    assert "[skip_norm/bias]" not in plain.stdout

    verbose = _cli("explain", str(path), "-v")
    assert "also refused: [skip_norm/bias] bias 'z' has shape [1, 1, 8]; the kernel needs [8] (a form of 3 nodes)" \
        in verbose.stdout

    data = json.loads(_cli("explain", str(path), "--json").stdout)
    [entry] = data["kept"]
    assert data["unfused"] == [] and entry["check"] == "shape" and {o["check"] for o in entry["others"]} == \
        {"bias", "shape"}

    check = _cli("check", str(path), "-v")
    assert check.returncode == 0, "a norm that is fused already is not left unfused"
    as_json = _cli("check", str(path), "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["kept"][0]["check"] == "shape"
