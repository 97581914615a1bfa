"""Residual + norm: norm(input + skip [+ bias]) as one com.microsoft kernel (``--target ort`` only).

SkipLayerNormalization computes ``s = input + skip + bias; y = LayerNorm(s) * gamma + beta`` and can also output
``s`` (``input_skip_bias_sum``), which pre-norm models read again for the next residual.
SkipSimplifiedLayerNormalization is the same with RMS normalization and no beta. These rules consume the norms
the layer_norm and rms_norm rules wrote (or that the exporter wrote).

The kernels take 2-D or 3-D input. A norm over the last axis of a rank-4 sum ([B, H, W, C]: Swin, ViTDet, SAM)
treats every position alike, so the same kernel runs on the sum seen as [B, H·W, C] (a Reshape that keeps the last
axis and the batch), and its results are reshaped back: exactly the same numbers.

Ascend ATB's LayerNormOperation maps here: POSTNORM (norm(x + residual)) is SkipLayerNormalization; PRENORM (the
same, plus the sum as a second output) is SkipLayerNormalization with output 3.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from lnfuse.match.pattern import Either, Match, Op, Var, attr_value, noop_outputs, through_noops
from lnfuse.match.rule import ABSENT, GraphContext, Refusal, Replacement, Rule
from lnfuse.index.ops import onnx_op
from ._common import dims_text, dtype_of, kernel_epsilon, node_name, rank_of, read_outside

_KERNEL_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_LAYER = ("LayerNormalization",)
_RMS = ("SimplifiedLayerNormalization", "RMSNormalization")


@functools.cache
def reference():
    """SkipLayerNormalization: (y, mean, inv_std_var, input + skip + bias); statistics in float32.
    Compiled by onnxscript on first use: decompose and the tests need it, fusing does not."""
    from onnxscript import FLOAT, script
    from onnxscript import opset18 as op

    @script(default_opset=op)
    def skip_layer_normalization(input, skip, gamma, beta, bias, epsilon: float = 1e-12):
        s = op.Add(op.Add(input, skip), bias)
        sf = op.Cast(s, to=FLOAT.dtype)
        axes = op.Constant(value_ints=[-1])
        mean = op.ReduceMean(sf, axes)
        d = op.Sub(sf, mean)
        var = op.ReduceMean(op.Mul(d, d), axes)
        eps = op.CastLike(op.Constant(value_float=epsilon), var)
        std = op.Sqrt(op.Add(var, eps))
        normalized = op.CastLike(op.Div(d, std), input)
        return op.Add(op.Mul(normalized, gamma), beta), mean, op.Reciprocal(std), s

    return skip_layer_normalization


@functools.cache
def reference_simplified():
    """SkipSimplifiedLayerNormalization: (y, inv_std_var, input + skip + bias); statistics in float32.
    Compiled by onnxscript on first use: decompose and the tests need it, fusing does not."""
    from onnxscript import FLOAT, script
    from onnxscript import opset18 as op

    @script(default_opset=op)
    def skip_simplified_layer_normalization(input, skip, gamma, bias, epsilon: float = 1e-12):
        s = op.Add(op.Add(input, skip), bias)
        sf = op.Cast(s, to=FLOAT.dtype)
        mean_square = op.ReduceMean(op.Mul(sf, sf), op.Constant(value_ints=[-1]))
        eps = op.CastLike(op.Constant(value_float=epsilon), mean_square)
        rms = op.Sqrt(op.Add(mean_square, eps))
        normalized = op.CastLike(op.Div(sf, rms), input)
        return op.Mul(normalized, gamma), op.Reciprocal(rms), s

    return skip_simplified_layer_normalization


# s = a + b, with an optional 1-D bias added before or after the residual
SUM = Either(
    Op("Add", Op("Add", Var("a"), Var("b"), name="add_inner"), Var("bias"), name="add"),
    Op("Add", Op("Add", Var("a"), Var("bias"), name="add_bias"), Var("b"), name="add"),
    Op("Add", Var("a"), Var("b"), name="add"),
)


class SkipNorm(Rule):
    name = "skip_norm"
    anchors = frozenset(_LAYER + _RMS)
    refines = True
    targets = frozenset({"ort"})
    # addends whose shapes onnx's inference cannot relate are refused (``_input_and_skip``), never fused smaller;
    # a no-op it cannot read through for want of a type is an anchor left in doubt (``engine._undecided``)
    settles_for_less = False
    # OPT flattens the sum to [B*S, H] (or back) between the residual and the norm: a norm over the last axis
    # commutes with a Reshape that keeps the last axis, so the kernel runs on the sum as it is and the Reshape moves
    # after it. Exporters put no-ops between the sum and the norm (paddle2onnx: Identity, Identity; inference
    # Dropouts; Reshapes and Casts to what the value already is): they are read through, on either side of a Reshape
    patterns = (Op(_LAYER + _RMS, through_noops(Either(
        SUM, Op("Reshape", through_noops(SUM), Var("target"), name="reshape", extra_inputs=True))),
        Var("gamma"), name="norm", extra_inputs=True),)

    def build(self, m: Match, ctx: GraphContext) -> Replacement:
        norm = m.node("norm")
        rms = onnx_op(norm) in _RMS
        fused_type = "SkipSimplifiedLayerNormalization" if rms else "SkipLayerNormalization"
        s, reshape = m.value("add"), m.node("reshape")
        _check_norm(norm, s)
        if reshape is not None:
            _check_norm(norm, norm.inputs[0])
            if rank_of(s) == 4:
                raise Refusal("shape", f"the residual sum '{s.name}' has rank 4 and is reshaped before the norm; "
                              "the kernel takes 2-D or 3-D input")
        h = _hidden(s)
        if reshape is not None and _hidden(norm.inputs[0]) != h:
            raise Refusal("shape", f"Reshape '{node_name(reshape)}' changes the last axis ({h} to "
                          f"{norm.inputs[0].shape[-1]}): the norm does not commute with it")
        dtype = dtype_of(s)
        if dtype not in _KERNEL_DTYPES:
            raise Refusal("dtype", f"{fused_type} has no {dtype} kernel")
        gamma = _vector(norm.inputs[1], h, dtype, "gamma")
        beta = None if rms or len(norm.inputs) < 3 or norm.inputs[2] is None else \
            _vector(norm.inputs[2], h, dtype, "beta")
        bias = _vector(m.value("bias"), h, dtype, "bias") if m.value("bias") is not None else None
        full_x, skip = _input_and_skip(m.value("a"), m.value("b"), s)
        region = [n for n in m.nodes]
        # the outputs of the no-ops read through hold the sum (or, after a Reshape, the reshaped sum): a reader
        # outside takes the fused op's sum as well, so no no-op has to stay behind
        sum_aliases = noop_outputs(reshape.inputs[0] if reshape is not None else norm.inputs[0], s)
        reshaped_aliases = noop_outputs(norm.inputs[0], reshape.outputs[0]) if reshape is not None else []
        flat = rank_of(s) == 4
        x, skip, before = _flattened(ctx, full_x, skip, h, node_name(norm)) if flat else (full_x, skip, [])
        epsilon = kernel_epsilon(norm, 1e-5)
        inputs = [x, skip, gamma] + ([] if rms else [beta]) + [bias]
        while inputs and inputs[-1] is None:
            inputs.pop()
        fused = ctx.node(fused_type, inputs, {"epsilon": float(epsilon)}, domain="com.microsoft",
                         num_outputs=4, hint=node_name(norm))
        outputs = {norm.outputs[0]: fused.outputs[0]}
        # statistics the norm already exposed keep their meaning: LN Mean/InvStdDev, SLN inv_std_var
        stats = [(1, 1), (2, 2)] if not rms else [(1, 2)]
        for old_index, new_index in stats:
            if len(norm.outputs) > old_index and read_outside(norm.outputs[old_index], region):
                if reshape is not None or flat:
                    raise Refusal("outputs", f"the statistics of '{node_name(norm)}' are read, in a shape the "
                                  "kernel does not write")
                outputs[norm.outputs[old_index]] = fused.outputs[new_index]
        if read_outside(s, region):
            outputs[s] = fused.outputs[3]
        for old, new in outputs.items():
            new.type, new.shape = old.type, old.shape
        for alias in sum_aliases:
            if read_outside(alias, region):
                outputs[alias] = fused.outputs[3]
                fused.outputs[3].type, fused.outputs[3].shape = s.type, s.shape
        used = set(outputs.values())
        nodes = before + [fused]
        if flat:
            nodes += _unflattened(ctx, fused, outputs, s, full_x, node_name(norm))
        if reshape is not None:
            read_reshaped = [v for v in (reshape.outputs[0], *reshaped_aliases) if read_outside(v, region)]
            for olds, new in (([norm.outputs[0]], fused.outputs[0]), (read_reshaped, fused.outputs[3])):
                if olds:
                    moved = ctx.node("Reshape", [new, m.value("target")], dict(reshape.attributes),
                                     hint=node_name(reshape))
                    moved.outputs[0].type, moved.outputs[0].shape = olds[0].type, olds[0].shape
                    outputs.update((old, moved.outputs[0]) for old in olds)
                    used.add(new)
                    nodes.append(moved)
            for out in (fused.outputs[0], fused.outputs[3]):  # the kernel runs on the sum's shape
                out.type, out.shape = s.type, s.shape
        _trim_unused_outputs(fused, used)
        return Replacement(op_type=fused_type, domain="com.microsoft", nodes=nodes, outputs=outputs,
                           region=region, attributes={"epsilon": float(epsilon)},
                           opset_imports={"com.microsoft": 1})


def _check_norm(norm: ir.Node, s: ir.Value) -> None:
    rank = rank_of(s)
    if rank not in (2, 3, 4):
        raise Refusal("shape", f"the residual sum '{s.name}' has rank {rank}; the kernel takes 2-D or 3-D input "
                      "(and rank 4 seen as [B, H·W, C])")
    axis = attr_value(norm, "axis", -1)
    if axis not in (-1, rank - 1):
        raise Refusal("axes", f"{norm.op_type} '{node_name(norm)}' normalizes from axis {axis}; the kernel "
                      "normalizes the last axis only")
    if attr_value(norm, "stash_type", 1) != 1:
        raise Refusal("dtype", f"{norm.op_type} '{node_name(norm)}' has stash_type "
                      f"{attr_value(norm, 'stash_type')}; the kernel computes in float32")


def _hidden(s: ir.Value) -> int:
    h = s.shape[-1]
    if not isinstance(h, int):
        raise Refusal("shape", f"the hidden size of '{s.name}' is not known")
    return h


def _vector(value: ir.Value, h: int, dtype: ir.DataType, what: str) -> ir.Value:
    """gamma, beta and bias must be 1-D of size H and of the input's dtype."""
    if value.shape is None or list(value.shape) != [h]:
        shape = None if value.shape is None else list(value.shape)
        # a rank other than 1, or one dim that is another number, is what the symbolic inference would find too
        decided = shape is not None and (len(shape) != 1 or isinstance(shape[0], int))
        raise Refusal(what, f"{what} '{value.name}' has shape {shape}; the kernel needs [{h}]", decided=decided)
    if dtype_of(value) != dtype:
        raise Refusal("dtype", f"{what} '{value.name}' is {dtype_of(value)}, the input is {dtype}",
                      decided=dtype_of(value) is not None)
    return value


def _input_and_skip(a: ir.Value, b: ir.Value, s: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The full-shape addend is the kernel's input; the other may be (B,S,H), (1,S,H) or (S,H)."""
    full = list(s.shape)
    if any(not isinstance(d, int) and d.value is None for d in full):
        raise Refusal("shape", f"the shape of the residual sum '{s.name}' is not fully known ({dims_text(full)})")
    for x, skip in ((a, b), (b, a)):
        if x.shape is None or list(x.shape) != full or skip.shape is None or dtype_of(skip) != dtype_of(x):
            continue
        dims = list(skip.shape)
        if dims == full or (len(full) >= 3 and dims in ([1] + full[1:], full[1:])):
            return x, skip
    raise Refusal("shape", f"the addends of '{s.name}' have shapes {_shape(a)} and {_shape(b)}; the kernel needs "
                  f"one of shape {dims_text(full)} and the other {dims_text(full)}, [1,S,H] or [S,H]")


def _flattened(ctx: GraphContext, x: ir.Value, skip: ir.Value, c: int,
               hint: str) -> tuple[ir.Value, ir.Value, list[ir.Node]]:
    """x [B, H, W, C] as [B, H·W, C], and skip ([B, H, W, C], [1, H, W, C] or [H, W, C]) in the layout the kernel
    broadcasts the same way ([B, H·W, C], [1, H·W, C] or [H·W, C]).

    x's target keeps B with a 0 (copy the input's dim) and states H·W when H and W are known; otherwise H·W is
    computed from x's shape (a -1 would be ambiguous for an empty batch). The skip's -1 is always determined: the
    other dims multiply to C or 1·C."""
    if c == 0:
        raise Refusal("shape", f"'{x.name}' has an empty last axis")
    nodes: list[ir.Node] = []
    _b, height, width, _c = x.shape
    if isinstance(height, int) and isinstance(width, int):
        target = ctx.constant(np.array([0, height * width, c], np.int64), f"{hint}/flat_shape")
        spatial = height * width
    else:
        shape = ctx.node("Shape", [x], hint=hint)
        b = ctx.node("Slice", [shape.outputs[0], _ints(ctx, [0], hint), _ints(ctx, [1], hint)], hint=hint)
        hw = ctx.node("Slice", [shape.outputs[0], _ints(ctx, [1], hint), _ints(ctx, [3], hint)], hint=hint)
        prod = ctx.node("ReduceProd", [hw.outputs[0]], {"keepdims": 1}, hint=hint)
        concat = ctx.node("Concat", [b.outputs[0], prod.outputs[0], _ints(ctx, [c], hint)], {"axis": 0}, hint=hint)
        nodes += [shape, b, hw, prod, concat]
        target = concat.outputs[0]
        spatial = None
    flat_x = _reshape(ctx, x, target, [x.shape[0], spatial, c], hint)
    nodes.append(flat_x.producer())
    skip_dims = list(skip.shape)
    if len(skip_dims) == 4 and skip_dims == list(x.shape):
        flat_skip = _reshape(ctx, skip, target, [x.shape[0], spatial, c], hint)
    elif len(skip_dims) == 4:  # [1, H, W, C]
        flat_skip = _reshape(ctx, skip, _ints(ctx, [1, -1, c], hint), [1, spatial, c], hint)
    else:  # [H, W, C]
        flat_skip = _reshape(ctx, skip, _ints(ctx, [-1, c], hint), [spatial, c], hint)
    nodes.append(flat_skip.producer())
    return flat_x, flat_skip, nodes


def _unflattened(ctx: GraphContext, fused: ir.Node, outputs: dict[ir.Value, ir.Value], s: ir.Value,
                 x: ir.Value, hint: str) -> list[ir.Node]:
    """The kernel's results ([B, H·W, C]: output 0, and the sum as output 3 when it is read) back in the sum's
    shape, which is x's (the full-shape addend): static when every dim is known, else read from x."""
    if all(isinstance(d, int) for d in s.shape):
        back = ctx.constant(np.array(list(s.shape), np.int64), f"{hint}/shape")
        nodes = []
    else:
        shape = ctx.node("Shape", [x], hint=hint)
        back, nodes = shape.outputs[0], [shape]
    flat_shape = list(fused.inputs[0].shape)
    restored_of: dict[ir.Value, ir.Value] = {}  # the sum and the no-ops that held it share one Reshape back
    for old, new in list(outputs.items()):
        if new not in restored_of:
            new.type, new.shape = old.type, ir.Shape(flat_shape)
            restored_of[new] = _reshape(ctx, new, back, list(s.shape), hint)
            restored_of[new].type = old.type
            nodes.append(restored_of[new].producer())
        outputs[old] = restored_of[new]
    return nodes


def _reshape(ctx: GraphContext, value: ir.Value, target: ir.Value, dims: list, hint: str) -> ir.Value:
    node = ctx.node("Reshape", [value, target], hint=hint)
    out = node.outputs[0]
    out.type = value.type
    out.shape = ir.Shape([d if d is not None else ir.SymbolicDim(None) for d in dims])
    return out


def _ints(ctx: GraphContext, values: list[int], hint: str) -> ir.Value:
    return ctx.constant(np.array(values, np.int64), f"{hint}/shape")


def _shape(value: ir.Value) -> str:
    return "unknown" if value.shape is None else dims_text(value.shape)


def _trim_unused_outputs(node: ir.Node, used: set[ir.Value]) -> None:
    """Optional outputs nobody reads are dropped (trailing) or left unnamed, so the kernel skips them."""
    last = max(i for i, out in enumerate(node.outputs) if i == 0 or out in used)
    node.resize_outputs(last + 1)
    for out in node.outputs[1:]:
        if out not in used:
            out.meta[ABSENT] = True


RULE = SkipNorm()
