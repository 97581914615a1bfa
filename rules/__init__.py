"""The fusion rules, one module per fused-op family, in the order they run.

Norms come first: later families (residual, embedding) consume the norms fused here.
"""

from __future__ import annotations

from lnfuse.rule import Rule

from . import layer_norm, rms_norm, skip_norm


def all_rules() -> tuple[Rule, ...]:
    return (layer_norm.RULE, rms_norm.RULE, skip_norm.RULE)
