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
  the region must not swallow it); so does every constant and every other op;
- a Cast of a float to a number is read through (``cast_view``), and so is a Cast back to a float of such a Cast:
  it changes the rounding, not the number. The Casts read are in the region, and a rule proves each keeps at least
  its norm's precision (a Cast to a narrower float, or to an integer, computes something else: ``rules/_norm.py``,
  ``check_casts``, which names it).
Factors are compared as computations (two nodes with the same op, attributes and inputs are one factor), so the
twin ``x - mean`` nodes of old exports still make a square.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable

import numpy as np
import onnx_ir as ir

from lnfuse.index.constants import is_static, static_value
from lnfuse.index.ops import is_op, onnx_op

CHAIN = frozenset({"Add", "Sub", "Neg", "Mul", "Div", "Reciprocal", "Pow", "Sqrt", "Identity"})
#: ops that hand on one operand unchanged where a proof says so (``_guarded``): clamps at 0 of a quantity that is
#: >= 0, and Where whose condition is known or implies the other branch equals the one taken
GUARDS = frozenset({"Max", "Relu", "Clip", "Where"})
#: ops that only move elements (``_viewed``): an Expand to its input's own shape, a Reshape that only inserts unit
#: dims, a Transpose. (An Unsqueeze after the inverse root is the rules' own form, ``inverse_sqrt``: it restores the
#: axes of a variance it does not read directly.)
VIEWS = frozenset({"Expand", "Reshape", "Transpose"})
#: reductions the proofs of ``_guarded`` read (what each computes per slice of the reduced axes)
_REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceMin", "ReduceMax"})
#: ops whose result is a multiple of a power of one input (seen through when a factor is matched)
POWERS = frozenset({"Sqrt", "Reciprocal", "Pow", "Div", "Mul", "Neg", "Identity"})
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
    #: ops above this factor that only move its elements, outermost first: Reshapes that only insert unit dims (the
    #: keepdims=0 statistics that jax2tf and jnp re-broadcast as a whole) and Transposes (jax2tf's vmap computes in
    #: a permuted layout). The factor stands for ``views(value) ** exponent``; ``view_axes`` says where each axis
    #: of value lands, and the rules prove the layouts agree.
    views: tuple[ir.Node, ...] = ()


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
    #: ``key`` answers, by value and depth
    keys: dict = field(default_factory=dict)
    #: the norms found reading a shared statistic (``rules/_shared_stats``), by reader, input and patterns: each
    #: norm of an input asks about every other's readers, which found anew each time is quadratic in their number
    siblings: dict = field(default_factory=dict)


def expand(value: ir.Value, cache: Cache | None = None) -> Expansion:
    """The normal form of ``value``: its monomials, and the nodes they were read through."""
    if cache is not None and value in cache.expansions:
        return cache.expansions[value]
    static = cache.static if cache is not None else None
    walk = _Walk(_chain(value, static), static, keys=cache.keys if cache is not None else {})
    terms = _expand(value, walk)
    found = Expansion(tuple(terms), tuple(walk.nodes))
    if cache is not None:
        cache.expansions[value] = found
    return found


def power_view(value: ir.Value, static: dict | None = None) -> tuple[ir.Value, Fraction, float, ir.Node] | None:
    """``(base, p, c, node)`` when ``value`` is ``c * base ** p`` by one node: Identity, Sqrt, Reciprocal, Pow,
    Div(1, base), Neg, a product or quotient with a one-element constant (``ReduceSum(x) / N``), or a Cast the
    normal form reads through (``cast_view``)."""
    node = value.producer()
    if node is not None and node.outputs[0] is value and cast_view(node):
        return node.inputs[0], Fraction(1), 1.0, node
    if node is None or onnx_op(node) not in POWERS or node.outputs[0] is not value:
        return None
    ins = node.inputs
    if is_op(node, "Identity"):
        # paddle2onnx writes one after nearly every op: a mean read by two twin Subs is an Identity's output
        return ins[0], Fraction(1), 1.0, node
    if is_op(node, "Sqrt"):
        return ins[0], Fraction(1, 2), 1.0, node
    if is_op(node, "Reciprocal"):
        return ins[0], Fraction(-1), 1.0, node
    if is_op(node, "Neg"):
        return ins[0], Fraction(1), -1.0, node
    if is_op(node, "Pow"):
        p = _scalar(ins[1], node, static)
        return (ins[0], p, 1.0, node) if p is not None else None
    if is_op(node, "Mul"):
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


def key(value: ir.Value, depth: int = _KEY_DEPTH, memo: dict | None = None) -> tuple:
    """Equal keys: the values are computed by the same pure ops from the same inputs. Only ONNX's own ops are known
    pure: another domain's op may be random or stateful, so each of its results is a value of its own. ``memo``
    keeps the answers while the graph does not change (``Cache.keys``)."""
    if memo is None:
        return _key(value, depth, None)
    found = memo.get((value, depth))
    if found is None:
        found = memo[(value, depth)] = _key(value, depth, memo)
    return found


def _key(value: ir.Value, depth: int, memo: dict | None) -> tuple:
    node = value.producer()
    if node is None or is_op(node, "Constant"):
        # exporters write the same axes or exponent as separate initializers: equal numbers are the same value
        found = _constant_key(value)
        if found is not None:
            return found
    if node is None or depth == 0 or onnx_op(node) in (None, *_IMPURE) or is_op(node, "Constant") or \
            any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) or a.is_ref()
                for a in node.attributes.values()):
        return ("value", id(value))
    attrs = tuple(sorted((name, repr(a.value)) for name, a in node.attributes.items()))
    inputs = tuple(None if v is None else key(v, depth - 1, memo) for v in node.inputs)
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



def _is_chain(node: ir.Node | None) -> bool:
    return node is not None and (onnx_op(node) in CHAIN | GUARDS | VIEWS or cast_view(node)) and \
        len(node.outputs) == 1


#: the dtypes whose Casts the normal form reads through: numbers, whose Cast keeps the number up to rounding
_NUMBERS = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE,
                      ir.DataType.INT8, ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64,
                      ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64})
_FLOATS = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE})


def cast_view(node: ir.Node | None) -> bool:
    """A Cast the normal form reads as its input: from a float to a number, or back to a float from a Cast of a
    float (fp16 tools keep the statistics in float32 with Casts around each op: ``Cast16(ReduceMean(Cast32(x)))``).
    What it rounds is not the normal form's to judge: each Cast read stays in the region, and the rule refuses one
    that rounds below the norm's precision or leaves the floats."""
    if not is_op(node, "Cast") or not node.inputs or node.inputs[0] is None:
        return False
    source, to = node.inputs[0], node.attributes.get("to")
    if source.type is None or to is None or to.is_ref() or ir.DataType(to.value) not in _NUMBERS:
        return False
    if source.dtype in _FLOATS:
        return True
    inner = source.producer()
    return source.dtype in _NUMBERS and ir.DataType(to.value) in _FLOATS and inner is not None and \
        inner.outputs[0] is source and cast_view(inner) and inner.inputs[0].dtype in _FLOATS


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
    # bfloat16 is numpy's kind "V" (ml_dtypes), a float all the same: a bf16 norm's exponent is a number
    if array is None or (array.dtype.kind not in "fiu" and array.dtype != ir.DataType.BFLOAT16.numpy()):
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
    #: ``key`` answers (``Cache.keys``)
    keys: dict = field(default_factory=dict)


def _expand(value: ir.Value, walk: _Walk) -> list[Monomial]:
    if value in walk.done:
        return walk.done[value]
    node = value.producer()
    if node is None or node not in walk.chain:
        return _leaf(value)
    result = _expand_node(node, walk)
    if result is None or len(result) > _MAX_TERMS:
        return _leaf(value)
    if node not in walk.nodes and not _only_transposed(result, value):
        walk.nodes.append(node)
    walk.done[value] = result
    return result


def _only_transposed(terms: list[Monomial], value: ir.Value) -> bool:
    """``value`` is Transposes of one leaf, read straight off it: the matcher takes either the value itself or the
    leaf under the Transposes (``pattern._layouts``), and adds the Transposes to the region only in the second case,
    so they are not read here."""
    if len(terms) != 1 or terms[0].coef != 1 or len(terms[0].factors) != 1:
        return False
    (f,) = terms[0].factors
    return f.exponent == 1 and transposed_top(f.value, f.views) is value


def transposed_top(value: ir.Value, views: tuple[ir.Node, ...]) -> ir.Value | None:
    """The value the graph names for ``views`` of ``value`` when they are Transposes read straight off it, one from
    the other (``Transpose(x)``: the matcher may take it as it is); None otherwise."""
    if not views:
        return None
    top = value
    for node in reversed(views):
        if not is_op(node, "Transpose") or node.inputs[0] is not top:
            return None
        top = node.outputs[0]
    return top


def _expand_node(node: ir.Node, walk: _Walk) -> list[Monomial] | None:
    op = onnx_op(node)
    ins = node.inputs
    if op == "Identity" or cast_view(node):
        return _expand(ins[0], walk)
    if op in GUARDS:
        return _guarded(node, walk)
    if op in VIEWS:
        return _viewed(node, walk)
    if op in ("Add", "Sub"):
        for i in (1, 0):
            # x + 0 and x - 0 are the number x for every x (NaN and infinities included), when the zeros do not
            # broadcast the result beyond x: Flax's RMSNorm through jax2tf subtracts a zero mean expanded to a
            # run-time shape. A constant zero stays a term: it is a rule's parameter (epsilon 0 is accepted).
            if not is_static(ins[i], 0, walk.static) and uniform(ins[i], walk.static) == 0 and \
                    _same_shape(node.outputs[0], ins[1 - i]):
                _take_cone([ins[i]], node, walk)
                other = _expand(ins[1 - i], walk)
                return other if i == 1 or op == "Add" else _scaled(other, -1.0)
        a, b = _expand(ins[0], walk), _expand(ins[1], walk)
        return a + (b if op == "Add" else _scaled(b, -1.0))
    if op == "Neg":
        return _scaled(_expand(ins[0], walk), -1.0)
    if op == "Mul":
        for i in (0, 1):
            c = _scalar(ins[i], node, walk.static)
            if c is not None:
                return _scaled(_expand(ins[1 - i], walk), float(c))
        return _product(_operand(ins[0], walk), _operand(ins[1], walk), walk.keys)
    if op == "Div":
        c = _scalar(ins[1], node, walk.static)
        if c is not None:
            return None if c == 0 else _scaled(_expand(ins[0], walk), 1.0 / float(c))
        inverse = _power(_operand(ins[1], walk), Fraction(-1))
        numerator = _scalar(ins[0], node, walk.static)
        if numerator is not None:
            return None if inverse is None else _scaled(inverse, float(numerator))
        return None if inverse is None else _product(_operand(ins[0], walk), inverse, walk.keys)
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


def _product(a: list[Monomial], b: list[Monomial], memo: dict | None = None) -> list[Monomial] | None:
    if len(a) > 1 and len(b) > 1:
        return None
    out = []
    for s in a:
        for t in b:
            factors = _merge(s.factors + t.factors, memo)
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
    return [Monomial(coef, tuple(Factor(f.value, f.exponent * p, f.twins, f.views) for f in t.factors))]


def _merge(factors: tuple[Factor, ...], memo: dict | None = None) -> tuple[Factor, ...] | None:
    """Factors of one computation multiplied together: exponents add where that is exact, else the product is not
    expanded (None)."""
    merged: list[Factor] = []
    keys: list[tuple] = []
    for f in factors:
        k = (key(f.value, memo=memo), _views_key(f.views))
        if k in keys:
            i = keys.index(k)
            old = merged[i]
            if not _merge_ok(old.exponent, f.exponent):
                return None
            twins = old.twins + ((f.value,) if f.value is not old.value and f.value not in old.twins else ()) + \
                tuple(t for t in f.twins if t not in old.twins)
            merged[i] = Factor(old.value, old.exponent + f.exponent, twins, old.views)
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


# ---- guards and views: ops that are the identity where a proof says so --------------------------------------------
# Each is read through only when the proof holds for every real input; otherwise the op's result stays a unit (a
# leaf), exactly as before. What is proved is the value in exact arithmetic: a clamp at 0 of E[x²] - E[x]² only acts
# on rounding error, which the fused op (a two-pass variance, never negative) does not make in the first place.

#: ops whose result holds the elements of their first input, rearranged or repeated
_MOVES = frozenset({"Expand", "Reshape", "Unsqueeze", "Squeeze", "Identity", "Flatten", "Tile", "Transpose"})


def uniform(value: ir.Value | None, static: dict | None = None, depth: int = 0) -> float | None:
    """The number every element of ``value`` holds, when one number fills it: a small constant of equal elements,
    ``ConstantOfShape``, or a move (Expand, Reshape...) of such a value to any shape, run-time shapes included.
    Large constants are not read (None)."""
    if value is None or depth > _KEY_DEPTH * 2:
        return None
    node = value.producer()
    if node is not None and onnx_op(node) in _MOVES and node.outputs[0] is value:
        return uniform(node.inputs[0], static, depth + 1)
    if node is not None and is_op(node, "ConstantOfShape"):
        fill = node.attributes.get("value")
        if fill is None:
            return 0.0
        array = fill.value.numpy() if not fill.is_ref() else None
        return None if array is None or array.size != 1 else float(array.reshape(-1)[0])
    shape = value.shape
    if shape is None or not shape.is_static() or int(np.prod([int(d) for d in shape])) > _SMALL_CONSTANT:
        return None
    array = static_value(value, static)
    if array is None or array.size == 0 or array.dtype.kind not in "fiub":
        return None
    flat = np.asarray(array, dtype=np.float64).reshape(-1)
    return float(flat[0]) if np.all(flat == flat[0]) else None


def _dims_equal(a, b) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a is not None and b is not None and a.value is not None and a.value == b.value


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    """The two values have one shape: known dims equal, symbolic dims the same named symbol."""
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return False
    return all(_dims_equal(x, y) for x, y in zip(a.shape, b.shape))


def _viewed(node: ir.Node, walk: _Walk) -> list[Monomial] | None:
    """An Expand to its input's own shape is its input, element for element. A Reshape or Unsqueeze that only
    inserts unit dims (``Reshape(ReduceSum(x, keepdims=0), [B, S, 1])``: the axes a statistic dropped, restored)
    commutes with the elementwise ops under it, so its input's monomials are kept, each factor marked as restored by
    it; the rules prove a restore puts back exactly the axes its statistic reduced. Every factor must have the
    Reshape's input shape: a factor that broadcasts under it would be reshaped differently alone.

    A Transpose commutes with elementwise ops too (``T(w * h) = T(w) * T(h)``) when every factor has the
    Transpose's rank: broadcasting pairs axes by position, and permuting operands of one rank permutes the pairs.
    A factor of lower rank would be padded on the left first, which a permutation of its own axes does not say.
    The factors are marked with the Transpose; the rules compose the permutations and prove the norm's layouts
    agree (``rules/_norm.py``, ``check_layouts``)."""
    source = node.inputs[0]
    if source is None:
        return None
    if is_op(node, "Expand"):
        return _expand(source, walk) if _same_shape(node.outputs[0], source) else None
    if is_op(node, "Transpose"):
        if transpose_perm(node) is None:
            return None
        terms = _expand(source, walk)
        rank = len(source.shape)
        if not all(f.value.shape is not None and len(f.value.shape) == rank for t in terms for f in t.factors):
            return None
    else:
        if not _inserts_unit_dims(node):
            return None
        terms = _expand(source, walk)
        for t in terms:
            if not all(_same_shape(f.value, source) for f in t.factors):
                return None
    return [Monomial(t.coef, tuple(Factor(f.value, f.exponent, f.twins, (node,) + f.views) for f in t.factors))
            for t in terms]


def transpose_perm(node: ir.Node) -> list[int] | None:
    """The permutation of a Transpose whose input rank is known (the default reverses the axes): output axis i is
    input axis perm[i]. None when it is not a permutation of the input's axes."""
    source = node.inputs[0] if node.inputs else None
    if source is None or source.shape is None or onnx_op(node) is None:
        return None
    rank = len(source.shape)
    attr = node.attributes.get("perm")
    if attr is not None and attr.is_ref():
        return None
    perm = list(range(rank))[::-1] if attr is None else [int(a) for a in attr.value]
    return perm if sorted(perm) == list(range(rank)) else None


def view_axes(views: tuple[ir.Node, ...], rank: int) -> list[int] | None:
    """Where each axis of a factor of rank ``rank`` lands after ``views`` (outermost first): a Transpose moves input
    axis ``perm[i]`` to axis i, a unit-dim Reshape keeps the order and skips the inserted dims, and between two views
    of different ranks the inner result broadcasts onto the outer input aligned on the right. None when a view's
    ranks are unknown."""
    axes = list(range(rank))
    for node in reversed(views):
        source, out = node.inputs[0], node.outputs[0]
        if source.shape is None or out.shape is None or len(source.shape) < rank:
            return None
        axes = [a + len(source.shape) - rank for a in axes]
        step = _view_step(node)
        if step is None:
            return None
        axes, rank = [step[a] for a in axes], len(out.shape)
    return axes


def _view_step(node: ir.Node) -> list[int] | None:
    """Input axis -> output axis of one view."""
    if is_op(node, "Transpose"):
        perm = transpose_perm(node)
        return None if perm is None else [perm.index(a) for a in range(len(perm))]
    have, want = list(node.inputs[0].shape), list(node.outputs[0].shape)
    step, i = [], 0
    for j, d in enumerate(want):
        if i < len(have) and _dims_equal(d, have[i]):
            step.append(j)
            i += 1
    return step if i == len(have) else None


def _views_key(views: tuple[ir.Node, ...]) -> tuple:
    """Views that move elements alike: Transposes by their permutation (twin Transposes of one value are one
    factor), other views by node."""
    return tuple(("Transpose", tuple(transpose_perm(n) or ())) if is_op(n, "Transpose") else ("node", id(n))
                 for n in views)


def _inserts_unit_dims(node: ir.Node) -> bool:
    """The output's dims are the input's with unit dims inserted (a Reshape never reorders elements, so these
    are the input's elements, each row where the kept statistic has it)."""
    source, out = node.inputs[0], node.outputs[0]
    if source.shape is None or out.shape is None or len(out.shape) <= len(source.shape):
        return False
    have, want = list(source.shape), list(out.shape)
    i = 0
    for d in want:
        if i < len(have) and _dims_equal(d, have[i]):
            i += 1
        elif d != 1:
            return False
    return i == len(have)


def _guarded(node: ir.Node, walk: _Walk) -> list[Monomial] | None:
    op = onnx_op(node)
    if op == "Where":
        return _where(node, walk)
    operand = _clamped_at_zero(node, walk.static)
    if operand is None or not _same_shape(node.outputs[0], operand):
        return None
    terms = _expand(operand, walk)
    # max(v, 0) = v exactly where v >= 0: the clamp is read through only when v's normal form proves it
    return terms if nonnegative(terms, walk.static) else None


def _clamped_at_zero(node: ir.Node, static: dict | None) -> ir.Value | None:
    """v when the node is ``Max(v, 0)`` (either order), ``Relu(v)`` or ``Clip(v, 0)`` with no upper bound (or +inf)."""
    ins = [v for v in node.inputs]
    if is_op(node, "Relu"):
        return ins[0]
    if is_op(node, "Max") and len(ins) == 2 and None not in ins:
        for i in (0, 1):
            c = _scalar(ins[i], node, static)
            if c is not None and c == 0:
                return ins[1 - i]
        return None
    if is_op(node, "Clip") and ins and ins[0] is not None:
        low = ins[1] if len(ins) > 1 else None
        high = ins[2] if len(ins) > 2 else None
        lo = _scalar(low, node, static) if low is not None else node.attributes.get("min")
        lo = lo.value if isinstance(lo, ir.Attr) else lo
        if high is not None:
            array = static_value(high, static)
            if array is None or array.size != 1 or float(array.reshape(-1)[0]) != np.inf:
                return None
        elif "max" in node.attributes and node.attributes["max"].value != np.inf:
            return None
        return ins[0] if lo is not None and float(lo) == 0 else None
    return None


def _where(node: ir.Node, walk: _Walk) -> list[Monomial] | None:
    """``Where(c, a, b)`` is a where c is known true everywhere (jnp.var's ``Where(N - ddof > 0, var, NaN)``), b
    where known false; and ``Where(c, 0, d)`` is d when c implies d = 0 (Equinox's guard of constant rows,
    ``Where(min(x) == max(x) ∧ ..., 0, x - mean(x))``: where a row of x is constant, x - mean(x) is 0 in exact
    arithmetic, so both branches are the same number). Never when c or the other branch broadcasts the result
    beyond the branch taken."""
    cond, a, b = node.inputs
    if None in (cond, a, b):
        return None
    known = static_value(cond, walk.static) if is_static(cond, 0, walk.static) else None
    if known is not None and known.size > 0 and known.dtype == np.bool_ and (np.all(known) or not np.any(known)):
        taken = a if np.all(known) else b
        if not _same_shape(node.outputs[0], taken):
            return None
        _take_cone([cond, b if taken is a else a], node, walk)
        return _expand(taken, walk)
    if uniform(a, walk.static) == 0 and _same_shape(node.outputs[0], b):
        terms = _expand(b, walk)
        centred = _centred(terms, walk.static)
        if centred is not None and _implies_constant(cond, centred, walk.static):
            _take_cone([cond, a], node, walk)
            return terms
    return None


#: the most nodes a guard's proof may take with it into the region
_MAX_CONE = 32


def _take_cone(values: list[ir.Value], guard: ir.Node, walk: _Walk) -> None:
    """The nodes computing what a guard reads but no longer hands on (its condition, the branch not taken, the
    zeros): they go with the region when nothing else reads them, so the region still computes its result from the
    same inputs (and verification does not feed them random numbers). A node read elsewhere stays, its result an
    input of the region."""
    cone: list[ir.Node] = []
    todo = [v.producer() for v in values if v is not None]
    while todo and len(cone) < _MAX_CONE:
        node = todo.pop(0)
        if node is None or node in cone or node in walk.nodes or onnx_op(node) is None or \
                any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            continue
        if any(out.is_graph_output() or any(user is not guard and user not in cone for user, _ in out.uses())
               for out in node.outputs):
            continue
        cone.append(node)
        todo.extend(v.producer() for v in node.inputs if v is not None)
    walk.nodes.extend(cone)


def _centred(terms: list[Monomial], static: dict | None) -> tuple[tuple, tuple] | None:
    """(key of x, (axes, keepdims)) when the terms are x - mean(x): ``x`` and the mean of the same x, restored or
    kept, with coefficients 1 and -1."""
    if len(terms) != 2:
        return None
    for x_term, m_term in (terms, terms[::-1]):
        if len(x_term.factors) != 1 or len(m_term.factors) != 1 or x_term.coef != 1:
            continue
        (xf,), (mf,) = x_term.factors, m_term.factors
        if xf.exponent != 1 or xf.views:
            continue
        found = _moment(mf, m_term.coef, static)
        if found is not None and found[1] == 1 and found[2] == Fraction(1) and abs(found[3] + 1) <= 1e-6 and \
                found[0] == key(xf.value):
            return found[0], found[4]
    return None


def _implies_constant(cond: ir.Value, centred: tuple, static: dict | None) -> bool:
    """c implies that the row of x is constant and finite, so x - mean(x) is 0 there: c is an ``And`` (any nesting,
    any further conjuncts, which only make c true in fewer places) of ``Equal(ReduceMin(x), ReduceMax(x))`` over the
    mean's axes, kept, and ``Equal(m - m, 0)`` with m the mean (or a multiple): m - m is 0 exactly when m is finite.
    Without the second, a row of equal infinities would give 0 where x - mean(x) is NaN."""
    conjuncts, todo = [], [cond]
    while todo and len(conjuncts) < _MAX_TERMS:
        value = todo.pop()
        node = value.producer() if value is not None else None
        if node is not None and is_op(node, "And") and None not in node.inputs:
            todo.extend(node.inputs)
        elif node is not None and is_op(node, "Equal") and len(node.inputs) == 2 and \
                None not in node.inputs:
            conjuncts.append(node)
    x_key, where = centred
    constant = finite = False
    for node in conjuncts:
        found = [_reduction(v.producer(), static) for v in node.inputs]
        if None not in found and {found[0][0], found[1][0]} == {"ReduceMin", "ReduceMax"}:
            # kept dims: the extrema broadcast onto the rows they were taken over
            constant = constant or all(key(f[3]) == x_key and f[1] == where[0] and f[2] == 1 for f in found)
            continue
        for diff, zero in (node.inputs, node.inputs[::-1]):
            sub = diff.producer()
            if uniform(zero, static) != 0 or sub is None or not is_op(sub, "Sub") or \
                    key(sub.inputs[0]) != key(sub.inputs[1]):
                continue
            mean = _moment(Factor(sub.inputs[0], Fraction(1)), 1.0, static)
            finite = finite or (mean is not None and mean[:3] == (x_key, 1, 1) and mean[3] != 0 and
                                mean[4][0] == where[0])
    return constant and finite


def _reduction(node: ir.Node | None, static: dict | None) -> tuple[str, tuple, int, ir.Value] | None:
    """(op, axes as negative numbers, keepdims, input) of a reduction over known axes."""
    if node is None or onnx_op(node) not in _REDUCTIONS or not node.inputs or \
            node.inputs[0] is None or node.inputs[0].shape is None:
        return None
    rank = len(node.inputs[0].shape)
    attr = node.attributes.get("axes")
    if attr is not None:
        axes = list(attr.value)
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        array = static_value(node.inputs[1], static)
        if array is None:
            return None
        axes = array.reshape(-1).tolist()
    else:
        axes = []
    if not axes:
        noop = node.attributes.get("noop_with_empty_axes")
        if noop is not None and noop.value:
            return None
        axes = list(range(rank))
    if any(not -rank <= int(a) < rank for a in axes):
        return None
    keep = node.attributes.get("keepdims")
    return node.op_type, tuple(sorted({int(a) % rank - rank for a in axes})), \
        1 if keep is None else int(keep.value), node.inputs[0]


def _moment(factor: Factor, coef: float, static: dict | None) -> tuple | None:
    """``coef * factor`` as ``c * E[b ** p] ** e`` over some axes: (key of b, p, e, c, (axes, keepdims, views)),
    seen through the scalings and powers that compute the factor (``ReduceSum(x) / N`` is the mean when N is the
    count of the reduced elements)."""
    value, exponent = factor.value, factor.exponent
    for _ in range(_MAX_CHAIN):
        node = value.producer()
        found = _reduction(node, static)
        if found is not None:
            break
        view = power_view(value, static)
        if view is None or not power_ok(view[1], exponent):
            return None
        base, p, c, _ = view
        if exponent.denominator != 1 and c <= 0:
            return None
        coef *= float(c ** float(exponent)) if exponent.denominator != 1 else float(Fraction(c) ** exponent)
        value, exponent = base, p * exponent
    else:
        return None
    op, axes, keepdims, summand = found
    if op not in ("ReduceMean", "ReduceSum", "ReduceSumSquare"):
        return None
    count = 1
    if op != "ReduceMean":
        dims = [list(summand.shape)[a] for a in axes]
        if not all(isinstance(d, int) for d in dims) or int(np.prod(dims)) == 0:
            return None
        count = int(np.prod(dims))
    base, power = summand, Fraction(1)
    if op == "ReduceSumSquare":
        power = Fraction(2)
    else:
        inner = _expand(summand, _Walk(_chain(summand, static), static))
        if len(inner) == 1 and inner[0].coef == 1 and len(inner[0].factors) == 1 and not inner[0].factors[0].views:
            base, power = inner[0].factors[0].value, inner[0].factors[0].exponent
    # the reduction is count * E[...]: the coefficient of E[...] ** e
    return key(base), power, exponent, coef * float(count) ** float(exponent), (axes, keepdims, factor.views)


def nonnegative(terms: list[Monomial], static: dict | None = None) -> bool:
    """The sum is >= 0 for every real input (where it is a number): its terms split into
    - monomials with a coefficient >= 0 whose factors are each even powers, or powers of a mean of an even power
      (a mean of squares is >= 0, and so is any power of it); and
    - one-pass variances ``c * E[x²] - c * E[x]²`` (c > 0) over the same axes of the same x, which are >= 0 by
      Jensen's inequality (equivalently: they equal the mean of (x - E[x])²)."""
    rest = list(terms)
    moments = [_moment(t.factors[0], t.coef, static) if len(t.factors) == 1 else None for t in rest]
    paired: set[int] = set()
    for i, sq in enumerate(moments):
        if sq is None or i in paired or sq[1] != 2 or sq[2] != 1 or sq[3] <= 0:
            continue
        for j, mean in enumerate(moments):
            if j == i or j in paired or mean is None:
                continue
            if mean[0] == sq[0] and mean[1] == 1 and mean[2] == 2 and mean[4] == sq[4] and \
                    abs(mean[3] + sq[3]) <= 1e-6 * sq[3]:
                paired.update((i, j))
                break
    for i, t in enumerate(rest):
        if i in paired:
            continue
        if t.coef < 0:
            return False
        for f in t.factors:
            even = f.exponent.denominator == 1 and f.exponent.numerator % 2 == 0
            found = _moment(f, 1.0, static) if not even else None
            if not even and (found is None or found[1].denominator != 1 or found[1].numerator % 2):
                return False
    return True
