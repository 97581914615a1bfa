"""Writing several files so that they appear together or not at all.

Each file is written into a hidden temporary folder beside its destination (same file system, so the final
``os.replace`` is atomic), and renamed into place only once every file of the run has been written. A temporary
folder holds a locked owner file for as long as its run lives: a later run removes a folder whose lock is free (its
run was killed) and leaves alone anything it cannot prove is such a folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from lnfuse.load import trust

#: short and fixed-length, so a temporary folder fits beside an output of any valid name (a 255-byte file name)
_FOLDER = re.compile(r"^\.[0-9a-f]{12}\.lnfuse-tmp$")
_OWNER = ".lnfuse-owner"
_OWNER_TEXT = b"lnfuse staging folder\n"


class Staging:
    """Temporary folders, one per destination folder, whose files are renamed into place by ``commit``."""

    def __init__(self) -> None:
        self._areas: dict[str, tuple[Path, Path, int | None]] = {}  # real destination folder -> (folder, temp, lock fd)

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def area(self, folder: Path) -> Path:
        """The temporary folder whose files go to ``folder`` (made on first use, after removing dead runs'
        leftovers there)."""
        key = os.path.realpath(folder)
        if key not in self._areas:
            remove_stale(folder)
            temp = folder / f".{secrets.token_hex(6)}.lnfuse-tmp"
            # known before it exists, so that a Ctrl-C at any point still has it removed by close()
            self._areas[key] = (folder, temp, None)
            os.mkdir(temp, 0o700)
            fd = os.open(temp / _OWNER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            self._areas[key] = (folder, temp, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, _OWNER_TEXT)
        return self._areas[key][1]

    def commit(self, last: Path) -> None:
        """Rename every staged file to its destination; ``last`` (the model, which names the others) goes last."""
        moves = []
        for folder, temp, _ in self._areas.values():
            for file in sorted(p for p in temp.rglob("*") if p.is_file() and p != temp / _OWNER):
                moves.append((file, trust.confined(folder, file.relative_to(temp))))
        moves.sort(key=lambda move: os.path.realpath(move[1]) == os.path.realpath(last))
        for _, final in moves:
            # checked before the run wrote anything; again here, since the rename is what would replace a
            # device or FIFO put there meanwhile, and before the first rename, so that a refusal renames nothing
            trust.check_destination(final)
            final.parent.mkdir(parents=True, exist_ok=True)
        for file, final in moves:
            trust.confined(final.parent, final.name)  # a folder made a link meanwhile is still caught
            trust.check_destination(final)
            os.replace(file, final)

    def close(self) -> None:
        for _, temp, fd in self._areas.values():
            with contextlib.suppress(OSError):
                shutil.rmtree(temp)
            if fd is not None:
                os.close(fd)
        self._areas.clear()


def remove_stale(folder: Path) -> None:
    """Remove temporary folders of runs that died without cleaning up (SIGKILL, power loss): only folders named as
    lnfuse names them, owned by this user, holding lnfuse's owner file, whose lock no live run holds."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if not _FOLDER.match(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        with contextlib.suppress(OSError):
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            fd = _open_owner(os.path.join(entry.path, _OWNER))
            if fd is None:
                continue
            try:
                if os.read(fd, len(_OWNER_TEXT)) != _OWNER_TEXT:
                    continue
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its run is alive
                shutil.rmtree(entry.path)
            finally:
                os.close(fd)


def _open_owner(path: str) -> int | None:
    """The owner file of a folder that may be a dead run's, open for reading; None if it is anything but a regular
    file. The folder may come from anywhere (unpacked with the model): opening a FIFO for reading blocks until a
    writer comes, forever, and opening a device can act on it, so nothing but a regular file is opened, and that
    without following a link or waiting (the fstat catches a swap between the lstat and the open)."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd
