"""From the command line's inputs (files, folders, globs, a list file) to the models to fuse, each with the path
its output takes under the output folder, which mirrors the input tree."""

from __future__ import annotations

import fnmatch
import glob
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from lnfuse.load import trust
from lnfuse.errors import UsageError

#: lnfuse's own temporary folders (``save/staging``) are never inputs
_STAGING = ".lnfuse-tmp"
#: how many folders deep a folder given as input (or a glob's ``**``) is looked into: model zoos nest a few levels
#: (org/model/variant/onnx); a folder nested deeper is refused, not walked (a tree 1,300 deep once ended the run,
#: and one just under that took 35 s to walk before any model ran)
MAX_FOLDER_DEPTH = 64
#: how many files and folders all the folders and ``**`` globs of one run may hold together: a walk of this many
#: takes seconds on a local disk, and a tree larger than this is refused before any model runs
MAX_FOLDER_ENTRIES = 500_000


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
    budget = _Budget()
    for entry in entries:
        path = _absolute(entry)
        _named(path, entry)
        if path.is_dir():
            if _under(_real(path), skipped):
                raise UsageError(f"{entry}: is the output folder {output} (or inside it), whose models are skipped so "
                                 "that outputs never replace inputs; give another -o, or --in-place to rewrite the "
                                 "models where they are")
            found += [(model, path) for model in _walk(path, skipped, budget)]
        elif not path.exists() and glob.has_magic(entry):
            root = _absolute(_fixed_prefix(entry))
            # what the pattern finds below its fixed folder is that folder's: a link out of it is not an input
            # (as in a folder given whole), nor is anything in lnfuse's own temporary folders
            real_root = os.path.realpath(root)
            matches = [m for m in map(_absolute, _glob(entry, budget)) if m.is_file() and not _in_output(m, skipped)
                       and trust.inside(os.path.realpath(m), real_root)
                       and not any(part.endswith(_STAGING) for part in m.parts[len(root.parts):])]
            if not matches:
                raise UsageError(f"{entry}: no file matches; check the pattern (quote it so the shell does not "
                                 "expand it first)")
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


def _named(path: Path, entry: str) -> None:
    """``UsageError`` for an input the system cannot even look up (a name longer than it allows)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        pass  # a missing file stays in the list: its row says so
    except OSError as error:
        shown = entry if len(entry) <= 120 else entry[:60] + "..." + entry[-40:]
        raise UsageError(f"{shown}: cannot be looked up ({error.strerror}); give a shorter path") from None


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


class _Budget:
    """The files and folders the walks of one run may still look at (``MAX_FOLDER_ENTRIES``)."""

    def __init__(self) -> None:
        self.left = MAX_FOLDER_ENTRIES

    def spend(self, count: int, said: str) -> None:
        self.left -= count
        if self.left < 0:
            raise UsageError(f"{said}: more than {MAX_FOLDER_ENTRIES:,} files and folders in the folders to search; "
                             "name the model folders (or a list of models, --from-list) rather than a tree this "
                             "large")


def _walk(folder: Path, output: Path | None, budget: _Budget) -> list[Path]:
    """The ``*.onnx`` files (any case) in ``folder`` at any depth up to ``MAX_FOLDER_DEPTH``, in sorted order,
    without ``output`` or lnfuse's temporary folders."""
    root = os.path.realpath(folder)
    # a link found in the folder is the folder's, not the user's: followed only where it stays inside it
    # ``M.ONNX`` is a model too; a link to nothing is kept, so that its row says so rather than nothing at all
    return [path for path, entry in _files(folder, output, budget, str(folder))
            if entry.name.lower().endswith(".onnx") and (entry.is_file() or _dangling(path))
            and (not entry.is_symlink() or _dangling(path) or (trust.inside(os.path.realpath(path), root)
                                                               and not _in_output(path, output)))]


def _dangling(path: Path) -> bool:
    return path.is_symlink() and not path.exists()


def _files(folder: Path, output: Path | None, budget: _Budget, said: str) -> list[tuple[Path, os.DirEntry]]:
    """Every entry but folders under ``folder``, depth first in sorted order as ``os.walk`` gives them, walked
    with a stack (no recursion) and within the depth and entry bounds. Links to folders are not followed (a link
    loop ends nothing); folders that cannot be read are skipped, as ``os.walk`` skips them."""
    if _under(_real(folder), output):
        return []
    skipped = _identity(output)
    found: list[tuple[Path, os.DirEntry]] = []
    stack: list[tuple[Path, int]] = [(folder, 0)]
    while stack:
        here, depth = stack.pop()
        try:
            with os.scandir(here) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError:
            continue
        budget.spend(len(entries), said)
        folders = []
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                # compared by identity, not by real path: a real path costs a step per folder above it
                if not entry.name.endswith(_STAGING) and _identity(entry) != skipped:
                    folders.append(here / entry.name)
            elif not entry.is_dir():  # a link to a folder is neither walked nor a file
                found.append((here / entry.name, entry))
        if folders and depth == MAX_FOLDER_DEPTH:
            raise UsageError(f"{said}: folders nested more than {MAX_FOLDER_DEPTH} deep in it; lnfuse looks "
                             f"{MAX_FOLDER_DEPTH} levels down at most: name the deeper folder itself")
        stack += [(f, depth + 1) for f in reversed(folders)]
    return found


def _identity(path: os.DirEntry | Path | None) -> tuple[int, int] | None:
    try:
        st = path.stat(follow_symlinks=False) if path is not None else None
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if st is not None else None


def _glob(pattern: str, budget: _Budget) -> list[str]:
    """The files a glob matches, sorted. ``**`` is matched against the bounded walk of the glob's fixed folder
    (glob's own ``**`` recurses once per level, and follows links to folders); other globs have one level per
    component of the pattern."""
    if "**" not in pattern:
        try:
            return sorted(glob.glob(pattern))
        except RecursionError:  # glob recurses once per component of the pattern
            raise UsageError(f"{pattern[:60]}...: a pattern of more components than lnfuse follows; give a shorter "
                             "one, or name the folders") from None
    root = _fixed_prefix(pattern)
    rest = Path(pattern).parts[len(Path(root).parts) if root != "." else 0:]
    return sorted(str(path) for path, _ in _files(Path(root), None, budget, pattern)
                  if _matches(path.relative_to(root).parts, rest))


def _matches(parts: tuple[str, ...], patterns: tuple[str, ...]) -> bool:
    """Whether a relative path matches glob components, ``**`` standing for any number of folders. As glob does,
    a wildcard does not match a hidden name (``.x``) unless the component itself starts with a dot."""
    # reachable[j]: the first i parts matched by the first j components (a table, no recursion)
    reachable = [True] + [False] * len(patterns)
    for j, pat in enumerate(patterns):
        if pat == "**":
            reachable[j + 1] = reachable[j]
    for part in parts:
        hidden = part.startswith(".")
        step = [False] * (len(patterns) + 1)
        for j, pat in enumerate(patterns):
            if pat == "**":
                step[j + 1] = step[j] or (reachable[j + 1] and not hidden)
            elif reachable[j] and (not hidden or pat.startswith(".")) and fnmatch.fnmatchcase(part, pat):
                step[j + 1] = True
        reachable = step
    return reachable[-1]


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
