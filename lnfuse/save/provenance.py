"""What lnfuse did, written into the model itself, where a viewer shows it (Netron lists a model's metadata_props
as model properties, and a node's metadata_props and doc_string in the node's panel).

- the model: ``lnfuse.version``, ``lnfuse.target``, ``lnfuse.options``, ``lnfuse.fused`` (fused op counts, JSON),
  ``lnfuse.unfused`` (candidates left unfused);
- each fused node: ``lnfuse.rule``, ``lnfuse.replaced`` (names of the input's nodes it stands for, JSON),
  ``lnfuse.max_error`` (measured in ONNX Runtime), and a one-sentence doc_string;
- ``lnfuse decompose``: ``lnfuse.decomposed`` (op counts, JSON) and ``lnfuse.left`` (fused ops it could not
  replace), in place of an earlier fuse's keys;
- ``lnfuse explain --annotate``: each node of a candidate left unfused gets ``lnfuse.refused`` (why), each node of
  a fusable one ``lnfuse.fuses_into``.

Keys are only added or replaced under the ``lnfuse.`` prefix: the input's own properties stay as they were.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Sequence

import onnx_ir as ir

from lnfuse.load.trust import untrusted_json
from lnfuse.report import Fused, Report
from lnfuse.version import lnfuse_version

RULE, REPLACED, ERROR = "lnfuse.rule", "lnfuse.replaced", "lnfuse.max_error"
REFUSED, FUSES_INTO = "lnfuse.refused", "lnfuse.fuses_into"

#: names listed in a doc_string before it says "and N more" (the metadata lists every one)
_NAMES_SHOWN = 8


def mark_fused(new_nodes: Sequence[ir.Node], region: Sequence[ir.Node], record: Fused) -> None:
    """Label the fused node(s) of one rewrite. A region node that lnfuse itself wrote earlier (a norm a Skip op
    absorbs) stands for the input's nodes it replaced, so ``replaced`` always names nodes of the input model."""
    replaced: list[str] = []
    for node in region:
        replaced.extend(_stands_for(node))
    error = "not verified" if record.max_error is None else f"{record.max_error:.3g}"
    shown = ", ".join(replaced[:_NAMES_SHOWN]) + (f" and {len(replaced) - _NAMES_SHOWN} more"
                                                   if len(replaced) > _NAMES_SHOWN else "")
    checked = "not verified" if record.max_error is None else f"verified in ONNX Runtime, max error {error}"
    for node in [n for n in new_nodes if n.op_type == record.op_type] or list(new_nodes):
        node.metadata_props[RULE] = record.rule
        node.metadata_props[REPLACED] = json.dumps(replaced)
        node.metadata_props[ERROR] = error
        node.doc_string = f"lnfuse {record.rule}: replaces {len(replaced)} nodes ({shown}); {checked}"


def _stands_for(node: ir.Node) -> list[str]:
    """The input nodes a node stands for: those lnfuse recorded on it, else itself. The input is untrusted, so a
    record that is not a JSON list of names counts as no record."""
    earlier = untrusted_json(node.metadata_props.get(REPLACED))
    if isinstance(earlier, list) and earlier and all(isinstance(name, str) for name in earlier):
        return earlier
    return [node.name or f"<unnamed {node.op_type}>"]


def mark_model(model: ir.Model, report: Report, options: dict) -> None:
    """Say on the written model which lnfuse ran, with which options, and what it fused and left."""
    props = model.metadata_props
    props["lnfuse.version"] = lnfuse_version()
    props["lnfuse.target"] = report.target
    props["lnfuse.options"] = json.dumps(options, sort_keys=True, default=str)
    # a model fused again keeps what the earlier run fused (its ops are still in it), plus what this run did
    fused = Counter(_counts(props.get("lnfuse.fused")))
    fused.update(report.fused_counts())
    props["lnfuse.fused"] = json.dumps(dict(fused), sort_keys=True)
    props["lnfuse.unfused"] = str(len(report.unfused))


def _counts(text: str | None) -> dict[str, int]:
    """An earlier run's fused op counts, if the model's metadata holds them as lnfuse writes them."""
    counts = untrusted_json(text)
    if not isinstance(counts, dict):
        return {}
    return {op: n for op, n in counts.items() if isinstance(op, str) and isinstance(n, int) and n > 0}


def mark_decomposed(model: ir.Model, report: Report, verify: bool) -> None:
    """After ``lnfuse decompose``: the fused ops replaced by primitives; what an earlier fuse recorded no longer holds."""
    props = model.metadata_props
    for stale in ("lnfuse.fused", "lnfuse.unfused", "lnfuse.target"):
        props.pop(stale, None)
    props["lnfuse.version"] = lnfuse_version()
    props["lnfuse.options"] = json.dumps({"command": "decompose", "verify": verify}, sort_keys=True)
    props["lnfuse.decomposed"] = json.dumps(dict(Counter(f.op_type for f in report.fused)), sort_keys=True)
    props["lnfuse.left"] = str(len(report.unfused))


def mark_candidates(model: ir.Model, report: Report, scopes: dict[str, ir.Graph | ir.Function]) -> int:
    """On an unchanged copy of the input: each node of every candidate says why it was left unfused (or what it
    fuses into). ``scopes`` maps the report's graph paths to the copy's graphs. Returns the nodes labelled."""
    by_name = {path: {node.name: node for node in graph if node.name} for path, graph in scopes.items()}
    reasons: dict[ir.Node, list[str]] = {}
    for u in report.unfused:
        for node in _named(by_name.get(u.graph, {}), u.nodes):
            reasons.setdefault(node, []).append(f"{u.rule}/{u.check}: {u.reason}")
    fuses: dict[ir.Node, list[str]] = {}
    for f in report.fused:
        for node in _named(by_name.get(f.graph, {}), f.nodes):
            fuses.setdefault(node, []).append(f"{f.op_type} ({f.rule})")
    for node, why in reasons.items():
        node.metadata_props[REFUSED] = "; ".join(dict.fromkeys(why))
        node.doc_string = f"lnfuse: left unfused: {node.metadata_props[REFUSED]}"
    for node, into in fuses.items():
        if node not in reasons:
            node.metadata_props[FUSES_INTO] = ", ".join(dict.fromkeys(into))
            node.doc_string = f"lnfuse: fuses into {node.metadata_props[FUSES_INTO]}"
    model.metadata_props["lnfuse.version"] = lnfuse_version()
    model.metadata_props["lnfuse.explained"] = (
        f"target {report.target}: {len(report.unfused)} candidate(s) left unfused, {len(report.fused)} fusable; "
        f"see each node's {REFUSED} / {FUSES_INTO}")
    return len(reasons.keys() | fuses.keys())


def _named(nodes: dict[str, ir.Node], names: Sequence[str]) -> list[ir.Node]:
    """The nodes with these names (an unnamed node has no name to be found by, and is left as it is)."""
    return [nodes[name] for name in names if name in nodes]
