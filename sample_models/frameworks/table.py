"""Print the framework zoo's table for docs/exporters.md: framework × exporter × norm kind → what lnfuse writes
today, or why it leaves the norm (the deciding reason ``lnfuse explain`` gives).

Needs only lnfuse (and onnx); from the repo root:
    python sample_models/frameworks/table.py            # markdown table, then the versions of each folder
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent.parent))
import lnfuse  # noqa: E402

FOLDERS = {  # folder: (framework, exporter, the versions.json keys that say which framework and exporter)
    "jax2onnx": ("JAX (Flax nnx/linen, Equinox, jnp)", "jax2onnx", ("jax", "flax", "equinox", "jax2onnx")),
    "jax2tf": ("JAX (Flax linen, Equinox)", "jax2tf + tf2onnx", ("jax", "flax", "equinox", "tf2onnx")),
    "keras3": ("Keras 3", "tf2onnx", ("tensorflow", "keras", "tf2onnx")),
    "tf_keras": ("tf-keras (Keras 2)", "tf2onnx", ("tensorflow", "tf_keras", "tf2onnx")),
    "keras_hub": ("Keras 3 + keras-hub", "model.export (tf2onnx, jax2onnx, torch)",
                  ("keras", "keras_hub", "tensorflow", "tf2onnx", "jax", "jax2onnx", "torch")),
    "paddle": ("PaddlePaddle", "paddle2onnx", ("paddlepaddle", "paddle2onnx")),
    "mindspore": ("MindSpore", "mindspore.export", ("mindspore",)),
    "spox": ("spox", "(builds ONNX)", ("spox",)),
    "onnxscript": ("onnxscript", "(builds ONNX)", ("onnxscript",)),
}
NORM_OPS = {"LayerNormalization": "LN", "SimplifiedLayerNormalization": "SLN", "RMSNormalization": "RMS",
            "SkipLayerNormalization": "SkipLN", "SkipSimplifiedLayerNormalization": "SkipSLN",
            "EmbedLayerNormalization": "EmbedLN"}
STATISTICS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "GlobalAveragePool", "BatchNormalization")


def kind(name: str) -> str:
    for key, label in (("gpt_neox", "LNs sharing statistics"), ("position_", "sliced table, not 0..S-1"),
                       ("bert", "embedding + LN"), ("gpt2", "embedding + LN"), ("token_and", "embedding + LN"),
                       ("rms_scaling", "not a norm (rms_scaling)"), ("residual", "residual + LN"),
                       ("embedding", "embedding + LN"), ("channels_first", "channels-first LN"),
                       ("rmsnorm", "RMSNorm"), ("layernorm", "LayerNorm")):
        if key in name:
            return label
    return "?"


def counts(model: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in model.graph.node:
        out[node.op_type] = out.get(node.op_type, 0) + 1
    return out


def row(path: Path) -> list[str]:
    name = path.stem
    before, result = counts(onnx.load(path)), lnfuse.fuse(path)
    after = counts(result.model)
    written = ", ".join(f"{NORM_OPS[op]} {n}" for op, n in after.items() if op in NORM_OPS) or "-"
    native = sum(before.get(op, 0) for op in NORM_OPS)
    left = sum(after.get(op, 0) for op in STATISTICS)
    label = kind(name)
    wanted = {"residual + LN": "Skip", "embedding + LN": "Embed"}.get(label)
    reason = ""
    left_alone = result.report.unfused or [u for u in result.report.kept if u.rule == "embed_norm"]
    if left_alone:
        deciding = [u for u in left_alone if u.rule != "skip_norm" or u.check != "shape"]
        u = (deciding or left_alone)[0]
        reason = f"[{u.rule}/{u.check}] {u.reason}"
        reason = reason if len(reason) <= 110 else reason[:107] + "..."
    if label.startswith("sliced table"):
        status = "**EmbedLN of a slice that is no 0..S-1**" if "EmbedLN" in written else \
            "norm fused, rightly no EmbedLN" + (f": {reason}" if reason else "") if left == 0 else f"**left**: {reason}"
    elif label.startswith("not a norm"):
        status = f"refused, rightly: {reason}" if not written.strip("-") else "**fused a non-norm**"
    elif left == 0 and (wanted is None or wanted in written):
        status = "already native" if not result.report.fused and native else "fused"
    elif left == 0:
        status = f"norm fused, {label.split(' +')[0]} not: " + (reason or "no candidate named")
    else:
        status = "**left**: " + (reason or "explain: no normalization-like candidates")
    return [path.parent.name, name, label, written, status]


def main() -> None:
    rows, versions = [], {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).glob("*.onnx")):
            rows.append(row(path))
        record = json.loads((ROOT / folder / "versions.json").read_text())
        versions[folder] = record
    print(f"lnfuse {lnfuse.__version__}, {datetime.date.today().isoformat()}; target ort (the default)\n")
    print("| framework | exporter | model | norm kind | lnfuse writes | result |")
    print("|---|---|---|---|---|---|")
    for folder, name, label, written, status in rows:
        framework, exporter, _keys = FOLDERS[folder]
        print(f"| {framework} | {exporter} | `{folder}/{name}` | {label} | {written} | {status} |")
    print("\nVersions (each folder's versions.json):\n")
    for folder, record in versions.items():
        keys = FOLDERS[folder][2]
        made = ", ".join(f"{k} {record[k]}" for k in keys if k in record)
        print(f"- `{folder}`: {made}; onnx {record.get('onnx')}, onnxruntime {record.get('onnxruntime')}")
        for key, value in record.items():
            if key.startswith("not kept: "):
                print(f"  - not kept, `{key[len('not kept: '):]}`: {value}")


if __name__ == "__main__":
    main()
