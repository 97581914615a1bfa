"""Names the command line and the Python API share: the targets and the rule lists. A module of its own so the command
line can offer them without importing the optimizer.

A target says what a fused model may contain: ``ort`` (the default) may write ONNX Runtime's own fused ops, ``onnx``
only standard ONNX ops."""

from __future__ import annotations

from collections.abc import Iterable

TARGETS = ("ort", "onnx")


def rule_names(rules: Iterable[str] | str | None) -> list[str] | None:
    """Rule names given as a list, or as one string (``"layer_norm"``, ``"layer_norm,skip_norm"``, as ``--only``
    takes them)."""
    if isinstance(rules, str):
        return [name.strip() for name in rules.split(",") if name.strip()]
    return None if rules is None else list(rules)
