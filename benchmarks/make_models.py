"""Generate the models the benchmarks run on, into one folder (deterministic: every weight is seeded).

    python benchmarks/make_models.py [--out /tmp/lnfuse-bench-models] [--only torch|stacks] [--layers 12,24,48,96]

Writes:

* ``bert_base_legacy_op14.onnx``   BERT-base sized encoder (12 layers, hidden 768, 12 heads, FFN 3072, vocab 30522,
                                    512 positions, nn.LayerNorm, exact GELU), legacy TorchScript exporter, opset 14,
                                    dynamic batch/sequence; about 440 MB.
* ``llama_small_legacy_op14.onnx`` LLaMA-style decoder (hidden 1024, 8 layers, 16 heads, SwiGLU FFN 2816, RoPE,
                                    RMSNorm written like HF LlamaRMSNorm with its fp32 cast), legacy exporter, opset 14.
* ``stack_{L}layers.onnx``         BERT-like post-norm stacks of L layers (hidden 512, FFN 2048: BERT-medium widths)
                                    written directly with onnx.helper, with LayerNorm decomposed into
                                    ReduceMean/Sub/Pow/.../Add(beta). No torch needed, so ``speed.py`` regenerates them.

torch is needed only for the first two (``--only stacks`` skips them). The shipped ``sample_models/*.onnx`` are not
copied: ``compare.py`` reads them from the repository, so there is a single copy of them.

Every layer of a stack has its own weights, as in every real export (12.6 MB a layer: 151 MB at 12 layers, 1.2 GB
at 96, under protobuf's 2 GB so every tool can write the model inline). A file-to-file tool's floor is then what it
is on real models, reading and writing the weights; the graph's own cost grows with depth on top of it.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
from onnx import TensorProto, numpy_helper

DEFAULT_OUT = Path("/tmp/lnfuse-bench-models")
STACK_LAYERS = (12, 24, 48, 96)
SAMPLE_DIR = Path(__file__).resolve().parent.parent / "sample_models"

# ORT 1.31 reads these IR versions; the legacy exporter writes IR 7/8 anyway, this only guards future torch.
MAX_IR_VERSION = 10


def stack_model_name(layers: int) -> str:
    return f"stack_{layers}layers.onnx"


# =========================================================================== generated stacks (no torch)


@dataclass(frozen=True)
class GenConfig:
    layers: int
    hidden: int = 512
    ffn: int = 2048
    eps: float = 1e-12
    seed: int = 0


class _GraphBuilder:
    """Collects nodes and initializers; every value and node gets a unique, readable name."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name

    def scalar(self, prefix: str, value: float) -> str:
        # Per-use scalar initializers, as the legacy exporter writes them after constant folding.
        self._count += 1
        return self.const(f"{prefix}.const_{self._count}", np.array(value, dtype=np.float32))

    def op(self, op_type: str, inputs: list[str], prefix: str, **attrs: Any) -> str:
        self._count += 1
        out = f"{prefix}/{op_type}_{self._count}"
        self.nodes.append(oh.make_node(op_type, inputs, [out], name=out, **attrs))
        return out


def _linear(b: _GraphBuilder, x: str, weight: str, width: int, prefix: str) -> str:
    """MatMul with a shared weight, then this layer's own bias (the exporter's MatMul + Add)."""
    bias = b.const(f"{prefix}.bias", b.rng.normal(0.0, 0.02, width))
    return b.op("Add", [b.op("MatMul", [x, weight], prefix), bias], prefix)


def _layer_norm(b: _GraphBuilder, x: str, cfg: GenConfig, prefix: str) -> str:
    """Decomposed LayerNorm: ReduceMean/Sub/Pow/ReduceMean/Add eps/Sqrt/Div/Mul gamma/Add beta (opset 14 axes attr)."""
    mean = b.op("ReduceMean", [x], prefix, axes=[-1], keepdims=1)
    centred = b.op("Sub", [x, mean], prefix)
    square = b.op("Pow", [centred, b.scalar(prefix, 2.0)], prefix)
    var = b.op("ReduceMean", [square], prefix, axes=[-1], keepdims=1)
    std = b.op("Sqrt", [b.op("Add", [var, b.scalar(prefix, cfg.eps)], prefix)], prefix)
    normed = b.op("Div", [centred, std], prefix)
    # Non-trivial gamma/beta so a wrong fusion shows up numerically.
    gamma = b.const(f"{prefix}.weight", b.rng.uniform(0.5, 1.5, cfg.hidden))
    beta = b.const(f"{prefix}.bias", b.rng.normal(0.0, 0.1, cfg.hidden))
    return b.op("Add", [b.op("Mul", [normed, gamma], prefix), beta], prefix)


def _erf_gelu(b: _GraphBuilder, x: str, prefix: str) -> str:
    """Exact GELU as opset 14 spells it: x * 0.5 * (1 + erf(x / sqrt(2)))."""
    erf = b.op("Erf", [b.op("Div", [x, b.scalar(prefix, math.sqrt(2.0))], prefix)], prefix)
    one_plus = b.op("Add", [erf, b.scalar(prefix, 1.0)], prefix)
    return b.op("Mul", [b.op("Mul", [x, one_plus], prefix), b.scalar(prefix, 0.5)], prefix)


def _attention(b: _GraphBuilder, x: str, weights: dict[str, str], cfg: GenConfig, prefix: str) -> str:
    """Single-head attention: enough MatMul/Transpose/Softmax to look like a real block, no head reshapes."""
    q = _linear(b, x, weights["q"], cfg.hidden, f"{prefix}.query")
    k = _linear(b, x, weights["k"], cfg.hidden, f"{prefix}.key")
    v = _linear(b, x, weights["v"], cfg.hidden, f"{prefix}.value")
    scores = b.op("MatMul", [q, b.op("Transpose", [k], prefix, perm=[0, 2, 1])], prefix)
    scaled = b.op("Div", [scores, b.scalar(prefix, math.sqrt(cfg.hidden))], prefix)
    context = b.op("MatMul", [b.op("Softmax", [scaled], prefix, axis=-1), v], prefix)
    return _linear(b, context, weights["o"], cfg.hidden, f"{prefix}.output")


def _encoder_layer(b: _GraphBuilder, x: str, cfg: GenConfig, i: int) -> str:
    """BERT post-norm: x = LN(x + attn(x)); x = LN(x + W2 gelu(W1 x))."""
    prefix = f"layer.{i}"
    weights = _layer_weights(b, cfg, prefix)
    attn = _attention(b, x, weights, cfg, f"{prefix}.attention")
    x = _layer_norm(b, b.op("Add", [x, attn], prefix), cfg, f"{prefix}.attention.norm")
    hidden = _erf_gelu(b, _linear(b, x, weights["ffn_in"], cfg.ffn, f"{prefix}.intermediate"), prefix)
    ffn = _linear(b, hidden, weights["ffn_out"], cfg.hidden, f"{prefix}.output")
    return _layer_norm(b, b.op("Add", [x, ffn], prefix), cfg, f"{prefix}.output.norm")


def _layer_weights(b: _GraphBuilder, cfg: GenConfig, prefix: str) -> dict[str, str]:
    shapes = {"q": (cfg.hidden, cfg.hidden), "k": (cfg.hidden, cfg.hidden), "v": (cfg.hidden, cfg.hidden),
              "o": (cfg.hidden, cfg.hidden), "ffn_in": (cfg.hidden, cfg.ffn), "ffn_out": (cfg.ffn, cfg.hidden)}
    return {key: b.const(f"{prefix}.{key}.weight", b.rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))
            for key, shape in shapes.items()}


def build_stack(cfg: GenConfig) -> onnx.ModelProto:
    b = _GraphBuilder(np.random.default_rng(cfg.seed))
    x = "hidden_states"
    for i in range(cfg.layers):
        x = _encoder_layer(b, x, cfg, i)
    b.nodes.append(oh.make_node("Identity", [x], ["last_hidden_state"], name="output"))
    dims = ["batch", "sequence", cfg.hidden]
    graph = oh.make_graph(
        b.nodes, f"stack_{cfg.layers}layers",
        [oh.make_tensor_value_info("hidden_states", TensorProto.FLOAT, dims)],
        [oh.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, dims)],
        b.initializers)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 14)], ir_version=8,
                          producer_name="lnfuse-benchmarks")
    onnx.checker.check_model(model, full_check=True)
    return model


def write_stack(out: Path, layers: int) -> Path:
    path = out / stack_model_name(layers)
    onnx.save(build_stack(GenConfig(layers)), path)
    return path


def ensure_stacks(out: Path, layers: tuple[int, ...] = STACK_LAYERS) -> list[Path]:
    """Used by speed.py: (re)generate only the missing stacks, a few seconds each."""
    out.mkdir(parents=True, exist_ok=True)
    return [p if (p := out / stack_model_name(n)).exists() else write_stack(out, n) for n in layers]


# =========================================================================== detector CNNs (no torch)


#: Resize counts of the generated detectors (``detector_model_name``): OCR/detection FPNs ship with 50 to 200
DETECTOR_RESIZES = (50, 200)


def detector_model_name(resizes: int, norm: bool = False) -> str:
    return f"detector_{resizes}resize{'_norm' if norm else ''}.onnx"


def _conv(b: _GraphBuilder, x: str, c_in: int, c_out: int, prefix: str, stride: int = 1) -> str:
    weight = b.const(f"{prefix}.weight.{b._count}", b.rng.normal(0.0, 0.1, (c_out, c_in, 3, 3)))
    bias = b.const(f"{prefix}.bias.{b._count}", b.rng.normal(0.0, 0.01, c_out))
    return b.op("Relu", [b.op("Conv", [x, weight, bias], prefix, kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              strides=[stride, stride])], prefix)


def _int64(b: _GraphBuilder, name: str, values: list[int]) -> str:
    b.initializers.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
    return name


def _upsample_to(b: _GraphBuilder, x: str, like: str, prefix: str, by_sizes: bool) -> str:
    """Upsample ``x`` to ``like``'s height and width, the two ways exporters write it: ``scales`` [1, 1, 2, 2]
    (torch's ``scale_factor=2``), or ``sizes`` computed at run time from ``Shape(like)`` (``size=like.shape[2:]``,
    DBNet's and YOLO's necks). Both give ORT's symbolic inference a sympy expression per dim to simplify."""
    if by_sizes:
        spatial = b.op("Slice", [b.op("Shape", [like], prefix), "det.two", "det.four"], prefix)
        channels = b.op("Slice", [b.op("Shape", [x], prefix), "det.zero", "det.two"], prefix)
        sizes = b.op("Concat", [channels, spatial], prefix, axis=0)
        return b.op("Resize", [x, "", "", sizes], prefix, mode="nearest")
    return b.op("Resize", [x, "", "det.scales"], prefix, mode="nearest")


def build_detector(resizes: int, norm: bool = False, width: int = 8, levels: int = 5, seed: int = 0
                   ) -> onnx.ModelProto:
    """A DBNet/YOLO-like detector: a strided Conv backbone of ``levels`` feature maps, then repeated FPN passes
    (top-down: upsample the coarser map, Concat with the finer, Conv; bottom-up: strided Conv, Add) until
    ``resizes`` Resize ops are written, half of them with ``scales`` and half with ``sizes`` from ``Shape``; a
    DBNet head upsamples every level to the finest and concatenates them. Dynamic batch, height and width; no
    normalization unless ``norm``, which ends the head with one decomposed LayerNorm over the channels (a
    candidate downstream of every Resize)."""
    b = _GraphBuilder(np.random.default_rng(seed))
    _int64(b, "det.zero", [0])
    _int64(b, "det.two", [2])
    _int64(b, "det.four", [4])
    b.const("det.scales", np.array([1.0, 1.0, 2.0, 2.0]))
    x = _conv(b, "image", 3, width, "stem", stride=2)
    feats = []
    for level in range(levels):
        x = _conv(b, x, width, width, f"backbone.{level}", stride=2)
        feats.append(x)
    written, passes = 0, 0
    while written < resizes - (levels - 1):
        prefix = f"fpn.{passes}"
        for level in range(levels - 2, -1, -1):  # top-down
            if written >= resizes - (levels - 1):
                break
            up = _upsample_to(b, feats[level + 1], feats[level], f"{prefix}.up{level}", by_sizes=written % 2 == 1)
            written += 1
            merged = b.op("Concat", [feats[level], up], prefix, axis=1)
            feats[level] = _conv(b, merged, 2 * width, width, f"{prefix}.td{level}")
        for level in range(1, levels):  # bottom-up
            down = _conv(b, feats[level - 1], width, width, f"{prefix}.bu{level}", stride=2)
            feats[level] = b.op("Add", [feats[level], down], prefix)
        passes += 1
    head = [feats[0]]
    for level in range(1, levels):
        head.append(_upsample_to(b, feats[level], feats[0], f"head.up{level}", by_sizes=True))
    y = _conv(b, b.op("Concat", head, "head", axis=1), levels * width, width, "head")
    if norm:  # a channels-first LayerNorm, as ConvNeXt/SAM write it: over axis 1
        mean = b.op("ReduceMean", [y], "head.norm", axes=[1], keepdims=1)
        centred = b.op("Sub", [y, mean], "head.norm")
        var = b.op("ReduceMean", [b.op("Mul", [centred, centred], "head.norm")], "head.norm", axes=[1], keepdims=1)
        std = b.op("Sqrt", [b.op("Add", [var, b.scalar("head.norm", 1e-6)], "head.norm")], "head.norm")
        normed = b.op("Div", [centred, std], "head.norm")
        gamma = b.const("head.norm.weight", b.rng.uniform(0.5, 1.5, (width, 1, 1)))
        beta = b.const("head.norm.bias", b.rng.normal(0.0, 0.1, (width, 1, 1)))
        y = b.op("Add", [b.op("Mul", [normed, gamma], "head.norm"), beta], "head.norm")
    prob = b.op("Sigmoid", [b.op("Conv", [y, b.const("head.out.weight", b.rng.normal(0.0, 0.1, (1, width, 1, 1)))],
                                 "head.out", kernel_shape=[1, 1])], "head.out")
    b.nodes.append(oh.make_node("Identity", [prob], ["probability"], name="output"))
    graph = oh.make_graph(
        b.nodes, detector_model_name(resizes, norm).removesuffix(".onnx"),
        [oh.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [oh.make_tensor_value_info("probability", TensorProto.FLOAT, ["batch", 1, None, None])],
        b.initializers)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8,
                          producer_name="lnfuse-benchmarks")
    onnx.checker.check_model(model, full_check=True)
    return model


def ensure_detectors(out: Path, resizes: tuple[int, ...] = DETECTOR_RESIZES, norm: bool = True) -> list[Path]:
    """Used by cliff.py: (re)generate the missing detectors (with no norm, and with ``norm`` one with a norm too)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for count in resizes:
        for with_norm in (False, True) if norm else (False,):
            path = out / detector_model_name(count, with_norm)
            if not path.exists():
                onnx.save(build_detector(count, with_norm), path)
            paths.append(path)
    return paths


# =========================================================================== torch models (lazy torch import)


def _torch_modules() -> dict[str, Callable[[], tuple[Any, tuple, dict]]]:
    """Defined inside a function so importing this file (speed.py does) never needs torch."""
    import torch
    from torch import nn

    def heads_split(x: torch.Tensor, heads: int) -> torch.Tensor:
        b, s, h = x.shape
        return x.reshape(b, s, heads, h // heads).transpose(1, 2)

    def heads_merge(x: torch.Tensor) -> torch.Tensor:
        b, n, s, d = x.shape
        return x.transpose(1, 2).reshape(b, s, n * d)

    class BertAttention(nn.Module):
        def __init__(self, hidden: int, heads: int) -> None:
            super().__init__()
            self.heads, self.inv_scale = heads, 1.0 / math.sqrt(hidden // heads)
            self.query, self.key, self.value, self.dense = (nn.Linear(hidden, hidden) for _ in range(4))

        def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
            q, k, v = (heads_split(lin(x), self.heads) for lin in (self.query, self.key, self.value))
            probs = torch.softmax(q @ k.transpose(-1, -2) * self.inv_scale + mask_bias, dim=-1)
            return self.dense(heads_merge(probs @ v))

    class BertBlock(nn.Module):
        def __init__(self, hidden: int, heads: int, ffn: int) -> None:
            super().__init__()
            self.attention = BertAttention(hidden, heads)
            self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
            self.intermediate, self.output = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
            self.output_norm = nn.LayerNorm(hidden, eps=1e-12)

        def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
            x = self.attention_norm(x + self.attention(x, mask_bias))
            return self.output_norm(x + self.output(nn.functional.gelu(self.intermediate(x))))

    class BertBase(nn.Module):
        def __init__(self, vocab: int = 30522, hidden: int = 768, layers: int = 12, heads: int = 12,
                     ffn: int = 3072, positions: int = 512) -> None:
            super().__init__()
            self.word = nn.Embedding(vocab, hidden)
            self.position = nn.Embedding(positions, hidden)
            self.segment = nn.Embedding(2, hidden)
            self.embedding_norm = nn.LayerNorm(hidden, eps=1e-12)
            self.blocks = nn.ModuleList(BertBlock(hidden, heads, ffn) for _ in range(layers))
            self.pooler = nn.Linear(hidden, hidden)
            # HF slices a registered arange, so positions are a Slice, not a Range, in the graph.
            self.register_buffer("position_ids", torch.arange(positions)[None], persistent=False)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            seq = input_ids.shape[1]
            x = self.word(input_ids) + self.position(self.position_ids[:, :seq]) + self.segment(token_type_ids)
            x = self.embedding_norm(x)
            mask_bias = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
            for block in self.blocks:
                x = block(x, mask_bias)
            return x, torch.tanh(self.pooler(x[:, 0]))

    class RMSNorm(nn.Module):
        """HF LlamaRMSNorm: statistics in fp32, gamma applied in the input dtype."""

        def __init__(self, hidden: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            dtype = h.dtype
            h = h.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * h.to(dtype)

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    class LlamaBlock(nn.Module):
        def __init__(self, hidden: int, heads: int, ffn: int) -> None:
            super().__init__()
            self.heads, self.inv_scale = heads, 1.0 / math.sqrt(hidden // heads)
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(hidden), RMSNorm(hidden)
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
                nn.Linear(hidden, hidden, bias=False) for _ in range(4))
            self.gate_proj, self.up_proj = (nn.Linear(hidden, ffn, bias=False) for _ in range(2))
            self.down_proj = nn.Linear(ffn, hidden, bias=False)

        def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
            q, k, v = (heads_split(lin(x), self.heads) for lin in (self.q_proj, self.k_proj, self.v_proj))
            scores = rope(q, cos, sin) @ rope(k, cos, sin).transpose(-1, -2) * self.inv_scale
            scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
            return self.o_proj(heads_merge(torch.softmax(scores, dim=-1) @ v))

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            x = x + self.attention(self.input_layernorm(x), cos, sin, mask)
            h = self.post_attention_layernorm(x)
            return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))

    class LlamaSmall(nn.Module):
        def __init__(self, vocab: int = 32000, hidden: int = 1024, layers: int = 8, heads: int = 16,
                     ffn: int = 2816, positions: int = 2048) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleList(LlamaBlock(hidden, heads, ffn) for _ in range(layers))
            self.norm = RMSNorm(hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
            head_dim = hidden // heads
            inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
            angles = torch.outer(torch.arange(positions).float(), inv_freq)
            angles = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos_cached", angles.cos(), persistent=False)
            self.register_buffer("sin_cached", angles.sin(), persistent=False)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            seq = input_ids.shape[1]
            cos, sin = self.cos_cached[:seq], self.sin_cached[:seq]
            pos = torch.arange(seq)
            # Masked where the key is in the future or is padding.
            mask = (pos[None, :] > pos[:, None])[None, None] | (attention_mask[:, None, None, :] == 0)
            x = self.embed_tokens(input_ids)
            for layer in self.layers:
                x = layer(x, cos, sin, mask)
            return self.lm_head(self.norm(x))

    def example_ids(vocab: int) -> torch.Tensor:
        # Export with batch 2, sequence 7, so a dimension baked in by accident would break the dynamic-shape check.
        return torch.randint(0, vocab, (2, 7))

    def bert() -> tuple[Any, tuple, dict]:
        ids = example_ids(30522)
        args = (ids, torch.ones_like(ids), torch.zeros_like(ids))
        return BertBase(), args, {
            "input_names": ["input_ids", "attention_mask", "token_type_ids"],
            "output_names": ["last_hidden_state", "pooler_output"],
            "dynamic_axes": {**{n: {0: "batch", 1: "sequence"} for n in
                                ("input_ids", "attention_mask", "token_type_ids", "last_hidden_state")},
                             "pooler_output": {0: "batch"}}}

    def llama() -> tuple[Any, tuple, dict]:
        ids = example_ids(32000)
        return LlamaSmall(), (ids, torch.ones_like(ids)), {
            "input_names": ["input_ids", "attention_mask"], "output_names": ["logits"],
            "dynamic_axes": {n: {0: "batch", 1: "sequence"} for n in ("input_ids", "attention_mask", "logits")}}

    return {"bert_base_legacy_op14.onnx": bert, "llama_small_legacy_op14.onnx": llama}


def _randomize_norm_weights(module: Any) -> None:
    """nn.LayerNorm/RMSNorm start at gamma=1, beta=0, where a fusion that drops gamma or beta would go unnoticed."""
    import torch

    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.copy_(torch.rand_like(param) + 0.5 if name.endswith("weight") else torch.randn_like(param) * 0.1)


def export_torch_model(out: Path, name: str, factory: Callable[[], tuple[Any, tuple, dict]]) -> Path:
    import torch

    torch.manual_seed(0)
    module, args, names = factory()
    module.eval()
    _randomize_norm_weights(module)
    path = out / name
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer warnings
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=14, do_constant_folding=True,
                          **names)
    _check_export(path, module, args)
    return path


def _check_export(path: Path, module: Any, args: tuple) -> None:
    """The export must load in ORT and agree with torch on a different batch/sequence than it was traced with."""
    import onnxruntime as ort
    import torch

    model = onnx.load(str(path), load_external_data=False)
    if model.ir_version > MAX_IR_VERSION:
        raise RuntimeError(f"{path.name}: IR {model.ir_version} is newer than ORT 1.31 reads")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (3, 5), generator=gen)
    feeds_t = (ids,) + tuple(torch.ones_like(ids) if i == 0 else torch.zeros_like(ids) for i in range(len(args) - 1))
    with torch.no_grad():
        expected = module(*feeds_t)
    expected = expected if isinstance(expected, tuple) else (expected,)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    got = sess.run(None, {i.name: t.numpy() for i, t in zip(sess.get_inputs(), feeds_t, strict=True)})
    worst = max(float(np.max(np.abs(g - e.numpy()))) for g, e in zip(got, expected, strict=True))
    if not worst < 1e-3:
        raise RuntimeError(f"{path.name}: ORT and torch differ by {worst}")


# =========================================================================== command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--only", choices=["torch", "stacks"], help="make only the torch exports or only the stacks")
    parser.add_argument("--layers", default=",".join(map(str, STACK_LAYERS)), help="depths of the generated stacks")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs: list[tuple[str, Callable[[], Path]]] = []
    if args.only != "stacks":
        jobs += [(name, lambda n=name, f=factory: export_torch_model(args.out, n, f))
                 for name, factory in _torch_modules().items()]
    if args.only != "torch":
        jobs += [(stack_model_name(n), lambda n=n: write_stack(args.out, n))
                 for n in (int(x) for x in args.layers.split(","))]
    for name, job in jobs:
        start = time.perf_counter()
        path = job()
        print(f"{name:34s} {path.stat().st_size / 1e6:8.1f} MB  {time.perf_counter() - start:6.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
