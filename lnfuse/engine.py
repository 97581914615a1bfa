"""The fusion pass: for every graph (main, subgraphs, functions) and every rule: match -> check -> verify -> rewrite.

The engine knows no op by name: rules say what they match and what they write; the engine enforces what is true of
every rewrite (no deleted intermediate is read elsewhere, the numbers agree in ORT, names of graph outputs are kept,
dead nodes are removed, opsets are declared).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from lnfuse.errors import out_of_memory
from lnfuse.match import candidates as statistics
from lnfuse.match.algebra import Cache
from lnfuse.index.canonical import canonicalize
from lnfuse.index.constants import is_static, static_value
from lnfuse.index.demand import PendingShapes
from lnfuse.match.pattern import Match, noop_in_doubt
from lnfuse.save.provenance import mark_fused
from lnfuse.match.quantized_norms import rounding_reason
from lnfuse.report import Candidate, Fused, Refused, Report, Unfused
from lnfuse.match.rule import ABSENT, GraphContext, Refusal, Replacement, Rule
from lnfuse.index.shapes import infer_shapes
from lnfuse.index.traversal import every_node
from lnfuse.verification.region import Outcome, verify
from lnfuse.index.ops import is_op, known_op

#: match attempts per root node; commuted operands make a few, a pathological graph must not make thousands
_MAX_ATTEMPTS = 64
#: how many producer steps a match may span from its root to the anchor it covers; a root farther from every anchor
#: cannot match, so it is not tried (the normal form reads through at most 48 chain nodes, the patterns around it a
#: few more: this bound leaves a wide margin)
_REACH = 160


@dataclass
class Options:
    target: str = "ort"
    verify: bool = True
    rules: tuple[Rule, ...] = ()
    #: keep a verified rewrite whose float rounding difference reaches a quantizer (see ``verify.verify``)
    allow_requantization: bool = False
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
class _Attempt:
    """One match of an anchor that a check refused, with the nodes it covered (how far it matched)."""

    refusal: Refusal
    nodes: list[ir.Node]
    #: how far through the checks it got: 0 the rule's own checks (a form whose pieces do not fit), 1 the
    #: engine's check of intermediates, 2 its cycle check, 3 verification in ORT (it passed every check)
    stage: int = 0
    #: within the rule's checks, how many of the match's bindings they had read when one failed
    read: int = 0


@dataclass
class _Pass:
    """What one rule found in one graph."""

    accepted: list[_Candidate] = field(default_factory=list)
    refused: dict[ir.Node, list[_Attempt]] = field(default_factory=dict)
    #: graph order of the nodes when the pass began (indexing once keeps a pass linear in the graph's size)
    position: dict[ir.Node, float] = field(default_factory=dict)
    #: every refusal of a match, even one a smaller form then superseded (``refused`` forgets those)
    refusals: list[Refusal] = field(default_factory=list)

    def refuse(self, anchor: ir.Node, attempt: _Attempt) -> None:
        self.refused.setdefault(anchor, []).append(attempt)
        self.refusals.append(attempt.refusal)


def fuse_model(model: ir.Model, options: Options, report: Report,
               nodes: Mapping[ir.Node, None] | None = None, shapes: PendingShapes | None = None) -> None:
    """Rewrite ``model`` in place and record what happened in ``report``. ``nodes``: every node of the model
    (``nodes_of``), when the caller has them. ``shapes``: the symbolic shape inference the load deferred. Rules
    first match and check on onnx's shapes (exact, where known); the symbolic inference runs, for the values the
    candidates need, only when a rule's pass leaves something undecided on them (``_undecided``), and that pass is
    then done again."""
    seeds: set[str] | None = None  # the candidates' values, while the symbolic inference waits
    if shapes is not None:
        seeds = demand(model, options)
        if not seeds:
            report.notes.extend(shapes.resolve(model, seeds))
            seeds = None
    before = (nodes if nodes is not None else nodes_of(model)) if seeds is not None else {}
    replaced: dict[ir.Value, str] = {}  # fused outputs, and the name of the value each replaced
    names = _all_names(model, nodes)
    opsets_used: dict[str, int] = {}
    starved: dict[ir.Node, str] = {}  # the nodes of regions whose verification ran out of memory
    every_scope = list(scopes(model))
    steps, step = max(1, len(every_scope) * len(options.rules)), 0
    for scope in every_scope:
        ctx = GraphContext(scope.graph, scope.opset, options.target, scope.path, names)
        removed = canonicalize(scope.graph, ctx.fresh_name)
        report.notes.extend(f"{scope.path}: removed {what}" for what in removed)
        # found before any rule rewrites the graph: what the report must account for, matched or not
        found_stats = statistics.find(scope.graph)
        fused_by: dict[ir.Node, tuple[str, str]] = {}
        ran: set[str] = set()
        refusals: list[tuple[Rule, _Pass]] = []
        swept = False
        order: _Order | None = None  # shared by the rules' passes until one rewrites the graph
        for rule in options.rules:
            step += 1
            if options.target not in rule.targets:
                continue
            if options.progress is not None:
                options.progress((step - 1) / steps, f"{scope.path}: {rule.name}")
            order = order or _Order.of(scope.graph)
            ran.add(rule.name)
            found = find(rule, ctx, order)
            recorded = len(report.fused)
            # undecided before verification: verifying on onnx's shapes would be wasted (verification only adds
            # refusals, so a pass undecided before it is undecided after it)
            why = _undecided(rule, found, found.accepted, found_stats, order) if seeds is not None else ""
            kept = [] if why else _verified(found.accepted, model, scope, options, report, found, starved)
            if seeds is not None and (why := why or _undecided(rule, found, kept, found_stats, order)):
                del report.fused[recorded:]  # this pass is done again on the new shapes
                _forget(found.accepted)
                report.notes.extend(shapes.resolve(model, seeds, why=f"{scope.path}: {why}", aliases=replaced))
                retype_new_values(model, before, keep=set(replaced))
                seeds = None
                if not swept:  # nothing rewritten in this graph yet: the statistics are found on the new shapes
                    found_stats = statistics.find(scope.graph)
                found = find(rule, ctx, order)
                kept = _verified(found.accepted, model, scope, options, report, found, starved)
            for candidate in kept:
                fused_by.update(dict.fromkeys(candidate.replacement.region,
                                              (rule.name, candidate.replacement.op_type)))
                apply(scope.graph, candidate.replacement, found.position, ctx.fresh_name)
                if seeds is not None:  # what each fused output stands for, by the name the inference knows
                    replaced.update({new: replaced.get(old, old.name) for old, new in
                                     candidate.replacement.outputs.items() if old.name})
                opsets_used.update(candidate.replacement.opset_imports)
            refusals.append((rule, found))
            if kept:
                cleanup(scope.graph, kept)
                swept = True
                order = None
        if removed and not swept:  # nothing fused here, but what the removals left unread goes too
            cleanup(scope.graph, [])
        accounted = _record_candidates(scope, found_stats, refusals, fused_by, ran, report)
        _record_refusals(scope, refusals, report, accounted)
    if seeds is not None:
        report.notes.extend(shapes.resolve(model, seeds, needed=False))
    for domain, version in opsets_used.items():
        model.opset_imports.setdefault(domain, version)
        for function in model.functions.values():
            if any(n.domain == domain for n in function):
                function.opset_imports.setdefault(domain, version)


def _undecided(rule: Rule, found: _Pass, kept: list[_Candidate], stats: list[statistics.Statistics],
               order: _Order) -> str:
    """Why a pass on onnx's shapes may not be what the symbolic inference's would give ('' when it is): a check
    refused a match (it may have needed a dim onnx left unknown), unless the refusal says it was ``decided``; a
    fused op reads several run-time tensors (how their shapes relate is what the symbolic inference proves, and a
    rule may choose a smaller form, without a refusal, where it cannot tell: an embedding's positions as an input
    rather than 0..S-1; ``Rule.settles_for_less``); a norm-like statistic of the rule's kind was neither fused nor
    refused (shapes also decide what patterns match: a Reshape to its input's own shape, an added zero of the same
    shape); or an anchor of the rule was neither, behind a Cast or Reshape that may be a no-op onnx's types could
    not prove. A fused op that reads one run-time tensor and constants needs that tensor's rank and reduced dims,
    which onnx's shapes gave, or a check would have refused."""
    if any(not r.decided for r in found.refusals):
        return f"{rule.name} refused a match"
    if rule.settles_for_less and any(_run_time_inputs(c.replacement) > 1 for c in kept):
        return f"{rule.name} fused ops that read several run-time tensors"
    fused = {node for c in kept for node in c.replacement.region}
    left = [s for s in stats if s.rule == rule.name and s.square.graph is not None
            and not fused.issuperset([s.square, *s.means])]
    if left:
        return f"{rule.name} left {len(left)} norm-like statistic(s) unmatched"
    anchors = (node for op in rule.anchors for node in order.of_op.get(op, ()))
    if any(node not in fused and node not in found.refused and noop_in_doubt(node.inputs[0] if node.inputs else None)
           for node in anchors):
        return f"{rule.name} met a Cast or Reshape whose input's type onnx left unknown"
    return ""


def _forget(candidates: list[_Candidate]) -> None:
    """Let go of replacements never applied: their nodes, though outside the graph, count among the readers of the
    values they read, and would keep those alive in the clean-up and refuse later rewrites of them."""
    for c in candidates:
        for node in c.replacement.nodes:
            for index in range(len(node.inputs)):
                node.replace_input_with(index, None)


def _run_time_inputs(rep: Replacement) -> int:
    """How many distinct values not fixed at build time the replacement's nodes read from outside it."""
    made = {v for node in rep.nodes for v in node.outputs}
    read = {v for node in rep.nodes for v in node.inputs if v is not None and v not in made}
    return sum(not is_static(v) for v in read)


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


@dataclass
class _Order:
    """What every rule's pass reads first, worked out in one pass over the graph as it is (on a graph of a million
    nodes each pass costs): its nodes in order and their positions, the nodes of each op type, and the nodes that
    read a value no earlier node of the graph produces (from an enclosing scope, or out of order). A pass that
    rewrites the graph makes it stale."""

    nodes: list[ir.Node]
    position: dict[ir.Node, float]
    of_op: dict[str | None, list[ir.Node]]  # by ``known_op``
    unseen_producer: list[ir.Node]
    near: dict[frozenset[str], list[ir.Node]] = field(default_factory=dict)

    @staticmethod
    def of(graph: ir.Graph | ir.Function) -> _Order:
        nodes, position, of_op, unseen = [], {}, {}, []
        for node in graph:
            for value in node.inputs:
                if value is not None and (producer := value.producer()) is not None and producer not in position:
                    unseen.append(node)
                    break
            position[node] = len(nodes)
            nodes.append(node)
            of_op.setdefault(known_op(node), []).append(node)
        return _Order(nodes, position, of_op, unseen)

    def near_nodes(self, anchors: frozenset[str]) -> list[ir.Node]:
        if anchors not in self.near:
            self.near[anchors] = _near(self, anchors)
        return self.near[anchors]


def demand(model: ir.Model, options: Options) -> set[str]:
    """The names of the main graph's values that candidates read or write: those of the nodes near an anchor of a
    rule that runs (``_near``, where matching looks). An anchor inside a body or a function makes every value of the
    main graph needed (the body's shapes follow from its holder's inputs, a function's from its calls'). Empty: no
    candidates, and no shape inference beyond onnx's is needed."""
    anchors = frozenset().union(*(r.anchors for r in options.rules if options.target in r.targets))
    if not anchors:
        return set()
    order = _Order.of(model.graph)
    near = order.near_nodes(anchors) if any(op in order.of_op for op in anchors) else []
    elsewhere = any(known_op(node) in anchors for function in model.functions.values() for node in every_node(function))
    elsewhere = elsewhere or any(known_op(node) in anchors for node in every_node(model.graph)
                                 if node.graph is not model.graph)
    if elsewhere:
        near = order.nodes
    return {v.name for node in near for v in [*node.inputs, *node.outputs] if v is not None and v.name}


def find(rule: Rule, ctx: GraphContext, order: _Order | None = None) -> _Pass:
    """Greedy, outputs first: the first match found from the last node of a norm is its largest form. ``order``:
    the graph's (see ``_Order``), when the caller has it."""
    order = order or _Order.of(ctx.graph)
    position = order.position
    found = _Pass(position=position)
    cache = Cache()  # what matching works out about the graph; valid until the pass rewrites it
    consumed: set[ir.Node] = set()
    roots = [p.root_ops() for p in rule.patterns]
    roots = None if None in roots else frozenset().union(*roots)
    # every match covers an anchor among the root's producers: on a long graph with few norms, most roots are far
    # from any, and trying them would make matching cost the graph's size times the normal form's reach
    near = order.near_nodes(rule.anchors)
    for node in reversed(near):
        if node in consumed or not node.outputs or (roots is not None and known_op(node) not in roots):
            continue
        candidate = _first_valid(rule, ctx, node.outputs[0], consumed, found, position, cache)
        if candidate is not None:
            found.accepted.append(candidate)
            consumed.update(candidate.replacement.region)
    for pattern, check, reason in rule.near_misses:
        near_roots = pattern.root_ops()
        for node in near:
            if near_roots is not None and known_op(node) not in near_roots:
                continue  # the pattern cannot match here: skip making a matcher per node
            for m in _limited(pattern.match(node.outputs[0] if node.outputs else None, Match(cache=cache))):
                for anchor in rule.anchor_nodes(m):
                    if anchor not in consumed:
                        found.refuse(anchor, _Attempt(Refusal(check, reason), list(m.nodes)))
    for candidate in found.accepted:
        for anchor in candidate.anchors:
            found.refused.pop(anchor, None)
    return found


def _near(order: _Order, anchors: frozenset[str]) -> list[ir.Node]:
    """The nodes within ``_REACH`` producer steps of an anchor, in graph order: a breadth-first walk from the anchors
    to the readers of their outputs, each step from a producer to a later reader in the graph. A producer that is
    not an earlier node of the graph (in an enclosing scope, or later in an unsorted graph) counts as an anchor:
    this only prunes."""
    steps: dict[ir.Node, int] = {node: 0 for op in anchors for node in order.of_op.get(op, ())}
    frontier = list(steps)
    later = [node for node in order.unseen_producer if node not in steps]  # one step from such a producer
    position = order.position
    for step in range(1, _REACH + 1):
        reached = []
        for node in later if step == 1 else ():
            if node not in steps:
                steps[node] = step
                reached.append(node)
        for node in frontier:
            at = position[node]
            for value in node.outputs:
                for reader, _ in value.uses():
                    if reader not in steps and position.get(reader, -1) > at:
                        steps[reader] = step
                        reached.append(reader)
        frontier = reached
    return sorted(steps, key=position.__getitem__)


class _Reads(Mapping):
    """A match's bindings, counting the names a rule reads: checks read bindings as they go, so a form refused
    after reading more of them got further through the checks (a bias that is no bias fails early, and says
    less about the candidate than a residual whose addends differ in shape, found later)."""

    def __init__(self, bindings: Mapping):
        self._bindings, self._read = bindings, set()

    @staticmethod
    def of(m: Match) -> Match:
        return dataclasses.replace(m, values=_Reads(m.values), named_nodes=_Reads(m.named_nodes))

    def __getitem__(self, name):
        self._read.add(name)
        return self._bindings[name]

    def __contains__(self, name) -> bool:
        self._read.add(name)
        return name in self._bindings

    def __iter__(self):
        return iter(self._bindings)

    def __len__(self) -> int:
        return len(self._bindings)

    def read(self) -> int:
        return len(self._read)


def _limited(matches: Iterator[Match]) -> Iterator[Match]:
    for i, m in enumerate(matches):
        if i >= _MAX_ATTEMPTS:
            return
        yield m


def _first_valid(rule: Rule, ctx: GraphContext, root: ir.Value, consumed: set[ir.Node],
                 found: _Pass, position: dict[ir.Node, float], cache: Cache) -> _Candidate | None:
    for pattern in rule.patterns:
        for m in _limited(pattern.match(root, Match(cache=cache))):
            if consumed.intersection(m.nodes):
                continue
            anchors = list(rule.anchor_nodes(m))
            stage, m = 0, _Reads.of(m)
            try:
                _no_function_attributes(m)
                check_in_scope(m.nodes, position)
                replacement = rule.build(m, ctx)
                stage = 1
                check_in_scope(replacement.region, position)
                check_intermediates(replacement)
                stage = 2
                check_no_cycle(replacement, position)
            except Refusal as refusal:
                ctx.settle(keep=False)
                for anchor in anchors:
                    found.refuse(anchor, _Attempt(refusal, list(m.nodes), stage, m.values.read() + m.named_nodes.read()))
                continue
            ctx.settle(keep=True)
            # a larger form refused for its gamma/beta means the affine stays outside: say so
            notes = list(dict.fromkeys(a.refusal.detail for anchor in anchors for a in found.refused.get(anchor, [])
                                       if a.refusal.check in ("gamma", "beta")))
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


def check_in_scope(nodes: Iterable[ir.Node], position: Mapping[ir.Node, float]) -> None:
    """Every node a rewrite deletes is in the graph being rewritten (``position`` holds its nodes): a match that
    climbs out of a branch through an outer-scope value, or a reader inside a branch, is in another graph, where
    one fused node cannot stand for both."""
    for node in nodes:
        if node not in position:
            raise Refusal("scope", f"{node.op_type} '{_label(node)}' is part of the norm but lies in another graph "
                          "(a subgraph reads it by outer-scope name, or it is read from one)")


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
              found: _Pass, starved: dict[ir.Node, str]) -> list[_Candidate]:
    """The candidates ORT finds computing what they replace. ``starved``: the nodes of regions whose verification
    ran out of memory, with what it said; a candidate over any of them is refused unrun (another form of the same
    norm needs about as much, and would fail after seconds of allocating: the user must raise the memory either
    way), and the regions that run out of memory here are added."""
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
    unrun = {id(c): f"not run: it overlaps a region whose verification ran out of memory ({said})"
             for c in candidates for n in c.replacement.region if (said := starved.get(n))}
    run = [c for c in candidates if id(c) not in unrun]
    outcomes = dict(zip(map(id, run), verify([c.replacement for c in run], opsets, model.ir_version,
                                             found.position, allow_requantization=options.allow_requantization)))
    kept = []
    for c in candidates:
        outcome = outcomes.get(id(c)) or Outcome(False, float("nan"), unrun[id(c)])
        if outcome.ok:
            kept.append(c)
            c.notes.extend(q.describe() for q in outcome.requantized)
            _record_fused(c, scope, outcome.max_error, report)
            continue
        _forget([c])
        if id(c) not in unrun and out_of_memory(outcome.detail):
            starved.update(dict.fromkeys(c.replacement.region, outcome.detail))
        refusal = Refusal("verify", f"{c.replacement.op_type} rewrite not applied: {outcome.detail}")
        for anchor in c.anchors:
            found.refuse(anchor, _Attempt(refusal, c.replacement.region, stage=3))
    return kept


def _record_fused(c: _Candidate, scope: Scope, error: float | None, report: Report) -> None:
    rep = c.replacement
    record = Fused(
        rule=c.rule.name, op_type=rep.op_type, graph=scope.path, nodes=[_label(n) for n in rep.region],
        attributes=rep.attributes, max_error=None if error is None or math.isnan(error) else error,
        outputs=[old.name for old in rep.outputs], notes=c.notes + rep.notes)
    report.fused.append(record)
    mark_fused(rep.nodes, rep.region, record)


def _label(node: ir.Node) -> str:
    """A node's name, or its op type where the exporter left it unnamed (the report must still say what it was)."""
    return node.name or f"<unnamed {node.op_type}>"


def deciding(attempts: list[_Attempt]) -> _Attempt:
    """The refusal that kept an anchor unfused: the one on the form that got furthest through the checks (a form
    the rule accepted and the engine refused for a cycle fits the model; a form refused for a bias of the wrong
    shape does not; within the rule's checks, the one that had read more bindings), then by the nodes it matched;
    the first tried where they tie. Fixing what the
    first pattern tried would not help when another form was refused for another reason."""
    return max(attempts, key=lambda a: (a.stage, a.read, len(a.nodes)))


def _record_candidates(scope: Scope, found: list[statistics.Statistics], passes: list[tuple[Rule, _Pass]],
                       fused_by: Mapping[ir.Node, tuple[str, str]], ran: set[str], report: Report) -> set[ir.Node]:
    """One report entry per norm-like candidate (``lnfuse.match.candidates``), and an unfused entry for each one left:
    the deciding refusal of the rule of its kind (a centred norm is explained by layer_norm, never by the RMS
    formula a centred value also half-matches), or, where that rule's patterns never started on it, what was seen.
    Returns the reductions accounted for, which no other entry repeats."""
    refused = {rule.name: found_pass.refused for rule, found_pass in passes}
    accounted: set[ir.Node] = set()
    for stats in found:
        if stats.square.graph is None and stats.square not in fused_by:
            continue  # removed as unread (nothing reads the norm): nothing is left to fuse
        reductions = stats.reductions()
        accounted.update(reductions)
        anchor = ", ".join(f"{n.op_type} '{_label(n)}'" for n in reductions)
        entry = Candidate(scope.path, stats.kind, anchor, stats.describe(), [_label(n) for n in stats.nodes],
                          fused=False, rule=stats.rule)
        report.candidates.append(entry)
        attempts = [a for n in reductions for a in refused.get(stats.rule, {}).get(n, [])]
        consumed = [n for n in reductions if n in fused_by]
        # a centred norm whose variance was fused as an RMS norm of x - mean, the mean left outside, is not the
        # LayerNorm it was written as: its rule's refusal still says why
        if stats.square in fused_by and (len(consumed) == len(reductions) or not attempts):
            entry.fused, (entry.rule, entry.op_type) = True, fused_by[stats.square]
            continue
        if stats.quantizers:  # no rule fuses through rounding, whatever it matched
            unfused = Unfused("quantized", scope.path, anchor, "quantized", rounding_reason(stats.quantizers),
                              [_label(n) for n in [*stats.nodes, *stats.quantizers]])
        elif attempts:
            decided = deciding(attempts)
            unfused = Unfused(stats.rule, scope.path, anchor, decided.refusal.check, decided.refusal.detail,
                              [_label(n) for n in decided.nodes], _others(decided, attempts))
        elif stats.rule not in ran:
            unfused = Unfused(stats.rule, scope.path, anchor, "skipped", f"{stats.describe()}: {stats.rule} did not "
                              "run (--only/--skip), and no rule that ran fused it", entry.nodes)
        else:  # another kind's rule may have matched a part (mean(d²) + eps of d = x - mean): not this norm
            started = any(n in attempts_of for attempts_of in refused.values() for n in reductions)
            unfused = Unfused(stats.rule, scope.path, anchor, "spelling", f"{stats.describe()}: no "
                              f"{stats.rule + ' pattern' if started else 'rule'} matches this spelling", entry.nodes)
        entry.rule, entry.check, entry.reason = unfused.rule, unfused.check, unfused.reason
        report.unfused.append(unfused)
    return accounted


def _others(decided: _Attempt, attempts: list[_Attempt]) -> list[Refused]:
    """The checks that failed on the forms tried other than the deciding one, once each."""
    others = {(a.refusal.check, a.refusal.detail): len(a.nodes) for a in attempts if a is not decided
              and (a.refusal.check, a.refusal.detail) != (decided.refusal.check, decided.refusal.detail)}
    return [Refused(check, reason, matched) for (check, reason), matched in others.items()]


def _record_refusals(scope: Scope, passes: list[tuple[Rule, _Pass]], report: Report,
                     accounted: set[ir.Node] = frozenset()) -> None:
    """One entry per refused candidate still in the graph, with its deciding refusal and the others; where rules
    disagree on an anchor, the first rule's reason is the one a user needs. Anchors in ``accounted`` already
    have their entry (``_record_candidates``)."""
    reported: set[ir.Node] = set()
    for rule, found in passes:
        by_refusal: dict[int, tuple[_Attempt, list[_Attempt], list[ir.Node]]] = {}
        for anchor, attempts in found.refused.items():
            if anchor in reported:
                continue
            decided = deciding(attempts)
            if anchor.graph is None:  # fused by a later rule
                if rule.reports_fallback:
                    report.notes.append(f"{scope.path}: {rule.name} left {anchor.op_type} '{_label(anchor)}' to a "
                                        f"later rule ({decided.refusal.check}: {decided.refusal.detail})")
                continue
            if anchor in accounted:
                continue
            by_refusal.setdefault(id(decided.refusal), (decided, attempts, []))[2].append(anchor)
        for decided, attempts, anchors in by_refusal.values():
            reported.update(anchors)
            (report.kept if rule.refines else report.unfused).append(Unfused(
                rule=rule.name, graph=scope.path, anchor=", ".join(f"{a.op_type} '{a.name}'" for a in anchors),
                check=decided.refusal.check, reason=decided.refusal.detail, nodes=[_label(n) for n in decided.nodes],
                others=_others(decided, attempts)))


def apply(graph: ir.Graph | ir.Function, rep: Replacement, position: dict[ir.Node, float],
          fresh_name: Callable[[str], str]) -> None:
    """Put the new nodes where the region's last node was, point every reader at the new values, drop the region.
    ``position`` (graph order at the start of the pass) gets the new nodes, between the region's last node and the
    node after it. ``fresh_name`` names the nodes made here (a node name the model already uses makes it invalid)."""
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
                                          name=fresh_name(f"{value.name}/Constant")))
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
                identity = ir.node("Identity", [new], name=fresh_name(f"{old.name}/Identity"))
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
        if len(readers) != 1 or not is_op(readers[0][0], "Reshape") or readers[0][1] != 0 \
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


def _all_names(model: ir.Model, nodes: Iterable[ir.Node] | None = None) -> set[str]:
    """The names of the model's nodes and values. ``nodes``: every node of the model (``nodes_of``), when the
    caller has them (else they are walked)."""
    names = set()
    graphs = [model.graph, *model.functions.values()]
    for graph in graphs:
        for value in graph.inputs:
            names.add(value.name)
    for node in nodes if nodes is not None else (node for graph in graphs for node in every_node(graph)):
        names.add(node.name)
        names.update(v.name for v in node.outputs)
        names.update(v.name for v in node.inputs if v is not None)
    names.update(model.graph.initializers)
    return names


def nodes_of(model: ir.Model) -> dict[ir.Node, None]:
    """Every node of the model, subgraphs and functions included (what was there before a rewrite), in the order
    of ``every_node`` over the main graph and then each function."""
    return dict.fromkeys(node for graph in [model.graph, *model.functions.values()] for node in every_node(graph))


def type_new_values(model: ir.Model, before: Mapping[ir.Node, None] | set[ir.Node]) -> set[str]:
    """Give every value lnfuse wrote (the outputs of nodes not in ``before``) its dtype and shape, and return their
    names: the saved model declares them, so that a later pass (decompose, ORT, onnx's inference) sees a fully
    typed graph. Rules type what they can from the values they replace; the rest is inferred here, node by node
    with onnx's inference for standard ops, and with ONNX Runtime's symbolic inference for its contrib ops."""
    names: set[str] = set()
    for graph in [model.graph, *model.functions.values()]:
        opsets = {**model.opset_imports, **(graph.opset_imports if isinstance(graph, ir.Function) else {})}
        new = [n for n in every_node(graph) if n not in before]
        untyped = []
        for node in new:
            if any(_untyped(v) for v in node.outputs) and not _infer_node(node, opsets, model.ir_version):
                untyped.append(node)
        if untyped:
            _infer_contrib(untyped, opsets, model.ir_version)
        for value in (v for n in new for v in n.outputs):
            if value.shape is not None:
                value.shape = _plausible(value.shape)
        names.update(v.name for n in new for v in n.outputs if v.name and not _untyped(v))
    return names


def retype_new_values(model: ir.Model, before: Mapping[ir.Node, None] | set[ir.Node],
                      keep: set[ir.Value] = frozenset()) -> None:
    """Infer again, node by node in graph order, the shapes of the values lnfuse wrote (outputs of nodes not in
    ``before``), after the values they are computed from got new shapes: a norm fused on onnx's shapes carries
    them, and a later rule compares it with values the symbolic inference has since renamed. ``keep``: values
    already given the new shape of the value they replaced (``PendingShapes.resolve``'s aliases), as rules type
    a fused output. Where inference now says nothing, the shape it had stays (its dims are named apart from the new
    ones: ``demand._rename_unknown_dims``)."""
    for graph in [model.graph, *model.functions.values()]:
        opsets = {**model.opset_imports, **(graph.opset_imports if isinstance(graph, ir.Function) else {})}
        new = [n for n in every_node(graph) if n not in before]
        had = {v: v.shape for n in new for v in n.outputs}
        untyped = []
        for node in new:
            for value in node.outputs:
                if value not in keep:
                    value.shape = None
            if not _infer_node(node, opsets, model.ir_version):
                untyped.append(node)
        if untyped:
            _infer_contrib(untyped, opsets, model.ir_version)
        for value, shape in had.items():
            # as type_new_values writes them: a size no run can have stays unknown
            value.shape = shape if value.shape is None else _plausible(value.shape)


#: no real tensor has this many elements; a larger static shape comes from a declared dim nothing checks
_MAX_PLAUSIBLE_ELEMENTS = 1 << 40


def _plausible(shape: ir.Shape) -> ir.Shape:
    """The shape with sizes no run can have left unknown: 0 or a product past ``_MAX_PLAUSIBLE_ELEMENTS``, inferred
    from a declared input dim (``[batch, 0]``, ``[batch, 2**62]``). Written on lnfuse's values, ONNX Runtime's
    load-time inference would take them as fact and refuse the model (a Reshape's -1, a product overflow)."""
    dims = [None if d == 0 else d for d in shape]
    if math.prod(d for d in dims if isinstance(d, int)) > _MAX_PLAUSIBLE_ELEMENTS:
        dims = [d if not isinstance(d, int) or i == len(dims) - 1 else None for i, d in enumerate(dims)]
    return shape if dims == list(shape) else ir.Shape(dims)


def _untyped(value: ir.Value) -> bool:
    return bool(value.name) and (value.type is None or value.shape is None)


def _infer_node(node: ir.Node, opsets: dict[str, int], ir_version: int) -> bool:
    """Type the node's outputs with onnx's own inference for its op; False where onnx has no schema for it."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except onnx.defs.SchemaError:
        return False
    known = [v for v in node.inputs if v is not None and v.type is not None]
    types = {v.name: ir.serde.serialize_value(v).type for v in known}
    data = {}
    for v in known:  # small constants (axes, Reshape targets) decide output shapes
        if v.shape is not None and v.shape.is_static() and math.prod(v.shape.numpy()) <= 64 \
                and (array := static_value(v)) is not None:
            data[v.name] = onnx.numpy_helper.from_array(np.asarray(array), v.name)
    try:
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, ir.serde.serialize_node(node), types, data,
            opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()], ir_version=ir_version)
    except Exception:  # noqa: BLE001 - onnx raises several types; the value stays untyped and the test says so
        return True
    for value in node.outputs:
        _set_type(value, inferred.get(value.name))
    return True


def _infer_contrib(nodes: list[ir.Node], opsets: dict[str, int], ir_version: int) -> None:
    """ONNX Runtime's symbolic inference on a small graph of just these nodes, their inputs as typed inputs."""
    produced = {v for n in nodes for v in n.outputs}
    inputs = {v.name: v for n in nodes for v in n.inputs if v is not None and v not in produced}
    if any(v.type is None or v.shape is None for v in inputs.values()):
        return
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes], "lnfuse_types",
        [ir.serde.serialize_value(v) for v in inputs.values()],
        [onnx.helper.make_value_info(v.name, onnx.TypeProto()) for v in produced if v.name])
    probe = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    probe.ir_version = ir_version
    inferred, _ = infer_shapes(probe)
    found = {v.name: v.type for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for value in produced:
        if _untyped(value):
            _set_type(value, found.get(value.name))


def _set_type(value: ir.Value, type_proto: onnx.TypeProto | None) -> None:
    if type_proto is None or not type_proto.tensor_type.elem_type:
        return
    if value.type is None:
        value.type = ir.serde.deserialize_type_proto_for_type(type_proto)
    if value.shape is None and type_proto.tensor_type.HasField("shape"):
        value.shape = ir.serde.deserialize_type_proto_for_shape(type_proto)
