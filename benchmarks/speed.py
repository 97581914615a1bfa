"""How long lnfuse takes, file to file, next to other optimizers and to the cost of just loading and saving the model.

    python benchmarks/make_models.py --only torch     # once, for BERT-base (needs torch); the stacks are made here
    python benchmarks/speed.py [--models /tmp/lnfuse-bench-models] [--rounds 5] [--json out.json]
    python benchmarks/speed.py --profile stack_96layers.onnx [--profile-tool lnfuse-noverify]   # cProfile hotspots

Models: ``bert_base_legacy_op14.onnx`` (skipped with a note when absent) and ``stack_{12,24,48,96}layers.onnx``
(generated here when absent; no torch needed).

Every tool goes from the file on disk to a written file, so each time includes loading and saving:

* ``floor``            ``onnx.load(path)`` + ``onnx.save(model, out)``: what any file-to-file tool pays at least.
* ``lnfuse``           ``lnfuse.fuse(path).save(out)`` (verification on); ``lnfuse-noverify`` with ``verify=False``.
* ``ort-transformers`` ``optimize_model(path, model_type='bert', num_heads=0, hidden_size=0, opt_level=0)``
                       + ``save_model_to_file(out)``.
* ``ort-cpp``          an ORT session at ORT_ENABLE_EXTENDED with ``optimized_model_filepath=out`` (ORT writes it).
* ``onnxscript``       ``onnx.load`` + ``onnxscript.rewriter.rewrite`` with the LayerNorm/RMSNorm fusion rules
                       + ``onnx.save``.

All runs happen in this one process, in rounds: each round runs every tool once on every model, and the order of
the tools rotates from round to round and model to model, so drift (page cache, thermal, memory) spreads evenly.
Before the first round each tool runs once, untimed, on a shipped tiny model to pay for imports. Medians are printed,
with ratios to the floor and to ORT's C++ optimizer.

Then, for BERT-base (``--process-models``), every tool also runs as a whole process as a user runs it
(``process.py``: lnfuse's CLI, the others as one-line scripts), interpreter start and imports included: the
``process s`` column, its ratio to ORT's C++ optimizer run the same way, and the peak RSS. PASS/FAIL lines:

* lnfuse as a whole process at most 0.7x ORT's C++ optimizer as a whole process, on BERT-base;
* lnfuse (verification on) no slower than ORT's C++ optimizer offline, per model;
* lnfuse (verification on) within 1.5x of the floor, per model;
* lnfuse (verification on) at 96 layers within 8.5x of 12 layers (8x the layers).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import logging
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import onnx
import onnxruntime as ort

# Run as a script, so this file's folder is on sys.path and make_models (next to it) imports without torch.
from make_models import DEFAULT_OUT, STACK_LAYERS, ensure_stacks, stack_model_name
from process import ChildRun, command, compile_lnfuse, competition_note, cpu_snapshot, run_child

REPO = Path(__file__).resolve().parent.parent
WARMUP_MODEL = REPO / "sample_models" / "bert_tiny_legacy_op14.onnx"
BERT_BASE = "bert_base_legacy_op14.onnx"

FLOOR_LIMIT = 1.5  # lnfuse / floor
DEPTH_LIMIT = 8.5  # lnfuse at 96 layers / at 12 layers
PROCESS_LIMIT = 0.7  # lnfuse / ORT's C++ optimizer, each as a whole process, on BERT-base


# =========================================================================== the tools: path in, file out


def run_floor(path: Path, out: Path) -> None:
    onnx.save(onnx.load(str(path)), str(out))


def run_lnfuse(path: Path, out: Path) -> None:
    import lnfuse

    lnfuse.fuse(str(path)).save(str(out))


def run_lnfuse_noverify(path: Path, out: Path) -> None:
    import lnfuse

    lnfuse.fuse(str(path), verify=False).save(str(out))


def run_ort_transformers(path: Path, out: Path) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    optimize_model(str(path), model_type="bert", num_heads=0, hidden_size=0, opt_level=0).save_model_to_file(str(out))


def run_ort_cpp(path: Path, out: Path) -> None:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(out)
    ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_onnxscript(path: Path, out: Path) -> None:
    from onnxscript.rewriter import rewrite
    from onnxscript.rewriter.rules.fusion._layer_norm import layer_normalization_rules
    from onnxscript.rewriter.rules.fusion._rms_normalization import rms_normalization_rules

    model = rewrite(onnx.load(str(path)), [*layer_normalization_rules, *rms_normalization_rules])
    onnx.save(model, str(out))


TOOLS: Mapping[str, Callable[[Path, Path], None]] = MappingProxyType({
    "floor": run_floor,
    "lnfuse": run_lnfuse,
    "lnfuse-noverify": run_lnfuse_noverify,
    "ort-transformers": run_ort_transformers,
    "ort-cpp": run_ort_cpp,
    "onnxscript": run_onnxscript,
})


# =========================================================================== timing


def _quiet() -> contextlib.ExitStack:
    """Tools log progress and warnings; keep them off the table."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def time_once(tool: str, model: Path, scratch: Path) -> float | str:
    """Seconds for one file-to-file run, or the error's first line; the output is deleted afterwards."""
    out = scratch / f"{tool}-{model.name}"
    gc.collect()  # garbage of the previous run must not be collected on this run's clock
    try:
        with _quiet():
            start = time.perf_counter()
            TOOLS[tool](model, out)
            return time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - a failing tool is reported, the benchmark goes on
        return f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
    finally:
        out.unlink(missing_ok=True)


def rotated(items: list[str], shift: int) -> list[str]:
    shift %= len(items)
    return items[shift:] + items[:shift]


def run_rounds(models: list[Path], tools: list[str], rounds: int, scratch: Path,
               progress: bool) -> dict[tuple[str, str], list[float | str]]:
    times: dict[tuple[str, str], list[float | str]] = {(m.name, t): [] for m in models for t in tools}
    for r in range(rounds):
        round_start = time.perf_counter()
        for i, model in enumerate(models):
            for tool in rotated(tools, r + i):
                times[model.name, tool].append(time_once(tool, model, scratch))
        if progress:
            print(f"round {r + 1}/{rounds}: {time.perf_counter() - round_start:.0f} s", file=sys.stderr, flush=True)
    return times


def run_process_rounds(models: list[Path], tools: list[str], rounds: int, scratch: Path,
                       progress: bool) -> dict[tuple[str, str], list[ChildRun]]:
    """Each tool as a whole process (``process.command``): interpreter start and imports included, as a user
    pays them. Rotated like ``run_rounds``."""
    runs: dict[tuple[str, str], list[ChildRun]] = {(m.name, t): [] for m in models for t in tools}
    for r in range(rounds):
        round_start = time.perf_counter()
        for i, model in enumerate(models):
            for tool in rotated(tools, r + i):
                out = scratch / f"process-{tool}-{model.name}"
                runs[model.name, tool].append(run_child(command(tool, model, out)))
                out.unlink(missing_ok=True)
        if progress:
            print(f"process round {r + 1}/{rounds}: {time.perf_counter() - round_start:.0f} s", file=sys.stderr,
                  flush=True)
    return runs


def process_median(runs: list[ChildRun]) -> float | None:
    return statistics.median(r.seconds for r in runs) if runs and not any(r.error for r in runs) else None


def warm_up(tools: list[str], scratch: Path) -> None:
    for tool in tools:
        time_once(tool, WARMUP_MODEL, scratch)


def median(samples: list[float | str]) -> float | None:
    numbers = [s for s in samples if isinstance(s, float)]
    return statistics.median(numbers) if numbers and len(numbers) == len(samples) else None


# =========================================================================== reporting


def first_error(samples: list[float | str]) -> str | None:
    return next((s for s in samples if isinstance(s, str)), None)


def ratio_text(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


def print_table(models: list[Path], tools: list[str], times: dict[tuple[str, str], list[float | str]],
                processes: dict[tuple[str, str], list[ChildRun]]) -> None:
    """In-process medians, then (when measured) the same tool as a whole process: seconds, ratio to ORT's C++
    optimizer run the same way, and peak RSS."""
    print(f"{'model':28s} {'tool':17s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'x floor':>8s} {'x ort-cpp':>9s}"
          f" {'process s':>10s} {'x ort-cpp':>9s} {'peak MB':>8s}")
    for model in models:
        floor = median(times.get((model.name, "floor"), []))
        cpp = median(times.get((model.name, "ort-cpp"), []))
        cpp_process = process_median(processes.get((model.name, "ort-cpp"), []))
        for tool in tools:
            samples = times[model.name, tool]
            med = median(samples)
            if med is None:
                print(f"{model.stem:28s} {tool:17s} {first_error(samples) or 'no data'}")
                continue
            line = (f"{model.stem:28s} {tool:17s} {med:9.2f} {min(samples):7.2f} {max(samples):7.2f} "
                    f"{ratio_text(med, floor):>8s} {ratio_text(med, cpp):>9s}")
            runs = processes.get((model.name, tool), [])
            whole = process_median(runs)
            if whole is not None:
                peak = statistics.median(r.peak_mb for r in runs)
                line += f" {whole:10.2f} {ratio_text(whole, cpp_process):>9s} {peak:8.0f}"
            elif runs:
                line += f" {next(r.error for r in runs if r.error)}"
            print(line)
        print()


def depth_ratios(tools: list[str], times: dict[tuple[str, str], list[float | str]]) -> dict[str, float | None]:
    shallow, deep = stack_model_name(min(STACK_LAYERS)), stack_model_name(max(STACK_LAYERS))
    out: dict[str, float | None] = {}
    for tool in tools:
        a, b = median(times.get((shallow, tool), [])), median(times.get((deep, tool), []))
        out[tool] = b / a if a and b else None
    return out


def target_lines(models: list[Path], times: dict[tuple[str, str], list[float | str]],
                 depth: dict[str, float | None], processes: dict[tuple[str, str], list[ChildRun]]) -> list[str]:
    lines = []
    bert = next((m for m in models if m.name == BERT_BASE), None)
    if bert is not None:
        lnf, cpp = (process_median(processes.get((bert.name, t), [])) for t in ("lnfuse", "ort-cpp"))
        if lnf is not None and cpp is not None:
            verdict = "PASS" if lnf <= PROCESS_LIMIT * cpp else "FAIL"
            lines.append(f"{verdict}  {bert.stem}, whole process: lnfuse {lnf:.2f} s vs ORT C++ optimizer {cpp:.2f} s "
                         f"({lnf / cpp:.2f}x, target <= {PROCESS_LIMIT}x)")
    for model in models:
        lnf, cpp, floor = (median(times.get((model.name, t), [])) for t in ("lnfuse", "ort-cpp", "floor"))
        if lnf is not None and cpp is not None:
            verdict = "PASS" if lnf <= cpp else "FAIL"
            lines.append(f"{verdict}  {model.stem}: lnfuse {lnf:.2f} s vs ORT C++ optimizer {cpp:.2f} s "
                         f"({lnf / cpp:.2f}x, target <= 1.00x)")
        if lnf is not None and floor is not None:
            verdict = "PASS" if lnf <= FLOOR_LIMIT * floor else "FAIL"
            lines.append(f"{verdict}  {model.stem}: lnfuse {lnf:.2f} s vs floor {floor:.2f} s "
                         f"({lnf / floor:.2f}x, target <= {FLOOR_LIMIT}x)")
    ratio = depth.get("lnfuse")
    if ratio is not None:
        verdict = "PASS" if ratio <= DEPTH_LIMIT else "FAIL"
        lines.append(f"{verdict}  depth: lnfuse at {max(STACK_LAYERS)} layers / {min(STACK_LAYERS)} layers = {ratio:.2f}x "
                     f"(target <= {DEPTH_LIMIT}x)")
    return lines


def print_depth(depth: dict[str, float | None]) -> None:
    cells = ", ".join(f"{t} {r:.2f}x" for t, r in depth.items() if r is not None)
    print(f"depth linearity ({max(STACK_LAYERS)} / {min(STACK_LAYERS)} layers, 8x the nodes): {cells}")


# =========================================================================== profiling


def profile(model: Path, tool: str, scratch: Path, top: int) -> None:
    """cProfile one warm run and print the functions with the most cumulative and own time."""
    warm_up([tool], scratch)
    profiler = cProfile.Profile()
    out = scratch / "profiled.onnx"
    with _quiet():
        profiler.runcall(TOOLS[tool], model, out)
    out.unlink(missing_ok=True)
    for key in ("cumulative", "tottime"):
        print(f"--- {tool} on {model.name}: top {top} by {key}")
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(key).print_stats(top)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))


# =========================================================================== command line


def model_paths(folder: Path) -> tuple[list[Path], list[str]]:
    notes = []
    models = []
    if (folder / BERT_BASE).exists():
        models.append(folder / BERT_BASE)
    else:
        notes.append(f"note: {folder / BERT_BASE} is missing (python benchmarks/make_models.py --only torch); skipped")
    return models + ensure_stacks(folder), notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=DEFAULT_OUT, help="folder of make_models.py's output")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of: " + ", ".join(TOOLS))
    parser.add_argument("--json", type=Path, help="also write every sample as JSON")
    parser.add_argument("--profile", metavar="MODEL", help="instead of the benchmark: cProfile one tool on MODEL "
                        "(a file name in --models, or a path)")
    parser.add_argument("--profile-tool", default="lnfuse", choices=list(TOOLS))
    parser.add_argument("--top", type=int, default=25, help="rows per profile listing")
    parser.add_argument("--quiet", action="store_true", help="no per-round progress on stderr")
    parser.add_argument("--only", metavar="MODEL[,MODEL]", help="time only these model files (e.g. "
                        f"{BERT_BASE})")
    parser.add_argument("--process-rounds", type=int, default=3, help="rounds of each tool as a whole process "
                        "(interpreter start included; 0: skip)")
    parser.add_argument("--process-models", default=BERT_BASE, help="comma-separated model file names timed as "
                        "whole processes too ('all': every model)")
    args = parser.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    if set(tools) - set(TOOLS):
        parser.error(f"unknown tool(s): {', '.join(sorted(set(tools) - set(TOOLS)))}")
    ort.set_default_logger_severity(3)  # ORT's C++ warnings are not results
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="lnfuse-speed-", dir=args.models.parent) as tmp:
        scratch = Path(tmp)  # next to the models: same disk for every tool's output
        if args.profile:
            target = Path(args.profile) if Path(args.profile).exists() else args.models / args.profile
            profile(target, args.profile_tool, scratch, args.top)
            return 0
        models, notes = model_paths(args.models)
        if args.only:
            models = [m for m in models if m.name in args.only.split(",")]
        cpu_start = cpu_snapshot()
        warm_up(tools, scratch)
        start = time.perf_counter()
        times = run_rounds(models, tools, args.rounds, scratch, progress=not args.quiet)
        chosen = [m for m in models if args.process_models == "all" or m.name in args.process_models.split(",")]
        if chosen and args.process_rounds and any(t.startswith("lnfuse") for t in tools):
            notes.append(compile_lnfuse())
        processes = run_process_rounds(chosen, tools, args.process_rounds, scratch, progress=not args.quiet)
    print_table(models, tools, times, processes)
    depth = depth_ratios(tools, times)
    print_depth(depth)
    print()
    print("\n".join(target_lines(models, times, depth, processes) + notes))
    elapsed = time.perf_counter() - start
    print(f"\n{args.rounds} rounds, {elapsed:.0f} s; ORT {ort.__version__}, onnx {onnx.__version__}")
    print(competition_note(cpu_start))
    if args.json:
        args.json.write_text(json.dumps({f"{m}|{t}": s for (m, t), s in times.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
