"""Red-team findings: each test is a hostile or malformed model that once made lnfuse accept what ONNX Runtime
refuses, write an invalid model, or change what a model computes. Built here, run through the real CLI path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest
from onnx import TensorProto

from lnfuse.cli import main

H = 8


def _layer_norm_nodes(x: str = "x", y: str = "n") -> list[onnx.NodeProto]:
    return [oh.make_node("ReduceMean", [x], ["m"], axes=[-1]), oh.make_node("Sub", [x, "m"], ["d"]),
            oh.make_node("Pow", ["d", "two"], ["sq"]), oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
            oh.make_node("Add", ["var", "eps"], ["ve"]), oh.make_node("Sqrt", ["ve"], ["std"]),
            oh.make_node("Div", ["d", "std"], [y])]


def _save(model: onnx.ModelProto, folder: Path) -> Path:
    path = folder / "model.onnx"
    onnx.save(model, path)
    return path


def _norm_model(tail: onnx.NodeProto, inits=(), value_info=()) -> onnx.ModelProto:
    """The decomposed norm of ``x`` [2, H] into ``n``, then ``tail`` from ``n`` to the output ``y``."""
    inits = [onh.from_array(np.array(2.0, np.float32), "two"), onh.from_array(np.array(1e-5, np.float32), "eps"),
             *inits]
    model = oh.make_model(oh.make_graph(_layer_norm_nodes() + [tail], "g",
                                        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
                                        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, H])], inits,
                                        value_info=list(value_info)),
                          opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _ort_loads(model: onnx.ModelProto) -> None:
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _cli(model: onnx.ModelProto, folder: Path, capsys, *args: str) -> tuple[int, str, Path]:
    """The model saved in ``folder`` and run through the CLI into ``folder/out``: exit code, stderr, output path."""
    path = _save(model, folder)
    out = folder / "out" / "fused.onnx"
    out.parent.mkdir()
    code = main([str(path), "-o", str(out), *args])
    return code, capsys.readouterr().err, out


def _refused(code: int, err: str, out: Path, *words: str) -> None:
    """Exit 2, one line on stderr holding ``words``, nothing written."""
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and all(word in err for word in words)
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_an_input_whose_types_onnx_runtime_refuses_is_refused(tmp_path: Path, capsys, target: str):
    # a float16 constant added to a float32 tensor: onnx's basic checker passes it, ONNX Runtime refuses to load
    # it ("Type parameter (T) bound to different types"), and a written copy would fail the full checker
    model = _norm_model(oh.make_node("Add", ["n", "half"], ["y"]), [onh.from_array(np.ones([H], np.float16), "half")])
    with pytest.raises(Exception, match="bound to different types|Type Error"):
        _ort_loads(model)
    _refused(*_cli(model, tmp_path, capsys, "--target", target, "--no-verify"), "type")


@pytest.mark.parametrize("declared", [TensorProto.INT64, TensorProto.FLOAT16])
def test_a_value_declared_of_another_dtype_than_its_node_computes_is_refused(tmp_path: Path, capsys, declared: int):
    # value_info says the norm's output is int64 (or float16) where its nodes compute float32: ONNX Runtime refuses to
    # load it ("Type Error"); the type is checked once, by the same strict inference that gives lnfuse its shapes
    model = _norm_model(oh.make_node("Neg", ["n"], ["y"]),
                        value_info=[oh.make_tensor_value_info("n", declared, [2, H])])
    with pytest.raises(Exception, match="Type Error"):
        _ort_loads(model)
    _refused(*_cli(model, tmp_path, capsys), "types do not line up", "'n'")


def _declared(kind: str) -> onnx.ValueInfoProto:
    if kind == "sequence":
        return oh.make_value_info("n", oh.make_sequence_type_proto(oh.make_tensor_type_proto(TensorProto.FLOAT, None)))
    if kind == "optional":
        return oh.make_value_info("n", oh.make_optional_type_proto(oh.make_tensor_type_proto(TensorProto.FLOAT, None)))
    info = onnx.ValueInfoProto(name="n")
    if kind == "sparse":
        info.type.sparse_tensor_type.elem_type = TensorProto.FLOAT
    else:  # a tensor of no element type, with a shape
        info.type.tensor_type.shape.dim.add().dim_value = 2
    return info


@pytest.mark.parametrize("kind", ["sequence", "optional", "sparse", "no element type"])
def test_a_value_declared_of_another_kind_than_its_node_computes_is_refused(tmp_path: Path, capsys, kind: str):
    # the norm's output declared a sequence, an optional, a sparse tensor, or a tensor of element type 0: ONNX Runtime
    # refuses each; only shapes are claims it ignores
    model = _norm_model(oh.make_node("Neg", ["n"], ["y"]), value_info=[_declared(kind)])
    with pytest.raises(Exception):
        _ort_loads(model)
    _refused(*_cli(model, tmp_path, capsys), "types do not line up", "'n'")


@pytest.mark.parametrize("declared, ort_loads", [
    (([1], TensorProto.FLOAT), False),  # another rank
    (([2, 5], TensorProto.FLOAT), False),  # another number along a dim
    (([2, H], TensorProto.DOUBLE), False),  # another dtype
    ((["a", "b"], TensorProto.FLOAT), True),  # names: ORT merges them
    (([2, H], TensorProto.FLOAT), True),
])
def test_a_body_declaring_an_enclosing_graphs_value_is_read_as_ort_reads_it(tmp_path: Path, capsys, declared,
                                                                            ort_loads: bool):
    shape, dtype = declared
    then = oh.make_graph([oh.make_node("Add", ["x", "x"], ["t"])], "then", [],
                         [oh.make_tensor_value_info("t", TensorProto.FLOAT, None)],
                         value_info=[oh.make_tensor_value_info("x", dtype, shape)])
    other = oh.make_graph([oh.make_node("Mul", ["x", "x"], ["e"])], "else", [],
                          [oh.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    nodes = [oh.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    model = oh.make_model(oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, H]),
                                                     oh.make_tensor_value_info("c", TensorProto.BOOL, [])],
                                        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, H])]),
                          opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    if ort_loads:
        _ort_loads(model)
        code, err, _ = _cli(model, tmp_path, capsys)
        assert code == 0, err
    else:
        with pytest.raises(Exception, match="Graph attribute inferencing failed"):
            _ort_loads(model)
        _refused(*_cli(model, tmp_path, capsys), "enclosing graph")


def test_a_value_typed_by_its_declaration_alone_still_has_its_readers_checked(tmp_path: Path, capsys):
    # a contrib op onnx cannot type, its output declared float by value_info, added to an int64 constant: ORT refuses
    # ("bound to different types"); the types are checked again once the declaration has typed the value
    nodes = [oh.make_node("Gelu", ["x"], ["g"], domain="com.microsoft"), oh.make_node("Add", ["g", "k"], ["y"])]
    model = oh.make_model(oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
                                        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, H])],
                                        [onh.from_array(np.ones((2, H), np.int64), "k")],
                                        value_info=[oh.make_tensor_value_info("g", TensorProto.FLOAT, [2, H])]),
                          opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    with pytest.raises(Exception, match="Type Error|bound to different types"):
        _ort_loads(model)
    _refused(*_cli(model, tmp_path, capsys), "types do not line up")


@pytest.mark.parametrize("version", [0, -1])
def test_an_opset_version_below_one_is_refused(tmp_path: Path, capsys, version: int):
    # ONNX Runtime refuses it ("invalid model"); lnfuse wrote it back unchanged, failing the full checker
    nodes = [oh.make_node("Relu", ["x"], ["y"])]
    model = oh.make_model(oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
                                        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, H])]),
                          opset_imports=[oh.make_opsetid("", version)])
    model.ir_version = 8
    with pytest.raises(Exception):
        _ort_loads(model)
    _refused(*_cli(model, tmp_path, capsys, "--target", "onnx", "--no-verify"), "opset")


def _relu_model(elem_type: int = TensorProto.FLOAT, inits=()) -> onnx.ModelProto:
    model = oh.make_model(oh.make_graph([oh.make_node("Relu", ["x"], ["y"])], "g",
                                        [oh.make_tensor_value_info("x", elem_type, [2, H])],
                                        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, H])], list(inits)),
                          opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_string_initializer_without_raw_data_is_checked_not_crashed_on(tmp_path: Path, capsys):
    # a STRING tensor has no bit width: the well-formedness check raised TypeError (exit 3)
    text = onnx.TensorProto(name="s", data_type=TensorProto.STRING)  # shape [], no value: corrupt
    path = _save(_relu_model(inits=[text]), tmp_path)
    code = main([str(path), "-o", str(tmp_path / "fused.onnx"), "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "string_data" in err


def test_an_input_of_undefined_type_is_not_an_internal_error(tmp_path: Path, capsys):
    # strict type inference raised ValueError ("Invalid tensor data type 0") out of the type check: exit 3
    model = oh.make_model(oh.make_graph(
        [oh.make_node("Gather", ["w", "ids"], ["y"])], "g",
        [oh.make_tensor_value_info("ids", TensorProto.UNDEFINED, ["batch", "sequence"])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", H])],
        [onh.from_array(np.ones([4, H], np.float32), "w")]), opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    path = _save(model, tmp_path)
    code = main([str(path), "-o", str(tmp_path / "fused.onnx"), "--no-verify"])
    err = capsys.readouterr().err
    assert code in (0, 2), err
    assert len(err.strip().splitlines()) <= 1


def test_ops_of_other_domains_are_never_taken_for_the_same_value():
    """Two identical nodes of another domain may be random or stateful (a contrib dropout): the normal form must not
    merge them into one factor (with --no-verify, only this stands between them and a wrong norm)."""
    import onnx_ir as ir

    from lnfuse.match.algebra import key

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 4]))
    a = ir.Node("com.example", "Noise", [x], num_outputs=1)
    b = ir.Node("com.example", "Noise", [x], num_outputs=1)
    same_a = ir.Node("", "Relu", [x], num_outputs=1)
    same_b = ir.Node("", "Relu", [x], num_outputs=1)
    assert key(a.outputs[0]) != key(b.outputs[0])
    assert key(same_a.outputs[0]) == key(same_b.outputs[0])
