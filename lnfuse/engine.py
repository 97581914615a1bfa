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

import onnx_ir as ir

from lnfuse.errors import out_of_memory
from lnfuse.match import candidates as statistics
from lnfuse.match.algebra import Cache
from lnfuse.index.canonical import canonicalize
from lnfuse.index.constants import is_static
from lnfuse.index.demand import PendingShapes
from lnfuse.match.pattern import Match, noop_in_doubt
from lnfuse.save.provenance import mark_fused
from lnfuse.match.quantized_norms import rounding_reason
from lnfuse.report import Candidate, Fused, Refused, Report, Unfused
from lnfuse.match.rule import GraphContext, Refusal, Replacement, Rule
from lnfuse.index.traversal import every_node
from lnfuse.index.scopes import Scope, all_names, nodes_of, scopes
from lnfuse.index.new_values import retype_new_values
from lnfuse.rewrite import apply, cleanup
from lnfuse.verification.region import Outcome, verify
from lnfuse.index.ops import known_op, op_name
from lnfuse.index.quantizers import QuantizerReach, Reached

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
    #: keep a verified rewrite whose changed values reach a quantizer (``lnfuse.index.quantizers``)
    allow_requantization: bool = False
    #: ``--quantize-embeddings``: the scheme its pass (after this one) quantizes embedding blocks in, if asked
    quantize_embeddings: str | None = None
    #: called with (fraction of the pass done, what is running) while the pass runs (the CLI draws a bar)
    progress: Callable[[float, str], None] | None = None


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
    names = all_names(model, nodes)
    opsets_used: dict[str, int] = {}
    starved: dict[ir.Node, str] = {}  # the nodes of regions whose verification ran out of memory
    reach = None if options.allow_requantization else QuantizerReach(model)
    every_scope = list(scopes(model))
    steps, step = max(1, len(every_scope) * len(options.rules)), 0
    for scope in every_scope:
        ctx = GraphContext(scope.graph, scope.opset, options.target, scope.path, names, options.quantize_embeddings)
        removed = canonicalize(scope.graph, ctx.fresh_name)
        report.notes.extend(f"{scope.path}: removed {what}" for what in removed)
        # found before any rule rewrites the graph: what the report must account for, matched or not
        found_stats = statistics.find(scope.graph)
        fused_by: dict[ir.Node, tuple[str, str]] = {}
        left_to_siblings: dict[ir.Node, tuple[str, str]] = {}
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
            kept = [] if why else _verified(found.accepted, model, scope, options, report, found, starved, reach)
            if seeds is not None and (why := why or _undecided(rule, found, kept, found_stats, order)):
                del report.fused[recorded:]  # this pass is done again on the new shapes
                _forget(found.accepted)
                report.notes.extend(shapes.resolve(model, seeds, why=f"{scope.path}: {why}", aliases=replaced))
                retype_new_values(model, before, keep=set(replaced))
                seeds = None
                if not swept:  # nothing rewritten in this graph yet: the statistics are found on the new shapes
                    found_stats = statistics.find(scope.graph)
                found = find(rule, ctx, order)
                kept = _verified(found.accepted, model, scope, options, report, found, starved, reach)
            for candidate in kept:
                fused_by.update(dict.fromkeys(candidate.replacement.region,
                                              (rule.name, candidate.replacement.op_type)))
                left_to_siblings.update(dict.fromkeys(candidate.replacement.shared,
                                                      (rule.name, candidate.replacement.op_type)))
                apply(scope.graph, candidate.replacement, found.position, ctx.fresh_name)
                if seeds is not None:  # what each fused output stands for, by the name the inference knows
                    replaced.update({new: replaced.get(old, old.name) for old, new in
                                     candidate.replacement.outputs.items() if old.name})
                opsets_used.update(candidate.replacement.opset_imports)
            refusals.append((rule, found))
            if kept:
                cleanup(scope.graph, [c.replacement for c in kept])
                swept = True
                order = None
        if removed and not swept:  # nothing fused here, but what the removals left unread goes too
            cleanup(scope.graph, [])
        # statistics norms left to one another count as fused once every norm reading them was (they are gone)
        fused_by.update({n: by for n, by in left_to_siblings.items() if n.graph is None and n not in fused_by})
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
    # a statistic rounded inside (QDQ, QOperator) is left whatever the shapes: no rule fuses through rounding
    left = [s for s in stats if s.rule == rule.name and s.square.graph is not None and not s.quantizers
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
              found: _Pass, starved: dict[ir.Node, str], reach: QuantizerReach | None) -> list[_Candidate]:
    """The candidates ORT finds computing what they replace. ``starved``: the nodes of regions whose verification
    ran out of memory, with what it said; a candidate over any of them is refused unrun (another form of the same
    norm needs about as much, and would fail after seconds of allocating: the user must raise the memory either
    way), and the regions that run out of memory here are added. ``reach``: where quantizers are, unless the user
    allowed requantization; a candidate whose outputs reach one is refused before anything runs."""
    if reach is not None:
        candidates = _not_requantizing(candidates, reach, found)
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
                                             found.position)))
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


def _not_requantizing(candidates: list[_Candidate], reach: QuantizerReach, found: _Pass) -> list[_Candidate]:
    """The candidates none of whose outputs reaches a quantizer; the others are refused, naming the quantizer. A
    fused op rounds differently from the ops it replaces, so every output it replaces counts as changed: no sample
    can show that no input moves a quantized value."""
    kept = []
    for c in candidates:
        reached = next(((old, r) for old in c.replacement.outputs if (r := reach.first_quantizers([old]))), None)
        if reached is None:
            kept.append(c)
            continue
        _forget([c])
        refusal = Refusal("requantization", _requantization_detail(c.replacement, *reached), decided=True)
        for anchor in c.anchors:
            found.refuse(anchor, _Attempt(refusal, c.replacement.region, stage=3))
    return kept


def _requantization_detail(rep: Replacement, output: ir.Value, reached: list[Reached]) -> str:
    first = reached[0]
    more = f" (and {len(reached) - 1} more quantizer(s))" if len(reached) > 1 else ""
    path = "directly" if first.hops == 0 else f"through {first.hops} op(s)"
    return (f"{rep.op_type} rewrite not applied: '{output.name}' reaches {op_name(first.quantizer)} "
            f"'{_label(first.quantizer)}' {path}{more}; the fused op rounds differently from the ops it replaces, "
            "and a quantizer turns a rounding difference into a whole step for some inputs, so the quantized model "
            "would change: fuse the float model before quantizing it, or --allow-requantization fuses anyway")


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
