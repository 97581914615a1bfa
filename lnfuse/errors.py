"""Errors a user can act on. The CLI prints ``str(error)`` as one line and exits with ``exit_code``."""

from __future__ import annotations


def first_line(error: Exception) -> str:
    """The first line of an exception's message (libraries raise multi-line ones; the CLI prints one line)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class LnfuseError(Exception):
    exit_code = 2


class InputError(LnfuseError):
    """The input model cannot be read or is not a valid ONNX model."""


class OutputError(LnfuseError):
    """The output cannot be written where the user asked."""


class UsageError(LnfuseError):
    """The options do not make sense together."""
