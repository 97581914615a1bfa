"""The trust boundary: a model folder is untrusted input, the command line is trusted.

A model names the files it wants read (external data locations). Each one must resolve, links followed, to a file
inside the model's folder, with a single link, and hold exactly the bytes the tensor declares; anything else is
refused before a byte of it is read. On the way out, lnfuse never writes through a link out of the output folder and
never writes over a file it reads (compared by device and inode, not by name).
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Callable

import onnx
import onnx_ir as ir

from lnfuse.errors import InputError, OutputError


def check_external_data(proto: onnx.ModelProto, base: Path, where: str,
                        lnfuse_made: Callable[[onnx.TensorProto], bool] | None = None) -> list[Path]:
    """The files the model's external-data references (in any graph or attribute) name, once each is known to be
    one it may read. ``lnfuse_made`` tells the placeholders lnfuse put in for weights left in the model file."""
    from onnx.external_data_helper import _get_all_tensors

    root = os.path.realpath(base)
    return sorted({external_file(t, base, root, where) for t in _get_all_tensors(proto)
                   if t.data_location == onnx.TensorProto.EXTERNAL
                   and not (lnfuse_made is not None and lnfuse_made(t))})


def external_file(tensor: onnx.TensorProto, base: Path, root: str, where: str) -> Path:
    """The file a tensor's external data lies in, once it is known to be inside ``root`` (the real path of the
    model's folder) and to hold the tensor's bytes where the entry says. Or ``InputError`` naming the tensor."""
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    said = f"{where}: tensor {tensor.name!r} has external data {location!r}"
    if not location or "\0" in location:
        raise InputError(f"{said}: not a file name; re-export the model")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or ".." in Path(location).parts:
        raise InputError(f"{said} outside the model's folder; external data must be a relative path inside it "
                         "(onnx and ONNX Runtime refuse it too)")
    path = base / location
    real = os.path.realpath(path)
    if not _inside(real, root):
        raise InputError(f"{said}, a link to {real!r} outside the model's folder; copy the file into the folder "
                         "(cp -L) if you trust it")
    try:
        st = os.stat(os.path.join(base, location))  # as readers join it: "w.data/" is not the file w.data
    except OSError:
        raise InputError(f"{said}: the file is missing; put it next to the model") from None
    if not os.path.isfile(real):
        raise InputError(f"{said}: not a regular file; re-export the model")
    if st.st_nlink > 1:
        # another name for these bytes may live anywhere on the file system (a hard link to a secret is as good
        # as a symbolic one, and cannot be seen through); onnx's checker refuses it as a "potential hardlink attack"
        raise InputError(f"{said}: the file has {st.st_nlink} hard links; copy it (cp) to a file of its own")
    offset = _number(info.get("offset", "0"), said, "offset")
    needed = tensor_bytes(tensor, said)
    length = _number(info["length"], said, "length") if "length" in info else st.st_size - offset
    if length != needed:
        raise InputError(f"{said}: its length {length} is not the {needed} bytes its type and shape need; "
                         "re-export the model")
    if offset + length > st.st_size:
        raise InputError(f"{said}: bytes {offset}..{offset + length} lie past the end of the {st.st_size}-byte "
                         "file; the file is truncated or not this model's")
    return path


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


def _number(text: str, said: str, key: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise InputError(f"{said}: {key} {text!r} is not a non-negative whole number; re-export the model")
    return int(text)


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """Device and inode of the file a path names (links followed), or None if there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


#: what a path that is not a regular file is, as a message says it
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def check_destination(path: Path) -> None:
    """Refuse to write ``path`` unless it is absent, a regular file, or a link to a regular file or to nothing
    (the link is then replaced, not followed). Outputs are renamed into place: over a device, FIFO or socket the
    rename would replace it with a regular file (as root, ``-o /dev/null`` would break /dev/null for every
    program), and over a folder it fails only after everything was written."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as error:  # a parent that is not a folder (ENOTDIR), a name too long
        raise OutputError(f"{path}: cannot be written ({error.strerror or error}); choose another output path")\
            from None
    through = ""
    if stat.S_ISLNK(st.st_mode):
        hop = _process_file_link(path)
        if hop is not None:
            # /dev/stdout, /dev/fd/N: the rename would replace the link itself (/dev/stdout for the whole system)
            raise OutputError(f"{path}: is a link to {hop!r}, an open file of a process, not a file; name a file "
                              "(the report is printed on stdout with --json)")
        try:
            st = os.stat(path)
        except OSError:
            return  # a dangling link (or a loop of links): the link itself is replaced
        through = f" (through the link {str(path)!r})"
    if stat.S_ISREG(st.st_mode):
        return
    kind = _kind(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path}: is {kind}{through}, not a file; name the file to write inside it, e.g. "
                          f"{str(path / 'model.onnx')!r}")
    raise OutputError(f"{path}: is {kind}{through}; lnfuse writes only regular files and never replaces or "
                      "writes into special files; name a file (to discard the output, write it to a temporary "
                      "folder and remove it)")


#: a link chain longer than this is a loop (the system's own limit is 40)
_MAX_LINKS = 40


def _process_file_link(path: Path) -> str | None:
    """The link on the way from ``path`` that lies in /proc (``/proc/self/fd/1``), or None. Such a link names a
    process's open file (a terminal, a pipe, a file stdout was sent to), not a path."""
    current = os.path.abspath(path)
    for _ in range(_MAX_LINKS):
        parent = os.path.realpath(os.path.dirname(current))
        current = os.path.join(parent, os.path.basename(current))
        if parent == "/proc" or parent.startswith("/proc/"):
            return current
        if not os.path.islink(current):
            return None
        current = os.path.join(parent, os.readlink(current))
    return None


def check_folder(folder: Path, what: Path) -> None:
    """The folder ``what`` is written into exists, is a folder (links followed) and can be written."""
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        raise OutputError(f"{what}: folder {str(folder)!r} does not exist; create it first") from None
    except OSError as error:
        raise OutputError(f"{what}: folder {str(folder)!r} cannot be reached ({error.strerror or error}); choose "
                          "another output path") from None
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{what}: {str(folder)!r} is {_kind(st.st_mode)}, not a folder; choose an output path "
                          "inside a folder")
    if not os.access(folder, os.W_OK):
        raise OutputError(f"{what}: folder {str(folder)!r} is not writable; choose another output path")


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def confined(folder: Path, relative: str | os.PathLike) -> Path:
    """``folder / relative``, refused if the relative part is absolute or climbs out, or if a folder on the way
    is a link out of ``folder``. The last component itself may be a link: it is replaced by a rename, not
    followed."""
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts or "\0" in str(rel):
        raise OutputError(f"{folder}: refusing to write {str(rel)!r}, which is not inside the output folder")
    path = folder / rel
    if not _inside(os.path.realpath(path.parent), os.path.realpath(folder)):
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
