"""Shared by the ``make_<framework>.py`` scripts: save one exported model and the framework's own numbers for it.

Each model goes to ``sample_models/frameworks/<framework>/<name>.onnx`` with a sibling ``<name>.npz`` holding
``input_names`` (the ONNX graph input names, in order), ``input_0``, ``input_1``, ... (one input batch) and
``expected`` (the framework's own output for that batch, computed by the framework, not by ONNX Runtime).
``<framework>/versions.json`` records the versions the files were made with.

Only numpy and onnx are needed here (every framework venv has them); onnxruntime is used when present to check that
the saved file reproduces the framework's output before anything is kept.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent
MAX_BYTES = 1 << 20
SEED = 20  # issue 20


def perturbed(rng: np.random.Generator, shape, centre: float) -> np.ndarray:
    """A norm weight (centre 1) or bias (centre 0) moved off its initial value, so a fusion that drops or swaps
    them shows in the numbers."""
    return (centre + rng.normal(0.0, 0.3, shape)).astype(np.float32)


def _scrub(proto: onnx.ModelProto) -> None:
    """Drop what names this machine (absolute paths in doc strings and metadata); keep every node as written."""
    graphs = [proto.graph] + [a.g for n in proto.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
    for graph in graphs:
        for node in graph.node:
            if "/" in node.doc_string:
                node.doc_string = ""
            kept = [p for p in node.metadata_props if "stack" not in p.key and "/" not in p.value]
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
    if "/" in proto.doc_string:
        proto.doc_string = ""


def save(framework: str, name: str, proto: onnx.ModelProto, inputs: list[np.ndarray], expected: np.ndarray,
         tol: float = 1e-4) -> Path:
    """Write the model and its npz; check size, the checker and (when installed) ONNX Runtime against
    ``expected``. Raises when ORT does not reproduce the framework."""
    folder = ROOT / framework
    folder.mkdir(parents=True, exist_ok=True)
    _scrub(proto)
    path = folder / f"{name}.onnx"
    onnx.save_model(proto, str(path))
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise AssertionError(f"{path.name}: {size} bytes, over 1 MB")
    saved = onnx.load(str(path))
    names = [i.name for i in saved.graph.input
             if i.name not in {t.name for t in saved.graph.initializer}]
    if len(names) != len(inputs):
        raise AssertionError(f"{name}: graph inputs {names}, {len(inputs)} arrays given")
    expected = np.asarray(expected)
    np.savez(folder / f"{name}.npz", input_names=np.array(names),
             **{f"input_{i}": np.asarray(a) for i, a in enumerate(inputs)}, expected=expected)
    try:
        onnx.checker.check_model(saved, full_check=True)
        checker = "ok"
    except Exception as exc:  # recorded, not fatal: the data is what the exporter wrote
        checker = f"FAILS ({str(exc).splitlines()[0][:80]})"
    status = "ORT not installed"
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    if ort is not None:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        got = sess.run(None, dict(zip(names, inputs)))[0]
        err = float(np.abs(got.astype(np.float64) - expected.astype(np.float64)).max())
        if got.shape != expected.shape or not np.isfinite(got).all() or err > tol:
            raise AssertionError(f"{framework}/{name}: ORT differs from the framework by {err} "
                                 f"(shapes {got.shape} {expected.shape})")
        status = f"max|ort-ref| {err:.1e}"
    ops: dict[str, int] = {}
    for node in saved.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    print(f"{framework}/{name:28} opset {saved.opset_import[0].version:2}  nodes {len(saved.graph.node):3}  "
          f"{size / 1024:5.1f} kB  checker {checker}  {status}", flush=True)
    return path


def save_or_record(failed: dict[str, str], framework: str, name: str, proto: onnx.ModelProto,
                   inputs: list[np.ndarray], expected: np.ndarray, tol: float = 1e-4) -> None:
    """``save``; when the exporter's output is wrong (ORT refuses it or computes other numbers), keep no file and
    record why in ``failed`` (written to versions.json as ``not kept: <name>``)."""
    try:
        save(framework, name, proto, inputs, expected, tol)
    except Exception as exc:
        failed[name] = str(exc).splitlines()[0].replace(str(ROOT) + "/", "")[:300]
        for suffix in (".onnx", ".npz"):
            (ROOT / framework / f"{name}{suffix}").unlink(missing_ok=True)
        print(f"{framework}/{name}: NOT KEPT: {failed[name]}", flush=True)


def write_versions(framework: str, versions: dict[str, str], failed: dict[str, str] | None = None) -> None:
    folder = ROOT / framework
    folder.mkdir(parents=True, exist_ok=True)
    record = {"python": platform.python_version(), "numpy": np.__version__, "onnx": onnx.__version__}
    try:
        import onnxruntime
        record["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    record.update(versions)
    record.update({f"not kept: {k}": v for k, v in (failed or {}).items()})
    (folder / "versions.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(framework, record, file=sys.stderr)
