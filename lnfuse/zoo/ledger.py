"""The run's ledger: JSON Lines, one row per finished model, appended and flushed to disk as each finishes, so
that a run killed at any point (Ctrl-C, SIGKILL, a lost machine) loses no finished result; and which models a
rerun can skip."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lnfuse.errors import UsageError
from lnfuse.zoo.identity import unchanged
from lnfuse.zoo.job import Job

#: failures that depend on the limits: a rerun with other limits tries the model again
LIMITED = ("timeout", "over memory")
#: failures of the run rather than of the model: a rerun tries the model again
RETRIED = ("worker died",)


class Ledger:
    def __init__(self, path: Path):
        self.path = path
        if not path.parent.is_dir():
            raise UsageError(f"--ledger {path}: folder '{path.parent}' does not exist; create it first")
        self.rows = self._read()
        self._file = None

    def _read(self) -> dict[str, dict]:
        """The last row of each input. A line cut short by a kill mid-write (the last one) is ignored."""
        rows: dict[str, dict] = {}
        if not self.path.exists():
            return rows
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"--ledger {self.path}: cannot read it ({error}); give another file or remove it")\
                from None
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("input"), str):
                rows[row["input"]] = row
        return rows

    def finished(self, job: Job, version: str, limits: dict) -> tuple[dict | None, bool]:
        """The row of a previous run this job need not repeat, and whether it still stands: (row, True) when the
        model and the data files that row read have the stat keys it recorded (no byte is read for it); (row,
        False) when the row would stand but a stat key changed, so a worker must compare the content hash first
        (``job.run`` with ``resume``); (None, False) when the model runs again: another lnfuse or library
        version, other options, another or a missing output, a failure of the run (``worker died``), a failure
        the limits decide under other limits, or a row whose content is not known."""
        row = self.rows.get(job.source)
        if row is None or row.get("lnfuse") != version or row.get("options") != job.key_options():
            return None, False
        if row.get("status") in RETRIED or (row.get("status") in LIMITED and row.get("limits") != limits):
            return None, False
        if row.get("output") is not None and (row["output"] != job.output or not Path(row["output"]).exists()):
            return None, False
        names = row.get("data_files")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or \
                not isinstance(row.get("sha256"), str):
            return None, False
        return row, unchanged(Path(job.source), row)

    def append(self, row: dict) -> None:
        """One line, written whole and pushed to disk before the next model's row."""
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
            if self._file.tell() and not self.path.read_bytes().endswith(b"\n"):
                self._file.write("\n")  # end the line a kill cut short, so that this row starts its own
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.rows[row["input"]] = row

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
