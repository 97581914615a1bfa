"""A model's identity for resuming: what the ledger records of the files a model read, and the cheap check a rerun
makes before trusting a row.

Two keys per file (the model and each data file it read): a sha256 of its bytes, and its stat key (inode, size,
mtime_ns, ctime_ns) taken from the open file before it is hashed. A rerun compares stat keys only, in the driver:
metadata, no byte of a model is read there. Only a model whose stat keys changed is hashed again, in a worker, and
only a different hash runs it again (a model copied back over itself is not fused twice). ctime cannot be set by a
user (``touch -d`` and ``cp -p`` set mtime, not ctime), so a file rewritten with its size and mtime restored still
shows as changed. The device number is left out: the same file on NFS has another one on every node of a cluster.

Every data file is hashed through the model folder's gate (``Gate.admit_file``, ``Gate.open``), with the admission
a load makes: inside the folder, links followed; a regular file of one link; opened without following links or
blocking. A model folder changed into something hostile after the first run is never read outside the gate.

A data file is hashed as 1 MiB blocks with each run of all-zero blocks written as its length (``_hash_data``): the
holes of a sparse file (``load.sparse``) are then never read, and the same bytes give the same digest whether their
zeros are holes on disk or written out."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from lnfuse.errors import InputError, LnfuseError
from lnfuse.load.sparse import data_blocks

#: the form of the identity a row records (data files named as the model names them, content digest by blocks): a
#: row of another form is not trusted, its model runs again
IDENTITY = 2
#: the stat fields of a file's key; see the module's docstring for why not st_dev
_KEY = ("st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")
_CHUNK = 1 << 20  # reads of a model file
#: a data file's digest is taken over blocks of this size: part of the ledger's format (another size would make
#: every touched model with data files run again on a rerun)
_BLOCK = 1 << 20


def stat_key(st: os.stat_result) -> list[int]:
    return [getattr(st, name) for name in _KEY]


@dataclass
class ModelIdentity:
    """The model file hashed (its bytes, before anything parses them); data files are added by ``complete``."""

    path: Path
    prefix: hashlib._Hash  # sha256 over b"\\0" + the model's bytes: the digest's start, whatever data files follow
    key: list[int]
    #: digests already taken, by data files: a resumed model whose hash was compared before it was fused again
    #: with the same data files is not hashed twice
    _taken: dict[tuple[str, ...], tuple[str, list[list]]] = field(default_factory=dict)

    def early(self) -> dict:
        """The row's identity fields while the data files it reads are not known yet (sent before fusing, for the
        row of a model whose worker is stopped)."""
        return {"sha256": None, "data_files": None, "stat": [["", *self.key]], "bytes_in": self.key[1]}

    def complete(self, data_files: list[str] | None, admitted: dict[str, list[int]] | None = None) -> dict:
        """The row's identity fields: the hash of the model and of ``data_files`` (relative to its folder), read
        through the folder's gate. Unknown (None) when the data files are not known, one is no longer admitted, one
        is not the file ``admitted`` says the fuse read (its stat key then), or the model file was written to since
        it was hashed: such a row is never taken as finished by a rerun, which fuses the model again."""
        if data_files is None:
            return self.early()
        try:
            digest, keys = self.digest(data_files)
        except (LnfuseError, OSError):  # refused by the gate, or gone or unreadable since it was admitted
            return self.early()
        if admitted is not None and any(admitted.get(name) != key for name, *key in keys[1:]):
            return self.early()  # written to between the fuse's read and this hash: the hash is not what was fused
        try:
            if stat_key(os.stat(self.path)) != self.key:
                return self.early()  # the model file was written to since it was hashed: maybe before it was read
        except OSError:
            return self.early()
        return {"sha256": digest, "data_files": list(data_files), "stat": keys,
                "bytes_in": sum(key[2] for key in keys)}

    def digest(self, data_files: list[str]) -> tuple[str, list[list]]:
        """(sha256, stat keys named "" for the model and by location for the data files), or ``InputError`` when
        the gate refuses a data file."""
        from lnfuse.load.gate import Gate  # in a worker only: the driver compares stat keys, it never hashes

        if tuple(data_files) in self._taken:
            return self._taken[tuple(data_files)]
        digest, keys = self.prefix.copy(), [["", *self.key]]
        gate = Gate(self.path.parent, str(self.path))
        for name in data_files:
            gate.admit_file(name)
            with gate.open(name) as stream:
                st = os.fstat(stream.fileno())
                keys.append([name, *stat_key(st)])
                digest.update(name.encode() + b"\0")
                _hash_data(digest, stream.fileno(), st.st_size)
                if stat_key(os.fstat(stream.fileno())) != keys[-1][1:]:
                    raise InputError(f"{name}: written to while lnfuse hashed it; run lnfuse again on a folder "
                                     "nothing else is changing")
        self._taken[tuple(data_files)] = digest.hexdigest(), keys
        return self._taken[tuple(data_files)]


def _hash_data(digest: hashlib._Hash, fd: int, size: int) -> None:
    """The first ``size`` bytes of ``fd`` into ``digest``: the size, then block by block ``D`` and the block's
    bytes, or ``Z`` and the count of a run of all-zero blocks (a run is always whole, so the encoding is one per
    content). Only the blocks that hold data on disk are read."""
    digest.update(size.to_bytes(8, "little"))
    following = 0  # the block after the last one written
    for index, chunk in data_blocks(fd, size, _BLOCK):
        if index > following:
            digest.update(b"Z" + (index - following).to_bytes(8, "little"))
        digest.update(b"D")
        digest.update(chunk)
        following = index + 1
    if -(-size // _BLOCK) > following:
        digest.update(b"Z" + (-(-size // _BLOCK) - following).to_bytes(8, "little"))


def of_model(path: Path) -> ModelIdentity:
    """Hash the model file the user named (a link is fine: it is the user's, as for ``io.read_proto``); never
    blocking on a FIFO named as a model."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; check the path") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not an ONNX file") from None
    except OSError as error:
        raise InputError(f"{path}: cannot be read ({error.strerror}); check its permissions") from None
    with os.fdopen(fd, "rb") as stream:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: not a regular file; give an ONNX file")
        # the model's name in the digest is "" (data files are named), and its size says where its bytes end
        digest = hashlib.sha256(b"\0" + st.st_size.to_bytes(8, "little"))
        left = st.st_size
        while left and (chunk := stream.read(min(_CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
        if left:
            raise InputError(f"{path}: the file got shorter while lnfuse read it; run lnfuse again on a folder "
                             "nothing else is changing")
    return ModelIdentity(path, digest, stat_key(st))


def unchanged(source: Path, row: dict) -> bool:
    """Whether the model and every data file ``row`` read still have the stat keys it recorded: metadata only (the
    driver reads no byte of a model). False when the row has no keys (an older ledger, unknown data files)."""
    keys, names = row.get("stat"), row.get("data_files")
    if not isinstance(keys, list) or not isinstance(names, list) or \
            [k[0] if isinstance(k, list) and k else None for k in keys] != ["", *names]:
        return False
    folder = os.path.realpath(source.parent)  # data files are named relative to the real folder, as the gate does
    for name, *key in keys:
        try:
            st = os.stat(source if not name else os.path.join(folder, name))
        except (OSError, ValueError):
            return False
        if stat_key(st) != key:
            return False
    return True
