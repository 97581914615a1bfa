"""No requantization by construction: whether a rewrite may move a quantized value is read off the graph, not off
a sample. A norm whose output reaches a quantizer by any path (any ops, any distance, through subgraphs and
model-local functions) is left as it is by default, naming the quantizer; ``allow_requantization`` fuses it.
Paths that carry no value (a Shape) and quantizers the norm does not reach leave the norm free to fuse."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx import TensorProto

import lnfuse
from normgraphs import Spec, build, feeds_for, session

H = 8  # normgraphs' hidden size: the norm's output is [3, 2, 8]


def _norm() -> onnx.ModelProto:
    """normgraphs' decomposed LayerNormalization of 'X', its output renamed 'Y'."""
    model = build(Spec())
    old = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = ["Y" if o == old else o for o in node.output]
    model.graph.output[0].name = "Y"
    return model


def _const(name: str, array: np.ndarray) -> onnx.TensorProto:
    return onh.from_array(np.asarray(array), name)


def _tail(nodes: list[onnx.NodeProto], outputs: list[onnx.ValueInfoProto], inits=(), functions=(), opsets=(),
          inputs=()) -> onnx.ModelProto:
    """The norm of ``normgraphs`` with ``nodes`` after it reading 'Y', and ``outputs`` as the graph's outputs."""
    model = _norm()
    model.graph.input.extend(inputs)
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(inits)
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    model.functions.extend(functions)
    model.opset_import.extend(oh.make_opsetid(domain, version) for domain, version in opsets)
    return model


def _with_tail(nodes: list[onnx.NodeProto], outputs: list[onnx.ValueInfoProto], *parts, **named) -> onnx.ModelProto:
    """``_tail``, its outputs typed as onnx infers them and the whole checked."""
    return _typed(_tail(nodes, outputs, *parts, **named))


def _typed(model: onnx.ModelProto) -> onnx.ModelProto:
    """The outputs typed as onnx infers them (the checker wants a shape on each), then checked."""
    graph = onnx.shape_inference.infer_shapes(model).graph
    inferred = {v.name: v for v in [*graph.value_info, *graph.output] if v.type.tensor_type.HasField("shape")}
    for output in model.graph.output:
        if not output.type.tensor_type.HasField("shape") and output.name in inferred:
            output.CopyFrom(inferred[output.name])
    onnx.checker.check_model(model, full_check=True)
    return model


def _out(name: str, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, elem, None)


def _qdq(source: str, name: str) -> list[onnx.NodeProto]:
    return [oh.make_node("QuantizeLinear", [source, "s", "z"], [f"{name}_q"], name=name),
            oh.make_node("DequantizeLinear", [f"{name}_q", "s", "z"], [f"{name}_dq"], name=f"{name}_dq")]


SCALE = [_const("s", np.float32(0.05)), _const("z", np.int8(0))]
FLAG = oh.make_tensor_value_info("flag", TensorProto.BOOL, [])


def _cls_token() -> onnx.ModelProto:
    """norm -> Reshape -> Gather (a CLS token) -> QuantizeLinear: a value a few generic ops away is still quantized."""
    nodes = [oh.make_node("Reshape", ["Y", "shape"], ["flat"], name="flatten"),
             oh.make_node("Gather", ["flat", "zero"], ["cls"], axis=1, name="cls_gather"), *_qdq("cls", "cls_quant")]
    return _with_tail(nodes, [_out("cls_quant_dq")], [_const("shape", np.array([3, 2, H], np.int64)),
                                                      _const("zero", np.int64(0)), *SCALE])


def _gemm_split() -> onnx.ModelProto:
    """norm -> MatMul -> Reshape -> Split -> Transpose -> QuantizeLinear (ViT/GPT-2's attention input)."""
    nodes = [oh.make_node("MatMul", ["Y", "w"], ["proj"], name="proj"),
             oh.make_node("Reshape", ["proj", "heads"], ["split_in"], name="heads"),
             oh.make_node("Split", ["split_in", "halves"], ["q", "k"], axis=2, name="split"),
             oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1, 3], name="transpose"),
             *_qdq("kt", "k_quant"), oh.make_node("Identity", ["q"], ["q_out"])]
    return _with_tail(nodes, [_out("k_quant_dq"), _out("q_out")],
                      [_const("w", np.random.default_rng(0).normal(size=(H, 2 * H)).astype(np.float32)),
                       _const("heads", np.array([3, 2, 2, H], np.int64)),
                       _const("halves", np.array([1, 1], np.int64)), *SCALE])


def _dynamic() -> onnx.ModelProto:
    """norm -> DynamicQuantizeLinear (quantize_dynamic's activations): its scale is computed from the very values
    that would change, so a difference moves both the grid and the values on it."""
    nodes = [oh.make_node("DynamicQuantizeLinear", ["Y"], ["yq", "ys", "yz"], name="dyn_quant")]
    return _with_tail(nodes, [_out("yq", TensorProto.UINT8), _out("ys"), _out("yz", TensorProto.UINT8)])


def _scale_from_norm() -> onnx.ModelProto:
    """A hand-written dynamic quantizer: the norm decides the scale another tensor is quantized with."""
    nodes = [oh.make_node("ReduceMax", ["Y"], ["peak"], keepdims=0, name="peak"),
             oh.make_node("Div", ["peak", "levels"], ["scale"], name="scale"),
             oh.make_node("QuantizeLinear", ["X", "scale"], ["xq"], name="x_quant")]
    return _with_tail(nodes, [_out("xq", TensorProto.UINT8), _out("Y")], [_const("levels", np.float32(127.0))])


def _through_if() -> onnx.ModelProto:
    """An If branch reads the norm by outer-scope name; the If's output is quantized after it."""
    then = oh.make_graph([oh.make_node("Relu", ["Y"], ["t"])], "then", [], [_out("t")])
    other = oh.make_graph([oh.make_node("Neg", ["Y"], ["e"])], "else", [], [_out("e")])
    nodes = [oh.make_node("If", ["flag"], ["branch"], then_branch=then, else_branch=other, name="branch"),
             *_qdq("branch", "branch_quant")]
    return _with_tail(nodes, [_out("branch_quant_dq")], SCALE, inputs=[FLAG])


def _quantizer_in_branch() -> onnx.ModelProto:
    """The quantizer sits inside the branch that reads the norm."""
    then = oh.make_graph(_qdq("Y", "inner_quant"), "then", [], [_out("inner_quant_dq")])
    other = oh.make_graph([oh.make_node("Identity", ["Y"], ["e"])], "else", [], [_out("e")])
    nodes = [oh.make_node("If", ["flag"], ["branch"], then_branch=then, else_branch=other, name="branch")]
    return _with_tail(nodes, [_out("branch")], SCALE, inputs=[FLAG])


def _into_function() -> onnx.ModelProto:
    """A model-local function quantizes what the norm gives it."""
    body = [oh.make_node("Constant", [], ["fs"], value=oh.make_tensor("fs", TensorProto.FLOAT, [], [0.05])),
            oh.make_node("QuantizeLinear", ["a", "fs"], ["b"], name="function_quant")]
    function = oh.make_function("local", "Quantize", ["a"], ["b"], body, [oh.make_opsetid("", 17)])
    nodes = [oh.make_node("Quantize", ["Y"], ["yq"], domain="local", name="call")]
    return _with_tail(nodes, [_out("yq", TensorProto.UINT8)], functions=[function], opsets=[("local", 1)])


def _int8_cast() -> onnx.ModelProto:
    """A Cast to int8 rounds to a grid like any quantizer."""
    nodes = [oh.make_node("Cast", ["Y"], ["yi"], to=TensorProto.INT8, name="to_int8")]
    return _with_tail(nodes, [_out("yi", TensorProto.INT8)])


def _int8_accuracy_matmul() -> onnx.ModelProto:
    """MatMulNBits at accuracy level 4 quantizes its activation to int8 blocks inside the kernel."""
    rng = np.random.default_rng(0)
    nodes = [oh.make_node("MatMulNBits", ["Y", "packed", "scales"], ["mm"], domain="com.microsoft", K=H, N=4,
                          bits=4, block_size=16, accuracy_level=4, name="mm_nbits")]
    inits = [_const("packed", rng.integers(0, 256, (4, 1, 8), dtype=np.uint8)),
             _const("scales", np.full(4, 0.1, np.float32))]
    model = _tail(nodes, [oh.make_tensor_value_info("mm", TensorProto.FLOAT, [3, 2, 4])], inits,
                  opsets=[("com.microsoft", 1)])
    session(model)  # ORT runs it: a contrib op the checker does not know
    return model


HOSTILE = {"cls_token": (_cls_token, "cls_quant"), "gemm_split": (_gemm_split, "k_quant"),
           "dynamic": (_dynamic, "dyn_quant"), "scale_from_norm": (_scale_from_norm, "x_quant"),
           "through_if": (_through_if, "branch_quant"), "quantizer_in_branch": (_quantizer_in_branch, "inner_quant"),
           "into_function": (_into_function, "function_quant"), "int8_cast": (_int8_cast, "to_int8"),
           "int8_accuracy_matmul": (_int8_accuracy_matmul, "mm_nbits")}


def _norms(model: onnx.ModelProto) -> int:
    return Counter(n.op_type for n in model.graph.node)["LayerNormalization"]


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_norm_reaching_a_quantizer_is_left_and_the_quantizer_named(case):
    make, quantizer = HOSTILE[case]
    model = make()
    result = lnfuse.fuse(model)
    assert _norms(result.model) == 0, "the quantized model would change"
    (left,) = result.report.unfused
    assert left.check == "requantization", left
    assert f"'{quantizer}'" in left.reason and "--allow-requantization" in left.reason, left.reason
    feeds = feeds_for(model)
    for before, after in zip(session(model).run(None, feeds), session(result.model).run(None, feeds)):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_allow_requantization_fuses_it(case):
    model = HOSTILE[case][0]()
    result = lnfuse.fuse(model, allow_requantization=True)
    assert _norms(result.model) == 1 and not result.report.unfused, result.report.explain()


def test_a_path_that_carries_only_a_shape_is_no_requantization():
    """Shape(norm) -> Cast -> QuantizeLinear quantizes the norm's shape, which no rewrite changes."""
    nodes = [oh.make_node("Shape", ["Y"], ["dims"]), oh.make_node("Cast", ["dims"], ["dims_f"], to=TensorProto.FLOAT),
             oh.make_node("QuantizeLinear", ["dims_f", "s", "z"], ["dims_q"], name="dims_quant")]
    model = _with_tail(nodes, [_out("Y"), _out("dims_q", TensorProto.INT8)], SCALE)
    result = lnfuse.fuse(model)
    assert _norms(result.model) == 1, result.report.explain()


def test_a_quantizer_the_norm_does_not_reach_leaves_it_free():
    nodes = _qdq("X", "input_quant")
    model = _with_tail(nodes, [_out("Y"), _out("input_quant_dq")], SCALE)
    result = lnfuse.fuse(model)
    assert _norms(result.model) == 1, result.report.explain()


def test_a_norm_inside_a_function_whose_caller_quantizes_is_left():
    """The rewrite is in a function body; its output leaves through the function's output into a quantizer."""
    norm = _norm()
    body = [n for n in norm.graph.node]
    constants = [oh.make_node("Constant", [], [t.name], value=t) for t in norm.graph.initializer]
    function = oh.make_function("local", "Norm", ["X"], ["Y"], constants + body, [oh.make_opsetid("", 17)])
    graph = oh.make_graph([oh.make_node("Norm", ["x"], ["y"], domain="local", name="call"), *_qdq("y", "after")],
                          "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2, H])],
                          [_out("after_dq")], SCALE)
    model = oh.make_model(graph, functions=[function], opset_imports=[oh.make_opsetid("", 17),
                                                                      oh.make_opsetid("local", 1)])
    model.ir_version = norm.ir_version
    model = _typed(model)
    result = lnfuse.fuse(model)
    assert not any(n.op_type == "LayerNormalization" for n in result.model.functions[0].node)
    assert any(u.check == "requantization" and "'after'" in u.reason for u in result.report.unfused), \
        result.report.explain()
    allowed = lnfuse.fuse(model, allow_requantization=True)
    assert any(n.op_type == "LayerNormalization" for n in allowed.model.functions[0].node)


def test_a_loop_state_quantized_in_the_body_is_reached():
    """The norm is a Loop's initial state; the body quantizes the state it is given."""
    body = oh.make_graph(
        [oh.make_node("Identity", ["cond_in"], ["cond_out"]),
         oh.make_node("QuantizeLinear", ["state", "s", "z"], ["state_q"], name="body_quant"),
         oh.make_node("DequantizeLinear", ["state_q", "s", "z"], ["state_out"])], "body",
        [oh.make_tensor_value_info("i", TensorProto.INT64, []),
         oh.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         oh.make_tensor_value_info("state", TensorProto.FLOAT, [3, 2, H])],
        [oh.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         oh.make_tensor_value_info("state_out", TensorProto.FLOAT, [3, 2, H])])
    nodes = [oh.make_node("Loop", ["trips", "", "Y"], ["final"], body=body, name="loop")]
    model = _with_tail(nodes, [oh.make_tensor_value_info("final", TensorProto.FLOAT, [3, 2, H])],
                       [*SCALE, _const("trips", np.int64(2))])
    result = lnfuse.fuse(model)
    assert _norms(result.model) == 0
    assert any(u.check == "requantization" and "'body_quant'" in u.reason for u in result.report.unfused)


def _fake_quant() -> onnx.ModelProto:
    """A quantizer written out in float ops (x / s, Round, Clip, * s), as some QAT exports write it."""
    nodes = [oh.make_node("Div", ["Y", "s"], ["scaled"]), oh.make_node("Round", ["scaled"], ["whole"], name="round"),
             oh.make_node("Mul", ["whole", "s"], ["fake"])]
    return _with_tail(nodes, [_out("fake")], SCALE)


def _int32_cast() -> onnx.ModelProto:
    nodes = [oh.make_node("Cast", ["Y"], ["yi"], to=TensorProto.INT32, name="to_int32")]
    return _with_tail(nodes, [_out("yi", TensorProto.INT32)])


@pytest.mark.parametrize("make, rounding", [(_fake_quant, "round"), (_int32_cast, "to_int32")])
def test_a_rounding_to_whole_numbers_is_a_quantizer(make, rounding):
    result = lnfuse.fuse(make())
    assert _norms(result.model) == 0
    (left,) = result.report.unfused
    assert left.check == "requantization" and f"'{rounding}'" in left.reason, left.reason


def test_an_op_of_another_domain_writing_int8_is_a_quantizer():
    """A quantizer lnfuse has never heard of (a vendor's QuantizeLinear in its own domain, typed int8 by the model)."""
    nodes = [oh.make_node("ExtendedQuantizeLinear", ["Y", "s", "z"], ["yq"], domain="com.vendor", name="vendor_quant")]
    model = _tail(nodes, [oh.make_tensor_value_info("yq", TensorProto.INT8, [3, 2, H])], SCALE,
                  opsets=[("com.vendor", 1)])
    result = lnfuse.fuse(model, verify=False)  # ORT cannot run the vendor's op: the rule is the graph's alone
    assert _norms(result.model) == 0
    assert any(u.check == "requantization" and "'vendor_quant'" in u.reason for u in result.report.unfused)


def test_a_cast_between_integers_rounds_nothing():
    """ArgMax's indices cast to int32 after the norm: no float is rounded on the way, so the norm fuses."""
    nodes = [oh.make_node("ArgMax", ["Y"], ["best"], axis=-1), oh.make_node("Cast", ["best"], ["best32"],
                                                                          to=TensorProto.INT32, name="to_int32")]
    model = _with_tail(nodes, [_out("Y"), _out("best32", TensorProto.INT32)])
    result = lnfuse.fuse(model)
    assert _norms(result.model) == 1, result.report.explain()
