"""One model's work, the same in a local worker and in a Ray actor's: fuse it exactly as ``lnfuse model -o out``
does, save it with ``FuseResult.save``, and return its ledger row. Every failure becomes a row; nothing raises.

The optimizer is imported inside the functions that run it: the process that schedules the jobs builds ``Job``s
and never fuses, and should not pay a second of imports for it; the workers import it once, up front."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lnfuse.load import trust
from lnfuse.errors import LnfuseError, OutputError, first_line, one_line, out_of_memory
from lnfuse.version import version_line
from lnfuse.zoo.identity import IDENTITY, ModelIdentity, of_model

#: exit codes, the worst of which is the run's (as ``lnfuse check``: 1 means a candidate was left)
OK, LEFT, BAD, INTERNAL = 0, 1, 2, 3
#: a resumed model whose files were touched but hold the bytes of its previous row: that row stands
UNCHANGED = "unchanged"


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
    #: a previous row's sha256 and data_files, and its output's ("output"), to compare before fusing (see ledger)
    resume: dict | None = None
    ledger: str | None = None  # the run's ledger, which no file of this model's may replace

    def row(self, **fields) -> dict:
        """A ledger row for this model; ``fields`` say how it went."""
        base = {"model": self.relative, "input": self.source, "output": None, "status": "", "exit": INTERNAL,
                "reason": "", "fused": {}, "refused": 0, "seconds": 0.0, "bytes_in": 0, "bytes_out": 0,
                "sha256": None, "data_files": None, "stat": None, "output_identity": None, "identity": IDENTITY,
                "lnfuse": version_line(), "options": self.key_options()}
        base.update(fields)
        return base

    def key_options(self) -> dict:
        """The options that decide what is written (a rerun with others does the model again)."""
        return {**self.options, "external_data": self.external_data, "in_place": self.in_place,
                "inputs": self.inputs}


def run(job: Job, hashed: Callable[[dict], None] | None = None) -> dict:
    """Fuse, verify and write one model; its row, whatever happens. ``hashed`` gets the model's identity as far as it
    is known before the fusing starts (the model file's hash and stat key), for the row of a model whose worker is
    then stopped. With ``job.resume`` (a previous row whose files' stat keys changed), a model whose bytes, and
    whose output's bytes, are those of that row is not fused again: its row says ``unchanged``, with the new stat
    keys."""
    start, began = time.perf_counter(), time.time_ns()
    fields: dict = {}
    model, completed = None, False
    try:
        model = of_model(Path(job.source))  # the model's bytes, hashed before anything parses them
        fields = model.early()
        if job.resume is not None and _same_content(model, job.resume):
            output = _same_output(job)
            if output is not False:
                return job.row(status=UNCHANGED, exit=OK, output_identity=output,
                               **model.complete(job.resume["data_files"]))
        if hashed is not None:
            hashed(dict(fields))
        fields.update(_fuse(job, model))
        completed = True
    except LnfuseError as error:
        fields.update(status="bad input", exit=error.exit_code, reason=str(error))
    except MemoryError:
        fields.update(status="over memory", exit=BAD, reason="ran out of memory under --max-memory")
    except Exception as error:  # noqa: BLE001 - one model's bug is its row, never the run's end
        text = _shortened(one_line(first_line(error)))
        if out_of_memory(text):
            fields.update(status="over memory", exit=BAD, reason=f"ran out of memory ({text})")
        else:
            fields.update(status="internal error", exit=INTERNAL,
                          reason=f"{type(error).__name__}: {text}; please report it with the model")
    if model is not None and not completed and fields.get("sha256") is None:
        # the fuse failed before its load said which data files it read: a listing of its own (a parse on the
        # failure path only), so that a rerun can tell whether the failure still holds. A fuse that finished
        # keeps the identity it found, unknown included (a file written to after the fuse read it)
        fields.update(_after_failure(model, Path(job.source), began))
    return job.row(seconds=round(time.perf_counter() - start, 3), **fields)


def _after_failure(model: ModelIdentity, source: Path, began: int) -> dict:
    """The identity of a model whose fuse failed, listed and hashed now; unknown if one of its files changed since
    ``began`` (ns; its ctime, a second of slack for the kernel's coarse clock): the failure may be of other bytes."""
    fields = model.complete(listed_files(source))
    if fields.get("sha256") and any(key[4] >= began - 10**9 for key in fields["stat"]):
        return model.early()
    return fields


def identify(job: Job) -> dict:
    """The identity fields of a model whose worker was stopped while it fused (``timeout``, ``over memory``), for
    its row: a rerun under the same limits skips it only if its files are the same."""
    try:
        model = of_model(Path(job.source))
    except LnfuseError:
        return {}
    return model.complete(listed_files(Path(job.source)))


def _same_content(model: ModelIdentity, previous: dict) -> bool:
    try:
        return model.digest(previous["data_files"])[0] == previous["sha256"]
    except LnfuseError:
        return False


def _same_output(job: Job) -> dict | None | bool:
    """The output's identity now if it has the bytes the previous row recorded (None when that row had no output),
    False if not: the output was replaced, and the model is fused again rather than keeping what is there."""
    previous = job.resume.get("output")
    if previous is None:
        return None
    now = output_identity(Path(job.output))
    return now if now is not None and now["sha256"] == previous.get("sha256") else False


def output_identity(path: Path) -> dict | None:
    """What the ledger records of an output as written: the digest and stat keys of the file and of the data files
    it names, read through a gate on its folder as a model's are; None when they cannot be told. A rerun keeps an
    output only while these hold."""
    try:
        fields = of_model(path).complete(listed_files(path))
    except LnfuseError:
        return None
    return {k: fields[k] for k in ("sha256", "data_files", "stat")} if fields["sha256"] is not None else None


def _fuse(job: Job, model: ModelIdentity) -> dict:
    """The row's fields for the fused model, its identity included: the data files its load read are hashed before
    anything is written, so that a model stopped while hashing (past --timeout) has no output."""
    from lnfuse.api import fuse  # in the workers, imported once before the first model (see local.py)

    inputs = _inputs(job.inputs)
    result = fuse(job.source, inputs=inputs, **job.options)
    report = result.report
    fused = report.fused_counts()
    done = model.complete(*_read_files(result.ir_model, Path(job.source)))
    done |= {"fused": fused, "refused": len(report.unfused)}
    starved = next((u for u in report.unfused if out_of_memory(u.reason)), None)
    if starved is not None:
        # a check that could not run for lack of memory is no verdict on the model: written, the output would
        # depend on the memory limit
        said = out_of_memory(starved.reason)
        return done | {"status": "over memory", "exit": BAD, "reason": one_line(
            f"ran out of memory verifying {starved.anchor} [{starved.rule}] ({said} in ONNX Runtime); nothing was "
            "written; raise --max-memory")}
    if report.model_check is not None and not report.model_check["ok"]:
        return done | {"status": "differs", "exit": LEFT, "reason": f"the fused model differs from the original "
                       f"({report.model_check['summary']}); nothing was written, please report this model"}
    _writes_confined(job)
    for path in (job.output, job.report):
        if path is not None:
            _make_folder(Path(path).parent)
    written = result.save(job.output, in_place=job.in_place, external_data=job.external_data, report=job.report)
    done |= {"output": job.output, "output_identity": output_identity(Path(job.output)),
             "bytes_out": sum(path.stat().st_size for path in written
                              if job.report is None or path != Path(job.report))}
    if report.unfused:
        first = report.unfused[0]
        return done | {"status": "candidates left", "exit": OK,  # written, as a run of the model alone: exit 0
                       "reason": _shortened(one_line(f"{len(report.unfused)} left, first {first.anchor} "
                                                     f"[{first.rule}/{first.check}] {first.reason}"))}
    return done | {"status": "fused" if fused else "nothing to fuse", "exit": OK}


def _shortened(text: str, limit: int = 300) -> str:
    """``text`` cut at a word's end to fit ``limit`` characters, with an ellipsis when cut."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 1]
    return (cut[:cut.rfind(" ")] if " " in cut else cut).rstrip(" ,;:") + "…"


def _make_folder(folder: Path) -> None:
    """The folder a mirrored output goes into; ``OutputError`` when a file (or a dangling link) is in its place."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"{folder}: cannot make this folder for the output ({error.strerror}); remove or rename "
                          "what is in its place") from None


def _writes_confined(job: Job) -> None:
    """What this model writes stays in the folders the user named: a link placed in them, where the input tree is
    mirrored, would take the writes elsewhere. (Its data file is ``<output>.data``, named by lnfuse, never by the
    model.)"""
    depth = len(Path(job.relative).parts)
    for path in filter(None, (None if job.in_place else job.output, job.report)):
        root = os.path.realpath(Path(path).parents[depth - 1])
        if not trust.inside(os.path.realpath(Path(path).parent), root):
            raise OutputError(f"{path}: a link inside {root} leads out of it; remove the link")


def _read_files(model, path: Path) -> tuple[list[str] | None, dict[str, list[int]] | None]:
    """The data files the fuse's load admitted through its gate, as the model names them, and their stat keys
    when they were admitted (``io.DATA_LOCATIONS``). A model whose files do not start with this model file (not
    from that load) is not trusted: the model is listed again (``listed_files``), with no keys."""
    from lnfuse.load.io import DATA_LOCATIONS, INPUT_FILES

    files = [Path(f) for f in model.meta.get(INPUT_FILES, [])]
    admitted = model.meta.get(DATA_LOCATIONS)
    if not files or files[0] != Path(os.path.abspath(path)) or admitted is None:
        return listed_files(path), None
    return list(admitted), admitted


def _inputs(path: str | None) -> dict | None:
    if path is None:
        return None
    from lnfuse.verification.whole_model import read_inputs

    return read_inputs(path)


def listed_files(path: Path) -> list[str] | None:
    """The data files ``path`` reads, by a parse of its own, or None when it cannot be told (the model does not
    parse, or the gate refuses one of its references)."""
    try:
        return data_files(path)
    except Exception:  # noqa: BLE001 - whatever the parse raises, the data files are unknown, and so is the hash
        return None


def data_files(path: Path) -> list[str]:
    """The external-data files ``path`` reads, as it names them (relative to its folder), each admitted by lnfuse's
    gate (inside the folder, a regular file of one link, long enough), or ``InputError`` naming the reference that
    is not."""
    from lnfuse.load import io
    from lnfuse.load.gate import Gate

    proto, weights = io.read_proto(path)
    gate = Gate(path.parent, str(path))
    gate.admit_all(proto, lnfuse_made=weights.holds if weights is not None else None, read_inline=False)
    return list(gate.admitted())
