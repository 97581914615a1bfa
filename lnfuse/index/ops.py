"""Op identity: the one place that decides which op a node is.

A node's ``op_type`` is a name the model chose. It names ONNX's op only in ONNX's domain ("" or its other spelling
"ai.onnx"), and ONNX Runtime's contrib op only in "com.microsoft"; in any other domain it names whatever the model
says, typically a model-local function (``evil::QuantizeLinear`` may compute anything). Every rule, proof,
canonicalization, matcher and engine step asks these functions, never ``op_type`` alone
(``tests/test_op_identity.py`` holds the code to that).

No model-local function shadows an op these functions name, and no opset range needs asking here:
- ONNX Runtime resolves a node of its domains ("", "ai.onnx", "ai.onnx.ml", "com.microsoft") to the op it
  registers for that domain, name and opset, and only otherwise to a model-local function; in the ONNX domains it
  never runs a function at all (a function ``::Identity`` computing x + 1 is dead code: ORT runs Identity). So
  renaming such a function's call sites would change what the model computes, and is not done;
- every node of the ONNX domain is an op registered at the model's opset once the model is loaded: onnx's checker
  refuses any other (``load/io.validate``), and ``load/repair`` makes functions import the model's opset, as ORT
  runs them. ``tests/test_op_identity.py`` pins ONNX Runtime's side of this.
"""

from __future__ import annotations

import functools
from typing import Protocol

import onnx

#: the default domain's two spellings
ONNX_DOMAINS = frozenset({"", "ai.onnx"})
#: ONNX Runtime's contrib domain
ORT_DOMAIN = "com.microsoft"
#: the domains of ops only ONNX Runtime runs
ORT_DOMAINS = frozenset({ORT_DOMAIN, "com.microsoft.nchwc", "com.ms.internal.nhwc", "com.microsoft.dml",
                         "com.microsoft.extensions"})


class _Named(Protocol):
    """An onnx_ir node or an onnx NodeProto: both carry these two fields."""

    op_type: str
    domain: str


def onnx_op(node: _Named | None) -> str | None:
    """The name of the ONNX op ``node`` is, or None when it is none (no node, or a node of another domain whatever
    its name). Compare the result, look it up in tables: ``onnx_op(node) in _MOVES``."""
    if node is None or node.domain not in ONNX_DOMAINS:
        return None
    return node.op_type


def ort_op(node: _Named | None) -> str | None:
    """The name of the ONNX Runtime contrib op (domain "com.microsoft") ``node`` is, or None. A name ONNX Runtime
    registers no op for in that domain (``com.microsoft::Unsqueeze``) is no contrib op: ONNX Runtime runs the
    model-local function of that name, which may compute anything."""
    if node is None or node.domain != ORT_DOMAIN or (ORT_DOMAIN, node.op_type) not in ort_schemas():
        return None
    return node.op_type


@functools.cache
def ort_schemas() -> dict[tuple[str, str], object]:
    """ONNX Runtime's registered op schemas by (domain, name), the newest version of each (read once: the registry
    is fixed per install)."""
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

    found: dict[tuple[str, str], object] = {}
    for schema in get_all_operator_schema():
        key = (schema.domain, schema.name)
        if key not in found or schema.since_version > found[key].since_version:
            found[key] = schema
    return found


def known_op(node: _Named | None) -> str | None:
    """The name of the op ``node`` is when it is ONNX's or ONNX Runtime's contrib op, else None. For lists of
    candidates by name (anchors, roots) whose patterns then ask ``is_op`` with the domain they want."""
    return onnx_op(node) or ort_op(node)


def is_op(node: _Named | None, *names: str, domain: str = "") -> bool:
    """Whether ``node`` is ONNX's op of one of ``names`` (``domain="com.microsoft"``: ONNX Runtime's contrib op)."""
    found = onnx_op(node) if domain in ONNX_DOMAINS else ort_op(node) if domain == ORT_DOMAIN else \
        (node.op_type if node is not None and node.domain == domain else None)
    return found is not None and found in names


def op_key(node: _Named) -> tuple[str, str]:
    """(domain, name) with the default domain spelled "": what tells two ops apart when counting or grouping."""
    return ("" if node.domain in ONNX_DOMAINS else node.domain), node.op_type


def op_name(node: _Named) -> str:
    """A node's op for people to read (messages, reports, node names): ``Add``, ``com.microsoft::Gelu``. Says
    nothing about what the node computes."""
    domain, name = op_key(node)
    return f"{domain}::{name}" if domain else name


def only_ort_runs(domain: str, op_type: str, opset: int) -> bool:
    """Whether (domain, op_type) is an op only ONNX Runtime runs, in a graph whose default-domain opset is
    ``opset``: a contrib op, or a default-domain op ONNX does not define at that opset (ORT's own
    LayerNormalization before opset 17), which onnx's checker rejects."""
    if domain in ORT_DOMAINS:
        return True
    return domain in ONNX_DOMAINS and not onnx.defs.has(op_type, opset, "")
