"""The command-line options of a many-model run, and when a ``lnfuse`` command is one.

Imported by the CLI for every command, so it imports nothing heavy."""

from __future__ import annotations

import argparse
import glob
import os
import re

from lnfuse.errors import UsageError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that only a run over many models has (the single-model ones apply to each model)."""
    group = parser.add_argument_group("many models (several inputs, a folder, a glob, or --from-list: -o names "
                                      "an output folder that mirrors the input tree; see docs/zoo.md)")
    group.add_argument("--from-list", metavar="FILE", help="also fuse the models listed in FILE (one path, folder "
                       "or glob a line, relative to the current folder; # comments)")
    group.add_argument("--jobs", type=_positive_int, metavar="N", help="worker processes (default: the cores)")
    group.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                       help="per model: stop it and record a timeout past this many seconds (default: none)")
    group.add_argument("--max-memory", type=parse_size, metavar="SIZE",
                       help="per model: the most memory its worker may allocate (RLIMIT_DATA; mapped model files "
                       "do not count), e.g. 4G (default: none)")
    group.add_argument("--ledger", metavar="FILE", help="JSON Lines, one row per finished model, written as each "
                       "finishes; a rerun skips what it already holds (default: OUTDIR/lnfuse-ledger.jsonl)")
    group.add_argument("--ray", nargs="?", const="", metavar="ADDRESS", help="run the models on Ray actors: on the "
                       "cluster at ADDRESS ('auto', 'ray://head:10001'), or a new local instance without one")


def is_many(args: argparse.Namespace) -> bool:
    """A many-model run: more than one input, a folder or a glob, a list, Ray, or ``--jobs`` with ``-o`` naming a
    folder. One model file with ``-o`` naming an ``.onnx`` file is one model's run whatever else is given (``--jobs
    2`` does not make ``-o fused.onnx`` a folder)."""
    if len(args.model) != 1 or any(getattr(args, name) is not None for name in ("from_list", "ray")):
        return True
    if args.jobs is not None and not str(getattr(args, "output", "") or "").lower().endswith(".onnx"):
        return True
    only = args.model[0]
    return os.path.isdir(only) or (not os.path.exists(only) and glob.has_magic(only))


def check_single(args: argparse.Namespace) -> None:
    """The many-model options that mean nothing for one model: refused rather than ignored; and ``-o`` naming a
    folder, where one model's output is a file."""
    output = getattr(args, "output", None)
    if output and output.endswith(("/", os.sep)) and not os.path.isdir(output):  # a folder is refused on write
        name = os.path.basename(args.model[0]) or "model.onnx"
        raise UsageError(f"-o {output}: names a folder, not a file; name the file to write inside it, e.g. "
                         f"{os.path.join(output, name)}")
    given = [flag for flag, name in (("--timeout", "timeout"), ("--max-memory", "max_memory"), ("--ledger", "ledger"))
             if getattr(args, name) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} apply to a run over many models (several inputs, a folder, a glob, "
                         "--from-list or --jobs, with -o naming a folder); drop them for one model")


def parse_size(text: str) -> int:
    """``4G``, ``1500M``, ``512MiB``, or a number of bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size; write e.g. 4G, 1500M or 512MiB")
    scale = 1024 ** " kmgt".index(match.group(2).lower() or " ")
    size = float(match.group(1)) * scale
    if not 1 <= size <= _MOST_MEMORY:  # a setrlimit past this fails in the worker, not here
        raise argparse.ArgumentTypeError(f"'{text}' is not a memory size lnfuse can set; give one from 1 byte to "
                                         f"{_MOST_MEMORY >> 50} PiB, e.g. 4G")
    return int(size)


#: the largest --max-memory: far above any machine's memory, far below what setrlimit takes
_MOST_MEMORY = 1 << 50
#: the longest --timeout: a month (a longer one is no limit, and timers past this overflow)
_MOST_SECONDS = 30 * 24 * 3600


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of workers; give 1 or more")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= _MOST_SECONDS:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds lnfuse can wait; give a positive "
                                         f"number up to {_MOST_SECONDS} (30 days)")
    return value

