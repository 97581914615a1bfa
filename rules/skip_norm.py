"""Residual + norm: norm(input + skip [+ bias]) as one com.microsoft kernel (``--target ort`` only).

SkipLayerNormalization computes ``s = input + skip + bias; y = LayerNorm(s) * gamma + beta`` and can also output
``s`` (``input_skip_bias_sum``), which pre-norm models read again for the next residual.
SkipSimplifiedLayerNormalization is the same with RMS normalization and no beta. These rules consume the norms
the layer_norm and rms_norm rules wrote (or that the exporter wrote).

Ascend ATB's LayerNormOperation maps here: POSTNORM (norm(x + residual)) is SkipLayerNormalization; PRENORM (the
same, plus the sum as a second output) is SkipLayerNormalization with output 3.
"""

from __future__ import annotations

import functools

import onnx_ir as ir

from lnfuse.pattern import Either, Match, Op, Var, attr_value
from lnfuse.rule import ABSENT, GraphContext, Refusal, Replacement, Rule
from ._common import dtype_of, node_name, read_outside

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
    targets = frozenset({"ort"})
    # OPT flattens the sum to [B*S, H] (or back) between the residual and the norm: a norm over the last axis
    # commutes with a Reshape that keeps the last axis, so the kernel runs on the sum as it is and the Reshape moves
    # after it
    patterns = (Op(_LAYER + _RMS, Either(SUM, Op("Reshape", SUM, Var("target"), name="reshape", extra_inputs=True)),
                   Var("gamma"), name="norm", extra_inputs=True),)

    def build(self, m: Match, ctx: GraphContext) -> Replacement:
        norm = m.node("norm")
        rms = norm.op_type in _RMS
        fused_type = "SkipSimplifiedLayerNormalization" if rms else "SkipLayerNormalization"
        s, reshape = m.value("add"), m.node("reshape")
        _check_norm(norm, s)
        if reshape is not None:
            _check_norm(norm, norm.inputs[0])
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
        x, skip = _input_and_skip(m.value("a"), m.value("b"), s)
        region = [n for n in m.nodes]
        epsilon = attr_value(norm, "epsilon", 1e-5)
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
                if reshape is not None:
                    raise Refusal("outputs", f"the statistics of '{node_name(norm)}' are read, in the shape "
                                  "after the Reshape")
                outputs[norm.outputs[old_index]] = fused.outputs[new_index]
        if read_outside(s, region):
            outputs[s] = fused.outputs[3]
        for old, new in outputs.items():
            new.type, new.shape = old.type, old.shape
        used = set(outputs.values())
        nodes = [fused]
        if reshape is not None:
            for old, new in ((norm.outputs[0], fused.outputs[0]), (reshape.outputs[0], fused.outputs[3])):
                if old is norm.outputs[0] or read_outside(old, region):
                    moved = ctx.node("Reshape", [new, m.value("target")], dict(reshape.attributes),
                                     hint=node_name(reshape))
                    moved.outputs[0].type, moved.outputs[0].shape = old.type, old.shape
                    outputs[old] = moved.outputs[0]
                    used.add(new)
                    nodes.append(moved)
            for out in (fused.outputs[0], fused.outputs[3]):  # the kernel runs on the sum's shape
                out.type, out.shape = s.type, s.shape
        _trim_unused_outputs(fused, used)
        return Replacement(op_type=fused_type, domain="com.microsoft", nodes=nodes, outputs=outputs,
                           region=region, attributes={"epsilon": float(epsilon)},
                           opset_imports={"com.microsoft": 1})


def _check_norm(norm: ir.Node, s: ir.Value) -> None:
    rank = None if s.shape is None else len(s.shape)
    if rank not in (2, 3):
        raise Refusal("shape", f"the residual sum '{s.name}' has rank {rank}; the kernel takes 2-D or 3-D input")
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
        raise Refusal(what, f"{what} '{value.name}' has shape {shape}; the kernel needs [{h}]")
    if dtype_of(value) != dtype:
        raise Refusal("dtype", f"{what} '{value.name}' is {dtype_of(value)}, the input is {dtype}")
    return value


def _input_and_skip(a: ir.Value, b: ir.Value, s: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The full-shape addend is the kernel's input; the other may be (B,S,H), (1,S,H) or (S,H)."""
    full = list(s.shape)
    if any(not isinstance(d, int) and d.value is None for d in full):
        raise Refusal("shape", f"the shape of the residual sum '{s.name}' is not fully known ({full})")
    for x, skip in ((a, b), (b, a)):
        if x.shape is None or list(x.shape) != full or skip.shape is None or dtype_of(skip) != dtype_of(x):
            continue
        dims = list(skip.shape)
        if dims == full or (len(full) == 3 and dims in ([1] + full[1:], full[1:])):
            return x, skip
    raise Refusal("shape", f"the addends of '{s.name}' have shapes {_shape(a)} and {_shape(b)}; the kernel needs "
                  f"one of shape {full} and the other {full}, [1, S, H] or [S, H]")


def _shape(value: ir.Value):
    return None if value.shape is None else list(value.shape)


def _trim_unused_outputs(node: ir.Node, used: set[ir.Value]) -> None:
    """Optional outputs nobody reads are dropped (trailing) or left unnamed, so the kernel skips them."""
    last = max(i for i, out in enumerate(node.outputs) if i == 0 or out in used)
    node.resize_outputs(last + 1)
    for out in node.outputs[1:]:
        if out not in used:
            out.meta[ABSENT] = True


RULE = SkipNorm()
