"""One model's work, the same in a local worker and in a Ray task: fuse it exactly as ``lnfuse model -o out``
does, save it with ``FuseResult.save``, and return its ledger row. Every failure becomes a row; nothing raises.

The optimizer is imported inside the functions that run it: the process that schedules the jobs builds ``Job``s
and never fuses, and should not pay a second of imports for it; the workers import it once, up front."""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lnfuse.errors import LnfuseError, UsageError, first_line, one_line
from lnfuse.version import version_line

#: exit codes, the worst of which is the run's (as ``lnfuse check``: 1 means a candidate was left)
OK, LEFT, BAD, INTERNAL = 0, 1, 2, 3
#: what an allocation failure says when it does not arrive as a MemoryError (ONNX Runtime, protobuf, C++)
_OUT_OF_MEMORY = re.compile(r"bad_alloc|out of memory|failed to allocate|cannot allocate memory|MemoryError", re.I)


@dataclass(frozen=True)
class Job:
    """Everything one model's run needs, picklable (it crosses to a worker process or a Ray node)."""

    source: str
    output: str
    relative: str
    options: dict = field(default_factory=dict)  # fuse's keyword arguments, as the CLI gives them
    external_data: str = "keep"
    in_place: bool = False
    inputs: str | None = None  # --inputs: an .npz for --verify model
    report: str | None = None  # where this model's JSON report goes, if asked for
    estimate: int = 0  # bytes of memory it is expected to need (admission, Ray's memory resource)

    def row(self, **fields) -> dict:
        """A ledger row for this model; ``fields`` say how it went."""
        base = {"model": self.relative, "input": self.source, "output": None, "status": "", "exit": INTERNAL,
                "reason": "", "fused": {}, "refused": 0, "seconds": 0.0, "bytes_in": 0, "bytes_out": 0,
                "sha256": None, "data_files": [], "lnfuse": version_line(), "options": self.key_options()}
        base.update(fields)
        return base

    def key_options(self) -> dict:
        """The options that decide what is written (a rerun with others does the model again)."""
        return {**self.options, "external_data": self.external_data, "in_place": self.in_place,
                "inputs": self.inputs}


def run(job: Job, hashed: Callable[[dict], None] | None = None) -> dict:
    """Fuse, verify and write one model; its row, whatever happens. ``hashed`` gets the model's identity (hash,
    data files, size) before the fusing starts, for the row of a model whose worker is then stopped."""
    start = time.perf_counter()
    fields: dict = {}
    try:
        fields = _content(Path(job.source))
        if hashed is not None:
            hashed(dict(fields))
        fields.update(_fuse(job))
    except LnfuseError as error:
        fields.update(status="bad input", exit=error.exit_code, reason=str(error))
    except MemoryError:
        fields.update(status="over memory", exit=BAD, reason="ran out of memory under --max-memory")
    except Exception as error:  # noqa: BLE001 - one model's bug is its row, never the run's end
        text = one_line(first_line(error))[:300]
        if _OUT_OF_MEMORY.search(text):
            fields.update(status="over memory", exit=BAD, reason=f"ran out of memory ({text})")
        else:
            fields.update(status="internal error", exit=INTERNAL,
                          reason=f"{type(error).__name__}: {text}; please report it with the model")
    return job.row(seconds=round(time.perf_counter() - start, 3), **fields)


def _fuse(job: Job) -> dict:
    from lnfuse.api import fuse  # in the workers, imported once before the first model (see local.py)

    inputs = _inputs(job.inputs)
    result = fuse(job.source, inputs=inputs, **job.options)
    report = result.report
    fused = report.fused_counts()
    done = {"fused": fused, "refused": len(report.unfused)}
    starved = next((u for u in report.unfused if _OUT_OF_MEMORY.search(u.reason)), None)
    if starved is not None:
        # a check that could not run for lack of memory is no verdict on the model: written, the output would
        # depend on the memory limit
        said = _OUT_OF_MEMORY.search(starved.reason).group()
        return done | {"status": "over memory", "exit": BAD, "reason": one_line(
            f"ran out of memory verifying {starved.anchor} [{starved.rule}] ({said} in ONNX Runtime); nothing was "
            "written; raise --max-memory")}
    if report.model_check is not None and not report.model_check["ok"]:
        return done | {"status": "differs", "exit": LEFT, "reason": f"the fused model differs from the original "
                       f"({report.model_check['summary']}); nothing was written, please report this model"}
    for path in (job.output, job.report):
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    result.save(job.output, in_place=job.in_place, external_data=job.external_data, report=job.report)
    done |= {"output": job.output, "bytes_out": _written_bytes(Path(job.output), job.external_data,
                                                                 result.has_external_data)}
    if report.unfused:
        first = report.unfused[0]
        return done | {"status": "candidates left", "exit": LEFT,
                       "reason": one_line(f"{len(report.unfused)} left, first {first.anchor} [{first.rule}/"
                                          f"{first.check}] {first.reason}")[:300]}
    return done | {"status": "fused" if fused else "nothing to fuse", "exit": OK}


def _inputs(path: str | None) -> dict | None:
    if path is None:
        return None
    import numpy as np
    try:
        return dict(np.load(path))
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: cannot read inputs ({error}); give an .npz of input name -> array") from None


def _content(path: Path) -> dict:
    """The model's identity for resuming: a hash of its bytes and of each data file it reads (which are only
    known once its references passed the trust checks), and how many bytes that is."""
    try:
        names = data_files(path)
    except LnfuseError:
        names = []
        if not path.is_file():
            raise
    digest = content_digest(path, names)
    size = path.stat().st_size + sum((path.parent / n).stat().st_size for n in names)
    return {"sha256": digest, "data_files": names, "bytes_in": size}


def data_files(path: Path) -> list[str]:
    """The external-data files ``path`` reads, relative to its folder, each admitted by lnfuse's gate (inside the
    folder, a regular file of one link, long enough), or ``InputError`` naming the reference that is not."""
    from lnfuse.load import io
    from lnfuse.load.gate import Gate

    proto, weights = io.read_proto(path)
    gate = Gate(path.parent, str(path))
    gate.admit_all(proto, lnfuse_made=weights.holds if weights is not None else None, read_inline=False)
    return [os.path.relpath(f, gate.folder) for f in gate.files()]


def content_digest(path: Path, data_files: list[str]) -> str | None:
    """sha256 over the model file and its data files (named relative to its folder), or None when one of them
    is no longer a regular file inside the model's folder (then nothing is skipped on its account)."""
    digest = hashlib.sha256()
    folder = os.path.realpath(path.parent)
    for name in ["", *data_files]:
        file = path if not name else path.parent / name
        real = os.path.realpath(file)
        if not os.path.isfile(real) or (name and not real.startswith(folder + os.sep)):
            return None
        digest.update(name.encode() + b"\0")
        with open(real, "rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _written_bytes(output: Path, layout: str, external: bool) -> int:
    """The output and the data files written with it (``keep``: the input's, copied beside it when elsewhere)."""
    total = output.stat().st_size
    if not external:
        return total
    if layout == "single":
        data = output.with_name(output.name + ".data")
        return total + (data.stat().st_size if data.exists() else 0)
    try:
        files = data_files(output)
    except LnfuseError:
        return total
    return total + sum((output.parent / f).stat().st_size for f in files)
