"""A small backward matcher: patterns are written as op calls and matched from an output value upwards.

Why not onnxscript's matcher: it refuses any match whose intermediates are read outside the pattern, but lnfuse must
see those matches (to expose LayerNormalization's Mean/InvStdDev, or to explain the refusal). Here the matcher only
finds structure; which intermediates may be read elsewhere is decided by the engine.

Semantics:
- ``Op`` matches the producer of a value; ``Add``/``Mul`` operands are tried in both orders.
- A pattern with a ``name`` binds the value it matched. Meeting the name again requires the same value, or a
  second node that matches the same pattern with the same bindings (old PyTorch exports compute ``x - mean`` twice).
- ``Either`` tries alternatives in order; matching is a generator, so every alternative is reachable by backtracking.
- ``Terms`` matches a value by its normal form (``lnfuse.match.algebra``): a sum of monomials, each a coefficient and
  factors with exponents. The pattern lists its monomials; order, association, signs and folded constants of the
  graph's spelling do not matter. Exponents and coefficients the rule wants to check (and explain) are bound as
  facts instead of being required.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterator, Mapping, Sequence

import onnx_ir as ir

from lnfuse.match import algebra
from lnfuse.index.constants import static_value
from lnfuse.index.ops import is_op, onnx_op, op_key

COMMUTATIVE = frozenset({"Add", "Mul"})
#: ops whose result has each element where their input has it: what is matched below them is in their frame
FRAME_KEEPING = frozenset({"Cast", "Identity"})
#: the op types ``noop_source`` may find handing their input on unchanged (each is then checked)
NOOP_OPS = frozenset({"Identity", "Cast", "Reshape", "Dropout"})
#: how many no-ops one ``ThroughNoOps`` reads through: exporters write one or two; a chain of thousands in front of
#: a residual must not make every match attempt walk it
_MAX_NOOPS = 8


@dataclass(frozen=True, eq=False)
class Trail:
    """Nodes a match covered, newest first, shared with the match it grew from: adding is O(1) whatever the size
    (a match over a chain of a million sign flips grows one node at a time, and copying would make it quadratic).
    ``nodes`` is one node, a sequence of nodes, or another trail (what a chain of views read)."""

    nodes: "ir.Node | Sequence[ir.Node] | Trail"
    older: "Trail | None" = None


@dataclass(frozen=True)
class Match:
    """Bindings found by a pattern: named values, named nodes, and every node the pattern covered (the region)."""

    values: Mapping[str, ir.Value] = field(default_factory=dict)
    named_nodes: Mapping[str, ir.Node] = field(default_factory=dict)
    trail: Trail | None = None
    #: numbers the normal form found (exponents, coefficients), for the rule's checks
    facts: Mapping[str, object] = field(default_factory=dict)
    #: what the pass already worked out about the (unchanging) graph; not a binding
    cache: algebra.Cache | None = field(default=None, compare=False, repr=False)
    #: where the value being matched sits: (frame, views). The frame is the value the pattern was matched from
    #: (None) or the input of the op whose pattern is being matched below (a reduction's, say); the views (outermost
    #: first) place the value in it. Kept through Terms, Casts and Identities, which move no element.
    frame: tuple = (None, ())

    @functools.cached_property
    def nodes(self) -> tuple[ir.Node, ...]:
        """The region: every node covered, once each, in the order the pattern first met them."""
        seen: dict[ir.Node, None] = {}
        stack: list = [self.trail]
        while stack:
            item = stack.pop()
            if isinstance(item, Trail):
                stack.extend((item.nodes, item.older))  # the older entries come out first
            elif isinstance(item, ir.Node):
                seen.setdefault(item)
            elif item is not None:
                stack.extend(reversed(item))
        return tuple(seen)

    def bind(self, name: str, value: ir.Value) -> "Match":
        return Match({**self.values, name: value}, self.named_nodes, self.trail, self.facts, self.cache, self.frame)

    def add_node(self, node: ir.Node, name: str | None) -> "Match":
        named = {**self.named_nodes, name: node} if name and name not in self.named_nodes else self.named_nodes
        return Match(self.values, named, Trail(node, self.trail), self.facts, self.cache, self.frame)

    def add_nodes(self, nodes: "Sequence[ir.Node] | Trail | None") -> "Match":
        if not nodes:
            return self
        return Match(self.values, self.named_nodes, Trail(nodes, self.trail), self.facts, self.cache, self.frame)

    def with_fact(self, name: str, value: object) -> "Match":
        return Match(self.values, self.named_nodes, self.trail, {**self.facts, name: value}, self.cache, self.frame)

    def in_frame(self, frame: tuple) -> "Match":
        return self if frame == self.frame else \
            Match(self.values, self.named_nodes, self.trail, self.facts, self.cache, frame)

    def fact(self, name: str, default: object = None) -> object:
        return self.facts.get(name, default)

    def views(self, value: ir.Value) -> list[tuple[ir.Node, ...]]:
        """The views (unit-dim restores and Transposes, outermost first) the normal form saw above ``value``, one
        tuple per factor, from the frame each was matched in (``viewed``)."""
        return [nodes for _, v, nodes in self.viewed() if v is value]

    def viewed(self) -> tuple[tuple[ir.Value | None, ir.Value, tuple[ir.Node, ...]], ...]:
        """Every factor matched under views: (frame, value, views). ``views`` place value in the frame: the value
        the pattern was matched from (None), or the input of the op whose pattern read it (a reduction's input, say),
        composed through the Terms and Casts between (``_assign_factors``)."""
        return self.fact("viewed", ())

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
        if not is_op(node, *self.op_types, domain=self.domain):
            return
        if node.outputs[0] is not value:
            return
        n_in = len(node.inputs)
        if n_in < len(self.inputs) or (n_in > len(self.inputs) and not self.extra_inputs):
            return
        for attr, accepts in self.attrs.items():
            if not accepts(attr_value(node, attr)):
                return
        twin = m.named_nodes.get(self.name) if self.name is not None else None
        if twin is not None and twin is not node and not _same_computation(node, twin, len(self.inputs)):
            return
        # a node met again (x - mean read by the square and the numerator) must match this pattern too
        m = m.add_node(node, self.name)
        actual = list(node.inputs[: len(self.inputs)])
        orders = [list(self.inputs)]
        if onnx_op(node) in COMMUTATIVE and len(self.inputs) == 2 and self.inputs[0] is not self.inputs[1]:
            orders.append(orders[0][::-1])
        if onnx_op(node) in FRAME_KEEPING:
            for order in orders:
                yield from _match_all(actual, order, m)
            return
        # each input of any other op is a frame of its own (a reduction's input is not laid out like its result)
        for order in orders:
            for found in _match_all(actual, order, m, framed=True):
                yield found.in_frame(m.frame)


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


#: an exponent the pattern requires, or the name of a fact that receives whatever exponent the graph has
Exponent = "Fraction | str"


@dataclass(frozen=True)
class Mono:
    """``coef * scale * prod(pattern ** exponent)``: ``scale`` names a fact that receives the graph's coefficient
    divided by ``coef`` (None: the coefficient must be ``coef``)."""

    coef: float
    factors: tuple[tuple[Pattern, "Fraction | str"], ...]
    scale: str | None = None


def mono(coef: float, *factors: "Pattern | tuple[Pattern, Fraction | str]", scale: str | None = None) -> Mono:
    return Mono(coef, tuple(f if isinstance(f, tuple) else (f, Fraction(1)) for f in factors), scale)


class Terms(Pattern):
    """A value whose normal form is exactly these monomials (each graph monomial used once). Given tuples of
    monomials instead, they are alternative forms, tried in order on one expansion of the value.

    ``either_sign``: the value may also be the negation (a base under an even power: ``(mean - x)**2``).
    """

    def __init__(self, *monomials: "Mono | tuple[Mono, ...]", name: str | None = None, either_sign: bool = False):
        self.forms = (monomials,) if all(isinstance(p, Mono) for p in monomials) else tuple(monomials)
        self.name = name
        self.either_sign = either_sign

    def root_ops(self) -> frozenset[str] | None:
        # a form that is one factor alone matches any value
        alone = any(len(form) == 1 and len(form[0].factors) == 1 for form in self.forms)
        return None if alone else algebra.CHAIN

    def _match(self, value, m):
        if value is None:
            return
        found = algebra.expand(value, m.cache)
        with_nodes = m.add_nodes(found.nodes)
        for form in self.forms:
            if len(found.terms) != len(form):
                continue
            for sign in ((1.0, -1.0) if self.either_sign else (1.0,)):
                terms = [algebra.Monomial(t.coef * sign, t.factors) for t in found.terms]
                yield from _assign_terms(list(form), terms, with_nodes)


def _assign_terms(pattern: list[Mono], terms: list, m: Match) -> Iterator[Match]:
    if not pattern:
        yield m
        return
    head, rest = pattern[0], pattern[1:]
    for i, term in enumerate(terms):
        if len(term.factors) != len(head.factors):
            continue
        for found, coef in _assign_factors(list(head.factors), list(term.factors), m, term.coef):
            found = _coefficient(head, coef, found)
            if found is not None:
                yield from _assign_terms(rest, terms[:i] + terms[i + 1:], found)


def _coefficient(p: Mono, coef: float, m: Match) -> Match | None:
    ratio = coef / p.coef
    if p.scale is None:
        return m if abs(ratio - 1) <= 1e-6 else None
    bound = m.fact(p.scale)
    if bound is None:
        return m.with_fact(p.scale, ratio)
    return m if abs(ratio - bound) <= 1e-6 * max(1.0, abs(bound)) else None


def _assign_factors(pattern: list, factors: list, m: Match, coef: float) -> Iterator[tuple[Match, float]]:
    """Each pattern factor matched to one graph factor (seen through the scalings and powers that compute it);
    yields the match and the monomial's coefficient with what the views took out of the factors."""
    if not pattern:
        yield m, coef
        return
    (leaf, exponent), rest = pattern[0], pattern[1:]
    frame, outer = m.frame
    for i, factor in enumerate(factors):
        for value, power, nodes, c in _views(factor.value, factor.exponent, m.cache):
            if isinstance(exponent, Fraction):
                if power != exponent:
                    continue
                bound = m
            else:
                seen = m.fact(exponent)
                if seen is not None and seen != power:
                    continue
                bound = m.with_fact(exponent, power)
            bound = bound.add_nodes(nodes)
            for seen, views in _layouts(value, factor.views):
                inner = bound
                if outer or views:
                    # the factor is ``views(seen)`` in this frame, and what its pattern matches below is in the
                    # frame views(seen) lands in: the rule composes them (``rules/_norm.py``, ``check_layouts``)
                    # and proves restores put back exactly the reduced axes
                    inner = bound.with_fact("viewed", bound.viewed() + ((frame, seen, outer + views),))
                    inner = inner.in_frame((frame, outer + views)).add_nodes(views)
                else:
                    # read as it is, recorded too: a value read both ways in one frame (a mean transposed in the
                    # numerator and not in m²) is in two layouts, which the rule refuses
                    inner = bound.with_fact("viewed", bound.viewed() + ((frame, seen, ()),))
                for found in leaf.match(seen, inner):
                    found = found.in_frame(m.frame)
                    for twinned in _match_twins(leaf, factor.twins, found):
                        yield from _assign_factors(rest, factors[:i] + factors[i + 1:], twinned, coef * c)


def _layouts(value: ir.Value, views: tuple[ir.Node, ...]) -> Iterator[tuple[ir.Value, tuple[ir.Node, ...]]]:
    """A factor under views, as (value, views) to match: first as the value the graph computes, when the views are
    Transposes read straight off it (``Transpose(x)`` is the value the graph names, as it always was), then as the
    value under the views."""
    top = algebra.transposed_top(value, views)
    if top is not None:
        yield top, ()
    yield value, views


#: how many scalings and powers a factor is seen through: real spellings take a few (Sqrt, Reciprocal, a 1/N); past
#: this a chain of a million sign flips in front of a norm would be walked again from every point of it
_MAX_VIEWS = 16


def _views(value: ir.Value, exponent: Fraction,
           cache: algebra.Cache | None) -> Iterator[tuple[ir.Value, Fraction, Trail | None, float]]:
    """``value ** exponent``, then the same seen through the scalings and powers that compute value
    (``Sqrt(v)**-1`` is ``v**-0.5``, ``(ReduceSum(x) / N)**2`` is ``N**-2 * ReduceSum(x)**2``) where the chain was
    not expanded because an intermediate is read elsewhere. Yields (base, exponent, nodes, coefficient)."""
    nodes: Trail | None = None
    coef = 1.0
    for _ in range(_MAX_VIEWS):
        yield value, exponent, nodes, coef
        view = algebra.power_view(value, cache.static if cache is not None else None)
        if view is None or not algebra.power_ok(view[1], exponent):
            return
        base, p, c, node = view
        if exponent.denominator != 1 and c <= 0:
            return
        coef *= float(c ** float(exponent)) if exponent.denominator != 1 else float(Fraction(c) ** exponent)
        value, exponent, nodes = base, p * exponent, Trail(node, nodes)


def _match_twins(leaf: Pattern, twins: tuple, m: Match) -> Iterator[Match]:
    """Twin values (the same computation written twice) must match the same pattern with the same bindings."""
    if not twins:
        yield m
        return
    for found in leaf.match(twins[0], m):
        yield from _match_twins(leaf, twins[1:], found)


def noop_source(node: ir.Node | None) -> ir.Value | None:
    """The input that ``node`` hands on as its result unchanged (the same numbers, dtype and shape), or None.

    Provably so, from the graph alone:
    - ``Identity``;
    - ``Cast`` to the dtype its input already has;
    - ``Reshape`` to the input's own shape: a constant target equal to the input's static shape, or
      ``Shape(data)`` of the very value it reshapes;
    - ``Dropout`` in inference: no ``training_mode`` input, or a constant false one (the ratio is then unused), and
      its mask output read by nobody (the mask is a second result a fused op could not give back). An ``is_test=0``
      attribute (Dropout before opset 7) is training, not a no-op.
    """
    if onnx_op(node) not in NOOP_OPS or not node.inputs:
        return None
    source = node.inputs[0]
    if source is None or any(a.is_ref() for a in node.attributes.values()):
        return None
    if is_op(node, "Identity"):
        return source
    if is_op(node, "Cast"):
        to = attr_value(node, "to")
        return source if to is not None and source.type is not None and source.dtype == ir.DataType(to) else None
    if is_op(node, "Reshape"):
        return source if len(node.inputs) == 2 and _reshapes_to_own_shape(source, node.inputs[1]) else None
    mask = node.outputs[1] if len(node.outputs) > 1 else None
    if mask is not None and (mask.uses() or mask.is_graph_output()) or attr_value(node, "is_test", 1) == 0:
        return None
    training = node.inputs[2] if len(node.inputs) > 2 else None
    if training is not None:
        flag = static_value(training)
        if flag is None or flag.size != 1 or bool(flag.reshape(-1)[0]):
            return None
    return source


def _reshapes_to_own_shape(data: ir.Value, target: ir.Value | None) -> bool:
    if target is None:
        return False
    shaper = target.producer()
    if is_op(shaper, "Shape") \
            and shaper.inputs[0] is data and attr_value(shaper, "start", 0) == 0 and attr_value(shaper, "end") is None:
        return True
    if data.shape is None or not all(isinstance(d, int) for d in data.shape):
        return False
    wanted = static_value(target)
    return wanted is not None and wanted.ndim == 1 and wanted.tolist() == list(data.shape)


class ThroughNoOps(Pattern):
    """``p`` at the value, or at the value a chain of no-ops (``noop_source``) hands on: the no-op nodes are part
    of the match. The rule decides what their outputs become when something else reads them (they hold p's value)."""

    def __init__(self, inner: Pattern):
        self.inner = inner
        self.name = None

    def root_ops(self) -> frozenset[str] | None:
        inner = self.inner.root_ops()
        return None if inner is None else inner | NOOP_OPS

    def _match(self, value, m):
        # farthest first: a Reshape that is a no-op is read through before a pattern takes it for a real one
        chain = [(value, m)]
        while len(chain) <= _MAX_NOOPS and value is not None:
            node = value.producer()
            value = noop_source(node) if node is not None and node.outputs[0] is value else None
            if value is not None:
                m = m.add_node(node, None)
                chain.append((value, m))
        for value, m in reversed(chain):
            yield from self.inner.match(value, m)


class ThroughCasts(Pattern):
    """``p`` at the value, or at the value a chain of Casts the normal form reads through (``algebra.cast_view``)
    computes it from, nearest first: a reduction of ``Cast32(x16)`` is a reduction of x, held wider (fp16 tools
    widen each statistic's input). The Casts are part of the match; the rule proves none rounds below the norm's
    precision, as for every Cast the normal form reads."""

    def __init__(self, inner: Pattern):
        self.inner = inner
        self.name = None

    def root_ops(self) -> frozenset[str] | None:
        inner = self.inner.root_ops()
        return None if inner is None else inner | {"Cast"}

    def _match(self, value, m):
        for _ in range(_MAX_NOOPS):
            yield from self.inner.match(value, m)
            node = value.producer() if value is not None else None
            if node is None or node.outputs[0] is not value or not algebra.cast_view(node):
                return
            m, value = m.add_node(node, None), node.inputs[0]


def through_casts(p: Pattern) -> Pattern:
    """``p``, or ``p`` read through the Casts in front of it (``ThroughCasts``)."""
    return ThroughCasts(p)


def noop_in_doubt(value: ir.Value | None, depth: int = 8) -> bool:
    """Whether ``value`` is computed through a Cast or Reshape that ``noop_source`` could not prove a no-op for want
    of what onnx's inference left unknown (its input's dtype, or a dim of its input's shape), within ``depth`` ops
    of no-op kinds: the symbolic inference might prove it one, and a pattern read through it."""
    for _ in range(depth):
        node = value.producer() if value is not None else None
        if onnx_op(node) not in NOOP_OPS or not node.inputs \
                or node.inputs[0] is None:
            return False
        source = node.inputs[0]
        unknown_dim = source.shape is None or any(
            not isinstance(d, int) and (d.value is None or d.value.startswith("unk__")) for d in source.shape)
        if noop_source(node) is None and ((is_op(node, "Cast") and source.type is None) or
                                          (is_op(node, "Reshape") and unknown_dim)):
            return True
        value = source
    return False


def through_noops(p: Pattern) -> Pattern:
    """``p``, seen through any no-ops in front of it (paddle2onnx writes ``Add -> Identity -> Identity -> norm``)."""
    return ThroughNoOps(p)


def noop_outputs(value: ir.Value, source: ir.Value) -> list[ir.Value]:
    """The outputs of the no-op chain that hands ``source`` on as ``value`` (``value`` included, ``source`` not):
    each holds ``source``'s tensor."""
    found = []
    while value is not source:
        found.append(value)
        value = noop_source(value.producer())
        if value is None:
            raise ValueError("not a chain of no-ops")
    return found


def maybe_cast(p: Pattern, cast: str, name: str | None = None) -> Pattern:
    """``p`` or ``Cast(p)``: exporters add Casts around statistics in mixed precision. The Cast node is bound to
    ``cast`` so checks can read its target type; the value after the optional Cast is bound to ``name``."""
    return Either(Op("Cast", p, name=cast), p, name=name)


def _same_computation(node: ir.Node, twin: ir.Node, matched_inputs: int) -> bool:
    """A second node bound to an already bound name must compute the same thing: same op, same attributes, and the
    same values in the inputs the pattern does not look at (ReduceMean's axes, Unsqueeze's axes)."""
    if (op_key(node), len(node.inputs)) != (op_key(twin), len(twin.inputs)):
        return False
    if [None if v is None else algebra.key(v) for v in node.inputs[matched_inputs:]] != \
            [None if v is None else algebra.key(v) for v in twin.inputs[matched_inputs:]]:
        return False
    mine = {k: a.value for k, a in node.attributes.items()}
    theirs = {k: a.value for k, a in twin.attributes.items()}
    return mine == theirs


def _match_all(values: list, patterns: list, m: Match, framed: bool = False) -> Iterator[Match]:
    """Each value matched by its pattern; ``framed``: each in the frame of its own value."""
    if not patterns:
        yield m
        return
    head = patterns[0]
    if head is None:
        yield from _match_all(values[1:], patterns[1:], m, framed)
        return
    for found in head.match(values[0], m.in_frame((values[0], ())) if framed else m):
        yield from _match_all(values[1:], patterns[1:], found, framed)


def attr_value(node: ir.Node, name: str, default: object = None) -> object:
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref():
        return default
    return attr.value
