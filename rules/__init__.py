"""The fusion rules, one module per fused-op family, in the order they run.

Norms come first: later families (residual, embedding) consume the norms fused here.
"""

from __future__ import annotations

from lnfuse.match.rule import Rule

from . import embed_norm, layer_norm, rms_norm, skip_norm


def all_rules() -> tuple[Rule, ...]:
    # embeddings before residuals: the embedding sum word + position + segment is also an Add before a norm
    return (layer_norm.RULE, rms_norm.RULE, embed_norm.RULE, skip_norm.RULE)
