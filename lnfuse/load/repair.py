"""Read a model the way ONNX Runtime reads it: repair what ORT repairs itself, refuse what ORT refuses.

The input contract is "every model the installed ONNX Runtime loads". ORT sorts nodes that are out of order,
declares a contrib domain a model uses without importing it, reads any IR version it was built for, treats a dim of
-1 as unknown, reads the domain "ai.onnx" as the default one, keeps the last of two initializers of one name, takes
initializers that are not graph inputs at IR version 3, and runs a model-local function written at another opset
at the model's. onnx's checker and lnfuse's own shape code refuse all of these, so each is repaired here, on the
proto, before anything else looks at the model, to a model that computes the same. What cannot be repaired (a real
cycle, an IR version the runtime cannot read) is refused with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import onnx

from lnfuse.errors import InputError
from lnfuse.index.ops import is_op, ort_schemas


def repair(proto: onnx.ModelProto, where: str) -> None:
    """Make ``proto`` (in place) what ORT would run, or raise ``InputError`` with what ORT would refuse."""
    _check_ir_version(proto, where)
    _default_domain_spelled_once(proto)
    _functions_at_the_models_opsets(proto)
    for nodes, available, scope in _scopes(proto, where):
        _sort_nodes(nodes, available, scope)
    # listed once, after sorting (a sort copies the nodes, and the bodies they hold with them); on a graph of a
    # million nodes each walk of it costs a second
    graphs = [graph for graph, _ in _graphs(proto.graph, frozenset())]
    _declare_missing_domains(proto, graphs)
    _unknown_negative_dims(graphs)
    _last_initializer_of_each_name(proto.graph)
    _no_declarations_of_initializers(proto.graph)
    _initializers_need_not_be_inputs(proto)


def _scopes(proto: onnx.ModelProto, where: str) -> Iterator[tuple[object, set[str], str]]:
    """Each list of nodes that must be in order: the main graph, function bodies, and the bodies of If/Loop/Scan
    nodes in either, with the names defined before their first node."""
    for graph, outer in _graphs(proto.graph, frozenset()):
        yield graph.node, _names_defined(graph) | outer, f"{where}: graph '{graph.name}'"
    for function in proto.functions:
        inputs = frozenset(function.input)
        yield function.node, set(inputs), f"{where}: function '{function.name}'"
        for sub in (sub for node in function.node for attr in node.attribute for sub in _subgraphs_of(attr)):
            for graph, outer in _graphs(sub, inputs):
                yield graph.node, _names_defined(graph) | outer, f"{where}: graph '{graph.name}'"


# -- IR version: a fact about the installed runtime ---------------------------------------------------------------

#: the IR version every onnxruntime lnfuse supports reads (pyproject: onnxruntime>=1.20 reads IR 10); a model at
#: most this old is not probed for the installed runtime's limit (a session built to fail, per model)
_READ_BY_EVERY_RUNTIME = 10


def _check_ir_version(proto: onnx.ModelProto, where: str) -> None:
    limit = runtime_max_ir_version() if proto.ir_version > _READ_BY_EVERY_RUNTIME else None
    if limit is not None and proto.ir_version > limit:
        raise InputError(f"{where}: IR version {proto.ir_version} is newer than the installed ONNX Runtime reads "
                         f"(<= {limit}); upgrade onnxruntime or re-export with an older onnx")
    if proto.ir_version > onnx.IR_VERSION:
        # ORT reads it but the installed onnx's checker does not: what lnfuse writes must pass that checker
        proto.ir_version = onnx.IR_VERSION


def runtime_max_ir_version() -> int | None:
    """The highest IR version the installed ONNX Runtime loads. ORT does not expose it, so it is asked once: a
    one-node model at an absurd IR version is refused with the limit in the message."""
    import onnxruntime as ort

    probe = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "probe",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])]))
    probe.ir_version = 1 << 30
    try:
        ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - ORT raises its own exception types; only the message matters
        found = re.search(r"max supported IR version:\s*(\d+)", str(error))
        return int(found.group(1)) if found else None
    return None


# -- domains and versions ---------------------------------------------------------------------------------------

def _default_domain_spelled_once(proto: onnx.ModelProto) -> None:
    """"ai.onnx" is the default domain's other name to ORT in the main graph and its bodies (not in a model-local
    function, where ORT refuses it, and so does the checker); onnx's checker knows only "". Nodes and imports say "";
    of two imports of the default domain, ORT runs the one listed last."""
    for graph, _ in _graphs(proto.graph, frozenset()):
        for node in graph.node:
            if node.domain == "ai.onnx":
                node.domain = ""
    imports = proto.opset_import
    default = [i for i, entry in enumerate(imports) if entry.domain in ("", "ai.onnx")]
    if not any(imports[i].domain == "ai.onnx" for i in default):
        return
    imports[default[-1]].domain = ""
    for i in reversed(default[:-1]):
        del imports[i]


def _functions_at_the_models_opsets(proto: onnx.ModelProto) -> None:
    """A model-local function may import a domain at another version than the model. ORT inlines it and runs its
    ops at the model's version, not the function's (a Softmax(axis=1) of a function at opset 11 in a model at 17
    computes opset 13's Softmax; an op whose inputs changed between the two fails to load); onnx's checker refuses
    the mix. Importing the model's versions in the function says what ORT computes."""
    model = {i.domain: i.version for i in proto.opset_import}
    for function in proto.functions:
        for i in function.opset_import:
            i.version = model.get(i.domain, i.version)


# -- node order ---------------------------------------------------------------------------------------------------

def _graphs(graph: onnx.GraphProto, outer: frozenset[str]) -> Iterator[tuple[onnx.GraphProto, frozenset[str]]]:
    """The graph and every If/Loop/Scan body inside it, each with the names its enclosing scopes define."""
    yield graph, outer
    inner = None
    for node in graph.node:
        if not node.attribute:  # most nodes have none: testing is a third of the cost of listing them
            continue
        for attr in node.attribute:
            for sub in _subgraphs_of(attr):
                inner = inner if inner is not None else frozenset(outer | _names_defined(graph))
                yield from _graphs(sub, inner)


def _subgraphs_of(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    return ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)


def _names_defined(graph: onnx.GraphProto) -> set[str]:
    return {v.name for v in graph.input} | {t.name for t in graph.initializer} | \
        {t.name for t in graph.sparse_initializer}


def _reads(node: onnx.NodeProto) -> set[str]:
    """The names a node reads: its inputs and what its bodies read from the enclosing scopes."""
    names = {name for name in node.input if name}
    for attr in node.attribute:
        for sub in _subgraphs_of(attr):
            names |= _outer_reads(sub)
    return names


def _outer_reads(graph: onnx.GraphProto) -> set[str]:
    defined = _names_defined(graph) | {out for node in graph.node for out in node.output}
    return {name for node in graph.node for name in _reads(node)} - defined


def _sort_nodes(nodes, available: set[str], where: str) -> None:
    """Put ``nodes`` in an order where each node comes after the producers of what it reads, keeping the order they
    had wherever it is already valid. A cycle is refused with the nodes on it."""
    if _in_order(nodes, set(available)):
        return
    import networkx as nx  # here: only an unsorted graph needs it, and importing it costs 0.1 s at every start

    producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    order = nx.DiGraph()
    order.add_nodes_from(range(len(nodes)))
    order.add_edges_from((producer[name], i) for i, node in enumerate(nodes) for name in _reads(node)
                         if name in producer)
    try:
        ordered = list(nx.lexicographical_topological_sort(order))
    except nx.NetworkXUnfeasible:
        cycle = [nodes[a] for a, _ in nx.find_cycle(order)]
        path = " -> ".join(_label(n) for n in cycle + cycle[:1])
        raise InputError(f"{where}: the nodes form a cycle ({path}); ONNX Runtime refuses it too; fix the model "
                         "where it was made") from None
    sorted_nodes = [onnx.NodeProto.FromString(nodes[i].SerializeToString()) for i in ordered]
    del nodes[:]
    nodes.extend(sorted_nodes)


def _in_order(nodes, known: set[str]) -> bool:
    """Whether no node reads a name that a node after it produces, in one pass over the protos (each field read
    of a NodeProto costs: a million-node graph is read once here)."""
    early: set[str] = set()  # read before anything defined them: from outside, undefined, or produced later
    for node in nodes:
        inputs = node.input
        if not known.issuperset(inputs):
            early.update(name for name in inputs if name not in known)
        if node.attribute:
            early.update(name for name in _reads(node) if name not in known)
        known.update(node.output)
    # an early name was not known when read, so it is not one of the names given before the first node: it is in
    # ``known`` now only if a node produced it (at or after its reader)
    return early.isdisjoint(known)


def _label(node: onnx.NodeProto) -> str:
    return f"{node.op_type} '{node.name or node.output[0]}'"


# -- domains ------------------------------------------------------------------------------------------------------

def _declare_missing_domains(proto: onnx.ModelProto, graphs: list[onnx.GraphProto]) -> None:
    """A node of a domain the model does not import runs in ORT at the latest version ORT knows for that domain
    (ORT adds the import itself); declare it so, in the model and in each function that uses it. ``graphs``: the
    main graph and the bodies inside it."""
    local = {f.domain for f in proto.functions}
    scopes = [(proto.opset_import, {n.domain for graph in graphs for n in graph.node})] + \
        [(f.opset_import, {n.domain for n in _nodes_in(f.node)}) for f in proto.functions]
    latest = None
    for imports, domains in scopes:
        declared = {"" if i.domain == "ai.onnx" else i.domain for i in imports}
        missing = domains - {"", "ai.onnx"} - declared - local
        latest = latest if latest is not None or not missing else _runtime_domains()
        for domain in sorted(missing & set(latest or ())):
            imports.append(onnx.helper.make_opsetid(domain, latest[domain]))


def _runtime_domains() -> dict[str, int]:
    latest: dict[str, int] = {}
    for (domain, _), schema in ort_schemas().items():
        latest[domain] = max(latest.get(domain, 1), schema.since_version)
    return latest


def _nodes_in(nodes) -> list[onnx.NodeProto]:
    found = []
    for node in nodes:
        found.append(node)
        for attr in node.attribute:
            for sub in _subgraphs_of(attr):
                found.extend(n for graph, _ in _graphs(sub, frozenset()) for n in graph.node)
    return found


# -- dims ---------------------------------------------------------------------------------------------------------

def _unknown_negative_dims(graphs: list[onnx.GraphProto]) -> None:
    """A dim written as -1 (or any negative value) means "unknown" to ORT. It becomes a symbolic dim of its own name
    (valid ONNX with the same meaning), so shape inference can carry it through the graph: a lookup indexed by an
    input of unknown dims still has the input's dims. ``graphs``: the main graph and the bodies inside it."""
    taken = {dim.dim_param for graph in graphs
             for info in [*graph.input, *graph.output, *graph.value_info] for dim in _dims(info.type)}
    for graph in graphs:
        for info in [*graph.input, *graph.output, *graph.value_info]:
            for axis, dim in enumerate(_dims(info.type)):
                if dim.HasField("dim_value") and dim.dim_value < 0:
                    name = f"{info.name}_dim{axis}"
                    while name in taken:
                        name += "_"
                    taken.add(name)
                    dim.dim_param = name


def _dims(type_proto: onnx.TypeProto) -> Iterator[onnx.TensorShapeProto.Dimension]:
    kind = type_proto.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        yield from getattr(type_proto, kind).shape.dim
    elif kind in ("sequence_type", "optional_type"):
        yield from _dims(getattr(type_proto, kind).elem_type)
    elif kind == "map_type":
        yield from _dims(type_proto.map_type.value_type)


# -- initializers -------------------------------------------------------------------------------------------------

def _last_initializer_of_each_name(graph: onnx.GraphProto) -> None:
    """Two initializers of one name in the main graph, or an initializer and a Constant node's output: ORT uses the
    one it meets last, the Constant after every initializer (and warns). Keep that one. In a body ORT refuses the
    duplicate, and the checker refuses it too."""
    constants = {out for node in graph.node if is_op(node, "Constant")
                 for out in node.output}
    last = {t.name: i for i, t in enumerate(graph.initializer)}
    if len(last) == len(graph.initializer) and constants.isdisjoint(last):
        return
    kept = [t for i, t in enumerate(graph.initializer) if last[t.name] == i and t.name not in constants]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _no_declarations_of_initializers(graph: onnx.GraphProto) -> None:
    """A value_info naming an initializer of the main graph: ORT ignores it and reads the initializer as it is,
    whatever dtype or shape the value_info says; so does lnfuse, which drops it (shape inference and the rules would
    otherwise read a shape the tensor does not have)."""
    held = {t.name for t in graph.initializer}
    kept = [v for v in graph.value_info if v.name not in held]
    if len(kept) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(kept)


def _initializers_need_not_be_inputs(proto: onnx.ModelProto) -> None:
    """Before IR version 4 every initializer had to be a graph input too; ORT reads one that is not as a constant,
    which is what IR version 4 says it is."""
    if proto.ir_version < 4:
        inputs = {i.name for i in proto.graph.input}
        if any(t.name not in inputs for t in proto.graph.initializer):
            proto.ir_version = 4


# -- graph outputs without a shape --------------------------------------------------------------------------------

def declare_output_shapes(proto: onnx.ModelProto, skeleton: onnx.ModelProto) -> None:
    """A main-graph output typed without a shape (``make_tensor_value_info(name, type, None)``), or not typed at all,
    is an output of unknown rank (and type) to ORT; onnx's checker wants the fields. Declare what shape inference
    finds for it (on the weightless ``skeleton``), in both protos. An output whose type or rank inference cannot
    find stays as it is (and the checker names it)."""
    untyped = [i for i, out in enumerate(proto.graph.output) if out.type.WhichOneof("value") is None]
    missing = [i for i, out in enumerate(proto.graph.output)
               if out.type.HasField("tensor_type") and not out.type.tensor_type.HasField("shape")]
    if not missing and not untyped:
        return
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton)
    except Exception:  # noqa: BLE001 - onnx raises several types; without inference the checker speaks
        return
    for i in untyped:
        found = inferred.graph.output[i].type
        if found.HasField("tensor_type") and found.tensor_type.elem_type and found.tensor_type.HasField("shape"):
            for target in (proto.graph.output[i], skeleton.graph.output[i]):
                target.type.CopyFrom(found)
    for i in missing:
        found = inferred.graph.output[i].type.tensor_type
        if found.HasField("shape"):
            for target in (proto.graph.output[i], skeleton.graph.output[i]):
                target.type.tensor_type.shape.CopyFrom(found.shape)
