"""The one printer: every line lnfuse shows a person (summaries, ``-v``, explain, check, progress, the many-model
table, warnings, errors, notes) is written here, and every piece of text in it is escaped the same way.

A model, its folder and the files in it are untrusted: a node name, a doc string, a file name may hold an escape
sequence (set the window title, set the clipboard with OSC 52, clear the screen), C1 controls (``\\x9b`` is a CSI on
many terminals), bidi overrides that reorder what follows, a carriage return or a backspace that overwrites what was
printed, or a newline followed by a forged ``lnfuse check:`` verdict. ``escape`` shows every such character as a
Python escape (``\\x1b``, ``\\n``, ``\\u202e``), so no string can end a line, move the cursor or reorder text.

Multi-line text is never a string with model text inside it: it is a list of lines, each escaped on its own
(``block``, ``say``), so a line break a model brings in stays inside its line. lnfuse's own colours (``Styled``) and
its progress bar's cursor codes (``status``) are added after escaping, by this module only.
"""

from __future__ import annotations

import os

import contextlib
import io
import re
import sys
import unicodedata
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TextIO

#: Unicode categories a terminal may act on or a reader cannot see: Cc (C0, DEL, C1; \n \r \v \f \x85 among them),
#: Cf (bidi embeddings, overrides and isolates, U+200E/U+200F, U+061C, zero widths, tag characters), Zl and Zp
#: (U+2028, U+2029), Cs (lone surrogates: a file name that is not UTF-8, which no stream can encode) and Cn
#: (unassigned here, but perhaps a format character in the terminal's newer Unicode)
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Cn"})
#: printable ASCII is shown as it is; only the rest is looked up
_NOT_PLAIN = re.compile(r"[^\x20-\x7e]")
_STYLE_CODE = re.compile(r"[0-9;]+")


def escape(text: object) -> str:
    """``text`` as one line of visible characters: every control, format or line-break character is shown as its
    Python escape (``\\n``, ``\\x1b``, ``\\x9b``, ``\\u202e``, ``\\udcff``). Backslashes are kept as they are, so
    escaping twice changes nothing."""
    return _NOT_PLAIN.sub(_escaped, str(text))


def _escaped(match: re.Match) -> str:
    char = match.group()
    if unicodedata.category(char) not in _HIDDEN:
        return char
    return char.encode("unicode_escape").decode("ascii")


@dataclass(frozen=True)
class Styled:
    """Text shown in one of lnfuse's colours: the text is escaped like any other, the code (an SGR parameter:
    ``1`` bold, ``32`` green, ``33`` yellow) is lnfuse's own."""

    text: str
    code: str

    def __post_init__(self) -> None:
        if not _STYLE_CODE.fullmatch(self.code):
            raise ValueError(f"not a colour code: {self.code!r}")


#: one line: text, coloured text, or a line made of parts
Line = str | Styled | Sequence[str | Styled]


def render(line: Line) -> str:
    """One line as it is shown: escaped, then coloured."""
    if isinstance(line, str):
        return escape(line)
    if isinstance(line, Styled):
        return f"\033[{line.code}m{escape(line.text)}\033[0m"
    return "".join(render(part) for part in line)


def block(lines: Iterable[Line]) -> str:
    """Lines joined into one text, each escaped on its own: the text's only line breaks are lnfuse's."""
    return "\n".join(render(line) for line in lines)


def say(*lines: Line, err: bool = False) -> None:
    """Print each argument as exactly one line, on stdout (``err``: stderr)."""
    _write("".join(render(line) + "\n" for line in lines), err)


def say_block(text: str, *, err: bool = False) -> None:
    """Print a text made of several lines by lnfuse (``block``'s result, a JSON document with ``ensure_ascii``, the
    usage text): split at its line breaks, each line escaped again (which changes nothing in such a text)."""
    say(*text.split("\n"), err=err)


def status(text: str = "") -> None:
    """The progress bar: ``text`` drawn over the current line of stderr; an empty text clears the line."""
    _write("\r\033[K" + escape(text), err=True)


def is_terminal(err: bool = False) -> bool:
    """Whether stdout (``err``: stderr) is a terminal that moves its cursor: progress bars only there (not with
    ``TERM=dumb``, which draws ``\r`` and clear-line codes as text)."""
    stream = _stream(err)
    return stream is not None and stream.isatty() and os.environ.get("TERM") != "dumb"


def colour(err: bool = False) -> bool:
    """Whether to colour what goes to stdout (``err``: stderr): on such a terminal, unless ``NO_COLOR`` is set to
    anything but the empty string (no-color.org)."""
    return is_terminal(err) and not os.environ.get("NO_COLOR")


def is_stderr(stream: object) -> bool:
    """Whether a library handing text to print meant stderr (argparse gives the stream with the text)."""
    return stream is sys.stderr


def flush() -> None:
    """Flush stdout and stderr, as the program ends."""
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except OSError:  # a closed pipe: what was printed is lost either way; the exit code still says how it went
        pass


def _stream(err: bool) -> TextIO:
    # looked up at each call: contextlib.redirect_stdout and pytest's capture replace them
    return sys.stderr if err else sys.stdout


def _write(text: str, err: bool) -> None:
    stream = _stream(err)
    if stream is None:  # started with the stream closed (``2>&-``): nothing can be shown, and nothing fails
        return
    try:
        stream.write(text)
    except UnicodeEncodeError:  # a stream that cannot show every printable character (PYTHONIOENCODING=ascii)
        encoding = getattr(stream, "encoding", None) or "ascii"
        stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
    stream.flush()


class _ReaderMayLeave(io.TextIOBase):
    """stdout that stops writing once its reader has gone (``lnfuse check m.onnx | head -1``): what lnfuse did,
    wrote and exits with does not depend on whether anyone read all of what it printed."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream, self._gone = stream, False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                self._stream.write(text)
                self._stream.flush()  # a closed pipe shows here, not later at exit
            except BrokenPipeError:
                self._gone = True
        return len(text)

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str | None:
        return getattr(self._stream, "encoding", None)


def reader_may_leave() -> contextlib.AbstractContextManager:
    """stdout, for the command's run, that a reader who has gone does not turn into an error."""
    if sys.stdout is None:  # started with stdout closed: ``_write`` shows nothing
        return contextlib.nullcontext()
    return contextlib.redirect_stdout(_ReaderMayLeave(sys.stdout))


@contextlib.contextmanager
def library_messages() -> Iterator[None]:
    """For the command's run: Python warnings, and log records when nothing else handles logging, are printed
    through ``say``: a library's message may quote a model's names."""
    import logging  # here, not at the top: --help and usage errors answer without it

    class Printed(logging.Handler):
        """Log records no other handler takes (what Python's last-resort handler would print raw on stderr)."""

        def emit(self, record: logging.LogRecord) -> None:
            say(record.getMessage(), err=True)

    root = logging.getLogger()
    handler = None if root.handlers else Printed(logging.WARNING)
    if handler is not None:
        root.addHandler(handler)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            yield
        finally:
            if handler is not None:
                root.removeHandler(handler)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    say(f"warning: {category.__name__}: {message}", err=True)
