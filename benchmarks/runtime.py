"""Does fusing pay off at inference? Session creation time and latency in ONNX Runtime, original vs lnfuse-fused.

    python benchmarks/make_models.py --only torch     # once (needs torch)
    python benchmarks/runtime.py [--models /tmp/lnfuse-bench-models] [--runs 20] [--warmup 3] [--json out.json]

Models: ``bert_base_legacy_op14.onnx`` and ``llama_small_legacy_op14.onnx`` (a missing one is skipped with a note).
Each is fused once with ``lnfuse.fuse(path)`` (target ort, verification on) and saved to a temporary file.

For each of original / fused and each ORT level, graph optimizations DISABLED (the graph runs as written) and
ORT_ENABLE_ALL (what a deployment uses), on the CPU provider with ORT's default threads:

* session creation: median of ``--sessions`` creations from the file (ENABLE_ALL includes ORT's own fusions);
* latency: batch 1, sequence 128; ``--warmup`` untimed runs, then ``--runs`` timed runs whose median and minimum are
  printed. The four sessions of a model take turns run by run, in rotating order, so any drift hits all alike;
* speed-up: original median / fused median at the same level;
* max|diff|: worst absolute output difference to the original model at the same level, same inputs.

Inputs are random but valid for any table: ids in 0..1, attention masks of ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
import onnxruntime as ort

# Run as a script, so this folder is on sys.path: share the input generation and the output comparison.
from compare import max_abs_diff, random_inputs
from make_models import DEFAULT_OUT
from speed import competition_note, cpu_snapshot

MODELS = ("bert_base_legacy_op14.onnx", "llama_small_legacy_op14.onnx")
LEVELS = MappingProxyType({"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                           "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL})
BATCH, SEQUENCE = 1, 128


@dataclass
class Variant:
    model: str
    graph: str  # "original" or "lnfuse"
    level: str  # a key of LEVELS
    path: Path
    session_seconds: list[float] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    max_diff: float | None = None


def create_session(path: Path, level: str) -> tuple[ort.InferenceSession, float]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = LEVELS[level]
    start = time.perf_counter()
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return sess, time.perf_counter() - start


def fuse_to_file(path: Path, folder: Path) -> tuple[Path, float]:
    import lnfuse

    out = folder / f"{path.stem}.fused.onnx"
    start = time.perf_counter()
    lnfuse.fuse(str(path)).save(str(out))
    return out, time.perf_counter() - start


def rotated(items: list, shift: int) -> list:
    shift %= len(items)
    return items[shift:] + items[:shift]


def open_sessions(variants: list[Variant], creations: int) -> list[ort.InferenceSession]:
    """Create each session ``creations`` times, taking turns, and keep the last of each."""
    sessions: list[ort.InferenceSession | None] = [None] * len(variants)
    for i in range(max(1, creations)):
        for k in rotated(list(range(len(variants))), i):
            sessions[k] = None  # release the previous session first, so at most one extra copy is in memory
            sessions[k], seconds = create_session(variants[k].path, variants[k].level)
            variants[k].session_seconds.append(seconds)
    return [s for s in sessions if s is not None]


def time_runs(variants: list[Variant], sessions: list[ort.InferenceSession], feeds: dict[str, np.ndarray],
              warmup: int, runs: int) -> None:
    for sess in sessions:
        for _ in range(warmup):
            sess.run(None, feeds)
    for i in range(runs):
        for k in rotated(list(range(len(variants))), i):
            start = time.perf_counter()
            sessions[k].run(None, feeds)
            variants[k].latencies_ms.append((time.perf_counter() - start) * 1e3)


def measure_model(path: Path, folder: Path, args: argparse.Namespace) -> tuple[list[Variant], float]:
    fused, fuse_seconds = fuse_to_file(path, folder)
    variants = [Variant(path.stem, graph, level, p) for graph, p in (("original", path), ("lnfuse", fused))
                for level in LEVELS]
    sessions = open_sessions(variants, args.sessions)
    feeds = random_inputs(sessions[0], batch=BATCH, sequence=SEQUENCE)
    outputs = [sess.run(None, feeds) for sess in sessions]
    for k, variant in enumerate(variants):
        reference = next(i for i, v in enumerate(variants) if v.graph == "original" and v.level == variant.level)
        variant.max_diff = max_abs_diff(outputs[reference], outputs[k])
    time_runs(variants, sessions, feeds, args.warmup, args.runs)
    return variants, fuse_seconds


def print_table(variants: list[Variant]) -> None:
    print(f"{'model':26s} {'graph':9s} {'ORT opt':8s} {'session s':>9s} {'median ms':>9s} {'min ms':>8s} "
          f"{'speed-up':>8s} {'max|diff|':>9s}")
    for v in variants:
        base = next(o for o in variants if o.model == v.model and o.level == v.level and o.graph == "original")
        median = statistics.median(v.latencies_ms)
        speedup = statistics.median(base.latencies_ms) / median
        print(f"{v.model:26s} {v.graph:9s} {v.level:8s} {statistics.median(v.session_seconds):9.2f} {median:9.1f} "
              f"{min(v.latencies_ms):8.1f} {speedup:7.2f}x {v.max_diff:9.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=DEFAULT_OUT, help="folder of make_models.py's output")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per variant first")
    parser.add_argument("--sessions", type=int, default=3, help="session creations per variant (median printed)")
    parser.add_argument("--json", type=Path, help="also write every measurement as JSON")
    args = parser.parse_args(argv)
    ort.set_default_logger_severity(3)
    logging.disable(logging.WARNING)
    everything: list[Variant] = []
    lines = []
    cpu_start = cpu_snapshot()
    with tempfile.TemporaryDirectory(prefix="lnfuse-runtime-", dir=args.models) as tmp:
        for name in MODELS:
            path = args.models / name
            if not path.exists():
                lines.append(f"note: {path} is missing (python benchmarks/make_models.py --only torch); skipped")
                continue
            variants, fuse_seconds = measure_model(path, Path(tmp), args)
            everything += variants
            lines.append(f"{path.stem}: lnfuse.fuse + save took {fuse_seconds:.1f} s")
    if everything:
        print_table(everything)
    print("\n".join(lines))
    print(f"batch {BATCH}, sequence {SEQUENCE}; {args.warmup} warm-up + {args.runs} timed runs per variant; "
          f"ORT {ort.__version__}, {ort.get_device()}, default threads")
    print(competition_note(cpu_start))
    if args.json:
        args.json.write_text(json.dumps([{**asdict(v), "path": str(v.path)} for v in everything], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
