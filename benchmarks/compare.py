"""Compare lnfuse with other normalization-fusing optimizers, model by model, and print one table.

    python benchmarks/make_models.py                  # once: BERT-base and LLaMA-small (optional here)
    python benchmarks/compare.py [--models /tmp/lnfuse-bench-models] [--json out.json] [--quick] [--markdown]
                                 [--tools lnfuse,lnfuse-onnx,ort-transformers,ort-cpp,onnxscript-rules,onnxscript-ort]

Models: the shipped ``sample_models/*.onnx``; ``bert_base_legacy_op14.onnx`` and ``llama_small_legacy_op14.onnx`` from
``--models`` when present (``--quick`` skips them); the ONNX backend suite's 57 expanded LayerNormalization /
RMSNormalization cases, summed into one row per tool; and onnxscript's code-form test models (Whisper encoder and
decoder, SmolLM; Phi-2 and Phi-4 with ``--onnxscript-all``), written by ``sample_models/make_exporter_samples.py``.
A result that differs from the original by more than 0.05 is marked **wrong** in the Markdown table.

Tools (each starts from the file on disk, so its time includes loading it; nothing is saved):

* ``lnfuse``            ``lnfuse.fuse(path)`` (target ort, verification on).
* ``lnfuse-onnx``       ``lnfuse.fuse(path, target="onnx", upgrade_opset=True)``: standard ops only, models below
                        opset 17 (LayerNorm) or 23 (RMSNorm) converted up first, kept only if they still agree.
* ``ort-transformers``  ``onnxruntime.transformers.optimizer.optimize_model(path, model_type='bert'|'gpt2',
                        num_heads=0, hidden_size=0, opt_level=0)`` (Python fusions only).
* ``ort-cpp``           ONNX Runtime's C++ graph optimizer offline: a session at ORT_ENABLE_EXTENDED writing
                        ``optimized_model_filepath``, which is then loaded.
* ``onnxscript-rules``  ``onnxscript.rewriter.rewrite`` with the fusion rules ``layer_normalization_rules`` and
                        ``rms_normalization_rules`` (``onnxscript.rewriter.rules.fusion``).
* ``onnxscript-ort``    ``onnxscript.rewriter.ort_fusions.optimize_for_ort`` on the onnx_ir model.

Columns: time; the norm ops in the result (legend below the table; the torch exports at opset 17+ and onnxscript's
models already hold some LayerNormalization nodes, which every tool keeps); ReduceMean (and tf2onnx's
GlobalAveragePool) nodes left; other op types the tool introduced (attention, GELU, ... fusions); the worst absolute output difference
to the original on the same random inputs (both run in ORT CPU with graph optimizations disabled, so ORT fuses
nothing at load); and whether ``onnx.checker.check_model(full_check=True)`` passes (ORT-only ops in the default
domain make it fail by design).
A tool that raises gets ``error: <one line>`` in its row and the run goes on.

Quantized rows: ``bert_tiny_dynamic_int8_op14`` and ``bert_tiny_qdq_op14`` are a tiny BERT quantized by ONNX
Runtime's own quantizer (``sample_models/make_quantized.py``: ``quantize_dynamic`` int8, and ``quantize_static`` in
QDQ format). They are sample models, so every tool runs on them like on the others. In the QDQ model every norm
has QuantizeLinear/DequantizeLinear pairs inside it: a tool that fuses one there removes rounding the model does.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
import onnx
import onnxruntime as ort

# Run as a script, so this folder is on sys.path: the busy-machine check lives with the speed benchmark.
from speed import competition_note, cpu_snapshot

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = Path("/tmp/lnfuse-bench-models")
BIG_MODELS = ("bert_base_legacy_op14.onnx", "llama_small_legacy_op14.onnx")
BACKEND_GROUP = "onnx backend (57 cases)"

# Fused normalization ops, with the short names the table uses.
NORM_OPS = MappingProxyType({
    "LayerNormalization": "LN",
    "SimplifiedLayerNormalization": "SLN",
    "RMSNormalization": "RMS",
    "SkipLayerNormalization": "SkipLN",
    "SkipSimplifiedLayerNormalization": "SkipSLN",
    "EmbedLayerNormalization": "EmbedLN",
    "QEmbedLayerNormalization": "QEmbedLN",
})

# An output difference above this is a wrong rewrite, not rounding (fp16 models differ by up to 4e-3)
WRONG = 0.05

# Concrete sizes for symbolic dims: batch 2, everything else 8 (fits every position table here, RoBERTa's too).
BATCH, SEQUENCE = 2, 8


@dataclass(frozen=True)
class Case:
    name: str
    path: Path
    decoder: bool  # picks the ORT transformers optimizer's model_type
    group: str  # rows with the same group are summed into one


@dataclass
class Outcome:
    tool: str
    model: str
    seconds: float = 0.0
    fused: Counter = field(default_factory=Counter)
    reduce_mean_left: int = 0
    new_ops: Counter = field(default_factory=Counter)
    max_diff: float | None = None
    checker_ok: bool | None = None
    error: str | None = None
    tool_failed: bool = False  # the tool raised, so there is no result to describe
    cases: int = 1  # > 1 for an aggregated group
    checker_passes: int = 0
    errors: int = 0


# =========================================================================== the tools


def quiet() -> contextlib.ExitStack:
    """Tools print progress and warnings (stdout, logging); keep them out of the table."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def run_lnfuse(path: Path, decoder: bool) -> onnx.ModelProto:
    import lnfuse

    return lnfuse.fuse(str(path)).model


def run_lnfuse_onnx(path: Path, decoder: bool) -> onnx.ModelProto:
    import lnfuse

    return lnfuse.fuse(str(path), target="onnx", upgrade_opset=True).model


def run_ort_transformers(path: Path, decoder: bool) -> onnx.ModelProto:
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = "gpt2" if decoder else "bert"
    return optimize_model(str(path), model_type=model_type, num_heads=0, hidden_size=0, opt_level=0).model


def run_ort_cpp(path: Path, decoder: bool) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory(prefix="lnfuse-cmp-") as tmp:
        out = Path(tmp) / "optimized.onnx"
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        opts.optimized_model_filepath = str(out)
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        # weights the input kept external stay references (by name, beside the input) in the written model
        return onnx.load(str(out), load_external_data=False)


def run_onnxscript_rules(path: Path, decoder: bool) -> onnx.ModelProto:
    from onnxscript.rewriter import rewrite
    from onnxscript.rewriter.rules.fusion._layer_norm import layer_normalization_rules
    from onnxscript.rewriter.rules.fusion._rms_normalization import rms_normalization_rules

    return rewrite(onnx.load(str(path)), [*layer_normalization_rules, *rms_normalization_rules])


def run_onnxscript_ort(path: Path, decoder: bool) -> onnx.ModelProto:
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model, _counts = optimize_for_ort(ir.load(str(path)))
    return ir.serde.serialize_model(model)


TOOLS: Mapping[str, Callable[[Path, bool], onnx.ModelProto]] = MappingProxyType({
    "lnfuse": run_lnfuse,
    "lnfuse-onnx": run_lnfuse_onnx,
    "ort-transformers": run_ort_transformers,
    "ort-cpp": run_ort_cpp,
    "onnxscript-rules": run_onnxscript_rules,
    "onnxscript-ort": run_onnxscript_ort,
})


# =========================================================================== measuring one result


def all_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Nodes of the main graph, of subgraphs (If/Loop/Scan bodies) and of model-local functions."""
    stack = [model.graph.node] + [f.node for f in model.functions]
    while stack:
        for node in stack.pop():
            yield node
            stack.extend(a.g.node for a in node.attribute if a.type == onnx.AttributeProto.GRAPH)
            stack.extend(g.node for a in node.attribute if a.type == onnx.AttributeProto.GRAPHS for g in a.graphs)


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in all_nodes(model))


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # measure the graph as written
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def random_inputs(sess: ort.InferenceSession, seed: int = 0, batch: int = BATCH,
                  sequence: int = SEQUENCE) -> dict[str, np.ndarray]:
    """Valid for every model here: ids 0..1 index any table, masks are all ones, floats are standard normal.
    Symbolic dims become ``batch`` (the first) and ``sequence`` (any other)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for meta in sess.get_inputs():
        shape = [d if isinstance(d, int) else (batch if i == 0 else sequence) for i, d in enumerate(meta.shape)]
        if "int" in meta.type:
            values = np.ones(shape) if "mask" in meta.name else rng.integers(0, 2, shape)
            feeds[meta.name] = values.astype(np.int32 if "int32" in meta.type else np.int64)
        else:
            dtype = np.float16 if "float16" in meta.type else np.float64 if "double" in meta.type else np.float32
            feeds[meta.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def max_abs_diff(expected: list[np.ndarray], got: list[np.ndarray]) -> float:
    if len(expected) != len(got):
        raise ValueError(f"{len(got)} outputs instead of {len(expected)}")
    worst = 0.0
    for e, g in zip(expected, got, strict=True):
        if e.shape != g.shape:
            raise ValueError(f"output shape {g.shape} instead of {e.shape}")
        diff = np.abs(e.astype(np.float64) - g.astype(np.float64))
        worst = max(worst, float(np.nan_to_num(diff, nan=np.inf).max(initial=0.0)))
    return worst


def checker_passes(model: onnx.ModelProto) -> bool:
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception:  # noqa: BLE001 - any checker complaint is a "no"
        return False
    return True


def one_line(exc: BaseException, limit: int = 200) -> str:
    """The error on one line; ORT's status prefix is dropped so the part that says what is wrong fits."""
    text = " ".join(str(exc).split())
    text = text.split("] : ", 1)[-1] if text.startswith("[ONNXRuntimeError]") else text
    text = f"{type(exc).__name__}: {text}"
    return "error: " + (text if len(text) <= limit else text[: limit - 3] + "...")


@dataclass(frozen=True)
class Reference:
    """The original model's op counts and outputs, computed once per model and shared by every tool."""

    ops: Counter
    feeds: dict[str, np.ndarray]
    outputs: list[np.ndarray]


def reference(path: Path) -> Reference:
    model = onnx.load(str(path))
    sess = session(model)
    feeds = random_inputs(sess)
    return Reference(op_counts(model), feeds, sess.run(None, feeds))


def measure(tool: str, case: Case, ref: Reference) -> Outcome:
    outcome = Outcome(tool=tool, model=case.name)
    try:
        with quiet():
            start = time.perf_counter()
            result = TOOLS[tool](case.path, case.decoder)
            outcome.seconds = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - a crashing tool is a result, not a reason to stop
        outcome.error, outcome.errors, outcome.tool_failed = one_line(exc), 1, True
        return outcome
    ops = op_counts(result)
    outcome.fused = Counter({op: n for op, n in ops.items() if op in NORM_OPS})
    outcome.reduce_mean_left = ops.get("ReduceMean", 0) + ops.get("GlobalAveragePool", 0)  # tf2onnx's means
    outcome.new_ops = Counter({op: n for op, n in ops.items() if op not in NORM_OPS and op not in ref.ops})
    outcome.checker_ok = checker_passes(result)
    outcome.checker_passes = int(outcome.checker_ok)
    try:
        with quiet():
            outcome.max_diff = max_abs_diff(ref.outputs, session(result).run(None, ref.feeds))
    except Exception as exc:  # noqa: BLE001 - e.g. the result does not load in ORT
        outcome.error, outcome.errors = one_line(exc).replace("error:", "error (running result):", 1), 1
    return outcome


def merge(outcomes: list[Outcome], name: str) -> Outcome:
    """Sum a group (the backend cases) into one row: totals, the worst difference, passes out of cases."""
    total = Outcome(tool=outcomes[0].tool, model=name, cases=len(outcomes))
    for o in outcomes:
        total.seconds += o.seconds
        total.fused += o.fused
        total.reduce_mean_left += o.reduce_mean_left
        total.new_ops += o.new_ops
        total.checker_passes += o.checker_passes
        total.errors += o.errors
        if o.max_diff is not None:
            total.max_diff = max(total.max_diff or 0.0, o.max_diff)
        total.error = total.error or o.error
    return total


# =========================================================================== the models


def sample_cases(samples: Path) -> list[Case]:
    return [Case(p.stem, p, is_decoder(p.name), p.stem) for p in sorted(samples.glob("*.onnx"))]


def big_cases(models: Path) -> list[Case]:
    return [Case(Path(n).stem, models / n, is_decoder(n), Path(n).stem) for n in BIG_MODELS if (models / n).exists()]


def is_decoder(name: str) -> bool:
    return "llama" in name or "gpt2" in name


def backend_cases(folder: Path) -> list[Case]:
    """The expanded (function-body) LayerNormalization/RMSNormalization cases, written to files for the tools."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # collecting every case computes expected outputs, some overflow on purpose
        from onnx.backend.test.case.node import collect_testcases

        found = collect_testcases(None)
    chosen = sorted((c for c in found if ("layer_normalization" in c.name or "rms_normalization" in c.name)
                     and c.name.endswith(("_expanded", "_expanded_ver18"))), key=lambda c: c.name)
    cases = []
    for c in chosen:
        path = folder / f"{c.name}.onnx"
        onnx.save(c.model, str(path))
        cases.append(Case(c.name, path, False, BACKEND_GROUP))
    return cases


# =========================================================================== other exporters (issue 12)
# The committed samples of make_exporter_samples.py (tf2onnx/Keras, channels-first norms, HF Swin and ViTDet) are
# rows like every other sample. onnxscript's code-form test models are too big to commit: they are written here,
# the whisper ones with random weights, SmolLM (671 MB) with sparse zero weights (the tools fuse the graph; the
# outputs still compare). Phi-2 (1.4 GB) and Phi-4 (6.8 GB) only with --onnxscript-all.
ONNXSCRIPT_CASES = {"_whisper_encoder": 1 << 30, "_whisper_decoder": 1 << 30, "_smollm_1": 64 * 1024}
ONNXSCRIPT_BIG = {"_phi2lm": 64 * 1024, "_phi4lm": 64 * 1024}


def onnxscript_cases(folder: Path, every: bool) -> list[Case]:
    """Written into one folder whose relative external data the results reference: run them from that folder."""
    import sys

    sys.path.insert(0, str(REPO / "sample_models"))
    from make_exporter_samples import onnxscript_model

    chosen = {**ONNXSCRIPT_CASES, **(ONNXSCRIPT_BIG if every else {})}
    cases = []
    for name, inline in chosen.items():
        path = onnxscript_model(name, folder, seed=0, inline_bytes=inline)
        label = f"onnxscript{name}"
        cases.append(Case(label, path, "whisper_encoder" not in name, label))
    return cases


def warm_up(tools: list[str], cases: list[Case]) -> None:
    """One untimed run per tool, so the first timed model does not pay for imports and first-session setup."""
    for case in cases:
        for tool in tools:
            with contextlib.suppress(Exception), quiet():
                TOOLS[tool](case.path, case.decoder)


def run_all(cases: Iterable[Case], tools: list[str], progress: bool) -> list[Outcome]:
    rows: list[Outcome] = []
    grouped: dict[tuple[str, str], list[Outcome]] = {}
    for case in cases:
        try:
            ref = reference(case.path)
        except Exception as exc:  # noqa: BLE001 - without the original's outputs no tool can be judged
            failure = one_line(exc).replace("error:", "error (original does not run):", 1)
            rows += [Outcome(tool, case.name, error=failure, tool_failed=True, errors=1) for tool in tools]
            continue
        for tool in tools:
            outcome = measure(tool, case, ref)
            if progress:
                print(f"  {case.name:45s} {tool:18s} {outcome.seconds:7.2f} s {outcome.error or ''}", flush=True)
            if case.group == case.name:
                rows.append(outcome)
            else:
                grouped.setdefault((case.group, tool), []).append(outcome)
    rows += [merge(outs, group) for (group, _tool), outs in grouped.items()]
    return rows


# =========================================================================== the table


def fused_text(fused: Counter) -> str:
    return ", ".join(f"{NORM_OPS[op]} {n}" for op, n in sorted(fused.items(), key=lambda kv: NORM_OPS[kv[0]])) or "-"


def new_ops_text(ops: Counter, limit: int = 4) -> str:
    items = sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{op} {n}" for op, n in items[:limit])
    return (text + (f", +{len(items) - limit} more" if len(items) > limit else "")) or "-"


def row_cells(o: Outcome) -> list[str]:
    if o.tool_failed:
        return [o.model, o.tool, "", o.error or "error"]  # nothing else to show
    checker = ("yes" if o.checker_ok else "no") if o.cases == 1 else f"{o.checker_passes}/{o.cases}"
    diff = "-" if o.max_diff is None else f"{o.max_diff:.2e}"
    errors = "" if not o.errors else (o.error or "") if o.cases == 1 else f"{o.errors} error(s), first: {o.error}"
    return [o.model, o.tool, f"{o.seconds:.2f}", fused_text(o.fused), str(o.reduce_mean_left), diff, checker,
            new_ops_text(o.new_ops), errors]


def _join(cells: list[str], widths: list[int]) -> str:
    if len(cells) == 4:  # a failed tool: its error spans the remaining columns
        return "  ".join(c.ljust(w) for c, w in zip(cells[:3], widths)) + cells[3]
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def print_table(rows: list[Outcome]) -> None:
    header = ["model", "tool", "time s", "fused norm ops", "RM left", "max|diff|", "checker", "other new ops", ""]
    cells = [row_cells(o) for o in rows]
    full = [header] + [r for r in cells if len(r) == len(header)]
    widths = [max(len(r[i]) for r in full + [r for r in cells if i < 3]) for i in range(len(header) - 1)] + [0]
    print(_join(header, widths))
    for i, r in enumerate(cells):
        if i and r[0] != cells[i - 1][0]:
            print()  # a blank line between models keeps the tools of one model together
        print(_join(r, widths))
    print("\nlegend: " + ", ".join(f"{short}={op}" for op, short in NORM_OPS.items()))
    print("RM left = ReduceMean (and GlobalAveragePool) nodes left; "
          "checker = onnx.checker full_check (n/cases for the backend group)")


def print_markdown(rows: list[Outcome], tools: list[str]) -> None:
    """One row per model, one column per tool: the fused norm ops, then the ReduceMean left (the README table)."""
    models = list(dict.fromkeys(o.model for o in rows))
    cell = {(o.model, o.tool): o for o in rows}
    print("| model | " + " | ".join(tools) + " |")
    print("|---|" + "---|" * len(tools))
    for model in models:
        cells = []
        for tool in tools:
            o = cell.get((model, tool))
            if o is None or o.tool_failed:
                cells.append("error")
                continue
            text = f"{fused_text(o.fused)} (RM {o.reduce_mean_left})"
            if o.max_diff is not None and o.max_diff > WRONG:
                text += f" **wrong: differs by {o.max_diff:.2g}**"
            cells.append(text + (" **error**" if o.errors else ""))
        print(f"| {model} | " + " | ".join(cells) + " |")


def to_json(rows: list[Outcome]) -> str:
    return json.dumps([{**asdict(o), "fused": dict(o.fused), "new_ops": dict(o.new_ops)} for o in rows], indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=DEFAULT_MODELS, help="folder of make_models.py's output")
    parser.add_argument("--samples", type=Path, default=REPO / "sample_models")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of: " + ", ".join(TOOLS))
    parser.add_argument("--quick", action="store_true", help="skip BERT-base and LLaMA-small")
    parser.add_argument("--no-backend", action="store_true", help="skip the 57 ONNX backend cases")
    parser.add_argument("--json", type=Path, help="also write every row as JSON")
    parser.add_argument("--progress", action="store_true", help="print each run as it finishes (to stdout)")
    parser.add_argument("--markdown", action="store_true", help="also print a model x tool Markdown table")
    parser.add_argument("--no-onnxscript", action="store_true", help="skip onnxscript's code-form models")
    parser.add_argument("--onnxscript-all", action="store_true", help="add onnxscript's Phi-2 and Phi-4 (8 GB)")
    parser.add_argument("--only-models", help="comma-separated substrings: keep the models whose name has one")
    args = parser.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    unknown = set(tools) - set(TOOLS)
    if unknown:
        parser.error(f"unknown tool(s): {', '.join(sorted(unknown))}")
    ort.set_default_logger_severity(3)  # ORT's C++ warnings (e.g. unused initializers) are not results
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="lnfuse-backend-") as tmp:
        cases = sample_cases(args.samples) + ([] if args.quick else big_cases(args.models))
        cases += [] if args.no_backend else backend_cases(Path(tmp))
        extra = [] if args.no_onnxscript else onnxscript_cases(Path(tmp) / "onnxscript", args.onnxscript_all)
        if args.only_models:
            keep = args.only_models.split(",")
            cases, extra = ([c for c in group if any(k in c.name for k in keep)] for group in (cases, extra))
        warm_up(tools, [c for c in cases if c.name in ("bert_tiny_legacy_op14", "llama_tiny_legacy_op14")])
        cpu_start = cpu_snapshot()
        start = time.perf_counter()
        rows = run_all(cases, tools, args.progress)
        if extra:
            with contextlib.chdir(Path(tmp) / "onnxscript"):  # the results reference their data files by name
                rows += run_all(extra, tools, args.progress)
    print_table(rows)
    print(f"total {time.perf_counter() - start:.0f} s; inputs: batch {BATCH}, sequence {SEQUENCE}, ids in 0..1, "
          f"masks of ones; ORT {ort.__version__}, onnx {onnx.__version__}")
    print(competition_note(cpu_start))
    if args.markdown:
        print()
        print_markdown(rows, tools)
    if args.json:
        args.json.write_text(to_json(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
