"""What lnfuse did, and what it left alone and why: as a text summary and as JSON."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from lnfuse.terminal import Line, Styled, block, escape

#: the rule name ``decompose`` gives its entries: a ``Fused`` is then a fused op replaced by primitives, an
#: ``Unfused`` one left as it was
DECOMPOSE = "decompose"

@dataclass
class Fused:
    rule: str
    op_type: str
    graph: str
    nodes: list[str]
    attributes: dict
    max_error: float | None
    outputs: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Refused:
    """A check that failed on one of the forms tried for a candidate, and how many nodes that form matched."""

    check: str
    reason: str
    matched: int


@dataclass
class Unfused:
    """A candidate left as it was: the deciding check (``check``/``reason``, on the form that matched furthest,
    whose nodes are ``nodes``), and the checks that failed on the other forms tried (``others``)."""

    rule: str
    graph: str
    anchor: str
    check: str
    reason: str
    nodes: list[str] = field(default_factory=list)
    others: list[Refused] = field(default_factory=list)


@dataclass
class Candidate:
    """Norm-like statistics found by what they compute (``lnfuse.match.candidates``), whatever the rules matched: where
    they are, their kind (``centred``: a LayerNorm's; ``uncentred``: an RMS norm's), what was seen
    (``statistics``), and what became of them: fused (``rule`` wrote ``op_type``), or left, with the ``check`` and
    ``reason`` of the matching entry in ``Report.unfused``."""

    graph: str
    kind: str
    anchor: str
    statistics: str
    nodes: list[str]
    fused: bool
    rule: str
    op_type: str = ""
    check: str = ""
    reason: str = ""


@dataclass
class Report:
    source: str
    target: str
    verified: bool
    ops_before: dict[str, int] = field(default_factory=dict)
    ops_after: dict[str, int] = field(default_factory=dict)
    fused: list[Fused] = field(default_factory=list)
    unfused: list[Unfused] = field(default_factory=list)
    #: fused norms a later rule could not fold more into (a residual, the embeddings): kept as they are, not left
    kept: list[Unfused] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ort_only: bool = False
    seconds: float = 0.0
    model_check: dict | None = None
    #: every norm-like candidate found independently of the rules, fused or not
    candidates: list[Candidate] = field(default_factory=list)

    def fused_counts(self) -> dict[str, int]:
        """Fused ops in the written model, by type (a norm later folded into a Skip op counts once, as Skip)."""
        made = Counter(f.op_type for f in self.fused)
        return {op: self.ops_after.get(op, 0) - self.ops_before.get(op, 0) for op in sorted(made)
                if self.ops_after.get(op, 0) > self.ops_before.get(op, 0)}

    def worst_errors(self) -> dict[str, float]:
        worst: dict[str, float] = {}
        for f in self.fused:
            if f.max_error is not None and not math.isnan(f.max_error):
                worst[f.op_type] = max(worst.get(f.op_type, 0.0), f.max_error)
        return worst

    def to_json(self) -> str:
        data = asdict(self)
        data["fused_counts"] = self.fused_counts()
        data["worst_error"] = self.worst_errors()
        return json.dumps(data, indent=2, default=_plain, allow_nan=False)

    def fused_by_rule(self) -> list[tuple[str, str, int, float | None]]:
        """(rule, fused op, count in the written model, worst verified error), one row per op the model gained."""
        counts, worst = self.fused_counts(), self.worst_errors()
        rule_of: dict[str, str] = {}
        for f in self.fused:
            rule_of.setdefault(f.op_type, f.rule)
        return [(rule_of[op], op, n, worst.get(op)) for op, n in counts.items()]

    def decomposed_by_op(self) -> list[tuple[str, int, float | None]]:
        """After ``decompose``: (fused op, how many were replaced by primitives, worst verified error)."""
        counts = Counter(f.op_type for f in self.fused if f.rule == DECOMPOSE)
        worst = self.worst_errors()
        return [(op, n, worst.get(op)) for op, n in sorted(counts.items())]

    def summary(self, verbose: bool = False, colour: bool = False, decompose: bool = False) -> str:
        """Small tables: op counts before/after, fused per rule (after ``decompose``: decomposed per op), what was
        left and why, notes, time. ``decompose``: the report is decompose's, even if it decomposed nothing. Names
        from the model are escaped (``lnfuse.terminal``): the text's only line breaks are its own."""
        return block(self.summary_lines(verbose, colour, decompose))

    def summary_lines(self, verbose: bool = False, colour: bool = False, decompose: bool = False) -> list[Line]:
        """``summary``'s lines, for ``lnfuse.terminal.say``."""
        style = _Style(colour)
        nodes_before, nodes_after = sum(self.ops_before.values()), sum(self.ops_after.values())
        lines: list[Line] = [[style.bold(f"lnfuse: {self.source}"), f"  (target {self.target}, verification "
                              f"{'on' if self.verified else 'off'}, {self.seconds:.2f} s)"], ""]
        changed = sorted(op for op in set(self.ops_before) | set(self.ops_after)
                         if self.ops_before.get(op, 0) != self.ops_after.get(op, 0))
        rows = [[op, str(self.ops_before.get(op, 0)), str(self.ops_after.get(op, 0))] for op in changed]
        lines += _table(["op", "before", "after"], rows + [["all nodes", str(nodes_before), str(nodes_after)]])
        lines.append("")
        fused, decomposed = self.fused_by_rule(), self.decomposed_by_op()
        decomposing = decompose or bool(decomposed) or any(u.rule == DECOMPOSE for u in self.unfused)
        if fused:
            lines += style.green(_table(["rule", "fused op", "count", "worst verified error"],
                                        [[r, op, str(n), "not verified" if e is None else f"{e:.2e}"]
                                         for r, op, n, e in fused]))
        elif decomposed:
            lines += style.green(_table(["decomposed op", "count", "worst verified error"],
                                        [[op, str(n), "not verified" if e is None else f"{e:.2e}"]
                                         for op, n, e in decomposed]))
        else:
            lines.append("decomposed: nothing" if decomposing else "fused: nothing")
        if self.unfused:
            lines.append("")
            shown = self.unfused if verbose else self.unfused[:20]
            left = "left fused" if decomposing else "left unfused"
            lines += style.yellow(_table([f"{left} ({len(self.unfused)})", "rule/check", "reason"],
                                         [[f"{u.graph}: {u.anchor}", f"{u.rule}/{u.check}", u.reason]
                                          for u in shown]))
            if len(shown) < len(self.unfused):
                lines.append(f"... {len(self.unfused) - len(shown)} more (-v, or lnfuse explain)")
        if verbose and self.kept:
            lines.append("")
            lines += _table([f"kept as fused ({len(self.kept)})", "rule/check", "why not more"],
                            [[f"{k.graph}: {k.anchor}", f"{k.rule}/{k.check}", k.reason] for k in self.kept])
        if verbose:
            lines.append("")
            for f in self.fused:
                err = "" if f.max_error is None else f" err {f.max_error:.2e}"
                if f.rule == DECOMPOSE:
                    lines.append(f"decomposed {f.op_type} in {f.graph} ({', '.join(f.nodes)}){err}")
                    continue
                lines.append(f"fused {f.op_type} in {f.graph} from {len(f.nodes)} nodes "
                             f"({', '.join(f.nodes[:3])}{'...' if len(f.nodes) > 3 else ''}){err}")
        if self.model_check or self.notes:
            lines.append("")
        if self.model_check:
            lines.append(f"whole-model check: {self.model_check.get('summary')}")
        lines += [f"note: {note}" for note in self.notes]
        return lines

    def explain(self, verbose: bool = False) -> str:
        """Every candidate: fused (with what), or left with the deciding check; ``verbose`` also lists the checks
        that failed on the other forms tried. Names from the model are escaped, as in ``summary``."""
        return block(self.explain_lines(verbose))

    def explain_lines(self, verbose: bool = False) -> list[str]:
        """``explain``'s lines, for ``lnfuse.terminal.say``."""
        lines = [f"lnfuse explain: {self.source} (target {self.target})"]
        for f in self.fused:
            attrs = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in f.attributes.items())
            err = "" if f.max_error is None else f"; verified, max error {f.max_error:.2e}"
            lines.append(f"FUSED   {f.graph}: {f.op_type}({attrs}) from {', '.join(f.nodes)}{err}")
            lines.extend(f"        note: {note}" for note in f.notes)
        for label, entries in (("LEFT    ", self.unfused), ("KEPT    ", self.kept)):
            for u in entries:
                lines.append(f"{label}{u.graph}: {u.anchor} [{u.rule}/{u.check}] {u.reason}")
                if verbose:
                    lines += [f"        also refused: [{u.rule}/{o.check}] {o.reason} (a form of {o.matched} nodes)"
                              for o in u.others]
                elif u.others:
                    lines.append(f"        ({len(u.others)} other check(s) failed on other forms tried; -v lists "
                                 "them)")
        if self.candidates:
            left = sum(not c.fused for c in self.candidates)
            lines.append(f"{len(self.candidates)} norm-like statistic(s) found: {len(self.candidates) - left} fused, "
                         f"{left} left")
        elif len(lines) == 1:
            lines.append("no normalization-like candidates")
        for note in self.notes:
            lines.append(f"note: {note}")
        return lines


class _Style:
    """Colour on a terminal (the printer adds the codes, after escaping), plain text elsewhere."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def _paint(self, code: str, lines):
        if isinstance(lines, str):
            return Styled(lines, code) if self.enabled else lines
        return [self._paint(code, line) for line in lines]

    def bold(self, text):
        return self._paint("1", text)

    def green(self, lines):
        return self._paint("32", lines)

    def yellow(self, lines):
        return self._paint("33", lines)


def _table(header: list[str], rows: list[list[str]], max_width: int = 100) -> list[str]:
    """Left-aligned columns, numbers right-aligned; the last column is not padded (reasons are long). Cells are
    escaped first, so that columns line up as shown."""
    header, rows = [escape(cell) for cell in header], [[escape(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    widths = [min(w, max_width) for w in widths]

    def line(cells: list[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            if cell.isdigit():
                out.append(cell.rjust(widths[i]))
            else:
                out.append(cell if i == len(cells) - 1 else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return [line(header)] + [line(r) for r in rows]


def _plain(obj):
    if isinstance(obj, float):
        return None if math.isnan(obj) else obj
    return str(obj)
