"""Fuse, then quantize, or the other way round: what each order of lnfuse and ONNX Runtime's quantizer gives on
the tiny BERT of sample_models/make_quantized.py (the table in docs/quantized.md).

    pip install -e '.[export]' && python benchmarks/quantize_order.py

Each row: the fused norm ops, the ReduceMean and QuantizeLinear nodes left, and the worst difference of the output
to the float model's, on batch 2, sequence 8 (ORT CPU, default session options).
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sample_models"))
import lnfuse  # noqa: E402
from make_quantized import _Calibration, _inputs, export_float  # noqa: E402

#: ORT's quantizer cannot infer types through com.microsoft ops; this is the tensor type it should assume
UNTYPED = {"DefaultTensorType": onnx.TensorProto.FLOAT}
SHOWN = ("EmbedLayerNormalization", "QEmbedLayerNormalization", "SkipLayerNormalization", "LayerNormalization",
         "ReduceMean", "QuantizeLinear", "MatMulInteger")


def pipelines(tmp: Path, fp32: Path) -> dict[str, Path]:
    def out(name: str) -> Path:
        return tmp / f"{name}.onnx"

    lnfuse.fuse(fp32).save(out("fused"))
    lnfuse.fuse(fp32, quantize_embeddings="uint8").save(out("fused_qembed"))
    quantize_dynamic(fp32, out("dynamic"), weight_type=QuantType.QInt8)
    lnfuse.fuse(out("dynamic")).save(out("dynamic_fused"))
    quantize_dynamic(out("fused"), out("fused_dynamic"), weight_type=QuantType.QInt8, extra_options=UNTYPED,
                     op_types_to_quantize=["MatMul", "Attention", "Gather"])
    quantize_dynamic(out("fused_qembed"), out("fused_qembed_dynamic"), weight_type=QuantType.QInt8,
                     extra_options=UNTYPED)
    static = dict(quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    quantize_static(fp32, out("qdq"), _Calibration(), **static)
    quantize_static(out("fused"), out("fused_qdq"), _Calibration(), extra_options=UNTYPED, **static)
    # the same without the types lnfuse declares for the values it writes: what the quantizer does without them
    untyped = onnx.load(out("fused"))
    del untyped.graph.value_info[:]
    onnx.save(untyped, out("fused_untyped"))
    quantize_static(out("fused_untyped"), out("fused_untyped_qdq"), _Calibration(), extra_options=UNTYPED, **static)
    return {
        "quantize_dynamic only": out("dynamic"),
        "quantize_dynamic, then lnfuse": out("dynamic_fused"),
        "lnfuse, then quantize_dynamic (MatMul, Attention, Gather)": out("fused_dynamic"),
        "lnfuse --quantize-embeddings uint8, then quantize_dynamic": out("fused_qembed_dynamic"),
        "quantize_static QDQ only": out("qdq"),
        "lnfuse, then quantize_static QDQ": out("fused_qdq"),
        "lnfuse, value_info removed, then quantize_static QDQ": out("fused_untyped_qdq"),
    }


def main() -> None:
    feeds = _inputs(np.random.default_rng(5))
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        fp32 = tmp / "fp32.onnx"
        export_float(fp32)
        run = lambda path: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]  # noqa: E731
        reference = run(fp32)
        for name, path in pipelines(tmp, fp32).items():
            counts = Counter(n.op_type for n in onnx.load(path).graph.node)
            ops = ", ".join(f"{op} {counts[op]}" for op in SHOWN if counts[op])
            print(f"{name:60s} {ops:75s} worst difference {np.abs(run(path) - reference).max():.4f}")
    print(f"onnxruntime {ort.__version__}")


if __name__ == "__main__":
    main()
