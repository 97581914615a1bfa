"""Walking a graph's nodes and those of its subgraphs (If/Loop/Scan bodies, at any depth), in onnx_ir's model and
in the protobuf one.

The same walk as onnx_ir's ``RecursiveGraphIterator`` (each node, then the nodes of its subgraphs), with one
generator per graph instead of a chain of them per node: on a graph of a million nodes each walk costs a third.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import onnx
import onnx_ir as ir


def every_node(graph: ir.Graph | ir.Function) -> Iterator[ir.Node]:
    """The nodes of ``graph`` in order, each followed by the nodes of its subgraphs (a stack of the graphs being
    walked, not a recursion: an onnx_ir model built in memory can nest bodies at any depth)."""
    stack = [iter(graph)]
    while stack:
        node = next(stack[-1], None)
        if node is None:
            stack.pop()
            continue
        yield node
        if node.attributes:
            stack += [iter(sub) for sub in reversed(list(subgraphs(node)))]


def subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    """The graphs held by the node's attributes, in attribute order."""
    for attr in node.attributes.values():
        if attr.is_ref():
            continue
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.value
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.value


def proto_bodies(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.GraphProto]:
    """The If/Loop/Scan bodies held by these nodes, at any depth."""
    stack = [nodes]
    while stack:
        for node in stack.pop():
            if not node.attribute:  # most nodes have none: testing is a third of the cost of listing them
                continue
            for attr in node.attribute:
                subs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
                stack.extend(sub.node for sub in subs)
                yield from subs


def every_proto_node(proto: onnx.ModelProto, main_graph: bool = True) -> Iterator[onnx.NodeProto]:
    """The nodes of the main graph (unless ``main_graph`` is False), of the model-local functions, and of every
    If/Loop/Scan body in either, at any depth."""
    if main_graph:
        yield from proto.graph.node
    for function in proto.functions:
        yield from function.node
    for nodes in (proto.graph.node, *(f.node for f in proto.functions)):
        for body in proto_bodies(nodes):
            yield from body.node


def every_graph(model: ir.Model) -> Iterator[ir.Graph | ir.Function]:
    """The main graph, every If/Loop/Scan body in it at any depth, then the model-local functions."""
    yield model.graph
    for node in every_node(model.graph):
        if node.attributes:
            yield from subgraphs(node)
    yield from model.functions.values()
