"""The run's ledger: JSON Lines, one row per finished model, appended and flushed to disk as each finishes, so
that a run killed at any point (Ctrl-C, SIGKILL, a lost machine) loses no finished result; and which models a
rerun can skip.

Every row is signed with this user's key (``lnfuse.userkey``): the ledger may sit in a folder that came with a
download (``--in-place``, an ``-o`` inside the downloaded folder), and every other field of a row (digests, stat
keys, paths) can be computed or guessed from public files. A row whose signature does not check is ignored (its
model runs again), and counted (``unsigned``) for one warning."""

from __future__ import annotations

import errno
import io
import json
import os
import stat
from pathlib import Path
from typing import Iterator

from lnfuse import userkey
from lnfuse.errors import UsageError
from lnfuse.load.trust import untrusted_json
from lnfuse.zoo.identity import IDENTITY, unchanged
from lnfuse.zoo.job import Job

#: failures that depend on the limits: a rerun with other limits tries the model again
LIMITED = ("timeout", "over memory")
#: failures of the run rather than of the model: a rerun tries the model again
RETRIED = ("worker died",)
#: what a row's signature is for (a staging owner file's signature cannot pass for one)
_PURPOSE = "lnfuse ledger row 1"
#: the field holding a row's signature, over every other field
SIGNATURE = "signature"


#: the fields a row must have, with their types, to be read: a row of another shape (hand-edited, of another
#: version) is ignored and its model runs again
_FIELDS = {"input": str, "model": str, "status": str, "exit": int, "reason": str, "fused": dict, "refused": int,
           "seconds": (int, float), "bytes_in": int, "bytes_out": int}


def _valid(row) -> bool:
    return isinstance(row, dict) and all(isinstance(row.get(k), t) and not isinstance(row.get(k), bool)
                                         for k, t in _FIELDS.items()) \
        and row["exit"] in (0, 1, 2, 3) and all(isinstance(v, int) for v in row["fused"].values())


def _known(identity) -> bool:
    """Whether ``identity`` (a row, or its ``output_identity``) records a content digest and the data files it
    covers."""
    if not isinstance(identity, dict):
        return False
    names = identity.get("data_files")
    return isinstance(names, list) and all(isinstance(n, str) for n in names) and \
        isinstance(identity.get("sha256"), str)


class Ledger:
    def __init__(self, path: Path):
        self.path = path
        if not path.parent.is_dir():
            raise UsageError(f"--ledger {path}: folder '{path.parent}' does not exist; create it first")
        self._key = userkey.user_key()
        self.unsigned = 0  # rows read whose signature is not this user's key's: ignored
        self.rows = self._read()
        # opened for appending now: a ledger that cannot be written stops the run before any model is written
        self._file = self._open(os.O_RDWR | os.O_APPEND | os.O_CREAT)
        self._appended = False

    def _read(self) -> dict[str, dict]:
        """The last row of each input. A line cut short by a kill mid-write (the last one) is ignored. Read a line at
        a time, each at most ``_MAX_LINE`` bytes: a ledger may come with a download, and only rows signed with this
        user's key are kept, so memory never grows with what someone else wrote."""
        rows: dict[str, dict] = {}
        try:
            with self._open(os.O_RDONLY) as stream:
                size = os.fstat(stream.fileno()).st_size
                if size > _MAX_LEDGER:
                    raise UsageError(f"--ledger {self.path}: {size} bytes, more than a ledger of a million models "
                                     f"({_MAX_LEDGER >> 30} GiB); it is not lnfuse's: give another file or remove it")
                for line in _lines(io.BufferedReader(stream, 1 << 16)):
                    row = _parsed(line)
                    if row is None:
                        continue
                    if not self._signed(row):
                        self.unsigned += 1
                    elif _valid(row):
                        rows[row["input"]] = row
        except FileNotFoundError:
            return rows
        except OSError as error:
            raise UsageError(f"--ledger {self.path}: cannot read it ({error}); give another file or remove it")\
                from None
        return rows

    def _signed(self, row) -> bool:
        if not isinstance(row, dict):
            return False
        fields = {k: v for k, v in row.items() if k != SIGNATURE}
        return userkey.signed(self._key, _PURPOSE, fields, row.get(SIGNATURE))

    def finished(self, job: Job, version: str, limits: dict) -> tuple[dict | None, bool]:
        """The row of a previous run this job need not repeat, and whether it still stands: (row, True) when the
        model and the data files that row read have the stat keys it recorded (no byte is read for it); (row,
        False) when the row would stand but a stat key changed, so a worker must compare the content hashes first
        (``job.run`` with ``resume``); (None, False) when the model runs again: another lnfuse or library
        version, other options, another or a missing output, an output whose digest the row does not record, a
        failure of the run (``worker died``), a failure the limits decide under other limits, or a row whose
        content is not known. The output's stat keys count as the model's do: an output replaced since is
        hashed again, and kept only if its bytes are the ones the row recorded."""
        row = self.rows.get(job.source)
        if row is None or row.get("lnfuse") != version or row.get("options") != job.key_options() or \
                row.get("identity") != IDENTITY:
            return None, False
        if row.get("status") in RETRIED or (row.get("status") in LIMITED and row.get("limits") != limits):
            return None, False
        output = row.get("output")
        if output is not None and (output != job.output or not Path(output).exists() or
                                   not _known(row.get("output_identity"))):
            return None, False  # an output whose bytes the row does not record is never kept
        if not _known(row):
            return None, False
        return row, unchanged(Path(job.source), row) and \
            (output is None or unchanged(Path(output), row["output_identity"]))

    def append(self, row: dict) -> None:
        """One line, signed, written whole and pushed to disk before the next model's row."""
        if not self._appended:
            self._appended = True
            end = self._file.seek(0, os.SEEK_END)
            if end and os.pread(self._file.fileno(), 1, end - 1) != b"\n":
                self._file.write(b"\n")  # end the line a kill cut short, so that this row starts its own
        row = {k: v for k, v in row.items() if k != SIGNATURE}
        row[SIGNATURE] = userkey.sign(self._key, _PURPOSE, row)
        line = memoryview((json.dumps(row, sort_keys=True) + "\n").encode())
        while line:
            line = line[self._file.write(line):]
        os.fsync(self._file.fileno())
        self.rows[row["input"]] = row

    def _open(self, flags: int):
        """The ledger file itself: never through a link (rows would land outside the output folder), never a FIFO
        or device (a read would block, a write go elsewhere)."""
        try:
            fd = os.open(self.path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UsageError(f"--ledger {self.path}: is a link; give the ledger's own path, or remove the link")\
                    from None
            if error.errno == errno.ENOENT and not flags & os.O_CREAT:
                raise  # no ledger yet: nothing to read
            raise UsageError(f"--ledger {self.path}: cannot open it ({error.strerror}); give a file lnfuse may "
                             "write") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UsageError(f"--ledger {self.path}: is not a regular file; give another path or remove it")
        return os.fdopen(fd, "rb" if flags == os.O_RDONLY else "r+b", buffering=0)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


#: a row is under a few KB (its reason is cut at 300 characters); a longer line is not one lnfuse wrote
_MAX_LINE = 1 << 20
#: over a million models' rows
_MAX_LEDGER = 4 << 30


def _lines(stream) -> Iterator[bytes | None]:
    """The ledger's lines, each at most ``_MAX_LINE`` bytes; None for a longer one (its bytes are skipped)."""
    while True:
        line = stream.readline(_MAX_LINE + 1)
        if not line:
            return
        if len(line) <= _MAX_LINE or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = stream.readline(_MAX_LINE)
        yield None


def _parsed(line: bytes | None) -> dict | None:
    if line is None:
        return None
    try:
        row = untrusted_json(line.decode())
    except UnicodeDecodeError:
        return None
    if row is None:
        return None
    return row if isinstance(row, dict) else {}
