"""lnfuse: verified normalization fusion for ONNX models.

>>> import lnfuse
>>> result = lnfuse.fuse("model.onnx")          # or an onnx.ModelProto
>>> print(result.report.summary())
>>> result.save("model.fused.onnx")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from lnfuse.errors import InputError, LnfuseError, OutputError, UsageError

if TYPE_CHECKING:
    from lnfuse.api import FuseResult, fuse
    from lnfuse.decompose import decompose
    from lnfuse.report import Report

__all__ = ["fuse", "decompose", "FuseResult", "Report", "LnfuseError", "InputError", "OutputError", "UsageError"]
__version__ = "0.1.0"

#: imported on first use: the optimizer pulls in onnx_ir, ONNX Runtime and numpy (about half a second), which
#: ``lnfuse --help`` and ``import lnfuse.errors`` do not need
_LAZY = {"fuse": "lnfuse.api", "FuseResult": "lnfuse.api", "decompose": "lnfuse.decompose", "Report": "lnfuse.report"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'lnfuse' has no attribute '{name}'")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
