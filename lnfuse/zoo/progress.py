"""Progress across the models: a bar rewritten in place on a terminal (done, failed, running, ETA), one plain
line per finished model otherwise."""

from __future__ import annotations

import time

from lnfuse import terminal
from lnfuse.zoo.job import Job


class Progress:
    """On stderr, through the printer: a model's name (a file or folder name from a downloaded tree) and its reason
    are escaped, so each finished model is one line."""

    def __init__(self, total: int, *, quiet: bool = False):
        self.total, self.quiet = total, quiet
        self.bar = not quiet and terminal.is_terminal(err=True)
        self.done = self.failed = self.running = self.total_resumed = 0
        self.start = time.monotonic()

    def started(self, job: Job) -> None:
        self.running += 1
        self._draw(job.relative)

    def resumed(self, count: int) -> None:
        """Models a previous run finished: counted as done, not drawn one by one."""
        self.done += count
        self.total_resumed = count

    def finished(self, row: dict) -> None:
        self.running -= 1
        self.done += 1
        self.failed += row["exit"] >= 2
        if self.quiet:
            return
        if self.bar:
            self._draw(row["model"])
            return
        count = f"[{self.done:>{len(str(self.total))}}/{self.total}]"
        how = f"{row['seconds']:.2f} s"
        detail = ", ".join(f"{op} {n}" for op, n in row["fused"].items()) if row["exit"] < 2 else row["reason"]
        terminal.say(f"{count} {row['status']:<15} {how:>15}  {row['model']}" + (f"  ({detail})" if detail else ""),
                     err=True)

    def close(self) -> None:
        if self.bar:
            terminal.status()

    def _draw(self, label: str) -> None:
        if not self.bar:
            return
        elapsed = time.monotonic() - self.start
        ran = self.done - self.total_resumed
        # the first models carry the workers' start-up: an estimate from them alone is far off
        eta = "--:--" if ran < min(_SETTLED, self.total - self.total_resumed) else \
            _clock(elapsed / ran * (self.total - self.done))
        filled = round(24 * self.done / max(self.total, 1))
        terminal.status(f"[{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total} done, "
                        f"{self.failed} failed, {self.running} running, ETA {eta}  {_fit(terminal.escape(label))}")


#: models finished before the ETA is shown
_SETTLED = 3


def _fit(name: str, width: int = 40) -> str:
    """A model's path in ``width`` characters: its first folder and its file name, the middle left out."""
    if len(name) <= width:
        return name
    tail = width * 2 // 3
    return name[:width - tail - 1] + "…" + name[-tail:]


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02}:{seconds:02}" if hours else f"{minutes}:{seconds:02}"
