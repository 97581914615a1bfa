"""Regenerate the sample ONNX models exported from real Hugging Face transformers code.

Where ``make_samples.py`` hand-writes its modules, this script builds tiny,
randomly initialised models from the transformers config classes themselves,
so the graphs carry exactly the node patterns real HF exports have. It makes
six files next to this one:

* ``hf_gpt2_dynamo_op18.onnx``         GPT2Model (ln_1/ln_2 per block, final ln_f,
                                        learned positions), dynamo exporter, opset 18.
* ``hf_distilbert_legacy_op14.onnx``   DistilBertModel (embeddings LayerNorm, post-norm
                                        blocks), TorchScript (legacy) exporter, opset 14.
* ``hf_bart_legacy_op14.onnx``         BartModel, encoder and decoder (decoder_input_ids =
                                        input_ids). Each embedding block is a word Gather, a
                                        Mul by embed_scale (1.0), learned positions offset by 2
                                        and layernorm_embedding; legacy exporter, opset 14.
* ``hf_opt_legacy_op14.onnx``          OPTModel (pre-norm, positions from the attention mask's
                                        CumSum, offset 2), legacy exporter, opset 14.
* ``hf_t5_encoder_dynamo_op18.onnx``   T5EncoderModel (T5LayerNorm: RMS norm, no bias, no
                                        mean), dynamo exporter, opset 18.
* ``hf_gemma_fp16_legacy_op17.onnx``   GemmaModel in float16 (GemmaRMSNorm: fp32 statistics,
                                        scale 1 + weight), legacy exporter, opset 17.

Every model has hidden size 32, 2 layers, vocabulary 100, 64 positions, eager
attention and no KV cache. Each is wrapped so the graph takes ``input_ids`` and
``attention_mask`` (all six models take one) and returns ``last_hidden_state``
only, with dynamic batch and sequence axes. Weights come from the models' own
initialisers under a fixed seed; every norm's weight and bias is then moved away
from its identity value (scale 1, shift 0) so that a wrong fusion shows up
numerically. No hub access is needed or attempted (``HF_HUB_OFFLINE=1``).

transformers and torch are *optional* dependencies: they are only needed to
regenerate these files, which are committed. The files were made with
``pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu`` and then
``pip install transformers==5.23.0`` (the CPU torch build; plain PyPI ``torch`` on Linux is the CUDA one). Other
versions may export different node patterns, so regenerate with the pinned ones.

After exporting, each file is checked: onnx full_check, an onnxruntime run with
graph optimizations off on batch 2, sequence 5 (the export used batch 3,
sequence 7, so a baked-in dimension fails) with a right-padded row in the
attention mask, no NaN, and agreement with torch's own output (float32 within
1e-4, float16 within 1e-2). Reruns give the same weights and the same numbers.

Run from the repo root:  ``python sample_models/make_hf_samples.py``
"""

from __future__ import annotations

import os

# Set before transformers is imported: it reads the variable at import time.
os.environ["HF_HUB_OFFLINE"] = "1"

import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers
from torch import nn

# shared with the hand-written samples: sizes, IR cap, and the export/check helpers
from make_samples import (CHECK_BATCH, CHECK_SEQ, EXPORT_BATCH, EXPORT_SEQ, MAX_IR_VERSION_FOR_ORT, OUT_DIR,
                          count_ops, run_ort, strip_stack_traces)

# The dynamo exporter logs one warning per torchvision op it cannot register.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

HIDDEN = 32
LAYERS = 2
HEADS = 4
FFN = 64
VOCAB = 100
MAX_POSITIONS = 64

INPUT_NAMES = ["input_ids", "attention_mask"]
OUTPUT_NAME = "last_hidden_state"

# Shared by every config: eager attention keeps the softmax in the graph, and
# without a cache the models return only hidden states.
COMMON = dict(vocab_size=VOCAB, attn_implementation="eager", use_cache=False)


# --------------------------------------------------------------------------- models


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN, n_positions=MAX_POSITIONS,
        # The default bos/eos id (50256) lies outside the tiny vocabulary.
        bos_token_id=0, eos_token_id=0, **COMMON,
    )  # fmt: skip
    return transformers.GPT2Model(config)


def distilbert() -> nn.Module:
    config = transformers.DistilBertConfig(
        dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
        max_position_embeddings=MAX_POSITIONS, **COMMON,
    )  # fmt: skip
    return transformers.DistilBertModel(config)


def bart() -> nn.Module:
    config = transformers.BartConfig(
        d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_position_embeddings=MAX_POSITIONS, **COMMON,
    )  # fmt: skip
    return transformers.BartModel(config)


def opt() -> nn.Module:
    config = transformers.OPTConfig(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=FFN,
        word_embed_proj_dim=HIDDEN, max_position_embeddings=MAX_POSITIONS, **COMMON,
    )  # fmt: skip
    return transformers.OPTModel(config)


def t5_encoder() -> nn.Module:
    config = transformers.T5Config(
        d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS,
        relative_attention_num_buckets=8, relative_attention_max_distance=MAX_POSITIONS, **COMMON,
    )  # fmt: skip
    return transformers.T5EncoderModel(config)


def gemma() -> nn.Module:
    config = transformers.GemmaConfig(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
        head_dim=HIDDEN // HEADS, intermediate_size=FFN, max_position_embeddings=MAX_POSITIONS, **COMMON,
    )  # fmt: skip
    return transformers.GemmaModel(config)


class LastHiddenState(nn.Module):
    """Gives a model the graph signature (input_ids, attention_mask) -> last_hidden_state."""

    def __init__(self, model: nn.Module, seq2seq: bool = False) -> None:
        super().__init__()
        self.model = model
        self.seq2seq = seq2seq

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        extra = {"decoder_input_ids": input_ids} if self.seq2seq else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **extra)
        return out.last_hidden_state


def is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or name.endswith(("LayerNorm", "RMSNorm"))


def randomize_norms(model: nn.Module) -> int:
    """Move every norm's weight and bias off its identity value; return how many norms.

    With identity affine parameters a fusion that drops or swaps scale/bias
    would still produce the right numbers, hiding the bug. GemmaRMSNorm stores
    scale - 1 (it multiplies by 1 + weight), so its identity weight is 0.
    """
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if not is_norm(module):
                continue
            count += 1
            identity = 0.0 if type(module).__name__ == "GemmaRMSNorm" else 1.0
            module.weight.normal_(identity, 0.2)
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, 0.2)
    if count == 0:
        raise AssertionError(f"no norm modules found in {type(model).__name__}")
    return count


# --------------------------------------------------------------------------- inputs


def make_inputs(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # Ids from 3 up skip the special tokens (pad/bos/eos) of every config here.
    input_ids = rng.integers(3, VOCAB, size=(batch, seq), dtype=np.int64)
    attention_mask = np.ones((batch, seq), dtype=np.int64)
    # Right padding: every query row still sees at least one key, even with a
    # causal mask, so no softmax row is fully masked.
    attention_mask[0, -2:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# --------------------------------------------------------------------------- export


def export_legacy(model: nn.Module, inputs: dict[str, np.ndarray], opset: int) -> onnx.ModelProto:
    dynamic_axes = {name: {0: "batch", 1: "sequence"} for name in INPUT_NAMES + [OUTPUT_NAME]}
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # The legacy exporter is used on purpose, and HF's tracer warnings
        # (Python bools from tensors in mask code) do not affect these shapes.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            tuple(torch.from_numpy(inputs[name]) for name in INPUT_NAMES),
            buffer,
            dynamo=False,
            opset_version=opset,
            input_names=INPUT_NAMES,
            output_names=[OUTPUT_NAME],
            dynamic_axes=dynamic_axes,
            do_constant_folding=True,
        )
    return onnx.load_from_string(buffer.getvalue())


def export_dynamo(model: nn.Module, inputs: dict[str, np.ndarray], opset: int) -> onnx.ModelProto:
    batch = torch.export.Dim("batch")
    # The position tables hold MAX_POSITIONS rows.
    sequence = torch.export.Dim("sequence", max=MAX_POSITIONS)
    dynamic_shapes = {name: {0: batch, 1: sequence} for name in INPUT_NAMES}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "# The axis name", UserWarning)
        # torch's own pytree deprecation, raised inside the exporter.
        warnings.filterwarnings("ignore", "`isinstance\\(treespec, LeafSpec\\)`", FutureWarning)
        program = torch.onnx.export(
            model,
            (),
            kwargs={name: torch.from_numpy(inputs[name]) for name in INPUT_NAMES},
            dynamo=True,
            opset_version=opset,
            input_names=INPUT_NAMES,
            output_names=[OUTPUT_NAME],
            dynamic_shapes=dynamic_shapes,
            verbose=False,
        )
    return program.model_proto


@dataclass(frozen=True)
class Sample:
    file_name: str
    build: Callable[[], nn.Module]
    exporter: Callable[[nn.Module, dict[str, np.ndarray], int], onnx.ModelProto]
    opset: int
    seed: int
    seq2seq: bool = False
    fp16: bool = False


def samples() -> list[Sample]:
    return [
        Sample("hf_gpt2_dynamo_op18.onnx", gpt2, export_dynamo, 18, seed=10),
        Sample("hf_distilbert_legacy_op14.onnx", distilbert, export_legacy, 14, seed=11),
        Sample("hf_bart_legacy_op14.onnx", bart, export_legacy, 14, seed=12, seq2seq=True),
        Sample("hf_opt_legacy_op14.onnx", opt, export_legacy, 14, seed=13),
        Sample("hf_t5_encoder_dynamo_op18.onnx", t5_encoder, export_dynamo, 18, seed=14),
        Sample("hf_gemma_fp16_legacy_op17.onnx", gemma, export_legacy, 17, seed=15, fp16=True),
    ]  # fmt: skip


def build(sample: Sample) -> tuple[nn.Module, int]:
    torch.manual_seed(sample.seed)
    model = sample.build()
    norms = randomize_norms(model)
    wrapped = LastHiddenState(model, seq2seq=sample.seq2seq).eval()
    if sample.fp16:
        # CPU has fp16 kernels for everything used here, so the trace runs in
        # real fp16 and the graph's weights/activations are float16.
        wrapped = wrapped.half()
    return wrapped, norms


def torch_reference(model: nn.Module, inputs: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    return out.float().numpy()


# --------------------------------------------------------------------------- verify


def make_and_verify(sample: Sample) -> dict[str, object]:
    model, norms = build(sample)
    with torch.no_grad():
        proto = sample.exporter(model, make_inputs(EXPORT_BATCH, EXPORT_SEQ, 123), sample.opset)
    strip_stack_traces(proto)
    if proto.ir_version > MAX_IR_VERSION_FOR_ORT:
        proto.ir_version = MAX_IR_VERSION_FOR_ORT
    path = OUT_DIR / sample.file_name
    onnx.save_model(proto, str(path))

    saved = onnx.load(str(path))
    onnx.checker.check_model(saved, full_check=True)
    if [i.name for i in saved.graph.input] != INPUT_NAMES:
        raise AssertionError(f"{path.name}: inputs {[i.name for i in saved.graph.input]}")
    if [o.name for o in saved.graph.output] != [OUTPUT_NAME]:
        raise AssertionError(f"{path.name}: outputs {[o.name for o in saved.graph.output]}")
    inputs = make_inputs(CHECK_BATCH, CHECK_SEQ, 7)
    output = run_ort(path, inputs)
    if output.shape != (CHECK_BATCH, CHECK_SEQ, HIDDEN):
        raise AssertionError(f"{path.name}: output shape {output.shape}")
    if np.isnan(output).any():
        raise AssertionError(f"{path.name}: NaN in output")
    expected_dtype = np.float16 if sample.fp16 else np.float32
    if output.dtype != expected_dtype:
        raise AssertionError(f"{path.name}: output dtype {output.dtype}, want {expected_dtype}")
    tol = 1e-2 if sample.fp16 else 1e-4
    max_err = float(np.abs(output.astype(np.float32) - torch_reference(model, inputs)).max())
    if max_err > tol:
        raise AssertionError(f"{path.name}: differs from torch by {max_err}")
    opset = next(o.version for o in saved.opset_import if o.domain in ("", "ai.onnx"))
    return {
        "file": path.name,
        "opset": opset,
        "nodes": len(saved.graph.node),
        "norms": norms,
        "ReduceMean": count_ops(saved, "ReduceMean"),
        "LayerNorm": count_ops(saved, "LayerNormalization"),
        "max_err": max_err,
        "kB": path.stat().st_size / 1024,
    }


def print_row(r: dict[str, object]) -> None:
    print(
        f"{r['file']:32} {r['opset']:>5} {r['nodes']:>5} {r['norms']:>5} {r['ReduceMean']:>10} "
        f"{r['LayerNorm']:>9} {r['max_err']:>14.2e} {r['kB']:>6.1f}",
        flush=True,
    )


def main() -> None:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'file':32} {'opset':>5} {'nodes':>5} {'norms':>5} {'ReduceMean':>10} "
          f"{'LayerNorm':>9} {'max|ort-torch|':>14} {'kB':>6}")  # fmt: skip
    for sample in samples():
        print_row(make_and_verify(sample))


if __name__ == "__main__":
    main()
