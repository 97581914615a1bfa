"""The quantized zoo (sample_models/quantized/, made by sample_models/make_quantized_zoo.py) through every
norm-fusing optimizer, in one run: the table of docs/quantized.md (issue 28).

    python benchmarks/quantized_recipes.py

For each model and recipe, and each tool: the norms fused (fused norm ops in the result), how many of the values
entering quantizers moved (a value a QuantizeLinear, DynamicQuantizeLinear, MatMulNBits at accuracy_level 4 or a
QOperator op reads, compared bit for bit by name on 16 input sets of batch 1..3 and sequence 3..10, or gone from
the result), and the worst absolute difference of the outputs. Both models run in ONNX Runtime with graph
optimizations off, so ORT fuses nothing for either. Tools (the runners of benchmarks/compare.py where it has them):

* ``lnfuse``                 ``lnfuse.fuse(path)``: the default policy
* ``lnfuse --allow-req.``    ``lnfuse.fuse(path, allow_requantization=True)``
* ``ORT C++``                a session at ORT_ENABLE_EXTENDED writing ``optimized_model_filepath``
* ``ORT python 0``           ``optimize_model(model_type='bert'|'gpt2', opt_level=0)``: Python fusions only
* ``ORT python``             ``optimize_model`` at its default level for the model type (ORT's basic optimizations
                             first, then the Python fusions)
* ``onnxscript rules``       onnxscript's layer_normalization_rules and rms_normalization_rules
* ``onnxscript ort_fusions`` ``onnxscript.rewriter.ort_fusions.optimize_for_ort``

A tool that raises gets ``crash (ExceptionClass)`` (and the module, for a missing one); a result ONNX Runtime does not
load, ``unloadable``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np
import onnx
import onnxruntime as ort

# Run as a script, so this folder is on sys.path: the tools are compare.py's
from compare import (NORM_OPS, is_decoder, op_counts, quiet, run_onnxscript_ort, run_onnxscript_rules,
                     run_ort_cpp, run_ort_transformers)

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "sample_models")]
import lnfuse  # noqa: E402
from make_quantized_zoo import HERE as SAMPLES, RECIPES, SOURCES, ZOO, zoo_name  # noqa: E402
from quantizers import INPUT_SETS, exposing, input_sets, session, watches  # noqa: E402


def run_lnfuse(path: Path, decoder: bool) -> onnx.ModelProto:
    return lnfuse.fuse(path).model


def run_lnfuse_allowing(path: Path, decoder: bool) -> onnx.ModelProto:
    return lnfuse.fuse(path, allow_requantization=True).model


def run_ort_python_default(path: Path, decoder: bool) -> onnx.ModelProto:
    from onnxruntime.transformers.optimizer import optimize_model

    return optimize_model(str(path), model_type="gpt2" if decoder else "bert", num_heads=0, hidden_size=0).model


TOOLS: Mapping[str, Callable[[Path, bool], onnx.ModelProto]] = MappingProxyType({
    "lnfuse": run_lnfuse,
    "lnfuse --allow-req.": run_lnfuse_allowing,
    "ORT C++": run_ort_cpp,
    "ORT python 0": run_ort_transformers,
    "ORT python": run_ort_python_default,
    "onnxscript rules": run_onnxscript_rules,
    "onnxscript ort_fusions": run_onnxscript_ort,
})


def norms_fused(model: onnx.ModelProto) -> int:
    counts = op_counts(model)
    return sum(counts[op] for op in NORM_OPS)


def measure(original: onnx.ModelProto, path: Path, tool: str, decoder: bool,
            sets: list[dict[str, np.ndarray]], reference: list[dict[str, np.ndarray]]) -> str:
    """One cell: ``fused / moved of watched / worst difference``, or why there is none."""
    try:
        with quiet():
            result = TOOLS[tool](path, decoder)
    except Exception as error:  # noqa: BLE001 - a crashing tool is a result
        missing = f": {error.name}" if isinstance(error, ImportError) and error.name else ""
        return f"crash ({type(error).__name__}{missing})"
    fused = norms_fused(result) - norms_fused(original)
    watched = watches(original, result)
    try:
        sess = session(exposing(result, {w.after for w in watched if w.after}), optimized=False)
    except Exception:  # noqa: BLE001 - ORT refuses the model it was given
        return f"{fused} / unloadable"
    moved: dict[str, bool] = {}
    worst = 0.0
    outputs = [o.name for o in original.graph.output]
    for feed, want in zip(sets, reference, strict=True):
        try:
            got = dict(zip((o.name for o in sess.get_outputs()), sess.run(None, feed)))
        except Exception:  # noqa: BLE001 - it loads but does not run
            return f"{fused} / fails to run"
        for w in watched:
            if not np.issubdtype(want[w.before].dtype, np.floating):
                continue
            same = w.after is not None and want[w.before].shape == got[w.after].shape \
                and want[w.before].tobytes() == got[w.after].tobytes()
            moved[w.before] = moved.get(w.before, False) or not same
        for name in outputs:
            worst = max(worst, float(np.max(np.abs(got[name].astype(np.float64) - want[name].astype(np.float64)))))
    quantized = f"{sum(moved.values())} of {len(moved)}" if moved else "-"
    return f"{fused} / {quantized} / {worst:.1e}"


def norms_present(source: str) -> int:
    """What lnfuse finds and fuses in the float source: every norm it has."""
    report = lnfuse.fuse(SAMPLES / f"{source}.onnx").report
    return sum(c.fused for c in report.candidates)


def main() -> int:
    ort.set_default_logger_severity(3)  # ORT's C++ warnings (e.g. unused initializers) are not results
    logging.disable(logging.WARNING)
    start = time.perf_counter()
    print("| model | recipe | norms | " + " | ".join(TOOLS) + " |")
    print("|---|---|---|" + "---|" * len(TOOLS))
    for source in SOURCES:
        present = norms_present(source)
        for recipe in RECIPES:
            path = ZOO / zoo_name(source, recipe)
            original = onnx.load(path)
            sets = input_sets(original)
            watch_all = {w.before for w in watches(original, original)}
            reference_session = session(exposing(original, watch_all), optimized=False)
            names = [o.name for o in reference_session.get_outputs()]
            reference = [dict(zip(names, reference_session.run(None, feed))) for feed in sets]
            cells = [measure(original, path, tool, is_decoder(source), sets, reference) for tool in TOOLS]
            print(f"| {source.split('_')[0]} | {recipe} | {present} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nEach cell: norms fused / values entering quantizers moved, of those the model quantizes (\"-\": none) "
          f"/ worst output difference, on {INPUT_SETS} input sets; {time.perf_counter() - start:.0f} s; "
          f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, lnfuse {lnfuse.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
