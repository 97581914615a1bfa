"""Writing several files so that they appear together or not at all.

Each file is written into a hidden temporary folder beside its destination (same file system, so the final
``os.replace`` is atomic), and renamed into place only once every file of the run has been written. A temporary
folder holds a locked owner file for as long as its run lives. The owner file says which run made the folder
(machine, boot, process and its start time, the folder's name and inode), signed with this user's key
(``lnfuse.userkey``): a later run removes a folder only if that signature checks, the run it names is gone and the
lock is free. A folder's name and an owner file's text can come with a download; the signature cannot.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import stat
from pathlib import Path

from lnfuse import userkey
from lnfuse.load import trust

#: short and fixed-length, so a temporary folder fits beside an output of any valid name (a 255-byte file name)
_FOLDER = re.compile(r"^\.[0-9a-f]{12}\.lnfuse-tmp$")
_OWNER = ".lnfuse-owner"
#: what an owner file's signature is for (a ledger row's signature cannot pass for one)
_PURPOSE = "lnfuse staging owner 1"
#: an owner file lnfuse writes is a few hundred bytes; a larger one is not lnfuse's, and is not read whole
_OWNER_MAX = 4096


class Staging:
    """Temporary folders, one per destination folder, whose files are renamed into place by ``commit``."""

    def __init__(self, reads: set[tuple[int, int]] = frozenset()) -> None:
        """``reads``: (device, inode) of every file the run reads; a dead run's folder holding one is kept."""
        self._areas: dict[str, tuple[Path, Path, int | None]] = {}  # real destination folder -> (folder, temp, lock fd)
        self._reads = reads

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def area(self, folder: Path) -> Path:
        """The temporary folder whose files go to ``folder`` (made on first use, after removing dead runs'
        leftovers there)."""
        key = os.path.realpath(folder)
        if key not in self._areas:
            secret = _key()
            if secret is not None:
                remove_stale(folder, secret, self._reads)
            while True:
                temp = folder / f".{secrets.token_hex(6)}.lnfuse-tmp"
                # known before it exists, so that a Ctrl-C at any point still has it removed by close()
                self._areas[key] = (folder, temp, None)
                try:
                    os.mkdir(temp, 0o700)
                    break
                except FileExistsError:  # a folder of that name is another's: never this run's to remove
                    del self._areas[key]
            fd = os.open(temp / _OWNER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            self._areas[key] = (folder, temp, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
            _write_all(fd, _owner_text(temp, secret))
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


def remove_stale(folder: Path, key: bytes, reads: set[tuple[int, int]] = frozenset()) -> None:
    """Remove temporary folders of this user's runs on this machine that died without cleaning up (SIGKILL, power
    loss): only a folder named as lnfuse names them, owned by this user, whose owner file is signed with ``key`` for
    this very folder, whose run is gone, whose lock no live process holds, and that holds none of the files this run
    reads (``reads``: device and inode). Anything else is left alone."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if not _FOLDER.match(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        with contextlib.suppress(OSError):
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != os.getuid():
                continue
            fd = _open_owner(os.path.join(entry.path, _OWNER))
            if fd is None:
                continue
            try:
                record = _signed_record(fd, key)
                if record is None or not _names(record, entry.name, st) or not _dead(record) \
                        or _holds(entry.path, reads):
                    continue
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its run is alive
                shutil.rmtree(entry.path)
            finally:
                os.close(fd)


def _holds(path: str, reads: set[tuple[int, int]]) -> bool:
    """Whether the folder ``path`` holds (at any depth, links not followed) a file of ``reads``."""
    if not reads:
        return False
    for root, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) in reads:
                return True
    return False


def _key() -> bytes | None:
    """This user's key; None when none can be made (a read-only home): the folder is then written with an unsigned
    owner file, which no later run removes. A key file that is there but unsafe is refused (``UsageError``)."""
    try:
        return userkey.user_key()
    except userkey.KeyUnavailable:
        return None


def _owner_text(temp: Path, key: bytes | None) -> bytes:
    """The owner file of the folder ``temp`` this process just made: which run made it, signed."""
    st = os.lstat(temp)
    record = {"folder": temp.name, "inode": [st.st_dev, st.st_ino], **_this_run()}
    if key is not None:
        record["signature"] = userkey.sign(key, _PURPOSE, record)
    return (json.dumps(record, sort_keys=True) + "\n").encode()


def _this_run() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": pid, "start": _started(pid)}


def _signed_record(fd: int, key: bytes) -> dict | None:
    """The owner file's record if its signature is ``key``'s, else None."""
    text = os.read(fd, _OWNER_MAX + 1)
    if len(text) > _OWNER_MAX:
        return None
    record = trust.untrusted_json(text)
    if not isinstance(record, dict):
        return None
    signature = record.pop("signature", None)
    return record if userkey.signed(key, _PURPOSE, record, signature) else None


def _names(record: dict, name: str, st: os.stat_result) -> bool:
    """Whether the record was written for this folder: its name and inode (an owner file copied into another
    folder, or a folder copied whole, is not the one its run made)."""
    return record.get("folder") == name and record.get("inode") == [st.st_dev, st.st_ino]


def _dead(record: dict) -> bool:
    """Whether the run that wrote ``record`` is gone: a run of this machine, which has restarted since, or whose
    process is gone or is another one now (the pid taken again: another start time). A run of another machine
    (a shared file system) may be alive: kept."""
    if record.get("host") != socket.gethostname():
        return False
    if record.get("boot") != _boot_id():
        return True
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    started = _started(pid)
    return started is None or started != record.get("start")


def _boot_id() -> str:
    """This boot of this machine (Linux); "" where it cannot be told."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), None if there is no such process; -1 where
    it cannot be told (no /proc): then a process of that pid counts as the run."""
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        if os.path.isdir("/proc/self"):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return -1
    # the second field is the command in parentheses, which may hold spaces and ")": split after the last ")";
    # start time is field 22, the 20th after it
    return int(text.rsplit(b")", 1)[1].split()[19])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


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
