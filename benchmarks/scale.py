"""What lnfuse costs on top of reading and writing a model, where the model is large in ways other than its depth:
weights held in ``Constant`` nodes, and a graph of a million nodes.

    python benchmarks/scale.py [--models /tmp/lnfuse-bench-models] [--rounds 3] [--chain 1000000] [--only constants]

Models (generated into ``--models`` when absent, deterministic, no torch needed):

* ``constant_weights_{N}mb.onnx``  a LLaMA-shaped decoder (hidden 1024, FFN 4096) whose every weight is the
                                    ``value`` of a ``Constant`` node, as onnxscript's code form writes them (671 MB),
                                    with a decomposed LayerNorm before each block (gamma/beta also Constants).
* ``chain_{N}nodes.onnx``           one decomposed LayerNorm followed by a chain of N ``Neg`` nodes (25 MB at 1M).
* ``negs_before_{N}nodes.onnx``    a chain of N ``Neg`` nodes in front of one decomposed LayerNorm (the normal form
                                    reads sign chains: it must not read this one again from every point of it).
* ``scales_before_{N}nodes.onnx``  the same with ``Mul`` by a constant.
``--chain`` takes several lengths (default 10,000, 100,000 and 1,000,000), to show the time growing linearly.

Each tool runs as its own process (interpreter start and imports included) and is timed from the parent; peak RSS
comes from ``wait4``. The order of the tools rotates from round to round; medians are printed:

* ``lnfuse``          the CLI, verification on.
* ``onnx_ir``         ``onnx_ir.load`` + ``onnx_ir.save``: the IR lnfuse works on, read and written.
* ``onnx``            ``onnx.load`` + ``onnx.checker.check_model`` + ``onnx.save``.
* ``ort-cpp``         ONNX Runtime's C++ optimizer (ORT_ENABLE_EXTENDED, ``optimized_model_filepath``).

Targets (PASS/FAIL lines): Constant weights: lnfuse no slower than ``onnx`` and under 0.5 GB peak; chains: lnfuse
within 1.5x of ``onnx_ir`` in time and in peak RSS, and lnfuse's time per node at the longest chain within 1.5x of
that at the next (linear growth).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
from onnx import TensorProto, numpy_helper

from make_models import DEFAULT_OUT
from process import ChildRun, command, compile_lnfuse, competition_note, cpu_snapshot, run_child

CONSTANT_LAYERS = 10
CONSTANT_HIDDEN, CONSTANT_FFN = 1024, 4096
CHAIN_WIDTH = 64
RSS_LIMIT_MB = 512
CHAIN_LIMIT = 1.5

# =========================================================================== models


def _layer_norm(nodes: list[onnx.NodeProto], x: str, hidden: int, prefix: str, constant) -> str:
    """ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add, every operand a Constant node (opset 17 axes as an
    attribute of ReduceMean 17)."""
    def op(op_type: str, inputs: list[str], **attrs) -> str:
        out = f"{prefix}/{op_type}_{len(nodes)}"
        nodes.append(oh.make_node(op_type, inputs, [out], **attrs))
        return out

    mean = op("ReduceMean", [x], axes=[-1])
    d = op("Sub", [x, mean])
    var = op("ReduceMean", [op("Pow", [d, constant(f"{prefix}.two", np.array(2.0, np.float32))])], axes=[-1])
    std = op("Sqrt", [op("Add", [var, constant(f"{prefix}.eps", np.array(1e-5, np.float32))])])
    rng = np.random.default_rng(len(nodes))
    gamma = constant(f"{prefix}.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    beta = constant(f"{prefix}.bias", rng.normal(0.0, 0.1, hidden).astype(np.float32))
    return op("Add", [op("Mul", [op("Div", [d, std]), gamma]), beta])


def build_constant_weights(layers: int = CONSTANT_LAYERS) -> onnx.ModelProto:
    """Every weight a Constant node right before its first reader, as onnxscript's code form writes a model."""
    nodes: list[onnx.NodeProto] = []
    rng = np.random.default_rng(0)

    def constant(name: str, value: np.ndarray) -> str:
        nodes.append(oh.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name)))
        return name

    def weight(name: str, shape: tuple[int, int]) -> str:
        return constant(name, rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))

    def op(op_type: str, inputs: list[str]) -> str:
        out = f"{op_type}_{len(nodes)}"
        nodes.append(oh.make_node(op_type, inputs, [out]))
        return out

    h, m = CONSTANT_HIDDEN, CONSTANT_FFN
    x = "hidden_states"
    for i in range(layers):
        p = f"layers.{i}"
        n1 = _layer_norm(nodes, x, h, f"{p}.input_layernorm", constant)
        q, k, v = (op("MatMul", [n1, weight(f"{p}.attn.{w}", (h, h))]) for w in "qkv")
        x = op("Add", [x, op("MatMul", [op("Add", [op("Add", [q, k]), v]), weight(f"{p}.attn.o", (h, h))])])
        n2 = _layer_norm(nodes, x, h, f"{p}.post_attention_layernorm", constant)
        gate = op("MatMul", [n2, weight(f"{p}.mlp.gate", (h, m))])
        up = op("MatMul", [n2, weight(f"{p}.mlp.up", (h, m))])
        act = op("Mul", [op("Mul", [gate, op("Sigmoid", [gate])]), up])
        x = op("Add", [x, op("MatMul", [act, weight(f"{p}.mlp.down", (m, h))])])
    nodes.append(oh.make_node("Identity", [x], ["last_hidden_state"]))
    dims = ["batch", "sequence", h]
    graph = oh.make_graph(nodes, "constant_weights",
                          [oh.make_tensor_value_info("hidden_states", TensorProto.FLOAT, dims)],
                          [oh.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, dims)])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8,
                         producer_name="lnfuse-benchmarks")


#: chain models by file-name prefix: (the chain's op, whether it comes before the norm)
CHAINS = {"chain": ("Neg", False), "negs_before": ("Neg", True), "scales_before": ("Mul", True)}


def build_chain(length: int, kind: str = "chain") -> onnx.ModelProto:
    """A LayerNorm and a chain of ``length`` sign or scale nodes, after or before it (``CHAINS``). The chain's
    nodes are added in place (make_node per node would take minutes)."""
    op_type, before = CHAINS[kind]
    head: list[onnx.NodeProto] = []

    def constant(name: str, value: np.ndarray) -> str:
        head.append(oh.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name)))
        return name

    # -1: a scale the canonical form does not remove (a Mul by 1 is), and the values stay finite
    scale = [constant("scale", np.array(-1.0, np.float32))] if op_type == "Mul" else []
    graph = oh.make_graph([], "chain", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", CHAIN_WIDTH])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", CHAIN_WIDTH])])

    def chain(x: str, last: str) -> None:
        for i in range(length):
            node = graph.node.add()
            node.op_type = op_type
            node.input.extend([x] + scale)
            x = last if i == length - 1 else f"v{i}"
            node.output.append(x)

    if before:
        graph.node.extend(head)
        chain("x", "chained")
        tail: list[onnx.NodeProto] = []
        out = _layer_norm(tail, "chained", CHAIN_WIDTH, "norm", lambda name, value: _constant_node(tail, name, value))
        tail.append(oh.make_node("Identity", [out], ["y"]))
        graph.node.extend(tail)
    else:
        out = _layer_norm(head, "x", CHAIN_WIDTH, "norm", constant)
        graph.node.extend(head)
        chain(out, "y")
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8,
                         producer_name="lnfuse-benchmarks")


def _constant_node(nodes: list[onnx.NodeProto], name: str, value: np.ndarray) -> str:
    nodes.append(oh.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name)))
    return name


def ensure_model(folder: Path, name: str, build) -> Path:
    path = folder / name
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        tmp = path.with_suffix(".tmp")
        onnx.save(build(), tmp)
        tmp.rename(path)
        print(f"made {name} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)
    return path


# =========================================================================== tools: each a child process (process.py)

TOOLS = ("lnfuse", "onnx_ir", "onnx", "ort-cpp")


def run_rounds(models: list[Path], tools: list[str], rounds: int, scratch: Path,
               timeout: float) -> dict[tuple[str, str], list[ChildRun]]:
    runs: dict[tuple[str, str], list[ChildRun]] = {(m.name, t): [] for m in models for t in tools}
    for r in range(rounds):
        for i, model in enumerate(models):
            for tool in tools[(r + i) % len(tools):] + tools[:(r + i) % len(tools)]:
                out = scratch / f"{tool}-{model.name}"
                runs[model.name, tool].append(run_child(command(tool, model, out), timeout))
                out.unlink(missing_ok=True)
                print(f"round {r + 1}: {model.stem} {tool}: {runs[model.name, tool][-1]}", file=sys.stderr,
                      flush=True)
    return runs


def summary(samples: list[ChildRun]) -> tuple[float, float] | None:
    """(median seconds, median peak RSS in MB), or None if any run failed."""
    if not samples or any(s.error for s in samples):
        return None
    return statistics.median(s.seconds for s in samples), statistics.median(s.peak_mb for s in samples)


def print_table(models: list[Path], tools: list[str], runs: dict[tuple[str, str], list[ChildRun]]) -> list[str]:
    lines = []
    print(f"{'model':26s} {'tool':9s} {'median s':>9s} {'peak MB':>8s} {'x onnx_ir s':>11s} {'x onnx_ir MB':>12s}")
    for model in models:
        base = summary(runs.get((model.name, "onnx_ir"), []))
        for tool in tools:
            got = summary(runs[model.name, tool])
            if got is None:
                error = next((s.error for s in runs[model.name, tool] if s.error), "no data")
                print(f"{model.stem:26s} {tool:9s} {error}")
                continue
            ratios = (f"{got[0] / base[0]:11.2f} {got[1] / base[1]:12.2f}" if base else f"{'-':>11s} {'-':>12s}")
            print(f"{model.stem:26s} {tool:9s} {got[0]:9.2f} {got[1]:8.0f} {ratios}")
        print()
        lines += targets(model, runs)
    return lines


def targets(model: Path, runs: dict[tuple[str, str], list[ChildRun]]) -> list[str]:
    lnfuse = summary(runs.get((model.name, "lnfuse"), []))
    if lnfuse is None:
        return []
    if model.name.startswith("constant_weights"):
        lines = []
        onnx_floor = summary(runs.get((model.name, "onnx"), []))
        if onnx_floor:
            verdict = "PASS" if lnfuse[0] <= onnx_floor[0] else "FAIL"
            lines.append(f"{verdict}  {model.stem}: lnfuse {lnfuse[0]:.2f} s vs onnx load+check+save "
                         f"{onnx_floor[0]:.2f} s ({lnfuse[0] / onnx_floor[0]:.2f}x, target <= 1.00x)")
        verdict = "PASS" if lnfuse[1] <= RSS_LIMIT_MB else "FAIL"
        lines.append(f"{verdict}  {model.stem}: lnfuse peak RSS {lnfuse[1]:.0f} MB (target <= {RSS_LIMIT_MB} MB)")
        return lines
    base = summary(runs.get((model.name, "onnx_ir"), []))
    if base is None:
        return []
    return [f"{'PASS' if lnfuse[k] <= CHAIN_LIMIT * base[k] else 'FAIL'}  {model.stem}: lnfuse {what} "
            f"{lnfuse[k]:.{digits}f} vs onnx_ir load+save {base[k]:.{digits}f} ({lnfuse[k] / base[k]:.2f}x, "
            f"target <= {CHAIN_LIMIT}x)" for k, what, digits in ((0, "s", 2), (1, "peak MB", 0))]


def linear_growth(models: list[Path], runs: dict[tuple[str, str], list[ChildRun]]) -> list[str]:
    """lnfuse's seconds per thousand nodes along each kind of chain; PASS when the longest chain costs at most
    ``CHAIN_LIMIT`` times per node what the next shorter one does (a quadratic walk shows as 10x per 10x)."""
    lines = []
    for kind in CHAINS:
        points = []
        for model in models:
            stem, _, rest = model.stem.rpartition("_")
            got = summary(runs.get((model.name, "lnfuse"), []))
            if stem == kind and rest.endswith("nodes") and got is not None:
                points.append((int(rest[:-len("nodes")]), got[0]))
        points.sort()
        if len(points) < 2:
            continue
        per = [f"{n:,}: {1000 * t / n:.3f} ms" for n, t in points]
        (n1, t1), (n2, t2) = points[-2:]
        ratio = (t2 / n2) / (t1 / n1)
        lines.append(f"{'PASS' if ratio <= CHAIN_LIMIT else 'FAIL'}  {kind}: lnfuse per 1000 nodes {', '.join(per)} "
                     f"(longest / next: {ratio:.2f}x, target <= {CHAIN_LIMIT}x)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=DEFAULT_OUT, help="where the models are (made if absent)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chain", default="10000,100000,1000000", help="comma-separated chain lengths")
    parser.add_argument("--chains", default=",".join(CHAINS), help="comma-separated subset of: " + ", ".join(CHAINS))
    parser.add_argument("--only", choices=("constants", "chain"), help="run the Constant-weights or the chain models")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of: " + ", ".join(TOOLS))
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a run counts as failed")
    args = parser.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    if set(tools) - set(TOOLS):
        parser.error(f"unknown tool(s): {', '.join(sorted(set(tools) - set(TOOLS)))}")
    models = []
    if args.only != "chain":
        models.append(ensure_model(args.models, "constant_weights_671mb.onnx", build_constant_weights))
    if args.only != "constants":
        for kind in [k for k in args.chains.split(",") if k]:
            for length in sorted(int(n) for n in args.chain.split(",") if n):
                models.append(ensure_model(args.models, f"{kind}_{length}nodes.onnx",
                                           lambda length=length, kind=kind: build_chain(length, kind)))
    compiled = compile_lnfuse() if "lnfuse" in tools else ""
    cpu_start = cpu_snapshot()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lnfuse-scale-", dir=args.models) as tmp:
        runs = run_rounds(models, tools, args.rounds, Path(tmp), args.timeout)
    print()
    lines = print_table(models, tools, runs) + linear_growth(models, runs)
    print("\n".join(lines + ([compiled] if compiled else [])))
    print(f"\n{args.rounds} rounds, {time.perf_counter() - start:.0f} s; onnx {onnx.__version__}")
    print(competition_note(cpu_start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
