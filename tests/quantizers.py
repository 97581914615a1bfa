"""What quantizers read, and an original and a rewritten model run side by side on many input sets, with the values
quantizers read exposed: for tests/test_quantized_zoo.py and benchmarks/quantized_recipes.py (issue 28).

A value a rewrite did not change keeps its name, so the values are matched by name: read by the same quantizer node,
or, where the quantizer is gone, by the value's own name (through removed Casts and Q/DQ pairs, whose copying is
measured, not assumed: the bytes are compared)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sample_models"))
from make_quantized_zoo import feeds  # noqa: E402

INPUT_SETS = 16

#: ops that quantize a float activation they read (input 0), and ONNX Runtime's QOperator ops, which read
#: activations quantized already (a float one among them would be quantized inside the kernel)
QUANTIZERS = frozenset({("", "QuantizeLinear"), ("", "DynamicQuantizeLinear"), ("com.microsoft", "QuantizeLinear"),
                        ("com.microsoft", "DynamicQuantizeMatMul"), ("com.microsoft", "DynamicQuantizeLSTM")})


def _quantized_inputs(node: onnx.NodeProto) -> list[str]:
    """The inputs of ``node`` it quantizes, or reads quantized already (a QOperator op): none for other ops."""
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    if (domain, node.op_type) in QUANTIZERS:
        return list(node.input[:1])
    if (domain, node.op_type) == ("com.microsoft", "MatMulNBits"):
        return list(node.input[:1]) if any(a.name == "accuracy_level" and a.i >= 4 for a in node.attribute) else []
    qoperator = node.op_type.startswith("QLinear") or (domain == "com.microsoft" and node.op_type.startswith("Q"))
    return list(node.input) if qoperator else []


def quantized_values(model: onnx.ModelProto) -> dict[tuple[str, int], str]:
    """(quantizer node name, input index) -> the run-time tensor it reads there (constant scales and zero points
    aside). Main graph only: the zoo's models have no subgraphs or functions (asserted)."""
    assert not model.functions and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                           for n in model.graph.node for a in n.attribute)
    constants = {t.name for t in model.graph.initializer} | {o for n in model.graph.node if n.op_type == "Constant"
                                                               for o in n.output}
    found: dict[tuple[str, int], str] = {}
    for node in model.graph.node:
        found.update({(node.name, i): name for i, name in enumerate(_quantized_inputs(node))
                      if name and name not in constants})
    return found


@dataclass(frozen=True)
class Watch:
    """A value a quantizer reads in the original (``before``) and the same value in the fused model (``after``;
    None when it is gone)."""

    quantizer: str
    before: str
    after: str | None


def watches(original: onnx.ModelProto, fused: onnx.ModelProto) -> list[Watch]:
    """Each run-time value a quantizer of ``original`` reads, found again in ``fused``: read by the same quantizer
    (a node the rewrite did not touch keeps its name), or, where lnfuse removed the quantizer (a Q/DQ pair that gives
    back its input exactly), the value by its name, or by the name of the value removed Casts and Q/DQ pairs in
    front of it copied (whether they copied it is measured: the run compares the bytes)."""
    nodes = {n.name: n for n in fused.graph.node}
    producers = {o: n for n in original.graph.node for o in n.output}
    made = {o for n in fused.graph.node for o in n.output} | {i.name for i in fused.graph.input}
    found = []
    for (quantizer, index), name in quantized_values(original).items():
        label = f"{producers.get(name, onnx.NodeProto(op_type='input')).op_type} -> " + next(
            f"{n.op_type} '{n.name}'" for n in original.graph.node if n.name == quantizer)
        if quantizer in nodes:
            found.append(Watch(label, name, nodes[quantizer].input[index]))
            continue
        same = name
        while same not in made and same in producers:
            step = producers[same]
            if step.op_type == "Cast":
                same = step.input[0]
            elif step.op_type == "DequantizeLinear" and step.input[0] in producers \
                    and producers[step.input[0]].op_type == "QuantizeLinear":
                same = producers[step.input[0]].input[0]
            else:
                break
        found.append(Watch(label, name, same if same in made else None))
    return found


def exposing(model: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """A copy that also returns ``names`` as graph outputs (ORT infers their types)."""
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    known = {o.name for o in copy.graph.output}
    copy.graph.output.extend(onnx.ValueInfoProto(name=n) for n in sorted(names - known))
    return copy


def session(model: onnx.ModelProto, optimized: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def input_sets(model: onnx.ModelProto, count: int = INPUT_SETS) -> list[dict[str, np.ndarray]]:
    """``count`` input sets of batch 1..3 and sequence 3..10, from seeds of their own: a float difference moves a
    quantized value only near a rounding boundary, so one input set rarely shows it."""
    return [feeds(model, np.random.default_rng(100 + i), batch=1 + i % 3, sequence=3 + i % 8)
            for i in range(count)]


def _named(sess: ort.InferenceSession, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(zip((o.name for o in sess.get_outputs()), sess.run(None, feed)))


@dataclass
class Runs:
    """Both models on every input set, with ORT's optimizations off (``plain``) and on (``optimized``, only where
    quantizers are watched): (original's values, fused model's values) by name, graph outputs and watched values."""

    watched: list[Watch]
    outputs: list[str]
    plain: list[tuple[dict, dict]]
    optimized: list[tuple[dict, dict]]


def run_both(original: onnx.ModelProto, fused: onnx.ModelProto) -> Runs:
    watched = watches(original, fused)
    sets = input_sets(original)
    ran = {}
    for optimized in (False, True) if watched else (False,):
        before = session(exposing(original, {w.before for w in watched}), optimized)
        after = session(exposing(fused, {w.after for w in watched if w.after}), optimized)
        ran[optimized] = [(_named(before, feed), _named(after, feed)) for feed in sets]
    return Runs(watched, [o.name for o in original.graph.output], ran[False], ran.get(True, []))
