"""Statistics two norms of the same input share: each norm is fused with its own gamma/beta, the shared nodes stay.

An exporter that removes common subexpressions (tf2onnx over Keras' parallel-residual blocks: GPT-NeoX normalizes
one input for the attention and for the MLP) computes the mean, the centred value, the variance and 1/sqrt(var + eps)
once and reads them from both norms. Each norm is still a norm of that input: its fused op computes the statistics
again from x, so its region need not delete them. The shared nodes are left out of the region while every reader
outside it is a node of another norm of the same input, proven by matching that norm with the rule's own patterns;
once every such norm is fused nothing reads them and the clean-up removes them. A statistic also read by anything
else stays in the region, where the engine refuses it (the fused op cannot expose it).
"""

from __future__ import annotations

from typing import Sequence

import onnx_ir as ir

from lnfuse.match.pattern import Match, Pattern
from lnfuse.match.rule import Replacement

#: how far (reader steps) a sibling norm's output may lie from the node that reads the shared statistic: Keras'
#: spelling takes three (gamma * inv -> x * k -> + beta' -> + ...)
_REACH = 6
#: nodes visited looking for one sibling's output; matches tried from each
_VISIT, _MATCHES = 48, 16


def leave_shared(m: Match, region: list[ir.Node], patterns: Sequence[Pattern],
                 y: ir.Value) -> tuple[list[ir.Node], list[ir.Node]]:
    """(the region less the statistics that other norms of the same input also read, those shared nodes). ``y``:
    the value the fused op replaces (its readers are the norm's users, not a sibling)."""
    inside = set(region)
    shared: list[ir.Node] = []
    proven: dict[ir.Node, bool] = {}
    for node in region:
        outside = [r for v in node.outputs if v is not y for r, _ in v.uses() if r not in inside]
        if outside and not any(v.is_graph_output() for v in node.outputs if v is not y) and \
                all(_is_sibling(reader, m, patterns, proven) for reader in outside):
            shared.append(node)
    # what a shared node reads inside the region stays with it
    todo = list(shared)
    while todo:
        for value in todo.pop().inputs:
            producer = value.producer() if value is not None else None
            if producer in inside and producer not in shared:
                shared.append(producer)
                todo.append(producer)
    left = set(shared)
    return [n for n in region if n not in left], shared


def _is_sibling(reader: ir.Node, m: Match, patterns: Sequence[Pattern], proven: dict[ir.Node, bool]) -> bool:
    """Whether ``reader`` is a node of another norm of m's input: a match of ``patterns`` rooted at a value a few
    reader steps after it, with the same x, that covers it."""
    if reader not in proven:
        x, y = m.value("x"), m.value("y")
        if x is None:
            proven[reader] = False
        else:
            # the roots found are kept for the pass: the other norms of x ask about the same readers
            key = (reader, x, tuple(map(id, patterns)))
            store = m.cache.siblings if m.cache is not None else {}
            if key not in store:
                store[key] = _sibling_roots(reader, x, patterns, m)
            proven[reader] = any(root is not y for root in store[key])
    return proven[reader]


def _sibling_roots(reader: ir.Node, x: ir.Value, patterns: Sequence[Pattern], m: Match) -> tuple[ir.Value, ...]:
    """The roots (two at most) of matches of ``patterns`` over ``x`` that cover ``reader``, a few reader steps after
    it: two, so that a norm asking finds another than itself (its own output is never its sibling)."""
    roots: list[ir.Value] = []
    frontier, seen = [reader], {reader}
    for _ in range(_REACH):
        following = []
        for node in frontier:
            for root in node.outputs:
                if _covers(root, reader, x, patterns, m):
                    roots.append(root)
                    if len(roots) == 2:
                        return tuple(roots)
                for user, _ in root.uses():
                    if user not in seen and len(seen) < _VISIT:
                        seen.add(user)
                        following.append(user)
        frontier = following
    return tuple(roots)


def _covers(root: ir.Value, reader: ir.Node, x: ir.Value, patterns: Sequence[Pattern], m: Match) -> bool:
    for pattern in patterns:
        for k, found in enumerate(pattern.match(root, Match(cache=m.cache))):
            if k >= _MATCHES:
                break
            if found.value("x") is x and reader in found.nodes:
                return True
    return False


def left_to_siblings(done: Replacement, shared: list[ir.Node], x: ir.Value) -> Replacement:
    """``done`` recording the statistics ``leave_shared`` left in the graph (the engine counts them fused once
    every norm reading them is), with a note saying so."""
    done.shared = shared
    if shared:
        done.notes.append(f"{len(shared)} statistic node(s) another norm of '{x.name}' also reads are left to it "
                          "(removed once nothing reads them)")
    return done
