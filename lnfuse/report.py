"""What lnfuse did, and what it left alone and why: as a text summary and as JSON."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field


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
class Unfused:
    rule: str
    graph: str
    anchor: str
    check: str
    reason: str
    nodes: list[str] = field(default_factory=list)


@dataclass
class Report:
    source: str
    target: str
    verified: bool
    ops_before: dict[str, int] = field(default_factory=dict)
    ops_after: dict[str, int] = field(default_factory=dict)
    fused: list[Fused] = field(default_factory=list)
    unfused: list[Unfused] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ort_only: bool = False
    seconds: float = 0.0
    model_check: dict | None = None

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

    def summary(self, verbose: bool = False, colour: bool = False) -> str:
        text = self._summary(verbose)
        if not colour:
            return text
        # on a terminal only: fused in green, left unfused in yellow, the header in bold
        paint = {"  fused:": "\033[32m", "  left unfused:": "\033[33m", "lnfuse:": "\033[1m"}
        lines = []
        for line in text.splitlines():
            start = next((code for key, code in paint.items() if line.startswith(key)), None)
            lines.append(f"{start}{line}\033[0m" if start else line)
        return "\n".join(lines)

    def _summary(self, verbose: bool) -> str:
        nodes_before, nodes_after = sum(self.ops_before.values()), sum(self.ops_after.values())
        lines = [f"lnfuse: {self.source} (target {self.target}, verification {'on' if self.verified else 'off'})",
                 f"  nodes: {nodes_before} -> {nodes_after}"]
        changed = sorted(op for op in set(self.ops_before) | set(self.ops_after)
                         if self.ops_before.get(op, 0) != self.ops_after.get(op, 0))
        if changed:
            lines.append("  ops changed: " + ", ".join(
                f"{op} {self.ops_before.get(op, 0)}->{self.ops_after.get(op, 0)}" for op in changed))
        counts, worst = self.fused_counts(), self.worst_errors()
        if counts:
            lines.append("  fused:")
            for op, n in sorted(counts.items()):
                err = f"  (worst verified error {worst[op]:.2e})" if op in worst else ""
                lines.append(f"    {op:<34} {n:>4}{err}")
        else:
            lines.append("  fused: nothing")
        if self.unfused:
            lines.append(f"  left unfused: {len(self.unfused)} candidate(s)")
            for u in self.unfused if verbose else self.unfused[:20]:
                lines.append(f"    {u.graph}: {u.anchor} [{u.rule}/{u.check}] {u.reason}")
            if not verbose and len(self.unfused) > 20:
                lines.append(f"    ... {len(self.unfused) - 20} more (-v, or lnfuse explain)")
        if verbose:
            for f in self.fused:
                err = "" if f.max_error is None else f" err {f.max_error:.2e}"
                lines.append(f"    fused {f.op_type} in {f.graph} from {len(f.nodes)} nodes "
                             f"({', '.join(f.nodes[:3])}{'...' if len(f.nodes) > 3 else ''}){err}")
        if self.model_check:
            lines.append(f"  whole-model check: {self.model_check.get('summary')}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        lines.append(f"  time: {self.seconds:.2f} s")
        return "\n".join(lines)

    def explain(self) -> str:
        lines = [f"lnfuse explain: {self.source} (target {self.target})"]
        for f in self.fused:
            attrs = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in f.attributes.items())
            err = "" if f.max_error is None else f"; verified, max error {f.max_error:.2e}"
            lines.append(f"FUSED   {f.graph}: {f.op_type}({attrs}) from {', '.join(f.nodes)}{err}")
        for u in self.unfused:
            lines.append(f"LEFT    {u.graph}: {u.anchor} [{u.rule}/{u.check}] {u.reason}")
        if len(lines) == 1:
            lines.append("no normalization-like candidates")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def _plain(obj):
    if isinstance(obj, float):
        return None if math.isnan(obj) else obj
    return str(obj)
