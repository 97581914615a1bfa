"""The lnfuse command.

    lnfuse model.onnx -o fused.onnx [options]     fuse (the default command)
    lnfuse a.onnx dir/ 'z/*.onnx' -o OUTDIR       many models: all cores (--jobs) or Ray (--ray), one table
    lnfuse explain model.onnx                     every candidate, fused or not, and why
    lnfuse decompose fused.onnx -o plain.onnx     fused norm ops back into primitive ONNX ops
    lnfuse check model.onnx                       exit 1 if a norm-like candidate is left unfused (for CI gates)
    lnfuse --version
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

# only what parsing the command line needs: the optimizer (onnx_ir, ONNX Runtime, numpy) is imported by the command
# that runs it, so --help and usage errors answer at once
from lnfuse import terminal
from lnfuse.errors import LnfuseError
from lnfuse.targets import TARGETS, rule_names
from lnfuse.zoo import options as zoo_options

COMMANDS = ("fuse", "explain", "decompose", "check")


def _common(parser: argparse.ArgumentParser, many: bool = False) -> None:
    parser.add_argument("model", nargs="*" if many else None,
                        help="input .onnx file (never modified)" + ("; or several, folders and globs" if many else ""))
    parser.add_argument("--target", choices=TARGETS, default="ort",
                        help="ort (default): may write ONNX Runtime's fused ops; onnx: standard ONNX ops only")
    parser.add_argument("--no-verify", action="store_true", help="skip the per-rewrite check in ONNX Runtime")
    parser.add_argument("--only", metavar="RULE[,RULE]", help="run only these rules")
    parser.add_argument("--skip", metavar="RULE[,RULE]", help="do not run these rules")
    parser.add_argument("--upgrade-opset", action="store_true",
                        help="with --target onnx: convert the model to the opset the fused ops need (kept only if "
                             "the whole model still verifies)")
    parser.add_argument("--allow-requantization", action="store_true",
                        help="also fuse norms whose outputs reach a quantizer (QuantizeLinear, "
                             "DynamicQuantizeLinear, ...): the fused op's rounding moves quantized values by whole "
                             "steps for some inputs")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list every candidate, and every check that failed on the forms tried")


class _Version(argparse.Action):
    """``--version``: the versions come from package metadata, read only when asked for."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print lnfuse's version and its libraries' and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from lnfuse.version import version_line
        terminal.say(version_line())
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse, printing through the printer: a usage error quotes the arguments, and a shell glob over a
    downloaded folder makes file names arguments."""

    def _print_message(self, message: str, file=None) -> None:  # usage and help: argparse's own lines
        if message:
            terminal.say_block(message.rstrip("\n"), err=terminal.is_stderr(file))

    def error(self, message: str):
        """The usage, then the error on one line (a newline in an argument stays in it)."""
        terminal.say_block(self.format_usage().rstrip("\n"), err=True)
        terminal.say(f"{self.prog}: error: {message}", err=True)
        self.exit(2)


_DESCRIPTIONS = {
    "fuse": "Fuse the normalizations of ONNX models (LayerNormalization, RMSNormalization and ONNX Runtime's fused "
            "norms), each rewrite verified in ONNX Runtime. One model: -o names the output file; several models, a "
            "folder, a glob or --from-list: -o names a folder that mirrors the inputs.",
    "explain": "List every norm-like candidate of a model: fused (into what, with the error measured), kept, or left "
               "with the check that failed and the values it saw. Writes nothing unless --annotate or --report.",
    "decompose": "Replace every fused norm op lnfuse can write with primitive ONNX ops (the exact inverse of fuse), "
                 "for runtimes without the fused kernels; each replacement verified in ONNX Runtime.",
    "check": "A CI gate: exit 1 if a norm-like candidate of the model is left unfused (as fuse would leave it), 0 if "
             "none is. Writes nothing.",
}


def _parser(command: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=f"lnfuse{'' if command == 'fuse' else ' ' + command}", description=_DESCRIPTIONS[command])
    if command == "decompose":
        parser.add_argument("model", help="input .onnx file (never modified)")
        parser.add_argument("-o", "--output", required=True, help="where to write the decomposed model")
        parser.add_argument("--no-verify", action="store_true", help="skip the per-rewrite check in ONNX Runtime")
        parser.add_argument("--in-place", action="store_true", help="allow the output to be the input file")
        parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
        return parser
    _common(parser, many=command == "fuse")
    if command == "explain":
        parser.add_argument("--annotate", metavar="OUT.onnx", help="also write a copy of the model (weights "
                            "unchanged) whose candidate nodes say why they were left unfused, for Netron")
        parser.add_argument("--report", metavar="FILE", help="also write the report as JSON (what --json prints)")
    if command == "fuse":
        parser.add_argument("--version", action=_Version)
        parser.add_argument("-o", "--output", required=True, help="where to write the fused model")
        parser.add_argument("--report", metavar="FILE", help="also write the report as JSON")
        parser.add_argument("--verify", choices=("model",), help="'model': also run the whole original and fused "
                            "models and report the worst difference per output")
        parser.add_argument("--inputs", metavar="FILE.npz", help="inputs for --verify model (default: random)")
        parser.add_argument("--in-place", action="store_true", help="allow the output to be the input file")
        parser.add_argument("--external-data", choices=("keep", "single"), default="keep",
                            help="models with external weights: keep (default) = an output in the model's folder "
                                 "references its data files, unread; elsewhere the bytes the model reads are copied "
                                 "into <output>.data; single = every weight into <output>.data")
        parser.add_argument("--quantize-embeddings", choices=("uint8", "int8"),
                            help="write QEmbedLayerNormalization with per-tensor quantized tables (changes numbers; "
                                 "the report gives the worst difference to the float model)")
        parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
        zoo_options.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command's exit code; what it prints goes through the printer to a reader that may leave (``--help |
    head -1``)."""
    with terminal.reader_may_leave():
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "fuse"
    if command == "fuse" and argv and argv[0] in ("-h", "--help") and len(argv) == 1:
        terminal.say_block(__doc__.strip())  # shown as it is: plain text, no markup
    parser = _parser(command)
    args = parser.parse_args(argv)
    if command == "fuse" and not args.model and args.from_list is None:
        parser.error("the following arguments are required: model (or --from-list FILE)")
    if getattr(args, "upgrade_opset", False) and args.target != "onnx":
        parser.error("--upgrade-opset converts the model for --target onnx (ONNX's own fused ops need opset 17 "
                     "or 23); add --target onnx, or drop it: --target ort fuses at any opset")
    from lnfuse import interrupts
    try:
        with interrupts.as_keyboard_interrupt(), terminal.library_messages():
            if command == "fuse" and zoo_options.is_many(args):
                from lnfuse.zoo.command import run as run_many
                return run_many(args)
            if command == "fuse":
                zoo_options.check_single(args)
                args.model = args.model[0]
            return _run(command, args)
    except LnfuseError as error:
        terminal.say(f"lnfuse: error: {error}", err=True)
        return error.exit_code
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM/SIGHUP raised as one (``interrupts``)
        said = "" if type(interrupt) is KeyboardInterrupt else f" ({interrupts.name(interrupt)})"
        terminal.say(f"lnfuse: interrupted{said}; nothing was written", err=True)
        return interrupts.exit_code(interrupt)
    except Exception as error:  # noqa: BLE001 - a user gets one line, never a traceback
        text = (str(error).strip().splitlines() or [""])[0][:300]
        terminal.say(f"lnfuse: internal error ({type(error).__name__}: {text}); nothing was written; please report "
                     "it with the model", err=True)
        return 3


def _progress(fraction: float, label: str) -> None:
    """A bar on one rewritten line of stderr (terminals only); an empty label clears it."""
    if label:
        done = round(24 * min(max(fraction, 0.0), 1.0))
        terminal.status(f"[{'#' * done}{'.' * (24 - done)}] {fraction:4.0%}  {terminal.escape(label)[:60]}")
    else:
        terminal.status()


def _check_outputs(*paths: str | None) -> None:
    """Refuse an output path that cannot be written (a missing folder, a folder, a device, FIFO or socket) before
    the model is read: fusing a large model takes a while. Saving checks every path again when it writes."""
    from lnfuse.load import trust

    for text in filter(None, paths):
        path = Path(text)
        trust.check_folder(path.parent, path)
        trust.check_destination(path)


def _run(command: str, args: argparse.Namespace) -> int:

    from lnfuse.api import fuse
    from lnfuse.commands.decompose import decompose

    _check_outputs(getattr(args, "output", None), getattr(args, "report", None), getattr(args, "annotate", None))
    if command == "decompose":
        result = decompose(args.model, verify_rewrites=not args.no_verify)
        result.save(args.output, in_place=args.in_place)
        if not args.quiet:
            terminal.say(*result.report.summary_lines(decompose=True), f"wrote {args.output}")
        return 0
    inputs = None
    if getattr(args, "inputs", None):
        from lnfuse.verification.whole_model import read_inputs

        inputs = read_inputs(args.inputs)
    quiet = getattr(args, "quiet", False) or getattr(args, "json", False)
    bar = None if quiet or not terminal.is_terminal(err=True) else _progress
    result = fuse(args.model, target=args.target, verify=not args.no_verify, only=rule_names(args.only),
                  progress=bar,
                  skip=rule_names(args.skip), upgrade_opset=args.upgrade_opset,
                  verify_model=getattr(args, "verify", None) == "model", inputs=inputs,
                  quantize_embeddings=getattr(args, "quantize_embeddings", None),
                  allow_requantization=args.allow_requantization)
    report = result.report
    if command == "explain":
        if args.json:
            terminal.say_block(report.to_json())
        else:
            terminal.say(*report.explain_lines(verbose=args.verbose))
        if args.annotate:  # the report, if asked for, is renamed into place with the annotated copy
            from lnfuse.save.annotate import write_annotated
            labelled = write_annotated(args.model, report, args.annotate, report_file=args.report)
            terminal.say(f"wrote {args.annotate} ({labelled} candidate node(s) annotated)", err=args.json)
        elif args.report:
            _write_report(args.report, report.to_json(), result.ir_model)
        if args.report:
            terminal.say(f"wrote {args.report}", err=args.json)
        return 0
    if command == "check":
        if args.json:  # the report alone, so that scripts can parse stdout
            terminal.say_block(report.to_json())
            return 1 if report.unfused else 0
        for u in report.unfused:
            terminal.say(f"unfused: {u.graph}: {u.anchor} [{u.rule}/{u.check}] {u.reason}")
            if args.verbose:
                terminal.say(*(f"  also refused: [{u.rule}/{o.check}] {o.reason} (a form of {o.matched} nodes)"
                               for o in u.others))
        skipped = [u for u in report.unfused if u.check == "skipped"]
        if skipped:  # --only/--skip narrows what is fused, not what the gate counts
            terminal.say(f"lnfuse check: {len(skipped)} candidate(s) of rules that did not run "
                         f"({', '.join(sorted({u.rule for u in skipped}))}) count as left unfused")
        terminal.say(f"lnfuse check: {len(report.unfused)} candidate(s) left unfused, "
                     f"{sum(report.fused_counts().values())} fusable")
        return 1 if report.unfused else 0
    if report.model_check is not None and not report.model_check["ok"]:
        terminal.say(f"lnfuse: error: the fused model differs from the original ({report.model_check['summary']}); "
                     "nothing was written, please report this model", err=True)
        return 1
    if bar is not None:
        bar(0.95, f"writing {args.output}")
    try:
        result.save(args.output, in_place=args.in_place, external_data=args.external_data, report=args.report)
    finally:
        if bar is not None:
            bar(1.0, "")
    if args.json:
        terminal.say_block(report.to_json())
    elif not args.quiet:
        terminal.say(*report.summary_lines(verbose=args.verbose, colour=terminal.colour()),
                     f"wrote {args.output}")
    return 0


def _write_report(path: str, text: str, model) -> None:
    """``explain --report`` without ``--annotate``: the report alone, written as every output is (into a temporary
    folder beside it, then renamed into place), and never over a file the run read (the input or its data)."""
    from lnfuse.load import io, trust
    from lnfuse.errors import OutputError
    from lnfuse.save.staging import Staging

    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not os.access(folder, os.W_OK):
        raise OutputError(f"{target}: folder {str(folder)!r} is not writable; choose another report path")
    reads = {ident: p for p in model.meta.get(io.INPUT_FILES, []) if (ident := trust.identity(p)) is not None}
    trust.check_no_overwrite(reads, [target], set())
    try:
        with Staging() as staging:
            (staging.area(folder) / target.name).write_text(text)
            staging.commit(last=target)
    except OSError as error:
        raise OutputError(f"{target}: could not write ({error.strerror or error})") from None


def run() -> None:
    """The ``lnfuse`` program: one command, then exit at once.

    The program makes objects that live until it ends, or nearly: the modules its imports build (sympy, which
    onnx_ir imports, makes hundreds of thousands) and the model it works on. Python's cycle collector would walk
    them again and again, and at exit the interpreter would take every one apart: together 0.1 to 0.4 s on a model
    lnfuse fuses in under a second. So the collector stays off (the fuse pauses it anyway, see
    ``api._cycle_collection_paused``), and once everything is written, closed and flushed the process ends without
    the teardown, unless a profiler or tracer watches it (cProfile, coverage: they write their results at exit).
    ``main`` called from Python changes neither."""
    gc.disable()
    code = main()
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    terminal.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
