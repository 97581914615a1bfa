"""lnfuse as an ``onnx_ir`` pass, to run in an ``ir.passes.PassManager`` next to onnxscript's optimizer and
rewriter passes (which are ``onnx_ir`` passes too).

    import onnx_ir as ir, lnfuse
    from onnxscript.rewriter import RewritePass
    from onnxscript.rewriter.rules.common import no_op_cast_rule

    manager = ir.passes.PassManager([RewritePass([no_op_cast_rule]), lnfuse.FusePass(target="onnx")])
    fused = manager(program.model).model
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import onnx_ir as ir

from lnfuse.api import TARGETS, fuse, select_rules
from lnfuse.errors import UsageError
from lnfuse.report import Report


class FusePass(ir.passes.FunctionalPass):
    """``lnfuse.fuse`` as a pass, with the same options. Functional: the input model is never modified, the result
    is a new model (every rewrite checked and, unless ``verify=False``, verified in ONNX Runtime). ``modified``
    says whether any op changed; the provenance lnfuse writes into the model's metadata is not counted. After a
    run, ``report`` holds what was fused and what was left, and why."""

    def __init__(self, *, target: str = "ort", verify: bool = True, only: Iterable[str] | None = None,
                 skip: Iterable[str] | None = None, upgrade_opset: bool = False, verify_model: bool = False,
                 inputs: dict[str, np.ndarray] | None = None, quantize_embeddings: str | None = None,
                 allow_requantization: bool = False):
        super().__init__()
        if target not in TARGETS:  # wrong options fail when the pipeline is built, not halfway through it
            raise UsageError(f"unknown target '{target}'; use one of {', '.join(TARGETS)}")
        select_rules(only, skip)
        self.options = dict(target=target, verify=verify, only=list(only or []) or None,
                            skip=list(skip or []) or None, upgrade_opset=upgrade_opset, verify_model=verify_model,
                            inputs=inputs, quantize_embeddings=quantize_embeddings,
                            allow_requantization=allow_requantization)
        self.report: Report | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = fuse(model, **self.options)
        self.report = result.report
        modified = result.report.ops_before != result.report.ops_after
        return ir.passes.PassResult(result.ir_model, modified=modified)
