"""The fusion pass: for every graph (main, subgraphs, functions) and every rule: match -> check -> verify -> rewrite.

The engine knows no op by name: rules say what they match and what they write; the engine enforces what is true of
every rewrite (no deleted intermediate is read elsewhere, the numbers agree in ORT, names of graph outputs are kept,
dead nodes are removed, opsets are declared).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import onnx_ir as ir

from lnfuse.canonical import canonicalize
from lnfuse.pattern import Match
from lnfuse.provenance import mark_fused
from lnfuse.report import Fused, Report, Unfused
from lnfuse.rule import ABSENT, GraphContext, Refusal, Replacement, Rule
from lnfuse.verify import verify

#: match attempts per root node; commuted operands make a few, a pathological graph must not make thousands
_MAX_ATTEMPTS = 64


@dataclass
class Options:
    target: str = "ort"
    verify: bool = True
    rules: tuple[Rule, ...] = ()
    #: called with (fraction of the pass done, what is running) while the pass runs (the CLI draws a bar)
    progress: Callable[[float, str], None] | None = None


@dataclass
class Scope:
    graph: ir.Graph | ir.Function
    path: str
    opset: int


@dataclass
class _Candidate:
    rule: Rule
    replacement: Replacement
    anchors: list[ir.Node]
    notes: list[str] = field(default_factory=list)


@dataclass
class _Pass:
    """What one rule found in one graph."""

    accepted: list[_Candidate] = field(default_factory=list)
    refused: dict[ir.Node, tuple[Refusal, list[ir.Node]]] = field(default_factory=dict)
    #: graph order of the nodes when the pass began (indexing once keeps a pass linear in the graph's size)
    position: dict[ir.Node, float] = field(default_factory=dict)


def fuse_model(model: ir.Model, options: Options, report: Report) -> None:
    """Rewrite ``model`` in place and record what happened in ``report``."""
    names = _all_names(model)
    opsets_used: dict[str, int] = {}
    every_scope = list(scopes(model))
    steps, step = max(1, len(every_scope) * len(options.rules)), 0
    for scope in every_scope:
        ctx = GraphContext(scope.graph, scope.opset, options.target, scope.path, names)
        removed = canonicalize(scope.graph, ctx.fresh_name)
        report.notes.extend(f"{scope.path}: removed {what}" for what in removed)
        refusals: list[tuple[Rule, _Pass]] = []
        swept = False
        for rule in options.rules:
            step += 1
            if options.target not in rule.targets:
                continue
            if options.progress is not None:
                options.progress((step - 1) / steps, f"{scope.path}: {rule.name}")
            found = find(rule, ctx)
            kept = _verified(found.accepted, model, scope, options, report, found)
            for candidate in kept:
                apply(scope.graph, candidate.replacement, found.position)
                opsets_used.update(candidate.replacement.opset_imports)
            refusals.append((rule, found))
            if kept:
                cleanup(scope.graph, kept)
                swept = True
        if removed and not swept:  # nothing fused here, but what the removals left unread goes too
            cleanup(scope.graph, [])
        _record_refusals(scope, refusals, report)
    for domain, version in opsets_used.items():
        model.opset_imports.setdefault(domain, version)
        for function in model.functions.values():
            if any(n.domain == domain for n in function):
                function.opset_imports.setdefault(domain, version)


def scopes(model: ir.Model) -> Iterator[Scope]:
    """Every graph lnfuse rewrites: the main graph, If/Loop/Scan bodies at any depth, and model-local functions."""
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
    yield from _with_subgraphs(model.graph, "main", opset)
    for function in model.functions.values():
        f_opset = function.opset_imports.get("", opset)
        yield from _with_subgraphs(function, f"function {function.domain}::{function.name}", f_opset)


def _with_subgraphs(graph: ir.Graph | ir.Function, path: str, opset: int) -> Iterator[Scope]:
    yield Scope(graph, path, opset)
    for node in list(graph):
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            subs = [attr.value] if attr.type == ir.AttributeType.GRAPH else \
                list(attr.value) if attr.type == ir.AttributeType.GRAPHS else []
            for sub in subs:
                yield from _with_subgraphs(sub, f"{path}/{node.name or node.op_type}.{attr.name}", opset)


def find(rule: Rule, ctx: GraphContext) -> _Pass:
    """Greedy, outputs first: the first match found from the last node of a norm is its largest form."""
    nodes = list(ctx.graph)
    position: dict[ir.Node, float] = {node: i for i, node in enumerate(nodes)}
    found = _Pass(position=position)
    consumed: set[ir.Node] = set()
    roots = [p.root_ops() for p in rule.patterns]
    roots = None if None in roots else frozenset().union(*roots)
    for node in reversed(nodes):
        if node in consumed or not node.outputs or (roots is not None and node.op_type not in roots):
            continue
        candidate = _first_valid(rule, ctx, node.outputs[0], consumed, found, position)
        if candidate is not None:
            found.accepted.append(candidate)
            consumed.update(candidate.replacement.region)
    for pattern, check, reason in rule.near_misses:
        for node in ctx.graph:
            for m in _limited(pattern.match(node.outputs[0] if node.outputs else None, Match())):
                for anchor in rule.anchor_nodes(m):
                    if anchor not in consumed:
                        found.refused.setdefault(anchor, (Refusal(check, reason), list(m.nodes)))
    for candidate in found.accepted:
        for anchor in candidate.anchors:
            found.refused.pop(anchor, None)
    return found


def _limited(matches: Iterator[Match]) -> Iterator[Match]:
    for i, m in enumerate(matches):
        if i >= _MAX_ATTEMPTS:
            return
        yield m


def _first_valid(rule: Rule, ctx: GraphContext, root: ir.Value, consumed: set[ir.Node],
                 found: _Pass, position: dict[ir.Node, float]) -> _Candidate | None:
    for pattern in rule.patterns:
        for m in _limited(pattern.match(root, Match())):
            if consumed.intersection(m.nodes):
                continue
            anchors = list(rule.anchor_nodes(m))
            try:
                _no_function_attributes(m)
                replacement = rule.build(m, ctx)
                check_intermediates(replacement)
                check_no_cycle(replacement, position)
            except Refusal as refusal:
                for anchor in anchors:
                    found.refused.setdefault(anchor, (refusal, list(m.nodes)))
                continue
            # a larger form refused for its gamma/beta means the affine stays outside: say so
            notes = [found.refused[a][0].detail for a in anchors
                     if a in found.refused and found.refused[a][0].check in ("gamma", "beta")]
            return _Candidate(rule, replacement, anchors, notes)
    return None


def _no_function_attributes(m: Match) -> None:
    """An attribute that refers to a function's attribute has a value only at each call: checks cannot read it,
    and a region cut out to verify would silently run without it."""
    for node in m.nodes:
        for attr in node.attributes.values():
            if attr.is_ref():
                raise Refusal("attribute", f"{node.op_type} '{node.name}' takes '{attr.name}' from the function's "
                              f"attribute '{attr.ref_attr_name}', known only at each call")


def check_intermediates(rep: Replacement) -> None:
    """Every value the rewrite deletes must be read only inside the region (or be replaced by a fused output)."""
    region = set(rep.region)
    for node in rep.region:
        for value in node.outputs:
            if value in rep.outputs:
                continue
            if value.is_graph_output():
                raise Refusal("intermediate", f"'{value.name}' ({node.op_type}) is a graph output and the fused op "
                              "cannot produce it")
            for reader, _ in value.uses():
                if reader not in region:
                    raise Refusal("intermediate", f"'{value.name}' ({node.op_type}) is also read by "
                                  f"{reader.op_type} '{reader.name}', and the fused op cannot expose it")


def check_no_cycle(rep: Replacement, position: dict[ir.Node, float]) -> None:
    """The new nodes must not read anything computed from the region they replace (a gamma computed from the
    norm's own mean, say): the fused op would feed itself. Reading a region value through what replaces it is
    fine when an earlier new node produces the replacement (a Reshape after the fused op, whose target is computed
    from the shape of the sum the fused op outputs)."""
    region = set(rep.region)
    start = min(position[n] for n in rep.region)
    order = {node: i for i, node in enumerate(rep.nodes)}
    produced = {v for n in rep.nodes for v in n.outputs}
    for index, new_node in enumerate(rep.nodes):
        stack = [v for v in new_node.inputs if v is not None and v not in produced]
        seen: set[ir.Value] = set()
        while stack:
            value = stack.pop()
            node = value.producer()
            if value in seen or node is None or node not in position or position[node] < start:
                continue
            seen.add(value)
            if node in region:
                replacement = rep.outputs.get(value)
                if replacement is not None and order.get(replacement.producer(), index) < index:
                    continue
                raise Refusal("cycle", f"'{value.name}' is computed inside the norm and also feeds the fused op")
            stack.extend(v for v in node.inputs if v is not None)


def _verified(candidates: list[_Candidate], model: ir.Model, scope: Scope, options: Options, report: Report,
              found: _Pass) -> list[_Candidate]:
    if not candidates:
        return []
    if not options.verify:
        for c in candidates:
            _record_fused(c, scope, None, report)
        return candidates
    opsets = {d: v for d, v in model.opset_imports.items()}
    opsets[""] = scope.opset
    for c in candidates:
        for domain, version in c.replacement.opset_imports.items():
            opsets.setdefault(domain, version)
    outcomes = verify([c.replacement for c in candidates], opsets, model.ir_version, found.position)
    kept = []
    for c, outcome in zip(candidates, outcomes):
        if outcome.ok:
            kept.append(c)
            _record_fused(c, scope, outcome.max_error, report)
        else:
            refusal = Refusal("verify", f"{c.replacement.op_type} rewrite not applied: {outcome.detail}")
            for anchor in c.anchors:
                found.refused[anchor] = (refusal, c.replacement.region)
    return kept


def _record_fused(c: _Candidate, scope: Scope, error: float | None, report: Report) -> None:
    rep = c.replacement
    record = Fused(
        rule=c.rule.name, op_type=rep.op_type, graph=scope.path, nodes=[_label(n) for n in rep.region],
        attributes=rep.attributes, max_error=None if error is None or math.isnan(error) else error,
        outputs=[old.name for old in rep.outputs], notes=c.notes)
    report.fused.append(record)
    mark_fused(rep.nodes, rep.region, record)


def _label(node: ir.Node) -> str:
    """A node's name, or its op type where the exporter left it unnamed (the report must still say what it was)."""
    return node.name or f"<unnamed {node.op_type}>"


def _record_refusals(scope: Scope, passes: list[tuple[Rule, _Pass]], report: Report) -> None:
    """One entry per refused candidate still in the graph; where rules disagree on an anchor, the first rule's
    reason is the one a user needs (a centred norm refused as LayerNormalization is not an RMS near-miss)."""
    reported: set[ir.Node] = set()
    for rule, found in passes:
        by_refusal: dict[int, tuple[Refusal, list[ir.Node], list[ir.Node]]] = {}
        for anchor, (refusal, nodes) in found.refused.items():
            if anchor in reported:
                continue
            if anchor.graph is None:  # fused by a later rule
                if rule.reports_fallback:
                    report.notes.append(f"{scope.path}: {rule.name} left {anchor.op_type} '{_label(anchor)}' to a "
                                        f"later rule ({refusal.check}: {refusal.detail})")
                continue
            by_refusal.setdefault(id(refusal), (refusal, nodes, []))[2].append(anchor)
        for refusal, nodes, anchors in by_refusal.values():
            reported.update(anchors)
            report.unfused.append(Unfused(
                rule=rule.name, graph=scope.path, anchor=", ".join(f"{a.op_type} '{a.name}'" for a in anchors),
                check=refusal.check, reason=refusal.detail, nodes=[_label(n) for n in nodes]))


def apply(graph: ir.Graph | ir.Function, rep: Replacement, position: dict[ir.Node, float]) -> None:
    """Put the new nodes where the region's last node was, point every reader at the new values, drop the region.
    ``position`` (graph order at the start of the pass) gets the new nodes, between the region's last node and the
    node after it."""
    host = graph.graph if isinstance(graph, ir.Function) else graph
    new_constants = []
    for node in rep.nodes:
        for value in node.inputs:
            if value is not None and value.producer() is None and value.const_value is not None \
                    and value.graph is None and value not in new_constants:
                new_constants.append(value)
    last = max(rep.region, key=lambda n: position[n])
    constant_nodes = []
    for value in new_constants:
        if isinstance(graph, ir.Function):  # functions have no initializers
            constant_nodes.append(ir.node("Constant", [], {"value": value.const_value}, outputs=[value],
                                          name=f"{value.name}/Constant"))
        else:
            host.register_initializer(value)
    inserted = constant_nodes + rep.nodes
    host.insert_after(last, inserted)
    for node in rep.nodes:
        for out in node.outputs:
            if out.meta.get(ABSENT):
                out.name = ""  # after insertion: the graph names every unnamed value it receives
    named_outputs: set[ir.Value] = set()
    for old, new in rep.outputs.items():
        if old.is_graph_output():
            if new in named_outputs:
                identity = ir.node("Identity", [new], name=f"{old.name}/Identity")
                host.insert_after(rep.nodes[-1], [identity])
                inserted.append(identity)
                new = identity.outputs[0]
            name = old.name
            old.name = f"{name}__replaced"
            new.name = name
            named_outputs.add(new)
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    host.remove(rep.region, safe=True)
    for k, node in enumerate(inserted, start=1):
        position[node] = position[last] + k / (len(inserted) + 1)
    if any(position.get(reader, -1) < position[last] for new in rep.outputs.values()
           for reader, _ in new.uses() if reader in position):
        host.sort()
        position.update({node: i for i, node in enumerate(host)})


def cleanup(graph: ir.Graph | ir.Function, kept: list[_Candidate]) -> None:
    """Remove Reshapes that now give a fused output the shape it already has, then every node and initializer
    nothing reads (the shape bookkeeping of the removed regions, Constants of epsilon...). Only graphs lnfuse
    rewrote are swept, and nothing that computes a graph output is touched."""
    host = graph.graph if isinstance(graph, ir.Function) else graph
    for c in kept:
        for node in c.replacement.nodes:
            for new in node.outputs:
                _bypass_identity_reshapes(host, new)
    for node in reversed(list(host)):
        if not any(out.uses() or out.is_graph_output() for out in node.outputs):
            host.remove(node, safe=True)
    if not isinstance(graph, ir.Function):
        for name, value in list(host.initializers.items()):
            if not value.uses() and not value.is_graph_input() and not value.is_graph_output():
                del host.initializers[name]


def _bypass_identity_reshapes(host: ir.Graph, value: ir.Value) -> None:
    """Reshape chains that bring a fused output back to the shape it already has are the identity."""
    chain, current = [], value
    while True:
        readers = [(r, i) for r, i in current.uses()]
        if len(readers) != 1 or readers[0][0].op_type != "Reshape" or readers[0][1] != 0 \
                or readers[0][0].graph is not host:
            return
        chain.append(readers[0][0])
        current = readers[0][0].outputs[0]
        if current.is_graph_output() and not _same_static_shape(value, current):
            return  # the model's output needs that intermediate shape
        if _same_static_shape(value, current):
            break
    if current.is_graph_output():
        if value.is_graph_output():
            return
        name = current.name
        current.name = f"{name}__replaced"
        value.name = name
    current.replace_all_uses_with(value, replace_graph_outputs=True)
    host.remove(chain, safe=True)


def _same_static_shape(a: ir.Value, b: ir.Value) -> bool:
    return a.shape is not None and b.shape is not None and a.shape.is_static() and b.shape.is_static() \
        and list(a.shape) == list(b.shape)


def _all_names(model: ir.Model) -> set[str]:
    names = set()
    for graph in [model.graph, *model.functions.values()]:
        for value in graph.inputs:
            names.add(value.name)
        for node in ir.traversal.RecursiveGraphIterator(graph):
            names.add(node.name)
            names.update(v.name for v in node.outputs)
            names.update(v.name for v in node.inputs if v is not None)
    names.update(model.graph.initializers)
    return names
