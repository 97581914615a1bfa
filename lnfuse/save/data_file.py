"""The one data file an output's weights go to: ``<output>.data``, named from the output the user named.

A model names its data files itself, and those names are data, never paths lnfuse writes: copied under their own
names they replaced ``.git/config`` or ``.bashrc`` beside the output. So every external weight that cannot be
referenced where it lies is copied into this one file. Each data file is copied once per range of it that some
tensor uses (overlapping and repeated ranges, and one file named through several links, are merged), so the bytes
written never exceed the bytes the model reads; holes in a sparse file stay holes.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from lnfuse.errors import InputError
from lnfuse.load.gate import GatedTensor
from lnfuse.load.sparse import data_runs, holes_told

#: a range keeps its place within a page, so a tensor aligned in the input file is aligned in the output's
_PAGE = 4096
_CHUNK = 1 << 20


@dataclass(frozen=True)
class _Span:
    """A merged range of one input data file: ``[start, end)`` of the file the tensor ``reader`` reads."""

    reader: GatedTensor
    start: int
    end: int


def write(path: Path, externals: list[GatedTensor], inline: list[ir.TensorProtocol]) -> dict[int, int]:
    """Create ``path`` (a new file: it is staged, never an existing one) holding the bytes of every tensor given;
    returns each tensor's offset in it, keyed by ``id(tensor)``."""
    offsets: dict[int, int] = {}
    with open(path, "xb", buffering=0) as out:
        end = 0
        for span, tensors in _spans(externals):
            at = _aligned(end, span.start % _PAGE)
            _copy_span(span, out, at)
            for tensor in tensors:
                offsets[id(tensor)] = at + (tensor.offset or 0) - span.start
            end = at + span.end - span.start
        for tensor in inline:
            if id(tensor) in offsets:
                continue
            data = tensor.tobytes()
            offsets[id(tensor)] = at = _aligned(end, 0)
            out.seek(at)
            write_all(out, data)
            end = at + len(data)
        out.truncate(end)
    return offsets


def _spans(externals: list[GatedTensor]) -> list[tuple[_Span, list[GatedTensor]]]:
    """The external tensors grouped by the ranges of their files they read, overlapping ranges merged."""
    by_file: dict[tuple[int, int], list[GatedTensor]] = defaultdict(list)
    for tensor in externals:
        by_file[tensor.gate.identity(str(tensor.location))].append(tensor)
    spans = []
    for tensors in by_file.values():
        tensors.sort(key=lambda t: t.offset or 0)
        current: list[GatedTensor] = []
        start = end = -1
        for tensor in tensors:
            offset = tensor.offset or 0
            if current and offset > end:
                spans.append((_Span(current[0], start, end), current))
                current = []
            if not current:
                start, end = offset, offset
            current.append(tensor)
            end = max(end, offset + (tensor.length or tensor.nbytes))
        if current:
            spans.append((_Span(current[0], start, end), current))
    return spans


def _aligned(end: int, phase: int) -> int:
    """The first offset at or after ``end`` with ``offset % _PAGE == phase``."""
    return end + (phase - end) % _PAGE


def _copy_span(span: _Span, out, at: int) -> None:
    """Bytes ``span.start..span.end`` of the span's file to ``at`` in ``out``, through the gate that admitted the
    file; holes are skipped (the output file reads zeros there too)."""
    with span.reader.gate.open(str(span.reader.location)) as source:
        fd = source.fileno()
        if os.fstat(fd).st_blocks * 512 < os.fstat(fd).st_size and not holes_told(fd):
            # a sparse file on a filesystem that cannot say where its holes are: what reads as zeros is skipped,
            # as cp --sparse=auto does, rather than written out
            _copy_nonzero(fd, out, span, at)
            return
        for start, end in data_runs(fd, span.end, span.start):
            out.seek(at + start - span.start)
            copy_range(source, out, start, end - start)
        if os.fstat(fd).st_size < span.end:  # a hole read past a new end is no hole: the file got shorter
            raise _shorter()


def _copy_nonzero(fd: int, out, span: _Span, at: int) -> None:
    for start in range(span.start, span.end, _CHUNK):
        length = min(_CHUNK, span.end - start)
        chunk = os.pread(fd, length, start)
        if len(chunk) < length:
            raise _shorter()
        if chunk.count(0) != length:
            out.seek(at + start - span.start)
            write_all(out, chunk)


def copy_range(source, out, offset: int, length: int) -> None:
    """``length`` bytes of ``source`` from ``offset`` to where ``out`` stands, inside the kernel where it can (nothing
    passes through this process), else read and written."""
    while length:
        try:
            # 64 MiB a call: a signal (Ctrl-C, SIGTERM) is handled between calls, and one call of gigabytes
            # can take longer than the grace a stopped worker has to clean up
            copied = os.copy_file_range(source.fileno(), out.fileno(), min(length, 1 << 26), offset)
        except (AttributeError, OSError):
            copied = 0
        if not copied:
            chunk = os.pread(source.fileno(), min(length, _CHUNK), offset)
            if not chunk:
                raise _shorter()
            write_all(out, chunk)
            copied = len(chunk)
        offset += copied
        length -= copied


def write_all(file, data: bytes) -> None:
    """An unbuffered file may write less than it is given."""
    view = memoryview(data)
    while view:
        view = view[file.write(view):]


def _shorter() -> InputError:
    return InputError("an external data file got shorter while lnfuse copied it; run lnfuse again on a folder "
                      "nothing else is changing")
