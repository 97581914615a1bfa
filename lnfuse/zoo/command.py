"""``lnfuse a.onnx dir/ 'glob*.onnx' --from-list FILE -o OUTDIR``: the run over many models, from the parsed
command line to the closing table and the exit code."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from lnfuse import interrupts
from lnfuse import terminal
from lnfuse.errors import UsageError
from lnfuse.load import trust
from lnfuse.targets import rule_names
from lnfuse.version import version_line
from lnfuse.zoo.inputs import expand
from lnfuse.zoo.job import UNCHANGED, Job
from lnfuse.zoo.ledger import Ledger
from lnfuse.zoo.limits import estimate
from lnfuse.zoo.progress import Progress
from lnfuse.zoo.table import closing_table, exit_code

LEDGER_NAME = "lnfuse-ledger.jsonl"


def run(args: argparse.Namespace) -> int:
    """Fuse every model the arguments name; the worst model's exit code."""
    output = Path(os.path.abspath(args.output))
    if output.exists() and not output.is_dir():
        raise UsageError(f"-o {output}: is a file; with many models -o names the output folder")
    report_folder = Path(os.path.abspath(args.report)) if args.report else None
    if report_folder is not None and report_folder.exists() and not report_folder.is_dir():
        raise UsageError(f"--report {report_folder}: is a file; with many models --report names a folder")
    models = expand(args.model, args.from_list, output, exclude=not args.in_place)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"-o {output}: cannot make this folder ({error.strerror}); give a folder that can be "
                         "made there") from None
    options = {"target": args.target, "verify": not args.no_verify, "only": rule_names(args.only),
               "skip": rule_names(args.skip), "upgrade_opset": args.upgrade_opset,
               "verify_model": args.verify == "model", "quantize_embeddings": args.quantize_embeddings,
               "allow_requantization": args.allow_requantization}
    jobs = [Job(str(m.path), str(output / m.relative), str(m.relative), options, args.external_data, args.in_place,
                os.path.abspath(args.inputs) if args.inputs else None,
                str(report_folder / f"{m.relative}.json") if report_folder is not None else None,
                estimate(m.path, args.max_memory)) for m in models]
    ledger_path = Path(os.path.abspath(args.ledger)) if args.ledger else output / LEDGER_NAME
    _no_collision(jobs, ledger_path)
    jobs = [dataclasses.replace(job, ledger=str(ledger_path)) for job in jobs]
    ledger = Ledger(ledger_path)
    limits = {"timeout": args.timeout, "max_memory": args.max_memory}
    version = version_line()
    rows: dict[str, dict] = {}
    for i, job in enumerate(jobs):
        row, stands = ledger.finished(job, version, limits)
        if stands:
            rows[job.source] = row
        elif row is not None:  # its files were touched: a worker compares the hashes before fusing it again
            jobs[i] = dataclasses.replace(job, resume={"sha256": row["sha256"], "data_files": row["data_files"],
                                                       "output": row.get("output_identity")})
    resumed = len(rows)
    if ledger.unsigned:  # always said: rows someone else wrote into this user's ledger are worth knowing of
        terminal.say(f"lnfuse: warning: {ledger.unsigned} row(s) of {ledger.path} are not signed by your lnfuse "
                     "(written by another user or key, an older lnfuse, or edited): ignored, their models run again",
                     err=True)
    quiet = args.quiet or args.json
    progress = Progress(len(jobs), quiet=quiet)
    if resumed and not quiet:
        rest = "running the rest" if resumed < len(jobs) else \
            "nothing left to run (remove the ledger, or a model's rows, to fuse again)"
        terminal.say(f"lnfuse: {resumed} of {len(jobs)} model(s) already finished in {ledger.path}; {rest}", err=True)
    progress.resumed(resumed)

    def finished(row: dict) -> None:
        nonlocal resumed
        if row["status"] == UNCHANGED:  # the same bytes as its previous row, which stands, with the new stat keys
            row = {**ledger.rows[row["input"]],
                   **{k: row[k] for k in ("sha256", "data_files", "stat", "output_identity")}}
            resumed += 1
        row["limits"] = limits
        ledger.append(row)
        rows[row["input"]] = row
        progress.finished(row)

    todo = [job for job in jobs if job.source not in rows]
    start = time.monotonic()
    try:
        if args.ray is not None:
            from lnfuse.zoo.ray_runner import run_ray
            run_ray(todo, args.ray, args.jobs, args.timeout, args.max_memory, progress.started, finished)
        else:
            from lnfuse.zoo.local import run_local
            run_local(todo, args.jobs or _cores(), args.timeout, args.max_memory, progress.started, finished)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM/SIGHUP raised as one (``interrupts``)
        progress.close()
        said = "" if type(interrupt) is KeyboardInterrupt else f" ({interrupts.name(interrupt)})"
        terminal.say(f"lnfuse: interrupted{said}; {len(rows)} of {len(jobs)} model(s) finished and kept in "
                     f"{ledger.path}; rerun the same command to do the rest", err=True)
        return interrupts.exit_code(interrupt)
    finally:
        ledger.close()
    progress.close()
    ordered = [rows[job.source] for job in jobs]
    code = exit_code(ordered)
    if args.json:
        terminal.say_block(json.dumps({"exit": code, "models": ordered}, indent=1))  # ASCII: ensure_ascii
    elif not args.quiet:
        terminal.say_block(closing_table(ordered, wall=time.monotonic() - start, resumed=resumed,
                                         verbose=args.verbose))
        terminal.say(f"wrote {output}/ (ledger {ledger.path})")
    return code


def _no_collision(jobs: list[Job], ledger: Path) -> None:
    """No file the run writes is written twice, or is a file another model reads: an output, ``<output>.data`` or
    report that is the ledger, another model's write, another input model, or (when writes land in the inputs'
    folders or below them: ``--in-place``, a report folder among the inputs) a data file another model reads. A
    model's writes over its own files are ``save``'s to judge (``--in-place`` replaces the model and its
    ``single`` data file)."""
    written: dict[str, tuple[str, str]] = {os.path.realpath(ledger): ("the ledger", "")}
    for job in jobs:
        for path in _writes(job):
            key = os.path.realpath(path)
            if key in written:
                raise UsageError(f"{job.source}: its output {path} would be {written[key][0]} too; rename the model, "
                                 "or give another -o, --report or --ledger")
            written[key] = (f"the output of {job.source}", job.source)
    read = {os.path.realpath(job.source): job.source for job in jobs}
    folders = {os.path.dirname(key) for key in read}
    if any(trust.inside(key, folder) for key in written for folder in folders):
        from lnfuse.zoo.job import listed_files  # parses each model: only when writes land among the inputs

        for job in jobs:
            folder = os.path.dirname(os.path.realpath(job.source))
            for name in listed_files(Path(job.source)) or []:
                read.setdefault(os.path.realpath(os.path.join(folder, name)), job.source)
    for key, (what, writer) in written.items():
        reader = read.get(key)
        if reader is not None and reader != writer:
            raise UsageError(f"{key}: {what} would replace a file {reader} reads; rename one of them, or give "
                             "another -o, --report or --ledger")


def _writes(job: Job) -> list[str]:
    """The files a model's run may write: its output, ``<output>.data`` (unless its weights stay referenced where
    they are: ``keep`` in the model's own folder) and its report."""
    data = None
    if job.external_data != "keep" or os.path.realpath(os.path.dirname(job.output)) != \
            os.path.realpath(os.path.dirname(job.source)):
        data = job.output + ".data"
    return [p for p in (job.output, data, job.report) if p is not None]


def _cores() -> int:
    """The cores this process may run on (a container or taskset may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
