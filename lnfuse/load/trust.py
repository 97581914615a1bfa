"""The trust boundary's shared checks: a model folder is untrusted input, the command line is trusted.

What a model asks to read is admitted by ``lnfuse.load.gate`` (the only reader of a model folder). On the way out,
lnfuse never writes through a link out of the output folder and never writes over a file it reads (compared by
device and inode, not by name).
"""

from __future__ import annotations

import math
import json
import os
import stat
from pathlib import Path

from lnfuse.errors import InputError, OutputError


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


def untrusted_json(text: str | bytes | None) -> object:
    """JSON that came with a download (an owner file, a ledger row, a model's metadata): None for anything that is
    not JSON, a structure nested too deep for the parser included (a few kilobytes of ``[`` overflow it)."""
    if not text:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
