"""lnfuse: verified normalization fusion for ONNX models.

>>> import lnfuse
>>> result = lnfuse.fuse("model.onnx")          # or an onnx.ModelProto
>>> print(result.report.summary())
>>> result.save("model.fused.onnx")

In an onnx_ir PassManager: ``lnfuse.FusePass(target="onnx")``; ``lnfuse.fuse`` also takes torch's ONNXProgram.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from lnfuse.errors import InputError, LnfuseError, OutputError, UsageError

if TYPE_CHECKING:
    from lnfuse.api import FuseResult, fuse
    from lnfuse.commands.decompose import decompose
    from lnfuse.report import Report

__all__ = ["fuse", "decompose", "FusePass", "FuseResult", "Report", "LnfuseError", "InputError", "OutputError",
           "UsageError"]

#: imported on first use: the optimizer pulls in onnx_ir, ONNX Runtime and numpy (about half a second), which
#: ``lnfuse --help`` and ``import lnfuse.errors`` do not need
_LAZY = {"fuse": "lnfuse.api", "FuseResult": "lnfuse.api", "decompose": "lnfuse.commands.decompose",
         "Report": "lnfuse.report", "FusePass": "lnfuse.integrations.ir_pass"}


def __getattr__(name: str):
    if name == "__version__":
        from lnfuse.version import lnfuse_version
        return lnfuse_version()
    if name not in _LAZY:
        raise AttributeError(f"module 'lnfuse' has no attribute '{name}'")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
