"""A tiny BERT (transformers' own BertModel, random weights) quantized by ONNX Runtime's own quantizer, the way CPU
users shrink a BERT: ``quantize_dynamic`` (int8 weights, embedding lookups as ``Gather(int8 table) ->
DequantizeLinear``) and ``quantize_static`` in QDQ format (QuantizeLinear/DequantizeLinear pairs around every op,
inside every norm).

    pip install -e '.[export]' && python sample_models/make_quantized.py

Writes bert_tiny_dynamic_int8_op14.onnx and bert_tiny_qdq_op14.onnx next to this file (the float export is made
in a temporary folder). Calibration reads 8 batches of random ids from a fixed seed.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic,
                                      quantize_static)
from transformers import BertConfig, BertModel

from checked import save_checked

HERE = Path(__file__).resolve().parent
VOCAB, SEQ = 100, 8


class _Wrapped(torch.nn.Module):
    """input_ids, token_type_ids and attention_mask in, last_hidden_state out."""

    def __init__(self, model: BertModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, token_type_ids, attention_mask):
        return self.model(input_ids=input_ids, token_type_ids=token_type_ids,
                          attention_mask=attention_mask).last_hidden_state


def _inputs(rng: np.random.Generator, batch: int = 2) -> dict[str, np.ndarray]:
    return {"input_ids": rng.integers(0, VOCAB, (batch, SEQ), dtype=np.int64),
            "token_type_ids": rng.integers(0, 2, (batch, SEQ), dtype=np.int64),
            "attention_mask": np.ones((batch, SEQ), dtype=np.int64)}


class _Calibration(CalibrationDataReader):
    def __init__(self):
        rng = np.random.default_rng(0)
        self.batches = iter([_inputs(rng) for _ in range(8)])

    def get_next(self):
        return next(self.batches, None)


def export_float(path: Path) -> None:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=64, attn_implementation="eager")
    bert = BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        # away from the identity (scale 1, shift 0), so that quantizing gamma and beta, or a wrong fusion, shows
        for module in bert.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
    model = _Wrapped(bert)
    ids = {k: torch.from_numpy(v) for k, v in _inputs(np.random.default_rng(1)).items()}
    dims = {0: "batch", 1: "sequence"}
    torch.onnx.export(model, tuple(ids.values()), path, dynamo=False, opset_version=14,
                      input_names=list(ids), output_names=["last_hidden_state"],
                      dynamic_axes={**{k: dims for k in ids}, "last_hidden_state": dims})


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = Path(tmp) / "bert_tiny_fp32.onnx"
        export_float(fp32)
        dynamic, qdq = HERE / "bert_tiny_dynamic_int8_op14.onnx", HERE / "bert_tiny_qdq_op14.onnx"
        quantize_dynamic(fp32, dynamic, weight_type=QuantType.QInt8)
        quantize_static(fp32, qdq, _Calibration(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    for path in (dynamic, qdq):
        save_checked(onnx.load(path), path)


if __name__ == "__main__":
    main()
