"""Every model the installed ONNX Runtime loads is accepted: what ORT repairs itself is repaired, one case per
class; what ORT refuses (a real cycle, an IR version it cannot read) is refused with the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import lnfuse
from lnfuse.load.repair import runtime_max_ir_version
from normgraphs import Spec, build, feeds_for, run, tolerance


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *args], capture_output=True, text=True, timeout=300)


def _ort_loads(model: onnx.ModelProto) -> None:
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _fuses_exactly(model: onnx.ModelProto, reference: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """lnfuse accepts the model, fuses its norm, and the fused model computes what the model (as ORT runs it, or
    its ``reference`` where ORT itself refuses the model) computes."""
    if reference is None:
        _ort_loads(model)
    result = lnfuse.fuse(model)
    fused = result.model
    assert [f.op_type for f in result.report.fused] == ["LayerNormalization"]
    feeds = feeds_for(build(Spec()))
    if any(i.name == "cond" for i in model.graph.input):
        feeds["cond"] = np.array(True)
    expected = run(reference or model, feeds)[0]
    np.testing.assert_allclose(run(fused, feeds)[0], expected, **tolerance("float32"))
    return fused


def test_nodes_out_of_order_are_sorted():
    model = build(Spec())
    reversed_nodes = list(model.graph.node)[::-1]
    del model.graph.node[:]
    model.graph.node.extend(reversed_nodes)
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model)
    fused = _fuses_exactly(model)
    onnx.checker.check_model(fused, full_check=True)


def _if_around(norm: onnx.ModelProto, body_nodes: list) -> onnx.ModelProto:
    body = oh.make_graph(body_nodes, "then_body", [], list(norm.graph.output),
                         list(norm.graph.initializer))
    other = oh.make_graph([oh.make_node("Identity", [norm.graph.input[0].name], ["same"])], "else_body", [],
                          [oh.make_tensor_value_info("same", onnx.TensorProto.FLOAT, [3, 2, 8])])
    # a constant condition would let shape inference copy the taken branch over the other
    cond = oh.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])
    graph = oh.make_graph([oh.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=other)], "main",
                          [*norm.graph.input, cond], [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 2, 8])])
    model = oh.make_model(graph, opset_imports=list(norm.opset_import))
    model.ir_version = norm.ir_version
    return model


def test_nodes_out_of_order_inside_a_subgraph_are_sorted():
    """ORT sorts only the main graph; lnfuse sorts bodies too (sorting never changes what a graph computes)."""
    norm = build(Spec())
    _fuses_exactly(_if_around(norm, list(norm.graph.node)[::-1]), _if_around(norm, list(norm.graph.node)))


def _function_around(norm: onnx.ModelProto, reverse: bool) -> onnx.ModelProto:
    constants = [oh.make_node("Constant", [], [t.name], value=t) for t in norm.graph.initializer]
    x, y = norm.graph.input[0].name, norm.graph.output[0].name
    nodes = constants + list(norm.graph.node)
    function = oh.make_function("local", "Norm", [x], [y], nodes[::-1] if reverse else nodes,
                                list(norm.opset_import))
    graph = oh.make_graph([oh.make_node("Norm", [x], [y], domain="local")], "main", list(norm.graph.input),
                          list(norm.graph.output))
    model = oh.make_model(graph, opset_imports=[*norm.opset_import, oh.make_opsetid("local", 1)],
                          functions=[function])
    model.ir_version = norm.ir_version
    return model


def test_nodes_out_of_order_inside_a_function_are_sorted():
    norm = build(Spec())
    _fuses_exactly(_function_around(norm, reverse=True), _function_around(norm, reverse=False))


def test_contrib_node_without_its_domain_import_is_declared():
    model = build(Spec())
    y = model.graph.output[0]
    model.graph.node.append(oh.make_node("FastGelu", [y.name], ["gelu"], domain="com.microsoft"))
    model.graph.output.append(oh.make_tensor_value_info("gelu", onnx.TensorProto.FLOAT, [3, 2, 8]))
    assert "com.microsoft" not in {i.domain for i in model.opset_import}
    fused = lnfuse.fuse(model).model
    _ort_loads(model)
    assert {i.domain: i.version for i in fused.opset_import}["com.microsoft"] == 1
    assert "FastGelu" in [n.op_type for n in fused.graph.node]
    feeds = feeds_for(build(Spec()))
    for a, b in zip(run(fused, feeds), run(model, feeds)):
        np.testing.assert_allclose(a, b, **tolerance("float32"))


def test_every_ir_version_the_runtime_reads_is_accepted(tmp_path: Path):
    limit = runtime_max_ir_version()
    assert limit is not None and limit >= 10
    model = build(Spec())
    model.ir_version = limit
    fused = _fuses_exactly(model)
    assert fused.ir_version <= onnx.IR_VERSION, "what lnfuse writes passes the installed checker"
    path, out = tmp_path / "newest.onnx", tmp_path / "fused.onnx"
    onnx.save(model, path)
    proc = _cli(str(path), "-o", str(out), "-q")
    assert proc.returncode == 0, proc.stderr
    onnx.checker.check_model(onnx.load(out), full_check=True)


def test_an_ir_version_the_runtime_cannot_read_is_refused(tmp_path: Path):
    limit = runtime_max_ir_version()
    model = build(Spec())
    model.ir_version = limit + 1
    with pytest.raises(Exception, match="IR version"):
        _ort_loads(model)
    path = tmp_path / "too_new.onnx"
    onnx.save(model, path)
    proc = _cli(str(path), "-o", str(tmp_path / "out.onnx"))
    assert proc.returncode == 2
    assert f"IR version {limit + 1}" in proc.stderr and f"<= {limit}" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_minus_one_dims_are_unknown_dims(tmp_path: Path):
    model = build(Spec())
    for info in [*model.graph.input, *model.graph.output]:
        for dim in info.type.tensor_type.shape.dim[:-1]:
            dim.Clear()
            dim.dim_value = -1
    path, out = tmp_path / "minus_one.onnx", tmp_path / "fused.onnx"
    onnx.save(model, path)
    _fuses_exactly(model)
    proc = _cli(str(path), "-o", str(out), "-q")
    assert proc.returncode == 0, proc.stderr
    written = onnx.load(out)
    dims = written.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and not dims[0].HasField("dim_value") and dims[-1].dim_value == 8


def test_a_real_cycle_is_refused_naming_its_nodes(tmp_path: Path):
    """Lenient is not unsafe: nodes that read each other's outputs cannot be ordered, and ORT refuses them too."""
    model = build(Spec())
    nodes = model.graph.node
    sub = next(n for n in nodes if n.op_type == "Sub")
    div = next(n for n in nodes if n.op_type == "Div")
    sub.input[0] = div.output[0]  # the centred value now depends on the division it feeds
    with pytest.raises(Exception):
        _ort_loads(model)
    path = tmp_path / "cycle.onnx"
    onnx.save(model, path)
    proc = _cli(str(path), "-o", str(tmp_path / "out.onnx"))
    assert proc.returncode == 2, proc.stderr
    assert "cycle" in proc.stderr and f"'{sub.name}'" in proc.stderr and f"'{div.name}'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.onnx").exists()


def test_two_initializers_of_one_name_read_as_ort_reads_them():
    """ORT keeps the initializer written last; the fused model computes with that one, not the first."""
    model = build(Spec())
    gamma = next(t for t in model.graph.initializer if t.name in model.graph.node[-2].input)
    first = onnx.TensorProto()
    first.CopyFrom(gamma)
    first.ClearField("raw_data")
    first.ClearField("float_data")
    first.float_data.extend([100.0] * int(np.prod(first.dims)))
    model.graph.initializer.insert(0, first)  # a decoy before the one ORT uses
    fused = _fuses_exactly(model)
    onnx.checker.check_model(fused, full_check=True)


def _function_model(body: list, function_opset: int, model_opset: int, shape: list[int], x: str = "x",
                    y: str = "y") -> onnx.ModelProto:
    function = oh.make_function("local", "F", [x], [y], body, [oh.make_opsetid("", function_opset)])
    return oh.make_model(oh.make_graph([oh.make_node("F", [x], [y], domain="local")], "g",
                                       [oh.make_tensor_value_info(x, onnx.TensorProto.FLOAT, shape)],
                                       [oh.make_tensor_value_info(y, onnx.TensorProto.FLOAT, shape)]),
                         opset_imports=[oh.make_opsetid("", model_opset), oh.make_opsetid("local", 1)],
                         functions=[function])


def test_a_function_at_another_opset_runs_at_the_models_as_in_ort():
    """ORT runs a function importing opset 11 in a model importing 17 at opset 17 (onnx's checker refuses the
    mix): Softmax(axis=1) is opset 13's, a softmax over axis 1 alone, not opset 11's over the flattened axes 1..2.
    lnfuse reads it as ORT does, and the model it writes computes the same."""
    model = _function_model([oh.make_node("Softmax", ["x"], ["y"], axis=1)], 11, 17, [2, 3, 4])
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    written = lnfuse.fuse(model).model
    onnx.checker.check_model(written, full_check=True)
    expected = run(model, {"x": x})[0]
    np.testing.assert_allclose(run(written, {"x": x})[0], expected, rtol=1e-6)
    np.testing.assert_allclose(expected.sum(axis=1), 1.0, rtol=1e-5)  # opset 13's meaning, as ORT runs it


def test_a_norm_in_a_function_at_another_opset_is_fused():
    norm = build(Spec(opset=13))
    body = [oh.make_node("Constant", [], [t.name], value=t) for t in norm.graph.initializer] + list(norm.graph.node)
    shape = [d.dim_value for d in norm.graph.input[0].type.tensor_type.shape.dim]
    model = _function_model(body, 13, 17, shape, norm.graph.input[0].name, norm.graph.output[0].name)
    fused = _fuses_exactly(model)
    onnx.checker.check_model(fused, full_check=True)
