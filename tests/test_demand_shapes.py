"""Shape inference on demand (``lnfuse.index.demand``): ONNX Runtime's symbolic inference runs only where candidates
are, and within a budget. What is asserted is behaviour, read from the report's notes (times are the benchmark's:
``benchmarks/cliff.py``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto, numpy_helper

import lnfuse
from lnfuse.index import demand

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from make_models import build_detector  # noqa: E402 - the benchmark's own generator


def _incomplete_for_onnx(model: onnx.ModelProto) -> bool:
    """Whether onnx's own inference (what lnfuse runs at load) leaves some dim of a computed value unknown."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        dims = info.type.tensor_type.shape.dim
        if not info.type.tensor_type.HasField("shape") or any(
                not d.HasField("dim_value") and (not d.dim_param or d.dim_param.startswith("unk__")) for d in dims):
            return True
    return False


def _shape_notes(report) -> list[str]:
    return [note for note in report.notes if note.startswith("shapes:")]


def test_no_candidates_no_symbolic_inference():
    model = build_detector(12)
    assert _incomplete_for_onnx(model)  # ORT's symbolic inference would have run at load before
    result = lnfuse.fuse(model)
    notes = _shape_notes(result.report)
    assert len(notes) == 1 and "was not run (no normalization candidates" in notes[0]
    assert not result.report.fused
    assert [n.op_type for n in result.model.graph.node] == [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_candidate_behind_many_resizes_fuses_on_onnx_shapes(target):
    """The detector's norm over the channels needs its input's rank and channel count, which onnx's inference
    gives; the height and width it leaves unknown decide nothing, so ORT's symbolic inference is not run."""
    model = build_detector(12, norm=True)
    assert _incomplete_for_onnx(model)
    result = lnfuse.fuse(model, target=target)
    (note,) = _shape_notes(result.report)
    assert "symbolic inference was not run (every candidate was decided on onnx's shapes" in note
    assert [f.op_type for f in result.report.fused] == ["LayerNormalization"]
    assert result.report.fused[0].attributes.get("axis") == 1
    assert not result.report.unfused


def test_refused_candidate_runs_symbolic_inference_and_the_pass_again():
    """A check that refuses on onnx's shapes runs ORT's symbolic inference, and the rule's pass again on its
    shapes; what it still refuses is reported with the reason. Here a norm over the channels whose gamma is laid
    out along the width: the larger form is refused either way, the norm fuses with the affine left outside, and
    the notes say which inference decided it."""
    model = build_detector(12, norm=True)
    gamma = next(i for i in model.graph.initializer if i.name == "head.norm.weight")
    gamma.CopyFrom(numpy_helper.from_array(np.linspace(0.5, 1.5, 8).astype(np.float32).reshape(1, 1, 1, 8),
                                           "head.norm.weight"))
    result = lnfuse.fuse(model, target="onnx")
    notes = _shape_notes(result.report)
    assert any("symbolic inference ran on the whole model (its 12 Resize ops without sympy.simplify), as onnx's "
               "shapes left a candidate undecided (main: layer_norm refused a match)" in n for n in notes), notes
    (fused,) = result.report.fused
    assert fused.op_type == "LayerNormalization" and fused.attributes.get("axis") == 1
    assert any("gamma 'head.norm.weight' has shape [1,1,1,8]" in n for n in fused.notes), fused.notes


@pytest.mark.parametrize("name, fused", [
    ("hf_gpt2_dynamo_op18.onnx", {"EmbedLayerNormalization": 1, "SkipLayerNormalization": 4}),
    ("hf_vitdet_legacy_op17.onnx", {"LayerNormalization": 3, "SkipLayerNormalization": 4}),
])
def test_refusals_decided_on_ranks_do_not_run_symbolic_inference(name: str, fused: dict):
    """The residual rule first tries each residual Add as input + skip + bias, and refuses where the "bias" has
    rank 3 rather than [H]. A rank onnx's inference knows is one ORT's symbolic inference would find too, so the
    refusal is decided, the symbolic inference is not run, and every residual still fuses."""
    path = REPO / "sample_models" / name
    report = lnfuse.fuse(str(path)).report
    (note,) = _shape_notes(report)  # there is a note: onnx's inference left dims unknown
    assert "symbolic inference was not run (every candidate was decided on onnx's shapes" in note
    counts: dict = {}
    for f in report.fused:
        counts[f.op_type] = counts.get(f.op_type, 0) + 1
    assert counts == fused
    assert not report.unfused


def _pending(nodes, inputs, outputs, inits=(), domains=()) -> onnx.ModelProto:
    """A model with a NonZero output: onnx's inference leaves its dim unknown, so the symbolic inference waits."""
    nodes = list(nodes) + [oh.make_node("NonZero", [outputs[0].name], ["nz"])]
    graph = oh.make_graph(nodes, "g", inputs, outputs + [oh.make_tensor_value_info("nz", TensorProto.INT64, None)],
                          list(inits))
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)] + [oh.make_opsetid(d, 1) for d in domains])
    model.ir_version = 8
    return model


def test_a_dim_name_decides_no_refusal():
    """gamma and beta are [hidden], a name a graph input declares; the residual rule refuses them ("needs [64]") on
    onnx's shapes. ORT's symbolic inference finds hidden = 64 (x [.., hidden] is multiplied by a [64, 64] weight),
    so the refusal is not taken as decided: it runs, and the residual fuses."""
    h = 64
    nodes = [oh.make_node("MatMul", ["x", "w"], ["t"]), oh.make_node("Abs", ["g_in"], ["gamma"]),
             oh.make_node("Abs", ["b_in"], ["beta"]), oh.make_node("Add", ["t", "r"], ["s"]),
             oh.make_node("LayerNormalization", ["s", "gamma", "beta"], ["n"], axis=-1, epsilon=1e-5)]
    inputs = [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", "hidden"]),
              oh.make_tensor_value_info("r", TensorProto.FLOAT, ["batch", "seq", h]),
              oh.make_tensor_value_info("g_in", TensorProto.FLOAT, ["hidden"]),
              oh.make_tensor_value_info("b_in", TensorProto.FLOAT, ["hidden"])]
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((h, h)).astype(np.float32), "w")
    model = _pending(nodes, inputs, [oh.make_tensor_value_info("n", TensorProto.FLOAT, None)], [weight])
    report = lnfuse.fuse(model).report
    assert [f.op_type for f in report.fused] == ["SkipLayerNormalization"]
    assert any("symbolic inference ran" in n for n in _shape_notes(report))


def test_a_cast_onnx_cannot_prove_a_no_op_leaves_the_residual_in_doubt():
    """The second residual's sum is Cast to float before its norm; one addend comes from a contrib op onnx cannot
    type, so onnx's shapes cannot prove the Cast a no-op and the residual pattern does not match, without a
    refusal. The pass is in doubt: the symbolic inference types the sum, and both residuals fuse."""
    h = 64
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(h).astype(np.float32), n) for n in ("g1", "b1", "g2", "b2")]
    nodes = [oh.make_node("Add", ["x", "r"], ["s1"]),
             oh.make_node("LayerNormalization", ["s1", "g1", "b1"], ["n1"], axis=-1, epsilon=1e-5),
             oh.make_node("FastGelu", ["n1"], ["f"], domain="com.microsoft"), oh.make_node("Add", ["f", "n1"], ["s2"]),
             oh.make_node("Cast", ["s2"], ["c2"], to=TensorProto.FLOAT),
             oh.make_node("LayerNormalization", ["c2", "g2", "b2"], ["n2"], axis=-1, epsilon=1e-5)]
    inputs = [oh.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "seq", h]) for n in ("x", "r")]
    model = _pending(nodes, inputs, [oh.make_tensor_value_info("n2", TensorProto.FLOAT, ["batch", "seq", h])],
                     inits, domains=["com.microsoft"])
    for only in (None, ["layer_norm", "skip_norm"]):
        report = lnfuse.fuse(model, only=only).report
        assert [f.op_type for f in report.fused] == ["SkipLayerNormalization"] * 2, only
        assert any("symbolic inference ran" in n for n in _shape_notes(report)), only


def test_symbolic_shapes_still_prove_residuals():
    """BERT's residual adds are fused into SkipLayerNormalization when their addends are proved the same shape,
    which takes the symbolic inference's dim names (onnx's alone leaves them unknown)."""
    path = REPO / "sample_models" / "bert_tiny_legacy_op14.onnx"
    assert _incomplete_for_onnx(onnx.load(str(path)))
    report = lnfuse.fuse(str(path)).report
    assert any("symbolic inference ran on the whole model, as onnx's shapes left a candidate undecided" in n
               for n in _shape_notes(report))
    assert sum(f.op_type == "SkipLayerNormalization" for f in report.fused) == 4
    assert sum(f.op_type == "EmbedLayerNormalization" for f in report.fused) == 1
    assert not report.unfused


def test_norms_fused_on_onnx_shapes_are_retyped_for_later_rules():
    """In BERT the norms fuse on onnx's shapes; the embedding rule then refuses on them and ORT's inference runs.
    The fused norms' outputs are typed again from its shapes (``new_values.retype_new_values``): the residual rule,
    after it, proves their addends the same shape with the new names."""
    path = REPO / "sample_models" / "bert_tiny_legacy_op14.onnx"
    result = lnfuse.fuse(str(path))
    skips = [f for f in result.report.fused if f.op_type == "SkipLayerNormalization"]
    assert len(skips) == 4
    fused = {o for n in result.model.graph.node if n.op_type == "SkipLayerNormalization" for o in n.output}
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(result.model.graph.value_info) + list(result.model.graph.output)}
    assert all(not str(d).startswith("unk__") for name in fused & set(shapes) for d in shapes[name])


def _branchy(width: int = 4) -> onnx.ModelProto:
    """A LayerNorm over the last axis of x, and beside it a branch of Resizes the norm does not read: the
    candidates' cone is the norm and what feeds it."""
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", width])
    nodes = [oh.make_node("ReduceMean", ["x"], ["m"], axes=[-1]), oh.make_node("Sub", ["x", "m"], ["c"]),
             oh.make_node("Mul", ["c", "c"], ["s"]), oh.make_node("ReduceMean", ["s"], ["v"], axes=[-1]),
             oh.make_node("Add", ["v", "eps"], ["ve"]), oh.make_node("Sqrt", ["ve"], ["d"]),
             oh.make_node("Div", ["c", "d"], ["y"]), oh.make_node("Mul", ["y", "gamma"], ["norm"])]
    previous = "x"
    for i in range(3):
        nodes.append(oh.make_node("Resize", [previous, "", "scales"], [f"r{i}"], mode="nearest"))
        previous = f"r{i}"
    inits = [numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
             numpy_helper.from_array(np.linspace(0.5, 1.5, width).astype(np.float32), "gamma"),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    graph = oh.make_graph(nodes, "branchy", [x], [oh.make_tensor_value_info("norm", TensorProto.FLOAT, None),
                                                  oh.make_tensor_value_info(previous, TensorProto.FLOAT, None)], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def test_cone_holds_the_candidates_and_what_feeds_them():
    model = _branchy()
    cone = demand._cone(model.graph, {"c", "y"})
    # the nodes that write or read a seed, and every node they are computed from; not the Resize branch
    assert [model.graph.node[i].output[0] for i in cone] == ["m", "c", "s", "v", "ve", "d", "y", "norm"]
    sub, names = demand._sub_skeleton(model, cone)
    assert names == {"m", "c", "s", "v", "ve", "d", "y", "norm"}
    assert [o.name for o in sub.graph.output] == ["norm"]
    result = lnfuse.fuse(model, target="onnx")
    assert [f.op_type for f in result.report.fused] == ["LayerNormalization"]


def test_budget_stops_pure_python_work_and_leaves_nothing_pending():
    def endless(check) -> None:
        deadline = time.perf_counter() + 60  # the budget must stop it long before
        while time.perf_counter() < deadline:
            sum(range(1000))
        raise AssertionError("the budget did not stop the work")

    assert demand._within(0.05, endless) is None
    # nothing is left to be raised later in this thread, and work within its budget returns its result
    for _ in range(5):
        sum(range(100_000))
    assert demand._within(5.0, lambda check: "done") == "done"


def test_budget_check_between_nodes_raises_once_spent():
    def spend(check) -> str:
        start = time.thread_time()
        while time.thread_time() - start < 0.1:
            pass
        check()
        return "not stopped"

    assert demand._within(0.02, spend) is None


@pytest.mark.parametrize("resizes", [12])
def test_no_candidate_report_names_the_graph_size(resizes):
    model = build_detector(resizes)
    (note,) = _shape_notes(lnfuse.fuse(model).report)
    assert f"in {len(model.graph.node)} nodes" in note


def test_budget_under_a_profiler_returns():
    """The budget's exception, once sent, is raised and caught in the inferring thread: cleared instead with
    ``SetAsyncExc(NULL)``, CPython 3.11 left its eval breaker set, and under a profiler (cProfile, coverage) the
    next function entry spun forever. Run in a child so that a hang fails the test instead of the suite."""
    import subprocess

    script = (
        "import cProfile, time\n"
        "from lnfuse.index import demand\n"
        "def work(check):\n"
        "    end = time.perf_counter() + 30\n"
        "    while time.perf_counter() < end:\n"
        "        for _ in range(300): check()\n"
        "        sum(range(1000))\n"
        "profile = cProfile.Profile(); profile.enable()\n"
        "results = [demand._within(0.03 + 0.01 * (i % 5), work) for i in range(10)]\n"
        "results.append(demand._within(5.0, lambda check: 'done'))\n"
        "profile.disable()\n"
        "print(results)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == repr([None] * 10 + ["done"])
