"""lnfuse: verified normalization fusion for ONNX models.

>>> import lnfuse
>>> result = lnfuse.fuse("model.onnx")          # or an onnx.ModelProto
>>> print(result.report.summary())
>>> result.save("model.fused.onnx")
"""

from lnfuse.api import FuseResult, fuse
from lnfuse.decompose import decompose
from lnfuse.errors import InputError, LnfuseError, OutputError, UsageError
from lnfuse.report import Report

__all__ = ["fuse", "decompose", "FuseResult", "Report", "LnfuseError", "InputError", "OutputError", "UsageError"]
__version__ = "0.1.0"
