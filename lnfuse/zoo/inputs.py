"""From the command line's inputs (files, folders, globs, a list file) to the models to fuse, each with the path
its output takes under the output folder, which mirrors the input tree."""

from __future__ import annotations

import glob
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from lnfuse.load import trust
from lnfuse.errors import UsageError

#: lnfuse's own temporary folders (``io.save``'s staging) are never inputs
_STAGING = ".lnfuse-tmp"


@dataclass(frozen=True)
class Model:
    """One model to fuse: where it is, and its path relative to the root of the inputs (mirrored under -o)."""

    path: Path
    relative: Path


def expand(arguments: list[str], from_list: str | None, output: Path, *, exclude: bool = True) -> list[Model]:
    """Every model the arguments name, once each, in a stable order. A folder gives its ``*.onnx`` files at any
    depth (links to folders are not followed; the output folder is skipped, so that a rerun does not fuse its own
    outputs); a glob gives the files it matches; a file is taken whatever its name. A path that does not exist
    stays in the list: its row says so, as for any other bad input. ``exclude=False`` (--in-place, where the
    outputs are the inputs) keeps the output folder in."""
    entries = list(arguments)
    if from_list is not None:
        entries += _listed(from_list)
    # compared by real path: a link to the output folder (or into it) is the output folder
    skipped = Path(os.path.realpath(output)) if exclude else None
    found: list[tuple[Path, Path]] = []  # (model, the folder its argument is rooted at)
    for entry in entries:
        path = _absolute(entry)
        if path.is_dir():
            found += [(model, path) for model in _walk(path, skipped)]
        elif not path.exists() and glob.has_magic(entry):
            matches = [_absolute(m) for m in sorted(glob.glob(entry, recursive=True))]
            matches = [m for m in matches if m.is_file() and not _in_output(m, skipped) and _STAGING not in str(m)]
            if not matches:
                raise UsageError(f"{entry}: no file matches; check the pattern (quote it so the shell does not "
                                 "expand it first)")
            root = _absolute(_fixed_prefix(entry))
            found += [(m, root) for m in matches]
        else:
            if _in_output(path, skipped):
                raise UsageError(f"{entry}: is inside the output folder {output}, where the outputs could replace it "
                                 "or its data; choose another -o, or --in-place to rewrite the models where they are")
            found.append((path, path.parent))
    if not found:
        raise UsageError("no .onnx file in the inputs; give model files, folders holding them, or globs")
    root = Path(os.path.commonpath([str(r) for _, r in found]))
    models, seen = [], set()
    for path, _ in found:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            models.append(Model(path, path.relative_to(root)))
    return models


#: a list of paths longer than this is not a list of models
_LIST_BYTES = 64 << 20


def _listed(from_list: str) -> list[str]:
    """The paths a list file names: a regular file (a FIFO would block, a device never end), of text, no NUL."""
    said = f"--from-list {from_list}"
    try:
        fd = os.open(from_list, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as stream:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UsageError(f"{said}: not a regular file; give a text file, one path a line")
            data = stream.read(_LIST_BYTES + 1)
        text = data.decode()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"{said}: cannot read it ({error}); give a text file, one path a line") from None
    if len(data) > _LIST_BYTES or "\0" in text:
        raise UsageError(f"{said}: not a list of paths (over {_LIST_BYTES >> 20} MiB, or a NUL byte); give a text "
                         "file, one path a line")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def _walk(folder: Path, output: Path | None) -> list[Path]:
    models, root = [], os.path.realpath(folder)
    for where, folders, files in os.walk(folder):  # followlinks=False: a link loop in a model folder ends nothing
        here = Path(where)
        folders[:] = sorted(f for f in folders if not f.endswith(_STAGING) and not _under(_real(here / f), output))
        # a link found in the folder is the folder's, not the user's: followed only where it stays inside it
        models += [here / f for f in sorted(files) if f.endswith(".onnx") and (here / f).is_file()
                   and (not (here / f).is_symlink() or trust.inside(os.path.realpath(here / f), root))
                   and not _in_output(here / f, output)]
    return models


def _absolute(entry: str) -> Path:
    """``entry`` as an absolute path to the file the kernel opens: a ``..`` after a link leads out of the link's
    target, not back beside the link, so such a path's folder is resolved rather than shortened as text."""
    joined = os.path.join(os.getcwd(), entry)
    if ".." not in Path(joined).parts:
        return Path(os.path.normpath(joined))
    head, tail = os.path.split(joined.rstrip(os.sep))
    return Path(os.path.realpath(joined)) if tail in ("", "..") else Path(os.path.realpath(head)) / tail


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _in_output(model: Path, output: Path | None) -> bool:
    """Whether a model file, or the folder its data files are read from (beside the name given, which may be a
    link), lies in the output folder: outputs and their kept data could replace it."""
    return _under(_real(model), output) or _under(_real(model.parent), output)


def _under(path: Path, folder: Path | None) -> bool:
    return folder is not None and (path == folder or folder in path.parents)


def _fixed_prefix(pattern: str) -> str:
    """The folder part of a glob before its first wildcard: ``zoo/a/*/m.onnx`` is rooted at ``zoo/a``."""
    parts = Path(pattern).parts
    fixed: list[str] = []
    for part in parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return str(Path(*fixed)) if fixed else "."
