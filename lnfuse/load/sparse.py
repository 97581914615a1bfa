"""Where a file holds data: a sparse file (a weight file written by seeking past zeros, or copied by ``cp``) has
holes that read as zeros and take no disk, and neither copying nor hashing it need touch them."""

from __future__ import annotations

import errno
import os
from typing import Iterator

from lnfuse.errors import InputError


def data_runs(fd: int, size: int, begin: int = 0) -> Iterator[tuple[int, int]]:
    """The (start, end) ranges of bytes ``begin`` to ``size`` that may hold data, in order; everything between them
    is a hole. Where the system or filesystem cannot tell (no ``SEEK_DATA``), one range: all of it."""
    offset = begin
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
            end = os.lseek(fd, start, os.SEEK_HOLE)
        except (AttributeError, OSError) as error:
            if isinstance(error, OSError) and error.errno == errno.ENXIO:  # no data past offset: the rest is a hole
                return
            if isinstance(error, OSError) and error.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            start, end = offset, size
        if start < offset or end <= start:  # an answer that does not move forward (a FUSE or NFS server's): no map
            start, end = offset, size
        if start >= size:
            return
        end = min(end, size)
        yield start, end
        offset = end


def holes_told(fd: int) -> bool:
    """Whether the system and filesystem say where ``fd``'s holes are (``SEEK_HOLE`` works)."""
    try:
        os.lseek(fd, 0, os.SEEK_HOLE)
    except (AttributeError, OSError):
        return False
    return True


def data_blocks(fd: int, size: int, block: int) -> Iterator[tuple[int, bytes]]:
    """(index, bytes) of each ``block``-sized block of the first ``size`` bytes that holds a byte other than zero,
    in order. Only blocks that hold data on disk (``data_runs``) are read; a file that got shorter meanwhile is an
    ``InputError`` (what a hole read past a new end gives is no hole)."""
    zero, unread = bytes(block), 0
    for start, end in data_runs(fd, size):
        last = (end - 1) // block
        for index in range(max(unread, start // block), last + 1):
            length = min(block, size - index * block)
            chunk = os.pread(fd, length, index * block)
            if len(chunk) < length:
                raise _shorter()
            if chunk != zero[:length]:
                yield index, chunk
        unread = max(unread, last + 1)
    if os.fstat(fd).st_size < size:
        raise _shorter()


def _shorter() -> InputError:
    return InputError("a data file got shorter while lnfuse read it; run lnfuse again on a folder nothing else is "
                      "changing")
