"""Rewriting a graph: a verified ``Replacement`` put in place of its region, and what that leaves unread swept
away. Shared by fusion (``engine``) and decompose, which verify their replacements before they get here."""

from __future__ import annotations

from typing import Callable, Iterable

import onnx_ir as ir

from lnfuse.index.ops import is_op
from lnfuse.match.rule import ABSENT, Replacement


def apply(graph: ir.Graph | ir.Function, rep: Replacement, position: dict[ir.Node, float],
          fresh_name: Callable[[str], str]) -> None:
    """Put the new nodes where the region's last node was, point every reader at the new values, drop the region.
    ``position`` (graph order at the start of the pass) gets the new nodes, between the region's last node and the
    node after it. ``fresh_name`` names the nodes made here (a node name the model already uses makes it invalid)."""
    host = graph.graph if isinstance(graph, ir.Function) else graph
    new_constants = []
    for node in rep.nodes:
        for value in node.inputs:
            if value is not None and value.producer() is None and value.const_value is not None \
                    and value.graph is None and value not in new_constants:
                new_constants.append(value)
    last = max(rep.region, key=lambda n: position[n])
    constant_nodes = []
    for value in new_constants:
        if isinstance(graph, ir.Function):  # functions have no initializers
            constant_nodes.append(ir.node("Constant", [], {"value": value.const_value}, outputs=[value],
                                          name=fresh_name(f"{value.name}/Constant")))
        else:
            host.register_initializer(value)
    inserted = constant_nodes + rep.nodes
    host.insert_after(last, inserted)
    for node in rep.nodes:
        for out in node.outputs:
            if out.meta.get(ABSENT):
                out.name = ""  # after insertion: the graph names every unnamed value it receives
    named_outputs: set[ir.Value] = set()
    for old, new in rep.outputs.items():
        if old.is_graph_output():
            if new in named_outputs:
                identity = ir.node("Identity", [new], name=fresh_name(f"{old.name}/Identity"))
                host.insert_after(rep.nodes[-1], [identity])
                inserted.append(identity)
                new = identity.outputs[0]
            name = old.name
            old.name = f"{name}__replaced"
            new.name = name
            named_outputs.add(new)
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    host.remove(rep.region, safe=True)
    for k, node in enumerate(inserted, start=1):
        position[node] = position[last] + k / (len(inserted) + 1)
    if any(position.get(reader, -1) < position[last] for new in rep.outputs.values()
           for reader, _ in new.uses() if reader in position):
        host.sort()
        position.update({node: i for i, node in enumerate(host)})


def cleanup(graph: ir.Graph | ir.Function, kept: Iterable[Replacement]) -> None:
    """Remove Reshapes that now give a fused output (of the ``kept`` replacements) the shape it already has, then
    every node and initializer nothing reads (the shape bookkeeping of the removed regions, Constants of
    epsilon...). Only graphs lnfuse rewrote are swept, and nothing that computes a graph output is touched."""
    host = graph.graph if isinstance(graph, ir.Function) else graph
    for replacement in kept:
        for node in replacement.nodes:
            for new in node.outputs:
                _bypass_identity_reshapes(host, new)
    for node in reversed(list(host)):
        if not any(out.uses() or out.is_graph_output() for out in node.outputs):
            host.remove(node, safe=True)
    if not isinstance(graph, ir.Function):
        for name, value in list(host.initializers.items()):
            if not value.uses() and not value.is_graph_input() and not value.is_graph_output():
                del host.initializers[name]


def _bypass_identity_reshapes(host: ir.Graph, value: ir.Value) -> None:
    """Reshape chains that bring a fused output back to the shape it already has are the identity."""
    chain, current = [], value
    while True:
        readers = [(r, i) for r, i in current.uses()]
        if len(readers) != 1 or not is_op(readers[0][0], "Reshape") or readers[0][1] != 0 \
                or readers[0][0].graph is not host:
            return
        chain.append(readers[0][0])
        current = readers[0][0].outputs[0]
        if current.is_graph_output() and not _same_static_shape(value, current):
            return  # the model's output needs that intermediate shape
        if _same_static_shape(value, current):
            break
    if current.is_graph_output():
        if value.is_graph_output():
            return
        name = current.name
        current.name = f"{name}__replaced"
        value.name = name
    current.replace_all_uses_with(value, replace_graph_outputs=True)
    host.remove(chain, safe=True)


def _same_static_shape(a: ir.Value, b: ir.Value) -> bool:
    return a.shape is not None and b.shape is not None and a.shape.is_static() and b.shape.is_static() \
        and list(a.shape) == list(b.shape)

