"""SIGTERM and SIGHUP taken the way Ctrl-C is.

``timeout``, CI cancellation and ``docker stop`` send SIGTERM; a closed terminal sends SIGHUP. Left to their default
action they end the process at once, leaving a run's temporary folder and half-written files behind. Raised as a
``KeyboardInterrupt`` instead, they go through the cleanup every ``finally`` and ``with Staging()`` already does for
Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

#: what ends a run the way Ctrl-C does
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """A SIGTERM or SIGHUP, delivered as Ctrl-C is, so that the same cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(interrupt: BaseException) -> int:
    """128 + the signal's number, as a shell reports a process its signal ended: 130 (Ctrl-C), 143 (SIGTERM), 129
    (SIGHUP)."""
    return 128 + getattr(interrupt, "signum", signal.SIGINT)


def name(interrupt: BaseException) -> str:
    return signal.Signals(getattr(interrupt, "signum", signal.SIGINT)).name


def _raise(signum: int, frame) -> None:
    # once: a second signal must not break off the cleanup the first one started
    for other in TERMINATING:
        signal.signal(other, signal.SIG_IGN)
    raise Terminated(signum)


@contextlib.contextmanager
def as_keyboard_interrupt(signums: tuple[int, ...] = TERMINATING) -> Iterator[None]:
    """While the block runs, ``signums`` raise ``Terminated`` (a KeyboardInterrupt). Signals can only be handled in
    the main thread: elsewhere (lnfuse called from a user's thread) nothing changes. A signal the host ignores stays
    ignored (``nohup``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in signums}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, _raise)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def ignored(signums: tuple[int, ...] = TERMINATING) -> Iterator[None]:
    """``signums`` ignored while the block runs (in the main thread), so that a process started meanwhile inherits
    SIG_IGN for them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
