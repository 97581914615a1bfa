"""Residual + norm becomes SkipLayerNormalization / SkipSimplifiedLayerNormalization where the kernel computes
exactly the same, with the residual sum exposed when something else reads it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

import lnfuse
from normgraphs import feeds_for, op_types, run

H = 8


def _model(adds: list[tuple[str, str, str]], norm: str = "LayerNormalization", shapes: dict | None = None,
           extra_outputs: tuple[str, ...] = (), extra_nodes: tuple = (), dtype=np.float32, opset: int = 17,
           norm_attrs: dict | None = None, rank: int = 3) -> onnx.ModelProto:
    """Graph inputs ``a``/``b`` (plus any in ``shapes``), the given Adds, then ``norm`` of the last sum."""
    rng = np.random.default_rng(0)
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    full = [2, 3, H][-rank:] if rank <= 3 else [2, 2, 3, H]
    shapes = {"a": full, "b": full, **(shapes or {})}
    inputs = [oh.make_tensor_value_info(n, elem, s) for n, s in shapes.items()]
    inits = [onh.from_array(rng.uniform(0.5, 1.5, H).astype(dtype), "gamma"),
             onh.from_array(rng.normal(size=H).astype(dtype), "beta"),
             onh.from_array(rng.normal(size=H).astype(dtype), "bias")]
    nodes = [oh.make_node("Add", [x, y], [out]) for x, y, out in adds]
    last = adds[-1][2]
    norm_inputs = [last, "gamma"] + (["beta"] if norm == "LayerNormalization" else [])
    nodes.append(oh.make_node(norm, norm_inputs, ["Y"], **({"epsilon": 1e-6} if norm_attrs is None else norm_attrs)))
    nodes.extend(extra_nodes)
    outputs = [oh.make_tensor_value_info("Y", elem, full)]
    outputs += [oh.make_tensor_value_info(o, elem, full) for o in extra_outputs]
    model = oh.make_model(oh.make_graph(nodes, "skip", inputs, outputs, inits),
                          opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _fused(model: onnx.ModelProto, expect: str) -> onnx.NodeProto:
    result = lnfuse.fuse(model)
    nodes = [n for n in result.model.graph.node if n.op_type == expect]
    assert len(nodes) == 1, (op_types(result.model), result.report.unfused)
    assert nodes[0].domain == "com.microsoft"
    assert any(o.domain == "com.microsoft" and o.version == 1 for o in result.model.opset_import)
    feeds = feeds_for(model)
    for want, got in zip(run(model, feeds), run(result.model, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)
    return nodes[0]


def _eps(node: onnx.NodeProto) -> float:
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon")


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_post_norm(order):
    node = _fused(_model([(*order, "s")]), "SkipLayerNormalization")
    assert list(node.input[:4]) == [*order, "gamma", "beta"]
    assert _eps(node) == pytest.approx(1e-6)
    assert len(node.output) == 1


def test_epsilon_is_written_even_when_the_norm_used_its_default():
    node = _fused(_model([("a", "b", "s")], norm_attrs={}), "SkipLayerNormalization")
    assert _eps(node) == pytest.approx(1e-5), "LayerNormalization's default, not the contrib op's 1e-12"


def test_a_negative_epsilon_stays_in_the_norm_it_was_written_in():
    """ONNX's LayerNormalization accepts any epsilon; ONNX Runtime's SkipLayerNormalization refuses to load one
    below 0, so such a residual is left as it is, with the reason."""
    model = _model([("a", "b", "s")], norm_attrs={"epsilon": -1e-5})
    result = lnfuse.fuse(model)
    assert "SkipLayerNormalization" not in op_types(result.model)
    assert any(u.check == "epsilon" and "-1e-05" in u.reason for u in result.report.kept), result.report.kept


def test_bias_before_the_residual():
    node = _fused(_model([("a", "bias", "ab"), ("ab", "b", "s")]), "SkipLayerNormalization")
    assert node.input[4] == "bias"


def test_bias_after_the_residual():
    node = _fused(_model([("a", "b", "ab"), ("ab", "bias", "s")]), "SkipLayerNormalization")
    assert node.input[4] == "bias"


def test_pre_norm_sum_read_later_comes_from_output_3():
    later = oh.make_node("Add", ["s", "Y"], ["next"])
    model = _model([("a", "b", "s")], extra_nodes=(later,), extra_outputs=("next",))
    node = _fused(model, "SkipLayerNormalization")
    assert len(node.output) == 4 and node.output[1] == node.output[2] == ""
    fused = lnfuse.fuse(model).model
    reader = next(n for n in fused.graph.node if n.op_type == "Add")
    assert node.output[3] in reader.input


def test_sum_that_is_a_graph_output_keeps_its_name():
    node = _fused(_model([("a", "b", "s")], extra_outputs=("s",)), "SkipLayerNormalization")
    assert node.output[3] == "s"


@pytest.mark.parametrize("skip_shape", [[1, 3, H], [3, H]])
def test_broadcast_skip_the_kernel_accepts(skip_shape):
    node = _fused(_model([("a", "b", "s")], shapes={"b": skip_shape}), "SkipLayerNormalization")
    assert list(node.input[:2]) == ["a", "b"]


def test_skip_op_on_2d_input():
    _fused(_model([("a", "b", "s")], rank=2), "SkipLayerNormalization")


@pytest.mark.parametrize("case, check", [
    (dict(shapes={"b": [2, 1, H]}), "shape"),
    (dict(rank=4, shapes={"b": [2, 1, 1, H]}), "shape"),
    (dict(dtype=np.float64), "dtype"),
    (dict(norm_attrs={"axis": -2, "epsilon": 1e-5}), "axes"),
])
def test_refused_where_the_kernel_differs(case, check):
    model = _model([("a", "b", "s")], **case)
    result = lnfuse.fuse(model)
    assert not any(op.startswith("Skip") for op in op_types(result.model))
    assert any(u.rule == "skip_norm" and u.check == check for u in result.report.kept), result.report.kept


@pytest.mark.parametrize("norm, opset", [("SimplifiedLayerNormalization", 17), ("RMSNormalization", 23)])
def test_rms_norms_become_skip_simplified(norm, opset):
    node = _fused(_model([("a", "bias", "ab"), ("ab", "b", "s")], norm=norm, opset=opset),
                  "SkipSimplifiedLayerNormalization")
    assert list(node.input) == ["a", "b", "gamma", "bias"]


def test_inner_sum_read_elsewhere_keeps_the_bias_add_outside():
    other = oh.make_node("Relu", ["ab"], ["r"])
    model = _model([("a", "bias", "ab"), ("ab", "b", "s")], extra_nodes=(other,), extra_outputs=("r",))
    node = _fused(model, "SkipLayerNormalization")
    assert "ab" in node.input[:2] and len(node.input) == 4


def test_target_onnx_keeps_add_and_layer_norm():
    result = lnfuse.fuse(_model([("a", "b", "s")]), target="onnx")
    assert op_types(result.model) == ["Add", "LayerNormalization"]
    onnx.checker.check_model(result.model, full_check=True)


def test_residual_that_may_broadcast_at_run_time_stays_an_add():
    # r = table[:L] is valid for L = S and for L = 1 (broadcast); the kernel accepts only the first. ORT's
    # symbolic shape inference would assume L = S because the Add broadcasts them.
    from onnx import TensorProto
    rng = np.random.default_rng(0)
    nodes = [oh.make_node("Slice", ["table", "zero", "L", "zero"], ["r"]),
             oh.make_node("Add", ["x", "r"], ["s"]),
             oh.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], epsilon=1e-5)]
    inits = [onh.from_array(rng.standard_normal((16, 8)).astype(np.float32), "table"),
             onh.from_array(np.array([0], np.int64), "zero"),
             onh.from_array(np.linspace(0.5, 2, 8).astype(np.float32), "gamma"),
             onh.from_array(np.linspace(-1, 1, 8).astype(np.float32), "beta")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 8]),
                                       oh.make_tensor_value_info("L", TensorProto.INT64, [1])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", 8])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    for verify in (True, False):
        fused = lnfuse.fuse(model, verify=verify).model
        assert "SkipLayerNormalization" not in op_types(fused)
        for length in (5, 1):
            feeds = {"x": rng.standard_normal((2, 5, 8)).astype(np.float32), "L": np.array([length], np.int64)}
            np.testing.assert_allclose(run(fused, feeds)[0], run(model, feeds)[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("target,fused", [([6, H], True), ([2, 3 * H], False)])
def test_norm_of_a_reshaped_sum(target, fused):
    # OPT: the sum is flattened to [B*S, H] before the norm, and the flattened sum is the next residual. A norm of
    # the last axis commutes with a Reshape that keeps it; one that changes the last axis does not.
    from onnx import TensorProto
    rng = np.random.default_rng(0)
    width = target[-1]
    nodes = [oh.make_node("Add", ["a", "b"], ["s"]), oh.make_node("Reshape", ["s", "target"], ["flat"]),
             oh.make_node("LayerNormalization", ["flat", "gamma", "beta"], ["Y"], epsilon=1e-5),
             oh.make_node("Add", ["flat", "Y"], ["next"])]
    inits = [onh.from_array(np.array(target, np.int64), "target"),
             onh.from_array(rng.uniform(0.5, 1.5, width).astype(np.float32), "gamma"),
             onh.from_array(rng.normal(size=width).astype(np.float32), "beta")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, H]) for n in "ab"],
                          [oh.make_tensor_value_info("next", TensorProto.FLOAT, target)], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 10
    if not fused:
        assert "SkipLayerNormalization" not in op_types(lnfuse.fuse(model).model)
        return
    node = _fused(model, "SkipLayerNormalization")
    assert list(node.input[:2]) in (["a", "b"], ["b", "a"]), "the kernel runs on the sum before the Reshape"
    assert len(node.output) == 4 and node.output[3], "the flattened sum is read again: output 3, reshaped"


# ---- rank 4: [B, H, W, C] (Swin, ViTDet, SAM) is seen as [B, H·W, C] by the kernel, then reshaped back -----------

def _rank4_model(x_shape: list, skip_shape: list, *, read_sum: bool = False, read_stats: bool = False,
                 elem=None) -> onnx.ModelProto:
    from onnx import TensorProto
    rng = np.random.default_rng(4)
    elem = elem or TensorProto.FLOAT
    nodes = [oh.make_node("Add", ["x", "r"], ["s"]),
             oh.make_node("LayerNormalization", ["s", "gamma", "beta"], ["Y"] + (["mean"] if read_stats else []),
                          epsilon=1e-6)]
    outputs = [oh.make_tensor_value_info("Y", elem, x_shape)]
    if read_sum:  # pre-norm: the sum is the next residual
        nodes.append(oh.make_node("Add", ["s", "Y"], ["next"]))
        outputs = [oh.make_tensor_value_info("next", elem, x_shape)]
    if read_stats:
        outputs.append(oh.make_tensor_value_info("mean", TensorProto.FLOAT, x_shape[:3] + [1]))
    inits = [onh.from_array(rng.uniform(0.5, 1.5, H).astype(np.float32), "gamma"),
             onh.from_array(rng.normal(size=H).astype(np.float32), "beta")]
    graph = oh.make_graph(nodes, "rank4", [oh.make_tensor_value_info("x", elem, x_shape),
                                           oh.make_tensor_value_info("r", elem, skip_shape)], outputs, inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _feeds(batch: int, x_hw: tuple[int, int], skip_shape: list) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    skip = [batch if d == "B" else x_hw[0] if d == "h" else x_hw[1] if d == "w" else d for d in skip_shape]
    return {"x": (rng.standard_normal((batch, *x_hw, H)) * 3 + 1).astype(np.float32),
            "r": rng.standard_normal(skip).astype(np.float32)}


@pytest.mark.parametrize("x_shape, skip_shape", [
    ([2, 2, 3, H], [2, 2, 3, H]),            # static
    (["B", 2, 3, H], ["B", 2, 3, H]),        # symbolic batch: H·W stated, B copied (0 in the target)
    (["B", "h", "w", H], ["B", "h", "w", H]),  # symbolic spatial dims: H·W computed from x's shape
    (["B", 2, 3, H], [1, 2, 3, H]),          # ViTDet's position embedding
    (["B", 2, 3, H], [2, 3, H]),
])
def test_rank4_residual_norm_runs_on_the_sum_seen_as_rank_3(x_shape, skip_shape):
    model = _rank4_model(x_shape, skip_shape)
    result = lnfuse.fuse(model)
    ops = op_types(result.model)
    assert ops.count("SkipLayerNormalization") == 1, (ops, result.report.unfused)
    assert "Add" not in ops and "LayerNormalization" not in ops
    skip = next(n for n in result.model.graph.node if n.op_type == "SkipLayerNormalization")
    shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
              for v in onnx.shape_inference.infer_shapes(result.model).graph.value_info}
    assert len(shapes.get(skip.input[0], [])) in (0, 3), "the kernel's input is rank 3"
    onnx.checker.check_model(result.model, full_check=True)
    # batches other than the declared one, the empty batch included where the batch is symbolic
    batches = [2] if x_shape[0] == 2 else [1, 4, 0]
    for batch in batches:
        feeds = _feeds(batch, (2, 3) if x_shape[1] != "h" else (3, 5), skip_shape)
        want, got = run(model, feeds)[0], run(result.model, feeds)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_rank4_pre_norm_sum_read_later_is_output_3_reshaped_back():
    model = _rank4_model(["B", 2, 3, H], ["B", 2, 3, H], read_sum=True)
    result = lnfuse.fuse(model)
    skip = next(n for n in result.model.graph.node if n.op_type == "SkipLayerNormalization")
    assert len(skip.output) == 4 and skip.output[3], "the sum is read again"
    readers = [n.op_type for n in result.model.graph.node if skip.output[3] in n.input]
    assert readers == ["Reshape"], "the sum comes back in the [B, H, W, C] shape"
    feeds = _feeds(3, (2, 3), ["B", 2, 3, H])
    np.testing.assert_allclose(run(result.model, feeds)[0], run(model, feeds)[0], atol=1e-5, rtol=1e-4)


def test_rank4_norm_whose_statistics_are_read_stays():
    result = lnfuse.fuse(_rank4_model([2, 2, 3, H], [2, 2, 3, H], read_stats=True))
    assert "SkipLayerNormalization" not in op_types(result.model)
    assert any(u.rule == "skip_norm" and u.check == "outputs" for u in result.report.kept)


@pytest.mark.parametrize("name", ["hf_vitdet_legacy_op17.onnx", "hf_vitdet_dynamo_op18.onnx"])
def test_vitdet_rank4_residual_norms_become_skip_ops(name):
    """transformers' ViTDet keeps its activations as [B, H, W, C]: the patch + position sum and both residual
    sums of each layer feed a LayerNorm (sample_models/make_exporter_samples.py)."""
    from pathlib import Path
    from lnfuse.verification.whole_model import compare_models
    path = Path(__file__).resolve().parent.parent / "sample_models" / name
    original = onnx.load(path)
    assert sum(n.op_type == "LayerNormalization" for n in original.graph.node) == 4
    result = lnfuse.fuse(path)
    ops = op_types(result.model)
    # the 3 channels-first VitDetLayerNorms fuse as Transpose -> LayerNormalization -> Transpose (issue 12 algebra)
    assert ops.count("SkipLayerNormalization") == 4 and ops.count("LayerNormalization") == 3
    assert not [u for u in result.report.kept if u.rule == "skip_norm"]
    onnx.checker.check_model(result.model, full_check=True)
    for batch in (1, 3):
        feeds = {"pixel_values": np.random.default_rng(batch).standard_normal((batch, 3, 32, 32), np.float32)}
        check = compare_models(original, result.model, feeds)
        assert check["ok"], check
