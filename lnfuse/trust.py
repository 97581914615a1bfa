"""The trust boundary's shared checks: a model folder is untrusted input, the command line is trusted.

What a model asks to read is admitted by ``lnfuse.gate`` (the only reader of a model folder). On the way out,
lnfuse never writes through a link out of the output folder and never writes over a file it reads (compared by
device and inode, not by name).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import onnx
import onnx_ir as ir

from lnfuse.errors import InputError, OutputError


def tensor_bytes(tensor: onnx.TensorProto, said: str) -> int:
    """The bytes a tensor of this type and shape holds (four-bit types pack two elements a byte)."""
    elements = element_count(tensor.dims, said)
    try:
        itemsize = ir.DataType(tensor.data_type).itemsize
    except ValueError:
        raise InputError(f"{said}: unknown data type {tensor.data_type}; re-export the model") from None
    if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        raise InputError(f"{said}: a {onnx.TensorProto.DataType.Name(tensor.data_type)} tensor cannot be external "
                         "data; re-export the model")
    return math.ceil(elements * itemsize)


def element_count(dims, said: str) -> int:
    if any(d < 0 for d in dims):
        raise InputError(f"{said}: negative dimension in {list(dims)}; re-export the model")
    return math.prod(dims)


def inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """Device and inode of the file a path names (links followed), or None if there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def confined(folder: Path, relative: str | os.PathLike) -> Path:
    """``folder / relative``, refused if the relative part is absolute or climbs out, or if a folder on the way
    is a link out of ``folder``. The last component itself may be a link: it is replaced by a rename, not
    followed."""
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts or "\0" in str(rel):
        raise OutputError(f"{folder}: refusing to write {str(rel)!r}, which is not inside the output folder")
    path = folder / rel
    if not inside(os.path.realpath(path.parent), os.path.realpath(folder)):
        raise OutputError(f"{path}: a folder on the way is a link out of the output folder {str(folder)!r}; "
                          "remove the link or choose another output folder")
    return path


def check_no_overwrite(reads: dict[tuple[int, int], Path], writes: list[Path],
                       allowed: set[tuple[int, int]]) -> None:
    """No file lnfuse writes is a file it reads (by device and inode: another name or a hard link is the same
    file), except the ones in ``allowed`` (--in-place), and no two written files are one."""
    seen: dict[object, Path] = {}
    for path in writes:
        ident = identity(path)
        if ident is not None and ident in reads and ident not in allowed:
            raise OutputError(f"{path}: this is the input file {str(reads[ident])!r} (or a link to it); writing it "
                              "would destroy the input; choose another path")
        key = ident or os.path.join(os.path.realpath(path.parent), path.name)
        if key in seen:
            raise OutputError(f"{path}: lnfuse would write it twice (also as {str(seen[key])!r}); choose other "
                              "paths")
        seen[key] = path
