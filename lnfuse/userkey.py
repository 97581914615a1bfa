"""This user's secret key, and the signatures made with it: how lnfuse tells a record it wrote itself (a ledger row,
a staging folder's owner file) from one that came with a download. Every other byte of such a record is a public
function of public files (a model's digest, a folder's name), so only a key the download cannot hold tells them
apart.

The key is 32 random bytes in ``$LNFUSE_KEY_FILE``, else ``$XDG_CONFIG_HOME/lnfuse/key``, else
``~/.config/lnfuse/key``: outside every model and output folder. It is made at first need, readable by this user
only; a key file that is a link, not a regular file, another user's, or readable or writable by others is refused
(anyone who can read it can forge rows, anyone who can replace it can make them)."""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path

from lnfuse.errors import UsageError

KEY_BYTES = 32
ENV = "LNFUSE_KEY_FILE"


class KeyUnavailable(UsageError):
    """There is no key file and none can be made there (a read-only home, no home at all)."""


def key_file() -> Path:
    """Where this user's key is (or will be made)."""
    named = os.environ.get(ENV)
    if named:
        return Path(os.path.abspath(named))
    config = os.environ.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(config):  # the XDG spec: a relative value is ignored
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            raise KeyUnavailable(f"no home folder to keep lnfuse's key in; set {ENV} to a file path lnfuse may "
                                 "create, outside model and output folders")
        config = os.path.join(home, ".config")
    return Path(config) / "lnfuse" / "key"


def user_key() -> bytes:
    """This user's key, made on first use; ``UsageError`` (``KeyUnavailable`` when it cannot be made) otherwise."""
    path = key_file()
    try:
        return _read(path)
    except FileNotFoundError:
        _make(path)
        return _read(path)


def is_key(st: os.stat_result) -> bool:
    """Whether ``st`` is the key file's: a model folder holding it (a run on ``~/.config``) must not read it as
    weights, which would copy the key into an output."""
    try:
        key = os.stat(key_file(), follow_symlinks=False)
    except (OSError, UsageError):
        return False
    return (key.st_dev, key.st_ino) == (st.st_dev, st.st_ino)


def sign(key: bytes, purpose: str, record: dict) -> str:
    """HMAC-SHA256 over ``purpose`` and the canonical JSON of ``record`` (sorted keys, no spaces, ASCII): the same
    for a record read back from its JSON. ``purpose`` keeps a signature of one kind of record from passing for
    another's."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hmac.new(key, purpose.encode() + b"\0" + text.encode(), hashlib.sha256).hexdigest()


def signed(key: bytes, purpose: str, record: dict, signature: object) -> bool:
    """Whether ``signature`` is this key's for ``record``, compared in constant time."""
    try:
        expected = sign(key, purpose, record)
    except (TypeError, ValueError, RecursionError):  # not JSON (a NaN), or nested past any row lnfuse writes
        return False
    return isinstance(signature, str) and hmac.compare_digest(expected, signature)


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ENOTDIR):  # not there (nor its folder): to be made
            raise FileNotFoundError(path) from None
        if error.errno == errno.ELOOP:
            raise UsageError(f"lnfuse's key file {path} is a link; replace it by the file itself (or remove it: "
                             "lnfuse makes a new key, and rows of earlier ledgers run again)") from None
        raise UsageError(f"lnfuse's key file {path} cannot be read ({error.strerror}); fix its permissions or set "
                         f"{ENV}") from None
    try:
        _check(path, os.fstat(fd))
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise UsageError(f"lnfuse's key file {path} holds {len(key)} bytes, not {KEY_BYTES}; remove it (lnfuse makes "
                         "a new one, and rows of earlier ledgers run again)")
    return key


def _check(path: Path, st: os.stat_result) -> None:
    """Refuse a key file others may have read or replaced: with it, they sign records as this user."""
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"lnfuse's key file {path} is not a regular file; remove it (lnfuse makes a new one)")
    if st.st_uid != os.geteuid():
        raise UsageError(f"lnfuse's key file {path} belongs to user {st.st_uid}, not to you; remove it (lnfuse makes "
                         f"a new one) or set {ENV}")
    if st.st_mode & 0o077:
        raise UsageError(f"lnfuse's key file {path} may be read or written by others (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}); run chmod 600 on it, or remove it if others may have "
                         "read it")


def _make(path: Path) -> None:
    """Write a new key beside ``path`` and link it there: the key appears whole or not at all, and of two runs
    making it at once, the first link wins and both read the same key."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        draft = path.parent / f".key.{secrets.token_hex(8)}"
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(draft, path)
        except FileExistsError:
            pass  # another run made it first: that key is the one
        finally:
            os.unlink(draft)
    except OSError as error:
        raise KeyUnavailable(f"cannot make lnfuse's key file {path} ({error.strerror or error}); set {ENV} to a "
                             "file path lnfuse may create, outside model and output folders") from None
