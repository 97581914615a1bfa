"""Red team, round 8: quantizers the graph walk (``lnfuse.index.quantizers``) did not see.

Each model below quantizes what the norm computes, and ONNX Runtime runs it (or, for the GPU-only contrib op, would
run it on the provider it is written for); lnfuse under its default options must leave the norm as it is.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto

import lnfuse
from normgraphs import feeds_for, session
from test_requantization_graph import _const, _norm, _out, _tail, _typed


def _cast_picked_by_caller() -> onnx.ModelProto:
    """A function's Cast whose ``to`` is the caller's attribute; the call picks int8."""
    cast = oh.make_node("Cast", ["a"], ["b"], name="picked_cast")
    cast.attribute.append(oh.make_attribute_ref("to", onnx.AttributeProto.INT))
    function = oh.make_function("local", "CastTo", ["a"], ["b"], [cast], [oh.make_opsetid("", 17)], attributes=["to"])
    call = oh.make_node("CastTo", ["Y"], ["yi"], domain="local", to=TensorProto.INT8, name="call")
    return _typed(_tail([call], [_out("yi", TensorProto.INT8)], functions=[function], opsets=[("local", 1)]))


def _cast_like_in_untyped_body() -> onnx.ModelProto:
    """A CastLike to an int8 constant inside an attribute-parametric function (lnfuse leaves such bodies untyped)."""
    body = [oh.make_node("Constant", [], ["like"], value=oh.make_tensor("like", TensorProto.INT8, [], [0])),
            oh.make_node("CastLike", ["a", "like"], ["b"], name="body_cast_like")]
    function = oh.make_function("local", "Round8", ["a"], ["b"], body, [oh.make_opsetid("", 17)],
                                attributes=["unused"])
    call = oh.make_node("Round8", ["Y"], ["yi"], domain="local", unused=1, name="call")
    return _typed(_tail([call], [_out("yi", TensorProto.INT8)], functions=[function], opsets=[("local", 1)]))


def _cast_like_after_contrib_op() -> onnx.ModelProto:
    """norm -> com.microsoft::Gelu (onnx's inference cannot type it) -> CastLike(int8): the CastLike reads a value of
    unknown type, so the quantizer test (reads a float, writes int8) failed on the first half."""
    nodes = [oh.make_node("Gelu", ["Y"], ["g"], domain="com.microsoft"),
             oh.make_node("CastLike", ["g", "like"], ["yi"], name="cast_like")]
    model = _tail(nodes, [oh.make_tensor_value_info("yi", TensorProto.INT8, [3, 2, 8])],
                  [_const("like", np.int8(0))], opsets=[("com.microsoft", 1)])
    session(model)
    return model


def _qlinear_in_untyped_body() -> onnx.ModelProto:
    """The norm's peak is the activation scale of a QLinearMatMul inside an attribute-parametric function: the
    QLinear op's output type is unknown there, and so is its scale's."""
    body = [oh.make_node("QLinearMatMul", ["aq", "scale", "zp", "bq", "scale_b", "zp", "scale_b", "zp"], ["b"],
                         name="body_qlinear")]
    function = oh.make_function("local", "QMM", ["aq", "scale", "zp", "bq", "scale_b"], ["b"], body,
                                [oh.make_opsetid("", 17)], attributes=["unused"])
    nodes = [oh.make_node("ReduceMax", ["Y"], ["peak"], keepdims=0, name="peak"),
             oh.make_node("QMM", ["aq", "peak", "zp", "bq", "sb"], ["yq"], domain="local", unused=1, name="call")]
    inits = [_const("aq", np.ones((2, 2), np.int8)), _const("zp", np.int8(0)), _const("bq", np.ones((2, 2), np.int8)),
             _const("sb", np.float32(0.1))]
    return _typed(_tail(nodes, [oh.make_tensor_value_info("yq", TensorProto.INT8, [2, 2]), _out("Y")], inits,
                        functions=[function], opsets=[("local", 1)]))


def _accuracy_level_picked_by_caller() -> onnx.ModelProto:
    """A function's MatMulNBits whose accuracy_level is the caller's attribute; the call picks 4 (int8 blocks)."""
    rng = np.random.default_rng(0)
    matmul = oh.make_node("MatMulNBits", ["a", "packed", "scales"], ["b"], domain="com.microsoft", K=8, N=4, bits=4,
                          block_size=16, name="body_nbits")
    matmul.attribute.append(oh.make_attribute_ref("accuracy_level", onnx.AttributeProto.INT, "level"))
    body = [oh.make_node("Constant", [], ["packed"], value=onnx.numpy_helper.from_array(
                rng.integers(0, 256, (4, 1, 8), dtype=np.uint8), "packed")),
            oh.make_node("Constant", [], ["scales"], value=onnx.numpy_helper.from_array(
                np.full(4, 0.1, np.float32), "scales")), matmul]
    function = oh.make_function("local", "Project", ["a"], ["b"], body,
                                [oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)], attributes=["level"])
    call = oh.make_node("Project", ["Y"], ["mm"], domain="local", level=4, name="call")
    model = _tail([call], [oh.make_tensor_value_info("mm", TensorProto.FLOAT, [3, 2, 4])], functions=[function],
                  opsets=[("local", 1), ("com.microsoft", 1)])
    session(model)
    return model


def _qlora_int8_accuracy() -> onnx.ModelProto:
    """MatMulNBitsQLoRA at accuracy_level 4 quantizes its activation to int8 blocks like MatMulNBits (its schema:
    "Accuracy policy following MatMulNBits ... 4 (int8)"); ONNX Runtime registers it for GPU providers only."""
    rng = np.random.default_rng(0)
    model = _norm()
    model.graph.node.append(oh.make_node(
        "MatMulNBitsQLoRA", ["Y", "w", "ws", "la", "las", "lb", "lbs"], ["mm"], domain="com.microsoft", K=8, N=4,
        bits=4, block_size=16, lora_bits=4, lora_block_size=16, accuracy_level=4, name="qlora"))
    model.graph.initializer.extend([
        _const("w", rng.integers(0, 256, (4, 1, 8), dtype=np.uint8)), _const("ws", np.full((4, 1), .1, np.float32)),
        _const("la", rng.integers(0, 256, (2, 1, 8), dtype=np.uint8)), _const("las", np.full((2, 1), .1, np.float32)),
        _const("lb", rng.integers(0, 256, (4, 1, 8), dtype=np.uint8)), _const("lbs", np.full((4, 1), .1, np.float32))])
    del model.graph.output[:]
    model.graph.output.append(oh.make_tensor_value_info("mm", TensorProto.FLOAT, [3, 2, 4]))
    model.opset_import.append(oh.make_opsetid("com.microsoft", 1))
    return model


HIDDEN = {"cast_picked_by_caller": _cast_picked_by_caller, "cast_like_in_untyped_body": _cast_like_in_untyped_body,
          "cast_like_after_contrib_op": _cast_like_after_contrib_op, "qlinear_in_untyped_body": _qlinear_in_untyped_body,
          "accuracy_level_picked_by_caller": _accuracy_level_picked_by_caller,
          "qlora_int8_accuracy": _qlora_int8_accuracy}


@pytest.mark.parametrize("case", sorted(HIDDEN))
def test_a_quantizer_the_walk_cannot_type_still_keeps_the_norm(case):
    model = HIDDEN[case]()
    result = lnfuse.fuse(model)
    assert Counter(n.op_type for n in result.model.graph.node)["LayerNormalization"] == 0, \
        "the quantized model would change"
    (left,) = result.report.unfused
    assert left.check == "requantization", left
    if case != "qlora_int8_accuracy":  # ORT runs the rest on CPU: the model is left computing what it did
        feeds = feeds_for(model)
        for before, after in zip(session(model).run(None, feeds), session(result.model).run(None, feeds)):
            np.testing.assert_array_equal(before, after)


def test_a_declaration_of_no_value_does_not_type_the_value_lnfuse_names_alike(tmp_path):
    """value_info a tool left behind for a value it removed (no node writes it) is loaded by ONNX Runtime, which
    ignores it. lnfuse wrote the input's declarations back by name, so the fused op's new output, named as the
    declaration happens to be, was declared int64 [7]: ONNX Runtime refused the output."""
    from test_mixed_precision import _converter_norm, _run
    model = _converter_norm(TensorProto.FLOAT16, TensorProto.FLOAT)
    mean = [n for n in model.graph.node if n.op_type == "Cast"][1].output[0]  # read outside: the norm is an RMS
    model.graph.node.append(oh.make_node("Neg", [mean], ["neg_mean"]))
    model.graph.output.append(oh.make_tensor_value_info("neg_mean", TensorProto.FLOAT16, ["B", 4, 1]))
    model = onnx.shape_inference.infer_shapes(model)
    fused_name = [o for n in lnfuse.fuse(model).model.graph.node for o in n.output if o.endswith("_out0")][0]
    model.graph.value_info.append(oh.make_tensor_value_info(fused_name, TensorProto.INT64, [7]))
    feeds = {"x": np.random.default_rng(0).normal(0, 1, (1, 4, 8)).astype(np.float16)}
    _run(model, feeds)  # ORT loads the input
    onnx.save(model, tmp_path / "in.onnx")
    lnfuse.fuse(tmp_path / "in.onnx").save(tmp_path / "out.onnx")
    _run(onnx.load(tmp_path / "out.onnx"), feeds)


def _gpu_only(node: onnx.NodeProto, shape: list[int], inits=()) -> onnx.ModelProto:
    """The norm read by one contrib op ONNX Runtime registers for GPU providers only (lnfuse verifies the norm's
    region on the CPU: the rest of the model need not run there)."""
    model = _norm()
    model.graph.node.append(node)
    model.graph.initializer.extend(inits)
    del model.graph.output[:]
    model.graph.output.append(oh.make_tensor_value_info(node.output[0], TensorProto.FLOAT, shape))
    model.opset_import.append(oh.make_opsetid("com.microsoft", 1))
    return model


def _attention_on_a_quantized_cache() -> onnx.ModelProto:
    """GroupQueryAttention with k_quant_type/v_quant_type: it quantizes the new keys and values into its int8 cache
    and attends over the cache, so its float output moves with the quantized keys."""
    node = oh.make_node("GroupQueryAttention", ["Y", "Y", "Y", "past_k", "past_v", "seqlens", "total"],
                        ["attended", "present_k", "present_v"], domain="com.microsoft", num_heads=2, kv_num_heads=2,
                        k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=8, name="gqa")
    inits = [_const("past_k", np.zeros((3, 2, 0, 4), np.int8)), _const("past_v", np.zeros((3, 2, 0, 4), np.int8)),
             _const("seqlens", np.full(3, 1, np.int32)), _const("total", np.int32(2))]
    return _gpu_only(node, [3, 2, 8], inits)


def _fp8_activation_matmul() -> onnx.ModelProto:
    """MatMulBlockQuantizedFp8Weight given a_scale rounds its activation to float8 e4m3 (W8A8, its schema)."""
    node = oh.make_node("MatMulBlockQuantizedFp8Weight", ["Y", "w8", "w_scale", "a_scale"], ["mm"],
                        domain="com.microsoft", block_size=8, name="fp8_mm")
    inits = [onnx.numpy_helper.from_array(np.zeros((4, 8), np.uint8), "w8"), _const("w_scale", np.ones((4, 1), np.float32)),
             _const("a_scale", np.float32(0.1))]
    model = _gpu_only(node, [3, 2, 4], inits)
    model.graph.initializer[-3].data_type = TensorProto.FLOAT8E4M3FN
    return model


@pytest.mark.parametrize("make", [_attention_on_a_quantized_cache, _fp8_activation_matmul])
def test_a_contrib_op_that_quantizes_when_asked_keeps_the_norm(make):
    result = lnfuse.fuse(make())
    assert Counter(n.op_type for n in result.model.graph.node)["LayerNormalization"] == 0, \
        "the quantized model would change"
    (left,) = result.report.unfused
    assert left.check == "requantization", left
