"""The part of a normalization every family shares: ``y = cast?(cast?(d) * inv_std(var + eps)) [* gamma] [+ beta]``.

LayerNormalization is this with ``d = x - mean(x)``; RMS normalization with ``d = x``. Both rules use these pieces
for the inverse square root (in every spelling exporters write), the optional affine, the Casts that carry mixed
precision, and which intermediates the fused op can still expose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from lnfuse.constants import static_value
from lnfuse.pattern import Const, Either, Match, Op, Pattern, Var, maybe_cast
from lnfuse.rule import GraphContext, Refusal, Replacement
from ._common import (FLOATS, cast_target, check_laid_out, dtype_of, is_widening, node_name, param_as, read_outside,
                      readers_outside, scalar)


def inverse_std(var_eps: Pattern) -> Pattern:
    """1 / sqrt(var + eps) in the spellings exporters write (constants checked by ``check_inverse_sqrt``)."""
    std = Op("Sqrt", var_eps, name="std")
    return Either(
        Op("Reciprocal", std, name="inv_std"),
        Op("Div", Const("one"), std, name="inv_std"),
        Op("Pow", std, Const("minus_one"), name="inv_std"),
        Op("Pow", var_eps, Const("minus_half"), name="inv_std"),
    )


def normalize(d: Pattern, var_eps: Pattern) -> Pattern:
    """d / sqrt(var + eps), as a division or a product with the inverse."""
    return Either(
        Op("Div", d, Op("Sqrt", var_eps, name="std"), name="normalize"),
        Op("Div", d, Op("Pow", var_eps, Const("half"), name="std_pow"), name="normalize"),
        Op("Mul", d, inverse_std(var_eps), name="normalize"),
    )


def affine(normalized: Pattern) -> Pattern:
    """``cast?(cast?(normalized) [* gamma] [+ beta])``; gamma and beta are checked later by ``param_as``."""
    n = maybe_cast(normalized, cast="cast_normalized", name="n")
    scaled = Either(Op("Mul", n, Var("gamma"), name="mul_gamma"), n)
    biased = Either(Op("Add", scaled, Var("beta"), name="add_beta"), scaled)
    return maybe_cast(biased, cast="cast_out", name="y")


_INVERSE_CONSTANTS = (("one", 1.0, "numerator"), ("minus_one", -1.0, "exponent"),
                      ("minus_half", -0.5, "exponent"), ("half", 0.5, "exponent"))


def check_inverse_sqrt(m: Match) -> None:
    for name, expected, what in _INVERSE_CONSTANTS:
        if m.value(name) is not None and (found := scalar(m, name, what)) != expected:
            node = m.node("inv_std") or m.node("std_pow")
            raise Refusal(what, f"{node.op_type} '{node_name(node)}' uses {what} {found:g} where 1/sqrt(var + eps) "
                          f"needs {expected:g}")


def check_inner_casts(m: Match, names: tuple[str, ...]) -> None:
    """Casts inside the statistics must not round: a narrowing Cast there computes something else."""
    for name in names:
        node = m.node(name)
        if node is not None and not is_widening(dtype_of(node.inputs[0]), cast_target(node)):
            raise Refusal("dtype", f"Cast '{node_name(node)}' rounds {dtype_of(node.inputs[0])} to "
                          f"{cast_target(node)} inside the statistics")


def stash_type(dtype: ir.DataType) -> ir.DataType:
    """The precision of the statistics: float32 for 16- and 32-bit floats (what mixed-precision exports cast to),
    double for double, so a float64 norm keeps computing in float64."""
    return ir.DataType.DOUBLE if dtype == ir.DataType.DOUBLE else ir.DataType.FLOAT


@dataclass
class Boundary:
    """Where the fused op starts and ends: which value it reads, which it replaces, and in which dtype."""

    x: ir.Value
    y: ir.Value
    dtype: ir.DataType
    region: list[ir.Node]


def boundaries(m: Match) -> list[Boundary]:
    """Ways to place the fused op, best first.

    Folding the Casts around the statistics keeps the model's dtype at the boundary (stash_type carries the fp32
    statistics); when the dtypes do not line up, or the cast input is read elsewhere, the Casts stay outside.
    """
    region = list(m.nodes)
    cast_in, cast_out = m.node("cast_in"), m.node("cast_out")
    x_inner, y_outer = m.value("x"), m.value("y")
    x_choices = [(x_inner, [])]
    if cast_in is not None:
        fold_ok = is_widening(dtype_of(cast_in.inputs[0]), cast_target(cast_in)) and \
            not read_outside(x_inner, region)
        x_choices = ([(cast_in.inputs[0], [])] if fold_ok else []) + [(x_inner, [cast_in])]
    y_choices = [(y_outer, [])]
    if cast_out is not None:
        y_choices.append((cast_out.inputs[0], [cast_out]))
    found = []
    for x, keep_x in x_choices:
        for y, keep_y in y_choices:
            if dtype_of(x) is not None and dtype_of(x) == dtype_of(y) and dtype_of(x) in FLOATS and \
                    _normalized_cast_ok(m.node("cast_normalized"), dtype_of(x)):
                kept = set(keep_x + keep_y)
                found.append(Boundary(x, y, dtype_of(x), [n for n in region if n not in kept]))
    if not found:
        raise Refusal("dtype", f"input dtype {dtype_of(x_inner)} and output dtype {dtype_of(y_outer)} cannot be "
                      f"carried by one fused op")
    return found


def first_placement(m: Match, write: Callable[[Boundary], Replacement]) -> Replacement:
    """The replacement for the best boundary that passes every check; the first refusal if none does."""
    refusal = None
    for boundary in boundaries(m):
        try:
            return write(boundary)
        except Refusal as r:
            refusal = refusal or r
    raise refusal


def _normalized_cast_ok(cast: ir.Node | None, dtype: ir.DataType) -> bool:
    """A Cast of the normalized value is folded only if it is exact, or rounds to the fused op's own dtype (the
    ``.to(input_dtype)`` of mixed-precision models, where the fused op rounds once at its output instead)."""
    if cast is None:
        return True
    target = cast_target(cast)
    return target in FLOATS and (is_widening(dtype_of(cast.inputs[0]), target) or target == dtype)


def params(m: Match, ctx: GraphContext, b: Boundary, k: int) -> tuple[ir.Value | None, ir.Value | None]:
    gamma = m.value("gamma") if m.node("mul_gamma") in b.region else None
    beta = m.value("beta") if m.node("add_beta") in b.region else None
    return (None if gamma is None else param_as(ctx, gamma, b.x, k, b.dtype, "gamma"),
            None if beta is None else param_as(ctx, beta, b.x, k, b.dtype, "beta"))


def ones_scale(ctx: GraphContext, x: ir.Value, k: int, dtype: ir.DataType) -> ir.Value:
    """A norm without gamma still needs the fused op's scale input."""
    dims = list(x.shape)[-k:] if x.shape is not None else []
    if len(dims) != k or not all(isinstance(d, int) for d in dims):
        raise Refusal("shape", f"the normalized dims of '{x.name}' are unknown, so the unit scale cannot be made")
    check_laid_out(dims, "a unit scale")
    return ctx.constant(np.ones(dims, dtype=dtype.numpy()), "lnfuse_unit_scale")


def inverse_std_readers(m: Match, region: list[ir.Node]) -> tuple[list[ir.Value], list[ir.Node]]:
    """Values read outside the norm that hold 1/sqrt(var + eps), and the nodes absorbed to expose them.

    The matched inverse may itself be read elsewhere; a Reciprocal or Div(1, std) reading std from outside is
    absorbed (the ONNX function body of LayerNormalization computes InvStdDev that way).
    """
    exposed, absorbed = [], []
    inv = m.value("inv_std")
    if inv is not None and read_outside(inv, region):
        exposed.append(inv)
    std = m.value("std")
    for reader in readers_outside(std, region) if std is not None else []:
        one_over = reader.op_type == "Div" and reader.inputs[1] is std and _is_one(reader.inputs[0])
        if reader.op_type == "Reciprocal" or one_over:
            absorbed.append(reader)
            exposed.append(reader.outputs[0])
    return exposed, absorbed


def _is_one(value: ir.Value) -> bool:
    """A 1 that does not broadcast the quotient to another shape."""
    if value.shape is None or len(value.shape) > 1 or any(d != 1 for d in value.shape):
        return False
    array = static_value(value)
    return array is not None and bool(np.all(array == 1))


def expose(ctx: GraphContext, fused_output: ir.Value, old: ir.Value, stash: ir.DataType) -> ir.Value:
    """A statistic of the fused op standing for ``old``, cast to old's dtype when the op computes it in ``stash``."""
    if dtype_of(old) in (None, stash):
        return fused_output
    cast = ctx.node("Cast", [fused_output], {"to": dtype_of(old)}, hint="lnfuse_stat")
    cast.outputs[0].type = old.type
    return cast.outputs[0]


def finish(op_type: str, domain: str, outputs: dict[ir.Value, ir.Value], region: list[ir.Node], attributes: dict,
           opsets: dict[str, int] | None = None) -> Replacement:
    """The replacement for ``outputs``: its nodes are every new (not yet placed) node they are computed from."""
    return Replacement(op_type=op_type, domain=domain, nodes=new_nodes(outputs.values()), outputs=outputs,
                       region=region, attributes=attributes, opset_imports=opsets or {})


def new_nodes(values) -> list[ir.Node]:
    order: list[ir.Node] = []

    def visit(node: ir.Node) -> None:
        if node in order:
            return
        for value in node.inputs:
            if value is not None and value.producer() is not None and value.producer().graph is None:
                visit(value.producer())
        order.append(node)

    for value in values:
        if value.producer() is not None and value.producer().graph is None:
            visit(value.producer())
    return order
