"""Shape inference on demand: ONNX Runtime's symbolic inference runs only where candidates need it, on a budget.

onnx's inference (C++, exact) runs at load on every model: it costs milliseconds. Where it leaves dims unknown,
ONNX Runtime's symbolic inference can name them (the residual rule proves addends the same shape with those names),
but it is Python and sympy: about 0.1 ms a node on a transformer, and seconds for each Resize of a detector's neck,
where sympy simplifies nested floor expressions (a 50-Resize FPN took 27 s, where loading and saving take 0.1 s).
So at load it is only prepared (``infer_shapes_deferred``), and the engine asks for it (``PendingShapes.resolve``)
once it knows where the candidates are, and only if onnx's shapes do not decide them:

* no candidates (no node of any rule's anchor ops): it never runs;
* candidates, all decided on onnx's shapes (each rule's pass fused every norm-like statistic of its kind, no
  check refused a match but on ranks, numbers and dtypes (``Refusal.decided``), and each fused op reads one
  run-time tensor besides constants, or is of a rule that refuses what it cannot prove instead of fusing less):
  it never runs. A fact onnx leaves unknown is refused by the checks, never assumed, so these fusions hold; and a
  dim only ORT's inference could name can change a pass only through a refusal, a statistic left unmatched or a
  no-op not proved (``engine._undecided``), where it then runs and the pass is done again;
* candidates: it runs on the whole model if the model is small (``WHOLE_NODES``; the shapes are then exactly what
  they always were), else on the candidates' cone (the nodes near an anchor and every node they are computed from:
  a value's shape depends only on those);
* either way within a budget of CPU seconds growing with the nodes it infers (``budget_seconds``); past it, the
  whole model's run is retried on the cone when that is smaller, and otherwise onnx's shapes are kept. The report
  says which happened, and why.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import onnx
import onnx_ir as ir

from lnfuse.index.shapes import (Claims, OnnxVerdict, infer_with_claims, ort_symbolic, take_claims,
                                 infer_function_types)
from lnfuse.index.traversal import every_node, proto_bodies
from lnfuse.index.ops import is_op

#: a model of at most this many nodes (subgraphs included) is inferred whole, as it always was: ORT's symbolic
#: inference takes about a second on it where no op makes sympy slow, and dim names merged anywhere in the model
#: are then the same as before demand-driven inference
WHOLE_NODES = 10_000
#: the CPU seconds ORT's symbolic inference may take: a base (its set-up, and a small model's every node) plus an
#: allowance per node inferred. Wide, as a backstop against what is not known to be slow: the sample models take at
#: most 0.43 s (Swin, 953 nodes: a 4.5x margin, so a slower CPU finds the same shapes), a transformer about 0.1 ms
#: a node, a Conv on dynamic dims about 3 ms. CPU time of the inferring thread, not wall time, so that a busy
#: machine does not change which shapes are found.
BASE_SECONDS = 1.0
SECONDS_PER_NODE = 1e-3
#: past this many Resize ops, resized dims are computed without ``sympy.simplify`` (up to seconds a node on a
#: detector's neck: ``shapes.Recording._infer_Resize``); at most this many, ORT's own arithmetic runs as it always did
RESIZE_LIMIT = 8
#: how often the watchdog reads the inferring thread's CPU clock
_POLL_SECONDS = 0.02


def budget_seconds(nodes: int) -> float:
    return BASE_SECONDS + SECONDS_PER_NODE * nodes


def infer_shapes_deferred(proto: onnx.ModelProto, check_types: bool = False
                          ) -> tuple[onnx.ModelProto, str | None, PendingShapes | None]:
    """``shapes.infer_shapes`` without ONNX Runtime's symbolic inference: onnx's own only. Where that leaves a dim
    unknown, the third result holds what the symbolic inference needs to run later; None when onnx's was complete.
    ``proto`` gives up its value_info, and is kept (without it) by the pending inference. ``check_types``: as for
    ``shapes.infer_shapes``."""
    claims, verdict = take_claims(proto.graph), OnnxVerdict()
    inferred, error, complete = infer_with_claims(proto, claims, None, check_types, verdict)
    return inferred, error, None if complete else PendingShapes(proto, claims, verdict)


class _OverBudget(BaseException):
    """Raised inside ORT's symbolic inference when its budget is spent. A BaseException: ORT's and sympy's
    ``except Exception`` blocks must not swallow it."""


class _Interrupted(_OverBudget):
    """The watchdog's ``_OverBudget``, raised asynchronously in the inferring thread (``_within``)."""


@dataclass
class PendingShapes:
    """A model whose shapes onnx's inference left incomplete at load: its skeleton (weights as typed inputs, no
    value_info) and its declared claims, kept until the engine knows which values candidates need."""

    skeleton: onnx.ModelProto | None
    claims: Claims
    #: what onnx's inference of the skeleton found at load (it need not run again on it)
    verdict: OnnxVerdict
    #: times ORT's symbolic inference was started on this model (what tests and benchmarks can observe)
    symbolic_runs: int = 0

    def resolve(self, model: ir.Model, seeds: Iterable[str] | None, why: str | None = None,
                needed: bool = True, aliases: Mapping[ir.Value, str] | None = None) -> list[str]:
        """Give ``model``'s values the symbolic inference's shapes where candidates need them. ``seeds``: the
        names of the values the candidates read and write (None or empty: there are no candidates). ``why``: what
        onnx's shapes left undecided, for the report. ``needed=False``: every candidate was decided on onnx's
        shapes, and it is not run. ``aliases``: values written since load, each typed like the value of that name
        it replaced. Returns what happened, for the report; the skeleton is let go."""
        skeleton, self.skeleton = self.skeleton, None
        if skeleton is None:
            return []
        seeds = set(seeds or ())
        total = _count_nodes(skeleton.graph)
        if not seeds:
            return [f"shapes: onnx's inference left some dims unknown; ONNX Runtime's symbolic inference was not run "
                    f"(no normalization candidates in {total} nodes)"]
        if not needed:
            return ["shapes: onnx's inference left some dims unknown; ONNX Runtime's symbolic inference was not run "
                    "(every candidate was decided on onnx's shapes: no check refused, no fused op reads several "
                    "run-time tensors, no norm-like statistic was left unmatched)"]
        notes = []
        for label, proto, claims, names, verdict in self._attempts(skeleton, seeds, total):
            nodes = _count_nodes(proto.graph)
            budget = budget_seconds(nodes)
            resizes = _count_ops(proto.graph, "Resize")
            plain = resizes > RESIZE_LIMIT
            if plain:
                label += f" (its {resizes} Resize ops without sympy.simplify)"
            self.symbolic_runs += 1
            inferred = _within(budget, lambda check, p=proto, c=claims, v=verdict: infer_with_claims(
                p, c, lambda q: ort_symbolic(q, check, plain), verdict=v)[0])
            if inferred is None:
                notes.append(f"shapes: ONNX Runtime's symbolic inference of {label} stopped at its budget "
                             f"({budget:.2f} CPU-s for {nodes} nodes)")
                continue
            _apply(model, inferred, names, aliases or {})
            # no seconds in the note: the report is the same from run to run (the benchmark measures time)
            notes.append(f"shapes: ONNX Runtime's symbolic inference ran on {label}"
                         + (f", as onnx's shapes left a candidate undecided ({why})" if why else ""))
            return notes
        notes.append("shapes: kept onnx's inference alone; checks that need a dim it left unknown refuse and say so")
        return notes

    def _attempts(self, skeleton: onnx.ModelProto, seeds: set[str], total: int) -> Iterator[tuple]:
        """What to infer, in order, until one is done within its budget: the whole model if it is small or the
        cone is all of it, then the candidates' cone if that is smaller (found only when it is needed: a small
        model inferred whole within its budget never needs it)."""
        nodes = len(skeleton.graph.node)
        cone = None if total <= WHOLE_NODES else _cone(skeleton.graph, seeds)
        if cone is None or len(cone) == nodes:
            yield "the whole model", skeleton, self.claims, None, self.verdict
        cone = cone if cone is not None else _cone(skeleton.graph, seeds)
        if len(cone) < nodes:
            sub, names = _sub_skeleton(skeleton, cone)
            # the claims of the values it computes; its outputs are its own, and bodies keep theirs
            declared = {name: info for name, info in self.claims[0].items() if name in names}
            yield (f"the candidates' cone ({len(cone)} of {nodes} nodes)", sub,
                   (declared, [onnx.TypeProto() for _ in sub.graph.output], []), names, None)


def _within(seconds: float, work: Callable[[Callable[[], None]], onnx.ModelProto]) -> onnx.ModelProto | None:
    """``work(check)``, or None if it takes more than ``seconds`` of this thread's CPU time.

    sympy can spend seconds inside one node, so a check between nodes (``check``, which ORT's loop calls) is not
    enough: a watchdog thread reads this thread's CPU clock and, past the budget, raises ``_Interrupted`` in it
    (``PyThreadState_SetAsyncExc``: raised at the next bytecode, so inside sympy's pure Python; it works in any
    thread, unlike a signal, and costs nothing while it waits, unlike a trace function). A C call in progress
    finishes first; ``check`` is the backstop should an exception handler in between swallow it.

    An exception sent and not yet raised when the work ends is raised here and caught (``_absorb``), never
    cleared with ``SetAsyncExc(NULL)``: CPython 3.11 then leaves the interpreter's eval breaker set for good, and
    under a profiler or tracer (cProfile, coverage) the next function entry spins forever."""
    thread = threading.get_ident()
    clock = _cpu_clock(thread)
    start = clock()
    lock, open_, sent = threading.Lock(), [True], [False]
    fired, stop = threading.Event(), threading.Event()

    def watch() -> None:
        while not stop.wait(_POLL_SECONDS):
            if clock() - start > seconds:
                with lock:
                    if open_[0]:
                        fired.set()
                        sent[0] = True
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                                                   ctypes.py_object(_Interrupted))
                return

    def check() -> None:  # the watchdog reads the clock: a thread's CPU clock is a system call, too dear per node
        if fired.is_set():
            raise _OverBudget

    def close() -> None:
        with lock:
            open_[0] = False  # from here on the watchdog sends nothing
        stop.set()
        if sent[0]:
            _absorb()

    watchdog = threading.Thread(target=watch, name="lnfuse-shape-budget", daemon=True)
    result = None
    try:
        watchdog.start()
        result = work(check)
    except _OverBudget:
        result = None
    # the sent exception may surface anywhere until absorbed, close() included: repeat until it ran through
    while True:
        try:
            close()
            break
        except _Interrupted:
            continue
    watchdog.join()
    return None if fired.is_set() else result


def _absorb() -> None:
    """Raise a pending asynchronous exception here: CPython checks for one on entering a Python function, so the
    call to ``_entered`` raises it if it is pending, and does nothing otherwise."""
    try:
        _entered()
    except _Interrupted:
        pass


def _entered() -> None:
    return None


def _cpu_clock(thread: int) -> Callable[[], float]:
    """The CPU clock of ``thread`` (readable from another thread), or wall time where the system has none."""
    try:
        clock_id = time.pthread_getcpuclockid(thread)
        time.clock_gettime(clock_id)
    except (AttributeError, OSError):
        return time.perf_counter
    return lambda: time.clock_gettime(clock_id)


def _count_nodes(graph: onnx.GraphProto) -> int:
    return _count_ops(graph, None)


def _count_ops(graph: onnx.GraphProto, op_type: str | None) -> int:
    """The nodes of ``graph`` and its bodies (of ``op_type`` only, when given)."""
    return sum(len(g.node) if op_type is None else sum(is_op(n, op_type) for n in g.node)
               for g in [graph, *proto_bodies(graph.node)])


def _reads(node: onnx.NodeProto) -> list[str]:
    """The names a node reads: its inputs and, for a node with bodies, every name read inside them (outer-scope
    values included; the body's own names are not the main graph's, so they are simply not found there)."""
    names = list(node.input)
    stack = [a for a in node.attribute if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)]
    while stack:
        attr = stack.pop()
        for body in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            for inner in body.node:
                names.extend(inner.input)
                stack.extend(a for a in inner.attribute
                             if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS))
    return names


def _cone(graph: onnx.GraphProto, seeds: set[str]) -> list[int]:
    """Positions of the main graph's nodes that write or read a seed, and of every node they are computed from."""
    producer = {name: i for i, node in enumerate(graph.node) for name in node.output if name}
    work = [i for i, node in enumerate(graph.node)
            if any(name in seeds for name in node.output) or any(name in seeds for name in node.input)]
    kept = set(work)
    while work:
        for name in _reads(graph.node[work.pop()]):
            index = producer.get(name)
            if index is not None and index not in kept:
                kept.add(index)
                work.append(index)
    return sorted(kept)


def _sub_skeleton(skeleton: onnx.ModelProto, cone: list[int]) -> tuple[onnx.ModelProto, set[str]]:
    """The skeleton cut to ``cone``'s nodes; its outputs are the values no node of the cone reads (ORT's inference
    visits only the nodes that lead to an output). Returns it and the names of the values it computes."""
    graph = skeleton.graph
    nodes = [graph.node[i] for i in cone]
    names = {name for node in nodes for name in node.output if name}
    read = {name for node in nodes for name in _reads(node)}
    outputs = [name for name in dict.fromkeys(n for node in nodes for n in node.output if n) if name not in read]
    sub = onnx.ModelProto(ir_version=skeleton.ir_version)
    sub.opset_import.extend(skeleton.opset_import)
    sub.functions.extend(skeleton.functions)
    sub.graph.CopyFrom(onnx.helper.make_graph(nodes, graph.name, list(graph.input),
                                              [onnx.helper.make_value_info(n, onnx.TypeProto()) for n in outputs],
                                              list(graph.initializer)))
    return sub, names


def _apply(model: ir.Model, inferred: onnx.ModelProto, only: set[str] | None,
           aliases: Mapping[ir.Value, str] | None = None) -> None:
    """Set the types ``inferred`` gives on ``model``'s values (those named in ``only``, when given): the main
    graph's, its outputs' (the whole model only: a cone's outputs are its own) and its bodies'; then the
    functions', from their call sites' new types."""
    graph = inferred.graph
    _rename_unknown_dims(graph)
    types = {v.name: v.type for v in graph.value_info}
    for body in proto_bodies(graph.node):
        types.update((v.name, v.type) for v in list(body.value_info) + list(body.output))
    if only is not None:
        types = {name: t for name, t in types.items() if name in only}
    read: dict[bytes, tuple[ir.Shape | None, ir.TypeProtocol | None]] = {}
    for node in every_node(model.graph):
        for value in node.outputs:
            type_proto = types.get(value.name)
            if type_proto is None or (value.is_graph_output() and node.graph is model.graph):
                continue
            _set(value, type_proto, read)
    for value, name in (aliases or {}).items():
        type_proto = types.get(name)
        if type_proto is not None and not value.is_graph_output():
            _set(value, type_proto, read)
    if only is None:
        for value, info in zip(model.graph.outputs, graph.output):
            if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
                _set(value, info.type, read)
    if model.functions:
        infer_function_types(model)


def _rename_unknown_dims(graph: onnx.GraphProto) -> None:
    """Rename the ``unk__N`` dims this late inference made (onnx's pass after ORT's names them so) to
    ``unk__late_N``: the values it does not retype (outside the cone, or made by canonicalization or an earlier
    rewrite) keep the names onnx's inference at load gave, which count from ``unk__0`` too, and the same name means
    the same dim. A graph input's own dim names (an exporter may write ``unk__183`` there) are the same dims in
    both, and stay."""
    declared = {d.dim_param for v in graph.input for d in v.type.tensor_type.shape.dim}
    infos = [*graph.value_info, *graph.output]
    for body in proto_bodies(graph.node):
        infos += [*body.value_info, *body.output]
    for info in infos:
        for dim in info.type.tensor_type.shape.dim:
            if dim.dim_param.startswith("unk__") and dim.dim_param not in declared:
                dim.dim_param = "unk__late_" + dim.dim_param[len("unk__"):]


def _set(value: ir.Value, type_proto: onnx.TypeProto, read: dict) -> None:
    """As onnx_ir sets a value's type from value_info, each distinct type read once (frozen shapes are shared)."""
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.elem_type:
        return
    key = type_proto.SerializeToString()
    if key not in read:
        read[key] = (ir.serde.deserialize_type_proto_for_shape(type_proto),
                     ir.serde.deserialize_type_proto_for_type(type_proto))
    shape, kind = read[key]
    value.shape, value.type = shape, ir.TensorType(kind.dtype) if type(kind) is ir.TensorType else kind


