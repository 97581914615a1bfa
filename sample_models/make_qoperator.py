"""Float samples quantized by ONNX Runtime's own quantizer in QOperator format, the other layout of
``quantize_static``: each quantizable op becomes its QLinear form (``QLinearAdd``, ``QLinearMul``,
``QLinearMatMul``...), which reads and writes 8-bit values, instead of a QuantizeLinear/DequantizeLinear pair around a
float op. Inside a decomposed norm the epsilon Add (and gamma's Mul, beta's Add, LLaMA's ``x * 1/σ``) become QLinear
ops, while ReduceMean, Sub, Pow, Sqrt and Div stay float between a DequantizeLinear and a QuantizeLinear.

    pip install -e '.[test]' && python sample_models/make_qoperator.py

(made with onnxruntime 1.32.0, onnx 1.23.2, numpy 2.4.6; no torch: the inputs are the float samples next to this
file). Writes into ``sample_models/qoperator/``:

* ``{bert,gpt2,llama,vit}_qop_per_tensor.onnx``   ``quantize_static(..., quant_format=QuantFormat.QOperator)``, every
  op type the quantizer knows (its default), activations uint8, weights int8, one scale per tensor;
* ``{bert,llama}_qop_per_channel.onnx``           the same with ``per_channel=True`` (a scale per output channel of
  each weight);
* ``bert_qop_matmul_only.onnx``                   ``op_types_to_quantize=["MatMul"]``: the norms stay float, their
  outputs are quantized for the QLinearMatMul that reads them (a rounding after the norm, not inside it);
* ``llama_qop_mul_only.onnx``                     ``op_types_to_quantize=["Mul"]``: the epsilon Add stays float, the
  RMS norm's 1/σ is quantized for the QLinearMul that scales x by it (the rounding is at the division);
* ``gpt2_fused_then_qop.onnx``                    lnfuse first (``--target onnx --upgrade-opset``: five
  LayerNormalization at opset 17), then the same QOperator quantization: the norms are single float ops between a
  DequantizeLinear and a QuantizeLinear. (With ``--target ort`` the fused model holds EmbedLayerNormalization, which
  the quantizer turns into a QEmbedLayerNormalization ONNX Runtime refuses to load: docs/quantized.md.)

Calibration reads 8 batches of random inputs (ids below the vocabulary, images from a normal distribution) from a
fixed seed, so a rerun writes the same files.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

import lnfuse
from checked import save_checked

HERE = Path(__file__).resolve().parent
OUT = HERE / "qoperator"
BATCH, SEQ = 2, 8


def _text(rng: np.random.Generator, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Token ids below the samples' vocabulary (100), token types 0/1, a full attention mask."""
    found = {"input_ids": rng.integers(0, 100, (BATCH, SEQ), dtype=np.int64),
             "token_type_ids": rng.integers(0, 2, (BATCH, SEQ), dtype=np.int64),
             "attention_mask": np.ones((BATCH, SEQ), dtype=np.int64)}
    return {name: found[name] for name in names}


def _image(rng: np.random.Generator, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The ViT sample's trained size: 3 channels, 32 x 32 (its position table has 4 * 4 + 1 rows)."""
    return {names[0]: rng.standard_normal((BATCH, 3, 32, 32)).astype(np.float32)}


@dataclass(frozen=True)
class Source:
    short: str
    float_file: str
    inputs: Callable[[np.random.Generator, tuple[str, ...]], dict[str, np.ndarray]]


SOURCES = {s.short: s for s in (Source("bert", "bert_tiny_legacy_op14.onnx", _text),
                                Source("gpt2", "gpt2_tiny_legacy_op14.onnx", _text),
                                Source("llama", "llama_tiny_legacy_op14.onnx", _text),
                                Source("vit", "wm_vit_legacy_op14.onnx", _image))}


class _Calibration(CalibrationDataReader):
    def __init__(self, source: Source, names: tuple[str, ...]):
        rng = np.random.default_rng(0)
        self.batches = iter([source.inputs(rng, names) for _ in range(8)])

    def get_next(self):
        return next(self.batches, None)


def quantize(source: Source, model: Path, out: Path, **options) -> None:
    """``quantize_static`` in QOperator format with the calibration above; ``options`` as the quantizer takes them."""
    names = tuple(i.name for i in onnx.load(model).graph.input)
    quantize_static(model, out, _Calibration(source, names), quant_format=QuantFormat.QOperator,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, **options)
    save_checked(onnx.load(out), out)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for source in SOURCES.values():
        quantize(source, HERE / source.float_file, OUT / f"{source.short}_qop_per_tensor.onnx")
    for short in ("bert", "llama"):
        source = SOURCES[short]
        quantize(source, HERE / source.float_file, OUT / f"{short}_qop_per_channel.onnx", per_channel=True)
    bert = SOURCES["bert"]
    quantize(bert, HERE / bert.float_file, OUT / "bert_qop_matmul_only.onnx", op_types_to_quantize=["MatMul"])
    llama = SOURCES["llama"]
    quantize(llama, HERE / llama.float_file, OUT / "llama_qop_mul_only.onnx", op_types_to_quantize=["Mul"])
    gpt2 = SOURCES["gpt2"]
    with tempfile.TemporaryDirectory() as tmp:
        fused = Path(tmp) / "gpt2_fused.onnx"
        lnfuse.fuse(str(HERE / gpt2.float_file), target="onnx", upgrade_opset=True).save(fused)
        quantize(gpt2, fused, OUT / "gpt2_fused_then_qop.onnx")


if __name__ == "__main__":
    main()
