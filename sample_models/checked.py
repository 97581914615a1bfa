"""Saving a sample model the same way in every generator script, without torch (the quantized zoo needs none)."""

from __future__ import annotations

from pathlib import Path

import onnx


def save_checked(model: onnx.ModelProto, path: Path, *, any_node_order: bool = False) -> None:
    """Save a sample after the full check, at an IR version older ONNX Runtime releases read too.

    ``any_node_order``: the tool that made the model writes nodes out of order (ONNX Runtime loads such a graph,
    onnx's checker does not), and the sample keeps that order, since lnfuse must read what the tool writes: the
    check then runs on a topologically sorted copy."""
    model.ir_version = min(model.ir_version, 10)
    onnx.checker.check_model(topologically_sorted(model) if any_node_order else model, full_check=True)
    onnx.save(model, path)
    print(f"wrote {path.name} ({path.stat().st_size // 1024} KB)")


def topologically_sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose main-graph nodes come after the nodes they read (stable otherwise)."""
    sorted_model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = sorted_model.graph
    known = {v.name for v in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(i in known for i in n.input)]
        if not ready:
            raise ValueError(f"a cycle or a value nobody makes, at node {pending[0].name!r}")
        for node in ready:
            known.update(node.output)
        ordered += ready
        pending = [n for n in pending if n not in ready]
    del graph.node[:]
    graph.node.extend(ordered)
    return sorted_model
