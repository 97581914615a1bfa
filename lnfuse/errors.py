"""Errors a user can act on. The CLI prints ``str(error)`` as one line and exits with ``exit_code``."""

from __future__ import annotations

import re

from lnfuse.terminal import escape

#: ``text`` with control, format and line-break characters shown as escapes (``\n``), so it prints as exactly one
#: line: the one escape the printer uses (``lnfuse.terminal.escape``)
one_line = escape


#: what an allocation failure says when it does not arrive as a MemoryError (ONNX Runtime, protobuf, C++)
_OUT_OF_MEMORY = re.compile(r"bad_alloc|out of memory|failed to allocate|cannot allocate memory|MemoryError", re.I)


def out_of_memory(text: str) -> str | None:
    """The words in ``text`` that say an allocation failed, or None."""
    found = _OUT_OF_MEMORY.search(text)
    return found.group() if found else None


def first_line(error: Exception) -> str:
    """The first line of an exception's message (libraries raise multi-line ones; the CLI prints one line)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class LnfuseError(Exception):
    exit_code = 2

    def __str__(self) -> str:
        return one_line(super().__str__())


class InputError(LnfuseError):
    """The input model cannot be read or is not a valid ONNX model."""


class OutputError(LnfuseError):
    """The output cannot be written where the user asked."""


class UsageError(LnfuseError):
    """The options do not make sense together."""
