"""What a rule is, and what it hands back to the engine.

A rule owns the math of one fused-op family: the patterns it accepts, the checks that prove a match computes what
the fused op computes, and the nodes that replace it. The engine owns everything generic: walking graphs, the
"no intermediate is read elsewhere" check, verification in ORT, applying the rewrite, and the report.
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import onnx_ir as ir

from lnfuse.match.pattern import Match, Pattern
from lnfuse.index.ops import known_op

#: meta key on a new node's output that stays an absent optional output ("" in the saved model)
ABSENT = "lnfuse.absent"



class Refusal(Exception):
    """A check failed: the match does not compute what the fused op computes, or the target cannot express it."""

    def __init__(self, check: str, detail: str, decided: bool = False):
        """``decided``: the refusal rests only on facts onnx's inference gives exactly and ONNX Runtime's symbolic
        inference would not change (a known rank, a dim that is a number, a known dtype, a constant's numbers), so
        the symbolic inference need not run for it. A dim name is no such fact: the symbolic inference may find it
        equal to a number."""
        super().__init__(f"{check}: {detail}")
        self.check = check
        self.detail = detail
        self.decided = decided


@dataclass
class Replacement:
    """New nodes for a match, and which old values they stand for.

    ``outputs`` maps each old value that outlives the region (the norm's result, an exposed mean...) to the new value
    that replaces it. ``region`` is every old node that disappears (the matched nodes plus any the rule absorbed).
    ``shared``: nodes of the norm left in the graph for another norm that also reads them (removed once it is fused).
    """

    op_type: str
    domain: str
    nodes: list[ir.Node]
    outputs: dict[ir.Value, ir.Value]
    region: list[ir.Node]
    attributes: dict[str, object] = field(default_factory=dict)
    opset_imports: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    shared: list[ir.Node] = field(default_factory=list)


def new_nodes(values: Iterable[ir.Value]) -> list[ir.Node]:
    """The new nodes (built, not yet in a graph) that ``values`` are computed from, each after those it reads: a
    ``Replacement``'s ``nodes``. Shared by the rules and decompose."""
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


class GraphContext:
    """What a rule may know about the graph it rewrites: its opset, the target, shapes, and fresh names."""

    def __init__(self, graph: ir.Graph | ir.Function, opset: int, target: str, path: str, used_names: set[str],
                 quantize_embeddings: str | None = None):
        self.graph = graph
        self.opset = opset
        self.target = target
        self.path = path
        #: the scheme the user asked embedding blocks to be quantized in (``--quantize-embeddings``), if any: a rule
        #: may then hand over a block that only that pass can finish
        self.quantize_embeddings = quantize_embeddings
        self._used = used_names
        self._counter = itertools.count()
        self.is_function = isinstance(graph, ir.Function)
        #: nodes made by builds not yet settled (``settle``): a node reads its inputs from the moment it exists
        self._made: list[ir.Node] = []

    def fresh_name(self, hint: str) -> str:
        name = hint
        while name in self._used:
            name = f"{hint}_{next(self._counter)}"
        self._used.add(name)
        return name

    def constant(self, array: np.ndarray, hint: str) -> ir.Value:
        """A new constant value; the engine stores it as an initializer (or a Constant node inside a function)."""
        value = ir.Value(name=self.fresh_name(hint), const_value=ir.tensor(np.array(array, order="C")))
        value.type = ir.TensorType(value.const_value.dtype)
        value.shape = ir.Shape(array.shape)
        return value

    def node(self, op_type: str, inputs: Sequence[ir.Value | None], attributes: dict | None = None, *,
             domain: str = "", num_outputs: int = 1, hint: str = "lnfuse") -> ir.Node:
        node = ir.node(op_type, list(inputs), attributes or {}, domain=domain, num_outputs=num_outputs,
                       name=self.fresh_name(f"{hint}/{op_type}"))
        for i, out in enumerate(node.outputs):
            out.name = self.fresh_name(f"{hint}/{op_type}_out{i}")
        self._made.append(node)
        return node

    def settle(self, keep: bool) -> None:
        """End a build: keep what it made (the engine then owns it), or let it go. A node never applied still
        counts among the readers of the values it reads, which would keep them alive in the clean-up and refuse
        later rewrites of them."""
        if not keep:
            for node in self._made:
                for index in range(len(node.inputs)):
                    node.replace_input_with(index, None)
        self._made.clear()


class Rule(abc.ABC):
    """One fused-op family. Subclasses set the class attributes and write ``build``."""

    #: short name used by ``--only`` / ``--skip`` and in the report
    name: str
    #: op types whose nodes mark a normalization-like candidate (reported when left unfused)
    anchors: frozenset[str]
    #: the targets this rule writes for (contrib ops only for ONNX Runtime)
    targets: frozenset[str] = frozenset({"ort", "onnx"})
    #: alternatives tried at every node, in order; the first match whose checks pass is used
    patterns: Sequence[Pattern]
    #: (pattern, reason): shapes that look like this family but compute something else, for the report
    near_misses: Sequence[tuple[Pattern, str, str]] = ()
    #: when this rule refuses a candidate that a later rule then fuses as something smaller, say why in a note
    reports_fallback: bool = False
    #: its anchors are fused norms already (it folds a residual or the embeddings into them): a refusal leaves the
    #: norm fused in the form it has, which is reported as kept, never as a candidate left unfused
    refines: bool = False
    #: where it cannot tell how the run-time tensors a match reads relate in shape, the rule may choose a smaller
    #: form without refusing (the embedding rule takes positions as an input rather than 0..S-1); the fusions of a
    #: rule that refuses instead stand on onnx's shapes, and do not make the symbolic inference run
    settles_for_less: bool = True

    @abc.abstractmethod
    def build(self, m: Match, ctx: GraphContext) -> Replacement:
        """Check the match and build its replacement, or raise ``Refusal``."""

    def anchor_nodes(self, m: Match) -> Iterable[ir.Node]:
        """The anchor nodes a match covers (so the report can tie refusals to candidates)."""
        return (n for n in m.nodes if known_op(n) in self.anchors)
