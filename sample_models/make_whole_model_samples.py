"""Regenerate the whole-model samples: real transformers exports whose inputs a random guess does not fit.

``--verify model`` and ``--upgrade-opset`` run the whole model on inputs lnfuse builds from the graph. These four
exports are the kinds that broke a naive builder, each written the way optimum writes it (TorchScript exporter,
opset 14, every input dim symbolic, optimum's dim names):

* ``wm_vit_legacy_op14.onnx``       ViTModel: ``pixel_values[batch_size, num_channels, height, width]``; the channel
                                     dim must be the patch Conv's 3 and height/width the trained 32 (the position
                                     table has 4*4+1 rows).
* ``wm_convnext_legacy_op14.onnx``  ConvNextModel, two stages: spatial dims big enough for a stride-4 stem and a
                                     stride-2 downsampling; hand-written channels-first LayerNorms.
* ``wm_wav2vec2_legacy_op14.onnx``  Wav2Vec2Model: ``input_values[batch_size, sequence_length]`` of raw audio,
                                     longer than the conv feature extractor's kernels and strides need.
* ``wm_llama_past_legacy_op14.onnx`` LlamaModel with a KV cache: ``past_key_values.{i}.key/value`` of
                                     ``past_sequence_length``, an attention mask of
                                     ``past_sequence_length + sequence_length`` and ``position_ids``.

Configs are tiny (hidden 32, 2 layers) and random under a fixed seed; no hub access. Each file is checked with
onnx's full check and run once in ONNX Runtime against torch on inputs of sizes other than the export's.
Made with torch 2.13 and transformers 5.23 (CPU). Run from the repo root:
``python sample_models/make_whole_model_samples.py``
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import io
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers
from torch import nn

OUT_DIR = Path(__file__).resolve().parent
OPSET = 14
HIDDEN, LAYERS, HEADS, FFN = 32, 2, 4, 64


class Hidden(nn.Module):
    """The model's last hidden state only (optimum's feature-extraction task)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).last_hidden_state


class LlamaWithPast(nn.Module):
    """input_ids, attention_mask, position_ids and the flat past keys/values -> hidden state and present."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = transformers.DynamicCache()
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        present = []
        for layer in range(len(past) // 2):
            present += [out.past_key_values.layers[layer].keys, out.past_key_values.layers[layer].values]
        return (out.last_hidden_state, *present)


def vit() -> tuple[nn.Module, dict, dict]:
    config = transformers.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                    intermediate_size=FFN, image_size=32, patch_size=8, num_channels=3)
    image = {0: "batch_size", 1: "num_channels", 2: "height", 3: "width"}
    return (Hidden(transformers.ViTModel(config, add_pooling_layer=False)),
            {"pixel_values": lambda b: torch.randn(b, 3, 32, 32)}, {"pixel_values": image})


def convnext() -> tuple[nn.Module, dict, dict]:
    config = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                         image_size=32)
    image = {0: "batch_size", 1: "num_channels", 2: "height", 3: "width"}
    return (Hidden(transformers.ConvNextModel(config)),
            {"pixel_values": lambda b: torch.randn(b, 3, 24 + 8 * b, 32)}, {"pixel_values": image})


def wav2vec2() -> tuple[nn.Module, dict, dict]:
    config = transformers.Wav2Vec2Config(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, do_stable_layer_norm=True, feat_extract_norm="layer")
    return (Hidden(transformers.Wav2Vec2Model(config)),
            {"input_values": lambda b: torch.randn(b, 400 + 80 * b)},
            {"input_values": {0: "batch_size", 1: "sequence_length"}})


def llama_with_past() -> tuple[nn.Module, dict, dict]:
    kv_heads, head_dim = 2, HIDDEN // HEADS
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
        intermediate_size=FFN, vocab_size=100, max_position_embeddings=64, attn_implementation="eager")
    past, seq = 5, 3

    def past_tensor(b):
        return torch.randn(b, kv_heads, past, head_dim)
    inputs = {"input_ids": lambda b: torch.randint(0, 100, (b, seq)),
              "attention_mask": lambda b: torch.ones(b, past + seq, dtype=torch.int64),
              "position_ids": lambda b: torch.arange(past, past + seq).expand(b, seq)}
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
            "attention_mask": {0: "batch_size", 1: "past_sequence_length + sequence_length"},
            "position_ids": {0: "batch_size", 1: "sequence_length"}}
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            inputs[f"past_key_values.{layer}.{kind}"] = past_tensor
            axes[f"past_key_values.{layer}.{kind}"] = {0: "batch_size", 2: "past_sequence_length"}
    return LlamaWithPast(transformers.LlamaModel(config)), inputs, axes


SAMPLES = {"wm_vit_legacy_op14.onnx": vit, "wm_convnext_legacy_op14.onnx": convnext,
           "wm_wav2vec2_legacy_op14.onnx": wav2vec2, "wm_llama_past_legacy_op14.onnx": llama_with_past}


def export(name: str, make) -> None:
    torch.manual_seed(0)
    model, inputs, axes = make()
    model.eval()
    args = tuple(f(2) for f in inputs.values())
    with torch.no_grad():
        outputs = model(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    output_names = ["last_hidden_state"] + [f"present.{i // 2}.{('key', 'value')[i % 2]}"
                                            for i in range(len(outputs) - 1)]
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, buffer, dynamo=False, opset_version=OPSET, input_names=list(inputs),
                          output_names=output_names, dynamic_axes=axes, do_constant_folding=True)
    proto = onnx.load_from_string(buffer.getvalue())
    onnx.checker.check_model(proto, full_check=True)
    path = OUT_DIR / name
    onnx.save(proto, path)
    # run on another batch (and, where the model allows, other sizes) than the export's
    check = tuple(f(3) for f in inputs.values())
    with torch.no_grad():
        want = model(*check)
    want = want[0] if isinstance(want, tuple) else want
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    got = session.run(None, {k: v.numpy() for k, v in zip(inputs, check)})[0]
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=1e-3)
    print(f"{name}: {path.stat().st_size:,} bytes, {len(proto.graph.node)} nodes, agrees with torch")


def main() -> None:
    for name, make in SAMPLES.items():
        export(name, make)


if __name__ == "__main__":
    main()
