"""No time cliff: lnfuse next to ORT's C++ optimizer and onnx_ir's load + save, on models with little or nothing
to fuse, each tool as a whole process, side by side in one run.

    python benchmarks/cliff.py [--models /tmp/lnfuse-bench-models] [--rounds 3] [--only detector] [--json out.json]

Models: every ``sample_models/*.onnx`` and ``sample_models/frameworks/**/*.onnx``, and the generated detectors
(``make_models.build_detector``: a DBNet/YOLO-like FPN with dynamic height and width, 50 and 200 Resize ops, half
upsampling by ``scales`` and half to ``sizes`` computed from ``Shape``; without a norm, and with one decomposed
LayerNorm downstream of every Resize), written to ``--models`` when missing.

Tools, each a whole process as a user runs it (``process.py``: interpreter start and imports included):

* ``lnfuse``   ``lnfuse model.onnx -o out.onnx -q`` (verification on);
* ``onnx_ir``  ``ir.save(ir.load(path), out)``: the load + save every file-to-file tool pays;
* ``ort-cpp``  an ORT session at ORT_ENABLE_EXTENDED writing ``optimized_model_filepath`` (offline).

Rounds rotate the tools' order per model, and medians are printed. Then, in this process with imports paid, the
detectors' work alone: ``lnfuse.fuse(path).save(out)`` against ``ir.save(ir.load(path), out)``.

PASS/FAIL lines (issue 20):

* every model: lnfuse's whole process at most 3x ORT's C++ optimizer's + 1 s;
* each detector with no norm: lnfuse's whole process at most onnx_ir's load + save (whole process) + 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import onnx
import onnxruntime as ort

# Run as a script, so this folder is on sys.path.
from make_models import DEFAULT_OUT, ensure_detectors
from process import ChildRun, command, compile_lnfuse, competition_note, cpu_snapshot, run_child

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_models"
TOOLS = ("lnfuse", "onnx_ir", "ort-cpp")
ORT_FACTOR, ORT_SLACK = 3.0, 1.0  # lnfuse <= 3x ORT's C++ optimizer + 1 s
FLOOR_SLACK = 0.5  # detector without a norm: lnfuse <= onnx_ir load + save + 0.5 s


def sample_paths() -> list[Path]:
    return sorted(SAMPLES.glob("*.onnx")) + sorted((SAMPLES / "frameworks").rglob("*.onnx"))


def label(path: Path) -> str:
    return str(path.relative_to(SAMPLES)) if path.is_relative_to(SAMPLES) else path.name


def run_rounds(models: list[Path], rounds: int, scratch: Path) -> dict[tuple[str, str], list[ChildRun]]:
    runs: dict[tuple[str, str], list[ChildRun]] = {(label(m), t): [] for m in models for t in TOOLS}
    for r in range(rounds):
        start = time.perf_counter()
        for i, model in enumerate(models):
            shift = (r + i) % len(TOOLS)
            for tool in TOOLS[shift:] + TOOLS[:shift]:
                out = scratch / f"{tool}-{model.name}"
                runs[label(model), tool].append(run_child(command(tool, model, out), timeout=300))
                out.unlink(missing_ok=True)
        print(f"round {r + 1}/{rounds}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return runs


def median(runs: list[ChildRun]) -> float | None:
    return statistics.median(r.seconds for r in runs) if runs and not any(r.error for r in runs) else None


def in_process(detectors: list[Path], rounds: int, scratch: Path) -> dict[tuple[str, str], float]:
    """Medians of lnfuse's fuse + save and onnx_ir's load + save in this process (imports paid once before)."""
    import onnx_ir as ir

    import lnfuse

    def fuse(path: Path, out: Path) -> None:
        lnfuse.fuse(str(path)).save(str(out))

    def floor(path: Path, out: Path) -> None:
        ir.save(ir.load(str(path)), str(out))

    tools = {"lnfuse": fuse, "onnx_ir": floor}
    warm = SAMPLES / "bert_tiny_legacy_op14.onnx"
    for run in tools.values():
        run(warm, scratch / "warm.onnx")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for model in detectors:
            for name, run in tools.items():
                start = time.perf_counter()
                run(model, scratch / "in-process.onnx")
                times.setdefault((model.name, name), []).append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def node_counts(path: Path) -> tuple[int, int]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return len(graph.node), sum(n.op_type == "Resize" for n in graph.node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=DEFAULT_OUT, help="where the detectors are written")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", help="comma-separated substrings: time only models whose name has one")
    parser.add_argument("--json", type=Path, help="also write every sample as JSON")
    args = parser.parse_args(argv)
    ort.set_default_logger_severity(3)
    warnings.simplefilter("ignore")
    detectors = ensure_detectors(args.models)
    models = sample_paths() + detectors
    if args.only:
        models = [m for m in models if any(part in label(m) for part in args.only.split(","))]
    notes = [compile_lnfuse()]
    cpu_start = cpu_snapshot()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lnfuse-cliff-") as tmp:
        scratch = Path(tmp)
        runs = run_rounds(models, args.rounds, scratch)
        chosen = [m for m in models if m in detectors]
        inside = in_process(chosen, args.rounds, scratch) if chosen else {}
    elapsed = time.perf_counter() - start
    print(f"{'model':58s} {'nodes':>6s} {'Resize':>6s} {'lnfuse s':>9s} {'onnx_ir s':>9s} {'ort-cpp s':>9s}"
          f" {'x ort':>6s} {'limit s':>8s} {'lnfuse MB':>9s}")
    lines, failed = [], 0
    for model in models:
        name = label(model)
        lnf, floor, cpp = (median(runs[name, t]) for t in TOOLS)
        nodes, resizes = node_counts(model)
        cells = [f"{v:9.2f}" if v is not None else f"{'error':>9s}" for v in (lnf, floor, cpp)]
        limit = ORT_FACTOR * cpp + ORT_SLACK if cpp is not None else None
        peak = statistics.median(r.peak_mb for r in runs[name, "lnfuse"])
        print(f"{name:58s} {nodes:6d} {resizes:6d} {' '.join(cells)} "
              f"{(f'{lnf / cpp:6.2f}' if lnf and cpp else '     -')} {(f'{limit:8.2f}' if limit else '       -')}"
              f" {peak:9.0f}")
        for tool in TOOLS:
            errors = [r.error for r in runs[name, tool] if r.error]
            if errors:
                lines.append(f"ERROR {name}: {tool}: {errors[0]}")
        if lnf is None or limit is None:
            failed += 1
            lines.append(f"FAIL  {name}: no measurement")
            continue
        ok = lnf <= limit
        failed += not ok
        if not ok:
            lines.append(f"FAIL  {name}: lnfuse {lnf:.2f} s > 3x ORT C++ {cpp:.2f} s + 1 s = {limit:.2f} s")
        if model in detectors and "_norm" not in model.name and floor is not None:
            ok = lnf <= floor + FLOOR_SLACK
            failed += not ok
            lines.append(f"{'PASS' if ok else 'FAIL'}  {name} (no norm): lnfuse {lnf:.2f} s vs onnx_ir load + save "
                         f"{floor:.2f} s + {FLOOR_SLACK} s = {floor + FLOOR_SLACK:.2f} s (whole processes)")
    passed = sum(1 for m in models if (v := median(runs[label(m), "lnfuse"])) is not None
                 and (c := median(runs[label(m), "ort-cpp"])) is not None and v <= ORT_FACTOR * c + ORT_SLACK)
    lines.insert(0, f"{'PASS' if passed == len(models) else 'FAIL'}  {passed} / {len(models)} models: lnfuse's whole "
                    f"process <= 3x ORT's C++ optimizer (ORT_ENABLE_EXTENDED, offline) + 1 s")
    if inside:
        print()
        print(f"{'in one process, imports paid':58s} {'lnfuse s':>9s} {'onnx_ir s':>9s} {'difference':>10s}")
        for model in chosen:
            lnf, floor = inside[model.name, "lnfuse"], inside[model.name, "onnx_ir"]
            print(f"{model.name:58s} {lnf:9.2f} {floor:9.2f} {lnf - floor:+10.2f}")
    print()
    print("\n".join(lines + notes))
    print(f"\n{args.rounds} rounds, {elapsed:.0f} s; ORT {ort.__version__}, onnx {onnx.__version__}")
    print(competition_note(cpu_start))
    if args.json:
        args.json.write_text(json.dumps({f"{m}|{t}": [r.seconds for r in v] for (m, t), v in runs.items()}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
