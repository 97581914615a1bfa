"""A small backward matcher: patterns are written as op calls and matched from an output value upwards.

Why not onnxscript's matcher: it refuses any match whose intermediates are read outside the pattern, but lnfuse must
see those matches (to expose LayerNormalization's Mean/InvStdDev, or to explain the refusal). Here the matcher only
finds structure; which intermediates may be read elsewhere is decided by the engine.

Semantics:
- ``Op`` matches the producer of a value; ``Add``/``Mul`` operands are tried in both orders.
- A pattern with a ``name`` binds the value it matched. Meeting the name again requires the same value, or a
  second node that matches the same pattern with the same bindings (old PyTorch exports compute ``x - mean`` twice).
- ``Either`` tries alternatives in order; matching is a generator, so every alternative is reachable by backtracking.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import onnx_ir as ir

from lnfuse.constants import is_static

COMMUTATIVE = frozenset({"Add", "Mul"})


@dataclass(frozen=True)
class Match:
    """Bindings found by a pattern: named values, named nodes, and every node the pattern covered (the region)."""

    values: Mapping[str, ir.Value] = field(default_factory=dict)
    named_nodes: Mapping[str, ir.Node] = field(default_factory=dict)
    nodes: tuple[ir.Node, ...] = ()

    def bind(self, name: str, value: ir.Value) -> "Match":
        return Match({**self.values, name: value}, self.named_nodes, self.nodes)

    def add_node(self, node: ir.Node, name: str | None) -> "Match":
        named = {**self.named_nodes, name: node} if name and name not in self.named_nodes else self.named_nodes
        return Match(self.values, named, self.nodes + (node,))

    def value(self, name: str) -> ir.Value | None:
        return self.values.get(name)

    def node(self, name: str) -> ir.Node | None:
        return self.named_nodes.get(name)

    def has(self, name: str) -> bool:
        return name in self.values or name in self.named_nodes


class Pattern(abc.ABC):
    name: str | None = None

    def match(self, value: ir.Value | None, m: Match) -> Iterator[Match]:
        if self.name is not None and self.name in m.values:
            bound = m.values[self.name]
            if bound is value:
                yield m
                return
            if not isinstance(self, Op):
                return
            # A different node computing the same thing from the same bindings is the same tensor.
        for found in self._match(value, m):
            yield found if self.name is None or self.name in found.values else found.bind(self.name, value)

    @abc.abstractmethod
    def _match(self, value: ir.Value | None, m: Match) -> Iterator[Match]: ...

    def root_ops(self) -> frozenset[str] | None:
        """The op types a matched value can be produced by (None: any value)."""
        return None


class Var(Pattern):
    """Any value (a graph input, an initializer, or any node's output) that the region reads."""

    def __init__(self, name: str, where: Callable[[ir.Value], bool] | None = None):
        self.name = name
        self.where = where

    def _match(self, value, m):
        if value is not None and (self.where is None or self.where(value)):
            yield m


class Const(Var):
    """A value fixed when the model is built: an initializer that is not a graph input, a Constant node, or a small
    computation on those (``Cast(Constant)``, ``Size(Shape(x))`` of a known rank...).

    Only the structure is checked here; the value is read later, when a check needs it (weights may be external).
    """

    def __init__(self, name: str):
        super().__init__(name, is_static)


class Op(Pattern):
    def __init__(
        self,
        op_type: str | tuple[str, ...],
        *inputs: Pattern | None,
        name: str | None = None,
        domain: str = "",
        attrs: Mapping[str, Callable[[object], bool]] | None = None,
        extra_inputs: bool = False,
    ):
        self.op_types = (op_type,) if isinstance(op_type, str) else tuple(op_type)
        self.inputs = inputs
        self.name = name
        self.domain = domain
        self.attrs = attrs or {}
        self.extra_inputs = extra_inputs

    def root_ops(self) -> frozenset[str]:
        return frozenset(self.op_types)

    def _match(self, value, m):
        node = value.producer() if value is not None else None
        if node is None or node.op_type not in self.op_types or _domain(node.domain) != self.domain:
            return
        if node.outputs[0] is not value:
            return
        n_in = len(node.inputs)
        if n_in < len(self.inputs) or (n_in > len(self.inputs) and not self.extra_inputs):
            return
        for attr, accepts in self.attrs.items():
            if not accepts(attr_value(node, attr)):
                return
        if node in m.nodes:
            yield m
            return
        twin = m.named_nodes.get(self.name) if self.name is not None else None
        if twin is not None and not _same_computation(node, twin, len(self.inputs)):
            return
        m = m.add_node(node, self.name)
        actual = list(node.inputs[: len(self.inputs)])
        orders = [list(self.inputs)]
        if node.op_type in COMMUTATIVE and len(self.inputs) == 2 and self.inputs[0] is not self.inputs[1]:
            orders.append(orders[0][::-1])
        for order in orders:
            yield from _match_all(actual, order, m)


class Either(Pattern):
    def __init__(self, *alternatives: Pattern, name: str | None = None):
        self.alternatives = alternatives
        self.name = name

    def root_ops(self) -> frozenset[str] | None:
        roots = [alt.root_ops() for alt in self.alternatives]
        return None if None in roots else frozenset().union(*roots)

    def _match(self, value, m):
        for alt in self.alternatives:
            yield from alt.match(value, m)


def maybe_cast(p: Pattern, cast: str, name: str | None = None) -> Pattern:
    """``p`` or ``Cast(p)``: exporters add Casts around statistics in mixed precision. The Cast node is bound to
    ``cast`` so checks can read its target type; the value after the optional Cast is bound to ``name``."""
    return Either(Op("Cast", p, name=cast), p, name=name)


def _same_computation(node: ir.Node, twin: ir.Node, matched_inputs: int) -> bool:
    """A second node bound to an already bound name must compute the same thing: same op, same attributes, and the
    same values in the inputs the pattern does not look at (ReduceMean's axes, Unsqueeze's axes)."""
    if (node.op_type, node.domain, len(node.inputs)) != (twin.op_type, twin.domain, len(twin.inputs)):
        return False
    if list(node.inputs[matched_inputs:]) != list(twin.inputs[matched_inputs:]):
        return False
    mine = {k: a.value for k, a in node.attributes.items()}
    theirs = {k: a.value for k, a in twin.attributes.items()}
    return mine == theirs


def _match_all(values: list, patterns: list, m: Match) -> Iterator[Match]:
    if not patterns:
        yield m
        return
    head = patterns[0]
    if head is None:
        yield from _match_all(values[1:], patterns[1:], m)
        return
    for found in head.match(values[0], m):
        yield from _match_all(values[1:], patterns[1:], found)


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def attr_value(node: ir.Node, name: str, default: object = None) -> object:
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref():
        return default
    return attr.value
