"""The graphs lnfuse rewrites (scopes) and what they hold, walked once for every stage that needs them: fusion
(``engine``), decompose, ``explain --annotate`` and the API's op counts."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator

import onnx_ir as ir

from lnfuse.index.traversal import every_node


@dataclass
class Scope:
    graph: ir.Graph | ir.Function
    path: str
    opset: int


def scopes(model: ir.Model) -> Iterator[Scope]:
    """Every graph lnfuse rewrites: the main graph, If/Loop/Scan bodies at any depth, and model-local functions."""
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
    yield from _with_subgraphs(model.graph, "main", opset)
    for function in model.functions.values():
        f_opset = function.opset_imports.get("", opset)
        yield from _with_subgraphs(function, f"function {function.domain}::{function.name}", f_opset)


def _with_subgraphs(graph: ir.Graph | ir.Function, path: str, opset: int) -> Iterator[Scope]:
    yield Scope(graph, path, opset)
    for node in list(graph):
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            subs = [attr.value] if attr.type == ir.AttributeType.GRAPH else \
                list(attr.value) if attr.type == ir.AttributeType.GRAPHS else []
            for sub in subs:
                yield from _with_subgraphs(sub, f"{path}/{node.name or node.op_type}.{attr.name}", opset)


def all_names(model: ir.Model, nodes: Iterable[ir.Node] | None = None) -> set[str]:
    """The names of the model's nodes and values. ``nodes``: every node of the model (``nodes_of``), when the
    caller has them (else they are walked)."""
    names = set()
    graphs = [model.graph, *model.functions.values()]
    for graph in graphs:
        for value in graph.inputs:
            names.add(value.name)
    for node in nodes if nodes is not None else (node for graph in graphs for node in every_node(graph)):
        names.add(node.name)
        names.update(v.name for v in node.outputs)
        names.update(v.name for v in node.inputs if v is not None)
    names.update(model.graph.initializers)
    return names


def nodes_of(model: ir.Model) -> dict[ir.Node, None]:
    """Every node of the model, subgraphs and functions included (what was there before a rewrite), in the order
    of ``every_node`` over the main graph and then each function."""
    return dict.fromkeys(node for graph in [model.graph, *model.functions.values()] for node in every_node(graph))


def count_ops(nodes: Iterable[ir.Node]) -> dict[str, int]:
    """How many of these nodes have each op type, in the order each first appears."""
    return dict(Counter(node.op_type for node in nodes))


def op_counts(model: ir.Model) -> dict[str, int]:
    """``count_ops`` over every node of the model (the report's ops before and after)."""
    return count_ops(nodes_of(model))
