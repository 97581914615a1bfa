"""Sums of products: the normal form that norm patterns are matched on.

A value computed by a chain of Add, Sub, Neg, Mul, Div, Reciprocal, Pow (constant exponent) and Sqrt is written as
``sum_i c_i * prod_j f_ij ** e_ij``: a list of monomials, each a numeric coefficient and factors with rational
exponents. Exporters spell one formula in many orders and associations (``d * inv * gamma``, ``gamma * d / std``,
``x*k + (-mean*k + beta)``); they all reach the same monomials, so a rule states the math once.

What is expanded, and why it stays exact:
- products and quotients are flattened; a one-element constant that does not raise the rank folds into the
  coefficient;
- a product of a sum with a monomial is distributed (a product of two sums is not: ``d * d`` stays ``d ** 2``);
- powers multiply exponents only where that holds for every real base, negative and zero included (``(f**2)**0.5``
  is ``|f|``, not ``f``; ``f * f**-1`` is NaN at 0, not 1): see ``_power_ok`` and ``_merge_ok``;
- a sum or product whose value is also read outside the chain stays a unit (its readers need the value itself, and
  the region must not swallow it); so does every constant, every other op, and a Cast (which changes precision).
Factors are compared as computations (two nodes with the same op, attributes and inputs are one factor), so the
twin ``x - mean`` nodes of old exports still make a square.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable

import numpy as np
import onnx_ir as ir

from lnfuse.constants import is_static, static_value

CHAIN = frozenset({"Add", "Sub", "Neg", "Mul", "Div", "Reciprocal", "Pow", "Sqrt", "Identity"})
#: ops whose result is a multiple of a power of one input (seen through when a factor is matched)
POWERS = frozenset({"Sqrt", "Reciprocal", "Pow", "Div", "Mul", "Neg"})
_MAX_TERMS = 8
_MAX_CHAIN = 48
_KEY_DEPTH = 4
_SMALL_CONSTANT = 64
_IMPURE = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                     "Bernoulli", "Dropout"})


@dataclass(frozen=True)
class Factor:
    """``value ** exponent``; ``twins`` are other values computing the same thing (merged into this factor)."""

    value: ir.Value
    exponent: Fraction
    twins: tuple[ir.Value, ...] = ()


@dataclass(frozen=True)
class Monomial:
    coef: float
    factors: tuple[Factor, ...]


@dataclass(frozen=True)
class Expansion:
    terms: tuple[Monomial, ...]
    nodes: tuple[ir.Node, ...]  # the chain nodes the terms were read through


@dataclass
class Cache:
    """What was worked out about a graph while it does not change: the engine keeps one per pass (a rule's matching
    over one graph) and drops it before rewriting. Patterns tried at one node after another meet the same values
    again and again; each is expanded, and each producer chain judged static or not, once."""

    #: ``constants.is_static`` answers
    static: dict = field(default_factory=dict)
    #: ``expand`` results
    expansions: dict = field(default_factory=dict)


def expand(value: ir.Value, cache: Cache | None = None) -> Expansion:
    """The normal form of ``value``: its monomials, and the nodes they were read through."""
    if cache is not None and value in cache.expansions:
        return cache.expansions[value]
    static = cache.static if cache is not None else None
    walk = _Walk(_chain(value, static), static)
    terms = _expand(value, walk)
    found = Expansion(tuple(terms), tuple(walk.nodes))
    if cache is not None:
        cache.expansions[value] = found
    return found


def power_view(value: ir.Value, static: dict | None = None) -> tuple[ir.Value, Fraction, float, ir.Node] | None:
    """``(base, p, c, node)`` when ``value`` is ``c * base ** p`` by one node: Sqrt, Reciprocal, Pow, Div(1, base),
    Neg, or a product or quotient with a one-element constant (``ReduceSum(x) / N``)."""
    node = value.producer()
    if node is None or not _is_onnx(node) or node.op_type not in POWERS or node.outputs[0] is not value:
        return None
    ins = node.inputs
    if node.op_type == "Sqrt":
        return ins[0], Fraction(1, 2), 1.0, node
    if node.op_type == "Reciprocal":
        return ins[0], Fraction(-1), 1.0, node
    if node.op_type == "Neg":
        return ins[0], Fraction(1), -1.0, node
    if node.op_type == "Pow":
        p = _scalar(ins[1], node, static)
        return (ins[0], p, 1.0, node) if p is not None else None
    if node.op_type == "Mul":
        for i in (0, 1):
            c = _scalar(ins[i], node, static)
            if c is not None:
                return ins[1 - i], Fraction(1), float(c), node
        return None
    c = _scalar(ins[1], node, static)
    if c is not None and c != 0:
        return ins[0], Fraction(1), 1.0 / float(c), node
    c = _scalar(ins[0], node, static)
    return (ins[1], Fraction(-1), float(c), node) if c is not None else None


def power_ok(e: Fraction, p: Fraction) -> bool:
    """``(f**e)**p == f**(e*p)`` for every real f (NaN where either side is NaN)."""
    if e.denominator == 1 and p.denominator == 1:
        return True
    return (e * p).denominator != 1 and not (e.denominator == 1 and e.numerator % 2 == 0)


def key(value: ir.Value, depth: int = _KEY_DEPTH) -> tuple:
    """Equal keys: the values are computed by the same pure ops from the same inputs. Only ONNX's own ops are known
    pure: another domain's op may be random or stateful, so each of its results is a value of its own."""
    node = value.producer()
    if node is None or node.op_type == "Constant":
        # exporters write the same axes or exponent as separate initializers: equal numbers are the same value
        found = _constant_key(value)
        if found is not None:
            return found
    if node is None or depth == 0 or not _is_onnx(node) or node.op_type in _IMPURE or node.op_type == "Constant" or \
            any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) or a.is_ref()
                for a in node.attributes.values()):
        return ("value", id(value))
    attrs = tuple(sorted((name, repr(a.value)) for name, a in node.attributes.items()))
    inputs = tuple(None if v is None else key(v, depth - 1) for v in node.inputs)
    return (node.op_type, node.domain, attrs, list(node.outputs).index(value), inputs)


# ---- internals ----------------------------------------------------------------------------------------------

def _constant_key(value: ir.Value) -> tuple | None:
    """A small constant (up to _SMALL_CONSTANT elements, by its declared shape: weights are never read) is known by
    its dtype, shape and bytes."""
    shape = value.shape
    if shape is None or not all(isinstance(d, int) for d in shape) or int(np.prod(list(shape))) > _SMALL_CONSTANT:
        return None
    array = static_value(value)
    return None if array is None else ("const", array.dtype.str, array.shape, array.tobytes())


def _is_onnx(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def _is_chain(node: ir.Node | None) -> bool:
    return node is not None and _is_onnx(node) and node.op_type in CHAIN and len(node.outputs) == 1


def _chain(root: ir.Value, static: dict | None) -> set[ir.Node]:
    """Chain nodes reachable from root whose results are read only inside the chain (root's own node excepted)."""
    chain: set[ir.Node] = set()
    stack = [root]
    while stack and len(chain) < _MAX_CHAIN:
        value = stack.pop()
        node = value.producer()
        if not _is_chain(node) or node in chain or is_static(value, 0, static):
            continue
        chain.add(node)
        stack.extend(v for v in node.inputs if v is not None)
    top = root.producer()
    # a node whose result is also read outside leaves the chain; then the chain nodes it read are checked again
    queue = list(chain)
    while queue:
        node = queue.pop()
        if node is top or node not in chain:
            continue
        out = node.outputs[0]
        if out.is_graph_output() or any(user not in chain for user, _ in out.uses()):
            chain.discard(node)
            queue.extend(v.producer() for v in node.inputs if v is not None and v.producer() in chain)
    # keep only what is still reachable from the root through the chain
    reachable, stack = set(), [top]
    while stack:
        node = stack.pop()
        if node not in chain or node in reachable:
            continue
        reachable.add(node)
        stack.extend(v.producer() for v in node.inputs if v is not None and v.producer() is not None)
    return reachable


def _leaf(value: ir.Value) -> list[Monomial]:
    return [Monomial(1.0, (Factor(value, Fraction(1)),))]


def _scalar(value: ir.Value | None, node: ir.Node, static: dict | None) -> Fraction | None:
    """A one-element constant operand that does not raise the rank of ``node``'s result, as an exact fraction."""
    if value is None:
        return None
    # a constant the graph leaves untyped (in a function no single call signature types) has its value's shape
    shape = value.shape if value.shape is not None else _static_shape(value, static)
    if shape is None or not shape.is_static() or any(int(d) != 1 for d in shape):
        return None
    # the result always has the constant's rank: it is the other operand's rank that must be at least as large
    others = [v for v in node.inputs if v is not None and v is not value] or [value]
    if len(shape) > 0 and any(v.shape is None or len(v.shape) < len(shape) for v in others):
        return None
    array = static_value(value, static)
    if array is None or array.dtype.kind not in "fiu":
        return None
    number = float(np.asarray(array).reshape(-1)[0])
    if not np.isfinite(number):
        return None
    return Fraction(number)


def _static_shape(value: ir.Value, static: dict | None) -> ir.Shape | None:
    array = static_value(value, static)
    return None if array is None else ir.Shape(np.shape(array))


@dataclass
class _Walk:
    """One expansion in progress: the chain it may read through, the nodes read so far, the monomials of the values
    already expanded, and the ``is_static`` answers of the pass."""

    chain: set[ir.Node]
    static: dict | None
    nodes: list[ir.Node] = field(default_factory=list)
    done: dict = field(default_factory=dict)


def _expand(value: ir.Value, walk: _Walk) -> list[Monomial]:
    if value in walk.done:
        return walk.done[value]
    node = value.producer()
    if node is None or node not in walk.chain:
        return _leaf(value)
    result = _expand_node(node, walk)
    if result is None or len(result) > _MAX_TERMS:
        return _leaf(value)
    if node not in walk.nodes:
        walk.nodes.append(node)
    walk.done[value] = result
    return result


def _expand_node(node: ir.Node, walk: _Walk) -> list[Monomial] | None:
    op = node.op_type
    ins = node.inputs
    if op == "Identity":
        return _expand(ins[0], walk)
    if op in ("Add", "Sub"):
        a, b = _expand(ins[0], walk), _expand(ins[1], walk)
        return a + (b if op == "Add" else _scaled(b, -1.0))
    if op == "Neg":
        return _scaled(_expand(ins[0], walk), -1.0)
    if op == "Mul":
        for i in (0, 1):
            c = _scalar(ins[i], node, walk.static)
            if c is not None:
                return _scaled(_expand(ins[1 - i], walk), float(c))
        return _product(_operand(ins[0], walk), _operand(ins[1], walk))
    if op == "Div":
        c = _scalar(ins[1], node, walk.static)
        if c is not None:
            return None if c == 0 else _scaled(_expand(ins[0], walk), 1.0 / float(c))
        inverse = _power(_operand(ins[1], walk), Fraction(-1))
        numerator = _scalar(ins[0], node, walk.static)
        if numerator is not None:
            return None if inverse is None else _scaled(inverse, float(numerator))
        return None if inverse is None else _product(_operand(ins[0], walk), inverse)
    if op in ("Reciprocal", "Sqrt", "Pow"):
        p = Fraction(-1) if op == "Reciprocal" else Fraction(1, 2) if op == "Sqrt" else \
            _scalar(ins[1], node, walk.static)
        if p is None:
            return None
        return _power(_operand(ins[0], walk), p)
    return None


def _operand(value: ir.Value, walk: _Walk) -> list[Monomial]:
    """An operand of a product: its monomials, or itself as one factor when it is a sum of several."""
    terms = _expand(value, walk)
    return terms if len(terms) == 1 else _leaf(value)


def _scaled(terms: Iterable[Monomial], c: float) -> list[Monomial]:
    return [Monomial(t.coef * c, t.factors) for t in terms]


def _product(a: list[Monomial], b: list[Monomial]) -> list[Monomial] | None:
    if len(a) > 1 and len(b) > 1:
        return None
    out = []
    for s in a:
        for t in b:
            factors = _merge(s.factors + t.factors)
            if factors is None:
                return None
            out.append(Monomial(s.coef * t.coef, factors))
    return out


def _power(terms: list[Monomial], p: Fraction) -> list[Monomial] | None:
    if len(terms) != 1:
        return None
    (t,) = terms
    if p.denominator != 1 and t.coef <= 0:
        return None
    if t.coef == 0 and p < 0:
        return None
    if not all(power_ok(f.exponent, p) for f in t.factors):
        return None
    coef = float(t.coef ** float(p)) if p.denominator != 1 else float(Fraction(t.coef) ** p)
    return [Monomial(coef, tuple(Factor(f.value, f.exponent * p, f.twins) for f in t.factors))]


def _merge(factors: tuple[Factor, ...]) -> tuple[Factor, ...] | None:
    """Factors of one computation multiplied together: exponents add where that is exact, else the product is not
    expanded (None)."""
    merged: list[Factor] = []
    keys: list[tuple] = []
    for f in factors:
        k = key(f.value)
        if k in keys:
            i = keys.index(k)
            old = merged[i]
            if not _merge_ok(old.exponent, f.exponent):
                return None
            twins = old.twins + ((f.value,) if f.value is not old.value and f.value not in old.twins else ()) + \
                tuple(t for t in f.twins if t not in old.twins)
            merged[i] = Factor(old.value, old.exponent + f.exponent, twins)
        else:
            keys.append(k)
            merged.append(f)
    return tuple(merged)


def _merge_ok(a: Fraction, b: Fraction) -> bool:
    """``f**a * f**b == f**(a+b)`` for every real f: same sign (0 * inf is NaN), and no NaN lost for f < 0."""
    if (a > 0) != (b > 0):
        return False
    if a.denominator == 1 and b.denominator == 1:
        return True
    return (a + b).denominator != 1
