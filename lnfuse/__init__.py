"""lnfuse: verified normalization fusion for ONNX models.

>>> import lnfuse
>>> result = lnfuse.fuse("model.onnx")          # or an onnx.ModelProto
>>> print(result.report.summary())
>>> result.save("model.fused.onnx")

In an onnx_ir PassManager: ``lnfuse.FusePass(target="onnx")``; ``lnfuse.fuse`` also takes torch's ONNXProgram.
"""

from lnfuse.api import FuseResult, fuse
from lnfuse.decompose import decompose
from lnfuse.errors import InputError, LnfuseError, OutputError, UsageError
from lnfuse.report import Report

__all__ = ["fuse", "decompose", "FusePass", "FuseResult", "Report", "LnfuseError", "InputError", "OutputError",
           "UsageError"]


def __getattr__(name: str):
    """``FusePass`` (an onnx_ir pass) and ``__version__`` (from the package metadata) are made on first use."""
    if name == "FusePass":
        from lnfuse.passes import FusePass
        return FusePass
    if name == "__version__":
        from lnfuse.version import lnfuse_version
        return lnfuse_version()
    raise AttributeError(f"module 'lnfuse' has no attribute '{name}'")
