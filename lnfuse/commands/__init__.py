"""Commands beyond fusing: ``decompose`` (fused ops back to primitives) and ``--quantize-embeddings``."""
