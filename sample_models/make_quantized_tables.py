"""Models whose embedding tables ONNX Runtime's quantizer already made 8-bit, in both orders it writes them, from
the float exports next to this file (torch 2.13.0's TorchScript exporter, see make_samples.py and
make_hf_samples.py):

* ``bert_tiny_qdq_gather_int8_op14.onnx``: ``quantize_static`` in QDQ format with only ``Gather`` quantized,
  activations int8: ``DequantizeLinear(int8 table) -> Gather`` (and an exact Q/DQ pair after each lookup); the
  norms, gamma and beta stay float.
* ``bert_tiny_qdq_gather_matmul_op14.onnx``: the same with ``MatMul`` quantized too, uint8 activations: the
  embedding norm's output is quantized by a QuantizeLinear in front of the first MatMuls.
* ``hf_distilbert_dynamic_int8_op14.onnx``: ``quantize_dynamic`` (its default op types, ``Gather`` among them):
  ``Gather(uint8 table) -> DequantizeLinear``, word and position tables only.
* ``roberta_tiny_dynamic_int8_op14.onnx``: ``quantize_dynamic`` of the RoBERTa export, whose positions are computed
  from the ids (not 0..S-1).

(``bert_tiny_dynamic_int8_op14.onnx``, ``quantize_dynamic`` of a BERT with segment embeddings, is made by
make_quantized.py.)

    pip install onnx==1.23.2 onnxruntime==1.32.0 numpy==2.4.6 && python sample_models/make_quantized_tables.py

Calibration reads 4 batches of random ids (batch 2, sequence 8) from a fixed seed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic,
                                      quantize_static)

from checked import save_checked

HERE = Path(__file__).resolve().parent
VOCAB, SEQ = 100, 8


class _Calibration(CalibrationDataReader):
    def __init__(self, model: onnx.ModelProto):
        rng = np.random.default_rng(0)
        names = [i.name for i in model.graph.input]
        self.batches = iter([{name: _feed(name, rng) for name in names} for _ in range(4)])

    def get_next(self):
        return next(self.batches, None)


def _feed(name: str, rng: np.random.Generator) -> np.ndarray:
    if name == "attention_mask":
        return np.ones((2, SEQ), np.int64)
    return rng.integers(0, 2 if name == "token_type_ids" else VOCAB, (2, SEQ), dtype=np.int64)


def main() -> None:
    bert, distilbert, roberta = (HERE / f"{n}_legacy_op14.onnx" for n in ("bert_tiny", "hf_distilbert",
                                                                            "roberta_tiny"))
    with tempfile.TemporaryDirectory() as tmp:
        made = {}
        for name, source, op_types, activations in (
                ("bert_tiny_qdq_gather_int8_op14.onnx", bert, ["Gather"], QuantType.QInt8),
                ("bert_tiny_qdq_gather_matmul_op14.onnx", bert, ["Gather", "MatMul"], QuantType.QUInt8)):
            made[name] = Path(tmp) / name
            quantize_static(source, made[name], _Calibration(onnx.load(source)), quant_format=QuantFormat.QDQ,
                            op_types_to_quantize=op_types, activation_type=activations,
                            weight_type=QuantType.QInt8)
        for name, source in (("hf_distilbert_dynamic_int8_op14.onnx", distilbert),
                             ("roberta_tiny_dynamic_int8_op14.onnx", roberta)):
            made[name] = Path(tmp) / name
            quantize_dynamic(source, made[name], weight_type=QuantType.QInt8)
        for name, path in made.items():
            save_checked(onnx.load(path), HERE / name)


if __name__ == "__main__":
    main()
