"""The part of a normalization every family shares: ``y = cast?(cast?(d) * inv_std(var + eps)) [* gamma] [+ beta]``.

LayerNormalization is this with ``d = x - mean(x)``; RMS normalization with ``d = x``. Both rules use these pieces
for the inverse square root (in every spelling exporters write), the optional affine, the Casts that carry mixed
precision, and which intermediates the fused op can still expose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fractions import Fraction

import numpy as np
import onnx_ir as ir

from lnfuse.index.constants import is_static, static_value
from lnfuse.match.algebra import transpose_perm, view_axes
from lnfuse.match.pattern import Either, Match, Mono, Op, Pattern, Terms, Var, maybe_cast, mono
from lnfuse.match.rule import GraphContext, Refusal, Replacement, new_nodes
from lnfuse.index.ops import is_op, onnx_op
from ._common import (FLOATS, cast_target, channel_param, check_laid_out, dtype_of, is_widening, node_name,
                      param_as, rank_of, read_outside, readers_outside, split_views)


# ---- the math, as monomials ----------------------------------------------------------------------------------
# A numerator is a list of (coefficient, factor pattern, scale fact): x - mean is [(1, X, ...), (-1, MEAN, ...)]
# when the graph distributes it, [(1, D, ...)] when it computes d once.
Numerator = list[tuple[float, Pattern, str]]


def inverse_sqrt(var_eps: Pattern) -> list[tuple[Pattern, str]]:
    """(var + eps) ** e: 1/sqrt, Reciprocal(Sqrt), Pow(-0.5), Div(1, Sqrt)... all reach this factor; ``check_inverse``
    proves e = -1/2. Or that factor computed without the reduced axes and unsqueezed after it
    (``rsqrt(x.pow(2).mean(-1) + eps).unsqueeze(-1)``): elementwise ops on one-element constants commute with the
    Unsqueeze, which is bound as the variance's own (``reduced_axes`` proves it restores the reduced axes)."""
    unkept = Op("Unsqueeze", Terms(mono(1, (var_eps, "inv_exponent"))), name="var_unsqueeze", extra_inputs=True)
    return [(var_eps, "inv_exponent"), (unkept, "inv_outer")]


def var_plus_eps(variance: Pattern, *more: Mono) -> Terms:
    """var + eps (``eps_scale`` and ``var_scale`` receive any coefficients the graph puts on them)."""
    return Terms(mono(1, variance, scale="var_scale"), *more, mono(1, Var("eps"), scale="eps_scale"),
                 name="var_eps")


def normalized(numerator: Numerator, inverse: tuple[Pattern, str], *scale: Pattern) -> tuple[Mono, ...]:
    return tuple(mono(c, leaf, inverse, *scale, scale=fact) for c, leaf, fact in numerator)


def affine(numerators: list[Numerator], inverses: list[tuple[Pattern, str]], beta: bool = True) -> Pattern:
    """``cast?(n [* gamma] [+ beta])`` with ``n = numerator * (var + eps) ** -1/2``, in any order and association
    (``gamma * d / std``, ``d * (gamma / std)``, ``x*k + (-mean*k + beta)``...), or with a Cast of n before gamma
    (mixed precision): gamma and beta are checked later by ``param_as``."""
    gamma, bias = Var("gamma"), mono(1, Var("beta"))
    betas = (True, False) if beta else (False,)
    forms = [normalized(num, inverse, *([gamma] if g else [])) + ((bias,) if b else ())
             for inverse in inverses for g in (True, False) for b in betas for num in numerators]
    cast = Op("Cast", Terms(*[normalized(num, inverse) for inverse in inverses for num in numerators]),
              name="cast_normalized")
    cast_forms = [(mono(1, cast, gamma, scale="scale_out"),) + ((bias,) if b else ()) for b in betas] + \
        ([(mono(1, cast, scale="scale_out"), bias)] if beta else [])
    return maybe_cast(Either(Terms(*forms), Terms(*cast_forms), cast), cast="cast_out", name="y")


def check_inverse(m: Match) -> None:
    e = m.fact("inv_exponent")
    if m.fact("inv_outer") is not None:
        e = None if e is None else e * m.fact("inv_outer")  # (Unsqueeze(v ** e)) ** outer
        # before the Unsqueeze, epsilon must not raise the rank of the reduced variance either
        eps, reduced = m.value("eps"), m.node("var").outputs[0]
        if eps is None or eps.shape is None or reduced.shape is None or len(eps.shape) > len(reduced.shape):
            raise Refusal("shape", f"epsilon '{eps.name if eps else '?'}' may raise the rank of the variance "
                          "computed without its reduced axes")
        # nor anything else: a second Unsqueeze of the variance itself is taken by the matcher for a twin of the
        # restoring one (same op, same axes), and would restore the axes twice
        inner = m.node("var_unsqueeze").inputs[0]
        if rank_of(inner) != rank_of(reduced):
            raise Refusal("shape", f"the Unsqueeze after 1/sqrt(var + eps) reads '{inner.name}' of rank "
                          f"{rank_of(inner)}, not the variance computed without its reduced axes (rank "
                          f"{rank_of(reduced)})")
    if e is not None and e != Fraction(-1, 2):
        raise Refusal("exponent", f"var + eps is raised to {float(e):g}, where 1/sqrt(var + eps) needs -0.5")


def check_scales(m: Match, names: tuple[str, ...]) -> float:
    """The common coefficient of the numerator's terms (folded into gamma)."""
    found = [float(m.fact(n)) for n in names if m.fact(n) is not None]
    scale = found[0] if found else 1.0
    out = m.fact("scale_out")
    return scale * (float(out) if out is not None else 1.0)


def check_casts(b: "Boundary") -> None:
    """Every Cast of a float the fused op replaces keeps at least the precision of the norm's input: fp16 tools hold
    the statistics in float32 with Casts around each op, and round back to float16 between them
    (``Cast16(ReduceMean(Cast32(x)))``); that is the norm with roundings no coarser than its own dtype, which the
    fused op computes with its statistics in ``stash_type``, and verification measures the difference like any
    fusion's. A Cast to a narrower float (float32 statistics rounded to float16), or out of the floats, computes
    another function: refused. A Cast of an integer is skipped: on the norm's values it follows a Cast out of the
    floats, refused here first; otherwise it computes a shape. A Cast of a value of unknown type is held to what a
    Cast of a float must meet."""
    for node in b.region:
        source = dtype_of(node.inputs[0]) if is_op(node, "Cast") else None
        if not is_op(node, "Cast") or (source is not None and source not in FLOATS):
            continue
        target, shown = cast_target(node), source or "a value of unknown type"
        if target not in FLOATS:
            raise Refusal("dtype", f"Cast '{node_name(node)}' turns {shown} into {target} inside the norm: "
                          "its statistics are not computed in a float", decided=source is not None)
        if not is_widening(b.dtype, target):
            raise Refusal("dtype", f"Cast '{node_name(node)}' rounds {shown} to {target} inside the norm, below "
                          f"the precision of its {b.dtype} input: not a wider computation of the same statistics",
                          decided=source is not None)


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
    if not found and None in (dtype_of(x_inner), dtype_of(y_outer)):
        raise Refusal("dtype", f"the dtype of '{x_inner.name}' or '{y_outer.name}' is unknown (inference could not "
                      "type it: in a function whose calls pass different types or shapes, say)")
    if not found:
        raise Refusal("dtype", f"input dtype {dtype_of(x_inner)} and output dtype {dtype_of(y_outer)} cannot be "
                      f"carried by one fused op")
    return found


def first_placement(m: Match, write: Callable[[Boundary], Replacement]) -> Replacement:
    """The replacement for the best boundary that passes every check; the first refusal if none does."""
    refusal = None
    for boundary in boundaries(m):
        try:
            check_casts(boundary)
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


def params(m: Match, ctx: GraphContext, b: Boundary, k: int, scale: float = 1.0,
           layout=param_as, laid: dict[str, ir.Value] | None = None) -> tuple[ir.Value | None, ir.Value | None]:
    """gamma and beta in the fused op's layout; a coefficient the normal form found on the normalized value
    (``-x*k + mean*k``, ``0.5 * d / std``) is folded into a constant gamma. ``laid``: gamma/beta as the graph's
    Transposes lay them out where they are applied (``check_layouts``)."""
    laid = laid or {}
    gamma, beta = laid.get("gamma", m.value("gamma")), laid.get("beta", m.value("beta"))
    if abs(scale - 1) > 1e-6:
        if gamma is not None and static_value(gamma) is None:
            raise Refusal("gamma", f"the normalized value is scaled by {scale:g} and gamma '{gamma.name}' is "
                          "computed at run time, so the two cannot be folded into the fused op's scale")
        base = np.ones([1], np.float64) if gamma is None else static_value(gamma).astype(np.float64)
        gamma = ctx.constant((base * scale).astype(b.dtype.numpy()), "lnfuse_scaled_gamma")
    return (None if gamma is None else layout(ctx, gamma, b.x, k, b.dtype, "gamma"),
            None if beta is None else layout(ctx, beta, b.x, k, b.dtype, "beta"))


def scale_input(ctx: GraphContext, gamma: ir.Value | None, x: ir.Value, k: int, dtype: ir.DataType,
                channel: int | None = None) -> ir.Value:
    """The fused op's scale: gamma, or ones when the norm has none (of the normalized dims, or [C] for a
    channels-first norm)."""
    if gamma is not None:
        return gamma
    dims = [] if x.shape is None else [list(x.shape)[channel]] if channel is not None else list(x.shape)[-k:]
    if len(dims) != (1 if channel is not None else k) or not all(isinstance(d, int) for d in dims):
        raise Refusal("shape", f"the normalized dims of '{x.name}' are unknown, so the unit scale cannot be made")
    check_laid_out(dims, "a unit scale")
    return ctx.constant(np.ones(dims, dtype=dtype.numpy()), "lnfuse_unit_scale")


def layout_params(m: Match, ctx: GraphContext, b: Boundary, k: int, scale: float, channel: int | None,
                  laid: dict[str, ir.Value] | None = None):
    """gamma and beta for a norm over the trailing axes, or over one channel axis."""
    if channel is None:
        return params(m, ctx, b, k, scale, laid=laid)
    return params(m, ctx, b, k, scale, lambda c, v, x, _k, d, w: channel_param(c, v, x, channel, d, w), laid)


def transposed(ctx: GraphContext, b: Boundary, layout: "Layout") -> Boundary:
    """The boundary with x in the layout the norm is computed in: ``Transpose(x, perm)`` when the graph reads x
    permuted (one new node; the graph's own Transposes of x are in the region)."""
    if layout.perm is None:
        return b
    source, perm = b.x, layout.perm
    producer = source.producer()
    if producer is not None and is_op(producer, "Transpose") and transpose_perm(producer) is not None:
        # x is itself a Transpose (outside the region): one Transpose of its input, or none when they cancel
        source, perm = producer.inputs[0], [transpose_perm(producer)[i] for i in perm]
        if perm == list(range(len(perm))):
            return Boundary(source, b.y, b.dtype, b.region)
    node = ctx.node("Transpose", [source], {"perm": perm}, hint="lnfuse_layout")
    node.outputs[0].type = b.x.type
    node.outputs[0].shape = None if source.shape is None else ir.Shape([list(source.shape)[i] for i in perm])
    return Boundary(node.outputs[0], b.y, b.dtype, b.region)


def inverse_std_readers(m: Match, region: list[ir.Node]) -> tuple[list[ir.Value], list[ir.Node]]:
    """Values read outside the norm that hold 1/sqrt(var + eps), and the nodes absorbed to expose them.

    An inverse in the region may itself be read elsewhere; a Reciprocal or Div(1, std) reading std from outside is
    absorbed (the ONNX function body of LayerNormalization computes InvStdDev that way).
    """
    var_eps = m.value("var_eps")
    stds = [n.outputs[0] for n in region if is_op(n, "Sqrt") and n.inputs[0] is var_eps]
    exposed, absorbed = [], []
    for node in region:
        if _is_inverse_std(node, var_eps, stds) and read_outside(node.outputs[0], region):
            exposed.append(node.outputs[0])
    for std in stds:
        for reader in readers_outside(std, region):
            if _is_inverse_std(reader, var_eps, stds) and not is_op(reader, "Pow"):
                absorbed.append(reader)
                exposed.append(reader.outputs[0])
    if exposed and m.fact("inv_outer") is not None:
        # computed before the Unsqueeze that restores the reduced axes: the fused op's inverse std keeps them
        raise Refusal("shape", f"'{exposed[0].name}' (1/sqrt(var + eps)) is read without the reduced axes, where the "
                      "fused op's inverse standard deviation keeps them")
    return exposed, absorbed


def _is_inverse_std(node: ir.Node, var_eps: ir.Value, stds: list[ir.Value]) -> bool:
    if is_op(node, "Reciprocal"):
        return node.inputs[0] in stds
    if is_op(node, "Div"):
        return node.inputs[1] in stds and _is_one(node.inputs[0])
    if is_op(node, "Pow"):
        exponent = static_value(node.inputs[1]) if _is_one_element(node.inputs[1]) else None
        return exponent is not None and ((node.inputs[0] in stds and float(exponent.reshape(-1)[0]) == -1) or
                                         (node.inputs[0] is var_eps and float(exponent.reshape(-1)[0]) == -0.5))
    return False


def _is_one_element(value: ir.Value) -> bool:
    return value.shape is not None and len(value.shape) <= 1 and all(d == 1 for d in value.shape)


def absorb_type_reads(region: list[ir.Node]) -> list[ir.Node]:
    """Nodes outside the region that read a region value only for its type or shape (``CastLike(eps, var)``,
    ``Shape(d)``) and feed only the region: they go with it (the fused op needs their value, not their node).

    A ``Shape`` or ``Size`` of a region value may feed the region through a few shape computations (torch's dynamo
    exporter builds the target of the Reshape that restores var's axes from ``Shape(var)``): the whole chain goes
    with the region when nothing else reads it."""
    inside = set(region)
    added = True
    while added:
        added = False
        for node in list(region):  # in order, not the set's: the report lists the nodes as found
            for out in node.outputs:
                for reader, _ in out.uses():
                    if reader in inside or not reader.outputs:
                        continue
                    if onnx_op(reader) in ("Shape", "Size"):
                        # a static shape too: the count folded from it is computed by the chain after it
                        chain = _shape_chain(reader, inside)
                    elif all(is_static(o) for o in reader.outputs):
                        chain = [reader]
                    else:
                        continue
                    if chain and all(user in inside or user in chain for n in chain for o in n.outputs
                                     for user, _ in o.uses()) and \
                            not any(o.is_graph_output() for n in chain for o in n.outputs):
                        inside.update(chain)
                        region.extend(chain)
                        added = True
    return region


#: the most nodes a shape computation between a region value's Shape and the region may have (dynamo's target of
#: the Reshape that restores var's axes takes three); a longer one is not a type read and stays
_SHAPE_CHAIN = 16


def _shape_chain(start: ir.Node, inside: set[ir.Node]) -> list[ir.Node]:
    """``start`` and the nodes its result reaches before the region (at most _SHAPE_CHAIN of them; [] if more)."""
    chain, todo = [start], [start]
    while todo:
        for out in todo.pop().outputs:
            for user, _ in out.uses():
                if user in inside or user in chain:
                    continue
                if len(chain) >= _SHAPE_CHAIN:
                    return []
                chain.append(user)
                todo.append(user)
    return chain


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


def channels_last(ctx: GraphContext, x: ir.Value, y: ir.Value, axis: int,
                  fused: Callable[[ir.Value], ir.Value]) -> ir.Value:
    """``Transpose(fused(Transpose(x)))`` with the channel axis moved last and back: a norm over axis 1 of NCHW is a
    norm over the last axis of NHWC, exactly (runtimes fold the Transposes into their neighbours)."""
    rank = len(x.shape)
    perm = [i for i in range(rank) if i != axis] + [axis]
    back = [perm.index(i) for i in range(rank)]
    inner = ctx.node("Transpose", [x], {"perm": perm}, hint="lnfuse_channels_last")
    inner.outputs[0].type = x.type
    inner.outputs[0].shape = ir.Shape([list(x.shape)[i] for i in perm])
    outer = ctx.node("Transpose", [fused(inner.outputs[0])], {"perm": back}, hint="lnfuse_channels_first")
    outer.outputs[0].type, outer.outputs[0].shape = y.type, y.shape
    return outer.outputs[0]


def finish(op_type: str, domain: str, outputs: dict[ir.Value, ir.Value], region: list[ir.Node], attributes: dict,
           opsets: dict[str, int] | None = None) -> Replacement:
    """The replacement for ``outputs``: its nodes are every new (not yet placed) node they are computed from."""
    return Replacement(op_type=op_type, domain=domain, nodes=new_nodes(outputs.values()), outputs=outputs,
                       region=region, attributes=attributes, opset_imports=opsets or {})


# ---- layouts: norms the graph computes in a transposed layout ---------------------------------------------------
# The normal form reads through Transposes (``algebra._viewed``), so x, gamma and the statistics may each be seen
# through permutations: ``T(w * h) * rsqrt(mean(T(h * h)) + eps)`` (jax2tf's vmap) is an RMS norm of T(h). The
# layouts are axis maps (each axis of a value -> its axis in a frame): the frame of the norm's output, and the
# frame of each statistic's input. The norm is one norm of one tensor when x is laid out alike wherever it is read,
# and the reduced axes are mapped through the permutations to the axes the fused op normalizes.

@dataclass
class Layout:
    """x in the layout of the norm's output: the fused op reads ``Transpose(x, perm)`` (``perm`` None: x itself)
    and normalizes ``axes`` (negative) of it; ``params``: gamma/beta as laid out where the graph multiplies or adds
    them, when the graph transposed them."""

    perm: list[int] | None
    axes: tuple[int, ...]
    params: dict[str, ir.Value]


def check_layouts(m: Match, ctx: GraphContext, axes: tuple[int, ...], stats: dict[str, str | None],
                  main: str) -> Layout:
    """Prove that x is normalized in one layout, and say which. ``axes``: what ``agreed_axes`` proved, in each
    statistic's input; ``stats``: each statistic's name -> the statistic in whose input frame it is read (None: the
    output's frame); ``main``: the statistic the normalized axes are read from."""
    seen = [(frame, value, split_views(chain)) for frame, value, chain in m.viewed()]
    if not any(transposes for _, _, (transposes, _) in seen):
        return Layout(None, axes, {})
    nodes = {name: m.node(name) for name in stats if m.node(name) is not None}
    frames = {None: "the output"} | {n.inputs[0]: f"the input of '{node_name(n)}'" for n in nodes.values()}
    outputs = {n.outputs[0] for n in nodes.values()}
    epsilon_terms = {m.value("var_eps"), m.value("eps")} - {None}
    x = m.value("x")
    rank = rank_of(x)
    if rank is None:
        raise Refusal("shape", f"the rank of '{x.name}' is unknown, so its transposed layouts cannot be compared")
    x_maps: dict = {}
    stat_maps: dict = {}
    params: dict[str, ir.Value] = {}
    for frame, value, (transposes, restores) in seen:
        if frame not in frames:
            if transposes:
                raise Refusal("layout", f"Transpose '{node_name(transposes[0])}' moves '{value.name}' inside "
                              "an op lnfuse does not follow layouts through")
            continue
        if value in epsilon_terms:
            continue  # the variance's own views carry these (eps is one number wherever it lands)
        if not transposes and not restores and value not in outputs and value is not m.value("x"):
            continue  # a parameter read as it is: laid out by the usual checks
        placed = restores[0].outputs[0] if restores else value
        found = view_axes(transposes, rank_of(placed) or 0)
        frame_rank = rank_of(frame if frame is not None else m.value("y"))
        if found is None or frame_rank is None or frame_rank < len(found):
            raise Refusal("shape", f"the ranks around Transpose '{node_name(transposes[0])}' are unknown")
        found = [a + frame_rank - (rank_of(transposes[0].outputs[0]) if transposes else len(found)) for a in found]
        if value in outputs:
            stat_maps.setdefault(value, set()).add((frame, tuple(found)))
        elif value is m.value("gamma") or value is m.value("beta"):
            name = "gamma" if value is m.value("gamma") else "beta"
            if frame is not None or restores:
                raise Refusal(name, f"{name} '{value.name}' is moved inside the norm's statistics")
            params[name] = _laid_out(ctx, value, found, frame_rank, name)
        else:
            if rank_of(value) != rank or restores:
                raise Refusal("layout", f"'{value.name}' is read through Transpose '{node_name(transposes[0])}' "
                              f"and is not laid out like x '{x.name}'")
            x_maps.setdefault(frame, set()).add(tuple(found))
    for frame, maps in x_maps.items():
        if len(maps) > 1:
            raise Refusal("layout", f"x '{x.name}' is read in {frames[frame]} through permutations that disagree: "
                          f"{' vs '.join(str(list(p)) for p in sorted(maps))}")

    def x_in(frame) -> tuple[int, ...]:
        if frame in x_maps:
            return next(iter(x_maps[frame]))
        base = rank_of(frame if frame is not None else m.value("y"))
        return tuple(range(base - rank, base)) if base is not None and base >= rank else ()

    y_map = x_in(None)
    if sorted(y_map) != list(range(rank)) or rank_of(m.value("y")) != rank:
        raise Refusal("layout", f"x '{x.name}' (rank {rank}) does not fill the norm's output")
    main_axes = None
    # one node may be two statistics (the numerator's mean and the variance's), each read in its own frame
    wheres: dict = {}
    for name, node in nodes.items():
        wheres.setdefault(node, set()).add(nodes[stats[name]].inputs[0] if stats[name] in nodes else None)
    for name, node in nodes.items():
        where = nodes[stats[name]].inputs[0] if stats[name] in nodes else None
        seen_at = stat_maps.get(node.outputs[0], set())
        placed = [f for f in seen_at if f[0] is where]
        if any(f[0] not in wheres[node] for f in seen_at) or len(placed) > 1:
            raise Refusal("layout", f"statistic '{node_name(node)}' is read in a layout lnfuse does not follow")
        kept = placed[0][1] if placed else tuple(range(rank))
        inner, outer = x_in(node.inputs[0]), x_in(where)
        # x's axis j is axis inner[j] of the statistic's input, which lands on axis kept[inner[j]] where the
        # statistic is read: x must be there at outer[j], in every position
        composed = tuple(kept[a] for a in inner) if len(kept) == rank and len(inner) == rank else None
        if composed != outer:
            raise Refusal("layout", f"statistic '{node_name(node)}' reads x '{x.name}' permuted by "
                          f"{_perm(inner)} and is read back permuted by {_perm(kept)}, where x itself is read "
                          f"permuted by {_perm(outer)}: the norm's rows are not x's rows")
        if name == main:
            main_axes = tuple(sorted(kept[a % rank] - rank for a in axes))
    perm = [y_map.index(i) for i in range(rank)]
    return Layout(None if perm == list(range(rank)) else perm, main_axes if main_axes is not None else axes, params)


def _perm(axes: tuple[int, ...]) -> list[int]:
    """An axis map as a Transpose's perm (output axis i is input axis perm[i])."""
    return [list(axes).index(i) for i in range(len(axes))] if sorted(axes) == list(range(len(axes))) else list(axes)


def _laid_out(ctx: GraphContext, value: ir.Value, axes: list[int], rank: int, what: str) -> ir.Value:
    """A constant gamma/beta moved by the graph's Transposes, as the constant it is where it is applied: axis j of
    ``value`` at axis ``axes[j]`` of a rank-``rank`` operand."""
    array = static_value(value)
    if array is None:
        raise Refusal(what, f"{what} '{value.name}' is transposed at run time; only a constant is laid out anew")
    if array.ndim != len(axes):
        raise Refusal(what, f"{what} '{value.name}' has rank {array.ndim}, not the rank of its Transpose")
    order = sorted(range(len(axes)), key=lambda j: axes[j])
    shape = [1] * rank
    for j in order:
        shape[axes[j]] = array.shape[j]
    return ctx.constant(np.transpose(array, order).reshape(shape), f"{value.name}_laid_out")
