"""Where a file holds data: a sparse file (a weight file written by seeking past zeros, or copied by ``cp``) has
holes that read as zeros and take no disk, and neither copying nor hashing it need touch them."""

from __future__ import annotations

import errno
import os
from typing import Iterator


def data_runs(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """The (start, end) ranges of the first ``size`` bytes that may hold data, in order; everything between them is
    a hole. Where the system or filesystem cannot tell (no ``SEEK_DATA``), one range: all of it."""
    offset = 0
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
