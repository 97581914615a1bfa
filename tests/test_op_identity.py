"""Op identity: a node is ONNX's op only in ONNX's domain (``lnfuse/index/ops.py``), whatever a model names it.

A red team found steps outside a verified region that trusted the name alone: the removal of identity
QuantizeLinear/DequantizeLinear pairs (and the moves between them) in ``canonical.py``, and, with ``--no-verify``,
the embedding rule's proof that position ids are 0..S-1. A model-local function called ``QuantizeLinear`` or
``Identity`` in a domain of its own computes what it says, not what ONNX's op does. The tests run the CLI on such
models and require the written model to compute what the input computes in ONNX Runtime; one test holds ONNX
Runtime to what the predicate assumes about functions named like ops in its own domains; one holds the code to
asking the predicate.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx import TensorProto

from lnfuse.cli import main
from normgraphs import EmbedBlock, session

ROOT = Path(__file__).resolve().parents[1]
H = 8


def _function(domain: str, name: str, inputs: list[str], body: list[onnx.NodeProto], attributes=()) -> onnx.FunctionProto:
    return oh.make_function(domain, name, inputs, ["y"], body, [oh.make_opsetid("", 17)], attributes=list(attributes))


def _plus(values, dtype=np.float32) -> onnx.NodeProto:
    return oh.make_node("Constant", [], ["k"], value=onh.from_array(np.asarray(values, dtype)))


def _model(nodes, inputs, outputs, inits, functions, domain: str, opset: int = 17) -> onnx.ModelProto:
    imports = [oh.make_opsetid("", opset)] + ([oh.make_opsetid(domain, 1)] if domain else [])
    model = oh.make_model(oh.make_graph(nodes, "opid", inputs, outputs, inits), opset_imports=imports,
                          functions=functions)
    model.ir_version = 9
    return model


def _fuse(model: onnx.ModelProto, tmp_path: Path, capsys, *args: str) -> tuple[int, str, onnx.ModelProto | None]:
    path, out = tmp_path / "model.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    code = main([str(path), "-o", str(out), *args])
    err = capsys.readouterr().err
    return code, err, onnx.load(out) if code == 0 else None


def _same(original: onnx.ModelProto, fused: onnx.ModelProto, feeds_list) -> None:
    want, got = session(original), session(fused)
    for feeds in feeds_list:
        for a, b in zip(want.run(None, feeds), got.run(None, feeds)):
            np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-3)


# ---- what ONNX Runtime runs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("domain,name,opset,runs_function", [
    ("", "Identity", 17, False), ("ai.onnx", "Identity", 17, False), ("", "Relu", 13, False),
    ("com.microsoft", "Gelu", 17, False),   # a contrib op ORT registers: its kernel runs, not the function
    ("com.microsoft", "NotAnOrtOp", 17, True),  # nothing registered: the function runs
    ("com.microsoft", "Unsqueeze", 17, True),  # ONNX's name, but ORT registers no such contrib op: the function runs
    ("evil", "Identity", 17, True)])
def test_onnx_runtime_runs_the_registered_op_not_a_function_of_its_name(domain, name, opset, runs_function):
    # what ops.py rests on: a model-local function never stands in for an op ORT registers in that domain, so a
    # node of ONNX's domain (which the checker requires to be a registered op) is ONNX's op. Renaming the
    # function's call sites into a private domain would make them run the function: a change of meaning.
    fn = _function(domain, name, ["x"], [_plus(1.0), oh.make_node("Add", ["x", "k"], ["y"])])
    model = _model([oh.make_node(name, ["x"], ["y"], domain=domain)],
                   [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                   [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2])], [], [fn], domain, opset)
    y = session(model).run(None, {"x": np.zeros(2, np.float32)})[0]
    assert (y == 1).all() if runs_function else (y != 1).all()


# ---- identity requantization pairs ----------------------------------------------------------------------------------

def _functions_named(domain: str, which: str) -> list[onnx.FunctionProto]:
    """A function named like ONNX's ``which`` that computes something else (a different shift per column, which a
    LayerNorm does not undo)."""
    shift = np.array([0, 9, 0, 3, 0, 0, 5, 0])
    if which == "Identity":
        return [_function(domain, which, ["x"], [_plus(shift * 0.1), oh.make_node("Add", ["x", "k"], ["y"])])]
    if which == "QuantizeLinear":
        body = [oh.make_node("Div", ["x", "s"], ["d"]), _plus(shift), oh.make_node("Add", ["d", "k"], ["a"]),
                oh.make_node("Cast", ["a"], ["y"], to=TensorProto.INT8)]
        return [_function(domain, which, ["x", "s", "z"], body)]
    body = [oh.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT), oh.make_node("Mul", ["f", "s"], ["m"]),
            _plus(shift), oh.make_node("Add", ["m", "k"], ["y"])]
    return [_function(domain, which, ["x", "s", "z"], body)]


def _requantized_lookup(domain: str, which: str) -> onnx.ModelProto:
    """DequantizeLinear(table) -> Gather -> Identity -> QuantizeLinear -> DequantizeLinear -> LayerNorm (written
    out): an identity pair after the lookup, as ORT's QDQ quantizer writes them, with ``which`` of its nodes
    being a model-local function of that name in ``domain``."""
    def op(name: str, inputs: list[str], out: str) -> onnx.NodeProto:
        return oh.make_node(name, inputs, [out], name=out, domain=domain if name == which else "")
    f32 = lambda name, value: onh.from_array(np.asarray(value, np.float32), name)  # noqa: E731
    inits = [f32("s", 0.5), onh.from_array(np.array(0, np.int8), "z"),
             onh.from_array(np.arange(-40, 40, dtype=np.int8).reshape(10, H), "table"),
             f32("two", 2.0), f32("eps", 1e-5), f32("g", np.linspace(0.5, 1.5, H)), f32("b", np.linspace(-1, 1, H))]
    nodes = [op("DequantizeLinear", ["table", "s", "z"], "tf"), op("Gather", ["tf", "ids"], "e"),
             op("Identity", ["e"], "e2"), op("QuantizeLinear", ["e2", "s", "z"], "q"),
             oh.make_node(which if which == "DequantizeLinear" else "DequantizeLinear", ["q", "s", "z"], ["x"],
                          name="x", domain=domain if which == "DequantizeLinear" else ""),
             op("ReduceMean", ["x"], "m"), op("Sub", ["x", "m"], "d"), op("Pow", ["d", "two"], "sq"),
             op("ReduceMean", ["sq"], "var"), op("Add", ["var", "eps"], "ve"), op("Sqrt", ["ve"], "std"),
             op("Div", ["d", "std"], "n"), op("Mul", ["n", "g"], "ng"), op("Add", ["ng", "b"], "y")]
    for node in nodes:
        if node.op_type == "ReduceMean":
            node.attribute.append(oh.make_attribute("axes", [-1]))
    return _model(nodes, [oh.make_tensor_value_info("ids", TensorProto.INT64, ["B", 3])],
                  [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 3, H])], inits,
                  _functions_named(domain, which), domain)


@pytest.mark.parametrize("verify", [(), ("--no-verify",)], ids=["verified", "no-verify"])
@pytest.mark.parametrize("which", ["Identity", "QuantizeLinear", "DequantizeLinear"])
@pytest.mark.parametrize("domain", ["evil", ""], ids=["own-domain", "onnx-domain"])
def test_a_function_named_like_a_requantization_step_is_not_that_step(tmp_path, capsys, domain, which, verify):
    model = _requantized_lookup(domain, which)
    code, err, fused = _fuse(model, tmp_path, capsys, *verify)
    assert code == 0, err
    rng = np.random.default_rng(0)
    _same(model, fused, [{"ids": rng.integers(0, 10, size=(b, 3)).astype(np.int64)} for b in (1, 4)])
    kinds = {(n.domain, n.op_type) for n in fused.graph.node}
    assert ("", "LayerNormalization") in kinds, "the norm itself is still fused"
    if domain:
        assert (domain, which) in kinds, "the function's call is kept"


# ---- the embedding rule's position ids ------------------------------------------------------------------------------

P = 16


def _gpt2_positions(domain: str, which: str) -> onnx.ModelProto:
    """GPT-2's embeddings: word(ids) + pos(Unsqueeze(Range(0, S))) -> LayerNorm, with ``which`` step of the
    position ids a model-local function of ``domain`` that shifts the ids by one (a different table row)."""
    g = EmbedBlock()
    g.const("one", np.array(1, np.int64))
    shape = g.node("Shape", ["ids"], "ids_shape")
    seq = g.node("Gather", [shape, g.const("one_s", np.array(1, np.int64))], "seq_len", axis=0)
    ids = g.node("Range", [g.const("zero_s", np.array(0, np.int64)), seq, "one"], "arange")
    ids = g.node("Unsqueeze", [ids, g.const("axis0", np.array([0], np.int64))], "pos_ids")
    extra = {"Identity": ([ids], {}), "Cast": ([ids], {"to": TensorProto.INT64}),
             "Expand": ([ids, shape], {}), "Unsqueeze": None}[which]
    if extra is not None:
        ids = g.node(which, *extra[:1], "pos_moved", **extra[1])
    for node in g.nodes:
        if node.op_type == which:
            node.domain = domain
    word = g.node("Gather", [g.table("word", 20), "ids"], "word_emb")
    pos = g.node("Gather", [g.table("pos", P + 2), ids], "pos_emb")
    g.nodes.append(oh.make_node("Add", [word, pos], ["s"], name="s"))
    one = oh.make_node("Constant", [], ["k"], value=onh.from_array(np.array(1, np.int64)))
    inputs = {"Identity": ["x"], "Cast": ["x"], "Expand": ["x", "shape"], "Unsqueeze": ["x", "axes"]}[which]
    real = oh.make_node(which, inputs, ["r"], **({"to": TensorProto.INT64} if which == "Cast" else {}))
    fn = _function(domain, which, inputs, [real, one, oh.make_node("Add", ["r", "k"], ["y"])])
    if which == "Cast":  # the call's attribute is the function's: declared, and read by the body's Cast
        fn.attribute.append("to")
        real.attribute[0].CopyFrom(oh.make_attribute_ref("to", onnx.AttributeProto.INT))
        fn.node[0].CopyFrom(real)
    g.const("gamma", np.linspace(0.5, 1.5, H).astype(np.float32))
    g.const("beta", np.linspace(-1.0, 1.0, H).astype(np.float32))
    g.node("LayerNormalization", ["s", "gamma", "beta"], "Y", epsilon=1e-5)
    return _model(g.nodes, g.inputs, [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "seq", H])],
                  g.inits, [fn], domain)


@pytest.mark.parametrize("verify", [(), ("--no-verify",)], ids=["verified", "no-verify"])
@pytest.mark.parametrize("which", ["Identity", "Cast", "Unsqueeze", "Expand"])
def test_position_ids_through_a_function_named_like_a_view_are_not_0_to_s(tmp_path, capsys, which, verify):
    model = _gpt2_positions("evil", which)
    code, err, fused = _fuse(model, tmp_path, capsys, *verify)
    assert code == 0, err
    rng = np.random.default_rng(0)
    _same(model, fused, [{"ids": rng.integers(0, 20, size=(b, s)).astype(np.int64)} for b, s in ((1, 5), (2, 9))])


# ---- the code asks the predicate ----------------------------------------------------------------------------------

#: uses of ``.op_type`` in a comparison or a lookup that are not questions about what a node computes, each with
#: its reason: (file, a fragment of the line)
ALLOWED = {
    ("lnfuse/report.py", "worst[f.op_type]"): "a fused record of lnfuse's own, grouped for the report",
    ("lnfuse/report.py", "rule_of.setdefault(f.op_type"): "the same records, naming the rule behind each op",
    ("lnfuse/save/provenance.py", "n.op_type == record.op_type"): "the nodes lnfuse just built, marked for provenance",
    ("lnfuse/load/io.py", 'if node.op_type == "Constant"'): "densifying every sparse Constant value the model holds "
    "(whatever its domain, onnx_ir reads only dense ones): more than ONNX's op is the safe side",
}


def _bare_uses(path: Path) -> list[tuple[int, str]]:
    """Where ``.op_type`` decides something: compared (==, !=, in, not in), used as a key (``d[x.op_type]``,
    ``d.get(x.op_type)``, ``d.setdefault(x.op_type, ...)``), or kept in a name to be compared later
    (``op = node.op_type``)."""
    source = path.read_text()
    found = []

    def is_op_type(expr) -> bool:
        return isinstance(expr, ast.Attribute) and expr.attr == "op_type"

    for node in ast.walk(ast.parse(source)):
        hit = None
        if isinstance(node, ast.Compare) and any(is_op_type(e) for e in [node.left, *node.comparators]):
            hit = node
        elif isinstance(node, ast.Subscript) and is_op_type(node.slice):
            hit = node
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "setdefault", "pop") and node.args and is_op_type(node.args[0]):
            hit = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and is_op_type(node.value) and \
                all(isinstance(t, ast.Name) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
            hit = node
        if hit is not None:
            found.append((hit.lineno, source.splitlines()[hit.lineno - 1].strip()))
    return found


def test_a_contrib_name_onnx_runtime_does_not_register_is_no_op():
    """``com.microsoft::Unsqueeze`` is whatever the model's function of that name computes (the case above): the
    predicate names no op for it, so no rule reads it as a view and no inference types it as one."""
    from lnfuse.index.ops import known_op, ort_op
    registered, unregistered = oh.make_node("Gelu", ["x"], ["y"], domain="com.microsoft"), \
        oh.make_node("Unsqueeze", ["x", "a"], ["y"], domain="com.microsoft")
    assert ort_op(registered) == known_op(registered) == "Gelu"
    assert ort_op(unregistered) is None and known_op(unregistered) is None


def test_no_step_decides_an_op_by_its_name_alone():
    bare = []
    for path in sorted([*(ROOT / "lnfuse").rglob("*.py"), *(ROOT / "rules").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "lnfuse/index/ops.py":
            continue
        for line, text in _bare_uses(path):
            if not any(rel == f and fragment in text for f, fragment in ALLOWED):
                bare.append(f"{rel}:{line}: {text}")
    assert not bare, "ask lnfuse.index.ops (is_op / onnx_op / known_op) instead:\n" + "\n".join(bare)


def test_the_allow_list_names_lines_that_exist():
    for (rel, fragment), reason in ALLOWED.items():
        assert reason and any(fragment in text for _, text in _bare_uses(ROOT / rel)), (rel, fragment)


@pytest.mark.parametrize("flags", [[], ["--no-verify"]])
def test_a_requantization_pair_into_another_float_type_is_not_an_identity(tmp_path: Path, flags: list[str]):
    """DQ(Q(v, s16, z), s32, z) with v a float16 value dequantized on the same grid: the pair gives back v's values,
    but as float32, rounded once more; removing it handed float32 readers a float16 value (ORT refused the
    output) or changed the numbers (a Cast reader). The red team's finding; the clean-up is outside any verified
    region, so it must hold with --no-verify too."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto as TP, helper as oh, numpy_helper as onh

    inits = [onh.from_array(np.array(0.5, np.float16), "s16"), onh.from_array(np.array(0.5, np.float32), "s32"),
             onh.from_array(np.array(0, np.int8), "z")]
    nodes = [oh.make_node("DequantizeLinear", ["x", "s16", "z"], ["v"], name="dq0"),
             oh.make_node("QuantizeLinear", ["v", "s16", "z"], ["q"], name="q1"),
             oh.make_node("DequantizeLinear", ["q", "s32", "z"], ["w"], name="dq1"),
             oh.make_node("Neg", ["w"], ["y"], name="neg")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.INT8, [2, 8])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [2, 8])], inits)
    model = tmp_path / "m.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)]), model)
    proc = subprocess.run([sys.executable, "-m", "lnfuse.cli", str(model), "-o", str(tmp_path / "out.onnx"), *flags],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    x = {"x": np.arange(-8, 8, dtype=np.int8).reshape(2, 8) * 7}
    run = lambda path: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)[0]
    assert run(tmp_path / "out.onnx").dtype == np.float32
    np.testing.assert_array_equal(run(tmp_path / "out.onnx"), run(model))
