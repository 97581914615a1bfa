"""Export a tiny DeBERTa-v2 (random weights, transformers' own model code) with torch's dynamo exporter.

Its embedding block reads the positions as ``position_ids[:, :S]`` of a registered [1, max_positions] buffer,
with S taken from the attention mask's shape, and the token types as zeros expanded to the mask's shape: the
layouts lnfuse's embedding rule has to prove are 0..S-1 and [batch, sequence].

    pip install -e '.[export]' && python sample_models/make_deberta_sample.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DebertaV2Config, DebertaV2Model

from checked import save_checked

OUT = Path(__file__).resolve().parent / "deberta_v2_tiny_dynamo_op18.onnx"


def main() -> None:
    torch.manual_seed(0)
    config = DebertaV2Config(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=16, max_position_embeddings=32, type_vocab_size=2,
                             position_biased_input=True, relative_attention=True, pos_att_type=["p2c", "c2p"],
                             position_buckets=8)
    model = DebertaV2Model(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    dims = {0: "batch", 1: "sequence"}
    program = torch.onnx.export(model, (ids, mask), dynamo=True, input_names=["input_ids", "attention_mask"],
                                dynamic_shapes=(dims, dims), opset_version=18)
    save_checked(program.model_proto, OUT)


if __name__ == "__main__":
    main()
