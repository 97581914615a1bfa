"""Versions of lnfuse and of the libraries it runs on, read from the installed packages' metadata (importing the
libraries themselves to ask would cost a second)."""

from __future__ import annotations

import functools
from importlib import metadata

#: the libraries whose versions decide what lnfuse writes; onnxruntime ships under several distribution names
_LIBRARIES = (("onnx", ("onnx",)), ("onnxruntime", ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml",
                                                    "onnxruntime-openvino", "ort-nightly")),
              ("onnxscript", ("onnxscript",)), ("onnx-ir", ("onnx-ir",)))


@functools.cache  # the version of the code this process imported: a pip run meanwhile does not change it
def installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def lnfuse_version() -> str:
    """From the package metadata; a source tree that was never installed says so rather than guessing."""
    return installed("lnfuse") or "unknown (not installed; run pip install -e .)"


def library_versions() -> dict[str, str]:
    found = {}
    for name, distributions in _LIBRARIES:
        version = next((v for v in map(installed, distributions) if v), None)
        if version:
            found[name] = version
    return found


def version_line() -> str:
    """``lnfuse 0.1.0 (onnx 1.23.2, onnxruntime 1.32.0, onnxscript 0.7.2, onnx-ir 1.1.0)``"""
    libraries = ", ".join(f"{name} {version}" for name, version in library_versions().items())
    return f"lnfuse {lnfuse_version()}" + (f" ({libraries})" if libraries else "")
