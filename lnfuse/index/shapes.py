"""Types and shapes for the values the checks look at.

onnx's shape inference covers the main graph and its subgraphs. Model-local function bodies carry no types, so
each function is inferred once as a small graph whose inputs take the types of its first call site.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx
import onnx_ir as ir

from lnfuse.index.budget import MAX_ELEMENTS, SIZE_PRODUCING, elements
from lnfuse.index.library_budget import Hidden, hide_oversized, restore
from lnfuse.index.traversal import every_node, every_proto_node
from lnfuse.index.ops import is_op, known_op, onnx_op


class TypesDisagree(Exception):
    """Strict inference (``check_types``) found values whose types do not line up, as ONNX Runtime refuses to load
    them: a node binding one type parameter to two types, or a declared value_info of another dtype than its node
    computes. The message is the first such finding."""


#: what onnx's strict inference says when types do not line up
#: how onnx's strict inference says types do not line up; "ParseData type mismatch" is a constant input of another
#: type than its op takes (Unsqueeze axes in double), which ONNX Runtime refuses as a type error too
_TYPE_ERRORS = ("TypeInferenceError", "inconsistent type", "unsupported type", "ParseData type mismatch")


def type_error(error: Exception) -> str | None:
    """The line of an inference error that says types do not line up, if it says so. A node whose input has no type
    at all only follows from an earlier error (a shape one, say), and is not one."""
    found = [line for line in str(error).splitlines()
             if any(words in line for words in _TYPE_ERRORS) and "is null" not in line]
    return found[0].strip()[:300] if found else None


def infer_shapes(proto: onnx.ModelProto, check_types: bool = False) -> tuple[onnx.ModelProto, str | None]:
    """The model with value_info for as many values as can be inferred, and the error if inference failed.

    Declared value_info and output shapes are claims, not facts: inference runs without them, from the inputs and
    initializers, and a claim is used only where inference says nothing (see ``_merge_claims``). ``proto`` gives
    up its value_info to this function.
    """
    inferred, error, _ = infer_with_claims(proto, take_claims(proto.graph), ort_symbolic, check_types)
    return inferred, error


@dataclass
class OnnxVerdict:
    """What onnx's own inference found on a skeleton, for when the same skeleton is inferred again with ONNX
    Runtime's symbolic inference (``demand.PendingShapes``): that its result was incomplete with and without data
    propagation, so neither needs to run again, whether data propagation is safe on it (``_infer``), and whether
    the budget hid anything from it (when not, its walk need not run again either)."""

    #: None until onnx's inference of the skeleton was found incomplete
    safe: bool | None = None
    hid: bool = True


def infer_with_claims(proto: onnx.ModelProto, claims: Claims, symbolic: _Symbolic | None,
                      check_types: bool = False, verdict: OnnxVerdict | None = None
                      ) -> tuple[onnx.ModelProto, str | None, bool]:
    """Inference (``_infer``) with the claims put back where it said nothing; and whether onnx's was complete.
    ``check_types``: raise ``TypesDisagree`` where types do not line up (``_plain``, ``_check_claimed_types``).
    ``verdict``: filled in by a first inference of ``proto``, read by the next."""
    known = verdict is not None and verdict.safe is not None
    # the libraries fold constants without a bound: what would pass the budget is hidden from them meanwhile
    hidden = hide_oversized(proto) if not known or verdict.hid else Hidden()
    if verdict is not None and not known:
        verdict.hid = bool(hidden.renamed)
    try:
        inferred, error, complete = _infer(proto, symbolic, check_types, verdict)
        if check_types:
            _check_claimed_types(inferred.graph, claims)
        if _merge_claims(inferred.graph, claims):
            # a claim filled a gap: infer again, so the values computed from it get shapes too (and have their
            # types checked: a value typed by its claim alone may feed a node that binds two types)
            again, again_error, again_complete = _infer(inferred, symbolic, check_types)
            if again_error is None:
                inferred, complete = again, again_complete
    finally:
        restore(proto, hidden)
    restore(inferred, hidden)
    return inferred, error, complete


#: ONNX Runtime's symbolic inference of a model: its partial result, or None where it cannot run
_Symbolic = Callable[[onnx.ModelProto], "onnx.ModelProto | None"]


def _infer(proto: onnx.ModelProto, symbolic: _Symbolic | None, check_types: bool = False,
           verdict: OnnxVerdict | None = None) -> tuple[onnx.ModelProto, str | None, bool]:
    """onnx's or ONNX Runtime's inference, whichever completes; and whether onnx's alone was complete.

    The residual rule must prove two addends have the same shape, so symbolic dims must stay consistent through
    Reshape and Shape arithmetic. onnx's inference (C++, milliseconds) often manages; where it leaves a dim
    unknown (an ``unk__`` per value), ONNX Runtime's symbolic shape inference (Python, ~0.1 ms per node, seconds
    per Resize on a detector's neck) does it instead, when ``symbolic`` is given, and onnx's then fills in what
    the symbolic pass left open. ``verdict``: where onnx's inference of ``proto`` already ran and was incomplete,
    it is not run again (else it is filled in).
    """
    quick = None
    if verdict is not None and verdict.safe is not None:
        safe = verdict.safe
    else:
        plain = _plain(proto, check_types)
        if plain is not None and _complete(plain.graph):
            return plain, None, True  # every shape known without data propagation, which could add nothing
        safe = not _has_huge_input(proto) and not _long_vector(plain) and not _sizes_out_of_sight(proto)
        if verdict is not None:
            verdict.safe = safe
        if safe:
            with contextlib.suppress(Exception):
                quick = onnx.shape_inference.infer_shapes(proto, data_prop=True)
                if _complete(quick.graph):
                    return quick, None, True
    result = symbolic(proto) if symbolic is not None else None
    if result is None and quick is None and safe and verdict is not None:
        with contextlib.suppress(Exception):  # skipped above: what to fall back on
            quick = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    if result is None and quick is not None:
        return quick, None, False  # what the call below would compute again: the same inference, same options
    try:
        # onnx's data propagation is only the fallback: it materializes Size/Shape values, and on a Size of a
        # multi-GB weight it allocates until the machine runs out of memory
        propagate = result is None and safe
        return onnx.shape_inference.infer_shapes(result or proto, data_prop=propagate), None, False
    except Exception as exc:  # noqa: BLE001 - shape inference is a help, not a requirement
        if result is not None:
            return result, None, False
        return proto, str(exc).splitlines()[0], False


#: what a graph declares about its values: value_info by name, and its outputs' types
Claims = tuple[dict[str, onnx.ValueInfoProto], list[onnx.TypeProto], list["Claims"]]


def take_claims(graph: onnx.GraphProto) -> Claims:
    """Remove the graph's value_info and output shapes (and its subgraphs'), and return them. Output dtypes stay:
    a graph output's dtype is part of the model's interface, and inference checks it against what is computed."""
    declared = {v.name: v for v in graph.value_info}
    graph.ClearField("value_info")
    outputs = []
    for output in graph.output:
        outputs.append(onnx.TypeProto.FromString(output.type.SerializeToString()))
        output.type.tensor_type.ClearField("shape")
    subgraphs = [take_claims(sub) for sub in _subgraphs(graph)]
    return declared, outputs, subgraphs


def _check_claimed_types(graph: onnx.GraphProto, claims: Claims,
                         outer: dict[str, onnx.TypeProto] | None = None) -> None:
    """``TypesDisagree`` for a declared value_info that ONNX Runtime refuses: one whose type is not the kind of value
    inferred for it (another dtype; a sequence, optional or sparse value for a tensor), a tensor declared without an
    element type, or, in a body, a value of an enclosing graph (``outer``: their types) declared with another dtype,
    rank or number of elements along a dim. Otherwise shapes are claims ORT ignores. Graph outputs keep their
    declared dtypes during inference (``take_claims``), which checks them itself."""
    declared, _, subgraphs = claims
    inferred = {v.name: v.type for v in graph.value_info}
    for name, claim in declared.items():
        if _untyped_tensor(claim.type):
            raise TypesDisagree(f"value '{name}' is declared a tensor of no element type")
        got = inferred.get(name)
        if got is not None and _known_kind(got) and _known_kind(claim.type) and _kind(claim.type) != _kind(got):
            raise TypesDisagree(f"value '{name}' is declared {_describe(claim.type)} but its node computes "
                                f"{_describe(got)}")
        if got is None and outer and name in outer and not _agrees(claim.type, outer[name]):
            raise TypesDisagree(f"value '{name}' of an enclosing graph is declared {_describe(claim.type)} "
                                f"{_dims(claim.type)} in a body, where it is {_describe(outer[name])} "
                                f"{_dims(outer[name])}")
    if subgraphs:
        visible = {**(outer or {}), **{v.name: v.type for v in graph.input}, **inferred}
        for sub_claims, sub in zip(subgraphs, _subgraphs(graph)):
            _check_claimed_types(sub, sub_claims, visible)


def _agrees(claim: onnx.TypeProto, actual: onnx.TypeProto) -> bool:
    """Whether a body's declaration of an enclosing graph's value fits the value: ONNX Runtime merges the two while
    it infers the body, and refuses another dtype, another rank, or two numbers for one dim."""
    if not (claim.HasField("tensor_type") and actual.HasField("tensor_type")):
        return not _known_kind(claim) or not _known_kind(actual) or _kind(claim) == _kind(actual)
    want, have = claim.tensor_type, actual.tensor_type
    if want.elem_type and have.elem_type and want.elem_type != have.elem_type:
        return False
    if not want.HasField("shape") or not have.HasField("shape"):
        return True
    return len(want.shape.dim) == len(have.shape.dim) and all(
        not (a.HasField("dim_value") and b.HasField("dim_value")) or a.dim_value == b.dim_value
        for a, b in zip(want.shape.dim, have.shape.dim))


def _dims(type_proto: onnx.TypeProto) -> str:
    tensor = type_proto.tensor_type
    if not type_proto.HasField("tensor_type") or not tensor.HasField("shape"):
        return ""
    return "[" + ", ".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                           for d in tensor.shape.dim) + "]"


def _kind(type_proto: onnx.TypeProto) -> bytes:
    """The type without its shapes and denotations: what must agree between a declaration and the value."""
    kind = onnx.TypeProto.FromString(type_proto.SerializeToString())
    stack = [kind]
    while stack:
        t = stack.pop()
        t.ClearField("denotation")
        which = t.WhichOneof("value")
        if which in ("tensor_type", "sparse_tensor_type"):
            getattr(t, which).ClearField("shape")
        elif which in ("sequence_type", "optional_type"):
            stack.append(getattr(t, which).elem_type)
        elif which == "map_type":
            stack.append(t.map_type.value_type)
    return kind.SerializeToString()


def _known_kind(type_proto: onnx.TypeProto) -> bool:
    return type_proto.WhichOneof("value") is not None


def _untyped_tensor(type_proto: onnx.TypeProto) -> bool:
    """A tensor (or sparse tensor) type, at any depth, whose element type is left undefined."""
    which = type_proto.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        return getattr(type_proto, which).elem_type == 0
    if which in ("sequence_type", "optional_type"):
        return _untyped_tensor(getattr(type_proto, which).elem_type)
    if which == "map_type":
        return _untyped_tensor(type_proto.map_type.value_type)
    return False


def _describe(type_proto: onnx.TypeProto) -> str:
    which = type_proto.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        elem = getattr(type_proto, which).elem_type
        name = onnx.TensorProto.DataType.Name(elem) if elem in onnx.TensorProto.DataType.values() else str(elem)
        return name if which == "tensor_type" else f"a sparse {name} tensor"
    if which in ("sequence_type", "optional_type"):
        container = "a sequence" if which == "sequence_type" else "an optional"
        return f"{container} of {_describe(getattr(type_proto, which).elem_type)}"
    return which or "untyped"


def _merge_claims(graph: onnx.GraphProto, claims: Claims) -> bool:
    """Put back what inference left unknown, and nothing it contradicts; True if a claim filled a gap.

    Per value: no inferred type takes the declared one whole; a declared dtype or rank that differs is dropped;
    per dim, an inferred number or name stays, and only a dim inference left unknown takes the declared one."""
    declared, outputs, subgraphs = claims
    filled = False
    # by name, only when there is a claim to look up (a graph of a million values infers as many)
    known = {v.name: v for v in list(graph.value_info) + list(graph.input)} if declared else {}
    for name, claim in declared.items():
        value = known.get(name)
        if value is None:
            graph.value_info.append(claim)
            filled = True
        else:
            filled |= _fill(value.type, claim.type)
    for output, claim in zip(graph.output, outputs):
        filled |= _fill(output.type, claim)
    for sub_claims, sub in zip(subgraphs, _subgraphs(graph)):  # no claims: the graph's nodes are not read
        filled |= _merge_claims(sub, sub_claims)
    return filled


def _fill(inferred: onnx.TypeProto, claim: onnx.TypeProto) -> bool:
    mine, theirs = inferred.tensor_type, claim.tensor_type
    if not inferred.HasField("tensor_type") or not claim.HasField("tensor_type"):
        return False
    if not mine.elem_type:
        inferred.CopyFrom(claim)
        return True
    if theirs.elem_type != mine.elem_type or not theirs.HasField("shape"):
        return False
    if not mine.HasField("shape"):
        mine.shape.CopyFrom(theirs.shape)
        return True
    if len(mine.shape.dim) != len(theirs.shape.dim):
        return False
    filled = False
    for dim, said in zip(mine.shape.dim, theirs.shape.dim):
        if _unknown(dim) and not _unknown(said):
            dim.CopyFrom(said)
            filled = True
    return filled


def _unknown(dim: onnx.TensorShapeProto.Dimension) -> bool:
    return not dim.HasField("dim_value") and (not dim.dim_param or dim.dim_param.startswith("unk__"))


def _subgraphs(graph: onnx.GraphProto):
    for node in graph.node:
        if not node.attribute:  # most nodes have none: testing is a third of the cost of listing them
            continue
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield attr.g
            elif attr.type == onnx.AttributeProto.GRAPHS:
                yield from attr.graphs


def _complete(graph: onnx.GraphProto) -> bool:
    """Every value the graph computes has a known dtype and a shape with every dim a number or a named symbol."""
    verdicts: dict[bytes, bool] = {}  # per distinct type: a graph of a million values has a handful
    complete = {""}  # the names whose type is complete (the last entry of a name decides), and no output's
    for infos in (graph.value_info, graph.output):
        for info in infos:
            type_proto = info.type
            key = type_proto.SerializeToString()
            verdict = verdicts.get(key)
            if verdict is None:
                verdict = verdicts[key] = _complete_type(type_proto.tensor_type)
            if verdict:
                complete.add(info.name)
            elif info.name:
                complete.discard(info.name)
    subgraph = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    for node in graph.node:
        if node.attribute and any(a.type in subgraph for a in node.attribute):
            return False
        if not complete.issuperset(node.output):
            return False
    return True


def _complete_type(tensor: onnx.TypeProto.Tensor) -> bool:
    return bool(tensor.elem_type) and tensor.HasField("shape") and all(
        d.HasField("dim_value") or (d.dim_param and not d.dim_param.startswith("unk__")) for d in tensor.shape.dim)


def _sizes_out_of_sight(proto: onnx.ModelProto) -> bool:
    """Whether a model-local function or an If/Loop/Scan body holds an op that makes a size from its inputs
    (``budget.SIZE_PRODUCING``). The budget's walk sees the main graph only, and onnx's data propagation runs
    through function bodies at each call: a Pad of 2**31 inside a function took 24 GB. Such models are inferred
    without data propagation (which folds nothing, so it allocates nothing for any size)."""
    return any(onnx_op(node) in SIZE_PRODUCING for node in every_proto_node(proto, main_graph=False))


def _has_huge_input(proto: onnx.ModelProto) -> bool:
    """An input whose known dims alone make more than 2**24 elements: onnx's data propagation materializes Size
    and Shape values of it. Symbolic dims count as 1 (a [batch, 2**40] input is huge whatever batch is), and the
    product is taken in Python ints (numpy's wraps around past 2**63)."""
    return any(elements(d.dim_value or 1 for d in v.type.tensor_type.shape.dim) > 1 << 24
               for v in proto.graph.input if v.type.tensor_type.shape.dim)


def _plain(proto: onnx.ModelProto, check_types: bool = False) -> onnx.ModelProto | None:
    """onnx's inference without data propagation (which folds nothing), or None where it fails. ``check_types``:
    strictly, raising ``TypesDisagree`` for a type error; another error (a shape that does not fit) is left to the
    lenient run, as ONNX Runtime reads such a model. When strict inference succeeds, it is the lenient one's result:
    strictness only decides what is an error."""
    if check_types:
        try:
            return onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
        except Exception as error:  # noqa: BLE001 - onnx raises several types; the message says which error
            if (detail := type_error(error)) is not None:
                raise TypesDisagree(detail) from None
    try:
        return onnx.shape_inference.infer_shapes(proto)
    except Exception:  # noqa: BLE001 - then data propagation would fail as well
        return None


def _long_vector(plain: onnx.ModelProto | None) -> bool:
    """Whether onnx's inference without data propagation (``_plain``) found a 1-D value longer than the budget (or
    failed). onnx's data propagation holds every 1-D value that reaches an op it propagates through (Add, Concat,
    Gather...) as a TensorShapeProto of one dim per element, about 150 bytes each, whether its data is known or
    not: a [2**28] vector is 40 GB. Such a model is inferred without data propagation."""
    if plain is None:
        return True
    for info in itertools.chain(plain.graph.input, plain.graph.value_info, plain.graph.output):
        dims = info.type.tensor_type.shape.dim
        if len(dims) == 1 and dims[0].dim_value > MAX_ELEMENTS:
            return True
    return False


def ort_symbolic(proto: onnx.ModelProto, check: Callable[[], None] | None = None,
                 plain_resize: bool = False) -> onnx.ModelProto | None:
    """ORT's symbolic inference, keeping partial results. Its public entry point writes a file into the working
    directory when a node cannot be inferred, so the loop it runs is run here instead. ``check`` is called before
    each node (a deadline raises there). ``plain_resize``: a resized dim gets a fresh name instead of the
    expression sympy simplifies (``Recording._infer_Resize``)."""
    if not any(i.domain in ("", "ai.onnx") and i.version >= 7 for i in proto.opset_import):
        return None
    disguised = _undisguise(proto)
    try:
        with _quiet():
            inference = _recording_inference()(2**31 - 1, True, False, 0)
            inference.check = check
            inference.plain_resize = plain_resize
            inference._preprocess(proto)
            while inference.run_:
                inference._infer_impl()
            inference._update_output_from_vi()
            _rename_assumed_dims(inference.out_mp_, inference.assumed, inference.suggested_merge_)
            _restore_op_types(inference.out_mp_, disguised)
            _negative_dims_unknown(inference.out_mp_.graph)
            return inference.out_mp_
    except Exception:  # noqa: BLE001 - many internal failure types; onnx's inference is the fallback
        return None
    finally:
        _restore_op_types(proto, disguised)


def _negative_dims_unknown(graph: onnx.GraphProto) -> None:
    """ORT's inference gives ``table[0:INT32_MIN]`` (rows 0..-1, none) the dim -1, which is no size: it is left
    unknown, as a declared -1 is. Kept, verification drew inputs of that shape and crashed (red team, round 9)."""
    for info in [*graph.value_info, *graph.output]:
        for dim in info.type.tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value < 0:
                dim.Clear()
    for body in _subgraphs(graph):
        _negative_dims_unknown(body)


def _undisguise(proto: onnx.ModelProto) -> dict[str, str]:
    """Rename, in the main graph, every node that is no op of ONNX's or ONNX Runtime's (a model-local function's
    call, a custom op, a "com.microsoft" name ONNX Runtime registers nothing for) so that ORT's symbolic
    inference, which looks ops up by name alone, cannot take a function named ``LayerNormalization`` or
    ``com.microsoft::Unsqueeze`` for ONNX's op and type its output as the op's. Returns the original op types by
    first output name, for ``_restore_op_types``."""
    renamed = {}
    for node in proto.graph.node:
        if known_op(node) is None and node.output:
            renamed[node.output[0]] = node.op_type
            node.op_type = f"lnfuse_unknown_{len(renamed)}"
    return renamed


def _restore_op_types(proto: onnx.ModelProto, renamed: dict[str, str]) -> None:
    if not renamed:
        return
    for node in proto.graph.node:
        if node.output and node.output[0] in renamed and node.op_type.startswith("lnfuse_unknown_"):
            node.op_type = renamed[node.output[0]]


def _ort_symbolic_shape_infer():
    """ORT's symbolic_shape_infer module, executed from its file: importing it by name first runs
    ``onnxruntime/tools/__init__.py``, which imports torch whenever torch is installed (1-2 s, unused here)."""
    name = "onnxruntime.tools.symbolic_shape_infer"
    if name not in sys.modules:
        import onnxruntime

        path = Path(onnxruntime.__file__).parent / "tools" / "symbolic_shape_infer.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


#: the types a Cast may carry a shape's values through (``Recording._infer_Cast``)
_HOLDS_SIZES = frozenset({onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT32,
                          onnx.TensorProto.UINT64, onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})


def _recording_inference():
    class Recording(_ort_symbolic_shape_infer().SymbolicShapeInference):
        """ORT's inference, recording each node where it merged two different dims. Where they meet in a
        broadcast, ORT assumes them equal; but one may be 1 at run time, where the Skip/Embed kernels refuse or
        differ from the Add they replace."""

        def __init__(self, *args):
            super().__init__(*args)
            self.current: onnx.NodeProto | None = None
            self.assumed: list[tuple[onnx.NodeProto, list[str]]] = []
            self.check: Callable[[], None] | None = None
            self.plain_resize = False

        def _onnx_infer_single_node(self, node):
            if self.check is not None:
                self.check()
            self.current = node
            return super()._onnx_infer_single_node(node)

        def _infer_Cast(self, node):  # noqa: N802 - ORT's dispatch name
            """ORT carries a shape's values through any Cast; only a type that holds every size keeps them: a
            sequence length Cast to bool is 1, to uint8 it wraps at 256, to float16 it rounds past 2048. Carried,
            Slice(table, 0, Cast(Cast(S, bool), int64)) was typed [S, H] where it is [1, H], and the Skip op written
            over its Add failed where the Add broadcasts (red team, round 9). float32 keeps them (exact to 2**24
            per dim): the resize chains of detectors Cast their sizes through it."""
            to = _ort_symbolic_shape_infer().get_attribute(node, "to")
            if to in _HOLDS_SIZES:
                super()._infer_Cast(node)

        def _infer_symbolic_compute_ops(self, node):
            """ORT computes Equal of shape values with Python's ``==``, which compares sympy expressions as
            written: S == 100 is False, and Where(S == 100, 1, S) was inferred S, where at S = 100 it is 1 (a
            position Slice of one row, which the Add broadcasts and a Skip op written over it does not; red team,
            round 9). Equal is kept only where sympy decides it for every size."""
            if is_op(node, "Equal") and len(node.input) == 2:
                values = self._get_int_or_float_values(node, broadcast=True)
                if any(v is None for v in values):
                    return
                pairs = zip(*values) if any(isinstance(v, list) for v in values) else [values]
                sympy = _ort_symbolic_shape_infer().sympy
                if not all(_equal_decided(sympy.sympify(a), sympy.sympify(b)) for a, b in pairs):
                    return
            super()._infer_symbolic_compute_ops(node)

        def _infer_Resize(self, node):  # noqa: N802 - ORT's dispatch name
            """With ``plain_resize``, the dims ORT would get from ``simplify(floor(d * scale))`` or
            ``simplify(floor(size))`` without ``simplify``, which takes up to seconds per node on a detector's neck
            (d is there the expression of every Conv and Resize before it): a size read from a shape is a dim
            already, d * k for a whole k is whole, and any other scale gives a fresh symbol, which claims nothing
            (rules then prove less about what follows, never something wrong)."""
            if not self.plain_resize:
                return super()._infer_Resize(node)
            module = _ort_symbolic_shape_infer()
            shape = self._get_sympy_shape(node, 0)
            legacy = module.get_opset(self.out_mp_) <= 10
            scales = self._try_get_value(node, 1 if legacy else 2)
            sizes = None if legacy else self._try_get_value(node, 3)
            cropped = module.get_attribute(node, "coordinate_transformation_mode") == b"tf_crop_and_resize"
            fresh = self._new_symbolic_shape(len(shape), node)
            dims = []
            for axis, dim in enumerate(shape):
                if sizes is not None and axis < len(sizes) and _whole(sizes[axis]):
                    dims.append(sizes[axis])
                elif sizes is None and scales is not None and axis < len(scales) and not cropped \
                        and _whole(scales[axis]) and float(scales[axis]) >= 1:
                    dims.append(dim * int(scales[axis]))
                else:
                    dims.append(fresh[axis])
            self._update_computed_dims(dims)  # as ORT registers what it computes, so later merges can name them
            self.known_vi_[node.output[0]].CopyFrom(onnx.helper.make_tensor_value_info(
                node.output[0], self.known_vi_[node.input[0]].type.tensor_type.elem_type,
                module.get_shape_from_sympy_shape(dims)))

        def _preprocess(self, in_mp):
            super()._preprocess(in_mp)
            # the graph inputs' dims in order, before a merge renames them
            dims = (d.dim_param for i in in_mp.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param)
            self.input_order = {name: index for index, name in enumerate(dict.fromkeys(dims))}

        def _add_suggested_merge(self, symbols, apply=False):
            if self.current is not None and not _safe_merge(symbols, self.suggested_merge_):
                self.assumed.append((self.current, [str(s) for s in symbols]))
            names = {_representative(s, self.suggested_merge_) for s in symbols}
            super()._add_suggested_merge(symbols, apply)
            self._rename_merged(names, apply)

        def _rename_merged(self, names: set[str], apply: bool) -> None:
            """ORT names merged dims after the first of the best kind (a number, an input's dim, a plain symbol, the
            shortest expression) it meets in a set: an order that changes with the hash seed, and with it which
            values carry an input's own dim name, and so what the rules can prove. The name kept is instead the
            first of that kind in a fixed order: the graph inputs' order, then by name."""
            merged = self.suggested_merge_
            kept = _representative(next(iter(names)), merged)
            if kept not in self.symbolic_dims_ or not all(_representative(n, merged) == kept for n in names):
                return  # a number, or a merge ORT did not make
            kind = self._kind(kept)
            chosen = min((n for n in names if self._kind(n) == kind),
                         key=lambda n: (self.input_order.get(n, len(self.input_order)), len(n), n))
            if chosen == kept:
                return
            for name, into in list(merged.items()):
                if into == kept:
                    merged[name] = chosen
            merged.pop(chosen, None)
            merged[kept] = chosen
            if apply and self.auto_merge_:
                self._apply_suggested_merge()

        def _kind(self, name: str) -> tuple:
            if name in self.input_symbols_:
                return (0,)
            if type(self.symbolic_dims_.get(name)) is _ort_symbolic_shape_infer().sympy.Symbol:
                return (1,)
            return (2, len(name))

    return Recording


def _equal_decided(a, b) -> bool:
    """Whether ORT's ``a == b`` on two shape values holds for every size: sympy decides their difference, or one is
    a negative number, which a size never is (torch's ``Where(shape == -1, 1, shape)`` before an Expand, whose
    other side is an expression sympy cannot bound)."""
    if (a - b).is_zero is not None:
        return True
    return any(side.is_number and side < 0 for side in (a, b))


def _whole(value) -> bool:
    """A whole number (Python, numpy or sympy), or a sympy expression known to be whole (a dim read by Shape)."""
    if getattr(value, "is_integer", None) is True:
        return True
    try:
        return float(value) == int(value)
    except (TypeError, ValueError, OverflowError):
        return False


def _rename_assumed_dims(model: onnx.ModelProto, assumed: list, merged: dict) -> None:
    """The output of a node where ORT assumed two dims equal gets a dim of its own there, so that no rule proves
    the node's result the same shape as one of its inputs (a residual Add whose skip may broadcast).

    ORT goes on merging after the node, and renames the node's output to whichever name the final merge keeps:
    the dims are found by that final name, not by the names the node saw."""
    values = {v.name: v for v in list(model.graph.value_info) + list(model.graph.output)}
    for index, (node, symbols) in enumerate(assumed):
        finals = {_representative(s, merged) for s in symbols}
        for name in node.output:
            value = values.get(name)
            if value is None or not value.type.tensor_type.HasField("shape"):
                continue
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param in finals or (dim.HasField("dim_value") and str(dim.dim_value) in finals):
                    dim.Clear()
                    dim.dim_param = f"lnfuse_broadcast_{index}"


def _representative(symbol, merged: dict) -> str:
    """The name ORT's merges (``merged``: name -> the name it became) leave for ``symbol``."""
    name, seen = str(symbol), set()
    while name in merged and name not in seen:
        seen.add(name)
        name = str(merged[name])
    return name


def _safe_merge(symbols, merged: dict) -> bool:
    """Dims a broadcast may merge without assuming anything: equal already, 1 with anything, or a dim with its own
    clamp by a number (``Min(64, sequence)``: a position buffer sliced to the sequence is equal to it wherever the
    Add runs at all). Names are compared as the merges so far (``merged``) left them."""
    rest = sorted({_representative(d, merged) for d in symbols} - {"0", "1"})
    return len(rest) <= 1 or (len(rest) == 2 and (_clamps(rest[0], rest[1], merged)
                                                  or _clamps(rest[1], rest[0], merged)))


def _clamps(bounded: str, dim: str, merged: dict) -> bool:
    """Whether ``bounded`` is ``Min(n, d)`` or ``Max(n, d)`` for a number n and a d merged with ``dim``."""
    found = (re.fullmatch(r"(?:Min|Max)\((\d+), (.+)\)", bounded)
             or re.fullmatch(r"(?:Min|Max)\((.+), (\d+)\)", bounded))
    if found is None:
        return False
    inner = found.group(2) if found.group(1).isdigit() else found.group(1)
    return _representative(inner, merged) == dim


@contextlib.contextmanager
def _quiet():
    # the symbolic inference prints and logs freely on models it cannot finish
    logger = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def infer_function_types(model: ir.Model) -> None:
    """Give the values inside model-local functions the types and shapes of their calls.

    Only a function whose every call passes the same types and shapes is typed: a rewrite proven for one call
    signature (the axes relative to a rank, a unit scale of one width, a Cast that is a no-op for one dtype) may
    be wrong for another. Untyped bodies are left alone, and the checks that need types refuse.
    """
    for key, calls in _calls(model).items():
        function = model.functions[key]
        if function.attributes:
            continue  # attribute-parametric: the body's types depend on the call
        signatures = {tuple(_signature(v) for v in call.inputs) for call in calls}
        if len(signatures) != 1 or any(None in sig for sig in signatures):
            continue
        call = calls[0]
        inputs = [ir.serde.serialize_value(actual, name=formal.name)
                  for formal, actual in zip(function.inputs, call.inputs)]
        _infer_body(model, function, inputs)


def _signature(value: ir.Value | None):
    if value is None or value.type is None or value.shape is None:
        return None
    return (value.dtype, tuple(str(d) for d in value.shape))


def _calls(model: ir.Model) -> dict:
    calls: dict = {}
    if not model.functions:
        return calls
    for graph in [model.graph, *model.functions.values()]:
        for node in every_node(graph):
            key = (node.domain, node.op_type, node.overload)
            if key in model.functions:
                calls.setdefault(key, []).append(node)
    return calls


def _infer_body(model: ir.Model, function: ir.Function, inputs: list) -> None:
    body = ir.serde.serialize_function(function)
    graph = onnx.helper.make_graph(list(body.node), "body", inputs,
                                   [onnx.helper.make_value_info(o, onnx.TypeProto()) for o in body.output])
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in {**model.opset_imports, **function.opset_imports}.items()]
    probe = onnx.helper.make_model(graph, opset_imports=opsets)
    probe.ir_version = model.ir_version
    hide_oversized(probe)  # only the values' types are read back, by name: the renamed inputs need no restoring
    # the same guards as the main graph's: a Tile of 2^28 in a body took 3.7 GB through data propagation
    propagate = not _has_huge_input(probe) and not _long_vector(_plain(probe)) and not _sizes_out_of_sight(probe)
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, data_prop=propagate).graph
    except Exception:  # noqa: BLE001 - without types the checks refuse and say why
        return
    found = {v.name: v.type for v in list(inferred.value_info) + list(inferred.input) + list(inferred.output)}
    values = {v.name: v for v in function.inputs}
    for node in function:
        values.update({v.name: v for v in node.outputs})
    for name, type_proto in found.items():
        value = values.get(name)
        if value is None or not type_proto.tensor_type.elem_type:
            continue
        value.type = ir.TensorType(ir.DataType(type_proto.tensor_type.elem_type))
        if type_proto.tensor_type.HasField("shape"):
            value.shape = ir.serde.deserialize_type_proto_for_shape(type_proto)
